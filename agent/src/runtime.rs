//! The running agent: one host's consensus node, data-plane endpoint, trainer thread,
//! heartbeats, revocation watchers and (while it leads) the reconfiguration controller.
//!
//! The trainer thread follows the committed log. Before every step it looks at the newest
//! epoch: a survivor of a planned change trains the old epoch up to the new epoch's start
//! step and switches there; a rank whose collective failed switches as soon as the new epoch
//! is committed; a newcomer enters at once and waits for its peers at the boundary. Entering
//! an epoch is itself a small protocol on the new group: every rank publishes its state,
//! the ranks allgather (step, content hash), the first rank at the highest step is the
//! source, and every rank that differs from it (a newcomer, a laggard that did not apply the
//! step in flight, a diverged copy) fetches the source's state before a barrier. So every
//! rank starts the epoch with a bit-identical state, checked, not assumed.

use crate::checkpoint::CheckpointSettings;
use crate::dataplane::frame::Channel;
use crate::dataplane::handoff::{serve_handoff, HandoffDialer};
use crate::dataplane::{DataPlaneConfig, DataPlaneError, Endpoint, Group};
use crate::policy::{BaseBatch, BatchPolicy};
use crate::report::{AgentReport, Broken, Phase, Transition, MAX_TRANSITIONS, REPORT_VERSION};
use crate::revocation::{Source, Watcher};
use crate::stage::StageConnections;
use limpet_consensus::state::{cluster_id, Command, Epoch, Hardware, MemberSpec, MemberStatus, NodeId};
use limpet_consensus::{Client, LocalState, Node, NodeConfig, NodeHandle};
use limpet_snapshot::handoff::{fetch, label_of, FetchOptions, Offer, Server};
use limpet_snapshot::StateImage;
use limpet_trainer::data::Dataset;
use limpet_trainer::{JobSpec, Trainer};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

/// The frame step marker of the entry protocol's collectives (no training step uses it).
const ENTRY_STEP: u64 = u64::MAX;

/// Everything an agent needs to run.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// Raft id.
    pub id: NodeId,
    /// Unique name.
    pub name: String,
    /// Cluster name.
    pub cluster: String,
    /// Consensus listen address.
    pub control: SocketAddr,
    /// Consensus address peers use (empty: the bound one).
    pub advertise_control: String,
    /// Data-plane listen address.
    pub data: SocketAddr,
    /// Data-plane address peers use (empty: the bound one).
    pub advertise_data: String,
    /// State directory.
    pub state_dir: PathBuf,
    /// Cluster secret.
    pub secret: Vec<u8>,
    /// Founding members (identical on every founder), or `None` to join through `seeds`.
    pub bootstrap: Option<Vec<MemberSpec>>,
    /// Control addresses to join through.
    pub seeds: Vec<String>,
    /// The job.
    pub job: JobSpec,
    /// Where the job's data is (if not the default).
    pub data_path: Option<PathBuf>,
    /// Where this rank's parameters and optimizer state live.
    pub device: limpet_trainer::device::DeviceChoice,
    /// The Hugging Face directory the job's weights start from (its fingerprint is in the job).
    pub init_from: Option<PathBuf>,
    /// Batch / learning-rate policy.
    pub policy: BatchPolicy,
    /// World size the job's batch was declared for.
    pub base_world: u64,
    /// Fewest ranks training continues with.
    pub min_nodes: usize,
    /// Revocation sources to poll.
    pub sources: Vec<Source>,
    /// Their poll interval.
    pub poll: Duration,
    /// Heartbeat interval.
    pub heartbeat: Duration,
    /// Silence after which a node is failed.
    pub heartbeat_timeout: Duration,
    /// Data-plane timeout (a dead or silent peer is an error after this).
    pub dp_timeout: Duration,
    /// TCP congestion control of data-plane sockets (`None`: the host's default).
    pub dp_congestion: Option<String>,
    /// Raft tick.
    pub tick: Duration,
    /// Append one JSON line per completed step here.
    pub step_log: Option<PathBuf>,
    /// Time a planned epoch change is scheduled ahead of the furthest rank.
    pub lead: Duration,
    /// Margin kept before a revocation deadline.
    pub notice_margin: Duration,
    /// Pipeline parallelism; `None` trains plain data parallelism.
    pub pipeline: Option<PipelineSettings>,
    /// Durable checkpoints; `None` writes only the final one.
    pub checkpoint: Option<CheckpointSettings>,
    /// Mutual TLS on the control plane (and, with `tls_data`, the data plane); `None` runs
    /// in plain text with the cluster secret only.
    pub tls: Option<Arc<limpet_consensus::tls::Tls>>,
    /// Encrypt data-plane connections too (TLS 1.3) when `tls` is set; otherwise they are
    /// authenticated by the cluster secret only.
    pub tls_data: bool,
}

/// An agent's pipeline settings. The node that sets the job profiles the model and records
/// the profile with these in the job, so every leader plans from the same numbers.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineSettings {
    /// Stages per replica, or `None` for the planner's choice.
    pub depth: Option<usize>,
    /// Forced block cuts instead of the planner's (the layout `--layout` names).
    pub cuts: Option<Vec<usize>>,
    /// Memory training may use on each host, bytes.
    pub mem_bytes: u64,
    /// The network between hosts.
    pub link: crate::planner::Link,
    /// Mirror each stage's state to its neighbouring stage every this many steps (0: off),
    /// so a stage with no live replica costs at most this many steps, not the job.
    pub shadow_every: u64,
}

impl AgentConfig {
    /// What the leader's decisions depend on.
    pub fn leader_settings(&self) -> crate::leader::LeaderSettings {
        crate::leader::LeaderSettings {
            heartbeat_ms: self.heartbeat.as_millis() as u64,
            heartbeat_timeout_ms: self.heartbeat_timeout.as_millis() as u64,
            lead_ms: self.lead.as_millis() as u64,
            notice_margin_ms: self.notice_margin.as_millis() as u64,
            min_nodes: self.min_nodes,
            policy: self.policy,
            base: BaseBatch {
                global_batch: self.job.global_batch as u64,
                micro_batch: self.job.micro_batch as u64,
                world: self.base_world.max(1),
            },
        }
    }

    /// A configuration with the defaults for everything but identity, addresses and job.
    pub fn new(
        id: NodeId,
        name: &str,
        cluster: &str,
        state_dir: PathBuf,
        secret: Vec<u8>,
        job: JobSpec,
    ) -> AgentConfig {
        AgentConfig {
            id,
            name: name.to_string(),
            cluster: cluster.to_string(),
            control: "127.0.0.1:0".parse().expect("address"),
            advertise_control: String::new(),
            data: "127.0.0.1:0".parse().expect("address"),
            advertise_data: String::new(),
            state_dir,
            secret,
            bootstrap: None,
            seeds: Vec::new(),
            job,
            data_path: None,
            device: limpet_trainer::device::DeviceChoice::Cpu,
            init_from: None,
            policy: BatchPolicy::FixedGlobal,
            base_world: 1,
            min_nodes: 1,
            sources: Vec::new(),
            poll: Duration::from_secs(2),
            heartbeat: Duration::from_millis(100),
            heartbeat_timeout: Duration::from_millis(1000),
            dp_timeout: Duration::from_secs(3),
            dp_congestion: Some(crate::dataplane::endpoint::DEFAULT_CONGESTION.to_string()),
            tick: Duration::from_millis(50),
            step_log: None,
            lead: Duration::from_millis(400),
            notice_margin: Duration::from_millis(1000),
            pipeline: None,
            checkpoint: None,
            tls: None,
            tls_data: true,
        }
    }
}

/// Why an agent stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Exit {
    /// Asked to stop (SIGINT, or the caller's token).
    Stopped,
    /// Removed from the cluster after leaving (notice, drain): its work is done.
    Removed(String),
}

/// One line of the step log.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StepLine {
    /// Unix milliseconds when the step completed.
    pub wall_ms: u64,
    /// The step completed (0-based).
    pub step: u64,
    /// Its epoch.
    pub epoch: u64,
    /// World size of the epoch.
    pub world: usize,
    /// This rank in it.
    pub rank: usize,
    /// The node.
    pub node: NodeId,
    /// Global mean loss of the step.
    pub loss: f64,
}

