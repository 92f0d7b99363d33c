//! Deterministic global sampling.
//!
//! The training set is read as an endless stream of passes; pass `p` visits the samples in a
//! permutation seeded by `(seed, p)`: a Fisher-Yates shuffle held in memory for up to
//! [`SHUFFLE_MAX`] samples, and above that a keyed Feistel permutation computed per position
//! (constant memory, so a dataset of billions of windows costs nothing to sample from). Step `s` consumes the stream positions
//! `[s*B, (s+1)*B)` for global batch `B`. A rank's share is a contiguous slice of that range,
//! a pure function of `(step, rank, world, plan)`; the shares of all ranks tile the range
//! exactly, so the samples of a step do not depend on how many ranks there are.

use crate::data::permutation;
use crate::TrainerError;
use std::ops::Range;

/// How a step's global batch is cut into rank shares and micro-batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchPlan {
    /// Samples per step over all ranks.
    pub global_batch: usize,
    /// Most samples in one forward pass; a larger share is accumulated over micro-batches.
    pub micro_batch: usize,
}

impl BatchPlan {
    /// Validates the sizes.
    pub fn try_new(global_batch: usize, micro_batch: usize) -> Result<Self, TrainerError> {
        if global_batch == 0 || micro_batch == 0 {
            return Err(TrainerError::Config(format!(
                "global_batch ({global_batch}) and micro_batch ({micro_batch}) must be at least 1"
            )));
        }
        Ok(BatchPlan { global_batch, micro_batch })
    }

    /// Offsets `[lo, hi)` within the global batch that `rank` of `world` computes. The first
    /// `B mod world` ranks take one extra sample. Ranks beyond the batch get an empty share.
    pub fn share(&self, rank: usize, world: usize) -> Range<usize> {
        assert!(world > 0 && rank < world, "rank {rank} outside world {world}");
        let (base, extra) = (self.global_batch / world, self.global_batch % world);
        let lo = rank * base + rank.min(extra);
        let len = base + usize::from(rank < extra);
        lo..lo + len
    }

    /// Offsets `[lo, hi)` of `rank`'s share when the ranks compute `shares` samples each (a
    /// slower host a smaller share); equal shares when `shares` does not split this batch
    /// over `world` ranks (empty, say). The shares tile the batch in rank order either way.
    pub fn share_in(&self, rank: usize, world: usize, shares: &[u64]) -> Range<usize> {
        let fits = shares.len() == world
            && shares.iter().try_fold(0u64, |a, &b| a.checked_add(b)) == Some(self.global_batch as u64);
        if !fits {
            return self.share(rank, world);
        }
        let lo: u64 = shares[..rank].iter().sum();
        lo as usize..(lo + shares[rank]) as usize
    }

    /// Stream positions of `rank`'s share at `step`.
    pub fn positions(&self, step: u64, rank: usize, world: usize) -> Range<u64> {
        let start = step * self.global_batch as u64;
        let r = self.share(rank, world);
        start + r.start as u64..start + r.end as u64
    }

    /// Cuts a range of positions into micro-batches of at most `micro_batch` samples.
    pub fn micro_batches(&self, positions: Range<u64>) -> impl Iterator<Item = Range<u64>> {
        let mb = self.micro_batch as u64;
        let end = positions.end;
        (positions.start..end).step_by(self.micro_batch).map(move |s| s..(s + mb).min(end))
    }
}

/// Largest split whose passes are shuffled in memory (4 MiB of indices).
pub const SHUFFLE_MAX: usize = 1 << 20;

/// Maps stream positions to sample indices, caching the permutation of the current pass.
#[derive(Debug)]
pub struct Sampler {
    seed: u64,
    len: usize,
    pass: Option<(u64, Vec<u32>)>,
}

/// One value of the SplitMix64 sequence: a strong 64-bit mixer for the Feistel rounds.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Position `i` of a permutation of `0..n` keyed by `key`: a balanced Feistel network over
/// the smallest even power of two at least `n`, walking the cycle until it lands below `n`
/// (fewer than four steps on average). A bijection whatever the round function.
pub(crate) fn feistel(i: u64, n: u64, key: u64) -> u64 {
    debug_assert!(i < n);
    let bits = (64 - (n - 1).max(1).leading_zeros()).max(2);
    let half = bits.div_ceil(2);
    let mask = (1u64 << half) - 1;
    let mut x = i;
    loop {
        let (mut l, mut r) = (x >> half, x & mask);
        for round in 0..6u64 {
            let f = mix(key ^ mix(round ^ (r << 8))) & mask;
            (l, r) = (r, l ^ f);
        }
        x = (l << half) | r;
        if x < n {
            return x;
        }
    }
}

