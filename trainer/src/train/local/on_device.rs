//! The device leg of a host's hierarchical allreduce: local ranks whose gradients lie on
//! their devices (a GPU host's staged gradients) sum them device to device, and only the
//! lanes' chunks cross host memory, to and from the ring between hosts.
//!
//! The shape is the host collective's (`local.rs`): the same chunks, lanes and barriers, so
//! a host that sums on its devices and one that sums in host memory drive the ring alike.
//! Per chunk, the first local rank to reach it copies its values into a sum on its own
//! device (kept from step to step, where it was made); every other rank adds its values to
//! it, copied peer to peer (over NVLink where the devices have it; on the CPU twin a plain
//! add). The chunk's lane driver copies the sum to the host, crosses it, and copies the
//! result back; every local rank then copies the sum onto its own device. The values past
//! the gradients (a step's scalars) are summed in host memory beside them.
//!
//! This is the seam NCCL fills on a GPU host: a host's devices change only with the host,
//! so a communicator over them would never need reconfiguring. Unverified on a GPU: the
//! CPU twin (`Bind::Staged(Device::Cpu)`) runs the same code in `make test`.

use super::{lock_chunk, LocalRank};
use crate::train::local::cut;
use crate::TrainerError;
use std::ops::Range;
use tch::{Device, Tensor};

impl LocalRank<'_> {
    /// [`crate::Reduce::allreduce_sum_on_device`] for a host's local ranks (see the module).
    pub(super) fn all_on_device(
        &mut self,
        on_device: &Tensor,
        buf: &mut [f32],
        lossy: usize,
        step: u64,
    ) -> Result<(), TrainerError> {
        let g = on_device.numel();
        if g > buf.len() {
            return Err(TrainerError::Config(format!(
                "{g} values on the device for a buffer of {}",
                buf.len()
            )));
        }
        let ranges = cut(buf.len(), self.shared.lanes);
        // Its own kind: a local rank summing on its device beside one summing in host
        // memory is a bug the shape check names.
        let chunks = self.begin(buf.len(), "f32, gradients on the device", ranges.len())?;
        for c in self.order(ranges.len()) {
            let mut chunk = lock_chunk(&chunks[c]);
            let first = chunk.added == 0;
            chunk.added += 1;
            let range = ranges[c].clone();
            let (dev, host) = split(&range, g);
            let sum = &mut chunk.f32s;
            if first {
                sum.clear();
                sum.resize(range.len(), 0.0);
            }
            for i in host {
                match first {
                    true => sum[i - range.start] = buf[i],
                    false => sum[i - range.start] += buf[i],
                }
            }
            if dev.is_empty() {
                continue;
            }
            let mine = on_device.f_narrow(0, dev.start as i64, dev.len() as i64)?;
            match chunk.dev.as_mut() {
                // A sum of the right size, wherever it was made: this rank's values copied
                // into it (peer to peer across devices).
                Some(s) if first && s.numel() == dev.len() => {
                    s.f_copy_(&mine)?;
                }
                _ if first => chunk.dev = Some(mine.f_detach_copy()?),
                Some(s) => {
                    let _ = s.f_add_(&mine.f_to_device(s.device())?)?;
                }
                None => {
                    return Err(TrainerError::Config(format!(
                        "chunk {c}'s device sum is missing after {} local ranks added to it",
                        chunk.added - 1
                    )))
                }
            }
        }
        let outcome = self.cross(&chunks, &ranges, &mut |inter, chunk, range| {
            let (dev, _) = split(&range, g);
            let lossy = lossy.saturating_sub(range.start).min(range.len());
            if let Some(sum) = chunk.dev.as_mut().filter(|_| !dev.is_empty()) {
                // Only the lane driver's chunks cross host memory, one copy each way.
                sum.f_to_device(Device::Cpu)?.f_copy_data(&mut chunk.f32s[..dev.len()], dev.len())?;
                inter.allreduce_sum_bf16(&mut chunk.f32s, lossy, step)?;
                sum.f_copy_(&Tensor::from_slice(&chunk.f32s[..dev.len()]))?;
                return Ok(());
            }
            inter.allreduce_sum_bf16(&mut chunk.f32s, lossy, step)
        })?;
        if outcome.is_ok() {
            for c in self.order(ranges.len()) {
                let chunk = lock_chunk(&chunks[c]);
                let range = ranges[c].clone();
                let (dev, host) = split(&range, g);
                for i in host {
                    buf[i] = chunk.f32s[i - range.start];
                }
                if let Some(sum) = chunk.dev.as_ref().filter(|_| !dev.is_empty()) {
                    on_device.f_narrow(0, dev.start as i64, dev.len() as i64)?.f_copy_(sum)?;
                }
            }
        }
        self.end(&chunks)?;
        outcome
    }
}

/// A chunk's values that lie on the device (below `g`) and in host memory.
fn split(range: &Range<usize>, g: usize) -> (Range<usize>, Range<usize>) {
    (range.start.min(g)..range.end.min(g), range.start.max(g)..range.end)
}
