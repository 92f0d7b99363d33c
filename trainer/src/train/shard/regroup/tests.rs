//! The regroup's tests: hostile peers' facts, forged exponents and sums, and the choice of givers.

use super::hostile_reduce::Hostile;
use super::*;
use crate::train::tests::{job, synthetic};
use crate::ModelKind;
use proptest::prelude::*;

fn sharded_trainer() -> Trainer {
    let data = synthetic();
    let mut j = job(ModelKind::Mlp, &data, 16, 16);
    j.optimizer = crate::optim::OptimizerSpec::adamw(1e-2, 0.01);
    let mut t = Trainer::try_new(j, data).unwrap();
    let n = t.buffer_len() - 3;
    t.shard_state(ShardLayout::new(n, 2, 0, 1).unwrap().tagged(3)).unwrap();
    t
}

/// A peer whose facts are rank 0's own (so the regroup gets as far as the exponents,
/// with the peer as the rank they come from) and who then adds `exps` to them.
struct ForgedExponents {
    facts: Vec<i64>,
    exps: Vec<i64>,
    calls: usize,
}

impl Reduce for ForgedExponents {
    fn allreduce_sum(&mut self, _: &mut [f32], _: u64) -> Result<(), TrainerError> {
        Ok(())
    }

    fn allreduce_sum_i64(&mut self, buf: &mut [i64], _: u64) -> Result<(), TrainerError> {
        self.calls += 1;
        let add = if self.calls == 1 { &self.facts } else { &self.exps };
        let from = if self.calls == 1 { FACTS } else { 0 };
        let start = from.min(buf.len());
        for (v, r) in buf[start..].iter_mut().zip(add.iter().cycle()) {
            *v = v.wrapping_add(*r);
        }
        Ok(())
    }
}

/// A peer whose facts say it is a step ahead in the same layout and kept that step's
/// sum, which it then gives as `sum` (after giving no exponents).
struct ForgedSum {
    facts: Vec<i64>,
    sum: Vec<i64>,
    calls: usize,
}

impl Reduce for ForgedSum {
    fn allreduce_sum(&mut self, _: &mut [f32], _: u64) -> Result<(), TrainerError> {
        Ok(())
    }

