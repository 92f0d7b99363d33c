//! `limpet-lab bench pipeline`: how good the planner's predictions are and what pipelining buys.
//! It profiles the model here, plans a layout for N hosts (processes on this machine), then
//! trains a few steps in the chosen layout, in the runners-up and in plain data parallelism,
//! each rank a real `limpet-lab pipe-worker` process on loopback, and prints predicted against
//! measured step time and the throughput of each.

use crate::dp_cmd::{spawn_group, Workers};
use anyhow::Context;
use clap::Args;
use limpet_agent::planner::{self, HostLayout, HostSpec, Plan, PlanInput};
use limpet_agent::stage::StageConnections;
use limpet_daemon::args::JobArgs;
use limpet_daemon::UsageError;
use serde::Serialize;
use std::io::{BufRead, BufReader, Write};
use std::time::{Duration, Instant};

/// `limpet-lab pipe-worker`: one rank of a data x pipeline layout, for the benchmark.
#[derive(Debug, Args)]
pub struct PipeWorkerArgs {
    /// The job.
    #[command(flatten)]
    pub job: JobArgs,
    /// The group, ranks data-major (replica r, stage s is rank r * stages + s).
    #[command(flatten)]
    pub peers: crate::dp_cmd::WorkerPeers,
    /// The layout (`START..END@HOST,...|...;micro=N`); host `hK` is rank order's node K+1.
    #[arg(long)]
    pub layout: String,
    /// Steps to train.
    #[arg(long, default_value_t = 20)]
    pub train_steps: u64,
    /// Data-plane timeout in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    pub timeout_ms: u64,
    /// Local ranks of this host (CPU devices, a trainer thread each), each a replica of the
    /// host's stage, as `limpetd` trains with `[node].devices`.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=8))]
    pub local_ranks: u64,
}

/// What a worker prints when it is done.
#[derive(Debug, Serialize, serde::Deserialize)]
struct WorkerReport {
    node: u64,
    stage: usize,
    replica: usize,
    step_ms: Vec<f64>,
    loss: f64,
}

