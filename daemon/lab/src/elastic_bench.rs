//! `limpet-lab bench elastic`: what a transition costs, measured from step logs, next to
//! torchrun (PyTorch's elastic launcher, gloo backend) recovering from a killed worker on the
//! same model and data in the same run.
//!
//! limpet: a local cluster trains the digits MLP through a spot notice, a join, a `kill -9`
//! of the Raft leader's host and one of another host. Reported per transition: the ranks'
//! idle time, lost steps, and for the kills the time from the kill to the next completed
//! step (a new leader included). torchrun: `bench/torchrun_elastic.py` (checkpoint every
//! 100 steps) with one worker killed at the same point of the job; reported: the time from
//! the kill to the next completed step, and the steps redone from the checkpoint. torchft:
//! `bench/torchft_elastic.py`, replica groups of one process coordinated by torchft's
//! lighthouse, one group killed; reported: the time from the kill to the survivors' first
//! step committed without it, with `torchft_lighthouse`'s default join timeout (60 s) and
//! with 100 ms.

use crate::demo::{now_ms, run_scenario, Action};
use crate::local::LocalJob;
use crate::steplog::{json_lines, step_logs_in};
use anyhow::Context;
use clap::Args;
use serde::Serialize;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// `limpet-lab bench elastic`.
#[derive(Debug, Args)]
pub struct BenchElasticArgs {
    /// Steps of the job.
    #[arg(long, default_value_t = 6000)]
    pub steps: u64,
    /// `mlp` (digits, global batch 64; compared with torchrun) or `gpt` (common-licenses,
    /// global batch 32: longer steps, limpet only).
    #[arg(long, default_value = "mlp")]
    pub model: String,
    /// Founding agents (and torchrun workers).
    #[arg(long, default_value_t = 4)]
    pub nodes: usize,
    /// How long to wait for torchrun's next step after the kill, seconds.
    #[arg(long, default_value_t = 60)]
    pub torchrun_wait: u64,
    /// torchft's replica groups (one process each; one is killed).
    #[arg(long, default_value_t = 3)]
    pub torchft_replicas: usize,
    /// Leave torchft out (it is installed by `bash deploy/setup.sh --bench`, which `make
    /// bench` runs).
    #[arg(long)]
    pub no_torchft: bool,
    /// Instead of transitions: the step time of a reproducible job against the ordinary one,
    /// the same job on the same agents, one run after the other.
    #[arg(long)]
    pub reproducible: bool,
    /// With --model llama: its size preset.
    #[arg(long, default_value = "small")]
    pub preset: String,
    /// With --model llama: the residual stream's width instead of the preset's (and the
    /// SwiGLU width at 8/3 of it, a multiple of 16), for a larger gradient.
    #[arg(long)]
    pub d_model: Option<usize>,
    /// With --reproducible: canonical shards per step [default: the job's, 8].
    #[arg(long)]
    pub shards: Option<usize>,
    /// Also run the same transitions with the optimizer state sharded, with this many
    /// replicas of each shard (`[job].shard_state = "optimizer"`), after the whole-state run.
    #[arg(long)]
    pub shard_replicas: Option<usize>,
    /// Print the results as JSON.
    #[arg(long)]
    pub json: bool,
    /// Keep the runs (step logs, node logs, the peers' logs) in this directory.
    #[arg(long)]
    pub dir: Option<std::path::PathBuf>,
}

/// `--reproducible`: median step times of both paths.
#[derive(Debug, Serialize)]
pub struct ReproBench {
    /// The model.
    pub model: String,
    /// Its gradient, bytes (f32).
    pub gradient_bytes: u64,
    /// Agents.
    pub nodes: usize,
    /// Mean step time of the ordinary job, ms.
    pub ordinary_ms: f64,
    /// Mean step time of the reproducible job, ms.
    pub reproducible_ms: f64,
    /// reproducible / ordinary.
    pub ratio: f64,
    /// Steps of the reproducible job that agreed their exponents (the first, and each one
    /// whose prediction missed), of `steps`.
    pub agreed_steps: usize,
    /// Steps of each job.
    pub steps: u64,
    /// Whether the goal (at most 1.3x) was met.
    pub met: bool,
}

