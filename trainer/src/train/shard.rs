//! Sharded optimizer state (ZeRO-1 over the ring): each rank keeps the optimizer state of one
//! block of the flat gradient, plus `replicas` neighbours' blocks so that a killed rank's
//! state survives on another.
//!
//! A sharded step reduce-scatters the gradient (each rank gets its block summed, and the
//! blocks it replicates forwarded whole from their owners), computes the global norm from
//! each owner's block, updates the parameters and state of every block it holds, and
//! allgathers the parameters from the owners. The ring moves what an allreduce moves plus
//! the replicated blocks once. Holders of one block update it from the same bits in the same
//! way, so the owner and its replicas agree bit for bit; the update is elementwise, so a
//! block updates exactly as it would within the whole tensor.

use super::{Reduce, StepStats, Trainer};
use crate::optim::{clip_to_norm, decays, scratch_for, sum_of_squares, update, OptimizerSpec};
use crate::TrainerError;
use std::ops::Range;
use tch::{Device, Kind, Tensor};

/// Blocks are cut at multiples of this many values (64 bytes), so none splits a cache line.
const ALIGN: usize = 16;

/// Which block of the flat gradient (and optimizer state) each rank owns, and how many
/// blocks before its own a rank also holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardLayout {
    /// One block per rank, in rank order, tiling the gradient.
    pub blocks: Vec<Range<usize>>,
    /// This rank.
    pub rank: usize,
    /// Blocks of the ranks before this one (around the ring) it holds as well.
    pub replicas: usize,
}

impl ShardLayout {
    /// Near-equal blocks of a gradient of `len` values over `world` ranks.
    pub fn new(len: usize, world: usize, rank: usize, replicas: usize) -> Result<Self, TrainerError> {
        if world == 0 || rank >= world {
            return Err(TrainerError::Config(format!("rank {rank} of a world of {world}")));
        }
        if world > 1 && replicas >= world {
            return Err(TrainerError::Config(format!(
                "{replicas} replicas of each shard need more than {world} ranks"
            )));
        }
        let cut = |i: usize| if i == world { len } else { (i * len / world) / ALIGN * ALIGN };
        let blocks = (0..world).map(|i| cut(i)..cut(i + 1)).collect();
        Ok(ShardLayout { blocks, rank, replicas: if world == 1 { 0 } else { replicas } })
    }

    /// The blocks this rank holds: its own first, then the `replicas` before it.
    pub fn held(&self) -> Vec<usize> {
        let w = self.blocks.len();
        (0..=self.replicas).map(|k| (self.rank + w - k) % w).collect()
    }
}

/// The optimizer state of the blocks one rank holds: per block, one flat tensor per slot.
#[derive(Debug)]
pub(crate) struct ShardState {
    layout: ShardLayout,
    held: Vec<(usize, Vec<Tensor>)>,
    scratch: Option<Tensor>,
}

impl ShardState {
    /// Updates every held block of `params` from the averaged, clipped gradient `grad`.
    fn apply(&mut self, spec: &OptimizerSpec, params: &[(String, Tensor)], grad: &Tensor, lr: f64, t: u64) {
        let device = params.first().map_or(Device::Cpu, |(_, p)| p.device());
        let largest = self.held.iter().map(|(b, _)| self.layout.blocks[*b].len()).max().unwrap_or(0);
        let scratch = scratch_for(&mut self.scratch, largest, device);
        tch::no_grad(|| {
            for (b, slots) in &self.held {
                let block = self.layout.blocks[*b].clone();
                for (name, p, part) in pieces(params, block.clone()) {
                    let (at, len) = (part.start as i64, part.len() as i64);
                    let pv = p.view([-1]).narrow(0, at - offset_of(params, name), len);
                    let gv = grad.narrow(0, at, len);
                    let mut sv: Vec<Tensor> =
                        slots.iter().map(|s| s.narrow(0, at - block.start as i64, len)).collect();
                    let decays = decays(name, p.dim(), spec.decay_embeddings());
                    update(spec, decays, &pv, &gv, &mut sv, &scratch.narrow(0, 0, len), lr, t);
                }
            }
        });
    }
}

/// The parts of `params` that fall in `range` of the flat order: (name, parameter, range in
/// the flat order).
fn pieces<'a>(
    params: &'a [(String, Tensor)],
    range: Range<usize>,
) -> impl Iterator<Item = (&'a str, &'a Tensor, Range<usize>)> + 'a {
    let mut offset = 0usize;
    params.iter().filter_map(move |(name, p)| {
        let (start, end) = (offset, offset + p.numel());
        offset = end;
        let (lo, hi) = (start.max(range.start), end.min(range.end));
        (lo < hi).then_some((name.as_str(), p, lo..hi))
    })
}

