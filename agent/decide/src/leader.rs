//! The leader's decisions for one round, as a pure function of what it knows: the replicated
//! state, the agents' latest reports (with their ages) and the time. From those it derives
//! the controller's inputs (which nodes are alive, how far each got, how long a step takes,
//! whether a broken group must be rebuilt), runs [`controller::decide`], and adds the
//! bookkeeping commands that follow from the reports: a scheduled epoch a rank entered
//! becomes current, a joining member that trains becomes active, and an epoch that has run
//! `MEASURE_STEPS` steps on every rank has its throughput recorded (what scaling by value
//! fits its curve to), and a host of a pipelined job measured `straggler_ratio` away from
//! its peers has its speed recorded (what the pipeline planner places blocks by).
//!
//! The runtime's leader loop only gathers the inputs, logs the reason when it changes and
//! proposes the commands; everything it decides is tested here by what this returns.

use crate::controller::{self, ControllerConfig, NodeProgress};
use crate::policy::{BaseBatch, BatchPolicy, GradientStats};
use crate::stuck::{self, Stuck};
use limpet_consensus::state::{ClusterState, Command, MemberStatus, NodeId, Throughput};
use std::collections::BTreeMap;

pub use crate::report::Reports;

/// The settings the leader's decisions depend on (from the agent's configuration).
#[derive(Clone, Debug, PartialEq)]
pub struct LeaderSettings {
    /// How often agents report, ms.
    pub heartbeat_ms: u64,
    /// Silence after which a node has failed, ms.
    pub heartbeat_timeout_ms: u64,
    /// How far ahead of the furthest rank a planned change starts, ms.
    pub lead_ms: u64,
    /// Kept before a revocation deadline, ms.
    pub notice_margin_ms: u64,
    /// Fewest nodes an epoch may have.
    pub min_nodes: usize,
    /// The batch and learning-rate policy.
    pub policy: BatchPolicy,
    /// The batch the job declared, and the world it declared it for.
    pub base: BaseBatch,
    /// A rank this many times slower per sample gets a smaller share (below 1: off).
    pub straggler_ratio: f64,
    /// Steps of an epoch before its measured speeds count.
    pub straggler_steps: u64,
}

/// What the leader does this round, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Round {
    /// Commands to propose, in order.
    pub commands: Vec<Command>,
    /// The controller's reason (logged when it changes).
    pub reason: String,
    /// The job is stuck at a step (logged as an error, a metric, shown by `limpet status`).
    pub stuck: Option<Stuck>,
}

/// Steps of lead a planned change gets when no step time has been measured yet.
const DEFAULT_LEAD_STEPS: u64 = 5;

/// Steps every rank of an epoch trains before its throughput is recorded: the ranks' step
/// times are smoothed ([`crate::speed::smooth`], a tenth per step), so the entry's slow first
/// steps weigh < 1% by then.
pub const MEASURE_STEPS: u64 = 50;

/// The leader's decisions for the state `st`, the `reports` and the time `now_ms`.
pub fn plan_round(s: &LeaderSettings, st: &ClusterState, reports: &Reports, now_ms: u64) -> Round {
    plan_round_with(s, st, reports, now_ms, &Evidence::default())
}

/// What the leader learned itself, across rounds, beside the reports.
#[derive(Clone, Debug, Default)]
pub struct Evidence {
    /// Suspects (see [`suspects`]) whose control port refused the leader's connection just
    /// now: nothing listens there.
    pub refused: std::collections::BTreeSet<NodeId>,
    /// Suspects whose control port accepted the leader's connection just now: the host is
    /// up and something listens, so the process lives, if stalled or slow.
    pub answered: std::collections::BTreeSet<NodeId>,
    /// When each node outside the current epoch was first heard reporting in time (unix
    /// ms), as [`Evidence::track_ready`] keeps it: joins are admitted in waves.
    pub ready_since: BTreeMap<NodeId, u64>,
    /// A pipelined job's last layout, reused while nothing it depends on changed.
    pub layouts: controller::LayoutMemo,
}

impl Evidence {
    /// Notes, at `now_ms`, the nodes outside the current epoch that report in time (a
    /// node's first such round starts its wait), forgetting those that train in it or went
    /// quiet.
    pub fn track_ready(&mut self, st: &ClusterState, reports: &Reports, timeout_ms: u64, now_ms: u64) {
        let ranks = st.current.as_ref().map(|e| e.ranks.as_slice()).unwrap_or_default();
        let ready: Vec<NodeId> = reports
            .iter()
            .filter(|(id, (age, _))| *age <= timeout_ms && !ranks.contains(id))
            .filter(|(id, _)| st.members.get(id).is_some_and(|m| m.status.is_staying()))
            .map(|(&id, _)| id)
            .collect();
        self.ready_since.retain(|id, _| ready.contains(id));
        for id in ready {
            self.ready_since.entry(id).or_insert(now_ms);
        }
    }
}

