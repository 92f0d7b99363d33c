//! Who may claim what in a regroup among hosts ([`RegroupBounds`]): a rank's layout, step
//! and whole state count only where the log or another host bears them out, so that no
//! rank's facts alone decide every rank's state.

use super::FACTS;
use crate::train::ShardLayout;
use crate::TrainerError;
use std::ops::Range;

/// What the log lets each rank of a regroup claim: a bound on one rank's word, so that no
/// rank's facts alone decide every rank's state (see `Trainer::regroup`).
#[derive(Clone, Debug, Default)]
pub struct RegroupBounds {
    /// Each rank's host, any id (ranks of one host share it, and vouch for nothing).
    pub hosts: Vec<u64>,
    /// The epochs (layout tags) the log knows alike on every rank: a holder claiming one of
    /// these must hold the layout the log gave its device in it.
    pub known: Vec<u64>,
    /// Each rank's layouts in the `known` epochs it trained in.
    pub layouts: Vec<Vec<ShardLayout>>,
}

/// A layout's identity in a row of facts: tag, world, replicas, rank, the block-holding
/// ranks a host, this one's place among them (one up; 0: none) and their count.
fn layout_facts(row: &[i64]) -> [i64; 7] {
    [row[0], row[1], row[2], row[3], row[19], row[21], row[22]]
}

impl ShardLayout {
    /// [`layout_facts`] of this layout, as its holder writes them.
    fn facts(&self) -> [i64; 7] {
        let (shards, m) = self.shards();
        let s = self.shard_rank().map_or(0, |s| s as i64 + 1);
        [
            self.tag as i64,
            self.world() as i64,
            self.replicas as i64,
            self.rank as i64,
            m as i64,
            s,
            shards as i64,
        ]
    }
}

impl RegroupBounds {
    /// Which claims of the checked `layouts` (`None` where a rank holds no shard) the log
    /// and the other hosts bear out; a holder refused here gives nothing and takes what it
    /// keeps. Every rank decides alike from the same facts and bounds.
    ///
    /// - A holder's layout of an epoch the log knows must be the one the log gave its
    ///   device; one of an epoch the log does not know (scheduled, entered, then replaced
    ///   before it started) counts only where a rank on another host holds it too.
    /// - Holders of one layout on two hosts may be a step apart (a ring breaks mid-step),
    ///   never more: further apart, one of them is lying, nobody can tell which, and the
    ///   regroup fails (the entry waits) rather than believe either. Holders of an older
    ///   layout (a host that sat an epoch out) may be any way behind.
    /// - A whole state (a rank without a shard that kept its optimizer state: a newcomer's
    ///   fresh one, or one trained whole further on) counts, where holders count, only when
    ///   a rank on another host holds a whole state at the same step: one rank's word that
    ///   it is further on would make every holder start afresh.
    ///
    /// Returns whose whole state counts, or an error when holders contradict each other or
    /// ranks hold shards and none counts (the entry waits rather than start afresh).
    pub(super) fn admit(
        &self,
        facts: &[i64],
        layouts: &mut [Option<Vec<Range<usize>>>],
    ) -> Result<Vec<bool>, TrainerError> {
        let world = layouts.len();
        if self.hosts.len() != world || self.layouts.len() != world {
            return Err(TrainerError::Config(format!(
                "regroup bounds for {} and {} ranks in a group of {world}",
                self.hosts.len(),
                self.layouts.len()
            )));
        }
        let row = |j: usize| &facts[FACTS * j..FACTS * (j + 1)];
        let identity = |j: usize| {
            let r = row(j);
            [r[0], r[1], r[2], r[19], r[22]]
        };
        let other_host = |j: usize, k: usize| self.hosts[j] != self.hosts[k];
        let claimed: Vec<usize> = (0..world).filter(|&j| layouts[j].is_some()).collect();
        let admitted: Vec<usize> = claimed
            .iter()
            .copied()
            .filter(|&j| {
                let tag = row(j)[0];
                if self.known.iter().any(|&k| k as i64 == tag) {
                    return self.layouts[j].iter().any(|l| l.facts() == layout_facts(row(j)));
                }
                claimed.iter().any(|&k| other_host(j, k) && identity(k) == identity(j))
            })
            .collect();
        for &j in &admitted {
            let apart = admitted
                .iter()
                .find(|&&k| other_host(j, k) && row(k)[0] == row(j)[0] && row(k)[4].abs_diff(row(j)[4]) > 1);
            if let Some(&k) = apart {
                return Err(TrainerError::Mismatch(format!(
                    "ranks {j} and {k} hold layout {} at steps {} and {}: one of them is not what it says",
                    row(j)[0],
                    row(j)[4],
                    row(k)[4]
                )));
            }
        }
        for (j, held) in layouts.iter_mut().enumerate() {
            if !admitted.contains(&j) {
                *held = None;
            }
        }
        if !claimed.is_empty() && admitted.is_empty() {
            return Err(TrainerError::Mismatch(format!(
                "ranks {claimed:?} say they hold shards, and the log and the other hosts bear none of them out"
            )));
        }
        let whole = |j: usize| row(j)[8] == 1 && row(j)[1] == 0;
        Ok((0..world)
            .map(|j| {
                whole(j)
                    && (admitted.is_empty()
                        || (0..world).any(|k| other_host(j, k) && whole(k) && row(k)[4] == row(j)[4]))
            })
            .collect())
    }
}
