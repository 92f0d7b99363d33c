//! `limpetd`'s Prometheus endpoint: installs the exporter's recorder behind the `metrics`
//! facade (the agent records steps, transitions, checkpoints and data-plane bytes where
//! they happen), serves its text format at `GET /metrics`, and follows the consensus node
//! for the raft gauges, over plain HTTP or mutual TLS (`[node].metrics_tls`).
//! `deploy/grafana/limpet.json` is a dashboard over these names.

use limpet_consensus::NodeHandle;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;

/// Seconds: from a 1 ms MLP step to a multi-second stall.
const BUCKETS: &[f64] = &[0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0];

/// Every metric limpetd exports, with its help text (the `# HELP` lines).
pub const METRICS: &[(&str, &str)] = &[
    ("limpet_capacity_decisions_total", "Capacity records this node's reconciler committed, by action."),
    ("limpet_capacity_launches_total", "Hosts the reconciler launched, by market (spot, on-demand)."),
    ("limpet_capacity_errors_total", "Refused launches by EC2 error code (reconcile: a round that failed)."),
    ("limpet_capacity_target", "Hosts the reconciler keeps."),
    (
        "limpet_capacity_hosts",
        "Hosts the reconciler counts: members joining or training, plus launches on their way.",
    ),
    ("limpet_steps_total", "Optimizer steps this node completed."),
    ("limpet_step_seconds", "Wall time of one training step on this node."),
    ("limpet_applied_step", "Steps applied to this node's state (the next step to run)."),
    ("limpet_loss", "Global mean loss of the last step."),
    ("limpet_samples_per_second", "Samples per second of the last step, this rank's share."),
    ("limpet_world_size", "Ranks in the epoch this node trains in."),
    ("limpet_epoch", "The epoch this node trains in."),
    ("limpet_transitions_total", "Epoch changes this node entered, by cause."),
    ("limpet_transition_idle_seconds", "Time from this node's last step to its first step in the new epoch."),
    (
        "limpet_lost_steps_total",
        "Steps in flight when a collective broke that no peer finished, computed again.",
    ),
    ("limpet_redone_steps_total", "Steps trained again after rolling back to a pipeline stage's shadow, to a checkpoint when a shard of the optimizer state was lost, or to the survivors' agreed step when this rank alone applied the step in flight."),
    ("limpet_data_bytes_sent_total", "Data-plane bytes sent, by kind (ring, pipe, handoff)."),
    ("limpet_data_bytes_received_total", "Data-plane bytes received, by kind (ring, pipe, handoff)."),
    ("limpet_checkpoints_total", "Checkpoint parts this node wrote."),
    ("limpet_checkpoint_failures_total", "Checkpoint parts this node failed to write."),
    ("limpet_checkpoint_step", "Step of the last checkpoint part this node wrote."),
    (
        "limpet_config_disagreements_total",
        "Checkpoints at which the hosts' configuration differed where it must not, by key (checkpoint.s3).",
    ),
    ("limpet_shard_losses_total", "Blocks of sharded optimizer state lost with every holder: back to a checkpoint."),
    ("limpet_checkpoint_seconds", "Time to encode and write one checkpoint part."),
    ("limpet_raft_term", "Raft term this node is in."),
    (
        "limpet_control_bytes_total",
        "Control-plane bytes this node sent or received, by direction and kind (raft batches, heartbeat reports).",
    ),
    ("limpet_raft_commit_index", "Newest log index this node knows to be committed."),
    ("limpet_raft_applied_index", "Newest log index applied to this node's cluster state."),
    ("limpet_raft_leader", "Raft id of the leader this node follows (0: none known)."),
    ("limpet_raft_is_leader", "1 while this node leads the cluster."),
    ("limpet_members", "Cluster members by status, as this node's log has them."),
];

/// Handshakes the TLS endpoint runs at once; more connections are closed unanswered.
const MAX_HANDSHAKES: usize = 16;

/// The time a client has for its whole TLS handshake.
const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(10);

/// Installs the recorder and serves `/metrics` on `addr` as tasks of `tasks` (they end with
/// its root token), over mutual TLS when `tls` is given (clients need a certificate of the
/// cluster CA); the bound address.
pub async fn serve(
    addr: SocketAddr,
    tls: Option<Arc<rustls::ServerConfig>>,
    tasks: &limpet_agent::runtime::Tasks,
) -> crate::Result<SocketAddr> {
    let handle = install()?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| crate::UsageError(format!("[node].metrics {addr}: {e}")))?;
    let bound = listener.local_addr()?;
    let render = handle.clone();
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let h = render.clone();
            async move { ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], h.render()) }
        }),
    );
    let stop = tasks.token();
    match tls {
        None => tasks.spawn("metrics", async move {
            let serve =
                axum::serve(listener, app).with_graceful_shutdown(async move { stop.cancelled().await });
            if let Err(e) = serve.await {
                tracing::error!(%e, "the metrics endpoint stopped");
            }
        }),
        Some(cfg) => {
            let listener = TlsListener::start(listener, cfg, tasks);
            tasks.spawn("metrics", async move {
                let serve =
                    axum::serve(listener, app).with_graceful_shutdown(async move { stop.cancelled().await });
                if let Err(e) = serve.await {
                    tracing::error!(%e, "the metrics endpoint stopped");
                }
            });
        }
    }
    // Histograms keep their samples until upkeep folds them into the buckets.
    let stop = tasks.token();
    tasks.spawn("metrics-upkeep", async move {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_secs(5)) => handle.run_upkeep(),
            }
        }
    });
    Ok(bound)
}

