//! The regroup's decision: rows checked as a peer's word, the choice of givers, the relays,
//! and plans from honest and forged rows.

use super::plan::{givers, relay_pieces};
use super::*;
use proptest::prelude::*;

/// An honest holder's row: rank `rank` of a layout of `world` ranks, one a host, tag 3,
/// one replica, at `step`, keeping the same layout re-cut under tag 4.
fn holder(rank: usize, world: usize, step: u64) -> RegroupFacts {
    RegroupFacts {
        layout: Some(HeldLayout {
            tag: 3,
            world,
            replicas: 1,
            rank,
            per_host: 1,
            place: Some(rank),
            shards: world,
        }),
        step,
        pending: false,
        last_norm: None,
        whole: false,
        cursor: step * 64,
        seed: 7,
        draws: step,
        stale: false,
        digest: [step as u8; 32],
        kept_sum: false,
        target: Some(KeptLayout { replicas: 1, per_host: 1, place: Some(rank), shards: world }),
    }
}

fn row(f: &RegroupFacts) -> Vec<i64> {
    f.encode()
}

#[test]
fn a_row_travels_unchanged() {
    let mut f = holder(1, 4, 9);
    f.last_norm = Some((8, 0.25));
    f.stale = true;
    f.digest = std::array::from_fn(|i| i as u8 * 7);
    assert_eq!(row(&f).len(), WORDS);
    assert_eq!(RegroupFacts::decode(&row(&f), 4).unwrap(), f);
    let fresh = RegroupFacts { layout: None, target: None, whole: true, ..holder(0, 4, 0) };
    assert_eq!(RegroupFacts::decode(&row(&fresh), 4).unwrap(), fresh);
}

/// A forged row is refused naming the rank and what was wrong; layouts' held values are
/// those the layout arithmetic gives.
#[test]
fn a_forged_row_is_refused_naming_the_rank() {
    let bad = |f: &RegroupFacts, edit: &dyn Fn(&mut Vec<i64>)| {
        let mut w = row(f);
        edit(&mut w);
        let mut words = row(&holder(0, 4, 0));
        words.extend(w);
        words.extend(row(&holder(2, 4, 0)));
        words.extend(row(&holder(3, 4, 0)));
        decode_all(&words, 4).map(|_| ()).unwrap_err().to_string()
    };
    let f = holder(1, 4, 0);
    // Offsets of the wire form: world 1, replicas 2, rank 3, step 4, pending 5, per_host 19,
    // place 21, shards 22, target replicas 18 and its facts 20, 23, 24.
    for (k, v) in
        [(1, 1 << 40), (2, 65), (3, 4), (4, -1), (5, 2), (19, 0), (19, 3), (19, i64::MIN), (21, 6), (22, 6)]
    {
        let e = bad(&f, &|w| w[k] = v);
        assert!(e.contains("rank 1's facts in the regroup"), "word {k} = {v}: {e}");
    }
    let e = bad(&f, &|w| w[2] = 4);
    assert!(e.contains("4 replicas of each shard need more than 4 ranks"), "{e}");
    for (k, v) in [(20, -1), (20, MOST_RANKS + 1), (24, i64::MAX), (23, -1), (23, MOST_RANKS + 2)] {
        let e = bad(&f, &|w| w[k] = v);
        assert!(e.contains("rank 1's facts") && e.contains("a target fact"), "word {k}: {e}");
    }
    // A kept layout that does not fit the group of four.
    let e = bad(&f, &|w| (w[20], w[24]) = (1, 5));
    assert!(e.contains("rank 1's facts") && e.contains("the layout it keeps"), "{e}");
    // Hosts of 3 and 2 (five ranks, two holding blocks on each): rank 2 owns an empty block.
    let empty = HeldLayout { tag: 1, world: 5, replicas: 1, rank: 2, per_host: 2, place: None, shards: 4 };
    assert!(empty.held(1000).is_empty());
    let fourth = HeldLayout { rank: 4, place: Some(3), ..empty.clone() };
    assert_eq!(fourth.held(1000), vec![cut(1000, 4, 3)..1000, cut(1000, 4, 1)..cut(1000, 4, 2)]);
}

