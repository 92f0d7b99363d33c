//! A data-parallel step whose reduction overlaps its backward, as DDP's buckets do: backward
//! runs one block at a time from the head ([`Model::loss_backward_by_blocks`]), and as soon as
//! the gradients at the end of the flat buffer are whole they are handed, a bucket at a time,
//! to a thread that sums them over the ranks while backward goes on with the blocks before.
//! On a device each bucket's gradients are copied to the host buffer when it is handed over,
//! not after backward. The buckets are fixed by the model alone (every rank reduces the same
//! ranges in the same order), and the three scalars at the buffer's end go last. With
//! sharded optimizer state each bucket is reduce-scattered instead (each rank's block of it
//! to its owner and replicas), which sums every value in the ring order the whole buffer's
//! reduce-scatter would: the same bits.

use super::buckets::{bucket_values, within};
use super::{StepStats, Trainer};
use crate::device::Ready;
use crate::model::Model;
use crate::{Reduce, TrainerError};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};

/// How an overlapped step's buckets met its backward, counted as it runs: the buckets
/// backward handed over, and of those the ones handed over while the reducing thread was
/// inside the sum of an earlier one. That is the overlap itself (backward of bucket k + 1
/// while bucket k is summed, as DDP's buckets); none when every sum came after backward.
#[derive(Debug)]
pub struct OverlapProbe {
    /// The step watched (`u64::MAX`: none yet).
    step: AtomicU64,
    /// The last step watched to its end (`u64::MAX`: none): a step that failed is not one.
    finished: AtomicU64,
    summing: AtomicBool,
    handed: AtomicUsize,
    during_sum: AtomicUsize,
}

impl Default for OverlapProbe {
    fn default() -> Self {
        OverlapProbe {
            step: AtomicU64::new(u64::MAX),
            finished: AtomicU64::new(u64::MAX),
            summing: AtomicBool::new(false),
            handed: AtomicUsize::new(0),
            during_sum: AtomicUsize::new(0),
        }
    }
}

impl OverlapProbe {
    /// Buckets handed over so far in the step watched.
    pub fn handed(&self) -> usize {
        self.handed.load(Ordering::SeqCst)
    }

    /// Of those, the ones handed over while an earlier bucket was being summed.
    pub fn during_sum(&self) -> usize {
        self.during_sum.load(Ordering::SeqCst)
    }

    /// `(during_sum, handed)` if the last step watched to its end is `step` (a step that
    /// failed and was trained again another way is not).
    pub fn of_step(&self, step: u64) -> Option<(usize, usize)> {
        (self.finished.load(Ordering::SeqCst) == step).then(|| (self.during_sum(), self.handed()))
    }

    fn start(&self, step: u64) {
        self.finished.store(u64::MAX, Ordering::SeqCst);
        self.summing.store(false, Ordering::SeqCst);
        self.handed.store(0, Ordering::SeqCst);
        self.during_sum.store(0, Ordering::SeqCst);
        self.step.store(step, Ordering::SeqCst);
    }

    /// A bucket about to be handed over (before it is sent, so a sum already running is an
    /// earlier bucket's).
    fn hand_over(&self) {
        if self.summing.load(Ordering::SeqCst) {
            self.during_sum.fetch_add(1, Ordering::SeqCst);
        }
        self.handed.fetch_add(1, Ordering::SeqCst);
    }
}

/// The ranges of the flat gradient buffer to reduce after each block's backward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Buckets {
    /// The model's first block.
    first: usize,
    /// For each block (from `first`), what becomes reducible once its backward has ended.
    after: Vec<Vec<Range<usize>>>,
}

