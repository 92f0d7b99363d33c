//! The running agent: one host's consensus node, data-plane endpoint, trainer thread,
//! heartbeats, revocation watchers and (while it leads) the reconfiguration controller.
//!
//! Rooms, one per concern:
//! - `config`: what the agent runs by;
//! - `tasks`: the one shutdown path (root token, tracked tasks and threads, panics fatal);
//! - `error`: what can go wrong, fatal kept apart from transient;
//! - this module: start (wiring) and wait (the bounded stop);
//! - one module per task: `announce`, `heartbeats`, `revocations`, `lead`;
//! - `train_loop`: the trainer thread, deciding with the pure `next_action`;
//! - `entry`: entering an epoch (its plan and wire codec are `limpet_decide::entry`);
//! - `checkpointer` and `shadows`: the state copies a step leaves behind;
//! - `synthetic`: the control part with a training loop that needs no libtorch (the lab's
//!   agents by the hundred).
//!
//! The control part (`start_control`, the tasks, `entry`'s protocol steps) builds without
//! the `trainer` feature; the trainer loop and what it steps with need it.

mod announce;
#[cfg(feature = "trainer")]
mod checkpointer;
mod config;
mod drill;
pub(crate) mod entry;
pub mod error;
mod heartbeats;
mod lead;
#[cfg(feature = "trainer")]
mod local_ranks;
#[cfg(feature = "trainer")]
mod one_step;
mod revocations;
#[cfg(feature = "trainer")]
mod shadows;
#[cfg(feature = "trainer")]
mod sharding;
pub mod synthetic;
pub mod tasks;
#[cfg(feature = "trainer")]
pub mod train_loop;

#[cfg(feature = "trainer")]
pub use config::AgentConfig;
pub use config::{CheckpointSettings, ControlConfig, PipelineSettings, Resume, Stages, Timing};
pub use drill::Slowdown;
pub use error::{AgentError, Fatal, Retryable};
pub use lead::LeadJob;
pub use tasks::Tasks;

use crate::dataplane::handoff::handoff_loop;
use crate::dataplane::{DataPlaneConfig, Endpoint};
use crate::report::{AgentReport, Phase};
use limpet_consensus::state::{cluster_id, Hardware, MemberSpec, MemberStatus, NodeId};
use limpet_consensus::{NodeConfig, NodeHandle};
use limpet_snapshot::handoff::Server;
#[cfg(feature = "trainer")]
use limpet_trainer::{data::Dataset, Trainer, TrainerError};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

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
    /// World size of the epoch, in hosts.
    pub world: usize,
    /// This host's rank in it.
    pub rank: usize,
    /// The epoch's ranks counted per device, when some node trains with several
    /// (`[node].devices`); absent otherwise (then `world`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub devices: usize,
    /// The node's Raft id.
    pub node: NodeId,
    /// The node's name (what the CLI, status and configurations call it).
    #[serde(default)]
    pub name: String,
    /// Global mean loss of the step.
    pub loss: f64,
    /// A reproducible step that agreed its exponents (`StepStats::agreed`); absent when not.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub agreed: bool,
    /// The held-out loss after this step, when the job evaluated (`eval_every`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    /// A step of a model of several buckets reduced while backward runs (`[during, handed]`):
    /// of the buckets its backward handed over (on this host's first device), how many while
    /// the reducing thread was summing an earlier one (0: none overlapped). Absent for steps
    /// reduced after backward, and for models of one bucket.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlap: Option<[usize; 2]>,
    /// On a rank's first step after an entry that took its state back (it was newer than the
    /// survivors' agreed step, or a stage or a shard went back to a snapshot or a
    /// checkpoint): `[from, to]`, the steps `from..to` it had applied and trains again, out
    /// of the old lineage. Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub went_back: Option<[u64; 2]>,
}

fn is_zero(v: &usize) -> bool {
    *v == 0
}

/// A running agent.
#[cfg(feature = "trainer")]
pub struct Agent {
    handle: NodeHandle,
    tasks: Tasks,
    trainer: std::thread::JoinHandle<Result<Exit, AgentError>>,
    control_addr: SocketAddr,
    data_addr: SocketAddr,
    id: NodeId,
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

#[cfg(feature = "trainer")]
impl Agent {
    /// Starts every part of the agent under a root token of its own. Needs a multi-threaded
    /// tokio runtime.
    pub async fn start(cfg: AgentConfig) -> Result<Agent, AgentError> {
        Agent::start_with(cfg, Tasks::new(CancellationToken::new())).await
    }

