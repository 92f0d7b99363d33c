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
});
