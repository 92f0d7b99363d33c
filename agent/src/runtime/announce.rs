//! Announcing this node: proposes `Join` with its current addresses until the log holds them
//! (a founder's data address, a restarted node's readmission); then, for the node's life,
//! asks again whenever the log marks it failed while it trains (it was slow, or cut off, not
//! dead: a live host is never out for good), backing off from one second to a minute.

use limpet_consensus::state::{Command, MemberSpec, MemberStatus};
use limpet_consensus::NodeHandle;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Makes the log hold this node's current addresses (a founder's data address, a restarted
/// node's readmission): proposes `Join` until it is applied. Then watches the log: marked
/// failed while this process lives, the node proposes `Join` again and comes back as a
/// newcomer (copying state from live ranks at its next epoch).
pub(super) async fn announce(handle: NodeHandle, me: MemberSpec, stop: CancellationToken) {
    let mut watch = handle.watch();
    let mut admitted = false;
    // The status the log gave this node before the newest change: only a node failed while
    // it was joining or active comes back (one failed on its way out, drained or noticed,
    // stays out), and not more often than the backoff allows (a flapping host costs its
    // cluster two epochs a time).
    let mut before: Option<MemberStatus> = None;
    let mut backoff = REJOIN_BACKOFF_MIN;
    let mut last_rejoin: Option<tokio::time::Instant> = None;
    loop {
        let known = handle.watch().borrow().state.members.get(&me.id).cloned();
        let status = known.as_ref().map(|m| m.status);
        let current = known.as_ref().is_some_and(|m| says(&m.spec, &me) && m.status.is_staying());
        // Leaving, draining or removed (after leaving) are the node's own way out; before it
        // was admitted, a failed or gone record is an earlier life's, which it replaces.
        let out = matches!(status, Some(MemberStatus::Leaving | MemberStatus::Draining))
            || (admitted && status == Some(MemberStatus::Gone));
        let failed_in_training = status == Some(MemberStatus::Failed)
            && matches!(before, Some(MemberStatus::Joining | MemberStatus::Active));
        let due = !current && !out && (!admitted || failed_in_training);
        if current {
            admitted = true;
        }
        if status != Some(MemberStatus::Failed) {
            before = status;
        }
        if due && admitted {
            if let Some(wait) =
                last_rejoin.map(|t| (t + backoff).saturating_duration_since(tokio::time::Instant::now()))
            {
                if !wait.is_zero() {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(wait) => {}
                    }
                }
                backoff = (backoff * 2).min(REJOIN_BACKOFF_MAX);
            }
            last_rejoin = Some(tokio::time::Instant::now());
        }
        if !due {
            tokio::select! {
                _ = stop.cancelled() => return,
                changed = watch.changed() => if changed.is_err() { return },
            }
            continue;
        }
        if admitted {
            tracing::warn!(
                node = me.id,
                "the log marks this running node failed; asking to be admitted again"
            );
        }
        let member = to_announce(known.as_ref().map(|m| &m.spec), &me);
        match handle.propose(Command::Join { member }, Some(Duration::from_secs(2))).await {
            Ok((_, what)) => tracing::info!(node = me.id, what, "announced"),
            Err(e) => tracing::debug!(node = me.id, %e, "announce failed; retrying"),
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(300)) => {}
        }
    }
}

/// The least time between two rejoins of a node the log marked failed while it ran; it
/// doubles with each, up to [`REJOIN_BACKOFF_MAX`].
const REJOIN_BACKOFF_MIN: Duration = Duration::from_secs(1);
/// The most.
const REJOIN_BACKOFF_MAX: Duration = Duration::from_secs(60);

/// Whether the log's `record` of this node says what it announces (`me`): all of it but the
/// speed the leader measured (`Hardware::speed_milli`), which the node's own word does not
/// know. Comparing that too made the node and the leader overwrite each other's record every
/// 300 ms once the leader had measured the node (a refresh put 0 back, the leader its figure
/// again), and the leader re-plan a pipeline each time.
fn says(record: &MemberSpec, me: &MemberSpec) -> bool {
    *record == to_announce(Some(record), me)
}

/// What this node proposes: `me`, keeping the speed the leader recorded for it, if any, so a
/// refresh (new addresses, a restart) does not undo the measurement.
fn to_announce(record: Option<&MemberSpec>, me: &MemberSpec) -> MemberSpec {
    let mut member = me.clone();
    if let Some(r) = record {
        member.hardware.speed_milli = r.hardware.speed_milli;
    }
    member
}

#[cfg(test)]
mod tests {
    use super::*;
    use limpet_consensus::state::Hardware;

    fn me() -> MemberSpec {
        MemberSpec {
            id: 2,
            name: "node-2".into(),
            control_addr: "127.0.0.1:1".into(),
            data_addr: "127.0.0.1:2".into(),
            hardware: Hardware { cpus: 2, ranks: 1, ..Hardware::default() },
        }
    }

    #[test]
    fn the_leaders_measured_speed_is_not_announced_over() {
        let mut measured = me();
        measured.hardware.speed_milli = 350;
        assert!(
            says(&measured, &me()),
            "the record differs from the announcement only in the leader's figure"
        );
        assert_eq!(to_announce(Some(&measured), &me()).hardware.speed_milli, 350);
        assert_eq!(to_announce(None, &me()), me());
        // Anything of the node's own word that differs is announced again, the speed kept.
        let mut moved = me();
        moved.data_addr = "127.0.0.1:3".into();
        assert!(!says(&measured, &moved));
        let again = to_announce(Some(&measured), &moved);
        assert_eq!((again.data_addr.as_str(), again.hardware.speed_milli), ("127.0.0.1:3", 350));
        let mut fewer = me();
        fewer.hardware.ranks = 2;
        assert!(!says(&measured, &fewer), "a changed device count is announced");
    }
}
