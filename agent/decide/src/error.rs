//! What the decisions refuse: a peer's record that cannot be used, or states from which no
//! epoch can be entered. None is retried as is: the caller waits for the log to change.

use limpet_consensus::state::NodeId;

/// Why a decision could not be made from what it was given.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DecideError {
    /// A heartbeat report that does not decode, is of another version, claims another
    /// sender or is out of bounds.
    #[error("report of node {from}: {detail}")]
    Report {
        /// The node it came from (as the transport authenticated it).
        from: NodeId,
        /// What is wrong with it.
        detail: String,
    },
    /// An epoch-entry record that is malformed or names blocks outside the model.
    #[error("an entry record {0}")]
    EntryRecord(String),
    /// The published states hold no copy of some block: the epoch cannot be entered.
    #[error("{0}")]
    NoSource(String),
    /// Two survivors a step apart and no other: rank `ahead` applied step `step` before the
    /// ring broke, rank `behind` did not. Not yet enterable: `behind` finishes the step alone
    /// and then stands witness for `ahead`'s state (or refuses it).
    #[error("the survivors {behind} and {ahead} are a step apart (the ring broke after rank {ahead} applied step {step} and before rank {behind} did): rank {behind} finishes the step alone to check rank {ahead}'s state")]
    TornStep {
        /// The rank at `step`.
        behind: usize,
        /// The rank at `step + 1`.
        ahead: usize,
        /// The step the ring broke in.
        step: u64,
    },
}
