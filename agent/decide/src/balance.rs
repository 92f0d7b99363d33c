//! Stragglers: each step's samples shared out by measured speed, so a slower host computes
//! fewer of them and the others stop waiting for it. The samples a step trains, and the sum
//! of their gradients, do not depend on who computes which (the sampler tiles the batch in
//! rank order either way), so unequal shares keep a run equivalent to one process.
//!
//! Speeds are the ranks' own reports of milliseconds per sample (forward and backward, no
//! collectives). Shares stay equal unless the slowest rank is `ratio` times slower than the
//! fastest; then each rank's share is proportional to its speed (largest remainders, rank
//! order on ties), so every rank takes about as long.

use limpet_consensus::state::NodeId;
use std::collections::BTreeMap;

/// A host this much slower than the fastest gets a smaller share; below it, equal shares.
pub const DEFAULT_RATIO: f64 = 1.5;

/// Shares of `global_batch` for `ranks` by the speeds in `ms_per_sample` (ranks without a
/// measurement count as the median), or empty for equal shares: fewer than two ranks, no
/// measurement, `ratio` off (below 1), or no rank that much slower. The slowest rank and
/// its slowness come with it.
pub fn shares(
    global_batch: u64,
    ranks: &[NodeId],
    local: &[u32],
    ms_per_sample: &BTreeMap<NodeId, f64>,
    ratio: f64,
) -> (Vec<u64>, Option<(NodeId, f64)>) {
    let none = (Vec::new(), None);
    let on = ratio.is_finite() && ratio >= 1.0;
    let devices: Vec<u64> = (0..ranks.len()).map(|i| u64::from(local_of(local, i))).collect();
    let total_ranks: u64 = devices.iter().sum();
    if ranks.len() < 2 || !on || global_batch < total_ranks {
        return none;
    }
    let Some(times) = times(ranks, ms_per_sample) else { return none };
    // A host's time per sample is its devices' together; stragglers are judged per device
    // (a host with two devices is not a fast host, but two ranks).
    let per_rank: Vec<f64> = times.iter().zip(&devices).map(|(t, &n)| t * n as f64).collect();
    let (fastest, slowest) = per_rank.iter().fold((f64::MAX, 0.0f64), |(lo, hi), &t| (lo.min(t), hi.max(t)));
    let slower = slowest / fastest;
    let worst = ranks[per_rank.iter().position(|&t| t == slowest).unwrap_or(0)];
    if slower < ratio {
        return (Vec::new(), Some((worst, slower)));
    }
    let speed: Vec<f64> = times.iter().map(|t| 1.0 / t).collect();
    let total: f64 = speed.iter().sum();
    // Every rank keeps at least one sample: a rank with none would still wait on the ring.
    let spare = global_batch - total_ranks;
    let exact: Vec<f64> = speed.iter().map(|s| spare as f64 * s / total).collect();
    let mut out: Vec<u64> = exact.iter().zip(&devices).map(|(e, &n)| n + e.floor() as u64).collect();
    let mut left = global_batch - out.iter().sum::<u64>();
    let mut order: Vec<usize> = (0..ranks.len()).collect();
    order.sort_by(|&a, &b| {
        (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())).then(a.cmp(&b))
    });
    for &i in order.iter().cycle() {
        if left == 0 {
            break;
        }
        out[i] += 1;
        left -= 1;
    }
    (out, Some((worst, slower)))
}

/// Node `i`'s local ranks (`local` empty: one each).
fn local_of(local: &[u32], i: usize) -> u32 {
    local.get(i).copied().unwrap_or(1).max(1)
}

/// Each rank's milliseconds per sample, the ones without a measurement counted as the
/// median; none unless two ranks measured.
fn times(ranks: &[NodeId], ms_per_sample: &BTreeMap<NodeId, f64>) -> Option<Vec<f64>> {
    // Reports are peers' words: only finite, positive times count.
    let valid = |r: &NodeId| ms_per_sample.get(r).copied().filter(|t| t.is_finite() && *t > 0.0);
    let mut known: Vec<f64> = ranks.iter().filter_map(valid).collect();
    if known.len() < 2 {
        return None;
    }
    known.sort_by(f64::total_cmp);
    let median = known[known.len() / 2];
    Some(ranks.iter().map(|r| valid(r).unwrap_or(median)).collect())
}

/// A change of shares must be predicted to make a step at least this much faster: measured
/// speeds wobble on a busy host, and an epoch change for a few percent costs more than it
/// saves (and, near the ratio, would flip back and forth).
pub const MIN_GAIN: f64 = 0.10;

/// The compute time of a step under `shares` (empty: equal shares of `global_batch`): its
/// slowest rank's share times that rank's milliseconds per sample. None without speeds.
pub fn predicted_ms(
    shares: &[u64],
    global_batch: u64,
    ranks: &[NodeId],
    local: &[u32],
    ms_per_sample: &BTreeMap<NodeId, f64>,
) -> Option<f64> {
    let times = times(ranks, ms_per_sample)?;
    // Equal shares are equal per device: a node takes its devices' samples.
    let n: u64 = (0..ranks.len()).map(|i| u64::from(local_of(local, i))).sum();
    let share = |i: usize| match shares.get(i) {
        Some(&s) => s as f64,
        None => {
            let first: u64 = (0..i).map(|j| u64::from(local_of(local, j))).sum();
            (first..first + u64::from(local_of(local, i)))
                .map(|r| global_batch / n + u64::from(r < global_batch % n))
                .sum::<u64>() as f64
        }
    };
    Some(times.iter().enumerate().map(|(i, t)| share(i) * t).fold(0.0, f64::max))
}

