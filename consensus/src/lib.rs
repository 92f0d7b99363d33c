//! limpet's control plane: a Raft group (tikv raft-rs) whose log holds the cluster's
//! membership and epochs, persisted in sled and spoken over tonic gRPC.
//!
//! Data flows one way through the crate:
//! - `state`: the replicated `ClusterState` and the `Command`s that change it (pure);
//! - `membership`: the leader's voter controller, a pure function of what the leader sees;
//! - `storage`: raft-rs `Storage` over sled (`SledLog`) and memory (`MemLog`);
//! - `core`: one node's `RawNode` + storage + state machine, driven by ticks and messages;
//! - `harness` (feature `lab`: tests, fuzz targets and the lab, not the product): many
//!   cores on an in-memory network that drops, cuts, isolates and crashes;
//! - `tasks`: the shutdown path a node's tasks (and the agent's around it) are spawned
//!   through: one root token, tracked, a panic fatal and named;
//! - `inbox`, `node`, `service` and `transport`: what flows into a node's task, a core on
//!   a tokio task, the gRPC service it serves (who may call what) and the client the CLI,
//!   the benchmarks and peers use.

//!
//! Without the default `node` feature the crate is `state` and `membership` only.

#[cfg(feature = "node")]
pub mod chunks;
#[cfg(feature = "node")]
pub mod codec;
#[cfg(feature = "node")]
pub mod core;
#[cfg(feature = "node")]
pub mod error;
#[cfg(feature = "lab")]
pub mod harness;
#[cfg(feature = "node")]
pub mod inbox;
pub mod membership;
#[cfg(feature = "node")]
pub mod node;
#[cfg(feature = "node")]
mod service;
pub mod state;
#[cfg(feature = "node")]
pub mod storage;
#[cfg(feature = "node")]
pub mod tasks;
#[cfg(feature = "node")]
pub mod tls;
#[cfg(feature = "node")]
pub mod transport;

#[cfg(feature = "node")]
pub use crate::core::{Applied, Core, CoreConfig, NodeStatus, Output, StepError, MAX_TERM_LEAD};
#[cfg(feature = "node")]
pub use error::{ConsensusError, Result};
pub use membership::{VoterDecision, VoterPolicy};
#[cfg(feature = "node")]
pub use node::{LocalState, Node, NodeConfig, NodeHandle, NodeReport, Reports};
#[cfg(feature = "node")]
pub use service::{
    address_cap, CONNECTIONS_PER_MEMBER, MAX_CONNECTIONS as MAX_CONTROL_CONNECTIONS,
    MAX_CONNECTIONS_PER_ADDRESS,
};
pub use state::{ClusterState, Command, Epoch, Member, MemberSpec, MemberStatus, NodeId, ProposalId};
#[cfg(feature = "node")]
pub use storage::{AppliedState, Identity, LogStore, MemLog, SledLog};
#[cfg(feature = "node")]
pub use transport::{Client, ReadResult};
