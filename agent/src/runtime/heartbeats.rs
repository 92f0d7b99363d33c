//! Heartbeats: this agent's report (phase, step, suspect, transitions) to every member each
//! interval, and at once when the trainer asks (after a collective failure). The leader's
//! controller decides from these reports; the local copy serves `limpet status`.

use super::config::AgentConfig;
use super::tasks::Tasks;
use crate::report::AgentReport;
use limpet_consensus::state::MemberStatus;
use limpet_consensus::{Client, NodeHandle};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// Sends this agent's report to every member each interval (and at once when the trainer
/// asks, after a collective failure), and keeps it locally too.
pub(super) async fn heartbeats(
    cfg: Arc<AgentConfig>,
    handle: NodeHandle,
    progress: Arc<Mutex<AgentReport>>,
    now: Arc<Notify>,
    tasks: Tasks,
) {
    let stop = tasks.token();
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
            let budget = cfg.timing.heartbeat().max(Duration::from_millis(200));
            tasks.spawn("heartbeat-send", async move {
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
            _ = tokio::time::sleep(cfg.timing.heartbeat()) => {}
            _ = now.notified() => {}
        }
    }
}