/// Where parameter `name` starts in the flat order.
fn offset_of(params: &[(String, Tensor)], name: &str) -> i64 {
    params.iter().take_while(|(n, _)| n != name).map(|(_, p)| p.numel() as i64).sum()
}

impl Trainer {
    /// Keeps only the optimizer state of the blocks `layout` gives this rank and drops the
    /// rest. The trainer's full state is the starting point (a fresh job's zeros, or a
    /// checkpoint's); [`Trainer::unshard`] gathers it back.
    pub fn shard_state(&mut self, layout: ShardLayout) -> Result<(), TrainerError> {
        let n = self.grads.grads_len();
        if layout.blocks.last().map(|b| b.end) != Some(n) {
            return Err(TrainerError::Config(format!(
                "a shard layout of {:?} for {n} values",
                layout.blocks
            )));
        }
        if self.optim.is_released() {
            return Err(TrainerError::Config("the optimizer state is sharded already".into()));
        }
        let params = self.model.params();
        let device = self.model.device();
        let mut held = Vec::new();
        for b in layout.held() {
            let block = layout.blocks[b].clone();
            let mut slots = Vec::new();
            for k in 0..self.optim.spec().slots().len() {
                let flat = Tensor::f_zeros([block.len() as i64], (Kind::Float, device))?;
                for (name, _, part) in pieces(params, block.clone()) {
                    let i = params.iter().position(|(n, _)| n == name).expect("a parameter");
                    let from = self.optim.slot_mut(k, i).view([-1]);
                    let len = part.len() as i64;
                    let src = from.narrow(0, part.start as i64 - offset_of(params, name), len);
                    tch::no_grad(|| flat.narrow(0, (part.start - block.start) as i64, len).f_copy_(&src))?;
                }
                slots.push(flat);
            }
            held.push((b, slots));
        }
        self.optim.release();
        self.shard = Some(ShardState { layout, held, scratch: None });
        Ok(())
    }

    /// The layout of a sharded trainer's state.
    pub fn shard_layout(&self) -> Option<&ShardLayout> {
        self.shard.as_ref().map(|s| &s.layout)
    }

    /// The optimizer state this rank holds of block `block` (one vector per slot), if it
    /// holds that block.
    pub fn held_shard(&self, block: usize) -> Result<Option<Vec<Vec<f32>>>, TrainerError> {
        let Some((_, slots)) = self.shard.as_ref().and_then(|s| s.held.iter().find(|(b, _)| *b == block))
        else {
            return Ok(None);
        };
        let mut out = Vec::new();
        for t in slots {
            let mut v = vec![0f32; t.numel()];
            t.to_device(Device::Cpu).f_copy_data(&mut v, t.numel())?;
            out.push(v);
        }
        Ok(Some(out))
    }

    /// Gathers the whole optimizer state from every rank's block (a collective, under
    /// `reduce`) and drops the sharding: what a checkpoint, a state image or a new layout
    /// starts from.
    pub fn unshard(&mut self, reduce: &mut dyn Reduce) -> Result<(), TrainerError> {
        let Some(shard) = self.shard.take() else { return Ok(()) };
        let n = self.grads.grads_len();
        let own = shard.layout.blocks[shard.layout.rank].clone();
        let slots_held = &shard.held.first().expect("its own block").1;
        let params = self.model.params();
        let mut slots = Vec::new();
        for own_slot in slots_held {
            let mut all = vec![0f32; n];
            own_slot.to_device(Device::Cpu).f_copy_data(&mut all[own.clone()], own.len())?;
            if let Err(e) = reduce.allgather_blocks(&mut all, &shard.layout.blocks, self.step) {
                self.shard = Some(shard);
                return Err(e);
            }
            let flat = Tensor::from_slice(&all).to_device(self.model.device());
            let mut at = 0i64;
            slots.push(
                params
                    .iter()
                    .map(|(_, p)| {
                        let t = flat.narrow(0, at, p.numel() as i64).view_as(p).copy();
                        at += p.numel() as i64;
                        t
                    })
                    .collect(),
            );
        }
        self.optim.restore(slots);
        Ok(())
    }

