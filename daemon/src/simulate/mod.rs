//! `limpet simulate`: what a job costs over a real preemption trace, trained by limpet, by
//! checkpoint-restart (as torchrun's elastic agent does it) and on on-demand hosts: hours to
//! train, goodput, dollars per trained sample, with a plot of live hosts and progress. The
//! costs of limpet's transitions default to what this repository measures (`make demo`,
//! `limpet-lab bench elastic`); every one is a flag. `docs/simulate.md` explains the model.

pub mod model;
mod plot;
pub mod trace;

use crate::UsageError;
use clap::Args;
use model::{Outcome, Params, Policy};
use std::path::PathBuf;
use trace::Trace;

/// limpet's idle on a notice, measured (`make demo`), in ms.
pub const NOTICE_IDLE_MS: f64 = 10.0;
/// limpet's failure timeout plus recovery after a kill -9, measured, in ms.
pub const KILL_RECOVERY_MS: f64 = 1343.0;
/// limpet's fixed idle of a join besides the state copy, measured, in ms.
pub const JOIN_IDLE_MS: f64 = 21.0;

/// `limpet simulate`.
#[derive(Debug, Args)]
pub struct SimulateArgs {
    /// The preemption trace: `ms_since_start,add|remove,NODE` per line [default: the AWS p3
    /// trace shipped with limpet].
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Samples the job needs (default: what the on-demand fleet trains in the trace's span).
    #[arg(long)]
    samples: Option<f64>,
    /// Samples per second of one host (only ratios matter unless --samples is given).
    #[arg(long, default_value_t = 1.0)]
    host_rate: f64,
    /// Fraction of linear speed-up kept per doubling of the fleet.
    #[arg(long, default_value_t = 0.95)]
    scaling: f64,
    /// A `limpet status --json` document of a cluster that trained the job: the throughput
    /// its leader measured at each world size replaces --host-rate and --scaling (fitted as
    /// scaling by value fits it).
    #[arg(long, value_name = "STATUS_JSON")]
    throughput_from: Option<PathBuf>,
    /// Seconds of one training step (what a kill without notice loses).
    #[arg(long, default_value_t = 1.0)]
    step_seconds: f64,
    /// Fraction of revocations without a notice (AWS sends a two-minute notice for spot
    /// interruptions; a host can still die without one).
    #[arg(long, default_value_t = 0.05)]
    no_notice: f64,
    /// limpet: idle of a transition on a notice (make demo: 10 ms).
    #[arg(long, default_value_t = NOTICE_IDLE_MS)]
    notice_idle_ms: f64,
    /// limpet: failure timeout plus recovery after a kill -9 (1000 ms + make demo's 343 ms).
    #[arg(long, default_value_t = KILL_RECOVERY_MS)]
    kill_recovery_ms: f64,
    /// limpet: fixed idle of a join, besides copying the state (make demo: 21 ms).
    #[arg(long, default_value_t = JOIN_IDLE_MS)]
    join_idle_ms: f64,
    /// Training state in GB (a newcomer copies it from a peer).
    #[arg(long, default_value_t = 1.0)]
    state_gb: f64,
    /// Link speed between hosts in Gbit/s.
    #[arg(long, default_value_t = 10.0)]
    link_gbps: f64,
    /// Seconds from a host's arrival until it can train (boot and install), for both spot
    /// policies.
    #[arg(long, default_value_t = 60.0)]
    boot_seconds: f64,
    /// Checkpoint-restart: seconds from a change to training again (torchrun measured here:
    /// no step within 60 s of a worker's loss, so 60 is a lower bound).
    #[arg(long, default_value_t = 60.0)]
    restart_seconds: f64,
    /// Minutes of training between checkpoints (both spot policies write them).
    #[arg(long, default_value_t = 10.0)]
    checkpoint_minutes: f64,
    /// Checkpoint-restart: seconds one checkpoint pauses training.
    #[arg(long, default_value_t = 10.0)]
    checkpoint_write_seconds: f64,
    /// Checkpoint-restart: a new host does not restart the job (it waits for the next
    /// failure to be taken in).
    #[arg(long)]
    no_restart_on_add: bool,
    /// Spot price per host-hour (p3.2xlarge, us-east-1: about 0.30x on-demand).
    #[arg(long, default_value_t = 0.918)]
    spot_price: f64,
    /// On-demand price per host-hour (p3.2xlarge, us-east-1).
    #[arg(long, default_value_t = 3.06)]
    on_demand_price: f64,
    /// Hosts of the on-demand fleet (default: the most the trace has live at once).
    #[arg(long)]
    on_demand_hosts: Option<usize>,
    /// Simulation tick in milliseconds.
    #[arg(long, default_value_t = 100.0)]
    tick_ms: f64,
    /// Draw live hosts and progress over time for each policy into this SVG file.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

impl SimulateArgs {
    fn params(&self, trace: &Trace) -> Result<Params, UsageError> {
        let positive = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(v)
            } else {
                Err(UsageError(format!("--{name} {v}: must be a positive number")))
            }
        };
        let non_negative = |name: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(v)
            } else {
                Err(UsageError(format!("--{name} {v}: must be zero or more")))
            }
        };
        let scaling_ok = self.scaling > 0.0 && self.scaling <= 1.0;
        if !(0.0..=1.0).contains(&self.no_notice) || !scaling_ok {
            return Err(UsageError("--no-notice must be in [0, 1] and --scaling in (0, 1]".into()));
        }
        let hosts = self.on_demand_hosts.unwrap_or_else(|| trace.max_live());
        if hosts == 0 {
            return Err(UsageError("--on-demand-hosts must be at least 1".into()));
        }
        let mut p = Params {
            host_rate: positive("host-rate", self.host_rate)?,
            scaling: self.scaling,
            step_s: non_negative("step-seconds", self.step_seconds)?,
            notice_idle_s: non_negative("notice-idle-ms", self.notice_idle_ms)? / 1e3,
            kill_recovery_s: non_negative("kill-recovery-ms", self.kill_recovery_ms)? / 1e3,
            no_notice: self.no_notice,
            join_idle_s: non_negative("join-idle-ms", self.join_idle_ms)? / 1e3,
            state_bytes: non_negative("state-gb", self.state_gb)? * 1e9,
            link_bytes_per_s: positive("link-gbps", self.link_gbps)? * 1e9 / 8.0,
            boot_s: non_negative("boot-seconds", self.boot_seconds)?,
            restart_s: non_negative("restart-seconds", self.restart_seconds)?,
            checkpoint_every_s: positive("checkpoint-minutes", self.checkpoint_minutes)? * 60.0,
            checkpoint_write_s: non_negative("checkpoint-write-seconds", self.checkpoint_write_seconds)?,
            restart_on_add: !self.no_restart_on_add,
            spot_price: non_negative("spot-price", self.spot_price)?,
            on_demand_price: non_negative("on-demand-price", self.on_demand_price)?,
            on_demand_hosts: hosts,
            samples: 0.0,
            tick_s: positive("tick-ms", self.tick_ms)? / 1e3,
            rates: Vec::new(),
            until_s: None,
        };
        if let Some(path) = &self.throughput_from {
            p.rates = measured_rates(path, hosts.max(trace.max_live()))?;
        }
        p.samples = match self.samples {
            Some(s) => positive("samples", s)?,
            None => p.rate(hosts) * trace.duration_s().max(3600.0),
        };
        Ok(p)
    }
}

