//! Reproducible steps (`JobSpec::reproducible`): the same bits whatever the world size, the
//! transitions or the restarts. The job's micro-batch is part of the job: it changes the bits
//! only where it is smaller than a shard, whose count it then raises.
//!
//! An ordinary step sums gradients in f32 in an order that depends on how the batch was cut
//! (micro-batches, ranks, the ring), so two runs agree only up to rounding. Here:
//!
//! 1. Each step's global batch is cut into canonical shards ([`SHARDS`] unless the job says,
//!    more where a shard would exceed the job's micro-batch: [`shard_count`]) whose bounds
//!    depend only on the job; a shard's gradient is one forward and backward over exactly
//!    its samples, so it is the same bits on whichever rank computes it (same binary, same
//!    intra-op threads). Ranks take whole shards.
//! 2. Every tensor has an exponent for the step, predicted from the previous step's shards
//!    (part of the state, so every rank and every resume predicts the same).
//! 3. Each shard's gradient is rounded to fixed point, [`FRACTION_BITS`](fixed::FRACTION_BITS)
//!    bits below that exponent, as soon as its backward ends, and the shards are summed as
//!    i64: integer addition does not care about order, so the ring's sum is the same as one
//!    process's.
//!    The same sum counts the shards that did not fit the prediction (a value too large, or
//!    every value too small for full precision); if any did, every rank knows it from the
//!    sum, and the step is computed again at the exact maximum over all shards, agreed by
//!    one more collective. So is a step without a prediction (the first).
//! 4. The sum goes back to f32 once, and clipping and the optimizer run on identical inputs.
//!
//! The loss is summed the same way, so per-step losses are identical too. Costs: a backward
//! per shard instead of per micro-batch, one pass over each shard's gradient, and an i64
//! (twice the f32) allreduce.

mod fixed;

pub(super) use fixed::EXP_RANGE;
pub use fixed::{MAX_SHARDS, SHARDS};

use super::Trainer;
use crate::{Reduce, StepStats, TrainerError};
use fixed::{
    dequantize, exp_bits_f32, exp_f64, fitted, non_finite, predict, quantize, quantize_into,
    quantize_pair_into, scale, shard, shards_of, top_bits, Seen, ZERO_EXP,
};
use limpet_snapshot::{Dtype, RawTensor, StateImage};
use std::ops::Range;

/// How many canonical shards a step of `global_batch` samples is cut into: the job's
/// `shards` (default [`SHARDS`]), more where a shard would exceed the job's micro-batch (a
/// shard is one forward and backward, so a job sized to fit its micro-batch in device memory
/// fits its shards too), at most one a sample and [`MAX_SHARDS`]. It depends on the job alone,
/// never on the world, so every world cuts the same shards.
pub(crate) fn shard_count(shards: Option<usize>, global_batch: usize, micro_batch: usize) -> usize {
    let fit = global_batch.div_ceil(micro_batch.max(1));
    shards.unwrap_or(SHARDS).max(fit).clamp(1, global_batch.min(MAX_SHARDS))
}

/// The image tensor holding a reproducible job's predicted exponents.
pub const EXPONENTS: &str = "exact/exponents";

