//! `limpet-lab chaos`: a preemption trace (limpet's shipped AWS p3 trace unless another is
//! named) replayed against a local cluster, compressed in time: a removal is a spot notice
//! through the node's metadata service and, at its deadline, `kill -9` (or, for every k-th
//! removal, `kill -9` at once, no notice); an addition is a new node joining. As it goes it
//! shows progress; at the end it checks the step logs (no step applied twice), measures what
//! the replay trained (goodput against what the same hosts would have trained without any
//! transition, at the speeds measured in the same run), and runs `limpet simulate`'s model
//! over the same compressed segment twice, with the transition costs the cost figure assumes
//! and with those this replay measured (`chaos_measured`), so the simulation is checked against
//! what happened. `--runs N` replays several segments (`chaos_runs`). A table, a plot and `--json`. With `--reproducible`, the job then runs to
//! `--steps` and must end with one uninterrupted process's content hash and losses. With
//! `--ec2 CLUSTER`, the removals go to a real fleet instead (`chaos_ec2`).

use crate::demo::now_ms;
use crate::local::{post_notice, LocalCluster, LocalJob};
use crate::steplog::{merge, read_step_logs};
use crate::transitions::Watcher;
use anyhow::Context;
use clap::Args;
use limpet_agent::runtime::StepLine;
use limpet_daemon::simulate::model::{simulate, Params, Policy};
use limpet_daemon::simulate::trace::{Event, Trace};
use limpet_daemon::status::{gather, TransitionDoc};
use limpet_daemon::UsageError;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// `limpet-lab chaos`.
#[derive(Clone, Debug, Args)]
pub struct ChaosArgs {
    /// The preemption trace: `ms_since_start,add|remove,NODE` per line [default: the AWS p3
    /// trace shipped with limpet].
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Compress the trace's time by this factor.
    #[arg(long, default_value_t = 60.0)]
    pub speedup: f64,
    /// Start of the segment replayed, in the trace's seconds.
    #[arg(long, default_value_t = 0.0)]
    pub from_s: f64,
    /// End of the segment, in the trace's seconds (default: the trace's end).
    #[arg(long)]
    pub until_s: Option<f64>,
    /// Replay only these hosts of the trace (comma-separated; default: all of them).
    #[arg(long, value_delimiter = ',')]
    pub hosts: Vec<String>,
    /// The notice a revoked host gets, in the trace's seconds (AWS: 120), compressed too.
    #[arg(long, default_value_t = 120.0)]
    pub notice_s: f64,
    /// Every k-th removal is a `kill -9` without notice (0: none).
    #[arg(long, default_value_t = 0)]
    pub kill_every: u32,
    /// The job's model (`mlp`, `convnet`, `gpt`).
    #[arg(long, default_value = "mlp")]
    pub model: String,
    /// Its data (`digits`, `chars`, `synthetic`).
    #[arg(long, default_value = "digits")]
    pub data: String,
    /// Global batch.
    #[arg(long, default_value_t = 64)]
    pub batch: u64,
    /// A reproducible job ([job].reproducible): after the segment the job runs to --steps,
    /// and its final content hash and every step's loss must be one uninterrupted process's.
    #[arg(long, requires = "steps")]
    pub reproducible: bool,
    /// With --reproducible: the job's steps (without: more than the segment trains; the job
    /// is stopped at the segment's end).
    #[arg(long, requires = "reproducible")]
    pub steps: Option<u64>,
    /// Directory for the cluster, its logs, `chaos.json` and `chaos.svg`.
    #[arg(long)]
    pub dir: PathBuf,
    /// Run with certificates.
    #[arg(long)]
    pub tls: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Replay against this cluster's EC2 instances instead of a local cluster: removals
    /// through AWS Fault Injection Service or TerminateInstances (docs/operations.md).
    #[arg(long, value_name = "CLUSTER")]
    pub ec2: Option<String>,
    /// The IAM role FIS assumes (with --ec2).
    #[arg(long, value_name = "ARN")]
    pub fis_role: Option<String>,
    /// AWS region (with --ec2; default: the SDK's).
    #[arg(long)]
    pub region: Option<String>,
    /// Another EC2 and FIS endpoint (with --ec2).
    #[arg(long)]
    pub endpoint_url: Option<String>,
    /// Several segments picked from the trace instead of one (`--runs`).
    #[command(flatten)]
    pub runs: crate::chaos_pick::RunsArgs,
}

