//! Feeds arbitrary bytes to the decoders of the consensus documents: log entry payloads
//! (`Proposal`), commands from the `Propose` RPC, and snapshots sent by a leader. Garbage must
//! give an error, never a panic; whatever decodes must re-encode to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use limpet_consensus::state::{Command, Proposal, SnapshotData};

fuzz_target!(|data: &[u8]| {
    if let Ok(p) = Proposal::decode(data) {
        assert_eq!(Proposal::decode(&p.encode()).expect("re-decodes"), p);
    }
    if let Ok(c) = Command::decode(data) {
        let bytes = serde_json::to_vec(&c).expect("encodes");
        assert_eq!(Command::decode(&bytes).expect("re-decodes"), c);
    }
    if let Ok(s) = SnapshotData::decode(data, 7) {
        assert_eq!(SnapshotData::decode(&s.encode(), 7).expect("re-decodes"), s);
    }
});