impl Trainer {
    /// One reproducible step: this rank's shards at the predicted exponents, their
    /// fixed-point sum through `reduce` (and, when a shard did not fit, the exact maxima and
    /// the shards again), then the update. Every rank of any world applies the same bits.
    pub fn exact_step(
        &mut self,
        rank: usize,
        world: usize,
        reduce: &mut dyn Reduce,
    ) -> Result<StepStats, TrainerError> {
        // Sharded state: the same fixed-point sum of the whole gradient, then each rank
        // updates the blocks it holds and the parameters are gathered (`apply_exact_sharded`).
        let sharded = match &self.shard {
            Some(_) => {
                // Stale parameters (a step broke after its update) wait for a regroup.
                self.usable_shard()?;
                self.shard_layout().cloned()
            }
            None => None,
        };
        if let Some(l) = sharded.as_ref().filter(|l| (l.rank(), l.world()) != (rank, world)) {
            return Err(TrainerError::Config(format!(
                "a step as rank {rank} of {world} with state sharded for rank {} of {}",
                l.rank(),
                l.world()
            )));
        }
        let started = std::time::Instant::now();
        let step = self.step;
        self.exact_sum = None;
        let k = shard_count(self.job.shards, self.plan.global_batch, self.job.micro_batch);
        let mine = shards_of(k, rank, world);
        let n = self.grads.grads_len();
        let tensors = self.model.params().len() + 1;
        // The sum: the gradients, the loss, the sample count, then the misfits and tallies
        // (each pass writes all of it).
        let mut acc = std::mem::take(&mut self.exact_acc);
        acc.resize(n + 3 + 3 * tensors, 0);
        // The state changes only once the step is done: a step broken off by a transition
        // is computed again from the same prediction.
        let predicted = self.exact_exponents.clone().filter(|p| p.len() == tensors);
        let mut first = None;
        if let Some(p) = &predicted {
            let seen = self.shard_pass(mine.clone(), k, Some(p), &mut acc)?;
            seen.write(&mut acc[n + 2..]);
            reduce.allreduce_sum_i64(&mut acc, step)?;
            first = Some(seen);
        }
        let agreed = !(predicted.is_some() && fitted(&acc[n + 2..]));
        let exps = match predicted {
            Some(p) if !agreed => p,
            _ => {
                // The exact maximum over all shards, then the shards again at it: they fit.
                let mut top = match first {
                    Some(seen) => seen.top,
                    None => self.shard_pass(mine.clone(), k, None, &mut acc)?.top,
                };
                reduce.allreduce_max_i32(&mut top, step)?;
                // Honest ranks send exponents inside the range; a buggy or hostile one must
                // not make a scale overflow (every rank clamps the same maxima alike).
                for e in &mut top {
                    *e = (*e).clamp(*EXP_RANGE.start(), *EXP_RANGE.end());
                }
                let seen = self.shard_pass(mine, k, Some(&top), &mut acc)?;
                seen.write(&mut acc[n + 2..]);
                reduce.allreduce_sum_i64(&mut acc, step)?;
                top
            }
        };
        let next = self.dequantize_sum(&acc, &exps);
        self.compute_ms = started.elapsed().as_secs_f64() * 1e3;
        self.exact_acc = acc;
        // Until the next step begins, this rank can give the step's sum to a holder whose
        // part of it broke (`regroup`): a reproducible step is then finished, not lost.
        self.exact_sum = Some((step + 1, exps.clone()));
        let stats = match sharded {
            None => {
                let stats = self.apply_reduced()?;
                self.exact_exponents = Some(next);
                stats
            }
            Some(layout) => self.apply_exact_sharded(&layout, next, step, reduce)?,
        };
        Ok(StepStats { agreed, ..stats })
    }

    /// Writes the gradient, loss and sample count of the fixed-point sum `acc` (made at
    /// exponents `exps`) into the gradient buffer; returns the exponents it predicts for the
    /// next step.
    pub(super) fn dequantize_sum(&mut self, acc: &[i64], exps: &[i32]) -> Vec<i32> {
        let n = self.grads.grads_len();
        let next = predict(&acc[n + 2..], exps);
        let sizes: Vec<usize> = self.model.params().iter().map(|(_, p)| p.numel()).collect();
        let buf = self.grads.as_mut_slice();
        let mut at = 0;
        for (t, &len) in sizes.iter().enumerate() {
            // The inverse of a power of two is exact.
            let inv = 1.0 / scale(exps[t]);
            for (d, &q) in buf[at..at + len].iter_mut().zip(&acc[at..at + len]) {
                *d = dequantize(q, inv) as f32;
            }
            at += len;
        }
        buf[n] = dequantize(acc[n], 1.0 / scale(exps[sizes.len()])) as f32;
        buf[n + 1] = acc[n + 1] as f32;
        // AdaScale's statistic is per-rank: not part of a reproducible job.
        buf[n + 2] = 0.0;
        next
    }

