//! The revocation watcher: polls one source (a cloud's metadata service) and turns a notice
//! into a committed `Notice` command, which the leader answers with an epoch without this
//! node, timed to end before the deadline. The notice also goes into this node's heartbeat
//! report the moment it is seen, so the leader plans the leave even while the command is
//! still on its way (a leader that just died drops what was forwarded to it).

use crate::report::{AgentReport, PendingNotice};
use crate::revocation::{Source, Watcher};
use limpet_consensus::state::{Command, MemberStatus, NodeId};
use limpet_consensus::NodeHandle;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// How long one try to record a notice waits for it to commit.
const PROPOSE_TRY: Duration = Duration::from_millis(400);
/// The first pause before another try (a try can also fail at once: no leader known yet).
const RETRY_PAUSE: Duration = Duration::from_millis(20);

/// Polls one revocation source and turns a notice into a `Notice` command.
pub(super) async fn watch_revocations(
    id: NodeId,
    source: Source,
    poll: Duration,
    handle: NodeHandle,
    (progress, beat_now): (Arc<Mutex<AgentReport>>, Arc<Notify>),
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
            Ok(Some(n)) if news(told, n.source, n.deadline_ms) || forgotten(told, status(&handle, id)) => {
                tracing::warn!(deadline_ms = n.deadline_ms, source = n.source, "revocation notice");
                // Said in this node's heartbeat at once: every member, the next leader too,
                // knows of it before the log does.
                let pending = PendingNotice { deadline_ms: n.deadline_ms, source: n.source.to_string() };
                progress.lock().expect("progress lock").notice = Some(pending);
                beat_now.notify_one();
                let cmd = Command::Notice { id, deadline_ms: n.deadline_ms, source: n.source.to_string() };
                if record(&handle, cmd, &stop).await {
                    told = Some((n.source, n.deadline_ms));
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

/// Proposes `cmd` until it commits, the log refuses it or the agent stops; whether it
/// committed. A proposal forwarded to a leader that just died is lost without an answer:
/// waiting out a long timeout (and then the next poll) let lesser changes take the next
/// epochs while the deadline ran. A notice is idempotent in the log, so it is proposed again
/// soon (each try bounded; pauses growing to a second), and the new leader takes the next.
async fn record(handle: &NodeHandle, cmd: Command, stop: &CancellationToken) -> bool {
    let mut pause = RETRY_PAUSE;
    for tries in 1u32.. {
        match handle.propose(cmd.clone(), Some(PROPOSE_TRY)).await {
            Ok(_) => return true,
            Err(e) if e.is_retryable() => {
                if tries == 1 || tries % 10 == 0 {
                    tracing::warn!(%e, tries, "could not record the notice yet; proposing again");
                }
            }
            Err(e) => {
                tracing::warn!(%e, "the log refused the notice");
                return false;
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return false,
            _ = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(Duration::from_secs(1));
    }
    false
}

/// This node's status in the log, if it is a member.
fn status(handle: &NodeHandle, id: NodeId) -> Option<MemberStatus> {
    handle.watch().borrow().state.members.get(&id).map(|m| m.status)
}

/// Whether the log no longer holds a notice recorded before (`told`): the member is staying
/// again, as a `Join` this node proposed at start-up makes it when the log applies it after
/// the notice. The host is still going away, so the notice is proposed again.
fn forgotten(told: Option<(&str, u64)>, status: Option<MemberStatus>) -> bool {
    told.is_some()
        && matches!(status, Some(MemberStatus::Joining | MemberStatus::Active | MemberStatus::Draining))
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
    use super::{forgotten, news};
    use limpet_consensus::state::MemberStatus;

    #[test]
    fn a_notice_the_log_lost_is_proposed_again() {
        let told = Some(("aws", 1200));
        for staying in [MemberStatus::Joining, MemberStatus::Active, MemberStatus::Draining] {
            assert!(forgotten(told, Some(staying)), "{staying:?}");
        }
        for gone in [MemberStatus::Leaving, MemberStatus::Failed, MemberStatus::Gone] {
            assert!(!forgotten(told, Some(gone)), "{gone:?}");
        }
        // Nothing recorded yet, or not a member (yet): nothing to propose again.
        assert!(!forgotten(None, Some(MemberStatus::Active)));
        assert!(!forgotten(told, None));
    }

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
