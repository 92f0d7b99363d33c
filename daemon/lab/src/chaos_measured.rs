//! What a replay's simulation is given: the speeds measured per world size, and what the
//! replay's transitions cost, by kind, measured from the epoch changes `limpet status`
//! reports: the idle of a notice's, a join's and a failure's (the simulation charges the
//! step a failure loses apart, as it does with its assumed costs). A
//! replay's simulation is run twice, with the costs the cost figure assumes and with these,
//! so a difference can be told apart: the model's mechanics, or its assumed costs.

use limpet_agent::runtime::StepLine;
use limpet_daemon::simulate::model::Params;
use limpet_daemon::status::TransitionDoc;
use serde::Serialize;
use std::collections::BTreeMap;

/// The simulation's job size: more than any window trains, so it stops at the window's end.
pub const SAMPLES: f64 = 1e15;

/// Mean milliseconds of idle each kind of transition cost in a replay (`None`: the replay had
/// none of that kind alone).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct MeasuredCosts {
    /// A spot notice's: the leaving host drains at a step boundary.
    pub notice_idle_ms: Option<f64>,
    /// A `kill -9`'s: finding the dead peer and entering the new epoch.
    pub kill_recovery_ms: Option<f64>,
    /// A join's, besides the state copy the simulation charges apart (none here: a replay's
    /// state moves over loopback in milliseconds).
    pub join_idle_ms: Option<f64>,
}

/// The costs of `transitions`, a step taking `step_s` seconds. Only transitions with one
/// cause count: one with several pays for them at once. A failure's idle runs from the last
/// step finished, so it holds the step it aborted, which the simulation charges apart.
pub fn measure(transitions: &[TransitionDoc], step_s: f64) -> MeasuredCosts {
    let mean = |prefix: &str, less: f64| {
        let costs: Vec<f64> = transitions
            .iter()
            .filter(|t| t.cause.starts_with(prefix) && one_cause(&t.cause))
            .filter_map(|t| Some((t.idle_ms? as f64 - less).max(0.0)))
            .collect();
        (!costs.is_empty()).then(|| costs.iter().sum::<f64>() / costs.len() as f64)
    };
    MeasuredCosts {
        notice_idle_ms: mean("notice for ", 0.0),
        kill_recovery_ms: mean("failure of ", step_s * 1e3),
        join_idle_ms: mean("join of ", 0.0),
    }
}

/// Whether a transition's cause text names one cause: causes are joined by ", ", which a
/// cause's own explanation in parentheses may also hold ("reported: aws notice, deadline T").
fn one_cause(cause: &str) -> bool {
    let mut depth = 0usize;
    let mut bare = String::new();
    for c in cause.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            c if depth == 0 => bare.push(c),
            _ => {}
        }
    }
    !bare.contains(", ")
}

/// Samples per second by world size: over every epoch, the steps after its first (which
/// carries the transition) over the time from its first step's completion to its last's.
pub(crate) fn measured_rates(lines: &[StepLine], batch: u64) -> BTreeMap<usize, f64> {
    let mut epochs: BTreeMap<u64, (usize, BTreeMap<u64, u64>)> = BTreeMap::new();
    for l in lines {
        let e = epochs.entry(l.epoch).or_insert((l.world, BTreeMap::new()));
        let at = e.1.entry(l.step).or_insert(l.wall_ms);
        *at = (*at).min(l.wall_ms);
    }
    let mut by_world: BTreeMap<usize, (f64, f64)> = BTreeMap::new();
    for (world, steps) in epochs.values() {
        let (Some(first), Some(last)) = (steps.values().min(), steps.values().max()) else { continue };
        if steps.len() >= 3 && last > first {
            let w = by_world.entry(*world).or_default();
            w.0 += (steps.len() - 1) as f64;
            w.1 += (last - first) as f64 / 1e3;
        }
    }
    by_world.into_iter().map(|(world, (n, secs))| (world, batch as f64 * n / secs)).collect()
}

