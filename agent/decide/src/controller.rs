//! The leader's reconfiguration controller: from the replicated state, the ranks' progress
//! and the time, decide which commands to propose, and say why. Pure: no I/O, no clock; the
//! agent calls it on the leader and proposes what it returns, tests call it directly.
//!
//! Rules, in order:
//! 1. A rank of the current epoch that is failed, gone or silent past the heartbeat timeout
//!    is marked failed; the next epoch starts at the highest step a survivor applied (the step
//!    in flight is abandoned), and survivors behind it copy state from the one ahead.
//! 2. A member that is leaving (notice) or draining is left out of the next epoch, which starts
//!    `lead_steps` after the furthest rank, or at the next step when the deadline is nearer
//!    than that at the measured step time. A notice a node reports before the log has it
//!    counts the same: it goes into the very next epoch (with a failure it coincides with),
//!    never behind a join or a change of shares.
//! 3. A healthy joining member is added; it copies state from a live rank. Joins come in
//!    waves (a refill of spot capacity boots dozens of hosts over seconds): newcomers are
//!    admitted together once no other has become ready for `JOIN_SETTLE_MS`, or once the
//!    first has waited `JOIN_WAVE_MAX_MS`, or at once with a change the epoch makes anyway,
//!    so a wave is one epoch (or a bounded few), not one per host.
//! 4. With fewer candidates than `min_nodes`, nothing is scheduled (a scheduled epoch naming a
//!    node that can no longer train is withdrawn): training pauses and waits.
//! 5. A member that left the current epoch (leaving, draining) is removed.
//! 6. When the job is pipelined (the job document has `pipeline` settings), the planner lays
//!    the candidates out as data x pipeline from the job's recorded profile; candidates the
//!    best layout does not use stay out as spares, and a change of layout alone (after a
//!    join that makes another layout faster) is an epoch change too.
//!
//! 7. With data parallelism, a rank whose measured time per sample is `straggler_ratio` times
//!    the fastest's, for `straggler_steps` steps of the current epoch, gets a share of each
//!    step's samples in proportion to its speed (`balance`); every epoch planned afterwards
//!    shares by speed too, and equal shares return when the hosts keep up again. A change of
//!    shares alone (the return to equal ones too) must be predicted to make steps
//!    `balance::MIN_GAIN` faster, so a speed wobbling around the ratio moves nothing. Not under AdaScale, whose gradient statistics
//!    assume equal shares.
//!
//! Ranks keep their order across epochs (survivors first, newcomers by id), so a rank's data
//! share moves as little as possible.

use crate::planner::{arrange, refit_micro_batch, PipelineJob};
use crate::policy::{BaseBatch, BatchPolicy, GradientStats};
use limpet_consensus::state::{
    Cause, ClusterState, Command, Epoch, Layout, MemberStatus, NodeId, MAX_LOCAL_RANKS,
    MAX_PIPELINE_LOCAL_RANKS,
};
use std::collections::BTreeMap;

/// Knobs of the controller.
#[derive(Clone, Debug, PartialEq)]
pub struct ControllerConfig {
    /// Fewest ranks an epoch may have; below it training pauses.
    pub min_nodes: usize,
    /// A rank not heard from for this long has failed.
    pub heartbeat_timeout_ms: u64,
    /// A planned transition starts this many steps after the furthest rank (time for the
    /// epoch to commit everywhere before anyone reaches it).
    pub lead_steps: u64,
    /// Safety margin kept before a revocation deadline.
    pub notice_margin_ms: u64,
    /// The batch / learning-rate policy.
    pub policy: BatchPolicy,
    /// The job's declared batch.
    pub base: BaseBatch,
    /// A rank this many times slower per sample than the fastest gets a smaller share (below
    /// 1: off).
    pub straggler_ratio: f64,
    /// Steps of the current epoch before its speeds count.
    pub straggler_steps: u64,
}

/// What the leader knows of one node's training.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeProgress {
    /// Steps the node has applied (the next step it trains).
    pub applied_step: u64,
    /// Milliseconds since its last heartbeat.
    pub heartbeat_age_ms: u64,
}