/// Two holders of a layout at one step, re-cutting it: the values are given by their
/// holders, nobody's parameters move, and each keeps what it held.
#[test]
fn honest_holders_plan_nothing_but_what_is_missing() {
    let facts = [holder(0, 2, 5), holder(1, 2, 5)];
    let p = plan(1000, &facts, None, false).unwrap().unwrap();
    assert_eq!((p.step, p.tag, p.cursor), (5, 3, 320));
    assert!(!p.moves_params() && p.slot_moves.is_empty(), "{p:?}");
    // A newcomer in place of rank 1 (no shard, no state): it takes its block and the
    // parameters; rank 0 gives everything (it holds both blocks with its replica).
    let newcomer =
        RegroupFacts { layout: None, whole: false, step: 0, cursor: 0, digest: [0; 32], ..holder(1, 2, 0) };
    let p = plan(1000, &[holder(0, 2, 5), newcomer], None, false).unwrap().unwrap();
    assert_eq!(p.pieces, vec![(0, 0..1000)]);
    assert_eq!(p.params_to, vec![false, true]);
    assert!(p.slot_moves.iter().all(|m| m.giver == 0 && m.to == vec![1]));
    // A holder a step behind with the norm pending finishes with its peer's norm.
    let mut ahead = holder(0, 2, 6);
    ahead.last_norm = Some((5, 1.5));
    let mut behind = holder(1, 2, 5);
    behind.pending = true;
    let p = plan(1000, &[ahead.clone(), behind], None, false).unwrap().unwrap();
    assert_eq!((p.step, p.norm, p.finishes.clone()), (6, Some(1.5), vec![false, true]));
    // Every holder gone but one that holds half: the other half is named as lost.
    let alone = RegroupFacts {
        layout: Some(HeldLayout { replicas: 0, ..holder(0, 2, 5).layout.unwrap() }),
        ..holder(0, 2, 5)
    };
    let fresh = RegroupFacts { layout: None, ..holder(1, 2, 0) };
    let e = plan(1000, &[alone, fresh], None, false).unwrap_err();
    assert!(matches!(e, RegroupError::Lost(_)), "{e}");
}

/// With bounds, a row the log does not bear out is nobody's giver: a forged newer layout
/// holding every value, or the same layout too many steps on.
#[test]
fn bounds_keep_one_rank_from_deciding() {
    let bounds = RegroupBounds {
        hosts: vec![0, 1],
        known: vec![3],
        layouts: (0..2).map(|r| vec![holder(r, 2, 0).layout.unwrap()]).collect(),
    };
    let mut forged = holder(1, 2, 1_000_000);
    forged.layout =
        Some(HeldLayout { tag: 9, world: 1, replicas: 0, rank: 0, per_host: 1, place: Some(0), shards: 1 });
    let p = plan(1000, &[holder(0, 2, 0), forged.clone()], Some(&bounds), false).unwrap().unwrap();
    assert_eq!((p.step, p.newest), (0, 0));
    let believed = plan(1000, &[holder(0, 2, 0), forged], None, false).unwrap().unwrap();
    assert_eq!(believed.step, 1_000_000);
    let e = plan(1000, &[holder(0, 2, 0), holder(1, 2, 7)], Some(&bounds), false).unwrap_err();
    assert!(e.to_string().contains("at steps 0 and 7"), "{e}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Whatever rows a group sums, decoding and planning end with a result, never a panic;
    /// a plan's pieces tile the state from ranks that may give them, and its relays bring
    /// each rank exactly what it keeps and lacks.
    #[test]
    fn any_rows_plan_or_refuse(
        world in 1usize..5,
        words in proptest::collection::vec(prop_oneof![
            Just(0i64), Just(1), Just(2), Just(3), Just(-1), Just(i64::MAX), any::<i64>(), 0i64..8,
        ], WORDS * 4),
        honest in proptest::collection::vec(any::<bool>(), 4),
        n in 0usize..600,
        bounded in any::<bool>(),
        reproducible in any::<bool>(),
    ) {
        // Some rows honest, the others arbitrary words.
        let mut all = Vec::new();
        for j in 0..world {
            match honest[j] {
                true => all.extend(row(&holder(j, world, 3))),
                false => all.extend_from_slice(&words[WORDS * j..WORDS * (j + 1)]),
            }
        }
        let Ok(facts) = decode_all(&all, world) else { return Ok(()) };
        let bounds = RegroupBounds {
            hosts: (0..world as u64).collect(),
            known: vec![3],
            layouts: (0..world).map(|r| vec![holder(r, world, 0).layout.unwrap()]).collect(),
        };
        let Ok(Some(p)) = plan(n, &facts, bounded.then_some(&bounds), reproducible) else { return Ok(()) };
        let mut at = 0;
        for (j, r) in &p.pieces {
            prop_assert_eq!(r.start, at);
            at = r.end;
            prop_assert!(r.clone().all(|v| p.own[*j].iter().any(|o| o.contains(&v))), "rank {} gives {:?} it does not hold", j, r);
        }
        prop_assert_eq!(at, n);
        prop_assert_eq!(p.params_to.len(), world);
        for m in p.slot_moves.iter().chain(&p.param_moves) {
            prop_assert!(!m.to.contains(&m.giver) && m.to.iter().all(|&t| t < world));
        }
    }

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
