//! A group of two whose other member is hostile: its row of a regroup's facts is whatever it
//! sends, and every value the state's allreduces carry from it is garbage (the regroup's
//! property tests; the including module brings `Reduce` and `TrainerError` into scope).

use super::{Reduce, TrainerError};

/// The hostile member's contribution.
pub struct Hostile {
    /// Added (wrapping, as the ring's sum does) to the facts from index `from` on, repeated.
    pub row: Vec<i64>,
    /// Which fact it starts at: past this rank's row to forge only the peer's, 0 to write
    /// over this rank's too.
    pub from: usize,
    /// Added to every value of the state's allreduces.
    pub noise: f32,
}

impl Reduce for Hostile {
    fn allreduce_sum(&mut self, buf: &mut [f32], _: u64) -> Result<(), TrainerError> {
        buf.iter_mut().for_each(|v| *v += self.noise);
        Ok(())
    }

    fn allreduce_sum_i64(&mut self, buf: &mut [i64], _: u64) -> Result<(), TrainerError> {
        let from = self.from.min(buf.len());
        for (v, r) in buf[from..].iter_mut().zip(self.row.iter().cycle()) {
            *v = v.wrapping_add(*r);
        }
        Ok(())
    }
}
