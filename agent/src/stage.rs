//! A rank's place and connections in a data x pipeline layout: which stage and replica it
//! is, a ring group among the replicas of its stage (gradients), a ring group among the
//! stages of its replica (the step's norm, loss and statistics), and the pipe links to its
//! neighbouring stages (activations and their gradients).
//!
//! Ranks are numbered data-major: rank `r * pipeline + s` is replica `r` of stage `s`.
//!
//! Hosts of several local ranks (`[node].devices`) hold their stage on each device: local
//! rank `k` of replica `r`'s host is replica `r * local + k` of `data * local`, linked to local
//! rank `k` of the neighbouring stages' hosts by pipe lane `k`, and the stage's replicas sum
//! through host memory and one ring lane per local rank between the hosts
//! (`runtime::local_ranks`).

use crate::dataplane::frame::MAX_LANES;

// A pipelined epoch's local ranks (the log's bound) each have a pipe lane.
const _: () = assert!(MAX_LANES as u32 == limpet_consensus::state::MAX_PIPELINE_LOCAL_RANKS);
use crate::dataplane::{DataPlaneError, Endpoint, Group, PipeLink};
use limpet_trainer::pipeline::{StagePosition, StageReducers};
use limpet_trainer::{LocalGroup, LocalSums, Reduce, StepStats, Trainer, TrainerError};
use std::time::Instant;

/// Everything a stage rank trains over.
pub struct StageConnections {
    /// Where this rank sits.
    pub pos: StagePosition,
    /// The replicas of this rank's stage, in replica order.
    pub replicas: Group,
    /// The stages of this rank's replica, in stage order.
    pub stages: Group,
    /// Links to the previous and next stage of this replica.
    pub link: PipeLink,
    /// Hosts of several local ranks: the replicas' ring lanes `1..local`, in lane order
    /// (empty for one).
    pub lanes: Vec<Group>,
    /// Hosts of several local ranks: pipe lanes `1..local` to the same neighbours, in lane
    /// order (empty for one).
    pub links: Vec<PipeLink>,
}

impl StageConnections {
    /// Connects this node's rank of `epoch`, whose `ranks` (node ids, data-major) form
    /// `data` replicas of a `pipeline`-stage pipeline, each host with `local` local ranks;
    /// `addrs` are their data addresses.
    pub fn connect(
        ep: &Endpoint,
        epoch: u64,
        layout: (usize, usize, usize),
        ranks: &[u64],
        addrs: &[String],
        deadline: Instant,
        abort: &dyn Fn() -> bool,
    ) -> Result<StageConnections, DataPlaneError> {
        StageConnections::connect_with(ep, epoch, layout, ranks, addrs, (deadline, abort), true)
    }

    /// As [`StageConnections::connect`], the groups with butterfly links only if `tree`
    /// (see [`Endpoint::group_until_with`]).
    pub fn connect_with(
        ep: &Endpoint,
        epoch: u64,
        (data, pipeline, local): (usize, usize, usize),
        ranks: &[u64],
        addrs: &[String],
        (deadline, abort): (Instant, &dyn Fn() -> bool),
        tree: bool,
    ) -> Result<StageConnections, DataPlaneError> {
        if data == 0
            || pipeline == 0
            || data * pipeline != ranks.len()
            || addrs.len() != ranks.len()
            || !(1..=MAX_LANES).contains(&local)
        {
            return Err(DataPlaneError::Config(format!(
                "a {data}x{pipeline} layout of hosts of {local} local ranks over {} ranks and {} addresses",
                ranks.len(),
                addrs.len()
            )));
        }
        let me = ep.config().node;
        let i = ranks
            .iter()
            .position(|&r| r == me)
            .ok_or_else(|| DataPlaneError::Config(format!("node {me} is not in the rank order {ranks:?}")))?;
        let (replica, stage) = (i / pipeline, i % pipeline);
        let at = |r: usize, s: usize| r * pipeline + s;
        let pick = |idx: Vec<usize>| -> (Vec<u64>, Vec<String>) {
            (idx.iter().map(|&k| ranks[k]).collect(), idx.iter().map(|&k| addrs[k].clone()).collect())
        };
        let (rep_ranks, rep_addrs) = pick((0..data).map(|r| at(r, stage)).collect());
        let (st_ranks, st_addrs) = pick((0..pipeline).map(|s| at(replica, s)).collect());
        let replicas = ep.group_until_with(epoch, &rep_ranks, &rep_addrs, (deadline, abort), tree)?;
        let lanes = if local > 1 {
            crate::dataplane::lanes::connect(ep, epoch, &rep_ranks, &rep_addrs, local, deadline, abort)?
        } else {
            Vec::new()
        };
        let stages = ep.group_until_with(epoch, &st_ranks, &st_addrs, (deadline, abort), tree)?;
        let prev = (stage > 0).then(|| ranks[at(replica, stage - 1)]);
        let next = (stage + 1 < pipeline)
            .then(|| (ranks[at(replica, stage + 1)], addrs[at(replica, stage + 1)].as_str()));
        let link = PipeLink::connect(ep, epoch, prev, next, deadline, abort)?;
        let links = (1..local)
            .map(|k| PipeLink::connect_lane(ep, epoch, (prev, next), k, deadline, abort))
            .collect::<Result<Vec<_>, _>>()?;
        let pos = StagePosition { stage, stages: pipeline, replica, replicas: data };
        Ok(StageConnections { pos, replicas, stages, link, lanes, links })
    }

