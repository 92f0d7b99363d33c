//! The fleet reconciler's decision: from the committed log (members, earlier capacity
//! records) and what EC2 lists, the one thing to do next and why. The leader runs it on a
//! timer and records what it returns before acting, so a leader change resumes instead of
//! repeating (see `limpet_consensus::state::CapacityLog`).
//!
//! The rules, in order:
//! 1. a launch decided but not confirmed is resumed (its instances looked for, then launched
//!    with the same idempotency token);
//! 2. instances holding no live member are terminated: members gone from the cluster, and
//!    launches that never joined within `join_timeout`;
//! 3. below the target, one host is launched: spot first, in the pool with the fewest of the
//!    cluster's hosts among those without a recent capacity error; on-demand once spot has
//!    been unobtainable for `on_demand_after`;
//! 4. above the target with on-demand hosts, the newest on-demand host is drained (spot came
//!    back); a host that stays slow is drained once its replacement trains (it does not
//!    count as live until then, so rule 3 launches the replacement); scaling by value drains
//!    the newest host when the target fell;
//! 5. at the target with on-demand hosts, spot is probed every `spot_retry` (one spot host
//!    more, within `max`), which step 4 then turns into a swap;
//! 6. otherwise, hold.
//!
//! With scaling by value (`min_marginal_value`), the target is the one [`scale`] last
//! recorded (`CapacityLog::target`), chosen from the measured throughput per world size and
//! the price of a host (`crate::scaling`).

use limpet_consensus::state::{
    CapacityAction, CapacityLog, CapacityRecord, ClusterState, Market, MemberStatus, NodeId, Pool,
};
use std::collections::{BTreeMap, BTreeSet};

/// What the reconciler is told to keep.
#[derive(Clone, Debug, PartialEq)]
pub struct CapacityPolicy {
    /// Hosts wanted.
    pub target: u32,
    /// Fewest hosts (the floor scaling may not go below).
    pub min: u32,
    /// Most hosts (probes and swaps stay within it).
    pub max: u32,
    /// Where hosts may be launched, in order of preference on a tie.
    pub pools: Vec<Pool>,
    /// Launch on-demand once spot has been unobtainable this long.
    pub on_demand_after_ms: u64,
    /// While on-demand hosts run, try spot again this often.
    pub spot_retry_ms: u64,
    /// Skip a pool this long after a capacity error there (and wait this long after any
    /// other refused launch).
    pub pool_cooldown_ms: u64,
    /// A launched host that has not joined after this long is terminated.
    pub join_timeout_ms: u64,
    /// Each new host takes a spare credential (its node name); without one, no launch.
    pub spares_required: bool,
    /// Scaling by value: a host is worth adding while it adds this many samples (that
    /// count) per dollar; `None`: the target is fixed.
    pub min_marginal_value: Option<f64>,
}

impl CapacityPolicy {
    /// The number of hosts wanted now: the one scaling by value recorded last, else the
    /// configured target.
    pub fn target_now(&self, log: &CapacityLog) -> u32 {
        let chosen = self.min_marginal_value.and(log.target);
        chosen.unwrap_or(self.target).clamp(self.min, self.max.max(self.min))
    }
}

/// One of the cluster's instances, as EC2 lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Instance {
    /// Instance id.
    pub id: String,
    /// `pending`, `running`, `shutting-down`, `stopping`, `stopped`.
    pub state: String,
    /// Spot or on-demand.
    pub market: Market,
    /// Where it runs.
    pub pool: Pool,
    /// Launch time (unix milliseconds).
    pub launched_ms: Option<u64>,
    /// Its `limpet:launch` tag: the reconciler's launch that made it.
    pub launch_token: Option<String>,
    /// Its `limpet:node` tag: the node name it takes (else its instance id).
    pub node_name: Option<String>,
}

