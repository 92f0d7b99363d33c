//! `limpet-lab demo` (and `make demo`): a local cluster of `limpetd` processes trains a
//! character-level GPT on real text while a scripted scenario plays: a spot notice through a
//! node's metadata service, a new node joining, a `kill -9` without notice, and a drain.
//! Shows live status, then a summary table (steps, test accuracy, every transition with its
//! cause, idle time and lost steps), `summary.json`, and a plot of loss and world size
//! against step with the transitions marked.

use crate::local::{post_notice, LocalCluster, LocalJob};
use crate::steplog::{merge, read_step_logs, stalls};
use anyhow::Context;
use clap::Args;
use limpet_consensus::state::Command;
use limpet_daemon::plot::elastic_svg;
use limpet_daemon::status::{gather, StatusDoc, TransitionDoc};
use serde::Serialize;
use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// `limpet-lab demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Output directory (configurations, logs, state, summary.json, demo.svg); a previous
    /// demo's output there is replaced.
    #[arg(long, default_value = "demo-out")]
    pub dir: PathBuf,
    /// Total training steps. The corpus is small (264 KB of licences): over 800 steps the
    /// held-out loss falls with the training loss; past about 1000 it stops falling while the
    /// training loss goes on down (the model starts to memorize the text).
    #[arg(long, default_value_t = 800)]
    pub steps: u64,
    /// Give up if the job has not finished after this many seconds.
    #[arg(long, default_value_t = 900)]
    pub timeout: u64,
    /// Run without certificates (the cluster secret only, plain-text data plane).
    #[arg(long)]
    pub no_tls: bool,
}