    /// Local ranks per host these connections were made for.
    pub fn local_ranks(&self) -> usize {
        1 + self.links.len()
    }

    /// Local rank `k`'s place: replica `replica * local + k` of `replicas * local`.
    pub fn position_of(&self, k: usize) -> StagePosition {
        let local = self.local_ranks();
        StagePosition {
            replica: self.pos.replica * local + k,
            replicas: self.pos.replicas * local,
            ..self.pos
        }
    }

    /// One pipelined step of `trainer` over these connections.
    pub fn step(
        &mut self,
        trainer: &mut limpet_trainer::Trainer,
    ) -> Result<limpet_trainer::StepStats, limpet_trainer::TrainerError> {
        trainer.pipeline_step(
            self.pos,
            &mut self.link,
            StageReducers { replicas: &mut self.replicas, stages: &mut self.stages },
        )
    }
}

impl StageConnections {
    /// One pipelined step of a host's local ranks over these connections: `leader` (local
    /// rank 0, on this thread, over the host's own links) and the first `local - 1` of
    /// `followers`, each on `pool` over its pipe lane and ring lane, a replica of its own.
    /// Each follower first takes the leader's plan (and its state, when it does not hold it:
    /// after an entry, say, which may also have changed the stage's blocks). The replicas'
    /// gradients are summed through host memory (`sums`) and the lanes; the stages' three
    /// scalars, alike on every local rank after that sum, cross the stages once, on the
    /// leader's ring. The leader's stats.
    pub fn step_local(
        &mut self,
        leader: &mut Trainer,
        followers: &mut [Trainer],
        sums: &LocalSums,
        pool: &rayon::ThreadPool,
    ) -> Result<StepStats, TrainerError> {
        let local = self.local_ranks();
        if followers.len() + 1 < local {
            // The epoch counts more devices than this host trains with (its record is older
            // than this process: a host back with fewer): the group cannot train, as in data
            // parallelism (`local_ranks::step`), until the record and the count agree again.
            return Err(TrainerError::Reduce {
                peer: None,
                detail: format!(
                    "{local} pipe lanes connected for a host of {} device(s)",
                    1 + followers.len()
                ),
                violation: true,
            });
        }
        let followers = &mut followers[..local - 1];
        for f in followers.iter_mut() {
            f.follow(leader)?;
        }
        let positions: Vec<StagePosition> = (0..local).map(|k| self.position_of(k)).collect();
        let StageConnections { pos, replicas, stages, link, lanes, links } = self;
        let replica_sum =
            LocalGroup::of_host_counts(local, pos.replica * local, local, sums, vec![local; pos.replicas]);
        // Three scalars: no lanes, and memory of their own.
        let stage_sum = LocalGroup::of_host_counts(
            local,
            pos.stage * local,
            1,
            &LocalSums::default(),
            vec![local; pos.stages],
        );
        let mut theirs: Vec<Option<Result<StepStats, TrainerError>>> =
            followers.iter().map(|_| None).collect();
        let mine = pool.in_place_scope(|s| {
            let parts =
                followers.iter_mut().zip(links.iter_mut()).zip(lanes.iter_mut()).zip(theirs.iter_mut());
            for (i, (((f, link), lane), slot)) in parts.enumerate() {
                let (replica_sum, stage_sum, at) = (&replica_sum, &stage_sum, positions[i + 1]);
                s.spawn(move |_| {
                    let mut over_replicas = replica_sum.rank(i + 1, Some(lane as &mut (dyn Reduce + Send)));
                    let mut over_stages = Silent(stage_sum.rank(i + 1, None));
                    let reduce = StageReducers { replicas: &mut over_replicas, stages: &mut over_stages };
                    *slot = Some(caught(i + 1, || f.pipeline_step(at, link, reduce)));
                });
            }
            let mut over_replicas = replica_sum.rank(0, Some(replicas as &mut (dyn Reduce + Send)));
            let mut over_stages = stage_sum.rank(0, Some(stages as &mut (dyn Reduce + Send)));
            let reduce = StageReducers { replicas: &mut over_replicas, stages: &mut over_stages };
            leader.pipeline_step(positions[0], link, reduce)
        });
        // A local rank's own failure (not a link's or a ring's) is the host's: fatal, as the
        // first device's would be. A failed link or ring is every local rank's, reported once:
        // the first device's, unless it names no peer and another's does (a neighbour that
        // broke pipe lane k is named by local rank k; the first device only saw it leave).
        let mut named = None;
        for r in theirs.into_iter().map(|r| r.expect("the scope ran every local rank")) {
            match r {
                Err(e @ TrainerError::Reduce { peer: Some(_), .. }) => named = named.or(Some(e)),
                Err(TrainerError::Reduce { .. }) | Ok(_) => {}
                Err(e) => return Err(e),
            }
        }
        match (mine, named) {
            (Err(TrainerError::Reduce { peer: None, .. }), Some(e)) => Err(e),
            (mine, _) => mine,
        }
    }
}

