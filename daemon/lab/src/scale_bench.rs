//! `limpet-lab bench scale`: what running limpet costs as the fleet grows, measured on real
//! `limpetd` processes on this machine at each fleet size of `--hosts`.
//!
//! Per size, two runs. The control plane alone: a cluster of that many agents whose job never
//! starts (its minimum world is one more than the fleet), so what each process spends is the
//! consensus, the heartbeats and the leader's rounds: per-node CPU and control-plane bytes
//! over `--window` seconds (`limpet_control_bytes_total` scraped from every agent), the
//! leader's own, and the commit latency of proposals through the leader. Then the
//! transitions: the same fleet trains a job through a mass revocation (a quarter of the
//! hosts at once, a third of them `kill -9` without notice, the rest with notices) and then a
//! wave of joins (a quarter of the fleet booted at one instant): the epochs that took, the
//! idle time, the steps lost, and the time from the joins to their first trained step.
//!
//! With `--synthetic` the agents are `limpet-synthetic` (the same control part, a training
//! loop that sleeps its compute and sums its gradients over the group, a state of a chosen
//! size that joiners copy): without libtorch's 200 MB each, hundreds fit this machine.
//!
//! All agents share this machine's cores (a real fleet's do not), so the figures are upper
//! bounds of what a host spends; what the benchmark shows is how they grow with the fleet.

use crate::demo::{now_ms, run_scenario, Action};
use crate::local::{LocalCluster, LocalJob};
use crate::steplog::step_logs_in;
use anyhow::Context;
use clap::Args;
use limpet_agent::runtime::synthetic::SyntheticJob;
use limpet_consensus::state::Command;
use limpet_consensus::Client;
use limpet_daemon::status::gather;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// `limpet-lab bench scale`.
#[derive(Debug, Args)]
pub struct BenchScaleArgs {
    /// Fleet sizes to measure, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "8,16,32")]
    pub hosts: Vec<usize>,
    /// Seconds the control plane alone is measured.
    #[arg(long, default_value_t = 10)]
    pub window: u64,
    /// Proposals timed through the leader.
    #[arg(long, default_value_t = 50)]
    pub proposals: usize,
    /// Steps of the job trained through the revocation (at 20% of them) and the joins (at
    /// 40%): enough that the joiners, booting for seconds, come in before the end.
    #[arg(long, default_value_t = 3000)]
    pub steps: u64,
    /// One JSON object per fleet size, one a line, instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Where the runs go (default: a temporary directory).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// The plot of each figure against the fleet's size (default: scale.svg in the runs'
    /// directory with `--dir`, else none).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Each agent in a network namespace of its own, with its own address (root only),
    /// instead of every agent on 127.0.0.1.
    #[arg(long)]
    pub netns: bool,
    /// The control plane alone: no job is trained, so no revocation or joins are measured.
    #[arg(long)]
    pub control_only: bool,
    /// Synthetic agents (`limpet-synthetic`: limpetd's control part with a training loop that
    /// needs no libtorch, built by `make synthetic`) in limpetd's place, so hundreds fit this
    /// machine's memory.
    #[arg(long)]
    pub synthetic: bool,
    /// A synthetic step's compute, milliseconds (slept).
    #[arg(long, default_value_t = 50)]
    pub step_ms: u64,
    /// A synthetic state's size, KiB: what a joiner copies.
    #[arg(long, default_value_t = 4096)]
    pub state_kib: usize,
    /// A synthetic step's gradients, KiB: what the group sums each step.
    #[arg(long, default_value_t = 64)]
    pub grad_kib: usize,
}

