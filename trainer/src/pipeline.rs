//! Pipeline-stage execution: one stage of a data x pipeline layout trains its blocks on a
//! 1F1B schedule of micro-batches, exchanging activations and their gradients with its
//! neighbouring stages through a [`StageLink`], and sums gradients with the other replicas of
//! its stage through a [`Reduce`].
//!
//! A step computes the same update as unpipelined training of the same global batch:
//! every replica takes its share of the batch exactly as a data-parallel rank would, the
//! stages of a replica together compute the share's summed gradients, the replicas of a stage
//! sum them, and the stages of a replica then sum three scalars (the squared gradient norm
//! for clipping, the loss, AdaScale's statistic) so that every stage clips by the norm of the
//! whole model's gradient and reports the same loss. With dropout, stages draw their masks
//! from their own generators, so pipelined and unpipelined runs differ by the masks drawn.

use crate::{Reduce, TrainerError};
use tch::{Kind, Tensor};

/// Where this rank sits in a data x pipeline layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagePosition {
    /// This rank's stage (0 = first).
    pub stage: usize,
    /// Stages per replica.
    pub stages: usize,
    /// This rank's replica.
    pub replica: usize,
    /// Data-parallel replicas.
    pub replicas: usize,
}

impl StagePosition {
    /// Whether this is the first stage (it reads the samples).
    pub fn is_first(&self) -> bool {
        self.stage == 0
    }

    /// Whether this is the last stage (it computes the loss).
    pub fn is_last(&self) -> bool {
        self.stage + 1 == self.stages
    }

    /// The 1F1B order of forward (`true`) and backward passes over `m` micro-batches: warm-up
    /// forwards (one fewer for each later stage), then alternating one forward and one
    /// backward, then the remaining backwards. Micro-batches go through both in order.
    pub fn schedule(&self, m: usize) -> Vec<(bool, usize)> {
        let warmup = (self.stages - self.stage - 1).min(m);
        let mut out = Vec::with_capacity(2 * m);
        let (mut f, mut b) = (0, 0);
        while f < warmup {
            out.push((true, f));
            f += 1;
        }
        while f < m {
            out.push((true, f));
            f += 1;
            out.push((false, b));
            b += 1;
        }
        while b < m {
            out.push((false, b));
            b += 1;
        }
        out
    }
}

/// A received activation or gradient: values and shape.
#[derive(Clone, Debug, PartialEq)]
pub struct Activation {
    /// The dimensions.
    pub shape: Vec<i64>,
    /// Row-major f32 values.
    pub values: Vec<f32>,
}

impl Activation {
    /// Copies a tensor out.
    pub fn from_tensor(t: &Tensor) -> Result<Activation, TrainerError> {
        let t = t.detach().to_kind(Kind::Float).to_device(tch::Device::Cpu).contiguous();
        let n = t.numel();
        let mut values = vec![0f32; n];
        t.f_copy_data(&mut values, n)?;
        Ok(Activation { shape: t.size(), values })
    }

    /// The values as a tensor, checking that they fill the shape.
    pub fn to_tensor(&self) -> Result<Tensor, TrainerError> {
        let n: i64 = self.shape.iter().product();
        if self.shape.iter().any(|&d| d < 0) || n as usize != self.values.len() {
            return Err(TrainerError::reduce(format!(
                "a tensor of shape {:?} arrived with {} values",
                self.shape,
                self.values.len()
            )));
        }
        Ok(Tensor::from_slice(&self.values).view(self.shape.as_slice()))
    }
}

/// Point-to-point transfers between neighbouring stages of one replica. `step` and `micro`
/// tag every transfer so a stale or reordered one is refused.
pub trait StageLink {
    /// Sends micro-batch `micro`'s output activation to the next stage.
    fn send_activation(&mut self, step: u64, micro: usize, a: &Activation) -> Result<(), TrainerError>;
    /// Receives micro-batch `micro`'s input activation from the previous stage.
    fn recv_activation(&mut self, step: u64, micro: usize) -> Result<Activation, TrainerError>;
    /// Sends the gradient of micro-batch `micro`'s input back to the previous stage.
    fn send_gradient(&mut self, step: u64, micro: usize, g: &Activation) -> Result<(), TrainerError>;
    /// Receives the gradient of micro-batch `micro`'s output from the next stage.
    fn recv_gradient(&mut self, step: u64, micro: usize) -> Result<Activation, TrainerError>;
}

/// The link of a one-stage pipeline: there is no neighbour to talk to.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoLink;

impl StageLink for NoLink {
    fn send_activation(&mut self, _: u64, _: usize, _: &Activation) -> Result<(), TrainerError> {
        Err(TrainerError::Config("a single-stage pipeline has no next stage".into()))
    }
    fn recv_activation(&mut self, _: u64, _: usize) -> Result<Activation, TrainerError> {
        Err(TrainerError::Config("a single-stage pipeline has no previous stage".into()))
    }
    fn send_gradient(&mut self, _: u64, _: usize, _: &Activation) -> Result<(), TrainerError> {
        Err(TrainerError::Config("a single-stage pipeline has no previous stage".into()))
    }
    fn recv_gradient(&mut self, _: u64, _: usize) -> Result<Activation, TrainerError> {
        Err(TrainerError::Config("a single-stage pipeline has no next stage".into()))
    }
}

/// The two reductions a pipelined step needs.
pub struct StageReducers<'a> {
    /// Sums among the replicas of this stage (the gradient buffer).
    pub replicas: &'a mut dyn Reduce,
    /// Sums among the stages of this replica (three scalars).
    pub stages: &'a mut dyn Reduce,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_f_one_b_orders_every_micro_batch_once() {
        for stages in 1..5 {
            for m in 1..7 {
                for stage in 0..stages {
                    let pos = StagePosition { stage, stages, replica: 0, replicas: 1 };
                    let s = pos.schedule(m);
                    let fwd: Vec<usize> = s.iter().filter(|x| x.0).map(|x| x.1).collect();
                    let bwd: Vec<usize> = s.iter().filter(|x| !x.0).map(|x| x.1).collect();
                    assert_eq!(fwd, (0..m).collect::<Vec<_>>());
                    assert_eq!(bwd, (0..m).collect::<Vec<_>>());
                    // A micro-batch's backward comes after its forward, and at most
                    // `stages - stage` forwards are outstanding (1F1B's memory bound).
                    let mut open = 0usize;
                    for &(f, k) in &s {
                        if f {
                            open += 1;
                            assert!(open <= stages - stage, "{stage}/{stages} m={m}: {s:?}");
                        } else {
                            assert!(
                                s.iter().position(|&x| x == (true, k))
                                    < s.iter().position(|&x| x == (false, k))
                            );
                            open -= 1;
                        }
                    }
                }
            }
        }
        let last = StagePosition { stage: 2, stages: 3, replica: 0, replicas: 1 };
        assert_eq!(last.schedule(2), vec![(true, 0), (false, 0), (true, 1), (false, 1)]);
        let first = StagePosition { stage: 0, stages: 3, replica: 0, replicas: 1 };
        assert_eq!(
            first.schedule(3),
            vec![(true, 0), (true, 1), (true, 2), (false, 0), (false, 1), (false, 2)]
        );
    }
}
