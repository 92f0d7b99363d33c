//! The trainer's error type: data, configuration, checkpoint mismatch, and libtorch failures.

use std::path::PathBuf;

/// Bytes that are not the format they claim to be: what a decoder of untrusted input (a
/// pickle, a `.npy` header, a token manifest, a `config.json`) finds, before its caller names
/// the file ([`TrainerError::Data`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Malformed(pub String);

impl From<Malformed> for String {
    fn from(m: Malformed) -> String {
        m.0
    }
}

/// A setting's word that is none of its choices.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{got:?} is not one of {choices}")]
pub struct NotOneOf {
    /// What was given.
    pub got: String,
    /// The choices, as a reader would list them.
    pub choices: &'static str,
}

/// Why training could not start or go on.
#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    /// A libtorch call failed.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    /// A state image could not be read, written or decoded.
    #[error(transparent)]
    Snapshot(#[from] limpet_snapshot::SnapshotError),
    /// A data file is missing or malformed.
    #[error("data {path}: {detail}")]
    Data {
        /// The file or directory.
        path: PathBuf,
        /// What was wrong.
        detail: String,
    },
    /// The job does not make sense (bad batch sizes, a model that cannot read the data, ...).
    #[error("invalid job: {0}")]
    Config(String),
    /// One configuration key's value does not make sense: the key is `[section].name`, so a
    /// configuration file's checks can name it (and its line) without reading the message.
    #[error("invalid job: {key}: {detail}")]
    Key {
        /// The key, as `[section].name`.
        key: String,
        /// What is wrong.
        detail: String,
    },
    /// A checkpoint does not belong to this job.
    #[error("checkpoint does not match the job: {0}")]
    Mismatch(String),
    /// Sharded state cannot be rebuilt: every rank that held a block of it is gone. The
    /// state must come from a checkpoint.
    #[error("sharded state lost: {0}")]
    ShardLost(String),
    /// A reduce (or a pipeline link) across ranks failed.
    #[error("gradient reduce failed: {detail}")]
    Reduce {
        /// The peer the failure points at (it closed, went silent or broke the protocol),
        /// when the transport knows one: the agent reports it as the suspect.
        peer: Option<u64>,
        /// What happened.
        detail: String,
        /// A peer's bytes broke the protocol (a bug or a hostile peer), as opposed to a
        /// transient failure (a closed connection, a silent peer).
        violation: bool,
    },
}

impl TrainerError {
    /// A reduce failure that names no peer (a malformed buffer).
    pub fn reduce(detail: impl Into<String>) -> TrainerError {
        TrainerError::Reduce { peer: None, detail: detail.into(), violation: false }
    }
}

impl From<limpet_decide::regroup::RegroupError> for TrainerError {
    fn from(e: limpet_decide::regroup::RegroupError) -> Self {
        use limpet_decide::regroup::RegroupError as R;
        match e {
            R::Record { .. } | R::Contradiction(_) => TrainerError::Mismatch(e.to_string()),
            R::Lost(detail) => TrainerError::ShardLost(detail),
            R::Bounds(detail) => TrainerError::Config(detail),
        }
    }
}

impl From<crate::optim::FusedError> for TrainerError {
    fn from(e: crate::optim::FusedError) -> Self {
        TrainerError::Torch(tch::TchError::Torch(e.to_string()))
    }
}