/// What the controller looks at.
#[derive(Clone, Debug)]
pub struct View<'a> {
    /// The replicated state.
    pub state: &'a ClusterState,
    /// Now, unix milliseconds.
    pub now_ms: u64,
    /// Per-node progress (absent: never heard from).
    pub progress: &'a BTreeMap<NodeId, NodeProgress>,
    /// Measured time of one training step (0 when unknown).
    pub step_time_ms: f64,
    /// Gradient statistics for AdaScale.
    pub grad_stats: Option<GradientStats>,
    /// A rank reports that the current epoch's group broke although every rank is alive:
    /// rebuild it with the same ranks, from the furthest rank's step.
    pub rebuild: bool,
    /// Milliseconds per sample each rank of the current epoch measured (its own words).
    pub ms_per_sample: &'a BTreeMap<NodeId, f64>,
    /// Revocation notices nodes report having seen (their own words, about themselves) that
    /// the log may not have yet. A notice proposed to a leader
    /// that just died is lost until the node proposes it again; planned from the report,
    /// the node's leave goes into the very next epoch all the same.
    pub notices: &'a BTreeMap<NodeId, crate::report::PendingNotice>,
    /// When the leader first heard each node outside the current epoch report in time
    /// (unix ms): joins are admitted in waves (rule 3). A node absent has been ready since
    /// ever.
    pub ready_since: &'a BTreeMap<NodeId, u64>,
    /// The layout a pipelined job was last given, kept between rounds (absent: worked out
    /// afresh every round).
    pub layouts: Option<&'a LayoutMemo>,
}

/// A pipelined job's layout (the planner's search and the hosts' placement), with what it
/// was worked out from: the candidates, their measured speeds and devices, the current
/// epoch and the job. The leader keeps it between rounds, so a round in which none of these
/// changed reuses it: the planner runs on a change, not every 50 ms.
#[derive(Debug, Default)]
pub struct LayoutMemo {
    last: std::sync::Mutex<Option<(LayoutKey, Laid)>>,
    runs: std::sync::atomic::AtomicU64,
}

impl Clone for LayoutMemo {
    fn clone(&self) -> Self {
        let last = self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let runs = self.runs.load(std::sync::atomic::Ordering::Relaxed);
        LayoutMemo { last: std::sync::Mutex::new(last), runs: runs.into() }
    }
}

impl LayoutMemo {
    /// How many times the layout was worked out rather than reused.
    pub fn runs(&self) -> u64 {
        self.runs.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// What a pipelined job's layout depends on besides the leader's fixed settings.
#[derive(Clone, Debug, PartialEq)]
struct LayoutKey {
    /// The job's `pipeline` document (set once with the job; compared, not parsed).
    pipeline: serde_json::Value,
    candidates: Vec<NodeId>,
    /// Each candidate's measured speed and usable devices.
    hosts: Vec<(u64, u32)>,
    /// The current epoch (an epoch never changes once started).
    current: Option<u64>,
    /// The settings a layout reads (not the lead in steps, which follows the step time).
    min_nodes: usize,
    policy: BatchPolicy,
    base: BaseBatch,
}

type Laid = Result<(Vec<NodeId>, Layout, Option<u64>), String>;

/// Joins are admitted in waves: newcomers wait until none has become ready for this long...
pub const JOIN_SETTLE_MS: u64 = 300;
/// ...or until the first of them has waited this long, whichever is sooner. A change the
/// epoch makes anyway (a failure, a notice, a drain) takes every ready newcomer at once.
pub const JOIN_WAVE_MAX_MS: u64 = 3000;
/// The cluster's first epoch waits for its founders (the bootstrap's members) up to this long
/// after the first was ready, not `JOIN_WAVE_MAX_MS`: a fleet's hosts boot over tens of
/// seconds (libtorch alone takes seconds to load on a busy host), and a founder a few seconds
/// late would otherwise miss the first epoch and cost the cluster a join epoch at once.
pub const FORM_WAIT_MS: u64 = 30_000;

/// The controller's answer: commands to propose (maybe none) and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// To propose, in order.
    pub commands: Vec<Command>,
    /// Why (logged when it changes, shown in `limpet status`).
    pub reason: String,
}

impl View<'_> {
    fn healthy(&self, id: NodeId, cfg: &ControllerConfig) -> bool {
        self.progress.get(&id).is_some_and(|p| p.heartbeat_age_ms <= cfg.heartbeat_timeout_ms)
    }

    fn status(&self, id: NodeId) -> Option<MemberStatus> {
        self.state.members.get(&id).map(|m| m.status)
    }

    fn applied(&self, id: NodeId) -> u64 {
        self.progress.get(&id).map_or(0, |p| p.applied_step)
    }
}

