//! The collectives a trainer needs from its ranks, and the identity of a single-process run.

use crate::TrainerError;
use std::ops::Range;

/// One piece of a [`Reduce::relay`]: the values `range` of rank `giver`'s buffer, which
/// the ranks `to` take (a regroup's plan decides them).
pub use limpet_decide::regroup::Piece;

/// Sums gradient buffers across ranks, in place. Implementations must leave every rank with
/// the same bytes.
pub trait Reduce {
    /// Replaces `buf` with the elementwise sum of every rank's `buf` for `step`.
    fn allreduce_sum(&mut self, buf: &mut [f32], step: u64) -> Result<(), TrainerError>;

    /// As [`Reduce::allreduce_sum`], with `buf[..lossy]` free to travel in bfloat16 (a job's
    /// `reduce_dtype = "bf16"`): every rank must still end with the same bytes, and the rest
    /// of `buf` (a step's loss and sample count) is summed in f32. This default sums it all
    /// in f32, which is always allowed.
    fn allreduce_sum_bf16(&mut self, buf: &mut [f32], lossy: usize, step: u64) -> Result<(), TrainerError> {
        let _ = lossy;
        self.allreduce_sum(buf, step)
    }

    /// Whether this reduce sums gradients where they lie, device to device
    /// ([`Reduce::allreduce_sum_on_device`]): a host's local ranks do (the device leg of
    /// their hierarchical collective); a ring between hosts sums host memory.
    fn sums_on_device(&self) -> bool {
        false
    }

    /// As [`Reduce::allreduce_sum_bf16`], where `buf`'s first `on_device.numel()` values
    /// are `on_device`'s (this rank's gradients on its device, not yet copied to `buf`) and
    /// the rest are `buf`'s own (a step's scalars). Afterwards `on_device` holds the sums of
    /// its values and `buf` of the rest; `buf`'s first values are left undefined where the
    /// sum stayed on the devices. This default stages the values through `buf`: one copy to
    /// the host, the host's collective, one copy back.
    fn allreduce_sum_on_device(
        &mut self,
        on_device: &tch::Tensor,
        buf: &mut [f32],
        lossy: usize,
        step: u64,
    ) -> Result<(), TrainerError> {
        let g = on_device_len(on_device, buf)?;
        on_device.f_to_device(tch::Device::Cpu)?.f_copy_data(&mut buf[..g], g)?;
        self.allreduce_sum_bf16(buf, lossy, step)?;
        on_device.shallow_clone().f_copy_(&tch::Tensor::from_slice(&buf[..g]))?;
        Ok(())
    }

    /// The same as exact integers (a reproducible job's fixed-point gradients).
    fn allreduce_sum_i64(&mut self, _buf: &mut [i64], _step: u64) -> Result<(), TrainerError> {
        Err(TrainerError::reduce("this reduce cannot sum integers: a reproducible job needs one that can"))
    }

    /// Replaces `vals` with the elementwise maximum over ranks.
    fn allreduce_max_i32(&mut self, _vals: &mut [i32], _step: u64) -> Result<(), TrainerError> {
        Err(TrainerError::reduce("this reduce cannot take maxima: a reproducible job needs one that can"))
    }

    /// Ranks on each host of this reduce's group of `world` ranks, in host order (see
    /// [`Reduce::reduce_scatter_sum`]): one each unless a host's local ranks reduce together.
    fn host_counts(&self, world: usize) -> Vec<usize> {
        vec![1; world]
    }

    /// Leaves rank `i` with `buf[blocks[i]]` summed over ranks, and the blocks it holds as
    /// replicas too: those of the same local rank on the `replicas` hosts before its own
    /// (`ShardLayout::held` over [`Reduce::host_counts`]; with one rank per host, ranks
    /// `i - k` for `k` up to `replicas`): what sharded optimizer state needs. The rest of
    /// `buf` is undefined.
    fn reduce_scatter_sum(
        &mut self,
        _: &mut [f32],
        _: &[Range<usize>],
        _: usize,
        _: u64,
    ) -> Result<(), TrainerError> {
        Err(TrainerError::reduce("this reduce cannot reduce-scatter: sharded state needs one that can"))
    }