/// The simulation's parameters: the speeds measured in the replay (a world never measured
/// scales the nearest measured one linearly), the join time measured in it, and limpet's
/// transition costs as `limpet simulate` takes them.
pub(crate) fn params(
    kill_every: u32,
    rates: &BTreeMap<usize, f64>,
    lines: &[StepLine],
    join_s: f64,
    window: f64,
) -> Params {
    use limpet_daemon::simulate::{JOIN_IDLE_MS, KILL_RECOVERY_MS, NOTICE_IDLE_MS};
    let most = 16;
    let table: Vec<f64> = (0..=most)
        .map(|n| match rates.iter().min_by_key(|(w, _)| w.abs_diff(n)) {
            Some((w, r)) if n > 0 => r * n as f64 / *w as f64,
            _ => 0.0,
        })
        .collect();
    let mut gaps: Vec<f64> = Vec::new();
    let mut last: BTreeMap<(u64, u64), u64> = BTreeMap::new();
    for l in lines {
        if let Some(prev) = last.insert((l.node, l.epoch), l.wall_ms) {
            gaps.push(l.wall_ms.saturating_sub(prev) as f64 / 1e3);
        }
    }
    gaps.sort_by(f64::total_cmp);
    Params {
        host_rate: table.get(1).copied().unwrap_or(1.0).max(1e-9),
        scaling: 1.0,
        step_s: gaps.get(gaps.len() / 2).copied().unwrap_or(0.0),
        notice_idle_s: NOTICE_IDLE_MS / 1e3,
        kill_recovery_s: KILL_RECOVERY_MS / 1e3,
        no_notice: if kill_every > 0 { 1.0 / f64::from(kill_every) } else { 0.0 },
        join_idle_s: JOIN_IDLE_MS / 1e3,
        state_bytes: 0.0,
        link_bytes_per_s: 1.0,
        boot_s: join_s,
        restart_s: 0.0,
        checkpoint_every_s: f64::MAX,
        checkpoint_write_s: 0.0,
        async_pause_s: None,
        restart_on_add: false,
        checkpoint_on_notice: false,
        spot_price: 0.0,
        on_demand_price: 0.0,
        on_demand_hosts: 1,
        samples: SAMPLES,
        tick_s: 0.01,
        rates: table,
        deadline_s: None,
        until_s: Some(window),
        founders_booted: true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(cause: &str, idle_ms: u64, lost: u64) -> TransitionDoc {
        // Through JSON, as `limpet status --json` gives it, the other fields at their defaults.
        let doc = serde_json::json!({
            "epoch": 2, "step": 100, "world": 3, "cause": cause, "idle_ms": idle_ms,
            "lost_steps": lost, "fetched_bytes": 0,
        });
        serde_json::from_value(doc).unwrap()
    }

    #[test]
    fn each_kind_costs_its_mean_idle() {
        let ts = [
            t("first epoch", 0, 0),
            t("notice for node 3 (revocation notice from aws)", 20, 0),
            t("notice for node 4 (revocation notice from aws)", 10, 0),
            t("failure of node 5 (went silent)", 300, 1),
            t("join of node 6", 12, 0),
            t("notice for node 8 (reported: aws notice, deadline 1795736337000)", 30, 0),
            // Several causes at once: not one kind's cost.
            t("join of node 7, failure of node 2 (went silent)", 900, 1),
        ];
        let m = measure(&ts, 0.05);
        assert_eq!(m.notice_idle_ms, Some(20.0));
        // Less the aborted step's 50 ms, which the simulation charges apart.
        assert_eq!(m.kill_recovery_ms, Some(250.0));
        assert_eq!(m.join_idle_ms, Some(12.0));
        assert_eq!(measure(&ts[..1], 0.05), MeasuredCosts::default());
    }

    #[test]
    fn speeds_are_steps_over_time_within_epochs() {
        let line = |epoch, step, wall_ms, world| StepLine {
            wall_ms,
            step,
            epoch,
            world,
            rank: 0,
            devices: 0,
            node: 1,
            name: "node-1".into(),
            loss: 1.0,
            agreed: false,
            eval_loss: None,
            overlap: None,
            went_back: None,
        };
        // World 2: steps every 10 ms; world 3: every 20 ms (its first step late: a transition).
        let mut lines: Vec<StepLine> = (0..11).map(|s| line(1, s, 10 * s, 2)).collect();
        lines.push(line(2, 11, 500, 3));
        lines.extend((12..22).map(|s| line(2, s, 500 + 20 * (s - 11), 3)));
        let r = measured_rates(&lines, 64);
        assert!((r[&2] - 6400.0).abs() < 1e-6, "{r:?}");
        assert!((r[&3] - 3200.0).abs() < 1e-6, "{r:?}");
    }
}