/// A running agent.
pub struct Agent {
    node: Node,
    handle: NodeHandle,
    shutdown: CancellationToken,
    trainer: std::thread::JoinHandle<Result<Exit, String>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    control_addr: SocketAddr,
    data_addr: SocketAddr,
    id: NodeId,
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl Agent {
    /// Starts every part of the agent. Needs a multi-threaded tokio runtime.
    pub async fn start(cfg: AgentConfig) -> anyhow::Result<Agent> {
        let shutdown = CancellationToken::new();
        let data = Dataset::load(&cfg.job.data, cfg.data_path.as_deref())?;
        cfg.job.validate(&data)?;
        let mut dp = DataPlaneConfig::new(cluster_id(&cfg.cluster), cfg.id, cfg.secret.clone());
        dp.timeout = cfg.dp_timeout;
        dp.congestion = cfg.dp_congestion.clone();
        if let (Some(tls), true) = (&cfg.tls, cfg.tls_data) {
            dp.tls = Some(crate::dataplane::DataTls::from_tls(tls)?);
        }
        let endpoint = Arc::new(Endpoint::bind(cfg.data, dp)?);
        let data_addr = endpoint.addr();
        // Offers: the entry state, this rank's snapshot and the neighbour's it keeps, and
        // their predecessors while receivers finish.
        let server = Server::with_capacity(6);
        let stop_serving = Arc::new(AtomicBool::new(false));
        serve_handoff(Arc::clone(&endpoint), server.clone(), Arc::clone(&stop_serving));

        let mut ncfg = NodeConfig::new(cfg.id, &cfg.cluster, &cfg.name, cfg.control, cfg.state_dir.clone());
        ncfg.advertise = cfg.advertise_control.clone();
        ncfg.data_addr =
            if cfg.advertise_data.is_empty() { data_addr.to_string() } else { cfg.advertise_data.clone() };
        ncfg.tick = cfg.tick;
        ncfg.bootstrap = cfg.bootstrap.clone();
        ncfg.seeds = cfg.seeds.clone();
        ncfg.request_timeout = Duration::from_secs(3);
        ncfg.tls = cfg.tls.clone();
        let mut models = limpet_trainer::device::gpu_models();
        models.dedup();
        ncfg.hardware = Hardware {
            instance_type: "local".into(),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
            gpus: limpet_trainer::device::gpu_count() as u32,
            gpu_model: models.join(", "),
            memory_mib: host_memory_mib(),
            samples_per_sec_milli: 0,
        };
        let node = Node::start(ncfg.clone(), shutdown.clone()).await?;
        let handle = node.handle();
        let control_addr = node.addr();
        let me = MemberSpec {
            id: cfg.id,
            name: cfg.name.clone(),
            control_addr: if cfg.advertise_control.is_empty() {
                control_addr.to_string()
            } else {
                cfg.advertise_control.clone()
            },
            data_addr: ncfg.data_addr.clone(),
            hardware: ncfg.hardware.clone(),
        };

        let cfg = Arc::new(cfg);
        let progress = Arc::new(Mutex::new(AgentReport {
            v: REPORT_VERSION,
            node: cfg.id,
            pid: std::process::id(),
            phase: Phase::Starting,
            epoch: 0,
            applied_step: 0,
            loss: None,
            step_time_ms: 0.0,
            samples_per_s: 0.0,
            broken: None,
            transitions: Vec::new(),
            grad_stats: None,
        }));
        let beat_now = Arc::new(Notify::new());
        let mut tasks = Vec::new();
        tasks.push(tokio::spawn(announce(handle.clone(), me, shutdown.clone())));
        tasks.push(tokio::spawn(heartbeats(
            Arc::clone(&cfg),
            handle.clone(),
            Arc::clone(&progress),
            Arc::clone(&beat_now),
            shutdown.clone(),
        )));
        tasks.push(tokio::spawn(lead(Arc::clone(&cfg), handle.clone(), shutdown.clone())));
        for source in &cfg.sources {
            tasks.push(tokio::spawn(watch_revocations(
                cfg.id,
                source.clone(),
                cfg.poll,
                handle.clone(),
                shutdown.clone(),
            )));
        }

        let device = cfg.device.resolve().map_err(|e| anyhow::anyhow!("[job].device: {e}"))?;
        tracing::info!(device = ?device, choice = ?cfg.device, gpus = ?limpet_trainer::device::gpu_models(), "training device");
        let blocks = 0..cfg.job.model.num_blocks();
        let mut fresh = Trainer::on_device(cfg.job.clone(), data, blocks, device)?;
        if let Some(dir) = &cfg.init_from {
            fresh.init_from_hf(dir)?;
        }
        let looper = TrainLoop {
            handle: handle.clone(),
            last_checkpoint: None,
            writing_checkpoint: Arc::new(AtomicBool::new(false)),
            remote: Arc::new(tokio::sync::OnceCell::new()),
            was_member: false,
            cfg: Arc::clone(&cfg),
            endpoint,
            server,
            watch: handle.watch(),
            progress,
            beat_now,
            stop: shutdown.clone(),
            trainer: fresh,
            group: None,
            broken_at: None,
            last_step_done: None,
            lost: 0,
            step_time_ms: 0.0,
            log: None,
            rt: tokio::runtime::Handle::current(),
            finished: false,
            pending: None,
            grad_stats: None,
            snapshots: Vec::new(),
            shadows: Arc::new(Mutex::new(Vec::new())),
            shadow_round: Arc::new(AtomicU64::new(0)),
        };
        let trainer = std::thread::Builder::new().name("limpet-trainer".into()).spawn(move || {
            let r = looper.run();
            stop_serving.store(true, std::sync::atomic::Ordering::SeqCst);
            r
        })?;
        Ok(Agent { node, handle, shutdown, trainer, tasks, control_addr, data_addr, id: cfg.id })
    }

    /// The consensus node's bound address.
    pub fn control_addr(&self) -> SocketAddr {
        self.control_addr
    }

    /// The data plane's bound address.
    pub fn data_addr(&self) -> SocketAddr {
        self.data_addr
    }

    /// The node handle (proposals, reads, reports).
    pub fn handle(&self) -> NodeHandle {
        self.handle.clone()
    }

    /// A token that stops the agent when cancelled.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Asks the cluster to let this node go (SIGTERM from systemd): it leaves at the next
    /// epoch boundary and is removed; `wait` then returns `Exit::Removed`.
    pub async fn drain_self(&self, reason: &str) -> anyhow::Result<()> {
        let cmd = Command::Drain { id: self.id, reason: reason.to_string() };
        self.handle.propose(cmd, Some(Duration::from_secs(5))).await?;
        Ok(())
    }

    /// Waits until the trainer thread ends (removed, stopped or failed), then stops the rest.
    pub async fn wait(self) -> anyhow::Result<Exit> {
        let trainer = self.trainer;
        let result = tokio::task::spawn_blocking(move || trainer.join())
            .await?
            .map_err(|_| anyhow::anyhow!("the trainer thread panicked"))?;
        self.shutdown.cancel();
        for t in self.tasks {
            let _ = t.await;
        }
        self.node.wait().await?;
        result.map_err(|e| anyhow::anyhow!(e))
    }
}

/// Makes the log hold this node's current addresses (a founder's data address, a restarted
/// node's readmission): proposes `Join` until it is applied.
async fn announce(handle: NodeHandle, me: MemberSpec, stop: CancellationToken) {
    loop {
        let known = handle.watch().borrow().state.members.get(&me.id).cloned();
        let current = known.as_ref().is_some_and(|m| m.spec == me && m.status.is_staying());
        if current {
            return;
        }
        if known.as_ref().is_some_and(|m| matches!(m.status, MemberStatus::Leaving | MemberStatus::Draining))
        {
            return;
        }
        match handle.propose(Command::Join { member: me.clone() }, Some(Duration::from_secs(2))).await {
            Ok((_, what)) => tracing::info!(node = me.id, what, "announced"),
            Err(e) => tracing::debug!(node = me.id, %e, "announce failed; retrying"),
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(300)) => {}
        }
    }
}

/// Sends this agent's report to every member each interval (and at once when the trainer
/// asks, after a collective failure), and keeps it locally too.
async fn heartbeats(
    cfg: Arc<AgentConfig>,
    handle: NodeHandle,
    progress: Arc<Mutex<AgentReport>>,
    now: Arc<Notify>,
    stop: CancellationToken,
) {
    let clients: Arc<tokio::sync::Mutex<HashMap<String, Client>>> = Arc::default();
    loop {
        let report = progress.lock().expect("progress lock").encode();
        handle.reports().put(cfg.id, report.clone());
        let state = Arc::clone(&handle.watch().borrow().state);
        for m in state.members.values() {
            if m.spec.id == cfg.id || m.status == MemberStatus::Gone {
                continue;
            }
            let (addr, report, clients, cluster, me, tls) = (
                m.spec.control_addr.clone(),
                report.clone(),
                Arc::clone(&clients),
                cfg.cluster.clone(),
                cfg.id,
                cfg.tls.clone(),
            );
            let budget = cfg.heartbeat.max(Duration::from_millis(200));
            tokio::spawn(async move {
                let send = async {
                    let cached = clients.lock().await.get(&addr).cloned();
                    let mut c = match cached {
                        Some(c) => c,
                        None => {
                            let c = Client::connect_with(&addr, &cluster, tls.as_deref()).await?;
                            clients.lock().await.insert(addr.clone(), c.clone());
                            c
                        }
                    };
                    c.heartbeat(me, report).await
                };
                match tokio::time::timeout(budget, send).await {
                    Ok(Ok(())) => {}
                    _ => {
                        clients.lock().await.remove(&addr);
                    }
                }
            });
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(cfg.heartbeat) => {}
            _ = now.notified() => {}
        }
    }
}

/// Polls one revocation source and turns a notice into a `Notice` command.
async fn watch_revocations(
    id: NodeId,
    source: Source,
    poll: Duration,
    handle: NodeHandle,
    stop: CancellationToken,
) {
    let watcher = match Watcher::new(source.clone()) {
        Ok(w) => w,
        Err(e) => {
            tracing::error!(%e, "revocation source unusable");
            return;
        }
    };
    let mut told: Option<u64> = None;
    loop {
        match watcher.poll().await {
            Ok(Some(n)) if told != Some(n.deadline_ms) => {
                tracing::warn!(deadline_ms = n.deadline_ms, source = n.source, "revocation notice");
                let cmd = Command::Notice { id, deadline_ms: n.deadline_ms, source: n.source.to_string() };
                match handle.propose(cmd, Some(Duration::from_secs(3))).await {
                    Ok(_) => told = Some(n.deadline_ms),
                    Err(e) => tracing::warn!(%e, "could not record the notice; retrying"),
                }
            }
            Ok(_) => {}
            Err(e) => tracing::debug!(%e, "revocation poll failed"),
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(poll) => {}
        }
    }
}

