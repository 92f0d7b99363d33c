//! The fixed-point arithmetic of reproducible steps: the canonical shards and the ranks' tiles
//! of them, exponents, rounding gradients to fixed point and back, and the tallies that tell
//! whether a step's prediction held and predict the next one.

use crate::TrainerError;
use std::ops::Range;

/// Canonical shards per step unless the job says (fewer when the global batch is smaller).
pub const SHARDS: usize = 8;
/// The most canonical shards a step may have: 2^12 shards of values below 2^50 sum below
/// 2^62.
pub const MAX_SHARDS: usize = 4096;
/// Fixed-point bits below each tensor's exponent.
pub const FRACTION_BITS: i32 = 40;
/// A shard fits its prediction `e` when its values are below `2^(e + CEIL)`: in fixed point
/// below 2^50, inside the rounding trick's 2^51.
pub(super) const CEIL: i32 = 10;
/// ... and a prediction holds when some shard reaches `2^(e - FLOOR)`: the largest value then
/// keeps at least `FRACTION_BITS - FLOOR` bits (more than f32's 24).
pub(super) const FLOOR: i32 = 12;
/// The exponent of an all-zero tensor (its scale is irrelevant).
pub(super) const ZERO_EXP: i32 = -1000;
/// Scale factors are taken at no lower exponent, so that they stay finite in f64 (an
/// all-zero tensor's values are zero at any scale).
const MIN_SCALE_EXP: i32 = -900;
/// `x + MAGIC` for `|x| < 2^51` lands where f64's spacing is 1: the addition rounds `x` to
/// an integer (ties to even, IEEE's default), and the sum's bits minus `MAGIC`'s are that
/// integer. Plain arithmetic on both sides, so the loop over a gradient vectorizes.
const MAGIC: f64 = 6_755_399_441_055_744.0;

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

/// The smallest `e` with `|v| < 2^e` for the f32 whose magnitude's bits (sign cleared) are
/// `bits` (`ZERO_EXP` for zero).
pub(super) fn exp_bits_f32(bits: u32) -> i32 {
    if bits == 0 {
        return ZERO_EXP;
    }
    let biased = (bits >> 23) as i32;
    if biased == 0 {
        -126
    } else {
        biased - 126
    }
}

