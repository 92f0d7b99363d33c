//! The trainer's split step over the data plane: training with three ranks, each computing
//! its share of every global batch and summing gradients through a ring `Group`, matches
//! training alone up to float reduction order, and every rank ends bit-identical.

use limpet_agent::{DataPlaneConfig, Endpoint};
use limpet_trainer::data::{DataSpec, Dataset};
use limpet_trainer::{JobSpec, ModelKind, NoReduce, ShardLayout, Trainer, TrainerError};

/// One libtorch thread, set once per process (libtorch refuses a second setting).
fn one_thread() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| limpet_trainer::set_threads(1));
}

fn job_and_data() -> (JobSpec, Dataset) {
    let data = Dataset::load(&DataSpec::Synthetic { samples: 600, features: 12, classes: 4, seed: 5 }, None)
        .unwrap();
    let mut job = JobSpec::defaults_for(ModelKind::Mlp, &data).unwrap();
    job.steps = 12;
    job.schedule.warmup_steps = 2;
    (job, data)
}

fn trainer() -> Trainer {
    let (job, data) = job_and_data();
    Trainer::try_new(job, data).unwrap()
}

#[test]
fn three_ranks_over_the_ring_train_like_one() {
    one_thread();
    let mut alone = trainer();
    let mut solo_losses = Vec::new();
    for _ in 0..12 {
        solo_losses.push(alone.train_step(0, 1, &mut NoReduce).unwrap().loss);
    }
    let results = three_ranks(trainer);
    // Every rank holds the same state, bit for bit.
    assert!(results.iter().all(|(_, h)| *h == results[0].1));
    // The same samples and the same update at every step: losses agree with the solo run
    // up to the order in which floats were summed.
    for (step, (a, b)) in solo_losses.iter().zip(&results[0].0).enumerate() {
        assert!((a - b).abs() <= 1e-4 * a.abs().max(1.0), "step {step}: alone {a}, three ranks {b}");
    }
}

/// `reduce_dtype = "bf16"`: the ring carries the gradients in bfloat16, and every rank still
/// holds the same state, bit for bit; the losses stay close to the f32 ring's, and the
/// states differ from it (the format did change what was summed).
#[test]
fn three_ranks_reducing_in_bf16_agree_bit_for_bit_and_train_close_to_f32() {
    one_thread();
    let f32_ring = three_ranks(trainer);
    let bf16_ring = three_ranks(|| {
        let (mut job, data) = job_and_data();
        job.reduce_dtype = limpet_trainer::ReduceDtype::Bf16;
        Trainer::try_new(job, data).unwrap()
    });
    assert!(bf16_ring.iter().all(|(_, h)| *h == bf16_ring[0].1), "the ranks of a bf16 ring diverged");
    assert_ne!(bf16_ring[0].1, f32_ring[0].1, "bf16 on the wire trained the f32 ring's bits");
    for (step, (a, b)) in f32_ring[0].0.iter().zip(&bf16_ring[0].0).enumerate() {
        assert!((a - b).abs() <= 1e-2 * a.abs().max(1.0), "step {step}: f32 ring {a}, bf16 ring {b}");
    }
}

