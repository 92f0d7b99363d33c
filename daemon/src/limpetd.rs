//! `limpetd`: the agent as a service. Reads and checks the configuration, starts the agent
//! and its metrics endpoint, keeps systemd told (ready once joined, status, watchdog), and
//! turns signals into cluster actions: SIGTERM (systemd stop, the usual shutdown path of a
//! spot VM) drains the node so it leaves at an epoch boundary without losing a step, and
//! exits 0; a second SIGTERM or the end of the grace period stops it at once, as does
//! SIGINT (peers treat that as a failure, which they survive).

use crate::config::Config;
use crate::UsageError;
use clap::{Args, Parser, Subcommand};
use limpet_agent::runtime::{Agent, AgentConfig, Exit, Tasks};
use limpet_consensus::state::{MemberSpec, MemberStatus};
use limpet_trainer::data::Dataset;
use limpet_trainer::workload;
use limpet_trainer::JobSpec;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// limpetd: one host's agent in a limpet cluster.
#[derive(Debug, Parser)]
#[command(name = "limpetd", version, about, args_conflicts_with_subcommands = true)]
pub struct LimpetdCli {
    /// Check a configuration and exit (for systemd's ExecStartPre).
    #[command(subcommand)]
    pub command: Option<LimpetdCommand>,
    /// Run the agent.
    #[command(flatten)]
    pub run: RunArgs,
}

/// `limpetd` subcommands.
#[derive(Debug, Subcommand)]
pub enum LimpetdCommand {
    /// Check the configuration file and exit: 0 when valid, 64 with the bad key named. Also
    /// says which revocation sources the node would watch (probing the clouds for "auto").
    Validate {
        /// The configuration file.
        #[arg(long)]
        config: PathBuf,
        /// One JSON object on stdout (the error, too, when the file is bad).
        #[arg(long)]
        json: bool,
    },
    /// An EC2 host's first boot: fetch this node's certificate, key and the cluster secret
    /// from SSM Parameter Store ([security.ssm]), write them, check them, then delete the
    /// key's parameter. Does nothing when the files are already there.
    FetchCredentials {
        /// The configuration file.
        #[arg(long)]
        config: PathBuf,
        /// How long to wait for the parameters (default: [security.ssm].wait_secs).
        #[arg(long, value_parser = humantime::parse_duration)]
        wait: Option<Duration>,
    },
}

/// Running the agent.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The configuration file (TOML, see docs/limpetd.md).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Append one JSON line per completed step here (overrides [node].step_log).
    #[arg(long)]
    pub step_log: Option<PathBuf>,
    /// Log lines as text or JSON (overrides [node].log_format).
    #[arg(long, value_parser = ["text", "json"])]
    pub log_format: Option<String>,
}

