//! One step of a host's local ranks (`[node].devices`): each device's trainer on a thread of
//! its own, the host's sum through host memory, and between hosts one ring lane per local
//! rank of the host with the fewest, driven at once ([`limpet_trainer::LocalGroup`]).
//!
//! The first device's trainer is the host's: entries, checkpoints, handoffs and status read
//! it. The others follow it: before a step each copies its state when it was replaced (an
//! entry, a checkpoint) or is at another step, and takes its plan; after a step every local
//! rank applied the same reduced bytes, so their states stay equal without a copy. With
//! sharded state each device holds its own blocks instead, and takes only the plan; an
//! entry's and a checkpoint's collectives of sharded state run on every device at once
//! ([`each`]).
//!
//! Ranks are numbered over the epoch's devices, not its hosts ([`Epoch::first_rank_of`]), so
//! shares and a reproducible job's canonical shards are cut per device: two hosts of two
//! devices compute what four hosts of one do.

use crate::dataplane::frame::MAX_LANES;
use crate::stage::{caught, panic_text, slowest_compute_ms};
use crate::Group;
use limpet_consensus::state::Epoch;
use limpet_trainer::{LocalGroup, LocalSums, Reduce, StepMode, StepStats, Trainer, TrainerError};
use std::time::Instant;

/// The ring lanes between the hosts of `epoch`: one per local rank of the host with the
/// fewest (at most [`MAX_LANES`]), one without local ranks or with one host. A function of
/// the epoch alone, so every host connects and drives the same lanes.
pub(super) fn lanes_of(epoch: &Epoch) -> usize {
    if epoch.ranks.len() < 2 || epoch.local_ranks.is_empty() {
        return 1;
    }
    let fewest = (0..epoch.ranks.len()).map(|i| epoch.local_ranks_of(i) as usize).min().unwrap_or(1);
    fewest.clamp(1, MAX_LANES)
}

/// What one step of a host's local ranks did besides the update.
pub(super) struct LocalStep {
    /// Samples the host's local ranks computed.
    pub samples: usize,
    /// The longest local rank's own work (forward and backward), in milliseconds.
    pub compute_ms: f64,
}

/// Makes every local rank hold the host's state (`leader`'s), copied tensor by tensor from
/// device to device by each local rank that does not hold it yet. What an entry does before
/// its barrier, so the other hosts do not wait for the copies inside the next step's
/// collective.
pub(super) fn sync(leader: &Trainer, followers: &mut [Trainer]) -> Result<(), TrainerError> {
    if followers.iter().all(|f| f.follows(leader)) {
        return Ok(());
    }
    let started = Instant::now();
    let mut copied = 0;
    for f in followers.iter_mut() {
        copied += usize::from(f.follow(leader)?);
    }
    tracing::info!(
        step = leader.step(),
        copied,
        ms = started.elapsed().as_millis() as u64,
        "local ranks copied the host's state"
    );
    Ok(())
}