/// Three ranks over a real ring, each training its share of 12 steps with a trainer of
/// `make`: each rank's losses and content hash.
fn three_ranks(make: impl Fn() -> Trainer + Sync) -> Vec<(Vec<f64>, String)> {
    let order = [5u64, 2, 9];
    let eps: Vec<Endpoint> = order
        .iter()
        .map(|&n| {
            let cfg = DataPlaneConfig::new(1, n, b"sixteen-byte-secret!".to_vec());
            Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap()
        })
        .collect();
    let addrs: Vec<String> = eps.iter().map(|e| e.addr().to_string()).collect();
    std::thread::scope(|s| {
        let hs: Vec<_> = eps
            .iter()
            .enumerate()
            .map(|(rank, ep)| {
                let (addrs, make) = (&addrs, &make);
                s.spawn(move || {
                    let mut g = ep.group(1, &order, addrs).unwrap();
                    let mut t = make();
                    let losses: Vec<f64> =
                        (0..12).map(|_| t.train_step(rank, 3, &mut g).unwrap().loss).collect();
                    (losses, t.content_hash().unwrap())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// An AdamW job with clipping that bites, for the sharded-state comparison.
fn adamw_trainer() -> Trainer {
    let (mut job, data) = job_and_data();
    job.optimizer = limpet_trainer::optim::OptimizerSpec::adamw(0.01, 0.1);
    job.clip_norm = Some(0.05);
    Trainer::try_new(job, data).unwrap()
}

/// [`adamw_trainer`]'s job with sharded gradients (ZeRO-2) too, held like the moments.
fn sharded_gradients_trainer() -> Trainer {
    let (mut job, data) = job_and_data();
    job.optimizer = limpet_trainer::optim::OptimizerSpec::adamw(0.01, 0.1);
    job.clip_norm = Some(0.05);
    job.shard_state = Some(limpet_trainer::Sharding { replicas: 1, gradients: true });
    Trainer::try_new(job, data).unwrap()
}

/// [`adamw_trainer`]'s job, reproducible: every rank of any world applies the same bits.
fn reproducible_adamw_trainer() -> Trainer {
    let (mut job, data) = job_and_data();
    job.optimizer = limpet_trainer::optim::OptimizerSpec::adamw(0.01, 0.1);
    job.clip_norm = Some(0.05);
    job.reproducible = true;
    Trainer::try_new(job, data).unwrap()
}

/// Endpoints for nodes `nodes`, in that order.
fn endpoints(nodes: &[u64]) -> Vec<Endpoint> {
    nodes
        .iter()
        .map(|&n| {
            let cfg = DataPlaneConfig::new(1, n, b"sixteen-byte-secret!".to_vec());
            Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap()
        })
        .collect()
}

/// Runs `run` on every rank of a group of `eps` (ring order as given) in epoch `epoch`, each
/// with its item of `state`, and returns what each returns.
fn on_ranks<S: Send, T: Send>(
    eps: &[&Endpoint],
    epoch: u64,
    state: Vec<S>,
    run: impl Fn(usize, S, &mut limpet_agent::Group) -> T + Sync,
) -> Vec<T> {
    let order: Vec<u64> = eps.iter().map(|e| e.config().node).collect();
    let addrs: Vec<String> = eps.iter().map(|e| e.addr().to_string()).collect();
    std::thread::scope(|s| {
        let hs: Vec<_> = eps
            .iter()
            .zip(state)
            .enumerate()
            .map(|(rank, (ep, st))| {
                let (order, addrs, run) = (&order, &addrs, &run);
                s.spawn(move || run(rank, st, &mut ep.group(epoch, order, addrs).unwrap()))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Every tensor of two images, close (float order only): each value within 1e-4 of its
/// size, or, for a value near zero, of a millionth of the tensor's scale. A value near zero
/// (a bias that steps have barely moved) is the difference of summands that another summing
/// order rounds apart, and how far depends on the host's kernels (on a host with AVX-512 a
/// bias of 1.9e-5 came out 4e-9 apart).
fn images_close(a: &limpet_snapshot::StateImage, b: &limpet_snapshot::StateImage) {
    assert_eq!(a.tensors().keys().collect::<Vec<_>>(), b.tensors().keys().collect::<Vec<_>>());
    for (name, t) in a.tensors() {
        let (x, y) = (t.to_f32().unwrap(), b.tensors()[name].to_f32().unwrap());
        let scale = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert_eq!(x.len(), y.len(), "{name}");
        for (i, (p, q)) in x.iter().zip(&y).enumerate() {
            let tol = 1e-4 * p.abs().max(q.abs()) + 1e-6 * scale + 1e-9;
            assert!((p - q).abs() <= tol, "{name}[{i}]: {p} against {q} (scale {scale})");
        }
    }
}

/// Every tensor of two images, close to the tensor's scale: after steps at two worlds a
/// value near zero is the difference of summands the float order rounds apart.
fn images_close_to_scale(a: &limpet_snapshot::StateImage, b: &limpet_snapshot::StateImage) {
    assert_eq!(a.tensors().keys().collect::<Vec<_>>(), b.tensors().keys().collect::<Vec<_>>());
    for (name, t) in a.tensors() {
        let (x, y) = (t.to_f32().unwrap(), b.tensors()[name].to_f32().unwrap());
        let scale = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (i, (p, q)) in x.iter().zip(&y).enumerate() {
            assert!((p - q).abs() <= 1e-4 * scale + 1e-9, "{name}[{i}]: {p} against {q} (scale {scale})");
        }
    }
}

/// Sharded optimizer state (each rank one third of AdamW's moments, plus its left
/// neighbour's as a replica) trains like whole state over the same ring: the same losses,
/// norms, parameters and moments up to the order floats are summed in, every rank's gathered
/// state bit-identical, each replica bit-identical to its owner's block, a third of the state
/// held per block.
#[test]
fn sharded_optimizer_state_trains_like_whole_state() {
    one_thread();
    const STEPS: usize = 8;
    let eps = endpoints(&[5, 2, 9]);
    let group: Vec<&Endpoint> = eps.iter().collect();
    let whole = on_ranks(&group, 1, vec![(); 3], |rank, (), g| {
        let mut t = adamw_trainer();
        let stats: Vec<_> = (0..STEPS).map(|_| t.train_step(rank, 3, g).unwrap()).collect();
        (stats, t.image().unwrap())
    });
    let sharded = on_ranks(&group, 2, vec![(); 3], |rank, (), g| {
        let mut t = adamw_trainer();
        let n = t.buffer_len() - 3;
        t.shard_state(ShardLayout::new(n, 3, rank, 1).unwrap()).unwrap();
        // A sharded trainer has no whole state to image until it gathers it.
        assert!(t.image().unwrap_err().to_string().contains("sharded"));
        let stats: Vec<_> = (0..STEPS).map(|_| t.train_step(rank, 3, g).unwrap()).collect();
        let layout = t.shard_layout().unwrap().clone();
        let own = t.held_shard(rank).unwrap().unwrap();
        let replica = t.held_shard((rank + 2) % 3).unwrap().unwrap();
        assert!(t.held_shard((rank + 1) % 3).unwrap().is_none(), "rank {rank} holds a block it should not");
        t.unshard(g).unwrap();
        (stats, layout, own, replica, t.image().unwrap())
    });
    let clipped = sharded[0].0.iter().filter(|s| s.grad_norm > 0.05).count();
    assert!(clipped > 0, "no step clipped: the comparison would not cover clipping");
    for (rank, (stats, layout, own, replica, image)) in sharded.iter().enumerate() {
        assert_eq!(image.content_hash(), sharded[0].4.content_hash(), "rank {rank}'s state");
        // The replica of the block before this rank's is its owner's, bit for bit.
        let owner = &sharded[(rank + 2) % 3].2;
        assert_eq!(replica, owner, "rank {rank}'s replica of rank {}'s block", (rank + 2) % 3);
        // Two slots (AdamW's moments), each a third of the gradient.
        let n: usize = layout.blocks().iter().map(|b| b.len()).sum();
        assert_eq!(own.len(), 2);
        assert_eq!(own[0].len(), layout.blocks()[rank].len());
        assert!(own[0].len() <= n / 3 + 16, "{} of {n}", own[0].len());
        for (step, (a, b)) in whole[rank].0.iter().zip(stats).enumerate() {
            for (what, x, y) in
                [("loss", a.loss, b.loss), ("norm", a.grad_norm, b.grad_norm), ("lr", a.lr, b.lr)]
            {
                assert!(
                    (x - y).abs() <= 1e-5 * x.abs().max(1e-12),
                    "step {step} {what}: whole {x}, sharded {y}"
                );
            }
        }
    }
    images_close(&whole[0].1, &sharded[0].4);

    // Sharded gradients too (ZeRO-2): the same sums and updates, so the bits of sharded
    // optimizer state alone, every step and every tensor.
    let zero2 = on_ranks(&group, 3, vec![(); 3], |rank, (), g| {
        let mut t = sharded_gradients_trainer();
        let n = t.buffer_len() - 3;
        t.shard_state(ShardLayout::new(n, 3, rank, 1).unwrap()).unwrap();
        let stats: Vec<_> = (0..STEPS).map(|_| t.train_step(rank, 3, g).unwrap()).collect();
        t.unshard(g).unwrap();
        (stats, t.image().unwrap())
    });
    for (rank, (stats, image)) in zero2.iter().enumerate() {
        let bits = |s: &[limpet_trainer::StepStats]| -> Vec<[u64; 3]> {
            s.iter().map(|s| [s.loss.to_bits(), s.grad_norm.to_bits(), s.lr.to_bits()]).collect()
        };
        assert_eq!(bits(stats), bits(&sharded[rank].0), "rank {rank}'s steps");
        assert!(image.tensors() == sharded[rank].4.tensors(), "rank {rank}'s tensors");
    }
}

/// A rank killed with sharded state loses nothing: its block is rebuilt from its replica on
/// a survivor, the survivors re-cut the state for two and train on, and the result matches
/// whole-state training through the same change of world. With both holders of a block gone,
/// the re-cut refuses and names the checkpoint.
#[test]
fn a_killed_ranks_shard_is_rebuilt_from_its_replica() {
    one_thread();
    const STEPS: usize = 4;
    let eps = endpoints(&[5, 2, 9]);
    let (three, two): (Vec<&Endpoint>, Vec<&Endpoint>) = (eps.iter().collect(), vec![&eps[0], &eps[2]]);
    // Whole state: three ranks, then the two survivors.
    let whole = on_ranks(&three, 1, vec![(); 3], |rank, (), g| {
        let mut t = adamw_trainer();
        for _ in 0..STEPS {
            t.train_step(rank, 3, g).unwrap();
        }
        t
    });
    let survivors: Vec<Trainer> =
        whole.into_iter().enumerate().filter(|(r, _)| *r != 1).map(|(_, t)| t).collect();
    let whole = on_ranks(&two, 2, survivors, |rank, mut t, g| {
        for _ in 0..STEPS {
            t.train_step(rank, 2, g).unwrap();
        }
        t.image().unwrap()
    });
    // Sharded: the same, with rank 1 (node 2) gone after the first steps.
    let sharded = on_ranks(&three, 3, vec![(); 3], |rank, (), g| {
        let mut t = adamw_trainer();
        let n = t.buffer_len() - 3;
        t.shard_state(ShardLayout::new(n, 3, rank, 1).unwrap()).unwrap();
        for _ in 0..STEPS {
            t.train_step(rank, 3, g).unwrap();
        }
        t
    });
    let survivors: Vec<Trainer> =
        sharded.into_iter().enumerate().filter(|(r, _)| *r != 1).map(|(_, t)| t).collect();
    let sharded = on_ranks(&two, 4, survivors, |rank, mut t, g| {
        let n = t.buffer_len() - 3;
        let rebuilt =
            t.regroup(rank, 2, Some(ShardLayout::new(n, 2, rank, 1).unwrap()), u64::MAX, g, None).unwrap();
        assert_eq!(rebuilt, Some(STEPS as u64));
        // Both survivors hold the step's parameters and keep everything in a world of two:
        // only AdamW's two moments of the block each lacked move, to it alone.
        let lacked = ShardLayout::new(n, 3, 0, 1).unwrap().blocks()[if rank == 0 { 1 } else { 0 }].len();
        assert_eq!(t.regroup_values(), 2 * lacked as u64, "rank {rank}");
        for _ in 0..STEPS {
            t.train_step(rank, 2, g).unwrap();
        }
        t.unshard(g).unwrap();
        t.image().unwrap()
    });
    assert_eq!(sharded[0].content_hash(), sharded[1].content_hash());
    images_close(&whole[0], &sharded[0]);

    // Ranks 1 and 2 both gone: block 1 (held by ranks 1 and 2) has no live holder.
    let lone = on_ranks(&[&eps[0]], 5, vec![()], |_, (), g| {
        let mut t = adamw_trainer();
        let n = t.buffer_len() - 3;
        t.shard_state(ShardLayout::new(n, 3, 0, 1).unwrap()).unwrap();
        let e = t.regroup(0, 1, Some(ShardLayout::new(n, 1, 0, 0).unwrap()), u64::MAX, g, None).unwrap_err();
        assert!(matches!(e, limpet_trainer::TrainerError::ShardLost(_)), "{e}");
        (e.to_string(), ShardLayout::new(n, 3, 0, 1).unwrap().blocks()[1].clone())
    });
    let (e, block) = &lone[0];
    assert!(e.contains(&format!("no live rank holds values {block:?}")), "{e}");
}

/// The ring, but on one rank a collective of step `at` fails after this rank took part in
/// it (its peers finish it): what a kill in the middle of a step leaves behind. Which one:
/// the norm's allgather of a float sharded step, or the i64 sum of a reproducible one.
struct FailNorm<'a> {
    g: &'a mut limpet_agent::Group,
    at: u64,
    sum: bool,
}

impl limpet_trainer::Reduce for FailNorm<'_> {
    fn allreduce_sum(&mut self, buf: &mut [f32], step: u64) -> Result<(), TrainerError> {
        limpet_trainer::Reduce::allreduce_sum(&mut *self.g, buf, step)
    }
    fn allreduce_sum_i64(&mut self, buf: &mut [i64], step: u64) -> Result<(), TrainerError> {
        limpet_trainer::Reduce::allreduce_sum_i64(&mut *self.g, buf, step)?;
        if self.sum && step == self.at {
            return Err(TrainerError::reduce("injected: the step's sum broke here"));
        }
        Ok(())
    }
    fn reduce_scatter_sum(
        &mut self,
        buf: &mut [f32],
        blocks: &[std::ops::Range<usize>],
        replicas: usize,
        step: u64,
    ) -> Result<(), TrainerError> {
        limpet_trainer::Reduce::reduce_scatter_sum(&mut *self.g, buf, blocks, replicas, step)
    }
    fn allgather_blocks(
        &mut self,
        buf: &mut [f32],
        blocks: &[std::ops::Range<usize>],
        step: u64,
    ) -> Result<(), TrainerError> {
        limpet_trainer::Reduce::allgather_blocks(&mut *self.g, buf, blocks, step)?;
        if !self.sum && step == self.at && buf.len() == 2 * blocks.len() {
            return Err(TrainerError::reduce("injected: the norm's allgather broke here"));
        }
        Ok(())
    }
}

/// A re-cut that broke on some ranks leaves the survivors with two layouts: a rank that
/// finished it holds the new one, a rank whose last allreduce broke the one before. The
/// next regroup takes each value from the newest layout's holders where one is alive, else
/// from the older layout's, and ends bit for bit where survivors of one layout would.
#[test]
fn after_a_broken_recut_the_older_layout_gives_what_the_newer_lost() {
    one_thread();
    const STEPS: usize = 3;
    let eps = endpoints(&[11, 12, 13]);
    let (three, two): (Vec<&Endpoint>, Vec<&Endpoint>) = (eps.iter().collect(), vec![&eps[0], &eps[1]]);
    let trained = |epoch: u64, recut: bool| {
        on_ranks(&three, epoch, vec![(); 3], move |rank, (), g| {
            let mut t = adamw_trainer();
            let n = t.buffer_len() - 3;
            t.shard_state(ShardLayout::new(n, 3, rank, 1).unwrap().tagged(1)).unwrap();
            for _ in 0..STEPS {
                t.train_step(rank, 3, g).unwrap();
            }
            if recut {
                let next = ShardLayout::new(n, 3, rank, 1).unwrap().tagged(2);
                assert_eq!(t.regroup(rank, 3, Some(next), u64::MAX, g, None).unwrap(), Some(STEPS as u64));
            }
            t
        })
    };
    // The same training twice (the ring sums in one order, so bit for bit): rank 0 from the
    // run whose re-cut finished (layout 2), rank 1 from the one without it (layout 1);
    // rank 2, the only other holder of layout 2's block 1, is gone.
    let mut done = trained(1, true);
    let mut broken = trained(2, false);
    let mixed = vec![done.swap_remove(0), broken.swap_remove(1)];
    let plain: Vec<Trainer> = trained(3, false).into_iter().take(2).collect();
    let survive = |epoch: u64, starts: Vec<Trainer>| {
        on_ranks(&two, epoch, starts, |rank, mut t, g| {
            let n = t.buffer_len() - 3;
            let next = ShardLayout::new(n, 2, rank, 1).unwrap().tagged(9);
            assert_eq!(t.regroup(rank, 2, Some(next), u64::MAX, g, None).unwrap(), Some(STEPS as u64));
            t.train_step(rank, 2, g).unwrap();
            t.unshard(g).unwrap();
            t.image().unwrap()
        })
    };
    let (mixed, plain) = (survive(4, mixed), survive(5, plain));
    assert_eq!(mixed[0].content_hash(), plain[0].content_hash());
    assert_eq!(mixed[1].content_hash(), plain[0].content_hash());
}

/// A newcomer joins sharded survivors: the re-cut gives it its blocks, the parameters and
/// the step's position in the data, no rank holds the whole optimizer state, and the three go
/// on as whole-state training with the newcomer copied the state would.
#[test]
fn a_newcomer_takes_its_blocks_the_parameters_and_the_position_at_the_recut() {
    one_thread();
    const STEPS: usize = 3;
    let eps = endpoints(&[4, 6, 7]);
    let (two, three): (Vec<&Endpoint>, Vec<&Endpoint>) = (vec![&eps[0], &eps[1]], eps.iter().collect());
    let first = |sharded: bool| {
        move |rank: usize, (): (), g: &mut limpet_agent::Group| {
            let mut t = adamw_trainer();
            if sharded {
                let n = t.buffer_len() - 3;
                t.shard_state(ShardLayout::new(n, 2, rank, 1).unwrap()).unwrap();
            }
            for _ in 0..STEPS {
                t.train_step(rank, 2, g).unwrap();
            }
            t
        }
    };
    // Whole state: the newcomer loads a survivor's image, as the entry copies it.
    let whole = on_ranks(&two, 1, vec![(); 2], first(false));
    let mut newcomer = adamw_trainer();
    newcomer.load_image(&whole[0].image().unwrap()).unwrap();
    let starts: Vec<Trainer> = whole.into_iter().chain([newcomer]).collect();
    let whole = on_ranks(&three, 2, starts, |rank, mut t, g| {
        for _ in 0..STEPS {
            t.train_step(rank, 3, g).unwrap();
        }
        t.image().unwrap()
    });
    // Sharded: the newcomer is a trainer at step 0.
    let starts: Vec<Trainer> =
        on_ranks(&two, 3, vec![(); 2], first(true)).into_iter().chain([adamw_trainer()]).collect();
    let sharded = on_ranks(&three, 4, starts, |rank, mut t, g| {
        let n = t.buffer_len() - 3;
        let rebuilt =
            t.regroup(rank, 3, Some(ShardLayout::new(n, 3, rank, 1).unwrap()), u64::MAX, g, None).unwrap();
        assert_eq!((rebuilt, t.step()), (Some(STEPS as u64), STEPS as u64), "rank {rank}");
        assert_eq!(t.shard_layout().map(|l| l.held()), Some(vec![rank, (rank + 2) % 3]), "rank {rank}");
        // The survivors held everything and take nothing; the newcomer takes the moments of
        // its two blocks and the parameters.
        let blocks = ShardLayout::new(n, 3, 2, 1).unwrap();
        let its = blocks.held().iter().map(|&b| blocks.blocks()[b].len()).sum::<usize>();
        let want = if rank == 2 { 2 * its + n } else { 0 };
        assert_eq!(t.regroup_values(), want as u64, "rank {rank}");
        for _ in 0..STEPS {
            t.train_step(rank, 3, g).unwrap();
        }
        t.unshard(g).unwrap();
        t.image().unwrap()
    });
    for img in &sharded[1..] {
        assert_eq!(img.content_hash(), sharded[0].content_hash());
    }
    assert_eq!(sharded[2].meta().cursor, whole[2].meta().cursor);
    images_close_to_scale(&whole[2], &sharded[2]);
}

/// A step torn by a failure: rank 0 gathered the norm and updated its blocks, then its
/// parameters' allgather broke; rank 1's norm allgather broke, so it has the step's
/// gradient but never applied it. Both count the step (rank 1 finishing it with rank 0's
/// norm as the group regroups), log it, and the run then equals one without the failure,
/// value for value.
#[test]
fn a_step_torn_between_the_norm_and_the_parameters_is_finished_at_the_regroup() {
    one_thread();
    const STEPS: u64 = 6;
    const TORN: u64 = 3;
    let eps: Vec<Endpoint> = [3u64, 8]
        .iter()
        .map(|&n| {
            let mut cfg = DataPlaneConfig::new(1, n, b"sixteen-byte-secret!".to_vec());
            cfg.timeout = std::time::Duration::from_secs(2);
            Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap()
        })
        .collect();
    let two: Vec<&Endpoint> = eps.iter().collect();
    let sharded = |rank: usize| {
        let mut t = adamw_trainer();
        let n = t.buffer_len() - 3;
        t.shard_state(ShardLayout::new(n, 2, rank, 1).unwrap()).unwrap();
        t
    };
    let reference = on_ranks(&two, 1, vec![(); 2], |rank, (), g| {
        let mut t = sharded(rank);
        for _ in 0..STEPS {
            t.train_step(rank, 2, g).unwrap();
        }
        t.unshard(g).unwrap();
        t.image().unwrap()
    });
    let torn = on_ranks(&two, 2, vec![(); 2], |rank, (), g| {
        let mut t = sharded(rank);
        for _ in 0..TORN {
            t.train_step(rank, 2, g).unwrap();
        }
        let r = if rank == 1 {
            t.train_step(rank, 2, &mut FailNorm { g, at: TORN, sum: false })
        } else {
            t.train_step(rank, 2, g)
        };
        assert!(r.is_err(), "rank {rank}: the torn step succeeded");
        t
    });
    // Rank 0 applied the step to its blocks (and logs it); rank 1 did not, yet.
    assert_eq!((torn[0].step(), torn[1].step()), (TORN + 1, TORN));
    let finished = on_ranks(&two, 3, torn, |rank, mut t, g| {
        let n = t.buffer_len() - 3;
        let rebuilt =
            t.regroup(rank, 2, Some(ShardLayout::new(n, 2, rank, 1).unwrap()), u64::MAX, g, None).unwrap();
        assert_eq!(rebuilt, Some(TORN + 1));
        // Both hold every block (a world of two) and take no moments. Rank 1, finishing
        // the step, lacks the other blocks' parameters: rank 0 gives them all (ranks that
        // hold the same values, the lower gives).
        assert_eq!(t.regroup_values(), if rank == 1 { n as u64 } else { 0 }, "rank {rank}");
        let logged = t.take_unlogged().map(|s| s.step);
        while t.step() < STEPS {
            t.train_step(rank, 2, g).unwrap();
        }
        t.unshard(g).unwrap();
        (logged, t.image().unwrap())
    });
    for (rank, (logged, image)) in finished.iter().enumerate() {
        assert_eq!(*logged, Some(TORN), "rank {rank} does not log the torn step");
        for (name, t) in reference[0].tensors() {
            let (x, y) = (t.to_f32().unwrap(), image.tensors()[name].to_f32().unwrap());
            assert!(x == y, "rank {rank}: {name} differs from the run without the failure");
        }
    }
}

/// A reproducible job with sharded state trains the bits of one process training alone,
/// whatever the world: three ranks shard the state; one is killed after four steps and a
/// newcomer (holding nothing) joins the two survivors, who re-cut the state for three; the
/// exponents the next step predicts come with the re-cut. Every step's loss and the final
/// state (parameters, moments, position, exponents) are the lone process's, bit for bit.
#[test]
fn a_reproducible_job_with_sharded_state_trains_the_bits_of_one_process() {
    one_thread();
    const STEPS: usize = 4;
    let repro = reproducible_adamw_trainer;
    let mut alone = repro();
    let solo: Vec<u64> =
        (0..2 * STEPS).map(|_| alone.train_step(0, 1, &mut NoReduce).unwrap().loss.to_bits()).collect();
    let eps = endpoints(&[5, 2, 9, 7]);
    let first = on_ranks(&[&eps[0], &eps[1], &eps[2]], 1, vec![(); 3], |rank, (), g| {
        let mut t = repro();
        let n = t.buffer_len() - 3;
        t.shard_state(ShardLayout::new(n, 3, rank, 1).unwrap()).unwrap();
        let losses: Vec<u64> = (0..STEPS).map(|_| t.train_step(rank, 3, g).unwrap().loss.to_bits()).collect();
        (t, losses)
    });
    for (rank, (_, losses)) in first.iter().enumerate() {
        assert_eq!(losses[..], solo[..STEPS], "rank {rank}'s losses");
    }
    // Node 2 is killed; node 7 joins with nothing.
    let mut state: Vec<Option<Trainer>> =
        first.into_iter().enumerate().filter(|(r, _)| *r != 1).map(|(_, (t, _))| Some(t)).collect();
    state.push(None);
    let after = on_ranks(&[&eps[0], &eps[2], &eps[3]], 2, state, |rank, t, g| {
        let mut t = t.unwrap_or_else(repro);
        let n = t.buffer_len() - 3;
        let rebuilt =
            t.regroup(rank, 3, Some(ShardLayout::new(n, 3, rank, 1).unwrap()), u64::MAX, g, None).unwrap();
        assert_eq!(rebuilt, Some(STEPS as u64));
        let losses: Vec<u64> = (0..STEPS).map(|_| t.train_step(rank, 3, g).unwrap().loss.to_bits()).collect();
        t.unshard(g).unwrap();
        (losses, t.image().unwrap())
    });
    let want = alone.image().unwrap();
    for (rank, (losses, image)) in after.iter().enumerate() {
        assert_eq!(losses[..], solo[STEPS..], "rank {rank}'s losses after the re-cut");
        assert_eq!(image.content_hash(), want.content_hash(), "rank {rank}'s state");
    }
}

/// A kill while a reproducible step's sum is still being gathered: two ranks have the
/// whole sum and update their blocks, the third does not (its sum broke), and the kill takes
/// one that updated, the only other holder of one of the third's blocks at the new step.
/// The regroup finishes the step on the third from a survivor's sum instead of losing the
/// block, and the run ends with one process's losses and state, bit for bit.
#[test]
fn a_reproducible_step_torn_in_its_sum_is_finished_from_a_peers_sum() {
    one_thread();
    const STEPS: u64 = 8;
    const TORN: u64 = 3;
    let repro = reproducible_adamw_trainer;
    let mut alone = repro();
    let solo: Vec<u64> =
        (0..STEPS).map(|_| alone.train_step(0, 1, &mut NoReduce).unwrap().loss.to_bits()).collect();
    let eps = endpoints(&[5, 2, 9, 7]);
    let torn = on_ranks(&[&eps[0], &eps[1], &eps[2]], 1, vec![(); 3], |rank, (), g| {
        let mut t = repro();
        let n = t.buffer_len() - 3;
        t.shard_state(ShardLayout::new(n, 3, rank, 1).unwrap()).unwrap();
        for _ in 0..TORN {
            t.train_step(rank, 3, g).unwrap();
        }
        let r = t.train_step(rank, 3, &mut FailNorm { g, at: TORN, sum: rank == 2 });
        assert!(r.is_err(), "rank {rank}: the torn step succeeded");
        t
    });
    let steps: Vec<u64> = torn.iter().map(|t| t.step()).collect();
    assert_eq!(steps, [TORN + 1, TORN + 1, TORN], "ranks 0 and 1 updated their blocks, rank 2 did not");
    // Rank 0 (holding blocks 0 and 2) is killed: block 2 of step TORN + 1 is then on no live
    // rank, but rank 2 holds it at TORN and rank 1 kept the step's sum. Node 7 joins.
    let mut state: Vec<Option<Trainer>> = torn.into_iter().skip(1).map(Some).collect();
    state.push(None);
    let after = on_ranks(&[&eps[1], &eps[2], &eps[3]], 2, state, |rank, t, g| {
        let mut t = t.unwrap_or_else(repro);
        let n = t.buffer_len() - 3;
        let rebuilt =
            t.regroup(rank, 3, Some(ShardLayout::new(n, 3, rank, 1).unwrap()), u64::MAX, g, None).unwrap();
        assert_eq!(rebuilt, Some(TORN + 1), "rank {rank}");
        let logged = t.take_unlogged().map(|s| (s.step, s.loss.to_bits()));
        let mut losses = Vec::new();
        while t.step() < STEPS {
            losses.push(t.train_step(rank, 3, g).unwrap().loss.to_bits());
        }
        t.unshard(g).unwrap();
        (logged, losses, t.image().unwrap())
    });
    let want = alone.image().unwrap();
    for (rank, (logged, losses, image)) in after.iter().enumerate() {
        // The ranks that applied the step (rank 0 here was rank 1) and the one that finished
        // it (rank 1, was 2) log it with its loss; the newcomer never took it.
        let expect = (rank < 2).then_some((TORN, solo[TORN as usize]));
        assert_eq!(*logged, expect, "rank {rank}'s log of the torn step");
        assert_eq!(losses[..], solo[TORN as usize + 1..], "rank {rank}'s losses after the regroup");
        assert_eq!(image.content_hash(), want.content_hash(), "rank {rank}'s state");
    }
}

/// A sharded job's checkpoint written as parts, one per rank (`Trainer::checkpoint_part`):
/// the parts join into the whole state bit for bit (the exponents of a reproducible job too),
/// each names the content hash that state has without any rank holding it, the bytes are
/// split near-evenly, and each rank trains on sharded afterwards.
#[test]
fn a_sharded_checkpoint_is_written_as_parts_that_join_into_the_whole_state() {
    one_thread();
    const STEPS: usize = 3;
    let repro = || {
        let (mut job, data) = job_and_data();
        job.optimizer = limpet_trainer::optim::OptimizerSpec::adamw(0.01, 0.1);
        job.reproducible = true;
        Trainer::try_new(job, data).unwrap()
    };
    let mut alone = repro();
    for _ in 0..STEPS {
        alone.train_step(0, 1, &mut NoReduce).unwrap();
    }
    let want = alone.image().unwrap();
    let eps = endpoints(&[5, 2, 9]);
    let out = on_ranks(&[&eps[0], &eps[1], &eps[2]], 1, vec![(); 3], |rank, (), g| {
        let mut t = repro();
        let n = t.buffer_len() - 3;
        t.shard_state(ShardLayout::new(n, 3, rank, 1).unwrap()).unwrap();
        for _ in 0..STEPS {
            t.train_step(rank, 3, g).unwrap();
        }
        let part = t.checkpoint_part(g).unwrap();
        assert!(t.shard_layout().is_some(), "the state stays sharded");
        t.train_step(rank, 3, g).unwrap();
        part
    });
    let total: usize = want.tensors().values().map(|t| t.data().len()).sum();
    let largest = want.tensors().values().map(|t| t.data().len()).max().unwrap();
    for (rank, part) in out.iter().enumerate() {
        assert_eq!((part.index, part.parts), (rank, 3));
        assert_eq!(part.whole_hash, want.content_hash(), "rank {rank}'s part names another state");
        let bytes: usize = part.image.tensors().values().map(|t| t.data().len()).sum();
        assert!(bytes <= total / 3 + largest, "rank {rank} writes {bytes} of {total} bytes");
    }
    let parts: Vec<_> = out.into_iter().map(|p| p.image).collect();
    let joined = limpet_snapshot::shards::join(parts.clone(), |i| format!("part {i}")).unwrap();
    assert_eq!(joined, want, "the parts join into one process's state");
    assert!(
        want.tensors().contains_key("exact/exponents")
            && want.tensors().keys().any(|n| n.starts_with("optim/"))
    );
    // Two parts alone are no checkpoint.
    assert!(limpet_snapshot::shards::join(parts[..2].to_vec(), |i| format!("part {i}")).is_err());
}