impl Sampler {
    /// A sampler over `len` samples.
    pub fn new(seed: u64, len: usize) -> Self {
        assert!(len > 0, "sampling from an empty split");
        Sampler { seed, len, pass: None }
    }

    /// Sample index at stream position `pos`.
    pub fn index_at(&mut self, pos: u64) -> usize {
        let (pass, offset) = (pos / self.len as u64, (pos % self.len as u64) as usize);
        if self.len > SHUFFLE_MAX {
            let key = mix(self.seed ^ mix(pass));
            return feistel(offset as u64, self.len as u64, key) as usize;
        }
        if self.pass.as_ref().map(|(p, _)| *p) != Some(pass) {
            self.pass = Some((pass, permutation(self.len, self.seed, pass)));
        }
        self.pass.as_ref().expect("set above").1[offset] as usize
    }

    /// Sample indices for a range of positions.
    pub fn indices(&mut self, positions: Range<u64>) -> Vec<i64> {
        positions.map(|p| self.index_at(p) as i64).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The shares of all ranks cover the global batch exactly once, in rank order.
        #[test]
        fn shares_tile_the_batch(batch in 1usize..2000, world in 1usize..64, step in 0u64..1000) {
            let plan = BatchPlan::try_new(batch, 7).unwrap();
            let mut next = step * batch as u64;
            for rank in 0..world {
                let p = plan.positions(step, rank, world);
                prop_assert_eq!(p.start, next);
                let len = (p.end - p.start) as usize;
                prop_assert!(len == batch / world || len == batch / world + 1);
                next = p.end;
            }
            prop_assert_eq!(next, (step + 1) * batch as u64);
        }

        /// Micro-batches partition a share and respect the size cap.
        #[test]
        fn micro_batches_partition(start in 0u64..10_000, len in 0u64..500, mb in 1usize..64) {
            let plan = BatchPlan::try_new(64, mb).unwrap();
            let mut next = start;
            for r in plan.micro_batches(start..start + len) {
                prop_assert_eq!(r.start, next);
                prop_assert!(r.end > r.start && r.end - r.start <= mb as u64);
                next = r.end;
            }
            prop_assert_eq!(next, start + len);
        }

        /// The Feistel permutation is a bijection of `0..n` for any size and key.
        #[test]
        fn feistel_is_a_permutation(n in 1u64..3000, key in any::<u64>()) {
            let mut seen: Vec<u64> = (0..n).map(|i| feistel(i, n, key)).collect();
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..n).collect::<Vec<_>>());
        }

        /// Every pass visits every sample exactly once.
        #[test]
        fn each_pass_is_a_permutation(len in 1usize..300, pass in 0u64..5, seed in any::<u64>()) {
            let mut s = Sampler::new(seed, len);
            let base = pass * len as u64;
            let mut seen = s.indices(base..base + len as u64);
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..len as i64).collect::<Vec<_>>());
        }
    }

    /// Large splits are sampled in constant memory, still one permutation per pass.
    #[test]
    fn large_splits_use_no_memory_and_still_shuffle() {
        let n = SHUFFLE_MAX + 12_345;
        let mut s = Sampler::new(7, n);
        let first: Vec<i64> = s.indices(0..1000);
        assert!(s.pass.is_none(), "a large split cached a pass");
        assert_ne!(first, (0..1000).collect::<Vec<i64>>());
        assert_ne!(first, s.indices(n as u64..n as u64 + 1000), "passes repeat");
        let mut seen: Vec<i64> = s.indices(0..n as u64);
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), n, "a pass of a large split misses samples");
        // Not an identity on average: neighbours land far apart.
        let far = first.windows(2).filter(|w| (w[0] - w[1]).abs() > 1000).count();
        assert!(far > 990, "{far} of 999 neighbours stayed close");
    }

    #[test]
    fn passes_differ_and_seeds_matter() {
        let mut a = Sampler::new(1, 100);
        let p0 = a.indices(0..100);
        let p1 = a.indices(100..200);
        assert_ne!(p0, p1);
        assert_ne!(p0, Sampler::new(2, 100).indices(0..100));
        assert_eq!(p0, Sampler::new(1, 100).indices(0..100));
    }
}