/// What a replay did and how the simulation compares.
#[derive(Debug, Serialize)]
pub struct ChaosReport {
    /// Seconds replayed (compressed).
    pub window_s: f64,
    /// The compression.
    pub speedup: f64,
    /// What was fired: seconds into the replay, and what.
    pub events: Vec<(f64, String)>,
    /// Distinct steps trained in the window.
    pub steps: u64,
    /// Steps applied twice in the surviving lineage (must be 0).
    pub steps_applied_twice: u64,
    /// Every epoch change, with idle, lost and redone steps.
    pub transitions: Vec<TransitionDoc>,
    /// Measured samples per second by world size.
    pub rates: BTreeMap<usize, f64>,
    /// Measured seconds from starting a node to its first step.
    pub join_s: f64,
    /// Samples the replay trained.
    pub replay_trained: f64,
    /// Its goodput: trained over what the same hosts would have trained.
    pub replay_goodput: f64,
    /// Samples the simulation of the same segment trained.
    pub simulated_trained: f64,
    /// Its goodput.
    pub simulated_goodput: f64,
    /// |replay - simulated| / simulated goodput.
    pub difference: f64,
    /// What this replay's transitions cost, by kind.
    pub measured_costs: crate::chaos_measured::MeasuredCosts,
    /// The simulation's goodput with those costs instead of the cost figure's.
    pub simulated_goodput_measured_costs: f64,
    /// |replay - that| / that.
    pub difference_measured_costs: f64,
    /// With `--reproducible`: the final state against one uninterrupted process's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reproducible: Option<SameBits>,
}

/// A reproducible replay's final state against one uninterrupted process of the same job.
#[derive(Debug, Serialize)]
pub struct SameBits {
    /// Steps of the job.
    pub steps: u64,
    /// The content hash every rank of the final epoch ended with.
    pub content_hash: String,
    /// One process's, trained by `limpet train --reproducible`.
    pub one_process_hash: String,
    /// Steps whose loss differs from one process's (by a bit).
    pub steps_with_other_loss: u64,
}

/// A scheduled action of the replay.
#[derive(Clone, Debug)]
enum Act {
    Notice(String),
    Kill(String),
    Join(String),
}

/// The selected hosts' segment of `trace`, in compressed seconds: the hosts live at its start
/// (added at 0), and the events within it.
pub(crate) fn segment(trace: &Trace, a: &ChaosArgs) -> limpet_daemon::Result<(Vec<String>, Trace, f64)> {
    let bad = |m: String| limpet_daemon::Failure::from(UsageError(m));
    if !(a.speedup.is_finite() && a.speedup >= 1.0) {
        return Err(bad(format!("--speedup {}: at least 1", a.speedup)));
    }
    let until = a.until_s.unwrap_or_else(|| trace.duration_s());
    if !(a.from_s >= 0.0 && until > a.from_s) {
        return Err(bad(format!("--from-s {} --until-s {until}: an empty segment", a.from_s)));
    }
    let wanted: BTreeSet<&str> = a.hosts.iter().map(String::as_str).collect();
    let picked = |e: &Event| wanted.is_empty() || wanted.contains(e.node.as_str());
    // Rounded: a segment picked in milliseconds comes back through seconds.
    let (from_ms, until_ms) = ((a.from_s * 1e3).round() as u64, (until * 1e3).round() as u64);
    let mut live = BTreeSet::new();
    for e in trace.events.iter().filter(|e| e.at_ms <= from_ms && picked(e)) {
        if e.add {
            live.insert(e.node.clone());
        } else {
            live.remove(&e.node);
        }
    }
    if live.is_empty() {
        return Err(bad(format!("no host of the selection is live at {} s of the trace", a.from_s)));
    }
    let founders: Vec<String> = live.iter().cloned().collect();
    let mut events: Vec<Event> =
        founders.iter().map(|n| Event { at_ms: 0, add: true, node: n.clone() }).collect();
    events.extend(trace.events.iter().filter(|e| e.at_ms > from_ms && e.at_ms < until_ms && picked(e)).map(
        |e| Event {
            at_ms: ((e.at_ms - from_ms) as f64 / a.speedup) as u64,
            add: e.add,
            node: e.node.clone(),
        },
    ));
    let window = (until - a.from_s) / a.speedup;
    if founders.len() + events.iter().filter(|e| e.add && e.at_ms > 0).count() > 12 {
        return Err(bad("more than 12 hosts in the segment: select fewer with --hosts".into()));
    }
    let end_ms = (window * 1e3) as u64;
    Ok((founders, Trace { events, end_ms }, window))
}

