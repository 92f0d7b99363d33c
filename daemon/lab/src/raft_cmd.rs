//! `limpet-lab raft-node` (one membership-log node in its own process, without training) and
//! `limpet-lab bench raft` (N such processes on loopback, measuring how fast membership
//! proposals commit). `RaftCluster` starts and stops the processes for both the benchmark
//! and the multi-process tests.

use anyhow::Context;
use clap::Args;
use limpet_consensus::state::{Command, Hardware};
use limpet_consensus::{Client, Node, NodeConfig, NodeStatus};
use limpet_daemon::config::parse_founders;
use limpet_daemon::UsageError;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// `limpet-lab raft-node`.
#[derive(Debug, Args)]
pub struct RaftNodeArgs {
    /// Raft id of this node (non-zero).
    #[arg(long)]
    pub id: u64,
    /// Name of this node [default: node-ID].
    #[arg(long)]
    pub name: Option<String>,
    /// Cluster name; nodes of other clusters are refused.
    #[arg(long, default_value = "limpet")]
    pub cluster: String,
    /// gRPC listen address.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// State directory (the sled log lives in DIR/consensus).
    #[arg(long, value_name = "DIR")]
    pub dir: PathBuf,
    /// Founding members, `ID=ADDR` each, the same list on every founder.
    #[arg(long, value_name = "ID=ADDR", value_delimiter = ',')]
    pub bootstrap: Vec<String>,
    /// Address of a member to join through (for nodes that are not founders).
    #[arg(long, value_name = "ADDR")]
    pub seed: Vec<String>,
    /// Milliseconds per raft tick (elections after 10-20 ticks).
    #[arg(long, default_value_t = 100)]
    pub tick_ms: u64,
    /// Applied entries between writes of the whole applied state (1: every batch).
    #[arg(long, default_value_t = limpet_consensus::CoreConfig::new(1, "x").save_every)]
    pub save_every: u64,
    /// Gone members' records in the founding state, as a large fleet's state holds.
    #[arg(long, default_value_t = 0)]
    pub ballast: usize,
    /// Applied entries between raft snapshots (compactions of the log).
    #[arg(long, default_value_t = limpet_consensus::CoreConfig::new(1, "x").snapshot_interval)]
    pub snapshot_interval: u64,
    /// Snapshot data past this many bytes travels in chunks of this size.
    #[arg(long, default_value_t = limpet_consensus::chunks::SNAPSHOT_CHUNK_BYTES)]
    pub snapshot_chunk_bytes: usize,
}

/// Runs one node until SIGTERM, SIGINT or a fatal storage error.
pub fn run_node(args: RaftNodeArgs) -> limpet_daemon::Result<()> {
    if args.id == 0 {
        return Err(UsageError("--id must be non-zero (raft reserves 0)".into()).into());
    }
    if args.tick_ms == 0 {
        return Err(UsageError("--tick-ms must be positive".into()).into());
    }
    let founders = parse_founders(&args.bootstrap)?;
    if !founders.is_empty() && !founders.iter().any(|f| f.id == args.id) {
        return Err(UsageError(format!("--bootstrap does not list this node's id {}", args.id)).into());
    }
    let name = args.name.clone().unwrap_or_else(|| format!("node-{}", args.id));
    let mut cfg = NodeConfig::new(args.id, &args.cluster, &name, args.listen, args.dir.clone());
    cfg.tick = Duration::from_millis(args.tick_ms);
    cfg.seeds = args.seed.clone();
    cfg.core.save_every = args.save_every;
    cfg.ballast = args.ballast;
    cfg.core.snapshot_interval = args.snapshot_interval;
    cfg.snapshot_chunk_bytes = args.snapshot_chunk_bytes;
    if let Some(me) = founders.iter().find(|f| f.id == args.id) {
        cfg.advertise = me.control_addr.clone();
    }
    cfg.bootstrap = (!founders.is_empty()).then_some(founders);
    tracing_init();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let shutdown = CancellationToken::new();
        let tasks = limpet_consensus::tasks::Tasks::new(shutdown.clone());
        let node = Node::start(cfg, &tasks).await?;
        println!("listening on {}", node.addr());
        let stop = shutdown.clone();
        tokio::spawn(async move {
            let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .expect("SIGTERM handler");
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
                _ = stop.cancelled() => {}
            }
            stop.cancel();
        });
        node.wait().await?;
        // A panic in one of the node's tasks stopped it: the process says so.
        let _ = tasks.shutdown(tokio::time::Instant::now() + limpet_consensus::tasks::SHUTDOWN_LIMIT).await;
        match tasks.fatal() {
            Some(f) => Err(f.into()),
            None => Ok(()),
        }
    })
}

