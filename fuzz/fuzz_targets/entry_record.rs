//! Feeds arbitrary words to the epoch-entry record decoder (every rank of a new epoch decodes
//! every other rank's published states). Garbage must give an error, never a panic; what
//! decodes stays within the model and re-encodes to the same states.
#![no_main]

use libfuzzer_sys::fuzz_target;
use limpet_decide::entry::plan::KINDS;
use limpet_decide::entry::wire::{decode, encode};

fuzz_target!(|data: &[u8]| {
    let blocks = data.first().map_or(4, |b| usize::from(*b));
    let words: Vec<f32> = data
        .get(1..)
        .unwrap_or(&[])
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    if let Ok(r) = decode(&words, blocks) {
        for k in KINDS {
            if let Some(d) = r.desc(k) {
                assert!(d.blocks.0 <= d.blocks.1 && d.blocks.1 <= blocks);
            }
        }
        assert_eq!(decode(&encode(&r), blocks).expect("re-decodes"), r);
    }
});
