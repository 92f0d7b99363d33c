//! Feeds arbitrary bytes to the decoder of `RaftBatch`es, the raft messages peers send over
//! gRPC. It must refuse garbage with an error, never panic; what it accepts must be messages
//! for this node from the batch's sender, and must survive re-encoding unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use limpet_consensus::transport::{decode_batch_bytes, encode_batch};

fuzz_target!(|data: &[u8]| {
    if let Ok(msgs) = decode_batch_bytes(data, 7, 1) {
        for m in &msgs {
            assert_eq!(m.to, 1);
        }
        let from = msgs.first().map_or(0, |m| m.from);
        let again = encode_batch(7, from, &msgs);
        let round = limpet_consensus::transport::decode_batch(&again, 7, 1).expect("re-decodes");
        assert_eq!(round, msgs);
    }
});