fn tracing_init() {
    limpet_daemon::init_tracing();
}

/// Node processes on loopback, killed when dropped.
pub struct RaftCluster {
    exe: PathBuf,
    dir: PathBuf,
    cluster: String,
    tick_ms: u64,
    /// Founders' `ID=ADDR` list.
    founders: Vec<String>,
    /// Each node's address, by id - 1.
    pub addrs: Vec<String>,
    children: Vec<Option<Child>>,
    /// More arguments of every node's `raft-node`.
    node_args: Vec<String>,
}

/// A loopback port nobody listens on right now (for child processes told their address).
pub fn free_port() -> limpet_daemon::Result<u16> {
    use nix::fcntl::{Flock, FlockArg};
    // A port is free once its probe closes, so it may be handed out again before the process
    // it was meant for binds it. Three guards: take ports below the kernel's ephemeral range,
    // which port-0 binds and outgoing connections of every other process draw from; never
    // return the same port twice in one process; and hold an advisory lock on a file named
    // for the port until this process exits, so that the other local clusters of a parallel
    // test run (each its own process, each drawing from the same range) skip it. The kernel
    // drops the lock when the process dies, `kill -9` included.
    static GIVEN: std::sync::Mutex<Vec<(u16, Option<Flock<std::fs::File>>)>> =
        std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().expect("port list lock");
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse::<u16>().ok()))
        .unwrap_or(32768);
    let locks = std::env::temp_dir().join("limpet-ports");
    // Without the directory the lock guard is lost, not the port: the other two still hold.
    let _ = std::fs::create_dir_all(&locks);
    let mut rng = rand::rng();
    for _ in 0..256 {
        let port = if low > 12_000 {
            rand::Rng::random_range(&mut rng, 10_000..low)
        } else {
            std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port()
        };
        if given.iter().any(|(p, _)| *p == port) {
            continue;
        }
        let lock = match std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(locks.join(format!("{port}.lock")))
        {
            Ok(file) => match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(held) => Some(held),
                // Another process holds this port for its cluster.
                Err((_, nix::errno::Errno::EWOULDBLOCK)) => continue,
                Err(_) => None,
            },
            Err(_) => None,
        };
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            given.push((port, lock));
            return Ok(port);
        }
    }
    limpet_daemon::fail!("no unused loopback port after 256 tries")
}

impl RaftCluster {
    /// Starts `n` nodes of `exe raft-node` under `dir`: up to five founders (the voters), and
    /// the rest join through node 1 as learners.
    pub fn start(exe: &Path, n: usize, dir: &Path, tick_ms: u64) -> limpet_daemon::Result<RaftCluster> {
        RaftCluster::start_with(exe, n, dir, tick_ms, Vec::new())
    }

    /// As [`RaftCluster::start`], each node given `node_args` too.
    pub fn start_with(
        exe: &Path,
        n: usize,
        dir: &Path,
        tick_ms: u64,
        node_args: Vec<String>,
    ) -> limpet_daemon::Result<RaftCluster> {
        let n_founders = n.min(5);
        let addrs: Vec<String> = (0..n_founders)
            .map(|_| free_port().map(|p| format!("127.0.0.1:{p}")))
            .collect::<limpet_daemon::Result<_>>()?;
        let founders = addrs.iter().enumerate().map(|(i, a)| format!("{}={a}", i + 1)).collect();
        let mut c = RaftCluster {
            exe: exe.to_path_buf(),
            dir: dir.to_path_buf(),
            cluster: "limpet-local".into(),
            tick_ms,
            founders,
            addrs,
            children: (0..n_founders).map(|_| None).collect(),
            node_args,
        };
        for id in 1..=n_founders as u64 {
            c.spawn(id)?;
        }
        for _ in n_founders..n {
            c.add_joiner()?;
        }
        Ok(c)
    }

