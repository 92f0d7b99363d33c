//! Batch-size and learning-rate policies: how an epoch's world size maps to its global batch,
//! micro-batch and learning-rate scale. Pure functions; every epoch records what they chose.
//!
//! | policy | global batch | lr scale | source |
//! |---|---|---|---|
//! | `fixed-global` (default) | constant | 1 | keeps the samples of every step independent of the world size, so an elastic run matches an uninterrupted one |
//! | `linear` | per-rank batch x world | world / base world | Goyal et al., "Accurate, Large Minibatch SGD" (2017) |
//! | `sqrt` | per-rank batch x world | sqrt(world / base world) | Krizhevsky, "One weird trick" (2014); Hoffer et al. (2017) |
//! | `adascale` | per-rank batch x world | AdaScale gain r in [1, S] | Johnson et al., "AdaScale SGD" (ICML 2020); as in KungFu and AdaptDL |
//!
//! AdaScale's gain for a batch S times the base one is r = (σ² + μ²) / (σ²/S + μ²), where σ² is
//! the per-sample gradient variance and μ² the squared norm of the mean gradient, estimated
//! by the trainer from the spread of the ranks' gradients. Without an estimate yet it is 1.

use limpet_consensus::state::EpochBatch;
use serde::{Deserialize, Serialize};

/// A declared batch / learning-rate policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BatchPolicy {
    /// Constant global batch; per-rank share and accumulation adjust.
    FixedGlobal,
    /// Constant per-rank batch; lr scales linearly with the world.
    Linear,
    /// Constant per-rank batch; lr scales with the square root of the world.
    Sqrt,
    /// Constant per-rank batch; lr scales by the AdaScale gain.
    Adascale,
}

/// The job's batch as declared, for the world it was declared for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BaseBatch {
    /// Global batch at `world`.
    pub global_batch: u64,
    /// Largest micro-batch a rank computes at once.
    pub micro_batch: u64,
    /// The world size the base batch and learning rate were tuned for.
    pub world: u64,
}

/// Gradient statistics for AdaScale, from the last steps.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct GradientStats {
    /// Per-sample gradient variance σ² (summed over coordinates).
    pub variance: f64,
    /// Squared norm of the mean gradient μ².
    pub mean_sq: f64,
}

/// What a policy decides for a world size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchDecision {
    /// The epoch's batch plan.
    pub batch: EpochBatch,
    /// The learning-rate multiplier.
    pub lr_scale: f64,
}

impl BatchPolicy {
    /// Decides the batch and learning-rate scale for `world` ranks.
    pub fn decide(self, base: BaseBatch, world: u64, stats: Option<GradientStats>) -> BatchDecision {
        let world = world.max(1);
        let base_world = base.world.max(1);
        let per_rank = base.global_batch.div_ceil(base_world).max(1);
        let micro = base.micro_batch.max(1);
        let scale = world as f64 / base_world as f64;
        match self {
            BatchPolicy::FixedGlobal => BatchDecision {
                batch: EpochBatch { global_batch: base.global_batch, micro_batch: micro },
                lr_scale: 1.0,
            },
            BatchPolicy::Linear | BatchPolicy::Sqrt | BatchPolicy::Adascale => {
                let batch = EpochBatch { global_batch: per_rank * world, micro_batch: micro };
                let lr_scale = match self {
                    BatchPolicy::Linear => scale,
                    BatchPolicy::Sqrt => scale.sqrt(),
                    _ => adascale_gain(scale, stats),
                };
                BatchDecision { batch, lr_scale }
            }
        }
    }
}

/// AdaScale's gain r = (σ² + μ²) / (σ²/S + μ²), within [1, S] for S >= 1 (1 without data).
pub fn adascale_gain(scale: f64, stats: Option<GradientStats>) -> f64 {
    let Some(GradientStats { variance, mean_sq }) = stats else { return 1.0 };
    if !(variance.is_finite() && mean_sq.is_finite()) || variance < 0.0 || mean_sq < 0.0 || scale <= 0.0 {
        return 1.0;
    }
    let denom = variance / scale + mean_sq;
    if denom <= 0.0 {
        return 1.0;
    }
    let r = (variance + mean_sq) / denom;
    let (lo, hi) = if scale >= 1.0 { (1.0, scale) } else { (scale, 1.0) };
    r.clamp(lo, hi)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const BASE: BaseBatch = BaseBatch { global_batch: 256, micro_batch: 32, world: 4 };

    #[test]
    fn fixed_global_keeps_the_batch_and_the_rate() {
        for w in 1..9 {
            let d = BatchPolicy::FixedGlobal.decide(BASE, w, None);
            assert_eq!(d.batch.global_batch, 256);
            assert_eq!(d.lr_scale, 1.0);
        }
    }

    #[test]
    fn linear_and_sqrt_scale_with_the_world() {
        let d = BatchPolicy::Linear.decide(BASE, 2, None);
        assert_eq!((d.batch.global_batch, d.lr_scale), (128, 0.5));
        let d = BatchPolicy::Sqrt.decide(BASE, 8, None);
        assert_eq!(d.batch.global_batch, 512);
        assert!((d.lr_scale - 2f64.sqrt()).abs() < 1e-12);
    }

    #[test]
    fn adascale_gain_is_one_without_noise_and_the_scale_with_pure_noise() {
        let none = GradientStats { variance: 0.0, mean_sq: 1.0 };
        assert_eq!(adascale_gain(4.0, Some(none)), 1.0);
        let noise = GradientStats { variance: 1.0, mean_sq: 0.0 };
        assert_eq!(adascale_gain(4.0, Some(noise)), 4.0);
        assert_eq!(adascale_gain(4.0, None), 1.0);
    }

    proptest! {
        #[test]
        fn adascale_gain_stays_within_one_and_the_scale(s in 0.01f64..64.0, v in 0.0f64..1e6, m in 0.0f64..1e6) {
            let r = adascale_gain(s, Some(GradientStats { variance: v, mean_sq: m }));
            prop_assert!(r.is_finite());
            prop_assert!(r >= s.min(1.0) - 1e-9 && r <= s.max(1.0) + 1e-9, "{r} for scale {s}");
        }
    }
}
