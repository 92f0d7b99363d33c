//! A job that cannot get past a step: the current epoch, and the ones just before it, rebuilt
//! the same ranks at the same step because a collective broke with every rank alive, and it
//! broke again. Pure: the leader bounds its rebuilds by this, `limpet status` shows it, and
//! both read the same replicated history and reports.
//!
//! Two kinds of breakage are told apart. A transient one (a reset connection, a peer silent
//! for a moment) is rebuilt again, but after [`REBUILDS`] in a row at one step only with a
//! growing pause, and the job is reported stuck meanwhile. A protocol violation (a peer sent
//! bytes the collective did not call for) is a bug or a hostile peer: honest ranks that
//! entered with one checked state cannot disagree on the protocol, so it gets one rebuild
//! (whose entry re-checks every rank's state) and then none. From inside the ring, limpet
//! cannot tell which side of a violation is at fault (each rank accuses its neighbour, and
//! a hostile rank can accuse an honest one), so it does not evict anybody on that word:
//! training waits at the step, loudly, until an operator drains or removes the host at
//! fault, which makes the next epoch another change than a rebuild.

use crate::report::Reports;
use limpet_consensus::state::{Cause, ClusterState, NodeId};
use serde::{Deserialize, Serialize};

/// Rebuilds in a row at one step after which a transient breakage counts as stuck.
pub const REBUILDS: usize = 3;
/// Rebuilds at one step a protocol violation gets.
pub const VIOLATION_REBUILDS: usize = 1;
/// The longest pause between rebuilds of a stuck job (a transient cause may still clear).
pub const MAX_PAUSE_MS: u64 = 60_000;

/// A job stuck at a step, and the last breakage that kept it there.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Stuck {
    /// The step no epoch got past.
    pub step: u64,
    /// Epochs in a row that rebuilt the same ranks at that step.
    pub rebuilds: usize,
    /// The rank that reported the breakage.
    pub node: NodeId,
    /// What it reported.
    pub error: String,
    /// Whether it was a protocol violation (no more rebuilds), not a transient failure.
    pub violation: bool,
}

impl std::fmt::Display for Stuck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "stuck at step {}: {} rebuild(s) in a row with every rank alive; node {} reports: {}",
            self.step, self.rebuilds, self.node, self.error
        )?;
        if self.violation {
            write!(
                f,
                " (a protocol violation: a bug or a hostile peer; no more rebuilds, drain the host at fault)"
            )
        } else {
            write!(f, " (rebuilt again after a growing pause)")
        }
    }
}

/// Epochs in a row, ending with the current one, that did nothing but rebuild the same
/// ranks at the current epoch's step; with that step.
pub fn rebuilds_in_a_row(st: &ClusterState) -> (u64, usize) {
    let Some(cur) = st.current.as_ref() else { return (0, 0) };
    let n = st
        .history
        .iter()
        .rev()
        .take_while(|e| {
            e.start_step == cur.start_step && e.ranks == cur.ranks && e.causes == [Cause::Rebuild]
        })
        .count();
    (cur.start_step, n)
}

/// The breakage live ranks of the current epoch report (a violation before any other), as
/// (node, error, violation).
fn breakage(st: &ClusterState, reports: &Reports, timeout_ms: u64) -> Option<(NodeId, String, bool)> {
    let cur = st.current.as_ref()?;
    let mut broken: Vec<_> = reports
        .values()
        .filter(|(age, r)| *age <= timeout_ms && cur.ranks.contains(&r.node))
        .filter_map(|(_, r)| r.broken.as_ref().filter(|b| b.epoch == cur.id).map(|b| (r.node, b)))
        .collect();
    broken.sort_by_key(|(node, b)| (!b.violation, *node));
    broken.first().map(|(node, b)| (*node, b.error.clone(), b.violation))
}

/// Whether the job is stuck now: the current epoch is the [`REBUILDS`]th (a violation: the
/// [`VIOLATION_REBUILDS`]th) rebuild in a row at its step, no rank got past that step in it,
/// and it broke too.
pub fn assess(st: &ClusterState, reports: &Reports, timeout_ms: u64) -> Option<Stuck> {
    let (step, rebuilds) = rebuilds_in_a_row(st);
    // A rebuild that trained past its start got unstuck: a later breakage starts a new count.
    let cur = st.current.as_ref()?;
    let progressed = reports.values().any(|(age, r)| {
        *age <= timeout_ms && cur.ranks.contains(&r.node) && r.epoch == cur.id && r.applied_step > step
    });
    if progressed {
        return None;
    }
    let (node, error, violation) = breakage(st, reports, timeout_ms)?;
    let limit = if violation { VIOLATION_REBUILDS } else { REBUILDS };
    (rebuilds >= limit).then_some(Stuck { step, rebuilds, node, error, violation })
}

/// How long a rank must have waited on a broken group before the leader rebuilds it: the
/// failure timeout, doubled for each rebuild past [`REBUILDS`] (at most [`MAX_PAUSE_MS`]);
/// never, for a stuck violation.
pub fn rebuild_after_ms(stuck: Option<&Stuck>, timeout_ms: u64) -> Option<u64> {
    match stuck {
        None => Some(timeout_ms),
        Some(s) if s.violation => None,
        Some(s) => {
            let doublings = (s.rebuilds + 1).saturating_sub(REBUILDS).min(16) as u32;
            Some(timeout_ms.saturating_mul(1 << doublings).min(MAX_PAUSE_MS.max(timeout_ms)))
        }
    }
}