    fn allreduce_sum_i64(&mut self, buf: &mut [i64], _: u64) -> Result<(), TrainerError> {
        self.calls += 1;
        let (add, from) = match self.calls {
            1 => (&self.facts[..], FACTS),
            3 => (&self.sum[..], 0),
            _ => return Ok(()),
        };
        let start = from.min(buf.len());
        for (v, r) in buf[start..].iter_mut().zip(add) {
            *v = v.wrapping_add(*r);
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

/// What a relay moves covers every value a rank keeps and does not hold, exactly once,
/// from the piece's giver; nothing goes to its giver or to a rank holding it already; the
/// moves are disjoint and lie within their givers' pieces.
#[test]
fn relay_pieces_deliver_what_each_rank_lacks_once(
    n in 0usize..200,
    world in 1usize..6,
    cuts in proptest::collection::vec(0usize..200, 0..6),
    givers_of in proptest::collection::vec(0usize..6, 7),
    takes_raw in proptest::collection::vec(proptest::collection::vec((0usize..200, 0usize..200), 0..3), 6),
    own_raw in proptest::collection::vec(proptest::collection::vec((0usize..200, 0usize..200), 0..3), 6),
) {
    let mut at: Vec<usize> = cuts.iter().map(|c| c % (n + 1)).chain([0, n]).collect();
    at.sort_unstable();
    at.dedup();
    let pieces: Vec<(usize, Range<usize>)> =
        at.windows(2).enumerate().map(|(k, w)| (givers_of[k % 7] % world, w[0]..w[1])).collect();
    let ranges = |raw: &Vec<(usize, usize)>| -> Vec<Range<usize>> {
        raw.iter().map(|&(a, b)| (a % (n + 1)).min(b % (n + 1))..(a % (n + 1)).max(b % (n + 1))).collect()
    };
    let takes: Vec<Vec<Range<usize>>> = takes_raw[..world].iter().map(ranges).collect();
    // A giver holds its own pieces.
    let own: Vec<Vec<Range<usize>>> = (0..world)
        .map(|j| ranges(&own_raw[j]).into_iter().chain(pieces.iter().filter(|p| p.0 == j).map(|p| p.1.clone())).collect())
        .collect();
    let moves = relay_pieces(&pieces, &takes, &own);
    let inside = |set: &[Range<usize>], v: usize| set.iter().any(|r| r.contains(&v));
    for m in &moves {
        prop_assert!(!m.range.is_empty() && !m.to.is_empty() && !m.to.contains(&m.giver));
        // Within the giver's pieces (adjacent ones of one giver may make one move).
        prop_assert!(m.range.clone().all(|v| pieces.iter().any(|p| p.0 == m.giver && p.1.contains(&v))));
    }
    for v in 0..n {
        let giver = pieces.iter().find(|p| p.1.contains(&v)).map(|p| p.0).unwrap();
        for j in 0..world {
            let got: Vec<&Piece> = moves.iter().filter(|m| m.range.contains(&v) && m.to.contains(&j)).collect();
            let lacks = inside(&takes[j], v) && !inside(&own[j], v) && j != giver;
            prop_assert_eq!(got.len(), usize::from(lacks), "rank {} value {}", j, v);
            prop_assert!(got.iter().all(|m| m.giver == giver));
        }
        prop_assert!(moves.iter().filter(|m| m.range.contains(&v)).count() <= 1, "overlapping moves at {}", v);
    }
}


    /// Whatever sum a peer that says it kept one gives a reproducible rank a step
    /// behind, the rank ends with an error or with the step finished, never a panic; a
    /// forged exponent or sample count is refused before the state changes.
    #[test]
    fn a_forged_sum_is_refused_or_finishes_the_step(
        values in proptest::collection::vec(prop_oneof![
            Just(0i64), Just(1), Just(-1), Just(1030), Just(1031), Just(i64::MAX), Just(i64::MIN), any::<i64>(),
        ], 1..64),
        exps_fit in any::<bool>(),
        count_fits in any::<bool>(),
    ) {
        let mut t = sharded_trainer();
        t.job.reproducible = true;
        let n = t.buffer_len() - 3;
        let tensors = t.model.params().len() + 1;
        let len = n + 3 + 3 * tensors;
        let mut facts = t.regroup_facts(FACTS).unwrap();
        (facts[3], facts[4], facts[9], facts[17]) = (1, 1, t.plan.global_batch as i64, 1);
        let mut sum: Vec<i64> = values.iter().cycle().take(len + tensors).copied().collect();
        match exps_fit {
            true => sum[len..].iter_mut().for_each(|e| *e = e.rem_euclid(1000)),
            false => sum[len + tensors - 1] = 1031,
        }
        sum[n + 1] = match count_fits {
            true => t.plan.global_batch as i64,
            false => sum[n + 1].clamp(-1 << 20, 1 << 20) * 64 + 1,
        };
        let before = t.step();
        let params: Vec<Vec<f32>> = t.model.params().iter().map(|(_, p)| Vec::<f32>::try_from(p.flatten(0, -1)).unwrap()).collect();
        let target = ShardLayout::new(n, 2, 0, 1).unwrap().tagged(3);
        let done = t.regroup(0, 2, Some(target), u64::MAX, &mut ForgedSum { facts, sum, calls: 0 }, None);
        prop_assert!(t.step() == before || t.step() == before + 1);
        if exps_fit && count_fits {
            // Garbage that passes the checks is a sum like any other: the step is done.
            prop_assert!(done.is_ok(), "{done:?}");
            prop_assert_eq!(t.step(), before + 1);
        } else {
            let e = done.unwrap_err().to_string();
            prop_assert!(e.contains("exponent") || e.contains("not the global batch"), "{e}");
            prop_assert_eq!(t.step(), before, "a refused sum changed the step");
            let after: Vec<Vec<f32>> = t.model.params().iter().map(|(_, p)| Vec::<f32>::try_from(p.flatten(0, -1)).unwrap()).collect();
            prop_assert!(after == params, "a refused sum changed the parameters");
        }
    }

    /// Whatever exponents the rank they come from gives in a reproducible job's
    /// regroup, this rank ends with an error or with exponents in range, never a panic.
    #[test]
    fn forged_exponents_are_refused_or_in_range(
        exps in proptest::collection::vec(prop_oneof![
            Just(0i64), Just(1), Just(-1), Just(1030), Just(1031), Just(i64::MAX), Just(i64::MIN), any::<i64>(), -2000i64..2000,
        ], 0..12),
    ) {
        let mut t = sharded_trainer();
        t.job.reproducible = true;
        let n = t.buffer_len() - 3;
        let mut facts = t.regroup_facts(FACTS).unwrap();
        facts[3] = 1;
        let mut peer = ForgedExponents { facts, exps: exps.clone(), calls: 0 };
        let target = ShardLayout::new(n, 2, 0, 1).unwrap().tagged(4);
        let done = t.regroup(0, 2, Some(target), u64::MAX, &mut peer, None);
        prop_assert!(peer.calls >= 2, "the regroup stopped before the exponents");
        if done.is_ok() {
            let range = super::super::super::exact::EXP_RANGE;
            let got = t.exact_exponents.clone().unwrap_or_default();
            prop_assert!(got.iter().all(|e| range.contains(e)), "{got:?}");
        }
        // Nothing given (the peer held none) is the one way to end with none.
        if exps.iter().all(|&e| e == 0) {
            prop_assert!(done.is_ok() && t.exact_exponents.is_none());
        }
    }

    /// Whatever a peer puts in its facts, a regroup ends with a result, never a panic,
    /// whatever world or replica count it forges (both are bounded before any use).
    #[test]
    fn a_hostile_peers_facts_never_panic(
        row in proptest::collection::vec(prop_oneof![
            Just(0i64), Just(1), Just(2), Just(-1), Just(i64::MAX), Just(i64::MIN), any::<i64>(), 0i64..1 << 20,
        ], FACTS),
        noise in any::<f32>(),
        recut in any::<bool>(),
    ) {
        let mut t = sharded_trainer();
        let n = t.buffer_len() - 3;
        let target = recut.then(|| ShardLayout::new(n, 2, 0, 1).unwrap().tagged(4));
        let _ = t.regroup(0, 2, target, u64::MAX, &mut Hostile { row, from: FACTS, noise }, None); // rank 1's row
    }

    /// The same from a row that is rank 0's own with a few values changed: past the
    /// checks, into the choice of givers and the moves.
    #[test]
    fn a_peers_facts_near_an_honest_row_never_panic(
        edits in proptest::collection::vec((0usize..FACTS, prop_oneof![
            Just(0i64), Just(1), Just(2), Just(3), Just(4), Just(-1), Just(i64::MAX), any::<i64>(),
        ]), 1..4),
        noise in any::<f32>(),
        recut in any::<bool>(),
        reproducible in any::<bool>(),
        bounded in any::<bool>(),
    ) {
        let mut t = sharded_trainer();
        // A reproducible job also takes a step's sum from a peer that says it kept one.
        t.job.reproducible = reproducible;
        let n = t.buffer_len() - 3;
        let mut row = t.regroup_facts(FACTS).unwrap();
        row[3] = 1;
        for (i, v) in edits {
            row[i] = v;
        }
        let target = recut.then(|| ShardLayout::new(n, 2, 0, 1).unwrap().tagged(4));
        let mut peer = Hostile { row, from: FACTS, noise }; // rank 1's row
        if bounded {
            let bounds = RegroupBounds {
                hosts: vec![0, 1],
                known: vec![3],
                layouts: (0..2).map(|r| vec![ShardLayout::new(n, 2, r, 1).unwrap().tagged(3)]).collect(),
            };
            let _ = t.regroup(0, 2, target, u64::MAX, &mut peer, Some(&bounds));
        } else {
            let _ = t.regroup(0, 2, target, u64::MAX, &mut peer, None);
        }
    }

    /// The pieces tile the values, each given by a source holding it, the most
    /// preferred one; a value nobody holds is named.
    #[test]
    fn givers_tile_the_values_from_the_preferred_holder(
        n in 0usize..300,
        raw in proptest::collection::vec((0usize..4, 0usize..320, 0usize..320, 0u8..3, -3i64..3), 0..12),
    ) {
        let sources: Vec<(usize, Range<usize>, (u8, i64))> =
            raw.iter().map(|&(j, a, b, p, t)| (j, a.min(b)..a.max(b), (p, t))).collect();
        let best = |v: usize| {
            sources.iter().filter(|(_, r, _)| r.contains(&v) && r.end <= n).min_by_key(|(j, _, p)| (*p, *j)).map(|s| s.0)
        };
        match givers(n, sources.clone()) {
            Ok(pieces) => {
                let mut at = 0;
                for (j, r) in &pieces {
                    prop_assert_eq!(r.start, at);
                    at = r.end;
                    for v in r.clone() {
                        prop_assert_eq!(best(v), Some(*j));
                    }
                }
                prop_assert_eq!(at, n);
            }
            Err(gap) => {
                prop_assert!(!gap.is_empty());
                prop_assert!((0..gap.start).all(|v| best(v).is_some()));
                prop_assert!(gap.clone().all(|v| best(v).is_none()));
                prop_assert!(gap.end == n || best(gap.end).is_some(), "the gap ends where a holder begins");
            }
        }
    }
}

/// The value ranges a layout holds.
fn held_values(l: &ShardLayout) -> Vec<Range<usize>> {
    l.held().into_iter().map(|b| l.blocks()[b].clone()).collect()
}

/// A forged row is refused naming the rank and what was wrong.
#[test]
fn a_forged_world_is_refused_naming_the_rank() {
    let mut row = vec![0i64; FACTS];
    row[1] = 1 << 40;
    let e = checked_layout(1000, 1, &row).unwrap_err().to_string();
    assert!(e.contains("rank 1's facts in the regroup"), "{e}");
    row[1] = 4;
    row[2] = 65;
    assert!(checked_layout(1000, 1, &row).is_err());
    row[2] = 3;
    row[3] = 2;
    (row[21], row[22]) = (3, 4);
    // Block-holding ranks per host: none, or not dividing their count, is refused.
    for forged in [0, 3, 5, i64::MIN] {
        row[19] = forged;
        let e = checked_layout(1000, 1, &row).unwrap_err().to_string();
        assert!(e.contains("rank 1's facts"), "{e}");
    }
    row[19] = 1;
    let one = ShardLayout::over_hosts(1000, 4, 1, 2, 3).unwrap();
    assert_eq!(checked_layout(1000, 1, &row).unwrap(), Some(held_values(&one)));
    // Hosts of two: the replica is the same local rank on the host before.
    row[2] = 1;
    row[19] = 2;
    let two = ShardLayout::over_hosts(1000, 4, 2, 2, 1).unwrap();
    assert_eq!(checked_layout(1000, 1, &row).unwrap(), Some(held_values(&two)));
    // Hosts of 3 and 2 (five ranks, two holding blocks on each): the third rank of host 0
    // owns an empty block and holds nothing; host 1's second rank (rank 4) is the fourth
    // to hold one, its replica the same local rank's block on host 0.
    let unequal = |rank| ShardLayout::over_host_counts(1000, &[3, 2], rank, 1).unwrap();
    (row[1], row[19], row[22]) = (5, 2, 4);
    for (rank, s) in [(2, 0), (4, 4), (1, 2)] {
        (row[3], row[21]) = (rank, s);
        let want: Vec<Range<usize>> = match s {
            0 => Vec::new(),
            _ => held_values(&unequal(rank as usize)),
        };
        assert_eq!(checked_layout(1000, 1, &row).unwrap(), Some(want.clone()), "rank {rank}");
        assert!(want.iter().all(|r| !r.is_empty()) && (s == 0) == want.is_empty(), "rank {rank}: {want:?}");
    }
    assert_eq!(unequal(2).held(), vec![2]);
    assert!(unequal(2).blocks()[2].is_empty());
    // A place past the block-holding ranks, or more of them than ranks: refused.
    for (s, shards) in [(5, 4), (1, 6)] {
        (row[21], row[22]) = (s, shards);
        let e = checked_layout(1000, 1, &row).unwrap_err().to_string();
        assert!(e.contains("rank 1's facts"), "{e}");
    }
    (row[1], row[3], row[21], row[22]) = (4, 2, 3, 4);
    // As many replicas as hosts: refused naming the rank, as every forged fact is.
    row[2] = 2;
    let e = checked_layout(1000, 1, &row).unwrap_err().to_string();
    assert!(
        e.contains("rank 1's facts") && e.contains("2 replicas of each shard need more than 2 hosts"),
        "{e}"
    );
    row[2] = 1;
    // The target's facts, bounded like a layout's.
    for (k, forged) in [(20, -1), (20, MOST_RANKS + 1), (24, i64::MAX), (23, -1), (23, MOST_RANKS + 2)] {
        let kept = row[k];
        row[k] = forged;
        let e = checked_layout(1000, 1, &row).unwrap_err().to_string();
        assert!(e.contains("rank 1's facts") && e.contains("a target fact"), "{e}");
        row[k] = kept;
    }
}

/// The sharded re-cut's version of an entry's rule: a rank publishing a layout the log never
/// gave it (a newer tag, one rank holding every value), the same layout a step too far, or a
/// whole state a step further on, is nobody's giver, and an honest rank keeps its own state
/// at its own step; believed, the same rows replace the honest rank's state and step, or
/// send it to start afresh. Honest claims still count: a host that holds every shard beside
/// a newcomer, and a layout of an epoch the log does not know that two hosts hold.
#[test]
fn a_rank_publishing_an_unplanned_layout_or_step_changes_no_state_in_a_recut() {
    let values = |t: &Trainer| -> Vec<Vec<f32>> {
        let s = t.shard.as_ref().unwrap();
        let params = t.model.params().iter().map(|(_, p)| p.shallow_clone());
        let held = s.held.iter().flat_map(|(_, h)| h.iter().map(Tensor::shallow_clone));
        params.chain(held).map(|p| Vec::<f32>::try_from(p.flatten(0, -1)).unwrap()).collect()
    };
    let honest = sharded_trainer();
    let n = honest.buffer_len() - 3;
    let mine = honest.regroup_facts(FACTS).unwrap();
    // Every value in one rank's hands, at the job's last step, under a tag past every epoch's.
    let mut forged = mine.clone();
    forged[..4].copy_from_slice(&[9, 1, 0, 0]);
    (forged[4], forged[9]) = (1_000_000, 1_000_000);
    (forged[19], forged[21], forged[22]) = (1, 1, 1);
    // The peer's own layout (the log's, tag 3), a step past this rank's and then at it.
    let mut ahead = mine.clone();
    (ahead[3], ahead[21], ahead[4], ahead[9]) = (1, 2, 7, 7);
    // No shard and a whole state one step further on: within a step, and alone.
    let mut whole = vec![0i64; FACTS];
    (whole[4], whole[8], whole[9]) = (1, 1, 64);
    let bounds = RegroupBounds {
        hosts: vec![0, 1],
        known: vec![3],
        layouts: (0..2).map(|r| vec![ShardLayout::new(n, 2, r, 1).unwrap().tagged(3)]).collect(),
    };
    let target = || Some(ShardLayout::new(n, 2, 0, 1).unwrap().tagged(4));
    for row in [&forged, &whole] {
        let mut t = sharded_trainer();
        let before = values(&t);
        let mut peer = Hostile { row: row.clone(), from: FACTS, noise: 3.0 };
        let done = t.regroup(0, 2, target(), u64::MAX, &mut peer, Some(&bounds)).unwrap();
        assert_eq!((done, t.step()), (Some(0), 0));
        assert!(values(&t) == before, "the re-cut took a value from the peer");
    }
    // The same layout seven steps on: one of the two is lying, and nobody can tell which.
    let mut t = sharded_trainer();
    let mut peer = Hostile { row: ahead, from: FACTS, noise: 3.0 };
    let e = t.regroup(0, 2, target(), u64::MAX, &mut peer, Some(&bounds)).unwrap_err().to_string();
    assert!(e.contains("at steps 0 and 7"), "{e}");
    assert_eq!(t.step(), 0);
    // The forged row beside a rank that holds no shard (a newcomer, or the job's first
    // re-cut): alone, it is nobody's source either.
    let mut fresh = Trainer::try_new(honest.job.clone(), synthetic()).unwrap();
    let mut peer = Hostile { row: forged.clone(), from: FACTS, noise: 3.0 };
    let e = fresh.regroup(0, 2, target(), u64::MAX, &mut peer, Some(&bounds)).unwrap_err().to_string();
    assert!(e.contains("bear none of them out"), "{e}");
    assert_eq!(fresh.step(), 0);
    // Believed (every claim taken at its word): the forged row decides this rank's state,
    // and the whole state "further on" makes it start afresh (nothing rebuilt).
    let mut t = sharded_trainer();
    let before = values(&t);
    let done =
        t.regroup(0, 2, target(), u64::MAX, &mut Hostile { row: forged, from: FACTS, noise: 3.0 }, None);
    assert_eq!((done.unwrap(), t.step()), (Some(1_000_000), 1_000_000));
    assert!(values(&t) != before);
    let mut t = sharded_trainer();
    assert_eq!(
        t.regroup(0, 2, target(), u64::MAX, &mut Hostile { row: whole, from: FACTS, noise: 0.0 }, None)
            .unwrap(),
        None
    );
    // An honest peer in the same layout at this rank's step: both count.
    let mut next = mine.clone();
    (next[3], next[21]) = (1, 2);
    let mut t = sharded_trainer();
    let mut peer = Hostile { row: next.clone(), from: FACTS, noise: 0.0 };
    assert_eq!(t.regroup(0, 2, target(), u64::MAX, &mut peer, Some(&bounds)).unwrap(), Some(0));
    // The same layout of an epoch the log does not know (scheduled, entered, replaced): two
    // hosts hold it, so it counts; one rank alone beside another host's does not.
    let unknown = RegroupBounds { known: Vec::new(), ..bounds.clone() };
    let mut t = sharded_trainer();
    let mut peer = Hostile { row: next, from: FACTS, noise: 0.0 };
    assert_eq!(t.regroup(0, 2, target(), u64::MAX, &mut peer, Some(&unknown)).unwrap(), Some(0));
    let mut t = sharded_trainer();
    let mut peer = Hostile { row: forged_again(&mine), from: FACTS, noise: 0.0 };
    let e = t.regroup(0, 2, target(), u64::MAX, &mut peer, Some(&unknown)).unwrap_err().to_string();
    assert!(e.contains("bear none of them out"), "{e}");
    // One host holding every shard, a newcomer's fresh state beside it: this rank's step
    // (5) stands, though the newcomer is at step 0.
    let mut t = sharded_trainer();
    (t.step, t.cursor) = (5, 5 * 64);
    let fresh = Trainer::try_new(t.job.clone(), synthetic()).unwrap().regroup_facts(FACTS).unwrap();
    let mut peer = Hostile { row: fresh, from: FACTS, noise: 0.0 };
    assert_eq!(t.regroup(0, 2, target(), u64::MAX, &mut peer, Some(&bounds)).unwrap(), Some(5));
    // A host that sat an epoch out (its layout one epoch older, at step 0) holds nobody back:
    // this rank's newer layout at step 5 is the one rebuilt.
    let mut t = sharded_trainer();
    (t.step, t.cursor) = (5, 5 * 64);
    let newer = t.shard.as_ref().unwrap().layout.clone().tagged(4);
    t.shard.as_mut().unwrap().layout = newer.clone();
    let mut stale = mine.clone();
    (stale[3], stale[21]) = (1, 2);
    let both = RegroupBounds {
        known: vec![3, 4],
        layouts: vec![vec![newer], vec![ShardLayout::new(n, 2, 1, 1).unwrap().tagged(3)]],
        ..bounds.clone()
    };
    let mut peer = Hostile { row: stale, from: FACTS, noise: 0.0 };
    assert_eq!(
        t.regroup(
            0,
            2,
            Some(ShardLayout::new(n, 2, 0, 1).unwrap().tagged(5)),
            u64::MAX,
            &mut peer,
            Some(&both)
        )
        .unwrap(),
        Some(5)
    );
}

/// `mine` made another layout of the same unknown tag: one rank holding every value.
fn forged_again(mine: &[i64]) -> Vec<i64> {
    let mut row = mine.to_vec();
    row[1..4].copy_from_slice(&[1, 0, 0]);
    (row[19], row[21], row[22]) = (1, 1, 1);
    row
}
