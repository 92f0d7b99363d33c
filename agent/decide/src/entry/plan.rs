//! Entry planning, pure: from every rank's published states (live, snapshots, shadows), the
//! step the epoch starts at and, for one rank, which states and blocks it takes from whom.
//! The agent's entry execution fetches what this plans; the wire codec (`wire`) carries the
//! published states.

pub use super::Desc;
use crate::DecideError;
use std::ops::Range;

/// What a rank does with its state when it enters an epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    /// It holds the epoch's state for its blocks.
    Keep,
    /// It is behind, new, or holds other blocks: assemble its blocks from holders.
    CatchUp,
    /// It holds its blocks at the top step but with another state (divergence): copy them
    /// from the reference and report.
    Repair,
    /// Some block has no live replica at the top step: everyone goes back to the newest
    /// step at which snapshots and live states together hold the whole model.
    Rollback,
}

/// Which of a rank's states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Src {
    /// The state it trains with.
    Live,
    /// Its own state at one of its last two shadowing steps (0: the newest).
    Snapshot(usize),
    /// The next stage's state at one of those steps, kept for it.
    Shadow(usize),
}

/// Every state a rank publishes, live first.
pub const KINDS: [Src; 5] = [Src::Live, Src::Snapshot(0), Src::Snapshot(1), Src::Shadow(0), Src::Shadow(1)];

/// What a rank publishes at an epoch's entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankState {
    /// The state it trains with.
    pub live: Desc,
    /// Its own states at its last two shadowing steps, newest first.
    pub snaps: [Option<Desc>; 2],
    /// The next stage's states it keeps at those steps, newest first.
    pub shadows: [Option<Desc>; 2],
}

impl RankState {
    /// The state of `kind`, if it has one.
    pub fn desc(&self, kind: Src) -> Option<Desc> {
        match kind {
            Src::Live => Some(self.live),
            Src::Snapshot(i) => self.snaps.get(i).copied().flatten(),
            Src::Shadow(i) => self.shadows.get(i).copied().flatten(),
        }
    }
}

/// How a rank enters: the step everyone starts at, what it does, and for each source rank
/// which of its states and which blocks it takes (itself included).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryPlan {
    /// The step every rank starts the epoch at.
    pub step: u64,
    /// What this rank does.
    pub action: Entry,
    /// For each source rank, which of its states and which blocks this rank takes.
    pub sources: Vec<(usize, Src, Vec<usize>)>,
    /// The rank whose live state this rank's assembled state must equal bit for bit (an
    /// agreed holder of exactly this rank's blocks at the step), where there is one.
    pub reference: Option<usize>,
}

fn add_source(sources: &mut Vec<(usize, Src, Vec<usize>)>, src: usize, kind: Src, k: usize) {
    match sources.iter_mut().find(|(s, t, _)| *s == src && *t == kind) {
        Some((_, _, blocks)) => blocks.push(k),
        None => sources.push((src, kind, vec![k])),
    }
}