/// Runs `limpet-lab pipe-worker`.
pub fn run_worker(args: PipeWorkerArgs) -> limpet_daemon::Result<()> {
    limpet_trainer::set_threads(1);
    let layout: HostLayout = args.layout.parse().map_err(|e| UsageError(format!("--layout: {e}")))?;
    let ep = crate::dp_cmd::bind_worker(&args.peers, args.timeout_ms)?;
    let peers = &args.peers;
    let (d, p, local) = (layout.data, layout.pipeline(), args.local_ranks as usize);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut conn =
        StageConnections::connect(&ep, 1, (d, p, local), &peers.ranks, &peers.addrs, deadline, &|| false)?;
    let stage = &layout.stages[conn.pos.stage];
    let (mut job, data) = limpet_daemon::train_cmd::job_from_flags(&args.job)?;
    if layout.micro_batch > 0 {
        job.micro_batch = layout.micro_batch;
    }
    job.steps = job.steps.max(args.train_steps);
    let blocks = stage.start..stage.end;
    let mut followers = (1..local)
        .map(|_| limpet_trainer::Trainer::for_stage(job.clone(), data.shallow_clone(), blocks.clone()))
        .collect::<Result<Vec<_>, _>>()?;
    let mut trainer = limpet_trainer::Trainer::for_stage(job, data, blocks)?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(local.max(2) - 1)
        .build()
        .context("the local ranks' threads")?;
    let sums = limpet_trainer::LocalSums::default();
    let mut step_ms = Vec::new();
    let mut loss = 0.0;
    for _ in 0..args.train_steps {
        let t = Instant::now();
        let stats = if local > 1 {
            conn.step_local(&mut trainer, &mut followers, &sums, &pool)?
        } else {
            conn.step(&mut trainer)?
        };
        loss = stats.loss;
        step_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let report =
        WorkerReport { node: peers.node, stage: conn.pos.stage, replica: conn.pos.replica, step_ms, loss };
    writeln!(std::io::stdout().lock(), "{}", serde_json::to_string(&report)?)?;
    Ok(())
}

/// `limpet-lab bench pipeline`.
#[derive(Debug, Args)]
pub struct BenchPipelineArgs {
    /// The job (model, data, batch).
    #[command(flatten)]
    pub job: JobArgs,
    /// Hosts, each a process on this machine.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=8))]
    pub hosts: u64,
    /// Steps each layout trains; the first fifth are warm-up and not counted.
    #[arg(long, default_value_t = 30)]
    pub train_steps: u64,
    /// Runner-up layouts to measure besides the chosen one and plain data parallelism.
    #[arg(long, default_value_t = 2)]
    pub others: usize,
    /// Print the results as JSON.
    #[arg(long)]
    pub json: bool,
    /// Also run a pipelined local cluster of `--hosts` agents through a spot notice and a
    /// `kill -9` of stage hosts, and report each re-planned transition.
    #[arg(long)]
    pub chaos: bool,
    /// Shadow every this many steps in the chaos run.
    #[arg(long, default_value_t = 10)]
    pub shadow_every: u64,
    /// Also train the best pipelined layout on hosts of this many local ranks (CPU devices,
    /// each a replica of its host's stage), against the same replicas on this many times the
    /// hosts of one device each, in the same run.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=8))]
    pub devices: u64,
}

/// The best pipelined layout on hosts of several local ranks against the same replicas on
/// hosts of one device each.
#[derive(Debug, Serialize)]
struct LocalRanks {
    layout: String,
    devices: u64,
    local_samples_per_s: f64,
    hosts_of_one: String,
    one_samples_per_s: f64,
    ratio: f64,
}

#[derive(Debug, Serialize)]
struct Measured {
    layout: String,
    shape: String,
    role: &'static str,
    predicted_ms: f64,
    measured_ms: f64,
    error_pct: f64,
    samples_per_s: f64,
}

use crate::stats::median;

/// The job flags as command-line arguments again, for the workers.
fn job_flags(j: &JobArgs) -> Vec<String> {
    let mut v = Vec::new();
    let mut push = |k: &str, val: Option<String>| {
        if let Some(x) = val {
            v.push(format!("--{k}"));
            v.push(x);
        }
    };
    let name = |x: &dyn Fn() -> Option<String>| x();
    push("model", name(&|| j.model.map(limpet_daemon::args::value_name)));
    push("data", name(&|| j.data.map(limpet_daemon::args::value_name)));
    push("data-path", j.data_path.as_ref().map(|p| p.display().to_string()));
    push("steps", j.keys.steps.map(|x| x.to_string()));
    push("batch", j.keys.global_batch.map(|x| x.to_string()));
    push("micro-batch", j.keys.micro_batch.map(|x| x.to_string()));
    push("optimizer", j.keys.optimizer.map(limpet_daemon::args::value_name));
    push("lr", j.keys.lr.map(|x| x.to_string()));
    push("weight-decay", j.keys.weight_decay.map(|x| x.to_string()));
    push("warmup", j.keys.warmup.map(|x| x.to_string()));
    push("clip", j.keys.clip.map(|x| x.to_string()));
    push("seed", j.keys.seed.map(|x| x.to_string()));
    push("context", j.context.map(|x| x.to_string()));
    push("layers", j.layers.map(|x| x.to_string()));
    v
}

/// Trains `layout` in worker processes and returns the measured step time (ms): per rank
/// the median after warm-up, then the slowest rank.
fn measure(layout: &HostLayout, job: &JobArgs, steps: u64, local: u64) -> limpet_daemon::Result<f64> {
    let exe = std::env::current_exe()?;
    let p = layout.pipeline();
    let host_node = |h: &str| -> limpet_daemon::Result<u64> {
        Ok(h.strip_prefix('h').and_then(|k| k.parse::<u64>().ok()).context("planner host names are hK")? + 1)
    };
    let mut ranks = Vec::new();
    for r in 0..layout.data {
        for s in 0..p {
            ranks.push(host_node(&layout.stages[s].hosts[r])?);
        }
    }
    let mut extra = vec![
        "--layout".to_string(),
        layout.spec(),
        "--train-steps".into(),
        steps.to_string(),
        "--local-ranks".into(),
        local.to_string(),
    ];
    extra.extend(job_flags(job));
    let mut workers: Workers = spawn_group(&exe, "pipe-worker", &ranks, &extra)?;
    let mut slowest: f64 = 0.0;
    for c in &mut workers.children {
        let out = c.stdout.take().context("worker stdout")?;
        let mut line = String::new();
        BufReader::new(out).read_line(&mut line)?;
        let rep: WorkerReport = serde_json::from_str(line.trim())
            .with_context(|| format!("a pipe worker of {} printed {line:?}", layout.spec()))?;
        let warm = (rep.step_ms.len() / 5).max(1).min(rep.step_ms.len() - 1);
        slowest = slowest.max(median(rep.step_ms[warm..].to_vec()));
    }
    for c in &mut workers.children {
        let status = c.wait()?;
        if !status.success() {
            limpet_daemon::fail!("a pipe worker of {} exited with {status}", layout.spec());
        }
    }
    Ok(slowest)
}

/// Runs `limpet-lab bench pipeline`.
pub fn bench(args: BenchPipelineArgs) -> limpet_daemon::Result<()> {
    limpet_trainer::set_threads(1);
    if args.chaos && args.hosts < 4 {
        return Err(UsageError(
            "--chaos needs --hosts 4 or more (a notice and a kill of two stage hosts)".into(),
        )
        .into());
    }
    if args.train_steps < 3 {
        return Err(UsageError("--train-steps must be at least 3".into()).into());
    }
    let (job, data) = limpet_daemon::train_cmd::job_from_flags(&args.job)?;
    let profile = limpet_daemon::plan_cmd::profile(&job, &data, 5)?;
    let link = limpet_daemon::plan_cmd::measure_loopback().context("measuring the loopback link")?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    // The hosts share this machine's cores: with every host busy each runs at cores / hosts
    // of the speed the profile saw.
    let speed = (cores / args.hosts as f64).min(1.0);
    let hosts: Vec<HostSpec> =
        (0..args.hosts).map(|k| HostSpec { name: format!("h{k}"), speed, mem_bytes: 16 << 30 }).collect();
    // The planner's layout is for hosts of one device; `--devices` trains that same layout on
    // hosts of several (and its micro-batch), beside the same replicas on hosts of one.
    let input = PlanInput {
        profile,
        hosts,
        link,
        global_batch: job.global_batch,
        max_depth: None,
        local_ranks: 1,
        replica_batch: None,
    };
    let report = planner::plan(&input)?;
    let todo = to_measure(&report, args.others, args.hosts);
    let bar = indicatif::ProgressBar::new(todo.len() as u64);
    let mut rows = Vec::new();
    for (role, plan) in &todo {
        bar.set_message(plan.layout.spec());
        let measured_ms = measure(&plan.layout, &args.job, args.train_steps, 1)?;
        bar.inc(1);
        rows.push(Measured {
            layout: plan.layout.spec(),
            shape: format!("{}x{}", plan.layout.data, plan.layout.pipeline()),
            role,
            predicted_ms: plan.step_ms,
            measured_ms,
            error_pct: (plan.step_ms - measured_ms) / measured_ms * 100.0,
            samples_per_s: job.global_batch as f64 / (measured_ms / 1e3),
        });
    }
    bar.finish_and_clear();
    let local = if args.devices > 1 { local_ranks(&args, &report, job.global_batch)? } else { None };
    let chaos = if args.chaos { Some(chaos_run(&args, &job, &todo[0].1)?) } else { None };
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "hosts": args.hosts, "host_speed": speed, "rows": rows, "local_ranks": local, "chaos": chaos
            }))?
        );
        return Ok(());
    }
    println!(
        "limpet-lab bench pipeline: {} blocks, global batch {}, {} hosts on {} cores (speed {:.2} each), link {:.2} GB/s",
        input.profile.blocks.len(),
        job.global_batch,
        args.hosts,
        cores,
        speed,
        input.link.bytes_per_s / 1e9
    );
    println!(
        "{:>14} {:>6} {:>13} {:>12} {:>8} {:>10}  layout",
        "role", "shape", "predicted ms", "measured ms", "error", "samples/s"
    );
    for r in &rows {
        println!(
            "{:>14} {:>6} {:>13.2} {:>12.2} {:>7.1}% {:>10.0}  {}",
            r.role, r.shape, r.predicted_ms, r.measured_ms, r.error_pct, r.samples_per_s, r.layout
        );
    }
    if let Some(d) = rows.iter().find(|r| r.role == "data parallel") {
        println!(
            "chosen layout against data parallelism on the same hosts: {:.2}x the samples/s",
            rows[0].samples_per_s / d.samples_per_s
        );
    }
    match (&local, args.devices) {
        (_, 1) => {}
        (Some(l), n) => println!(
            "hosts of {n} local ranks: {} at {:.0} samples/s, the same replicas on {}x the hosts of one device ({}) at {:.0}: {:.2}x",
            l.layout, l.local_samples_per_s, n, l.hosts_of_one, l.one_samples_per_s, l.ratio
        ),
        (None, n) => println!("hosts of {n} local ranks: no pipelined layout was planned for {} hosts", args.hosts),
    }
    if let Some(c) = &chaos {
        print_chaos(&args, c);
    }
    Ok(())
}

