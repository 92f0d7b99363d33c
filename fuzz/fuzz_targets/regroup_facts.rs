//! A member of a sharded job's group feeds arbitrary facts (and arbitrary values) into
//! `Trainer::regroup`, the decoder of every rank's row of facts at an epoch change. The
//! honest rank must answer with a result, never a panic or an allocation the forged
//! world, replica count or step asks for.
#![no_main]

use libfuzzer_sys::fuzz_target;
use limpet_trainer::data::{DataSpec, Dataset};
use limpet_trainer::optim::OptimizerSpec;
use limpet_trainer::{JobSpec, ModelKind, Reduce, ShardLayout, Trainer, TrainerError};

// The hostile member, shared with the regroup's property tests.
#[path = "../../trainer/src/train/shard/hostile_reduce.rs"]
mod hostile_reduce;
use hostile_reduce::Hostile;

fuzz_target!(|data: &[u8]| {
    let (Some(&flags), Some(noise)) = (data.first(), data.get(1..5)) else { return };
    let noise = f32::from_le_bytes(noise.try_into().expect("4 bytes"));
    let row: Vec<i64> =
        data[5..].chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
    if row.is_empty() {
        return;
    }
    // libtorch takes its thread counts once per process.
    static ONE_THREAD: std::sync::Once = std::sync::Once::new();
    ONE_THREAD.call_once(|| limpet_trainer::set_threads(1));
    let spec = DataSpec::Synthetic { samples: 64, features: 8, classes: 3, seed: 1 };
    let data_set = Dataset::load(&spec, None).expect("synthetic data");
    let mut job = JobSpec::defaults_for(ModelKind::Mlp, &data_set).expect("a job");
    job.optimizer = OptimizerSpec::adamw(1e-2, 0.01);
    // A reproducible job also takes a step's fixed-point sum from a peer that says it kept one.
    job.reproducible = flags & 4 == 4;
    let mut t = Trainer::try_new(job, data_set).expect("a trainer");
    let n = t.buffer_len() - 3;
    if flags & 1 == 1 {
        t.shard_state(ShardLayout::new(n, 2, 0, 1).expect("a layout").tagged(3)).expect("sharded");
    }
    let target = (flags & 2 == 2).then(|| ShardLayout::new(n, 2, 0, 1).expect("a layout").tagged(4));
    // As a group of hosts regroups (flag 8): the peer's claims bounded by what the log gave it.
    let bounds = (flags & 8 == 8).then(|| limpet_trainer::RegroupBounds {
        hosts: vec![0, 1],
        known: if flags & 16 == 16 { vec![3] } else { Vec::new() },
        layouts: (0..2).map(|r| vec![ShardLayout::new(n, 2, r, 1).expect("a layout").tagged(3)]).collect(),
    });
    let _ = t.regroup(0, 2, target, u64::MAX, &mut Hostile { row, from: 0, noise }, bounds.as_ref());
});