    /// The step's fixed-point sum this rank applied and the exponents it was made at, when
    /// no step has begun since (a regroup gives them to a holder whose sum broke).
    pub(super) fn kept_sum(&self) -> Option<(&[i64], &[i32])> {
        let tensors = self.model.params().len() + 1;
        let len = self.grads.grads_len() + 3 + 3 * tensors;
        match &self.exact_sum {
            Some((at, exps)) if *at == self.step && self.exact_acc.len() == len && exps.len() == tensors => {
                Some((&self.exact_acc, exps))
            }
            _ => None,
        }
    }

    /// This rank's shards `mine` of `k`: each one's forward and backward, then (given
    /// exponents) `acc` made their sum in fixed point, with the loss at `acc[n]` and the
    /// samples at `acc[n + 1]`. On the CPU, two shards' gradients stand in two buffers in
    /// turn and are rounded into the sum in one pass over it (the pass is memory-bound: one
    /// read and write of the i64 sum for two shards instead of one).
    fn shard_pass(
        &mut self,
        mine: Range<usize>,
        k: usize,
        exps: Option<&[i32]>,
        acc: &mut [i64],
    ) -> Result<Seen, TrainerError> {
        let n = self.grads.grads_len();
        let sizes: Vec<usize> = self.model.params().iter().map(|(_, p)| p.numel()).collect();
        let tensors = sizes.len() + 1;
        let step_seed = self.peek_step_seed();
        let mut seen = Seen { top: vec![ZERO_EXP; tensors], tally: vec![[0; 3]; tensors], over: 0 };
        if exps.is_some() {
            acc[n..].fill(0);
            if mine.is_empty() {
                acc[..n].fill(0);
            }
        }
        let paired = exps.is_some() && self.grads.is_bound();
        let shards: Vec<usize> = mine.collect();
        let (mut exps_a, mut exps_b) = (vec![ZERO_EXP; tensors], vec![ZERO_EXP; tensors]);
        let mut i = 0;
        while i < shards.len() {
            let (a, loss_a) = (shards[i], self.shard_grad(shards[i], k, step_seed)?);
            let second = shards.get(i + 1).copied().filter(|_| paired);
            let loss_b = match second {
                Some(b) => {
                    // Shard `a`'s gradient stays in the spare; `b`'s goes to the buffer the
                    // parameters now point at.
                    let mut spare = match self.exact_spare.take() {
                        Some(s) => s,
                        None => self.grads.spare()?,
                    };
                    std::mem::swap(&mut self.grads, &mut spare);
                    self.exact_spare = Some(spare);
                    self.grads.attach(self.model.params())?;
                    Some(self.shard_grad(b, k, step_seed)?)
                }
                None => None,
            };
            let first = i == 0;
            let gb: &[f32] = self.grads.as_mut_slice();
            let ga: &[f32] = match (second, self.exact_spare.as_mut()) {
                (Some(_), Some(s)) => s.as_mut_slice(),
                _ => gb,
            };
            let mut at = 0;
            for (t, &len) in sizes.iter().enumerate() {
                let (pa, slot) = (&ga[at..at + len], &mut acc[at..at + len]);
                let (bits_a, bits_b) = match (exps, second) {
                    (Some(e), Some(_)) => {
                        let pb = &gb[at..at + len];
                        if first {
                            quantize_pair_into::<true>(slot, pa, pb, scale(e[t]))
                        } else {
                            quantize_pair_into::<false>(slot, pa, pb, scale(e[t]))
                        }
                    }
                    (Some(e), None) if first => (quantize_into::<true>(slot, pa, scale(e[t])), 0),
                    (Some(e), None) => (quantize_into::<false>(slot, pa, scale(e[t])), 0),
                    (None, _) => (top_bits(pa), 0),
                };
                if bits_a.max(bits_b) >= 0x7f80_0000 {
                    let j = if bits_a >= 0x7f80_0000 { a } else { a + 1 };
                    return Err(non_finite(self.step, j));
                }
                exps_a[t] = exp_bits_f32(bits_a);
                exps_b[t] = exp_bits_f32(bits_b);
                at += len;
            }
            for (j, loss, shard_exps) in
                [(a, Some(loss_a), &mut exps_a), (a + 1, loss_b, &mut exps_b)].into_iter()
            {
                let Some(loss) = loss else { continue };
                if !loss.is_finite() {
                    return Err(non_finite(self.step, j));
                }
                shard_exps[sizes.len()] = exp_f64(loss.abs());
                if let Some(e) = exps {
                    acc[n] = acc[n].wrapping_add(quantize(loss, scale(e[sizes.len()])));
                }
                acc[n + 1] += shard(self.plan.global_batch, k, j).len() as i64;
                seen.note(shard_exps, exps);
            }
            i += if second.is_some() { 2 } else { 1 };
        }
        if self.shards_gradients() {
            // Sharded gradients keep no gradient between steps: the spare's shard is summed.
            if let Some(spare) = self.exact_spare.as_mut() {
                super::grads::release(spare.as_mut_slice());
            }
        }
        Ok(seen)
    }