/// `limpet-lab scenario`: any local cluster, job and script (the tests' driver).
#[derive(Debug, Args)]
pub struct ScenarioArgs {
    /// Output directory (must be empty or a previous run's).
    #[arg(long)]
    pub dir: PathBuf,
    /// Founding agents.
    #[arg(long, default_value_t = 3)]
    pub nodes: usize,
    /// Model: mlp, convnet, gpt, llama, torchscript.
    #[arg(long, default_value = "convnet")]
    pub model: String,
    /// Data: digits, chars, tokens, tensors, synthetic.
    #[arg(long, default_value = "digits")]
    pub data: String,
    /// The data file or directory (token shards for `--data tokens`).
    #[arg(long)]
    pub data_path: Option<PathBuf>,
    /// Tokens per sample for chars and tokens.
    #[arg(long)]
    pub context: Option<usize>,
    /// The LLaMA model's sizes.
    #[command(flatten)]
    pub model_keys: limpet_trainer::workload::ModelSection,
    /// Total steps.
    #[arg(long, default_value_t = 1000)]
    pub steps: u64,
    /// Global batch.
    #[arg(long, default_value_t = 64)]
    pub batch: u64,
    /// Peak learning rate [default: the model's].
    #[arg(long)]
    pub lr: Option<f64>,
    /// Optimizer [default: the model's].
    #[arg(long, value_parser = ["adamw", "sgd"])]
    pub optimizer: Option<String>,
    /// Batch / learning-rate policy: fixed-global, linear, sqrt, adascale.
    #[arg(long, default_value = "fixed-global")]
    pub policy: String,
    /// The same bits whatever the number of ranks ([job].reproducible).
    #[arg(long)]
    pub reproducible: bool,
    /// Evaluate the held-out loss every N steps ([job].eval_every; in the plot).
    #[arg(long, value_name = "N")]
    pub eval_every: Option<u64>,
    /// Shard the optimizer state, each shard on N more ranks ([job].shard_state).
    #[arg(long, value_name = "N")]
    pub shard_replicas: Option<usize>,
    /// With --shard-replicas: shard the gradients too ([job].shard_state =
    /// "optimizer+gradients", ZeRO-2).
    #[arg(long, requires = "shard_replicas")]
    pub shard_gradients: bool,
    /// CPU local ranks per node ([node].devices = ["cpu", ...]): a host's devices, each a rank.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub devices: u16,
    /// NODE:N gives NODE N CPU local ranks in place of --devices (hosts of unequal devices);
    /// repeatable.
    #[arg(long, value_name = "NODE:N", value_parser = parse_node_devices)]
    pub node_devices: Vec<(String, usize)>,
    /// Zones the nodes lie in, node N in zone-((N-1) mod ZONES) ([node].zone); 0: none said.
    #[arg(long, default_value_t = 0)]
    pub zones: u16,
    /// Fewest nodes training continues with.
    #[arg(long, default_value_t = 1)]
    pub min_nodes: usize,
    /// Pipeline stages per replica (a number, or `auto` for the planner's choice).
    #[arg(long)]
    pub pipeline: Option<String>,
    /// Memory per host for the pipeline planner (`16G`, `2M`, ...).
    #[arg(long)]
    pub pipeline_memory: Option<String>,
    /// Transformer blocks of the `gpt` model.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Shadow each pipeline stage to its neighbour every this many steps (0: off).
    #[arg(long, default_value_t = 0)]
    pub shadow_every: u64,
    /// Global micro-batch (default: the batch).
    #[arg(long)]
    pub micro_batch: Option<u64>,
    /// Events as FRACTION:ACTION[:NODE[:SECS|MS]], comma-separated; actions: notice (SECS to
    /// the revocation), join, kill, drain, term (SIGTERM), stall (SIGSTOP, then SIGCONT MS
    /// later: a live host that stops answering for a while); NODE may be `leader` or
    /// `follower` (a rank of the current epoch that does not lead); events at the same
    /// fraction fire together.
    /// Example: 0.2:notice:node-2:20,0.5:join,0.7:kill:leader,0.7:join,0.8:stall:follower:2000
    #[arg(long, default_value = "")]
    pub script: String,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 600)]
    pub timeout: u64,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
    /// Run the cluster with mutual TLS (a CA and certificates made for the run; the driver
    /// reads status and drains with an operator certificate).
    #[arg(long)]
    pub tls: bool,
    /// Share samples by measured speed when a host is this many times slower (0: off, the
    /// local default: processes sharing a few cores are noisy, not stragglers).
    #[arg(long, default_value_t = 0.0)]
    pub straggler_ratio: f64,
    /// Every node's `[timing].failure_timeout_ms` (its default when absent): dozens of agents
    /// sharing a few cores may go quiet longer than a host of its own ever would.
    #[arg(long, value_name = "MS")]
    pub failure_timeout_ms: Option<u64>,
    /// Every node's `[timing].data_timeout_ms`: how long a collective waits on a silent peer
    /// before it breaks (its default when absent).
    #[arg(long, value_name = "MS")]
    pub data_timeout_ms: Option<u64>,
    /// Each node in a network namespace of its own, with its own address (root only),
    /// instead of every node on 127.0.0.1.
    #[arg(long)]
    pub netns: bool,
    /// A straggler drill: NODE:US makes NODE sleep US microseconds per sample it computes.
    #[arg(long, value_parser = parse_slow)]
    pub slow: Option<(String, u64)>,
    /// A straggler drill: NODE:F makes NODE compute as a host F times slower would.
    #[arg(long, value_parser = parse_slow_factor)]
    pub slow_factor: Option<(String, f64)>,
    /// The script's joiners boot with the cluster and wait, libtorch loaded, until their
    /// join: joins then cost the join, not a load slowed by the cores every agent shares.
    #[arg(long)]
    pub joiners_booted: bool,
}

fn parse_slow_factor(s: &str) -> Result<(String, f64), String> {
    let (node, f) = s.split_once(':').ok_or_else(|| format!("--slow-factor {s:?} is not NODE:F"))?;
    match f.parse::<f64>() {
        Ok(v) if v.is_finite() && (1.0..=100.0).contains(&v) => Ok((node.to_string(), v)),
        _ => Err(format!("--slow-factor {s:?}: {f:?} is not a factor within 1..=100")),
    }
}

fn parse_node_devices(s: &str) -> Result<(String, usize), String> {
    let (node, n) = s.split_once(':').ok_or_else(|| format!("--node-devices {s:?} is not NODE:N"))?;
    match n.parse::<usize>() {
        Ok(n) if (1..=64).contains(&n) => Ok((node.to_string(), n)),
        _ => Err(format!("--node-devices {s:?}: {n:?} is not a device count within 1..=64")),
    }
}