/// node-1's mean step time in `dir`'s step logs, after the first tenth of the steps (they
/// warm up: connections, allocations). Wall times are whole milliseconds, so a mean over
/// many steps rather than a median of gaps.
fn mean_step_ms(dir: &Path) -> limpet_daemon::Result<f64> {
    let lines = step_logs_in(dir)?;
    let mut mine: Vec<u64> = lines.iter().filter(|l| l.node == 1).map(|l| l.wall_ms).collect();
    mine.sort_unstable();
    let kept = &mine[mine.len() / 10..];
    Ok(match kept {
        [first, .., last] => (last - first) as f64 / (kept.len() - 1) as f64,
        _ => 0.0,
    })
}

/// `--reproducible`: the same job both ways on `a.nodes` agents, no transitions.
fn bench_reproducible(a: &BenchElasticArgs, job: LocalJob) -> limpet_daemon::Result<()> {
    let tmp = tempfile::tempdir()?;
    let mut times = Vec::new();
    for reproducible in [false, true] {
        let dir = tmp.path().join(if reproducible { "reproducible" } else { "ordinary" });
        eprintln!(
            "{} job: {} agents, {} {} steps",
            if reproducible { "reproducible" } else { "ordinary" },
            a.nodes,
            job.model,
            a.steps
        );
        let job = LocalJob { reproducible, shards: a.shards.filter(|_| reproducible), ..job.clone() };
        run_scenario(&dir, a.nodes, job, &[], Duration::from_secs(1800), !a.json)?;
        times.push(mean_step_ms(&dir)?);
    }
    let agreed_steps =
        step_logs_in(&tmp.path().join("reproducible"))?.iter().filter(|l| l.node == 1 && l.agreed).count();
    let image = limpet_snapshot::read_file(&tmp.path().join("ordinary/node-1/checkpoint.safetensors"))?;
    let gradient_bytes = image
        .tensors()
        .iter()
        .filter(|(k, _)| k.starts_with("param/"))
        .map(|(_, t)| t.data().len() as u64)
        .sum();
    let ratio = times[1] / times[0].max(1e-9);
    let r = ReproBench {
        model: job.model.clone(),
        gradient_bytes,
        nodes: a.nodes,
        ordinary_ms: times[0],
        reproducible_ms: times[1],
        ratio,
        agreed_steps,
        steps: a.steps,
        met: ratio <= 1.3,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!(
            "{} on {} agents ({:.1} MB of gradients): ordinary {:.2} ms/step, reproducible {:.2} ms/step, {:.2}x (goal <= 1.3x: {}); exponents agreed on {} of {} steps",
            r.model,
            r.nodes,
            r.gradient_bytes as f64 / 1e6,
            r.ordinary_ms,
            r.reproducible_ms,
            r.ratio,
            if r.met { "met" } else { "not met" },
            r.agreed_steps,
            r.steps
        );
    }
    Ok(())
}

/// One measured transition.
#[derive(Debug, Serialize)]
pub struct Measured {
    /// What happened.
    pub event: String,
    /// Largest idle time of a surviving rank, ms (from the agents' records).
    pub idle_ms: Option<u64>,
    /// From the event to the next completed step, ms (kills only; from the step logs).
    pub recovery_ms: Option<u64>,
    /// Step computations lost or steps redone.
    pub lost_steps: Option<u64>,
    /// State copy time, ms (joins; with sharded state, the longest re-cut of any entry).
    pub fetch_ms: Option<u64>,
    /// Bytes of state the ranks received (sum over ranks).
    pub bytes: Option<u64>,
    /// The goal, in words.
    pub goal: String,
    /// Whether the goal was met.
    pub met: bool,
}

/// The whole result.
#[derive(Debug, Serialize)]
pub struct ElasticBench {
    /// Median step time in limpet's first epoch, ms.
    pub step_ms: f64,
    /// limpet's transitions.
    pub limpet: Vec<Measured>,
    /// The same with the optimizer state sharded (`--shard-replicas`).
    pub sharded: Option<Vec<Measured>>,
    /// torchrun after a killed worker (MLP only: its script trains the MLP).
    pub torchrun: Option<Measured>,
    /// torchft after a killed replica group, with `torchft_lighthouse`'s default join timeout and
    /// with 100 ms (MLP only).
    pub torchft: Vec<Measured>,
}

