//! Collectives between endpoints on loopback, one thread per rank: exact results for random
//! sizes, world sizes 1-5 and rank orders; refusals of strangers and stale epochs.

use limpet_agent::dataplane::frame::Channel;
use limpet_agent::{DataPlaneConfig, DataPlaneError, Endpoint};
use proptest::prelude::*;
use std::time::Duration;

const SECRET: &[u8] = b"0123456789abcdef-test-secret";

fn endpoints(nodes: &[u64], chunk_bytes: usize) -> Vec<Endpoint> {
    nodes
        .iter()
        .map(|&n| {
            let mut cfg = DataPlaneConfig::new(77, n, SECRET.to_vec());
            cfg.chunk_bytes = chunk_bytes;
            cfg.timeout = Duration::from_secs(5);
            Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap()
        })
        .collect()
}

/// Each rank's input: a deterministic function of (node, index).
fn input(node: u64, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((node as f32) * 0.37 + (i % 97) as f32 * 0.013 - 0.5) * if i % 3 == 0 { -1.0 } else { 1.0 })
        .collect()
}

/// Runs `f` on every rank (ranks in `order`) and returns each rank's result, in `order`.
fn on_every_rank<T: Send>(
    order: &[u64],
    chunk_bytes: usize,
    f: impl Fn(&mut limpet_agent::Group, u64) -> T + Sync,
) -> Vec<T> {
    let mut sorted = order.to_vec();
    sorted.sort_unstable();
    let eps = endpoints(&sorted, chunk_bytes);
    let addrs: Vec<String> =
        order.iter().map(|n| eps[sorted.iter().position(|s| s == n).unwrap()].addr().to_string()).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = order
            .iter()
            .map(|&node| {
                let ep = &eps[sorted.iter().position(|s| *s == node).unwrap()];
                let (addrs, f) = (&addrs, &f);
                s.spawn(move || {
                    let mut g = ep.group(1, order, addrs).expect("group");
                    f(&mut g, node)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn allreduce_equals_the_elementwise_sum(
        world in 1usize..=5,
        len in 0usize..20_000,
        shuffle in any::<u64>(),
        small_chunks in any::<bool>(),
    ) {
        let mut order: Vec<u64> = (1..=world as u64).map(|n| n * 10).collect();
        // A rank order that is not the node order.
        let k = (shuffle as usize) % world.max(1);
        order.rotate_left(k);
        if shuffle % 2 == 1 { order.reverse(); }
        let chunk = if small_chunks { 4096 } else { 512 << 10 };
        let results = on_every_rank(&order, chunk, |g, node| {
            let mut buf = input(node, len);
            g.allreduce_sum(&mut buf, 7).unwrap();
            buf
        });
        // The exact sum in f64; the ring sums W f32 values, so the error is within
        // (W - 1) ulps of the largest partial sum: 1e-5 relative to sum(|x|) is generous.
        let inputs: Vec<Vec<f32>> = order.iter().map(|&n| input(n, len)).collect();
        for i in 0..len {
            let exact: f64 = inputs.iter().map(|x| f64::from(x[i])).sum();
            let scale: f64 = inputs.iter().map(|x| f64::from(x[i].abs())).sum::<f64>().max(1e-6);
            let got = f64::from(results[0][i]);
            prop_assert!((got - exact).abs() <= 1e-5 * scale, "element {i}: {got} vs {exact}");
        }
        // Every rank holds bit-identical results.
        for r in &results[1..] {
            prop_assert!(r.iter().zip(&results[0]).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }

    /// With the first `lossy` values in bfloat16 on the wire: every rank still holds the same
    /// bits; those values are bfloat16 numbers within one rounding a hop of the exact sum,
    /// and the rest (a step's loss and sample count) are summed in f32 as ever.
    #[test]
    fn a_bf16_allreduce_rounds_alike_on_every_rank_and_keeps_the_rest_exact(
        world in 1usize..=5,
        len in 0usize..12_000,
        cut in any::<u16>(),
        small_chunks in any::<bool>(),
    ) {
        let lossy = cut as usize % (len + 1);
        let order: Vec<u64> = (1..=world as u64).map(|n| n * 10).collect();
        let chunk = if small_chunks { 4096 } else { 512 << 10 };
        let results = on_every_rank(&order, chunk, |g, node| {
            let mut buf = input(node, len);
            g.allreduce_sum_bf16(&mut buf, lossy, 7).unwrap();
            buf
        });
        let inputs: Vec<Vec<f32>> = order.iter().map(|&n| input(n, len)).collect();
        for i in 0..len {
            let exact: f64 = inputs.iter().map(|x| f64::from(x[i])).sum();
            let scale: f64 = inputs.iter().map(|x| f64::from(x[i].abs())).sum::<f64>().max(1e-6);
            let got = results[0][i];
            if i < lossy && world > 1 {
                prop_assert_eq!(got.to_bits() & 0xffff, 0, "element {} is not a bfloat16: {}", i, got);
                // Each of the W roundings is within 2^-9 of its partial sum, at most `scale`.
                let tol = world as f64 * 2f64.powi(-8) * scale;
                prop_assert!((f64::from(got) - exact).abs() <= tol, "element {i}: {got} vs {exact}");
            } else {
                prop_assert!((f64::from(got) - exact).abs() <= 1e-5 * scale, "element {i}: {got} vs {exact}");
            }
        }
        for r in &results[1..] {
            prop_assert!(r.iter().zip(&results[0]).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }

    /// A bfloat16 reduce-scatter: each block's owner and its replicas hold the same bfloat16
    /// values, near the exact sum.
    #[test]
    fn a_bf16_reduce_scatter_gives_replicas_the_owners_bits(
        world in 2usize..=5,
        len in 1usize..6000,
        replicas in 0usize..4,
    ) {
        let replicas = replicas.min(world - 1);
        let blocks: Vec<std::ops::Range<usize>> = (0..world).map(|i| i * len / world..(i + 1) * len / world).collect();
        let order: Vec<u64> = (1..=world as u64).collect();
        let results = on_every_rank(&order, 4096, |g, node| {
            let mut buf = input(node, len);
            g.reduce_scatter_sum_bf16(&mut buf, &blocks, replicas, len, 3).unwrap();
            buf
        });
        let inputs: Vec<Vec<f32>> = order.iter().map(|&n| input(n, len)).collect();
        for b in 0..world {
            let owner = &results[b];
            for i in blocks[b].clone() {
                let exact: f64 = inputs.iter().map(|x| f64::from(x[i])).sum();
                let scale: f64 = inputs.iter().map(|x| f64::from(x[i].abs())).sum::<f64>().max(1e-6);
                prop_assert_eq!(owner[i].to_bits() & 0xffff, 0);
                prop_assert!((f64::from(owner[i]) - exact).abs() <= world as f64 * 2f64.powi(-8) * scale);
                for k in 1..=replicas {
                    let holder = &results[(b + k) % world];
                    prop_assert_eq!(holder[i].to_bits(), owner[i].to_bits(), "block {} replica {}", b, k);
                }
            }
        }
    }

    /// Reduce-scatter over uneven (even empty) blocks: each rank's own block, and the
    /// `replicas` blocks before it, hold the exact sum (integer-valued floats: any order is
    /// exact), a replica bit-identical to its owner's block; allgather then delivers every
    /// rank's block to all.
    #[test]
    fn reduce_scatter_with_replicas_and_allgather_over_uneven_blocks(
        world in 1usize..=5,
        len in 0usize..6000,
        cuts in proptest::collection::vec(any::<u16>(), 4),
        replicas in 0usize..4,
        small_chunks in any::<bool>(),
    ) {
        let replicas = replicas.min(world - 1);
        let mut points: Vec<usize> = cuts.iter().take(world - 1).map(|&c| c as usize % (len + 1)).collect();
        points.sort_unstable();
        let bounds: Vec<usize> = std::iter::once(0).chain(points).chain(std::iter::once(len)).collect();
        let blocks: Vec<std::ops::Range<usize>> = bounds.windows(2).map(|w| w[0]..w[1]).collect();
        let order: Vec<u64> = (1..=world as u64).collect();
        let value = |node: u64, i: usize| ((node as usize * 31 + i * 7) % 1000) as f32 - 500.0;
        let chunk = if small_chunks { 4096 } else { 512 << 10 };
        let results = on_every_rank(&order, chunk, |g, node| {
            let mut buf: Vec<f32> = (0..len).map(|i| value(node, i)).collect();
            g.reduce_scatter_sum(&mut buf, &blocks, replicas, 3).unwrap();
            let reduced = buf.clone();
            // Then each rank contributes its block (marked by its node) to an allgather.
            let mut mine = vec![0.0f32; len];
            let r = g.rank();
            for i in blocks[r].clone() { mine[i] = (node * 100_000) as f32 + i as f32; }
            g.allgather_blocks(&mut mine, &blocks, 4).unwrap();
            (reduced, mine)
        });
        for (r, (reduced, gathered)) in results.iter().enumerate() {
            for k in 0..=replicas {
                let b = (r + world - k) % world;
                for i in blocks[b].clone() {
                    let exact: f32 = order.iter().map(|&n| value(n, i)).sum();
                    prop_assert_eq!(reduced[i], exact, "rank {} block {} element {}", r, b, i);
                }
            }
            for (b, block) in blocks.iter().enumerate() {
                for i in block.clone() {
                    prop_assert_eq!(gathered[i], (order[b] * 100_000) as f32 + i as f32);
                }
            }
        }
        // A block that tiles nothing is refused before any byte moves.
        if world > 1 {
            let bad = on_every_rank(&order, chunk, |g, _| {
                let mut buf = vec![0.0f32; len + 1];
                g.allgather_blocks(&mut buf, &blocks, 5).unwrap_err().to_string()
            });
            prop_assert!(bad[0].contains("do not tile"), "{}", bad[0]);
        }
    }

    #[test]
    fn integer_allreduce_is_exact_and_the_max_is_the_max(
        world in 1usize..=5,
        len in 0usize..6000,
        shuffle in any::<u64>(),
        small_chunks in any::<bool>(),
    ) {
        let mut order: Vec<u64> = (1..=world as u64).map(|n| n * 10).collect();
        order.rotate_left((shuffle as usize) % world);
        // Values across the whole range a shard sum uses, with carries between the halves
        // of each i64 (the ring moves them as two f32 words).
        let ints = |node: u64| -> Vec<i64> {
            (0..len as i64)
                .map(|i| {
                    let v = (i * 0x1_0000_0001 + node as i64 * 0x7fff_ffff) << 8;
                    if i % 2 == 0 { -v } else { v }
                })
                .collect()
        };
        let chunk = if small_chunks { 4096 } else { 512 << 10 };
        let results = on_every_rank(&order, chunk, |g, node| {
            let mut buf = ints(node);
            g.allreduce_sum_i64(&mut buf, 9).unwrap();
            let mut m = vec![node as i32, -(node as i32), 7];
            g.allreduce_max_i32(&mut m, 9).unwrap();
            (buf, m)
        });
        let want: Vec<i64> = (0..len).map(|i| order.iter().map(|&n| ints(n)[i]).fold(0i64, i64::wrapping_add)).collect();
        let top = *order.iter().max().unwrap() as i32;
        let least = *order.iter().min().unwrap() as i32;
        for (buf, m) in &results {
            prop_assert_eq!(buf, &want);
            prop_assert_eq!(m, &vec![top, -least, 7]);
        }
    }

    #[test]
    fn broadcast_and_allgather_deliver_every_byte(world in 1usize..=5, len in 0usize..5000, root in 0usize..5) {
        let order: Vec<u64> = (1..=world as u64).rev().collect();
        let root = root % world;
        let results = on_every_rank(&order, 4096, |g, node| {
            let mut b = input(node, len);
            g.broadcast(&mut b, root, 3).unwrap();
            let mine = input(node, len);
            let mut all = vec![0.0; len * g.world()];
            g.allgather(&mine, &mut all, 3).unwrap();
            g.barrier(3).unwrap();
            (b, all)
        });
        let want_b = input(order[root], len);
        let want_all: Vec<f32> = order.iter().flat_map(|&n| input(n, len)).collect();
        for (b, all) in results {
            prop_assert_eq!(&b, &want_b);
            prop_assert_eq!(&all, &want_all);
        }
    }

    /// A relay copies each piece, bit for bit (negative zero, NaN payloads and all), from its
    /// giver to every rank that takes it, over random pieces (some empty, some taken by
    /// nobody, several per giver), worlds 1-5 and chunk sizes that cut pieces into many
    /// chunks; each giver's own pieces stay as they were, and the group goes on.
    #[test]
    fn a_relay_delivers_each_piece_to_its_takers_bit_for_bit(
        world in 1usize..=5,
        len in 0usize..6000,
        raw in proptest::collection::vec((0usize..5, any::<u16>(), 0u8..32), 0..8),
        chunk_bytes in prop_oneof![Just(4096usize), Just(16384)],
    ) {
        let order: Vec<u64> = (1..=world as u64).rev().collect();
        // Pieces that do not overlap: cut points from the draws, in order.
        let mut cuts: Vec<usize> = raw.iter().map(|r| r.1 as usize % (len + 1)).chain([0, len]).collect();
        cuts.sort_unstable();
        let pieces: Vec<(usize, std::ops::Range<usize>, Vec<usize>)> = raw
            .iter()
            .zip(cuts.windows(2))
            .map(|(&(g, _, mask), w)| (g % world, w[0]..w[1], (0..world).filter(|&j| j != g % world && mask >> j & 1 == 1).collect()))
            .collect();
        // Values no arithmetic would keep: -0.0 and a NaN with a payload among them.
        let value = |node: u64, i: usize| match i % 5 {
            0 => -0.0f32,
            1 => f32::from_bits(0x7fc0_1234 ^ node as u32),
            _ => input(node, i + 1)[i],
        };
        let results = on_every_rank(&order, chunk_bytes, |g, node| {
            let mut b: Vec<f32> = (0..len).map(|i| value(node, i)).collect();
            let p: Vec<_> = pieces.iter().map(|(g, r, to)| (*g, r.clone(), to.as_slice())).collect();
            g.relay(&mut b, &p, 3).unwrap();
            g.barrier(4).unwrap();
            b
        });
        for (giver, range, to) in &pieces {
            let want: Vec<u32> = range.clone().map(|i| value(order[*giver], i).to_bits()).collect();
            for j in to.iter().chain([giver]) {
                let got: Vec<u32> = results[*j][range.clone()].iter().map(|v| v.to_bits()).collect();
                prop_assert_eq!(&got, &want, "rank {} of piece {:?} from {}", j, range, giver);
            }
        }
    }
}

/// What sharded state's overlapped step relies on: reduce-scattering a buffer bucket by
/// bucket (each rank's block cut to the bucket) gives the bits of one reduce-scatter of the
/// whole, replicas included, because the ring sums each value in an order set by its block
/// alone. Over worlds 1-5, uneven blocks and bucket cuts anywhere.
#[test]
fn reduce_scatter_by_buckets_gives_the_bits_of_the_whole() {
    let mut runner =
        proptest::test_runner::TestRunner::new(ProptestConfig { cases: 16, ..ProptestConfig::default() });
    let strategy = (
        1usize..=5,
        1usize..4000,
        proptest::collection::vec(any::<u16>(), 4),
        proptest::collection::vec(any::<u16>(), 0..5),
    );
    runner
        .run(&strategy, |(world, len, block_cuts, bucket_cuts)| {
            let order: Vec<u64> = (1..=world as u64).rev().collect();
            let mut b: Vec<usize> =
                block_cuts[..world - 1].iter().map(|c| *c as usize % (len + 1)).chain([0, len]).collect();
            b.sort_unstable();
            let blocks: Vec<std::ops::Range<usize>> = b.windows(2).map(|w| w[0]..w[1]).collect();
            let mut k: Vec<usize> =
                bucket_cuts.iter().map(|c| *c as usize % (len + 1)).chain([0, len]).collect();
            k.sort_unstable();
            k.dedup();
            let replicas = usize::from(world > 1);
            let out = on_every_rank(&order, 4096, |g, node| {
                let mut whole = input(node, len);
                g.reduce_scatter_sum(&mut whole, &blocks, replicas, 1).unwrap();
                let mut parts = input(node, len);
                // From the buffer's end, as backward hands buckets over.
                for w in k.windows(2).rev() {
                    let cut: Vec<std::ops::Range<usize>> = blocks
                        .iter()
                        .map(|r| r.start.clamp(w[0], w[1]) - w[0]..r.end.clamp(w[0], w[1]) - w[0])
                        .collect();
                    g.reduce_scatter_sum(&mut parts[w[0]..w[1]], &cut, replicas, 2).unwrap();
                }
                (g.rank(), whole, parts)
            });
            for (rank, whole, parts) in out {
                let w = blocks.len();
                for held in (0..=replicas).map(|r| (rank + w - r) % w) {
                    let r = blocks[held].clone();
                    let (a, b): (Vec<u32>, Vec<u32>) = (
                        whole[r.clone()].iter().map(|v| v.to_bits()).collect(),
                        parts[r].iter().map(|v| v.to_bits()).collect(),
                    );
                    prop_assert_eq!(a, b, "rank {} block {}", rank, held);
                }
            }
            Ok(())
        })
        .unwrap();
}

/// A relay's pieces are checked before anything moves: a giver or taker outside the world,
/// or values outside the buffer, are refused naming the piece, and the group still works.
#[test]
fn a_relay_piece_outside_the_world_or_the_buffer_is_refused() {
    let order = [2u64, 1];
    let out = on_every_rank(&order, 4096, |g, _| {
        let mut b = vec![1.0f32; 10];
        let bad = [
            g.relay(&mut b, &[(2, 0..4, &[0][..])], 1).unwrap_err().to_string(),
            g.relay(&mut b, &[(0, 0..4, &[5][..])], 1).unwrap_err().to_string(),
            g.relay(&mut b, &[(0, 8..12, &[1][..])], 1).unwrap_err().to_string(),
        ];
        let mut one = [1.0f32];
        g.allreduce_sum(&mut one, 2).unwrap();
        (bad, one[0])
    });
    for (bad, sum) in out {
        assert!(bad.iter().all(|e| e.contains("a relay piece from rank")), "{bad:?}");
        assert_eq!(sum, 2.0, "the group broke");
    }
}

#[test]
fn a_peer_without_the_secret_is_refused() {
    let eps = endpoints(&[1], 4096);
    let mut cfg = DataPlaneConfig::new(77, 2, b"another-secret-of-16+bytes".to_vec());
    cfg.timeout = Duration::from_secs(2);
    let stranger = Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap();
    let err = stranger.connect(&eps[0].addr().to_string(), 1, 1, Channel::Ring).unwrap_err();
    assert!(matches!(err, DataPlaneError::Refused(_)), "{err}");
    assert!(err.to_string().contains("secret"), "{err}");
    // Nothing from the stranger reached the inbox.
    let err = eps[0].accept_from(2, 1, Channel::Ring);
    assert!(err.is_err());
}

#[test]
fn a_member_cannot_answer_for_another() {
    // Node 2 knows the secret, but the caller dialled node 3 at its address: node 2's proof
    // binds its own id, so the caller refuses it (and node 2 refuses the caller's proof,
    // which was made for node 3).
    let eps = endpoints(&[1, 2], 4096);
    let err = eps[0].connect(&eps[1].addr().to_string(), 3, 1, Channel::Ring).unwrap_err();
    assert!(matches!(err, DataPlaneError::Refused(_)), "{err}");
    assert!(err.to_string().contains("not node 3"), "{err}");
    assert!(eps[1].accept_from(1, 1, Channel::Ring).is_err());
    // Dialled as itself, it answers.
    assert!(eps[0].connect(&eps[1].addr().to_string(), 2, 1, Channel::Ring).is_ok());
}

#[test]
fn slow_handshakes_are_capped_and_end_at_one_deadline() {
    use limpet_agent::dataplane::endpoint::MAX_HANDSHAKES;
    use std::io::{Read, Write};
    let eps = endpoints(&[1, 2], 4096);
    // More dribbling connections than the cap: the excess is closed unanswered at once.
    let mut slow: Vec<std::net::TcpStream> =
        (0..MAX_HANDSHAKES + 8).map(|_| std::net::TcpStream::connect(eps[0].addr()).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(300));
    let mut closed = 0;
    for s in &mut slow {
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        if matches!(s.read(&mut [0u8; 1]), Ok(0)) {
            closed += 1;
        }
    }
    assert!(closed >= 8, "{closed} of {} connections closed at the cap", slow.len());
    // The rest dribble a byte at a time, well inside any per-read timeout, and are still cut
    // off at the handshake's deadline (the endpoints' timeout here).
    let started = std::time::Instant::now();
    let mut open = slow.len();
    while open > 0 && started.elapsed() < Duration::from_secs(20) {
        open = 0;
        for s in &mut slow {
            let waiting = |e: &std::io::Error| {
                matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
            };
            if s.write_all(b"L").is_ok() && matches!(s.read(&mut [0u8; 1]), Err(e) if waiting(&e)) {
                open += 1;
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(open, 0, "dribbling handshakes still open after {:?}", started.elapsed());
    // A real peer still gets through.
    assert!(eps[1].connect(&eps[0].addr().to_string(), 1, 1, Channel::Ring).is_ok());
}

#[test]
fn one_peer_cannot_crowd_the_inbox() {
    use limpet_agent::dataplane::endpoint::MAX_INBOX_PER_PEER;
    let eps = endpoints(&[1, 2, 3], 4096);
    let target = eps[0].addr().to_string();
    // Node 2 connects for thirty epochs ahead and never lets a group take them.
    for epoch in 1..=30 {
        eps[1].connect(&target, 1, epoch, Channel::Ring).unwrap();
    }
    std::thread::sleep(Duration::from_millis(300));
    // Node 3 still gets in.
    eps[2].connect(&target, 1, 5, Channel::Ring).unwrap();
    assert!(eps[0].accept_from(3, 5, Channel::Ring).is_ok());
    let soon = || std::time::Instant::now() + Duration::from_millis(20);
    let held =
        (1..=30).filter(|&e| eps[0].accept_until(2, e, Channel::Ring, soon(), &|| false).is_ok()).count();
    assert_eq!(held, MAX_INBOX_PER_PEER);
}

#[test]
fn a_peer_of_another_cluster_or_a_stale_epoch_is_refused() {
    let eps = endpoints(&[1, 2], 4096);
    eps[0].set_min_epoch(5);
    let err = eps[1].connect(&eps[0].addr().to_string(), 1, 4, Channel::Ring).unwrap_err();
    assert!(err.to_string().contains("past this epoch"), "{err}");
    let other =
        Endpoint::bind("127.0.0.1:0".parse().unwrap(), DataPlaneConfig::new(78, 3, SECRET.to_vec())).unwrap();
    let err = other.connect(&eps[0].addr().to_string(), 1, 5, Channel::Ring).unwrap_err();
    assert!(err.to_string().contains("another cluster"), "{err}");
}

#[test]
fn garbage_on_the_port_is_refused_and_the_endpoint_keeps_serving() {
    use std::io::{Read, Write};
    let eps = endpoints(&[1, 2], 4096);
    for junk in [&b"GET / HTTP/1.1\r\n\r\n"[..], &[0u8; 56][..], &[0xffu8; 200][..]] {
        let mut s = std::net::TcpStream::connect(eps[0].addr()).unwrap();
        let _ = s.write_all(junk);
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        assert!(rest.len() <= 1, "the endpoint answered garbage with {} bytes", rest.len());
    }
    // A real peer still gets through.
    let s = eps[1].connect(&eps[0].addr().to_string(), 1, 1, Channel::Ring);
    assert!(s.is_ok());
    assert!(eps[0].accept_from(2, 1, Channel::Ring).is_ok());
}

#[test]
fn a_silent_peer_times_out_and_a_closed_one_fails_at_once() {
    let eps: Vec<Endpoint> = [1u64, 2, 3]
        .iter()
        .map(|&n| {
            let mut cfg = DataPlaneConfig::new(77, n, SECRET.to_vec());
            cfg.timeout = Duration::from_millis(800);
            Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap()
        })
        .collect();
    let addrs: Vec<String> = eps.iter().map(|e| e.addr().to_string()).collect();
    let order = [1u64, 2, 3];
    let started = std::time::Instant::now();
    let results: Vec<Result<(), DataPlaneError>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|i| {
                let (ep, addrs) = (&eps[i], &addrs);
                s.spawn(move || {
                    let mut g = ep.group(1, &order, addrs)?;
                    let mut buf = vec![1.0f32; 100_000];
                    g.allreduce_sum(&mut buf, 0)?;
                    if i == 2 {
                        // Rank 3 stops taking part: it neither sends nor closes.
                        std::thread::sleep(Duration::from_secs(3));
                        return Ok(());
                    }
                    g.allreduce_sum(&mut buf, 1)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(results[0].is_err() && results[1].is_err(), "{results:?}");
    // The survivors fail within the timeout plus the time their neighbour took to fail.
    assert!(started.elapsed() < Duration::from_secs(4));
    let msgs: Vec<String> = results[..2].iter().map(|r| r.as_ref().unwrap_err().to_string()).collect();
    assert!(msgs.iter().any(|m| m.contains("no progress")), "{msgs:?}");
}

/// A peer whose data port refuses (nothing listens: a dead process) is remembered as refusing
/// for the heartbeats to name, and forgotten once a connection to it succeeds or the news
/// is old.
#[test]
fn a_peer_whose_port_refuses_is_named_until_a_connection_succeeds() {
    let (ep, peer) = (quick(1), quick(2));
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed = free.local_addr().unwrap().to_string();
    drop(free);
    let soon = std::time::Instant::now() + Duration::from_millis(100);
    assert!(ep.connect_until(&closed, 2, 1, Channel::Ring, soon, &|| false).is_err());
    assert_eq!(ep.refused_lately(Duration::from_secs(2)), vec![2]);
    assert_eq!(ep.refused_lately(Duration::ZERO), Vec::<u64>::new(), "old news is dropped");
    assert!(ep.connect_until(&closed, 2, 1, Channel::Ring, soon, &|| true).is_err());
    let up = peer.addr().to_string();
    let c = ep.connect(&up, 2, 1, Channel::Ring);
    assert!(c.is_ok(), "{:?}", c.err());
    assert_eq!(ep.refused_lately(Duration::from_secs(2)), Vec::<u64>::new());
}

/// Both ends of a data-plane connection run the configured congestion control (reno by
/// default, which every host allows); `None` keeps the host's default; a name the host
/// refuses keeps the default too, and the connection still works.
#[test]
fn data_plane_sockets_use_the_configured_congestion_control() {
    use limpet_agent::dataplane::endpoint::{congestion_of, DEFAULT_CONGESTION};
    let host = limpet_agent::dataplane::endpoint::host_congestion();
    let pair = |cc: Option<&str>| {
        let eps: Vec<Endpoint> = [1u64, 2]
            .iter()
            .map(|&n| {
                let mut cfg = DataPlaneConfig::new(77, n, SECRET.to_vec());
                cfg.congestion = cc.map(str::to_string);
                Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap()
            })
            .collect();
        let out = eps[1].connect(&eps[0].addr().to_string(), 1, 1, Channel::Ring).unwrap();
        let inc = eps[0].accept_from(2, 1, Channel::Ring).unwrap();
        (congestion_of(&out).unwrap(), congestion_of(&inc).unwrap())
    };
    assert_eq!(
        pair(Some(DEFAULT_CONGESTION)),
        (DEFAULT_CONGESTION.to_string(), DEFAULT_CONGESTION.to_string())
    );
    assert_eq!(pair(None), (host.clone(), host.clone()));
    assert_eq!(pair(Some("nosuch_algo")), (host.clone(), host));
    // A malformed name is refused up front, naming it.
    let mut cfg = DataPlaneConfig::new(77, 3, SECRET.to_vec());
    cfg.congestion = Some("Reno!".into());
    let err = Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg).err().expect("refused");
    assert!(err.to_string().contains("\"Reno!\""), "{err}");
}

/// A short-timeout endpoint for the byte-stream properties below.
fn quick(node: u64) -> Endpoint {
    let mut cfg = DataPlaneConfig::new(9, node, b"collectives-test-secret".to_vec());
    cfg.timeout = Duration::from_millis(300);
    Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Arbitrary byte streams sent to the data port (what `fuzz/fuzz_targets/dataplane_stream`
    /// sends without end) are refused without a panic, and a member connects right after.
    #[test]
    fn arbitrary_bytes_on_the_data_port_are_refused_and_a_member_still_connects(
        streams in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..160), 1..4),
    ) {
        use std::io::{Read, Write};
        let (server, member) = (quick(1), quick(2));
        for bytes in &streams {
            let mut s = std::net::TcpStream::connect(server.addr()).unwrap();
            let _ = s.write_all(bytes);
            let _ = s.shutdown(std::net::Shutdown::Write);
            s.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
            let _ = s.read(&mut [0u8; 256]);
        }
        prop_assert!(member.connect(&server.addr().to_string(), 1, 1, Channel::Ring).is_ok());
        prop_assert!(server.accept_from(2, 1, Channel::Ring).is_ok());
    }

    /// An endpoint dialling a "server" that answers with arbitrary bytes gets an error (the
    /// answer needs the server's proof over the dialler's fresh nonce), never a panic.
    #[test]
    fn a_server_answering_garbage_is_refused(bytes in proptest::collection::vec(any::<u8>(), 0..160)) {
        use std::io::{Read, Write};
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let fake = std::thread::spawn(move || {
            if let Ok((mut s, _)) = l.accept() {
                s.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
                let _ = s.read(&mut [0u8; 256]);
                let _ = s.write_all(&bytes);
            }
        });
        prop_assert!(quick(2).connect(&addr, 1, 1, Channel::Ring).is_err());
        fake.join().unwrap();
    }
}

#[path = "support/hostile_peer.rs"]
mod hostile_peer;
use hostile_peer::hostile_peer_case;
use limpet_agent::dataplane::frame::{Header, Kind};

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// A member past a valid handshake sending arbitrary bytes, raw or behind a well-formed
    /// header for the very collective or pipeline receive the honest node waits on (what
    /// `fuzz/fuzz_targets/dataplane_peer` sends without end), gets an error and a broken
    /// group or link within the timeout, never a panic or a hang.
    #[test]
    fn a_member_sending_garbage_frames_breaks_only_its_collective(
        op in 0u8..10,
        mode in any::<u8>(),
        bytes in proptest::collection::vec(any::<u8>(), 0..200),
    ) {
        let mut input = vec![op, mode];
        input.extend_from_slice(&bytes);
        let _ = hostile_peer_case(&input);
    }
}

/// The harness itself can fail: it reaches the payload checks. In a world of two, a
/// one-value barrier's only frame from the peer is the reduce-scatter's; a truthful one
/// carrying 1.0 completes the barrier, 2.0 makes it count three ranks, and the right value
/// behind a header for another step is refused as stale.
#[test]
fn the_hostile_peer_harness_reaches_the_payload() {
    let frame = |step: u64, v: f32| {
        let mut input = vec![5u8, 0];
        input.extend_from_slice(&Header { kind: Kind::Data, epoch: 1, step, seq: 0, len: 4 }.encode());
        input.extend_from_slice(&v.to_le_bytes());
        input
    };
    assert!(hostile_peer_case(&frame(5, 1.0)).is_ok());
    let counted = hostile_peer_case(&frame(5, 2.0));
    assert!(matches!(&counted, Err(DataPlaneError::Protocol(m)) if m.contains("3 of 2")), "{counted:?}");
    assert!(
        matches!(hostile_peer_case(&frame(4, 1.0)), Err(DataPlaneError::Stale(_))),
        "a stale frame passed"
    );
}

/// A ring's lanes: every rank connects lanes 1 and 2 beside its ring, and each lane sums on
/// its own sockets while the others run (one thread per lane, the lanes taken in another
/// order on every rank), exactly; a world of one has lanes with nothing to cross.
#[test]
fn lanes_are_rings_of_their_own_that_sum_at_once() {
    let order = [30u64, 10, 20];
    let eps = endpoints(&[10, 20, 30], 4096);
    let at = |n: u64| &eps[(n / 10 - 1) as usize];
    let addrs: Vec<String> = order.iter().map(|&n| at(n).addr().to_string()).collect();
    let deadline = || std::time::Instant::now() + Duration::from_secs(5);
    let never = || false;
    let len = 10_001;
    let results: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
        let handles: Vec<_> = order
            .iter()
            .enumerate()
            .map(|(r, &node)| {
                let (ep, addrs) = (at(node), &addrs);
                s.spawn(move || {
                    let mut ring = ep.group(1, &order, addrs).expect("ring");
                    let mut lanes =
                        limpet_agent::dataplane::lanes::connect(ep, 1, &order, addrs, 3, deadline(), &never)
                            .expect("lanes");
                    assert_eq!(lanes.len(), 2);
                    let mut groups: Vec<(u64, &mut limpet_agent::Group)> = std::iter::once(&mut ring)
                        .chain(lanes.iter_mut())
                        .zip(0..)
                        .map(|(g, k)| (k, g))
                        .collect();
                    // Each rank starts its lanes in another order: they must not wait on
                    // one another.
                    groups.rotate_left(r);
                    std::thread::scope(|s| {
                        let hs: Vec<_> = groups
                            .into_iter()
                            .map(|(k, g)| {
                                s.spawn(move || {
                                    // Each lane sums inputs of its own: lanes wired to one
                                    // another would give another lane's sum.
                                    let mut b = input(node + 1000 * k, len);
                                    g.allreduce_sum(&mut b, 3).unwrap();
                                    b
                                })
                            })
                            .collect();
                        let mut out: Vec<Vec<f32>> = hs.into_iter().map(|h| h.join().unwrap()).collect();
                        out.rotate_right(r);
                        out
                    })
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Every rank holds each lane's sum, bit for bit, and it is that lane's sum.
    for k in 0..3u64 {
        let want: Vec<f64> =
            (0..len).map(|i| order.iter().map(|&n| f64::from(input(n + 1000 * k, len)[i])).sum()).collect();
        let k = k as usize;
        assert!(results.iter().all(|lanes| lanes[k] == results[0][k]), "ranks differ on lane {k}");
        for (got, want) in results[0][k].iter().zip(&want) {
            assert!((f64::from(*got) - want).abs() <= 1e-5 * (1.0 + want.abs()), "lane {k}: {got} vs {want}");
        }
    }
    // Too many lanes are refused; a world of one connects nothing.
    let alone = &endpoints(&[5], 4096)[0];
    let addr = [alone.addr().to_string()];
    let Err(err) = limpet_agent::dataplane::lanes::connect(alone, 1, &[5], &addr, 99, deadline(), &never)
    else {
        panic!("99 lanes connected")
    };
    assert!(err.to_string().contains("99 ring lanes"), "{err}");
    let solo = limpet_agent::dataplane::lanes::connect(alone, 1, &[5], &addr, 4, deadline(), &never).unwrap();
    assert_eq!(solo.len(), 3);
}