    /// The cluster name the nodes use.
    pub fn cluster(&self) -> &str {
        &self.cluster
    }

    /// Starts one more node that is not a founder: it asks node 1 to admit it. Returns its id.
    pub fn add_joiner(&mut self) -> limpet_daemon::Result<u64> {
        self.addrs.push(format!("127.0.0.1:{}", free_port()?));
        self.children.push(None);
        let id = self.addrs.len() as u64;
        self.spawn(id)?;
        Ok(id)
    }

    /// (Re)starts node `id` from its state directory.
    pub fn spawn(&mut self, id: u64) -> limpet_daemon::Result<()> {
        let i = (id - 1) as usize;
        let founders = self.founders.join(",");
        let membership = if i < self.founders.len() {
            ["--bootstrap", founders.as_str()]
        } else {
            ["--seed", self.addrs[0].as_str()]
        };
        let node_dir = self.dir.join(format!("node-{id}"));
        std::fs::create_dir_all(&node_dir)?;
        let log = std::fs::OpenOptions::new().create(true).append(true).open(node_dir.join("node.log"))?;
        let child = std::process::Command::new(&self.exe)
            .arg("raft-node")
            .args(["--id", &id.to_string(), "--cluster", &self.cluster, "--listen", &self.addrs[i]])
            .arg("--dir")
            .arg(&node_dir)
            .args(membership)
            .args(["--tick-ms", &self.tick_ms.to_string()])
            .args(&self.node_args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", self.exe.display()))?;
        self.children[i] = Some(child);
        Ok(())
    }

    /// Kills node `id` with SIGKILL (no chance to flush or say goodbye).
    pub fn kill(&mut self, id: u64) {
        if let Some(mut c) = self.children[(id - 1) as usize].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// A client of node `id`.
    pub async fn client(&self, id: u64) -> limpet_daemon::Result<Client> {
        Ok(Client::connect(&self.addrs[(id - 1) as usize], &self.cluster).await?)
    }

    /// Every live node's status (None where the node does not answer).
    pub async fn statuses(&self) -> Vec<Option<NodeStatus>> {
        let mut out = Vec::new();
        for (i, child) in self.children.iter().enumerate() {
            let status = match child {
                Some(_) => match self.client(i as u64 + 1).await {
                    Ok(mut c) => c.status().await.ok(),
                    Err(_) => None,
                },
                None => None,
            };
            out.push(status);
        }
        out
    }

    /// Waits until a leader is known by every live node, and returns it.
    pub async fn wait_for_leader(&self, within: Duration) -> limpet_daemon::Result<u64> {
        let start = Instant::now();
        loop {
            let statuses = self.statuses().await;
            let live: Vec<&NodeStatus> = statuses.iter().flatten().collect();
            let alive = self.children.iter().filter(|c| c.is_some()).count();
            if live.len() == alive {
                if let Some(l) = live.iter().find(|s| s.role == "leader") {
                    if live.iter().all(|s| s.leader == l.id) {
                        return Ok(l.id);
                    }
                }
            }
            if start.elapsed() > within {
                limpet_daemon::fail!("no leader after {within:?}; node logs are in {}", self.dir.display());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for RaftCluster {
    fn drop(&mut self) {
        for c in self.children.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `limpet-lab bench raft`.
#[derive(Debug, Args)]
pub struct BenchRaftArgs {
    /// Nodes (processes) in the cluster.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=9))]
    pub nodes: u64,
    /// Proposals per phase.
    #[arg(long, default_value_t = 1000)]
    pub proposals: u64,
    /// Proposals in flight during the throughput phase.
    #[arg(long, default_value_t = 32)]
    pub concurrency: u64,
    /// Where the nodes keep their state [default: a temporary directory].
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Applied entries between each node's writes of its whole applied state (1: every
    /// batch, as before the state was written lazily).
    #[arg(long, default_value_t = limpet_consensus::CoreConfig::new(1, "x").save_every)]
    pub save_every: u64,
    /// Gone members' records in the founding state: commits against a large fleet's state.
    #[arg(long, default_value_t = 0)]
    pub ballast: usize,
}

/// The benchmark's findings.
#[derive(Debug, serde::Serialize)]
pub struct RaftBenchReport {
    /// Nodes.
    pub nodes: u64,
    /// Proposals per phase.
    pub proposals: u64,
    /// Sequential commit latency, milliseconds.
    pub latency_ms: crate::stats::Percentiles,
    /// Proposals per second with `concurrency` in flight.
    pub throughput_per_sec: f64,
    /// In flight during the throughput phase.
    pub concurrency: u64,
    /// Log index at the end (every proposal is one entry).
    pub final_index: u64,
    /// Members in the state (the gone ones of `--ballast` included).
    pub members: usize,
    /// `--save-every`.
    pub save_every: u64,
}

fn bump(id: u64, n: u64) -> Command {
    Command::UpdateHardware { id, hardware: Hardware { samples_per_sec_milli: n, ..Hardware::default() } }
}

/// Runs the benchmark.
pub fn bench(args: BenchRaftArgs) -> limpet_daemon::Result<()> {
    if args.proposals == 0 || args.concurrency == 0 {
        return Err(UsageError("--proposals and --concurrency must be positive".into()).into());
    }
    let tmp = tempfile::tempdir()?;
    let dir = args.dir.clone().unwrap_or_else(|| tmp.path().to_path_buf());
    let exe = std::env::current_exe()?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let report = rt.block_on(bench_async(&exe, &dir, &args))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        let l = &report.latency_ms;
        println!(
            "raft membership log, {} nodes on loopback (sled, fsync per batch; the state of {} members written every {} entries)",
            report.nodes, report.members, report.save_every
        );
        println!("  commit latency, one at a time ({} proposals):", report.proposals);
        println!("    p50 {:.2} ms   p90 {:.2} ms   p99 {:.2} ms   max {:.2} ms", l.p50, l.p90, l.p99, l.max);
        println!(
            "  throughput with {} in flight: {:.0} proposals/s",
            report.concurrency, report.throughput_per_sec
        );
        if report.nodes == 5 {
            let verdict = if l.p99 < 20.0 { "met" } else { "missed" };
            println!("  goal p99 < 20 ms with 5 nodes: {verdict}");
        }
    }
    Ok(())
}

async fn bench_async(exe: &Path, dir: &Path, args: &BenchRaftArgs) -> limpet_daemon::Result<RaftBenchReport> {
    let node_args = vec![
        "--save-every".into(),
        args.save_every.to_string(),
        "--ballast".into(),
        args.ballast.to_string(),
    ];
    let cluster = RaftCluster::start_with(exe, args.nodes as usize, dir, 100, node_args)?;
    let leader = cluster.wait_for_leader(Duration::from_secs(30)).await?;
    let mut client = cluster.client(leader).await?;
    let bar = indicatif::ProgressBar::new(args.proposals * 2);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg:>12} [{bar:30}] {pos}/{len} proposals")
            .expect("template")
            .progress_chars("=> "),
    );
    if args.json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    bar.set_message("latency");
    // Warm the connection and the leader's path first.
    for n in 0..10 {
        client.propose(&bump(leader, n), Duration::from_secs(5)).await?;
    }
    let mut lat = Vec::with_capacity(args.proposals as usize);
    for n in 0..args.proposals {
        let t = Instant::now();
        client.propose(&bump(1 + n % args.nodes, n), Duration::from_secs(5)).await?;
        lat.push(t.elapsed().as_secs_f64() * 1e3);
        bar.inc(1);
    }
    bar.set_message("throughput");
    let start = Instant::now();
    let per_task = args.proposals.div_ceil(args.concurrency);
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..args.concurrency {
        let mut c = client.clone();
        let bar = bar.clone();
        let nodes = args.nodes;
        let count = per_task.min(args.proposals.saturating_sub(t * per_task));
        tasks.spawn(async move {
            for n in 0..count {
                c.propose(&bump(1 + (t + n) % nodes, n), Duration::from_secs(10)).await?;
                bar.inc(1);
            }
            Ok::<_, limpet_daemon::Failure>(())
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    let elapsed = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let final_index = client.status().await?.applied;
    Ok(RaftBenchReport {
        nodes: args.nodes,
        proposals: args.proposals,
        latency_ms: crate::stats::percentiles(&lat),
        throughput_per_sec: args.proposals as f64 / elapsed,
        concurrency: args.concurrency,
        final_index,
        members: args.nodes as usize + args.ballast,
        save_every: args.save_every,
    })
}