/// While this node leads: sets the job, runs the controller on the reports, activates
/// epochs that ranks entered and members that trained.
async fn lead(cfg: Arc<AgentConfig>, handle: NodeHandle, stop: CancellationToken) {
    let mut job = None;
    let mut resume_checked = false;
    let mut last_reason = String::new();
    let settings = cfg.leader_settings();
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
        let local = handle.watch().borrow().clone();
        if !local.is_leader {
            continue;
        }
        let st = &local.state;
        if st.job.is_none() {
            if job.is_none() {
                match job_document(&cfg).await {
                    Ok(doc) => job = Some(doc),
                    Err(e) => {
                        tracing::error!(%e, "could not profile the model for the pipeline planner");
                        continue;
                    }
                }
            }
            if !resume_checked && st.checkpoints.is_empty() {
                // A new cluster: start from the newest durable checkpoint of this job, if
                // there is one. Recorded before the job, so the first epoch starts there.
                match find_resume_point(&cfg).await {
                    Ok(Some(record)) => {
                        if let Err(e) = handle.propose(Command::RecordCheckpoint { record }, None).await {
                            tracing::warn!(%e, "could not record the checkpoint to resume from");
                            continue;
                        }
                    }
                    Ok(None) => {}
                    Err(e) => tracing::warn!(%e, "could not look for a checkpoint to resume from"),
                }
                resume_checked = true;
                continue;
            }
            let doc = job.clone().expect("set above");
            if let Err(e) = handle.propose(Command::SetJob { job: doc }, None).await {
                tracing::warn!(%e, "could not set the job");
            }
            continue;
        }
        let reports: BTreeMap<NodeId, (u64, AgentReport)> = handle
            .reports()
            .all()
            .into_iter()
            .filter_map(|r| {
                let rep = AgentReport::decode(&r.report, r.node).ok()?;
                Some((r.node, (r.age.as_millis() as u64, rep)))
            })
            .collect();
        let round = crate::leader::plan_round(&settings, &local.state, &reports, now_ms());
        if round.reason != last_reason {
            tracing::info!(reason = %round.reason, "controller");
            last_reason = round.reason;
        }
        for cmd in round.commands {
            if let Err(e) = handle.propose(cmd.clone(), Some(Duration::from_secs(2))).await {
                tracing::warn!(%e, ?cmd, "proposal failed");
                break;
            }
        }
    }
}

/// The newest durable checkpoint of this agent's job in the configured directory, as the
/// record a new cluster starts from (epoch 0: it predates every epoch of this cluster).
async fn find_resume_point(
    cfg: &AgentConfig,
) -> anyhow::Result<Option<limpet_consensus::state::CheckpointRecord>> {
    let Some(settings) = cfg.checkpoint.as_ref().filter(|c| c.resume) else {
        return Ok(None);
    };
    let dir = settings.dir.clone();
    let job = serde_json::to_value(&cfg.job)?;
    let blocks = cfg.job.model.num_blocks();
    if let Some(r) = &settings.remote {
        // Bring the newest copies home; the search below checks them like local files.
        let remote = crate::remote::Remote::connect(r).await;
        match remote.fetch_newest(&dir, blocks, settings.keep.max(1)).await {
            Ok(steps) if !steps.is_empty() => tracing::info!(?steps, "checkpoints fetched from S3"),
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(%e, "could not fetch checkpoints from S3; searching the local directory only")
            }
        }
    }
    let search = dir.clone();
    let (found, skipped) =
        tokio::task::spawn_blocking(move || crate::checkpoint::newest(&search, blocks, &job)).await??;
    for why in &skipped {
        tracing::warn!(why, "not resuming from this checkpoint");
    }
    Ok(found.map(|(listed, image)| {
        let location = crate::checkpoint::step_dir(&dir, listed.step);
        tracing::info!(step = listed.step, location = %location.display(), "a new cluster: resuming from the newest checkpoint");
        limpet_consensus::state::CheckpointRecord {
            step: listed.step,
            epoch: 0,
            content_hash: image.content_hash().to_string(),
            location: location.display().to_string(),
            node: cfg.id,
        }
    }))
}

/// This host's memory (`MemTotal` of /proc/meminfo) in MiB; 0 where it cannot be read.
fn host_memory_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| {
                l.strip_prefix("MemTotal:")?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()
            })
        })
        .map_or(0, |kib| kib / 1024)
}

/// The job as the log records it: the trainer's job spec and, for a pipelined job, the
/// pipeline settings with this node's profile of the model's blocks.
async fn job_document(cfg: &AgentConfig) -> anyhow::Result<serde_json::Value> {
    let mut doc = serde_json::to_value(&cfg.job)?;
    if let Some(p) = &cfg.pipeline {
        let (job, path) = (cfg.job.clone(), cfg.data_path.clone());
        let profile = tokio::task::spawn_blocking(move || -> anyhow::Result<crate::planner::ModelProfile> {
            let data = Dataset::load(&job.data, path.as_deref())?;
            Ok(crate::stage::profile_model(&job, &data, 5)?)
        })
        .await??;
        let pj = crate::planner::PipelineJob {
            profile,
            link: p.link,
            depth: p.depth,
            cuts: p.cuts.clone(),
            mem_bytes: p.mem_bytes,
        };
        doc["pipeline"] = serde_json::to_value(pj)?;
    }
    Ok(doc)
}

/// The trainer thread's state.
struct TrainLoop {
    cfg: Arc<AgentConfig>,
    /// Proposals (checkpoint records) from the trainer thread.
    handle: NodeHandle,
    /// When this rank last started writing a checkpoint (the time trigger's origin).
    last_checkpoint: Option<Instant>,
    /// A checkpoint is being written in the background: the next trigger waits for it.
    writing_checkpoint: Arc<AtomicBool>,
    /// The S3 client checkpoints are copied with, built at the first copy and kept: a new
    /// client would load the configuration and fetch credentials (on EC2, from the instance
    /// metadata service) again for every checkpoint.
    remote: Arc<tokio::sync::OnceCell<crate::remote::Remote>>,
    /// This process saw the log count the node as a member (joining or active).
    was_member: bool,
    endpoint: Arc<Endpoint>,
    server: Server,
    watch: watch::Receiver<LocalState>,
    progress: Arc<Mutex<AgentReport>>,
    beat_now: Arc<Notify>,
    stop: CancellationToken,
    trainer: Trainer,
    group: Option<(Epoch, Conn)>,
    broken_at: Option<(Instant, Option<NodeId>, String)>,
    last_step_done: Option<Instant>,
    lost: u64,
    step_time_ms: f64,
    log: Option<std::fs::File>,
    rt: tokio::runtime::Handle,
    finished: bool,
    /// The next epoch's ring connections, made ahead of its boundary.
    pending: Option<Pending>,
    /// Smoothed (σ², μ²) of the current epoch.
    grad_stats: Option<(f64, f64)>,
    /// This rank's own state at its last two shadowing steps, newest first (pipelined
    /// epochs). Two, because the newest step's shadow may still be on its way when a host
    /// dies: the step before is then the newest one both copies exist for.
    snapshots: Vec<Snap>,
    /// The next stage's state at those steps, fetched in the background, newest first.
    shadows: Arc<Mutex<Vec<Snap>>>,
    /// Bumped per shadowing round; an older round's fetch gives up.
    shadow_round: Arc<AtomicU64>,
}

/// A state kept for a rollback: its descriptor and encoded bytes.
#[derive(Clone)]
struct Snap {
    desc: Desc,
    bytes: Arc<Vec<u8>>,
}

/// The offer label of `node`'s own snapshot (or, with `shadow`, of the neighbour's snapshot
/// it keeps) at `step`: known to every rank without asking, unlike a content hash.
fn snap_label(node: NodeId, step: u64, shadow: bool) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(b"limpet snapshot");
    h.update(&node.to_le_bytes());
    h.update(&step.to_le_bytes());
    h.update(&[u8::from(shadow)]);
    *h.finalize().as_bytes()
}

/// Puts `snap` among `kept` (replacing one of the same step) and keeps the newest two.
fn keep_newest(kept: &mut Vec<Snap>, snap: Snap) {
    kept.retain(|k| k.desc.step != snap.desc.step);
    kept.push(snap);
    kept.sort_by_key(|k| std::cmp::Reverse(k.desc.step));
    kept.truncate(2);
}

/// The kinds of change an epoch's cause names, as metric labels (the node ids stay out of
/// label values, which must come from a small fixed set).
fn cause_kinds(cause: &str) -> Vec<&'static str> {
    cause
        .split(", ")
        .map(|c| match c.split(' ').next().unwrap_or("") {
            "notice" => "notice",
            "drain" => "drain",
            "failure" => "failure",
            "join" => "join",
            "re-plan" => "replan",
            "collective" => "rebuild",
            "first" => "start",
            _ => "other",
        })
        .collect()
}

