//! `limpet-lab dp-worker` (one rank of a data-plane group in its own process, for benchmarks and
//! multi-process tests) and `limpet-lab bench allreduce` (N such processes on loopback, next to
//! the same sizes through torch.distributed's gloo backend in the same run).

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
                for w in 0..2 {
                    g.allreduce_sum(&mut buf, step + w)?;
                }
                g.barrier(step + 2)?;
                let t = Instant::now();
                for i in 0..iters {
                    g.allreduce_sum(&mut buf, step + 3 + i)?;
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

/// `limpet-lab bench allreduce`.
#[derive(Debug, Args)]
pub struct BenchAllreduceArgs {
    /// Ranks (processes).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=16))]
    pub world: u64,
    /// Buffer sizes in bytes (K, M, G suffixes are powers of 1024).
    #[arg(long, value_delimiter = ',', default_value = "4K,256K,4M,16M,64M")]
    pub sizes: Vec<String>,
    /// Skip the gloo comparison.
    #[arg(long)]
    pub no_gloo: bool,
    /// Rounds of (limpet, gloo), alternating; each size reports the median round.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=20))]
    pub rounds: u64,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Also measure the ring over TLS 1.3 (certificates made for the run), in the same
    /// rounds: what encrypting the data plane costs.
    #[arg(long)]
    pub tls: bool,
    /// TCP congestion control of limpet's sockets, or `system` for the host's default (gloo
    /// always runs with the host's default).
    #[arg(long, default_value = limpet_agent::dataplane::endpoint::DEFAULT_CONGESTION)]
    pub congestion: String,
}

/// Per size, the median of several rounds' timings.
fn median_times(rounds: &[Vec<(usize, f64)>]) -> Vec<(usize, f64)> {
    (0..rounds[0].len()).map(|i| (rounds[0][i].0, median(rounds.iter().map(|r| r[i].1).collect()))).collect()
}

/// Parses `4K`, `16M`, `1G` or plain byte counts.
pub fn parse_size(s: &str) -> Result<usize, UsageError> {
    let bytes = limpet_daemon::args::parse_bytes(s).map_err(|e| UsageError(format!("size {e}")))? as usize;
    if bytes % 4 != 0 {
        return Err(UsageError(format!("size {s:?} is not a positive multiple of 4 bytes (f32)")));
    }
    Ok(bytes)
}

fn iterations(bytes: usize) -> u64 {
    ((256usize << 20) / bytes).clamp(5, 400) as u64
}

/// One size's measurement.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Measurement {
    /// Seconds per allreduce.
    pub seconds: f64,
    /// Bytes / seconds, GB/s.
    pub algbw_gbps: f64,
    /// algbw x 2(N-1)/N, GB/s.
    pub busbw_gbps: f64,
}

/// One row of the report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SizeReport {
    /// Buffer bytes.
    pub bytes: usize,
    /// limpet's ring.
    pub limpet: Measurement,
    /// gloo, when measured.
    pub gloo: Option<Measurement>,
    /// limpet busbw / gloo busbw (for 4 KB, compare times: gloo time / limpet time is the same number).
    pub ratio: Option<f64>,
    /// limpet's ring over TLS, when measured.
    pub limpet_tls: Option<Measurement>,
    /// limpet's ring with the host's default congestion control (gloo's), when that differs
    /// from limpet's: the comparison with gloo on equal TCP settings.
    pub limpet_host_congestion: Option<Measurement>,
    /// gloo time / that ring's time.
    pub ratio_host_congestion: Option<f64>,
}

fn measurement(bytes: usize, seconds: f64, world: u64) -> Measurement {
    let algbw = bytes as f64 / seconds / 1e9;
    let busbw = if world > 1 { algbw * 2.0 * (world - 1) as f64 / world as f64 } else { algbw };
    Measurement { seconds, algbw_gbps: algbw, busbw_gbps: busbw }
}

