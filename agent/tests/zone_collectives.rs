//! Large reductions in two levels across zones (`ring/levels.rs`), one thread per rank on
//! loopback: the same bits on every rank, sums within f32's error and exact integers, zones
//! of unequal sizes (ranks past the smallest zone's size owning nothing), bfloat16 parts
//! still the same bits everywhere, and a rank that dies mid-reduction failing every
//! survivor, its levels' neighbours included.

use limpet_agent::{DataPlaneConfig, DataPlaneError, Endpoint, Group};
use proptest::prelude::*;
use std::time::{Duration, Instant};

const SECRET: &[u8] = b"0123456789abcdef-test-secret";

fn endpoints(world: usize, timeout: Duration) -> Vec<Endpoint> {
    (0..world as u64)
        .map(|i| {
            let mut cfg = DataPlaneConfig::new(79, 100 + i, SECRET.to_vec());
            cfg.timeout = timeout;
            // No butterfly: every reduction here is the levels'.
            cfg.tree_min_world = usize::MAX;
            Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap()
        })
        .collect()
}

/// A group of `zones.len()` ranks (node order reversed, so that ranks and node ids differ),
/// rank `i` in zone `zones[i]`, its levels connected; `f` runs on each and its results come
/// back in rank order.
fn on_every_rank<T: Send>(
    zones: &[&str],
    timeout: Duration,
    f: impl Fn(&mut Group, usize) -> T + Sync,
) -> Vec<T> {
    let world = zones.len();
    let eps = endpoints(world, timeout);
    let order: Vec<u64> = (0..world as u64).rev().map(|i| 100 + i).collect();
    let addrs: Vec<String> = order.iter().map(|&n| eps[(n - 100) as usize].addr().to_string()).collect();
    let zones: Vec<String> = zones.iter().map(|z| z.to_string()).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = order
            .iter()
            .enumerate()
            .map(|(rank, &node)| {
                let (ep, order, addrs, zones, f) = (&eps[(node - 100) as usize], &order, &addrs, &zones, &f);
                s.spawn(move || {
                    let mut g = ep.group(1, order, addrs).expect("group");
                    let by = Instant::now() + Duration::from_secs(10);
                    g.connect_levels(ep, addrs, zones, (by, &|| false)).expect("levels");
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

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Zone layouts: equal zones, unequal ones, a zone of one rank, zones interleaved in rank
/// order.
const LAYOUTS: &[&[&str]] = &[
    &["a", "a", "b", "b", "c", "c"],
    &["a", "a", "a", "a", "b", "b", "c", "c", "c"],
    &["a", "b", "a", "c", "b", "a", "a"],
    &["a", "b", "b", "b", "b"],
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 8, ..ProptestConfig::default() })]

    /// f32 sums agree to the bit on every rank and with the exact sum within f32's error,
    /// i64 sums are exact, and a buffer partly in bfloat16 still ends the same bits
    /// everywhere, within a few bfloat16 roundings.
    #[test]
    fn two_levels_give_every_rank_the_same_bits(layout in 0..LAYOUTS.len(), len in 0usize..5000, seed in any::<u64>()) {
        let zones = LAYOUTS[layout];
        let world = zones.len();
        let lossy = len / 2;
        let out = on_every_rank(zones, Duration::from_secs(10), |g, rank| {
            assert!(g.has_levels());
            let mut sum = input(rank, len, seed);
            g.allreduce_sum(&mut sum, 3).unwrap();
            let mut ints: Vec<i64> = (0..len as i64).map(|i| (i - 5) * (rank as i64 + 1) * (1 << 40)).collect();
            g.allreduce_sum_i64(&mut ints, 4).unwrap();
            let mut half = input(rank, len, seed ^ 1);
            g.allreduce_sum_bf16(&mut half, lossy, 5).unwrap();
            g.barrier(6).unwrap();
            (sum, ints, half)
        });
        for (r, o) in out.iter().enumerate() {
            prop_assert_eq!(bits(&o.0), bits(&out[0].0), "rank {} summed other bits", r);
            prop_assert_eq!(bits(&o.2), bits(&out[0].2), "rank {} summed other bfloat16 bits", r);
        }
        for i in 0..len {
            let exact: f64 = (0..world).map(|r| input(r, len, seed)[i] as f64).sum();
            let scale: f64 = (0..world).map(|r| (input(r, len, seed)[i] as f64).abs()).sum();
            prop_assert!((out[0].0[i] as f64 - exact).abs() <= 1e-5 * scale.max(1.0));
            let ints: i64 = (0..world as i64).map(|r| (i as i64 - 5) * (r + 1) * (1 << 40)).sum();
            for o in &out {
                prop_assert_eq!(o.1[i], ints);
            }
            let exact: f64 = (0..world).map(|r| input(r, len, seed ^ 1)[i] as f64).sum();
            let scale: f64 = (0..world).map(|r| (input(r, len, seed ^ 1)[i] as f64).abs()).sum();
            let tol = if i < lossy { 0.03 } else { 1e-5 };
            prop_assert!((out[0].2[i] as f64 - exact).abs() <= tol * scale.max(1.0), "{} against {exact} at {i}", out[0].2[i]);
            if i < lossy {
                prop_assert_eq!(out[0].2[i].to_bits() & 0xffff, 0, "a bfloat16 value at {}", i);
            }
        }
    }
}

/// One zone, or a rank a zone, is the flat ring: no levels are connected.
#[test]
fn zones_that_gain_nothing_keep_the_flat_ring() {
    for zones in [&["a", "a", "a"][..], &["a", "b", "c"]] {
        let out = on_every_rank(zones, Duration::from_secs(10), |g, rank| {
            let mut b = input(rank, 100, 1);
            g.allreduce_sum(&mut b, 0).unwrap();
            g.has_levels()
        });
        assert!(out.iter().all(|l| !l), "{zones:?}");
    }
}

/// Buffers of no value, one, and fewer than the segments (the smallest zone's size): the
/// segments past the buffer's end are empty, and every rank still ends with the sum.
#[test]
fn buffers_shorter_than_the_segments_sum_right() {
    let zones = ["a", "a", "a", "b", "b", "b", "b"];
    for len in [0usize, 1, 2, 3] {
        let out = on_every_rank(&zones, Duration::from_secs(10), |g, rank| {
            let mut b: Vec<f32> = (0..len).map(|i| (rank * 10 + i) as f32).collect();
            g.allreduce_sum(&mut b, 0).unwrap();
            let mut ints: Vec<i64> = (0..len as i64).map(|i| i - rank as i64).collect();
            g.allreduce_sum_i64(&mut ints, 1).unwrap();
            (b, ints)
        });
        let want: Vec<f32> = (0..len).map(|i| (0..7).map(|r| (r * 10 + i) as f32).sum()).collect();
        let ints: Vec<i64> = (0..len as i64).map(|i| (0..7).map(|r| i - r).sum()).collect();
        assert!(out.iter().all(|o| o.0 == want && o.1 == ints), "{len}: {out:?}");
    }
}

/// A rank that does not connect the levels (a build without them, a member that reads
/// other zones) fails every other rank's connection of them within its deadline, rather
/// than a reduction later.
#[test]
fn a_rank_without_the_levels_fails_their_connection() {
    let zones: Vec<String> = ["a", "a", "b", "b"].iter().map(|z| z.to_string()).collect();
    let eps = endpoints(4, Duration::from_secs(10));
    let order: Vec<u64> = (100..104).collect();
    let addrs: Vec<String> = eps.iter().map(|e| e.addr().to_string()).collect();
    let started = Instant::now();
    let out: Vec<bool> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|rank| {
                let (ep, order, addrs, zones) = (&eps[rank], &order, &addrs, &zones);
                s.spawn(move || {
                    let mut g = ep.group(1, order, addrs).expect("group");
                    if rank == 2 {
                        // Keeps its group open past the others' deadline, without levels.
                        std::thread::sleep(Duration::from_secs(3));
                        return false;
                    }
                    let by = Instant::now() + Duration::from_secs(2);
                    g.connect_levels(ep, addrs, zones, (by, &|| false)).is_ok()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(out, vec![false; 4], "a rank connected levels without rank 2");
    assert!(started.elapsed() < Duration::from_secs(8), "took {:?}", started.elapsed());
}

/// A rank that dies inside a reduction over two levels (its sockets closed, as a `kill -9`
/// leaves them) fails every survivor long before the timeout, naming it where it was the
/// neighbour: a failure on one level breaks the group's every ring, so it spreads through
/// the zones at once. The group stays broken for the next call.
#[test]
fn a_rank_dying_mid_reduction_fails_every_survivor() {
    let zones = ["a", "a", "a", "b", "b", "b", "c", "c"];
    let started = Instant::now();
    let out = on_every_rank(&zones, Duration::from_secs(10), |g, rank| {
        let mut b = input(rank, 1 << 16, 3);
        g.allreduce_sum(&mut b, 0)?;
        if rank == 4 {
            // Rank 4 (zone b's second, on a ring across zones) goes away: its group drops,
            // closing every link.
            return Ok(());
        }
        let r = g.allreduce_sum(&mut b, 1);
        assert!(matches!(g.allreduce_sum(&mut b, 2), Err(DataPlaneError::Broken(_))));
        r
    });
    for (rank, r) in out.iter().enumerate() {
        if rank != 4 {
            assert!(r.is_err(), "rank {rank} reduced without rank 4");
        }
    }
    assert!(started.elapsed() < Duration::from_secs(4), "took {:?}", started.elapsed());
    // Node ids run backwards from rank order: rank 4 is node 103.
    let named: Vec<Option<u64>> = out.iter().map(|r| r.as_ref().err().and_then(|e| e.suspect())).collect();
    assert!(named.contains(&Some(103)), "nobody named rank 4: {out:?}");
}
