//! Small collectives over the butterfly (groups of many ranks), one thread per rank on
//! loopback: the same bits on every rank, exact integers and gathers of any bit pattern,
//! worlds that are and are not powers of two, the ring kept for large buffers, and a rank
//! that dies mid-collective failing every survivor at once.

use limpet_agent::{DataPlaneConfig, DataPlaneError, Endpoint, Group};
use proptest::prelude::*;
use std::time::{Duration, Instant};

const SECRET: &[u8] = b"0123456789abcdef-test-secret";

fn endpoints(world: usize, tree_min_world: usize, timeout: Duration) -> Vec<Endpoint> {
    (0..world as u64)
        .map(|i| {
            let mut cfg = DataPlaneConfig::new(78, 100 + i, SECRET.to_vec());
            cfg.timeout = timeout;
            cfg.tree_min_world = tree_min_world;
            Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap()
        })
        .collect()
}

/// Runs `f` on every rank of a group of `world` (node order reversed, so that ranks and node
/// ids differ) and returns each rank's result in rank order.
fn on_every_rank<T: Send>(
    world: usize,
    tree_min_world: usize,
    f: impl Fn(&mut Group, usize) -> T + Sync,
) -> Vec<T> {
    let eps = endpoints(world, tree_min_world, Duration::from_secs(10));
    let order: Vec<u64> = (0..world as u64).rev().map(|i| 100 + i).collect();
    let addrs: Vec<String> = order.iter().map(|&n| eps[(n - 100) as usize].addr().to_string()).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = order
            .iter()
            .enumerate()
            .map(|(rank, &node)| {
                let (ep, order, addrs, f) = (&eps[(node - 100) as usize], &order, &addrs, &f);
                s.spawn(move || {
                    let mut g = ep.group(1, order, addrs).expect("group");
                    f(&mut g, rank)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn input(rank: usize, len: usize, seed: u64) -> Vec<f32> {
    (0..len)
        .map(|i| {
            let x = (rank as u64 * 7919 + i as u64 * 104_729 + seed).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, ..ProptestConfig::default() })]

    /// Sums agree to the bit on every rank and with the exact sum within f32's error;
    /// integer sums are exact; gathers and broadcasts carry any bit pattern (NaNs, -0.0)
    /// unchanged.
    #[test]
    fn the_butterfly_gives_every_rank_the_same_bits(world in 8usize..=19, len in 0usize..3000, seed in any::<u64>()) {
        let out = on_every_rank(world, 8, |g, rank| {
            assert!(g.has_tree());
            let mut sum = input(rank, len, seed);
            g.allreduce_sum(&mut sum, 3).unwrap();
            let mut ints: Vec<i64> = (0..len as i64).map(|i| (i - 5) * (rank as i64 + 1) * (1 << 40)).collect();
            g.allreduce_sum_i64(&mut ints, 3).unwrap();
            let mine: Vec<f32> = input(rank, 5, seed)
                .into_iter()
                .chain([f32::from_bits(0x7fc0_0000 | rank as u32), -0.0, f32::from_bits(rank as u32)])
                .collect();
            let mut all = vec![0.0f32; mine.len() * g.world()];
            g.allgather(&mine, &mut all, 4).unwrap();
            let mut cast = if rank == 3 { input(99, len, seed) } else { vec![f32::NAN; len] };
            g.broadcast(&mut cast, 3, 5).unwrap();
            let mut max = vec![rank as i32 - 4, -(rank as i32)];
            g.allreduce_max_i32(&mut max, 6).unwrap();
            g.barrier(7).unwrap();
            (sum, ints, all, cast, max)
        });
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (r, o) in out.iter().enumerate() {
            prop_assert_eq!(bits(&o.0), bits(&out[0].0), "rank {} summed other bits", r);
            let gathered: Vec<u32> = (0..world)
                .flat_map(|k| {
                    let mut m = input(k, 5, seed);
                    m.extend([f32::from_bits(0x7fc0_0000 | k as u32), -0.0, f32::from_bits(k as u32)]);
                    bits(&m)
                })
                .collect();
            prop_assert_eq!(bits(&o.2), gathered);
            prop_assert_eq!(bits(&o.3), bits(&input(99, len, seed)));
            prop_assert_eq!(&o.4, &vec![world as i32 - 5, 0]);
        }
        for i in 0..len {
            let exact: f64 = (0..world).map(|r| input(r, len, seed)[i] as f64).sum();
            let scale: f64 = (0..world).map(|r| (input(r, len, seed)[i] as f64).abs()).sum();
            prop_assert!((out[0].0[i] as f64 - exact).abs() <= 1e-5 * scale.max(1.0));
            let ints: i64 = (0..world as i64).map(|r| (i as i64 - 5) * (r + 1) * (1 << 40)).sum();
            for o in &out {
                prop_assert_eq!(o.1[i], ints);
            }
        }
    }
}

/// Below `tree_min_world` a group makes no butterfly, and a large buffer in a group that has
/// one still goes round the ring (a tree round would carry all of it); both sum right.
#[test]
fn small_groups_and_large_buffers_keep_the_ring() {
    let out = on_every_rank(6, 8, |g, rank| {
        let mut b = input(rank, 100, 1);
        g.allreduce_sum(&mut b, 0).unwrap();
        (g.has_tree(), b)
    });
    assert!(out.iter().all(|o| !o.0));
    let len = 1 << 20;
    let out = on_every_rank(8, 8, |g, rank| {
        let mut b = input(rank, len, 2);
        g.allreduce_sum(&mut b, 0).unwrap();
        (g.has_tree(), b)
    });
    assert!(out.iter().all(|o| o.0));
    for o in &out {
        assert!(o.1.iter().zip(&out[0].1).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
    for i in (0..len).step_by(4099) {
        let exact: f64 = (0..8).map(|r| input(r, len, 2)[i] as f64).sum();
        assert!((out[0].1[i] as f64 - exact).abs() < 1e-4, "{} against {exact}", out[0].1[i]);
    }
}

/// A rank that dies inside a tree collective (its sockets closed, as a `kill -9` leaves them)
/// fails every survivor, each within the timeout and long before it for most, and the group
/// stays broken for the next call.
#[test]
fn a_rank_dying_mid_tree_fails_every_survivor() {
    let world = 11;
    let eps = endpoints(world, 8, Duration::from_secs(2));
    let order: Vec<u64> = (0..world as u64).map(|i| 100 + i).collect();
    let addrs: Vec<String> = eps.iter().map(|e| e.addr().to_string()).collect();
    let started = Instant::now();
    let results: Vec<Result<(), DataPlaneError>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let (ep, order, addrs) = (&eps[rank], &order, &addrs);
                s.spawn(move || {
                    let mut g = ep.group(1, order, addrs)?;
                    g.barrier(0)?;
                    if rank == 9 {
                        // Rank 9 (past the power of two) goes away: its group drops, closing
                        // every link.
                        return Ok(());
                    }
                    let r = g.barrier(1);
                    assert!(matches!(g.barrier(2), Err(DataPlaneError::Broken(_))));
                    r
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, r) in results.iter().enumerate() {
        if rank != 9 {
            assert!(r.is_err(), "rank {rank} passed a barrier without rank 9");
        }
    }
    assert!(started.elapsed() < Duration::from_secs(4), "took {:?}", started.elapsed());
    let direct = results[1].as_ref().unwrap_err();
    assert_eq!(direct.suspect(), Some(109), "rank 1 takes rank 9's fold: {direct}");
}

/// Ranks that disagree on a collective's shape (here one rank names another broadcast root)
/// fail it, at least one with a protocol error naming a partner, rather than or-ing
/// mismatched blocks into a result no rank asked for.
#[test]
fn a_rank_running_another_shape_fails_the_collective() {
    let out = on_every_rank(8, 8, |g, rank| {
        let mut b = vec![rank as f32; 16];
        let root = if rank == 5 { 2 } else { 3 };
        g.broadcast(&mut b, root, 1)
    });
    assert!(out.iter().all(|r| r.is_err()), "{out:?}");
    let violations: Vec<String> = out
        .iter()
        .filter_map(|r| r.as_ref().err())
        .filter(|e| e.is_violation())
        .map(|e| e.to_string())
        .collect();
    assert!(violations.iter().any(|m| m.contains("another shape")), "{out:?}");
}