fn rank0_times(workers: Workers) -> limpet_daemon::Result<Vec<(usize, f64)>> {
    let mut workers = workers;
    let mut out = None;
    for (i, c) in workers.children.iter_mut().enumerate() {
        let mut stdout = String::new();
        std::io::Read::read_to_string(c.stdout.as_mut().expect("piped"), &mut stdout)?;
        let status = c.wait()?;
        if !status.success() {
            limpet_daemon::fail!("worker {i} failed ({status})");
        }
        if i == 0 {
            out = Some(stdout);
        }
    }
    parse_times(&out.unwrap_or_default())
}

fn parse_times(json: &str) -> limpet_daemon::Result<Vec<(usize, f64)>> {
    let v: serde_json::Value =
        serde_json::from_str(json.trim()).with_context(|| format!("timing output {json:?}"))?;
    let sizes = v["sizes"].as_array().context("timing output without sizes")?;
    sizes
        .iter()
        .map(|s| {
            Ok((s["bytes"].as_u64().context("bytes")? as usize, s["seconds"].as_f64().context("seconds")?))
        })
        .collect()
}

/// The Python interpreter of the setup's venv: `LIMPET_PYTHON`, else the clone's
/// `.limpet/python` wrapper (found from the working directory or from this executable in
/// `target/<profile>/`).
pub fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("LIMPET_PYTHON") {
        return PathBuf::from(p);
    }
    let mut bases = vec![PathBuf::from(".")];
    if let Ok(exe) = std::env::current_exe() {
        bases.extend(exe.ancestors().skip(1).take(4).map(std::path::Path::to_path_buf));
    }
    bases
        .iter()
        .map(|b| b.join(".limpet/python"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("python3"))
}

fn gloo_times(world: u64, plan: &[(usize, u64)]) -> limpet_daemon::Result<Vec<(usize, f64)>> {
    let dir = tempfile::tempdir()?;
    let script = dir.path().join("gloo_allreduce.py");
    std::fs::write(&script, include_str!("../../../bench/gloo_allreduce.py"))?;
    let py = python();
    let out = Command::new(&py)
        .arg(&script)
        .arg(world.to_string())
        .arg(free_port()?.to_string())
        .args(plan.iter().map(|(b, i)| format!("{b}:{i}")))
        .env("OMP_NUM_THREADS", "1")
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {} (set LIMPET_PYTHON, or run `make setup`)", py.display()))?;
    if !out.status.success() {
        limpet_daemon::fail!("the gloo benchmark failed ({})", out.status);
    }
    parse_times(&String::from_utf8_lossy(&out.stdout))
}

