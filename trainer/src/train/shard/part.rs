//! A sharded job's checkpoint written as parts, one per rank, at once
//! ([`Trainer::checkpoint_part`]), so that no rank gathers the whole state for it.
//!
//! Each tensor of the whole state (a parameter, an optimizer slot of one, the predicted
//! exponents) is given to one rank to write: largest first to the rank with the fewest bytes
//! so far, the same choice on every rank. Parameters are whole on every rank, so their writer
//! copies its own. An optimizer slot's values are spread over the blocks' owners: they are
//! gathered a group of parameters at a time (an allgather of each owner's part of the group),
//! so a rank holds at most one group's values besides its part. Each rank's part carries the
//! content hash the whole state has: the ranks sum the checksums of the tensors they write
//! (each given by its writer alone, zeros elsewhere, so the sum is each checksum), and each
//! computes the hash from them and from the shapes every rank knows. Loading joins the parts
//! and checks that hash ([`limpet_snapshot::shards::join`]).

use super::pieces;
use crate::train::exact::EXPONENTS;
use crate::train::{raw, Reduce, Trainer};
use crate::TrainerError;
use limpet_snapshot::{shards, Dtype, RawTensor, StateImage};
use std::collections::BTreeMap;
use std::ops::Range;
use tch::Device;

/// Most values gathered at once (16 MB of f32), unless one parameter is larger.
const GATHER_VALUES: usize = 1 << 22;

/// One rank's part of a sharded checkpoint.
#[derive(Debug)]
pub struct CheckpointPart {
    /// The tensors this rank writes, marked with the whole state's hash.
    pub image: StateImage,
    /// This part's number (the rank) and how many parts the checkpoint has (the ranks).
    pub index: usize,
    /// How many parts the checkpoint has.
    pub parts: usize,
    /// The content hash of the whole, unsharded state the parts join into.
    pub whole_hash: String,
}

/// Which part writes each tensor (by name, with its bytes): largest first to the part with
/// the fewest bytes so far (the lower part on a tie), so parts are near-equal and every rank
/// computes the same answer.
pub fn writers(tensors: &[(String, usize)], parts: usize) -> BTreeMap<String, usize> {
    let mut order: Vec<&(String, usize)> = tensors.iter().collect();
    order.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let mut load = vec![0usize; parts.max(1)];
    let mut out = BTreeMap::new();
    for (name, bytes) in order {
        let (i, _) = load.iter().enumerate().min_by_key(|&(i, l)| (*l, i)).expect("one part at least");
        load[i] += bytes;
        out.insert(name.clone(), i);
    }
    out
}

/// Parameters taken together in one gather: consecutive ones while they hold at most
/// `most` values (a larger one alone), as index ranges.
fn groups(sizes: &[usize], most: usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut held) = (0, 0);
    for (i, &n) in sizes.iter().enumerate() {
        if i > start && held + n > most {
            out.push(start..i);
            (start, held) = (i, 0);
        }
        held += n;
    }
    if start < sizes.len() {
        out.push(start..sizes.len());
    }
    out
}

impl Trainer {
    /// This rank's part of a checkpoint of the whole state, sharded over the group of
    /// `reduce` (a collective: every rank calls it at the same step). See the module.
    pub fn checkpoint_part(&self, reduce: &mut dyn Reduce) -> Result<CheckpointPart, TrainerError> {
        self.checkpoint_part_gathering(reduce, GATHER_VALUES)
    }

