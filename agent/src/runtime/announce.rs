//! Announcing this node: proposes `Join` with its current addresses until the log holds them
//! (a founder's data address, a restarted node's readmission), then ends.

use limpet_consensus::state::{Command, MemberSpec, MemberStatus};
use limpet_consensus::NodeHandle;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Makes the log hold this node's current addresses (a founder's data address, a restarted
/// node's readmission): proposes `Join` until it is applied.
pub(super) async fn announce(handle: NodeHandle, me: MemberSpec, stop: CancellationToken) {
    loop {
        let known = handle.watch().borrow().state.members.get(&me.id).cloned();
        let current = known.as_ref().is_some_and(|m| m.spec == me && m.status.is_staying());
        if current {
            return;
        }
        if known.as_ref().is_some_and(|m| matches!(m.status, MemberStatus::Leaving | MemberStatus::Draining))
        {
            return;
        }
        match handle.propose(Command::Join { member: me.clone() }, Some(Duration::from_secs(2))).await {
            Ok((_, what)) => tracing::info!(node = me.id, what, "announced"),
            Err(e) => tracing::debug!(node = me.id, %e, "announce failed; retrying"),
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(300)) => {}
        }
    }
}