/// Runs the benchmark.
pub fn bench(a: BenchElasticArgs) -> limpet_daemon::Result<()> {
    if a.nodes < 3 && !a.reproducible {
        return Err(limpet_daemon::UsageError("--nodes must be at least 3".into()).into());
    }
    let tmp = tempfile::tempdir()?;
    let root = a.dir.clone().unwrap_or_else(|| tmp.path().to_path_buf());
    let (model, data, global_batch) = match a.model.as_str() {
        "mlp" => ("mlp", "digits", 64),
        "gpt" => ("gpt", "chars", 32),
        "llama" if a.reproducible => ("llama", "chars", 16),
        m => {
            return Err(limpet_daemon::UsageError(format!(
                "--model {m:?} is not mlp or gpt (or llama with --reproducible)"
            ))
            .into())
        }
    };
    let mut job = LocalJob {
        model: model.into(),
        data: data.into(),
        steps: a.steps,
        global_batch,
        ..LocalJob::default()
    };
    if model == "llama" {
        job.model_section.preset = Some(a.preset.clone());
        if let Some(d) = a.d_model {
            job.model_section.d_model = Some(d);
            job.model_section.ffn = Some((d * 8 / 3).div_ceil(16) * 16);
        }
    } else if a.d_model.is_some() {
        return Err(limpet_daemon::UsageError("--d-model applies to --model llama".into()).into());
    }
    if a.reproducible {
        return bench_reproducible(&a, job);
    }
    let script = vec![
        (0.2, Action::Notice { node: "node-2".into(), in_secs: 30 }),
        (0.4, Action::Join),
        (0.6, Action::Kill { node: "leader".into() }),
        (0.8, Action::Kill { node: "follower".into() }),
    ];
    eprintln!(
        "limpet: {} agents, {model} on {data}, {} steps: notice, join, kill -9 of the leader, kill -9 of another",
        a.nodes, a.steps
    );
    let dir = root.join("limpet");
    let (step_ms, limpet) = transitions(&dir, a.nodes, job.clone(), &script, !a.json)?;
    let sharded = match a.shard_replicas {
        Some(replicas) => {
            eprintln!("limpet, optimizer state sharded with {replicas} replica(s): the same transitions");
            let job = LocalJob { shard_state: Some(("optimizer".into(), replicas)), ..job };
            Some(transitions(&root.join("sharded"), a.nodes, job, &script, !a.json)?.1)
        }
        None => None,
    };
    let torchrun = if model == "mlp" {
        eprintln!(
            "torchrun: {} workers, the same MLP and data, checkpoint every 100 steps, one worker killed at 60%",
            a.nodes
        );
        Some(torchrun(&root.join("torchrun"), a.nodes, a.steps, Duration::from_secs(a.torchrun_wait))?)
    } else {
        None
    };
    let mut torchft = Vec::new();
    if model == "mlp" && !a.no_torchft {
        // `torchft_lighthouse`'s defaults (a 60 s join timeout, 5 s heartbeat timeout), then
        // its join timeout at 100 ms.
        for join_ms in [60_000, 100] {
            eprintln!(
                "torchft: {} replica groups of one process, the same MLP and data, one killed at 60%, the lighthouse's join timeout {join_ms} ms",
                a.torchft_replicas,
            );
            let dir = root.join(format!("torchft-{join_ms}"));
            let r = crate::torchft_peer::run(&dir, a.torchft_replicas, a.steps / 2, join_ms)?;
            let join =
                if join_ms == 60_000 { "60 s, its default".to_string() } else { format!("{join_ms} ms") };
            torchft.push(Measured {
                event: format!("torchft: kill -9 of a replica group (join timeout {join})"),
                idle_ms: None,
                recovery_ms: r.recovery_ms,
                lost_steps: r.lost_steps,
                fetch_ms: None,
                bytes: None,
                goal: "(peer: quorum without the group)".into(),
                met: r.recovery_ms.is_some(),
            });
        }
    }
    let r = ElasticBench { step_ms, limpet, sharded, torchrun, torchft };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print_table(&r);
    }
    Ok(())
}

/// Runs the scenario in `dir`: the median step of the first epoch, ms, and the transitions.
fn transitions(
    dir: &Path,
    nodes: usize,
    job: LocalJob,
    script: &[(f64, Action)],
    show: bool,
) -> limpet_daemon::Result<(f64, Vec<Measured>)> {
    let s = run_scenario(dir, nodes, job, script, Duration::from_secs(600), show)?;
    let lines = step_logs_in(dir)?;
    let mut first: Vec<u64> =
        lines.iter().filter(|l| l.epoch == 1 && l.node == 1).map(|l| l.wall_ms).collect();
    first.sort_unstable();
    let mut gaps: Vec<u64> = first.windows(2).map(|w| w[1] - w[0]).collect();
    gaps.sort_unstable();
    let step_ms = if gaps.is_empty() { 0.0 } else { gaps[gaps.len() / 2].max(1) as f64 };
    Ok((step_ms, measured(&s, &lines, step_ms)))
}

