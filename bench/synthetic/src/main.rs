//! `limpet-synthetic`: the lab's synthetic agent, run in `limpetd`'s place by
//! `limpet-lab bench scale --synthetic` (and any local cluster whose job is synthetic). It is
//! limpetd's control part (`limpet_agent::runtime::synthetic`: the consensus node, data plane,
//! heartbeats, revocation watchers and leader loop) with a training loop that needs no
//! libtorch, from the same configuration file, so hundreds run on one machine. It serves the
//! same Prometheus metrics of the control plane, says `limpetd started` as limpetd does once it
//! listens, drains on SIGTERM and stops on SIGINT.
//!
//! `limpet-synthetic fake-metadata --listen ADDR` serves the lab's fake cloud metadata (the
//! same module as `limpet-lab fake-metadata`): a local cluster starts one beside each agent,
//! and this one holds a few MB where the lab's binary, linked to libtorch, holds about 190.

mod config;
#[path = "../../../daemon/lab/src/fake_metadata.rs"]
#[allow(dead_code)]
mod fake_metadata;

use anyhow::Context;
use clap::{Parser, Subcommand};
use limpet_agent::runtime::synthetic::SyntheticAgent;
use limpet_agent::runtime::{Exit, Tasks};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The lab's synthetic agent (limpetd's control part, no libtorch).
#[derive(Debug, Parser)]
#[command(name = "limpet-synthetic")]
struct Cli {
    /// limpetd's configuration file, with a `[synthetic]` section for the job.
    #[arg(long)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve a fake cloud metadata service (AWS, GCP, Azure) until killed.
    FakeMetadata {
        /// Listen address.
        #[arg(long)]
        listen: SocketAddr,
    },
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sled=warn,raft=warn"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    // Two workers, as limpetd runs: a host's control part must not need more.
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("limpet-synthetic: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let run = match (cli.command, cli.config) {
        (Some(Command::FakeMetadata { listen }), _) => rt.block_on(fake_metadata(listen)),
        (None, Some(config)) => rt.block_on(agent(&config)),
        (None, None) => Err(anyhow::anyhow!("give --config FILE (or the fake-metadata command)")),
    };
    match run {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("limpet-synthetic: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn fake_metadata(listen: SocketAddr) -> anyhow::Result<()> {
    let md = fake_metadata::FakeMetadata::start(listen).await.with_context(|| format!("listening on {listen}"))?;
    eprintln!("fake metadata at {}", md.url());
    std::future::pending::<()>().await;
    Ok(())
}

async fn agent(path: &Path) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let s = config::load(path)?;
    if let Some(gate) = &s.start_gate {
        tracing::info!(gate = %gate.display(), "booted; waiting at the start gate");
        while !gate.exists() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let tasks = Tasks::new(tokio_util::sync::CancellationToken::new());
    let metrics = match s.metrics {
        Some(addr) => Some(serve_metrics(addr, &tasks).await?),
        None => None,
    };
    let (name, me) = (s.control.name.clone(), s.control.id);
    let agent = SyntheticAgent::start(s.control, s.job, s.step_log, tasks.clone()).await?;
    tracing::info!(node = %name, control = %agent.control_addr(), data = %agent.data_addr(), metrics = ?metrics, synthetic = true, "limpetd started");
    let (handle, stop) = (agent.handle(), agent.shutdown_token());
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let waiter = agent.wait();
    tokio::pin!(waiter);
    loop {
        tokio::select! {
            r = &mut waiter => {
                match r? {
                    Exit::Removed(why) => tracing::info!(node = %name, why, "left the cluster"),
                    Exit::Stopped => tracing::info!(node = %name, "stopped"),
                }
                return Ok(());
            }
            _ = term.recv() => {
                // Leave at the next boundary, as limpetd does (without its grace timer: the
                // lab kills what it no longer wants).
                tracing::warn!(node = %name, "SIGTERM: draining");
                let cmd = limpet_consensus::state::Command::Drain { id: me, reason: "SIGTERM".into() };
                if let Err(e) = handle.propose(cmd, Some(Duration::from_secs(5))).await {
                    tracing::warn!(%e, "could not record the drain; stopping");
                    stop.cancel();
                }
            }
            _ = int.recv() => {
                tracing::warn!(node = %name, "SIGINT: stopping now");
                stop.cancel();
            }
        }
    }
}

/// Serves `/metrics` (the control plane's counters the consensus records) on `addr`.
async fn serve_metrics(addr: SocketAddr, tasks: &Tasks) -> anyhow::Result<SocketAddr> {
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("[node].metrics {addr}"))?;
    let bound = listener.local_addr()?;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let h = handle.clone();
            async move { h.render() }
        }),
    );
    let stop = tasks.token();
    tasks.spawn("metrics", async move {
        let serve = axum::serve(listener, app).with_graceful_shutdown(async move { stop.cancelled().await });
        if let Err(e) = serve.await {
            tracing::error!(%e, "the metrics endpoint stopped");
        }
    });
    Ok(bound)
}
