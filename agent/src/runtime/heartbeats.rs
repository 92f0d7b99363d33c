//! Heartbeats: this agent's report (phase, step, suspect, transitions) each interval, and at
//! once when the trainer asks (after a collective failure), to the leader, and every
//! [`STANDBY_EVERY`] intervals to the voters that may succeed it: only a leader's controller
//! reads reports, and only a voter can become leader. A new leader counts silence from its
//! election (`lead.rs`), so its standby copies need not be fresh, only there: with them it
//! decides at once instead of waiting out a timeout for ranks it never heard. A node thus
//! sends about 1 + `max_voters` / 10 reports an interval whatever the fleet's size, and a
//! voter that does not lead receives a tenth of the leader's. While no leader is known every
//! voter gets every report. The local copy serves `limpet status`.

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

/// Every how many intervals the voters that do not lead get this node's report.
pub(crate) const STANDBY_EVERY: u64 = 10;

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
    // Nodes booted together would send their standby copies in the same interval.
    let mut round: u64 = cfg.id % STANDBY_EVERY;
    loop {
        round += 1;
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
        let (leader, standby, known) = {
            let watch = handle.watch();
            let local = watch.borrow();
            let (leader, standby) = recipients(&local, cfg.id);
            // A leader whose record this node lacks is as good as none known.
            let known = leader.is_some() || local.leader == cfg.id;
            (leader, standby, known)
        };
        // Channels to nodes that no longer vote or lead are closed, so their connection slots
        // come back.
        clients.lock().await.retain(|addr, _| leader.as_ref() == Some(addr) || standby.contains(addr));
        // A collective's failure may be the leader's own: its successor hears it at once too.
        let everyone = !known || urgent || round % STANDBY_EVERY == 1;
        let targets = leader.into_iter().chain(standby.into_iter().filter(|_| everyone));
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

/// The control addresses a report goes to: the leader's (`None` while none is known, or when
/// this node leads), and the other voters' (the nodes that may lead next); this node's own
/// left out, gone members too.
fn recipients(
    local: &limpet_consensus::LocalState,
    me: limpet_consensus::state::NodeId,
) -> (Option<String>, Vec<String>) {
    let st = &local.state;
    let addr = |id: &limpet_consensus::state::NodeId| {
        st.members.get(id).filter(|m| m.status != MemberStatus::Gone).map(|m| m.spec.control_addr.clone())
    };
    let leader = if local.leader == me { None } else { addr(&local.leader) };
    let standby = st.voters.iter().filter(|&&id| id != me && id != local.leader).filter_map(addr).collect();
    (leader, standby)
}

#[cfg(test)]
mod tests {
    use super::*;
    use limpet_consensus::state::{ClusterState, Hardware, MemberSpec};

    fn local(leader: u64) -> limpet_consensus::LocalState {
        let specs: Vec<MemberSpec> = (1..=8)
            .map(|id| MemberSpec {
                id,
                name: format!("n{id}"),
                control_addr: format!("10.0.0.{id}:7400"),
                data_addr: String::new(),
                hardware: Hardware::default(),
            })
            .collect();
        let state = ClusterState::founded("c", &specs, 3);
        limpet_consensus::LocalState {
            leader,
            state: Arc::new(state),
            applied_index: 1,
            is_leader: false,
            leader_caught_up: false,
            term: 1,
        }
    }

    /// A report goes to the leader, and to the voters that do not lead apart (sent to once
    /// every `STANDBY_EVERY` intervals); a learner is sent nothing; a leader sends itself
    /// nothing; with no leader known, the voters are all there is.
    #[test]
    fn reports_go_to_the_leader_and_the_standby_voters_apart() {
        let (leader, standby) = recipients(&local(2), 7);
        assert_eq!(leader.as_deref(), Some("10.0.0.2:7400"));
        assert_eq!(standby, ["10.0.0.1:7400", "10.0.0.3:7400"]);
        let (leader, standby) = recipients(&local(2), 2);
        assert_eq!((leader, standby), (None, vec!["10.0.0.1:7400".to_string(), "10.0.0.3:7400".to_string()]));
        let (leader, standby) = recipients(&local(0), 3);
        assert_eq!((leader, standby), (None, vec!["10.0.0.1:7400".to_string(), "10.0.0.2:7400".to_string()]));
    }
}
