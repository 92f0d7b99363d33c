//! Forward and backward of one micro-batch with less memory: activation checkpointing (each
//! block's activations are recomputed in backward from its saved input, as
//! `torch.utils.checkpoint` does per block) and a chunked loss (the vocabulary head and the
//! cross-entropy run a chunk of positions at a time, forward and backward, so no
//! `[batch, context, vocab]` tensor exists at once).
//!
//! libtorch has no user-defined autograd functions reachable from Rust, so both are written as
//! explicit block-by-block backward passes: a block's output is given its gradient through
//! `sum(output * gradient)`, whose derivative with respect to the output is exactly that
//! gradient, and the gradient with respect to the block's input is read from the input (a
//! leaf). The arithmetic of every block's backward is libtorch's own, so checkpointing
//! changes no bit of the gradients; chunking the loss changes the order in which the head's
//! weight gradient is summed (rounding only).

use super::Model;
use crate::TrainerError;
use serde::{Deserialize, Serialize};
use tch::{Kind, Reduction, Tensor};

/// How a micro-batch's forward and backward trade compute for memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryPlan {
    /// Recompute each block's activations in backward.
    pub checkpoint: bool,
    /// Positions per chunk of the vocabulary head and loss (none: all at once).
    pub loss_chunk: Option<usize>,
}

impl MemoryPlan {
    /// True when it changes anything.
    pub fn is_active(&self) -> bool {
        self.checkpoint || self.loss_chunk.is_some()
    }
}

fn grad_of(t: &Tensor, what: &str) -> Result<Tensor, TrainerError> {
    let g = t.grad();
    if g.defined() {
        Ok(g)
    } else {
        Err(TrainerError::Config(format!("{what} received no gradient")))
    }
}

impl Model {
    /// Runs the last block (the head) and the loss on `h`, a chunk of `chunk` positions at a
    /// time, forward and backward; the summed loss and the gradient with respect to `h`.
    fn chunked_head(&self, h: &Tensor, y: &Tensor, chunk: usize) -> Result<(f64, Tensor), TrainerError> {
        let last = self.blocks.end - 1;
        let size = h.size();
        let (b, t) = (size[0], size[1]);
        let d = *size.last().expect("[batch, time, width]");
        let rows = h.detach().reshape([b * t, d]);
        let targets = y.reshape([b * t]);
        let mut grads = Vec::new();
        let mut loss = 0.0;
        let mut start = 0;
        while start < b * t {
            let n = (chunk as i64).min(b * t - start);
            let hc = rows.narrow(0, start, n).unsqueeze(0).set_requires_grad(true);
            let logits = self.block_forward(last, &hc, true);
            let v = *logits.size().last().expect("logits have a vocabulary dimension");
            let ce = logits.view([-1, v]).cross_entropy_loss::<Tensor>(
                &targets.narrow(0, start, n),
                None,
                Reduction::Sum,
                -100,
                0.0,
            ) / t as f64;
            ce.f_backward()?;
            loss += ce.double_value(&[]);
            grads.push(grad_of(&hc, "a chunk of the head's input")?.squeeze_dim(0));
            start += n;
        }
        Ok((loss, Tensor::cat(&grads, 0).view([b, t, d])))
    }

    /// One micro-batch's forward and backward under `plan`: the summed loss; the gradients
    /// accumulate into the parameters' `.grad` as [`Model::forward_loss`] followed by a
    /// backward pass would leave them.
    pub fn loss_backward(&self, x: &Tensor, y: &Tensor, plan: MemoryPlan) -> Result<f64, TrainerError> {
        let whole = self.blocks.start == 0 && self.blocks.end == self.spec.num_blocks();
        // A recomputed block must draw what its forward drew: stochastic layers would not.
        if !plan.is_active()
            || self.script.is_some()
            || !whole
            || !self.spec.is_sequence()
            || self.is_stochastic()
        {
            let (_, loss) = self.forward_loss(x, y, true)?;
            loss.f_backward()?;
            return Ok(loss.double_value(&[]));
        }
        let last = self.blocks.end - 1;
        // Forward to the head: without a graph (keeping each block's input) when
        // checkpointing, else with it.
        let mut inputs = Vec::with_capacity(last);
        let mut h = x.shallow_clone();
        for i in 0..last {
            let out = if plan.checkpoint {
                tch::no_grad(|| self.block_forward(i, &h, true))
            } else {
                self.block_forward(i, &h, true)
            };
            inputs.push(h);
            h = out;
        }
        let head_in = if plan.checkpoint { h.detach().set_requires_grad(true) } else { h.shallow_clone() };
        let (loss, mut g) = match plan.loss_chunk {
            Some(chunk) => self.chunked_head(&head_in, y, chunk.max(1))?,
            None => {
                let leaf = head_in.detach().set_requires_grad(true);
                let out = self.block_forward(last, &leaf, true);
                let loss = self.loss_sum(&out, y);
                loss.f_backward()?;
                (loss.double_value(&[]), grad_of(&leaf, "the head's input")?)
            }
        };
        if !plan.checkpoint {
            // The blocks' graph is still there: one backward from the head's input.
            (&head_in * &g).sum(Kind::Float).f_backward()?;
            return Ok(loss);
        }
        for i in (0..last).rev() {
            let input = &inputs[i];
            let leaf = if i == 0 { input.shallow_clone() } else { input.detach().set_requires_grad(true) };
            let out = self.block_forward(i, &leaf, true);
            (&out * &g).sum(Kind::Float).f_backward()?;
            if i > 0 {
                g = grad_of(&leaf, "a block's input")?;
            }
        }
        Ok(loss)
    }