    /// Starts every part of the agent as tasks of `tasks` (whose root token stops it).
    pub async fn start_with(cfg: AgentConfig, tasks: Tasks) -> Result<Agent, AgentError> {
        let data = Dataset::load(&cfg.job.data, cfg.data_path.as_deref())?;
        cfg.job.validate(&data)?;
        let mut models = limpet_trainer::device::gpu_models();
        models.dedup();
        let hardware = Hardware {
            gpus: limpet_trainer::device::gpu_count() as u32,
            gpu_model: models.join(", "),
            ranks: cfg.devices.len().max(1) as u32,
            device: if on_gpu(&cfg) { "cuda" } else { "cpu" }.into(),
            ..host_hardware(&cfg.ctl)
        };
        let cfg = Arc::new(cfg);
        let control = Arc::new(cfg.ctl.clone());
        let job: Arc<dyn LeadJob> = Arc::clone(&cfg) as Arc<dyn LeadJob>;
        let Control { handle, endpoint, server, progress, beat_now, stop_serving, control_addr, data_addr } =
            start_control(control, hardware, job, &tasks).await?;

        let device = match cfg.devices.first() {
            Some(&d) => d,
            None => cfg
                .device
                .resolve()
                .map_err(|e| TrainerError::Key { key: "[job].device".into(), detail: e.to_string() })?,
        };
        tracing::info!(device = ?device, choice = ?cfg.device, local_ranks = cfg.devices.len().max(1), gpus = ?limpet_trainer::device::gpu_models(), "training device");
        if cfg.pipeline.is_some() {
            // This host's speed for the pipeline planner: the job's blocks profiled here, as
            // the founding leader profiled them for the job; beside training's start.
            let (cfg, progress) = (Arc::clone(&cfg), Arc::clone(&progress));
            tasks.spawn("profile", async move {
                let run = tokio::task::spawn_blocking(move || -> Result<f64, TrainerError> {
                    let data = Dataset::load(&cfg.job.data, cfg.data_path.as_deref())?;
                    profile_here(&cfg, &data)
                })
                .await;
                match run {
                    Ok(Ok(ms)) => progress.lock().expect("progress lock").profile_ms = ms,
                    Ok(Err(e)) => tracing::warn!(error = %e, "could not profile the model on this host: the planner takes it for the profiled one"),
                    Err(e) => tracing::warn!(error = %e, "the profile of the model on this host failed"),
                }
            });
        }
        let blocks = 0..cfg.job.model.num_blocks();
        // The host's other devices: a trainer each, which copies the first one's state
        // (and, in a pipeline, takes its stage's blocks) before it first trains.
        let mut followers = Vec::new();
        // A pipelined epoch never counts more than MAX_PIPELINE_LOCAL_RANKS a host: the
        // devices past them would only hold memory.
        let most = match cfg.pipeline {
            Some(_) => limpet_consensus::state::MAX_PIPELINE_LOCAL_RANKS as usize,
            None => usize::MAX,
        };
        for &d in cfg.devices.iter().skip(1).take(most.saturating_sub(1)) {
            followers.push(Trainer::on_device(cfg.job.clone(), data.shallow_clone(), blocks.clone(), d)?);
        }
        let mut fresh = Trainer::on_device(cfg.job.clone(), data, blocks, device)?;
        if let Some(dir) = &cfg.init_from {
            fresh.init_from_hf(dir)?;
        }
        let id = cfg.id;
        let looper = train_loop::TrainLoop::new(
            cfg,
            handle.clone(),
            endpoint,
            server,
            progress,
            beat_now,
            tasks.clone(),
            fresh,
            followers,
        );
        let trainer = spawn_training("limpet-trainer", move || looper.run(), stop_serving)?;
        Ok(Agent { handle, tasks, trainer, control_addr, data_addr, id })
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
        self.tasks.token()
    }

    /// Asks the cluster to let this node go (SIGTERM from systemd): it leaves at the next
    /// epoch boundary and is removed; `wait` then returns `Exit::Removed`.
    pub async fn drain_self(&self, reason: &str) -> Result<(), AgentError> {
        let cmd = limpet_consensus::state::Command::Drain { id: self.id, reason: reason.to_string() };
        self.handle.propose(cmd, Some(Duration::from_secs(5))).await?;
        Ok(())
    }

