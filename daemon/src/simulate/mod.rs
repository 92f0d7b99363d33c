//! `limpet simulate`: what a job costs over a real preemption trace, trained by limpet, by
//! checkpoint-restart (as torchrun's elastic agent does it) and on on-demand hosts: hours to
//! train, goodput, dollars per trained sample, with a plot of live hosts and progress. The
//! costs of limpet's transitions default to what this repository measures (`make demo`,
//! `limpet-lab bench elastic`); every one is a flag. `docs/simulate.md` explains the model.

pub mod compare;
pub mod deadline;
pub mod model;
mod plot;
pub mod sweep;
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
    /// How --trace is written: events (`ms,add|remove,NODE`), counts-hours (Bamboo's
    /// `time_hours,live_instances`), counts-seconds, or skypilot (SkyPilot's spot-traces JSON).
    #[arg(long, value_enum, default_value_t = trace::Format::Events)]
    trace_format: trace::Format,
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
    /// Checkpoint-restart: also report this interval, in minutes of training (the table always
    /// has the best interval of a search and Young's interval for the trace).
    #[arg(long)]
    checkpoint_minutes: Option<f64>,
    /// Checkpoint-restart: seconds one checkpoint takes to write (a synchronous one pauses
    /// training as long).
    #[arg(long, default_value_t = 10.0)]
    checkpoint_write_seconds: f64,
    /// Checkpoint-restart: the pause of an asynchronous checkpoint (as
    /// torch.distributed.checkpoint's async_save: the copy of the state; it counts once
    /// written); the search tries synchronous and asynchronous checkpoints.
    #[arg(long, default_value_t = 1.0)]
    async_pause_seconds: f64,
    /// Checkpoint-restart at Young's interval saves before a planned restart (a notice, an
    /// added host); the search tries both.
    #[arg(long)]
    checkpoint_on_notice: bool,
    /// Checkpoint-restart: a new host does not restart the job (it waits for the next
    /// failure to be taken in) at Young's interval; the search tries both.
    #[arg(long)]
    no_restart_on_add: bool,
    /// Spot price per host-hour (p3.2xlarge, us-east-1: about 0.30x on-demand).
    #[arg(long, default_value_t = 0.918)]
    spot_price: f64,
    /// On-demand price per host-hour (p3.2xlarge, us-east-1).
    #[arg(long, default_value_t = 3.06)]
    on_demand_price: f64,
    /// Hosts of the on-demand fleet (default: the spot fleet's time-average over the trace);
    /// the table also has the size of the lowest cost per sample.
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
    /// Print how the figures move with each assumption (price ratio, scaling, state size,
    /// link, revocations without notice, limpet's idle, restart time) instead.
    #[arg(long)]
    sweep: bool,
    /// The job must be done within this many hours (within the trace): each spot policy adds
    /// on-demand hosts when it would miss it; prints what meeting it costs each, against
    /// on-demand alone.
    #[arg(long, value_name = "HOURS", conflicts_with_all = ["sweep", "plot"])]
    deadline: Option<f64>,
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
        let window = trace.duration_s();
        let hosts = self.on_demand_hosts.unwrap_or_else(|| compare::average_fleet(trace, window));
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
            checkpoint_every_s: positive("checkpoint-minutes", self.checkpoint_minutes.unwrap_or(10.0))?
                * 60.0,
            checkpoint_write_s: non_negative("checkpoint-write-seconds", self.checkpoint_write_seconds)?,
            async_pause_s: None,
            restart_on_add: !self.no_restart_on_add,
            checkpoint_on_notice: self.checkpoint_on_notice,
            spot_price: non_negative("spot-price", self.spot_price)?,
            on_demand_price: non_negative("on-demand-price", self.on_demand_price)?,
            on_demand_hosts: hosts,
            samples: 0.0,
            tick_s: positive("tick-ms", self.tick_ms)? / 1e3,
            rates: Vec::new(),
            deadline_s: None,
            until_s: Some(window),
            founders_booted: false,
        };
        if let Some(path) = &self.throughput_from {
            p.rates = measured_rates(path, hosts.max(trace.max_live()))?;
        }
        non_negative("async-pause-seconds", self.async_pause_seconds)?;
        // A bound on the work asked for: a trace in epoch milliseconds, or a tiny tick, would
        // otherwise run for hours.
        if window / p.tick_s > 2e8 {
            return Err(UsageError(format!(
                "--tick-ms {}: {:.0} ticks over the trace's {:.1} h; use a longer tick (the pauses are kept whatever the tick)",
                self.tick_ms,
                window / p.tick_s,
                window / 3600.0
            )));
        }
        if window <= 0.0 {
            return Err(UsageError("the trace spans no time: its events all happen at once".into()));
        }
        p.samples = match self.samples {
            Some(s) => positive("samples", s)?,
            None => p.rate(hosts) * window,
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
    /// Every policy ran exactly this long: the trace's span.
    window_hours: f64,
    /// Mean seconds between the instants checkpoint-restart restarts at, and Young's
    /// interval from it.
    mean_time_between_changes_s: f64,
    young_interval_s: f64,
    /// Each policy's run, limpet first, then checkpoint-restart at its best.
    policies: Vec<PolicyDoc>,
    /// limpet's cost per sample against on-demand's (the first on-demand row), factored.
    breakdown: compare::Breakdown,
    /// Every checkpoint-restart setting searched, with its dollars per million samples.
    search: Vec<(compare::Setting, f64)>,
}