/// limpet's transitions in a finished scenario against their goals: the notice, the join
/// and the kill of the leader (`step_ms`: the median step before them).
fn measured(
    s: &crate::demo::Summary,
    lines: &[limpet_agent::runtime::StepLine],
    step_ms: f64,
) -> Vec<Measured> {
    let find = |cause: &str| s.transitions.iter().find(|t| t.cause.contains(cause));
    let mut limpet = Vec::new();
    if let Some(t) = find("notice for") {
        let idle = t.idle_ms.unwrap_or(0);
        limpet.push(Measured {
            event: "spot notice".into(),
            idle_ms: t.idle_ms,
            recovery_ms: None,
            lost_steps: t.lost_steps,
            fetch_ms: Some(t.fetch_ms),
            bytes: Some(t.fetched_bytes),
            goal: format!("idle <= 1 step ({step_ms:.1} ms), 0 lost"),
            met: idle as f64 <= step_ms.max(1.0) && t.lost_steps == Some(0),
        });
    }
    if let Some(t) = find("join of") {
        let idle = t.idle_ms.unwrap_or(0);
        limpet.push(Measured {
            event: "join".into(),
            idle_ms: t.idle_ms,
            recovery_ms: None,
            lost_steps: t.lost_steps,
            fetch_ms: Some(t.fetch_ms),
            bytes: Some(t.fetched_bytes),
            goal: "idle <= state copy + 500 ms".into(),
            met: idle <= t.fetch_ms + 500,
        });
    }
    // Each kill's transition names its node ("kill -9 node-3" -> "failure of node 3").
    let kills = s.events.iter().filter_map(|e| Some((e.1, e.2.strip_prefix("kill -9 node-")?)));
    for (i, (kill_at, rest)) in kills.enumerate() {
        let id = rest.split(|c: char| !c.is_ascii_digit()).next().unwrap_or_default();
        let Some(t) = find(&format!("failure of node {id}")) else { continue };
        let before = lines.iter().filter(|l| l.wall_ms <= kill_at).map(|l| l.epoch).max().unwrap_or(0);
        let next = lines.iter().filter(|l| l.wall_ms > kill_at && l.epoch > before).map(|l| l.wall_ms).min();
        let recovery = next.map(|n| n - kill_at);
        // The script kills the leader first, then a host that does not lead.
        let (event, goal, goal_ms) = match i {
            0 => ("kill -9 of the leader's host", "kill to next step < 3 s", 3000),
            _ => ("kill -9 of another host", "kill to next step <= 100 ms", 100),
        };
        limpet.push(Measured {
            event: event.into(),
            idle_ms: t.idle_ms,
            recovery_ms: recovery,
            lost_steps: t.lost_steps,
            fetch_ms: Some(t.fetch_ms),
            bytes: Some(t.fetched_bytes),
            goal: goal.into(),
            met: recovery.is_some_and(|r| r <= goal_ms),
        });
    }
    limpet
}

fn print_table(r: &ElasticBench) {
    let ms = |v: Option<u64>| v.map_or("-".into(), |v| format!("{v} ms"));
    let mb = |v: Option<u64>| v.map_or("-".into(), |v| format!("{:.2} MB", v as f64 / 1e6));
    println!("\nlimpet bench elastic (median step {:.1} ms)", r.step_ms);
    println!(
        "{:<42} {:>10} {:>14} {:>6} {:>10} {:>11}  {:<34} met",
        "transition", "idle", "kill->step", "lost", "copy", "bytes", "goal"
    );
    let sharded = r.sharded.iter().flatten().map(|m| (m, "sharded: "));
    let peers = r.torchrun.iter().chain(&r.torchft).map(|m| (m, ""));
    let rows = r.limpet.iter().map(|m| (m, "")).chain(sharded).chain(peers);
    for (m, state) in rows {
        println!(
            "{:<42} {:>10} {:>14} {:>6} {:>10} {:>11}  {:<34} {}",
            format!("{state}{}", m.event),
            ms(m.idle_ms),
            ms(m.recovery_ms),
            m.lost_steps.map_or("-".into(), |v| v.to_string()),
            ms(m.fetch_ms),
            mb(m.bytes),
            m.goal,
            if m.met { "yes" } else { "NO" }
        );
    }
}