/// Decides what to propose now.
pub fn decide(view: &View<'_>, cfg: &ControllerConfig) -> Decision {
    let st = view.state;
    if st.job.is_none() {
        return wait("no job set yet");
    }
    let current_ranks: Vec<NodeId> = st.current.as_ref().map(|e| e.ranks.clone()).unwrap_or_default();
    let mut commands = Vec::new();
    let mut causes = Vec::new();

    // 1. Failures among the current ranks.
    let failed = failures(view, cfg, &current_ranks, &mut commands, &mut causes);

    // 2-3. Who trains next: survivors in order, then healthy newcomers by id, a wave of
    // joins once it settled.
    let (mut ranks, mut newcomers) = candidates(view, cfg, &current_ranks, &failed, &mut causes);
    let waiting = join_wave_waits(view, &newcomers, causes.is_empty() && failed.is_empty());
    if waiting {
        // Those an epoch already scheduled takes stay in it (ranks may have entered it); the
        // others wait for the next wave.
        let planned = st.scheduled.as_ref().map(|e| e.ranks.as_slice()).unwrap_or_default();
        ranks.retain(|r| !newcomers.contains(r) || planned.contains(r));
        newcomers.retain(|n| planned.contains(n));
    }
    // 6. With a pipelined job the planner lays the candidates out; some may stay spares.
    let (ranks, layout, micro) = match lay_out(view, cfg, ranks) {
        Ok(l) => l,
        Err(why) => return wait(&why),
    };
    for &n in newcomers.iter().filter(|n| ranks.contains(n)) {
        causes.push(Cause::Join { node: n });
    }

    // 5. Members that left the current epoch are removed.
    commands.extend(removals(st, &current_ranks));

    if view.rebuild && failed.is_empty() && ranks == current_ranks {
        causes.push(Cause::Rebuild);
    }
    let rebuild = view.rebuild && failed.is_empty() && ranks == current_ranks;
    let same_layout = st.current.as_ref().is_none_or(|c| c.layout == layout);
    // A host whose devices are not what the current epoch counts (it came back with fewer
    // GPUs; in a pipeline, the host with the fewest changed): the same ranks, counted again.
    let recount = st.current.as_ref().is_some_and(|c| {
        let due = epoch_local_ranks(st, &c.ranks, &c.layout);
        c.ranks == ranks
            && (0..c.ranks.len()).any(|i| c.local_ranks_of(i) != due.get(i).copied().unwrap_or(1))
    });
    if recount && failed.is_empty() && !rebuild {
        causes.push(Cause::Replan { data: layout.data, pipeline: layout.pipeline });
    }
    // 7. The same ranks, shared out by speed.
    let unchanged = ranks == current_ranks && same_layout && failed.is_empty() && !rebuild && !recount;
    // (An epoch already scheduled for the same ranks is left to start: ranks may have
    // entered it.)
    if let Some(c) = rebalance(view, cfg, &ranks).filter(|_| unchanged && st.scheduled.is_none()) {
        causes.push(c);
    }
    let rebalancing = causes.iter().any(|c| matches!(c, Cause::Balance { .. }));
    if unchanged && st.current.is_some() && !rebalancing {
        // A pending change that no longer applies (its newcomer left again) is withdrawn. One
        // for the same ranks and layout (shares by speed, a rebuild) stands: its ranks may
        // have entered it already, and it takes no one who cannot come.
        if let Some(s) = st.scheduled.as_ref().filter(|s| s.ranks != ranks || s.layout != layout) {
            commands.push(Command::CancelEpoch {
                id: s.id,
                reason: "the change it made no longer applies".into(),
            });
        }
        let reason = if waiting {
            format!(
                "steady; newcomers wait for their wave to settle (no other ready for {JOIN_SETTLE_MS} ms, at most {JOIN_WAVE_MAX_MS} ms)"
            )
        } else {
            "steady".into()
        };
        return Decision { commands, reason };
    }
    if ranks.len() < cfg.min_nodes.max(1) {
        // A scheduled epoch naming a node that can no longer train is withdrawn.
        if let Some(s) = &st.scheduled {
            if s.ranks.iter().any(|r| !ranks.contains(r)) {
                commands.push(Command::CancelEpoch { id: s.id, reason: "too few healthy nodes".into() });
            }
        }
        let reason = format!(
            "paused: {} healthy node(s), at least {} needed{}",
            ranks.len(),
            cfg.min_nodes.max(1),
            if causes.is_empty() { String::new() } else { format!(" ({})", Cause::text(&causes)) }
        );
        return Decision { commands, reason };
    }
    if let Some(s) = &st.scheduled {
        // A scheduled epoch that already has exactly these ranks stands.
        if s.ranks == ranks && s.layout == layout && !(rebuild && s.start_step > max_applied(view, &ranks)) {
            return Decision {
                commands,
                reason: format!("epoch {} scheduled at step {}", s.id, s.start_step),
            };
        }
    }

    if st.current.is_none() {
        causes.clear();
    }
    if causes.is_empty() && st.current.is_some() {
        causes.push(Cause::Replan { data: layout.data, pipeline: layout.pipeline });
    }
    let epoch = plan_epoch(view, cfg, (&ranks, layout, micro), &current_ranks, &failed, rebuild, causes);
    let reason = format!("epoch {} at step {}: {}", epoch.id, epoch.start_step, epoch.cause);
    commands.push(Command::ScheduleEpoch { epoch });
    Decision { commands, reason }
}