/// The metrics endpoint's connections after their TLS handshake. Handshakes run as tasks of
/// their own (at most [`MAX_HANDSHAKES`], each within [`HANDSHAKE_DEADLINE`]), so a client that
/// stalls its handshake holds one slot for a while, never the endpoint.
struct TlsListener {
    ready: tokio::sync::mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl TlsListener {
    fn start(
        listener: TcpListener,
        cfg: Arc<rustls::ServerConfig>,
        tasks: &limpet_agent::runtime::Tasks,
    ) -> TlsListener {
        let local = listener.local_addr().expect("a bound listener has an address");
        let (tx, ready) = tokio::sync::mpsc::channel(MAX_HANDSHAKES);
        let acceptor = tokio_rustls::TlsAcceptor::from(cfg);
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
        let stop = tasks.token();
        let handshakes = tasks.clone();
        tasks.spawn("metrics-tls", async move {
            loop {
                let accepted = tokio::select! {
                    _ = stop.cancelled() => return,
                    a = listener.accept() => a,
                };
                let (tcp, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of descriptors, most likely: let some close.
                        tracing::warn!(%e, "metrics endpoint: accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                    tracing::debug!(%peer, "metrics endpoint: too many handshakes at once; closed");
                    continue;
                };
                let (acceptor, tx, stop) = (acceptor.clone(), tx.clone(), stop.clone());
                handshakes.spawn("metrics-handshake", async move {
                    let _slot = slot;
                    let handshake = tokio::time::timeout(HANDSHAKE_DEADLINE, acceptor.accept(tcp));
                    // A handshake left unfinished does not hold up the process's stop.
                    let done = tokio::select! {
                        () = stop.cancelled() => return,
                        done = handshake => done,
                    };
                    match done {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, %e, "metrics endpoint: client refused"),
                        Err(_) => tracing::debug!(%peer, "metrics endpoint: handshake timed out"),
                    }
                });
            }
        });
        TlsListener { ready, local }
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(c) => c,
            // The handshake task ended (shutdown): nothing more comes.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local)
    }
}

fn install() -> crate::Result<PrometheusHandle> {
    let handle = PrometheusBuilder::new().set_buckets(BUCKETS)?.install_recorder()?;
    for (name, help) in METRICS {
        // Counters end in `_total`, histograms in `_seconds`; the rest are gauges.
        if name.ends_with("_total") {
            metrics::describe_counter!(*name, *help);
        } else if name.ends_with("_seconds") {
            metrics::describe_histogram!(*name, *help);
        } else {
            metrics::describe_gauge!(*name, *help);
        }
    }
    Ok(handle)
}

/// Keeps the raft and membership gauges current from the consensus node.
pub async fn follow_consensus(handle: NodeHandle, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        if let Ok(s) = handle.status().await {
            metrics::gauge!("limpet_raft_term").set(s.term as f64);
            metrics::gauge!("limpet_raft_commit_index").set(s.commit as f64);
            metrics::gauge!("limpet_raft_applied_index").set(s.applied as f64);
            metrics::gauge!("limpet_raft_leader").set(s.leader as f64);
            metrics::gauge!("limpet_raft_is_leader").set(f64::from(u8::from(s.leader == s.id)));
        }
        let state = std::sync::Arc::clone(&handle.watch().borrow().state);
        let mut by_status = std::collections::BTreeMap::new();
        for m in state.members.values() {
            *by_status.entry(format!("{:?}", m.status).to_lowercase()).or_insert(0u32) += 1;
        }
        for status in ["joining", "active", "leaving", "draining", "failed", "gone"] {
            let n = by_status.get(status).copied().unwrap_or(0);
            metrics::gauge!("limpet_members", "status" => status).set(f64::from(n));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::METRICS;

    /// The metric names a PromQL expression uses (histogram series mapped to their metric).
    fn names_in(expr: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut rest = expr;
        while let Some(i) = rest.find("limpet_") {
            let tail = &rest[i..];
            let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
            let name = &tail[..end];
            let base =
                ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s)).unwrap_or(name);
            out.push(base.to_string());
            rest = &tail[end..];
        }
        out
    }

    #[test]
    fn the_grafana_dashboard_only_queries_metrics_limpetd_exports() {
        let dash: serde_json::Value =
            serde_json::from_str(include_str!("../../deploy/grafana/limpet.json")).expect("valid JSON");
        let known: Vec<&str> = METRICS.iter().map(|(n, _)| *n).collect();
        let mut used = Vec::new();
        let panels = dash["panels"].as_array().expect("panels");
        assert!(panels.len() >= 10);
        for p in panels {
            let targets = p["targets"].as_array().expect("every panel queries something");
            for t in targets {
                used.extend(names_in(t["expr"].as_str().expect("expr")));
            }
        }
        for name in &used {
            assert!(
                known.contains(&name.as_str()),
                "the dashboard queries {name}, which limpetd does not export"
            );
        }
        // Each headline figure of docs/operations.md has a panel.
        for name in [
            "limpet_step_seconds",
            "limpet_transitions_total",
            "limpet_data_bytes_sent_total",
            "limpet_raft_term",
        ] {
            assert!(used.iter().any(|u| u == name), "no panel shows {name}");
        }
    }

    #[test]
    fn names_are_found_in_promql() {
        let e = "histogram_quantile(0.9, sum by (le) (rate(limpet_step_seconds_bucket{job=~\"$job\"}[1m])))";
        assert_eq!(names_in(e), vec!["limpet_step_seconds"]);
        assert_eq!(
            names_in("max(limpet_epoch) + limpet_raft_term"),
            vec!["limpet_epoch", "limpet_raft_term"]
        );
    }
}