/// Runs the benchmark.
pub fn bench_allreduce(args: BenchAllreduceArgs) -> limpet_daemon::Result<()> {
    let sizes: Vec<usize> = args.sizes.iter().map(|s| parse_size(s)).collect::<Result<_, _>>()?;
    let host_cc = limpet_agent::dataplane::endpoint::host_congestion();
    let ours_cc = congestion_arg(&args.congestion)?.unwrap_or_else(|| host_cc.clone());
    let plan: Vec<(usize, u64)> = sizes.iter().map(|&b| (b, iterations(b))).collect();
    let plan_arg = plan.iter().map(|(b, i)| format!("{b}:{i}")).collect::<Vec<_>>().join(",");
    let exe = std::env::current_exe()?;
    let order: Vec<u64> = (1..=args.world).collect();
    let spinner = indicatif::ProgressBar::new_spinner();
    if args.json {
        spinner.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    spinner.enable_steady_tick(Duration::from_millis(120));
    spinner.set_message(format!("limpet ring allreduce, {} processes", args.world));
    // Alternate the two so that drift in the machine's state affects both alike.
    let (mut ours_rounds, mut theirs_rounds, mut tls_rounds) = (Vec::new(), Vec::new(), Vec::new());
    // When limpet's sockets use another algorithm than the host's default (which gloo
    // gets), the ring also runs with the host's default in the same rounds, so the report
    // shows the comparison on equal TCP settings too.
    let also_host = ours_cc != host_cc;
    let mut host_rounds = Vec::new();
    let certs = tempfile::tempdir()?;
    if args.tls {
        bench_certs(certs.path(), &order)?;
    }
    for round in 1..=args.rounds {
        spinner.set_message(format!(
            "round {round}/{}: limpet ring allreduce, {} processes",
            args.rounds, args.world
        ));
        let base =
            ["--mode", "bench", "--plan", plan_arg.as_str(), "--timeout-ms", "30000"].map(String::from);
        let with_cc = |cc: &str| [&base[..], &["--congestion".to_string(), cc.to_string()]].concat();
        let worker_args = with_cc(&args.congestion);
        ours_rounds.push(rank0_times(spawn_workers(&exe, &order, &worker_args)?)?);
        if also_host {
            spinner.set_message(format!(
                "round {round}/{}: limpet ring allreduce with the host's congestion control ({host_cc}), {} processes",
                args.rounds, args.world
            ));
            host_rounds.push(rank0_times(spawn_workers(&exe, &order, &with_cc("system"))?)?);
        }
        if args.tls {
            spinner.set_message(format!(
                "round {round}/{}: limpet ring allreduce over TLS, {} processes",
                args.rounds, args.world
            ));
            let mut with_tls = worker_args.to_vec();
            with_tls.extend(["--tls-dir".to_string(), certs.path().display().to_string()]);
            tls_rounds.push(rank0_times(spawn_workers(&exe, &order, &with_tls)?)?);
        }
        if !args.no_gloo {
            spinner.set_message(format!(
                "round {round}/{}: gloo allreduce (torch.distributed), {} processes",
                args.rounds, args.world
            ));
            theirs_rounds.push(gloo_times(args.world, &plan)?);
        }
    }
    let ours = median_times(&ours_rounds);
    let theirs = (!args.no_gloo).then(|| median_times(&theirs_rounds));
    let tls = args.tls.then(|| median_times(&tls_rounds));
    let host = also_host.then(|| median_times(&host_rounds));
    spinner.finish_and_clear();
    let rows = size_rows(args.world, &ours, theirs.as_deref(), tls.as_deref(), host.as_deref());
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "world": args.world, "sizes": rows,
                "congestion": {"limpet": ours_cc, "host_default": host_cc},
            }))?
        );
        return Ok(());
    }
    print_allreduce(&args, &rows, (&ours_cc, &host_cc))
}

/// A one-day CA and a certificate for each worker `n<id>`.
fn bench_certs(dir: &std::path::Path, order: &[u64]) -> limpet_daemon::Result<()> {
    limpet_daemon::certs::init(dir, "bench", 1)?;
    for n in order {
        limpet_daemon::certs::issue_for_days(dir, &format!("n{n}"), limpet_daemon::certs::Kind::Node(*n), 1)?;
    }
    Ok(())
}

/// One row per size: limpet's median time against gloo's, over TLS and with the host's
/// congestion control where those were measured.
fn size_rows(
    world: u64,
    ours: &[(usize, f64)],
    theirs: Option<&[(usize, f64)]>,
    tls: Option<&[(usize, f64)]>,
    host: Option<&[(usize, f64)]>,
) -> Vec<SizeReport> {
    ours.iter()
        .enumerate()
        .map(|(i, &(bytes, secs))| {
            let limpet = measurement(bytes, secs, world);
            let gloo = theirs.map(|t| measurement(bytes, t[i].1, world));
            let ratio = gloo.as_ref().map(|g| g.seconds / limpet.seconds);
            let limpet_tls = tls.map(|t| measurement(bytes, t[i].1, world));
            let limpet_host_congestion = host.map(|t| measurement(bytes, t[i].1, world));
            let ratio_host_congestion =
                gloo.as_ref().zip(limpet_host_congestion.as_ref()).map(|(g, h)| g.seconds / h.seconds);
            SizeReport {
                bytes,
                limpet,
                gloo,
                ratio,
                limpet_tls,
                limpet_host_congestion,
                ratio_host_congestion,
            }
        })
        .collect()
}