/// The nodes that may train next: the current ranks still healthy and staying, in order,
/// then healthy newcomers by id (returned apart too). A current rank left out for its status
/// (a notice, a drain) adds that cause; failed ranks already have theirs.
fn candidates(
    view: &View<'_>,
    cfg: &ControllerConfig,
    current_ranks: &[NodeId],
    failed: &[NodeId],
    causes: &mut Vec<Cause>,
) -> (Vec<NodeId>, Vec<NodeId>) {
    let st = view.state;
    let candidate = |id: NodeId| {
        view.status(id).is_some_and(MemberStatus::is_staying)
            && view.healthy(id, cfg)
            && !failed.contains(&id)
            && !view.notices.contains_key(&id)
    };
    let mut ranks: Vec<NodeId> = current_ranks.iter().copied().filter(|&r| candidate(r)).collect();
    for &r in current_ranks {
        if !failed.contains(&r) && !candidate(r) {
            let m = &st.members[&r];
            let reported = view.notices.get(&r).filter(|_| m.status.is_staying() && view.healthy(r, cfg));
            causes.push(match (reported, m.status) {
                (Some(n), _) => Cause::Notice {
                    node: r,
                    reason: format!("reported: {} notice, deadline {}", n.source, n.deadline_ms),
                },
                (None, MemberStatus::Leaving) => Cause::Notice { node: r, reason: m.reason.clone() },
                (None, MemberStatus::Draining) => Cause::Drain { node: r },
                (None, status) => Cause::Unavailable { node: r, status },
            });
        }
    }
    let newcomers: Vec<NodeId> =
        st.members.keys().copied().filter(|id| !current_ranks.contains(id) && candidate(*id)).collect();
    ranks.extend(&newcomers);
    (ranks, newcomers)
}

/// Whether `newcomers` wait for their wave to settle: only when nothing else changes the
/// epoch (`alone`), and until no newcomer became ready within `JOIN_SETTLE_MS` or the first
/// has waited `JOIN_WAVE_MAX_MS`.
/// The cluster's first epoch waits instead for every member still staying (its founders)
/// to be ready, at most `FORM_WAIT_MS`: a cluster forms whole, not with whoever booted first.
fn join_wave_waits(view: &View<'_>, newcomers: &[NodeId], alone: bool) -> bool {
    if newcomers.is_empty() || !alone {
        return false;
    }
    let since: Vec<u64> = newcomers.iter().filter_map(|n| view.ready_since.get(n).copied()).collect();
    let (Some(&first), Some(&last)) = (since.iter().min(), since.iter().max()) else { return false };
    let waited = |t: u64| view.now_ms.saturating_sub(t);
    if view.state.current.is_none() {
        let st = view.state;
        return waited(first) < FORM_WAIT_MS
            && st.members.values().any(|m| m.status.is_staying() && !newcomers.contains(&m.spec.id));
    }
    waited(first) < JOIN_WAVE_MAX_MS && waited(last) < JOIN_SETTLE_MS
}

/// Fills the `slots` rank slots of `layout` (data-major) from `candidates`, slot by slot
/// giving each the free candidate whose blocks in the `current` epoch overlap the slot's
/// blocks most (ties: candidates' order). So survivors keep their stages, blocks move only
/// where they must, and a stage's last live holder is never left out as a spare while a
/// host without its blocks trains it.
fn place_holders(
    candidates: &[NodeId],
    slots: usize,
    layout: &Layout,
    current: Option<&Epoch>,
    blocks: usize,
) -> Vec<NodeId> {
    let held = |id: NodeId| -> std::ops::Range<usize> {
        let Some(cur) = current else { return 0..0 };
        let Some(i) = cur.ranks.iter().position(|&r| r == id) else { return 0..0 };
        let stages = cur.layout.stage_blocks(blocks).unwrap_or_else(|_| std::iter::once(0..blocks).collect());
        stages[i % stages.len()].clone()
    };
    let stages = layout.stage_blocks(blocks).unwrap_or_else(|_| std::iter::once(0..blocks).collect());
    let overlap = |id: NodeId, slot: usize| {
        let (h, want) = (held(id), &stages[slot % stages.len()]);
        h.end.min(want.end).saturating_sub(h.start.max(want.start))
    };
    // Greedy over all (slot, host) pairs: the largest overlap first, ties to the earlier
    // slot and the earlier candidate.
    let mut out: Vec<Option<NodeId>> = vec![None; slots];
    let mut free: Vec<NodeId> = candidates.to_vec();
    while let Some((slot, k)) = (0..slots)
        .filter(|&i| out[i].is_none())
        .flat_map(|i| (0..free.len()).map(move |k| (i, k)))
        .max_by_key(|&(i, k)| (overlap(free[k], i), std::cmp::Reverse(i), std::cmp::Reverse(k)))
    {
        out[slot] = Some(free.remove(k));
    }
    out.into_iter().map(|r| r.expect("enough candidates")).collect()
}

