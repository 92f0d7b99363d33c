//! Local ranks: a node that trains with several devices (`[node].devices`) is that many
//! ranks of an epoch's data-parallel world, numbered node after node in rank order. In a
//! pipelined epoch every node has as many, each device a replica of the node's stage.

use super::Epoch;

/// The most local ranks (devices) one node may bring: more than any host has GPUs.
pub const MAX_LOCAL_RANKS: u32 = 64;

/// The most local ranks a node of a pipelined epoch may have: each is linked to the
/// neighbouring stages by a pipe lane of its own, and the data plane has this many.
pub const MAX_PIPELINE_LOCAL_RANKS: u32 = 8;

impl Epoch {
    /// Node `i`'s local ranks (in rank order of the epoch).
    pub fn local_ranks_of(&self, i: usize) -> u32 {
        self.local_ranks.get(i).copied().unwrap_or(1).max(1)
    }

    /// The epoch's ranks counted per device: the data-parallel world the trainers see.
    pub fn total_ranks(&self) -> usize {
        (0..self.ranks.len()).map(|i| self.local_ranks_of(i) as usize).sum()
    }

    /// Node `i`'s first rank in that world.
    pub fn first_rank_of(&self, i: usize) -> usize {
        (0..i).map(|j| self.local_ranks_of(j) as usize).sum()
    }

    /// Samples of each step each rank (device) computes, in that world's order: a node's
    /// share split evenly over its ranks; empty when every rank computes an equal share.
    pub fn rank_shares(&self) -> Vec<u64> {
        if self.shares.is_empty() {
            return Vec::new();
        }
        let mut out = Vec::with_capacity(self.total_ranks());
        for (i, &s) in self.shares.iter().enumerate() {
            let n = u64::from(self.local_ranks_of(i));
            out.extend((0..n).map(|r| s / n + u64::from(r < s % n)));
        }
        out
    }
}
