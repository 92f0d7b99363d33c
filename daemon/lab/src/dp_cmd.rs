//! `limpet-lab dp-worker` (one rank of a data-plane group in its own process, for benchmarks and
//! multi-process tests) and `limpet-lab bench allreduce` (N such processes on loopback, next to
//! the same sizes through torch.distributed's gloo backend in the same run). The benchmarks
//! live in `allreduce` and, for `limpet-lab bench handoff`, `handoff`.

mod allreduce;
mod handoff;

pub use allreduce::{bench_allreduce, parse_size, python, BenchAllreduceArgs, Measurement, SizeReport};
pub use handoff::{bench_handoff, BenchHandoffArgs};

use crate::raft_cmd::free_port;
use anyhow::Context;
use clap::{Args, ValueEnum};
use limpet_agent::{DataPlaneConfig, Endpoint};
use limpet_daemon::UsageError;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The environment variable carrying the cluster secret to worker processes.
pub const SECRET_ENV: &str = "LIMPET_DP_SECRET";
/// The cluster id workers use.
pub const WORKER_CLUSTER_ID: u64 = 0x6c69_6d70_6574;

/// What a worker does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WorkerMode {
    /// Time allreduces of each size; rank 0 prints the times as JSON.
    Bench,
    /// Allreduce deterministic inputs and check the exact sum; every rank prints a JSON line.
    Check,
    /// Allreduce in a loop until an error, then print it as JSON (for kill tests).
    Loop,
}

/// Who a worker process is among its group: what `spawn_group` passes every worker.
#[derive(Debug, Args)]
pub struct WorkerPeers {
    /// This node's id.
    #[arg(long)]
    pub node: u64,
    /// Node ids in rank order.
    #[arg(long, value_delimiter = ',', required = true)]
    pub ranks: Vec<u64>,
    /// Data-plane addresses in rank order (this node binds its own).
    #[arg(long, value_delimiter = ',', required = true)]
    pub addrs: Vec<String>,
    /// Connect over TLS with the certificates in DIR (`ca.pem`, `nNODE.pem`, `nNODE.key`).
    #[arg(long)]
    pub tls_dir: Option<PathBuf>,
    /// TCP congestion control of the data-plane sockets, or `system` for the host's default.
    #[arg(long, default_value = limpet_agent::dataplane::endpoint::DEFAULT_CONGESTION)]
    pub congestion: String,
}

/// `--congestion` as the data plane takes it: `system` keeps the host's default.
pub fn congestion_arg(name: &str) -> Result<Option<String>, UsageError> {
    limpet_agent::dataplane::endpoint::parse_congestion(name)
        .map_err(|e| UsageError(format!("--congestion: {e}")))
}

/// `limpet-lab dp-worker`.
#[derive(Debug, Args)]
pub struct DpWorkerArgs {
    /// The group.
    #[command(flatten)]
    pub peers: WorkerPeers,
    /// The epoch.
    #[arg(long, default_value_t = 1)]
    pub epoch: u64,
    /// What to do.
    #[arg(long, value_enum)]
    pub mode: WorkerMode,
    /// `BYTES:ITERS` pairs.
    #[arg(long, value_delimiter = ',')]
    pub plan: Vec<String>,
    /// Collective timeout in milliseconds.
    #[arg(long, default_value_t = 5000)]
    pub timeout_ms: u64,
    /// Seed of the inputs in check mode.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Bench mode: send the values in bfloat16 (`Group::allreduce_sum_bf16`).
    #[arg(long)]
    pub bf16: bool,
}

fn parse_plan(plan: &[String]) -> Result<Vec<(usize, u64)>, UsageError> {
    plan.iter()
        .map(|p| {
            let (b, i) = p
                .split_once(':')
                .ok_or_else(|| UsageError(format!("--plan entry {p:?} is not BYTES:ITERS")))?;
            let bytes = b.parse().map_err(|_| UsageError(format!("--plan entry {p:?}: bad byte count")))?;
            let iters =
                i.parse().map_err(|_| UsageError(format!("--plan entry {p:?}: bad iteration count")))?;
            Ok((bytes, iters))
        })
        .collect()
}

/// A check-mode input: a deterministic function of (seed, node, index).
pub fn check_input(seed: u64, node: u64, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let x =
                (i as u64).wrapping_mul(2654435761).wrapping_add(seed.wrapping_mul(97) + node * 7919) % 20011;
            (x as f32 / 20011.0 - 0.5) * (1.0 + node as f32 * 0.25)
        })
        .collect()
}

/// A worker's endpoint: its node of the group's ranks, bound to its own address, with the
/// secret its parent passed in the environment.
pub fn bind_worker(peers: &WorkerPeers, timeout_ms: u64) -> limpet_daemon::Result<Endpoint> {
    let WorkerPeers { node, ranks, addrs, tls_dir, congestion } = peers;
    let node = *node;
    let secret = std::env::var(SECRET_ENV).map_err(|_| UsageError(format!("{SECRET_ENV} is not set")))?;
    let rank = ranks
        .iter()
        .position(|&r| r == node)
        .ok_or_else(|| UsageError(format!("--node {node} is not in --ranks")))?;
    let listen = addrs.get(rank).ok_or_else(|| UsageError("--addrs shorter than --ranks".into()))?;
    let mut cfg = DataPlaneConfig::new(WORKER_CLUSTER_ID, node, secret.into_bytes());
    cfg.timeout = Duration::from_millis(timeout_ms);
    cfg.congestion = congestion_arg(congestion)?;
    if let Some(dir) = tls_dir {
        let files = limpet_consensus::tls::TlsFiles {
            ca: dir.join("ca.pem"),
            cert: dir.join(format!("n{node}.pem")),
            key: dir.join(format!("n{node}.key")),
        };
        cfg.tls = Some(limpet_agent::DataTls::from_tls(&limpet_consensus::tls::Tls::load(&files)?)?);
    }
    Ok(Endpoint::bind(listen.parse().with_context(|| format!("address {listen:?}"))?, cfg)?)
}