fn hash_bytes(hex: &str) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = hex.get(2 * i..2 * i + 2).and_then(|x| u8::from_str_radix(x, 16).ok()).unwrap_or(0);
    }
    out
}

fn hex_of(h: &[u8; 32]) -> String {
    h.iter().map(|b| format!("{b:02x}")).collect()
}

/// What a rank of the current epoch trains over.
enum Conn {
    /// Data parallelism: one ring over every rank.
    Ring(Group),
    /// A data x pipeline layout: its stage's replicas, its replica's stages, pipe links.
    Stages(Box<StageConnections>),
}

/// Ring connections of an epoch not entered yet.
struct Pending {
    epoch: u64,
    right: Option<crate::dataplane::Conn>,
    left: Option<crate::dataplane::Conn>,
}

impl TrainLoop {
    fn set_phase(&self, phase: Phase) {
        let mut p = self.progress.lock().expect("progress lock");
        p.phase = phase;
        p.epoch = self.group.as_ref().map_or(0, |(e, _)| e.id);
        p.applied_step = self.trainer.step();
        p.step_time_ms = self.step_time_ms;
        p.broken = self.broken_at.as_ref().map(|(at, suspect, error)| Broken {
            epoch: p.epoch,
            since_ms: at.elapsed().as_millis() as u64,
            suspect: *suspect,
            error: error.clone(),
        });
    }

    /// Waits up to `d` for the log to change.
    fn wait_change(&mut self, d: Duration) {
        let mut w = self.watch.clone();
        let _ = self.rt.block_on(async { tokio::time::timeout(d, w.changed()).await });
    }

