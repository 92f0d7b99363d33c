//! Reproducible steps (`JobSpec::reproducible`): the same bits whatever the world size, the
//! micro-batch, the transitions or the restarts.
//!
//! An ordinary step sums gradients in f32 in an order that depends on how the batch was cut
//! (micro-batches, ranks, the ring), so two runs agree only up to rounding. Here:
//!
//! 1. Each step's global batch is cut into at most [`SHARDS`] canonical shards whose bounds
//!    depend only on the job; a shard's gradient is one forward and backward over exactly
//!    its samples, so it is the same bits on whichever rank computes it (same binary, same
//!    intra-op threads). Ranks take whole shards.
//! 2. Every tensor gets a shared exponent for the step: the largest over all shards (an
//!    exact max across ranks).
//! 3. Each shard's gradient is rounded to fixed point, [`FRACTION_BITS`] bits below that
//!    exponent, and the shards are summed as i64: integer addition does not care about order,
//!    so the ring's sum is the same as one process's.
//! 4. The sum goes back to f32 once, and clipping and the optimizer run on identical inputs.
//!
//! The loss is summed the same way, so per-step losses are identical too. Costs: a backward
//! per shard instead of per micro-batch, the shards' gradients held until the exponent is
//! known, and an i64 (twice the f32) allreduce.

use super::Trainer;
use crate::{Reduce, StepStats, TrainerError};
use std::ops::Range;

/// Canonical shards per step unless the job says (fewer when the global batch is smaller).
pub const SHARDS: usize = 8;
/// Fixed-point bits below each tensor's exponent: 2^40 per shard leaves 2^23 of headroom
/// in an i64 for summing shards.
pub const FRACTION_BITS: i32 = 40;
/// The exponent of an all-zero tensor (its scale is irrelevant).
const ZERO_EXP: i32 = -1000;

/// Shard `j` of `k` over a global batch of `b` samples: `[j*b/k, (j+1)*b/k)`.
pub fn shard(b: usize, k: usize, j: usize) -> Range<usize> {
    j * b / k..(j + 1) * b / k
}

/// The shards rank `rank` of `world` computes: a contiguous tile of the `k` shards.
pub fn shards_of(k: usize, rank: usize, world: usize) -> Range<usize> {
    let (q, r) = (k / world, k % world);
    let start = rank * q + rank.min(r);
    start..start + q + usize::from(rank < r)
}

/// The smallest `e` with `|v| < 2^e` for an f32 (`ZERO_EXP` for zero).
fn exp_f32(v: f32) -> i32 {
    if v == 0.0 {
        return ZERO_EXP;
    }
    let biased = ((v.to_bits() >> 23) & 0xff) as i32;
    if biased == 0 {
        -126
    } else {
        biased - 126
    }
}

/// The same for an f64.
fn exp_f64(v: f64) -> i32 {
    if v == 0.0 {
        return ZERO_EXP;
    }
    let biased = ((v.to_bits() >> 52) & 0x7ff) as i32;
    if biased == 0 {
        -1022
    } else {
        biased - 1022
    }
}

/// The factor that takes values of exponent `exp` to fixed point (a power of two: exact).
fn scale(exp: i32) -> f64 {
    2f64.powi(FRACTION_BITS - exp)
}

/// `x` rounded to the nearest integer, ties to even, for `|x| < 2^51`: adding and taking
/// back 1.5 * 2^52 leaves no fraction bits (IEEE round-to-nearest-even does the rest). The
/// same as `round_ties_even`, without a libm call per gradient element.
fn round_even(x: f64) -> f64 {
    const MAGIC: f64 = 6_755_399_441_055_744.0;
    (x + MAGIC) - MAGIC
}

/// `v` in fixed point, given the factor `scale(exp)` of its tensor.
fn quantize(v: f64, k: f64) -> i64 {
    round_even(v * k) as i64
}

/// Back from fixed point, given `1 / scale(exp)` (exact: a power of two).
fn dequantize(q: i64, inv: f64) -> f64 {
    q as f64 * inv
}

