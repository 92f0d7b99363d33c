//! The trainer's split step over the data plane: training with three ranks, each computing
//! its share of every global batch and summing gradients through a ring `Group`, matches
//! training alone up to float reduction order, and every rank ends bit-identical.

use limpet_agent::{DataPlaneConfig, Endpoint};
use limpet_trainer::data::{DataSpec, Dataset};
use limpet_trainer::{JobSpec, ModelKind, NoReduce, Trainer};

fn trainer() -> Trainer {
    let data = Dataset::load(&DataSpec::Synthetic { samples: 600, features: 12, classes: 4, seed: 5 }, None)
        .unwrap();
    let mut job = JobSpec::defaults_for(ModelKind::Mlp, &data).unwrap();
    job.steps = 12;
    job.schedule.warmup_steps = 2;
    Trainer::try_new(job, data).unwrap()
}

#[test]
fn three_ranks_over_the_ring_train_like_one() {
    limpet_trainer::set_threads(1);
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
