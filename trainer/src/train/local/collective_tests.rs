//! Local ranks' collectives alone, on threads of one process: a rank that leaves or a failing
//! lane between hosts fails every local rank, buffers are cut into chunks summed in parallel and
//! carried lane by lane, disagreeing ranks fail a collective, and a relay over hosts of equal
//! devices goes between hosts only to its takers' hosts.

use super::*;

#[test]
fn a_local_rank_that_leaves_fails_the_others_instead_of_hanging() {
    let group = LocalGroup::new(3);
    std::thread::scope(|s| {
        let gone = group.rank(2, None);
        let waiting: Vec<_> = (0..2)
            .map(|i| {
                let mut r = group.rank(i, None);
                s.spawn(move || r.allreduce_sum(&mut [1.0, 2.0], 0))
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(50));
        drop(gone);
        for w in waiting {
            let e = w.join().unwrap().unwrap_err();
            assert!(e.to_string().contains("local rank 2 left"), "{e}");
        }
    });
}

#[test]
fn a_failure_between_hosts_reaches_every_local_rank_and_sums_are_hierarchical() {
    /// Fails its first collective (naming a peer), doubles the sum after.
    struct Flaky(usize);
    impl Reduce for Flaky {
        fn allreduce_sum(&mut self, b: &mut [f32], _: u64) -> Result<(), TrainerError> {
            self.0 += 1;
            if self.0 == 1 {
                return Err(TrainerError::Reduce {
                    peer: Some(7),
                    detail: "peer 7 closed".into(),
                    violation: false,
                });
            }
            b.iter_mut().for_each(|v| *v *= 2.0);
            Ok(())
        }
    }
    let group = LocalGroup::new(2);
    let mut flaky = Flaky(0);
    std::thread::scope(|s| {
        let mut r1 = group.rank(1, None);
        let other = s.spawn(move || {
            let mut b = [3.0f32, 4.0];
            let first = r1.allreduce_sum(&mut b, 0).map(|_| b);
            let mut b = [3.0f32, 4.0];
            (first, r1.allreduce_sum(&mut b, 1).map(|_| b))
        });
        let mut r0 = group.rank(0, Some(&mut flaky));
        let e = r0.allreduce_sum(&mut [1.0, 2.0], 0).unwrap_err();
        assert!(matches!(e, TrainerError::Reduce { peer: Some(7), .. }), "{e}");
        // The group goes on: the next collective succeeds everywhere.
        let mut b = [1.0f32, 2.0];
        r0.allreduce_sum(&mut b, 1).unwrap();
        assert_eq!(b, [8.0, 12.0]);
        let (first, second) = other.join().unwrap();
        assert!(matches!(first, Err(TrainerError::Reduce { peer: Some(7), .. })));
        assert_eq!(second.unwrap(), [8.0, 12.0]);
    });
}

#[test]
fn a_buffer_of_several_chunks_is_summed_in_parallel_and_crosses_hosts_chunk_by_chunk() {
    /// Counts the collectives between hosts and doubles each (a second host's equal sum).
    struct Counting(usize);
    impl Reduce for Counting {
        fn allreduce_sum(&mut self, b: &mut [f32], _: u64) -> Result<(), TrainerError> {
            self.0 += 1;
            b.iter_mut().for_each(|v| *v *= 2.0);
            Ok(())
        }
    }
    let len = 2 * CHUNK + 5;
    let group = LocalGroup::new(3);
    let mut counting = Counting(0);
    let results: Vec<Vec<f32>> = std::thread::scope(|s| {
        let others: Vec<_> = (1..3)
            .map(|i| {
                let mut r = group.rank(i, None);
                s.spawn(move || {
                    let mut b: Vec<f32> = (0..len).map(|v| (v % 7) as f32 * i as f32).collect();
                    r.allreduce_sum(&mut b, 0).unwrap();
                    b
                })
            })
            .collect();
        let mut b: Vec<f32> = vec![1.0; len];
        group.rank(0, Some(&mut counting)).allreduce_sum(&mut b, 0).unwrap();
        std::iter::once(b).chain(others.into_iter().map(|h| h.join().unwrap())).collect()
    });
    assert_eq!(counting.0, 3, "one collective between hosts per chunk");
    let want: Vec<f32> = (0..len).map(|v| 2.0 * (1.0 + 3.0 * (v % 7) as f32)).collect();
    for r in &results {
        assert!(r == &want, "a local rank holds another sum");
    }
}

#[test]
fn each_lane_carries_its_chunks_in_order_and_small_buffers_take_one_lane() {
    /// Records the lengths it carried and doubles each (a second host's equal sum).
    struct Lane(Vec<usize>);
    impl Reduce for Lane {
        fn allreduce_sum(&mut self, b: &mut [f32], _: u64) -> Result<(), TrainerError> {
            self.0.push(b.len());
            b.iter_mut().for_each(|v| *v *= 2.0);
            Ok(())
        }
    }
    // The cut: near-equal chunks tiling the buffer, at least one per lane the buffer
    // fills, at most CHUNK values each.
    for (len, lanes, chunks) in [
        (0, 4, 1),
        (3, 4, 1),
        (2 * MIN_LANE_VALUES - 1, 4, 1),
        (2 * MIN_LANE_VALUES, 4, 2),
        (9 * CHUNK + 1, 4, 12),
        (9 * CHUNK + 1, 1, 10),
    ] {
        let c = cut(len, lanes);
        assert_eq!(c.len(), chunks, "{len} values over {lanes} lanes");
        assert!(c.first().unwrap().start == 0 && c.last().unwrap().end == len);
        assert!(c.windows(2).all(|w| w[0].end == w[1].start) && c.iter().all(|r| r.len() <= CHUNK));
        // Each lane the buffer fills takes as many chunks as the others.
        assert_eq!(c.len() % lanes.min(len / MIN_LANE_VALUES).max(1), 0, "{len} over {lanes}");
    }
    // Three local ranks driving three lanes: chunk c on lane c % 3, in order.
    let lanes = 3;
    for len in [7 * MIN_LANE_VALUES + 5, 5] {
        let group = LocalGroup::with_sums(lanes, 0, lanes, &LocalSums::default());
        let mut carried: Vec<Lane> = (0..lanes).map(|_| Lane(Vec::new())).collect();
        let results: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = carried
                .iter_mut()
                .enumerate()
                .map(|(i, lane)| {
                    let group = &group;
                    s.spawn(move || {
                        let mut r = group.rank(i, Some(lane));
                        let mut b: Vec<f32> = (0..len).map(|v| (v % 5) as f32 + i as f32).collect();
                        r.allreduce_sum(&mut b, 0).unwrap();
                        b
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let want: Vec<f32> = (0..len).map(|v| 2.0 * (3.0 * (v % 5) as f32 + 3.0)).collect();
        assert!(results.iter().all(|r| r == &want), "a local rank holds another sum");
        let chunks = cut(len, lanes);
        for (k, lane) in carried.iter().enumerate() {
            let mine: Vec<usize> = chunks.iter().skip(k).step_by(lanes).map(|r| r.len()).collect();
            assert_eq!(lane.0, mine, "lane {k} of {len} values");
        }
        if len < MIN_LANE_VALUES {
            assert!(carried[1].0.is_empty() && carried[2].0.is_empty(), "a small buffer took one lane");
        } else {
            assert!(carried.iter().all(|l| !l.0.is_empty()), "every lane carried its part");
        }
    }
}

#[test]
fn a_failing_lane_fails_every_local_rank_and_copies_no_partial_sum() {
    /// A lane between hosts: doubles each sum (a second host's equal one), or fails.
    struct Lane(bool);
    impl Reduce for Lane {
        fn allreduce_sum(&mut self, b: &mut [f32], _: u64) -> Result<(), TrainerError> {
            if self.0 {
                let detail = "lane peer 9 closed".into();
                return Err(TrainerError::Reduce { peer: Some(9), detail, violation: false });
            }
            b.iter_mut().for_each(|v| *v *= 2.0);
            Ok(())
        }
    }
    let len = 4 * MIN_LANE_VALUES;
    let group = LocalGroup::with_sums(3, 0, 2, &LocalSums::default());
    let mut lanes = [Lane(false), Lane(true)];
    let outcomes: Vec<(Result<(), TrainerError>, Vec<f32>)> = std::thread::scope(|s| {
        let mut lanes = lanes.iter_mut();
        let handles: Vec<_> = (0..3)
            .map(|i| {
                let lane = lanes.next().map(|l| l as &mut (dyn Reduce + Send));
                let mut r = group.rank(i, lane);
                s.spawn(move || {
                    let mut b = vec![1.0f32; len];
                    (r.allreduce_sum(&mut b, 0), b)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (r, b)) in outcomes.iter().enumerate() {
        assert!(matches!(r, Err(TrainerError::Reduce { peer: Some(9), .. })), "local rank {i}: {r:?}");
        assert!(b.iter().all(|&v| v == 1.0), "local rank {i} copied a partial sum");
    }
}

#[test]
fn local_ranks_that_disagree_on_a_collective_fail_it_instead_of_summing_wrong() {
    // Lengths of one and of two chunks: the chunk only one rank has would be its own.
    let group = LocalGroup::new(2);
    let results: Vec<Result<(), TrainerError>> = std::thread::scope(|s| {
        let lens = [CHUNK, CHUNK + 3];
        let handles: Vec<_> = (0..2)
            .map(|i| {
                let mut r = group.rank(i, None);
                s.spawn(move || r.allreduce_sum(&mut vec![1.0; lens[i]], 0))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(results.iter().all(|r| r.is_err()), "{results:?}");
    assert!(results.iter().any(|r| matches!(r, Err(TrainerError::Reduce { violation: true, .. }))));
    // Sums kept from a group left mid-collective count nothing in the next group's.
    let sums = LocalSums::default();
    {
        let group = LocalGroup::with_sums(2, 0, 1, &sums);
        let mut r0 = group.rank(0, None);
        let gone = group.rank(1, None);
        std::thread::scope(|s| {
            let h = s.spawn(move || r0.allreduce_sum(&mut [5.0, 5.0], 0));
            std::thread::sleep(std::time::Duration::from_millis(20));
            drop(gone);
            assert!(h.join().unwrap().is_err());
        });
    }
    let group = LocalGroup::with_sums(2, 0, 1, &sums);
    let got: Vec<[f32; 2]> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|i| {
                let mut r = group.rank(i, None);
                s.spawn(move || {
                    let mut b = [1.0f32, 2.0];
                    r.allreduce_sum(&mut b, 1).unwrap();
                    b
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got, vec![[2.0, 4.0]; 2]);
}

/// Records the collectives a host's lane runs between hosts (and the relay's pieces), and
/// runs them on the stand-in for the ring.
struct Spy<'a> {
    inner: LocalRank<'a>,
    ran: &'a std::sync::Mutex<Vec<String>>,
}

impl Reduce for Spy<'_> {
    fn allreduce_sum(&mut self, buf: &mut [f32], step: u64) -> Result<(), TrainerError> {
        self.ran.lock().unwrap().push("sum".into());
        self.inner.allreduce_sum(buf, step)
    }

    fn allreduce_sum_i64(&mut self, buf: &mut [i64], step: u64) -> Result<(), TrainerError> {
        self.ran.lock().unwrap().push("sum of bits".into());
        self.inner.allreduce_sum_i64(buf, step)
    }

    fn relay(
        &mut self,
        buf: &mut [f32],
        pieces: &[Piece],
        rank: usize,
        step: u64,
    ) -> Result<(), TrainerError> {
        let said: Vec<String> =
            pieces.iter().map(|p| format!("{}:{:?}->{:?}", p.giver, p.range, p.to)).collect();
        self.ran.lock().unwrap().push(format!("relay {}", said.join(" ")));
        self.inner.relay(buf, pieces, rank, step)
    }
}

#[test]
fn a_relay_over_hosts_of_equal_devices_goes_between_hosts_only_to_its_takers_hosts() {
    // Three hosts of two devices: a piece kept on its host, one to the two other hosts, one
    // to the host before; values with a negative zero and a NaN's payload, whose bits count.
    let pieces = vec![
        Piece { giver: 0, range: 0..10, to: vec![1] },
        Piece { giver: 3, range: 10..20, to: vec![0, 5] },
        Piece { giver: 5, range: 20..40, to: vec![2, 3] },
    ];
    let value = |r: usize, i: usize| match i {
        12 => -0.0,
        25 => f32::from_bits(0x7fc0_1234),
        _ => (r * 1000 + i) as f32,
    };
    for equal in [true, false] {
        let ran = std::sync::Mutex::new(Vec::new());
        let ring = LocalGroup::new(3);
        let groups: Vec<LocalGroup> = (0..3)
            .map(|h| LocalGroup::of_hosts(2, 2 * h, 1, &LocalSums::default(), equal.then_some(3)))
            .collect();
        let bufs: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..6)
                .map(|r| {
                    let (group, ring, ran, pieces) = (&groups[r / 2], &ring, &ran, &pieces);
                    s.spawn(move || {
                        let mut buf: Vec<f32> = (0..40).map(|i| value(r, i)).collect();
                        if r % 2 == 1 {
                            group.rank(1, None).relay(&mut buf, pieces, r, 0).unwrap();
                            return buf;
                        }
                        let mut spy = Spy { inner: ring.rank(r / 2, None), ran };
                        let mut local = group.rank(0, Some(&mut spy));
                        local.relay(&mut buf, pieces, r, 0).unwrap();
                        buf
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for p in &pieces {
            for &t in &p.to {
                for i in p.range.clone() {
                    assert_eq!(bufs[t][i].to_bits(), value(p.giver, i).to_bits(), "rank {t}, value {i}");
                }
            }
        }
        let ran = ran.into_inner().unwrap();
        if equal {
            // Each host's lane ran one relay, of the pieces whose takers are on other hosts.
            assert_eq!(ran.len(), 3, "{ran:?}");
            assert!(ran.iter().all(|r| r == "relay 1:10..20->[0, 2] 2:20..40->[1]"), "{ran:?}");
        } else {
            assert!(ran.iter().all(|r| r == "sum of bits") && ran.len() == 3, "{ran:?}");
        }
    }
}
