//! The agent-to-agent data plane: authenticated TCP connections between agents and the
//! collectives that synchronous data-parallel training runs every step.
//!
//! - `conn`: one connection, plain TCP or TLS 1.3 (rustls, node certificates of the
//!   cluster CA) when the cluster runs with certificates;
//! - `frame`: the fixed-size header every frame carries (epoch, step, sequence, length) and
//!   the handshake's hello;
//! - `endpoint`: one listener per agent; connections prove they know the cluster secret
//!   (HMAC-SHA256 challenge-response, both ways) before any of their bytes are used, and are
//!   queued by (epoch, peer, channel) until a group takes them;
//! - `handoff`: the snapshot crate's state handoff over authenticated connections;
//! - `pipe`: point-to-point links between neighbouring pipeline stages (activations forward,
//!   gradients back);
//! - `ring`: a `Group` of ranks in epoch order and its collectives (ring allreduce as
//!   reduce-scatter + allgather, broadcast, allgather, barrier), chunked and pipelined over
//!   non-blocking sockets so sending, receiving and summing overlap, each bounded by a
//!   timeout: a dead or silent peer is an error on every survivor, never a hang;
//! - `lanes`: a ring's other lanes, one more ring each between the same hosts, which hosts
//!   of several local ranks drive at once.

pub mod conn;
pub mod endpoint;
pub mod frame;
pub mod handoff;
pub mod lanes;
pub mod pipe;
pub mod ring;

pub use conn::{Conn, DataTls};
pub use endpoint::{DataPlaneConfig, Endpoint};

/// Counts bytes that crossed the data plane, by direction and kind (`ring`, `pipe`,
/// `handoff`), into the `limpet_data_bytes_{sent,received}_total` metrics: payload and frame
/// headers, not TCP's own overhead.
pub fn count_bytes(sent: bool, kind: &'static str, bytes: u64) {
    let name = if sent { "limpet_data_bytes_sent_total" } else { "limpet_data_bytes_received_total" };
    metrics::counter!(name, "kind" => kind).increment(bytes);
}
pub use pipe::PipeLink;
pub use ring::Group;

/// What can go wrong on the data plane.
#[derive(Debug, thiserror::Error)]
pub enum DataPlaneError {
    /// A socket operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A peer closed its connection or vanished.
    #[error("peer {peer} closed the connection during {during}")]
    PeerClosed {
        /// The peer's node id.
        peer: u64,
        /// Which collective or phase.
        during: String,
    },
    /// Nothing arrived (or could be sent) for the whole timeout.
    #[error("no progress for {waited:?} during {during} (peer {peer} silent or dead)")]
    Timeout {
        /// The peer waited on.
        peer: u64,
        /// How long.
        waited: std::time::Duration,
        /// Which collective or phase.
        during: String,
    },
    /// A peer gave up on the collective and said so.
    #[error("peer {peer} aborted {during}")]
    PeerAborted {
        /// Who.
        peer: u64,
        /// Which collective.
        during: String,
    },
    /// Bytes that do not follow the protocol.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// A frame of another epoch, step or collective.
    #[error("stale frame: {0}")]
    Stale(String),
    /// A peer failed the handshake (no secret, other cluster, stale epoch).
    #[error("handshake refused: {0}")]
    Refused(String),
    /// The group saw an error before; it must be rebuilt for the next epoch.
    #[error("the group is broken by an earlier error: {0}")]
    Broken(String),
    /// Bad arguments (world, rank order, addresses).
    #[error("configuration: {0}")]
    Config(String),
}

impl DataPlaneError {
    /// The peer this error points at (it closed, went silent or aborted), if any: the
    /// agent's heartbeat reports it as the suspect, so the leader can tell a dead peer
    /// from a broken link.
    pub fn suspect(&self) -> Option<u64> {
        match self {
            DataPlaneError::PeerClosed { peer, .. }
            | DataPlaneError::Timeout { peer, .. }
            | DataPlaneError::PeerAborted { peer, .. } => Some(*peer),
            _ => None,
        }
    }

    /// Whether a peer's bytes broke the protocol: a bug or a hostile peer, never a
    /// transient fault of a healthy one.
    pub fn is_violation(&self) -> bool {
        matches!(self, DataPlaneError::Protocol(_))
    }

    /// The same failure as the trainer's error, its suspect kept as data.
    #[cfg(feature = "trainer")]
    pub fn into_trainer(self) -> limpet_trainer::TrainerError {
        let violation = self.is_violation();
        limpet_trainer::TrainerError::Reduce { peer: self.suspect(), detail: self.to_string(), violation }
    }

    pub(crate) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DataPlaneError {
        let what = what.into();
        move |source| DataPlaneError::Io { what, source }
    }
}
