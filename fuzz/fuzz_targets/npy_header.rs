//! Feeds arbitrary bytes to the `.npy` header parser (tensor datasets: files users bring).
//! It must return a header or an error, never panic; a header it accepts describes data that
//! starts within the bytes it read.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = limpet_trainer::data::tensors::parse_npy_header(data) {
        assert!(h.data_offset <= data.len() as u64);
        assert!(!h.shape.is_empty());
    }
});