/// The current ranks that failed: dead in the log, or silent past the timeout. A newly
/// failed one is marked failed; each is a cause of the next epoch.
fn failures(
    view: &View<'_>,
    cfg: &ControllerConfig,
    current_ranks: &[NodeId],
    commands: &mut Vec<Command>,
    causes: &mut Vec<Cause>,
) -> Vec<NodeId> {
    let mut failed = Vec::new();
    for &r in current_ranks {
        let status = view.status(r);
        let dead =
            matches!(status, None | Some(MemberStatus::Failed | MemberStatus::Gone)) || !view.healthy(r, cfg);
        if dead {
            failed.push(r);
            let leaving = matches!(status, Some(MemberStatus::Draining | MemberStatus::Leaving));
            if !matches!(status, None | Some(MemberStatus::Failed | MemberStatus::Gone)) {
                let why = match view.progress.get(&r) {
                    Some(p) if p.heartbeat_age_ms == u64::MAX => {
                        "its port refuses the leader, or a peer's collective failed on it and it went silent"
                            .to_string()
                    }
                    Some(p) => format!("no heartbeat for {:.1} s", p.heartbeat_age_ms as f64 / 1e3),
                    None => "never heard from".to_string(),
                };
                // A member on its way out (drained, or under a notice) that goes silent
                // before its last epoch ends is not marked failed: once out of the epochs it
                // is removed, where a failed record would stay a member (whose heartbeats
                // are still taken) for good.
                if !leaving {
                    commands.push(Command::MarkFailed { id: r, reason: why.clone() });
                }
                causes.push(Cause::Failure { node: r, why: Some(why) });
            } else {
                causes.push(Cause::Failure { node: r, why: None });
            }
        }
    }
    failed
}

/// The job's pipeline settings (the profile the planner uses), if it is pipelined and they
/// read.
pub fn pipeline_job(st: &ClusterState) -> Option<PipelineJob> {
    serde_json::from_value(st.job.as_ref()?.get("pipeline")?.clone()).ok()
}

/// The candidates' layout: data parallelism, or for a pipelined job the planner's layout
/// with its micro-batch and the candidates it places (spares left out). The error says why
/// the cluster pauses instead.
fn lay_out(view: &View<'_>, cfg: &ControllerConfig, ranks: Vec<NodeId>) -> Laid {
    let st = view.state;
    let (Some(memo), Some(pipeline)) = (view.layouts, st.job.as_ref().and_then(|j| j.get("pipeline"))) else {
        return work_out_layout(view, cfg, ranks);
    };
    let hosts = ranks
        .iter()
        .map(|r| (st.members.get(r).map_or(0, |m| m.spec.hardware.speed_milli), usable_ranks(st, *r)))
        .collect();
    let current = st.current.as_ref().map(|e| e.id);
    let mut last = memo.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((k, laid)) = last.as_ref() {
        let same = k.candidates == ranks && k.hosts == hosts && k.current == current;
        let settings = (k.min_nodes, k.policy, k.base) == (cfg.min_nodes, cfg.policy, cfg.base);
        if same && settings && k.pipeline == *pipeline {
            return laid.clone();
        }
    }
    memo.runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let key = LayoutKey {
        pipeline: pipeline.clone(),
        candidates: ranks.clone(),
        hosts,
        current,
        min_nodes: cfg.min_nodes,
        policy: cfg.policy,
        base: cfg.base,
    };
    let laid = work_out_layout(view, cfg, ranks);
    *last = Some((key, laid.clone()));
    laid
}

