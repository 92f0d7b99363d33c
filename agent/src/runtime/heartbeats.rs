//! Heartbeats: this agent's report (phase, step, suspect, transitions) each interval, and at
//! once when the trainer asks (after a collective failure), to the leader and to the voters
//! that may succeed it: only a leader's controller reads reports, and only a voter can become
//! leader, so a node sends at most `max_voters` + 1 reports an interval whatever the fleet's
//! size, and receives reports only while it votes. The local copy serves `limpet status`.

use super::config::ControlConfig;
use super::tasks::Tasks;
use crate::dataplane::endpoint::Endpoint;
use crate::report::AgentReport;
use limpet_consensus::state::MemberStatus;
use limpet_consensus::{Client, NodeHandle};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// How long a peer that refused this node's data connection is named in its reports.
const REFUSED_NEWS: Duration = Duration::from_secs(2);

/// Sends this agent's report to the leader and the voters each interval (and at once when
/// the trainer asks, after a collective failure), and keeps it locally too.
pub(super) async fn heartbeats(
    cfg: Arc<ControlConfig>,
    handle: NodeHandle,
    (progress, endpoint): (Arc<Mutex<AgentReport>>, Arc<Endpoint>),
    now: Arc<Notify>,
    tasks: Tasks,
) {
    let stop = tasks.token();
    let clients: Arc<tokio::sync::Mutex<HashMap<String, Client>>> = Arc::default();
    // Whether this round was asked for at once; such a round is urgent (the leader reads the
    // reports at once instead of at its next round) only for a collective failure not sent
    // as urgent before: a notice or an epoch entered waits for the round, so a fleet's
    // transition does not run the leader's round once a report.
    let mut at_once = false;
    let mut last_urgent = None;
    loop {
        let readers_take_it = voters_read_refused(&handle.watch().borrow().state);
        let (report, broken) = {
            let mut p = progress.lock().expect("progress lock");
            p.refused = if readers_take_it { endpoint.refused_lately(REFUSED_NEWS) } else { Vec::new() };
            p.refused.truncate(crate::leader::MAX_REFUSED_NAMED);
            (p.encode(), p.broken.as_ref().map(|b| (b.epoch, b.suspect)))
        };
        let urgent = at_once && broken.is_some() && broken != last_urgent;
        handle.reports().put(cfg.id, report.clone());
        if urgent {
            last_urgent = broken;
            handle.reports().mark_urgent(cfg.id);
        }
        let targets = recipients(&handle.watch().borrow(), cfg.id);
        // Channels to nodes that no longer vote or lead are closed, so their connection slots
        // come back.
        clients.lock().await.retain(|addr, _| targets.contains(addr));
        for addr in targets {
            let (addr, report, clients, cluster, me, tls) =
                (addr, report.clone(), Arc::clone(&clients), cfg.cluster.clone(), cfg.id, cfg.tls.clone());
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
                    c.heartbeat(me, report, urgent).await
                };
                match tokio::time::timeout(budget, send).await {
                    Ok(Ok(())) => {}
                    _ => {
                        clients.lock().await.remove(&addr);
                    }
                }
            });
        }
        at_once = tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(cfg.timing.heartbeat()) => false,
            _ = now.notified() => true,
        };
    }
}

/// Whether every voter (the leader among them) reads a report's `refused` peers: an older
/// agent refuses a report with a field it does not know, and would take the sender for silent.
fn voters_read_refused(st: &limpet_consensus::state::ClusterState) -> bool {
    st.voters.iter().all(|v| st.members.get(v).is_some_and(|m| m.spec.hardware.refused_reports))
}

/// The control addresses a report goes to: the leader's and every voter's (the nodes that
/// may lead next), this node's own left out, gone members too.
fn recipients(local: &limpet_consensus::LocalState, me: limpet_consensus::state::NodeId) -> Vec<String> {
    let st = &local.state;
    let mut ids: Vec<_> = st.voters.clone();
    ids.push(local.leader);
    ids.sort_unstable();
    ids.dedup();
    ids.into_iter()
        .filter(|&id| id != me)
        .filter_map(|id| st.members.get(&id))
        .filter(|m| m.status != MemberStatus::Gone)
        .map(|m| m.spec.control_addr.clone())
        .collect()
}
