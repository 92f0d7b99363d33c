//! The regroup's decision ([`plan`]): from every rank's checked row, the step rebuilt and
//! everything each rank does to reach it. Pure, and the same on every rank, so every rank
//! takes the same collectives in the same order.

use super::{RegroupBounds, RegroupError, RegroupFacts};
use std::ops::Range;

/// Values a relay moves from one rank to others.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The rank whose values these are.
    pub giver: usize,
    /// Which values of the buffer.
    pub range: Range<usize>,
    /// The ranks that take them (never the giver).
    pub to: Vec<usize>,
}

/// What every rank of a regroup does, decided alike from the same rows.
#[derive(Clone, Debug, PartialEq)]
pub struct RegroupPlan {
    /// The step rebuilt: the newest layout's (highest tag), at its furthest step.
    pub step: u64,
    /// The newest layout's tag.
    pub tag: u64,
    /// The rank at that step in that layout: every rank leaves with its position in the data
    /// (when it keeps a shard) and a reproducible job's exponents.
    pub newest: usize,
    /// That position: samples consumed, the RNG's seed and draws.
    pub cursor: u64,
    /// See `cursor`.
    pub seed: u64,
    /// See `cursor`.
    pub draws: u64,
    /// Ranks that finish the step with `norm` (their norm's allgather broke after a peer's
    /// of the same layout succeeded).
    pub finishes: Vec<bool>,
    /// The norm a peer gathered for the step, when one did.
    pub norm: Option<f64>,
    /// Ranks of a reproducible job that finish the step from the fixed-point sum
    /// `sum_giver` kept (their sum broke after a peer had all of it).
    pub catches_up: Vec<bool>,
    /// The rank at the step that kept its sum.
    pub sum_giver: Option<usize>,
    /// Who gives each value, tiling the state in order.
    pub pieces: Vec<(usize, Range<usize>)>,
    /// What each rank holds of the state at the step (it takes those values from itself:
    /// holders are bit-identical).
    pub own: Vec<Vec<Range<usize>>>,
    /// Ranks whose parameters are replaced by the step's.
    pub params_to: Vec<bool>,
    /// What each optimizer slot's relay moves: to every rank the values it keeps and lacks.
    pub slot_moves: Vec<Piece>,
    /// What the parameters' relay moves: everything, to the ranks in `params_to`.
    pub param_moves: Vec<Piece>,
}

impl RegroupPlan {
    /// Whether the parameters move at all (one more relay after the slots).
    pub fn moves_params(&self) -> bool {
        self.params_to.iter().any(|&m| m)
    }
}

