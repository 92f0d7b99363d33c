//! `limpetd`: the agent as a service. Reads and checks the configuration, starts the agent,
//! tells systemd it is ready, and turns signals into cluster actions: SIGTERM (systemd stop,
//! the usual shutdown path of a spot VM) drains the node so it leaves at an epoch boundary
//! without losing a step; SIGINT stops at once (peers treat it as a failure).

use crate::config::Config;
use crate::UsageError;
use clap::{Args, Parser, Subcommand};
use limpet_agent::revocation::Source;
use limpet_agent::runtime::{Agent, AgentConfig, Exit};
use limpet_consensus::state::MemberSpec;
use limpet_trainer::data::{DataSpec, Dataset};
use limpet_trainer::optim::OptimizerSpec;
use limpet_trainer::{JobSpec, ModelKind};
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
    /// Check the configuration file and exit: 0 when valid, 64 with the bad key named.
    Validate {
        /// The configuration file.
        #[arg(long)]
        config: PathBuf,
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
}

/// Runs `limpetd` with parsed arguments.
pub fn main(cli: LimpetdCli) -> anyhow::Result<()> {
    if let Some(LimpetdCommand::Validate { config }) = cli.command {
        let cfg = Config::load(&config).map_err(|e| UsageError(e.to_string()))?;
        println!(
            "{}: valid (node {} id {}, cluster {})",
            config.display(),
            cfg.node.name,
            cfg.node_id(),
            cfg.cluster.name
        );
        return Ok(());
    }
    let path = cli.run.config.ok_or_else(|| UsageError("--config FILE is required".into()))?;
    let cfg = Config::load(&path).map_err(|e| UsageError(e.to_string()))?;
    crate::init_tracing();
    limpet_trainer::set_threads(1);
    let agent_cfg = agent_config(&cfg, cli.run.step_log)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(serve(agent_cfg))
}

async fn serve(cfg: AgentConfig) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let name = cfg.name.clone();
    let me_id = cfg.id;
    let agent = Agent::start(cfg).await?;
    tracing::info!(node = %name, control = %agent.control_addr(), data = %agent.data_addr(), "limpetd ready");
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
    let stop = agent.shutdown_token();
    let handle = agent.handle();
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let drain_stop = stop.clone();
    let waiter = tokio::spawn(agent.wait());
    let me = name.clone();
    let signals = tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {
                tracing::warn!(node = %me, "SIGTERM: draining");
                let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
                Some(())
            }
            _ = int.recv() => {
                tracing::warn!(node = %me, "SIGINT: stopping now");
                drain_stop.cancel();
                None
            }
        }
    });
    let mut waiter = waiter;
    let mut signals = signals;
    loop {
        tokio::select! {
            r = &mut waiter => {
                signals.abort();
                let exit = r??;
                match exit {
                    Exit::Removed(why) => tracing::info!(node = %name, why, "left the cluster"),
                    Exit::Stopped => tracing::info!(node = %name, "stopped"),
                }
                return Ok(());
            }
            s = &mut signals => {
                if let Ok(Some(())) = s {
                    // Drain: leave at the next boundary; give the cluster a bounded time.
                    let cmd = limpet_consensus::state::Command::Drain { id: me_id, reason: "SIGTERM".into() };
                    if let Err(e) = handle.propose(cmd, Some(Duration::from_secs(5))).await {
                        tracing::warn!(%e, "could not record the drain; stopping");
                        stop.cancel();
                    }
                    let stop = stop.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_secs(90)).await;
                        stop.cancel();
                    });
                }
                signals = tokio::spawn(std::future::pending());
            }
        }
    }
}

