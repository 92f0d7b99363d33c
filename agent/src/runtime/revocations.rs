//! The revocation watcher: polls one source (a cloud's metadata service) and turns a notice
//! into a committed `Notice` command, which the leader answers with an epoch without this
//! node, timed to end before the deadline.

use crate::revocation::{Source, Watcher};
use limpet_consensus::state::{Command, NodeId};
use limpet_consensus::NodeHandle;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Polls one revocation source and turns a notice into a `Notice` command.
pub(super) async fn watch_revocations(
    id: NodeId,
    source: Source,
    poll: Duration,
    handle: NodeHandle,
    stop: CancellationToken,
) {
    let watcher = match Watcher::new(source.clone()) {
        Ok(w) => w,
        Err(e) => {
            tracing::error!(%e, "revocation source unusable");
            return;
        }
    };
    let mut told: Option<u64> = None;
    loop {
        match watcher.poll().await {
            Ok(Some(n)) if told != Some(n.deadline_ms) => {
                tracing::warn!(deadline_ms = n.deadline_ms, source = n.source, "revocation notice");
                let cmd = Command::Notice { id, deadline_ms: n.deadline_ms, source: n.source.to_string() };
                match handle.propose(cmd, Some(Duration::from_secs(3))).await {
                    Ok(_) => told = Some(n.deadline_ms),
                    Err(e) => tracing::warn!(%e, "could not record the notice; retrying"),
                }
            }
            Ok(_) => {}
            Err(e) => tracing::debug!(%e, "revocation poll failed"),
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(poll) => {}
        }
    }
}