/// The best pipelined layout of `report` trained on its hosts with `--devices` local ranks
/// each, then the same replicas (replica `r * devices + k` on a host of its own) on hosts of
/// one device: the same samples and the same threads, only the hosts fewer.
fn local_ranks(
    args: &BenchPipelineArgs,
    report: &planner::PlanReport,
    global_batch: usize,
) -> limpet_daemon::Result<Option<LocalRanks>> {
    let piped = std::iter::once(&report.best).chain(&report.runners_up).find(|p| p.layout.pipeline() > 1);
    let Some(plan) = piped else { return Ok(None) };
    let (layout, n) = (&plan.layout, args.devices as usize);
    let p = layout.pipeline();
    let mut wide = layout.clone();
    wide.data = layout.data * n;
    for (s, stage) in wide.stages.iter_mut().enumerate() {
        stage.hosts = (0..layout.data * n).map(|r| format!("h{}", r * p + s)).collect();
    }
    let local_ms = measure(layout, &args.job, args.train_steps, args.devices)?;
    let one_ms = measure(&wide, &args.job, args.train_steps, 1)?;
    let per_s = |ms: f64| global_batch as f64 / (ms / 1e3);
    Ok(Some(LocalRanks {
        layout: format!("{}x{} on {} hosts", layout.data, p, layout.data * p),
        devices: args.devices,
        local_samples_per_s: per_s(local_ms),
        hosts_of_one: format!("{}x{}", wide.data, p),
        one_samples_per_s: per_s(one_ms),
        ratio: one_ms / local_ms,
    }))
}