    /// Waits until the trainer thread ends (removed, stopped, or stopped by a fatal failure
    /// elsewhere), then stops every task. Once the root token is cancelled, everything has
    /// [`tasks::SHUTDOWN_LIMIT`] to end; a fatal failure is this call's error.
    pub async fn wait(self) -> Result<Exit, AgentError> {
        let Agent { trainer, tasks, .. } = self;
        wait_for(trainer, tasks).await
    }
}

/// Waits until `trainer` (the thread that trains) ends, then stops every task of `tasks`.
/// Once the root token is cancelled, everything has [`tasks::SHUTDOWN_LIMIT`] to end; a fatal
/// failure is this call's error.
async fn wait_for(
    trainer: std::thread::JoinHandle<Result<Exit, AgentError>>,
    tasks: Tasks,
) -> Result<Exit, AgentError> {
    let root = tasks.token();
    let mut joined = tokio::task::spawn_blocking(move || trainer.join());
    let deadline = tokio::select! {
        r = &mut joined => {
            let deadline = tokio::time::Instant::now() + tasks::SHUTDOWN_LIMIT;
            return finish(&tasks, deadline, r).await;
        }
        _ = root.cancelled() => tokio::time::Instant::now() + tasks::SHUTDOWN_LIMIT,
    };
    match tokio::time::timeout_at(deadline, joined).await {
        Ok(r) => finish(&tasks, deadline, r).await,
        Err(_) => {
            let _ = tasks.shutdown(deadline).await;
            Err(AgentError::from(Fatal::Stuck { limit: tasks::SHUTDOWN_LIMIT, after: tasks.fatal() }))
        }
    }
}

/// Starts the thread that trains (`run`, the trainer loop or the synthetic one) as `name`;
/// the handoff server stops serving when it ends.
fn spawn_training(
    name: &str,
    run: impl FnOnce() -> Result<Exit, AgentError> + Send + 'static,
    stop_serving: CancellationToken,
) -> Result<std::thread::JoinHandle<Result<Exit, AgentError>>, AgentError> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let r = run();
            stop_serving.cancel();
            r
        })
        .map_err(|source| AgentError::io(format!("starting the {name} thread"), source))
}

/// A failed collective: when, the peer it names, the error, whether it broke the protocol.
struct BrokenAt {
    at: std::time::Instant,
    suspect: Option<NodeId>,
    error: String,
    violation: bool,
}

impl BrokenAt {
    /// It as a report says it, for the group of `epoch`.
    fn report(&self, epoch: u64) -> crate::report::Broken {
        crate::report::Broken {
            epoch,
            since_ms: self.at.elapsed().as_millis() as u64,
            suspect: self.suspect,
            error: self.error.clone(),
            violation: self.violation,
        }
    }
}

/// The agent's control part, running: its data plane (with the state handoff server), its
/// consensus node, and the tasks that keep it a member (announce, heartbeats, revocation
/// watchers, the leader loop). What trains (the trainer loop, or the lab's synthetic one)
/// runs beside it and reports through `progress`.
pub struct Control {
    /// The consensus node.
    pub handle: NodeHandle,
    /// The data-plane endpoint.
    pub endpoint: Arc<Endpoint>,
    /// The states this node offers its peers.
    pub server: Server,
    /// This node's report, which the heartbeats send.
    pub progress: Arc<Mutex<AgentReport>>,
    /// Asks the heartbeats to send the report at once.
    pub beat_now: Arc<Notify>,
    /// Ends the handoff server (when training ends).
    pub stop_serving: CancellationToken,
    /// The consensus node's bound address.
    pub control_addr: SocketAddr,
    /// The data plane's bound address.
    pub data_addr: SocketAddr,
}