    fn run(mut self) -> Result<Exit, String> {
        if let Some(path) = &self.cfg.step_log {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|e| format!("step log {}: {e}", path.display()))?;
            self.log = Some(f);
        }
        let me = self.cfg.id;
        loop {
            if self.stop.is_cancelled() {
                return Ok(Exit::Stopped);
            }
            let local = self.watch.borrow().clone();
            let st = &local.state;
            if let Some(m) = st.members.get(&me) {
                self.was_member |= m.status.is_staying();
                // A removed node stays until the log no longer counts it as a voter: leaving
                // earlier could take the voters below a majority. One that starts out gone
                // (restarted after a drain) waits to be admitted again instead.
                if m.status == MemberStatus::Gone
                    && self.was_member
                    && self.group.is_none()
                    && !st.voters.contains(&me)
                {
                    self.set_phase(Phase::Left);
                    return Ok(Exit::Removed(m.reason.clone()));
                }
            }
            let newest =
                [st.current.as_ref(), st.scheduled.as_ref()].into_iter().flatten().max_by_key(|e| e.id);
            let in_epoch = self.group.as_ref().map_or(0, |(e, _)| e.id);
            if let Some(n) = newest.filter(|n| n.id > in_epoch) {
                let at_boundary = self.trainer.step() >= n.start_step;
                if n.ranks.contains(&me) {
                    if self.group.is_some() && self.broken_at.is_none() && !at_boundary {
                        let n = n.clone();
                        self.preform(&n);
                    }
                    if self.group.is_none() || self.broken_at.is_some() || at_boundary {
                        let n = n.clone();
                        if let Err(e) = self.enter(&n) {
                            tracing::warn!(epoch = n.id, %e, "could not enter the epoch");
                            self.group = None;
                            self.set_phase(Phase::Waiting);
                            self.wait_change(Duration::from_millis(100));
                        }
                        continue;
                    }
                } else if self.group.is_some() && (self.broken_at.is_some() || at_boundary) {
                    tracing::info!(
                        epoch = n.id,
                        step = self.trainer.step(),
                        "left training: not in the next epoch"
                    );
                    self.group = None;
                    self.broken_at = None;
                    // A rank that sits out (a spare) is not idle for the ones that train.
                    self.last_step_done = None;
                    self.set_phase(Phase::Left);
                    continue;
                }
            }
            let Some((epoch, _)) = &self.group else {
                let phase = if st.members.get(&me).is_some_and(|m| !m.status.is_staying()) {
                    Phase::Left
                } else {
                    Phase::Waiting
                };
                self.set_phase(phase);
                self.wait_change(Duration::from_millis(100));
                continue;
            };
            if self.broken_at.is_some() {
                self.set_phase(Phase::Waiting);
                self.wait_change(Duration::from_millis(50));
                continue;
            }
            if self.trainer.step() >= self.cfg.job.steps {
                if !self.finished {
                    // The job's result, where `limpet demo` and operators find it.
                    let path = limpet_trainer::save_checkpoint(&self.trainer, &self.cfg.state_dir)
                        .map_err(|e| format!("writing the final checkpoint: {e}"))?;
                    tracing::info!(step = self.trainer.step(), path = %path.display(), "job finished; final checkpoint written");
                    self.finished = true;
                }
                self.set_phase(Phase::Finished);
                self.wait_change(Duration::from_millis(200));
                continue;
            }
            let epoch = epoch.clone();
            self.step(&epoch)?;
        }
    }

    /// Trains one step in the current group; a collective error breaks the group.
    fn step(&mut self, epoch: &Epoch) -> Result<(), String> {
        let started = Instant::now();
        let step = self.trainer.step();
        let world = epoch.ranks.len();
        let group_rank = epoch.ranks.iter().position(|&r| r == self.cfg.id).unwrap_or(0);
        let (_, conn) = self.group.as_mut().expect("in a group");
        // A failed collective or stage link: (the peer it names, the error).
        let outcome: Result<limpet_trainer::StepStats, (Option<NodeId>, String)> = match conn {
            Conn::Ring(g) => {
                let buf = self.trainer.compute_grads(g.rank(), g.world()).map_err(|e| e.to_string())?;
                match g.allreduce_sum(buf, step) {
                    Ok(()) => Ok(self.trainer.apply_reduced().map_err(|e| e.to_string())?),
                    Err(e) => Err((suspect_of(&e), e.to_string())),
                }
            }
            Conn::Stages(c) => match c.step(&mut self.trainer) {
                Ok(stats) => Ok(stats),
                // The data plane's errors reach the trainer as text; they name the peer.
                Err(limpet_trainer::TrainerError::Reduce(e)) => Err((suspect_in(&e), e)),
                Err(e) => return Err(e.to_string()),
            },
        };
        let stats = match outcome {
            Ok(stats) => stats,
            Err((suspect, e)) => {
                tracing::warn!(epoch = epoch.id, step, %e, "collective failed; waiting for the next epoch");
                self.lost += 1;
                self.broken_at = Some((Instant::now(), suspect, e));
                self.set_phase(Phase::Waiting);
                self.beat_now.notify_one();
                return Ok(());
            }
        };
        let took = started.elapsed().as_secs_f64() * 1e3;
        self.step_time_ms =
            if self.step_time_ms == 0.0 { took } else { 0.9 * self.step_time_ms + 0.1 * took };
        self.last_step_done = Some(Instant::now());
        let line = StepLine {
            wall_ms: now_ms(),
            step: stats.step,
            epoch: epoch.id,
            world,
            rank: group_rank,
            node: self.cfg.id,
            loss: stats.loss,
        };
        if let Some(f) = self.log.as_mut() {
            let mut s = serde_json::to_string(&line).expect("step lines serialize");
            s.push('\n');
            f.write_all(s.as_bytes()).map_err(|e| format!("writing the step log: {e}"))?;
        }
        metrics::counter!("limpet_steps_total").increment(1);
        metrics::histogram!("limpet_step_seconds").record(took / 1e3);
        metrics::gauge!("limpet_applied_step").set(self.trainer.step() as f64);
        metrics::gauge!("limpet_loss").set(stats.loss);
        metrics::gauge!("limpet_samples_per_second").set(stats.samples as f64 / (took / 1e3).max(1e-9));
        // AdaScale's statistics are over data-parallel replicas, not pipeline stages.
        self.observe_gradients(&stats, epoch.layout.data as usize);
        self.maybe_checkpoint(epoch, group_rank);
        let every = self.cfg.pipeline.as_ref().map_or(0, |p| p.shadow_every);
        if epoch.layout.pipeline > 1 && every > 0 && self.trainer.step() % every == 0 {
            self.take_snapshot(epoch)?;
        }
        {
            let mut p = self.progress.lock().expect("progress lock");
            p.grad_stats = self.grad_stats;
            p.loss = Some(stats.loss);
            p.samples_per_s = stats.samples as f64 / (self.step_time_ms / 1e3).max(1e-9);
        }
        self.set_phase(Phase::Training);
        Ok(())
    }

    /// A new cluster's first epoch starts at the step of the checkpoint it resumes from: a
    /// rank that can read that checkpoint loads it (the others copy it from such a rank in
    /// the entry protocol, as any newcomer would).
    fn resume_from_checkpoint(&mut self, n: &Epoch) {
        if self.trainer.step() >= n.start_step {
            return;
        }
        let st = Arc::clone(&self.watch.borrow().state);
        let Some(rec) = st.checkpoints.iter().rev().find(|c| c.step == n.start_step && c.epoch == 0) else {
            return;
        };
        let dir = PathBuf::from(&rec.location);
        let loaded = (|| -> anyhow::Result<Trainer> {
            let root = dir.parent().ok_or_else(|| anyhow::anyhow!("no parent directory"))?;
            let listed = crate::checkpoint::listed_at(root, rec.step)?;
            let image = crate::checkpoint::load(&listed, self.cfg.job.model.num_blocks())?;
            if image.content_hash() != rec.content_hash {
                anyhow::bail!("its content hash differs from the one recorded in the log");
            }
            let data = self.trainer.data().shallow_clone();
            let mut t = Trainer::on_device(
                self.cfg.job.clone(),
                data,
                0..self.cfg.job.model.num_blocks(),
                self.trainer.model().device(),
            )?;
            t.load_image(&image)?;
            Ok(t)
        })();
        match loaded {
            Ok(t) => {
                tracing::info!(step = rec.step, location = %dir.display(), "resumed from the checkpoint");
                self.trainer = t;
            }
            Err(e) => tracing::warn!(
                step = rec.step,
                location = %dir.display(),
                %e,
                "cannot read the checkpoint to resume from here; a peer that can will hand it over"
            ),
        }
    }

    /// Writes this rank's part of a durable checkpoint when one is due: the ranks of the
    /// first replica write, one part per stage (the whole model in a data-parallel epoch).
    /// The state is copied here, at the step boundary; encoding, the file and the log record
    /// happen in the background while training goes on.
    fn maybe_checkpoint(&mut self, epoch: &Epoch, rank: usize) {
        let Some(c) = self.cfg.checkpoint.clone() else { return };
        let stages = epoch.layout.pipeline.max(1) as usize;
        if rank >= stages {
            return;
        }
        let step = self.trainer.step();
        let since = *self.last_checkpoint.get_or_insert_with(Instant::now);
        // The time trigger only applies without stages: each stage decides alone, and only
        // a step count gives them all the same answer.
        let due = (c.every_steps > 0 && step % c.every_steps == 0)
            || c.every.is_some_and(|d| stages == 1 && since.elapsed() >= d);
        if !due {
            return;
        }
        if self.writing_checkpoint.swap(true, Ordering::SeqCst) {
            tracing::warn!(step, "the previous checkpoint is still being written; skipping this one");
            return;
        }
        self.last_checkpoint = Some(Instant::now());
        let image = match self.trainer.image() {
            Ok(i) => i,
            Err(e) => {
                tracing::error!(step, %e, "could not copy the state for a checkpoint");
                self.writing_checkpoint.store(false, Ordering::SeqCst);
                return;
            }
        };
        let blocks = self.trainer.model().blocks();
        let nb = self.cfg.job.model.num_blocks();
        let (handle, rt, busy) = (self.handle.clone(), self.rt.clone(), Arc::clone(&self.writing_checkpoint));
        let client = Arc::clone(&self.remote);
        let (me, epoch_id) = (self.cfg.id, epoch.id);
        std::thread::spawn(move || {
            let started = Instant::now();
            match crate::checkpoint::write_part(&c.dir, &image, &blocks) {
                Ok(path) => {
                    let secs = started.elapsed().as_secs_f64();
                    metrics::counter!("limpet_checkpoints_total").increment(1);
                    metrics::gauge!("limpet_checkpoint_step").set(step as f64);
                    metrics::histogram!("limpet_checkpoint_seconds").record(secs);
                    tracing::info!(step, ?blocks, path = %path.display(), ms = (secs * 1e3) as u64, "checkpoint written");
                    if let Err(e) = crate::checkpoint::prune(&c.dir, c.keep, nb) {
                        tracing::warn!(%e, "could not delete old checkpoints");
                    }
                    let mut location = path.display().to_string();
                    if let Some(r) = &c.remote {
                        let copied = rt.block_on(async {
                            let remote = client.get_or_init(|| crate::remote::Remote::connect(r)).await;
                            let url = remote.upload(step, &blocks, &path).await?;
                            if let Err(e) = remote.prune(c.keep, nb).await {
                                tracing::warn!(%e, "could not delete old checkpoints in S3");
                            }
                            Ok::<_, crate::checkpoint::CheckpointError>(url)
                        });
                        match copied {
                            Ok(url) => {
                                tracing::info!(step, url, "checkpoint copied to S3");
                                location = url;
                            }
                            Err(e) => {
                                // The local copy stands; the failure counter is what alerts.
                                metrics::counter!("limpet_checkpoint_failures_total").increment(1);
                                tracing::error!(step, %e, "copying a checkpoint to S3 failed");
                            }
                        }
                    }
                    let record = limpet_consensus::state::CheckpointRecord {
                        step,
                        epoch: epoch_id,
                        content_hash: image.content_hash().to_string(),
                        location,
                        node: me,
                    };
                    let cmd = Command::RecordCheckpoint { record };
                    if let Err(e) = rt.block_on(handle.propose(cmd, Some(Duration::from_secs(5)))) {
                        tracing::warn!(step, %e, "checkpoint written but not recorded in the log");
                    }
                }
                Err(e) => {
                    metrics::counter!("limpet_checkpoint_failures_total").increment(1);
                    tracing::error!(step, %e, "writing a checkpoint failed");
                }
            }
            busy.store(false, Ordering::SeqCst);
        });
    }

    /// Keeps this rank's state as its snapshot (offered to peers under a label they can
    /// compute) and starts fetching the next stage's snapshot of the same step in the
    /// background: after this, losing any one stage host costs at most `shadow_every` steps.
    fn take_snapshot(&mut self, epoch: &Epoch) -> Result<(), String> {
        let image = self.trainer.image().map_err(|e| e.to_string())?;
        let bytes = image.encode().map_err(|e| e.to_string())?;
        let step = self.trainer.step();
        let b = self.trainer.model().blocks();
        let me = self.cfg.id;
        self.server.offer(Offer::new(bytes.clone(), 1 << 20, snap_label(me, step, false)));
        keep_newest(
            &mut self.snapshots,
            Snap {
                desc: Desc { step, hash: hash_bytes(image.content_hash()), blocks: (b.start, b.end) },
                bytes: Arc::new(bytes),
            },
        );
        let p = epoch.layout.pipeline as usize;
        let Some(i) = epoch.ranks.iter().position(|&r| r == me) else { return Ok(()) };
        let next = (i / p) * p + (i % p + 1) % p;
        let (node, addr) = (epoch.ranks[next], self.addrs_of(epoch)?[next].clone());
        let round = self.shadow_round.fetch_add(1, Ordering::SeqCst) + 1;
        let (endpoint, server, shadow, rounds) = (
            Arc::clone(&self.endpoint),
            self.server.clone(),
            Arc::clone(&self.shadows),
            Arc::clone(&self.shadow_round),
        );
        let epoch_id = epoch.id;
        std::thread::spawn(move || {
            let give_up = Instant::now() + Duration::from_secs(10);
            let opts = FetchOptions {
                expect: Some(snap_label(node, step, false)),
                reconnects: 0,
                ..Default::default()
            };
            while rounds.load(Ordering::SeqCst) == round && Instant::now() < give_up {
                let dialer = HandoffDialer { endpoint: &endpoint, epoch: epoch_id };
                let got = fetch(&dialer, &[format!("{node}@{addr}")], &opts)
                    .map_err(|e| e.to_string())
                    .and_then(|(bytes, stats)| {
                        crate::dataplane::count_bytes(false, "handoff", stats.bytes);
                        Ok((StateImage::decode(&bytes).map_err(|e| e.to_string())?, bytes))
                    });
                match got {
                    Ok((img, bytes)) if img.meta().step == step => {
                        let blocks = img
                            .tensors()
                            .keys()
                            .filter_map(|n| block_of(n))
                            .fold((usize::MAX, 0), |(lo, hi), k| (lo.min(k), hi.max(k + 1)));
                        server.offer(Offer::new(bytes.clone(), 1 << 20, snap_label(me, step, true)));
                        tracing::debug!(step, from = node, "shadowed the next stage");
                        keep_newest(
                            &mut shadow.lock().expect("shadow lock"),
                            Snap {
                                desc: Desc { step, hash: hash_bytes(img.content_hash()), blocks },
                                bytes: Arc::new(bytes),
                            },
                        );
                        return;
                    }
                    // Not offered yet (the neighbour finishes the step a moment later).
                    other => {
                        if let Err(e) = other {
                            tracing::debug!(step, from = node, %e, "shadow fetch");
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
            }
            if rounds.load(Ordering::SeqCst) == round {
                tracing::warn!(step, from = node, "could not shadow the next stage's state");
            }
        });
        Ok(())
    }

    /// The data addresses of an epoch's ranks, in rank order.
    fn addrs_of(&self, n: &Epoch) -> Result<Vec<String>, String> {
        let st = Arc::clone(&self.watch.borrow().state);
        let addrs: Vec<String> = n
            .ranks
            .iter()
            .map(|r| st.members.get(r).map(|m| m.spec.data_addr.clone()).unwrap_or_default())
            .collect();
        if addrs.iter().any(String::is_empty) {
            return Err(format!("epoch {}: a rank has no data address yet", n.id));
        }
        Ok(addrs)
    }

    /// Whether an epoch newer than `epoch_id` is in the log (then waiting for `epoch_id`'s
    /// peers is pointless).
    fn superseded(&self, epoch_id: u64) -> impl Fn() -> bool {
        let watch = self.watch.clone();
        move || {
            let st = Arc::clone(&watch.borrow().state);
            let newer =
                [st.current.as_ref(), st.scheduled.as_ref()].into_iter().flatten().any(|e| e.id > epoch_id);
            newer
        }
    }

    /// Connects the next epoch's ring while the current one still trains, without ever
    /// waiting: the connection to the right neighbour is made once (its endpoint answers the
    /// handshake on its own threads), the left neighbour's is picked up whenever it has
    /// arrived. So the boundary itself costs only the state check.
    fn preform(&mut self, n: &Epoch) {
        if self.pending.as_ref().is_some_and(|p| p.epoch != n.id) {
            self.pending = None;
        }
        let Ok(addrs) = self.addrs_of(n) else { return };
        let Ok((right, left)) = Group::neighbours(&self.endpoint, &n.ranks, &addrs) else { return };
        if self.pending.is_none() {
            let out = match right {
                None => None,
                Some(r) => {
                    let soon = Instant::now() + Duration::from_millis(200);
                    match self.endpoint.connect_until(
                        &addrs[r],
                        n.ranks[r],
                        n.id,
                        Channel::Ring,
                        soon,
                        &|| false,
                    ) {
                        Ok(s) => Some(s),
                        Err(e) => {
                            tracing::debug!(epoch = n.id, %e, "could not connect the next epoch early");
                            return;
                        }
                    }
                }
            };
            self.pending = Some(Pending { epoch: n.id, right: out, left: None });
        }
        let p = self.pending.as_mut().expect("set above");
        if let (None, Some(l)) = (&p.left, left) {
            p.left =
                self.endpoint.accept_until(n.ranks[l], n.id, Channel::Ring, Instant::now(), &|| false).ok();
        }
    }

    /// Updates the gradient statistics AdaScale needs from a step's reduced values. Each
    /// rank's mean gradient over b samples has E|m_i|² = μ² + σ²/b, the global mean over
    /// N = W b samples has E|g|² = μ² + σ²/N; the two give unbiased estimates of σ² and μ²
    /// (as AdaScale's and KungFu's implementations do). Every rank computes the same values
    /// from the same reduced buffer.
    fn observe_gradients(&mut self, stats: &limpet_trainer::StepStats, world: usize) {
        if world < 2 || stats.samples < world {
            self.grad_stats = None;
            return;
        }
        let (n, w) = (stats.samples as f64, world as f64);
        let b = n / w;
        let global = stats.grad_norm * stats.grad_norm;
        let per_rank = stats.rank_mean_sq_sum / w;
        let variance = ((per_rank - global) / (1.0 / b - 1.0 / n)).max(0.0);
        let mean_sq = (global - variance / n).max(0.0);
        if !(variance.is_finite() && mean_sq.is_finite()) {
            return;
        }
        self.grad_stats = Some(match self.grad_stats {
            Some((v, m)) => (0.9 * v + 0.1 * variance, 0.9 * m + 0.1 * mean_sq),
            None => (variance, mean_sq),
        });
    }

    /// Enters epoch `n`: forms its group, agrees on one state and switches to it.
    fn enter(&mut self, n: &Epoch) -> Result<(), String> {
        let me = self.cfg.id;
        self.set_phase(Phase::Entering);
        // The old group is done; peers of older epochs are refused from now on.
        self.group = None;
        self.endpoint.set_min_epoch(n.id);
        let addrs = self.addrs_of(n)?;
        // Peers arrive when they reach the boundary: wait for them (up to two minutes for a
        // newcomer that enters early), but not for an epoch replaced meanwhile.
        let by = Instant::now() + Duration::from_secs(120);
        let superseded = self.superseded(n.id);
        let mut group = match self.pending.take() {
            Some(p) if p.epoch == n.id => {
                let (_, left) =
                    Group::neighbours(&self.endpoint, &n.ranks, &addrs).map_err(|e| e.to_string())?;
                let left = match (p.left, left) {
                    (Some(s), _) => Some(s),
                    (None, Some(l)) => Some(
                        self.endpoint
                            .accept_until(n.ranks[l], n.id, Channel::Ring, by, &superseded)
                            .map_err(|e| e.to_string())?,
                    ),
                    (None, None) => None,
                };
                Group::assemble(&self.endpoint, n.id, &n.ranks, p.right, left).map_err(|e| e.to_string())?
            }
            _ => self
                .endpoint
                .group_until(n.id, &n.ranks, &addrs, by, &superseded)
                .map_err(|e| e.to_string())?,
        };

        self.resume_from_checkpoint(n);
        // Publish this rank's state, then agree on (step, blocks held, hash).
        let image = self.trainer.image().map_err(|e| e.to_string())?;
        let hash = image.content_hash().to_string();
        let encoded = image.encode().map_err(|e| e.to_string())?;
        self.server.offer(Offer::new(encoded, 1 << 20, label_of(&hash)));
        let held = self.trainer.model().blocks();
        // The kept states as published (the background fetch may add one meanwhile).
        let snapshots = self.snapshots.clone();
        let shadows = self.shadows.lock().expect("shadow lock").clone();
        let slot = |v: &[Snap], i: usize| v.get(i).map(|s| s.desc);
        let me_state = RankState {
            live: Desc { step: self.trainer.step(), hash: hash_bytes(&hash), blocks: (held.start, held.end) },
            snaps: [slot(&snapshots, 0), slot(&snapshots, 1)],
            shadows: [slot(&shadows, 0), slot(&shadows, 1)],
        };
        let mine = entry_words(&me_state);
        let mut all = vec![0f32; mine.len() * n.ranks.len()];
        group.allgather(&mine, &mut all, ENTRY_STEP).map_err(|e| e.to_string())?;
        let ranks: Vec<RankState> = all.chunks(mine.len()).map(decode_entry).collect();
        let me_idx = group.rank();
        let nb = self.cfg.job.model.num_blocks();
        let stages = n.layout.stage_blocks(nb)?;
        let target = stages[me_idx % stages.len()].clone();
        let plan = entry_plan(&ranks, me_idx, target.clone(), nb)?;
        let redone = self.trainer.step().saturating_sub(plan.step);
        let mut fetched_bytes = 0;
        let mut fetch_ms = 0;
        let repaired = plan.action == Entry::Repair;
        if plan.action != Entry::Keep {
            if repaired {
                tracing::warn!(
                    epoch = n.id,
                    step = plan.step,
                    "state hash differs from the source's at the same step; repairing"
                );
            }
            let fetch_started = Instant::now();
            let mut tensors = BTreeMap::new();
            let mut meta = None;
            for (src, kind, blocks) in &plan.sources {
                let fetched;
                let desc = ranks[*src].desc(*kind).expect("the plan names descriptors that exist");
                let hex = hex_of(&desc.hash);
                let img = if *src == me_idx {
                    let keep = match kind {
                        Src::Live => None,
                        Src::Snapshot(i) => snapshots.get(*i).cloned(),
                        Src::Shadow(i) => shadows.get(*i).cloned(),
                    };
                    match keep {
                        None => &image,
                        Some(k) => {
                            fetched = StateImage::decode(&k.bytes).map_err(|e| e.to_string())?;
                            if fetched.content_hash() != hex {
                                return Err("a kept snapshot no longer hashes to its descriptor".into());
                            }
                            &fetched
                        }
                    }
                } else {
                    let src_node = n.ranks[*src];
                    let source = format!("{src_node}@{}", addrs[*src]);
                    let label = match kind {
                        Src::Live => label_of(&hex),
                        Src::Snapshot(_) => snap_label(src_node, desc.step, false),
                        Src::Shadow(_) => snap_label(src_node, desc.step, true),
                    };
                    let opts = FetchOptions { expect: Some(label), ..FetchOptions::default() };
                    let dialer = HandoffDialer { endpoint: &self.endpoint, epoch: n.id };
                    let (bytes, stats) = fetch(&dialer, &[source], &opts).map_err(|e| e.to_string())?;
                    fetched_bytes += stats.bytes;
                    crate::dataplane::count_bytes(false, "handoff", stats.bytes);
                    fetched = StateImage::decode(&bytes).map_err(|e| e.to_string())?;
                    if fetched.content_hash() != hex {
                        return Err(format!("state from node {src_node} does not hash to what it announced"));
                    }
                    tracing::info!(
                        epoch = n.id,
                        step = plan.step,
                        from = src_node,
                        ?blocks,
                        bytes = stats.bytes,
                        "state copied from a peer"
                    );
                    &fetched
                };
                for (name, t) in img.tensors() {
                    if block_of(name).is_some_and(|b| blocks.contains(&b)) {
                        tensors.insert(name.clone(), t.clone());
                    }
                }
                if meta.is_none() || *src != me_idx {
                    let m = img.meta();
                    meta = Some((m.step, m.cursor, m.rng, m.job.clone()));
                }
            }
            let (step, cursor, rng, job) = meta.expect("an entry that copies names a source");
            let merged = StateImage::new(step, cursor, rng, job, tensors);
            if target != held {
                tracing::info!(epoch = n.id, from = ?held, to = ?target, "this rank's blocks change");
                self.trainer = Trainer::on_device(
                    self.cfg.job.clone(),
                    self.trainer.data().shallow_clone(),
                    target.clone(),
                    self.trainer.model().device(),
                )
                .map_err(|e| e.to_string())?;
            }
            self.trainer.load_image(&merged).map_err(|e| e.to_string())?;
            fetch_ms = fetch_started.elapsed().as_millis() as u64;
            if plan.action == Entry::Rollback {
                tracing::warn!(
                    epoch = n.id,
                    from = plan.step + redone,
                    to = plan.step,
                    "a stage had no live replica: back to the shadowed snapshot"
                );
                // Kept states newer than the lineage's new head belong to the abandoned one.
                self.snapshots.retain(|k| k.desc.step <= plan.step);
                self.shadows.lock().expect("shadow lock").retain(|k| k.desc.step <= plan.step);
            }
        }
        self.trainer
            .set_epoch_plan(n.batch.global_batch as usize, n.batch.micro_batch as usize, n.lr_scale)
            .map_err(|e| e.to_string())?;
        group.barrier(ENTRY_STEP).map_err(|e| e.to_string())?;
        let idle_ms = self.last_step_done.map_or(0, |t| t.elapsed().as_millis() as u64);
        let t = Transition {
            epoch: n.id,
            step: self.trainer.step(),
            cause: n.cause.clone(),
            idle_ms,
            lost_steps: std::mem::take(&mut self.lost),
            fetched_bytes,
            fetch_ms,
            repaired,
            redone_steps: if plan.action == Entry::Rollback { redone } else { 0 },
        };
        tracing::info!(node = me, epoch = n.id, step = t.step, world = n.ranks.len(), idle_ms, cause = %n.cause, "entered epoch");
        for kind in cause_kinds(&n.cause) {
            metrics::counter!("limpet_transitions_total", "cause" => kind).increment(1);
        }
        metrics::histogram!("limpet_transition_idle_seconds").record(idle_ms as f64 / 1e3);
        metrics::counter!("limpet_lost_steps_total").increment(t.lost_steps);
        metrics::counter!("limpet_redone_steps_total").increment(t.redone_steps);
        metrics::gauge!("limpet_epoch").set(n.id as f64);
        metrics::gauge!("limpet_world_size").set(n.ranks.len() as f64);
        let conn = if n.layout.pipeline > 1 {
            // Every rank passed the barrier, so every ring connection of the entry is taken:
            // the stage groups' connections (same epoch, same channel) cannot be mistaken
            // for them.
            drop(group);
            let layout = (n.layout.data as usize, n.layout.pipeline as usize);
            Conn::Stages(Box::new(
                StageConnections::connect(&self.endpoint, n.id, layout, &n.ranks, &addrs, by, &superseded)
                    .map_err(|e| e.to_string())?,
            ))
        } else {
            Conn::Ring(group)
        };
        self.group = Some((n.clone(), conn));
        self.broken_at = None;
        {
            let mut p = self.progress.lock().expect("progress lock");
            p.transitions.push(t);
            if p.transitions.len() > MAX_TRANSITIONS {
                p.transitions.remove(0);
            }
        }
        self.set_phase(Phase::Training);
        self.beat_now.notify_one();
        Ok(())
    }
}

/// What a rank does with its state when it enters an epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Entry {
    /// It holds the epoch's state for its blocks.
    Keep,
    /// It is behind, new, or holds other blocks: assemble its blocks from holders.
    CatchUp,
    /// It holds its blocks at the top step but with another state (divergence): copy them
    /// from the reference and report.
    Repair,
    /// Some block has no live replica at the top step: everyone goes back to the newest
    /// step at which snapshots and live states together hold the whole model.
    Rollback,
}

/// One state a rank can serve: its step, content hash and blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Desc {
    step: u64,
    hash: [u8; 32],
    blocks: (usize, usize),
}

