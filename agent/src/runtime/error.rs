//! The running agent's errors, kept apart by what the agent does about them. *Transient*
//! ones (an entry whose peers did not come, a peer's state that did not arrive or did not
//! verify, a plan the published states do not allow yet) end the attempt: the trainer loop
//! waits for the log to change and tries the next epoch. *Fatal* ones (the trainer itself
//! failed, a local file could not be written, a task failed) stop this agent with an error,
//! and systemd restarts it; but for `Job` (this node's `[job]` is not the cluster's), whose
//! exit status (64, `limpet_daemon::failure`) tells systemd a restart would only repeat it.

use crate::DataPlaneError;
use limpet_snapshot::handoff::HandoffError;
use limpet_snapshot::SnapshotError;
use limpet_trainer::TrainerError;

/// What went wrong in the running agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The data plane failed (a peer closed, went silent, or broke the protocol).
    #[error(transparent)]
    DataPlane(#[from] DataPlaneError),
    /// A state handoff from a peer failed.
    #[error("state handoff: {0}")]
    Handoff(#[from] HandoffError),
    /// A state image did not decode or verify.
    #[error("state image: {0}")]
    Image(#[from] SnapshotError),
    /// What the ranks published does not allow entering the epoch (yet), or a peer's state
    /// is not what it announced.
    #[error("{0}")]
    Entry(String),
    /// What the ranks published cannot be used: a malformed record, or no copy of a block.
    #[error(transparent)]
    Decide(#[from] limpet_decide::DecideError),
    /// The trainer failed on this rank.
    #[error(transparent)]
    Trainer(#[from] TrainerError),
    /// This node's `[job]` is not the job the cluster's log holds: it cannot train with it.
    #[error("this node's [job] is not the cluster's: {0} (ours vs the log's; every node of a cluster trains the job its first leader set)")]
    Job(String),
    /// The consensus node could not start or be asked (at start-up, or a drain).
    #[error(transparent)]
    Consensus(#[from] limpet_consensus::ConsensusError),
    /// A task or thread of the agent failed beyond repair (the first one's failure).
    #[error(transparent)]
    Task(#[from] limpet_consensus::tasks::TaskFailed),
    /// The trainer thread did not end within the shutdown limit after a stop.
    #[error("the trainer did not stop within {limit:?}{}", after.as_ref().map_or(String::new(), |f| format!(" (after {f})")))]
    Stuck {
        /// The shutdown limit.
        limit: std::time::Duration,
        /// The failure that stopped the agent, if one did.
        after: Option<limpet_consensus::tasks::TaskFailed>,
    },
    /// Checkpoints could not be listed, read or fetched, or their directory is not trusted.
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    /// The checkpoint a new cluster resumes from could not be looked for (yet).
    #[error("{during}: {source}")]
    Resume {
        /// What was being done.
        during: &'static str,
        /// What failed.
        source: crate::checkpoint::CheckpointError,
    },
    /// One of limpet's own records did not encode (a bug).
    #[error("encoding {what}: {source}")]
    Encode {
        /// The record.
        what: &'static str,
        /// serde's error.
        source: serde_json::Error,
    },
    /// The job's result could not be written (where `limpet-lab demo` and operators find it).
    #[error("writing the final checkpoint: {0}")]
    FinalCheckpoint(#[source] TrainerError),
    /// A local file could not be written.
    #[error("{what}: {source}")]
    Io {
        /// What was being written.
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
}

impl AgentError {
    /// Whether this error stops the agent (as opposed to ending one attempt).
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            AgentError::Trainer(_)
                | AgentError::Io { .. }
                | AgentError::Job(_)
                | AgentError::Consensus(_)
                | AgentError::Task(_)
                | AgentError::Stuck { .. }
                | AgentError::Checkpoint(_)
                | AgentError::FinalCheckpoint(_)
                | AgentError::Resume { .. }
                | AgentError::Encode { .. }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_of_this_rank_are_fatal_and_failures_between_ranks_are_not() {
        assert!(AgentError::from(TrainerError::Config("x".into())).is_fatal());
        let io = AgentError::Io { what: "the step log".into(), source: std::io::Error::other("disk full") };
        assert!(io.is_fatal());
        assert!(AgentError::Job("steps: 2 vs 1".into()).is_fatal());
        assert!(!AgentError::from(DataPlaneError::Protocol("bad frame".into())).is_fatal());
        assert!(!AgentError::Entry("node 3 does not hash to what it announced".into()).is_fatal());
    }
}