/// Builds the agent's configuration from the file's.
pub fn agent_config(cfg: &Config, step_log: Option<PathBuf>) -> anyhow::Result<AgentConfig> {
    let secret = std::fs::read(&cfg.node.secret_file)?;
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
        crate::raft_cmd::parse_founders(&cfg.cluster.bootstrap).map_err(|e| UsageError(e.0))?;
    a.base_world = cfg.job.base_world.unwrap_or(founders.len().max(1) as u64);
    a.bootstrap = if founders.is_empty() { None } else { Some(founders) };
    a.seeds = cfg.cluster.seeds.clone();
    a.data_path = cfg.job.data_path.clone();
    a.policy = cfg.job.policy;
    a.min_nodes = cfg.cluster.min_nodes;
    a.sources = cfg
        .revocation
        .sources
        .iter()
        .map(|s| match s.as_str() {
            "aws" => Source::Aws { endpoint: cfg.revocation.aws_endpoint.clone() },
            "gcp" => Source::Gcp { endpoint: cfg.revocation.gcp_endpoint.clone() },
            _ => Source::Azure { endpoint: cfg.revocation.azure_endpoint.clone() },
        })
        .collect();
    a.poll = Duration::from_secs_f64(cfg.revocation.poll_secs);
    let t = &cfg.timing;
    a.heartbeat = Duration::from_millis(t.heartbeat_ms);
    a.heartbeat_timeout = Duration::from_millis(t.failure_timeout_ms);
    a.dp_timeout = Duration::from_millis(t.data_timeout_ms);
    a.tick = Duration::from_millis(t.raft_tick_ms);
    a.lead = Duration::from_millis(t.lead_ms);
    a.notice_margin = Duration::from_millis(t.notice_margin_ms);
    a.step_log = step_log.or_else(|| cfg.node.step_log.clone());
    a.pipeline = cfg.pipeline.as_ref().map(|p| limpet_agent::runtime::PipelineSettings {
        depth: match p.stages {
            crate::config::Stages::Fixed(n) => Some(n),
            crate::config::Stages::Named(_) => None,
        },
        mem_bytes: crate::plan_cmd::parse_bytes(&p.memory).unwrap_or(16 << 30),
        link: limpet_agent::planner::Link { bytes_per_s: p.link_gbps * 1e9, latency_ms: p.latency_ms },
        shadow_every: p.shadow_every,
        cuts: p.cuts.clone(),
    });
    if let Some(cuts) = a.pipeline.as_ref().and_then(|p| p.cuts.as_ref()) {
        let blocks = a.job.model.num_blocks();
        if cuts.last().is_some_and(|&c| c >= blocks) {
            return Err(UsageError(format!(
                "[pipeline].cuts {cuts:?}: the model has {blocks} blocks, so every cut must be below {blocks}"
            ))
            .into());
        }
    }
    Ok(a)
}

/// The trainer's job from `[job]`: the model's defaults, overridden by what the file sets.
pub fn job_spec(cfg: &Config) -> anyhow::Result<JobSpec> {
    let j = &cfg.job;
    let kind = match j.model.as_str() {
        "mlp" => ModelKind::Mlp,
        "convnet" => ModelKind::Convnet,
        _ => ModelKind::Gpt,
    };
    let spec = match j.data.as_str() {
        "digits" => DataSpec::Digits,
        "chars" => DataSpec::Chars { context: 64 },
        _ => DataSpec::Synthetic { samples: 4096, features: 32, classes: 8, seed: j.seed },
    };
    let data = Dataset::load(&spec, j.data_path.as_deref())?;
    let mut job = JobSpec::defaults_for(kind, &data)?;
    job.steps = j.steps;
    job.schedule.warmup_steps = j.steps / 20;
    job.global_batch = j.global_batch as usize;
    job.micro_batch = j.micro_batch.unwrap_or(j.global_batch) as usize;
    job.seed = j.seed;
    if let Some(o) = &j.optimizer {
        let (lr, wd) = (job.optimizer.lr(), job.optimizer.weight_decay());
        job.optimizer = if o == "sgd" { OptimizerSpec::sgd(lr, wd) } else { OptimizerSpec::adamw(lr, wd) };
    }
    if let Some(lr) = j.lr {
        job.optimizer.set_lr(lr);
    }
    if let Some(wd) = j.weight_decay {
        job.optimizer.set_weight_decay(wd);
    }
    if let (Some(l), limpet_trainer::model::ModelSpec::Gpt { layers, .. }) = (j.layers, &mut job.model) {
        *layers = l;
    }
    job.validate(&data)?;
    Ok(job)
}