/// Runs `limpetd` with parsed arguments.
pub fn main(cli: LimpetdCli) -> anyhow::Result<()> {
    if let Some(LimpetdCommand::FetchCredentials { config, wait }) = &cli.command {
        return crate::credentials_cmd::run(config, *wait);
    }
    if let Some(LimpetdCommand::Validate { config, json }) = cli.command {
        return validate(&config, json);
    }
    let path = cli.run.config.ok_or_else(|| UsageError("--config FILE is required".into()))?;
    let cfg = Config::load(&path).map_err(|e| UsageError(e.to_string()))?;
    let json = cli
        .run
        .log_format
        .as_deref()
        .map_or(cfg.node.log_format == crate::config::LogFormat::Json, |f| f == "json");
    crate::init_tracing_as(json);
    if cfg.tls().is_none() {
        tracing::warn!(
            "running without certificates ([security] insecure = true): anyone who reaches these ports \
             and knows the cluster secret is a member, and traffic is plain text"
        );
    }
    limpet_trainer::set_threads(1);
    let backend = limpet_trainer::device::backend();
    tracing::info!(devices = backend.devices, device = %cfg.job.device, "libtorch: {backend}");
    let mut agent_cfg = agent_config(&cfg, cli.run.step_log)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let watched = rt.block_on(crate::watch_sources::resolve(&cfg));
    if watched.is_blind() {
        tracing::warn!("revocation sources: {}", watched.summary());
    } else {
        tracing::info!("revocation sources: {}", watched.summary());
    }
    agent_cfg.sources = watched.sources;
    if cfg.cluster.ec2_seeds && agent_cfg.bootstrap.is_none() {
        let me = cfg.node.advertise_control.clone().unwrap_or_else(|| cfg.node.control.clone());
        // A state directory with a consensus log belongs to a node that was admitted before.
        let fresh = !cfg.node.state_dir.join("consensus").exists();
        let found = rt.block_on(crate::fleet_cmd::ec2_seeds(
            &cfg.cluster.name,
            cfg.cluster.ec2_region.clone(),
            cfg.cluster.ec2_endpoint.clone(),
            agent_cfg.control.port(),
            &me,
            fresh,
        ))?;
        match found {
            crate::fleet_cmd::Discovery::Seeds(seeds) => {
                tracing::info!(?seeds, "seeds from EC2 tags");
                agent_cfg.seeds.extend(seeds);
            }
            crate::fleet_cmd::Discovery::Found => {
                tracing::info!(
                    cluster = %cfg.cluster.name,
                    "the oldest instance of the cluster, without state: founding it"
                );
                let data = cfg.node.advertise_data.clone().unwrap_or_else(|| cfg.node.data.clone());
                agent_cfg.bootstrap = Some(vec![MemberSpec {
                    id: cfg.node_id(),
                    name: cfg.node.name.clone(),
                    control_addr: me,
                    data_addr: data,
                    hardware: Default::default(),
                }]);
            }
        }
    }
    let opts = ServeOptions {
        metrics: cfg.node.metrics.as_deref().map(str::parse).transpose()?,
        metrics_tls: match (&agent_cfg.tls, cfg.node.metrics_tls) {
            (Some(tls), true) => Some(tls.data_server()?),
            _ => None,
        },
        grace: Duration::from_secs(cfg.timing.drain_grace_secs),
        capacity: reconciler(&cfg),
    };
    let result = rt.block_on(serve(agent_cfg, opts));
    // Whatever did not stop within the agent's shutdown limit (a trainer thread stuck in a
    // device call) is not waited for again: the process ends with the error above.
    rt.shutdown_timeout(Duration::from_millis(500));
    result
}

