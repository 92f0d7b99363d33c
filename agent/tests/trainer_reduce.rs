//! The trainer's split step over the data plane: training with three ranks, each computing
//! its share of every global batch and summing gradients through a ring `Group`, matches
//! training alone up to float reduction order, and every rank ends bit-identical.

use limpet_agent::{DataPlaneConfig, Endpoint};
use limpet_trainer::data::{DataSpec, Dataset};
use limpet_trainer::{JobSpec, ModelKind, NoReduce, ShardLayout, Trainer};

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

    let order = [5u64, 2, 9];
    let eps: Vec<Endpoint> = order
        .iter()
        .map(|&n| {
            let cfg = DataPlaneConfig::new(1, n, b"sixteen-byte-secret!".to_vec());
            Endpoint::bind("127.0.0.1:0".parse().unwrap(), cfg).unwrap()
        })
        .collect();
    let addrs: Vec<String> = eps.iter().map(|e| e.addr().to_string()).collect();
    let results: Vec<(Vec<f64>, String)> = std::thread::scope(|s| {
        let hs: Vec<_> = eps
            .iter()
            .enumerate()
            .map(|(rank, ep)| {
                let addrs = &addrs;
                s.spawn(move || {
                    let mut g = ep.group(1, &order, addrs).unwrap();
                    let mut t = trainer();
                    let losses: Vec<f64> =
                        (0..12).map(|_| t.train_step(rank, 3, &mut g).unwrap().loss).collect();
                    (losses, t.content_hash().unwrap())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Every rank holds the same state, bit for bit.
    assert!(results.iter().all(|(_, h)| *h == results[0].1));
    // The same samples and the same update at every step: losses agree with the solo run
    // up to the order in which floats were summed.
    for (step, (a, b)) in solo_losses.iter().zip(&results[0].0).enumerate() {
        assert!((a - b).abs() <= 1e-4 * a.abs().max(1.0), "step {step}: alone {a}, three ranks {b}");
    }
}

/// An AdamW job with clipping that bites, for the sharded-state comparison.
fn adamw_trainer() -> Trainer {
    let (mut job, data) = job_and_data();
    job.optimizer = limpet_trainer::optim::OptimizerSpec::adamw(0.01, 0.1);
    job.clip_norm = Some(0.05);
    Trainer::try_new(job, data).unwrap()
}

/// Runs `steps` steps on three ranks over the ring, each rank through `run`, and returns
/// what `run` returns per rank.
fn on_three_ranks<T: Send>(run: impl Fn(usize, &mut limpet_agent::Group) -> T + Sync) -> Vec<T> {
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
                let (addrs, run) = (&addrs, &run);
                s.spawn(move || run(rank, &mut ep.group(1, &order, addrs).unwrap()))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Sharded optimizer state (each rank one third of AdamW's moments, plus its left
/// neighbour's as a replica) trains like whole state over the same ring: the same losses and
/// parameters up to the order floats are summed in, every rank's gathered state bit-identical,
/// each replica bit-identical to its owner's block, and a third of the state held per block.
#[test]
fn sharded_optimizer_state_trains_like_whole_state() {
    one_thread();
    const STEPS: usize = 8;
    let whole = on_three_ranks(|rank, g| {
        let mut t = adamw_trainer();
        let losses: Vec<f64> = (0..STEPS).map(|_| t.train_step(rank, 3, g).unwrap().loss).collect();
        (losses, t.image().unwrap())
    });
    let sharded = on_three_ranks(|rank, g| {
        let mut t = adamw_trainer();
        let n = t.buffer_len() - 3;
        t.shard_state(ShardLayout::new(n, 3, rank, 1).unwrap()).unwrap();
        // A sharded trainer has no whole state to image until it gathers it.
        assert!(t.image().unwrap_err().to_string().contains("sharded"));
        let mut losses = Vec::new();
        let mut norms = Vec::new();
        for _ in 0..STEPS {
            let s = t.train_step(rank, 3, g).unwrap();
            losses.push(s.loss);
            norms.push(s.grad_norm);
        }
        let layout = t.shard_layout().unwrap().clone();
        let own = t.held_shard(rank).unwrap().unwrap();
        let replica = t.held_shard((rank + 2) % 3).unwrap().unwrap();
        assert!(t.held_shard((rank + 1) % 3).unwrap().is_none(), "rank {rank} holds a block it should not");
        t.unshard(g).unwrap();
        (losses, norms, layout, own, replica, t.image().unwrap())
    });
    let clipped = sharded[0].1.iter().filter(|&&n| n > 0.05).count();
    assert!(clipped > 0, "no step clipped: the comparison would not cover clipping");
    for (rank, (losses, norms, layout, own, replica, image)) in sharded.iter().enumerate() {
        // Every rank agrees: the same norm at every step and the same gathered state.
        assert_eq!(norms, &sharded[0].1, "rank {rank}'s norms");
        assert_eq!(image.content_hash(), sharded[0].5.content_hash(), "rank {rank}'s state");
        // The replica of the block before this rank's is its owner's, bit for bit.
        let owner = &sharded[(rank + 2) % 3].3;
        assert_eq!(replica, owner, "rank {rank}'s replica of rank {}'s block", (rank + 2) % 3);
        // Two slots (AdamW's moments), each a third of the gradient.
        let n: usize = layout.blocks.iter().map(|b| b.len()).sum();
        assert_eq!(own.len(), 2);
        assert_eq!(own[0].len(), layout.blocks[rank].len());
        assert!(own[0].len() <= n / 3 + 16, "{} of {n}", own[0].len());
        for (step, (a, b)) in whole[rank].0.iter().zip(losses).enumerate() {
            assert!((a - b).abs() <= 1e-4 * a.abs().max(1.0), "step {step}: whole {a}, sharded {b}");
        }
    }
    // Parameters and moments close to the whole-state run's (float order only).
    let (a, b) = (&whole[0].1, &sharded[0].5);
    for (name, t) in a.tensors() {
        let (x, y) = (t.to_f32().unwrap(), b.tensors()[name].to_f32().unwrap());
        let worst = x.iter().zip(&y).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
        assert!(worst <= 1e-4, "{name}: differs by {worst}");
    }
}