impl Instance {
    /// The name its `limpetd` runs under.
    pub fn name(&self) -> &str {
        self.node_name.as_deref().unwrap_or(&self.id)
    }

    fn alive(&self) -> bool {
        matches!(self.state.as_str(), "pending" | "running")
    }
}

/// What to do next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next {
    /// Finish launch record `seq`: look for its instances, else launch it (same token).
    Resume(u64),
    /// Record this action (then carry it out).
    Record(CapacityAction),
}

/// A decision and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// What.
    pub next: Next,
    /// Why, in words (stable while the situation is: a hold is recorded once per reason).
    pub reason: String,
    /// Live hosts counted (members joining or training, plus launches on their way).
    pub have: u32,
}

/// The idempotency token of the launch recorded as `seq` at `at_ms` in cluster `cluster`:
/// unique across clusters and across a cluster recreated under the same name.
pub fn launch_token(cluster: &str, seq: u64, at_ms: u64) -> String {
    format!("limpet-{:016x}-{seq}-{at_ms}", limpet_consensus::state::cluster_id(cluster))
}

/// The record of `d` as the next one in `log`, or `None` when `d` resumes a launch or
/// repeats the last hold.
pub fn record_of(d: &Decision, log: &CapacityLog, by: NodeId, at_ms: u64) -> Option<CapacityRecord> {
    let Next::Record(action) = &d.next else { return None };
    if *action == CapacityAction::Hold {
        if let Some(last) = log.records.last() {
            if last.action == CapacityAction::Hold && last.reason == d.reason {
                return None;
            }
        }
    }
    Some(CapacityRecord {
        seq: log.last_seq + 1,
        at_ms,
        by,
        action: action.clone(),
        reason: d.reason.clone(),
    })
}

/// The reconciler's next step.
pub fn decide(
    policy: &CapacityPolicy,
    state: &ClusterState,
    instances: &[Instance],
    spares: &[String],
    now_ms: u64,
) -> Decision {
    decide_with(policy, state, instances, spares, &[], now_ms)
}