/// One fleet size's figures (`--json` prints one a line).
#[derive(Clone, Debug, Serialize)]
pub struct ScaleRow {
    /// Agents.
    pub hosts: usize,
    /// Control-plane bytes a node sends and receives per second (mean over the nodes that do
    /// not lead).
    pub control_bytes_per_node_s: f64,
    /// The leader's.
    pub control_bytes_leader_s: f64,
    /// `control_bytes_per_node_s` by kind and direction (`raft sent`, `report received`, ...).
    pub control_kinds_per_node_s: BTreeMap<String, f64>,
    /// The leader's, by kind and direction.
    pub control_kinds_leader_s: BTreeMap<String, f64>,
    /// Control-plane messages a node sends and receives per second, by kind and direction
    /// (mean over the nodes that do not lead): with the bytes, a message's mean size.
    pub control_messages_per_node_s: BTreeMap<String, f64>,
    /// The leader's.
    pub control_messages_leader_s: BTreeMap<String, f64>,
    /// CPU of a node that does not lead, in cores (mean).
    pub node_cpu: f64,
    /// The leader's CPU, in cores.
    pub leader_cpu: f64,
    /// Commit latency through the leader, median and 99th percentile, ms.
    pub commit_p50_ms: f64,
    /// See `commit_p50_ms`.
    pub commit_p99_ms: f64,
    /// Proposals that failed (no leader, a deadline passed) while they were timed.
    pub proposals_failed: usize,
    /// Raft terms that began while the proposals were timed (0: one leader throughout).
    pub leader_changes: u64,
    /// The transitions (absent with `--control-only`).
    #[serde(flatten)]
    pub moves: Option<Moves>,
}

/// A fleet size's transitions: a mass revocation and a wave of joins.
#[derive(Clone, Debug, Serialize)]
pub struct Moves {
    /// Hosts revoked at once (a third of them killed without notice).
    pub revoked: usize,
    /// Longest idle time of a rank at the revocation's epoch change(s), seconds.
    pub mass_revocation_idle_s: f64,
    /// Epochs the revocation took: one, or two when the kills are found dead (at once, by
    /// the leader's probe of their ports) before the notices are seen (their metadata
    /// polled), the notices' then a planned change that loses no step.
    pub mass_revocation_epochs: usize,
    /// Steps lost at the revocation.
    pub lost_steps: u64,
    /// Hosts joining at once.
    pub joins: usize,
    /// Epochs the joins took.
    pub join_epochs: usize,
    /// From the joins' start to the first step trained with all of them, seconds.
    pub joins_trained_in_s: f64,
}

/// Runs the benchmark.
pub fn run(a: BenchScaleArgs) -> limpet_daemon::Result<()> {
    if a.hosts.iter().any(|&n| n < 4) {
        return Err(limpet_daemon::UsageError("--hosts: each fleet needs at least 4 hosts".into()).into());
    }
    let tmp = tempfile::tempdir()?;
    let root = a.dir.clone().unwrap_or_else(|| tmp.path().to_path_buf());
    let mut rows = Vec::new();
    for &n in &a.hosts {
        eprintln!("{n} hosts: the control plane alone for {} s ...", a.window);
        let idle = control_plane(&root.join(format!("idle-{n}")), n, &a)?;
        let moves = if a.control_only {
            None
        } else {
            eprintln!("{n} hosts: a mass revocation and a wave of joins ...");
            Some(transitions(&root.join(format!("run-{n}")), n, &a)?)
        };
        let row = idle.row(n, moves);
        if a.json {
            println!("{}", serde_json::to_string(&row)?);
        }
        rows.push(row);
    }
    if !a.json {
        print_table(&rows);
    }
    let plot = a.plot.clone().or_else(|| a.dir.as_ref().map(|d| d.join("scale.svg")));
    if let Some(path) = plot.filter(|_| rows.len() > 1) {
        plot_rows(&path, &rows)?;
        eprintln!("plot: {}", path.display());
    }
    Ok(())
}

/// The control plane's figures of a fleet of `n`, the job never started.
struct Idle {
    bytes_node: f64,
    bytes_leader: f64,
    kinds_node: BTreeMap<String, f64>,
    kinds_leader: BTreeMap<String, f64>,
    msgs_node: BTreeMap<String, f64>,
    msgs_leader: BTreeMap<String, f64>,
    cpu_node: f64,
    cpu_leader: f64,
    p50: f64,
    p99: f64,
    failed: usize,
    terms: u64,
}

