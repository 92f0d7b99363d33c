//! A device's side stream and its events, and the device allocator's memory figures
//! (`device_streams.cpp`): how staged gradients cross to the host while backward goes on,
//! and what `bench memory` reports as a device's peak.
//!
//! A bucket's copy to page-locked host memory is enqueued on a side stream, behind an event
//! of the compute stream (so it reads the bucket once backward has written it), and the
//! compute thread goes on at once; the thread that sums the bucket waits for the copy's own
//! event ([`Ready::wait`]) before it reads the host's values. On the CPU, the twin: the copy
//! is made at once and [`Ready`] holds nothing to wait for, so the same hand-over runs in
//! `make test`. The GPU side is unverified until a GPU has run it (`docs/workloads.md`).

use crate::TrainerError;
use std::ffi::c_void;
use tch::{Device, Tensor};

extern "C" {
    fn limpet_side_stream(kind: i32, index: i32, id: *mut i64) -> i32;
    fn limpet_copy_on_side(
        dst: *mut torch_sys::C_tensor,
        src: *mut torch_sys::C_tensor,
        id: i64,
        done: *mut *mut c_void,
    ) -> i32;
    fn limpet_event_wait(event: *mut c_void) -> i32;
    fn limpet_event_free(event: *mut c_void);
    fn limpet_device_memory(kind: i32, index: i32, current: *mut i64, peak: *mut i64, reset: i32) -> i32;
}

/// c10's number for a device's type and its index, for a device the shim serves: a GPU.
fn c10_device(device: Device) -> Option<(i32, i32)> {
    match device {
        // c10::DeviceType::CUDA.
        Device::Cuda(i) => Some((1, i as i32)),
        _ => None,
    }
}

fn threw(what: &str) -> TrainerError {
    TrainerError::Torch(tch::TchError::Torch(format!("libtorch threw while {what}")))
}

/// Where a device's copies to the host are enqueued: a stream of its own on a GPU, none on
/// the CPU (the copy is made at once).
#[derive(Debug)]
pub(crate) struct SideStream {
    /// The GPU's side stream (its id, the device naming it); `None` on the CPU.
    stream: Option<(Device, i64)>,
}

impl SideStream {
    /// A side stream of `device` (from its pool), or the CPU's twin.
    pub(crate) fn of(device: Device) -> Result<SideStream, TrainerError> {
        let Some((kind, index)) = c10_device(device) else { return Ok(SideStream { stream: None }) };
        let mut id = 0i64;
        // SAFETY: `id` is a live i64 the call writes.
        #[allow(unsafe_code)]
        let failed = unsafe { limpet_side_stream(kind, index, &mut id) };
        match failed {
            0 => Ok(SideStream { stream: Some((device, id)) }),
            _ => Err(threw("taking a side stream")),
        }
    }

    /// Copies `src` (on this stream's device) into `dst` (page-locked host memory of its
    /// size) once the work enqueued so far on the compute stream is done, without waiting:
    /// `dst` holds the values once the returned [`Ready`] is waited for. Neither may be
    /// written before then. On the CPU, the copy is made before this returns.
    pub(crate) fn copy_to_host(&self, dst: &Tensor, src: &Tensor) -> Result<Ready, TrainerError> {
        let Some((device, id)) = self.stream else {
            dst.shallow_clone().f_copy_(src)?;
            return Ok(Ready(None));
        };
        if src.device() != device || dst.device() != Device::Cpu || dst.numel() != src.numel() {
            return Err(TrainerError::Config(format!(
                "a side copy of {} values on {:?} into {} on {:?}, with the side stream of {device:?}",
                src.numel(),
                src.device(),
                dst.numel(),
                dst.device()
            )));
        }
        let (mut d, mut s) = (dst.shallow_clone(), src.shallow_clone());
        let mut event = std::ptr::null_mut();
        // SAFETY: both handles are live tch tensors for the call; the shim enqueues the copy
        // and hands back a new event, owned by the `Ready` from here on.
        #[allow(unsafe_code)]
        let failed = unsafe { limpet_copy_on_side(d.as_mut_ptr(), s.as_mut_ptr(), id, &mut event) };
        match (failed, event.is_null()) {
            (0, false) => Ok(Ready(Some(Event(event)))),
            _ => Err(threw("copying a bucket to the host on a side stream")),
        }
    }
}

/// An event of the shim's, owned.
#[derive(Debug)]
struct Event(*mut c_void);

// SAFETY: a c10 event may be waited for and freed from any thread; it is owned by one
// `Ready` at a time.
#[allow(unsafe_code)]
unsafe impl Send for Event {}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: made by `limpet_copy_on_side`, freed once, here. A copy still in flight
        // (a `Ready` dropped on an error path) is waited for first: it would otherwise land
        // in a host buffer the next step has zeroed.
        #[allow(unsafe_code)]
        unsafe {
            let _ = limpet_event_wait(self.0);
            limpet_event_free(self.0)
        }
    }
}

/// A copy to the host that may still be in flight; waited for before the host reads it.
#[derive(Debug)]
#[must_use = "the host's values are there only once the copy is waited for"]
pub(crate) struct Ready(Option<Event>);

impl Ready {
    /// A copy already made.
    pub(crate) fn done() -> Ready {
        Ready(None)
    }

    /// Blocks until the copy is made.
    pub(crate) fn wait(self) -> Result<(), TrainerError> {
        let Some(event) = &self.0 else { return Ok(()) };
        // SAFETY: a live event of the shim's (freed only when `self` drops, after this).
        #[allow(unsafe_code)]
        let failed = unsafe { limpet_event_wait(event.0) };
        match failed {
            0 => Ok(()),
            _ => Err(threw("waiting for a bucket's copy to the host")),
        }
    }
}

/// Bytes the device's caching allocator holds for tensors now and at its peak since the
/// last reset (`reset`: start a new peak after reading); `None` for the CPU, whose memory
/// the process's resident size tells.
pub fn device_memory(device: Device, reset: bool) -> Result<Option<(u64, u64)>, TrainerError> {
    let Some((kind, index)) = c10_device(device) else { return Ok(None) };
    let (mut current, mut peak) = (0i64, 0i64);
    // SAFETY: both are live i64s the call writes.
    #[allow(unsafe_code)]
    let failed = unsafe { limpet_device_memory(kind, index, &mut current, &mut peak, i32::from(reset)) };
    match failed {
        0 => Ok(Some((current.max(0) as u64, peak.max(0) as u64))),
        _ => Err(threw("reading the device allocator's statistics")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CPU twin: a copy is made before `copy_to_host` returns, waiting is free, and a
    /// bucket's range of a larger buffer lands in its range only.
    #[test]
    fn the_cpus_side_copy_is_made_at_once() {
        let side = SideStream::of(Device::Cpu).unwrap();
        let src = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]);
        let host = Tensor::zeros([6], (tch::Kind::Float, Device::Cpu));
        let ready = side.copy_to_host(&host.narrow(0, 1, 4), &src).unwrap();
        assert_eq!(Vec::<f32>::try_from(&host).unwrap(), [0.0, 1.0, 2.0, 3.0, 4.0, 0.0]);
        ready.wait().unwrap();
        assert_eq!(device_memory(Device::Cpu, true).unwrap(), None);
    }
}