impl Buckets {
    /// The buckets of `model`'s parameters, at most about `cap` values each (a block larger
    /// than `cap` is one bucket). Backward ends the blocks from the last; a range is handed
    /// over only when every parameter from it to the buffer's end is whole, so the buckets
    /// tile the buffer from its end, whatever order the parameters are stored in.
    pub(crate) fn new(model: &Model, cap: usize) -> Buckets {
        let blocks = model.blocks();
        let block_of = |name: &str| {
            blocks.clone().find(|i| name.starts_with(&format!("b{i:02}."))).unwrap_or(blocks.start)
        };
        let params: Vec<(usize, usize)> =
            model.params().iter().map(|(name, p)| (block_of(name), p.numel())).collect();
        let n: usize = params.iter().map(|&(_, len)| len).sum();
        let mut after = vec![Vec::new(); blocks.len()];
        let mut whole = vec![false; params.len()];
        // Parameters [next, len) are whole; values [frontier, sent) are whole but not sent.
        let (mut next, mut frontier, mut sent) = (params.len(), n, n);
        for b in blocks.clone().rev() {
            for (i, &(block, _)) in params.iter().enumerate() {
                whole[i] |= block == b;
            }
            while next > 0 && whole[next - 1] {
                next -= 1;
                frontier -= params[next].1;
            }
            if sent - frontier >= cap.max(1) || (b == blocks.start && sent > frontier) {
                after[b - blocks.start].push(frontier..sent);
                sent = frontier;
            }
        }
        debug_assert_eq!(sent, 0, "every parameter belongs to a block");
        Buckets { first: blocks.start, after }
    }

    /// What to hand over once block `b`'s backward has ended.
    fn after(&self, b: usize) -> &[Range<usize>] {
        &self.after[b - self.first]
    }

    /// Every bucket, in the order they are reduced.
    pub(crate) fn in_order(&self) -> impl Iterator<Item = &Range<usize>> {
        self.after.iter().rev().flatten()
    }
}

impl Trainer {
    /// Whether a step of this trainer in a group of `world` ranks overlaps its reduction
    /// with backward: a data-parallel step in floats (whole or sharded state), of a model
    /// whose backward splits by blocks, unless the job turned it off (`overlap = false`).
    /// Alone, there is nothing to overlap.
    pub fn overlaps(&self, world: usize) -> bool {
        world > 1
            && !self.job.reduce_after_backward
            && !self.job.reproducible
            && self.model.splits_backward(self.job.memory_plan())
    }