fn parse_slow(s: &str) -> Result<(String, u64), String> {
    let (node, us) = s.split_once(':').ok_or_else(|| format!("--slow {s:?} is not NODE:US"))?;
    let us = us.parse().map_err(|_| format!("--slow {s:?}: {us:?} is not microseconds"))?;
    Ok((node.to_string(), us))
}

/// Runs the demo.
pub fn run(a: DemoArgs) -> limpet_daemon::Result<()> {
    let job = LocalJob {
        model: "gpt".into(),
        data: "chars".into(),
        steps: a.steps,
        global_batch: 32,
        tls: !a.no_tls,
        // The held-out loss ten times over the run, in the plot beside the training loss.
        eval_every: Some((a.steps / 10).max(1)),
        ..LocalJob::default()
    };
    println!(
        "limpet-lab demo: 4 agents on loopback train a character GPT on /usr/share/common-licenses for {} steps{}.",
        a.steps,
        if a.no_tls { "" } else { ", with mutual TLS on every connection" }
    );
    println!("Scenario: spot notice, join, kill -9, drain. Output in {}/\n", a.dir.display());
    let script = vec![
        (0.15, Action::Notice { node: "node-2".into(), in_secs: 30 }),
        (0.35, Action::Join),
        (0.55, Action::Kill { node: "node-3".into() }),
        (0.75, Action::Drain { node: "node-4".into() }),
    ];
    let summary = run_scenario(&a.dir, 4, job, &script, Duration::from_secs(a.timeout), true)?;
    print_summary(&summary, &a.dir.join("demo.svg"));
    check(&summary)
}

/// Runs `limpet-lab scenario`.
pub fn scenario(a: ScenarioArgs) -> limpet_daemon::Result<()> {
    let script = parse_script(&a.script)?;
    if let Some(module) = &a.model_keys.path {
        // This process evaluates the final checkpoint: it needs the module too.
        limpet_trainer::model::script::register(module)?;
    }
    let job = LocalJob {
        model: a.model.clone(),
        data: a.data.clone(),
        steps: a.steps,
        global_batch: a.batch,
        lr: a.lr,
        optimizer: a.optimizer.clone(),
        policy: a.policy.clone(),
        min_nodes: a.min_nodes,
        pipeline: a.pipeline.clone(),
        pipeline_memory: a.pipeline_memory.clone(),
        // A LLaMA's layers are a [model] key; a GPT's the older [job].layers.
        layers: a.layers.filter(|_| a.model != "llama"),
        shadow_every: a.shadow_every,
        micro_batch: a.micro_batch,
        tls: a.tls,
        data_path: a.data_path.clone(),
        data_section: limpet_trainer::workload::DataSection { context: a.context },
        model_section: a.model_keys.with_layers(a.layers.filter(|_| a.model == "llama")),
        straggler_ratio: a.straggler_ratio,
        slow: a.slow.clone(),
        slow_factor: a.slow_factor.clone(),
        reproducible: a.reproducible,
        eval_every: a.eval_every,
        shard_state: a.shard_replicas.map(|r| {
            let mode = if a.shard_gradients { "optimizer+gradients" } else { "optimizer" };
            (mode.to_string(), r)
        }),
        devices: usize::from(a.devices),
        node_devices: a.node_devices.clone(),
        zones: usize::from(a.zones),
        extra_config: timing_section(a.failure_timeout_ms, a.data_timeout_ms),
        netns: a.netns,
        joiners_booted: a.joiners_booted,
        ..LocalJob::default()
    };
    let summary = run_scenario(&a.dir, a.nodes, job, &script, Duration::from_secs(a.timeout), !a.json)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        print_summary(&summary, &a.dir.join("demo.svg"));
    }
    check(&summary)
}

/// A `[timing]` section with the timeouts given, if any.
fn timing_section(failure_ms: Option<u64>, data_ms: Option<u64>) -> Option<String> {
    let keys = [("failure_timeout_ms", failure_ms), ("data_timeout_ms", data_ms)];
    let lines: String = keys.iter().filter_map(|(k, v)| Some(format!("{k} = {}\n", (*v)?))).collect();
    (!lines.is_empty()).then(|| format!("[timing]\n{lines}"))
}

