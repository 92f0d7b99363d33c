//! Feeds arbitrary keys and values to the decoder of the sled log's records (what a node
//! reads from disk at start). The first byte picks a known key (or uses the input as the key);
//! damage must be reported as an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use limpet_consensus::storage::decode_record;

const KEYS: [&[u8]; 6] = [
    b"meta/identity",
    b"meta/hard_state",
    b"meta/snapshot",
    b"meta/applied_index",
    b"meta/applied_conf",
    b"meta/applied_data",
];

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else { return };
    let mut entry_key = b"log/".to_vec();
    let (key, value): (&[u8], &[u8]) = match pick % 8 {
        k @ 0..=5 => (KEYS[k as usize], rest),
        6 if rest.len() >= 8 => {
            entry_key.extend_from_slice(&rest[..8]);
            (&entry_key, &rest[8..])
        }
        _ => rest.split_at(rest.len() / 2),
    };
    let _ = decode_record(key, value);
});
