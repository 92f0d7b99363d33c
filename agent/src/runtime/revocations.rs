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
    let mut told: Option<(&'static str, u64)> = None;
    loop {
        match watcher.poll().await {
            Ok(Some(n)) if news(told, n.source, n.deadline_ms) => {
                tracing::warn!(deadline_ms = n.deadline_ms, source = n.source, "revocation notice");
                let cmd = Command::Notice { id, deadline_ms: n.deadline_ms, source: n.source.to_string() };
                match handle.propose(cmd, Some(Duration::from_secs(3))).await {
                    Ok(_) => told = Some((n.source, n.deadline_ms)),
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

/// Whether a notice is news after `told` (the source and deadline last recorded): another
/// source (a rebalance recommendation, then the interruption itself) or a sooner deadline.
/// A rebalance recommendation's deadline is "two minutes from now" at every poll, so going by
/// the deadline alone would propose it again every poll.
fn news(told: Option<(&str, u64)>, source: &str, deadline_ms: u64) -> bool {
    told.is_none_or(|(s, d)| s != source || deadline_ms < d)
}

#[cfg(test)]
mod tests {
    use super::news;

    #[test]
    fn a_notice_is_proposed_once_unless_it_changes() {
        assert!(news(None, "aws-rebalance", 1000));
        // The same recommendation, seen again with a later "now + 2 min": not news.
        assert!(!news(Some(("aws-rebalance", 1000)), "aws-rebalance", 1500));
        // The interruption notice after the recommendation is.
        assert!(news(Some(("aws-rebalance", 1000)), "aws", 1200));
        assert!(!news(Some(("aws", 1200)), "aws", 1200));
        // A sooner deadline from the same source is.
        assert!(news(Some(("aws", 1200)), "aws", 900));
    }
}