impl Trainer {
    /// One reproducible step: this rank's shards, the exponents' max and the fixed-point
    /// sum through `reduce`, then the update. Every rank of any world applies the same bits.
    pub fn exact_step(
        &mut self,
        rank: usize,
        world: usize,
        reduce: &mut dyn Reduce,
    ) -> Result<StepStats, TrainerError> {
        let started = std::time::Instant::now();
        let step = self.step;
        let b = self.plan.global_batch;
        let k = self.job.shards.unwrap_or(SHARDS).clamp(1, b);
        let n = self.grads.grads_len();
        let sizes: Vec<usize> = self.model.params().iter().map(|(_, p)| p.numel()).collect();
        let step_seed = self.peek_step_seed();
        // Each shard: its gradient (the last stays in the trainer's buffer, the others are
        // copied out), its loss sum and its sample count; the exponents as they come.
        let mine = shards_of(k, rank, world);
        let mut shards: Vec<(Option<Vec<f32>>, f64, usize)> = Vec::new();
        let mut exps = vec![ZERO_EXP; sizes.len() + 1];
        for j in mine.clone() {
            let s = shard(b, k, j);
            let positions = self.cursor + s.start as u64..self.cursor + s.end as u64;
            self.grads.zero(self.model.params())?;
            if self.model.is_stochastic() {
                self.model.seed_dropout(step_seed ^ positions.start.wrapping_mul(0x9E37_79B9_7F4A_7C15));
            }
            let idx = self.sampler.indices(positions.clone());
            let (x, y) = self.batch_on_device(&idx)?;
            let (_, loss) = self.model.forward_loss(&x, &y, true)?;
            loss.f_backward()?;
            let loss = loss.double_value(&[]);
            self.grads.collect(self.model.params())?;
            let g = &self.grads.as_mut_slice()[..n];
            let mut at = 0;
            let mut finite = loss.is_finite();
            for (t, &len) in sizes.iter().enumerate() {
                let mut m = 0f32;
                for v in &g[at..at + len] {
                    let a = v.abs();
                    finite &= a.is_finite();
                    m = m.max(a);
                }
                exps[t] = exps[t].max(exp_f32(m));
                at += len;
            }
            if !finite {
                return Err(TrainerError::Config(format!(
                    "step {step}: shard {j} has a non-finite loss or gradient"
                )));
            }
            exps[sizes.len()] = exps[sizes.len()].max(exp_f64(loss.abs()));
            let kept = (j + 1 < mine.end).then(|| g.to_vec());
            shards.push((kept, loss, s.len()));
        }
        reduce.allreduce_max_i32(&mut exps, step)?;
        // This rank's shards in fixed point, summed exactly; then the loss and the count.
        let mut acc = vec![0i64; n + 2];
        for (kept, loss, count) in &shards {
            let g = match kept {
                Some(g) => g.as_slice(),
                None => &self.grads.as_mut_slice()[..n],
            };
            let mut at = 0;
            for (t, &len) in sizes.iter().enumerate() {
                let k = scale(exps[t]);
                for (a, &v) in acc[at..at + len].iter_mut().zip(&g[at..at + len]) {
                    *a += quantize(f64::from(v), k);
                }
                at += len;
            }
            acc[n] += quantize(*loss, scale(exps[sizes.len()]));
            acc[n + 1] += *count as i64;
        }
        drop(shards);
        reduce.allreduce_sum_i64(&mut acc, step)?;
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
        self.compute_ms = started.elapsed().as_secs_f64() * 1e3;
        self.apply_reduced()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_tile_the_batch_and_ranks_tile_the_shards() {
        for b in 1..40 {
            let k = b.min(SHARDS);
            let ends: Vec<_> = (0..k).map(|j| shard(b, k, j)).collect();
            assert_eq!(ends[0].start, 0);
            assert_eq!(ends[k - 1].end, b);
            assert!(ends.windows(2).all(|w| w[0].end == w[1].start && !w[0].is_empty()));
            for world in 1..12 {
                let tiles: Vec<_> = (0..world).map(|r| shards_of(k, r, world)).collect();
                assert_eq!(tiles.iter().map(|t| t.len()).sum::<usize>(), k);
                assert!(tiles.windows(2).all(|w| w[0].end == w[1].start));
            }
        }
    }

    #[test]
    fn exponents_bound_their_values_and_quantization_round_trips_closely() {
        for v in [1e-30f32, 0.3, 1.0, 1.5, 2.0, 1e30] {
            let e = exp_f32(v);
            assert!(f64::from(v) < 2f64.powi(e) && f64::from(v) >= 2f64.powi(e - 1), "{v} {e}");
            let back = dequantize(quantize(f64::from(v), scale(e)), 1.0 / scale(e));
            assert!((back - f64::from(v)).abs() <= 2f64.powi(e - FRACTION_BITS), "{v}");
        }
        assert_eq!(exp_f32(0.0), ZERO_EXP);
        assert!(f64::from(f32::MIN_POSITIVE / 4.0) < 2f64.powi(exp_f32(f32::MIN_POSITIVE / 4.0)));
        assert!(2.5 < 2f64.powi(exp_f64(2.5)));
        for x in [0.5, 1.5, 2.5, -0.5, -2.5, 3.7, -3.2, 1e12 + 0.5, -(2f64.powi(50)) - 0.5] {
            assert_eq!(round_even(x), x.round_ties_even(), "{x}");
        }
    }
}