impl Desc {
    fn holds(&self, block: usize) -> bool {
        (self.blocks.0..self.blocks.1).contains(&block)
    }
}

/// Which of a rank's states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Src {
    /// The state it trains with.
    Live,
    /// Its own state at one of its last two shadowing steps (0: the newest).
    Snapshot(usize),
    /// The next stage's state at one of those steps, kept for it.
    Shadow(usize),
}

/// Every state a rank publishes, live first.
const KINDS: [Src; 5] = [Src::Live, Src::Snapshot(0), Src::Snapshot(1), Src::Shadow(0), Src::Shadow(1)];

/// What a rank publishes at an epoch's entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RankState {
    live: Desc,
    snaps: [Option<Desc>; 2],
    shadows: [Option<Desc>; 2],
}

impl RankState {
    fn desc(&self, kind: Src) -> Option<Desc> {
        match kind {
            Src::Live => Some(self.live),
            Src::Snapshot(i) => self.snaps.get(i).copied().flatten(),
            Src::Shadow(i) => self.shadows.get(i).copied().flatten(),
        }
    }
}

/// How a rank enters: the step everyone starts at, what it does, and for each source rank
/// which of its states and which blocks it takes (itself included).
#[derive(Clone, Debug, PartialEq, Eq)]
struct EntryPlan {
    step: u64,
    action: Entry,
    sources: Vec<(usize, Src, Vec<usize>)>,
}