fn check(s: &Summary) -> limpet_daemon::Result<()> {
    if s.steps_applied_twice > 0 {
        limpet_daemon::fail!("{} step(s) were applied twice in the surviving lineage", s.steps_applied_twice);
    }
    Ok(())
}

/// Parses `--script`.
pub fn parse_script(text: &str) -> limpet_daemon::Result<Vec<(f64, Action)>> {
    let bad = |m: String| limpet_daemon::Failure::Usage(format!("--script: {m}"));
    let mut out = Vec::new();
    for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let parts: Vec<&str> = item.split(':').collect();
        let frac: f64 =
            parts[0].parse().map_err(|_| bad(format!("{item:?}: {:?} is not a fraction", parts[0])))?;
        if !(0.0..1.0).contains(&frac) {
            return Err(bad(format!("{item:?}: fraction {frac} is not within [0, 1)")));
        }
        let node = |i: usize| {
            parts.get(i).map(|s| s.to_string()).ok_or_else(|| bad(format!("{item:?}: which node?")))
        };
        let action = match parts.get(1).copied() {
            Some("notice") => {
                let secs = parts.get(3).map_or(Ok(30), |s| {
                    s.parse().map_err(|_| bad(format!("{item:?}: {s:?} is not seconds")))
                })?;
                Action::Notice { node: node(2)?, in_secs: secs }
            }
            Some("join") => Action::Join,
            Some("kill") => Action::Kill { node: node(2)? },
            Some("drain") => Action::Drain { node: node(2)? },
            Some("term") => Action::Term { node: node(2)? },
            Some("stall") => {
                let ms = parts.get(3).ok_or_else(|| bad(format!("{item:?}: stall for how many ms?")))?;
                let ms = ms.parse().map_err(|_| bad(format!("{item:?}: {ms:?} is not milliseconds")))?;
                Action::Stall { node: node(2)?, ms }
            }
            other => {
                let other = other.unwrap_or("");
                return Err(bad(format!(
                    "{item:?}: action {other:?} is not notice, join, kill, drain, term or stall"
                )));
            }
        };
        out.push((frac, action));
    }
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    Ok(out)
}

/// A scripted event, fired when the cluster reaches a fraction of the job.
#[derive(Clone, Debug)]
pub enum Action {
    /// A spot notice through the node's metadata service.
    Notice {
        /// Which node (or `leader`).
        node: String,
        /// Seconds to the revocation.
        in_secs: u64,
    },
    /// A new node joins.
    Join,
    /// `kill -9`.
    Kill {
        /// Which node (or `leader`).
        node: String,
    },
    /// `limpet drain`.
    Drain {
        /// Which node (or `leader`).
        node: String,
    },
    /// SIGTERM to the node's limpetd (systemd stopping the service): it drains itself.
    Term {
        /// Which node (or `leader`).
        node: String,
    },
    /// SIGSTOP to the node's limpetd, SIGCONT `ms` later: a live host that stops answering
    /// for a while (a long pause, a swap storm). It should stay.
    Stall {
        /// Which node (or `leader`).
        node: String,
        /// How long, ms.
        ms: u64,
    },
}

impl Action {
    fn describe(&self) -> String {
        match self {
            Action::Notice { node, in_secs } => format!("spot notice for {node} (revocation in {in_secs} s)"),
            Action::Join => "a new node joins".into(),
            Action::Kill { node } => format!("kill -9 {node} (no notice)"),
            Action::Drain { node } => format!("drain {node}"),
            Action::Term { node } => format!("SIGTERM to {node}'s limpetd"),
            Action::Stall { node, ms } => format!("stall {node} for {ms} ms (SIGSTOP, then SIGCONT)"),
        }
    }
}