/// Runs `f` on every local rank epoch `epoch` gives node `me` at once: `leader` (local rank
/// 0, on this thread) and its followers (each on a thread of its own), each with its rank in
/// the epoch's world and its reduce, local rank 0 driving `ring` between the hosts on one
/// lane (what an entry's and a checkpoint's collectives of sharded state need: they are
/// seldom, or carry little). An epoch of one device per host runs `f` on `ring` itself.
/// What each returned, in local rank order.
pub(super) fn each<R: Send>(
    leader: &mut Trainer,
    followers: &mut [Trainer],
    epoch: &Epoch,
    me: usize,
    ring: &mut Group,
    f: impl Fn(usize, &mut Trainer, &mut (dyn Reduce + Send)) -> R + Sync,
) -> Result<Vec<R>, TrainerError> {
    let (n, first) = (epoch.local_ranks_of(me) as usize, epoch.first_rank_of(me));
    if epoch.total_ranks() == epoch.ranks.len() {
        return Ok(vec![f(first, leader, ring)]);
    }
    enough_devices(epoch, n, 1 + followers.len())?;
    // A host of one device among hosts of several still reduces as a local group: every
    // host must run each collective the same way (a relay, say: the ring's own plan on
    // one, a sum of bits through the local group on another, would not meet).
    // Every host of the epoch is told alike: sharded state's blocks group by host from the
    // counts, and hosts alike relay by host.
    let group = LocalGroup::of_host_counts(n, first, 1, &LocalSums::default(), host_counts(epoch));
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = followers[..n - 1]
            .iter_mut()
            .enumerate()
            .map(|(i, t)| {
                let mut r = group.rank(i + 1, None);
                let spawned = std::thread::Builder::new()
                    .name(format!("limpet-rank-{}", i + 1))
                    .spawn_scoped(s, move || f(first + i + 1, t, &mut r));
                (i + 1, spawned)
            })
            .collect();
        let mine = f(first, leader, &mut group.rank(0, Some(ring as &mut (dyn Reduce + Send))));
        let mut out = vec![mine];
        for (i, h) in handles {
            let joined = h
                .map_err(|e| format!("could not start local rank {i}'s thread: {e}"))
                .and_then(|h| h.join().map_err(|p| format!("local rank {i} panicked: {}", panic_text(&p))));
            out.push(joined.map_err(TrainerError::Config)?);
        }
        Ok(out)
    })
}

/// Ranks on each host of `epoch`, in host order.
pub(super) fn host_counts(epoch: &Epoch) -> Vec<usize> {
    (0..epoch.ranks.len()).map(|i| epoch.local_ranks_of(i) as usize).collect()
}

/// Whether this host trains with at least the `n` local ranks `epoch` gives it. The log
/// refuses an epoch that gives a node more ranks than its record announced, but a record can
/// be older than this process (a host back with fewer devices): the group cannot train, and
/// the leader counts the ranks again.
fn enough_devices(epoch: &Epoch, n: usize, devices: usize) -> Result<(), TrainerError> {
    if n <= devices {
        return Ok(());
    }
    Err(TrainerError::Reduce {
        peer: None,
        detail: format!(
            "epoch {} gives this host {n} local ranks, but it trains with {devices} device(s)",
            epoch.id
        ),
        violation: true,
    })
}

/// The threads a host's other local ranks step on, kept from step to step. A thread made
/// for each step paid each step what a thread's first use costs (the allocator's and the
/// BLAS library's per-thread buffers faulted in again): hosts of two devices trained at 0.91x
/// of hosts of one. A thread takes whichever local rank comes next; libtorch's per-thread
/// state stays warm either way.
#[derive(Default)]
pub(super) struct RankThreads(Option<rayon::ThreadPool>);

impl RankThreads {
    /// The pool, of `n` threads (one per local rank after the first), made if it is not.
    pub(super) fn fit(&mut self, n: usize) -> Result<&rayon::ThreadPool, TrainerError> {
        let n = n.max(1);
        if self.0.as_ref().is_none_or(|p| p.current_num_threads() != n) {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .thread_name(|i| format!("limpet-rank-{}", i + 1))
                .build()
                .map_err(|e| {
                    TrainerError::Config(format!("could not start the local ranks' threads: {e}"))
                })?;
            self.0 = Some(pool);
        }
        Ok(self.0.as_ref().expect("made above"))
    }
}

