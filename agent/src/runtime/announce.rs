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
        let current = known.as_ref().is_some_and(|m| says(&m.spec, &me) && m.status.is_staying());
        if current {
            return;
        }
        if known.as_ref().is_some_and(|m| matches!(m.status, MemberStatus::Leaving | MemberStatus::Draining))
        {
            return;
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
