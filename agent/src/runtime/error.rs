//! The running agent's errors, typed by what the agent does about them. A [`Retryable`]
//! one ends the attempt: a group whose collective broke (the step waits for the next
//! epoch), an entry whose peers did not come, whose state did not arrive or verify, or whose
//! published states do not allow a plan yet (the trainer loop waits for the log to change and
//! tries again). A [`Fatal`] one stops this agent with an error, and systemd restarts it;
//! but for [`Fatal::Job`] (this node's `[job]` is not the cluster's) and [`Fatal::DeviceClass`]
//! (a reproducible job of another class of device), whose exit status (64,
//! `limpet_daemon::failure`) tells systemd a restart would only repeat it.
//!
//! The class is decided once, where an error becomes an [`AgentError`] (its `From`
//! conversions): a trainer's failed collective is retryable, any other trainer error fatal. So
//! a caller matches `AgentError::Retry` or propagates, and never has to know which variants
//! of which source to pick out first.

use crate::DataPlaneError;
use limpet_consensus::state::NodeId;
use limpet_snapshot::handoff::HandoffError;
use limpet_snapshot::SnapshotError;
#[cfg(feature = "trainer")]
use limpet_trainer::TrainerError;

/// What went wrong in the running agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// Ends this attempt; the agent goes on.
    #[error(transparent)]
    Retry(Retryable),
    /// Stops the agent.
    #[error(transparent)]
    Fatal(Fatal),
}

/// A failure between ranks: the attempt (a group's step, an entry) ends, the agent goes on.
#[derive(Debug, thiserror::Error)]
pub enum Retryable {
    /// The data plane failed (a peer closed, went silent, or broke the protocol).
    #[error(transparent)]
    DataPlane(#[from] DataPlaneError),
    /// A collective or pipeline link failed inside the trainer's step.
    #[error("{error}")]
    Collective {
        /// The peer the transport blames, when it knows one.
        suspect: Option<NodeId>,
        /// What failed.
        error: String,
        /// A peer's bytes broke the protocol (a bug or a hostile peer), not the network.
        violation: bool,
    },
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
}

impl Retryable {
    /// The peer to blame and whether it broke the protocol, when this broke a group.
    pub fn blame(&self) -> (Option<NodeId>, bool) {
        match self {
            Retryable::DataPlane(e) => (e.suspect(), e.is_violation()),
            Retryable::Collective { suspect, violation, .. } => (*suspect, *violation),
            _ => (None, false),
        }
    }
}

/// A failure of this agent: it stops.
#[derive(Debug, thiserror::Error)]
pub enum Fatal {
    /// The trainer failed on this rank (other than a collective between ranks).
    #[cfg(feature = "trainer")]
    #[error(transparent)]
    Trainer(TrainerError),
    /// This node's `[job]` is not the job the cluster's log holds: it cannot train with it.
    #[error("this node's [job] is not the cluster's: {0} (ours vs the log's; every node of a cluster trains the job its first leader set)")]
    Job(String),
    /// The cluster's reproducible job was set on another class of device than this host's.
    #[error("{0}")]
    DeviceClass(String),
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
    #[cfg(feature = "trainer")]
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
        matches!(self, AgentError::Fatal(_))
    }

    /// An entry that cannot go on (yet): retryable.
    pub fn entry(why: impl Into<String>) -> AgentError {
        AgentError::Retry(Retryable::Entry(why.into()))
    }

    /// A local file or thread that could not be made: fatal.
    pub fn io(what: impl Into<String>, source: std::io::Error) -> AgentError {
        AgentError::Fatal(Fatal::Io { what: what.into(), source })
    }
}

impl From<Retryable> for AgentError {
    fn from(e: Retryable) -> Self {
        AgentError::Retry(e)
    }
}

impl From<Fatal> for AgentError {
    fn from(e: Fatal) -> Self {
        AgentError::Fatal(e)
    }
}

#[cfg(feature = "trainer")]
impl From<TrainerError> for AgentError {
    /// A collective between ranks that failed is retryable; the trainer failing otherwise
    /// (its configuration, a peer's state it refused, a full disk) is fatal.
    fn from(e: TrainerError) -> Self {
        match e {
            TrainerError::Reduce { peer, violation, .. } => {
                let error = e.to_string();
                AgentError::Retry(Retryable::Collective { suspect: peer, error, violation })
            }
            e => AgentError::Fatal(Fatal::Trainer(e)),
        }
    }
}

/// Errors of a source whose class is fixed.
macro_rules! class {
    ($class:ident: $($t:ty),*) => {$(
        impl From<$t> for AgentError {
            fn from(e: $t) -> Self {
                AgentError::$class(e.into())
            }
        }
    )*};
}

class!(Retry: DataPlaneError, HandoffError, SnapshotError, limpet_decide::DecideError);
class!(Fatal: limpet_consensus::ConsensusError, limpet_consensus::tasks::TaskFailed, crate::checkpoint::CheckpointError);

#[cfg(all(test, feature = "trainer"))]
mod tests {
    use super::*;

    #[test]
    fn failures_of_this_rank_are_fatal_and_failures_between_ranks_are_not() {
        assert!(AgentError::from(TrainerError::Config("x".into())).is_fatal());
        assert!(AgentError::io("the step log", std::io::Error::other("disk full")).is_fatal());
        assert!(AgentError::from(Fatal::Job("steps: 2 vs 1".into())).is_fatal());
        assert!(!AgentError::from(DataPlaneError::Protocol("bad frame".into())).is_fatal());
        assert!(!AgentError::entry("node 3 does not hash to what it announced").is_fatal());
        // A collective the trainer ran between ranks is the group's failure, not this rank's,
        // and keeps the peer it names.
        let reduce = TrainerError::Reduce { peer: Some(3), detail: "peer 3 closed".into(), violation: true };
        match AgentError::from(reduce) {
            AgentError::Retry(r @ Retryable::Collective { .. }) => {
                assert_eq!(r.blame(), (Some(3), true));
                assert_eq!(r.to_string(), "gradient reduce failed: peer 3 closed");
            }
            other => panic!("{other:?}"),
        }
    }
}
