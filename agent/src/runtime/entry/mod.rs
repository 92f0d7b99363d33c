//! Entering an epoch: a small protocol on the new group. Every rank publishes its states
//! (`limpet_decide::entry::wire`), the ranks allgather them, every rank computes the same
//! plan (`limpet_decide::entry::plan`, pure): the
//! step the epoch starts at and who copies what from whom. Ranks that differ from the
//! source (a newcomer, a laggard that did not apply the step in flight, a diverged copy, a
//! stage whose host died) fetch state before a barrier, so every rank starts the epoch with
//! a bit-identical state, checked, not assumed. `execute` runs the plan with the trainer's
//! state; this module has the protocol's steps that need no trainer (the lab's synthetic
//! agents enter by them too): the ranks' addresses, the group (formed now, or from the
//! connections made ahead of the boundary: `connect_ahead`), the allgather of published
//! states, who survived, and a state's fetch.

pub(in crate::runtime) mod abandon;
#[cfg(feature = "trainer")]
mod execute;

#[cfg(feature = "trainer")]
pub(super) use execute::{enter, Conn, Entering, Torn};

use super::error::AgentError;
use crate::dataplane::frame::Channel;
use crate::dataplane::handoff::HandoffDialer;
use crate::{Endpoint, Group};
use limpet_consensus::state::{ClusterState, Epoch};
use limpet_decide::entry::{plan::RankState, wire};
use limpet_snapshot::handoff::{fetch, FetchOptions};
use limpet_snapshot::StateImage;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The frame step marker of the entry protocol's collectives (no training step uses it).
pub(in crate::runtime) const ENTRY_STEP: u64 = u64::MAX;

/// How long a rank waits at an entry for its peers (a newcomer that enters early waits for
/// the survivors to reach the boundary), unless the epoch is replaced or the agent stops.
pub(in crate::runtime) const ENTRY_WAIT: Duration = Duration::from_secs(120);

/// Ring connections of an epoch not entered yet.
pub(in crate::runtime) struct Pending {
    epoch: u64,
    right: Option<crate::dataplane::Conn>,
    left: Option<crate::dataplane::Conn>,
}

/// The data addresses of an epoch's ranks, in rank order.
pub(in crate::runtime) fn addrs_of(st: &ClusterState, n: &Epoch) -> Result<Vec<String>, AgentError> {
    let addrs: Vec<String> = n
        .ranks
        .iter()
        .map(|r| st.members.get(r).map(|m| m.spec.data_addr.clone()).unwrap_or_default())
        .collect();
    if addrs.iter().any(String::is_empty) {
        return Err(AgentError::entry(format!("epoch {}: a rank has no data address yet", n.id)));
    }
    Ok(addrs)
}

/// Connects the next epoch's ring while the current one still trains, without ever
/// waiting: the connection to the right neighbour is made once (its endpoint answers the
/// handshake on its own threads), the left neighbour's is picked up whenever it has
/// arrived. So the boundary itself costs only the state check.
pub(in crate::runtime) fn connect_ahead(
    pending: &mut Option<Pending>,
    endpoint: &Endpoint,
    n: &Epoch,
    addrs: &[String],
) {
    if pending.as_ref().is_some_and(|p| p.epoch != n.id) {
        *pending = None;
    }
    let Ok((right, left)) = Group::neighbours(endpoint, &n.ranks, addrs) else { return };
    if pending.is_none() {
        let out = match right {
            None => None,
            Some(r) => {
                let soon = Instant::now() + Duration::from_millis(200);
                match endpoint.connect_until(&addrs[r], n.ranks[r], n.id, Channel::Ring, soon, &|| false) {
                    Ok(s) => Some(s),
                    Err(e) => {
                        tracing::debug!(epoch = n.id, %e, "could not connect the next epoch early");
                        return;
                    }
                }
            }
        };
        *pending = Some(Pending { epoch: n.id, right: out, left: None });
    }
    let p = pending.as_mut().expect("set above");
    if let (None, Some(l)) = (&p.left, left) {
        p.left = endpoint.accept_until(n.ranks[l], n.id, Channel::Ring, Instant::now(), &|| false).ok();
    }
}

/// Every rank's state in rank order, through one allgather of their wire records; a
/// record a peer got wrong fails the entry naming that peer.
pub(in crate::runtime) fn exchange_states(
    group: &mut Group,
    mine: &RankState,
    n: &Epoch,
    nb: usize,
) -> Result<Vec<RankState>, AgentError> {
    let words = wire::encode(mine);
    let mut all = vec![0f32; words.len() * n.ranks.len()];
    group.allgather(&words, &mut all, ENTRY_STEP)?;
    all.chunks(words.len())
        .enumerate()
        .map(|(i, w)| wire::decode(w, nb).map_err(|e| AgentError::entry(format!("node {}: {e}", n.ranks[i]))))
        .collect()
}

/// Which of `n`'s ranks trained in the epoch before it (the newest started one): what the
/// entry plan weighs one survivor's published state against.
pub(in crate::runtime) fn survivors_of(st: &ClusterState, n: &Epoch) -> Vec<bool> {
    let before = st.history.iter().filter(|e| e.id < n.id).max_by_key(|e| e.id);
    n.ranks.iter().map(|r| before.is_some_and(|e| e.ranks.contains(r))).collect()
}

/// The epoch's ring: from the connections made ahead of the boundary where there are
/// some, else formed now (waiting for peers until `by` or `give_up`).
pub(in crate::runtime) fn form_group(
    endpoint: &Arc<Endpoint>,
    pending: Option<Pending>,
    n: &Epoch,
    addrs: &[String],
    (by, give_up): (Instant, &dyn Fn() -> bool),
    tree: bool,
) -> Result<Group, AgentError> {
    match pending {
        Some(p) if p.epoch == n.id => {
            let (_, left) = Group::neighbours(endpoint, &n.ranks, addrs)?;
            let left = match (p.left, left) {
                (Some(s), _) => Some(s),
                (None, Some(l)) => {
                    Some(endpoint.accept_until(n.ranks[l], n.id, Channel::Ring, by, give_up)?)
                }
                (None, None) => None,
            };
            let group = Group::assemble(endpoint, n.id, &n.ranks, p.right, left)?;
            Ok(group.with_tree(endpoint, addrs, (by, give_up), tree)?)
        }
        _ => endpoint.group_until_with(n.id, &n.ranks, addrs, (by, give_up), tree).map_err(AgentError::from),
    }
}

/// Fetches the state offered under `label` by `source` (`node@addr`): the image and the
/// bytes moved.
pub(in crate::runtime) fn fetch_state(
    endpoint: &Arc<Endpoint>,
    epoch: u64,
    source: &str,
    label: [u8; 32],
    max_bytes: u64,
) -> Result<(StateImage, u64), AgentError> {
    let opts = FetchOptions { expect: Some(label), max_bytes, ..FetchOptions::default() };
    let dialer = HandoffDialer { endpoint, epoch };
    let (bytes, stats) = fetch(&dialer, &[source.to_string()], &opts)?;
    crate::dataplane::count_bytes(false, "handoff", stats.bytes);
    Ok((StateImage::decode(&bytes)?, stats.bytes))
}