/// Starts the control part of an agent as tasks of `tasks`: a node of `hardware` training
/// `job`. Needs a multi-threaded tokio runtime.
pub async fn start_control(
    cfg: Arc<ControlConfig>,
    hardware: Hardware,
    job: Arc<dyn LeadJob>,
    tasks: &Tasks,
) -> Result<Control, AgentError> {
    let endpoint = Arc::new(bind_data_plane(&cfg, tasks)?);
    let data_addr = endpoint.addr();
    // Offers: the entry state, this rank's snapshot and the neighbour's it keeps, and
    // their predecessors while receivers finish.
    let server = Server::with_capacity(6);
    // Serving ends with the trainer (which cancels this) or with everything (the root).
    let stop_serving = tasks.token().child_token();
    let (serving, offers, stopped) = (Arc::clone(&endpoint), server.clone(), stop_serving.clone());
    let stop = move || stopped.is_cancelled();
    let spawner = tasks.clone();
    // Each request's transfer may outlast a stop (a slow reader): not waited for, but a
    // panic in one is fatal like anywhere else.
    let spawn = move |name: &'static str, f: Box<dyn FnOnce() + Send>| spawner.spawn_detached_thread(name, f);
    // Who may fetch state: the log's current members (not failed, not gone), filled in
    // once the node runs; nobody before.
    let fetchers: Arc<std::sync::RwLock<std::collections::BTreeSet<u64>>> = Arc::default();
    let admits = Arc::clone(&fetchers);
    let may_fetch: crate::dataplane::handoff::MayFetch =
        Arc::new(move |peer| admits.read().expect("fetchers lock").contains(&peer));
    tasks
        .spawn_thread("handoff", move || handoff_loop(&serving, &offers, &stop, &may_fetch, &spawn))
        .map_err(|source| AgentError::io("starting the handoff thread", source))?;

    let ncfg = node_config(&cfg, data_addr, hardware);
    let node = limpet_consensus::Node::start(ncfg.clone(), tasks).await?;
    let handle = node.handle();
    let control_addr = node.addr();
    let watcher = tasks.clone();
    tasks.spawn("consensus", async move {
        if let Err(e) = node.wait().await {
            watcher.fail("consensus", &e.to_string());
        }
    });
    let mut applied = handle.watch();
    let done = tasks.token();
    // The data plane refuses the certificates the log revokes, as the log says.
    let revoking = Arc::clone(&endpoint);
    tasks.spawn("handoff-members", async move {
        loop {
            let members: std::collections::BTreeSet<u64> = applied
                .borrow_and_update()
                .state
                .members
                .values()
                .filter(|m| !matches!(m.status, MemberStatus::Failed | MemberStatus::Gone))
                .map(|m| m.spec.id)
                .collect();
            *fetchers.write().expect("fetchers lock") = members;
            revoking.set_revoked(applied.borrow().state.revoked.0.keys().cloned().collect());
            tokio::select! {
                changed = applied.changed() => if changed.is_err() { return },
                () = done.cancelled() => return,
            }
        }
    });
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
    let progress = Arc::new(Mutex::new(AgentReport::new(cfg.id, std::process::id(), Phase::Starting)));
    let beat_now = Arc::new(Notify::new());
    spawn_tasks(tasks, (&cfg, job), &handle, me, (&progress, &endpoint), &beat_now);
    Ok(Control { handle, endpoint, server, progress, beat_now, stop_serving, control_addr, data_addr })
}

/// The data-plane endpoint the configuration describes (TLS when the cluster has
/// certificates and does not opt out).
fn bind_data_plane(cfg: &ControlConfig, tasks: &Tasks) -> Result<Endpoint, AgentError> {
    let mut dp = DataPlaneConfig::new(cluster_id(&cfg.cluster), cfg.id, cfg.secret.to_vec());
    dp.timeout = cfg.timing.data_timeout();
    dp.congestion = cfg.dp_congestion.clone();
    if let (Some(tls), true) = (&cfg.tls, cfg.tls_data) {
        dp.tls = Some(crate::dataplane::DataTls::from_tls(tls)?);
    }
    Ok(Endpoint::bind_with(cfg.data, dp, Arc::new(tasks.clone()))?)
}

