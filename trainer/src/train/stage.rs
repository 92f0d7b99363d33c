//! One step of a pipeline stage: its replica's share of the global batch in micro-batches
//! on the 1F1B schedule, activations and their gradients exchanged with the neighbouring
//! stages through a [`StageLink`], then gradients summed over the stage's replicas and the
//! norm, loss and AdaScale statistic over the replica's stages (see [`crate::pipeline`]).

use super::{check_count, StepStats, Trainer};
use crate::optim::clip_to_norm;
use crate::pipeline::{Activation, StageLink, StagePosition, StageReducers};
use crate::TrainerError;
use std::ops::Range;
use tch::{Kind, Tensor};

impl Trainer {
    /// One step of this trainer's pipeline stage at `pos`: its replica's share of the
    /// global batch in micro-batches on a 1F1B schedule, activations and their gradients
    /// through `link`, gradients summed over the stage's replicas and the norm, loss and
    /// AdaScale statistic over the replica's stages (see [`crate::pipeline`]).
    pub fn pipeline_step(
        &mut self,
        pos: StagePosition,
        link: &mut dyn StageLink,
        reduce: StageReducers<'_>,
    ) -> Result<StepStats, TrainerError> {
        self.refuse_sharded("a pipelined step")?;
        let ends = self.stage_ends(pos)?;
        let started = std::time::Instant::now();
        self.link_ms = 0.0;
        self.grads.zero(self.model.params(), self.shards_gradients())?;
        let share = self.plan.share(pos.replica, pos.replicas);
        let positions = self.cursor + share.start as u64..self.cursor + share.end as u64;
        let micros: Vec<Range<u64>> = self.plan.micro_batches(positions.clone()).collect();
        let step_seed = self.peek_step_seed();
        // Per micro-batch between its forward and backward: the stage's input (whose
        // gradient goes back) and its output (or, on the last stage, the loss).
        let mut held: Vec<Option<(Tensor, Tensor)>> = (0..micros.len()).map(|_| None).collect();
        let mut loss_sum = 0.0;
        for (forward, k) in pos.schedule(micros.len()) {
            if forward {
                let (input, out) = self.micro_forward(link, ends, step_seed, k, micros[k].clone())?;
                if ends.1 {
                    loss_sum += out.double_value(&[]);
                }
                held[k] = Some((input, out));
            } else {
                let (input, out) = held[k].take().expect("the schedule runs a forward before its backward");
                self.micro_backward(link, ends, k, &input, &out)?;
            }
        }
        self.finish_grads(loss_sum, (positions.end - positions.start) as f64, true)?;
        self.compute_ms = (started.elapsed().as_secs_f64() * 1e3 - self.link_ms).max(0.0);
        self.reduce_stage(reduce)
    }

    /// Whether this trainer's blocks are the first and the last of the model, checked
    /// against the stage position it is asked to run.
    fn stage_ends(&self, pos: StagePosition) -> Result<(bool, bool), TrainerError> {
        let blocks = self.model.blocks();
        let (first, last) = (blocks.start == 0, blocks.end == self.job.model.num_blocks());
        if pos.stage >= pos.stages
            || pos.replica >= pos.replicas
            || first != pos.is_first()
            || last != pos.is_last()
        {
            return Err(TrainerError::Config(format!(
                "blocks {blocks:?} of {} cannot be stage {} of {}",
                self.job.model.num_blocks(),
                pos.stage,
                pos.stages
            )));
        }
        Ok((first, last))
    }

