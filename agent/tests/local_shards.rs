//! Sharded optimizer state over hosts' local ranks, between hosts over the real ring: each
//! host's local ranks sum through host memory (`LocalGroup`) and the hosts reduce-scatter
//! and allgather their blocks over TCP on loopback. Two hosts of two devices train the bits
//! of one process in a reproducible job and close to whole state in floats; a host killed
//! with all its ranks loses no block, since every block's replica is on another host.

use limpet_agent::{DataPlaneConfig, Endpoint};
use limpet_trainer::data::{DataSpec, Dataset};
use limpet_trainer::optim::OptimizerSpec;
use limpet_trainer::{JobSpec, LocalGroup, LocalSums, ModelKind, NoReduce, Reduce, ShardLayout, Trainer};
use std::sync::atomic::{AtomicU64, Ordering};

/// One libtorch thread, set once per process (libtorch refuses a second setting).
fn one_thread() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| limpet_trainer::set_threads(1));
}

/// An AdamW job (clipped, so the global norm matters) over synthetic data.
fn trainer(reproducible: bool) -> Trainer {
    let data = Dataset::load(&DataSpec::Synthetic { samples: 600, features: 12, classes: 4, seed: 5 }, None)
        .unwrap();
    let mut job = JobSpec::defaults_for(ModelKind::Mlp, &data).unwrap();
    job.steps = 12;
    job.schedule.warmup_steps = 2;
    job.global_batch = 24;
    job.optimizer = OptimizerSpec::adamw(1e-2, 0.01);
    job.clip_norm = Some(0.05);
    job.reproducible = reproducible;
    Trainer::try_new(job, data).unwrap()
}

/// Endpoints of `hosts` hosts.
fn endpoints(hosts: usize) -> Vec<Endpoint> {
    (0..hosts as u64)
        .map(|n| {
            let cfg = DataPlaneConfig::new(1, n + 1, b"sixteen-byte-secret!".to_vec());
            Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap()
        })
        .collect()
}