/// The longest own work (forward and backward, without waiting on peers) of the last step of
/// a host's `local` local ranks (`leader` and the first of `followers`), in milliseconds: what
/// the host's speed is judged by.
pub(crate) fn slowest_compute_ms(leader: &Trainer, followers: &[Trainer], local: usize) -> f64 {
    followers
        .iter()
        .take(local.saturating_sub(1))
        .map(Trainer::compute_ms)
        .fold(leader.compute_ms(), f64::max)
}

/// Local rank `rank`'s step `f`, a panic of it made its error (the host's other ranks then
/// see the group aborted rather than wait).
pub(crate) fn caught(
    rank: usize,
    f: impl FnOnce() -> Result<StepStats, TrainerError>,
) -> Result<StepStats, TrainerError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        Err(TrainerError::Config(format!("local rank {rank} panicked: {}", panic_text(&panic))))
    })
}

/// A follower's side of its replica's sum over the stages, when the leader speaks for the
/// host: every local rank holds the same three scalars after the replicas' sum, so the
/// others add zeros and the host's sum is the leader's values, as a host of one rank sends.
struct Silent<R>(R);

impl<R: Reduce> Reduce for Silent<R> {
    fn allreduce_sum(&mut self, buf: &mut [f32], step: u64) -> Result<(), TrainerError> {
        buf.fill(0.0);
        self.0.allreduce_sum(buf, step)
    }
}

/// What a panic said, if it said it in words.
pub(crate) fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// Profiles `job`'s model on `device` of this host for the planner: every block's costs at
/// the job's micro-batch, and the step's time outside the blocks.
pub fn profile_model(
    job: &limpet_trainer::JobSpec,
    data: &limpet_trainer::data::Dataset,
    reps: usize,
    device: limpet_trainer::device::Device,
) -> Result<crate::planner::ModelProfile, limpet_trainer::TrainerError> {
    let blocks = limpet_trainer::profile::profile_blocks(job, data, reps, device)?;
    let overhead_ms = limpet_trainer::profile::profile_step_overhead(job, data, &blocks, reps, device)?;
    let model = serde_json::to_value(&job.model)
        .ok()
        .and_then(|v| v["kind"].as_str().map(str::to_string))
        .unwrap_or_else(|| "model".into());
    Ok(crate::planner::ModelProfile { model, micro_batch: job.micro_batch, blocks, overhead_ms })
}