/// Starts the agent's background tasks: announce, heartbeats, the leader loop and one
/// watcher per revocation source.
fn spawn_tasks(
    tasks: &Tasks,
    (cfg, job): (&Arc<ControlConfig>, Arc<dyn LeadJob>),
    handle: &NodeHandle,
    me: MemberSpec,
    (progress, endpoint): (&Arc<Mutex<AgentReport>>, &Arc<Endpoint>),
    beat_now: &Arc<Notify>,
) {
    let stop = tasks.token();
    tasks.spawn("announce", announce::announce(handle.clone(), me, stop.clone()));
    let beats = heartbeats::heartbeats(
        Arc::clone(cfg),
        handle.clone(),
        (Arc::clone(progress), Arc::clone(endpoint)),
        Arc::clone(beat_now),
        tasks.clone(),
    );
    tasks.spawn("heartbeats", beats);
    tasks.spawn("lead", lead::lead(Arc::clone(cfg), job, handle.clone(), stop.clone()));
    for source in &cfg.sources {
        let report = (Arc::clone(progress), Arc::clone(beat_now));
        let watch = revocations::watch_revocations(
            cfg.id,
            source.clone(),
            cfg.poll,
            handle.clone(),
            report,
            stop.clone(),
        );
        tasks.spawn("revocations", watch);
    }
}

/// Stops the remaining tasks once the trainer thread ended with `r`.
async fn finish(
    tasks: &Tasks,
    deadline: tokio::time::Instant,
    r: Result<std::thread::Result<Result<Exit, AgentError>>, tokio::task::JoinError>,
) -> Result<Exit, AgentError> {
    let exit = match r {
        Ok(Ok(r)) => r,
        Ok(Err(panic)) => {
            let text = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            tasks.fail("trainer", &format!("panicked: {text}"));
            return Err(tasks.fatal().expect("just recorded").into());
        }
        // The runtime went away under the join (it is shutting down): the thread's end is
        // unknown.
        Err(e) => {
            tasks.fail("trainer", &format!("its join failed: {e}"));
            return Err(tasks.fatal().expect("just recorded").into());
        }
    };
    if let Err(e) = tasks.shutdown(deadline).await {
        tracing::warn!(%e, "stopping the agent's tasks");
    }
    if let Some(f) = tasks.fatal() {
        return Err(f.into());
    }
    exit
}

/// The consensus node's configuration for this agent, on a host of `hardware`.
fn node_config(cfg: &ControlConfig, data_addr: SocketAddr, hardware: Hardware) -> NodeConfig {
    let mut ncfg = NodeConfig::new(cfg.id, &cfg.cluster, &cfg.name, cfg.control, cfg.state_dir.clone());
    ncfg.advertise = cfg.advertise_control.clone();
    ncfg.data_addr =
        if cfg.advertise_data.is_empty() { data_addr.to_string() } else { cfg.advertise_data.clone() };
    ncfg.tick = cfg.timing.raft_tick();
    ncfg.bootstrap = cfg.bootstrap.clone();
    ncfg.seeds = cfg.seeds.clone();
    ncfg.core.voters.max_voters = cfg.max_voters;
    ncfg.request_timeout = Duration::from_secs(3);
    ncfg.tls = cfg.tls.clone();
    ncfg.hardware = hardware;
    ncfg
}

/// This host as its record describes it, before its devices: one rank on the CPU.
pub fn host_hardware(cfg: &ControlConfig) -> Hardware {
    Hardware {
        instance_type: "local".into(),
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
        gpus: 0,
        gpu_model: String::new(),
        memory_mib: host_memory_mib(),
        samples_per_sec_milli: 0,
        speed_milli: 0,
        ranks: 1,
        device: "cpu".into(),
        zone: cfg.zone.clone(),
        butterfly: true,
        refused_reports: true,
        zone_levels: cfg.zone_levels,
    }
}

/// Whether this host's ranks train on GPUs.
#[cfg(feature = "trainer")]
fn on_gpu(cfg: &AgentConfig) -> bool {
    cfg.training_device() != limpet_trainer::device::Device::Cpu
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

/// Milliseconds one forward and backward of every block of the job's model takes on this
/// host at the job's micro-batch (a straggler drill's factor included).
#[cfg(feature = "trainer")]
fn profile_here(cfg: &AgentConfig, data: &limpet_trainer::data::Dataset) -> Result<f64, TrainerError> {
    let profile = crate::stage::profile_model(&cfg.job, data, 3, cfg.training_device())?;
    let ms: f64 = profile.blocks.iter().map(|b| b.fwd_ms + b.bwd_ms).sum();
    let took = cfg.slowdown.stretch(std::time::Duration::from_secs_f64(ms / 1e3));
    tracing::info!(
        ms = took.as_secs_f64() * 1e3,
        "this host's profile of the model (its speed for the pipeline planner)"
    );
    Ok(took.as_secs_f64() * 1e3)
}