fn job(n: usize, steps: u64, min_nodes: usize, a: &BenchScaleArgs) -> LocalJob {
    let global_batch = 8 * n as u64;
    let synthetic = a.synthetic.then_some(SyntheticJob {
        steps,
        step_ms: a.step_ms,
        state_bytes: a.state_kib << 10,
        grad_bytes: a.grad_kib << 10,
        seed: 0,
        global_batch,
    });
    LocalJob {
        netns: a.netns,
        model: "mlp".into(),
        data: "synthetic".into(),
        steps,
        global_batch,
        policy: "fixed-global".into(),
        min_nodes,
        // Each poll is two HTTP requests to the agent's metadata service on this machine's
        // cores: at 256 agents, polled every 0.2 s, 2,560 a second.
        revocation_poll_s: a.synthetic.then_some(1.0),
        synthetic,
        ..LocalJob::default()
    }
}

fn control_plane(dir: &Path, n: usize, a: &BenchScaleArgs) -> limpet_daemon::Result<Idle> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    let mut cluster = LocalCluster::up(dir, n, job(n, 1_000_000, n + 1, a))?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let file = cluster.file.clone();
    // Formed: a leader, every member admitted, at most five voters (the founders' extra
    // voters demoted), every report in.
    let formed = Instant::now();
    let (leader, state) = loop {
        if let Some((name, why)) = cluster.failed_to_start() {
            limpet_daemon::fail!("{name}'s limpetd exited before it started: {why}");
        }
        if formed.elapsed() > Duration::from_secs(120) {
            limpet_daemon::fail!("{n} agents did not form a cluster in 120 s; logs in {}", dir.display());
        }
        let doc = rt.block_on(gather(&file.cluster, &file.control_addrs(), None));
        let read = rt.block_on(async {
            let mut c = Client::connect(&file.nodes[0].control, &file.cluster).await?;
            c.read(false).await
        });
        if let (Ok(doc), Ok(read)) = (doc, read) {
            let reported = doc.nodes.iter().filter(|m| m.phase.is_some()).count();
            if read.leader != 0 && read.state.voters.len() <= 5 && reported == n {
                break (read.leader, read.state);
            }
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    std::thread::sleep(Duration::from_secs(3));
    let sample = || -> Vec<(u64, f64, BTreeMap<String, f64>)> {
        file.nodes.iter().map(|m| (m.id, cpu_seconds(m.pid), control_counts(&m.metrics))).collect()
    };
    let before = sample();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(a.window));
    let after = sample();
    let secs = t0.elapsed().as_secs_f64();
    let (mut cpu, mut bytes) = (Vec::new(), Vec::new());
    let (mut cpu_leader, mut bytes_leader) = (0.0, 0.0);
    let (mut kinds_node, mut kinds_leader) = (BTreeMap::new(), BTreeMap::new());
    let (mut msgs_node, mut msgs_leader) = (BTreeMap::new(), BTreeMap::new());
    for ((id, c0, k0), (_, c1, k1)) in before.iter().zip(&after) {
        let all: BTreeMap<String, f64> =
            k1.iter().map(|(k, v1)| (k.clone(), (v1 - k0.get(k).copied().unwrap_or(0.0)) / secs)).collect();
        let (msgs, rates): (BTreeMap<String, f64>, BTreeMap<String, f64>) =
            all.into_iter().partition(|(k, _)| k.ends_with(MESSAGES));
        let msgs: BTreeMap<String, f64> =
            msgs.into_iter().map(|(k, v)| (k.trim_end_matches(MESSAGES).to_string(), v)).collect();
        let (c, b) = ((c1 - c0) / secs, rates.values().sum::<f64>());
        if *id == leader {
            (cpu_leader, bytes_leader, kinds_leader, msgs_leader) = (c, b, rates, msgs);
        } else {
            cpu.push(c);
            bytes.push(b);
            for (k, v) in rates {
                *kinds_node.entry(k).or_insert(0.0) += v / (n - 1).max(1) as f64;
            }
            for (k, v) in msgs {
                *msgs_node.entry(k).or_insert(0.0) += v / (n - 1).max(1) as f64;
            }
        }
    }
    // Commits through the leader: its own hardware record, unchanged, proposed again. A
    // proposal that fails (the leader lost its quorum, a connection waited past its
    // deadline: hundreds of agents on two cores) is counted, and the next goes through
    // whichever node leads then.
    let hardware = state.members[&leader].spec.hardware.clone();
    let seed = file.nodes[0].control.clone();
    let (mut ms, failed, terms) = rt.block_on(async {
        let read = |addr: String| {
            let cluster = file.cluster.clone();
            async move { Client::connect(&addr, &cluster).await?.read(false).await }
        };
        let term_before = read(seed.clone()).await.map_or(0, |r| r.term);
        let mut ms = Vec::with_capacity(a.proposals);
        let mut failed = 0usize;
        let mut client: Option<Client> = None;
        while ms.len() < a.proposals && failed < 5 * a.proposals.max(4) {
            if client.is_none() {
                let addr = match read(seed.clone()).await {
                    Ok(r) if r.leader != 0 => {
                        r.state.members.get(&r.leader).map(|m| m.spec.control_addr.clone())
                    }
                    _ => None,
                };
                client = match addr {
                    Some(addr) => Client::connect(&addr, &file.cluster).await.ok(),
                    None => None,
                };
            }
            let Some(c) = client.as_mut() else {
                failed += 1;
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            };
            let cmd = Command::UpdateHardware { id: leader, hardware: hardware.clone() };
            let t = Instant::now();
            match c.propose(&cmd, Duration::from_secs(5)).await {
                Ok(_) => ms.push(t.elapsed().as_secs_f64() * 1e3),
                Err(e) => {
                    failed += 1;
                    eprintln!("{n} hosts: a proposal failed ({e}); through the leader then");
                    client = None;
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
        let term_after = read(seed.clone()).await.map_or(term_before, |r| r.term);
        (ms, failed, term_after.saturating_sub(term_before))
    });
    if ms.is_empty() {
        limpet_daemon::fail!("{n} hosts: no proposal committed in {failed} tries; logs in {}", dir.display());
    }
    cluster.down();
    ms.sort_by(f64::total_cmp);
    let pct =
        |p: f64| ms.get(((ms.len() as f64 * p).ceil() as usize).saturating_sub(1)).copied().unwrap_or(0.0);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    Ok(Idle {
        bytes_node: mean(&bytes),
        bytes_leader,
        kinds_node,
        kinds_leader,
        msgs_node,
        msgs_leader,
        cpu_node: mean(&cpu),
        cpu_leader,
        p50: pct(0.5),
        p99: pct(0.99),
        failed,
        terms,
    })
}

/// User and system CPU seconds process `pid` has used (0 if it is gone).
fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0.0 };
    // The fields after the command's closing parenthesis; utime and stime are the 12th and
    // 13th of them.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<f64> = rest.split_whitespace().filter_map(|x| x.parse().ok()).collect();
    let ticks = f.get(11).copied().unwrap_or(0.0) + f.get(12).copied().unwrap_or(0.0);
    ticks / clock_ticks()
}

/// Clock ticks a second, as the kernel counts a process's CPU time (`getconf CLK_TCK`;
/// 100 where that cannot be asked).
fn clock_ticks() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok()?.trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// The suffix of a message count's key in [`control_counts`].
const MESSAGES: &str = " messages";

/// The control-plane bytes and messages an agent counted, by kind and direction (`raft
/// sent`, ..., and `raft sent messages`, ...), from its metrics endpoint's URL (none if it
/// does not answer).
fn control_counts(metrics_url: &str) -> BTreeMap<String, f64> {
    let page = crate::local::get_text(metrics_url).unwrap_or_default();
    let label = |l: &str, name: &str| -> String {
        let at = l.find(&format!("{name}=\"")).map(|i| i + name.len() + 2);
        at.and_then(|i| Some(l[i..i + l[i..].find('"')?].to_string())).unwrap_or_default()
    };
    let mut out = BTreeMap::new();
    for (metric, suffix) in [("limpet_control_bytes_total", ""), ("limpet_control_messages_total", MESSAGES)]
    {
        for l in page.lines().filter(|l| l.starts_with(metric)) {
            if let Some(v) = l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
                *out.entry(format!("{} {}{suffix}", label(l, "kind"), label(l, "direction")))
                    .or_insert(0.0) += v;
            }
        }
    }
    out
}