    /// Shard `j` of `k`'s forward and backward into the buffer the parameters' gradients
    /// point at (zeroed first); its loss.
    fn shard_grad(&mut self, j: usize, k: usize, step_seed: u64) -> Result<f64, TrainerError> {
        let s = shard(self.plan.global_batch, k, j);
        let positions = self.cursor + s.start as u64..self.cursor + s.end as u64;
        self.grads.zero(self.model.params(), self.shards_gradients())?;
        if self.model.is_stochastic() {
            self.model.seed_dropout(step_seed ^ positions.start.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        }
        let idx = self.sampler.indices(positions);
        let (x, y) = self.batch_on_device(&idx)?;
        let loss = self.model.loss_backward(&x, &y, self.job.memory_plan())?;
        self.grads.collect(self.model.params(), self.shards_gradients())?;
        Ok(loss)
    }

    /// The predicted exponents as an image tensor (a reproducible job's state).
    pub(super) fn exponents_tensor(&self) -> Result<Option<RawTensor>, TrainerError> {
        let Some(e) = &self.exact_exponents else { return Ok(None) };
        let bytes = e.iter().flat_map(|v| v.to_le_bytes()).collect();
        Ok(Some(RawTensor::try_new(EXPONENTS, Dtype::I32, vec![e.len()], bytes)?))
    }

    /// The predicted exponents `image` holds for this trainer, checked: none when it has
    /// none (a reproducible job's first step, or an ordinary job).
    pub(super) fn exponents_in(&self, image: &StateImage) -> Result<Option<Vec<i32>>, TrainerError> {
        let Some(t) = image.tensors().get(EXPONENTS) else { return Ok(None) };
        let want = self.model.params().len() + 1;
        if !self.job.reproducible || t.dtype() != Dtype::I32 || t.shape() != [want] {
            return Err(TrainerError::Mismatch(format!(
                "tensor '{EXPONENTS}' is {} {:?}, this job needs {}",
                t.dtype().name(),
                t.shape(),
                if self.job.reproducible {
                    format!("I32 [{want}]")
                } else {
                    "none (not reproducible)".into()
                }
            )));
        }
        let e: Vec<i32> =
            t.data().chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
        if let Some(bad) = e.iter().find(|v| !EXP_RANGE.contains(v)) {
            return Err(TrainerError::Mismatch(format!(
                "tensor '{EXPONENTS}' holds exponent {bad}, outside {EXP_RANGE:?}"
            )));
        }
        Ok(Some(e))
    }
}
#[cfg(test)]
mod tests {
    use super::fixed::{CEIL, FLOOR};
    use super::*;
    use crate::{JobSpec, NoReduce};

    /// One process's collectives, counting the exponent agreements (the misfit path's extra
    /// collective); with `answer`, every agreement comes back as it, as from a buggy or
    /// hostile peer.
    #[derive(Default)]
    struct Counting {
        agreements: usize,
        answer: Option<i32>,
    }

    impl Reduce for Counting {
        fn allreduce_sum(&mut self, _buf: &mut [f32], _step: u64) -> Result<(), TrainerError> {
            Ok(())
        }
        fn allreduce_sum_i64(&mut self, _buf: &mut [i64], _step: u64) -> Result<(), TrainerError> {
            Ok(())
        }
        fn allreduce_max_i32(&mut self, vals: &mut [i32], _step: u64) -> Result<(), TrainerError> {
            self.agreements += 1;
            if let Some(a) = self.answer {
                vals.fill(a);
            }
            Ok(())
        }
    }

