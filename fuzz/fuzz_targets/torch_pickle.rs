//! Feeds arbitrary bytes to the reader of PyTorch `.bin` weights: as a state dict's pickle
//! (the opcode machine that refuses every global a state dict does not use) and as a whole
//! `torch.save` zip archive. Each must return an error or tensors whose layout stays inside
//! their storage, never panic or allocate past the input.
#![no_main]

use libfuzzer_sys::fuzz_target;
use limpet_trainer::hf::pickle::{parse_state_dict, read_archive};

fuzz_target!(|data: &[u8]| {
    if let Ok(refs) = parse_state_dict(data) {
        for (_, t) in refs {
            assert_eq!(t.shape.len(), t.stride.len());
        }
    }
    let _ = read_archive(data);
});