/// The allreduce table, then limpet with the host's congestion control and over TLS where
/// those were measured.
fn print_allreduce(
    args: &BenchAllreduceArgs,
    rows: &[SizeReport],
    (ours_cc, host_cc): (&str, &str),
) -> limpet_daemon::Result<()> {
    let also_host = ours_cc != host_cc;
    println!(
        "allreduce (sum, f32), world {}, loopback; busbw = algbw x 2(N-1)/N; median of {} round(s)",
        args.world, args.rounds
    );
    println!(
        "TCP congestion control: limpet {ours_cc}, gloo the host's default ({host_cc}){}",
        if also_host { "; limpet with the host's default is measured too, below" } else { "" }
    );
    println!(
        "{:>8} | {:>10} {:>8} {:>8} | {:>10} {:>8} {:>8} | {:>6}",
        "size", "limpet", "algbw", "busbw", "gloo", "algbw", "busbw", "ratio"
    );
    for r in rows {
        let g = r.gloo.as_ref();
        println!(
            "{:>8} | {:>10} {:>8.3} {:>8.3} | {:>10} {:>8} {:>8} | {:>6}",
            human(r.bytes),
            time(r.limpet.seconds),
            r.limpet.algbw_gbps,
            r.limpet.busbw_gbps,
            g.map_or("-".into(), |g| time(g.seconds)),
            g.map_or("-".into(), |g| format!("{:.3}", g.algbw_gbps)),
            g.map_or("-".into(), |g| format!("{:.3}", g.busbw_gbps)),
            r.ratio.map_or("-".into(), |x| format!("{x:.2}x")),
        );
    }
    println!("bandwidths in GB/s; ratio = gloo time / limpet time (above 1: limpet is faster)");
    if also_host {
        println!("\nlimpet's ring with the host's congestion control ({host_cc}, as gloo), same rounds:");
        println!(
            "{:>8} | {:>10} {:>8} | {:>10} {:>8} | {:>6}",
            "size", "limpet", "busbw", "gloo", "busbw", "ratio"
        );
        for r in rows {
            let Some(h) = &r.limpet_host_congestion else { continue };
            let g = r.gloo.as_ref();
            println!(
                "{:>8} | {:>10} {:>8.3} | {:>10} {:>8} | {:>6}",
                human(r.bytes),
                time(h.seconds),
                h.busbw_gbps,
                g.map_or("-".into(), |g| time(g.seconds)),
                g.map_or("-".into(), |g| format!("{:.3}", g.busbw_gbps)),
                r.ratio_host_congestion.map_or("-".into(), |x| format!("{x:.2}x")),
            );
        }
    }
    if args.tls {
        println!("\nthe same ring over TLS 1.3 (node certificates both ways), same rounds:");
        println!(
            "{:>8} | {:>10} {:>8} | {:>10} {:>8} | {:>9}",
            "size", "plain", "busbw", "TLS", "busbw", "TLS/plain"
        );
        for r in rows {
            let Some(t) = &r.limpet_tls else { continue };
            println!(
                "{:>8} | {:>10} {:>8.3} | {:>10} {:>8.3} | {:>8.0}%",
                human(r.bytes),
                time(r.limpet.seconds),
                r.limpet.busbw_gbps,
                time(t.seconds),
                t.busbw_gbps,
                100.0 * t.busbw_gbps / r.limpet.busbw_gbps
            );
        }
    }
    Ok(())
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => format!("{b}"),
    }
}

fn time(s: f64) -> String {
    if s < 1e-3 {
        format!("{:.1} us", s * 1e6)
    } else {
        format!("{:.2} ms", s * 1e3)
    }
}