    /// A shard is at most the job's micro-batch (a shard is one forward and backward), so a
    /// job sized to fit its micro-batch fits its shards; otherwise the count is the job's.
    #[test]
    fn shards_fit_the_micro_batch() {
        assert_eq!(shard_count(None, 64, 64), SHARDS);
        assert_eq!(shard_count(None, 64, 8), SHARDS, "eight shards of 8 fit");
        assert_eq!(shard_count(None, 64, 4), 16);
        assert_eq!(shard_count(None, 64, 5), 13, "shards of 4 or 5 samples, each at most 5");
        assert_eq!(shard_count(Some(5), 64, 64), 5);
        assert_eq!(shard_count(Some(32), 64, 16), 32);
        assert_eq!(shard_count(None, 4, 1), 4);
        assert_eq!(shard_count(None, 3, 64), 3, "at most one a sample");
        assert_eq!(shard_count(None, 1 << 20, 1), MAX_SHARDS);
        for (b, mb) in [(64, 5), (100, 7), (8, 3)] {
            let k = shard_count(None, b, mb);
            assert!((0..k).all(|j| shard(b, k, j).len() <= mb), "{b} over {k} shards, micro-batch {mb}");
        }
    }

    /// A reproducible job keeps a micro-batch smaller than a shard (it sets the shard count)
    /// and drops any other, which changes nothing.
    #[test]
    fn a_micro_batch_smaller_than_a_shard_is_kept_and_any_other_dropped() {
        use crate::train::tests::{job, synthetic};
        let data = synthetic();
        for (micro, kept) in [(4, 4), (7, 7), (8, 64), (16, 64)] {
            let mut j = job(crate::ModelKind::Mlp, &data, 32, 32);
            let keys = crate::job_keys::JobKeys {
                reproducible: Some(true),
                global_batch: Some(64),
                micro_batch: Some(micro),
                ..Default::default()
            };
            keys.apply(&mut j).unwrap();
            assert_eq!(j.micro_batch, kept, "micro-batch {micro}");
        }
    }

    #[test]
    fn absurd_agreed_exponents_cannot_overflow_a_scale() {
        let (img, _) = reproducible_state();
        let mut t = Trainer::from_image(&img, crate::train::tests::synthetic(), None).unwrap();
        t.exact_exponents = None;
        // Clamped into the range every rank alike: a useless step, not a panic.
        t.exact_step(0, 1, &mut Counting { agreements: 0, answer: Some(i32::MAX) }).unwrap();
        assert!(t.exact_exponents.unwrap().iter().all(|e| EXP_RANGE.contains(e)));
    }

    /// A state at step 3 of a reproducible MLP job, as an image.
    fn reproducible_state() -> (StateImage, Vec<i32>) {
        use crate::train::tests::{job, synthetic};
        let data = synthetic();
        let mut j = job(crate::ModelKind::Mlp, &data, 32, 32);
        j.reproducible = true;
        j.shards = Some(4);
        let mut t = Trainer::try_new(j, data).unwrap();
        let mut count = Counting::default();
        assert!(t.exact_step(0, 1, &mut count).unwrap().agreed);
        assert_eq!(count.agreements, 1, "the first step has no prediction");
        for _ in 0..2 {
            assert!(!t.exact_step(0, 1, &mut count).unwrap().agreed);
        }
        assert_eq!(count.agreements, 1, "later steps fit their prediction");
        (t.image().unwrap(), t.exact_exponents.clone().unwrap())
    }