#[derive(serde::Deserialize)]
struct TorchLine {
    wall_ms: u64,
    step: u64,
    restart: u64,
}

/// torchrun with `workers` processes of `script` in its own process group (so a stop kills
/// them all), logging to `torchrun.log` in `dir`.
fn spawn_torchrun(
    dir: &Path,
    script: &Path,
    workers: usize,
    steps: u64,
) -> limpet_daemon::Result<std::process::Child> {
    let log = std::fs::File::create(dir.join("torchrun.log"))?;
    let digits = limpet_trainer::data::default_digits_path();
    Command::new(crate::dp_cmd::python())
        .args(["-m", "torch.distributed.run", "--standalone", "--max-restarts=3", "--monitor-interval=0.5"])
        .arg(format!("--nproc-per-node={workers}"))
        .arg(script)
        .env("OUT", dir)
        .env("STEPS", steps.to_string())
        .env("CKPT_EVERY", "100")
        .env("DIGITS", &digits)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .context("starting torchrun (python -m torch.distributed.run)")
        .map_err(Into::into)
}

/// Runs torchrun, kills one worker at 60% of the job, and measures its recovery.
fn torchrun(dir: &Path, workers: usize, steps: u64, wait: Duration) -> limpet_daemon::Result<Measured> {
    std::fs::create_dir_all(dir)?;
    let script = dir.join("torchrun_elastic.py");
    std::fs::write(&script, include_str!("../../../bench/torchrun_elastic.py"))?;
    let mut child = spawn_torchrun(dir, &script, workers, steps)?;
    let pgid = nix::unistd::Pid::from_raw(child.id() as i32);
    let stop = |why: &str| {
        let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
        // Workers torchrun restarted run in sessions of their own, outside its group: each
        // wrote its pid.
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if e.file_name().to_string_lossy().starts_with("pid-") {
                let pid = std::fs::read_to_string(e.path()).ok().and_then(|p| p.trim().parse().ok());
                if let Some(pid) = pid {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
        }
        eprintln!("torchrun: {why}");
    };
    let steps_file = dir.join("steps.jsonl");
    let deadline = Instant::now() + Duration::from_secs(300);
    let kill_step = steps * 6 / 10;
    loop {
        if Instant::now() > deadline || matches!(child.try_wait(), Ok(Some(_))) {
            stop("did not reach the kill point");
            limpet_daemon::fail!(
                "torchrun did not reach step {kill_step}; see {}",
                dir.join("torchrun.log").display()
            );
        }
        if json_lines::<TorchLine>(&steps_file).last().is_some_and(|l| l.step >= kill_step) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid: i32 = std::fs::read_to_string(dir.join("pid-0-1"))?.trim().parse()?;
    let kill_at = now_ms();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL)?;
    let give_up = Instant::now() + wait;
    let goal = "(peer: restart from checkpoint)".to_string();
    loop {
        let lines = json_lines::<TorchLine>(&steps_file);
        if let Some(l) = lines.iter().find(|l| l.restart > 0) {
            let last_before = lines.iter().filter(|x| x.restart == 0).map(|x| x.step).max().unwrap_or(0);
            let m = Measured {
                event: "torchrun: kill -9 of a worker".into(),
                idle_ms: None,
                recovery_ms: Some(l.wall_ms.saturating_sub(kill_at)),
                lost_steps: Some((last_before + 1).saturating_sub(l.step)),
                fetch_ms: None,
                bytes: None,
                goal,
                met: true,
            };
            stop("recovered; stopped");
            let _ = child.wait();
            return Ok(m);
        }
        if Instant::now() > give_up || matches!(child.try_wait(), Ok(Some(_))) {
            let restarted = std::fs::read_dir(dir)?
                .flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("pid-1-"));
            stop("no step after the kill; stopped");
            let _ = child.wait();
            return Ok(Measured {
                event: format!(
                    "torchrun: kill -9 of a worker: no step within {} s ({})",
                    wait.as_secs(),
                    if restarted {
                        "restarted workers never trained"
                    } else {
                        "restarted workers never got past init_process_group"
                    }
                ),
                idle_ms: None,
                recovery_ms: None,
                lost_steps: None,
                fetch_ms: None,
                bytes: None,
                goal,
                met: false,
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
