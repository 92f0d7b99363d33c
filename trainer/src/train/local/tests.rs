//! Local ranks' training, on threads of one process (their collectives alone are tested in
//! `collective_tests.rs`).

use super::*;
use crate::train::grads::Bind;
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
        // Every host told every host's count, as an epoch tells them (hosts alike then
        // relay by host).
        .map(|(&n, &first)| {
            LocalGroup::of_host_counts(n, first, lanes, &LocalSums::default(), hosts.to_vec())
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

/// [`run`], every rank's gradients bound to its buffer as `bind` says.
fn run_bound(job: &JobSpec, hosts: &[usize], steps: usize, bind: Bind) -> Vec<Vec<String>> {
    let world: usize = hosts.iter().sum();
    let mut ranks = trainers(job, hosts);
    for t in &mut ranks {
        t.grads = crate::train::grads::GradBuffer::with_binding(t.model.params(), bind).unwrap();
    }
    let mut hashes = Vec::new();
    for _ in 0..steps {
        on_hosts(&mut ranks, hosts, |r, t, local| t.train_step(r, world, local).unwrap());
        hashes.push(ranks.iter().map(|t| t.content_hash().unwrap()).collect());
    }
    hashes
}

/// Local ranks whose gradients stay on their devices (staged, on the CPU twin) sum them
/// device to device, only the lanes' chunks crossing the host: the bits of the host-memory
/// path, with the reduction after backward and overlapped with it, over two lanes and over
/// a host whose third local rank drives none, and a model large enough for several chunks.
#[test]
fn local_ranks_summing_on_their_devices_train_the_bits_of_the_host_path() {
    let wide = JobSpec { reproducible: false, ..wide_exact_job() };
    let values = Trainer::try_new(wide.clone(), synthetic()).unwrap().buffer_len();
    assert!(cut(values, 2).len() == 2, "{values} values fill one lane");
    let staged = Bind::Staged(tch::Device::Cpu);
    for job in [wide.clone(), JobSpec { reduce_after_backward: true, ..wide.clone() }] {
        for hosts in [&[2usize, 2][..], &[2], &[3, 2]] {
            // Sums of three local ranks add in the order they reach a chunk: bits only
            // for two.
            if hosts.contains(&3) {
                let got = run_bound(&job, hosts, 2, staged);
                assert!(got.iter().all(|x| x.iter().all(|h| h == &x[0])), "{hosts:?}: ranks differ");
                continue;
            }
            let want = run_bound(&job, hosts, 3, Bind::Views);
            let got = run_bound(&job, hosts, 3, staged);
            assert_eq!(got, want, "{hosts:?}, after backward: {}", job.reduce_after_backward);
        }
    }
    // The host's sums really were on the devices: a chunk's sum tensor was made.
    let sums = LocalSums::default();
    let group = LocalGroup::with_sums(1, 0, 1, &sums);
    let on_device = Tensor::from_slice(&[1.0f32, 2.0]);
    let mut buf = [0.0f32, 0.0, 5.0];
    group.rank(0, None).allreduce_sum_on_device(&on_device, &mut buf, 0, 0).unwrap();
    assert_eq!(buf[2], 5.0);
    let chunk = sums.first(1);
    let dev: Vec<Vec<f32>> =
        lock_chunk(&chunk[0]).dev.iter().map(|t| Vec::<f32>::try_from(t).unwrap()).collect();
    assert_eq!(dev, [vec![1.0, 2.0]]);
    // Kept for the next step, and given back when asked.
    let next = LocalGroup::with_sums(1, 0, 1, &sums);
    next.rank(0, None).allreduce_sum_on_device(&on_device, &mut buf, 0, 1).unwrap();
    assert_eq!(lock_chunk(&chunk[0]).dev.len(), 1, "a sum of the same size made again");
    sums.drop_device_sums();
    assert!(lock_chunk(&chunk[0]).dev.is_empty());
}

/// Shards every rank's state over hosts of `hosts` local ranks with `replicas`, as group
/// `tag`.
fn shard(ranks: &mut [Trainer], hosts: &[usize], replicas: usize, tag: u64) {
    assert_eq!(ranks.len(), hosts.iter().sum::<usize>());
    for (r, t) in ranks.iter_mut().enumerate() {
        let n = t.buffer_len() - 3;
        t.shard_state(ShardLayout::over_host_counts(n, hosts, r, replicas).unwrap().tagged(tag)).unwrap();
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
    shard(&mut ranks, &hosts, 1, 1);
    for _ in 0..3 {
        on_hosts(&mut ranks, &hosts, |r, t, local| t.train_step(r, 4, local).unwrap());
    }
    // Each rank holds its block and the same local rank's block of the other host.
    let held: Vec<Vec<usize>> = ranks.iter().map(|t| t.shard_layout().unwrap().held()).collect();
    assert_eq!(held, vec![vec![0, 2], vec![1, 3], vec![2, 0], vec![3, 1]]);
    gathered_is_whole(&mut ranks, &hosts, &whole[2][0]);
    on_hosts(&mut ranks, &hosts, |_, t, local| t.unshard(local).unwrap());
    for (r, t) in ranks.iter().enumerate() {
        assert_eq!(t.content_hash().unwrap(), whole[2][0], "rank {r} after unsharding");
    }

    // Floats: the sharded step (reduce-scatter by hosts, overlapped with backward where the
    // model allows) ends close to whole state on the same hosts.
    let data = synthetic();
    let plain = job(ModelKind::Mlp, &data, 24, 4);
    let (mut a, mut b) = (trainers(&plain, &hosts), trainers(&plain, &hosts));
    shard(&mut a, &hosts, 1, 1);
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
    shard(&mut ranks, &hosts, 1, 1);
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
        t.regroup(r, 4, Some(target), u64::MAX, local, None).unwrap()
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

/// Hosts of unequal device counts shard too: the first two devices of each host hold the
/// blocks (a host's third owns an empty one and holds nothing), and a reproducible job trains
/// one process's bits through a kill of the host of three (its blocks' replicas are on the
/// others) and a newcomer host of three joining, re-cut both times without a gather.
#[test]
fn hosts_of_unequal_devices_shard_and_train_the_bits_of_one_process() {
    let exact = wide_exact_job();
    let whole = run(&exact, &[1], 6);
    let hosts = [2, 3, 2];
    let mut ranks = trainers(&exact, &hosts);
    shard(&mut ranks, &hosts, 1, 1);
    let held: Vec<Vec<usize>> = ranks.iter().map(|t| t.shard_layout().unwrap().held()).collect();
    // Block-holding ranks 0, 1 | 2, 3 | 5, 6; rank 4 owns an empty block. Each holds its
    // own and the same local rank's on the host before.
    assert_eq!(held, vec![vec![0, 5], vec![1, 6], vec![2, 0], vec![3, 1], vec![4], vec![5, 2], vec![6, 3]]);
    let layout = ranks[4].shard_layout().unwrap().clone();
    assert!(layout.blocks()[4].is_empty() && !layout.blocks()[3].is_empty());
    for _ in 0..2 {
        on_hosts(&mut ranks, &hosts, |r, t, local| t.train_step(r, 7, local).unwrap());
    }
    // A kill -9 of host 1 takes ranks 2, 3 and 4; host 2's first two devices hold its blocks.
    let mut survivors: Vec<Trainer> =
        ranks.drain(..).enumerate().filter(|(r, _)| !(2..5).contains(r)).map(|(_, t)| t).collect();
    let regroup = |ranks: &mut [Trainer], hosts: &[usize], tag: u64| {
        let world = hosts.iter().sum();
        on_hosts(ranks, hosts, |r, t, local| {
            let n = t.buffer_len() - 3;
            let target = ShardLayout::over_host_counts(n, hosts, r, 1).unwrap().tagged(tag);
            t.regroup(r, world, Some(target), u64::MAX, local, None).unwrap()
        })
    };
    assert_eq!(regroup(&mut survivors, &[2, 2], 2), vec![Some(2); 4]);
    for _ in 0..2 {
        on_hosts(&mut survivors, &[2, 2], |r, t, local| t.train_step(r, 4, local).unwrap());
    }
    // A host of three devices joins, holding nothing: the re-cut gives it the step's
    // parameters and position and its first two devices their blocks.
    survivors.extend(trainers(&exact, &[3]));
    let hosts = [2, 2, 3];
    assert_eq!(regroup(&mut survivors, &hosts, 3), vec![Some(4); 7]);
    assert!(survivors[6].shard_layout().unwrap().blocks()[6].is_empty());
    for _ in 0..2 {
        on_hosts(&mut survivors, &hosts, |r, t, local| t.train_step(r, 7, local).unwrap());
    }
    gathered_is_whole(&mut survivors, &hosts, &whole[5][0]);
    on_hosts(&mut survivors, &hosts, |_, t, local| t.unshard(local).unwrap());
    for (r, t) in survivors.iter().enumerate() {
        assert_eq!(t.content_hash().unwrap(), whole[5][0], "rank {r}");
    }
}

/// The whole state gathered into host memory for a checkpoint, kept by each host's first
/// rank (what `limpetd` writes a sharded job's final checkpoint from), is the state of
/// content hash `want`; every rank keeps its blocks, and a rank that kept no image gathered
/// the same all the same (asked to keep it, the next time).
fn gathered_is_whole(ranks: &mut [Trainer], hosts: &[usize], want: &str) {
    let firsts: Vec<usize> = hosts.iter().scan(0, |at, &n| Some(std::mem::replace(at, *at + n))).collect();
    let held: Vec<_> = ranks.iter().map(|t| t.shard_layout().cloned()).collect();
    let dir = tempfile::tempdir().unwrap();
    let image_file = dir.path().join("image.safetensors");
    for keep_first in [true, false] {
        let images = on_hosts(ranks, hosts, |r, t, local| {
            t.gathered_image(local, firsts.contains(&r) == keep_first).unwrap()
        });
        for (r, image) in images.iter().enumerate() {
            let hash = image.as_ref().map(|i| i.content_hash().to_string());
            let kept = firsts.contains(&r) == keep_first;
            assert_eq!(hash.as_deref(), kept.then_some(want), "rank {r}'s gathered image");
        }
        if keep_first {
            limpet_snapshot::write_image_atomic(&image_file, images[0].as_ref().unwrap()).unwrap();
        }
    }
    // Written a tensor at a time from the gathers (`Trainer::write_gathered_file`) by each
    // host's first rank, the others only gathering: the image's file, byte for byte.
    let file_of = |r: usize| dir.path().join(format!("rank-{r}.safetensors"));
    let hashes = on_hosts(ranks, hosts, |r, t, local| {
        let path = file_of(r);
        t.write_gathered_file(local, firsts.contains(&r).then_some(path.as_path()))
            .unwrap()
            .transpose()
            .unwrap()
    });
    let image_bytes = std::fs::read(&image_file).unwrap();
    for (r, hash) in hashes.iter().enumerate() {
        assert_eq!(hash.as_deref(), firsts.contains(&r).then_some(want), "rank {r}'s written file");
        assert_eq!(file_of(r).exists(), firsts.contains(&r), "rank {r}");
        if firsts.contains(&r) {
            assert!(std::fs::read(file_of(r)).unwrap() == image_bytes, "rank {r}'s file is not the image's");
        }
    }
    // A writer whose write fails (no directory to write in) still takes every gather, so
    // the group stays in step: the others return, and the ranks gather again after it.
    let nowhere = dir.path().join("no-such-directory").join("final.safetensors");
    let failed = on_hosts(ranks, hosts, |r, t, local| {
        let written = t.write_gathered_file(local, (r == 0).then_some(nowhere.as_path())).unwrap();
        written.map(|w| w.map_err(|e| e.to_string()))
    });
    assert!(matches!(&failed[0], Some(Err(e)) if e.contains("no-such-directory")), "{:?}", failed[0]);
    assert!(failed[1..].iter().all(Option::is_none), "{failed:?}");
    assert_eq!(ranks.iter().map(|t| t.shard_layout().cloned()).collect::<Vec<_>>(), held);
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

    fn host_counts(&self, world: usize) -> Vec<usize> {
        self.inner.host_counts(world)
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
    replicas: usize,
    device: bool,
) -> ShardedRun {
    let world: usize = hosts.iter().sum();
    let mut ranks: Vec<Trainer> =
        (0..world).map(|_| Trainer::try_new(job.clone(), data()).unwrap()).collect();
    if device {
        // The device path, on the CPU, as a GPU takes it: gradients of their own, copied into
        // the buffer, where they are given back between steps or a reproducible job's
        // buffers take them in turn; else views of a flat buffer staged through the host's.
        let own = job.reproducible || job.shard_state.is_some_and(|s| s.gradients);
        let bind = if own { Bind::Copied } else { Bind::Staged(tch::Device::Cpu) };
        for t in &mut ranks {
            t.grads = crate::train::grads::GradBuffer::with_binding(t.model.params(), bind).unwrap();
        }
    }
    shard(&mut ranks, hosts, replicas, 1);
    let (mut losses, mut stray) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let out = on_hosts(&mut ranks, hosts, |r, t, local| {
            crate::train::buckets::set_bucket_values(20_000);
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
    // On the device path a parameter's own gradient counts too.
    let left: Vec<bool> = ranks
        .iter()
        .map(|t| {
            t.grads.host_grads().abs().sum(tch::Kind::Float).double_value(&[]) > 0.0
                || (!t.grads.is_bound() && t.model.params().iter().any(|(_, p)| p.grad().defined()))
        })
        .collect();
    on_hosts(&mut ranks, hosts, |_, t, local| {
        crate::train::buckets::set_bucket_values(20_000);
        t.unshard(local).unwrap()
    });
    // The tensors, not the content hash: that covers the job, which differs.
    let states = ranks.iter().map(|t| t.image().unwrap().tensors().clone()).collect();
    (losses, stray, left, states)
}

/// Sharded gradients (ZeRO-2) train the bits of sharded optimizer state alone, with the
/// reduction overlapped with backward or after it, over hosts of two devices and of one:
/// the same losses and, gathered, the same state. What a rank keeps differs: when it starts
/// gathering the parameters, its buffer outside the blocks it holds is zeros (given back),
/// where sharded optimizer state alone keeps what the ring left there; after the step, the
/// buffer's gradients are all given back. On the device path (each parameter's gradient its
/// own, copied into the buffer) the same bits, and no parameter keeps a gradient after a
/// step with sharded gradients, where it does with sharded optimizer state alone.
#[test]
fn sharded_gradients_train_the_bits_of_sharded_state_and_keep_only_held_blocks() {
    use crate::train::tests::char_data;
    let chars = char_data();
    let base = job(ModelKind::Llama, &chars, 12, 2);
    // Two hosts: the threads standing for the ring between hosts sum in the order they
    // arrive, which only two operands make deterministic.
    // (Two hosts of one rank hold no replica: one would be every block.) On the device path
    // a rank's own block's squares are summed on the device, in another order than the
    // host's: the same bits unless the norm straddles a rounding of the f32 clip factor,
    // which these steps' norms do not.
    for (hosts, replicas) in [(vec![2, 2], 1), (vec![1, 1], 0)] {
        let mut on_host = Vec::new();
        for (after, device) in [(false, false), (true, false), (false, true), (true, true)] {
            let run = |j: &JobSpec| sharded_run(j, char_data, &hosts, replicas, device);
            let sharding = |gradients| Some(crate::Sharding { replicas, gradients });
            let one = JobSpec { reduce_after_backward: after, shard_state: sharding(false), ..base.clone() };
            let two = JobSpec { shard_state: sharding(true), ..one.clone() };
            let (l1, s1, left1, h1) = run(&one);
            let (l2, s2, left2, h2) = run(&two);
            let case = format!("hosts {hosts:?}, reduced after backward: {after}, device path: {device}");
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
            // The device paths (staged for sharded optimizer state, copied for sharded
            // gradients) train the bits of the host's (runs without them came first).
            match device {
                false => on_host.push(((l1, h1), (l2, h2))),
                true => assert!(
                    on_host[after as usize] == ((l1, h1), (l2, h2)),
                    "{case}: not the host path's bits"
                ),
            }
        }
    }
    // Reproducible: the whole fixed-point sum on every rank, the same bits again; also on
    // hosts of 3 and 2 devices (the third of host 0 holds no block), where a float job's
    // host sum of three ranks adds in the order they arrive.
    let exact = wide_exact_job();
    let sharding = |gradients| Some(crate::Sharding { replicas: 1, gradients });
    for hosts in [vec![2, 2], vec![3, 2]] {
        let run = |g, device| {
            sharded_run(&JobSpec { shard_state: sharding(g), ..exact.clone() }, synthetic, &hosts, 1, device)
        };
        let (one, two, on_device) = (run(false, false), run(true, false), run(true, true));
        let case = format!("reproducible, hosts {hosts:?}");
        assert_eq!(one.0, two.0, "{case}: losses");
        assert!(one.3 == two.3, "{case}: gathered state");
        assert!(two.1.iter().flatten().flatten().all(|&n| n == 0), "{case}: kept {:?}", two.1);
        assert!(two.2.iter().all(|l| !*l), "{case}: gradients left");
        assert_eq!(one.0, on_device.0, "{case}, device path: losses");
        assert!(one.3 == on_device.3, "{case}, device path: gathered state");
        assert!(on_device.2.iter().all(|l| !*l), "{case}, device path: gradients left");
    }
}
