//! The data plane's decoders of peer bytes (frame header, hello, pipeline tensor shape):
//! valid values round-trip, arbitrary and damaged bytes give errors, never panics. The fuzz
//! target `dataplane_frame` runs the same decoders. Also the checkpoint directory's names,
//! which come from shared storage.

use limpet_agent::dataplane::frame::{
    decode_shape, encode_shape, Channel, Header, Hello, Kind, HEADER_LEN, HELLO_LEN, MAX_LANES, MAX_PAYLOAD,
};
use proptest::prelude::*;

proptest! {
    #[test]
    fn headers_round_trip(abort in any::<bool>(), epoch in any::<u64>(), step in any::<u64>(), seq in any::<u32>(), len in 0..=MAX_PAYLOAD) {
        let h = Header { kind: if abort { Kind::Abort } else { Kind::Data }, epoch, step, seq, len };
        prop_assert_eq!(Header::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn hellos_round_trip(cluster_id in any::<u64>(), node in any::<u64>(), epoch in any::<u64>(), c in 0usize..8, lane in 1..MAX_LANES, nonce in any::<[u8; 16]>()) {
        let channel = [Channel::Ring, Channel::Handoff, Channel::Pipe, Channel::lane(lane).unwrap(), Channel::pipe(lane).unwrap(), Channel::Tree, Channel::Zone, Channel::Across][c];
        let h = Hello { cluster_id, node, epoch, channel, nonce };
        prop_assert_eq!(Hello::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn shapes_round_trip(shape in prop::collection::vec(0i64..8, 0..=8)) {
        prop_assert_eq!(decode_shape(&encode_shape(&shape)).unwrap(), shape);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..96)) {
        if Header::decode(&bytes).is_ok() {
            prop_assert_eq!(bytes.len(), HEADER_LEN);
        }
        if Hello::decode(&bytes).is_ok() {
            prop_assert_eq!(bytes.len(), HELLO_LEN);
        }
        if let Ok(shape) = decode_shape(&bytes) {
            prop_assert_eq!(encode_shape(&shape), bytes);
        }
    }

    #[test]
    fn damaged_shapes_are_refused_or_reread(shape in prop::collection::vec(0i64..64, 1..=8), at in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let mut b = encode_shape(&shape);
        let i = at.index(b.len());
        b[i] = byte;
        if let Ok(s) = decode_shape(&b) {
            prop_assert_eq!(encode_shape(&s), b);
        }
    }
}

#[test]
fn shape_refusals_name_the_problem() {
    let huge = encode_shape(&[1 << 20, 1 << 20]);
    assert!(decode_shape(&huge).unwrap_err().to_string().contains("at most"));
    assert!(decode_shape(&encode_shape(&[-1])).unwrap_err().to_string().contains("negative dimension"));
    assert!(decode_shape(&encode_shape(&[1; 9])).unwrap_err().to_string().contains("9 dimensions"));
    let mut short = encode_shape(&[2, 3]);
    short.pop();
    assert!(decode_shape(&short).unwrap_err().to_string().contains("bytes for 2 dimensions"));
}

#[test]
fn lane_refusals_name_the_problem() {
    let hello = |channel| Hello { cluster_id: 1, node: 2, epoch: 3, channel, nonce: [7; 16] }.encode();
    // A lane past the most (of the ring or of a pipe), a lane of a handoff, are refused by
    // name.
    for (c, name) in [(Channel::Ring, "ring"), (Channel::Pipe, "pipe")] {
        let mut far = hello(c);
        far[7] = MAX_LANES as u8;
        assert!(Hello::decode(&far).unwrap_err().to_string().contains(&format!("{name} lane {MAX_LANES}")));
    }
    for c in [Channel::Handoff, Channel::Tree, Channel::Zone, Channel::Across] {
        let mut b = hello(c);
        b[7] = 1;
        assert!(Hello::decode(&b).unwrap_err().to_string().contains("lane 1 of a channel that has none"));
    }
    // Lane 0 is the ring (the pipe) itself, and only one spelling of it exists.
    assert_eq!(Channel::lane(0), Some(Channel::Ring));
    assert_eq!(Channel::lane(MAX_LANES), None);
    assert_eq!(Channel::pipe(0), Some(Channel::Pipe));
    assert_eq!(Channel::pipe(MAX_LANES), None);
    assert_eq!(Hello::decode(&hello(Channel::lane(3).unwrap())).unwrap().channel, Channel::Lane(3));
    assert_eq!(Hello::decode(&hello(Channel::pipe(3).unwrap())).unwrap().channel, Channel::PipeLane(3));
}

// Checkpoint directory and file names come from a shared directory anyone may write to.
proptest! {
    #[test]
    fn checkpoint_names_never_panic_and_round_trip(name in ".{0,40}", step in any::<u64>(), a in 0usize..1000, len in 1usize..1000) {
        let _ = limpet_agent::checkpoint::parse_step_dir(&name);
        let _ = limpet_agent::checkpoint::parse_part(&name);
        if let Some((i, n)) = limpet_agent::checkpoint::parse_shard(&name) {
            prop_assert!(i < n);
        }
        let sp = limpet_agent::checkpoint::shard_path(std::path::Path::new("/c"), 1, a, a + len);
        prop_assert_eq!(limpet_agent::checkpoint::parse_shard(sp.file_name().unwrap().to_str().unwrap()), Some((a, a + len)));
        let dir = std::path::Path::new("/c");
        let step = step % 1_000_000_000_000;
        let sd = limpet_agent::checkpoint::step_dir(dir, step);
        prop_assert_eq!(limpet_agent::checkpoint::parse_step_dir(sd.file_name().unwrap().to_str().unwrap()), Some(step));
        let p = limpet_agent::checkpoint::part_path(dir, step, &(a..a + len));
        prop_assert_eq!(limpet_agent::checkpoint::parse_part(p.file_name().unwrap().to_str().unwrap()), Some(a..a + len));
    }
}
