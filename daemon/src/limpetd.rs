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
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// limpetd: one host's agent in a limpet cluster.
#[derive(Debug, Parser)]
#[command(name = "limpetd", version = crate::VERSION, about, args_conflicts_with_subcommands = true)]
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
pub fn main(cli: LimpetdCli) -> crate::Result<()> {
    if let Some(LimpetdCommand::FetchCredentials { config, wait }) = &cli.command {
        return crate::credentials_cmd::run(config, *wait);
    }
    if let Some(LimpetdCommand::Validate { config, json }) = cli.command {
        return validate(&config, json);
    }
    let path = cli.run.config.ok_or_else(|| UsageError("--config FILE is required".into()))?;
    let file = path.display().to_string();
    let text = Config::read(&path).map_err(crate::config::ConfigErrors::from)?;
    let cfg = Config::parse_unchecked(&text, &file)?;
    let json = cli
        .run
        .log_format
        .as_deref()
        .map_or(cfg.node.log_format == crate::config::LogFormat::Json, |f| f == "json");
    crate::init_tracing_as(json);
    limpet_trainer::set_threads(1);
    let backend = limpet_trainer::device::backend();
    tracing::info!(devices = backend.devices, device = %cfg.job.device, "libtorch: {backend}");
    let settings = cfg.settings()?;
    for warning in &settings.warnings {
        tracing::warn!("{warning}");
    }
    if cfg.tls().is_none() {
        tracing::warn!(
            "running without certificates ([security] insecure = true): anyone who reaches these ports \
             and knows the cluster secret is a member, and traffic is plain text"
        );
    }
    #[cfg(feature = "lab")]
    if let Some(gate) = &cfg.node.start_gate {
        wait_at_gate(gate);
    }
    let mut agent_cfg = settings.agent;
    if let Some(step_log) = cli.run.step_log {
        agent_cfg.step_log = Some(step_log);
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let watched = rt.block_on(crate::watch_sources::resolve(&cfg));
    if watched.is_blind() {
        tracing::warn!("revocation sources: {}", watched.summary());
    } else {
        tracing::info!("revocation sources: {}", watched.summary());
    }
    agent_cfg.sources = watched.sources;
    if cfg.cluster.ec2_seeds && agent_cfg.bootstrap.is_none() {
        let me = cfg.node.advertise_control.unwrap_or(cfg.node.control).to_string();
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
                let data = cfg.node.advertise_data.unwrap_or(cfg.node.data).to_string();
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
        metrics: settings.metrics,
        metrics_tls: settings.metrics_tls,
        grace: settings.grace,
        capacity: settings.capacity,
    };
    let result = rt.block_on(serve(agent_cfg, opts));
    // Whatever did not stop within the agent's shutdown limit (a trainer thread stuck in a
    // device call) is not waited for again: the process ends with the error above.
    rt.shutdown_timeout(Duration::from_millis(500));
    result
}

/// Lab builds: a host booted ahead of its time waits here, libtorch loaded, until the lab
/// opens its gate (the file appears). A wave of joiners then arrives at once, as hosts with
/// cores of their own would, not spread over the seconds libtorch takes to load on cores that
/// dozens of agents share.
#[cfg(feature = "lab")]
fn wait_at_gate(gate: &std::path::Path) {
    tracing::info!(gate = %gate.display(), "booted; waiting at the start gate");
    while !gate.exists() {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `limpetd validate`: everything start-up checks and builds (every key, the certificates,
/// the job from its data and model), short of binding and joining; then the paths it
/// writes, the revocation sources this host would watch, and the backend libtorch offers
/// here. Every problem of the file is reported, not just the first.
fn validate(config: &std::path::Path, json: bool) -> crate::Result<()> {
    let settled = Config::read(config).map_err(crate::config::ConfigErrors::from).and_then(|text| {
        let cfg = Config::parse_unchecked(&text, &config.display().to_string())?;
        let settings = cfg.settings()?;
        Ok((cfg, settings))
    });
    let (cfg, settings) = match settled {
        Ok(c) => c,
        Err(errors) => {
            if json {
                let first = errors.first();
                let all: Vec<_> = errors
                    .all()
                    .iter()
                    .map(|e| serde_json::json!({"key": e.key, "line": e.line, "error": e.detail}))
                    .collect();
                let v = serde_json::json!({
                    "file": first.file, "valid": false, "key": first.key, "line": first.line,
                    "error": first.detail, "errors": all,
                });
                println!("{v}");
            }
            return Err(errors.into());
        }
    };
    let model = match &settings.agent.job.model {
        limpet_trainer::model::ModelSpec::Torchscript(script) => Some(format!(
            "TorchScript module {} (blake3 {}), trained as one stage: its graph cannot be cut into pipeline stages",
            cfg.model.path.as_deref().unwrap_or(std::path::Path::new("?")).display(),
            &script.blake3[..16]
        )),
        _ => None,
    };
    let warnings = settings.warnings;
    // What the ranks train on here, resolved against this host: one rank per device.
    let name = |d: &limpet_trainer::device::Device| match d {
        limpet_trainer::device::Device::Cuda(i) => format!("cuda:{i}"),
        other => format!("{other:?}").to_lowercase(),
    };
    let trains_on: Vec<String> = match settings.agent.devices.as_slice() {
        [] => vec![name(&settings.agent.training_device())],
        devices => devices.iter().map(name).collect(),
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
            "device": cfg.job.device.to_string(),
            "trains_on": trains_on,
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
    println!("libtorch: {backend}; [job].device = \"{}\"", cfg.job.device);
    println!("trains on: {} (one rank each)", trains_on.join(", "));
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

/// Tells systemd (when it started us with `Type=notify`; otherwise a no-op).
fn notify(states: &[sd_notify::NotifyState]) {
    let _ = sd_notify::notify(false, states);
}

async fn serve(cfg: AgentConfig, opts: ServeOptions) -> crate::Result<()> {
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
    // Polled here rather than spawned: the agent's end is this loop's end.
    let waiter = agent.wait();
    tokio::pin!(waiter);
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
                let exit = r?;
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
                // Proposed beside this loop, which goes on watching the agent meanwhile.
                let cmd = limpet_consensus::state::Command::Drain { id: me_id, reason: "SIGTERM".into() };
                let (handle, stop) = (handle.clone(), stop.clone());
                tasks.spawn("drain", async move {
                    if let Err(e) = handle.propose(cmd, Some(Duration::from_secs(5))).await {
                        tracing::warn!(%e, "could not record the drain; stopping");
                        stop.cancel();
                    }
                });
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