impl Idle {
    fn row(self, n: usize, moves: Option<Moves>) -> ScaleRow {
        ScaleRow {
            hosts: n,
            control_bytes_per_node_s: self.bytes_node,
            control_bytes_leader_s: self.bytes_leader,
            control_kinds_per_node_s: self.kinds_node,
            control_kinds_leader_s: self.kinds_leader,
            control_messages_per_node_s: self.msgs_node,
            control_messages_leader_s: self.msgs_leader,
            node_cpu: self.cpu_node,
            leader_cpu: self.cpu_leader,
            commit_p50_ms: self.p50,
            commit_p99_ms: self.p99,
            proposals_failed: self.failed,
            leader_changes: self.terms,
            moves,
        }
    }
}

fn transitions(dir: &Path, n: usize, a: &BenchScaleArgs) -> limpet_daemon::Result<Moves> {
    let revoked = (n / 4).max(1);
    let killed = (revoked / 3).max(1);
    let joins = (n / 4).max(1);
    // The last hosts go: none of them is likely the leader (the first founders vote).
    let mut script: Vec<(f64, Action)> = Vec::new();
    for i in n - revoked + 1..=n {
        let node = format!("node-{i}");
        script.push((
            0.2,
            if i > n - killed { Action::Kill { node } } else { Action::Notice { node, in_secs: 60 } },
        ));
    }
    script.extend((0..joins).map(|_| (0.4, Action::Join)));
    let started = now_ms();
    let summary = run_scenario(dir, n, job(n, a.steps, 1, a), &script, Duration::from_secs(900), false)?;
    let fired = |what: &str| summary.events.iter().filter(|e| e.2.contains(what)).map(|e| e.1).min();
    let joined_at = fired("joins").unwrap_or(started);
    let after: Vec<_> = summary.transitions.iter().skip(1).collect();
    let mass: Vec<_> =
        after.iter().filter(|t| t.cause.contains("notice") || t.cause.contains("failure")).collect();
    let join_epochs: Vec<_> = after.iter().filter(|t| t.cause.contains("join")).collect();
    // The first step trained with every joiner: the first step log line of the epoch that
    // has the largest world after the joins.
    let lines = step_logs_in(dir)?;
    let last_join = join_epochs.last().map(|t| t.epoch);
    let joined_first_step =
        lines.iter().filter(|l| Some(l.epoch) == last_join).map(|l| l.wall_ms).min().unwrap_or(joined_at);
    Ok(Moves {
        revoked,
        mass_revocation_idle_s: mass.iter().filter_map(|t| t.idle_ms).max().unwrap_or(0) as f64 / 1e3,
        mass_revocation_epochs: mass.len(),
        lost_steps: mass.iter().filter_map(|t| t.lost_steps).sum(),
        joins,
        join_epochs: join_epochs.len(),
        joins_trained_in_s: joined_first_step.saturating_sub(joined_at) as f64 / 1e3,
    })
}