    #[test]
    fn a_misfit_prediction_is_caught_either_way_and_the_step_taken_at_the_exact_maxima() {
        let (img, predicted) = reproducible_state();
        let step = |exps: Option<Vec<i32>>| {
            let mut t = Trainer::from_image(&img, crate::train::tests::synthetic(), None).unwrap();
            t.exact_exponents = exps;
            let mut count = Counting::default();
            let agreed = t.exact_step(0, 1, &mut count).unwrap().agreed;
            assert_eq!(agreed, count.agreements == 1);
            (t.content_hash().unwrap(), count.agreements)
        };
        let (none, agreed) = step(None);
        assert_eq!(agreed, 1);
        // One tensor's prediction too high (no shard keeps full precision) or too low (a
        // shard past the ceiling); every tensor off: each is caught, and the step is the
        // one computed at the exact maxima, bit for bit.
        for (t, by) in [(0, FLOOR + 8), (0, -CEIL - 8), (usize::MAX, 30), (usize::MAX, -30)] {
            let off: Vec<i32> = predicted
                .iter()
                .enumerate()
                .map(|(i, &e)| if t == usize::MAX || i == t { e + by } else { e })
                .collect();
            assert_eq!(step(Some(off)), (none.clone(), 1), "tensor {t} off by {by}");
        }
        // Within the window the prediction stands: no agreement.
        let (_, agreed) = step(Some(predicted.iter().map(|e| e + 2).collect()));
        assert_eq!(agreed, 0);
        let (_, agreed) = step(Some(predicted));
        assert_eq!(agreed, 0);
    }

    /// The fixed-point path computes the ordinary path's update (up to f32 rounding): a
    /// wrong scale, a lost shard or a misplaced loss would show here, where two reproducible
    /// runs would still agree with each other.
    #[test]
    fn a_reproducible_job_trains_as_the_ordinary_one_does() {
        use crate::train::tests::{job, synthetic};
        let data = synthetic();
        let mut plain = job(crate::ModelKind::Mlp, &data, 32, 32);
        plain.optimizer = crate::optim::OptimizerSpec::sgd(0.05, 0.0);
        let exact = JobSpec { reproducible: true, shards: Some(5), ..plain.clone() };
        let run = |j: JobSpec| {
            let mut t = Trainer::try_new(j, synthetic()).unwrap();
            let losses: Vec<f64> = (0..20).map(|_| t.train_step(0, 1, &mut NoReduce).unwrap().loss).collect();
            let params: Vec<Vec<f32>> = t
                .model()
                .params()
                .iter()
                .map(|(_, p)| Vec::<f32>::try_from(p.detach().flatten(0, -1)).unwrap())
                .collect();
            (losses, params)
        };
        let (la, pa) = run(plain);
        let (lb, pb) = run(exact);
        for (s, (a, b)) in la.iter().zip(&lb).enumerate() {
            assert!((a - b).abs() <= 1e-5 * a.abs(), "step {s}: loss {a} (ordinary) vs {b}");
        }
        for (a, b) in pa.iter().zip(&pb) {
            let d: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f32>().sqrt();
            let n: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
            assert!(d <= 1e-5 * n.max(1e-6), "parameters differ by {d} (norm {n})");
        }
        assert_ne!(la, lb, "bit-equal to the ordinary path: the fixed-point path did not run");
    }

    #[test]
    fn an_image_with_bad_exponents_is_refused_naming_them() {
        let (img, predicted) = reproducible_state();
        let meta = img.meta();
        let with = |t: RawTensor| {
            let mut tensors = img.tensors().clone();
            tensors.insert(EXPONENTS.into(), t);
            let bad = StateImage::new(meta.step, meta.cursor, meta.rng, meta.job.clone(), tensors);
            Trainer::from_image(&bad, crate::train::tests::synthetic(), None).unwrap_err().to_string()
        };
        let i32s = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let short = &predicted[1..];
        let err = with(RawTensor::try_new(EXPONENTS, Dtype::I32, vec![short.len()], i32s(short)).unwrap());
        assert!(
            err.contains("tensor 'exact/exponents' is I32")
                && err.contains(&format!("[{}]", predicted.len())),
            "{err}"
        );
        let mut huge = predicted.clone();
        huge[0] = i32::MAX;
        let err = with(RawTensor::try_new(EXPONENTS, Dtype::I32, vec![huge.len()], i32s(&huge)).unwrap());
        assert!(err.contains(&format!("exponent {}", i32::MAX)), "{err}");
        let err =
            with(RawTensor::from_f32(EXPONENTS, vec![predicted.len()], &vec![0.0; predicted.len()]).unwrap());
        assert!(err.contains("is F32"), "{err}");
    }
}