#[derive(serde::Serialize)]
struct TraceDoc {
    file: String,
    events: usize,
    hours: f64,
    max_hosts: usize,
    /// The spot fleet's time-average size (hosts paid for).
    average_hosts: usize,
    revocations: usize,
}

#[derive(serde::Serialize)]
struct PolicyDoc {
    /// How the table names the row (the policy and its setting).
    label: String,
    /// Checkpoint-restart's setting.
    #[serde(skip_serializing_if = "Option::is_none")]
    setting: Option<compare::Setting>,
    /// Hosts of an on-demand row.
    #[serde(skip_serializing_if = "Option::is_none")]
    hosts: Option<usize>,
    #[serde(flatten)]
    outcome: Outcome,
    /// Dollars per trained sample relative to the first on-demand row's.
    cost_vs_on_demand: f64,
    /// Samples trained per hour of the window.
    samples_per_hour: f64,
    /// Hours the job (`params.samples`) takes at this row's pace over the window.
    hours_to_train: f64,
}

/// Runs `limpet simulate`.
pub fn run(a: SimulateArgs) -> crate::Result<()> {
    // Without --trace, the table's first line names the shipped trace as such.
    let (trace, file) = trace::load_as(a.trace.as_deref(), a.trace_format).map_err(UsageError)?;
    let p = a.params(&trace)?;
    if a.sweep {
        let bar = indicatif::ProgressBar::new(sweep::runs(&trace, &p));
        bar.set_style(progress_style());
        bar.set_message("sensitivity");
        let rows = sweep::sweep(&trace, &p, a.async_pause_seconds, &|| bar.inc(1))?;
        bar.finish_and_clear();
        if a.json {
            println!("{}", serde_json::to_string_pretty(&rows)?);
        } else {
            print!("{}", sweep::render(&file, &p, &rows));
        }
        return Ok(());
    }
    let never = |who: &str| UsageError(format!("{who}: the fleet never trains: the trace has no host live"));
    let bar = indicatif::ProgressBar::new(compare::search_runs(&trace, &p) + 4);
    bar.set_style(progress_style());
    bar.set_message("checkpoint-restart's best interval");
    let search = compare::best_checkpoint_restart(&trace, &p, a.async_pause_seconds, &|| bar.inc(1))
        .ok_or_else(|| never("checkpoint-restart"))?;
    if let Some(h) = a.deadline {
        bar.finish_and_clear();
        let rows = deadline::compare(&trace, &p, search.best.0, h)?;
        if a.json {
            println!("{}", serde_json::to_string_pretty(&rows)?);
        } else {
            println!("trace {file}");
            print!("{}", deadline::render(h, p.samples, &rows));
        }
        return Ok(());
    }
    // limpet checkpoints as often as checkpoint-restart at its best (its writes do not pause
    // training, but they matter only when every host is lost at once).
    let every = search.best.0.every_s;
    let limpet = model::simulate(&trace, &Params { checkpoint_every_s: every, ..p.clone() }, Policy::Limpet)
        .ok_or_else(|| never("limpet"))?;
    let label = format!("limpet, checkpoints {}", compare::Setting::every(every, true).describe());
    let mut rows: Vec<(String, Option<compare::Setting>, Option<usize>, Outcome)> =
        vec![(label, None, None, limpet)];
    let (best, young) = (search.best.clone(), search.young.clone());
    rows.push((format!("checkpoint-restart, best: {}", best.0.describe()), Some(best.0), None, best.1));
    rows.push((format!("checkpoint-restart, Young: {}", young.0.describe()), Some(young.0), None, young.1));
    if let Some(m) = a.checkpoint_minutes {
        let given = compare::Setting {
            on_notice: p.checkpoint_on_notice,
            ..compare::Setting::every(m * 60.0, p.restart_on_add)
        };
        let o = model::simulate(&trace, &given.apply(&p), Policy::CheckpointRestart)
            .ok_or_else(|| never("checkpoint-restart"))?;
        rows.push((format!("checkpoint-restart, {}", given.describe()), Some(given), None, o));
    }
    let cheapest = compare::cheapest_size(&p, trace.max_live().max(p.on_demand_hosts));
    let sizes =
        if cheapest == p.on_demand_hosts { vec![cheapest] } else { vec![p.on_demand_hosts, cheapest] };
    for (i, n) in sizes.into_iter().enumerate() {
        let od = model::simulate(&trace, &Params { on_demand_hosts: n, ..p.clone() }, Policy::OnDemand)
            .ok_or_else(|| never("on-demand"))?;
        let why = match (i, a.on_demand_hosts) {
            (0, None) => "the spot fleet's average",
            (0, Some(_)) => "as given",
            _ => "cheapest per sample",
        };
        let hosts = if n == 1 { "1 host".to_string() } else { format!("{n} hosts") };
        rows.push((format!("on-demand, {hosts} ({why})"), None, Some(n), od));
    }
    bar.inc(4);
    bar.finish_and_clear();
    let od =
        rows.iter().find(|r| r.3.policy == Policy::OnDemand).map(|r| r.3.clone()).expect("an on-demand row");
    if let Some(path) = &a.plot {
        let drawn: Vec<(String, &Outcome)> = rows
            .iter()
            .filter(|r| {
                r.3.policy == Policy::Limpet
                    || r.0.contains("best")
                    || r.3.policy == Policy::OnDemand && r.2 == Some(p.on_demand_hosts)
            })
            .map(|r| (format!("{}: {:.1} h to train", r.0, p.samples / (r.3.trained / r.3.hours)), &r.3))
            .collect();
        plot::simulation_svg(path, &drawn, &format!("{file}: live hosts and progress"))?;
    }
    let window = trace.duration_s();
    let report = Report {
        trace: TraceDoc {
            file,
            events: trace.events.len(),
            hours: window / 3600.0,
            max_hosts: trace.max_live(),
            average_hosts: compare::average_fleet(&trace, window),
            revocations: trace.removals(),
        },
        window_hours: window / 3600.0,
        mean_time_between_changes_s: compare::mean_time_between_changes(&trace, window, p.restart_on_add),
        young_interval_s: search.young.0.every_s,
        breakdown: compare::breakdown(&rows[0].3, &od, &p),
        search: search.tried,
        policies: rows
            .into_iter()
            .map(|(label, setting, hosts, o)| PolicyDoc {
                label,
                setting,
                hosts,
                cost_vs_on_demand: o.usd_per_million / od.usd_per_million,
                samples_per_hour: o.trained / o.hours,
                hours_to_train: p.samples / (o.trained / o.hours).max(f64::MIN_POSITIVE),
                outcome: o,
            })
            .collect(),
        params: p,
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

fn progress_style() -> indicatif::ProgressStyle {
    indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} runs").expect("a valid template")
}

fn render(r: &Report) -> String {
    let t = &r.trace;
    let p = &r.params;
    let mut s = format!(
        "trace {}: {} events over {:.1} h, up to {} hosts (on average {}), {} revocations, its fleet changing every {:.0} s on average while live\n\
         every policy runs the trace's {:.1} h; the job: {:.0} samples (what {} on-demand hosts train in that time)\n\n",
        t.file,
        t.events,
        t.hours,
        t.max_hosts,
        t.average_hosts,
        t.revocations,
        r.mean_time_between_changes_s,
        r.window_hours,
        p.samples,
        p.on_demand_hosts,
    );
    let mut table = crate::text::table(
        &[
            "POLICY",
            "GOODPUT",
            "CHANGES",
            "LOST",
            "PAUSED",
            "COST",
            "$/M SAMPLES",
            "VS ON-DEMAND",
            "HOURS TO TRAIN",
        ],
        1..9,
    );
    for d in &r.policies {
        let o = &d.outcome;
        table.add_row(vec![
            d.label.clone(),
            format!("{:.1}%", o.goodput * 100.0),
            o.transitions.to_string(),
            format!("{:.0} s", o.lost_s),
            format!("{:.0} s", o.paused_s),
            format!("${:.2}", o.cost),
            format!("{:.2}", o.usd_per_million),
            format!("{:.2}x", d.cost_vs_on_demand),
            format!("{:.1}", d.hours_to_train),
        ]);
    }
    s += &crate::text::lines(&table);
    let (limpet, best) = (&r.policies[0], &r.policies[1]);
    let b = &r.breakdown;
    s += &format!(
        "\nlimpet against checkpoint-restart at its best: {:.2}x the cost per sample, {:.2}x the time to train\n\
         limpet against on-demand = price {:.2} x boot {:.3} x scaling {:.3} x transitions {:.4} = {:.2}x\n",
        limpet.outcome.usd_per_million / best.outcome.usd_per_million,
        limpet.hours_to_train / best.hours_to_train,
        b.price,
        b.boot,
        b.scaling,
        b.transitions,
        b.total,
    );
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
