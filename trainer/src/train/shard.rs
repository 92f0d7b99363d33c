//! Sharded optimizer state (ZeRO-1 over the ring): each rank keeps the optimizer state of one
//! block of the flat gradient, plus `replicas` other hosts' blocks so that a killed rank's
//! (or host's) state survives on another host. With one rank per host the replicas are the
//! blocks of the ranks before it around the ring; with a host's local ranks
//! ([`ShardLayout::over_hosts`]) they are the blocks of the same local rank on the hosts
//! before it, never another device of the same host, which a `kill -9` takes along.
//!
//! A sharded step reduce-scatters the gradient (each rank gets its block summed, and the
//! blocks it replicates forwarded whole from their owners), computes the global norm from
//! each owner's block, updates the parameters and state of every block it holds, and
//! allgathers the parameters from the owners. The ring moves what an allreduce moves plus
//! the replicated blocks once. Holders of one block update it from the same bits in the same
//! way, so the owner and its replicas agree bit for bit; the update is elementwise, so a
//! block updates exactly as it would within the whole tensor.
//!
//! A step that fails before the update changes nothing. One that fails after it (in the
//! parameters' allgather) has applied the step to this rank's held blocks but not to its
//! other parameters: the trainer counts the step as applied and marks its parameters stale,
//! and every later step refuses until [`Trainer::regroup`] rebuilds them.
//!
//! At an epoch change [`Trainer::regroup`] rebuilds the state in the new group: the ranks
//! agree on the newest layout some of them hold blocks of, at the furthest step; each block of
//! it comes from one holder at that step (any: holders are bit-identical), parameters included;
//! and each rank keeps the blocks of the new layout it holds, or all of it. A block whose every
//! holder is gone cannot be rebuilt ([`TrainerError::ShardLost`]): the state must come from a
//! checkpoint.

mod layout;
mod part;
mod regroup;
mod unshard;

use layout::describe_counts;
pub use layout::ShardLayout;
pub use part::CheckpointPart;
pub(in crate::train) use unshard::OptimTensor;

use super::{grads, Reduce, StepStats, Trainer};
use crate::optim::{
    clip_to_norm, decays, scratch_for, sum_of_squares, update_all, Kernels, Optimizer, OptimizerSpec, Part,
};
use crate::TrainerError;
use std::ops::Range;
use tch::{Device, Tensor};

/// The optimizer state of the blocks one rank holds: per block, one flat tensor per slot.
#[derive(Debug)]
pub(crate) struct ShardState {
    layout: ShardLayout,
    held: Vec<(usize, Vec<Tensor>)>,
    scratch: Option<Tensor>,
    /// Why the parameters outside the held blocks are a step behind (a step failed after
    /// its update, in the parameters' allgather), if they are.
    stale: Option<String>,
    /// The step whose reduced, averaged gradient of the held blocks is in the gradient
    /// buffer, waiting for the global norm (its allgather failed): a regroup can finish it
    /// with the norm a peer got.
    pub(super) pending: Option<u64>,
    /// The global norm of the last step whose norm this rank gathered.
    last_norm: Option<(u64, f64)>,
}

impl ShardState {
    /// Updates every held block of `params` from the averaged, clipped gradient `grad`.
    fn apply(
        &mut self,
        spec: &OptimizerSpec,
        params: &[(String, Tensor)],
        grad: &Tensor,
        lr: f64,
        t: u64,
        kernels: Kernels,
    ) -> Result<(), crate::optim::FusedError> {
        let device = params.first().map_or(Device::Cpu, |(_, p)| p.device());
        // The work space of the largest piece (a parameter's part in a block), as whole
        // state's is of the largest parameter: one of a whole block was 300 MB at 350m,
        // world 4, on every rank.
        let largest = (self.held.iter())
            .flat_map(|(b, _)| pieces(params, self.layout.blocks[*b].clone()))
            .map(|p| p.range.len())
            .max()
            .unwrap_or(0);
        let scratch = scratch_for(&mut self.scratch, largest, device);
        let mut parts = Vec::new();
        // Views of the parameters made without autograd, as they are written.
        tch::no_grad(|| {
            for (b, slots) in &self.held {
                let block = self.layout.blocks[*b].clone();
                for piece in pieces(params, block.clone()) {
                    let (name, p) = (&params[piece.index].0, &params[piece.index].1);
                    let len = piece.range.len() as i64;
                    let at = (piece.range.start - block.start) as i64;
                    parts.push(Part {
                        p: p.view([-1]).narrow(0, (piece.range.start - piece.offset) as i64, len),
                        g: grad.narrow(0, piece.range.start as i64, len).to_device(device),
                        slots: slots.iter().map(|s| s.narrow(0, at, len)).collect(),
                        decays: decays(name, p.dim(), spec.decay_embeddings()),
                    });
                }
            }
        });
        update_all(spec, kernels, parts, &scratch, lr, t)
    }
}