/// Trains one step on node `me` (its index in `epoch`) with its local ranks, each as `mode`
/// says: `leader` and as many of `followers` as the epoch gives it, the host's sum going
/// between hosts through `ring` (lane 0, driven by the leader) and `lanes` (lane `k`, by
/// local rank `k`).
#[allow(clippy::too_many_arguments)]
pub(super) fn step(
    mode: StepMode,
    leader: &mut Trainer,
    followers: &mut [Trainer],
    epoch: &Epoch,
    me: usize,
    (ring, lanes): (&mut Group, &mut [Group]),
    sums: &LocalSums,
    ranks: &mut RankThreads,
) -> Result<(StepStats, LocalStep), TrainerError> {
    let n = epoch.local_ranks_of(me) as usize;
    if 1 + lanes.len() != lanes_of(epoch) || lanes_of(epoch) > n {
        // Connected at the entry for this epoch's count: the group cannot train as it is,
        // and the next epoch connects again.
        return Err(TrainerError::Reduce {
            peer: None,
            detail: format!(
                "epoch {}: {} ring lanes connected, {} due, for {n} local ranks",
                epoch.id,
                1 + lanes.len(),
                lanes_of(epoch)
            ),
            violation: false,
        });
    }
    enough_devices(epoch, n, 1 + followers.len())?;
    let followers = &mut followers[..n - 1];
    let pool = ranks.fit(followers.len())?;
    let (first, world) = (epoch.first_rank_of(me), epoch.total_ranks());
    let shares = epoch.rank_shares();
    leader.set_shares(shares.clone());
    // The plan and shares; a copy of the state only after a checkpoint loaded in the loop
    // (an entry copies it before its barrier, `sync`).
    for f in followers.iter_mut() {
        f.follow(leader)?;
    }
    let plan = leader.plan();
    let samples = (first..first + n).map(|r| plan.share_in(r, world, &shares).len()).sum();
    let group = LocalGroup::of_host_counts(n, first, 1 + lanes.len(), sums, host_counts(epoch));
    let mut lanes = lanes.iter_mut();
    let mut theirs: Vec<Option<Result<StepStats, TrainerError>>> = followers.iter().map(|_| None).collect();
    let mine = pool.in_place_scope(|s| {
        for ((i, f), slot) in followers.iter_mut().enumerate().zip(theirs.iter_mut()) {
            let lane = lanes.next().map(|g| g as &mut (dyn Reduce + Send));
            let group = &group;
            s.spawn(move |_| {
                let mut r = group.rank(i + 1, lane);
                *slot = Some(caught(i + 1, || f.step_as(mode, first + i + 1, world, &mut r)));
            });
        }
        leader.step_as(mode, first, world, &mut group.rank(0, Some(ring as &mut (dyn Reduce + Send))))
    });
    let theirs = theirs.into_iter().map(|r| r.expect("the scope ran every local rank"));
    // A local rank's own failure (not the ring's) is the host's: fatal, as the first
    // device's would be. A failed ring is every local rank's, reported once.
    for r in theirs {
        if let Err(e) = r {
            if !matches!(e, TrainerError::Reduce { .. }) {
                return Err(e);
            }
        }
    }
    let stats = mine?;
    let compute_ms = slowest_compute_ms(leader, followers, n);
    Ok((stats, LocalStep { samples, compute_ms }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use limpet_consensus::state::{EpochBatch, Layout};

    fn epoch(local_ranks: Vec<u32>, hosts: u64) -> Epoch {
        Epoch {
            id: 1,
            start_step: 0,
            ranks: (1..=hosts).collect(),
            layout: Layout { data: hosts as u32, pipeline: 1, cuts: Vec::new() },
            batch: EpochBatch { global_batch: 8, micro_batch: 8 },
            lr_scale: 1.0,
            sources: Default::default(),
            cause: String::new(),
            causes: Vec::new(),
            shares: Vec::new(),
            local_ranks,
        }
    }

    #[test]
    fn an_epoch_has_a_lane_per_local_rank_of_its_host_with_the_fewest() {
        assert_eq!(lanes_of(&epoch(Vec::new(), 3)), 1, "no local ranks");
        assert_eq!(lanes_of(&epoch(vec![4], 1)), 1, "one host has nothing to cross");
        assert_eq!(lanes_of(&epoch(vec![4, 2, 3], 3)), 2, "the fewest");
        assert_eq!(lanes_of(&epoch(vec![1, 8], 2)), 1);
        assert_eq!(lanes_of(&epoch(vec![16, 16], 2)), MAX_LANES, "at most MAX_LANES");
    }
}
