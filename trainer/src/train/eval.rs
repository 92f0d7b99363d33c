//! Held-out evaluation: the whole split in one process (`limpet train`), or a rank's share of
//! it (`limpetd`, where each rank of the epoch evaluates its part and one allreduce sums the
//! parts, so the evaluation is done once per step across the ranks, not once per rank).

use super::{Eval, Trainer};
use crate::TrainerError;
use std::ops::Range;

/// What a share of the held-out split sums to: pass `[loss, correct, count]` through an
/// allreduce, then [`EvalSums::mean`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EvalSums {
    /// Summed per-sample loss.
    pub loss: f64,
    /// Summed right predictions (per token for sequence models).
    pub correct: f64,
    /// Samples.
    pub count: f64,
}

impl EvalSums {
    /// As an allreduce buffer.
    pub fn to_buf(self) -> [f32; 3] {
        [self.loss as f32, self.correct as f32, self.count as f32]
    }

    /// From an allreduced buffer.
    pub fn from_buf(b: [f32; 3]) -> Self {
        EvalSums { loss: b[0].into(), correct: b[1].into(), count: b[2].into() }
    }

    /// The mean loss and accuracy (none for no samples).
    pub fn mean(&self) -> Option<Eval> {
        (self.count > 0.0).then(|| Eval { loss: self.loss / self.count, accuracy: self.correct / self.count })
    }
}

impl Trainer {
    /// Loss and accuracy on the held-out split.
    pub fn evaluate(&self) -> Result<Eval, TrainerError> {
        let sums = self.evaluate_range(0..self.data.test.len())?;
        Ok(sums.mean().unwrap_or(Eval { loss: f64::NAN, accuracy: f64::NAN }))
    }

    /// The part of the held-out split that `part` is of `0..whole` (a rank's share of the
    /// global batch: parts that tile `0..whole` tile the split), summed.
    pub fn evaluate_part(&self, part: Range<usize>, whole: usize) -> Result<EvalSums, TrainerError> {
        let n = self.data.test.len();
        let whole = whole.max(1);
        let at = |i: usize| ((n as u128 * i.min(whole) as u128) / whole as u128) as usize;
        self.evaluate_range(at(part.start)..at(part.end))
    }

    fn evaluate_range(&self, range: Range<usize>) -> Result<EvalSums, TrainerError> {
        let test = &self.data.test;
        let mut sums = EvalSums::default();
        // Windows of token shards can be long: evaluate them a micro-batch at a time.
        let chunk = match test {
            crate::data::Split::Memory { .. } => 256,
            crate::data::Split::Windows(_) | crate::data::Split::Rows(_) => {
                self.job.micro_batch.clamp(1, 256)
            }
        };
        let d = self.model.device();
        tch::no_grad(|| -> Result<(), TrainerError> {
            for start in range.clone().step_by(chunk) {
                let len = chunk.min(range.end - start);
                let (x, y) = test.range(start, len)?;
                let (x, y) = (self.shaped(x).to_device(d), y.to_device(d));
                let (loss, correct) = self.model.eval_sums(&x, &y, self.job.memory_plan())?;
                sums.loss += loss;
                sums.correct += correct;
            }
            Ok(())
        })?;
        sums.count = range.len() as f64;
        Ok(sums)
    }
}
