//! The flat gradient buffer a trainer reduces and steps from: every parameter's gradient in
//! parameter order, then three scalars (the loss sum, the sample count and the squared norm
//! of this rank's mean gradient).
//!
//! On the CPU the parameters' `.grad` tensors are views into this buffer, so backward
//! accumulates straight into the bytes the ring reduces and the optimizer reads: no gradient
//! copy and no second model-sized allocation per step. (libtorch's gradient accumulation adds
//! into an existing `.grad` in place when autograd is not recording, which it never is
//! during backward.) On another device the buffer is the host staging area: each
//! parameter's gradient is copied into its place after backward, and the update takes each
//! parameter's averaged part back, so no model-sized tensor is made on the device.

use crate::TrainerError;
use tch::{Device, Kind, Tensor};

#[derive(Debug)]
pub(crate) struct GradBuffer {
    /// `n + 3` f32 values on the host, contiguous; owned here and never resized.
    flat: Tensor,
    /// Number of gradient values.
    n: usize,
    /// The parameters' gradients are views into `flat`.
    bound: bool,
}

impl GradBuffer {
    /// A zeroed buffer for `params`; on the CPU their gradients are rebound into it.
    pub(crate) fn new(params: &[(String, Tensor)], device: Device) -> Result<Self, TrainerError> {
        Self::with_binding(params, device == Device::Cpu)
    }

    /// A zeroed buffer for `params`, their gradients rebound into it when `bind`.
    pub(crate) fn with_binding(params: &[(String, Tensor)], bind: bool) -> Result<Self, TrainerError> {
        let n: usize = params.iter().map(|(_, p)| p.numel()).sum();
        let flat = Tensor::f_zeros([n as i64 + 3], (Kind::Float, Device::Cpu))?;
        let mut buf = GradBuffer { flat, n, bound: false };
        if bind {
            buf.bind(params)?;
        }
        Ok(buf)
    }

    /// Makes every trainable parameter's `.grad` a view of its place in the buffer.
    fn bind(&mut self, params: &[(String, Tensor)]) -> Result<(), TrainerError> {
        let trainable: Vec<&Tensor> = params.iter().map(|(_, p)| p).filter(|p| p.requires_grad()).collect();
        if trainable.is_empty() {
            return Ok(());
        }
        // A `.grad` must exist to be rebound: one backward through the parameters' sum
        // creates them all.
        let total = trainable.iter().map(|p| p.sum(Kind::Float)).reduce(|a, b| a + b).expect("non-empty");
        total.f_backward()?;
        if let Some(p) = trainable.iter().find(|p| p.kind() != Kind::Float || p.grad().size() != p.size()) {
            return Err(TrainerError::Config(format!(
                "parameter of kind {:?} and shape {:?}: gradients are f32 and shaped like their parameter",
                p.kind(),
                p.size()
            )));
        }
        self.attach(params)?;
        let _ = self.flat.f_zero_()?;
        Ok(())
    }

    /// Whether the parameters' gradients are views of this buffer.
    pub(crate) fn is_bound(&self) -> bool {
        self.bound
    }

    /// A zeroed buffer of the same size, not bound: [`GradBuffer::attach`] makes it the
    /// gradients' (a reproducible step keeps two shards' gradients in two buffers in turn).
    pub(crate) fn spare(&self) -> Result<GradBuffer, TrainerError> {
        let flat = Tensor::f_zeros([self.n as i64 + 3], (Kind::Float, Device::Cpu))?;
        Ok(GradBuffer { flat, n: self.n, bound: false })
    }

    /// Makes the parameters' gradients (which exist, f32 and shaped like their parameters)
    /// views of this buffer. When they were another's, that one keeps its values, and must no
    /// longer be zeroed or collected into as the gradients' (it believes itself bound).
    pub(crate) fn attach(&mut self, params: &[(String, Tensor)]) -> Result<(), TrainerError> {
        let mut offset = 0i64;
        for (_, p) in params {
            let n = p.numel() as i64;
            if p.requires_grad() {
                p.grad().f_set_data(&self.flat.narrow(0, offset, n).view_as(p))?;
            }
            offset += n;
        }
        self.bound = true;
        Ok(())
    }

    /// Number of gradient values (the buffer holds three more).
    pub(crate) fn grads_len(&self) -> usize {
        self.n
    }