/// The same for an f64.
pub(super) fn exp_f64(v: f64) -> i32 {
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

/// The exponents an image may hold: those of finite f32 gradients and f64 losses, at
/// which [`scale`] and its inverse stay finite.
pub(in crate::train) const EXP_RANGE: std::ops::RangeInclusive<i32> = ZERO_EXP..=1030;

/// The factor that takes values of exponent `exp` to fixed point (a power of two: exact).
pub(super) fn scale(exp: i32) -> f64 {
    2f64.powi(FRACTION_BITS - exp.max(MIN_SCALE_EXP))
}

/// `v * k` rounded to the nearest integer, ties to even, for `|v * k| < 2^51` (else any
/// value: see [`MAGIC`]).
pub(super) fn quantize(v: f64, k: f64) -> i64 {
    ((v * k + MAGIC).to_bits() as i64).wrapping_sub(MAGIC.to_bits() as i64)
}

/// Adds `g` in fixed point at factor `k` to `acc` (or, `FIRST`, writes it there: a rank's
/// first shard spares reading what it would add to), and returns the bits of the largest
/// magnitude in `g` (at least `0x7f80_0000` when a value is not finite). A value too large
/// for `k` adds garbage, wrapping: the caller learns it from the returned bits.
pub(super) fn quantize_into<const FIRST: bool>(acc: &mut [i64], g: &[f32], k: f64) -> u32 {
    let mut top = 0u32;
    for (a, &v) in acc.iter_mut().zip(g) {
        top = top.max(v.to_bits() & 0x7fff_ffff);
        let q = quantize(f64::from(v), k);
        *a = if FIRST { q } else { a.wrapping_add(q) };
    }
    top
}

/// [`quantize_into`] for two shards at once: their integers' sum goes into `acc` in one
/// pass over it (integer addition: the same sum as one shard after the other).
pub(super) fn quantize_pair_into<const FIRST: bool>(
    acc: &mut [i64],
    ga: &[f32],
    gb: &[f32],
    k: f64,
) -> (u32, u32) {
    let (mut ta, mut tb) = (0u32, 0u32);
    for ((a, &x), &y) in acc.iter_mut().zip(ga).zip(gb) {
        ta = ta.max(x.to_bits() & 0x7fff_ffff);
        tb = tb.max(y.to_bits() & 0x7fff_ffff);
        let q = quantize(f64::from(x), k).wrapping_add(quantize(f64::from(y), k));
        *a = if FIRST { q } else { a.wrapping_add(q) };
    }
    (ta, tb)
}

pub(super) fn non_finite(step: u64, j: usize) -> TrainerError {
    TrainerError::Config(format!("step {step}: shard {j} has a non-finite loss or gradient"))
}

/// The bits of the largest magnitude in `g`.
pub(super) fn top_bits(g: &[f32]) -> u32 {
    g.iter().fold(0, |m, v| m.max(v.to_bits() & 0x7fff_ffff))
}

/// Back from fixed point, given `1 / scale(exp)` (exact: a power of two).
pub(super) fn dequantize(q: i64, inv: f64) -> f64 {
    q as f64 * inv
}

/// What one pass over a rank's shards saw, per tensor (the parameters', then the loss).
pub(super) struct Seen {
    /// The largest exponent over the shards.
    pub(super) top: Vec<i32>,
    /// Over the shards with a nonzero value: the sum of their exponents, how many they are,
    /// and how many reached the prediction's floor.
    pub(super) tally: Vec<[i64; 3]>,
    /// Shards with a value above the prediction's ceiling.
    pub(super) over: i64,
}

impl Seen {
    /// Counts one shard whose per-tensor exponents are `shard_exps`, against the prediction
    /// `exps` when there is one.
    pub(super) fn note(&mut self, shard_exps: &[i32], exps: Option<&[i32]>) {
        let mut over = false;
        for (t, &e) in shard_exps.iter().enumerate() {
            self.top[t] = self.top[t].max(e);
            if e == ZERO_EXP {
                continue;
            }
            let c = &mut self.tally[t];
            c[0] += i64::from(e);
            c[1] += 1;
            if let Some(p) = exps {
                c[2] += i64::from(e >= p[t] - FLOOR);
                over |= e > p[t] + CEIL;
            }
        }
        self.over += i64::from(over);
    }

    /// Writes the misfit count and the tallies where the sum carries them.
    pub(super) fn write(&self, tail: &mut [i64]) {
        tail[0] = self.over;
        for (t, c) in self.tally.iter().enumerate() {
            tail[1 + 3 * t..4 + 3 * t].copy_from_slice(c);
        }
    }
}

/// Whether every shard fit the prediction, from the summed misfit count and tallies: none
/// above a ceiling, and in every tensor with a nonzero value some shard at its floor.
pub(super) fn fitted(tail: &[i64]) -> bool {
    tail[0] == 0 && tail[1..].chunks_exact(3).all(|c| c[1] == 0 || c[2] > 0)
}

/// The next step's prediction from the summed tallies: one above the mean exponent of the
/// shards with a nonzero value (so the typical shard keeps a bit of headroom); a tensor
/// with none keeps `used`.
pub(super) fn predict(tail: &[i64], used: &[i32]) -> Vec<i32> {
    tail[1..]
        .chunks_exact(3)
        .zip(used)
        .map(|(c, &u)| {
            if c[1] > 0 {
                c[0].div_euclid(c[1])
                    .saturating_add(1)
                    .clamp(i64::from(*EXP_RANGE.start()), i64::from(*EXP_RANGE.end())) as i32
            } else {
                u
            }
        })
        .collect()
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
    fn exponents_bound_their_values_and_quantization_rounds_to_even() {
        let exp_f32 = |v: f32| exp_bits_f32(v.to_bits() & 0x7fff_ffff);
        for v in [1e-30f32, 0.3, 1.0, 1.5, 2.0, 1e30, -0.7] {
            let e = exp_f32(v);
            let m = f64::from(v).abs();
            assert!(m < 2f64.powi(e) && m >= 2f64.powi(e - 1), "{v} {e}");
            let back = dequantize(quantize(f64::from(v), scale(e)), 1.0 / scale(e));
            assert!((back - f64::from(v)).abs() <= 2f64.powi(e - FRACTION_BITS), "{v}");
        }
        assert_eq!(exp_f32(0.0), ZERO_EXP);
        assert_eq!(exp_f32(-0.0), ZERO_EXP);
        assert!(f64::from(f32::MIN_POSITIVE / 4.0) < 2f64.powi(exp_f32(f32::MIN_POSITIVE / 4.0)));
        assert!(2.5 < 2f64.powi(exp_f64(2.5)));
        for x in [0.5, 1.5, 2.5, -0.5, -2.5, 3.7, -3.2, 1e12 + 0.5, -(2f64.powi(50)) - 0.5, 0.0, -0.0] {
            assert_eq!(quantize(x, 1.0), x.round_ties_even() as i64, "{x}");
        }
        // The fused loop: the same integers and the largest magnitude, whatever the sign.
        let g = [0.25f32, -3.5, 1e-9, -0.0, 7.0];
        let mut acc = vec![1i64; g.len()];
        let bits = quantize_into::<false>(&mut acc, &g, scale(3));
        assert_eq!(f32::from_bits(bits), 7.0);
        for (a, v) in acc.iter().zip(g) {
            assert_eq!(*a, 1 + (f64::from(v) * 2f64.powi(37)).round_ties_even() as i64);
        }
        let mut fresh = vec![5i64; g.len()];
        quantize_into::<true>(&mut fresh, &g, scale(3));
        assert_eq!(
            fresh.iter().zip(&acc).map(|(f, a)| a - f).collect::<Vec<_>>(),
            [1; 5],
            "written, not added"
        );
        // Two shards in one pass: the same integers as one after the other.
        let h = [1.5f32, 2.25, -1e-7, 3.0, -8.0];
        let mut pair = vec![1i64; g.len()];
        let (ta, tb) = quantize_pair_into::<false>(&mut pair, &g, &h, scale(4));
        let mut one_by_one = vec![1i64; g.len()];
        quantize_into::<false>(&mut one_by_one, &g, scale(4));
        quantize_into::<false>(&mut one_by_one, &h, scale(4));
        assert_eq!((pair, f32::from_bits(ta), f32::from_bits(tb)), (one_by_one, 7.0, 8.0));
        assert!(top_bits(&[1.0, f32::NAN]) >= 0x7f80_0000 && top_bits(&[f32::NEG_INFINITY]) >= 0x7f80_0000);
        // Exponents at either end of what an image may hold keep factors finite.
        for e in [*EXP_RANGE.start(), *EXP_RANGE.end()] {
            assert!(scale(e).is_finite() && (1.0 / scale(e)).is_finite() && scale(e) > 0.0, "{e}");
        }
    }

    #[test]
    fn a_prediction_holds_only_when_every_shard_fits_and_some_reach_the_floor() {
        // Tail: misfits, then (sum, count, reached) per tensor.
        assert!(fitted(&[0, 10, 2, 1, 0, 0, 0]));
        assert!(!fitted(&[1, 10, 2, 1, 0, 0, 0]), "a shard above its ceiling");
        assert!(!fitted(&[0, 10, 2, 0, 0, 0, 0]), "no shard at the floor");
        // One above the mean (rounded down, also below zero); an all-zero tensor keeps its own.
        assert_eq!(predict(&[0, 10, 2, 1, -7, 2, 2, 0, 0, 0], &[0, 0, 5]), [6, -3, 5]);
    }
}