/// What the demo writes to `summary.json`.
#[derive(Debug, Serialize)]
pub struct Summary {
    /// Steps of the job.
    pub steps: u64,
    /// Wall time from start to the last step, seconds.
    pub wall_s: f64,
    /// Test loss of the final state.
    pub test_loss: f64,
    /// Test accuracy of the final state.
    pub test_accuracy: f64,
    /// The final checkpoint evaluated.
    pub checkpoint: PathBuf,
    /// The scripted events: step and unix ms when they fired, and what.
    pub events: Vec<(u64, u64, String)>,
    /// Every epoch change with cause, idle time and lost steps.
    pub transitions: Vec<TransitionDoc>,
    /// Steps completed more than once in the merged step logs (must be 0).
    pub steps_applied_twice: u64,
    /// Distinct steps in the merged step logs (the job's steps when none is missing).
    pub steps_logged: u64,
    /// Per transition after the first epoch: how long the cluster made no progress, from
    /// the step logs (epoch, stall in ms).
    #[serde(default)]
    pub stalls: Vec<(u64, u64)>,
}

/// Longest a scripted action waits for the previous one to show in the epoch.
const SETTLE_MAX: Duration = Duration::from_secs(10);
/// Longest a joiner booted ahead may still be loading when its join comes.
const BOOT_MAX: Duration = Duration::from_secs(120);