/// The plan for a state of `n` values from every rank's row, or `None` when nothing is to
/// be rebuilt: no rank holds a shard that counts, or a whole state counts further on than
/// any shard (the entry copies that instead). With `bounds`, only claims the log and other
/// hosts bear out count ([`RegroupBounds::admit`]); without, every rank is believed (one
/// process's own ranks). A rank keeps its `target`'s values, or the whole state.
pub fn plan(
    n: usize,
    facts: &[RegroupFacts],
    bounds: Option<&RegroupBounds>,
    reproducible: bool,
) -> Result<Option<RegroupPlan>, RegroupError> {
    let world = facts.len();
    let mut held: Vec<Option<Vec<Range<usize>>>> =
        facts.iter().map(|f| f.layout.as_ref().map(|l| l.held(n))).collect();
    let whole_ok = match bounds {
        Some(b) => b.admit(facts, &mut held)?,
        None => vec![true; world],
    };
    let holders: Vec<usize> = (0..world).filter(|&j| held[j].is_some()).collect();
    let layout_of = |j: usize| facts[j].layout.as_ref().filter(|_| held[j].is_some());
    let Some(&newest) = holders.iter().max_by_key(|&&j| (layout_of(j).map(|l| l.tag), facts[j].step)) else {
        return Ok(None);
    };
    let group = layout_of(newest).expect("a holder").group();
    let (tag, step) = (group.0, facts[newest].step);
    let whole_at = |j: usize| (facts[j].whole && whole_ok[j]).then_some(facts[j].step);
    if (0..world).filter_map(whole_at).any(|w| w > step) {
        return Ok(None);
    }
    // The position every rank leaves with, checked before anything moves.
    let f = &facts[newest];
    if f.cursor < step || f.cursor > u64::MAX / 4 {
        return Err(RegroupError::Contradiction(format!(
            "rank {newest} is at step {step} with cursor {}: {step} steps consume at least {step} samples",
            f.cursor
        )));
    }
    let of_newest = |j: usize| layout_of(j).is_some_and(|l| l.group() == group);
    let behind = |j: usize| facts[j].step.checked_add(1) == Some(step);
    // A step some ranks applied and others did not, because the norm's allgather failed on
    // them: those have the step's gradient and finish it with the norm a peer of the same
    // layout got for that step.
    let norm = (0..world)
        .find(|&j| of_newest(j) && facts[j].last_norm.is_some_and(|(at, _)| at.checked_add(1) == Some(step)))
        .and_then(|j| facts[j].last_norm.map(|(_, norm)| norm));
    let finishes: Vec<bool> =
        (0..world).map(|j| of_newest(j) && behind(j) && facts[j].pending && norm.is_some()).collect();
    // A reproducible step whose fixed-point sum broke on some ranks after others had all of
    // it (a kill while the ring was gathering): a holder a step behind finishes it from the
    // sum a peer at the step kept (the same bits on every rank), so a block whose other
    // holders are gone is not lost.
    let sum_giver = (0..world).find(|&j| of_newest(j) && facts[j].step == step && facts[j].kept_sum);
    let catches_up: Vec<bool> = (0..world)
        .map(|j| reproducible && sum_giver.is_some() && of_newest(j) && behind(j) && !facts[j].pending)
        .collect();
    let effective = |j: usize| if finishes[j] || catches_up[j] { step } else { facts[j].step };
    // Who gives each value: a holder of the newest layout at the step, else a holder of
    // another layout at that step (a rank whose last re-cut broke keeps the layout before
    // it, whole, until one succeeds), else a rank with the whole state at that step.
    let mut sources: Vec<(usize, Range<usize>, (u8, i64))> = Vec::new();
    for j in (0..world).filter(|&j| effective(j) == step) {
        match (&held[j], layout_of(j)) {
            (Some(ranges), Some(l)) => {
                let class = u8::from(!of_newest(j));
                sources.extend(ranges.iter().map(|r| (j, r.clone(), (class, -(l.tag as i64)))));
            }
            _ if whole_at(j) == Some(step) => sources.push((j, 0..n, (2, 0))),
            _ => {}
        }
    }
    let own: Vec<Vec<Range<usize>>> =
        (0..world).map(|j| sources.iter().filter(|s| s.0 == j).map(|s| s.1.clone()).collect()).collect();
    let keeps: Vec<Vec<Range<usize>>> = (0..world)
        .map(|j| match &facts[j].target {
            // Without a target at another step, a rank loads the whole state afterwards.
            None if effective(j) != step => Vec::new(),
            None => std::iter::once(0..n).collect(),
            Some(t) => t.held(n),
        })
        .collect();
    // The parameters move only to a rank without those of the step rebuilt: one at another
    // step, one finishing the step (its other blocks' parameters never came), one whose
    // parameters' allgather broke.
    let params_to: Vec<bool> = (0..world)
        .map(|j| {
            facts[j].step != step
                || finishes[j]
                || catches_up[j]
                || facts[j].stale
                || facts[j].digest != facts[newest].digest
        })
        .collect();
    let pieces = givers(n, sources).map_err(|gap| {
        RegroupError::Lost(format!(
            "no live rank holds values {gap:?} of the optimizer state at step {step} (layout {tag}): every holder is gone"
        ))
    })?;
    let slot_moves = relay_pieces(&pieces, &keeps, &own);
    let everything = |to: bool| std::iter::once(0..n).filter(|_| to).collect::<Vec<_>>();
    let param_moves = relay_pieces(
        &pieces,
        &params_to.iter().map(|&m| everything(m)).collect::<Vec<_>>(),
        &vec![Vec::new(); world],
    );
    Ok(Some(RegroupPlan {
        step,
        tag,
        newest,
        cursor: f.cursor,
        seed: f.seed,
        draws: f.draws,
        finishes,
        norm,
        catches_up,
        sum_giver,
        pieces,
        own,
        params_to,
        slot_moves,
        param_moves,
    }))
}

