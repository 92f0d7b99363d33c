//! A sharded job's re-cut (the trainer's `Trainer::regroup`), decided: what each rank
//! states about the state it holds (`record`: a typed row, checked as a peer's word), what
//! the log lets it claim (`bounds`), and the plan every rank of the group computes alike
//! from the same rows (`plan`): the step rebuilt, whose position in the data every rank
//! leaves with, who finishes a torn step, who gives each value and what moves to whom. The
//! trainer only executes a plan (its collectives and copies).
//!
//! The layout arithmetic the plan and the trainer's `ShardLayout` share is here too
//! ([`cut`], [`held_ranges`]), so the values a peer's row says it holds are the values its
//! layout holds.

mod bounds;
mod plan;
mod record;

pub use bounds::RegroupBounds;
pub use plan::{plan, Piece, RegroupPlan};
pub use record::{decode_all, HeldLayout, KeptLayout, RegroupFacts, MOST_RANKS, MOST_REPLICAS, WORDS};

use std::ops::Range;

/// Blocks are cut at multiples of this many values (64 bytes of f32), so none splits a
/// cache line.
pub const ALIGN: usize = 16;

/// Why a regroup cannot go on from the rows it was given. Every rank decides from the same
/// rows, so every rank refuses alike; none is retried as is (the entry waits for the log).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RegroupError {
    /// A rank's row that cannot be one rank's honest state.
    #[error("rank {rank}'s facts in the regroup: {detail}")]
    Record {
        /// The rank whose row it is.
        rank: usize,
        /// What is wrong with it.
        detail: String,
    },
    /// Claims that contradict each other, or that nothing bears out.
    #[error("{0}")]
    Contradiction(String),
    /// Values of the state that no live rank holds.
    #[error("{0}")]
    Lost(String),
    /// Bounds that do not fit the group (the caller's mistake, not a peer's).
    #[error("{0}")]
    Bounds(String),
}

/// Where block `i` of `shards` starts, of a gradient of `len` values: near-equal cuts at
/// multiples of [`ALIGN`].
pub fn cut(len: usize, shards: usize, i: usize) -> usize {
    if i == shards {
        len
    } else {
        (i * len / shards) / ALIGN * ALIGN
    }
}

/// The value ranges a rank holds in a layout over hosts of `m` block-holding ranks each,
/// `shards` of them in all (hosts x `m`), of a gradient of `len` values: for shard rank `s`
/// (host `s / m`'s local rank `s % m`), its block and the same local rank's on the
/// `replicas` hosts before its own; for a rank that holds no block (`None`), nothing.
pub fn held_ranges(
    len: usize,
    (shards, m): (usize, usize),
    s: Option<usize>,
    replicas: usize,
) -> Vec<Range<usize>> {
    let Some(s) = s else { return Vec::new() };
    (0..=replicas)
        .map(|k| (s + shards - (k * m) % shards) % shards)
        .map(|b| cut(len, shards, b)..cut(len, shards, b + 1))
        .collect()
}

#[cfg(test)]
mod tests;
