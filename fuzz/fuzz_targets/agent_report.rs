//! Feeds arbitrary bytes to the heartbeat report decoder (every member accepts reports from
//! the network). Garbage must give an error, never a panic; what decodes must re-encode to an
//! equal report.
#![no_main]

use libfuzzer_sys::fuzz_target;
use limpet_agent::report::AgentReport;

fuzz_target!(|data: &[u8]| {
    let from = data.first().map_or(1, |b| u64::from(*b));
    if let Ok(r) = AgentReport::decode(data, from) {
        assert_eq!(AgentReport::decode(&r.encode(), from).expect("re-decodes"), r);
    }
});