/// The layouts to run: the chosen one, `others` runners-up, and plain data parallelism over
/// all `hosts` for comparison (labelled so, even where it is a runner-up).
fn to_measure(report: &planner::PlanReport, others: usize, hosts: u64) -> Vec<(&'static str, Plan)> {
    let mut todo: Vec<(&'static str, Plan)> = vec![("chosen", report.best.clone())];
    for p in report.runners_up.iter().take(others) {
        todo.push(("runner-up", p.clone()));
    }
    let dp = |p: &Plan| p.layout.pipeline() == 1 && p.layout.data as u64 == hosts;
    if !todo.iter().any(|(_, p)| dp(p)) {
        if let Some(p) = report.runners_up.iter().find(|p| dp(p)) {
            todo.push(("data parallel", p.clone()));
        }
    }
    if let Some(t) = todo.iter_mut().skip(1).find(|(_, p)| dp(p)) {
        t.0 = "data parallel";
    }
    todo
}

/// The chaos run's transitions: stall, lost and redone steps, and what was copied.
fn print_chaos(args: &BenchPipelineArgs, c: &crate::demo::Summary) {
    println!(
        "\nreassignment: {} agents, {} steps, a spot notice at 20% and kill -9 at 55% of a stage host (shadow every {}):",
        args.hosts, c.steps, args.shadow_every
    );
    println!(
        "{:>5} {:>6} {:>6} {:>10} {:>5} {:>6} {:>9}  cause",
        "epoch", "step", "layout", "stall ms", "lost", "redone", "copied"
    );
    for t in c.transitions.iter().skip(1) {
        let stall = c.stalls.iter().find(|(e, _)| *e == t.epoch).map_or("-".into(), |(_, ms)| ms.to_string());
        println!(
            "{:>5} {:>6} {:>6} {:>10} {:>5} {:>6} {:>9}  {}",
            t.epoch,
            t.step,
            t.layout,
            stall,
            t.lost_steps.map_or("-".into(), |v| v.to_string()),
            t.redone_steps,
            if t.fetched_bytes > 0 { format!("{:.1} MB", t.fetched_bytes as f64 / 1e6) } else { "-".into() },
            t.cause
        );
    }
    println!(
        "test loss {:.4} after {} steps; steps applied twice: {}",
        c.test_loss, c.steps, c.steps_applied_twice
    );
}

/// A pipelined local cluster through a notice and a kill of stage hosts (at the chosen
/// layout's depth, at least 2), for the transitions' stall times.
fn chaos_run(
    args: &BenchPipelineArgs,
    job: &limpet_trainer::JobSpec,
    chosen: &Plan,
) -> limpet_daemon::Result<crate::demo::Summary> {
    let dir = tempfile::tempdir()?;
    let kind = |v: serde_json::Value| v["kind"].as_str().unwrap_or_default().to_string();
    let layers = match &job.model {
        limpet_trainer::model::ModelSpec::Gpt { layers, .. } => Some(*layers),
        _ => None,
    };
    let local = crate::local::LocalJob {
        model: kind(serde_json::to_value(&job.model)?),
        data: kind(serde_json::to_value(&job.data)?),
        steps: args.train_steps.max(100) * 10,
        global_batch: job.global_batch as u64,
        micro_batch: Some(job.micro_batch as u64),
        pipeline: Some(chosen.layout.pipeline().max(2).to_string()),
        layers,
        shadow_every: args.shadow_every,
        ..crate::local::LocalJob::default()
    };
    let script = crate::demo::parse_script("0.2:notice:follower:30,0.55:kill:follower")?;
    crate::demo::run_scenario(
        dir.path(),
        args.hosts as usize,
        local,
        &script,
        Duration::from_secs(900),
        false,
    )
}
