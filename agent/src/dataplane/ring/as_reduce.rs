//! The ring as a trainer's [`limpet_trainer::Reduce`]: each collective the trainer asks for,
//! run on the group, its failures as the trainer's errors.

use super::Group;
use std::ops::Range;

impl limpet_trainer::Reduce for Group {
    fn allreduce_sum(&mut self, buf: &mut [f32], step: u64) -> Result<(), limpet_trainer::TrainerError> {
        Group::allreduce_sum(self, buf, step).map_err(|e| e.into_trainer())
    }

    fn allreduce_sum_bf16(
        &mut self,
        buf: &mut [f32],
        lossy: usize,
        step: u64,
    ) -> Result<(), limpet_trainer::TrainerError> {
        Group::allreduce_sum_bf16(self, buf, lossy, step).map_err(|e| e.into_trainer())
    }

    fn allreduce_sum_i64(&mut self, buf: &mut [i64], step: u64) -> Result<(), limpet_trainer::TrainerError> {
        Group::allreduce_sum_i64(self, buf, step).map_err(|e| e.into_trainer())
    }

    fn allreduce_max_i32(&mut self, vals: &mut [i32], step: u64) -> Result<(), limpet_trainer::TrainerError> {
        Group::allreduce_max_i32(self, vals, step).map_err(|e| e.into_trainer())
    }

    fn reduce_scatter_sum(
        &mut self,
        buf: &mut [f32],
        blocks: &[Range<usize>],
        replicas: usize,
        step: u64,
    ) -> Result<(), limpet_trainer::TrainerError> {
        Group::reduce_scatter_sum(self, buf, blocks, replicas, step).map_err(|e| e.into_trainer())
    }

    fn reduce_scatter_sum_bf16(
        &mut self,
        buf: &mut [f32],
        blocks: &[Range<usize>],
        replicas: usize,
        lossy: usize,
        step: u64,
    ) -> Result<(), limpet_trainer::TrainerError> {
        Group::reduce_scatter_sum_bf16(self, buf, blocks, replicas, lossy, step).map_err(|e| e.into_trainer())
    }

    fn allgather_blocks(
        &mut self,
        buf: &mut [f32],
        blocks: &[Range<usize>],
        step: u64,
    ) -> Result<(), limpet_trainer::TrainerError> {
        Group::allgather_blocks(self, buf, blocks, step).map_err(|e| e.into_trainer())
    }

    fn relay(
        &mut self,
        buf: &mut [f32],
        pieces: &[limpet_trainer::Piece],
        rank: usize,
        step: u64,
    ) -> Result<(), limpet_trainer::TrainerError> {
        if rank != self.rank() {
            return Err(limpet_trainer::TrainerError::Config(format!(
                "a relay as rank {rank} on the ring's rank {}",
                self.rank()
            )));
        }
        let pieces: Vec<_> = pieces.iter().map(|p| (p.giver, p.range.clone(), p.to.as_slice())).collect();
        Group::relay(self, buf, &pieces, step).map_err(|e| e.into_trainer())
    }
}