fn add_source(sources: &mut Vec<(usize, Src, Vec<usize>)>, src: usize, kind: Src, k: usize) {
    match sources.iter_mut().find(|(s, t, _)| *s == src && *t == kind) {
        Some((_, _, blocks)) => blocks.push(k),
        None => sources.push((src, kind, vec![k])),
    }
}

/// From every rank's published states (in rank order), how rank `me`, which trains blocks
/// `target` of a model of `blocks` blocks in the epoch, enters.
///
/// Normally the epoch starts at the highest step any rank applied, from live states. The
/// *reference* is the first rank at that step holding exactly `target`: a rank that holds
/// the same blocks at the same step must match its hash or repair from it. Otherwise each
/// block comes from this rank itself if it holds it at the top step, else from the
/// reference, else from the first rank at the top step that holds it.
///
/// When some block of the model has no live holder at the top step (a pipeline stage lost
/// its only host), the epoch starts at the newest earlier step at which live states, kept
/// snapshots and shadows together hold every block, and every rank loads that step: this
/// rank's own states first, then the first rank's (live, then snapshot, then shadow).
fn entry_plan(
    ranks: &[RankState],
    me: usize,
    target: Range<usize>,
    blocks: usize,
) -> Result<EntryPlan, String> {
    let top = ranks.iter().map(|r| r.live.step).max().unwrap_or(0);
    let live_holder = |k: usize| ranks.iter().position(|r| r.live.step == top && r.live.holds(k));
    if let Some(missing) = (0..blocks).find(|&k| live_holder(k).is_none()) {
        // Every (rank, state) holding block `k` at `step`, in rank order, live first.
        let held_at = |step: u64, k: usize| -> Vec<(usize, Src)> {
            let mut v = Vec::new();
            for (i, r) in ranks.iter().enumerate() {
                for t in KINDS {
                    if r.desc(t).is_some_and(|d| d.step == step && d.holds(k)) {
                        v.push((i, t));
                    }
                }
            }
            v
        };
        let mut steps: Vec<u64> = ranks
            .iter()
            .flat_map(|r| KINDS.iter().filter_map(|&t| r.desc(t)).map(|d| d.step))
            .filter(|&s| s < top)
            .collect();
        steps.sort_unstable_by(|a, b| b.cmp(a));
        steps.dedup();
        let step = steps.into_iter().find(|&s| (0..blocks).all(|k| !held_at(s, k).is_empty())).ok_or_else(|| {
            format!("no rank holds block {missing} at step {top}, and no kept snapshot covers the model: no live replica to copy it from")
        })?;
        let mut sources = Vec::new();
        for k in target {
            let holders = held_at(step, k);
            let (src, kind) = holders
                .iter()
                .find(|&&(i, _)| i == me)
                .or(holders.first())
                .copied()
                .expect("the step was chosen so that every block is held");
            add_source(&mut sources, src, kind, k);
        }
        return Ok(EntryPlan { step, action: Entry::Rollback, sources });
    }
    let want = (target.start, target.end);
    let reference = ranks.iter().position(|r| r.live.step == top && r.live.blocks == want);
    let mine = ranks[me].live;
    if mine.step == top && mine.blocks == want {
        let r = reference.expect("this rank qualifies");
        if ranks[r].live.hash == mine.hash {
            return Ok(EntryPlan { step: top, action: Entry::Keep, sources: Vec::new() });
        }
        return Ok(EntryPlan {
            step: top,
            action: Entry::Repair,
            sources: vec![(r, Src::Live, target.collect())],
        });
    }
    let mut sources = Vec::new();
    for k in target {
        let src = if mine.step == top && mine.holds(k) {
            me
        } else if let Some(r) = reference {
            r
        } else {
            live_holder(k).expect("every block has a live holder at the top step")
        };
        add_source(&mut sources, src, Src::Live, k);
    }
    Ok(EntryPlan { step: top, action: Entry::CatchUp, sources })
}

/// The block a state tensor belongs to: `param/bNN.x` and `optim/<slot>/bNN.x` are block NN's.
fn block_of(name: &str) -> Option<usize> {
    let leaf = name.rsplit('/').next()?;
    let digits = leaf.strip_prefix('b')?.split('.').next()?;
    digits.parse().ok()
}