/// `limpet-lab bench handoff`.
#[derive(Debug, Args)]
pub struct BenchHandoffArgs {
    /// Size of the state to transfer (K, M, G suffixes are powers of 1024).
    #[arg(long, default_value = "256M")]
    pub bytes: String,
    /// Parallel streams.
    #[arg(long, default_value_t = 4)]
    pub streams: usize,
    /// Chunk size in KiB.
    #[arg(long, default_value_t = 4096)]
    pub chunk_kb: u32,
    /// Runs of each transfer (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

fn synthetic_image(bytes: usize) -> limpet_daemon::Result<limpet_snapshot::StateImage> {
    use limpet_snapshot::{RawTensor, RngState, StateImage};
    let tensors_n = 16usize;
    let per = (bytes / 4 / tensors_n).max(1);
    let mut tensors = std::collections::BTreeMap::new();
    for t in 0..tensors_n {
        let name = format!("b{t:02}.w");
        let values: Vec<f32> = (0..per).map(|i| ((i * 31 + t * 7) % 1009) as f32 * 1e-3).collect();
        tensors.insert(name.clone(), RawTensor::from_f32(&name, vec![per], &values)?);
    }
    Ok(StateImage::new(1, 0, RngState::new(0), serde_json::json!({"bench": "handoff"}), tensors))
}

use crate::stats::median;

/// Serves `server`'s offers on a loopback port for the rest of the process, one thread
/// per connection as the agent's handoff server does.
fn serve_loopback(server: &limpet_snapshot::handoff::Server) -> limpet_daemon::Result<String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?.to_string();
    let serving = server.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let server = serving.clone();
            std::thread::spawn(move || {
                let _ = conn.set_nodelay(true);
                let _ = server.serve(&mut conn, None);
            });
        }
    });
    Ok(addr)
}

/// Runs the handoff benchmark: a verified state transfer over loopback next to a plain TCP
/// copy of the same bytes.
pub fn bench_handoff(args: BenchHandoffArgs) -> limpet_daemon::Result<()> {
    use limpet_snapshot::handoff::{
        fetch, label_of, plain_copy_seconds, FetchOptions, Offer, Server, TcpDialer,
    };
    let size = parse_size(&args.bytes)?;
    if args.runs == 0 || args.streams == 0 {
        return Err(UsageError("--runs and --streams must be positive".into()).into());
    }
    let image = synthetic_image(size)?;
    let bytes = image.encode()?;
    let prepared = Instant::now();
    let label = label_of(image.content_hash());
    let offer = Offer::new(bytes.clone(), args.chunk_kb.saturating_mul(1024), label);
    let prepare_s = prepared.elapsed().as_secs_f64();
    let server = Server::new();
    server.offer(offer);
    let addr = serve_loopback(&server)?;
    let dialer = TcpDialer { timeout: Duration::from_secs(10) };
    let opts = FetchOptions {
        streams: args.streams,
        batch: 2,
        reconnects: 3,
        expect: Some(label),
        ..FetchOptions::default()
    };
    let bar = indicatif::ProgressBar::new(2 * args.runs as u64);
    if args.json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let (mut verified, mut plain) = (Vec::new(), Vec::new());
    for _ in 0..args.runs {
        bar.set_message("verified handoff");
        let t = Instant::now();
        let (got, _) = fetch(&dialer, std::slice::from_ref(&addr), &opts)?;
        verified.push(t.elapsed().as_secs_f64());
        if got != bytes {
            limpet_daemon::fail!("the transferred state differs from the source's");
        }
        bar.inc(1);
        bar.set_message("plain TCP copy");
        plain.push(plain_copy_seconds(&bytes)?);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let (v, p) = (median(verified), median(plain));
    let gbps = |s: f64| bytes.len() as f64 / s / 1e9;
    let report = serde_json::json!({
        "bytes": bytes.len(), "streams": args.streams, "chunk_bytes": args.chunk_kb as usize * 1024,
        "prepare_seconds": prepare_s,
        "verified_seconds": v, "verified_gbps": gbps(v),
        "plain_seconds": p, "plain_gbps": gbps(p),
        "ratio": p / v,
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "state handoff over loopback, {} in {} streams (median of {} runs)",
            human(bytes.len()),
            args.streams,
            args.runs
        );
        println!(
            "  verified transfer (every chunk checked against the manifest): {:.3} GB/s ({:.1} ms)",
            gbps(v),
            v * 1e3
        );
        println!(
            "  plain TCP copy of the same bytes, one stream:                 {:.3} GB/s ({:.1} ms)",
            gbps(p),
            p * 1e3
        );
        println!(
            "  verified / plain: {:.0}%   (offer prepared once in {:.1} ms, while training continues)",
            100.0 * p / v,
            prepare_s * 1e3
        );
    }
    Ok(())
}
