//! `limpet simulate --deadline H`: the decision users face. The job must be done within `H`
//! hours; each spot policy adds on-demand hosts when its fleet would miss it (checked once a
//! minute at the pace the policy has kept so far; they are never taken away), and on-demand
//! alone is the smallest fleet that makes it. Reported: when each finished, whether it met
//! the deadline, the on-demand host-hours it added, and what meeting it cost.

use super::compare::Setting;
use super::model::{simulate, Outcome, Params, Policy};
use super::trace::Trace;
use crate::UsageError;
use serde::Serialize;

/// One policy against the deadline.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// How the table names it.
    pub label: String,
    /// Whether the job was done by the deadline.
    pub met: bool,
    /// Dollars relative to on-demand alone meeting the deadline.
    pub cost_vs_on_demand: f64,
    /// Its run.
    #[serde(flatten)]
    pub outcome: Outcome,
}

/// The smallest on-demand fleet that trains `p.samples` within `deadline_s` (at most
/// `most` hosts).
pub fn on_demand_size(p: &Params, deadline_s: f64, most: usize) -> usize {
    (1..=most).find(|&n| p.rate(n) * deadline_s >= p.samples).unwrap_or(most)
}

/// limpet (checkpointing as often as checkpoint-restart's `best`), checkpoint-restart at
/// `best`, and on-demand alone, each to the job's end, with `deadline_h`. Refused when the
/// deadline lies past the trace (the fleet there would be made up).
pub fn compare(trace: &Trace, p: &Params, best: Setting, deadline_h: f64) -> Result<Vec<Row>, UsageError> {
    let deadline_s = deadline_h * 3600.0;
    if !(deadline_s.is_finite() && deadline_s > 0.0) {
        return Err(UsageError(format!("--deadline {deadline_h}: a positive number of hours")));
    }
    if deadline_s > trace.duration_s() {
        return Err(UsageError(format!(
            "--deadline {deadline_h}: past the trace's end ({:.1} h): the fleet there would be made up",
            trace.duration_s() / 3600.0
        )));
    }
    let p = Params { deadline_s: Some(deadline_s), until_s: None, ..p.clone() };
    let never = |who: &str| UsageError(format!("{who}: the job never finishes over this trace"));
    let limpet = simulate(trace, &Params { checkpoint_every_s: best.every_s, ..p.clone() }, Policy::Limpet)
        .ok_or_else(|| never("limpet"))?;
    // Checkpoint-restart takes the on-demand hosts it adds in by restarting (one that waited
    // for the next failure would pay for them idle).
    let best = Setting { restart_on_add: true, ..best };
    let restart = simulate(trace, &best.apply(&p), Policy::CheckpointRestart)
        .ok_or_else(|| never("checkpoint-restart"))?;
    let n = on_demand_size(&p, deadline_s, 100 * trace.max_live().max(p.on_demand_hosts));
    let od = simulate(trace, &Params { on_demand_hosts: n, ..p.clone() }, Policy::OnDemand)
        .ok_or_else(|| never("on-demand"))?;
    let od_cost = od.cost;
    let every = Setting::every(best.every_s, true).describe();
    let rows = [
        (format!("limpet, checkpoints {every}"), limpet),
        (format!("checkpoint-restart, {}", best.describe()), restart),
        (format!("on-demand, {n} hosts (the fewest that make it)"), od),
    ];
    Ok(rows
        .into_iter()
        .map(|(label, o)| Row {
            label,
            met: o.hours * 3600.0 <= deadline_s + p.tick_s,
            cost_vs_on_demand: o.cost / od_cost,
            outcome: o,
        })
        .collect())
}

/// The rows as a table.
pub fn render(deadline_h: f64, samples: f64, rows: &[Row]) -> String {
    let mut s = format!("the job: {samples:.0} samples, due within {deadline_h} h\n\n");
    let mut table = crate::text::table(
        &["POLICY", "DONE (H)", "MET", "ON-DEMAND ADDED (HOST-H)", "COST", "VS ON-DEMAND"],
        1..6,
    );
    for r in rows {
        let o = &r.outcome;
        table.add_row(vec![
            r.label.clone(),
            format!("{:.2}", o.hours),
            if r.met { "yes" } else { "no" }.to_string(),
            format!("{:.1}", o.fallback_host_hours),
            format!("${:.2}", o.cost),
            format!("{:.2}x", r.cost_vs_on_demand),
        ]);
    }
    s += &crate::text::lines(&table);
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::model::test_params;

    #[test]
    fn every_policy_meets_a_reachable_deadline_and_on_demand_is_the_fewest_hosts() {
        // Three hosts; two go at 1 h and come back at 2 h (as a zone losing capacity).
        let trace = Trace::parse(
            "0,add,a\n0,add,b\n0,add,c\n3600000,remove,b\n3600000,remove,c\n7200000,add,b\n7200000,add,c\n14400000,remove,a\n14400000,add,a\n",
            "t",
        )
        .unwrap();
        let p = Params {
            boot_s: 60.0,
            checkpoint_every_s: 300.0,
            checkpoint_write_s: 5.0,
            on_demand_hosts: 3,
            tick_s: 1.0,
            ..test_params(3.0 * 10.0 * 3.0 * 3600.0)
        };
        let best = Setting::every(300.0, false);
        // Three hosts for three hours' work in 3.5 h: the lost hour needs on-demand help.
        let rows = compare(&trace, &p, best, 3.5).unwrap();
        assert_eq!(rows.len(), 3);
        for r in &rows {
            assert!(r.met, "{}: done at {} h", r.label, r.outcome.hours);
        }
        assert_eq!(on_demand_size(&p, 3.5 * 3600.0, 100), 3);
        let (limpet, restart, od) = (&rows[0].outcome, &rows[1].outcome, &rows[2].outcome);
        assert_eq!(od.fallback_host_hours, 0.0);
        assert!(
            limpet.fallback_host_hours > 0.0 && restart.fallback_host_hours >= limpet.fallback_host_hours
        );
        assert!(
            rows[0].cost_vs_on_demand < 1.0 && rows[0].cost_vs_on_demand <= rows[1].cost_vs_on_demand,
            "{} {}",
            rows[0].cost_vs_on_demand,
            rows[1].cost_vs_on_demand
        );
        // A deadline past the trace, or none at all, is refused.
        assert!(compare(&trace, &p, best, 5.0).unwrap_err().0.contains("past the trace's end"));
        assert!(compare(&trace, &p, best, 0.0).unwrap_err().0.contains("positive"));
    }
}