/// A part of a parameter inside a range of the flat order.
struct Piece {
    /// The parameter's index.
    index: usize,
    /// Where the parameter starts in the flat order.
    offset: usize,
    /// The part, in the flat order.
    range: Range<usize>,
}

/// The parts of `params` that fall in `range` of the flat order.
fn pieces(params: &[(String, Tensor)], range: Range<usize>) -> impl Iterator<Item = Piece> + '_ {
    let mut offset = 0usize;
    params.iter().enumerate().filter_map(move |(index, (_, p))| {
        let (start, end) = (offset, offset + p.numel());
        offset = end;
        let (lo, hi) = (start.max(range.start), end.min(range.end));
        (lo < hi).then_some(Piece { index, offset: start, range: lo..hi })
    })
}

/// Copies `src`'s values in `range` of the flat order (parameter-shaped tensors, in order)
/// into `out` (which holds that range).
fn flat_values(
    src: &[Tensor],
    params: &[(String, Tensor)],
    range: Range<usize>,
    out: &mut [f32],
) -> Result<(), TrainerError> {
    for piece in pieces(params, range.clone()) {
        let len = piece.range.len();
        // `reshape`, not `view`: an optimizer state not yet written is a zero-stride view.
        let part = src[piece.index].detach().reshape([-1]).narrow(
            0,
            (piece.range.start - piece.offset) as i64,
            len as i64,
        );
        let at = piece.range.start - range.start;
        part.to_device(Device::Cpu).f_copy_data(&mut out[at..at + len], len)?;
    }
    Ok(())
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
        if let Some((name, _)) = params.iter().find(|(_, p)| !p.is_contiguous()) {
            return Err(TrainerError::Config(format!(
                "parameter {name} is not contiguous: it cannot be sharded"
            )));
        }
        let device = self.model.device();
        let mut held = Vec::new();
        for b in layout.held() {
            let block = layout.blocks[b].clone();
            let mut slots = Vec::new();
            for k in 0..self.optim.spec().slots().len() {
                let src: Vec<Tensor> =
                    (0..params.len()).map(|i| self.optim.slot(k, i).shallow_clone()).collect();
                let mut values = vec![0f32; block.len()];
                flat_values(&src, params, block.clone(), &mut values)?;
                slots.push(Tensor::from_slice(&values).to_device(device));
            }
            held.push((b, slots));
        }
        self.optim.release();
        self.shard =
            Some(ShardState { layout, held, scratch: None, stale: None, pending: None, last_norm: None });
        Ok(())
    }

    /// A step this rank applied although its collectives broke (its parameters' allgather,
    /// or its norm's, finished by [`Trainer::regroup`]): what it did, for the step log, once.
    pub fn take_unlogged(&mut self) -> Option<StepStats> {
        self.unlogged.take()
    }

    /// Whether a step waits for [`Trainer::take_unlogged`].
    pub fn has_unlogged(&self) -> bool {
        self.unlogged.is_some()
    }

    /// The layout of a sharded trainer's state.
    pub fn shard_layout(&self) -> Option<&ShardLayout> {
        self.shard.as_ref().map(|s| &s.layout)
    }

    /// The bytes of optimizer state this rank holds, and those of the whole state (every
    /// slot of every parameter, in f32): what sharding saves, counted rather than inferred
    /// from resident memory (`bench dp`, the last step's log line).
    pub fn optim_state_bytes(&self) -> (u64, u64) {
        let whole = (self.optim.spec().slots().len() * self.grads.grads_len() * 4) as u64;
        let held = match &self.shard {
            Some(s) => s
                .held
                .iter()
                .flat_map(|(_, slots)| slots)
                .map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
                .sum(),
            None => whole,
        };
        (held, whole)
    }

    /// The bytes of the whole state's tensors (the parameters and every optimizer slot):
    /// what an image of it holds, its header aside.
    pub fn state_bytes(&self) -> u64 {
        let params: u64 =
            self.model.params().iter().map(|(_, p)| (p.numel() * p.kind().elt_size_in_bytes()) as u64).sum();
        params + self.optim_state_bytes().1
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

    /// Drops the sharding of a trainer whose state is to be loaded whole (an image): fresh
    /// zero slots, which the image overwrites.
    pub(crate) fn drop_shard(&mut self) {
        if self.shard.take().is_some() {
            self.optim = Optimizer::new(self.optim.spec(), self.model.params());
        }
    }

    pub(super) fn usable_shard(&self) -> Result<&ShardState, TrainerError> {
        let s =
            self.shard.as_ref().ok_or_else(|| TrainerError::Config("the trainer is not sharded".into()))?;
        match &s.stale {
            Some(why) => Err(TrainerError::Config(format!(
                "parameters are stale since a step failed after its update ({why}): regroup or load an image"
            ))),
            None => Ok(s),
        }
    }

    /// One step with sharded state (see the module's notes); the trainer must be sharded
    /// for this rank of a group of `world`.
    pub fn sharded_step(
        &mut self,
        rank: usize,
        world: usize,
        reduce: &mut dyn Reduce,
    ) -> Result<StepStats, TrainerError> {
        if self.job.reproducible {
            return self.exact_step(rank, world, reduce);
        }
        let layout = self.step_layout(rank, world, &reduce.host_counts(world))?;
        let step = self.step;
        self.shard.as_mut().expect("sharded").pending = None;
        self.compute_grads(rank, world)?;
        let n = self.grads.grads_len();
        let give_back = self.shards_gradients();
        let lossy = self.lossy_values();
        let buf = self.grads.as_mut_slice();
        reduce.reduce_scatter_sum_bf16(&mut buf[..n], &layout.blocks, layout.replicas, lossy, step)?;
        if give_back {
            release_unheld(&layout, &mut buf[..n], 0);
        }
        reduce.allreduce_sum(&mut buf[n..], step)?;
        self.finish_sharded(&layout, step, reduce)
    }

    /// Whether this trainer keeps only the reduced gradients of the blocks it holds
    /// (`shard_state = "optimizer+gradients"`, ZeRO-2): its gradient buffer's pages are given
    /// back before each backward and, once reduced, outside the held blocks; the parameters
    /// are gathered a window at a time. Every rank of a job decides alike.
    pub(super) fn shards_gradients(&self) -> bool {
        self.shard.is_some() && self.job.shard_state.is_some_and(|s| s.gradients)
    }

    /// The layout a step as `rank` of `world` uses: this trainer's, checked usable and cut
    /// for that rank and world, and for hosts of `counts` ranks (the reduce's
    /// [`Reduce::host_counts`], which places the replicas' blocks it scatters).
    pub(super) fn step_layout(
        &self,
        rank: usize,
        world: usize,
        counts: &[usize],
    ) -> Result<ShardLayout, TrainerError> {
        let layout = self.usable_shard()?.layout.clone();
        if (layout.rank, layout.world()) != (rank, world) {
            return Err(TrainerError::Config(format!(
                "a step as rank {rank} of {world} with state sharded for rank {} of {}",
                layout.rank,
                layout.world()
            )));
        }
        // Without replicas hosts of equal counts reduce-scatter any layout alike; hosts of
        // unequal counts place the empty blocks by host.
        let equal = |c: &[usize]| c.iter().all(|&x| x == c[0]);
        if layout.counts != counts && (layout.replicas > 0 || !equal(&layout.counts) || !equal(counts)) {
            return Err(TrainerError::Config(format!(
                "state sharded over hosts of {} ranks, reduced over hosts of {}",
                describe_counts(&layout.counts),
                describe_counts(counts)
            )));
        }
        Ok(layout)
    }

    /// The rest of a sharded step once the buffer holds the held blocks' summed gradients
    /// and the summed scalars: the average, the global norm, the update of the held blocks
    /// and the parameters' allgather.
    pub(super) fn finish_sharded(
        &mut self,
        layout: &ShardLayout,
        step: u64,
        reduce: &mut dyn Reduce,
    ) -> Result<StepStats, TrainerError> {
        let (rank, world) = (layout.rank, layout.world());
        let n = self.grads.grads_len();
        let staged = self.grads.is_staged();
        let buf = self.grads.as_mut_slice();
        let (loss_sum, samples, rank_mean_sq_sum) = (buf[n], buf[n + 1], f64::from(buf[n + 2]));
        super::check_count(samples, self.plan.global_batch, "rank")?;
        let inv = 1.0 / samples;
        let own = sum_of_squares_held(self, layout, inv, staged)?;
        self.shard.as_mut().expect("sharded").pending = Some(step);
        // The global norm from each owner's block: each f64 sent as its bits in two f32
        // words (the ring copies them untouched) and summed in rank order, so every rank
        // gets the same bits.
        let bits = own.to_bits();
        let mut parts = vec![0f32; 2 * world];
        parts[2 * rank] = f32::from_bits((bits >> 32) as u32);
        parts[2 * rank + 1] = f32::from_bits(bits as u32);
        let halves: Vec<Range<usize>> = (0..world).map(|i| 2 * i..2 * i + 2).collect();
        reduce.allgather_blocks(&mut parts, &halves, step)?;
        let norm = parts
            .chunks(2)
            .map(|c| f64::from_bits((u64::from(c[0].to_bits()) << 32) | u64::from(c[1].to_bits())))
            .sum::<f64>()
            .sqrt();
        // From here on the step is applied to the held blocks: a failure leaves the other
        // parameters a step behind, which a regroup rebuilds.
        let stats = self.update_held(layout, step, norm, (loss_sum, samples, rank_mean_sq_sum))?;
        self.gather_and_advance(layout, stats, reduce)
    }

    /// Updates the held blocks of step `step` with the global `norm` (the norm is gathered,
    /// so nothing is pending), and what the step did, from the reduced loss sum, sample
    /// count and ranks' squared norms.
    fn update_held(
        &mut self,
        layout: &ShardLayout,
        step: u64,
        norm: f64,
        (loss_sum, samples, rank_mean_sq_sum): (f32, f32, f64),
    ) -> Result<StepStats, TrainerError> {
        {
            let s = self.shard.as_mut().expect("sharded");
            (s.pending, s.last_norm) = (None, Some((step, norm)));
        }
        let lr = self.apply_held(layout, norm)?;
        Ok(StepStats {
            step,
            loss: f64::from(loss_sum) / f64::from(samples),
            lr,
            grad_norm: norm,
            samples: samples as usize,
            rank_mean_sq_sum,
            agreed: false,
        })
    }

    /// The end of a reproducible step with sharded state: the buffer holds the whole summed
    /// gradient (every rank has it, dequantized from the exact sum), so each rank averages
    /// and takes the norm of the whole as [`Trainer::apply_reduced`] does, updates the blocks
    /// it holds with the same elementwise update, and the parameters are gathered from their
    /// owners: the bits of whole state, whatever the world and the layout. `next` are the
    /// exponents predicted for the next step; the moment the held blocks are updated they
    /// are this rank's (a rank that updated and then lost the parameters' allgather gives
    /// them in the regroup).
    pub(super) fn apply_exact_sharded(
        &mut self,
        layout: &ShardLayout,
        next: Vec<i32>,
        step: u64,
        reduce: &mut dyn Reduce,
    ) -> Result<StepStats, TrainerError> {
        let stats = self.update_exact_held(layout, next, step)?;
        self.gather_and_advance(layout, stats, reduce)
    }

    /// [`Trainer::apply_exact_sharded`] up to the parameters' allgather: the held blocks
    /// updated from the whole summed gradient in the buffer (also how a regroup finishes a
    /// reproducible step whose sum broke on this rank, from a peer's sum).
    pub(super) fn update_exact_held(
        &mut self,
        layout: &ShardLayout,
        next: Vec<i32>,
        step: u64,
    ) -> Result<StepStats, TrainerError> {
        let n = self.grads.grads_len();
        let buf = self.grads.as_mut_slice();
        let (loss_sum, samples) = (buf[n], buf[n + 1]);
        super::check_count(samples, self.plan.global_batch, "rank")?;
        let inv = 1.0 / samples;
        buf[..n].iter_mut().for_each(|g| *g *= inv);
        let norm = sum_of_squares(&buf[..n]).sqrt();
        if self.grads.is_staged() {
            // `apply_held` reads staged gradients on the device: the averaged sum goes there.
            // (Reproducible jobs keep each gradient its own; this keeps any other binding right.)
            let _ = self.grads.grads()?;
        }
        let stats = self.update_held(layout, step, norm, (loss_sum, samples, 0.0))?;
        if self.shards_gradients() {
            // Every rank summed the whole gradient; only the held blocks' was used.
            release_unheld(layout, &mut self.grads.as_mut_slice()[..n], 0);
        }
        self.exact_exponents = Some(next);
        Ok(stats)
    }

    /// The end of a sharded step once this rank's blocks are updated: the parameters
    /// gathered from their owners, and the next step. A failed gather still counts the step
    /// as applied (logged later) and marks the other parameters stale until a regroup.
    fn gather_and_advance(
        &mut self,
        layout: &ShardLayout,
        stats: StepStats,
        reduce: &mut dyn Reduce,
    ) -> Result<StepStats, TrainerError> {
        if let Err(e) = self.gather_params(layout, stats.step, reduce) {
            self.shard.as_mut().expect("sharded").stale = Some(e.to_string());
            self.unlogged = Some(stats);
            self.advance();
            return Err(e);
        }
        self.advance();
        Ok(stats)
    }

    /// Clips the held blocks of the averaged gradient in the buffer to the global `norm` and
    /// updates the held blocks with them, as the current step; returns the learning rate.
    fn apply_held(&mut self, layout: &ShardLayout, norm: f64) -> Result<f64, TrainerError> {
        let grad = match self.grads.staged() {
            // Staged: averaged on the device already (`sum_of_squares_held`), clipped there.
            Some(g) => {
                if let Some(max) = self.job.clip_norm.filter(|&max| norm > max) {
                    let s = (max / (norm + 1e-6)) as f32;
                    for b in layout.held() {
                        let r = &layout.blocks[b];
                        let _ = g.f_narrow(0, r.start as i64, r.len() as i64)?.f_mul_scalar_(f64::from(s))?;
                    }
                }
                g.shallow_clone()
            }
            None => {
                let buf = self.grads.as_mut_slice();
                for b in layout.held() {
                    clip_to_norm(&mut buf[layout.blocks[b].clone()], norm, self.job.clip_norm);
                }
                self.grads.grads()?
            }
        };
        let lr =
            self.job.optimizer.lr() * self.job.schedule.factor(self.step, self.job.steps) * self.lr_scale;
        let spec = self.optim.spec().clone();
        let t = self.step + 1;
        let kernels = Kernels::for_job(self.job.reproducible, self.model.device());
        self.shard.as_mut().expect("sharded").apply(&spec, self.model.params(), &grad, lr, t, kernels)?;
        Ok(lr)
    }

    /// The parameters from their owners: this rank's block into the gradient buffer (whose
    /// gradients are spent), gathered, and copied into every parameter. On the CPU the
    /// parameters' `.grad` views then hold parameters until the next step zeroes them.
    fn gather_params(
        &mut self,
        layout: &ShardLayout,
        step: u64,
        reduce: &mut dyn Reduce,
    ) -> Result<(), TrainerError> {
        let n = self.grads.grads_len();
        // With sharded gradients the buffer is filled and given back a window at a time, so
        // it never holds the whole model; otherwise one window is the whole buffer.
        let give_back = self.shards_gradients();
        let window = if give_back { super::buckets::bucket_values() } else { n }.max(1);
        let own = layout.blocks[layout.rank].clone();
        let params = self.model.params();
        let src: Vec<Tensor> = params.iter().map(|(_, p)| p.shallow_clone()).collect();
        // The host's values, which the allgather below writes (staged gradients' device
        // buffer is not the parameters').
        let flat = self.grads.host_grads();
        for start in (0..n).step_by(window) {
            let range = start..(start + window).min(n);
            let mine = own.start.clamp(range.start, range.end)..own.end.clamp(range.start, range.end);
            let buf = self.grads.as_mut_slice();
            flat_values(&src, params, mine.clone(), &mut buf[mine])?;
            let blocks = super::buckets::within(&layout.blocks, range.clone());
            reduce.allgather_blocks(&mut buf[range.clone()], &blocks, step)?;
            // Each parameter's part copied from the host buffer to its device: no
            // model-sized temporary there.
            tch::no_grad(|| -> Result<(), TrainerError> {
                for piece in pieces(params, range.clone()) {
                    let len = piece.range.len() as i64;
                    let p = &params[piece.index].1;
                    let at = (piece.range.start - piece.offset) as i64;
                    p.view([-1]).narrow(0, at, len).f_copy_(&flat.narrow(
                        0,
                        piece.range.start as i64,
                        len,
                    ))?;
                }
                Ok(())
            })?;
            if give_back {
                grads::release(&mut self.grads.as_mut_slice()[range]);
            }
        }
        Ok(())
    }
}

