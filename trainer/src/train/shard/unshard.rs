//! The whole state from sharded state: gathered back onto each rank ([`Trainer::unshard`]),
//! or into one rank's host memory as an image, the ranks keeping their blocks
//! ([`Trainer::gathered_image`]).

use super::unflatten;
use crate::train::{Reduce, Trainer};
use crate::TrainerError;
use limpet_snapshot::RawTensor;
use std::collections::BTreeMap;
use std::ops::Range;
use tch::Device;

/// Where one optimizer tensor of the whole state is ([`Trainer::optim_tensors`]).
pub(in crate::train) struct OptimTensor {
    /// Its optimizer slot.
    pub slot: usize,
    /// Its values in the slot's flat buffer.
    pub values: Range<usize>,
    pub shape: Vec<usize>,
}

impl Trainer {
    /// Gathers the whole optimizer state from every rank's block (a collective, under
    /// `reduce`) and drops the sharding: what a checkpoint or a state image starts from.
    /// If it fails, peers may have finished: every rank must then reload its state.
    pub fn unshard(&mut self, reduce: &mut dyn Reduce) -> Result<(), TrainerError> {
        if self.shard.is_none() {
            return Ok(());
        }
        let device = self.model.device();
        let mut slots = Vec::new();
        for k in 0..self.optim.spec().slots().len() {
            let all = self.gathered_slot(k, reduce)?;
            slots.push(unflatten(&all, self.model.params(), device));
        }
        self.shard = None;
        self.optim.restore(slots);
        Ok(())
    }

    /// The whole state as an image, its optimizer state gathered from every rank's block
    /// into host memory a slot at a time (a collective under `reduce`: every rank of the
    /// group calls it), for a rank that `keep`s it; the trainer stays sharded. The image is
    /// the one [`Trainer::unshard`] and [`Trainer::image`] would give, bit for bit, without
    /// the whole optimizer state ever on the device: what a checkpoint of a model whose state
    /// does not fit one device is written from, by one rank of a host while the others only
    /// send their blocks. An unsharded trainer's is its [`Trainer::image`].
    pub fn gathered_image(
        &self,
        reduce: &mut dyn Reduce,
        keep: bool,
    ) -> Result<Option<limpet_snapshot::StateImage>, TrainerError> {
        if self.shard.is_none() {
            return keep.then(|| self.image()).transpose();
        }
        let tensors = self.optim_tensors();
        let mut slots = BTreeMap::new();
        for k in 0..self.optim.spec().slots().len() {
            let all = self.gathered_slot(k, reduce)?;
            if !keep {
                continue;
            }
            for (key, t) in tensors.iter().filter(|(_, t)| t.slot == k) {
                let values = &all[t.values.clone()];
                slots.insert(key.clone(), RawTensor::from_f32(key, t.shape.clone(), values)?);
            }
        }
        keep.then(|| self.image_with(slots)).transpose()
    }

    /// Each optimizer tensor of the whole state by its name in an image
    /// (`optim/{slot}/{param}`): its slot and its values in the slot's flat buffer, cut as
    /// `unflatten` cuts it for the optimizer (parameter order, each its shape).
    pub(in crate::train) fn optim_tensors(&self) -> BTreeMap<String, OptimTensor> {
        let mut tensors = BTreeMap::new();
        for (slot, name) in self.optim.spec().slots().iter().enumerate() {
            let mut at = 0;
            for (param, p) in self.model.params() {
                let shape = p.size().iter().map(|&d| d as usize).collect();
                let values = at..at + p.numel();
                tensors.insert(format!("optim/{name}/{param}"), OptimTensor { slot, values, shape });
                at += p.numel();
            }
        }
        tensors
    }

    /// Optimizer slot `k` of the whole state, gathered from every rank's block into host
    /// memory (a collective under `reduce`).
    fn gathered_slot(&self, k: usize, reduce: &mut dyn Reduce) -> Result<Vec<f32>, TrainerError> {
        self.gathered_values(k, 0..self.grads.grads_len(), reduce)
    }

    /// `values` of optimizer slot `k` (a range of its flat buffer, in parameter order),
    /// gathered from the blocks that hold them into host memory: a collective under
    /// `reduce`, to which every rank brings the part of its own block inside the range
    /// (most bring none when the range is one tensor's).
    pub(in crate::train) fn gathered_values(
        &self,
        k: usize,
        values: Range<usize>,
        reduce: &mut dyn Reduce,
    ) -> Result<Vec<f32>, TrainerError> {
        let shard = self.usable_shard()?;
        let layout = &shard.layout;
        if values.end > self.grads.grads_len() {
            return Err(TrainerError::Config(format!(
                "values {values:?} of an optimizer slot of {}",
                self.grads.grads_len()
            )));
        }
        // The blocks cut to the range, in its coordinates: they still tile it, in rank order.
        let inside = |b: &Range<usize>| {
            let at = |i: usize| i.clamp(values.start, values.end) - values.start;
            at(b.start)..at(b.end)
        };
        let blocks: Vec<Range<usize>> = layout.blocks.iter().map(inside).collect();
        let (own, mine) = (&layout.blocks[layout.rank], blocks[layout.rank].clone());
        let mut all = vec![0f32; values.len()];
        if !mine.is_empty() {
            // The own block's tensor holds the slot's values `own`.
            let from = (values.start + mine.start - own.start) as i64;
            let part = shard.held[0].1[k].narrow(0, from, mine.len() as i64).to_device(Device::Cpu);
            part.f_copy_data(&mut all[mine.clone()], mine.len())?;
        }
        reduce.allgather_blocks(&mut all, &blocks, self.step)?;
        Ok(all)
    }
}