    /// One step with sharded state (see the module's notes); the trainer must be sharded.
    pub fn sharded_step(&mut self, reduce: &mut dyn Reduce) -> Result<StepStats, TrainerError> {
        let layout = match &self.shard {
            Some(s) => s.layout.clone(),
            None => {
                return Err(TrainerError::Config("a sharded step of a trainer that is not sharded".into()))
            }
        };
        let (rank, world, step) = (layout.rank, layout.blocks.len(), self.step);
        self.compute_grads(rank, world)?;
        let n = self.grads.grads_len();
        let held = layout.held();
        let buf = self.grads.as_mut_slice();
        reduce.reduce_scatter_sum(&mut buf[..n], &layout.blocks, layout.replicas, step)?;
        reduce.allreduce_sum(&mut buf[n..], step)?;
        let (loss_sum, samples, rank_mean_sq_sum) = (buf[n], buf[n + 1], f64::from(buf[n + 2]));
        if samples.round() as usize != self.plan.global_batch {
            return Err(TrainerError::reduce(format!(
                "reduced sample count {samples} is not the global batch {}: a rank's share is missing or doubled",
                self.plan.global_batch
            )));
        }
        let inv = 1.0 / samples;
        for &b in &held {
            buf[layout.blocks[b].clone()].iter_mut().for_each(|g| *g *= inv);
        }
        // The global norm from each owner's block, gathered as an f64 split in two f32s and
        // summed in rank order: every rank gets the same bits.
        let partial = sum_of_squares(&buf[layout.blocks[rank].clone()]);
        let mut parts = vec![0f32; 2 * world];
        parts[2 * rank] = partial as f32;
        parts[2 * rank + 1] = (partial - f64::from(partial as f32)) as f32;
        let halves: Vec<Range<usize>> = (0..world).map(|i| 2 * i..2 * i + 2).collect();
        reduce.allgather_blocks(&mut parts, &halves, step)?;
        let norm = parts.chunks(2).map(|c| f64::from(c[0]) + f64::from(c[1])).sum::<f64>().sqrt();
        for &b in &held {
            clip_to_norm(&mut buf[layout.blocks[b].clone()], norm, self.job.clip_norm);
        }
        let lr =
            self.job.optimizer.lr() * self.job.schedule.factor(self.step, self.job.steps) * self.lr_scale;
        let device = self.model.device();
        let grad = self.grads.grads_on(device);
        let spec = self.optim.spec().clone();
        self.shard.as_mut().expect("sharded").apply(&spec, self.model.params(), &grad, lr, step + 1);
        // The parameters from their owners: this rank's block into the buffer, gathered.
        let own = layout.blocks[rank].clone();
        let buf = self.grads.as_mut_slice();
        for (name, p, part) in pieces(self.model.params(), own) {
            let at = part.start as i64 - offset_of(self.model.params(), name);
            let src = p.detach().view([-1]).narrow(0, at, part.len() as i64).to_device(Device::Cpu);
            src.f_copy_data(&mut buf[part.clone()], part.len())?;
        }
        reduce.allgather_blocks(&mut buf[..n], &layout.blocks, step)?;
        let flat = self.grads.grads_on(device);
        tch::no_grad(|| -> Result<(), TrainerError> {
            let mut at = 0i64;
            for (_, p) in self.model.params() {
                let len = p.numel() as i64;
                p.shallow_clone().f_copy_(&flat.narrow(0, at, len).view_as(p))?;
                at += len;
            }
            Ok(())
        })?;
        let stats = StepStats {
            step,
            loss: f64::from(loss_sum) / f64::from(samples),
            lr,
            grad_norm: norm,
            samples: samples as usize,
            rank_mean_sq_sum,
            agreed: false,
        };
        self.advance();
        Ok(stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_tile_the_gradient_aligned_and_replicas_come_before() {
        let l = ShardLayout::new(1000, 3, 0, 1).unwrap();
        assert_eq!(l.blocks, vec![0..320, 320..656, 656..1000]);
        assert_eq!(l.held(), vec![0, 2]);
        assert_eq!(ShardLayout::new(1000, 3, 2, 2).unwrap().held(), vec![2, 1, 0]);
        // Fewer values than ranks: empty blocks, still a tiling.
        let small = ShardLayout::new(5, 4, 1, 0).unwrap();
        assert_eq!(small.blocks, vec![0..0, 0..0, 0..0, 0..5]);
        assert!(ShardLayout::new(10, 2, 0, 2).is_err());
        assert!(ShardLayout::new(10, 2, 2, 0).is_err());
        assert_eq!(ShardLayout::new(10, 1, 0, 3).unwrap().replicas, 0);
    }
}