fn print_table(rows: &[ScaleRow]) {
    println!(
        "{:>6} {:>12} {:>12} {:>9} {:>9} {:>9} {:>9} {:>8} {:>9} {:>7} {:>5} {:>6} {:>8}",
        "HOSTS",
        "CTRL B/S",
        "LEADER B/S",
        "NODE CPU",
        "LEAD CPU",
        "P50 MS",
        "P99 MS",
        "REVOKED",
        "IDLE S",
        "EPOCHS",
        "LOST",
        "JOINS",
        "IN S"
    );
    for r in rows {
        let moves = r.moves.as_ref().map_or_else(
            || format!("{:>8} {:>9} {:>7} {:>5} {:>6} {:>8}", "-", "-", "-", "-", "-", "-"),
            |m| {
                format!(
                    "{:>8} {:>9.2} {:>7} {:>5} {:>6} {:>8.2}",
                    m.revoked,
                    m.mass_revocation_idle_s,
                    m.mass_revocation_epochs,
                    m.lost_steps,
                    m.joins,
                    m.joins_trained_in_s
                )
            },
        );
        println!(
            "{:>6} {:>12.0} {:>12.0} {:>9.3} {:>9.3} {:>9.1} {:>9.1} {moves}",
            r.hosts,
            r.control_bytes_per_node_s,
            r.control_bytes_leader_s,
            r.node_cpu,
            r.leader_cpu,
            r.commit_p50_ms,
            r.commit_p99_ms,
        );
    }
    // What the control bytes are: raft's against the reports', each way.
    let kinds = |m: &BTreeMap<String, f64>| -> String {
        m.iter().map(|(k, v)| format!("{k} {v:.0}")).collect::<Vec<_>>().join(", ")
    };
    // And their messages' mean sizes.
    let sizes = |bytes: &BTreeMap<String, f64>, msgs: &BTreeMap<String, f64>| -> String {
        msgs.iter()
            .filter(|(_, m)| **m > 0.0)
            .map(|(k, m)| format!("{k} {m:.1}/s of {:.0} B", bytes.get(k).copied().unwrap_or(0.0) / m))
            .collect::<Vec<_>>()
            .join(", ")
    };
    for r in rows {
        println!("{} hosts, B/s a node: {}", r.hosts, kinds(&r.control_kinds_per_node_s));
        println!("{} hosts, B/s the leader: {}", r.hosts, kinds(&r.control_kinds_leader_s));
        println!(
            "{} hosts, messages a node: {}",
            r.hosts,
            sizes(&r.control_kinds_per_node_s, &r.control_messages_per_node_s)
        );
        println!(
            "{} hosts, messages the leader: {}",
            r.hosts,
            sizes(&r.control_kinds_leader_s, &r.control_messages_leader_s)
        );
    }
}

