//! How a command of `limpet`, `limpetd` or `limpet-lab` fails: a [`Failure`] keeps the typed
//! error of the crate it came from up to `main`, and [`Failure::exit_code`] is the one table
//! that turns each kind into an exit status (systemd's unit keys its restart policy on it).

use crate::config::ConfigErrors;
use limpet_agent::runtime::{AgentError, Fatal};
use limpet_consensus::ConsensusError;
use limpet_snapshot::SnapshotError;
use limpet_trainer::TrainerError;

/// Exit status for bad usage (sysexits' EX_USAGE): a flag, argument or combination is wrong,
/// or the configuration is. limpetd's unit does not restart on it: the same start fails again.
pub const EXIT_USAGE: u8 = 64;
/// Exit status for bad input data (sysexits' EX_DATAERR): a corrupted or mismatched file.
pub const EXIT_DATA: u8 = 65;
/// Exit status for any other failure (the OS, the network, a peer): worth a retry.
pub const EXIT_FAILURE: u8 = 1;

/// A command-line mistake, reported with exit status [`EXIT_USAGE`].
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// Why a command stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// A flag, argument or combination is wrong.
    #[error("{0}")]
    Usage(String),
    /// The configuration file has problems (every one found).
    #[error("{0}")]
    Config(#[from] ConfigErrors),
    /// The consensus node or a request to the cluster failed.
    #[error(transparent)]
    Consensus(#[from] ConsensusError),
    /// The running agent stopped.
    #[error(transparent)]
    Agent(#[from] AgentError),
    /// Training, a model, data or a checkpoint failed.
    #[error(transparent)]
    Trainer(#[from] TrainerError),
    /// A state image did not decode or verify.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// EC2 refused or could not be reached, or a fleet request was malformed.
    #[error(transparent)]
    Fleet(#[from] limpet_deploy::FleetError),
    /// A typed failure, with what was being done when it happened.
    #[error("{what}: {source}")]
    Within {
        /// What was being done.
        what: String,
        /// What failed.
        source: Box<Failure>,
    },
    /// Anything else (the OS, the network, a peer), with its context.
    #[error("{0:#}")]
    Other(anyhow::Error),
}

/// A command's result.
pub type Result<T = (), E = Failure> = std::result::Result<T, E>;

impl Failure {
    /// The exit status for this failure: the one table.
    pub fn exit_code(&self) -> u8 {
        use AgentError as A;
        use ConsensusError as C;
        use TrainerError as T;
        let consensus = |c: &C| match c {
            C::Config(_) => EXIT_USAGE,
            // Its storage cannot be trusted: a restart would not help.
            c if c.is_fatal() => EXIT_DATA,
            _ => EXIT_FAILURE,
        };
        let trainer = |t: &T| match t {
            T::Config(_) | T::Key { .. } => EXIT_USAGE,
            T::Snapshot(_) | T::Mismatch(_) | T::Data { .. } => EXIT_DATA,
            _ => EXIT_FAILURE,
        };
        match self {
            Failure::Usage(_) | Failure::Config(_) => EXIT_USAGE,
            Failure::Within { source, .. } => source.exit_code(),
            Failure::Consensus(c) | Failure::Agent(A::Fatal(Fatal::Consensus(c))) => consensus(c),
            Failure::Trainer(t) => trainer(t),
            // Start-up built the job from its configuration and data (Config::settings) before
            // the agent ran: a running rank's trainer failing (on a peer's state, a full
            // disk, a bug) is one systemd restarts.
            Failure::Agent(A::Fatal(Fatal::Trainer(_))) => EXIT_FAILURE,
            // The node's [job] is not the cluster's: the operator's to fix, a restart repeats it.
            Failure::Agent(A::Fatal(Fatal::Job(_) | Fatal::DeviceClass(_))) => EXIT_USAGE,
            Failure::Agent(_) => EXIT_FAILURE,
            Failure::Snapshot(_) => EXIT_DATA,
            Failure::Fleet(limpet_deploy::FleetError::Usage(_)) => EXIT_USAGE,
            Failure::Fleet(_) => EXIT_FAILURE,
            Failure::Other(_) => EXIT_FAILURE,
        }
    }

    /// An untyped failure from a message.
    pub fn msg(m: impl std::fmt::Display) -> Failure {
        Failure::Other(anyhow::anyhow!("{m}"))
    }

    /// The message `main` prints: this failure and its causes, each said once.
    pub fn report(&self) -> String {
        let mut out = self.to_string();
        let mut cause = std::error::Error::source(self);
        while let Some(c) = cause {
            let s = c.to_string();
            if !out.contains(&s) {
                out.push_str(": ");
                out.push_str(&s);
            }
            cause = c.source();
        }
        out
    }
}

impl From<UsageError> for Failure {
    fn from(e: UsageError) -> Failure {
        Failure::Usage(e.0)
    }
}

impl From<anyhow::Error> for Failure {
    fn from(e: anyhow::Error) -> Failure {
        Failure::Other(e)
    }
}

/// The agent's parts, used alone by `limpet-lab`'s workers and benchmarks, fail as the agent.
macro_rules! agent_from {
    ($($t:ty),* $(,)?) => {$(
        impl From<$t> for Failure {
            fn from(e: $t) -> Failure {
                Failure::Agent(AgentError::from(e))
            }
        }
    )*};
}
agent_from!(
    limpet_agent::DataPlaneError,
    limpet_snapshot::handoff::HandoffError,
    limpet_consensus::tasks::TaskFailed,
    limpet_agent::checkpoint::CheckpointError,
);

/// Errors that carry no kind of their own: they fail as [`Failure::Other`].
macro_rules! other_from {
    ($($t:ty),* $(,)?) => {$(
        impl From<$t> for Failure {
            fn from(e: $t) -> Failure {
                Failure::Other(anyhow::Error::from(e))
            }
        }
    )*};
}
other_from!(
    std::io::Error,
    serde_json::Error,
    std::time::SystemTimeError,
    std::num::ParseIntError,
    tokio::task::JoinError,
    nix::errno::Errno,
    toml::ser::Error,
    toml::de::Error,
    reqwest::Error,
    limpet_consensus::tls::TlsError,
    limpet_agent::planner::PlanError,
    metrics_exporter_prometheus::BuildError,
);

#[doc(hidden)]
pub use anyhow as __anyhow;

/// Returns a [`Failure::Other`] made from a message, as anyhow's `bail!` does.
#[macro_export]
macro_rules! fail {
    ($($t:tt)*) => {
        return Err($crate::Failure::Other($crate::failure::__anyhow::anyhow!($($t)*)))
    };
}

/// Context for a typed failure that keeps its kind (and so its exit status), where anyhow's
/// `context` would erase it.
pub trait Within<T> {
    /// Says what was being done when this failed.
    fn within(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T, E: Into<Failure>> Within<T> for std::result::Result<T, E> {
    fn within(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Failure::Within { what: what(), source: Box::new(e.into()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_has_its_exit_status_through_context() {
        let usage: Failure = UsageError("--nodes must be at least 1".into()).into();
        assert_eq!(usage.exit_code(), EXIT_USAGE);
        let data: Failure = TrainerError::Mismatch("shapes differ".into()).into();
        assert_eq!(data.exit_code(), EXIT_DATA);
        let within = Err::<(), _>(TrainerError::Mismatch("shapes differ".into()))
            .within(|| "loading ckpt".into())
            .unwrap_err();
        assert_eq!(within.exit_code(), EXIT_DATA);
        assert_eq!(within.report(), "loading ckpt: checkpoint does not match the job: shapes differ");
        let other: Failure = std::io::Error::other("disk full").into();
        assert_eq!(other.exit_code(), EXIT_FAILURE);
        let job: Failure = AgentError::from(Fatal::Job("a vs b".into())).into();
        assert_eq!(job.exit_code(), EXIT_USAGE);
        let lost: Failure = ConsensusError::NoLeader.into();
        assert_eq!(lost.exit_code(), EXIT_FAILURE);
    }

    #[test]
    fn a_cause_already_in_the_message_is_not_repeated() {
        let io = std::io::Error::other("disk full");
        let f: Failure = anyhow::Error::from(io).context("writing x").into();
        assert_eq!(f.report(), "writing x: disk full");
        let snap: Failure = TrainerError::Snapshot(SnapshotError::Format("bad magic".into())).into();
        assert_eq!(snap.report().matches("bad magic").count(), 1, "{}", snap.report());
    }
}