/// Whether rank `i`'s live state may be copied from: what no single rank's word decides.
/// `survivors[j]`: rank `j` trained in the epoch before this one (survivors train in step,
/// so honest ones publish one step, or two a step apart after a ring broke mid-step).
///
/// Ranks that hold the same blocks at the same step must hold the same state, so a state
/// two or more ranks publish alike is agreed when no other state of those blocks at that
/// step is published as often. A state one rank alone publishes is taken only where nothing
/// contradicts it: no rival state of its blocks at its step, and no survivor holding any of
/// its blocks at another step. A lone survivor (beside newcomers, or a pipeline stage's one
/// replica) is all there is; one survivor ahead of, or behind, another is one rank's word
/// against another's. So a rank publishing a made-up state at a step above everyone's, or a
/// rival of an honest one, is nobody's source.
pub fn agreed(ranks: &[RankState], i: usize, survivors: &[bool]) -> bool {
    let d = ranks[i].live;
    let count = |x: &Desc| ranks.iter().filter(|r| r.live == *x).count();
    let alike = count(&d);
    let rivals = ranks
        .iter()
        .filter(|r| r.live.step == d.step && r.live.blocks == d.blocks && r.live.hash != d.hash)
        .map(|r| count(&r.live))
        .max()
        .unwrap_or(0);
    if alike >= 2 || rivals > 0 {
        return alike > rivals;
    }
    let overlaps = |b: (usize, usize)| b.0 < d.blocks.1 && d.blocks.0 < b.1;
    let survivor = |j: usize| survivors.get(j).copied().unwrap_or(false);
    // A newcomer behind the survivors contradicts nobody (it is behind); one ahead of a
    // survivor does.
    let contradicts = |r: &RankState| if survivor(i) { r.live.step != d.step } else { r.live.step < d.step };
    !ranks.iter().enumerate().any(|(j, r)| j != i && survivor(j) && contradicts(r) && overlaps(r.live.blocks))
}

/// From every rank's published states (in rank order), how rank `me`, which trains blocks
/// `target` of a model of `blocks` blocks, enters; `survivors` marks the ranks that trained
/// in the epoch before (see [`agreed`]).
///
/// Only [`agreed`] live states are sources. Normally the epoch starts at the highest step
/// at which agreed live states hold every block, never below one step before the furthest
/// survivor's (the step in flight when a ring broke may be given up, but survivors' states
/// are never traded for a newcomer's older one because they contradict each other). The
/// *reference* is the first agreed rank at that step holding exactly `target`: a rank that
/// holds the same blocks at the same step must match its hash or repair from it. Otherwise
/// each block comes from this rank itself if its agreed state holds it at that step, else
/// from one of the agreed ranks publishing the reference's state (chosen by this rank's
/// index, so newcomers spread over them), else from the first agreed rank at that step that
/// holds it.
///
/// When no such step exists (a pipeline stage lost its only host), the epoch starts at the
/// newest step below the highest agreed one at which agreed live states, kept snapshots and
/// shadows together hold every block, and every rank loads that step: this rank's own
/// states first, then the first rank's (live, then snapshot, then shadow).
pub fn entry_plan(
    ranks: &[RankState],
    me: usize,
    target: Range<usize>,
    blocks: usize,
    survivors: &[bool],
) -> Result<EntryPlan, DecideError> {
    let ok: Vec<bool> = (0..ranks.len()).map(|i| agreed(ranks, i, survivors)).collect();
    let survivor = |j: usize| survivors.get(j).copied().unwrap_or(false);
    let floor = match (0..ranks.len()).filter(|&j| survivor(j) && ok[j]).map(|j| ranks[j].live.step).max() {
        Some(furthest) => furthest.saturating_sub(1),
        None if (0..ranks.len()).any(survivor) => {
            // Every survivor's word is contradicted by another's: going on from a newcomer's
            // older state would let one rank reset the job.
            let rivals: Vec<usize> = (0..ranks.len()).filter(|&j| survivor(j)).collect();
            if let Some(torn) = torn_step(ranks, &rivals, blocks) {
                return Err(torn);
            }
            return Err(DecideError::NoSource(format!(
                "the survivors {rivals:?} publish states that contradict each other, and none is agreed: no state to enter with"
            )));
        }
        None => 0,
    };
    let holder = |step: u64, k: usize| {
        (0..ranks.len()).find(|&i| ok[i] && ranks[i].live.step == step && ranks[i].live.holds(k))
    };
    let mut steps: Vec<u64> = (0..ranks.len()).filter(|&i| ok[i]).map(|i| ranks[i].live.step).collect();
    steps.sort_unstable_by(|a, b| b.cmp(a));
    steps.dedup();
    let Some(&highest) = steps.first() else {
        return Err(DecideError::NoSource(
            "no two ranks agree on a live state and none is uncontested: no state to enter with".into(),
        ));
    };
    if highest < floor {
        let rivals: Vec<usize> = (0..ranks.len()).filter(|&i| !ok[i]).collect();
        return Err(DecideError::NoSource(format!(
            "no agreed live state at step {floor} or above (one before the furthest agreed survivor's); ranks {rivals:?} publish states nobody confirms"
        )));
    }
    let top =
        steps.iter().copied().filter(|&s| s >= floor).find(|&s| (0..blocks).all(|k| holder(s, k).is_some()));
    let Some(top) = top else {
        return rollback(ranks, &ok, me, target, blocks, highest);
    };
    let want = (target.start, target.end);
    let reference =
        (0..ranks.len()).find(|&i| ok[i] && ranks[i].live.step == top && ranks[i].live.blocks == want);
    let mine = ranks[me].live;
    if let Some(r) = reference.filter(|_| mine.step == top && mine.blocks == want) {
        if ranks[r].live.hash == mine.hash {
            return Ok(EntryPlan { step: top, action: Entry::Keep, sources: Vec::new(), reference });
        }
        return Ok(EntryPlan {
            step: top,
            action: Entry::Repair,
            sources: vec![(r, Src::Live, target.collect())],
            reference,
        });
    }
    // Every agreed rank holding the reference's very state serves it alike: newcomers spread
    // over them (by rank), so K joiners copy from many holders at once, not all from one.
    let served_by = reference.map(|r| {
        let alike: Vec<usize> =
            (0..ranks.len()).filter(|&i| i != me && ok[i] && ranks[i].live == ranks[r].live).collect();
        if alike.is_empty() {
            r
        } else {
            alike[me % alike.len()]
        }
    });
    let mut sources = Vec::new();
    for k in target {
        let src = if ok[me] && mine.step == top && mine.holds(k) {
            me
        } else if let Some(r) = served_by {
            r
        } else {
            holder(top, k).expect("the step was chosen so that every block has an agreed holder")
        };
        add_source(&mut sources, src, Src::Live, k);
    }
    Ok(EntryPlan { step: top, action: Entry::CatchUp, sources, reference })
}