    /// One data-parallel step with the reduction overlapping backward (see the module): this
    /// rank's share, summed over the ranks by `reduce` a bucket at a time, then applied. What
    /// [`Trainer::compute_grads`], an allreduce of the buffer and
    /// [`Trainer::apply_reduced`] do, but for the ring's summation order within buckets
    /// (rounding only). A failed reduction leaves the state as it was.
    pub fn overlapped_step(
        &mut self,
        rank: usize,
        world: usize,
        reduce: &mut (dyn Reduce + Send),
    ) -> Result<StepStats, TrainerError> {
        if !self.overlaps(world) {
            // Every rank decides alike from the job and the model; a rank that would reduce
            // another way must not start sending buckets its peers do not expect.
            return Err(TrainerError::Config(
                "this step cannot overlap its reduction (see Trainer::overlaps)".into(),
            ));
        }
        let started = std::time::Instant::now();
        let step = self.step;
        let layout = match self.shard.is_some() {
            true => Some(self.step_layout(rank, world, &reduce.host_counts(world))?),
            false => None,
        };
        if let Some(s) = self.shard.as_mut() {
            s.pending = None;
        }
        let buckets = Buckets::new(&self.model, bucket_values());
        let probe = Arc::clone(&self.overlap);
        probe.start(step);
        self.grads.zero(self.model.params(), self.shards_gradients())?;
        let share = self.plan.share_in(rank, world, &self.shares);
        let positions = self.cursor + share.start as u64..self.cursor + share.end as u64;
        let micro: Vec<Range<u64>> = self.plan.micro_batches(positions.clone()).collect();
        let step_seed = self.peek_step_seed();
        let count = (positions.end - positions.start) as f64;
        let raw = self.grads.raw();
        let end = raw.len();
        let (tx, rx) = mpsc::channel::<(Range<usize>, Ready)>();
        let sharded = layout.as_ref();
        let give_back = self.shards_gradients();
        let bf16 = self.lossy_values() > 0;
        // Staged gradients that the reduce sums where they lie: buckets are handed over on
        // the device, and only the lanes' chunks cross the host (see `local/on_device.rs`).
        let on_device = match self.grads.staged() {
            Some(t) if layout.is_none() && reduce.sums_on_device() => Some(t.shallow_clone()),
            _ => None,
        };
        let staging = on_device.is_none();
        let sums: &mut (dyn Reduce + Send) = &mut *reduce;
        let pool = self.bucket_thread()?;
        let mut reduced = None;
        let slot = &mut reduced;
        let computed = pool.in_place_scope(|s| {
            // Moved in, so that a panic of backward drops it and the summing task ends.
            let tx = tx;
            s.spawn(move |_| {
                let summed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(
                    move || -> Result<(), TrainerError> {
                        // The squared norm of this rank's own gradient, bucket by bucket before
                        // each is summed; it goes into the scalars, which end the last bucket.
                        let mut sq = 0.0f64;
                        // Staged on the devices: summed there and read once, at the last
                        // bucket (a read waits for the device's queued work).
                        let mut sq_on_device: Option<tch::Tensor> = None;
                        for (range, ready) in rx {
                            // A staged bucket's copy to the host, on the device's side stream.
                            ready.wait()?;
                            probe.summing.store(true, Ordering::SeqCst);
                            let last = range.end == end;
                            // SAFETY: a range arrives here once its gradients are final; the
                            // compute side never touches it again before the scope ends.
                            #[allow(unsafe_code)]
                            let values = unsafe { raw.region(range.clone()) };
                            let grads = if last { values.len() - 3 } else { values.len() };
                            let dev = match &on_device {
                                Some(t) => Some(t.f_narrow(0, range.start as i64, grads as i64)?),
                                None => None,
                            };
                            match &dev {
                                Some(d) => {
                                    let here = crate::optim::device_squares(d)?;
                                    sq_on_device = Some(match sq_on_device.take() {
                                        Some(s) => s.f_add(&here)?,
                                        None => here,
                                    });
                                }
                                None => {
                                    sq += values[..grads]
                                        .iter()
                                        .map(|&g| f64::from(g) * f64::from(g))
                                        .sum::<f64>()
                                }
                            }
                            if last {
                                if let Some(s) = sq_on_device.take() {
                                    sq += s.f_double_value(&[])?;
                                }
                                let count = f64::from(values[grads + 1]);
                                values[grads + 2] =
                                    if count > 0.0 { (sq / (count * count)) as f32 } else { 0.0 };
                            }
                            // A bucket's gradients in the job's format; the scalars in f32.
                            let lossy = if bf16 { grads } else { 0 };
                            match sharded {
                                None => match &dev {
                                    Some(d) => sums.allreduce_sum_on_device(d, values, lossy, step)?,
                                    None => sums.allreduce_sum_bf16(values, lossy, step)?,
                                },
                                Some(l) => {
                                    let (g, scalars) = values.split_at_mut(grads);
                                    if !g.is_empty() {
                                        let blocks = within(l.blocks(), range.start..range.start + grads);
                                        sums.reduce_scatter_sum_bf16(g, &blocks, l.replicas(), lossy, step)?;
                                        if give_back {
                                            super::shard::release_unheld(l, g, range.start);
                                        }
                                    }
                                    if last {
                                        sums.allreduce_sum(scalars, step)?;
                                    }
                                }
                            }
                            probe.summing.store(false, Ordering::SeqCst);
                        }
                        Ok(())
                    },
                ));
                // A panic of the summing task is a bug here, not a peer's fault: not a
                // failed collective.
                *slot = Some(summed.unwrap_or_else(|_| {
                    Err(TrainerError::Config("the bucket-reducing thread panicked".into()))
                }));
            });
            let computed = self.backward_in_buckets(&micro, step_seed, &buckets, &tx, count, staging);
            if computed.is_ok() {
                self.compute_ms = started.elapsed().as_secs_f64() * 1e3;
            }
            drop(tx);
            computed
        });
        let reduced = reduced.expect("the scope ran the summing task");
        computed?;
        reduced?;
        self.overlap.finished.store(step, Ordering::SeqCst);
        if let Some(l) = &layout {
            return self.finish_sharded(l, step, reduce);
        }
        super::mode::summed(self.apply_sums(!staging))
    }

    /// What watches this trainer's overlapped steps (see [`OverlapProbe`]): the same probe
    /// from step to step, so it may be read while a step runs.
    pub fn overlap_probe(&self) -> Arc<OverlapProbe> {
        Arc::clone(&self.overlap)
    }

    /// The thread buckets are summed on, made at the first overlapped step and kept: a
    /// thread made each step paid its first use's costs each step.
    fn bucket_thread(&mut self) -> Result<std::sync::Arc<rayon::ThreadPool>, TrainerError> {
        if let Some(pool) = &self.bucket_thread {
            return Ok(std::sync::Arc::clone(pool));
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .thread_name(|_| "limpet-bucket-reduce".into())
            .build()
            .map_err(|e| TrainerError::Config(format!("could not start the reducing thread: {e}")))?;
        Ok(std::sync::Arc::clone(self.bucket_thread.insert(std::sync::Arc::new(pool))))
    }

    /// This rank's forward and backward over its micro-batches, the last one block by block,
    /// sending each bucket to the reducing thread once its gradients are final (all of them
    /// in order when this rank has no samples), then the three scalars (the loss sum, the
    /// sample count, and the squared norm that the reducing thread fills in). A model of one
    /// bucket sends it with the scalars, as one range: one sum a step. Staged gradients
    /// cross to the host buffer as their bucket is handed over only when `staging`.
    fn backward_in_buckets(
        &mut self,
        micro: &[Range<u64>],
        step_seed: u64,
        buckets: &Buckets,
        tx: &mpsc::Sender<(Range<usize>, Ready)>,
        count: f64,
        staging: bool,
    ) -> Result<(), TrainerError> {
        let n = self.grads.grads_len();
        // One bucket: it and the scalars after it are summed as one range. Several: the
        // bucket that starts the buffer is not next to the scalars, and goes on its own.
        let one = buckets.in_order().count() <= 1;
        // A job that shards its gradients keeps no device gradient once it is in the buffer.
        let forget = self.shards_gradients();
        let probe = Arc::clone(&self.overlap);
        let hand_over = |model: &Model, grads: &mut super::grads::GradBuffer, range: &Range<usize>| {
            let ready = match staging {
                true => grads.collect_range(model.params(), range, forget)?,
                false => Ready::done(),
            };
            if !one || range.end < n {
                probe.hand_over();
                // A send fails only when the reducing thread has stopped on an error, which
                // its join reports.
                let _ = tx.send((range.clone(), ready));
            } else {
                // Sent with the scalars below.
                ready.wait()?;
            }
            Ok::<(), TrainerError>(())
        };
        let mut loss_sum = 0.0;
        let plan = self.job.memory_plan();
        for (k, mb) in micro.iter().enumerate() {
            self.seed_micro_batch(step_seed, mb.start, k);
            let idx = self.sampler.indices(mb.clone());
            let (x, y) = self.batch_on_device(&idx)?;
            loss_sum += if k + 1 < micro.len() {
                self.model.loss_backward(&x, &y, plan)?
            } else {
                let (model, grads) = (&self.model, &mut self.grads);
                model.loss_backward_by_blocks(&x, &y, plan, &mut |b| {
                    buckets.after(b).iter().try_for_each(|r| hand_over(model, grads, r))
                })?
            };
        }
        if micro.is_empty() {
            // A rank with no samples still takes part in every bucket's sum.
            for r in buckets.in_order() {
                hand_over(&self.model, &mut self.grads, r)?;
            }
        }
        let mine = self.grads.raw();
        // SAFETY: the first bucket and the scalars have not been sent: nobody else's yet.
        #[allow(unsafe_code)]
        let scalars = unsafe { mine.region(n..n + 3) };
        scalars[0] = loss_sum as f32;
        scalars[1] = count as f32;
        let _ = tx.send((if one { 0..n + 3 } else { n..n + 3 }, Ready::done()));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelSpec;
    use crate::train::buckets::{set_bucket_values, BUCKET_VALUES};
    use crate::train::grads::Bind;
    use crate::train::tests::{char_data, job, synthetic};
    use crate::{JobSpec, LocalGroup, ModelKind};
    use tch::Tensor;

    fn tied(mut j: JobSpec) -> JobSpec {
        if let ModelSpec::Llama(l) = &mut j.model {
            l.tie_embeddings = true;
        }
        j
    }

    /// Each block's gradients are final when the block is handed over (later blocks add
    /// nothing to them), the blocks come from the last, and the gradients are those of one
    /// backward pass: the same bits, but for a tied embedding (rounding).
    #[test]
    fn each_block_hands_over_its_final_gradients() {
        let chars = char_data();
        let mut cases = vec![
            (job(ModelKind::Llama, &chars, 8, 8), true),
            (tied(job(ModelKind::Llama, &chars, 8, 8)), false),
            (JobSpec { activation_checkpointing: true, ..job(ModelKind::Llama, &chars, 8, 8) }, true),
            (JobSpec { loss_chunk: Some(5), ..job(ModelKind::Llama, &chars, 8, 8) }, true),
            (job(ModelKind::Gpt, &chars, 8, 8), true),
        ];
        let digits = synthetic();
        cases.push((job(ModelKind::Mlp, &digits, 8, 8), true));
        for (j, exact) in cases {
            let data = if matches!(j.model, ModelSpec::Mlp { .. }) {
                digits.shallow_clone()
            } else {
                chars.shallow_clone()
            };
            let mut t = Trainer::try_new(j.clone(), data).unwrap();
            let idx = t.sampler.indices(0..8);
            let (x, y) = t.batch_on_device(&idx).unwrap();
            let plan = j.memory_plan();
            assert!(t.model.splits_backward(plan));
            let blocks = t.model.blocks();
            let mut seen = Vec::new();
            let mut snaps: Vec<(String, Tensor)> = Vec::new();
            t.grads.zero(t.model.params(), false).unwrap();
            let loss = t
                .model
                .loss_backward_by_blocks(&x, &y, plan, &mut |b| {
                    seen.push(b);
                    for (name, p) in t.model.block_params(b) {
                        snaps.push((name, p.grad().copy()));
                    }
                    Ok(())
                })
                .unwrap();
            assert_eq!(seen, blocks.clone().rev().collect::<Vec<_>>(), "{:?}", j.model);
            let params: std::collections::BTreeMap<&String, &Tensor> =
                t.model.params().iter().map(|(n, p)| (n, p)).collect();
            for (name, at_hand_over) in &snaps {
                assert!(at_hand_over.equal(&params[name].grad()), "{name} changed after it was handed over");
            }
            let split = t.grads.as_mut_slice().to_vec();
            t.grads.zero(t.model.params(), false).unwrap();
            let whole_loss = t.model.loss_backward(&x, &y, plan).unwrap();
            let whole = t.grads.as_mut_slice().to_vec();
            assert_eq!(loss.to_bits(), whole_loss.to_bits());
            if exact {
                assert!(split == whole, "{:?}: the split backward changed a gradient", j.model);
            } else {
                let (a, b) = (Tensor::from_slice(&split), Tensor::from_slice(&whole));
                assert!(a.allclose(&b, 1e-5, 1e-7, false), "a tied embedding's gradient moved");
            }
        }
    }

    /// The buckets tile the buffer from its end, each handed over after a block whose
    /// backward ends every parameter in it, and a cap cuts them no larger than a block.
    #[test]
    fn buckets_tile_the_buffer_from_its_end() {
        let chars = char_data();
        for cap in [1, 20_000, BUCKET_VALUES] {
            let t =
                Trainer::try_new(tied(job(ModelKind::Llama, &chars, 8, 8)), chars.shallow_clone()).unwrap();
            let b = Buckets::new(&t.model, cap);
            let order: Vec<Range<usize>> = b.in_order().cloned().collect();
            let n = t.model.num_elements();
            assert_eq!(order.first().map(|r| r.end), Some(n));
            assert_eq!(order.last().map(|r| r.start), Some(0));
            assert!(order.windows(2).all(|w| w[1].end == w[0].start && w[0].start < w[0].end));
            // Each parameter lies in a bucket handed over no earlier than its block's end.
            let mut offset = 0;
            for (name, p) in t.model.params() {
                let block: usize = name[1..3].parse().unwrap();
                let at = t.model.blocks().find(|&k| b.after(k).iter().any(|r| r.contains(&offset)));
                assert!(
                    at.is_some_and(|k| k <= block),
                    "{name} at {offset} handed over before block {block} ended"
                );
                offset += p.numel();
            }
            if cap == 1 {
                assert_eq!(order.len(), t.model.blocks().len(), "a bucket per block");
            }
            if cap == BUCKET_VALUES {
                assert_eq!(order.len(), 1, "a small model is one bucket");
            }
        }
    }

    type Outcome = (Vec<f64>, Vec<String>, Vec<usize>, Vec<Tensor>);
    /// A sum's input and output on one rank.
    type Sum = (Vec<f32>, Vec<f32>);

    /// A reduce that records the length of every sum it is asked for.
    struct Counting<'a> {
        inner: crate::LocalRank<'a>,
        lens: Vec<usize>,
        io: Vec<Sum>,
    }

    impl Reduce for Counting<'_> {
        fn allreduce_sum(&mut self, buf: &mut [f32], step: u64) -> Result<(), TrainerError> {
            self.lens.push(buf.len());
            let before = buf.to_vec();
            let r = self.inner.allreduce_sum(buf, step);
            self.io.push((before, buf.to_vec()));
            r
        }
    }

    /// Two ranks (a host's local ranks: real threads, real sums; two, because a sum of two
    /// does not depend on which rank adds first) for `steps` steps; the losses, every rank's
    /// content hash, the lengths rank 0 summed and its parameters.
    fn three(j: &JobSpec, shares: &[u64], steps: usize, bind: Bind) -> Outcome {
        three_cap(j, shares, steps, bind, 20_000)
    }

    fn three_cap(j: &JobSpec, shares: &[u64], steps: usize, bind: Bind, cap: usize) -> Outcome {
        let data = char_data();
        let mut ranks: Vec<Trainer> =
            (0..2).map(|_| Trainer::try_new(j.clone(), data.shallow_clone()).unwrap()).collect();
        if bind != Bind::Views {
            // What a GPU host runs: gradients reaching the host buffer bucket by bucket.
            for t in &mut ranks {
                t.grads = crate::train::grads::GradBuffer::with_binding(t.model.params(), bind).unwrap();
            }
        }
        let mut losses = Vec::new();
        let mut lens = Vec::new();
        for _ in 0..steps {
            let group = LocalGroup::new(2);
            let out: Vec<(f64, Vec<usize>, Vec<Sum>)> = std::thread::scope(|s| {
                let handles: Vec<_> = ranks
                    .iter_mut()
                    .enumerate()
                    .map(|(i, t)| {
                        let group = &group;
                        s.spawn(move || {
                            set_bucket_values(cap);
                            t.set_shares(shares.to_vec());
                            let mut r =
                                Counting { inner: group.rank(i, None), lens: Vec::new(), io: Vec::new() };
                            let loss = t.train_step(i, 2, &mut r).unwrap().loss;
                            let io = r.io;
                            (loss, r.lens, io)
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            assert!(out.iter().all(|(l, _, _)| l.to_bits() == out[0].0.to_bits()));
            // Every sum is the two ranks' inputs added, and both ranks receive it.
            for ((i0, o0), (i1, o1)) in out[0].2.iter().zip(&out[1].2) {
                assert!(i0
                    .iter()
                    .zip(i1)
                    .zip(o0.iter().zip(o1))
                    .all(|((a, b), (s, t))| (a + b).to_bits() == s.to_bits() && s.to_bits() == t.to_bits()));
            }
            losses.push(out[0].0);
            lens.extend(out[0].1.iter().copied());
        }
        let hashes = ranks.iter().map(|t| t.content_hash().unwrap()).collect();
        let params = ranks[0].model.params().iter().map(|(_, p)| p.detach().copy()).collect();
        (losses, hashes, lens, params)
    }

    /// Reducing bucket by bucket while backward runs computes the step of reducing after it
    /// (bit for bit with two ranks; every sum is checked to be the ranks' inputs added),
    /// every rank ends with the same bits, a rank with no samples takes
    /// part in every bucket, the buckets really are several, and the device path (each
    /// bucket copied to the host as it is handed over) computes the same bits.
    #[test]
    fn overlapped_steps_match_the_step_after_backward() {
        let chars = char_data();
        let j = job(ModelKind::Llama, &chars, 12, 2);
        let after = JobSpec { reduce_after_backward: true, ..j.clone() };
        for shares in [vec![5, 7], vec![0, 12]] {
            let (l, hashes, lens, params) = three(&j, &shares, 4, Bind::Views);
            // One bucket: the one sum of the whole buffer, the same bits as after backward.
            let (lx, _, lensx, px) = three_cap(&j, &shares, 4, Bind::Views, BUCKET_VALUES);
            assert_eq!(
                lensx,
                vec![Trainer::try_new(j.clone(), chars.shallow_clone()).unwrap().buffer_len(); 4]
            );
            let (l2, hashes2, lens2, params2) = three(&after, &shares, 4, Bind::Views);
            let (l3, hashes3, lens3, _) = three(&j, &shares, 4, Bind::Copied);
            assert_eq!((&l3, &hashes3, &lens3), (&l, &hashes, &lens), "the device path reduced other bits");
            let (l4, hashes4, lens4, _) = three(&j, &shares, 4, Bind::Staged(tch::Device::Cpu));
            assert_eq!((&l4, &hashes4, &lens4), (&l, &hashes, &lens), "the staged path reduced other bits");
            assert!(hashes.iter().all(|h| h == &hashes[0]) && hashes2.iter().all(|h| h == &hashes2[0]));
            // A sum of two does not depend on the order it is taken in, and the gradients
            // are one backward pass's: buckets or not, the same bits (with more ranks, the
            // ring's order within each bucket rounds differently).
            assert_eq!((&l, &lx), (&l2, &l2), "losses moved apart");
            assert!(params.iter().zip(&params2).all(|(a, b)| a.equal(b)), "parameters moved apart");
            assert!(px.iter().zip(&params2).all(|(a, b)| a.equal(b)), "one bucket moved apart");
            let n = Trainer::try_new(j.clone(), chars.shallow_clone()).unwrap().buffer_len();
            assert_eq!(lens2, vec![n; 4], "one sum of the whole buffer a step");
            let per_step = lens.len() / 4;
            assert!(per_step >= 3, "{per_step} buckets a step");
            assert_eq!(lens.iter().sum::<usize>(), 4 * n);
        }
    }

    /// A reduce whose first sum returns only once backward has handed over another bucket
    /// (or fails after 30 s): a step through it finishes only if backward goes on while a
    /// bucket is being summed. Sums nothing (its rank computes the whole batch).
    struct Stalling {
        probe: std::sync::Arc<OverlapProbe>,
        calls: usize,
    }

    impl Reduce for Stalling {
        fn allreduce_sum(&mut self, _: &mut [f32], _: u64) -> Result<(), TrainerError> {
            self.calls += 1;
            let until = std::time::Instant::now() + std::time::Duration::from_secs(30);
            while self.calls == 1 && self.probe.handed() < 2 {
                if std::time::Instant::now() > until {
                    return Err(TrainerError::reduce(
                        "backward handed over no bucket while the first was summed",
                    ));
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            Ok(())
        }
    }

    /// The reduction overlaps backward, checked without timing: the first bucket's sum waits
    /// for backward to hand over the next one, so the step ends only if backward goes on while
    /// a bucket is summed (summing after backward would hand every bucket over first, and the
    /// probe would count none during a sum; summing on backward's thread would wait out the
    /// 30 s and fail),
    /// and the probe counts the buckets handed over during a sum. A job that reduces after
    /// backward hands over none.
    #[test]
    fn backward_goes_on_while_a_bucket_is_summed() {
        let chars = char_data();
        let j = job(ModelKind::Llama, &chars, 12, 2);
        set_bucket_values(20_000);
        let mut t = Trainer::try_new(j.clone(), chars.shallow_clone()).unwrap();
        // Rank 0 of 2 computes the whole batch, so a sum that adds nothing is the group's.
        t.set_shares(vec![12, 0]);
        let probe = t.overlap_probe();
        for _ in 0..2 {
            let mut r = Stalling { probe: std::sync::Arc::clone(&probe), calls: 0 };
            let step = t.step();
            t.train_step(0, 2, &mut r).unwrap();
            let (during, handed) = probe.of_step(step).unwrap();
            assert!(r.calls >= 3 && handed + 1 == r.calls, "{} sums for {handed} buckets", r.calls);
            assert!((1..handed).contains(&during), "{during} of {handed} buckets handed over during a sum");
        }
        let mut after = Trainer::try_new(JobSpec { reduce_after_backward: true, ..j }, chars).unwrap();
        after.set_shares(vec![12, 0]);
        let step = after.step();
        after.train_step(0, 2, &mut crate::NoReduce).unwrap();
        assert_eq!(after.overlap_probe().of_step(step), None, "a step after backward is not watched");
    }

    /// Two local ranks' sharded collectives in one process: a reduce-scatter sums the whole
    /// range (each rank then has its blocks summed, as the contract asks, and the rest too),
    /// an allgather sums each rank's own block with zeros from the other. Records the length
    /// of every reduce-scatter.
    struct TwoShards<'a> {
        inner: crate::LocalRank<'a>,
        rank: usize,
        scattered: Vec<usize>,
    }

    impl Reduce for TwoShards<'_> {
        fn allreduce_sum(&mut self, buf: &mut [f32], step: u64) -> Result<(), TrainerError> {
            self.inner.allreduce_sum(buf, step)
        }

        fn reduce_scatter_sum(
            &mut self,
            buf: &mut [f32],
            blocks: &[Range<usize>],
            _: usize,
            step: u64,
        ) -> Result<(), TrainerError> {
            assert_eq!(blocks.len(), 2);
            assert!(blocks[0].start == 0 && blocks[0].end == blocks[1].start && blocks[1].end == buf.len());
            self.scattered.push(buf.len());
            self.inner.allreduce_sum(buf, step)
        }

        fn allgather_blocks(
            &mut self,
            buf: &mut [f32],
            blocks: &[Range<usize>],
            step: u64,
        ) -> Result<(), TrainerError> {
            let own = blocks[self.rank].clone();
            for (i, v) in buf.iter_mut().enumerate() {
                if !own.contains(&i) {
                    *v = 0.0;
                }
            }
            self.inner.allreduce_sum(buf, step)
        }
    }

    /// Sharded state (each rank holding only its own block) overlaps its reduction too: each
    /// bucket is reduce-scattered as backward ends it, and the steps are those of
    /// reduce-scattering after backward, bit for bit, with a rank given no samples as well;
    /// the buckets really are several, and they tile the gradient once a step.
    #[test]
    fn sharded_steps_overlap_and_match_the_step_after_backward() {
        let chars = char_data();
        let j = job(ModelKind::Llama, &chars, 12, 2);
        let run = |j: &JobSpec, shares: &[u64]| {
            let data = char_data();
            let mut ranks: Vec<Trainer> = (0..2)
                .map(|rank| {
                    let mut t = Trainer::try_new(j.clone(), data.shallow_clone()).unwrap();
                    let n = t.buffer_len() - 3;
                    t.shard_state(crate::ShardLayout::new(n, 2, rank, 0).unwrap()).unwrap();
                    t
                })
                .collect();
            let (mut losses, mut scattered) = (Vec::new(), Vec::new());
            for _ in 0..4 {
                let group = LocalGroup::new(2);
                let out: Vec<(u64, Vec<usize>)> = std::thread::scope(|s| {
                    let handles: Vec<_> = ranks
                        .iter_mut()
                        .enumerate()
                        .map(|(i, t)| {
                            let group = &group;
                            s.spawn(move || {
                                set_bucket_values(20_000);
                                t.set_shares(shares.to_vec());
                                let mut r =
                                    TwoShards { inner: group.rank(i, None), rank: i, scattered: Vec::new() };
                                assert_eq!(t.overlaps(2), !t.job.reduce_after_backward);
                                let loss = t.train_step(i, 2, &mut r).unwrap().loss;
                                (loss.to_bits(), r.scattered)
                            })
                        })
                        .collect();
                    handles.into_iter().map(|h| h.join().unwrap()).collect()
                });
                assert_eq!(out[0].0, out[1].0);
                losses.push(out[0].0);
                scattered.push(out[0].1.clone());
            }
            let params: Vec<Vec<u32>> = ranks
                .iter()
                .map(|t| {
                    t.model
                        .params()
                        .iter()
                        .flat_map(|(_, p)| {
                            let v = Vec::<f32>::try_from(p.detach().flatten(0, -1)).unwrap();
                            v.into_iter().map(f32::to_bits)
                        })
                        .collect()
                })
                .collect();
            (losses, scattered, params)
        };
        let after = JobSpec { reduce_after_backward: true, ..j.clone() };
        for shares in [vec![5, 7], vec![0, 12]] {
            let (l, scattered, p) = run(&j, &shares);
            let (l2, scattered2, p2) = run(&after, &shares);
            assert_eq!(l, l2, "losses moved apart");
            assert!(p == p2, "parameters moved apart");
            assert!(p[0] == p[1], "the ranks' parameters differ");
            let n = Trainer::try_new(j.clone(), chars.shallow_clone()).unwrap().buffer_len() - 3;
            assert!(scattered2.iter().all(|s| s == &vec![n]), "{scattered2:?}");
            for s in &scattered {
                assert!(s.len() >= 3, "{} buckets a step", s.len());
                assert_eq!(s.iter().sum::<usize>(), n);
            }
        }
    }
}
