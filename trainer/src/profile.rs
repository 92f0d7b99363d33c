//! Measures what each block of a model costs on this host, for the pipeline planner: forward
//! and backward time of one micro-batch, the optimizer step over its parameters, the bytes of
//! its output (what a stage boundary sends), of its parameters and optimizer state, and the
//! bytes it keeps for backward (counted from the architecture). Each block's costs are the
//! planner's own [`BlockCost`], times the medians over the repetitions.

use crate::data::Dataset;
use crate::job::JobSpec;
use crate::model::Model;
use crate::optim::{Kernels, Optimizer};
use crate::TrainerError;
use limpet_decide::planner::BlockCost;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The per-call part of a time measured at `n` and `k` < `n` samples (the intercept of the
/// line through both points; 0 when they do not differ).
fn intercept(at_n: f64, at_k: f64, n: usize, k: usize) -> f64 {
    if n <= k {
        return 0.0;
    }
    ((at_k * n as f64 - at_n * k as f64) / (n - k) as f64).clamp(0.0, at_n)
}

/// Waits for `device`'s queued work, so that a clock read after it counts the work (a GPU
/// runs asynchronously: without it a timing measures the launch, not the kernel).
fn synchronize(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// Median forward and backward times of block `i` on input `x` (and the output).
fn time_block(model: &Model, i: usize, x: &Tensor, reps: usize) -> Result<(f64, f64, Tensor), TrainerError> {
    let device = model.device();
    let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
    let mut y = Tensor::new();
    for r in 0..=reps {
        let inp = if x.is_floating_point() { x.detach().set_requires_grad(true) } else { x.shallow_clone() };
        synchronize(device);
        let t0 = Instant::now();
        y = model.block_forward(i, &inp, true);
        synchronize(device);
        let t1 = Instant::now();
        // The gradient a later stage would send back: any tensor of the output's shape.
        let g = y.ones_like() * 1e-3;
        (&y * &g).sum(Kind::Float).f_backward()?;
        synchronize(device);
        let t2 = Instant::now();
        if r > 0 {
            fwd.push((t1 - t0).as_secs_f64() * 1e3);
            bwd.push((t2 - t1).as_secs_f64() * 1e3);
        }
    }
    Ok((median(fwd), median(bwd), y))
}

/// Profiles every block of `job`'s model on `device` (where the host trains: a GPU host's
/// speed is its GPU's) at its micro-batch and at a quarter of it (to split each time into a
/// per-call and a per-sample part), on real samples of `data`, repeating each measurement
/// `reps` times (after one warm-up) and keeping the median.
pub fn profile_blocks(
    job: &JobSpec,
    data: &Dataset,
    reps: usize,
    device: Device,
) -> Result<Vec<BlockCost>, TrainerError> {
    job.validate(data)?;
    if matches!(job.model, crate::model::ModelSpec::Torchscript(_)) {
        return Err(TrainerError::Config(
            "a TorchScript module is one stage (its graph cannot be cut into blocks): there is no pipeline to plan".into(),
        ));
    }
    let reps = reps.max(1);
    let model = Model::build(&job.model, 0..job.model.num_blocks(), job.seed, device, job.precision)?;
    let mb = job.micro_batch.min(data.train.len()).max(1);
    let idx: Vec<i64> = (0..mb as i64).collect();
    let (x, _) = data.train.batch(&idx)?;
    let mut x = x.to_device(device);
    let slots = job.optimizer.slots().len() as u64;
    let mut out = Vec::new();
    for i in model.blocks() {
        let params = model.block_params(i);
        let small_n = (mb / 4).max(1) as i64;
        let (fwd, bwd, y) = time_block(&model, i, &x, reps)?;
        let (fwd_small, bwd_small, _) = time_block(&model, i, &x.narrow(0, 0, small_n), reps)?;
        let mut apply = Vec::new();
        let numel: i64 = params.iter().map(|(_, p)| p.numel() as i64).sum();
        let mut optim = Optimizer::new(&job.optimizer, &params);
        let grad = Tensor::full([numel.max(1)], 1e-4, (Kind::Float, tch::Device::Cpu)).narrow(0, 0, numel);
        for r in 0..=reps {
            synchronize(device);
            let t0 = Instant::now();
            optim.apply(&params, &grad, 0.0, r as u64 + 1, Kernels::for_job(job.reproducible, device))?;
            synchronize(device);
            if r > 0 {
                apply.push(t0.elapsed().as_secs_f64() * 1e3);
            }
        }
        for (_, p) in &params {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        let param_bytes = numel as u64 * 4;
        out.push(BlockCost {
            fwd_ms: fwd,
            bwd_ms: bwd,
            fixed_fwd_ms: intercept(fwd, fwd_small, mb, small_n as usize),
            fixed_bwd_ms: intercept(bwd, bwd_small, mb, small_n as usize),
            apply_ms: median(apply),
            out_bytes: y.numel() as u64 * y.kind().elt_size_in_bytes() as u64,
            saved_bytes: job.model.saved_bytes_per_sample(i) * mb as u64,
            param_bytes,
            optim_bytes: param_bytes * slots,
        });
        x = y.detach();
    }
    Ok(out)
}

/// Time a whole one-micro-batch step spends outside the blocks' forward and backward passes
/// (reading the samples, the loss, gathering gradients into the flat buffer), in ms: the
/// median of `reps` timed `compute_grads` calls minus the blocks' profiled times.
pub fn profile_step_overhead(
    job: &JobSpec,
    data: &Dataset,
    blocks: &[BlockCost],
    reps: usize,
    device: Device,
) -> Result<f64, TrainerError> {
    let mut one = job.clone();
    one.global_batch = job.micro_batch;
    let all = 0..one.model.num_blocks();
    let mut t = crate::Trainer::on_device(one, data.shallow_clone(), all, device)?;
    let mut times = Vec::new();
    for r in 0..=reps.max(1) {
        synchronize(device);
        let t0 = Instant::now();
        t.compute_grads(0, 1)?;
        synchronize(device);
        if r > 0 {
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    let inside: f64 = blocks.iter().map(|b| b.fwd_ms + b.bwd_ms).sum();
    Ok((median(times) - inside).max(0.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::DataSpec;
    use crate::ModelKind;

    #[test]
    fn every_block_is_measured() {
        let data =
            Dataset::load(&DataSpec::Synthetic { samples: 256, features: 16, classes: 4, seed: 1 }, None)
                .unwrap();
        let mut job = JobSpec::defaults_for(ModelKind::Mlp, &data).unwrap();
        job.micro_batch = 32;
        let blocks = profile_blocks(&job, &data, 3, Device::Cpu).unwrap();
        assert_eq!(blocks.len(), job.model.num_blocks());
        // 16 -> 128 -> 128 -> 4, f32, AdamW's two slots.
        assert_eq!(blocks[0].param_bytes, (16 * 128 + 128) * 4);
        assert_eq!(blocks[0].optim_bytes, 2 * blocks[0].param_bytes);
        assert_eq!(blocks[0].out_bytes, 32 * 128 * 4);
        assert_eq!(blocks[2].out_bytes, 32 * 4 * 4);
        for b in &blocks {
            assert!(b.fwd_ms > 0.0 && b.bwd_ms > 0.0 && b.apply_ms > 0.0, "{b:?}");
            assert!(b.saved_bytes > 0);
            assert!((0.0..=b.fwd_ms).contains(&b.fixed_fwd_ms), "{b:?}");
        }
        let overhead = profile_step_overhead(&job, &data, &blocks, 3, Device::Cpu).unwrap();
        assert!(overhead.is_finite() && overhead >= 0.0);
    }
}