/// Runs one worker.
pub fn run_worker(args: DpWorkerArgs) -> limpet_daemon::Result<()> {
    let plan = parse_plan(&args.plan)?;
    let ep = bind_worker(&args.peers, args.timeout_ms)?;
    let WorkerPeers { node, ranks, addrs, .. } = &args.peers;
    let node = *node;
    let rank = ranks.iter().position(|&r| r == node).expect("bind_worker checked the node");
    let mut g = ep.group(args.epoch, ranks, addrs)?;
    let out = std::io::stdout();
    match args.mode {
        WorkerMode::Bench => {
            let mut sizes = Vec::new();
            for (step, &(bytes, iters)) in plan.iter().enumerate() {
                let step = step as u64 * 1000;
                let mut buf = vec![1.0f32; bytes / 4];
                let lossy = if args.bf16 { buf.len() } else { 0 };
                for w in 0..2 {
                    g.allreduce_sum_bf16(&mut buf, lossy, step + w)?;
                }
                g.barrier(step + 2)?;
                let t = Instant::now();
                for i in 0..iters {
                    g.allreduce_sum_bf16(&mut buf, lossy, step + 3 + i)?;
                }
                sizes.push(
                    serde_json::json!({"bytes": bytes, "seconds": t.elapsed().as_secs_f64() / iters as f64}),
                );
            }
            g.barrier(u64::MAX)?;
            if rank == 0 {
                writeln!(out.lock(), "{}", serde_json::json!({ "sizes": sizes }))?;
            }
        }
        WorkerMode::Check => {
            for (step, &(len, _)) in plan.iter().enumerate() {
                let mut buf = check_input(args.seed, node, len);
                g.allreduce_sum(&mut buf, step as u64)?;
                let mut worst = 0f64;
                let inputs: Vec<Vec<f32>> = ranks.iter().map(|&n| check_input(args.seed, n, len)).collect();
                for (i, got) in buf.iter().enumerate() {
                    let exact: f64 = inputs.iter().map(|x| f64::from(x[i])).sum();
                    let scale: f64 = inputs.iter().map(|x| f64::from(x[i].abs())).sum::<f64>().max(1e-6);
                    worst = worst.max((f64::from(*got) - exact).abs() / scale);
                }
                let hash = blake3::hash(bytemuck::cast_slice(&buf)).to_hex().to_string();
                let line = serde_json::json!({"node": node, "len": len, "max_rel_err": worst, "hash": hash});
                writeln!(out.lock(), "{line}")?;
            }
        }
        WorkerMode::Loop => {
            let mut buf = vec![1.0f32; plan.first().map_or(1 << 20, |p| p.0 / 4)];
            let mut step = 0u64;
            let mut last_ok = Instant::now();
            writeln!(out.lock(), "{}", serde_json::json!({"node": node, "ready": true}))?;
            out.lock().flush()?;
            loop {
                match g.allreduce_sum(&mut buf, step) {
                    Ok(()) => {
                        step += 1;
                        last_ok = Instant::now();
                    }
                    Err(e) => {
                        let line = serde_json::json!({
                            "node": node, "steps": step, "error": e.to_string(),
                            "ms_since_last_ok": last_ok.elapsed().as_secs_f64() * 1e3,
                        });
                        writeln!(out.lock(), "{line}")?;
                        return Ok(());
                    }
                }
            }
        }
    }
    Ok(())
}

/// Worker processes of one group, killed when dropped.
pub struct Workers {
    /// The children, in rank order.
    pub children: Vec<Child>,
}

impl Drop for Workers {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts `world` workers (node ids `order`) of `exe dp-worker` with `extra` arguments.
pub fn spawn_workers(
    exe: &std::path::Path,
    order: &[u64],
    extra: &[String],
) -> limpet_daemon::Result<Workers> {
    spawn_group(exe, "dp-worker", order, extra)
}

/// Starts one `exe SUBCOMMAND` process per node of `order`, each told every node's id and a
/// free loopback address, sharing a fresh secret.
pub fn spawn_group(
    exe: &std::path::Path,
    subcommand: &str,
    order: &[u64],
    extra: &[String],
) -> limpet_daemon::Result<Workers> {
    let addrs: Vec<String> = order
        .iter()
        .map(|_| free_port().map(|p| format!("127.0.0.1:{p}")))
        .collect::<limpet_daemon::Result<_>>()?;
    let ranks: Vec<String> = order.iter().map(u64::to_string).collect();
    let secret: String = (0..32).map(|_| format!("{:02x}", rand::random::<u8>())).collect();
    let mut children = Vec::new();
    for &node in order {
        let child = Command::new(exe)
            .arg(subcommand)
            .args(["--node", &node.to_string(), "--ranks", &ranks.join(","), "--addrs", &addrs.join(",")])
            .args(extra)
            .env(SECRET_ENV, &secret)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {}", exe.display()))?;
        children.push(child);
    }
    Ok(Workers { children })
}
