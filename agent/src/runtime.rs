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

use crate::controller::{self, ControllerConfig, NodeProgress};
use crate::dataplane::frame::Channel;
use crate::dataplane::handoff::{serve_handoff, HandoffDialer};
use crate::dataplane::{DataPlaneConfig, DataPlaneError, Endpoint, Group};
use crate::policy::{BaseBatch, BatchPolicy};
use crate::report::{AgentReport, Broken, Phase, Transition, MAX_TRANSITIONS, REPORT_VERSION};
use crate::revocation::{Source, Watcher};
use crate::stage::StageConnections;
use limpet_consensus::state::{
    cluster_id, ClusterState, Command, Epoch, Hardware, MemberSpec, MemberStatus, NodeId,
};
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
use std::sync::atomic::AtomicBool;
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
}

/// An agent's pipeline settings. The node that sets the job profiles the model and records
/// the profile with these in the job, so every leader plans from the same numbers.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineSettings {
    /// Stages per replica, or `None` for the planner's choice.
    pub depth: Option<usize>,
    /// Memory training may use on each host, bytes.
    pub mem_bytes: u64,
    /// The network between hosts.
    pub link: crate::planner::Link,
}

impl AgentConfig {
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
            policy: BatchPolicy::FixedGlobal,
            base_world: 1,
            min_nodes: 1,
            sources: Vec::new(),
            poll: Duration::from_secs(2),
            heartbeat: Duration::from_millis(100),
            heartbeat_timeout: Duration::from_millis(1000),
            dp_timeout: Duration::from_secs(3),
            tick: Duration::from_millis(50),
            step_log: None,
            lead: Duration::from_millis(400),
            notice_margin: Duration::from_millis(1000),
            pipeline: None,
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
        let endpoint = Arc::new(Endpoint::bind(cfg.data, dp)?);
        let data_addr = endpoint.addr();
        let server = Server::new();
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
        ncfg.hardware = Hardware {
            instance_type: "local".into(),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
            gpus: 0,
            memory_mib: 0,
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

        let fresh = Trainer::try_new(cfg.job.clone(), data)?;
        let looper = TrainLoop {
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
            let (addr, report, clients, cluster, me) = (
                m.spec.control_addr.clone(),
                report.clone(),
                Arc::clone(&clients),
                cfg.cluster.clone(),
                cfg.id,
            );
            let budget = cfg.heartbeat.max(Duration::from_millis(200));
            tokio::spawn(async move {
                let send = async {
                    let cached = clients.lock().await.get(&addr).cloned();
                    let mut c = match cached {
                        Some(c) => c,
                        None => {
                            let c = Client::connect(&addr, &cluster).await?;
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
    let mut last_reason = String::new();
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
        let commands = plan_commands(&cfg, &local, &reports, &mut last_reason);
        for cmd in commands {
            if let Err(e) = handle.propose(cmd.clone(), Some(Duration::from_secs(2))).await {
                tracing::warn!(%e, ?cmd, "proposal failed");
                break;
            }
        }
    }
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
        let pj =
            crate::planner::PipelineJob { profile, link: p.link, depth: p.depth, mem_bytes: p.mem_bytes };
        doc["pipeline"] = serde_json::to_value(pj)?;
    }
    Ok(doc)
}

/// The leader's decisions for one round (pure apart from logging).
fn plan_commands(
    cfg: &AgentConfig,
    local: &LocalState,
    reports: &BTreeMap<NodeId, (u64, AgentReport)>,
    last_reason: &mut String,
) -> Vec<Command> {
    let st: &ClusterState = &local.state;
    let timeout_ms = cfg.heartbeat_timeout.as_millis() as u64;
    let cur_id = st.current.as_ref().map_or(0, |e| e.id);
    let mut progress: BTreeMap<NodeId, NodeProgress> = reports
        .iter()
        .map(|(&id, (age, r))| (id, NodeProgress { applied_step: r.applied_step, heartbeat_age_ms: *age }))
        .collect();
    // A live rank whose collective broke names the peer; if that peer has also gone quiet
    // for a few heartbeats, it is dead: no need to wait out the whole timeout.
    let quiet = (cfg.heartbeat.as_millis() as u64 * 3).max(300);
    for (_, r) in reports.values().filter(|(age, _)| *age <= timeout_ms) {
        if let Some(b) = r.broken.as_ref().filter(|b| b.epoch == cur_id) {
            if let Some(p) = b.suspect.and_then(|s| progress.get_mut(&s)) {
                if p.heartbeat_age_ms > quiet {
                    p.heartbeat_age_ms = u64::MAX;
                }
            }
        }
    }
    let step_time_ms = reports
        .values()
        .filter(|(age, _)| *age <= timeout_ms)
        .map(|(_, r)| r.step_time_ms)
        .fold(0.0f64, f64::max);
    let lead_steps = if step_time_ms > 0.0 {
        ((cfg.lead.as_millis() as f64 / step_time_ms).ceil() as u64).clamp(2, 100_000)
    } else {
        5
    };
    // A group can also break with every node alive (a transient network fault): once a
    // rank has waited on a broken group longer than the failure timeout, rebuild it.
    let rebuild = reports.values().any(|(age, r)| {
        *age <= timeout_ms && r.broken.as_ref().is_some_and(|b| b.epoch == cur_id && b.since_ms > timeout_ms)
    });
    let ccfg = ControllerConfig {
        min_nodes: cfg.min_nodes,
        heartbeat_timeout_ms: timeout_ms,
        lead_steps,
        notice_margin_ms: cfg.notice_margin.as_millis() as u64,
        policy: cfg.policy,
        base: BaseBatch {
            global_batch: cfg.job.global_batch as u64,
            micro_batch: cfg.job.micro_batch as u64,
            world: cfg.base_world.max(1),
        },
    };
    let view = controller::View {
        state: st,
        now_ms: now_ms(),
        progress: &progress,
        step_time_ms,
        grad_stats: current_grad_stats(st, reports, timeout_ms),
        rebuild,
    };
    let decision = controller::decide(&view, &ccfg);
    if decision.reason != *last_reason {
        tracing::info!(reason = %decision.reason, "controller");
        *last_reason = decision.reason.clone();
    }
    let mut commands = decision.commands;
    // A scheduled epoch that one of its ranks entered becomes the current one.
    if let Some(s) = &st.scheduled {
        let entered = reports.values().any(|(_, r)| r.epoch == s.id && s.ranks.contains(&r.node));
        if entered
            && !commands
                .iter()
                .any(|c| matches!(c, Command::ScheduleEpoch { .. } | Command::CancelEpoch { .. }))
        {
            commands.push(Command::ActivateEpoch { id: s.id });
        }
    }
    // A joining member that trains in the current epoch is active.
    for (id, m) in &st.members {
        if m.status == MemberStatus::Joining
            && reports.get(id).is_some_and(|(_, r)| r.epoch == cur_id && cur_id > 0)
        {
            commands.push(Command::Activate { id: *id });
        }
    }
    commands
}

/// Gradient statistics reported by a live rank of the current epoch (all ranks compute the
/// same values).
fn current_grad_stats(
    st: &ClusterState,
    reports: &BTreeMap<NodeId, (u64, AgentReport)>,
    timeout_ms: u64,
) -> Option<crate::policy::GradientStats> {
    let cur = st.current.as_ref()?;
    cur.ranks.iter().find_map(|r| {
        let (age, rep) = reports.get(r)?;
        let (variance, mean_sq) = rep.grad_stats.filter(|_| *age <= timeout_ms && rep.epoch == cur.id)?;
        Some(crate::policy::GradientStats { variance, mean_sq })
    })
}

/// The trainer thread's state.
struct TrainLoop {
    cfg: Arc<AgentConfig>,
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
    right: Option<std::net::TcpStream>,
    left: Option<std::net::TcpStream>,
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
                // A removed node stays until the log no longer counts it as a voter: leaving
                // earlier could take the voters below a majority.
                if m.status == MemberStatus::Gone && self.group.is_none() && !st.voters.contains(&me) {
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
                let mut buf = self.trainer.compute_grads(g.rank(), g.world()).map_err(|e| e.to_string())?;
                match g.allreduce_sum(&mut buf, step) {
                    Ok(()) => Ok(self.trainer.apply_update(&mut buf).map_err(|e| e.to_string())?),
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
        // AdaScale's statistics are over data-parallel replicas, not pipeline stages.
        self.observe_gradients(&stats, epoch.layout.data as usize);
        {
            let mut p = self.progress.lock().expect("progress lock");
            p.grad_stats = self.grad_stats;
            p.loss = Some(stats.loss);
            p.samples_per_s = stats.samples as f64 / (self.step_time_ms / 1e3).max(1e-9);
        }
        self.set_phase(Phase::Training);
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

        // Publish this rank's state, then agree on (step, blocks held, hash).
        let image = self.trainer.image().map_err(|e| e.to_string())?;
        let hash = image.content_hash().to_string();
        let encoded = image.encode().map_err(|e| e.to_string())?;
        self.server.offer(Offer::new(encoded, 1 << 20, label_of(&hash)));
        let held = self.trainer.model().blocks();
        let mine = entry_words(self.trainer.step(), &hash, held.clone());
        let mut all = vec![0f32; mine.len() * n.ranks.len()];
        group.allgather(&mine, &mut all, ENTRY_STEP).map_err(|e| e.to_string())?;
        let ranks: Vec<RankState> = all.chunks(mine.len()).map(decode_entry).collect();
        let me_idx = group.rank();
        let stages = n.layout.stage_blocks(self.cfg.job.model.num_blocks())?;
        let target = stages[me_idx % stages.len()].clone();
        let plan = entry_plan(&ranks, me_idx, target.clone())?;
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
            for (src, blocks) in &plan.sources {
                let fetched;
                let img = if *src == me_idx {
                    &image
                } else {
                    let src_node = n.ranks[*src];
                    let source = format!("{src_node}@{}", addrs[*src]);
                    let hex: String = ranks[*src].hash.iter().map(|b| format!("{b:02x}")).collect();
                    let opts = FetchOptions { expect: Some(label_of(&hex)), ..FetchOptions::default() };
                    let dialer = HandoffDialer { endpoint: &self.endpoint, epoch: n.id };
                    let (bytes, stats) = fetch(&dialer, &[source], &opts).map_err(|e| e.to_string())?;
                    fetched_bytes += stats.bytes;
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
                self.trainer = Trainer::for_stage(
                    self.cfg.job.clone(),
                    self.trainer.data().shallow_clone(),
                    target.clone(),
                )
                .map_err(|e| e.to_string())?;
            }
            self.trainer.load_image(&merged).map_err(|e| e.to_string())?;
            fetch_ms = fetch_started.elapsed().as_millis() as u64;
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
        };
        tracing::info!(node = me, epoch = n.id, step = t.step, world = n.ranks.len(), idle_ms, cause = %n.cause, "entered epoch");
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
}

/// One rank's state as the entry protocol publishes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RankState {
    /// Steps applied.
    step: u64,
    /// Content hash of its state.
    hash: [u8; 32],
    /// The blocks it holds.
    blocks: (usize, usize),
}

impl RankState {
    fn holds(&self, block: usize) -> bool {
        (self.blocks.0..self.blocks.1).contains(&block)
    }
}

/// How a rank enters: the step everyone starts at, what it does, and for each source rank
/// the blocks it takes from it (itself included, for blocks it already holds).
#[derive(Clone, Debug, PartialEq, Eq)]
struct EntryPlan {
    step: u64,
    action: Entry,
    sources: Vec<(usize, Vec<usize>)>,
}

/// From every rank's published state (in rank order), how rank `me`, which trains blocks
/// `target` in the epoch, enters. The epoch starts at the highest step any rank applied.
/// The *reference* is the first rank at that step holding exactly `target`: a rank that
/// holds the same blocks at the same step must match its hash or repair from it. Otherwise
/// each block comes from this rank itself if it holds it at the top step, else from the
/// reference, else from the first rank at the top step that holds it. A block nobody holds
/// at the top step is an error: there is no live replica to copy.
fn entry_plan(ranks: &[RankState], me: usize, target: Range<usize>) -> Result<EntryPlan, String> {
    let top = ranks.iter().map(|r| r.step).max().unwrap_or(0);
    let want = (target.start, target.end);
    let reference = ranks.iter().position(|r| r.step == top && r.blocks == want);
    let mine = ranks[me];
    if mine.step == top && mine.blocks == want {
        let r = reference.expect("this rank qualifies");
        if ranks[r].hash == mine.hash {
            return Ok(EntryPlan { step: top, action: Entry::Keep, sources: Vec::new() });
        }
        return Ok(EntryPlan { step: top, action: Entry::Repair, sources: vec![(r, target.collect())] });
    }
    let mut sources: Vec<(usize, Vec<usize>)> = Vec::new();
    for k in target {
        let src = if mine.step == top && mine.holds(k) {
            me
        } else if let Some(r) = reference {
            r
        } else {
            ranks.iter().position(|r| r.step == top && r.holds(k)).ok_or_else(|| {
                format!("no rank holds block {k} at step {top}: no live replica to copy it from")
            })?
        };
        match sources.iter_mut().find(|(s, _)| *s == src) {
            Some((_, blocks)) => blocks.push(k),
            None => sources.push((src, vec![k])),
        }
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

/// (step, 32-byte hash, blocks held) as twelve f32 words for the allgather (bit patterns,
/// never summed).
fn entry_words(step: u64, hash_hex: &str, blocks: Range<usize>) -> [f32; 12] {
    let mut w = [0f32; 12];
    w[0] = f32::from_bits(step as u32);
    w[1] = f32::from_bits((step >> 32) as u32);
    let bytes: Vec<u8> = (0..32)
        .map(|i| u8::from_str_radix(hash_hex.get(2 * i..2 * i + 2).unwrap_or("00"), 16).unwrap_or(0))
        .collect();
    for (i, c) in bytes.chunks(4).enumerate() {
        w[2 + i] = f32::from_bits(u32::from_le_bytes(c.try_into().expect("4 bytes")));
    }
    w[10] = f32::from_bits(blocks.start as u32);
    w[11] = f32::from_bits(blocks.end as u32);
    w
}

fn decode_entry(w: &[f32]) -> RankState {
    let step = u64::from(w[0].to_bits()) | (u64::from(w[1].to_bits()) << 32);
    let mut hash = [0u8; 32];
    for i in 0..8 {
        hash[4 * i..4 * i + 4].copy_from_slice(&w[2 + i].to_bits().to_le_bytes());
    }
    RankState { step, hash, blocks: (w[10].to_bits() as usize, w[11].to_bits() as usize) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(step: u64, hash: [u8; 32], blocks: (usize, usize)) -> RankState {
        RankState { step, hash, blocks }
    }

    #[test]
    fn entry_plan_picks_the_first_rank_at_the_top_and_repairs_divergence() {
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let all = (0, 4);
        // Everyone equal: nobody copies.
        let same = [at(7, a, all), at(7, a, all), at(7, a, all)];
        assert!((0..3).all(|r| entry_plan(&same, r, 0..4).unwrap().action == Entry::Keep));
        // A laggard (it did not apply the step in flight) and a newcomer at step 0 catch up
        // from the first rank at the top.
        let mixed = [at(6, b, all), at(7, a, all), at(0, b, all), at(7, a, all)];
        let p = entry_plan(&mixed, 0, 0..4).unwrap();
        assert_eq!((p.step, p.action, p.sources), (7, Entry::CatchUp, vec![(1, vec![0, 1, 2, 3])]));
        assert_eq!(entry_plan(&mixed, 1, 0..4).unwrap().action, Entry::Keep);
        assert_eq!(entry_plan(&mixed, 2, 0..4).unwrap().sources, vec![(1, vec![0, 1, 2, 3])]);
        assert_eq!(entry_plan(&mixed, 3, 0..4).unwrap().action, Entry::Keep);
        // Same step, other state: copy and report.
        let diverged = [at(7, a, all), at(7, b, all)];
        let p = entry_plan(&diverged, 1, 0..4).unwrap();
        assert_eq!((p.action, p.sources), (Entry::Repair, vec![(0, vec![0, 1, 2, 3])]));
    }

    #[test]
    fn entry_plan_moves_blocks_between_stages() {
        let (a, b, c) = ([1u8; 32], [2u8; 32], [3u8; 32]);
        // Two stages (0..2, 2..4) become plain data parallelism: each rank keeps its own
        // blocks and takes the others from the other stage.
        let two = [at(9, a, (0, 2)), at(9, b, (2, 4))];
        let p = entry_plan(&two, 1, 0..4).unwrap();
        assert_eq!((p.action, p.sources), (Entry::CatchUp, vec![(0, vec![0, 1]), (1, vec![2, 3])]));
        // A 2x2 layout lost stage 1 of replica 0; the survivors re-plan to 1x2 with new
        // cuts (0..3, 3..4): the first takes block 2 from the surviving replica of stage 1.
        let survivors = [at(9, a, (0, 2)), at(9, a, (0, 2)), at(9, c, (2, 4))];
        let p = entry_plan(&survivors, 0, 0..3).unwrap();
        assert_eq!(p.sources, vec![(0, vec![0, 1]), (2, vec![2])]);
        let p = entry_plan(&survivors, 2, 3..4).unwrap();
        assert_eq!(p.sources, vec![(2, vec![3])]);
        // A block whose only holder did not apply the last step cannot be copied.
        let stale = [at(9, a, (0, 2)), at(8, b, (2, 4))];
        let e = entry_plan(&stale, 0, 0..4).unwrap_err();
        assert!(e.contains("no rank holds block 2 at step 9"), "{e}");
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
        let r = decode_entry(&entry_words(0x1_0000_0007, hex, 2..5));
        assert_eq!((r.step, r.blocks), (0x1_0000_0007, (2, 5)));
        let back: String = r.hash.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(back, hex);
    }
}
