//! Feeds arbitrary bytes to the state handoff's decoders: requests (what a sender reads) and
//! manifests (what a receiver reads). Garbage must give an error, never a panic or a huge
//! allocation; what decodes must re-encode to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use limpet_snapshot::handoff::{Manifest, Request};

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = Request::decode(data) {
        assert_eq!(Request::decode(&r.encode()).expect("re-decodes"), r);
    }
    if let Ok(m) = Manifest::read_from(&mut &data[..]) {
        assert_eq!(Manifest::read_from(&mut m.encode().as_slice()).expect("re-decodes"), m);
    }
    // The bounded reader, with a bound from the input: what it accepts is within it.
    if let (Some(b), Some(rest)) = (data.first(), data.get(1..)) {
        let max = 1u64 << (*b % 48);
        if let Ok(m) = Manifest::read_at_most(&mut &rest[..], max) {
            assert!(m.total <= max);
        }
    }
});