/// Starts a local cluster in `dir`, plays `script`, waits for the job to finish, and
/// writes `summary.json` and `demo.svg` there.
pub fn run_scenario(
    dir: &Path,
    nodes: usize,
    job: LocalJob,
    script: &[(f64, Action)],
    timeout: Duration,
    show: bool,
) -> limpet_daemon::Result<Summary> {
    if dir.join("cluster.json").exists() {
        std::fs::remove_dir_all(dir)
            .with_context(|| format!("clearing the previous run in {}", dir.display()))?;
    } else if dir.exists() && std::fs::read_dir(dir)?.next().is_some() {
        return Err(
            limpet_daemon::UsageError(format!("{} exists and holds something else", dir.display())).into()
        );
    }
    let steps = job.steps;
    let started = Instant::now();
    let booted_joins = job.joiners_booted;
    let mut cluster = LocalCluster::up(dir, nodes, job)?;
    let booted: VecDeque<String> = if booted_joins {
        let joins = script.iter().filter(|(_, a)| matches!(a, Action::Join)).count();
        (0..joins).map(|_| cluster.add_booted()).collect::<limpet_daemon::Result<_>>()?
    } else {
        VecDeque::new()
    };
    // With certificates, the driver is an operator: it reads status and drains with the
    // operator certificate the cluster was made with.
    let tls = match &cluster.file.operator_tls {
        Some(files) => Some(limpet_consensus::tls::Tls::load(files)?),
        None => None,
    };
    let tls = tls.as_ref();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let bar = if show { indicatif::ProgressBar::new(steps) } else { indicatif::ProgressBar::hidden() };
    bar.set_style(
        indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:40}] step {pos}/{len} {msg}")
            .expect("template")
            .progress_chars("=> "),
    );
    let mut player =
        Player { script, steps, next: 0, settling: None, fired: Vec::new(), killed: Vec::new(), booted };
    let deadline = Instant::now() + timeout;
    let mut last: Option<StatusDoc> = None;
    // Every transition seen (`transitions`): status shows the newest only.
    let mut seen: BTreeMap<u64, TransitionDoc> = BTreeMap::new();
    loop {
        if Instant::now() > deadline {
            bar.abandon();
            limpet_daemon::fail!(
                "the job did not finish within {} s; logs are in {}",
                timeout.as_secs(),
                dir.display()
            );
        }
        if let Some((name, why)) = cluster.failed_to_start() {
            limpet_daemon::fail!(
                "{name}'s limpetd exited before it started: {why}; logs are in {}",
                dir.display()
            );
        }
        let doc = match rt.block_on(gather(&cluster.file.cluster, &cluster.file.control_addrs(), tls)) {
            Ok(d) => d,
            Err(_) => {
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        show_progress(&bar, show, steps, &doc, last.as_ref());
        crate::transitions::remember(&mut seen, &doc);
        let current = doc.epoch.as_ref().map(|e| e.ranks.clone()).unwrap_or_default();
        let done = !current.is_empty()
            && current
                .iter()
                .all(|r| doc.nodes.iter().any(|n| &n.name == r && n.phase.as_deref() == Some("finished")));
        player.play(&mut cluster, &rt, tls, &doc, done, (&bar, show))?;
        last = Some(doc);
        if done && player.next == script.len() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bar.finish();
    let wall_s = started.elapsed().as_secs_f64();
    let doc = last.expect("at least one status");
    // Give the heartbeats a moment so every rank's transition record is in.
    std::thread::sleep(Duration::from_millis(300));
    let doc = rt.block_on(gather(&cluster.file.cluster, &cluster.file.control_addrs(), tls)).unwrap_or(doc);
    crate::transitions::remember(&mut seen, &doc);
    summarize(dir, cluster, &doc, seen.into_values().collect(), player, wall_s)
}

/// The step, epoch, world, loss and leader on the progress bar, and each new transition
/// above it.
fn show_progress(
    bar: &indicatif::ProgressBar,
    show: bool,
    steps: u64,
    doc: &StatusDoc,
    last: Option<&StatusDoc>,
) {
    bar.set_position(doc.step.min(steps));
    let world = doc.epoch.as_ref().map_or(0, |e| e.ranks.len());
    let loss = doc.nodes.iter().filter_map(|n| n.loss).next().map_or("-".into(), |l| format!("{l:.3}"));
    bar.set_message(format!(
        "epoch {} world {world} loss {loss} leader {}",
        doc.epoch.as_ref().map_or(0, |e| e.id),
        doc.leader.as_deref().unwrap_or("-")
    ));
    if let Some(prev) = last {
        for t in doc.transitions.iter().filter(|t| !prev.transitions.iter().any(|p| p.epoch == t.epoch)) {
            say(
                bar,
                show,
                format!("  epoch {} at step {}: world {} ({})", t.epoch, t.step, t.world, t.cause),
            );
        }
    }
}

/// Plays a scenario's script against the cluster as the job advances.
struct Player<'a> {
    script: &'a [(f64, Action)],
    steps: u64,
    /// The next action to fire.
    next: usize,
    /// The last action's node, whether it should join (or leave) the epoch, and since when.
    settling: Option<(String, bool, Instant)>,
    /// What was fired: the step, the wall clock in ms and a description.
    fired: Vec<(u64, u64, String)>,
    /// Ids of the nodes killed.
    killed: Vec<u64>,
    /// Joiners booted ahead, waiting at their gates, in the order they join.
    booted: VecDeque<String>,
}

impl Player<'_> {
    /// Fires every action whose step has come. Actions at the same fraction fire back to
    /// back; otherwise the next action waits until the previous one shows in the epoch: a fast job must not stack a kill onto a membership change still
    /// under way (two voters left mid-change cannot lose one), and each transition is
    /// measured on its own. Not forever: a cluster held below its minimum size forms no
    /// epoch until a later action (a join).
    fn play(
        &mut self,
        cluster: &mut LocalCluster,
        rt: &tokio::runtime::Runtime,
        tls: Option<&limpet_consensus::tls::Tls>,
        doc: &StatusDoc,
        done: bool,
        (bar, show): (&indicatif::ProgressBar, bool),
    ) -> limpet_daemon::Result<()> {
        let current = doc.epoch.as_ref().map(|e| e.ranks.clone()).unwrap_or_default();
        let settled = self.settling.as_ref().is_none_or(|(node, joins, since)| {
            done || current.contains(node) == *joins || since.elapsed() > SETTLE_MAX
        });
        if !settled {
            return Ok(());
        }
        self.settling = None;
        while self.next < self.script.len() && doc.step as f64 >= self.script[self.next].0 * self.steps as f64
        {
            let action = resolve(&self.script[self.next].1, doc);
            say(bar, show, format!("step {}: {}", doc.step, action.describe()));
            if let Action::Kill { node } = &action {
                self.killed.push(cluster.file.node(node)?.id);
            }
            let at = now_ms();
            let booted = matches!(action, Action::Join).then(|| self.booted.pop_front()).flatten();
            let joined = match booted {
                Some(name) => cluster.open_gate(&name, BOOT_MAX).map(|()| Some(name))?,
                None => fire(cluster, rt, tls, &action)?,
            };
            self.fired.push((doc.step, at, action.describe()));
            self.next += 1;
            self.settling = match (&action, joined) {
                (Action::Join, Some(name)) => Some((name, true, Instant::now())),
                (
                    Action::Notice { node, .. }
                    | Action::Kill { node }
                    | Action::Drain { node }
                    | Action::Term { node },
                    _,
                ) => Some((node.clone(), false, Instant::now())),
                // A stalled node stays where it is: nothing to settle.
                (Action::Join, None) | (Action::Stall { .. }, _) => None,
            };
            // Actions at the same point fire together (a kill and a join at one instant, two
            // joins in one epoch); otherwise the next waits for this one to settle.
            let together = self.script.get(self.next).is_some_and(|n| n.0 == self.script[self.next - 1].0);
            if self.settling.is_some() && !together {
                break;
            }
        }
        Ok(())
    }
}