/// Two survivors of the whole model a step apart, and no other: a ring broke after one
/// applied the step in flight and before the other did. Neither's word is taken as it is:
/// the one behind finishes the step alone (its own state, the whole batch), checks the other's
/// state against its own, and takes it or refuses it; nobody else copies anything until the
/// two publish one state.
fn torn_step(ranks: &[RankState], survivors: &[usize], blocks: usize) -> Option<DecideError> {
    let &[a, b] = survivors else { return None };
    let (behind, ahead) = if ranks[a].live.step < ranks[b].live.step { (a, b) } else { (b, a) };
    let (x, y) = (ranks[behind].live, ranks[ahead].live);
    let whole = x.blocks == (0, blocks) && y.blocks == (0, blocks);
    (whole && x.step.checked_add(1) == Some(y.step)).then_some(DecideError::TornStep {
        behind,
        ahead,
        step: x.step,
    })
}

/// The way back when some block has no agreed live holder: the newest step below `top` at
/// which agreed live states, kept snapshots and shadows hold every block.
fn rollback(
    ranks: &[RankState],
    ok: &[bool],
    me: usize,
    target: Range<usize>,
    blocks: usize,
    top: u64,
) -> Result<EntryPlan, DecideError> {
    let missing = (0..blocks)
        .find(|&k| !(0..ranks.len()).any(|i| ok[i] && ranks[i].live.step == top && ranks[i].live.holds(k)))
        .unwrap_or(0);
    // Every (rank, state) holding block `k` at `step`, in rank order, live first.
    let held_at = |step: u64, k: usize| -> Vec<(usize, Src)> {
        let mut v = Vec::new();
        for (i, r) in ranks.iter().enumerate() {
            for t in KINDS {
                let usable = t != Src::Live || ok[i];
                if usable && r.desc(t).is_some_and(|d| d.step == step && d.holds(k)) {
                    v.push((i, t));
                }
            }
        }
        v
    };
    let mut steps: Vec<u64> = ranks
        .iter()
        .flat_map(|r| KINDS.iter().filter_map(|&t| r.desc(t)).map(|d| d.step))
        .filter(|&s| s < top)
        .collect();
    steps.sort_unstable_by(|a, b| b.cmp(a));
    steps.dedup();
    let step = steps.into_iter().find(|&s| (0..blocks).all(|k| !held_at(s, k).is_empty())).ok_or_else(|| {
        DecideError::NoSource(format!("no rank holds block {missing} at step {top}, and no kept snapshot covers the model: no live replica to copy it from"))
    })?;
    let mut sources = Vec::new();
    for k in target {
        let holders = held_at(step, k);
        let (src, kind) = holders
            .iter()
            .find(|&&(i, _)| i == me)
            .or(holders.first())
            .copied()
            .expect("the step was chosen so that every block is held");
        add_source(&mut sources, src, kind, k);
    }
    Ok(EntryPlan { step, action: Entry::Rollback, sources, reference: None })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::entry::block_of;

    fn at(step: u64, hash: [u8; 32], blocks: (usize, usize)) -> RankState {
        RankState { live: Desc { step, hash, blocks }, snaps: [None; 2], shadows: [None; 2] }
    }

    /// Every rank trained in the epoch before, but those listed.
    fn but(n: usize, newcomers: &[usize]) -> Vec<bool> {
        (0..n).map(|i| !newcomers.contains(&i)).collect()
    }

    fn live(sources: Vec<(usize, Vec<usize>)>) -> Vec<(usize, Src, Vec<usize>)> {
        sources.into_iter().map(|(s, b)| (s, Src::Live, b)).collect()
    }

    #[test]
    fn entry_plan_picks_the_first_rank_at_the_top_and_repairs_divergence() {
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let all = (0, 4);
        // Everyone equal: nobody copies.
        let same = [at(7, a, all), at(7, a, all), at(7, a, all)];
        assert!((0..3)
            .all(|r| entry_plan(&same, r, 0..4, 4, &but(same.len(), &[])).unwrap().action == Entry::Keep));
        // A laggard (it did not apply the step in flight) and a newcomer at step 0 catch up
        // from the first rank at the top.
        let mixed = [at(6, b, all), at(7, a, all), at(0, b, all), at(7, a, all)];
        let p = entry_plan(&mixed, 0, 0..4, 4, &but(mixed.len(), &[2])).unwrap();
        assert_eq!((p.step, p.action, p.sources), (7, Entry::CatchUp, live(vec![(1, vec![0, 1, 2, 3])])));
        assert_eq!(entry_plan(&mixed, 1, 0..4, 4, &but(mixed.len(), &[2])).unwrap().action, Entry::Keep);
        assert_eq!(
            entry_plan(&mixed, 2, 0..4, 4, &but(mixed.len(), &[2])).unwrap().sources,
            live(vec![(1, vec![0, 1, 2, 3])])
        );
        assert_eq!(entry_plan(&mixed, 3, 0..4, 4, &but(mixed.len(), &[2])).unwrap().action, Entry::Keep);
        // Same step, other state: copy from the agreeing majority and report.
        let diverged = [at(7, a, all), at(7, b, all), at(7, a, all)];
        let p = entry_plan(&diverged, 1, 0..4, 4, &but(diverged.len(), &[])).unwrap();
        assert_eq!((p.action, p.sources), (Entry::Repair, live(vec![(0, vec![0, 1, 2, 3])])));
        assert_eq!(entry_plan(&diverged, 2, 0..4, 4, &but(diverged.len(), &[])).unwrap().action, Entry::Keep);
        // Two ranks that disagree: neither's word decides, and nobody enters.
        let split = [at(7, a, all), at(7, b, all)];
        let e = entry_plan(&split, 0, 0..4, 4, &but(split.len(), &[])).unwrap_err().to_string();
        assert!(e.contains("contradict each other"), "{e}");
    }

    /// Two survivors a step apart, nobody else to confirm either: every rank's plan says
    /// the one behind is to finish the step (nobody copies anything yet); once it took the
    /// other's state, the two are alike and everyone enters. A third survivor, a pipeline
    /// stage or a gap of two steps is not a torn step.
    #[test]
    fn a_torn_step_is_finished_by_the_survivor_behind_before_anyone_copies() {
        let (a, b, c) = ([1u8; 32], [2u8; 32], [3u8; 32]);
        let all = (0, 4);
        let torn = [at(6, b, all), at(7, a, all), at(0, c, all)];
        let survivors = but(torn.len(), &[2]);
        for me in 0..3 {
            let e = entry_plan(&torn, me, 0..4, 4, &survivors).unwrap_err();
            assert_eq!(e, DecideError::TornStep { behind: 0, ahead: 1, step: 6 }, "rank {me}");
        }
        let done = [at(7, a, all), at(7, a, all), at(0, c, all)];
        assert_eq!(entry_plan(&done, 0, 0..4, 4, &survivors).unwrap().action, Entry::Keep);
        assert_eq!(
            entry_plan(&done, 2, 0..4, 4, &survivors).unwrap().sources,
            live(vec![(0, vec![0, 1, 2, 3])])
        );
        let stage = [at(6, b, (0, 2)), at(7, a, (0, 2))];
        assert!(matches!(entry_plan(&stage, 0, 0..2, 4, &[true, true]), Err(DecideError::NoSource(_))));
        let apart = [at(5, b, all), at(7, a, all)];
        assert!(matches!(entry_plan(&apart, 0, 0..4, 4, &[true, true]), Err(DecideError::NoSource(_))));
        let three = [at(6, b, all), at(7, a, all), at(7, c, all)];
        assert!(!matches!(entry_plan(&three, 0, 0..4, 4, &[true; 3]), Err(DecideError::TornStep { .. })));
    }

    #[test]
    fn entry_plan_moves_blocks_between_stages() {
        let (a, b, c) = ([1u8; 32], [2u8; 32], [3u8; 32]);
        // Two stages (0..2, 2..4) become plain data parallelism: each rank keeps its own
        // blocks and takes the others from the other stage.
        let two = [at(9, a, (0, 2)), at(9, b, (2, 4))];
        let p = entry_plan(&two, 1, 0..4, 4, &but(two.len(), &[])).unwrap();
        assert_eq!((p.action, p.sources), (Entry::CatchUp, live(vec![(0, vec![0, 1]), (1, vec![2, 3])])));
        // A 2x2 layout lost stage 1 of replica 0; the survivors re-plan to 1x2 with new
        // cuts (0..3, 3..4): the first takes block 2 from the surviving replica of stage 1.
        let survivors = [at(9, a, (0, 2)), at(9, a, (0, 2)), at(9, c, (2, 4))];
        let p = entry_plan(&survivors, 0, 0..3, 4, &but(survivors.len(), &[])).unwrap();
        assert_eq!(p.sources, live(vec![(0, vec![0, 1]), (2, vec![2])]));
        let p = entry_plan(&survivors, 2, 3..4, 4, &but(survivors.len(), &[])).unwrap();
        assert_eq!(p.sources, live(vec![(2, vec![3])]));
        // A block whose only holder did not apply the last step, and no snapshot: no way on.
        let stale = [at(9, a, (0, 2)), at(8, b, (2, 4))];
        let e = entry_plan(&stale, 0, 0..4, 4, &but(stale.len(), &[])).unwrap_err().to_string();
        assert!(e.contains("no rank holds block 2 at step 9"), "{e}");
    }

    #[test]
    fn entry_plan_rolls_back_to_shadowed_snapshots() {
        let (a, b, sa, sb) = ([1u8; 32], [2u8; 32], [3u8; 32], [4u8; 32]);
        let d = |step, hash, blocks| Desc { step, hash, blocks };
        // Stage 0 (blocks 0..2) lost its host at step 23. The stage-1 host kept its own
        // snapshot at step 20 and stage 0's (its shadow); a spare joins with nothing.
        let ranks = [
            RankState {
                live: d(23, b, (2, 4)),
                snaps: [Some(d(20, sb, (2, 4))), None],
                shadows: [Some(d(20, sa, (0, 2))), None],
            },
            RankState { live: d(0, a, (0, 4)), snaps: [None; 2], shadows: [None; 2] },
        ];
        let p = entry_plan(&ranks, 0, 0..2, 4, &but(ranks.len(), &[1])).unwrap();
        assert_eq!((p.step, p.action), (20, Entry::Rollback));
        assert_eq!(p.sources, vec![(0, Src::Shadow(0), vec![0, 1])]);
        let p = entry_plan(&ranks, 1, 2..4, 4, &but(ranks.len(), &[1])).unwrap();
        assert_eq!(p.sources, vec![(0, Src::Snapshot(0), vec![2, 3])]);
        // The host died before its step-30 snapshot reached the neighbour: the neighbour has
        // its own at 30 and 20, the shadow at 20 only. Step 20 is the newest both exist for.
        let late = [RankState {
            live: d(33, b, (2, 4)),
            snaps: [Some(d(30, sb, (2, 4))), Some(d(20, sb, (2, 4)))],
            shadows: [Some(d(20, sa, (0, 2))), None],
        }];
        let p = entry_plan(&late, 0, 0..4, 4, &but(late.len(), &[])).unwrap();
        assert_eq!(
            (p.step, p.sources),
            (20, vec![(0, Src::Shadow(0), vec![0, 1]), (0, Src::Snapshot(1), vec![2, 3])])
        );
        // Without the shadow only the spare's fresh state at step 0 (the job's deterministic
        // initialization) holds every block: the job starts over.
        let bare = [RankState { shadows: [None; 2], ..ranks[0] }, ranks[1]];
        let p = entry_plan(&bare, 0, 0..2, 4, &but(bare.len(), &[1])).unwrap();
        assert_eq!((p.step, p.sources), (0, vec![(1, Src::Live, vec![0, 1])]));
        // With nobody at step 0 either, there is no way on.
        let none = [RankState { shadows: [None; 2], ..ranks[0] }];
        assert!(entry_plan(&none, 0, 0..2, 4, &but(none.len(), &[]))
            .unwrap_err()
            .to_string()
            .contains("no kept snapshot covers the model"));
    }

    /// Sixteen newcomers beside four survivors copy from all four, four each; a survivor
    /// whose state differs from the others' serves nobody.
    #[test]
    fn newcomers_spread_over_the_holders_of_the_agreed_state() {
        let (a, b, fresh) = ([1u8; 32], [3u8; 32], [2u8; 32]);
        let all = (0, 4);
        let mut ranks = vec![at(10, a, all); 4];
        ranks.extend(std::iter::repeat_n(at(0, fresh, all), 16));
        let survivors = but(ranks.len(), &(4..20).collect::<Vec<_>>());
        let mut served = [0usize; 4];
        for me in 4..20 {
            let p = entry_plan(&ranks, me, 0..4, 4, &survivors).unwrap();
            assert_eq!((p.step, p.action, p.reference), (10, Entry::CatchUp, Some(0)));
            let [(src, Src::Live, blocks)] = p.sources.as_slice() else { panic!("{:?}", p.sources) };
            assert_eq!(blocks, &vec![0, 1, 2, 3]);
            served[*src] += 1;
        }
        assert_eq!(served, [4, 4, 4, 4]);
        // Survivor 2 diverged: outvoted, it serves no newcomer (and repairs itself).
        ranks[2] = at(10, b, all);
        for me in 4..20 {
            let p = entry_plan(&ranks, me, 0..4, 4, &survivors).unwrap();
            assert!(p.sources.iter().all(|(src, _, _)| *src != 2), "{:?}", p.sources);
        }
        assert_eq!(entry_plan(&ranks, 2, 0..4, 4, &survivors).unwrap().action, Entry::Repair);
    }

    /// A rank publishing a made-up state at a step above everyone's (the job's last, say),
    /// at a join and at a rebuild, or a rival of an honest state: no honest rank copies it,
    /// and the honest ranks' plans are what they would be without it.
    #[test]
    fn a_rank_publishing_an_unplanned_step_changes_no_state() {
        let (a, fake, fresh) = ([1u8; 32], [0xee; 32], [2u8; 32]);
        let all = (0, 4);
        let last = 1_000_000;
        // A join at a planned boundary (step 10): two survivors, the liar, a newcomer.
        let join = [at(10, a, all), at(10, a, all), at(last, fake, all), at(0, fresh, all)];
        for me in [0, 1] {
            assert_eq!(entry_plan(&join, me, 0..4, 4, &but(join.len(), &[3])).unwrap().action, Entry::Keep);
        }
        let p = entry_plan(&join, 3, 0..4, 4, &but(join.len(), &[3])).unwrap();
        assert_eq!((p.step, p.action, p.reference), (10, Entry::CatchUp, Some(0)));
        // Either survivor serves the agreed state (rank 3 of two holders: the second).
        assert_eq!(p.sources, live(vec![(1, vec![0, 1, 2, 3])]));
        // The liar's own plan takes it back to the agreed state.
        assert_eq!(
            entry_plan(&join, 2, 0..4, 4, &but(join.len(), &[3])).unwrap().sources,
            live(vec![(0, vec![0, 1, 2, 3])])
        );
        // A lone survivor past a boundary committed late: its state is all there is, and a
        // liar claiming a later step beside it is contradicted by it.
        let late = [at(12, a, all), at(0, fresh, all)];
        assert_eq!(entry_plan(&late, 1, 0..4, 4, &but(late.len(), &[1])).unwrap().step, 12);
        // A newcomer claiming a later step beside it contradicts nothing it can show.
        let late = [at(12, a, all), at(last, fake, all), at(0, fresh, all)];
        let p = entry_plan(&late, 2, 0..4, 4, &but(3, &[1, 2])).unwrap();
        assert_eq!((p.step, p.sources), (12, live(vec![(0, vec![0, 1, 2, 3])])));
        // Two survivors a step apart, or further, one of them the liar (an honest rank that
        // applied the step in flight would publish the same): one rank's word against
        // another's. Nobody enters, not even from the newcomer's older state. A step apart,
        // the honest rank finishes the step alone and checks the liar's state against its
        // own before it takes it; nobody copies anything meanwhile.
        for liar in [11, last, 0] {
            let two = [at(10, a, all), at(liar, fake, all), at(0, fresh, all)];
            let e = entry_plan(&two, 2, 0..4, 4, &but(3, &[2])).unwrap_err();
            match liar {
                11 => assert_eq!(e, DecideError::TornStep { behind: 0, ahead: 1, step: 10 }),
                _ => assert!(e.to_string().contains("contradict each other"), "{e}"),
            }
        }
        // A rebuild after a kill -9: the epoch starts at step 20, the survivors' step; the
        // liar claims a step past it, then the survivors' step with a made-up state.
        let rebuild = [at(20, a, all), at(20, a, all), at(21, fake, all)];
        let p = entry_plan(&rebuild, 0, 0..4, 4, &but(rebuild.len(), &[])).unwrap();
        assert_eq!((p.step, p.action), (20, Entry::Keep));
        let rival = [at(20, a, all), at(20, a, all), at(20, fake, all)];
        assert_eq!(entry_plan(&rival, 1, 0..4, 4, &but(rival.len(), &[])).unwrap().action, Entry::Keep);
        let p = entry_plan(&rival, 2, 0..4, 4, &but(rival.len(), &[])).unwrap();
        assert_eq!((p.action, p.sources), (Entry::Repair, live(vec![(0, vec![0, 1, 2, 3])])));
        // One honest rank applied step 21 before the ring broke, and the liar publishes a
        // rival of it: the others agree on step 20, and everyone enters there.
        let ahead = [at(21, a, all), at(20, fresh, all), at(20, fresh, all), at(21, fake, all)];
        let p = entry_plan(&ahead, 0, 0..4, 4, &but(ahead.len(), &[])).unwrap();
        assert_eq!((p.step, p.action, p.sources), (20, Entry::CatchUp, live(vec![(1, vec![0, 1, 2, 3])])));
        // Without the liar the rank ahead is still one rank's word against two: it goes
        // back with them (one step computed again).
        let p = entry_plan(&ahead[..3], 0, 0..4, 4, &but(3, &[])).unwrap();
        assert_eq!((p.step, p.sources), (20, live(vec![(1, vec![0, 1, 2, 3])])));
        // A pipeline stage's replica claiming a step past its stage's: its blocks come from
        // the honest replica.
        let stages = [at(9, a, (0, 2)), at(9, fresh, (2, 4)), at(9, fresh, (2, 4)), at(last, fake, (2, 4))];
        let p = entry_plan(&stages, 0, 0..4, 4, &but(stages.len(), &[])).unwrap();
        assert_eq!(p.sources, live(vec![(0, vec![0, 1]), (1, vec![2, 3])]));
    }

    proptest::proptest! {
        /// Whatever one rank publishes (any step and blocks, a state of its own) beside two or more honest
        /// survivors that agree and any newcomers, every honest rank enters at the
        /// survivors' step and copies nothing from it.
        #[test]
        fn one_ranks_word_moves_no_honest_rank(
            survivors in 2usize..5,
            newcomers in 0usize..3,
            step in 1u64..50,
            late in 0u64..3,
            liar_at in 0usize..8,
            liar_step in proptest::prop_oneof![0u64..60, proptest::prelude::any::<u64>()],
            liar_hash in 3u8..6,
            liar_blocks in (0usize..4, 0usize..4),
            liar_survived in proptest::prelude::any::<bool>(),
        ) {
            let all = (0, 4);
            let mut ranks: Vec<RankState> = (0..survivors).map(|_| at(step + late, [1; 32], all)).collect();
            ranks.extend((0..newcomers).map(|_| at(0, [2; 32], all)));
            let (lo, hi) = (liar_blocks.0.min(liar_blocks.1), liar_blocks.0.max(liar_blocks.1));
            let liar = liar_at % (ranks.len() + 1);
            ranks.insert(liar, at(liar_step, [liar_hash; 32], (lo, hi.max(lo + 1))));
            let mut survived: Vec<bool> = (0..survivors).map(|_| true).collect();
            survived.extend((0..newcomers).map(|_| false));
            survived.insert(liar, liar_survived);
            for me in (0..ranks.len()).filter(|&i| i != liar) {
                let p = entry_plan(&ranks, me, 0..4, 4, &survived).unwrap();
                proptest::prop_assert_eq!(p.step, step + late);
                proptest::prop_assert!(p.sources.iter().all(|(src, _, _)| *src != liar));
                proptest::prop_assert!(p.reference != Some(liar));
            }
        }
    }

    #[test]
    fn tensor_names_map_to_blocks() {
        assert_eq!(block_of("param/b03.qkv.weight"), Some(3));
        assert_eq!(block_of("optim/m/b12.fc.bias"), Some(12));
        assert_eq!(block_of("param/tok"), None);
    }
}
