//! The regroup's execution under hostile peers: forged rows, exponents and sums, and the
//! log's bounds (the decision itself is tested in `limpet_decide::regroup`).

use super::hostile_reduce::Hostile;
use super::*;
use crate::train::tests::{job, synthetic};
use crate::ModelKind;
use limpet_decide::regroup::HeldLayout;
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
        let from = if self.calls == 1 { WORDS } else { 0 };
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
            1 => (&self.facts[..], WORDS),
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
        let mut f = t.regroup_facts().unwrap();
        f.layout.as_mut().unwrap().rank = 1;
        (f.step, f.cursor, f.kept_sum) = (1, t.plan.global_batch as u64, true);
        let facts = f.encode();
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
        let mut f = t.regroup_facts().unwrap();
        f.layout.as_mut().unwrap().rank = 1;
        let facts = f.encode();
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
        ], WORDS),
        noise in any::<f32>(),
        recut in any::<bool>(),
    ) {
        let mut t = sharded_trainer();
        let n = t.buffer_len() - 3;
        let target = recut.then(|| ShardLayout::new(n, 2, 0, 1).unwrap().tagged(4));
        let _ = t.regroup(0, 2, target, u64::MAX, &mut Hostile { row, from: WORDS, noise }, None); // rank 1's row
    }

    /// The same from a row that is rank 0's own with a few values changed: past the
    /// checks, into the choice of givers and the moves.
    #[test]
    fn a_peers_facts_near_an_honest_row_never_panic(
        edits in proptest::collection::vec((0usize..WORDS, prop_oneof![
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
        let mut f = t.regroup_facts().unwrap();
        f.layout.as_mut().unwrap().rank = 1;
        let mut row = f.encode();
        for (i, v) in edits {
            row[i] = v;
        }
        let target = recut.then(|| ShardLayout::new(n, 2, 0, 1).unwrap().tagged(4));
        let mut peer = Hostile { row, from: WORDS, noise }; // rank 1's row
        if bounded {
            let bounds = RegroupBounds {
                hosts: vec![0, 1],
                known: vec![3],
                layouts: (0..2).map(|r| vec![ShardLayout::new(n, 2, r, 1).unwrap().tagged(3).facts()]).collect(),
            };
            let _ = t.regroup(0, 2, target, u64::MAX, &mut peer, Some(&bounds));
        } else {
            let _ = t.regroup(0, 2, target, u64::MAX, &mut peer, None);
        }
    }

}

/// The value ranges a layout holds (an empty block is none).
fn held_values(l: &ShardLayout) -> Vec<Range<usize>> {
    l.held().into_iter().map(|b| l.blocks()[b].clone()).filter(|r| !r.is_empty()).collect()
}

/// A layout's statement in a regroup gives the values the layout holds: the decision's
/// arithmetic and the trainer's layouts agree, over hosts of one, of two, and of unequal counts.
#[test]
fn a_layouts_facts_give_the_values_it_holds() {
    let layouts = [
        ShardLayout::over_hosts(1000, 4, 1, 2, 3).unwrap(),
        ShardLayout::over_hosts(1000, 4, 2, 2, 1).unwrap(),
        ShardLayout::over_hosts(1000, 2, 2, 1, 1).unwrap(),
    ];
    // Hosts of 3 and 2 (five ranks, two holding blocks on each): the third rank of host 0
    // owns an empty block and holds nothing.
    let unequal: Vec<ShardLayout> =
        (0..5).map(|rank| ShardLayout::over_host_counts(1000, &[3, 2], rank, 1).unwrap()).collect();
    for l in layouts.iter().chain(&unequal) {
        assert_eq!(l.facts().held(1000), held_values(l), "{l:?}");
        assert_eq!(l.kept().held(1000), held_values(l), "{l:?}");
    }
    assert_eq!(unequal[2].held(), vec![2]);
    assert!(unequal[2].blocks()[2].is_empty() && unequal[2].facts().place.is_none());
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
    let mine = honest.regroup_facts().unwrap();
    // Every value in one rank's hands, at the job's last step, under a tag past every epoch's.
    let mut f = mine.clone();
    f.layout = Some(HeldLayout { tag: 9, ..alone(&mine) });
    (f.step, f.cursor) = (1_000_000, 1_000_000);
    let forged = f.encode();
    // The peer's own layout (the log's, tag 3), a step past this rank's and then at it.
    let mut f = as_rank_one(&mine);
    (f.step, f.cursor) = (7, 7);
    let ahead = f.encode();
    // No shard and a whole state one step further on: within a step, and alone.
    let f = RegroupFacts {
        layout: None,
        step: 1,
        whole: true,
        cursor: 64,
        seed: 0,
        draws: 0,
        digest: [0; 32],
        ..mine.clone()
    };
    let whole = f.encode();
    let bounds = RegroupBounds {
        hosts: vec![0, 1],
        known: vec![3],
        layouts: (0..2).map(|r| vec![ShardLayout::new(n, 2, r, 1).unwrap().tagged(3).facts()]).collect(),
    };
    let target = || Some(ShardLayout::new(n, 2, 0, 1).unwrap().tagged(4));
    for row in [&forged, &whole] {
        let mut t = sharded_trainer();
        let before = values(&t);
        let mut peer = Hostile { row: row.clone(), from: WORDS, noise: 3.0 };
        let done = t.regroup(0, 2, target(), u64::MAX, &mut peer, Some(&bounds)).unwrap();
        assert_eq!((done, t.step()), (Some(0), 0));
        assert!(values(&t) == before, "the re-cut took a value from the peer");
    }
    // The same layout seven steps on: one of the two is lying, and nobody can tell which.
    let mut t = sharded_trainer();
    let mut peer = Hostile { row: ahead, from: WORDS, noise: 3.0 };
    let e = t.regroup(0, 2, target(), u64::MAX, &mut peer, Some(&bounds)).unwrap_err().to_string();
    assert!(e.contains("at steps 0 and 7"), "{e}");
    assert_eq!(t.step(), 0);
    // The forged row beside a rank that holds no shard (a newcomer, or the job's first
    // re-cut): alone, it is nobody's source either.
    let mut fresh = Trainer::try_new(honest.job.clone(), synthetic()).unwrap();
    let mut peer = Hostile { row: forged.clone(), from: WORDS, noise: 3.0 };
    let e = fresh.regroup(0, 2, target(), u64::MAX, &mut peer, Some(&bounds)).unwrap_err().to_string();
    assert!(e.contains("bear none of them out"), "{e}");
    assert_eq!(fresh.step(), 0);
    // Believed (every claim taken at its word): the forged row decides this rank's state,
    // and the whole state "further on" makes it start afresh (nothing rebuilt).
    let mut t = sharded_trainer();
    let before = values(&t);
    let done =
        t.regroup(0, 2, target(), u64::MAX, &mut Hostile { row: forged, from: WORDS, noise: 3.0 }, None);
    assert_eq!((done.unwrap(), t.step()), (Some(1_000_000), 1_000_000));
    assert!(values(&t) != before);
    let mut t = sharded_trainer();
    assert_eq!(
        t.regroup(0, 2, target(), u64::MAX, &mut Hostile { row: whole, from: WORDS, noise: 0.0 }, None)
            .unwrap(),
        None
    );
    // An honest peer in the same layout at this rank's step: both count.
    let next = as_rank_one(&mine).encode();
    let mut t = sharded_trainer();
    let mut peer = Hostile { row: next.clone(), from: WORDS, noise: 0.0 };
    assert_eq!(t.regroup(0, 2, target(), u64::MAX, &mut peer, Some(&bounds)).unwrap(), Some(0));
    // The same layout of an epoch the log does not know (scheduled, entered, replaced): two
    // hosts hold it, so it counts; one rank alone beside another host's does not.
    let unknown = RegroupBounds { known: Vec::new(), ..bounds.clone() };
    let mut t = sharded_trainer();
    let mut peer = Hostile { row: next, from: WORDS, noise: 0.0 };
    assert_eq!(t.regroup(0, 2, target(), u64::MAX, &mut peer, Some(&unknown)).unwrap(), Some(0));
    let mut t = sharded_trainer();
    let mut peer = Hostile {
        row: RegroupFacts { layout: Some(alone(&mine)), ..mine.clone() }.encode(),
        from: WORDS,
        noise: 0.0,
    };
    let e = t.regroup(0, 2, target(), u64::MAX, &mut peer, Some(&unknown)).unwrap_err().to_string();
    assert!(e.contains("bear none of them out"), "{e}");
    // One host holding every shard, a newcomer's fresh state beside it: this rank's step
    // (5) stands, though the newcomer is at step 0.
    let mut t = sharded_trainer();
    (t.step, t.cursor) = (5, 5 * 64);
    let fresh = Trainer::try_new(t.job.clone(), synthetic()).unwrap().regroup_facts().unwrap().encode();
    let mut peer = Hostile { row: fresh, from: WORDS, noise: 0.0 };
    assert_eq!(t.regroup(0, 2, target(), u64::MAX, &mut peer, Some(&bounds)).unwrap(), Some(5));
    // A host that sat an epoch out (its layout one epoch older, at step 0) holds nobody back:
    // this rank's newer layout at step 5 is the one rebuilt.
    let mut t = sharded_trainer();
    (t.step, t.cursor) = (5, 5 * 64);
    let newer = t.shard.as_ref().unwrap().layout.clone().tagged(4);
    t.shard.as_mut().unwrap().layout = newer.clone();
    let stale = as_rank_one(&mine).encode();
    let both = RegroupBounds {
        known: vec![3, 4],
        layouts: vec![vec![newer.facts()], vec![ShardLayout::new(n, 2, 1, 1).unwrap().tagged(3).facts()]],
        ..bounds.clone()
    };
    let mut peer = Hostile { row: stale, from: WORDS, noise: 0.0 };
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

/// `mine`'s layout made one rank holding every value (same tag).
fn alone(mine: &RegroupFacts) -> HeldLayout {
    let l = mine.layout.clone().unwrap();
    HeldLayout { world: 1, replicas: 0, rank: 0, per_host: 1, place: Some(0), shards: 1, ..l }
}

/// `mine` as rank 1 of its layout states it (its peer's honest row).
fn as_rank_one(mine: &RegroupFacts) -> RegroupFacts {
    let mut f = mine.clone();
    let l = f.layout.as_mut().unwrap();
    (l.rank, l.place) = (1, Some(1));
    f
}