/// Each figure against the fleet's size, as a share of its value at the smallest fleet: a
/// flat line grows not at all with the fleet, a diagonal in proportion.
fn plot_rows(path: &Path, rows: &[ScaleRow]) -> limpet_daemon::Result<()> {
    use limpet_daemon::plot::{chart_on, draw_legend, draw_svg, legend_line};
    use plotters::prelude::*;
    type Figure = (&'static str, fn(&ScaleRow) -> f64, RGBColor);
    let figures: [Figure; 5] = [
        ("control bytes/s per node", |r| r.control_bytes_per_node_s, BLUE),
        ("leader CPU", |r| r.leader_cpu, RED),
        ("commit p99", |r| r.commit_p99_ms, GREEN),
        (
            "mass revocation idle",
            |r| r.moves.as_ref().map_or(f64::NAN, |m| m.mass_revocation_idle_s),
            MAGENTA,
        ),
        ("joins trained in", |r| r.moves.as_ref().map_or(f64::NAN, |m| m.joins_trained_in_s), BLACK),
    ];
    let x_max = rows.iter().map(|r| r.hosts).max().unwrap_or(1) as f64 * 1.05;
    let share = |f: fn(&ScaleRow) -> f64, r: &ScaleRow| f(r) / f(&rows[0]).max(1e-9);
    let y_max = figures
        .iter()
        .flat_map(|(_, f, _)| rows.iter().map(move |r| share(*f, r)))
        .filter(|v| v.is_finite())
        .fold(2.0_f64, f64::max)
        * 1.1;
    draw_svg(path, (900, 480), |root| {
        let mut chart =
            chart_on(root, Some("limpet at scale: each figure over its value at the smallest fleet"), 40)
                .build_cartesian_2d(0.0..x_max, 0.0..y_max)?;
        chart.configure_mesh().x_desc("hosts").y_desc("x the smallest fleet's").draw()?;
        for (name, f, colour) in figures {
            // A figure not measured at a size (`--control-only`) has no point there.
            let points: Vec<(f64, f64)> =
                rows.iter().map(|r| (r.hosts as f64, share(f, r))).filter(|p| p.1.is_finite()).collect();
            chart
                .draw_series(LineSeries::new(points.clone(), colour))?
                .label(name)
                .legend(legend_line(colour));
            chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, colour.filled())))?;
        }
        draw_legend(&mut chart, SeriesLabelPosition::UpperLeft)?;
        Ok(())
    })
}
