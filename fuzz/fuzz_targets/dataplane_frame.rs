//! Feeds arbitrary bytes to the data plane's decoders of what a peer sends: the handshake
//! hello and the frame header. Garbage must give an error, never a panic; what decodes must
//! re-encode to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use limpet_agent::dataplane::frame::{Header, Hello, HEADER_LEN, HELLO_LEN};

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = Header::decode(data) {
        assert_eq!(data.len(), HEADER_LEN);
        assert_eq!(&h.encode()[..], data);
    }
    if let Ok(h) = Hello::decode(data) {
        assert_eq!(data.len(), HELLO_LEN);
        assert_eq!(&h.encode()[..], data);
    }
});