/// [`lay_out`] without the memo.
fn work_out_layout(view: &View<'_>, cfg: &ControllerConfig, mut ranks: Vec<NodeId>) -> Laid {
    let st = view.state;
    let pipeline = match st.job.as_ref().and_then(|j| j.get("pipeline")) {
        None => None,
        Some(v) => match serde_json::from_value::<PipelineJob>(v.clone()) {
            Ok(p) => Some(p),
            Err(e) => return Err(format!("the job's pipeline settings are unreadable: {e}")),
        },
    };
    let mut layout = Layout::data_parallel(ranks.len());
    let mut micro = None;
    if let Some(p) = &pipeline {
        if ranks.len() >= cfg.min_nodes.max(1) {
            // Hosts measured faster or slower than the others (`Hardware::speed_milli`).
            let speeds: BTreeMap<NodeId, f64> = ranks
                .iter()
                .filter_map(|r| {
                    let milli = st.members.get(r)?.spec.hardware.speed_milli;
                    (milli != 0 && milli != 1000).then_some((*r, milli as f64 / 1000.0))
                })
                .collect();
            // Planned for the fewest devices any candidate has (what every host of the
            // pipeline then trains with), and the micro-batch picked again below for the
            // hosts placed, whose count may be larger (a spare had fewer).
            let local = pipeline_local_ranks(st, &ranks) as usize;
            match arrange(p, &ranks, step_batch(cfg, local), &speeds) {
                // Measured speeds wobble: the current layout stays unless the new one is
                // predicted clearly faster on the same hosts.
                Ok((_, plan)) if keeps_current(p, st, &ranks, &plan, cfg, &speeds) => {
                    let cur = st.current.as_ref().expect("checked by keeps_current");
                    return Ok((cur.ranks.clone(), cur.layout.clone(), Some(cur.batch.micro_batch)));
                }
                Ok((arranged, plan)) => {
                    layout = Layout {
                        data: plan.layout.data as u32,
                        pipeline: plan.layout.pipeline() as u32,
                        cuts: plan.layout.cuts().iter().map(|&c| c as u32).collect(),
                    };
                    // Hosts of one speed are interchangeable: put them where their blocks
                    // already are. Hosts of different speeds go where the planner put them.
                    ranks = if speeds.is_empty() {
                        place_holders(
                            &ranks,
                            arranged.len(),
                            &layout,
                            st.current.as_ref(),
                            p.profile.blocks.len(),
                        )
                    } else {
                        arranged
                    };
                    let placed = pipeline_local_ranks(st, &ranks) as usize;
                    let mut n = plan.layout.micro_batch;
                    if placed != local && layout.pipeline > 1 {
                        let cuts: Vec<usize> = layout.cuts.iter().map(|&c| c as usize).collect();
                        let shape = (layout.data as usize, cuts.as_slice());
                        if let Ok(refit) =
                            refit_micro_batch(p, &ranks, shape, step_batch(cfg, placed), &speeds)
                        {
                            n = refit.layout.micro_batch;
                        }
                    }
                    micro = Some(n as u64);
                }
                Err(e) => return Err(format!("paused: no layout for {} node(s): {e}", ranks.len())),
            }
        }
    }
    Ok((ranks, layout, micro))
}

/// What a step of the job trains, for the planner, on hosts of `local` devices: the global
/// batch, or under a policy whose batch grows with the replicas, each replica's (what
/// [`BatchPolicy::decide`] gives one replica), whatever the layout's replicas.
fn step_batch(cfg: &ControllerConfig, local: usize) -> crate::planner::StepBatch {
    let per_replica = (cfg.policy != BatchPolicy::FixedGlobal)
        .then(|| cfg.policy.decide(cfg.base, 1, None).batch.global_batch as usize);
    crate::planner::StepBatch { global: cfg.base.global_batch as usize, per_replica, local }
}

/// The local ranks every host of a pipeline of `ranks` trains with: as many as the one with
/// the fewest, at most [`MAX_PIPELINE_LOCAL_RANKS`].
fn pipeline_local_ranks(st: &ClusterState, ranks: &[NodeId]) -> u32 {
    ranks.iter().map(|&r| usable_ranks(st, r)).min().unwrap_or(1).min(MAX_PIPELINE_LOCAL_RANKS)
}

/// A re-plan of the same hosts must be predicted this much faster than their current layout.
const REPLAN_GAIN: f64 = 0.9;