/// Samples per second (that count) at 1..=`upto` hosts (index 0 unused), from the throughput
/// a `limpet status --json` document at `path` records, through the scaling curve fitted to it.
fn measured_rates(path: &std::path::Path, upto: usize) -> Result<Vec<f64>, UsageError> {
    let name = path.display();
    let text =
        std::fs::read_to_string(path).map_err(|e| UsageError(format!("--throughput-from {name}: {e}")))?;
    let doc: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
        UsageError(format!("--throughput-from {name}: not a limpet status --json document: {e}"))
    })?;
    let points: Vec<(u32, f64)> = doc["throughput"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|t| {
                    Some((
                        u32::try_from(t["world"].as_u64()?).ok()?,
                        t["useful_milli"].as_u64()? as f64 / 1e3,
                    ))
                })
                .collect()
        })
        .unwrap_or_default();
    let curve = limpet_agent::scaling::fit(&points).ok_or_else(|| {
        UsageError(format!("--throughput-from {name}: no throughput measured (the leader records it once an epoch ran 50 steps)"))
    })?;
    Ok((0..=upto).map(|n| if n == 0 { 0.0 } else { curve.at(n as u32) }).collect())
}

/// The whole result, as `--json` prints it.
#[derive(serde::Serialize)]
struct Report {
    trace: TraceDoc,
    params: Params,
    /// Each policy's run, limpet first.
    policies: Vec<PolicyDoc>,
}