/// A peer named in a data-plane error's text (`peer N ...`), for errors that reach the
/// agent through the trainer as text.
fn suspect_in(text: &str) -> Option<NodeId> {
    let at = text.find("peer ")? + "peer ".len();
    let digits: String = text[at..].chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// The peer a data-plane error names, if any.
fn suspect_of(e: &DataPlaneError) -> Option<NodeId> {
    match e {
        DataPlaneError::PeerClosed { peer, .. }
        | DataPlaneError::Timeout { peer, .. }
        | DataPlaneError::PeerAborted { peer, .. } => Some(*peer),
        _ => None,
    }
}

/// Words per state descriptor in the entry allgather: step (2), hash (8), blocks (2).
const DESC_WORDS: usize = 12;

/// A rank's published states (in `KINDS` order) as f32 words for the allgather (bit
/// patterns, never summed); a missing state has step `u64::MAX`.
fn entry_words(r: &RankState) -> [f32; KINDS.len() * DESC_WORDS] {
    let mut w = [0f32; KINDS.len() * DESC_WORDS];
    let none = Desc { step: u64::MAX, hash: [0; 32], blocks: (0, 0) };
    for (i, d) in KINDS.iter().map(|&k| r.desc(k)).enumerate() {
        let d = d.unwrap_or(none);
        let o = i * DESC_WORDS;
        w[o] = f32::from_bits(d.step as u32);
        w[o + 1] = f32::from_bits((d.step >> 32) as u32);
        for (j, c) in d.hash.chunks(4).enumerate() {
            w[o + 2 + j] = f32::from_bits(u32::from_le_bytes(c.try_into().expect("4 bytes")));
        }
        w[o + 10] = f32::from_bits(d.blocks.0 as u32);
        w[o + 11] = f32::from_bits(d.blocks.1 as u32);
    }
    w
}

fn decode_entry(w: &[f32]) -> RankState {
    let desc = |o: usize| {
        let step = u64::from(w[o].to_bits()) | (u64::from(w[o + 1].to_bits()) << 32);
        let mut hash = [0u8; 32];
        for i in 0..8 {
            hash[4 * i..4 * i + 4].copy_from_slice(&w[o + 2 + i].to_bits().to_le_bytes());
        }
        let d = Desc { step, hash, blocks: (w[o + 10].to_bits() as usize, w[o + 11].to_bits() as usize) };
        (step != u64::MAX).then_some(d)
    };
    let none = Desc { step: 0, hash: [0; 32], blocks: (0, 0) };
    let at = |k: usize| desc(k * DESC_WORDS);
    RankState { live: at(0).unwrap_or(none), snaps: [at(1), at(2)], shadows: [at(3), at(4)] }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(step: u64, hash: [u8; 32], blocks: (usize, usize)) -> RankState {
        RankState { live: Desc { step, hash, blocks }, snaps: [None; 2], shadows: [None; 2] }
    }

    fn live(sources: Vec<(usize, Vec<usize>)>) -> Vec<(usize, Src, Vec<usize>)> {
        sources.into_iter().map(|(s, b)| (s, Src::Live, b)).collect()
    }

    #[test]
    fn entry_plan_picks_the_first_rank_at_the_top_and_repairs_divergence() {
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let all = (0, 4);
        // Everyone equal: nobody copies.
        let same = [at(7, a, all), at(7, a, all), at(7, a, all)];
        assert!((0..3).all(|r| entry_plan(&same, r, 0..4, 4).unwrap().action == Entry::Keep));
        // A laggard (it did not apply the step in flight) and a newcomer at step 0 catch up
        // from the first rank at the top.
        let mixed = [at(6, b, all), at(7, a, all), at(0, b, all), at(7, a, all)];
        let p = entry_plan(&mixed, 0, 0..4, 4).unwrap();
        assert_eq!((p.step, p.action, p.sources), (7, Entry::CatchUp, live(vec![(1, vec![0, 1, 2, 3])])));
        assert_eq!(entry_plan(&mixed, 1, 0..4, 4).unwrap().action, Entry::Keep);
        assert_eq!(entry_plan(&mixed, 2, 0..4, 4).unwrap().sources, live(vec![(1, vec![0, 1, 2, 3])]));
        assert_eq!(entry_plan(&mixed, 3, 0..4, 4).unwrap().action, Entry::Keep);
        // Same step, other state: copy and report.
        let diverged = [at(7, a, all), at(7, b, all)];
        let p = entry_plan(&diverged, 1, 0..4, 4).unwrap();
        assert_eq!((p.action, p.sources), (Entry::Repair, live(vec![(0, vec![0, 1, 2, 3])])));
    }

    #[test]
    fn entry_plan_moves_blocks_between_stages() {
        let (a, b, c) = ([1u8; 32], [2u8; 32], [3u8; 32]);
        // Two stages (0..2, 2..4) become plain data parallelism: each rank keeps its own
        // blocks and takes the others from the other stage.
        let two = [at(9, a, (0, 2)), at(9, b, (2, 4))];
        let p = entry_plan(&two, 1, 0..4, 4).unwrap();
        assert_eq!((p.action, p.sources), (Entry::CatchUp, live(vec![(0, vec![0, 1]), (1, vec![2, 3])])));
        // A 2x2 layout lost stage 1 of replica 0; the survivors re-plan to 1x2 with new
        // cuts (0..3, 3..4): the first takes block 2 from the surviving replica of stage 1.
        let survivors = [at(9, a, (0, 2)), at(9, a, (0, 2)), at(9, c, (2, 4))];
        let p = entry_plan(&survivors, 0, 0..3, 4).unwrap();
        assert_eq!(p.sources, live(vec![(0, vec![0, 1]), (2, vec![2])]));
        let p = entry_plan(&survivors, 2, 3..4, 4).unwrap();
        assert_eq!(p.sources, live(vec![(2, vec![3])]));
        // A block whose only holder did not apply the last step, and no snapshot: no way on.
        let stale = [at(9, a, (0, 2)), at(8, b, (2, 4))];
        let e = entry_plan(&stale, 0, 0..4, 4).unwrap_err();
        assert!(e.contains("no rank holds block 2 at step 9"), "{e}");
    }

    #[test]
    fn entry_plan_rolls_back_to_shadowed_snapshots() {
        let (a, b, sa, sb) = ([1u8; 32], [2u8; 32], [3u8; 32], [4u8; 32]);
        let d = |step, hash, blocks| Desc { step, hash, blocks };
        // Stage 0 (blocks 0..2) lost its host at step 23. The stage-1 host kept its own
        // snapshot at step 20 and stage 0's (its shadow); a spare joins with nothing.
        let ranks = [
            RankState {
                live: d(23, b, (2, 4)),
                snaps: [Some(d(20, sb, (2, 4))), None],
                shadows: [Some(d(20, sa, (0, 2))), None],
            },
            RankState { live: d(0, a, (0, 4)), snaps: [None; 2], shadows: [None; 2] },
        ];
        let p = entry_plan(&ranks, 0, 0..2, 4).unwrap();
        assert_eq!((p.step, p.action), (20, Entry::Rollback));
        assert_eq!(p.sources, vec![(0, Src::Shadow(0), vec![0, 1])]);
        let p = entry_plan(&ranks, 1, 2..4, 4).unwrap();
        assert_eq!(p.sources, vec![(0, Src::Snapshot(0), vec![2, 3])]);
        // The host died before its step-30 snapshot reached the neighbour: the neighbour has
        // its own at 30 and 20, the shadow at 20 only. Step 20 is the newest both exist for.
        let late = [RankState {
            live: d(33, b, (2, 4)),
            snaps: [Some(d(30, sb, (2, 4))), Some(d(20, sb, (2, 4)))],
            shadows: [Some(d(20, sa, (0, 2))), None],
        }];
        let p = entry_plan(&late, 0, 0..4, 4).unwrap();
        assert_eq!(
            (p.step, p.sources),
            (20, vec![(0, Src::Shadow(0), vec![0, 1]), (0, Src::Snapshot(1), vec![2, 3])])
        );
        // Without the shadow only the spare's fresh state at step 0 (the job's deterministic
        // initialization) holds every block: the job starts over.
        let bare = [RankState { shadows: [None; 2], ..ranks[0] }, ranks[1]];
        let p = entry_plan(&bare, 0, 0..2, 4).unwrap();
        assert_eq!((p.step, p.sources), (0, vec![(1, Src::Live, vec![0, 1])]));
        // With nobody at step 0 either, there is no way on.
        let none = [RankState { shadows: [None; 2], ..ranks[0] }];
        assert!(entry_plan(&none, 0, 0..2, 4).unwrap_err().contains("no kept snapshot covers the model"));
    }

    #[test]
    fn tensor_names_map_to_blocks_and_errors_to_peers() {
        assert_eq!(block_of("param/b03.qkv.weight"), Some(3));
        assert_eq!(block_of("optim/m/b12.fc.bias"), Some(12));
        assert_eq!(block_of("param/tok"), None);
        assert_eq!(suspect_in("gradient reduce failed: peer 17 closed the connection"), Some(17));
        assert_eq!(suspect_in("no progress (peer 4 silent or dead)"), Some(4));
        assert_eq!(suspect_in("protocol violation"), None);
    }

    #[test]
    fn entry_words_round_trip() {
        let hex = "00ff10203040506070808090a0b0c0d0e0f0112233445566778899aabbccddee";
        let live = Desc { step: 0x1_0000_0007, hash: hash_bytes(hex), blocks: (2, 5) };
        let r =
            RankState { live, snaps: [Some(Desc { step: 5, ..live }), None], shadows: [None, Some(live)] };
        let back = decode_entry(&entry_words(&r));
        assert_eq!(back, r);
        assert_eq!(hex_of(&back.live.hash), hex);
    }
}