    /// As [`Reduce::reduce_scatter_sum`], with `buf[..lossy]` free to travel in bfloat16, as
    /// [`Reduce::allreduce_sum_bf16`]'s; this default sends it all in f32.
    fn reduce_scatter_sum_bf16(
        &mut self,
        buf: &mut [f32],
        blocks: &[Range<usize>],
        replicas: usize,
        lossy: usize,
        step: u64,
    ) -> Result<(), TrainerError> {
        let _ = lossy;
        self.reduce_scatter_sum(buf, blocks, replicas, step)
    }

    /// Fills every rank's `buf` with each rank `i`'s `buf[blocks[i]]`.
    fn allgather_blocks(&mut self, _: &mut [f32], _: &[Range<usize>], _: u64) -> Result<(), TrainerError> {
        Err(TrainerError::reduce("this reduce cannot allgather: sharded state needs one that can"))
    }

    /// Copies each piece's values from its giver's `buf` into the `buf` of every rank it goes
    /// to, unchanged (this rank is `rank`; every rank calls it with the same pieces, which do
    /// not overlap). What a re-cut of sharded state needs: each value moves only to the ranks
    /// that take it. `buf` outside what this rank gives or takes is left undefined. This
    /// default sums the pieces' bits as integers, each zero on all but its giver (exact, so
    /// every bit arrives, a negative zero too; every rank receives every piece); a ring
    /// relays each piece only as far as its last taker.
    fn relay(
        &mut self,
        buf: &mut [f32],
        pieces: &[Piece],
        rank: usize,
        step: u64,
    ) -> Result<(), TrainerError> {
        relay_by_sums(self, buf, pieces, rank, step)
    }
}

/// [`Reduce::relay`] through an integer sum of the pieces' bits, each zero on all but its
/// giver: exact (a negative zero arrives too), every rank receiving every piece.
pub(crate) fn relay_by_sums<R: Reduce + ?Sized>(
    reduce: &mut R,
    buf: &mut [f32],
    pieces: &[Piece],
    rank: usize,
    step: u64,
) -> Result<(), TrainerError> {
    if let Some(p) = pieces.iter().find(|p| p.range.start > p.range.end || p.range.end > buf.len()) {
        return Err(TrainerError::Config(format!("a piece {:?} of a buffer of {}", p.range, buf.len())));
    }
    let mut bits = vec![0i64; pieces.iter().map(|p| p.range.len()).sum()];
    let mut at = 0;
    for p in pieces {
        if p.giver == rank {
            for (d, v) in bits[at..at + p.range.len()].iter_mut().zip(&buf[p.range.clone()]) {
                *d = i64::from(v.to_bits());
            }
        }
        at += p.range.len();
    }
    reduce.allreduce_sum_i64(&mut bits, step)?;
    let mut at = 0;
    for p in pieces {
        if p.to.contains(&rank) {
            for (d, &b) in buf[p.range.clone()].iter_mut().zip(&bits[at..at + p.range.len()]) {
                // A peer's sum that is not one rank's bits is garbage either way.
                *d = f32::from_bits(b as u32);
            }
        }
        at += p.range.len();
    }
    Ok(())
}

/// How many of `buf`'s values an [`Reduce::allreduce_sum_on_device`] call has on the device:
/// `on_device`'s count, refused when it is more than `buf` holds.
pub(crate) fn on_device_len(on_device: &tch::Tensor, buf: &[f32]) -> Result<usize, TrainerError> {
    let g = on_device.numel();
    if g > buf.len() {
        return Err(TrainerError::Config(format!("{g} values on the device for a buffer of {}", buf.len())));
    }
    Ok(g)
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