/// Gives back the parts of `values` (the gradients at `at..` of the flat order) outside the
/// blocks `layout` gives this rank: reduced, they are other ranks' to use.
pub(super) fn release_unheld(layout: &ShardLayout, values: &mut [f32], at: usize) {
    let held = layout.held();
    let span = at..at + values.len();
    // Adjacent blocks this rank does not hold are given back as one run, so that pages
    // across their boundary go too.
    let mut run: Option<Range<usize>> = None;
    for (b, block) in layout.blocks.iter().enumerate() {
        let lo = block.start.clamp(span.start, span.end);
        let hi = block.end.clamp(span.start, span.end);
        if lo == hi {
            continue;
        }
        if held.contains(&b) {
            if let Some(r) = run.take() {
                grads::release(&mut values[r.start - at..r.end - at]);
            }
        } else {
            run = Some(run.map_or(lo..hi, |r| r.start..hi));
        }
    }
    if let Some(r) = run {
        grads::release(&mut values[r.start - at..r.end - at]);
    }
}

/// Parameter-shaped tensors on `device` from a flat vector in parameter order, each made
/// from its own part of `all`: no model-sized flat tensor on the device beside them (nor on
/// the host), only one parameter's host copy at a time.
fn unflatten(all: &[f32], params: &[(String, Tensor)], device: Device) -> Vec<Tensor> {
    let mut at = 0usize;
    params
        .iter()
        .map(|(_, p)| {
            let part = &all[at..at + p.numel()];
            at += p.numel();
            Tensor::from_slice(part).view(p.size().as_slice()).to_device(device)
        })
        .collect()
}

/// The held blocks of the reduce-scattered gradient in `t`'s buffer averaged (multiplied by
/// `inv`), and the sum of the squares of this rank's own block: on the host buffer, or, when
/// `staged`, on the device's, once the host's sums are copied there in one copy (what
/// [`Trainer::apply_held`] then clips and updates from, on the device).
fn sum_of_squares_held(
    t: &mut Trainer,
    layout: &ShardLayout,
    inv: f32,
    staged: bool,
) -> Result<f64, TrainerError> {
    let own = layout.blocks[layout.rank].clone();
    if staged {
        let g = t.grads.grads()?;
        for b in layout.held() {
            let r = &layout.blocks[b];
            let _ = g.f_narrow(0, r.start as i64, r.len() as i64)?.f_mul_scalar_(f64::from(inv))?;
        }
        return Ok(crate::optim::device_sum_of_squares(&g.f_narrow(
            0,
            own.start as i64,
            own.len() as i64,
        )?)?);
    }
    let buf = t.grads.as_mut_slice();
    for b in layout.held() {
        buf[layout.blocks[b].clone()].iter_mut().for_each(|g| *g *= inv);
    }
    Ok(sum_of_squares(&buf[own]))
}

#[cfg(test)]
mod tests;
