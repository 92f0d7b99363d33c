//! What a rank's trainer loop does next, given the committed log and where the rank stands:
//! train, connect the next epoch early, enter it (at its boundary, or at once after a failed
//! collective or as a newcomer), sit out, finish the job's steps, wait, or leave once the
//! node is removed. The agent's `runtime::train_loop` asks before every step and does it.

use crate::report::Phase;
use limpet_consensus::state::{ClusterState, Epoch, MemberStatus, NodeId};

/// Where this rank stands, as [`next_action`] needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Position {
    /// The epoch this rank trains in (`None`: in no group).
    pub epoch: Option<u64>,
    /// The next step it would train.
    pub step: u64,
    /// Its last collective failed (it waits for the next epoch).
    pub broken: bool,
    /// This process saw the log count the node as a member (joining or active).
    pub was_member: bool,
    /// The job's last step (training ends there).
    pub job_steps: u64,
}

/// What the trainer loop does next.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// The node was removed from the cluster after leaving: its work is done.
    Removed(String),
    /// Enter this epoch now.
    Enter(Epoch),
    /// The next epoch goes on without this rank: leave training (`u64`: its id).
    SitOut(u64),
    /// Nothing to train: report `phase` and wait for the log to change.
    Wait {
        /// The phase to report.
        phase: Phase,
        /// How long to wait at most, ms.
        ms: u64,
    },
    /// The job's steps are done: write the final checkpoint (once) and wait.
    Finish {
        /// A next epoch to connect ahead of its boundary meanwhile.
        connect_ahead: Option<Epoch>,
    },
    /// Train one step in the current epoch.
    Train {
        /// A next epoch to connect ahead of its boundary first.
        connect_ahead: Option<Epoch>,
    },
}

/// What node `me` at `at` does next, given the cluster state `st`. Pure.
pub fn next_action(st: &ClusterState, me: NodeId, at: Position) -> Action {
    // A removed node stays until the log no longer counts it as a voter: leaving earlier
    // could take the voters below a majority. One that starts out gone (restarted after a
    // drain) waits to be admitted again instead. A member's record is only ever dropped long
    // after it left (the state keeps a bounded past), so one this process saw as a member
    // and no longer finds has left too.
    let left = match st.members.get(&me) {
        Some(m) => (m.status == MemberStatus::Gone).then(|| m.reason.clone()),
        None => Some("left the cluster (its record since dropped)".to_string()),
    };
    if let Some(why) = left {
        if at.was_member && at.epoch.is_none() && !st.voters.contains(&me) {
            return Action::Removed(why);
        }
    }
    let newest = [st.current.as_ref(), st.scheduled.as_ref()].into_iter().flatten().max_by_key(|e| e.id);
    let mut connect_ahead = None;
    if let Some(n) = newest.filter(|n| n.id > at.epoch.unwrap_or(0)) {
        let at_boundary = at.step >= n.start_step;
        if n.ranks.contains(&me) {
            if at.epoch.is_none() || at.broken || at_boundary {
                return Action::Enter(n.clone());
            }
            connect_ahead = Some(n.clone());
        } else if at.epoch.is_some() && (at.broken || at_boundary) {
            return Action::SitOut(n.id);
        }
    }
    if at.epoch.is_none() {
        let leaving = st.members.get(&me).is_some_and(|m| !m.status.is_staying());
        return Action::Wait { phase: if leaving { Phase::Left } else { Phase::Waiting }, ms: 100 };
    }
    if at.broken {
        return Action::Wait { phase: Phase::Waiting, ms: 50 };
    }
    if at.step >= at.job_steps {
        return Action::Finish { connect_ahead };
    }
    Action::Train { connect_ahead }
}