/// Stops the cluster, evaluates the final checkpoints, merges the step logs into one loss
/// curve (plotted to `demo.svg`) and writes `summary.json`.
fn summarize(
    dir: &Path,
    mut cluster: LocalCluster,
    doc: &StatusDoc,
    transitions: Vec<TransitionDoc>,
    player: Player<'_>,
    wall_s: f64,
) -> limpet_daemon::Result<Summary> {
    let ranks = doc.epoch.as_ref().map(|e| e.ranks.clone()).context("no current epoch at the end")?;
    let checkpoints: Vec<PathBuf> =
        ranks.iter().map(|r| dir.join(r).join(limpet_trainer::CHECKPOINT_FILE)).collect();
    let checkpoint = checkpoints.first().cloned().context("the final epoch has no ranks")?;
    // The agents are done (each wrote its final checkpoint): their memory is given back
    // before the evaluation takes a model's worth.
    cluster.down();
    let (test_loss, test_accuracy) = match cluster.job.synthetic {
        // Nothing to evaluate: a synthetic state is a function of its step, which its
        // agents check at every copy.
        Some(_) => (f64::NAN, f64::NAN),
        None => evaluate(&checkpoints, cluster.job.data_path.as_deref())?,
    };
    let lines = read_step_logs(&cluster.file.nodes.iter().map(|n| n.step_log.clone()).collect::<Vec<_>>())?;
    let redone = crate::transitions::redone(&transitions);
    let (points, twice) = merge(&lines, &player.killed, &redone);
    let marks: Vec<(u64, String)> =
        transitions.iter().skip(1).map(|t| (t.step, short_cause(&t.cause))).collect();
    elastic_svg(&dir.join("demo.svg"), &points, &marks, "limpet: loss and world size through revocations")?;
    let summary = Summary {
        steps: player.steps,
        wall_s,
        test_loss,
        test_accuracy,
        checkpoint,
        events: player.fired,
        transitions,
        steps_applied_twice: twice,
        steps_logged: points.len() as u64,
        stalls: stalls(&lines),
    };
    std::fs::write(dir.join("summary.json"), serde_json::to_vec_pretty(&summary)?)?;
    Ok(summary)
}

/// Replaces `leader` in an action by the leader's name now, and `follower` by the first rank
/// of the current epoch that does not lead.
fn resolve(action: &Action, doc: &StatusDoc) -> Action {
    let leader = doc.leader.clone().unwrap_or_default();
    let follower = || {
        doc.epoch.as_ref().and_then(|e| e.ranks.iter().find(|r| **r != leader).cloned()).unwrap_or_default()
    };
    let pick = |n: &String| match n.as_str() {
        "leader" => leader.clone(),
        "follower" => follower(),
        _ => n.clone(),
    };
    match action {
        Action::Notice { node, in_secs } => Action::Notice { node: pick(node), in_secs: *in_secs },
        Action::Kill { node } => Action::Kill { node: pick(node) },
        Action::Drain { node } => Action::Drain { node: pick(node) },
        Action::Term { node } => Action::Term { node: pick(node) },
        Action::Stall { node, ms } => Action::Stall { node: pick(node), ms: *ms },
        Action::Join => Action::Join,
    }
}