/// Whether moving from `current` to `next` shares is predicted to make a step [`MIN_GAIN`]
/// faster at the measured speeds.
pub fn gains_enough(
    current: &[u64],
    next: &[u64],
    global_batch: u64,
    ranks: &[NodeId],
    local: &[u32],
    ms_per_sample: &BTreeMap<NodeId, f64>,
) -> bool {
    let now = predicted_ms(current, global_batch, ranks, local, ms_per_sample);
    let then = predicted_ms(next, global_batch, ranks, local, ms_per_sample);
    matches!((now, then), (Some(a), Some(b)) if a > 0.0 && b <= a * (1.0 - MIN_GAIN))
}

/// Whether `next` differs enough from `current` to be worth an epoch change: some rank's
/// share moves by at least a twentieth of the batch (one sample at least), or one side is
/// equal shares and the other not.
pub fn worth_changing(current: &[u64], next: &[u64], global_batch: u64) -> bool {
    match (current.is_empty(), next.is_empty()) {
        (true, true) => false,
        (false, false) if current.len() == next.len() => {
            let step = (global_batch / 20).max(1);
            current.iter().zip(next).any(|(a, b)| a.abs_diff(*b) >= step)
        }
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn speeds(v: &[(NodeId, f64)]) -> BTreeMap<NodeId, f64> {
        v.iter().copied().collect()
    }

    #[test]
    fn a_slow_host_gets_a_share_in_proportion_to_its_speed() {
        let s = speeds(&[(1, 0.1), (2, 0.1), (3, 0.4)]);
        let (out, worst) = shares(64, &[1, 2, 3], &[], &s, 1.5);
        assert_eq!(out, vec![28, 28, 8]);
        assert_eq!(worst, Some((3, 4.0)));
        // Within the ratio: equal shares.
        let s = speeds(&[(1, 0.1), (2, 0.12), (3, 0.14)]);
        assert!(shares(64, &[1, 2, 3], &[], &s, 1.5).0.is_empty());
        // Off, one rank, or no measurements: equal shares.
        let s = speeds(&[(1, 0.1), (2, 0.4)]);
        assert!(shares(64, &[1, 2], &[], &s, 0.0).0.is_empty());
        assert!(shares(64, &[1], &[], &s, 1.5).0.is_empty());
        assert!(shares(64, &[5, 6], &[], &s, 1.5).0.is_empty());
        // A rank without a measurement counts as the median.
        let s = speeds(&[(1, 0.1), (2, 0.1), (3, 1.0)]);
        assert_eq!(shares(40, &[1, 2, 3, 4], &[], &s, 1.5).0.iter().sum::<u64>(), 40);
    }

    #[test]
    fn a_host_with_more_devices_is_more_ranks_not_a_faster_one() {
        // Node 1 has two devices and takes half the time per sample of node 2's one.
        let s = speeds(&[(1, 0.05), (2, 0.1)]);
        let (out, worst) = shares(60, &[1, 2], &[2, 1], &s, 1.5);
        assert!(out.is_empty(), "equal per device: {out:?}");
        assert_eq!(worst.map(|(_, x)| x), Some(1.0));
        // Equal per device: node 1 computes two thirds of the batch, as fast as node 2.
        let equal = predicted_ms(&[], 60, &[1, 2], &[2, 1], &s).unwrap();
        assert!((equal - 2.0).abs() < 1e-9, "{equal}");
        // Per node, node 2 would be the straggler: 30 samples at 0.1 ms.
        assert!((predicted_ms(&[], 60, &[1, 2], &[], &s).unwrap() - 3.0).abs() < 1e-9);
        // A device that is slow per device still gets a smaller share, and every device of
        // a node keeps a sample.
        let s = speeds(&[(1, 0.2), (2, 0.1)]);
        let (out, _) = shares(60, &[1, 2], &[2, 1], &s, 1.5);
        assert_eq!(out, vec![21, 39]);
        let (out, _) = shares(3, &[1, 2], &[2, 1], &speeds(&[(1, 100.0), (2, 0.1)]), 1.5);
        assert_eq!(out, vec![2, 1]);
    }

    #[test]
    fn changes_are_worth_an_epoch_only_when_they_move_samples() {
        assert!(!worth_changing(&[], &[], 64));
        assert!(worth_changing(&[], &[30, 30, 4], 64));
        assert!(worth_changing(&[30, 30, 4], &[], 64));
        assert!(!worth_changing(&[30, 30, 4], &[29, 31, 4], 64));
        assert!(worth_changing(&[30, 30, 4], &[26, 30, 8], 64));
    }

    proptest! {
        /// Whatever the reported times (peers' words), shares tile the batch, give every
        /// rank at least one sample, and never panic.
        #[test]
        fn shares_tile_the_batch(
            times in proptest::collection::vec(prop_oneof![Just(f64::NAN), Just(0.0), Just(-1.0), Just(f64::INFINITY), 1e-9f64..1e9], 1..9),
            batch in 1u64..100_000,
            ratio in 0.0f64..4.0,
            devices in proptest::collection::vec(1u32..9, 0..9),
        ) {
            let ranks: Vec<NodeId> = (1..=times.len() as u64).collect();
            let local: Vec<u32> = if devices.len() >= ranks.len() { devices[..ranks.len()].to_vec() } else { Vec::new() };
            let s: BTreeMap<NodeId, f64> = ranks.iter().copied().zip(times).collect();
            let (out, _) = shares(batch, &ranks, &local, &s, ratio);
            if !out.is_empty() {
                prop_assert_eq!(out.len(), ranks.len());
                prop_assert_eq!(out.iter().sum::<u64>(), batch);
                // Every device of a node keeps at least one sample.
                prop_assert!(out.iter().enumerate().all(|(i, &x)| x >= u64::from(local_of(&local, i))));
            }
        }
    }
}