    /// Micro-batch `k`'s forward through this stage: its input (the batch on the first
    /// stage, else the previous stage's activation) and its output, sent on, or on the last
    /// stage its summed loss.
    fn micro_forward(
        &mut self,
        link: &mut dyn StageLink,
        (first, last): (bool, bool),
        step_seed: u64,
        k: usize,
        mb: Range<u64>,
    ) -> Result<(Tensor, Tensor), TrainerError> {
        let step = self.step;
        self.seed_micro_batch(step_seed, mb.start, k);
        let rows = (mb.end - mb.start) as i64;
        let idx = if first || last { self.sampler.indices(mb) } else { Vec::new() };
        let input = if first {
            self.batch_on_device(&idx)?.0
        } else {
            let waiting = std::time::Instant::now();
            let a = link.recv_activation(step, k);
            self.link_ms += waiting.elapsed().as_secs_f64() * 1e3;
            let a = a?;
            // The previous stage is a peer: an activation that is not a micro-batch of this
            // size is its fault, and must not panic this trainer inside libtorch. A sequence
            // model's is exactly (samples, window, width): a longer window would make
            // attention allocate with the square of a peer's number, a shorter one would
            // reach the loss with other positions than the targets.
            let expected = self.activation_shape(rows);
            if a.shape.first() != Some(&rows)
                || a.shape.iter().any(|&d| d <= 0)
                || expected.as_ref().is_some_and(|e| e != &a.shape)
            {
                return Err(TrainerError::reduce(format!(
                    "step {step} micro-batch {k}: an activation of shape {:?} for {rows} samples{}",
                    a.shape,
                    expected.map(|e| format!(" (expected {e:?})")).unwrap_or_default()
                )));
            }
            a.to_tensor()?.to_device(self.model.device()).set_requires_grad(true)
        };
        let out = if first {
            self.model.forward_t(&input, true)
        } else {
            // Its trailing dimensions are only checked by the blocks themselves.
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.model.forward_t(&input, true)))
                .map_err(|_| {
                    TrainerError::reduce(format!(
                        "step {step} micro-batch {k}: this stage cannot take an activation of shape {:?}",
                        input.size()
                    ))
                })?
        };
        if last {
            let (_, y) = self.batch_on_device(&idx)?;
            if first {
                return Ok((input, self.model.loss_sum(&out, &y)));
            }
            // An output made from a peer's activation that does not match the targets fails
            // the step, not this trainer.
            let loss = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.model.loss_sum(&out, &y)))
                .map_err(|_| {
                    TrainerError::reduce(format!(
                        "step {step} micro-batch {k}: an output of shape {:?} from the previous stage's activation does not match targets of shape {:?}",
                        out.size(),
                        y.size()
                    ))
                })?;
            Ok((input, loss))
        } else {
            let a = Activation::from_tensor(&out)?;
            let sending = std::time::Instant::now();
            let sent = link.send_activation(step, k, &a);
            self.link_ms += sending.elapsed().as_secs_f64() * 1e3;
            sent?;
            Ok((input, out))
        }
    }

    /// Micro-batch `k`'s backward: from its loss on the last stage, else from the next
    /// stage's gradient of `out`; the gradient of `input` goes back unless this is the first.
    fn micro_backward(
        &mut self,
        link: &mut dyn StageLink,
        (first, last): (bool, bool),
        k: usize,
        input: &Tensor,
        out: &Tensor,
    ) -> Result<(), TrainerError> {
        let step = self.step;
        if last {
            out.f_backward()?;
        } else {
            let waiting = std::time::Instant::now();
            let g = link.recv_gradient(step, k);
            self.link_ms += waiting.elapsed().as_secs_f64() * 1e3;
            let g = g?.to_tensor()?.to_device(self.model.device());
            if g.size() != out.size() {
                return Err(TrainerError::reduce(format!(
                    "step {step} micro-batch {k}: gradient of shape {:?} for an output of shape {:?}",
                    g.size(),
                    out.size()
                )));
            }
            (out * &g).sum(Kind::Float).f_backward()?;
        }
        if !first {
            let g = Activation::from_tensor(&input.grad())?;
            let sending = std::time::Instant::now();
            let sent = link.send_gradient(step, k, &g);
            self.link_ms += sending.elapsed().as_secs_f64() * 1e3;
            sent?;
        }
        Ok(())
    }

    /// Sums the stage's gradients over its replicas, then the norm, loss and AdaScale
    /// statistic over the replica's stages, and applies the clipped update.
    fn reduce_stage(&mut self, reduce: StageReducers<'_>) -> Result<StepStats, TrainerError> {
        let step = self.step;
        let n = self.grads.grads_len();
        let buf = self.grads.as_mut_slice();
        reduce.replicas.allreduce_sum(buf, step)?;
        let samples = buf[n + 1];
        check_count(samples, self.plan.global_batch, "replica")?;
        let grad = &mut buf[..n];
        let inv = 1.0 / samples;
        grad.iter_mut().for_each(|g| *g *= inv);
        let stage_sq: f64 = grad.iter().map(|&g| f64::from(g) * f64::from(g)).sum();
        let mut scalars = [stage_sq as f32, buf[n], buf[n + 2]];
        reduce.stages.allreduce_sum(&mut scalars, step)?;
        let norm = f64::from(scalars[0]).sqrt();
        let grad = &mut buf[..n];
        clip_to_norm(grad, norm, self.job.clip_norm);
        let loss = f64::from(scalars[1]) / f64::from(samples);
        let g = self.grads.grads()?;
        self.apply_clipped(loss, norm, samples as usize, f64::from(scalars[2]), &g)
    }

    /// The shape of the activation a stage after the first receives for `rows` samples, where
    /// the model fixes it: a sequence model's residual stream (samples, window, width) on
    /// token data. None for the others, whose blocks check their inputs' sizes themselves.
    fn activation_shape(&self, rows: i64) -> Option<Vec<i64>> {
        let crate::data::DataInfo::Tokens { context, .. } = self.data.info else { return None };
        let width = match &self.job.model {
            crate::model::ModelSpec::Gpt { width, .. } => *width,
            crate::model::ModelSpec::Llama(l) => l.d_model,
            _ => return None,
        };
        Some(vec![rows, context as i64, width as i64])
    }
}

#[cfg(test)]
mod tests;