/// Whether `plan` for the current epoch's own hosts (`candidates`, as a set) is not predicted
/// clearly faster than the current layout, with measured `speeds`: then it is not worth
/// moving blocks. Only when some host's speed was measured (equal hosts re-plan as before).
fn keeps_current(
    job: &PipelineJob,
    st: &ClusterState,
    candidates: &[NodeId],
    plan: &crate::planner::Plan,
    cfg: &ControllerConfig,
    speeds: &BTreeMap<NodeId, f64>,
) -> bool {
    let Some(cur) = st.current.as_ref() else { return false };
    let mut a = cur.ranks.clone();
    let mut b = candidates.to_vec();
    a.sort_unstable();
    b.sort_unstable();
    // A host count of devices that changed changes every device's micro-batch: re-planned.
    let local = pipeline_local_ranks(st, candidates);
    if speeds.is_empty() || a != b || cur.layout.pipeline < 2 || cur.local_ranks_of(0) != local {
        return false;
    }
    let cuts: Vec<usize> = cur.layout.cuts.iter().map(|&c| c as usize).collect();
    let shape = (cur.layout.data as usize, cuts.as_slice());
    let micro = cur.batch.micro_batch as usize;
    match crate::planner::predict_epoch(
        job,
        &cur.ranks,
        shape,
        micro,
        step_batch(cfg, local as usize),
        speeds,
    ) {
        Ok(now) => plan.step_ms > REPLAN_GAIN * now.step_ms,
        Err(_) => false,
    }
}

/// Members that left (notice, drain) and are in neither the current nor the scheduled epoch
/// are removed.
fn removals(st: &ClusterState, current_ranks: &[NodeId]) -> Vec<Command> {
    let mut out = Vec::new();
    for (id, m) in &st.members {
        if matches!(m.status, MemberStatus::Leaving | MemberStatus::Draining) && !current_ranks.contains(id) {
            let in_scheduled = st.scheduled.as_ref().is_some_and(|e| e.ranks.contains(id));
            if !in_scheduled {
                out.push(Command::Remove { id: *id, reason: "left its last epoch".into() });
            }
        }
    }
    out
}

fn max_applied(view: &View<'_>, ranks: &[NodeId]) -> u64 {
    ranks.iter().map(|&r| view.applied(r)).max().unwrap_or(0)
}

/// The furthest step the survivors applied, as no one rank's report decides it: the ranks
/// of one epoch train in step, so an honest rank is at most the step in flight ahead of
/// another, and a report further ahead than that of the next furthest is one rank's word
/// (a hostile one would move every boundary, or a rebuild's start, as far as it likes).
fn reported_step(view: &View<'_>, ranks: &[NodeId]) -> Option<u64> {
    let mut steps: Vec<u64> = ranks.iter().map(|&r| view.applied(r)).collect();
    steps.sort_unstable_by(|a, b| b.cmp(a));
    match steps.as_slice() {
        [] => None,
        [one] => Some(*one),
        [first, second, ..] => Some((*first).min(second.saturating_add(1))),
    }
}

fn wait(why: &str) -> Decision {
    Decision { commands: Vec::new(), reason: why.to_string() }
}

/// Whether the current epoch's ranks should share samples otherwise than they do, and why.
fn rebalance(view: &View<'_>, cfg: &ControllerConfig, ranks: &[NodeId]) -> Option<Cause> {
    let cur = view.state.current.as_ref()?;
    let on = cfg.straggler_ratio.is_finite() && cfg.straggler_ratio >= 1.0;
    if cur.layout.pipeline != 1 || cfg.policy == BatchPolicy::Adascale || !on {
        return None;
    }
    if max_applied(view, ranks).saturating_sub(cur.start_step) < cfg.straggler_steps {
        return None;
    }
    let (next, worst) = crate::balance::shares(
        cur.batch.global_batch,
        ranks,
        &cur.local_ranks,
        view.ms_per_sample,
        cfg.straggler_ratio,
    );
    let (node, slower) = worst?;
    let b = cur.batch.global_batch;
    if !crate::balance::worth_changing(&cur.shares, &next, b)
        || !crate::balance::gains_enough(&cur.shares, &next, b, ranks, &cur.local_ranks, view.ms_per_sample)
    {
        return None;
    }
    let slower_milli = if next.is_empty() { 0 } else { (slower * 1000.0).min(1e9) as u64 };
    Some(Cause::Balance { node, slower_milli })
}

/// The local ranks node `r` trains with, as its hardware record says: at most
/// [`MAX_LOCAL_RANKS`], and no more than its GPUs or (CPU ranks) its cores, since the record
/// is the node's own word.
pub fn usable_ranks(st: &ClusterState, r: NodeId) -> u32 {
    st.members.get(&r).map_or(1, |m| {
        let h = &m.spec.hardware;
        h.local_ranks().min(h.gpus.max(h.cpus).max(1)).min(MAX_LOCAL_RANKS)
    })
}

