//! Local ranks' collectives and training, on threads of one process.

use super::*;
use crate::train::tests::{job, synthetic};
use crate::{JobSpec, ModelKind, NoReduce, ShardLayout};
use limpet_snapshot::RawTensor;
use std::collections::BTreeMap;

/// Runs `f` once on every rank of hosts of `hosts` local ranks at once, each on a thread of
/// its own with its local rank's reduce (the hosts' sums go through one more group per
/// lane, standing for the ring's lanes): what each returned, in rank order.
fn on_hosts<R: Send>(
    ranks: &mut [Trainer],
    hosts: &[usize],
    f: impl for<'a, 'b> Fn(usize, &'a mut Trainer, &'a mut LocalRank<'b>) -> R + Sync,
) -> Vec<R> {
    let world: usize = hosts.iter().sum();
    assert_eq!(ranks.len(), world);
    // One lane per local rank of the host with the fewest, as an epoch gives them.
    let lanes = hosts.iter().copied().min().unwrap_or(1);
    let rings: Vec<LocalGroup> = (0..lanes).map(|_| LocalGroup::new(hosts.len())).collect();
    let firsts: Vec<usize> = hosts.iter().scan(0, |at, &n| Some(std::mem::replace(at, *at + n))).collect();
    let groups: Vec<LocalGroup> = hosts
        .iter()
        .zip(&firsts)
        .map(|(&n, &first)| {
            // Hosts alike relay by host, as an epoch of them does.
            let equal = hosts.iter().all(|&m| m == n).then_some(hosts.len());
            LocalGroup::of_hosts(n, first, lanes, &LocalSums::default(), equal)
        })
        .collect();
    let f = &f;
    std::thread::scope(|s| {
        let mut rest = ranks;
        let mut handles = Vec::new();
        for (h, &n) in hosts.iter().enumerate() {
            let (mine, tail) = rest.split_at_mut(n);
            rest = tail;
            let (group, rings, first) = (&groups[h], &rings, firsts[h]);
            for (i, t) in mine.iter_mut().enumerate() {
                handles.push(s.spawn(move || {
                    if i >= lanes {
                        return f(first + i, t, &mut group.rank(i, None));
                    }
                    let (mut between, mut alone) = (RingOfHosts(rings[i].rank(h, None)), NoReduce);
                    let inter: &mut (dyn Reduce + Send) =
                        if hosts.len() > 1 { &mut between } else { &mut alone };
                    let mut local = group.rank(i, Some(inter));
                    f(first + i, t, &mut local)
                }));
            }
        }
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A group standing for the ring between hosts, one member per host. Its reduce-scatter
/// sums every block for every member: a ring's gives each host its block and its replicas'
/// (the hosts before it), where a group's own would give a member the blocks at its local
/// rank count apart, which for a group of hosts is its own block again.
struct RingOfHosts<'a>(LocalRank<'a>);

impl Reduce for RingOfHosts<'_> {
    fn allreduce_sum(&mut self, buf: &mut [f32], step: u64) -> Result<(), TrainerError> {
        self.0.allreduce_sum(buf, step)
    }

    fn allreduce_sum_i64(&mut self, buf: &mut [i64], step: u64) -> Result<(), TrainerError> {
        self.0.allreduce_sum_i64(buf, step)
    }

    fn allreduce_max_i32(&mut self, vals: &mut [i32], step: u64) -> Result<(), TrainerError> {
        self.0.allreduce_max_i32(vals, step)
    }

    fn reduce_scatter_sum(
        &mut self,
        buf: &mut [f32],
        _: &[Range<usize>],
        _: usize,
        step: u64,
    ) -> Result<(), TrainerError> {
        self.0.allreduce_sum(buf, step)
    }

    fn allgather_blocks(
        &mut self,
        buf: &mut [f32],
        blocks: &[Range<usize>],
        step: u64,
    ) -> Result<(), TrainerError> {
        self.0.allgather_blocks(buf, blocks, step)
    }

    fn relay(
        &mut self,
        buf: &mut [f32],
        pieces: &[Piece],
        rank: usize,
        step: u64,
    ) -> Result<(), TrainerError> {
        self.0.relay(buf, pieces, rank, step)
    }
}

/// Trainers of `job`, one per rank of `hosts`.
fn trainers(job: &JobSpec, hosts: &[usize]) -> Vec<Trainer> {
    (0..hosts.iter().sum()).map(|_| Trainer::try_new(job.clone(), synthetic()).unwrap()).collect()
}

/// Ranks on `hosts` hosts (each its local ranks on threads) for `steps` steps; the
/// content hash of every rank after each step.
fn run(job: &JobSpec, hosts: &[usize], steps: usize) -> Vec<Vec<String>> {
    let world: usize = hosts.iter().sum();
    let mut ranks = trainers(job, hosts);
    let mut hashes = Vec::new();
    for _ in 0..steps {
        on_hosts(&mut ranks, hosts, |r, t, local| t.train_step(r, world, local).unwrap());
        hashes.push(ranks.iter().map(|t| t.content_hash().unwrap()).collect());
    }
    hashes
}

/// Shards every rank's state over hosts of `per_host` local ranks with `replicas`, as
/// group `tag`.
fn shard(ranks: &mut [Trainer], per_host: usize, replicas: usize, tag: u64) {
    let world = ranks.len();
    for (r, t) in ranks.iter_mut().enumerate() {
        let n = t.buffer_len() - 3;
        t.shard_state(ShardLayout::over_hosts(n, world, per_host, r, replicas).unwrap().tagged(tag)).unwrap();
    }
}

/// A reproducible job whose sums fill two lanes between hosts of two devices.
fn wide_exact_job() -> JobSpec {
    let data = synthetic();
    let mut exact = JobSpec { reproducible: true, ..job(ModelKind::Mlp, &data, 24, 4) };
    if let crate::model::ModelSpec::Mlp { hidden, .. } = &mut exact.model {
        *hidden = vec![256, 256];
    }
    exact
}

#[test]
fn sharded_state_over_local_ranks_trains_the_bits_of_whole_state() {
    let exact = wide_exact_job();
    let whole = run(&exact, &[1], 3);
    let hosts = [2, 2];
    let mut ranks = trainers(&exact, &hosts);
    shard(&mut ranks, 2, 1, 1);
    for _ in 0..3 {
        on_hosts(&mut ranks, &hosts, |r, t, local| t.train_step(r, 4, local).unwrap());
    }
    // Each rank holds its block and the same local rank's block of the other host.
    let held: Vec<Vec<usize>> = ranks.iter().map(|t| t.shard_layout().unwrap().held()).collect();
    assert_eq!(held, vec![vec![0, 2], vec![1, 3], vec![2, 0], vec![3, 1]]);
    on_hosts(&mut ranks, &hosts, |_, t, local| t.unshard(local).unwrap());
    for (r, t) in ranks.iter().enumerate() {
        assert_eq!(t.content_hash().unwrap(), whole[2][0], "rank {r} after unsharding");
    }

    // Floats: the sharded step (reduce-scatter by hosts, overlapped with backward where the
    // model allows) ends close to whole state on the same hosts.
    let data = synthetic();
    let plain = job(ModelKind::Mlp, &data, 24, 4);
    let (mut a, mut b) = (trainers(&plain, &hosts), trainers(&plain, &hosts));
    shard(&mut a, 2, 1, 1);
    for step in 0..3 {
        let la = on_hosts(&mut a, &hosts, |r, t, local| t.train_step(r, 4, local).unwrap().loss);
        let lb = on_hosts(&mut b, &hosts, |r, t, local| t.train_step(r, 4, local).unwrap().loss);
        assert!(
            la.iter().zip(&lb).all(|(x, y)| (x - y).abs() <= 1e-5 * y.abs().max(1.0)),
            "step {step}: {la:?} {lb:?}"
        );
    }
    on_hosts(&mut a, &hosts, |_, t, local| t.unshard(local).unwrap());
    for (x, y) in a.iter().zip(&b) {
        for ((name, p), (_, q)) in x.model().params().iter().zip(y.model().params()) {
            let diff = (p - q).abs().max().double_value(&[]);
            assert!(diff < 1e-4, "{name} differs by {diff}");
        }
    }
}

#[test]
fn a_host_killed_loses_no_shard_since_its_replicas_are_on_other_hosts() {
    let exact = wide_exact_job();
    let whole = run(&exact, &[1], 4);
    let hosts = [2, 2, 2];
    // A layout of one rank per host cannot scatter over local ranks: its replicas would be
    // the neighbouring device, on the same host. Refused before any collective.
    let mut t = Trainer::try_new(job(ModelKind::Mlp, &synthetic(), 24, 4), synthetic()).unwrap();
    let n = t.buffer_len() - 3;
    t.shard_state(ShardLayout::new(n, 6, 0, 1).unwrap()).unwrap();
    let e = t.sharded_step(0, 6, &mut LocalGroup::new(2).rank(0, None)).unwrap_err();
    assert!(e.to_string().contains("sharded over hosts of 1 ranks, reduced over hosts of 2"), "{e}");
    let mut ranks = trainers(&exact, &hosts);
    shard(&mut ranks, 2, 1, 1);
    for _ in 0..2 {
        on_hosts(&mut ranks, &hosts, |r, t, local| t.train_step(r, 6, local).unwrap());
    }
    // A kill -9 of host 1 takes ranks 2 and 3, the only owners of blocks 2 and 3 and the
    // replica holders of blocks 0 and 1; the same local ranks of hosts 2 and 0 hold those.
    let mut survivors: Vec<Trainer> =
        ranks.drain(..).enumerate().filter(|(r, _)| !(2..4).contains(r)).map(|(_, t)| t).collect();
    let hosts = [2, 2];
    let rebuilt = on_hosts(&mut survivors, &hosts, |r, t, local| {
        let n = t.buffer_len() - 3;
        let target = ShardLayout::over_hosts(n, 4, 2, r, 1).unwrap().tagged(2);
        t.regroup(r, 4, Some(target), u64::MAX, local).unwrap()
    });
    assert_eq!(rebuilt, vec![Some(2); 4]);
    for _ in 0..2 {
        on_hosts(&mut survivors, &hosts, |r, t, local| t.train_step(r, 4, local).unwrap());
    }
    on_hosts(&mut survivors, &hosts, |_, t, local| t.unshard(local).unwrap());
    for (r, t) in survivors.iter().enumerate() {
        assert_eq!(t.content_hash().unwrap(), whole[3][0], "survivor {r}");
    }
}

#[test]
fn two_hosts_of_two_devices_train_the_bits_of_four_hosts_of_one() {
    let data = synthetic();
    let exact = wide_exact_job();
    let values = Trainer::try_new(exact.clone(), synthetic()).unwrap().buffer_len();
    assert!(cut(values, 2).len() == 2, "{values} values fill one lane");
    let a = run(&exact, &[2, 2], 3);
    let b = run(&exact, &[1, 1, 1, 1], 3);
    let one = run(&exact, &[1], 3);
    for ((x, y), z) in a.iter().zip(&b).zip(&one) {
        assert!(x.iter().chain(y).all(|h| h == &z[0]), "ranks differ: {x:?} {y:?} {z:?}");
    }
    // Unequal hosts: two lanes, and a third local rank that drives none.
    let c = run(&exact, &[3, 2], 3);
    for (x, z) in c.iter().zip(&one) {
        assert!(x.iter().all(|h| h == &z[0]), "ranks of hosts of 3 and 2 differ: {x:?} {z:?}");
    }
    // An ordinary job: every local rank holds the same bits, and the hosts agree.
    let plain = job(ModelKind::Mlp, &data, 24, 4);
    let a = run(&plain, &[2, 1], 2);
    assert!(a.iter().all(|x| x.iter().all(|h| h == &x[0])), "{a:?}");
}

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
fn a_follower_copies_a_replaced_state_and_keeps_the_plan() {
    let data = synthetic();
    let j = job(ModelKind::Mlp, &data, 24, 4);
    let mut leader = Trainer::try_new(j.clone(), data.shallow_clone()).unwrap();
    let mut follower = Trainer::try_new(j, data).unwrap();
    assert!(follower.follow(&leader).unwrap(), "a first follow copies");
    assert!(!follower.follow(&leader).unwrap(), "equal states copy nothing");
    leader.train_step(0, 1, &mut NoReduce).unwrap();
    assert!(follower.follow(&leader).unwrap(), "a step apart copies");
    assert_eq!(follower.content_hash().unwrap(), leader.content_hash().unwrap());
    let image = leader.image().unwrap();
    leader.load_image(&image).unwrap();
    assert!(follower.follow(&leader).unwrap(), "a replaced state copies");
    leader.set_epoch_plan(12, 3, 0.5).unwrap();
    follower.follow(&leader).unwrap();
    assert_eq!((follower.plan(), follower.lr_scale), (leader.plan(), 0.5));
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

/// A reduce that looks at every parameters' gather a rank starts: whether the buffer holds
/// anything but zeros outside the blocks the rank holds and the values it gives.
struct GatherSpy<'a, 'b> {
    inner: &'a mut LocalRank<'b>,
    held: Vec<usize>,
    /// Per gather of the parameters: values outside the held blocks that are not zero.
    stray: Vec<usize>,
}

impl Reduce for GatherSpy<'_, '_> {
    fn allreduce_sum(&mut self, buf: &mut [f32], step: u64) -> Result<(), TrainerError> {
        self.inner.allreduce_sum(buf, step)
    }

    fn allreduce_sum_i64(&mut self, buf: &mut [i64], step: u64) -> Result<(), TrainerError> {
        self.inner.allreduce_sum_i64(buf, step)
    }

    fn allreduce_max_i32(&mut self, vals: &mut [i32], step: u64) -> Result<(), TrainerError> {
        self.inner.allreduce_max_i32(vals, step)
    }

    fn ranks_per_host(&self) -> usize {
        self.inner.ranks_per_host()
    }

    fn reduce_scatter_sum(
        &mut self,
        buf: &mut [f32],
        blocks: &[Range<usize>],
        replicas: usize,
        step: u64,
    ) -> Result<(), TrainerError> {
        self.inner.reduce_scatter_sum(buf, blocks, replicas, step)
    }

    fn allgather_blocks(
        &mut self,
        buf: &mut [f32],
        blocks: &[Range<usize>],
        step: u64,
    ) -> Result<(), TrainerError> {
        // The global norm's gather is two values a rank; the parameters' is of the gradient.
        if blocks.iter().any(|b| b.len() > 2) {
            let stray = blocks
                .iter()
                .enumerate()
                .filter(|(b, _)| !self.held.contains(b))
                .map(|(_, r)| buf[r.clone()].iter().filter(|v| **v != 0.0).count())
                .sum();
            self.stray.push(stray);
        }
        self.inner.allgather_blocks(buf, blocks, step)
    }
}

/// What [`sharded_run`] saw: losses per step and rank, what the spy found outside the held
/// blocks per step, rank and gather, whether gradients are left per rank, each rank's
/// gathered tensors.
type ShardedRun = (Vec<Vec<u64>>, Vec<Vec<Vec<usize>>>, Vec<bool>, Vec<BTreeMap<String, RawTensor>>);

/// Ranks of `job` (each with `data`'s dataset) on `hosts`, sharded over hosts of
/// `per_host` with `replicas`, for three steps, each rank's gradients cut into buckets and
/// windows of 20 000 values: every step's losses and, per step and rank, what the spy saw
/// outside the held blocks at each parameters' gather; whether any gradient is left after
/// the last step; each rank's replicas checked bit for bit against their owners' blocks;
/// then each rank's state, gathered.
fn sharded_run(
    job: &JobSpec,
    data: fn() -> crate::data::Dataset,
    hosts: &[usize],
    (per_host, replicas): (usize, usize),
) -> ShardedRun {
    let world: usize = hosts.iter().sum();
    let mut ranks: Vec<Trainer> =
        (0..world).map(|_| Trainer::try_new(job.clone(), data()).unwrap()).collect();
    shard(&mut ranks, per_host, replicas, 1);
    let (mut losses, mut stray) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let out = on_hosts(&mut ranks, hosts, |r, t, local| {
            crate::train::overlap::set_bucket_values(20_000);
            let held = t.shard_layout().unwrap().held();
            let mut spy = GatherSpy { inner: local, held, stray: Vec::new() };
            (t.train_step(r, world, &mut spy).unwrap().loss.to_bits(), spy.stray)
        });
        losses.push(out.iter().map(|o| o.0).collect::<Vec<_>>());
        stray.push(out.into_iter().map(|o| o.1).collect::<Vec<_>>());
    }
    // A replica updates from its block's gradient as its owner does: the same moments.
    for (r, t) in ranks.iter().enumerate() {
        for &b in &t.shard_layout().unwrap().held()[1..] {
            let (mine, owners) = (t.held_shard(b).unwrap(), ranks[b].held_shard(b).unwrap());
            assert!(mine.is_some() && mine == owners, "rank {r}'s replica of block {b}");
        }
    }
    let left: Vec<bool> =
        ranks.iter().map(|t| t.grads.grads().abs().sum(tch::Kind::Float).double_value(&[]) > 0.0).collect();
    on_hosts(&mut ranks, hosts, |_, t, local| {
        crate::train::overlap::set_bucket_values(20_000);
        t.unshard(local).unwrap()
    });
    // The tensors, not the content hash: that covers the job, which differs.
    let states = ranks.iter().map(|t| t.image().unwrap().tensors().clone()).collect();
    (losses, stray, left, states)
}

/// Sharded gradients (ZeRO-2) train the bits of sharded optimizer state alone/// Sharded gradients (ZeRO-2) train the bits of sharded optimizer state alone, with the
/// reduction overlapped with backward or after it, over hosts of two devices and of one:
/// the same losses and, gathered, the same state. What a rank keeps differs: when it starts
/// gathering the parameters, its buffer outside the blocks it holds is zeros (given back),
/// where sharded optimizer state alone keeps what the ring left there; after the step, the
/// buffer's gradients are all given back.
#[test]
fn sharded_gradients_train_the_bits_of_sharded_state_and_keep_only_held_blocks() {
    use crate::train::tests::char_data;
    let chars = char_data();
    let base = job(ModelKind::Llama, &chars, 12, 2);
    // Two hosts: the threads standing for the ring between hosts sum in the order they
    // arrive, which only two operands make deterministic.
    // (Two hosts of one rank hold no replica: one would be every block.)
    for (hosts, per_host, replicas) in [(vec![2, 2], 2, 1), (vec![1, 1], 1, 0)] {
        let run = |j: &JobSpec| sharded_run(j, char_data, &hosts, (per_host, replicas));
        for after in [false, true] {
            let sharding = |gradients| Some(crate::Sharding { replicas, gradients });
            let one = JobSpec { reduce_after_backward: after, shard_state: sharding(false), ..base.clone() };
            let two = JobSpec { shard_state: sharding(true), ..one.clone() };
            let (l1, s1, left1, h1) = run(&one);
            let (l2, s2, left2, h2) = run(&two);
            let case = format!("hosts {hosts:?}, reduced after backward: {after}");
            assert_eq!(l1, l2, "{case}: losses");
            assert!(h1 == h2, "{case}: gathered state");
            assert!(h2.iter().all(|h| h == &h2[0]), "{case}: ranks differ");
            // Several windows a gather with sharded gradients, one without.
            assert!(s2.iter().flatten().all(|g| g.len() >= 3), "{case}: {s2:?}");
            assert!(s1.iter().flatten().all(|g| g.len() == 1), "{case}: {s1:?}");
            assert!(s2.iter().flatten().flatten().all(|&n| n == 0), "{case}: kept {s2:?}");
            assert!(
                s1.iter().flatten().flatten().any(|&n| n > 0),
                "{case}: nothing kept outside held blocks"
            );
            assert!(left1.iter().all(|l| *l) && left2.iter().all(|l| !*l), "{case}: {left1:?} {left2:?}");
        }
    }
    // Reproducible: the whole fixed-point sum on every rank, the same bits again.
    let exact = wide_exact_job();
    let sharding = |gradients| Some(crate::Sharding { replicas: 1, gradients });
    let run =
        |g| sharded_run(&JobSpec { shard_state: sharding(g), ..exact.clone() }, synthetic, &[2, 2], (2, 1));
    let (one, two) = (run(false), run(true));
    assert_eq!(one.0, two.0, "reproducible: losses");
    assert!(one.3 == two.3, "reproducible: gathered state");
    assert!(two.1.iter().flatten().flatten().all(|&n| n == 0), "reproducible: kept {:?}", two.1);
    assert!(two.2.iter().all(|l| !*l), "reproducible: gradients left");
}
