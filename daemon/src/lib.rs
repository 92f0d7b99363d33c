//! limpet's binaries as a library: argument parsing, command implementations, and their
//! output (progress bars, summaries, plots). `src/bin` only calls into here, so tests reach
//! every command as a function call.

#![forbid(unsafe_code)]

pub mod cli;
pub mod config;
pub mod dp_cmd;
mod plot;
pub mod raft_cmd;
mod train_cmd;

/// Exit status for bad usage (sysexits' EX_USAGE): a flag, argument or combination is wrong.
pub const EXIT_USAGE: u8 = 64;
/// Exit status for bad input data (sysexits' EX_DATAERR): a corrupted or mismatched file.
pub const EXIT_DATA: u8 = 65;

/// A command-line mistake, reported with exit status [`EXIT_USAGE`].
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// The exit status for an error: usage, bad data, or anything else (1).
pub fn exit_code(e: &anyhow::Error) -> u8 {
    use limpet_trainer::TrainerError;
    if e.downcast_ref::<UsageError>().is_some() {
        return EXIT_USAGE;
    }
    if let Some(c) = e.downcast_ref::<limpet_consensus::ConsensusError>() {
        return match c {
            limpet_consensus::ConsensusError::Config(_) => EXIT_USAGE,
            c if c.is_fatal() => EXIT_DATA,
            _ => 1,
        };
    }
    match e.downcast_ref::<TrainerError>() {
        Some(TrainerError::Snapshot(_) | TrainerError::Mismatch(_) | TrainerError::Data { .. }) => EXIT_DATA,
        Some(TrainerError::Config(_)) => EXIT_USAGE,
        _ => 1,
    }
}