    /// Whether [`Model::loss_backward_by_blocks`] can give each block's gradients as its
    /// backward ends: a whole model of native blocks (a TorchScript graph is one piece), and
    /// no recomputed block that would draw other dropout masks than its forward did.
    pub fn splits_backward(&self, plan: MemoryPlan) -> bool {
        let whole = self.blocks.start == 0 && self.blocks.end == self.spec.num_blocks();
        self.script.is_none() && whole && !(plan.checkpoint && self.is_stochastic())
    }

    /// [`Model::loss_backward`], one block at a time from the last: `done(i)` runs as soon as
    /// block `i`'s backward has ended, when every parameter of block `i` has its whole
    /// gradient for this micro-batch (a parameter is used only by its own block and later
    /// ones: the tied head reads block 0's embedding, whose gradient ends with block 0). This
    /// is what lets a step reduce a bucket of gradients while backward goes on. Each block's
    /// arithmetic is libtorch's own, so the gradients are those of one backward pass but for
    /// a tied embedding, whose two parts are added one after the other (rounding only).
    /// Needs [`Model::splits_backward`].
    pub fn loss_backward_by_blocks(
        &self,
        x: &Tensor,
        y: &Tensor,
        plan: MemoryPlan,
        done: &mut dyn FnMut(usize) -> Result<(), TrainerError>,
    ) -> Result<f64, TrainerError> {
        if !self.splits_backward(plan) {
            return Err(TrainerError::Config(
                "this model's backward cannot be split by blocks (a TorchScript module, a pipeline stage, or dropout under activation checkpointing)".into(),
            ));
        }
        let last = self.blocks.end - 1;
        if last == 0 {
            let (_, loss) = self.forward_loss(x, y, true)?;
            loss.f_backward()?;
            done(0)?;
            return Ok(loss.double_value(&[]));
        }
        // Each block runs on a leaf copy of its input, so that its backward stops there and
        // the input's gradient is read off the leaf. With checkpointing the forward keeps no
        // graph, and each block is run again just before its backward.
        let mut kept: Vec<(Tensor, Option<Tensor>)> = Vec::with_capacity(last);
        let mut h = x.shallow_clone();
        for i in 0..last {
            let leaf = if i == 0 { h } else { h.detach().set_requires_grad(true) };
            let out = if plan.checkpoint {
                tch::no_grad(|| self.block_forward(i, &leaf, true))
            } else {
                self.block_forward(i, &leaf, true)
            };
            h = out.shallow_clone();
            kept.push((leaf, (!plan.checkpoint).then_some(out)));
        }
        let head_in = h.detach().set_requires_grad(true);
        let (loss, mut g) = match plan.loss_chunk.filter(|_| self.spec.is_sequence()) {
            Some(chunk) => self.chunked_head(&head_in, y, chunk.max(1))?,
            None => {
                let out = self.block_forward(last, &head_in, true);
                let loss = self.loss_sum(&out, y);
                loss.f_backward()?;
                (loss.double_value(&[]), grad_of(&head_in, "the head's input")?)
            }
        };
        done(last)?;
        for i in (0..last).rev() {
            let (leaf, out) = &kept[i];
            let out = match out {
                Some(o) => o.shallow_clone(),
                None => self.block_forward(i, leaf, true),
            };
            (&out * &g).sum(Kind::Float).f_backward()?;
            if i > 0 {
                g = grad_of(leaf, "a block's input")?;
            }
            done(i)?;
        }
        Ok(loss)
    }

    /// The summed loss and right predictions of `x` against `y`, without gradients: the head
    /// a chunk of positions at a time when `plan` has a loss chunk (a held-out evaluation of
    /// a large vocabulary holds no `[batch, context, vocab]` tensor either).
    pub fn eval_sums(&self, x: &Tensor, y: &Tensor, plan: MemoryPlan) -> Result<(f64, f64), TrainerError> {
        let whole = self.blocks.start == 0 && self.blocks.end == self.spec.num_blocks();
        let chunk = plan.loss_chunk.filter(|_| self.script.is_none() && whole && self.spec.is_sequence());
        tch::no_grad(|| {
            let Some(chunk) = chunk else {
                let (out, l) = self.forward_loss(x, y, false)?;
                let correct = out.map_or(0.0, |o| self.correct(&o, y));
                return Ok((l.double_value(&[]), correct));
            };
            let last = self.blocks.end - 1;
            let h = (0..last).fold(x.shallow_clone(), |h, i| self.block_forward(i, &h, false));
            let size = h.size();
            let (b, t, d) = (size[0], size[1], size[2]);
            let (rows, targets) = (h.reshape([b * t, d]), y.reshape([b * t]));
            let (mut loss, mut correct) = (0.0, 0.0);
            let mut start = 0;
            while start < b * t {
                let n = (chunk.max(1) as i64).min(b * t - start);
                let logits =
                    self.block_forward(last, &rows.narrow(0, start, n).unsqueeze(0), false).squeeze_dim(0);
                let yc = targets.narrow(0, start, n);
                let ce = logits.cross_entropy_loss::<Tensor>(&yc, None, Reduction::Sum, -100, 0.0);
                loss += ce.double_value(&[]) / t as f64;
                let hits = logits.argmax(-1, false).eq_tensor(&yc).to_kind(Kind::Double).sum(Kind::Double);
                correct += hits.double_value(&[]) / t as f64;
                start += n;
            }
            Ok((loss, correct))
        })
    }
}