#[derive(serde::Serialize)]
struct TraceDoc {
    file: String,
    events: usize,
    hours: f64,
    max_hosts: usize,
    revocations: usize,
}

#[derive(serde::Serialize)]
struct PolicyDoc {
    #[serde(flatten)]
    outcome: Outcome,
    /// Dollars per trained sample relative to on-demand's.
    cost_vs_on_demand: f64,
}

/// Runs `limpet simulate`.
pub fn run(a: SimulateArgs) -> anyhow::Result<()> {
    // Without --trace, the table's first line names the shipped trace as such.
    let (trace, file) = trace::load(a.trace.as_deref()).map_err(UsageError)?;
    let p = a.params(&trace)?;
    let mut outcomes = Vec::new();
    for policy in [Policy::Limpet, Policy::CheckpointRestart, Policy::OnDemand] {
        let o = model::simulate(&trace, &p, policy).ok_or_else(|| {
            UsageError(format!("{}: the job never finishes: the trace ends with no host live", policy.name()))
        })?;
        outcomes.push(o);
    }
    let od = outcomes.iter().find(|o| o.policy == Policy::OnDemand).map_or(f64::NAN, |o| o.usd_per_million);
    if let Some(path) = &a.plot {
        plot::simulation_svg(path, &outcomes, &format!("{file}: live hosts and progress"))?;
    }
    let report = Report {
        trace: TraceDoc {
            file,
            events: trace.events.len(),
            hours: trace.duration_s() / 3600.0,
            max_hosts: trace.max_live(),
            revocations: trace.removals(),
        },
        params: p,
        policies: outcomes
            .into_iter()
            .map(|o| PolicyDoc { cost_vs_on_demand: o.usd_per_million / od, outcome: o })
            .collect(),
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
        if let Some(path) = &a.plot {
            println!("plot: {}", path.display());
        }
    }
    Ok(())
}

fn render(r: &Report) -> String {
    let t = &r.trace;
    let mut s = format!(
        "trace {}: {} events over {:.1} h, up to {} hosts, {} revocations\njob: {:.0} samples (what {} on-demand hosts train in {:.1} h)\n\n",
        t.file, t.events, t.hours, t.max_hosts, t.revocations, r.params.samples, r.params.on_demand_hosts, t.hours
    );
    let mut table = crate::text::table(
        &[
            "POLICY",
            "HOURS",
            "GOODPUT",
            "TRANSITIONS",
            "LOST",
            "PAUSED",
            "COST",
            "$/M SAMPLES",
            "VS ON-DEMAND",
        ],
        1..9,
    );
    for p in &r.policies {
        let o = &p.outcome;
        table.add_row(vec![
            o.policy.name().to_string(),
            format!("{:.2}", o.hours),
            format!("{:.1}%", o.goodput * 100.0),
            o.transitions.to_string(),
            format!("{:.0} s", o.lost_s),
            format!("{:.0} s", o.paused_s),
            format!("${:.2}", o.cost),
            format!("{:.2}", o.usd_per_million),
            format!("{:.2}x", p.cost_vs_on_demand),
        ]);
    }
    s += &crate::text::lines(&table);
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::measured_rates;

    #[test]
    fn a_status_document_gives_the_measured_curve_and_bad_ones_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let status = dir.path().join("status.json");
        let doc = serde_json::json!({"throughput": [
            {"world": 2, "epoch": 1, "samples_milli": 600_000, "useful_milli": 600_000, "at_ms": 1},
            {"world": 4, "epoch": 2, "samples_milli": 1_000_000, "useful_milli": 1_000_000, "at_ms": 2},
        ]});
        std::fs::write(&status, doc.to_string()).unwrap();
        let r = measured_rates(&status, 5).unwrap();
        assert_eq!((r.len(), r[2], r[4]), (6, 600.0, 1000.0), "measured points as measured");
        assert_eq!(r[1], 300.0, "below the smallest world: perfect scaling down");
        assert!(r[3] > 600.0 && r[3] < 1000.0 && r[5] > 1000.0 && r[5] - 1000.0 < 400.0, "{r:?}");
        std::fs::write(&status, "{}").unwrap();
        assert!(measured_rates(&status, 5).unwrap_err().0.contains("no throughput measured"));
        std::fs::write(&status, "nope").unwrap();
        assert!(measured_rates(&status, 5).unwrap_err().0.contains("not a limpet status"));
        assert!(measured_rates(&dir.path().join("gone"), 5).unwrap_err().0.contains("--throughput-from"));
    }
}