/// Runs `f` once on every rank of hosts `eps` with `per_host` local ranks each (ranks in
/// host order), at once: local rank 0 of each host drives a ring between the hosts (a new
/// group for each call); what each returned, in rank order.
fn on_hosts<R: Send>(
    eps: &[Endpoint],
    ranks: &mut [Trainer],
    per_host: usize,
    f: impl Fn(usize, &mut Trainer, &mut (dyn Reduce + Send)) -> R + Sync,
) -> Vec<R> {
    static EPOCH: AtomicU64 = AtomicU64::new(1);
    let epoch = EPOCH.fetch_add(1, Ordering::Relaxed);
    assert_eq!(ranks.len(), eps.len() * per_host);
    let order: Vec<u64> = eps.iter().map(|e| e.config().node).collect();
    let addrs: Vec<String> = eps.iter().map(|e| e.addr().to_string()).collect();
    let groups: Vec<LocalGroup> = (0..eps.len())
        .map(|h| LocalGroup::of_hosts(per_host, h * per_host, 1, &LocalSums::default(), Some(eps.len())))
        .collect();
    let (f, order, addrs) = (&f, &order, &addrs);
    std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter_mut()
            .enumerate()
            .map(|(r, t)| {
                let (h, i) = (r / per_host, r % per_host);
                let (ep, group) = (&eps[h], &groups[h]);
                s.spawn(move || {
                    if i > 0 {
                        return f(r, t, &mut group.rank(i, None));
                    }
                    let mut ring = ep.group(epoch, order, addrs).unwrap();
                    let mut local = group.rank(0, Some(&mut ring));
                    f(r, t, &mut local)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Shards each rank's state over hosts of `per_host` ranks with one replica, as group `tag`.
fn shard(ranks: &mut [Trainer], per_host: usize, tag: u64) {
    let world = ranks.len();
    for (r, t) in ranks.iter_mut().enumerate() {
        let n = t.buffer_len() - 3;
        t.shard_state(ShardLayout::over_hosts(n, world, per_host, r, 1).unwrap().tagged(tag)).unwrap();
    }
}

/// The content hash of one process's trainer after `steps` steps.
fn alone(reproducible: bool, steps: usize) -> String {
    let mut t = trainer(reproducible);
    for _ in 0..steps {
        t.train_step(0, 1, &mut NoReduce).unwrap();
    }
    t.content_hash().unwrap()
}

#[test]
fn two_hosts_of_two_devices_with_sharded_state_train_like_whole_state() {
    one_thread();
    let eps = endpoints(2);
    // Reproducible: the bits of one process, each block's replica on the other host.
    let mut ranks: Vec<Trainer> = (0..4).map(|_| trainer(true)).collect();
    shard(&mut ranks, 2, 1);
    for _ in 0..4 {
        on_hosts(&eps, &mut ranks, 2, |r, t, red| t.train_step(r, 4, red).unwrap());
    }
    for (r, t) in ranks.iter().enumerate() {
        let held = t.shard_layout().unwrap().held();
        assert_eq!(held, vec![r, (r + 2) % 4], "rank {r}");
        // The replica is its owner's block, bit for bit.
        assert_eq!(t.held_shard(held[1]).unwrap(), ranks[held[1]].held_shard(held[1]).unwrap());
    }
    on_hosts(&eps, &mut ranks, 2, |_, t, red| t.unshard(red).unwrap());
    let want = alone(true, 4);
    assert!(ranks.iter().all(|t| t.content_hash().unwrap() == want), "sharded over local ranks differs");

    // Floats: sharded (the hosts reduce-scatter by host) against whole state, same hosts.
    let mut sharded: Vec<Trainer> = (0..4).map(|_| trainer(false)).collect();
    let mut whole: Vec<Trainer> = (0..4).map(|_| trainer(false)).collect();
    shard(&mut sharded, 2, 1);
    let mut clipped = 0;
    for step in 0..6 {
        let a = on_hosts(&eps, &mut sharded, 2, |r, t, red| t.train_step(r, 4, red).unwrap());
        let b = on_hosts(&eps, &mut whole, 2, |r, t, red| t.train_step(r, 4, red).unwrap());
        for (x, y) in a.iter().zip(&b) {
            for (what, p, q) in [("loss", x.loss, y.loss), ("norm", x.grad_norm, y.grad_norm)] {
                assert!((p - q).abs() <= 1e-5 * p.abs().max(1e-12), "step {step} {what}: {p} against {q}");
            }
            clipped += usize::from(x.grad_norm > 0.05);
        }
    }
    assert!(clipped > 0, "no step clipped: the global norm went untested");
    on_hosts(&eps, &mut sharded, 2, |_, t, red| t.unshard(red).unwrap());
    for (x, y) in sharded.iter().zip(&whole) {
        let (a, b) = (x.image().unwrap(), y.image().unwrap());
        for (name, t) in a.tensors() {
            let (p, q) = (t.to_f32().unwrap(), b.tensors()[name].to_f32().unwrap());
            for (i, (u, v)) in p.iter().zip(&q).enumerate() {
                assert!((u - v).abs() <= 1e-4 * u.abs().max(v.abs()) + 1e-9, "{name}[{i}]: {u} against {v}");
            }
        }
    }
}

#[test]
fn a_host_killed_with_its_local_ranks_loses_no_block_of_sharded_state() {
    one_thread();
    let eps = endpoints(3);
    let mut ranks: Vec<Trainer> = (0..6).map(|_| trainer(true)).collect();
    shard(&mut ranks, 2, 1);
    for _ in 0..2 {
        on_hosts(&eps, &mut ranks, 2, |r, t, red| t.train_step(r, 6, red).unwrap());
    }
    // Host 1 goes with ranks 2 and 3: the owners of blocks 2 and 3 and the replica holders
    // of blocks 0 and 1. Hosts 0 and 2 re-cut the state for four ranks from what they hold.
    let mut survivors: Vec<Trainer> =
        ranks.into_iter().enumerate().filter(|(r, _)| !(2..4).contains(r)).map(|(_, t)| t).collect();
    let eps: Vec<Endpoint> = eps.into_iter().enumerate().filter(|(h, _)| *h != 1).map(|(_, e)| e).collect();
    let rebuilt = on_hosts(&eps, &mut survivors, 2, |r, t, red| {
        let n = t.buffer_len() - 3;
        let target = ShardLayout::over_hosts(n, 4, 2, r, 1).unwrap().tagged(2);
        t.regroup(r, 4, Some(target), 2, red, None).unwrap()
    });
    assert_eq!(rebuilt, vec![Some(2); 4]);
    for _ in 0..2 {
        on_hosts(&eps, &mut survivors, 2, |r, t, red| t.train_step(r, 4, red).unwrap());
    }
    on_hosts(&eps, &mut survivors, 2, |_, t, red| t.unshard(red).unwrap());
    let want = alone(true, 4);
    for (r, t) in survivors.iter().enumerate() {
        assert_eq!(t.content_hash().unwrap(), want, "survivor {r}");
    }
}

/// Floats over three hosts of two devices on the real ring: every replica is its owner's
/// block bit for bit (the hosts' reduce-scatter forwards each host's summed blocks whole to
/// the next host, whose same devices keep them), and with the middle host dropped the
/// survivors rebuild its blocks from those replicas and train on, their replicas again their
/// owners' blocks.
#[test]
fn floats_over_three_hosts_of_two_devices_keep_every_replica_its_owners_block() {
    one_thread();
    let eps = endpoints(3);
    let mut ranks: Vec<Trainer> = (0..6).map(|_| trainer(false)).collect();
    shard(&mut ranks, 2, 1);
    let check = |ranks: &[Trainer], what: &str| {
        let w = ranks.len();
        for (r, t) in ranks.iter().enumerate() {
            let held = t.shard_layout().unwrap().held();
            assert_eq!(held, vec![r, (r + w - 2) % w], "{what}: rank {r}");
            let (mine, owners) =
                (t.held_shard(held[1]).unwrap(), ranks[held[1]].held_shard(held[1]).unwrap());
            assert!(mine.is_some() && mine == owners, "{what}: rank {r}'s replica of block {}", held[1]);
        }
    };
    for _ in 0..3 {
        on_hosts(&eps, &mut ranks, 2, |r, t, red| t.train_step(r, 6, red).unwrap());
    }
    check(&ranks, "three hosts");
    let mut survivors: Vec<Trainer> =
        ranks.into_iter().enumerate().filter(|(r, _)| !(2..4).contains(r)).map(|(_, t)| t).collect();
    let eps: Vec<Endpoint> = eps.into_iter().enumerate().filter(|(h, _)| *h != 1).map(|(_, e)| e).collect();
    let rebuilt = on_hosts(&eps, &mut survivors, 2, |r, t, red| {
        let n = t.buffer_len() - 3;
        let target = ShardLayout::over_hosts(n, 4, 2, r, 1).unwrap().tagged(2);
        t.regroup(r, 4, Some(target), 2, red, None).unwrap()
    });
    assert_eq!(rebuilt, vec![Some(3); 4]);
    for _ in 0..2 {
        on_hosts(&eps, &mut survivors, 2, |r, t, red| t.train_step(r, 4, red).unwrap());
    }
    check(&survivors, "two hosts after the third's loss");
}