/// `limpetd validate`: the file's checks, the paths it writes, the model module, the
/// revocation sources this host would watch, and the backend libtorch offers here.
fn validate(config: &std::path::Path, json: bool) -> anyhow::Result<()> {
    let cfg = match Config::load(config) {
        Ok(c) => c,
        Err(e) => {
            if json {
                let v = serde_json::json!({"file": e.file, "valid": false, "key": e.key, "error": e.detail});
                println!("{v}");
            }
            return Err(UsageError(e.to_string()).into());
        }
    };
    let mut warnings = write_path_warnings(&cfg);
    warnings.extend(shard_warning(&cfg));
    let model = if cfg.job.model == crate::config::ModelName::Torchscript {
        let path = cfg.model.path.as_deref().expect("validated: torchscript has [model].path");
        let hash = limpet_trainer::model::script::register(path).map_err(|e| UsageError(e.to_string()))?;
        Some(format!(
            "TorchScript module {} (blake3 {}), trained as one stage: its graph cannot be cut into pipeline stages",
            path.display(),
            &hash[..16]
        ))
    } else {
        None
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let watched = rt.block_on(crate::watch_sources::resolve(&cfg));
    let backend = limpet_trainer::device::backend();
    if json {
        let v = serde_json::json!({
            "file": config.display().to_string(),
            "valid": true,
            "node": cfg.node.name,
            "id": cfg.node_id(),
            "cluster": cfg.cluster.name,
            "revocation": watched.to_json(),
            "model": model,
            "libtorch": backend,
            "device": cfg.job.device,
            "warnings": warnings,
        });
        println!("{v}");
        return Ok(());
    }
    println!(
        "{}: valid (node {} id {}, cluster {})",
        config.display(),
        cfg.node.name,
        cfg.node_id(),
        cfg.cluster.name
    );
    println!("revocation: {}", watched.summary());
    println!("libtorch: {backend}; [job].device = {:?}", cfg.job.device);
    if watched.is_blind() {
        eprintln!("warning: this node would watch no revocation notices");
    }
    for warning in warnings {
        eprintln!("warning: {warning}");
    }
    if let Some(m) = model {
        println!("model: {m}");
    }
    Ok(())
}

/// How `limpetd` serves beyond the agent itself.
struct ServeOptions {
    /// Where to serve Prometheus metrics.
    metrics: Option<SocketAddr>,
    /// Serve them over mutual TLS with this configuration.
    metrics_tls: Option<std::sync::Arc<rustls::ServerConfig>>,
    /// How long a SIGTERM drain may take.
    grace: Duration,
    /// The fleet reconciler (`[capacity]`), run while this node leads.
    capacity: Option<crate::reconciler::Reconciler>,
}

/// The reconciler `[capacity]` asks for: EC2 where `[cluster]` finds it unless the section
/// says otherwise; spare credentials from `[security.ssm]` unless `spares = false`.
fn reconciler(cfg: &Config) -> Option<crate::reconciler::Reconciler> {
    let section = cfg.capacity.clone()?;
    let ec2 = limpet_deploy::FleetConfig {
        region: section.region.clone().or_else(|| cfg.cluster.ec2_region.clone()),
        endpoint: section.endpoint.clone().or_else(|| cfg.cluster.ec2_endpoint.clone()),
        credentials: None,
    };
    let ssm = cfg.tls().and_then(|s| s.ssm.as_ref());
    let spares = match (section.spares, ssm) {
        (Some(false), _) | (None, None) => None,
        (_, Some(ssm)) => Some((
            ssm.prefix.clone(),
            limpet_deploy::FleetConfig {
                region: ssm.region.clone().or_else(|| ec2.region.clone()),
                endpoint: ec2.endpoint.clone(),
                credentials: None,
            },
        )),
        // validate() refuses spares = true without [security.ssm].
        (Some(true), None) => None,
    };
    Some(crate::reconciler::Reconciler {
        section,
        cluster: cfg.cluster.name.clone(),
        me: cfg.node_id(),
        ec2,
        spares,
    })
}

/// Tells systemd (when it started us with `Type=notify`; otherwise a no-op).
fn notify(states: &[sd_notify::NotifyState]) {
    let _ = sd_notify::notify(false, states);
}

async fn serve(cfg: AgentConfig, opts: ServeOptions) -> anyhow::Result<()> {
    use sd_notify::NotifyState;
    use tokio::signal::unix::{signal, SignalKind};
    // limpetd owns the root token: every task below, the agent's included, is tracked under
    // it, and a panic in any of them ends the process with an error (systemd restarts it).
    let tasks = Tasks::new(tokio_util::sync::CancellationToken::new());
    // Bound before the agent starts, so a taken port stops limpetd before it joins.
    let metrics = match opts.metrics {
        Some(addr) => Some(crate::metrics::serve(addr, opts.metrics_tls, &tasks).await?),
        None => None,
    };
    let name = cfg.name.clone();
    let me_id = cfg.id;
    let agent = Agent::start_with(cfg, tasks.clone()).await?;
    tracing::info!(node = %name, control = %agent.control_addr(), data = %agent.data_addr(), metrics = ?metrics, "limpetd started");
    let stop = tasks.token();
    let handle = agent.handle();
    tasks.spawn("metrics-raft", crate::metrics::follow_consensus(handle.clone(), stop.clone()));
    tasks.spawn("systemd", tell_systemd(handle.clone(), me_id, stop.clone()));
    if let Some(r) = opts.capacity {
        tasks.spawn("capacity", crate::reconciler::run(r, handle.clone(), stop.clone()));
    }
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut waiter = tokio::spawn(agent.wait());
    let mut draining: Option<tokio::time::Instant> = None;
    loop {
        let deadline = async {
            match draining {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = &mut waiter => {
                let exit = r??;
                match exit {
                    Exit::Removed(why) => tracing::info!(node = %name, why, "left the cluster"),
                    Exit::Stopped => tracing::info!(node = %name, "stopped"),
                }
                return Ok(());
            }
            _ = term.recv() => {
                if draining.is_some() {
                    // A second SIGTERM: stop now. The cluster treats it as a failure, which it
                    // survives like any other; the drain already recorded stays in the log.
                    tracing::warn!(node = %name, "second SIGTERM: stopping now");
                    stop.cancel();
                    continue;
                }
                tracing::warn!(node = %name, grace_s = opts.grace.as_secs(), "SIGTERM: draining");
                notify(&[NotifyState::Stopping]);
                draining = Some(tokio::time::Instant::now() + opts.grace);
                // Leave at the next boundary; the leader (which may be this node: raft hands
                // leadership over when a voter is removed) schedules the epoch without it.
                let cmd = limpet_consensus::state::Command::Drain { id: me_id, reason: "SIGTERM".into() };
                if let Err(e) = handle.propose(cmd, Some(Duration::from_secs(5))).await {
                    tracing::warn!(%e, "could not record the drain; stopping");
                    stop.cancel();
                }
            }
            _ = int.recv() => {
                tracing::warn!(node = %name, "SIGINT: stopping now");
                stop.cancel();
            }
            _ = deadline => {
                tracing::warn!(node = %name, "the drain outlasted its grace period; stopping");
                draining = None;
                stop.cancel();
            }
        }
    }
}

/// Keeps systemd told: `READY=1` once this node is a member of the cluster in the committed
/// log (joined, not just listening), a `STATUS=` line as the phase changes, and watchdog
/// pings while the consensus node keeps answering, so a wedged agent is restarted.
async fn tell_systemd(
    handle: limpet_consensus::NodeHandle,
    me: u64,
    stop: tokio_util::sync::CancellationToken,
) {
    use sd_notify::NotifyState;
    let mut usec = 0;
    let watchdog = sd_notify::watchdog_enabled(false, &mut usec).then(|| Duration::from_micros(usec / 2));
    let mut ready = false;
    let mut last_status = String::new();
    let mut tick =
        tokio::time::interval(watchdog.unwrap_or(Duration::from_secs(1)).min(Duration::from_secs(1)));
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let local = handle.watch().borrow().clone();
        let member = local.state.members.get(&me);
        if !ready && member.is_some_and(|m| m.status.is_staying()) {
            ready = true;
            tracing::info!(node = me, leader = local.leader, "joined the cluster");
            notify(&[NotifyState::Ready]);
        }
        let status = match (member, &local.state.current) {
            (None, _) => "joining the cluster".to_string(),
            (Some(m), _) if matches!(m.status, MemberStatus::Draining | MemberStatus::Leaving) => {
                format!("{:?}: leaving at the next epoch boundary", m.status)
            }
            (Some(m), Some(e)) if e.ranks.contains(&me) => {
                format!("{:?}: training epoch {} of {} ranks", m.status, e.id, e.ranks.len())
            }
            (Some(m), _) => format!("{:?}: not training", m.status),
        };
        if status != last_status {
            notify(&[NotifyState::Status(&status)]);
            last_status = status;
        }
        // The watch only changes while the node's event loop runs; asking it something
        // proves it is not wedged.
        if watchdog.is_some() && handle.status().await.is_ok() {
            notify(&[NotifyState::Watchdog]);
        }
    }
}

/// A reproducible job whose canonical shards do not divide evenly among the founders: every
/// step, some hosts then run one shard's passes more than others, or sit idle (see
/// docs/design.md, reproducible jobs). A later world may differ; the founders are the world
/// the job is set up for.
pub fn shard_warning(cfg: &Config) -> Option<String> {
    let founders = cfg.cluster.bootstrap.len();
    if cfg.job.reproducible != Some(true) || founders == 0 {
        return None;
    }
    let k = cfg.job.shards.unwrap_or(limpet_trainer::SHARDS).min(cfg.job.global_batch as usize);
    let said = if cfg.job.shards.is_some() { "" } else { " (the default)" };
    if k < founders {
        return Some(format!(
            "[job].shards {k}{said} with {founders} founders: {} of them idle every step; shards = {founders} keeps each busy",
            founders - k
        ));
    }
    (k % founders != 0).then(|| {
        let most = k.div_ceil(founders);
        format!(
            "[job].shards {k}{said} with {founders} founders: some run {most} shards' passes a step, others {}; shards = {founders} (one pass each, the fastest) or a multiple of it evens them",
            most - 1
        )
    })
}

/// The directories limpetd writes to that it cannot write here, each naming its key. Run as
/// the unit's `ExecStartPre`, this sees the unit's sandbox: with `ProtectSystem=strict`,
/// every path outside the state, log and temporary directories must be in
/// `ReadWritePaths=`, else checkpoints and step logs fail only once training runs. A path
/// that does not exist yet (a mount not up) is named too, but may be fine later.
pub fn write_path_warnings(cfg: &Config) -> Vec<String> {
    let mut dirs: Vec<(&str, PathBuf)> = vec![("[node].state_dir", cfg.node.state_dir.clone())];
    if let Some(c) = &cfg.checkpoint {
        dirs.push((
            "[checkpoint].dir",
            c.dir.clone().unwrap_or_else(|| cfg.node.state_dir.join("checkpoints")),
        ));
    }
    if let Some(parent) = cfg.node.step_log.as_deref().and_then(std::path::Path::parent) {
        dirs.push(("[node].step_log", parent.to_path_buf()));
    }
    let mut out = Vec::new();
    for (key, dir) in dirs {
        // The nearest existing ancestor is where a write (or the directory's creation) lands.
        let Some(existing) = dir.ancestors().find(|a| a.exists()) else { continue };
        if existing != dir {
            out.push(format!("{key} {}: does not exist yet (a mount not up?)", dir.display()));
        }
        let probe = existing.join(format!(".limpetd-validate-{}", std::process::id()));
        match std::fs::File::create(&probe) {
            Ok(_) => {
                let _ = std::fs::remove_file(&probe);
            }
            Err(e) => out.push(format!(
                "{key} {}: not writable here ({e}); under the systemd unit, add it to ReadWritePaths=",
                existing.display()
            )),
        }
    }
    out
}

/// Builds the agent's configuration from the file's.
pub fn agent_config(cfg: &Config, step_log: Option<PathBuf>) -> anyhow::Result<AgentConfig> {
    let secret = crate::config::read_secret(&cfg.node.secret_file)
        .map_err(|why| anyhow::anyhow!("[node].secret_file: {why}"))?;
    let job = job_spec(cfg)?;
    let mut a = AgentConfig::new(
        cfg.node_id(),
        &cfg.node.name,
        &cfg.cluster.name,
        cfg.node.state_dir.clone(),
        secret,
        job,
    );
    a.control = cfg.node.control.parse()?;
    a.data = cfg.node.data.parse()?;
    a.advertise_control = cfg.node.advertise_control.clone().unwrap_or_default();
    a.advertise_data = cfg.node.advertise_data.clone().unwrap_or_default();
    let founders: Vec<MemberSpec> =
        crate::config::parse_founders(&cfg.cluster.bootstrap).map_err(|e| UsageError(e.0))?;
    a.base_world = cfg.job.base_world.unwrap_or(founders.len().max(1) as u64);
    a.bootstrap = if founders.is_empty() { None } else { Some(founders) };
    a.seeds = cfg.cluster.seeds.clone();
    a.data_path = cfg.job.data_path.clone();
    a.device = limpet_trainer::device::DeviceChoice::parse(&cfg.job.device)
        .map_err(|e| UsageError(format!("[job].device: {e}")))?;
    a.devices =
        cfg.node.local_devices().map_err(|e| UsageError(format!("[node].devices: {e}")))?.unwrap_or_default();
    if a.devices.len() > 1 && cfg.pipeline.is_some() {
        // Only `"auto"` gets here (validation refuses such a list): the first device.
        tracing::warn!(
            devices = a.devices.len(),
            "[node].devices = \"auto\": a pipelined job trains on one device; using the first"
        );
        a.devices.truncate(1);
    }
    a.init_from = cfg.model.init_from.clone();
    a.policy = cfg.job.policy;
    a.min_nodes = cfg.cluster.min_nodes;
    a.straggler_ratio = cfg.cluster.straggler_ratio;
    a.straggler_steps = cfg.cluster.straggler_steps;
    a.slowdown_us_per_sample = cfg.node.slowdown_us_per_sample;
    a.slowdown_factor = cfg.node.slowdown_factor;
    a.poll = Duration::from_secs_f64(cfg.revocation.poll_secs);
    let t = &cfg.timing;
    a.heartbeat = Duration::from_millis(t.heartbeat_ms);
    a.heartbeat_timeout = Duration::from_millis(t.failure_timeout_ms);
    a.dp_timeout = Duration::from_millis(t.data_timeout_ms);
    a.dp_congestion =
        limpet_agent::dataplane::endpoint::parse_congestion(&cfg.node.data_congestion).map_err(UsageError)?;
    a.tick = Duration::from_millis(t.raft_tick_ms);
    a.lead = Duration::from_millis(t.lead_ms);
    a.notice_margin = Duration::from_millis(t.notice_margin_ms);
    a.step_log = step_log.or_else(|| cfg.node.step_log.clone());
    if let Some(sec) = cfg.tls() {
        a.tls = Some(std::sync::Arc::new(sec.load("the configuration", cfg.node_id())?));
        a.tls_data = sec.data_plane == crate::config::DataPlaneMode::Tls;
    }
    a.pipeline = pipeline_settings(cfg, a.job.model.num_blocks())?;
    a.checkpoint = checkpoint_settings(cfg);
    Ok(a)
}

/// `[pipeline]` for a model of `blocks` blocks: explicit cuts must fall inside it.
fn pipeline_settings(
    cfg: &Config,
    blocks: usize,
) -> anyhow::Result<Option<limpet_agent::runtime::PipelineSettings>> {
    let Some(p) = cfg.pipeline.as_ref() else { return Ok(None) };
    if let Some(cuts) = &p.cuts {
        if cuts.last().is_some_and(|&c| c >= blocks) {
            return Err(UsageError(format!(
                "[pipeline].cuts {cuts:?}: the model has {blocks} blocks, so every cut must be below {blocks}"
            ))
            .into());
        }
    }
    Ok(Some(limpet_agent::runtime::PipelineSettings {
        depth: match p.stages {
            crate::config::Stages::Fixed(n) => Some(n),
            crate::config::Stages::Named(_) => None,
        },
        mem_bytes: crate::args::parse_bytes(&p.memory).unwrap_or(16 << 30),
        link: limpet_agent::planner::Link { bytes_per_s: p.link_gbps * 1e9, latency_ms: p.latency_ms },
        shadow_every: p.shadow_every,
        cuts: p.cuts.clone(),
    }))
}

/// `[checkpoint]`, its directory defaulting to the state directory's `checkpoints`.
fn checkpoint_settings(cfg: &Config) -> Option<limpet_agent::runtime::CheckpointSettings> {
    let c = cfg.checkpoint.as_ref()?;
    Some(limpet_agent::runtime::CheckpointSettings {
        every_steps: c.every_steps,
        every: (c.every_minutes > 0.0).then(|| Duration::from_secs_f64(c.every_minutes * 60.0)),
        dir: c.dir.clone().unwrap_or_else(|| cfg.node.state_dir.join("checkpoints")),
        keep: c.keep,
        resume: c.resume,
        min_free: c.min_free_bytes().expect("validated: [checkpoint].min_free"),
        shared: c.shared,
        remote: c.s3.as_ref().and_then(|url| limpet_agent::remote::parse_url(url).ok()).map(
            |(bucket, prefix)| limpet_agent::remote::RemoteSettings {
                bucket,
                prefix,
                endpoint: c.s3_endpoint.clone(),
                region: c.s3_region.clone(),
            },
        ),
    })
}

/// The trainer's job from `[job]`, `[model]` and `[data]`: the model's defaults, overridden
/// by what the file sets.
pub fn job_spec(cfg: &Config) -> anyhow::Result<JobSpec> {
    let j = &cfg.job;
    let kind = j.model.kind();
    let spec = workload::data_spec(&j.data, &cfg.data, j.seed)?;
    let data = Dataset::load(&spec, j.data_path.as_deref())?;
    let mut model = cfg.model.clone();
    if j.layers.is_some() {
        model.layers = j.layers;
    }
    let mut job = workload::job_for(kind, &data, &model).map_err(|e| UsageError(e.to_string()))?;
    j.keys().apply(&mut job).map_err(|e| UsageError(e.to_string()))?;
    job.validate(&data)?;
    Ok(job)
}
