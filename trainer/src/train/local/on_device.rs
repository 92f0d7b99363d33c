//! The device leg of a host's hierarchical allreduce: local ranks whose gradients lie on
//! their devices (a GPU host's staged gradients) sum them device to device, and only the
//! lanes' chunks cross host memory, to and from the ring between hosts.
//!
//! The shape is the host collective's (`local.rs`): the same chunks, lanes and barriers, so
//! a host that sums on its devices and one that sums in host memory drive the ring alike.
//! Each chunk's sum lives on the device of the local rank that drives its lane (kept from
//! step to step, one per size the chunk has had: together, one model-sized buffer spread
//! over the lanes' devices). The first local rank to reach a chunk copies its values into
//! the sum, every other adds its own, copied peer to peer (a chunk-sized temporary on the
//! sum's device; over NVLink where the devices have it; on the CPU twin a plain add). The
//! driver copies the sum to the host (a page-locked buffer of the chunk's, reused), crosses
//! it, and copies the result back; every local
//! rank then copies the sum onto its own device. The values past the gradients (a step's
//! scalars) are summed in host memory beside them.
//!
//! This is the seam NCCL fills on a GPU host: a host's devices change only with the host,
//! so a communicator over them would never need reconfiguring. Unverified on a GPU: the
//! CPU twin (`Bind::Staged(Device::Cpu)`) runs the same code in `make test`.

use super::{lock_chunk, LocalRank};
use crate::train::local::cut;
use crate::TrainerError;
use std::ops::Range;
use std::sync::Arc;
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
        let g = crate::train::reduce::on_device_len(on_device, buf)?;
        let lanes = self.shared.lanes;
        let ranges = cut(buf.len(), lanes);
        // Its own kind: a local rank summing on its device beside one summing in host
        // memory, or with another count on it, is a bug the shape check names.
        let chunks = self.begin((buf.len(), "f32", g.max(1)), ranges.len())?;
        // Every rank's device, known to all before any sum is made: a chunk's sum is on its
        // lane driver's.
        let devices = {
            let shared = Arc::clone(&self.shared);
            let mut st = shared.lock();
            st.devices.resize(shared.n, None);
            st.devices[self.index] = Some(on_device.device());
            let st = shared.barrier(st, |_| {})?;
            st.devices.clone()
        };
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
            let owner = devices[c % lanes].unwrap_or(on_device.device());
            let sum = sum_of(&mut chunk.dev, dev.len(), owner)?;
            match first {
                // Peer to peer across devices.
                true => drop(sum.f_copy_(&mine)?),
                false => drop(sum.f_add_(&mine.f_to_device(owner)?)?),
            }
        }
        // A lane driver's chunks' sums are on its own device.
        let own = on_device.device();
        let outcome = self.cross(&chunks, &ranges, &mut |inter, chunk, range| {
            let (dev, _) = split(&range, g);
            let lossy = lossy.saturating_sub(range.start).min(range.len());
            if dev.is_empty() {
                return inter.allreduce_sum_bf16(&mut chunk.f32s, lossy, step);
            }
            // Only the lane driver's chunks cross host memory, in a reused (page-locked)
            // buffer: one copy from the device, the ring over it, one copy back.
            let staging = staging_of(&mut chunk.staging, range.len(), own)?;
            let sum = sum_of(&mut chunk.dev, dev.len(), own)?;
            staging.f_narrow(0, 0, dev.len() as i64)?.f_copy_(sum)?;
            let values = host_values(staging);
            values[dev.len()..].copy_from_slice(&chunk.f32s[dev.len()..]);
            inter.allreduce_sum_bf16(values, lossy, step)?;
            chunk.f32s[dev.len()..].copy_from_slice(&values[dev.len()..]);
            sum.f_copy_(&staging.f_narrow(0, 0, dev.len() as i64)?)?;
            Ok(())
        })?;
        if outcome.is_ok() {
            for c in self.order(ranges.len()) {
                let mut chunk = lock_chunk(&chunks[c]);
                let range = ranges[c].clone();
                let (dev, host) = split(&range, g);
                for i in host {
                    buf[i] = chunk.f32s[i - range.start];
                }
                if !dev.is_empty() {
                    let owner = devices[c % lanes].unwrap_or(on_device.device());
                    let sum = sum_of(&mut chunk.dev, dev.len(), owner)?;
                    on_device.f_narrow(0, dev.start as i64, dev.len() as i64)?.f_copy_(sum)?;
                }
            }
        }
        self.end(&chunks)?;
        outcome
    }
}

/// A chunk's sum of `len` values on `device`: the one kept, else a new one kept from now.
fn sum_of(sums: &mut Vec<Tensor>, len: usize, device: Device) -> Result<&mut Tensor, TrainerError> {
    let at = match sums.iter().position(|t| t.numel() == len && t.device() == device) {
        Some(at) => at,
        None => {
            sums.push(Tensor::f_empty([len as i64], (tch::Kind::Float, device))?);
            sums.len() - 1
        }
    };
    Ok(&mut sums[at])
}

/// A chunk's host buffer of `len` f32 values for a sum on `device`: the one kept when it
/// has that size, else a new one (page-locked where `device` is a GPU).
fn staging_of(kept: &mut Option<Tensor>, len: usize, device: Device) -> Result<&mut Tensor, TrainerError> {
    if kept.as_ref().is_none_or(|t| t.numel() != len) {
        let host = Tensor::f_zeros([len as i64], (tch::Kind::Float, Device::Cpu))?;
        *kept = Some(match device {
            Device::Cpu => host,
            d => host.f_pin_memory(d)?,
        });
    }
    Ok(kept.as_mut().expect("made above"))
}

/// A contiguous f32 CPU tensor's values, borrowed as long as the tensor is.
#[allow(unsafe_code)]
fn host_values(t: &mut Tensor) -> &mut [f32] {
    assert!(t.device() == Device::Cpu && t.kind() == tch::Kind::Float && t.is_contiguous());
    let len = t.numel();
    // SAFETY: `t` is a contiguous f32 CPU tensor of `len` values made by `staging_of` and
    // owned by a chunk whose lock the caller holds; nothing else reads or writes it while
    // the `&mut` borrow of `t` lives.
    unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut f32, len) }
}

/// A chunk's values that lie on the device (below `g`) and in host memory.
fn split(range: &Range<usize>, g: usize) -> (Range<usize>, Range<usize>) {
    (range.start.min(g)..range.end.min(g), range.start.max(g)..range.end)
}