    /// Zeroes gradients and scalars, before a step's backward passes accumulate.
    pub(crate) fn zero(&mut self, params: &[(String, Tensor)]) -> Result<(), TrainerError> {
        let _ = self.flat.f_zero_()?;
        if !self.bound {
            for (_, p) in params {
                let mut g = p.grad();
                if g.defined() {
                    let _ = g.f_zero_()?;
                }
            }
        }
        Ok(())
    }

    /// Brings this step's gradients into the buffer: nothing to do when they are views of
    /// it; else each parameter's copied from its device straight into its place, one after
    /// another, so the device never holds a model-sized temporary.
    pub(crate) fn collect(&mut self, params: &[(String, Tensor)]) -> Result<(), TrainerError> {
        if self.bound {
            return Ok(());
        }
        let mut offset = 0i64;
        for (_, p) in params {
            let n = p.numel() as i64;
            let mut place = self.flat.narrow(0, offset, n);
            let g = p.grad();
            if g.defined() {
                place.f_copy_(&g.detach().reshape([-1]))?;
            } else {
                let _ = place.f_zero_()?;
            }
            offset += n;
        }
        Ok(())
    }

    /// Brings the gradients of the parameters that lie in `range` of the buffer into it
    /// (nothing when they are views of it): what a step does for each bucket as backward
    /// finishes its blocks, before handing the bucket to the reduction. Writes nothing
    /// outside `range`, which the reduction may be summing meanwhile.
    pub(crate) fn collect_range(
        &mut self,
        params: &[(String, Tensor)],
        range: &std::ops::Range<usize>,
    ) -> Result<(), TrainerError> {
        if self.bound {
            return Ok(());
        }
        let mut offset = 0usize;
        for (_, p) in params {
            let n = p.numel();
            let here = offset..offset + n;
            offset += n;
            if here.start < range.start || here.end > range.end {
                continue;
            }
            let mut place = self.flat.narrow(0, here.start as i64, n as i64);
            let g = p.grad();
            if g.defined() {
                place.f_copy_(&g.detach().reshape([-1]))?;
            } else {
                let _ = place.f_zero_()?;
            }
        }
        Ok(())
    }

    /// The buffer's memory, to be handed out one region at a time (see [`RawBuffer`]).
    pub(crate) fn raw(&mut self) -> RawBuffer {
        RawBuffer { ptr: self.flat.data_ptr() as *mut f32, len: self.n + 3 }
    }

    /// The gradient part of the buffer, as a tensor over the host memory itself: the update
    /// takes each parameter's part to the parameter's device as it reaches it.
    pub(crate) fn grads(&self) -> Tensor {
        self.flat.narrow(0, 0, self.n as i64)
    }

    /// The whole buffer as host memory, for the collectives and the scalars.
    #[allow(unsafe_code)]
    pub(crate) fn as_mut_slice(&mut self) -> &mut [f32] {
        let len = self.n + 3;
        // SAFETY: `flat` is a contiguous f32 CPU tensor of `len` elements that this struct
        // owns and never resizes or replaces, so the pointer is valid and aligned for `len`
        // values. Its only other users are the parameters' gradient views, written by
        // backward passes, which run inside the trainer's `&mut self` methods: none can run
        // while this borrow of `self` is alive.
        unsafe { std::slice::from_raw_parts_mut(self.flat.data_ptr() as *mut f32, len) }
    }
}

/// The buffer's memory as a pointer that may cross to the thread reducing it while this
/// rank's backward still writes other regions. It hands out disjoint regions: whoever calls
/// [`RawBuffer::region`] promises that nothing else reads or writes that region while the
/// slice lives (the overlapped step hands a bucket over only once backward has finished
/// writing it, and touches it again only after the reducing thread is joined).
pub(crate) struct RawBuffer {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: the pointer is to host memory owned by the `GradBuffer` it came from, which outlives
// every use (the overlapped step's threads are scoped within its `&mut Trainer`), and regions
// are handed out disjointly (see `region`).
#[allow(unsafe_code)]
unsafe impl Send for RawBuffer {}

impl RawBuffer {
    /// Values in the buffer.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The values in `range`.
    ///
    /// # Safety
    /// No other access to `range` (through another region, the gradient views, or the
    /// buffer's own methods) may happen while the returned slice lives.
    #[allow(unsafe_code, clippy::mut_from_ref)]
    pub(crate) unsafe fn region(&self, range: std::ops::Range<usize>) -> &mut [f32] {
        assert!(range.start <= range.end && range.end <= self.len, "region {range:?} of {}", self.len);
        // SAFETY: in bounds (checked above) of a live, aligned f32 allocation; exclusivity is
        // the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.end - range.start) }
    }
}