/// The trace `a` names, once its `--dir` is found empty (or absent).
pub(crate) fn prepare(a: &ChaosArgs) -> limpet_daemon::Result<Trace> {
    let (trace, _) = limpet_daemon::simulate::trace::load(a.trace.as_deref()).map_err(UsageError)?;
    if a.dir.exists() && std::fs::read_dir(&a.dir)?.next().is_some() {
        return Err(UsageError(format!("--dir {}: not empty", a.dir.display())).into());
    }
    Ok(trace)
}

/// Runs `limpet-lab chaos` (one segment: `chaos_runs` runs several).
pub fn run(a: ChaosArgs) -> limpet_daemon::Result<()> {
    let trace = prepare(&a)?;
    let (founders, seg, window) = segment(&trace, &a)?;
    if let Some(cluster) = &a.ec2 {
        let spec = crate::chaos_ec2::Ec2Chaos {
            fis_role: a.fis_role.clone(),
            region: a.region.clone(),
            endpoint_url: a.endpoint_url.clone(),
            notice_s: a.notice_s,
            kill_every: a.kill_every,
        };
        let report = crate::chaos_ec2::replay(&spec, cluster, &founders, &seg)?;
        std::fs::create_dir_all(&a.dir)?;
        std::fs::write(a.dir.join("chaos.json"), serde_json::to_vec_pretty(&report)?)?;
        if a.json {
            println!("{}", serde_json::to_string_pretty(&report)?);
        }
        return Ok(());
    }
    let report = replay(&a, &founders, &seg, window)?;
    std::fs::write(a.dir.join("chaos.json"), serde_json::to_vec_pretty(&report)?)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", table(&report));
        println!("plot: {}", a.dir.join("chaos.svg").display());
    }
    if report.steps_applied_twice > 0 {
        limpet_daemon::fail!("{} step(s) were applied twice", report.steps_applied_twice);
    }
    if let Some(r) = &report.reproducible {
        if r.content_hash != r.one_process_hash || r.steps_with_other_loss > 0 {
            limpet_daemon::fail!(
                "a reproducible job ended with content hash {} where one process ends with {}; {} step(s) had another loss",
                r.content_hash,
                r.one_process_hash,
                r.steps_with_other_loss
            );
        }
    }
    Ok(())
}

/// Longest a reproducible replay's job may go without a step before the replay gives up.
const FINISH_WITHIN: Duration = Duration::from_secs(120);

