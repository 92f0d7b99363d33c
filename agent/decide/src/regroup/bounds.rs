//! Who may claim what in a regroup among hosts ([`RegroupBounds`]): a rank's layout, step
//! and whole state count only where the log or another host bears them out, so that no
//! rank's row alone decides every rank's state.

use super::{HeldLayout, RegroupError, RegroupFacts};
use std::ops::Range;

/// What the log lets each rank of a regroup claim: a bound on one rank's word.
#[derive(Clone, Debug, Default)]
pub struct RegroupBounds {
    /// Each rank's host, any id (ranks of one host share it, and vouch for nothing).
    pub hosts: Vec<u64>,
    /// The epochs (layout tags) the log knows alike on every rank: a holder claiming one of
    /// these must hold the layout the log gave its device in it.
    pub known: Vec<u64>,
    /// Each rank's layouts in the `known` epochs it trained in.
    pub layouts: Vec<Vec<HeldLayout>>,
}

impl RegroupBounds {
    /// Which claims of `facts` the log and the other hosts bear out: a holder refused here
    /// has its `held` ranges cleared (it gives nothing and takes what it keeps). Every rank
    /// decides alike from the same rows and bounds.
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
    pub fn admit(
        &self,
        facts: &[RegroupFacts],
        held: &mut [Option<Vec<Range<usize>>>],
    ) -> Result<Vec<bool>, RegroupError> {
        let world = facts.len();
        if self.hosts.len() != world || self.layouts.len() != world || held.len() != world {
            return Err(RegroupError::Bounds(format!(
                "regroup bounds for {} and {} ranks in a group of {world}",
                self.hosts.len(),
                self.layouts.len()
            )));
        }
        let other_host = |j: usize, k: usize| self.hosts[j] != self.hosts[k];
        let claimed: Vec<(usize, &HeldLayout)> =
            facts.iter().enumerate().filter_map(|(j, f)| Some((j, f.layout.as_ref()?))).collect();
        let admitted: Vec<(usize, &HeldLayout)> = claimed
            .iter()
            .copied()
            .filter(|&(j, l)| match self.known.contains(&l.tag) {
                true => self.layouts[j].contains(l),
                false => claimed.iter().any(|&(k, m)| other_host(j, k) && m.group() == l.group()),
            })
            .collect();
        for &(j, l) in &admitted {
            let apart = admitted.iter().find(|&&(k, m)| {
                other_host(j, k) && m.tag == l.tag && facts[k].step.abs_diff(facts[j].step) > 1
            });
            if let Some(&(k, _)) = apart {
                return Err(RegroupError::Contradiction(format!(
                    "ranks {j} and {k} hold layout {} at steps {} and {}: one of them is not what it says",
                    l.tag, facts[j].step, facts[k].step
                )));
            }
        }
        for (j, h) in held.iter_mut().enumerate() {
            if !admitted.iter().any(|&(k, _)| k == j) {
                *h = None;
            }
        }
        if !claimed.is_empty() && admitted.is_empty() {
            let ranks: Vec<usize> = claimed.iter().map(|&(j, _)| j).collect();
            return Err(RegroupError::Contradiction(format!(
                "ranks {ranks:?} say they hold shards, and the log and the other hosts bear none of them out"
            )));
        }
        let whole = |j: usize| facts[j].whole && facts[j].layout.is_none();
        Ok((0..world)
            .map(|j| {
                whole(j)
                    && (admitted.is_empty()
                        || (0..world).any(|k| other_host(j, k) && whole(k) && facts[k].step == facts[j].step))
            })
            .collect())
    }
}
