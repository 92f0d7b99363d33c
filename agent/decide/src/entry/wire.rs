//! The entry protocol's wire form: what each rank publishes in the entry allgather (its live
//! state, two snapshots, two shadows), as a fixed-size plain-old-data record. The ring moves
//! f32 words; these words are bit patterns, never summed. Decoding checks every field a peer
//! controls, so a buggy or hostile rank cannot make the planner index out of range.

use super::plan::{Desc, RankState, KINDS};
use crate::DecideError;
use bytemuck::{Pod, Zeroable};

/// One published state: step (`u64::MAX`: none), content hash, blocks `[start, end)`; all
/// integers little-endian.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
struct WireDesc {
    step: u64,
    hash: [u8; 32],
    blocks: [u32; 2],
}

/// A rank's published states, in `KINDS` order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
struct WireRank {
    descs: [WireDesc; KINDS.len()],
}

/// f32 words per rank in the allgather.
pub const WORDS: usize = std::mem::size_of::<WireRank>() / 4;

const NONE: u64 = u64::MAX;

/// `r` as allgather words.
pub fn encode(r: &RankState) -> Vec<f32> {
    let mut w = WireRank::zeroed();
    for (slot, d) in w.descs.iter_mut().zip(KINDS.iter().map(|&k| r.desc(k))) {
        *slot = match d {
            Some(d) => WireDesc {
                step: d.step.to_le(),
                hash: d.hash,
                blocks: [(d.blocks.0 as u32).to_le(), (d.blocks.1 as u32).to_le()],
            },
            None => WireDesc { step: NONE.to_le(), hash: [0; 32], blocks: [0; 2] },
        };
    }
    bytemuck::bytes_of(&w)
        .chunks_exact(4)
        .map(|c| f32::from_ne_bytes(c.try_into().expect("4 bytes")))
        .collect()
}

/// One rank's words back into its states, for a model of `blocks` blocks. A live state is
/// required; block ranges must lie within the model and not be reversed.
pub fn decode(words: &[f32], blocks: usize) -> Result<RankState, DecideError> {
    if words.len() != WORDS {
        return Err(DecideError::EntryRecord(format!("has {} words, expected {WORDS}", words.len())));
    }
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
    let w: WireRank = bytemuck::pod_read_unaligned(&bytes);
    let mut out = [None; KINDS.len()];
    for (i, d) in w.descs.iter().enumerate() {
        let step = u64::from_le(d.step);
        if step == NONE {
            continue;
        }
        let (lo, hi) = (u32::from_le(d.blocks[0]) as usize, u32::from_le(d.blocks[1]) as usize);
        if lo > hi || hi > blocks {
            return Err(DecideError::EntryRecord(format!(
                "holds blocks {lo}..{hi} in state {i}, outside the model's 0..{blocks}"
            )));
        }
        out[i] = Some(Desc { step, hash: d.hash, blocks: (lo, hi) });
    }
    let live = out[0].ok_or_else(|| DecideError::EntryRecord("has no live state".into()))?;
    Ok(RankState { live, snaps: [out[1], out[2]], shadows: [out[3], out[4]] })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn records_round_trip() {
        let live = Desc { step: 0x1_0000_0007, hash: [0xab; 32], blocks: (2, 5) };
        let r =
            RankState { live, snaps: [Some(Desc { step: 5, ..live }), None], shadows: [None, Some(live)] };
        let w = encode(&r);
        assert_eq!(w.len(), WORDS);
        assert_eq!(decode(&w, 8).unwrap(), r);
    }

    #[test]
    fn bad_records_are_refused_with_the_reason() {
        let live = Desc { step: 3, hash: [1; 32], blocks: (0, 4) };
        let r = RankState { live, snaps: [None; 2], shadows: [None; 2] };
        assert!(decode(&encode(&r), 3).unwrap_err().to_string().contains("outside the model's 0..3"));
        assert!(decode(&encode(&r)[1..], 4).unwrap_err().to_string().contains("words"));
        let reversed = RankState { live: Desc { blocks: (3, 1), ..live }, ..r };
        assert!(decode(&encode(&reversed), 4).is_err());
        let mut none = encode(&r);
        none[0] = f32::from_bits(u32::MAX);
        none[1] = f32::from_bits(u32::MAX);
        assert!(decode(&none, 4).unwrap_err().to_string().contains("no live state"));
    }

    proptest! {
        // Whatever a peer sends decodes or is refused; it never panics, and what decodes
        // stays within the model.
        #[test]
        fn any_words_decode_or_are_refused(bits in proptest::collection::vec(any::<u32>(), WORDS), blocks in 0usize..64) {
            let words: Vec<f32> = bits.into_iter().map(f32::from_bits).collect();
            if let Ok(r) = decode(&words, blocks) {
                for k in KINDS {
                    if let Some(d) = r.desc(k) {
                        prop_assert!(d.blocks.0 <= d.blocks.1 && d.blocks.1 <= blocks);
                    }
                }
            }
        }
    }
}