/// The reconciler's next step when the members `slow` have stayed slow long enough to be
/// replaced: they do not count as live hosts (so a replacement is launched), and once the
/// hosts without them reach the target, the first of them is drained.
pub fn decide_with(
    policy: &CapacityPolicy,
    state: &ClusterState,
    instances: &[Instance],
    spares: &[String],
    slow: &[NodeId],
    now_ms: u64,
) -> Decision {
    let log = &state.capacity;
    let slow: Vec<NodeId> = slow
        .iter()
        .copied()
        .filter(|id| state.members.get(id).is_some_and(|m| m.status == MemberStatus::Active))
        .collect();
    let (counted, mut detail) = count(policy, state, instances, now_ms);
    let have = counted.saturating_sub(slow.len() as u32);
    if !slow.is_empty() {
        let names: Vec<String> = slow.iter().map(|id| name_of(state, *id)).collect();
        detail += &format!(" ({} slow, replacing)", names.join(", "));
    }
    let decision = |next, reason: String| Decision { next, reason, have };
    if let Some(r) = log.unresolved() {
        return decision(Next::Resume(r.seq), format!("launch {} is decided but not confirmed", r.seq));
    }

    // 2: instances that hold nothing.
    let mut stale = Vec::new();
    for i in instances.iter().filter(|i| i.alive()) {
        match state.member_named(i.name()) {
            Some(m) if m.status == MemberStatus::Gone => {
                stale.push((i.id.clone(), format!("{} left", i.name())))
            }
            Some(_) => {}
            None if i.launch_token.is_some() && past(i.launched_ms, policy.join_timeout_ms, now_ms) => {
                stale.push((i.id.clone(), format!("{} never joined", i.id)))
            }
            None => {}
        }
    }
    if !stale.is_empty() {
        let why: Vec<String> = stale.iter().map(|(_, w)| w.clone()).collect();
        let instances = stale.into_iter().map(|(id, _)| id).collect();
        return decision(Next::Record(CapacityAction::Terminate { instances }), why.join("; "));
    }

    let target = policy.target_now(log);
    let on_demand = on_demand_members(state, instances);
    let spot = spot_history(log);

    // 3: below the target.
    if have < target {
        let short = format!("{have} of {target} hosts{detail}");
        if let Some((code, at)) = last_refusal(log) {
            if now_ms < at.saturating_add(policy.pool_cooldown_ms) {
                return decision(
                    Next::Record(CapacityAction::Hold),
                    format!("{short}; EC2 refused the last launch ({code}), retrying after the cooldown"),
                );
            }
        }
        // Spot first; once spot has been unobtainable for `on_demand_after`, on-demand,
        // with one spot try every `spot_retry`.
        let fallback = spot
            .unobtainable_since
            .is_some_and(|since| now_ms.saturating_sub(since) >= policy.on_demand_after_ms);
        let spot_due =
            !fallback || spot.last_attempt.is_none_or(|t| now_ms.saturating_sub(t) >= policy.spot_retry_ms);
        let pick = spot_due
            .then(|| choose(policy, log, instances, Market::Spot, now_ms))
            .flatten()
            .map(|p| (p, Market::Spot))
            .or_else(|| {
                fallback
                    .then(|| choose(policy, log, instances, Market::OnDemand, now_ms))
                    .flatten()
                    .map(|p| (p, Market::OnDemand))
            });
        let Some((pool, market)) = pick else {
            let when = match (fallback, spot.unobtainable_since) {
                (true, _) => "on-demand pools too".to_string(),
                (false, Some(_)) => {
                    format!("on-demand {} s after spot ran out", policy.on_demand_after_ms / 1000)
                }
                (false, None) => "waiting for a pool to cool down".to_string(),
            };
            return decision(
                Next::Record(CapacityAction::Hold),
                format!("{short}; every pool had a capacity error lately ({when})"),
            );
        };
        let why = match market {
            Market::Spot => format!("{short}: spot in {pool}"),
            Market::OnDemand => format!(
                "{short}: spot unobtainable for at least {} s, on-demand in {pool}",
                policy.on_demand_after_ms / 1000
            ),
        };
        return launch(policy, state, spares, pool, market, why, now_ms, have);
    }

    // 4: spot came back and covers the target (its hosts train already): the newest
    // on-demand host goes.
    let active = state.members.values().filter(|m| m.status == MemberStatus::Active).count() as u32;
    let active_fast = active.saturating_sub(slow.len() as u32);
    if have > target && active > target {
        if let Some((node, instance)) = on_demand.last() {
            return decision(
                Next::Record(CapacityAction::Drain { node: *node, instance: instance.clone() }),
                format!("{have} hosts for a target of {target}: spot is back, draining on-demand {instance}"),
            );
        }
    }
    // A slow host goes once the hosts without it train at the target.
    if let Some(&node) = slow.first().filter(|_| active_fast >= target) {
        let instance = instance_of_member(state, instances, node);
        return decision(
            Next::Record(CapacityAction::Drain { node, instance }),
            format!("{} stayed slow and {have} other hosts train: draining it", name_of(state, node)),
        );
    }
    // Scaling by value lowered the target: the newest host goes.
    if policy.min_marginal_value.is_some() && have > target && active > target {
        if let Some((node, instance)) = newest_member(state, instances) {
            return decision(
                Next::Record(CapacityAction::Drain { node, instance: instance.clone() }),
                format!("{have} hosts for a target of {target} by value: draining the newest, {instance}"),
            );
        }
    }
    if have > target {
        return decision(
            Next::Record(CapacityAction::Hold),
            format!("{have} hosts for a target of {target}{detail}"),
        );
    }

    // 5: at the target with on-demand hosts: probe spot now and then.
    if !on_demand.is_empty() && have < policy.max {
        let due = spot.last_attempt.is_none_or(|t| now_ms.saturating_sub(t) >= policy.spot_retry_ms);
        if due {
            if let Some(pool) = choose(policy, log, instances, Market::Spot, now_ms) {
                let why = format!(
                    "{have} of {target} hosts, {} on-demand: probing spot in {pool} to replace one",
                    on_demand.len()
                );
                return launch(policy, state, spares, pool, Market::Spot, why, now_ms, have);
            }
        }
        return decision(
            Next::Record(CapacityAction::Hold),
            format!(
                "{have} of {target} hosts, {} on-demand; trying spot every {} s",
                on_demand.len(),
                policy.spot_retry_ms / 1000
            ),
        );
    }
    decision(Next::Record(CapacityAction::Hold), format!("{have} of {target} hosts{detail}"))
}