/// The local ranks each of `ranks` trains with in an epoch of `layout`, in rank order (empty
/// when every node has one): its usable ranks; in a pipeline, as many on every node as the
/// one with the fewest has (each device a replica of its node's stage, linked to the same
/// device of the neighbouring stages' nodes), at most [`MAX_PIPELINE_LOCAL_RANKS`].
fn epoch_local_ranks(st: &ClusterState, ranks: &[NodeId], layout: &Layout) -> Vec<u32> {
    let mut local_ranks: Vec<u32> = ranks.iter().map(|&r| usable_ranks(st, r)).collect();
    if layout.pipeline != 1 {
        let fewest = pipeline_local_ranks(st, ranks);
        local_ranks.iter_mut().for_each(|n| *n = fewest);
    }
    if local_ranks.iter().all(|&n| n == 1) {
        local_ranks.clear();
    }
    local_ranks
}

/// Builds the next epoch for `ranks`.
fn plan_epoch(
    view: &View<'_>,
    cfg: &ControllerConfig,
    (ranks, layout, micro): (&[NodeId], Layout, Option<u64>),
    current: &[NodeId],
    failed: &[NodeId],
    rebuild: bool,
    mut causes: Vec<Cause>,
) -> Epoch {
    let restart = !failed.is_empty() || rebuild;
    if causes.is_empty() {
        causes.push(Cause::Start);
    }
    let st = view.state;
    let cur = st.current.as_ref();
    let floor = cur.map_or(0, |e| e.start_step);
    let survivors: Vec<NodeId> = current.iter().copied().filter(|r| ranks.contains(r)).collect();
    let furthest = survivors.iter().copied().max_by_key(|&r| (view.applied(r), std::cmp::Reverse(r)));
    let max_applied = reported_step(view, &survivors).unwrap_or(floor).max(floor);
    let start = if cur.is_none() {
        // The first epoch starts where the job stands (0, or a checkpoint's step).
        st.checkpoints.last().map_or(0, |c| c.step)
    } else if restart {
        // Abandon the step in flight: start at the furthest survivor's applied step.
        max_applied
    } else {
        // Steps come from peers' reports: a buggy or hostile one may claim any number.
        let planned = max_applied.saturating_add(cfg.lead_steps.max(1));
        let soonest_deadline = current
            .iter()
            .filter(|r| !ranks.contains(r))
            .filter_map(|r| {
                let logged = st.members.get(r).and_then(|m| m.deadline_ms);
                logged.or_else(|| view.notices.get(r).map(|n| n.deadline_ms))
            })
            .min();
        match soonest_deadline {
            Some(deadline) if view.step_time_ms > 0.0 => {
                // The leaving node trains until `start`; it must finish before its deadline.
                let budget = deadline.saturating_sub(view.now_ms.saturating_add(cfg.notice_margin_ms)) as f64;
                let steps_left = (budget / view.step_time_ms).floor() as u64;
                planned.min(max_applied.saturating_add(steps_left.max(1)))
            }
            _ => planned,
        }
    };
    let start = start.max(floor);
    // No rank trains past the job's last step, so a boundary after it would never be
    // reached: a host joining once the job is done would wait for the others for ever.
    let end = st.job.as_ref().and_then(|j| j.get("steps")).and_then(serde_json::Value::as_u64);
    let start = end.map_or(start, |end| start.min(end.max(floor)));
    // Anyone behind the start, and every newcomer, copies state from the furthest survivor.
    let mut sources = BTreeMap::new();
    if let Some(src) = furthest {
        for &r in ranks {
            // Survivors of a planned transition train up to the start themselves; after a
            // failure the start is the furthest survivor's step and the others are behind.
            let behind = restart && view.applied(r) < start;
            if r != src && (!current.contains(&r) || behind) {
                sources.insert(r, src);
            }
        }
    }
    let id = st.last_epoch_id + 1;
    let local_ranks = epoch_local_ranks(st, ranks, &layout);
    // The batch policy scales with the data-parallel hosts, as `base_world` counts them (not
    // with pipeline stages, nor with a host's devices, which split its share).
    let decision = cfg.policy.decide(cfg.base, u64::from(layout.data), view.grad_stats);
    let mut batch = decision.batch;
    if let Some(m) = micro.filter(|&m| m > 0) {
        batch.micro_batch = m;
    }
    // Data-parallel ranks share each step's samples by measured speed (equal when they keep
    // up with each other).
    let shares = if layout.pipeline == 1 && cfg.policy != BatchPolicy::Adascale {
        crate::balance::shares(
            batch.global_batch,
            ranks,
            &local_ranks,
            view.ms_per_sample,
            cfg.straggler_ratio,
        )
        .0
    } else {
        Vec::new()
    };
    Epoch {
        id,
        start_step: start,
        ranks: ranks.to_vec(),
        layout,
        batch,
        lr_scale: decision.lr_scale,
        sources,
        cause: Cause::text(&causes),
        causes,
        shares,
        local_ranks,
    }
}