/// Plays one action; for a join, the new node's name.
fn fire(
    cluster: &mut LocalCluster,
    rt: &tokio::runtime::Runtime,
    tls: Option<&limpet_consensus::tls::Tls>,
    action: &Action,
) -> limpet_daemon::Result<Option<String>> {
    if let Action::Join = action {
        return cluster.add().map(Some);
    }
    match action {
        Action::Notice { node, in_secs } => post_notice(&cluster.file.node(node)?.metadata, *in_secs),
        Action::Join => unreachable!("handled above"),
        Action::Kill { node } => cluster.kill(node),
        Action::Term { node } => {
            let pid = cluster.file.node(node)?.pid;
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGTERM)
                .with_context(|| format!("SIGTERM to {node}"))
                .map_err(Into::into)
        }
        Action::Stall { node, ms } => {
            use nix::sys::signal::{kill, Signal};
            let pid = nix::unistd::Pid::from_raw(cluster.file.node(node)?.pid as i32);
            kill(pid, Signal::SIGSTOP).with_context(|| format!("SIGSTOP to {node}"))?;
            let ms = *ms;
            // The driver keeps polling status meanwhile; a thread wakes the node.
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(ms));
                let _ = kill(pid, Signal::SIGCONT);
            });
            Ok(())
        }
        Action::Drain { node } => {
            let id = cluster.file.node(node)?.id;
            let cmd = Command::Drain { id, reason: "limpet drain".into() };
            rt.block_on(limpet_daemon::propose_cmd::propose(
                &cluster.file.cluster,
                &cluster.file.control_addrs(),
                tls,
                cmd,
            ))
            .map(|_| ())
        }
    }
    .map(|()| None)
}

fn short_cause(cause: &str) -> String {
    let c = cause.split(" (").next().unwrap_or(cause);
    c.replace("notice for ", "notice ")
        .replace("failure of ", "kill ")
        .replace("drain of ", "drain ")
        .replace("join of ", "join ")
}

/// Test loss and accuracy of the final model, from the final checkpoints of the last
/// epoch's ranks in order: the first holds the whole model under data parallelism; under a
/// pipeline each holds its stage's blocks, and the stages of the first replica together
/// hold the model. `data_path` is the job's data (`None`: the dataset's own place).
pub fn evaluate(paths: &[PathBuf], data_path: Option<&Path>) -> limpet_daemon::Result<(f64, f64)> {
    // One whole file is evaluated as read; stages' files are merged (a copy) only when the
    // first does not hold the whole model: at 350m a copy is 3.6 GB.
    let mut merged: Option<limpet_snapshot::StateImage> = None;
    for path in paths {
        let image =
            limpet_snapshot::read_file(path).with_context(|| format!("reading {}", path.display()))?;
        let whole = match merged.take() {
            None => image,
            Some(base) => {
                let mut tensors = base.tensors().clone();
                for (name, t) in image.tensors() {
                    tensors.entry(name.clone()).or_insert_with(|| t.clone());
                }
                let m = base.meta();
                limpet_snapshot::StateImage::new(m.step, m.cursor, m.rng, m.job.clone(), tensors)
            }
        };
        let job: limpet_trainer::JobSpec = serde_json::from_value(whole.meta().job.clone())?;
        let data = limpet_trainer::data::Dataset::load(&job.data, data_path)?;
        if let Ok(t) = limpet_trainer::Trainer::from_image(&whole, data, None) {
            let e = t.evaluate()?;
            return Ok((e.loss, e.accuracy));
        }
        merged = Some(whole);
    }
    limpet_daemon::fail!("the final checkpoints {paths:?} do not hold the whole model")
}

fn print_summary(s: &Summary, plot: &Path) {
    println!("\n== limpet-lab demo summary ==");
    println!("steps            {}", s.steps);
    println!("wall time        {:.1} s", s.wall_s);
    println!("final test loss  {:.4}", s.test_loss);
    println!("test accuracy    {:.2}%", s.test_accuracy * 100.0);
    println!("steps logged     {} of {}", s.steps_logged, s.steps);
    println!("steps redone     {}", s.steps_applied_twice);
    println!("\n{}", limpet_daemon::status::transitions_table(&s.transitions));
    println!("plot: {}", plot.display());
}

/// Unix milliseconds now.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Prints a line above the progress bar, or plainly when the bar is not drawn (output is not
/// a terminal), so logs of piped runs keep the scenario's events. Nothing when `show` is off.
fn say(bar: &indicatif::ProgressBar, show: bool, line: String) {
    if !bar.is_hidden() {
        bar.println(line);
    } else if show {
        println!("{line}");
    }
}