#[allow(clippy::too_many_arguments)]
fn launch(
    policy: &CapacityPolicy,
    state: &ClusterState,
    spares: &[String],
    pool: Pool,
    market: Market,
    why: String,
    now_ms: u64,
    have: u32,
) -> Decision {
    let seq = state.capacity.last_seq + 1;
    let node_name = if policy.spares_required {
        let used: BTreeSet<&str> = state
            .capacity
            .records
            .iter()
            .filter_map(|r| match &r.action {
                CapacityAction::Launch { node_name, .. } => node_name.as_deref(),
                _ => None,
            })
            .collect();
        // A member holding a spare's name is that spare only if it has the spare's id (a
        // squatter of the name gives it up when the spare joins).
        let taken = |s: &str| {
            state.member_named(s).is_some_and(|m| m.spec.id == limpet_consensus::state::node_id_of_name(s))
        };
        match spares.iter().find(|s| !used.contains(s.as_str()) && !taken(s)) {
            Some(s) => Some(s.clone()),
            None => {
                return Decision {
                    next: Next::Record(CapacityAction::Hold),
                    reason: format!(
                        "{}; but no spare credential is left (limpet fleet spares --count N)",
                        why.split(':').next().unwrap_or(&why)
                    ),
                    have,
                }
            }
        }
    } else {
        None
    };
    let token = launch_token(&state.cluster, seq, now_ms);
    Decision {
        next: Next::Record(CapacityAction::Launch { pool, market, token, node_name }),
        reason: why,
        have,
    }
}

fn past(at: Option<u64>, after: u64, now: u64) -> bool {
    at.is_some_and(|t| now >= t.saturating_add(after))
}

/// Live hosts: members joining or training, plus instances launched for the cluster that
/// have no member yet and are still within the join timeout (listed, or recorded as
/// launched and not listed yet: EC2's listing lags its launches). And the words for them.
fn count(
    policy: &CapacityPolicy,
    state: &ClusterState,
    instances: &[Instance],
    now_ms: u64,
) -> (u32, String) {
    let live = state
        .members
        .values()
        .filter(|m| matches!(m.status, MemberStatus::Joining | MemberStatus::Active))
        .count();
    let mut coming: BTreeSet<String> = BTreeSet::new();
    for i in instances.iter().filter(|i| i.alive()) {
        if state.member_named(i.name()).is_none() && !past(i.launched_ms, policy.join_timeout_ms, now_ms) {
            coming.insert(i.id.clone());
        }
    }
    let listed: BTreeSet<&str> = instances.iter().map(|i| i.id.as_str()).collect();
    // An instance no longer listed because it was terminated (or that joined and left)
    // is not on its way.
    let ended: BTreeSet<&str> = state
        .capacity
        .records
        .iter()
        .filter_map(|r| match &r.action {
            CapacityAction::Terminate { instances } => Some(instances.iter().map(String::as_str)),
            _ => None,
        })
        .flatten()
        .chain(state.members.values().map(|m| m.spec.name.as_str()))
        .collect();
    for r in &state.capacity.records {
        if let CapacityAction::Launched { instances: ids, .. } = &r.action {
            if !past(Some(r.at_ms), policy.join_timeout_ms, now_ms) {
                for id in
                    ids.iter().filter(|id| !listed.contains(id.as_str()) && !ended.contains(id.as_str()))
                {
                    coming.insert(id.clone());
                }
            }
        }
    }
    let gone: Vec<String> = state
        .members
        .values()
        .filter(|m| matches!(m.status, MemberStatus::Draining | MemberStatus::Leaving | MemberStatus::Failed))
        .map(|m| format!("{} {}", m.spec.name, format!("{:?}", m.status).to_lowercase()))
        .collect();
    let mut detail = String::new();
    if !coming.is_empty() {
        detail += &format!(
            " ({} launching: {})",
            coming.len(),
            coming.iter().cloned().collect::<Vec<_>>().join(" ")
        );
    }
    if !gone.is_empty() {
        detail += &format!(" ({})", gone.join(", "));
    }
    ((live + coming.len()) as u32, detail)
}

