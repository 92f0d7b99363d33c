//! The checks an epoch must pass before the log takes it: its ranks are members that can
//! train, its layout covers them, its batch, shares and learning rate make sense, and the
//! state sources it names exist.

use super::{ClusterState, Epoch, MemberStatus, Refused};
use std::collections::BTreeSet;

impl ClusterState {
    /// Checks an epoch against the members (used when scheduling and by `validate`).
    pub(super) fn check_epoch(&self, e: &Epoch) -> Result<(), Refused> {
        if e.ranks.is_empty() {
            return Err(Refused(format!("epoch {} has no ranks", e.id)));
        }
        let unique: BTreeSet<_> = e.ranks.iter().collect();
        if unique.len() != e.ranks.len() {
            return Err(Refused(format!("epoch {} lists a rank twice", e.id)));
        }
        for r in &e.ranks {
            match self.members.get(r) {
                None => return Err(Refused(format!("epoch {}: rank node {r} is not a member", e.id))),
                Some(m) if matches!(m.status, MemberStatus::Gone | MemberStatus::Failed) => {
                    return Err(Refused(format!("epoch {}: rank node {r} is {:?}", e.id, m.status)))
                }
                Some(_) => {}
            }
        }
        if u64::from(e.layout.data) * u64::from(e.layout.pipeline) != e.ranks.len() as u64 {
            return Err(Refused(format!(
                "epoch {}: layout {}x{} does not cover {} ranks",
                e.id,
                e.layout.data,
                e.layout.pipeline,
                e.ranks.len()
            )));
        }
        let want_cuts = e.layout.pipeline.saturating_sub(1) as usize;
        if e.layout.cuts.len() != want_cuts
            || e.layout.cuts.windows(2).any(|w| w[0] >= w[1])
            || e.layout.cuts.first() == Some(&0)
        {
            return Err(Refused(format!(
                "epoch {}: {} stages need {want_cuts} increasing block cuts after block 0, not {:?}",
                e.id, e.layout.pipeline, e.layout.cuts
            )));
        }
        if e.batch.global_batch == 0 || e.batch.micro_batch == 0 {
            return Err(Refused(format!("epoch {}: batch sizes must be positive", e.id)));
        }
        let summed = e.shares.iter().try_fold(0u64, |a, &b| a.checked_add(b));
        if !e.shares.is_empty()
            && (e.layout.pipeline != 1
                || e.shares.len() != e.ranks.len()
                || summed != Some(e.batch.global_batch))
        {
            return Err(Refused(format!(
                "epoch {}: shares {:?} do not split a global batch of {} over {} data-parallel ranks",
                e.id,
                e.shares,
                e.batch.global_batch,
                e.ranks.len()
            )));
        }
        if !e.local_ranks.is_empty()
            && (e.local_ranks.len() != e.ranks.len()
                || e.local_ranks.iter().any(|&n| n == 0 || n > super::MAX_LOCAL_RANKS)
                || (e.layout.pipeline != 1
                    && (e.local_ranks.iter().any(|&n| n != e.local_ranks[0])
                        || e.local_ranks[0] > super::MAX_PIPELINE_LOCAL_RANKS)))
        {
            return Err(Refused(format!(
                "epoch {}: local ranks {:?} are not 1..={} for each of {} nodes (and in a pipeline as many for each, at most {})",
                e.id,
                e.local_ranks,
                super::MAX_LOCAL_RANKS,
                e.ranks.len(),
                super::MAX_PIPELINE_LOCAL_RANKS
            )));
        }
        // No node trains with more ranks than its own record announces.
        for (i, r) in e.ranks.iter().enumerate() {
            let has = self.members.get(r).map_or(1, |m| m.spec.hardware.local_ranks());
            if e.local_ranks_of(i) > has {
                return Err(Refused(format!(
                    "epoch {}: node {r} is given {} local ranks, but announced {has}",
                    e.id,
                    e.local_ranks_of(i)
                )));
            }
        }
        if !(e.lr_scale.is_finite() && e.lr_scale > 0.0) {
            return Err(Refused(format!("epoch {}: lr scale {} is not a positive number", e.id, e.lr_scale)));
        }
        for (to, from) in &e.sources {
            if !unique.contains(to) {
                return Err(Refused(format!(
                    "epoch {}: state source for node {to}, which is not a rank",
                    e.id
                )));
            }
            if !self.members.contains_key(from) {
                return Err(Refused(format!("epoch {}: state source node {from} is not a member", e.id)));
            }
        }
        Ok(())
    }
}
