//! The consensus crate's one error type. Fatal errors (storage, corruption) stop the node;
//! the rest are answers a caller can act on (retry, find the leader, fix the request).

use std::time::Duration;

/// Everything that can go wrong in the control plane.
#[derive(Debug, thiserror::Error)]
pub enum ConsensusError {
    /// The sled database failed; the node must stop rather than lose acknowledged writes.
    #[error("storage failure in {path}: {detail}")]
    Storage {
        /// The state directory.
        path: String,
        /// What sled said.
        detail: String,
    },
    /// A stored record does not decode or contradicts the others.
    #[error("corrupted state in {path}: {what}: {detail}")]
    Corrupt {
        /// The state directory.
        path: String,
        /// Which record.
        what: String,
        /// What is wrong with it.
        detail: String,
    },
    /// The state directory belongs to another cluster or node.
    #[error("{path} belongs to {found}, but this node is {expected}")]
    WrongIdentity {
        /// The state directory.
        path: String,
        /// What the directory says.
        found: String,
        /// What the configuration says.
        expected: String,
    },
    /// raft-rs refused an operation.
    #[error("raft: {0}")]
    Raft(#[from] raft::Error),
    /// Bytes from the network or a caller did not decode.
    #[error("could not decode {what}: {detail}")]
    Decode {
        /// Which document.
        what: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// A request named another cluster.
    #[error("request for cluster {got}; this node serves cluster {serves}")]
    WrongCluster {
        /// This node's cluster, named (quoted), or its id where the name is not known.
        serves: String,
        /// The request's cluster, named as the request names it (quoted), else its id.
        got: String,
    },
    /// A leader's decision reached raft after this node stopped leading its term.
    #[error("no longer the leader of term {term}: the new leader decides")]
    Deposed {
        /// The term the decision was made in.
        term: u64,
    },
    /// The request must be made at the leader, and this node does not lead: `addr` is the
    /// leader's control address where known (the client asks there).
    #[error("node {me} does not lead; ask the leader, node {leader} at {addr:?}")]
    NotLeader {
        /// The node that answered.
        me: u64,
        /// The leader it knows.
        leader: u64,
        /// The leader's control address ("" when not known).
        addr: String,
    },
    /// No leader is known, so the request cannot be served now.
    #[error("no leader is known yet; retry")]
    NoLeader,
    /// The request was not served in time (it may still take effect).
    #[error("timed out after {waited:?} waiting for {what}")]
    Timeout {
        /// How long.
        waited: Duration,
        /// What for.
        what: &'static str,
    },
    /// The state machine refused the command.
    #[error("command rejected: {0}")]
    Rejected(String),
    /// The node is stopping.
    #[error("the node is shutting down")]
    Shutdown,
    /// Bad configuration.
    #[error("configuration: {0}")]
    Config(String),
    /// A peer could not be reached.
    #[error("transport: {0}")]
    Transport(String),
    /// The caller's certificate (or its lack) does not allow the request.
    #[error("not allowed: {0}")]
    Denied(String),
}

impl ConsensusError {
    /// Whether the node must stop: its storage can no longer be trusted.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            ConsensusError::Storage { .. }
                | ConsensusError::Corrupt { .. }
                | ConsensusError::WrongIdentity { .. }
                | ConsensusError::Raft(raft::Error::Store(_))
        )
    }

    /// Whether retrying the same request later can succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            ConsensusError::NoLeader | ConsensusError::Timeout { .. } | ConsensusError::Transport(_)
        ) || matches!(self, ConsensusError::Raft(raft::Error::ProposalDropped))
    }
}

impl From<ConsensusError> for tonic::Status {
    fn from(e: ConsensusError) -> tonic::Status {
        let msg = e.to_string();
        match e {
            ConsensusError::Decode { .. } | ConsensusError::Config(_) => tonic::Status::invalid_argument(msg),
            ConsensusError::WrongCluster { .. } | ConsensusError::Denied(_) => {
                tonic::Status::permission_denied(msg)
            }
            ConsensusError::NoLeader | ConsensusError::Raft(raft::Error::ProposalDropped) => {
                tonic::Status::unavailable(msg)
            }
            ConsensusError::Transport(_) | ConsensusError::Shutdown => tonic::Status::unavailable(msg),
            ConsensusError::Timeout { .. } => tonic::Status::deadline_exceeded(msg),
            ConsensusError::Rejected(_) => tonic::Status::failed_precondition(msg),
            ConsensusError::NotLeader { leader, addr, .. } => {
                let mut status = tonic::Status::aborted(msg);
                if let (Ok(id), Ok(addr)) = (leader.to_string().parse(), addr.parse()) {
                    status.metadata_mut().insert(LEADER_ID, id);
                    status.metadata_mut().insert(LEADER_ADDR, addr);
                }
                status
            }
            _ => tonic::Status::internal(msg),
        }
    }
}

/// The gRPC metadata key naming the leader in a [`ConsensusError::NotLeader`] answer.
pub(crate) const LEADER_ID: &str = "limpet-leader-id";
/// The gRPC metadata key holding the leader's control address in that answer.
pub(crate) const LEADER_ADDR: &str = "limpet-leader-addr";

/// Results in this crate.
pub type Result<T, E = ConsensusError> = std::result::Result<T, E>;