/// A member's name, for reasons.
fn name_of(state: &ClusterState, id: NodeId) -> String {
    state.members.get(&id).map_or_else(|| format!("node {id}"), |m| m.spec.name.clone())
}

/// The live instance a member runs on (its name when EC2 lists none: a host outside the
/// fleet's instances).
fn instance_of_member(state: &ClusterState, instances: &[Instance], id: NodeId) -> String {
    let name = name_of(state, id);
    instances.iter().find(|i| i.alive() && i.name() == name).map_or(name, |i| i.id.clone())
}

/// The active member on the most recently launched live instance: (node, instance).
fn newest_member(state: &ClusterState, instances: &[Instance]) -> Option<(NodeId, String)> {
    instances
        .iter()
        .filter(|i| i.alive())
        .filter_map(|i| {
            let m = state.member_named(i.name())?;
            (m.status == MemberStatus::Active).then(|| (i.launched_ms, m.spec.id, i.id.clone()))
        })
        .max()
        .map(|(_, n, i)| (n, i))
}

/// Scaling by value's step: a `Scale` record when the measured throughput per world size
/// and `price` (dollars per host-hour of the next host) call for another number of hosts
/// than the one in effect; `None` when they do not, nothing is measured, or scaling by
/// value is off.
pub fn scale(policy: &CapacityPolicy, state: &ClusterState, price: Option<f64>) -> Option<Decision> {
    let threshold = policy.min_marginal_value?;
    let current = policy.target_now(&state.capacity);
    let vp = crate::scaling::ValuePolicy { min_marginal_value: threshold, min: policy.min, max: policy.max };
    let choice = crate::scaling::choose(&state.throughput.points(), price?, &vp, current)?;
    (choice.target != current || state.capacity.target.is_none()).then(|| Decision {
        next: Next::Record(CapacityAction::Scale { target: choice.target }),
        reason: format!("by value: {}", choice.reason),
        have: current,
    })
}

/// Members of the current epoch whose share of each step is `ratio` times below the mean
/// (the controller gave them less for being slower); none with equal shares or `ratio`
/// off (below 1).
pub fn slow_members(state: &ClusterState, ratio: f64) -> Vec<NodeId> {
    let Some(cur) = state.current.as_ref().filter(|c| c.shares.len() == c.ranks.len()) else {
        return Vec::new();
    };
    if !(ratio.is_finite() && ratio >= 1.0) {
        return Vec::new();
    }
    // Per device: a host of one GPU among hosts of four takes a quarter of their shares
    // without being slow.
    let per_device: Vec<f64> =
        cur.shares.iter().enumerate().map(|(i, &s)| s as f64 / f64::from(cur.local_ranks_of(i))).collect();
    let mean = per_device.iter().sum::<f64>() / per_device.len() as f64;
    cur.ranks.iter().zip(&per_device).filter(|(_, &s)| s * ratio < mean).map(|(&r, _)| r).collect()
}

