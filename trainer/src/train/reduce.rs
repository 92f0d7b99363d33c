//! The collectives a trainer needs from its ranks, and the identity of a single-process run.

use crate::TrainerError;
use std::ops::Range;

/// Sums gradient buffers across ranks, in place. Implementations must leave every rank with
/// the same bytes.
pub trait Reduce {
    /// Replaces `buf` with the elementwise sum of every rank's `buf` for `step`.
    fn allreduce_sum(&mut self, buf: &mut [f32], step: u64) -> Result<(), TrainerError>;

    /// The same as exact integers (a reproducible job's fixed-point gradients).
    fn allreduce_sum_i64(&mut self, _buf: &mut [i64], _step: u64) -> Result<(), TrainerError> {
        Err(TrainerError::reduce("this reduce cannot sum integers: a reproducible job needs one that can"))
    }

    /// Replaces `vals` with the elementwise maximum over ranks.
    fn allreduce_max_i32(&mut self, _vals: &mut [i32], _step: u64) -> Result<(), TrainerError> {
        Err(TrainerError::reduce("this reduce cannot take maxima: a reproducible job needs one that can"))
    }

    /// Leaves rank `i` with `buf[blocks[i]]` summed over ranks, and the `replicas` blocks
    /// before it too (what sharded optimizer state needs); the rest of `buf` is undefined.
    fn reduce_scatter_sum(
        &mut self,
        _: &mut [f32],
        _: &[Range<usize>],
        _: usize,
        _: u64,
    ) -> Result<(), TrainerError> {
        Err(TrainerError::reduce("this reduce cannot reduce-scatter: sharded state needs one that can"))
    }

    /// Fills every rank's `buf` with each rank `i`'s `buf[blocks[i]]`.
    fn allgather_blocks(&mut self, _: &mut [f32], _: &[Range<usize>], _: u64) -> Result<(), TrainerError> {
        Err(TrainerError::reduce("this reduce cannot allgather: sharded state needs one that can"))
    }
}

/// The reduce of a single-process run: the local buffer already is the sum.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoReduce;

impl Reduce for NoReduce {
    fn allreduce_sum(&mut self, _buf: &mut [f32], _step: u64) -> Result<(), TrainerError> {
        Ok(())
    }

    fn allreduce_sum_i64(&mut self, _buf: &mut [i64], _step: u64) -> Result<(), TrainerError> {
        Ok(())
    }

    fn allreduce_max_i32(&mut self, _vals: &mut [i32], _step: u64) -> Result<(), TrainerError> {
        Ok(())
    }

    fn reduce_scatter_sum(
        &mut self,
        _: &mut [f32],
        _: &[Range<usize>],
        _: usize,
        _: u64,
    ) -> Result<(), TrainerError> {
        Ok(())
    }

    fn allgather_blocks(&mut self, _: &mut [f32], _: &[Range<usize>], _: u64) -> Result<(), TrainerError> {
        Ok(())
    }
}