/// Who gives each value of `0..n`: `sources` are (rank, values it holds, preference: lower
/// first); each value goes to the most preferred source holding it (then the lowest rank).
/// The pieces in order, or the first range nobody holds.
pub(super) fn givers(
    n: usize,
    mut sources: Vec<(usize, Range<usize>, (u8, i64))>,
) -> Result<Vec<(usize, Range<usize>)>, Range<usize>> {
    sources.retain(|(_, r, _)| !r.is_empty() && r.end <= n);
    sources.sort_by_key(|(j, _, pref)| (*pref, *j));
    let mut cuts: Vec<usize> = sources.iter().flat_map(|(_, r, _)| [r.start, r.end]).chain([0, n]).collect();
    cuts.sort_unstable();
    cuts.dedup();
    let mut by: Vec<Option<usize>> = vec![None; cuts.len().saturating_sub(1)];
    for (j, r, _) in &sources {
        // Ranges of one layout tile the values, so each layout walks each piece once.
        let first = cuts.partition_point(|&c| c < r.start);
        for (i, who) in by.iter_mut().enumerate().skip(first) {
            if cuts[i + 1] > r.end {
                break;
            }
            who.get_or_insert(*j);
        }
    }
    let mut pieces: Vec<(usize, Range<usize>)> = Vec::new();
    for (i, who) in by.iter().enumerate() {
        let range = cuts[i]..cuts[i + 1];
        match (who, pieces.last_mut()) {
            (None, _) => {
                let end = by[i..].iter().position(Option::is_some).map_or(n, |k| cuts[i + k]);
                return Err(range.start..end);
            }
            (Some(j), Some((last, r))) if last == j && r.end == range.start => r.end = range.end,
            (Some(j), _) => pieces.push((*j, range)),
        }
    }
    Ok(pieces)
}

/// What a relay moves so that every rank `j` ends with the values `takes[j]` in its buffer:
/// each of `pieces` (its giver, its values) cut where a rank's takes begin or end, each part
/// going to the ranks that take it and do not hold it already (`own[j]`; the giver holds its
/// own). Adjacent parts of one giver going to the same ranks are one piece.
pub(super) fn relay_pieces(
    pieces: &[(usize, Range<usize>)],
    takes: &[Vec<Range<usize>>],
    own: &[Vec<Range<usize>>],
) -> Vec<Piece> {
    let covers =
        |set: &[Range<usize>], r: &Range<usize>| set.iter().any(|s| s.start <= r.start && r.end <= s.end);
    let mut out: Vec<Piece> = Vec::new();
    for (giver, range) in pieces {
        let mut cuts = vec![range.start, range.end];
        for t in takes.iter().chain(own).flatten() {
            cuts.extend([t.start, t.end].into_iter().filter(|c| range.start < *c && *c < range.end));
        }
        cuts.sort_unstable();
        cuts.dedup();
        for w in cuts.windows(2) {
            let part = w[0]..w[1];
            let to: Vec<usize> = (0..takes.len())
                .filter(|&j| j != *giver && covers(&takes[j], &part) && !covers(&own[j], &part))
                .collect();
            if to.is_empty() {
                continue;
            }
            match out.last_mut() {
                Some(p) if p.giver == *giver && p.range.end == part.start && p.to == to => {
                    p.range.end = part.end
                }
                _ => out.push(Piece { giver: *giver, range: part, to }),
            }
        }
    }
    out
}
