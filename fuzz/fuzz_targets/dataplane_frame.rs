//! Feeds arbitrary bytes to the data plane's decoders of what a peer sends: the handshake
//! hello, the frame header and the shape of a tensor sent between pipeline stages. Garbage must give an error, never a panic; what decodes must
//! re-encode to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use limpet_agent::dataplane::frame::{decode_shape, encode_shape, Header, Hello, HEADER_LEN, HELLO_LEN};

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = Header::decode(data) {
        assert_eq!(data.len(), HEADER_LEN);
        assert_eq!(&h.encode()[..], data);
    }
    if let Ok(shape) = decode_shape(data) {
        assert_eq!(encode_shape(&shape), data);
    }
    if let Ok(h) = Hello::decode(data) {
        assert_eq!(data.len(), HELLO_LEN);
        assert_eq!(&h.encode()[..], data);
    }
});