/// The most peers one report may name as refusing its connections (`AgentReport::refused`):
/// a rank's word costs the leader a probe each, so one rank cannot have it probe the fleet.
pub const MAX_REFUSED_NAMED: usize = 8;

/// The peers the current epoch's live ranks say their collective broke on, or whose data
/// port refused them while they connected a group (the next epoch's, say, where a peer
/// killed since is named by no broken collective): those whose liveness the leader checks
/// itself (`plan_round_with`'s `refused`).
pub fn suspects(st: &ClusterState, reports: &Reports, timeout_ms: u64) -> Vec<NodeId> {
    let Some(cur) = st.current.as_ref() else { return Vec::new() };
    let mut out: Vec<NodeId> = reports
        .values()
        .filter(|(age, r)| *age <= timeout_ms && cur.ranks.contains(&r.node))
        .flat_map(|(_, r)| {
            let broke = r.broken.as_ref().filter(|b| b.epoch == cur.id).and_then(|b| b.suspect);
            let refused = r.refused.iter().take(MAX_REFUSED_NAMED).copied();
            // A rank naming itself is no evidence (and would have the leader probe whatever
            // address it advertises).
            broke.into_iter().chain(refused).filter(move |&s| s != r.node)
        })
        .filter(|id| cur.ranks.contains(id))
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// [`plan_round`], with the evidence the leader gathered itself. A suspect whose port
/// refused (`Evidence::refused`) has nothing listening there: the process is dead (a
/// `kill -9`, a crash), and it is failed at once, without waiting for it to stay quiet. A
/// stalled process still has its port open (the kernel accepts for it,
/// `Evidence::answered`): it is alive, and only the failure timeout fails it, so a slow host
/// never takes a fast path. A suspect whose port did not answer at all (a host gone, a
/// network that drops) is failed once it has also been quiet for a few heartbeats.
/// Newcomers are admitted in waves from `Evidence::ready_since`.
pub fn plan_round_with(
    s: &LeaderSettings,
    st: &ClusterState,
    reports: &Reports,
    now_ms: u64,
    evidence: &Evidence,
) -> Round {
    let refused = &evidence.refused;
    let timeout_ms = s.heartbeat_timeout_ms;
    let cur_id = st.current.as_ref().map_or(0, |e| e.id);
    let live = || reports.values().filter(|(age, _)| *age <= timeout_ms);
    let mut progress: BTreeMap<NodeId, NodeProgress> = reports
        .iter()
        .map(|(&id, (age, r))| (id, NodeProgress { applied_step: r.applied_step, heartbeat_age_ms: *age }))
        .collect();
    // Only a rank of the epoch can say its group broke (a spare's word is no reason).
    let ranks = st.current.as_ref().map(|e| e.ranks.as_slice()).unwrap_or_default();
    // A live rank whose collective broke names the peer; if nothing listens on that peer's
    // port, or its host did not answer and it has also gone quiet for a few heartbeats, it
    // is dead: no need to wait out the whole timeout. An answering port is a live process.
    let quiet = (s.heartbeat_ms * 3).max(300);
    for (_, r) in live().filter(|(_, r)| ranks.contains(&r.node)) {
        // A peer whose data port refused a rank, and whose control port refuses the leader
        // too, is dead, in a broken collective or not (a peer killed after the ring broke
        // is named only by the next epoch's connections).
        for id in r.refused.iter().take(MAX_REFUSED_NAMED).filter(|id| refused.contains(id)) {
            if let Some(p) = progress.get_mut(id) {
                p.heartbeat_age_ms = u64::MAX;
            }
        }
        if let Some(b) = r.broken.as_ref().filter(|b| b.epoch == cur_id) {
            if let Some((id, p)) = b.suspect.and_then(|id| Some((id, progress.get_mut(&id)?))) {
                let silent = p.heartbeat_age_ms > quiet && !evidence.answered.contains(&id);
                if silent || refused.contains(&id) {
                    p.heartbeat_age_ms = u64::MAX;
                }
            }
        }
    }
    let step_time_ms = epoch_step_time(ranks, reports, timeout_ms);
    let lead_steps = if step_time_ms > 0.0 {
        ((s.lead_ms as f64 / step_time_ms).ceil() as u64).clamp(2, 100_000)
    } else {
        DEFAULT_LEAD_STEPS
    };
    // A group can also break with every node alive (a transient network fault): once a
    // rank has waited on a broken group longer than the failure timeout, rebuild it. Not
    // forever at one step: a job stuck there is rebuilt after growing pauses, and after a
    // protocol violation not at all (`stuck`).
    let stuck = stuck::assess(st, reports, timeout_ms);
    // A broken ring stops every rank of it within the collective timeout, so two ranks (one
    // in an epoch of one) must say they waited that long: one rank's `since_ms` is its word.
    let rebuild = stuck::rebuild_after_ms(stuck.as_ref(), timeout_ms).is_some_and(|after| {
        let waited = live()
            .filter(|(_, r)| {
                ranks.contains(&r.node)
                    && r.broken.as_ref().is_some_and(|b| b.epoch == cur_id && b.since_ms > after)
            })
            .count();
        waited >= ranks.len().min(2)
    });
    let ccfg = ControllerConfig {
        min_nodes: s.min_nodes,
        heartbeat_timeout_ms: timeout_ms,
        lead_steps,
        notice_margin_ms: s.notice_margin_ms,
        policy: s.policy,
        base: s.base,
        straggler_ratio: s.straggler_ratio,
        straggler_steps: s.straggler_steps,
    };
    // The nodes' own measurements of their speed (a node's property, whatever its epoch).
    let ms_per_sample: BTreeMap<NodeId, f64> =
        live().filter(|(_, r)| r.ms_per_sample > 0.0).map(|(_, r)| (r.node, r.ms_per_sample)).collect();
    // Notices nodes report about themselves, not yet in the log (a live, staying member's,
    // with a deadline still ahead: an honest node's notice stays in its reports until it has
    // gone, so a deadline in the past is no notice).
    let notices: BTreeMap<NodeId, crate::report::PendingNotice> = live()
        .filter(|(_, r)| st.members.get(&r.node).is_some_and(|m| m.status.is_staying()))
        .filter_map(|(_, r)| r.notice.clone().filter(|n| n.deadline_ms > now_ms).map(|n| (r.node, n)))
        .collect();
    let view = controller::View {
        state: st,
        now_ms,
        progress: &progress,
        step_time_ms,
        grad_stats: current_grad_stats(st, reports, timeout_ms),
        rebuild,
        ms_per_sample: &ms_per_sample,
        notices: &notices,
        ready_since: &evidence.ready_since,
        layouts: Some(&evidence.layouts),
    };
    let decision = controller::decide(&view, &ccfg);
    let mut commands = decision.commands;
    // A scheduled epoch that one of its ranks entered becomes the current one.
    if let Some(sch) = &st.scheduled {
        let entered = reports.values().any(|(_, r)| r.epoch == sch.id && sch.ranks.contains(&r.node));
        let replanned =
            commands.iter().any(|c| matches!(c, Command::ScheduleEpoch { .. } | Command::CancelEpoch { .. }));
        if entered && !replanned {
            commands.push(Command::ActivateEpoch { id: sch.id });
        }
    }
    // A joining member that trains in the current epoch is active.
    for (id, m) in &st.members {
        if m.status == MemberStatus::Joining
            && cur_id > 0
            && reports.get(id).is_some_and(|(_, r)| r.epoch == cur_id)
        {
            commands.push(Command::Activate { id: *id });
        }
    }
    if let Some(record) = measure(s, st, reports, now_ms) {
        commands.push(Command::RecordThroughput { record });
    }
    commands.extend(record_speeds(s, st, reports));
    let scheduling = commands.iter().any(|c| matches!(c, Command::ScheduleEpoch { .. }));
    let reason = match &stuck {
        Some(s) if !scheduling => s.to_string(),
        _ => decision.reason,
    };
    Round { commands, reason, stuck }
}

/// A recorded speed is changed only past this relative difference (measurements wobble).
const SPEED_CHANGE: f64 = 0.15;

/// Each live member's speed relative to the others, x 1000, where it changed: the median
/// of the members' profiles of the job's model (`profile_ms`, taken by each host when it
/// started) over its own. A pipelined job only; a speed within `straggler_ratio` of the
/// median is 1000 (noise must not move blocks around). A host's property, measured once: a
/// newcomer is placed by it from its first epoch.
fn record_speeds(s: &LeaderSettings, st: &ClusterState, reports: &Reports) -> Vec<Command> {
    let ratio = s.straggler_ratio;
    if crate::controller::pipeline_job(st).is_none() || !(ratio.is_finite() && ratio >= 1.0) {
        return Vec::new();
    }
    let raw: Vec<(NodeId, f64)> = reports
        .values()
        .filter(|(age, r)| *age <= s.heartbeat_timeout_ms && r.profile_ms > 0.0 && r.profile_ms.is_finite())
        .filter(|(_, r)| st.members.get(&r.node).is_some_and(|m| m.status.is_staying()))
        .map(|(_, r)| (r.node, 1.0 / r.profile_ms))
        .collect();
    if raw.len() < 2 {
        return Vec::new();
    }
    let mut sorted: Vec<f64> = raw.iter().map(|r| r.1).collect();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    let mut out = Vec::new();
    for (node, v) in raw {
        let rel = v / median;
        let milli = if rel > 1.0 / ratio && rel < ratio {
            1000
        } else {
            ((rel * 100.0).round() * 10.0).clamp(10.0, 100_000.0) as u64
        };
        let Some(m) = st.members.get(&node) else { continue };
        let was = if m.spec.hardware.speed_milli == 0 { 1000 } else { m.spec.hardware.speed_milli };
        if (milli as f64 / was as f64 - 1.0).abs() > SPEED_CHANGE {
            out.push(Command::RecordSpeed { id: node, speed_milli: milli });
        }
    }
    out
}

/// The current epoch's throughput, once every rank has trained `MEASURE_STEPS` steps of it
/// and reports a step time (the slowest rank's sets the pace), unless already recorded.
/// Samples that count: a step of a larger batch under `linear`, `sqrt` or `adascale`
/// counts as `lr_scale` steps of the declared batch.
fn measure(s: &LeaderSettings, st: &ClusterState, reports: &Reports, now_ms: u64) -> Option<Throughput> {
    let cur = st.current.as_ref()?;
    let world = u32::try_from(cur.ranks.len()).ok()?;
    if st.throughput.at(world).is_some_and(|t| t.epoch >= cur.id) {
        return None;
    }
    let mut step_ms = 0.0f64;
    for rank in &cur.ranks {
        let (age, r) = reports.get(rank)?;
        let trained = r.applied_step.saturating_sub(cur.start_step);
        let timed = r.step_time_ms.is_finite() && r.step_time_ms > 0.0;
        if *age > s.heartbeat_timeout_ms || r.epoch != cur.id || trained < MEASURE_STEPS || !timed {
            return None;
        }
        step_ms = step_ms.max(r.step_time_ms);
    }
    let samples = cur.batch.global_batch as f64 * 1000.0 / step_ms;
    let counted = cur.lr_scale * s.base.global_batch as f64 / cur.batch.global_batch as f64;
    let milli = |v: f64| (v * 1000.0).clamp(1.0, 1e12) as u64;
    Some(Throughput {
        world,
        epoch: cur.id,
        samples_milli: milli(samples),
        useful_milli: milli(samples * counted.min(1.0)),
        at_ms: now_ms,
    })
}

/// Gradient statistics reported by a live rank of the current epoch (all ranks compute the
/// same values).
fn current_grad_stats(st: &ClusterState, reports: &Reports, timeout_ms: u64) -> Option<GradientStats> {
    let cur = st.current.as_ref()?;
    // Every rank computes the same statistics from the same reduced gradients: the median
    // of the ranks' reports is no single rank's word.
    let stats: Vec<(f64, f64)> = cur
        .ranks
        .iter()
        .filter_map(|r| {
            let (age, rep) = reports.get(r)?;
            rep.grad_stats.filter(|_| *age <= timeout_ms && rep.epoch == cur.id)
        })
        .collect();
    let variance = median(stats.iter().map(|s| s.0).collect())?;
    let mean_sq = median(stats.iter().map(|s| s.1).collect())?;
    Some(GradientStats { variance, mean_sq })
}

/// The epoch's step time: its ranks step together, so the median of what they report
/// (a hostile rank's huge or tiny time moves it no further than an honest rank's).
fn epoch_step_time(ranks: &[NodeId], reports: &Reports, timeout_ms: u64) -> f64 {
    let times = ranks
        .iter()
        .filter_map(|r| reports.get(r).filter(|(age, _)| *age <= timeout_ms))
        .map(|(_, rep)| rep.step_time_ms)
        .filter(|t| t.is_finite() && *t > 0.0)
        .collect();
    median(times).unwrap_or(0.0)
}

/// The middle value (the lower of the middle two), or `None` for none.
fn median(mut v: Vec<f64>) -> Option<f64> {
    v.retain(|x| x.is_finite());
    v.sort_by(f64::total_cmp);
    v.get(v.len().saturating_sub(1) / 2).copied()
}