    /// [`Trainer::checkpoint_part`], gathering at most `most` values at once (tests cut a
    /// small model into several gathers).
    #[doc(hidden)]
    pub fn checkpoint_part_gathering(
        &self,
        reduce: &mut dyn Reduce,
        most: usize,
    ) -> Result<CheckpointPart, TrainerError> {
        let shard = self.usable_shard()?;
        let layout = &shard.layout;
        let (rank, parts) = (layout.rank(), layout.world());
        let params = self.model.params();
        let slots = self.optim.spec().slots();
        let slot_name = |k: usize, i: usize| format!("optim/{}/{}", slots[k], params[i].0);
        let shape = |i: usize| -> Vec<usize> { params[i].1.size().iter().map(|&d| d as usize).collect() };
        let exponents = self.exponents_tensor()?;

        // Every tensor of the whole state: name, dtype, shape.
        let mut all: BTreeMap<String, (Dtype, Vec<usize>)> = BTreeMap::new();
        for (i, (name, _)) in params.iter().enumerate() {
            all.insert(format!("param/{name}"), (Dtype::F32, shape(i)));
            for k in 0..slots.len() {
                all.insert(slot_name(k, i), (Dtype::F32, shape(i)));
            }
        }
        if let Some(e) = &exponents {
            all.insert(EXPONENTS.to_string(), (Dtype::I32, e.shape().to_vec()));
        }
        let sizes: Vec<(String, usize)> =
            all.iter().map(|(n, (d, s))| (n.clone(), s.iter().product::<usize>() * d.size())).collect();
        let writer = writers(&sizes, parts);
        let mine = |name: &str| writer.get(name) == Some(&rank);

        let mut tensors = BTreeMap::new();
        for (name, p) in params {
            let name = format!("param/{name}");
            if mine(&name) {
                tensors.insert(name.clone(), raw(&name, p)?);
            }
        }
        if let Some(e) = exponents.filter(|_| mine(EXPONENTS)) {
            tensors.insert(EXPONENTS.to_string(), e);
        }
        // The slots, gathered a group of parameters at a time from each block's owner.
        let own = layout.blocks()[rank].clone();
        let numels: Vec<usize> = params.iter().map(|(_, p)| p.numel()).collect();
        let starts: Vec<usize> =
            numels.iter().scan(0, |at, n| Some(std::mem::replace(at, *at + n))).collect();
        // A parameter of no values has slots of none: no block holds any of them.
        for (i, _) in numels.iter().enumerate().filter(|(_, &n)| n == 0) {
            for k in 0..slots.len() {
                let name = slot_name(k, i);
                if mine(&name) {
                    tensors.insert(name.clone(), RawTensor::from_f32(&name, shape(i), &[])?);
                }
            }
        }
        for g in groups(&numels, most) {
            let flat = starts[g.start]..starts[g.end - 1] + numels[g.end - 1];
            let within = |b: &Range<usize>| {
                let (lo, hi) = (b.start.clamp(flat.start, flat.end), b.end.clamp(flat.start, flat.end));
                lo - flat.start..hi - flat.start
            };
            let blocks: Vec<Range<usize>> = layout.blocks().iter().map(within).collect();
            let here = within(&own);
            for k in 0..slots.len() {
                let mut buf = vec![0f32; flat.len()];
                if !here.is_empty() {
                    let at = (flat.start + here.start - own.start) as i64;
                    shard.held[0].1[k]
                        .narrow(0, at, here.len() as i64)
                        .to_device(Device::Cpu)
                        .f_copy_data(&mut buf[here.clone()], here.len())?;
                }
                reduce.allgather_blocks(&mut buf, &blocks, self.step)?;
                for piece in pieces(params, flat.clone()) {
                    let name = slot_name(k, piece.index);
                    if mine(&name) {
                        let values = &buf[piece.range.start - flat.start..piece.range.end - flat.start];
                        tensors.insert(name.clone(), RawTensor::from_f32(&name, shape(piece.index), values)?);
                    }
                }
            }
        }

        // Each tensor's checksum (as the image computes it) from its writer, summed over the
        // ranks: every value is given by one rank, so the sum is each checksum.
        let as_words = |h: &blake3::Hash| -> [i64; 4] {
            std::array::from_fn(|w| {
                i64::from_le_bytes(h.as_bytes()[8 * w..8 * w + 8].try_into().expect("8 bytes"))
            })
        };
        let own: BTreeMap<&String, [i64; 4]> =
            tensors.iter().map(|(n, t)| (n, as_words(&blake3::hash(t.data())))).collect();
        let mut sums = vec![0i64; 4 * all.len()];
        for (j, name) in all.keys().enumerate() {
            if let Some(words) = own.get(name) {
                sums[4 * j..4 * j + 4].copy_from_slice(words);
            }
        }
        reduce.allreduce_sum_i64(&mut sums, self.step)?;
        let mut whole = BTreeMap::new();
        for ((name, (dtype, shape)), words) in all.into_iter().zip(sums.chunks(4)) {
            if own.get(&name).is_some_and(|w| w[..] != *words) {
                // Only a peer adds to what this rank gives: a shard naming a hash its
                // tensors do not make would be no checkpoint.
                return Err(TrainerError::Reduce {
                    peer: None,
                    detail: format!("the checksum of {name}, this rank's to give, came back changed"),
                    violation: true,
                });
            }
            let mut bytes = [0u8; 32];
            for (w, v) in words.iter().enumerate() {
                bytes[8 * w..8 * w + 8].copy_from_slice(&v.to_le_bytes());
            }
            whole.insert(name, (dtype, shape, blake3::Hash::from_bytes(bytes).to_hex().to_string()));
        }
        drop(own);
        let job = serde_json::to_value(&self.job).expect("JobSpec serializes");
        let whole_hash = shards::whole_hash((self.step, self.cursor, self.rng, &job), &whole);
        let image = shards::shard_image((self.step, self.cursor, self.rng, job), tensors, &whole_hash)?;
        Ok(CheckpointPart { image, index: rank, parts, whole_hash })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writers_balance_bytes_alike_everywhere_and_groups_tile_the_parameters() {
        let t: Vec<(String, usize)> = [("a", 100), ("b", 60), ("c", 50), ("d", 10), ("e", 0)]
            .iter()
            .map(|(n, b)| (n.to_string(), *b))
            .collect();
        let w = writers(&t, 2);
        assert_eq!((w["a"], w["b"], w["c"], w["d"], w["e"]), (0, 1, 1, 0, 0));
        assert_eq!(writers(&t, 1).values().copied().collect::<Vec<_>>(), vec![0; 5]);
        let mut shuffled = t.clone();
        shuffled.reverse();
        assert_eq!(writers(&shuffled, 3), writers(&t, 3), "the order given does not matter");
        let g = groups(&[GATHER_VALUES, 1, 2, GATHER_VALUES - 3, 1, 5 * GATHER_VALUES], GATHER_VALUES);
        assert_eq!(g, vec![0..1, 1..4, 4..5, 5..6]);
        assert!(groups(&[], GATHER_VALUES).is_empty());
    }
}
