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
}

fn add_source(sources: &mut Vec<(usize, Src, Vec<usize>)>, src: usize, kind: Src, k: usize) {
    match sources.iter_mut().find(|(s, t, _)| *s == src && *t == kind) {
        Some((_, _, blocks)) => blocks.push(k),
        None => sources.push((src, kind, vec![k])),
    }
}

/// From every rank's published states (in rank order), how rank `me`, which trains blocks
/// `target` of a model of `blocks` blocks in the epoch, enters.
///
/// Normally the epoch starts at the highest step any rank applied, from live states. The
/// *reference* is the first rank at that step holding exactly `target`: a rank that holds
/// the same blocks at the same step must match its hash or repair from it. Otherwise each
/// block comes from this rank itself if it holds it at the top step, else from the
/// reference, else from the first rank at the top step that holds it.
///
/// When some block of the model has no live holder at the top step (a pipeline stage lost
/// its only host), the epoch starts at the newest earlier step at which live states, kept
/// snapshots and shadows together hold every block, and every rank loads that step: this
/// rank's own states first, then the first rank's (live, then snapshot, then shadow).
pub fn entry_plan(
    ranks: &[RankState],
    me: usize,
    target: Range<usize>,
    blocks: usize,
) -> Result<EntryPlan, DecideError> {
    let top = ranks.iter().map(|r| r.live.step).max().unwrap_or(0);
    let live_holder = |k: usize| ranks.iter().position(|r| r.live.step == top && r.live.holds(k));
    if let Some(missing) = (0..blocks).find(|&k| live_holder(k).is_none()) {
        // Every (rank, state) holding block `k` at `step`, in rank order, live first.
        let held_at = |step: u64, k: usize| -> Vec<(usize, Src)> {
            let mut v = Vec::new();
            for (i, r) in ranks.iter().enumerate() {
                for t in KINDS {
                    if r.desc(t).is_some_and(|d| d.step == step && d.holds(k)) {
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
        return Ok(EntryPlan { step, action: Entry::Rollback, sources });
    }
    let want = (target.start, target.end);
    let reference = ranks.iter().position(|r| r.live.step == top && r.live.blocks == want);
    let mine = ranks[me].live;
    if mine.step == top && mine.blocks == want {
        let r = reference.expect("this rank qualifies");
        if ranks[r].live.hash == mine.hash {
            return Ok(EntryPlan { step: top, action: Entry::Keep, sources: Vec::new() });
        }
        return Ok(EntryPlan {
            step: top,
            action: Entry::Repair,
            sources: vec![(r, Src::Live, target.collect())],
        });
    }
    let mut sources = Vec::new();
    for k in target {
        let src = if mine.step == top && mine.holds(k) {
            me
        } else if let Some(r) = reference {
            r
        } else {
            live_holder(k).expect("every block has a live holder at the top step")
        };
        add_source(&mut sources, src, Src::Live, k);
    }
    Ok(EntryPlan { step: top, action: Entry::CatchUp, sources })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::entry::block_of;

    fn at(step: u64, hash: [u8; 32], blocks: (usize, usize)) -> RankState {
        RankState { live: Desc { step, hash, blocks }, snaps: [None; 2], shadows: [None; 2] }
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
        assert!((0..3).all(|r| entry_plan(&same, r, 0..4, 4).unwrap().action == Entry::Keep));
        // A laggard (it did not apply the step in flight) and a newcomer at step 0 catch up
        // from the first rank at the top.
        let mixed = [at(6, b, all), at(7, a, all), at(0, b, all), at(7, a, all)];
        let p = entry_plan(&mixed, 0, 0..4, 4).unwrap();
        assert_eq!((p.step, p.action, p.sources), (7, Entry::CatchUp, live(vec![(1, vec![0, 1, 2, 3])])));
        assert_eq!(entry_plan(&mixed, 1, 0..4, 4).unwrap().action, Entry::Keep);
        assert_eq!(entry_plan(&mixed, 2, 0..4, 4).unwrap().sources, live(vec![(1, vec![0, 1, 2, 3])]));
        assert_eq!(entry_plan(&mixed, 3, 0..4, 4).unwrap().action, Entry::Keep);
        // Same step, other state: copy and report.
        let diverged = [at(7, a, all), at(7, b, all)];
        let p = entry_plan(&diverged, 1, 0..4, 4).unwrap();
        assert_eq!((p.action, p.sources), (Entry::Repair, live(vec![(0, vec![0, 1, 2, 3])])));
    }

    #[test]
    fn entry_plan_moves_blocks_between_stages() {
        let (a, b, c) = ([1u8; 32], [2u8; 32], [3u8; 32]);
        // Two stages (0..2, 2..4) become plain data parallelism: each rank keeps its own
        // blocks and takes the others from the other stage.
        let two = [at(9, a, (0, 2)), at(9, b, (2, 4))];
        let p = entry_plan(&two, 1, 0..4, 4).unwrap();
        assert_eq!((p.action, p.sources), (Entry::CatchUp, live(vec![(0, vec![0, 1]), (1, vec![2, 3])])));
        // A 2x2 layout lost stage 1 of replica 0; the survivors re-plan to 1x2 with new
        // cuts (0..3, 3..4): the first takes block 2 from the surviving replica of stage 1.
        let survivors = [at(9, a, (0, 2)), at(9, a, (0, 2)), at(9, c, (2, 4))];
        let p = entry_plan(&survivors, 0, 0..3, 4).unwrap();
        assert_eq!(p.sources, live(vec![(0, vec![0, 1]), (2, vec![2])]));
        let p = entry_plan(&survivors, 2, 3..4, 4).unwrap();
        assert_eq!(p.sources, live(vec![(2, vec![3])]));
        // A block whose only holder did not apply the last step, and no snapshot: no way on.
        let stale = [at(9, a, (0, 2)), at(8, b, (2, 4))];
        let e = entry_plan(&stale, 0, 0..4, 4).unwrap_err().to_string();
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
        let p = entry_plan(&ranks, 0, 0..2, 4).unwrap();
        assert_eq!((p.step, p.action), (20, Entry::Rollback));
        assert_eq!(p.sources, vec![(0, Src::Shadow(0), vec![0, 1])]);
        let p = entry_plan(&ranks, 1, 2..4, 4).unwrap();
        assert_eq!(p.sources, vec![(0, Src::Snapshot(0), vec![2, 3])]);
        // The host died before its step-30 snapshot reached the neighbour: the neighbour has
        // its own at 30 and 20, the shadow at 20 only. Step 20 is the newest both exist for.
        let late = [RankState {
            live: d(33, b, (2, 4)),
            snaps: [Some(d(30, sb, (2, 4))), Some(d(20, sb, (2, 4)))],
            shadows: [Some(d(20, sa, (0, 2))), None],
        }];
        let p = entry_plan(&late, 0, 0..4, 4).unwrap();
        assert_eq!(
            (p.step, p.sources),
            (20, vec![(0, Src::Shadow(0), vec![0, 1]), (0, Src::Snapshot(1), vec![2, 3])])
        );
        // Without the shadow only the spare's fresh state at step 0 (the job's deterministic
        // initialization) holds every block: the job starts over.
        let bare = [RankState { shadows: [None; 2], ..ranks[0] }, ranks[1]];
        let p = entry_plan(&bare, 0, 0..2, 4).unwrap();
        assert_eq!((p.step, p.sources), (0, vec![(1, Src::Live, vec![0, 1])]));
        // With nobody at step 0 either, there is no way on.
        let none = [RankState { shadows: [None; 2], ..ranks[0] }];
        assert!(entry_plan(&none, 0, 0..2, 4)
            .unwrap_err()
            .to_string()
            .contains("no kept snapshot covers the model"));
    }

    #[test]
    fn tensor_names_map_to_blocks() {
        assert_eq!(block_of("param/b03.qkv.weight"), Some(3));
        assert_eq!(block_of("optim/m/b12.fc.bias"), Some(12));
        assert_eq!(block_of("param/tok"), None);
    }
}