/// With `--reproducible`: waits for the job's last step, then compares the final epoch's
/// checkpoints and every step's loss with one uninterrupted process of the same job.
fn same_bits(
    a: &ChaosArgs,
    cluster: &LocalCluster,
    bar: &indicatif::ProgressBar,
    rt: &tokio::runtime::Runtime,
    tls: Option<&limpet_consensus::tls::Tls>,
) -> limpet_daemon::Result<SameBits> {
    let steps = a.steps.context("--reproducible needs --steps")?;
    let logs: Vec<PathBuf> = cluster.file.nodes.iter().map(|n| n.step_log.clone()).collect();
    let (mut waited, mut reached) = (Instant::now(), 0);
    // Step logs name the step computed, from 0. Given up when no step comes for a while.
    loop {
        let now_at = read_step_logs(&logs)?.iter().map(|l| l.step + 1).max().unwrap_or(0);
        if now_at >= steps {
            break;
        }
        if now_at > reached {
            (waited, reached) = (Instant::now(), now_at);
        }
        if waited.elapsed() > FINISH_WITHIN {
            let stuck = rt
                .block_on(gather(&cluster.file.cluster, &cluster.file.control_addrs(), tls))
                .ok()
                .and_then(|d| d.stuck)
                .map_or(String::new(), |s| format!(": {s}"));
            limpet_daemon::fail!(
                "the job stopped at step {reached} of {steps}: no step for {FINISH_WITHIN:?}{stuck}"
            );
        }
        bar.set_message("the job's last steps");
        std::thread::sleep(Duration::from_millis(100));
    }
    // The ranks that trained the last step write the final checkpoint once it is logged.
    let hash_of = |p: &Path| -> limpet_daemon::Result<String> {
        Ok(limpet_snapshot::read_file(p)
            .with_context(|| format!("final checkpoint {}", p.display()))?
            .content_hash()
            .to_string())
    };
    let last: BTreeSet<String> =
        read_step_logs(&logs)?.into_iter().filter(|l| l.step + 1 == steps).map(|l| l.name).collect();
    let written = |r: &String| a.dir.join(r).join(limpet_trainer::CHECKPOINT_FILE).exists();
    let since = Instant::now();
    while !last.iter().all(written) {
        if since.elapsed() > Duration::from_secs(60) {
            limpet_daemon::fail!(
                "the ranks that trained step {steps} ({last:?}) wrote no final checkpoint within 60 s"
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let hashes = last
        .iter()
        .map(|r| hash_of(&a.dir.join(r).join(limpet_trainer::CHECKPOINT_FILE)))
        .collect::<limpet_daemon::Result<BTreeSet<String>>>()?;
    if hashes.len() != 1 {
        limpet_daemon::fail!(
            "the ranks that trained the last step ended with {} different states: {hashes:?}",
            hashes.len()
        );
    }
    bar.set_message("one uninterrupted process");
    let one = a.dir.join("one-process");
    let exe = std::env::current_exe()?.with_file_name("limpet");
    let out = std::process::Command::new(&exe)
        .args(["train", "--json", "--reproducible", "--model", &a.model, "--data", &a.data])
        .args(["--batch", &a.batch.to_string(), "--steps", &steps.to_string(), "--out"])
        .arg(&one)
        .output()
        .with_context(|| format!("running {}", exe.display()))?;
    if !out.status.success() {
        limpet_daemon::fail!("one process: {}", String::from_utf8_lossy(&out.stderr));
    }
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let one_process_hash =
        report["content_hash"].as_str().context("limpet train reported no content hash")?.to_string();
    // Its steps.jsonl counts steps from 1.
    let mut want = BTreeMap::new();
    for l in std::fs::read_to_string(one.join("steps.jsonl"))?.lines() {
        let v: serde_json::Value = serde_json::from_str(l)?;
        if let (Some(step), Some(loss)) = (v["step"].as_u64(), v["loss"].as_f64()) {
            want.insert(step.saturating_sub(1), loss.to_bits());
        }
    }
    let steps_with_other_loss = read_step_logs(&logs)?
        .iter()
        .filter(|l| want.get(&l.step) != Some(&l.loss.to_bits()))
        .map(|l| l.step)
        .collect::<BTreeSet<u64>>()
        .len() as u64;
    Ok(SameBits {
        steps,
        content_hash: hashes.into_iter().next().expect("one hash"),
        one_process_hash,
        steps_with_other_loss,
    })
}

pub(crate) fn replay(
    a: &ChaosArgs,
    founders: &[String],
    seg: &Trace,
    window: f64,
) -> limpet_daemon::Result<ChaosReport> {
    let job = LocalJob {
        model: a.model.clone(),
        data: a.data.clone(),
        steps: a.steps.unwrap_or(100_000_000),
        global_batch: a.batch,
        tls: a.tls,
        reproducible: a.reproducible,
        ..LocalJob::default()
    };
    let mut cluster = LocalCluster::up(&a.dir, founders.len(), job)?;
    let mut names: BTreeMap<String, String> =
        founders.iter().enumerate().map(|(i, f)| (f.clone(), format!("node-{}", i + 1))).collect();
    let logs = |c: &LocalCluster| c.file.nodes.iter().map(|n| n.step_log.clone()).collect::<Vec<_>>();
    // The trace's clock starts at the first step.
    let waited = Instant::now();
    let t0 = loop {
        if let Some(first) = read_step_logs(&logs(&cluster))?.iter().map(|l| l.wall_ms).min() {
            break first;
        }
        if waited.elapsed() > Duration::from_secs(120) {
            limpet_daemon::fail!("no step within 120 s; logs in {}", a.dir.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let start = Instant::now() - Duration::from_millis(now_ms().saturating_sub(t0));
    // The schedule, in replay seconds.
    let mut plan: Vec<(f64, Act)> = Vec::new();
    let notice = (a.notice_s / a.speedup).max(1.0);
    let mut removals = 0u32;
    for e in seg.events.iter().filter(|e| e.at_ms > 0) {
        let t = e.at_ms as f64 / 1e3;
        if e.add {
            plan.push((t, Act::Join(e.node.clone())));
        } else {
            removals += 1;
            if a.kill_every > 0 && removals % a.kill_every == 0 {
                plan.push((t, Act::Kill(e.node.clone())));
            } else {
                plan.push((t, Act::Notice(e.node.clone())));
                plan.push((t + notice, Act::Kill(e.node.clone())));
            }
        }
    }
    plan.sort_by(|x, y| x.0.total_cmp(&y.0));
    let bar = if a.json {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(window.ceil() as u64)
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} s {msg}")
            .expect("template")
            .progress_chars("=> "),
    );
    let (mut fired, mut killed, mut started_at) = (Vec::new(), Vec::new(), BTreeMap::new());
    // Status shows the newest transitions only: a replay's are read as it goes.
    let watcher = Watcher::start(
        cluster.file.cluster.clone(),
        cluster.file.control_addrs(),
        cluster.file.operator_tls.clone(),
    )?;
    let mut next = 0;
    while start.elapsed().as_secs_f64() < window {
        let now = start.elapsed().as_secs_f64();
        while next < plan.len() && plan[next].0 <= now {
            let (t, act) = plan[next].clone();
            next += 1;
            let what = match &act {
                Act::Notice(h) => {
                    let name = names.get(h).context("a notice for a host never started")?;
                    post_notice(&cluster.file.node(name)?.metadata, notice.ceil() as u64)?;
                    format!("spot notice for {h} ({name}), revoked in {notice:.0} s")
                }
                Act::Kill(h) => {
                    let name = names.get(h).context("a kill for a host never started")?.clone();
                    if !cluster.running(&name) {
                        continue;
                    }
                    killed.push(cluster.file.node(&name)?.id);
                    cluster.kill(&name)?;
                    format!("kill -9 {h} ({name})")
                }
                Act::Join(h) => {
                    let name = cluster.add()?;
                    watcher.set_addrs(cluster.file.control_addrs());
                    started_at.insert(cluster.file.node(&name)?.id, now_ms());
                    names.insert(h.clone(), name.clone());
                    format!("{h} joins as {name}")
                }
            };
            bar.println(format!("{t:7.1} s  {what}"));
            fired.push((t, what));
        }
        bar.set_position(now as u64);
        std::thread::sleep(Duration::from_millis(20));
    }
    let end_ms = t0 + (window * 1e3) as u64;
    let transitions = watcher.finish();
    let tls = match &cluster.file.operator_tls {
        Some(files) => Some(limpet_consensus::tls::Tls::load(files)?),
        None => None,
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let reproducible = match a.reproducible {
        true => Some(same_bits(a, &cluster, &bar, &rt, tls.as_ref())?),
        false => None,
    };
    bar.finish_and_clear();
    let lines: Vec<StepLine> =
        read_step_logs(&logs(&cluster))?.into_iter().filter(|l| l.wall_ms <= end_ms).collect();
    cluster.down();
    let redone = crate::transitions::redone(&transitions);
    let (points, twice) = merge(&lines, &killed, &redone);
    let rates = crate::chaos_measured::measured_rates(&lines, a.batch);
    let joins: Vec<f64> = started_at
        .iter()
        .filter_map(|(node, at)| {
            let first = lines.iter().filter(|l| l.node == *node).map(|l| l.wall_ms).min()?;
            Some(first.saturating_sub(*at) as f64 / 1e3)
        })
        .collect();
    let join_s = if joins.is_empty() { 0.0 } else { joins.iter().sum::<f64>() / joins.len() as f64 };
    let steps = points.len().saturating_sub(1) as u64;
    let replay_trained = steps as f64 * a.batch as f64;

    let assumed = crate::chaos_measured::params(a.kill_every, &rates, &lines, join_s, window);
    let sim = simulate(seg, &assumed, Policy::Limpet).context("the simulation found no host")?;
    let measured_costs = crate::chaos_measured::measure(&transitions, assumed.step_s);
    let measured = Params {
        notice_idle_s: measured_costs.notice_idle_ms.map_or(assumed.notice_idle_s, |m| m / 1e3),
        kill_recovery_s: measured_costs.kill_recovery_ms.map_or(assumed.kill_recovery_s, |m| m / 1e3),
        join_idle_s: measured_costs.join_idle_ms.map_or(assumed.join_idle_s, |m| m / 1e3),
        ..assumed.clone()
    };
    let with_measured = simulate(seg, &measured, Policy::Limpet).context("the simulation found no host")?;
    // Over what the booted hosts could have trained: the replay's boots are its own
    // processes starting, not the cloud's, so they are not charged to either.
    let possible = sim.possible_ready.max(f64::MIN_POSITIVE);
    let (replay_goodput, simulated_goodput) = (replay_trained / possible, sim.trained / possible);
    let report = ChaosReport {
        window_s: window,
        speedup: a.speedup,
        events: fired,
        steps,
        steps_applied_twice: twice,
        transitions,
        rates,
        join_s,
        replay_trained,
        replay_goodput,
        simulated_trained: sim.trained,
        simulated_goodput,
        difference: (replay_goodput - simulated_goodput).abs() / simulated_goodput.max(f64::MIN_POSITIVE),
        measured_costs,
        simulated_goodput_measured_costs: with_measured.trained / possible,
        difference_measured_costs: (replay_goodput - with_measured.trained / possible).abs()
            / (with_measured.trained / possible).max(f64::MIN_POSITIVE),
        reproducible,
    };
    plot(&a.dir.join("chaos.svg"), &lines, t0, &sim, a.batch, seg, join_s)?;
    Ok(report)
}

fn table(r: &ChaosReport) -> String {
    let mut s = format!(
        "replayed {:.0} s ({}x): {} steps, {} applied twice, {} transitions\n",
        r.window_s,
        r.speedup,
        r.steps,
        r.steps_applied_twice,
        r.transitions.len()
    );
    s += &limpet_daemon::status::transitions_table(&r.transitions);
    let rates: Vec<String> = r.rates.iter().map(|(w, v)| format!("{w}: {v:.0}/s")).collect();
    s += &format!(
        "\nmeasured speed by world: {}; a join took {:.1} s to its first step\n",
        rates.join(", "),
        r.join_s
    );
    s += &format!(
        "\n{:<12} {:>14} {:>9}\n{:<12} {:>14.0} {:>8.1}%\n{:<12} {:>14.0} {:>8.1}%\ndifference in goodput: {:.1}%\n",
        "",
        "samples",
        "goodput",
        "replay",
        r.replay_trained,
        r.replay_goodput * 100.0,
        "simulation",
        r.simulated_trained,
        r.simulated_goodput * 100.0,
        r.difference * 100.0
    );
    s += &format!(
        "with this replay's own transition costs (notice {}, kill {}, join {}): simulation {:.1}%, {:.1}% apart\n",
        ms(r.measured_costs.notice_idle_ms),
        ms(r.measured_costs.kill_recovery_ms),
        ms(r.measured_costs.join_idle_ms),
        r.simulated_goodput_measured_costs * 100.0,
        r.difference_measured_costs * 100.0
    );
    s
}

/// A measured cost, or that none was.
fn ms(v: Option<f64>) -> String {
    v.map_or("none".into(), |v| format!("{v:.0} ms"))
}

/// Hosts the trace has ready, the epoch's world, and samples trained (replay and simulation)
/// against seconds.
fn plot(
    path: &Path,
    lines: &[StepLine],
    t0: u64,
    sim: &limpet_daemon::simulate::model::Outcome,
    batch: u64,
    seg: &Trace,
    join_s: f64,
) -> limpet_daemon::Result<()> {
    use limpet_daemon::plot::{chart_on, count_label, draw_legend, draw_svg, legend_line};
    use plotters::prelude::*;
    let mut steps: BTreeMap<u64, (u64, usize)> = BTreeMap::new();
    for l in lines {
        steps.entry(l.step).or_insert((l.wall_ms, l.world));
    }
    // At most about 2000 points: a fast job logs tens of thousands of steps.
    let every = (steps.len() / 2000).max(1);
    let replay: Vec<(f64, f64, usize)> = steps
        .values()
        .enumerate()
        .filter(|(i, _)| i % every == 0 || *i + 1 == steps.len())
        .map(|(i, (ms, world))| (ms.saturating_sub(t0) as f64 / 1e3, (i as f64) * batch as f64, *world))
        .collect();
    let simulated: Vec<(f64, f64)> =
        sim.timeline.iter().map(|(h, _, frac)| (h * 3600.0, frac * crate::chaos_measured::SAMPLES)).collect();
    let mut ready: Vec<(f64, usize)> = Vec::new();
    let mut live: BTreeSet<&str> = BTreeSet::new();
    for e in &seg.events {
        let t = e.at_ms as f64 / 1e3 + if e.add && e.at_ms > 0 { join_s } else { 0.0 };
        if e.add {
            live.insert(&e.node);
        } else {
            live.remove(e.node.as_str());
        }
        ready.push((t, live.len()));
    }
    ready.sort_by(|a, b| a.0.total_cmp(&b.0));
    draw_svg(path, (1000, 640), |root| {
        let end = sim.hours * 3600.0;
        let most = replay.last().map_or(1.0, |p| p.1).max(sim.trained).max(1.0);
        let hosts = ready.iter().map(|r| r.1).max().unwrap_or(1) + 1;
        let (top, bottom) = root.split_vertically(280);
        let mut h = chart_on(&top, Some("limpet-lab chaos: a trace replayed, and its simulation"), 30)
            .build_cartesian_2d(0f64..end, 0usize..hosts)?;
        h.configure_mesh().y_desc("hosts").y_labels(hosts).draw()?;
        let mut stair = Vec::new();
        for w in ready.windows(2) {
            stair.push((w[0].0, w[0].1));
            stair.push((w[1].0, w[0].1));
        }
        if let Some(l) = ready.last() {
            stair.push((l.0, l.1));
            stair.push((end, l.1));
        }
        h.draw_series(LineSeries::new(stair, BLUE.mix(0.6)))?
            .label("hosts the trace has ready")
            .legend(legend_line(BLUE));
        h.draw_series(LineSeries::new(replay.iter().map(|p| (p.0, p.2)), RED.stroke_width(2)))?
            .label("world of the replay's epochs")
            .legend(legend_line(RED));
        draw_legend(&mut h, SeriesLabelPosition::MiddleRight)?;
        let mut d = chart_on(&bottom, None, 36)
            .y_label_area_size(80)
            .build_cartesian_2d(0f64..end, 0f64..most * 1.05)?;
        d.configure_mesh()
            .x_desc("seconds")
            .y_desc("samples trained")
            .y_label_formatter(&count_label)
            .draw()?;
        d.draw_series(LineSeries::new(replay.iter().map(|p| (p.0, p.1)), RED.stroke_width(2)))?
            .label("replay")
            .legend(legend_line(RED));
        d.draw_series(LineSeries::new(simulated, GREEN.stroke_width(2)))?
            .label("simulation")
            .legend(legend_line(GREEN));
        draw_legend(&mut d, SeriesLabelPosition::LowerRight)?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(from_s: f64, until_s: Option<f64>, hosts: &[&str], speedup: f64) -> ChaosArgs {
        ChaosArgs {
            trace: None,
            speedup,
            from_s,
            until_s,
            hosts: hosts.iter().map(|h| h.to_string()).collect(),
            notice_s: 120.0,
            kill_every: 0,
            model: "mlp".into(),
            data: "digits".into(),
            batch: 64,
            reproducible: false,
            steps: None,
            dir: PathBuf::new(),
            tls: false,
            json: false,
            ec2: None,
            fis_role: None,
            region: None,
            endpoint_url: None,
            runs: Default::default(),
        }
    }

    #[test]
    fn a_segment_starts_with_the_hosts_live_then_and_compresses_what_follows() {
        let t = Trace::parse(
            "0,add,a\n0,add,b\n0,add,c\n10000,remove,c\n20000,add,d\n30000,remove,a\n50000,add,e\n",
            "t",
        )
        .unwrap();
        let (founders, seg, window) = segment(&t, &args(15.0, Some(40.0), &[], 10.0)).unwrap();
        assert_eq!(founders, ["a", "b"]);
        assert_eq!(window, 2.5);
        let compressed: Vec<(u64, bool, &str)> =
            seg.events.iter().map(|e| (e.at_ms, e.add, e.node.as_str())).collect();
        assert_eq!(compressed, [(0, true, "a"), (0, true, "b"), (500, true, "d"), (1500, false, "a")]);
        // A selection of hosts keeps only their events.
        let (founders, seg, _) = segment(&t, &args(15.0, Some(40.0), &["b", "d"], 10.0)).unwrap();
        assert_eq!((founders.len(), seg.events.len()), (1, 2));
        for bad in
            [args(15.0, Some(10.0), &[], 10.0), args(0.0, None, &[], 0.5), args(35.0, None, &["c"], 10.0)]
        {
            assert!(segment(&t, &bad).is_err(), "{bad:?}");
        }
    }
}