/// The live members on on-demand instances, oldest launch first: (node, instance).
fn on_demand_members(state: &ClusterState, instances: &[Instance]) -> Vec<(NodeId, String)> {
    let mut v: Vec<(Option<u64>, NodeId, String)> = instances
        .iter()
        .filter(|i| i.alive() && i.market == Market::OnDemand)
        .filter_map(|i| {
            let m = state.member_named(i.name())?;
            (m.status == MemberStatus::Active).then(|| (i.launched_ms, m.spec.id, i.id.clone()))
        })
        .collect();
    v.sort();
    v.into_iter().map(|(_, n, i)| (n, i)).collect()
}

/// What the log says of spot: since when it has been unobtainable (the first capacity
/// error after the last spot launch that succeeded), and when it was last tried.
struct SpotHistory {
    unobtainable_since: Option<u64>,
    last_attempt: Option<u64>,
}

fn spot_history(log: &CapacityLog) -> SpotHistory {
    let mut h = SpotHistory { unobtainable_since: None, last_attempt: None };
    for r in &log.records {
        let Some(market) = launch_market(log, &r.action) else { continue };
        if market != Market::Spot {
            continue;
        }
        match &r.action {
            CapacityAction::Launch { .. } => h.last_attempt = Some(r.at_ms),
            CapacityAction::Launched { .. } => h.unobtainable_since = None,
            CapacityAction::Failed { capacity: true, .. } => {
                h.unobtainable_since.get_or_insert(r.at_ms);
            }
            _ => {}
        }
    }
    h
}

/// The market of a launch record or of the launch an outcome names.
fn launch_market(log: &CapacityLog, a: &CapacityAction) -> Option<Market> {
    let seq = match a {
        CapacityAction::Launch { market, .. } => return Some(*market),
        CapacityAction::Launched { launch, .. } | CapacityAction::Failed { launch, .. } => *launch,
        _ => return None,
    };
    match &log.launch(seq)?.action {
        CapacityAction::Launch { market, .. } => Some(*market),
        _ => None,
    }
}

/// The newest refusal that was not about capacity (a bad template, missing permissions),
/// unless a launch succeeded after it.
fn last_refusal(log: &CapacityLog) -> Option<(String, u64)> {
    let mut last = None;
    for r in &log.records {
        match &r.action {
            CapacityAction::Failed { code, capacity: false, .. } => last = Some((code.clone(), r.at_ms)),
            CapacityAction::Launched { .. } => last = None,
            _ => {}
        }
    }
    last
}

/// The pool for the next `market` launch: not cooling down after a capacity error, fewest of
/// the cluster's live instances, then the configured order.
fn choose(
    policy: &CapacityPolicy,
    log: &CapacityLog,
    instances: &[Instance],
    market: Market,
    now_ms: u64,
) -> Option<Pool> {
    let mut cooling: BTreeSet<&Pool> = BTreeSet::new();
    for r in &log.records {
        if let CapacityAction::Failed { launch, capacity: true, .. } = &r.action {
            if let Some(CapacityRecord { action: CapacityAction::Launch { pool, market: m, .. }, .. }) =
                log.launch(*launch)
            {
                if *m == market && now_ms < r.at_ms.saturating_add(policy.pool_cooldown_ms) {
                    cooling.insert(pool);
                }
            }
        }
    }
    let mut load: BTreeMap<&Pool, usize> = BTreeMap::new();
    for i in instances.iter().filter(|i| i.alive()) {
        *load.entry(&i.pool).or_default() += 1;
    }
    policy
        .pools
        .iter()
        .enumerate()
        .filter(|(_, p)| !cooling.contains(p))
        .min_by_key(|(k, p)| (load.get(p).copied().unwrap_or(0), *k))
        .map(|(_, p)| p.clone())
}

#[cfg(test)]
mod tests;
