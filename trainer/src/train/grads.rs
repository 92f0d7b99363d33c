//! The flat gradient buffer a trainer reduces and steps from: every parameter's gradient in
//! parameter order, then three scalars (the loss sum, the sample count and the squared norm
//! of this rank's mean gradient).
//!
//! How the parameters' gradients reach it ([`Bind`]):
//! - **Views** (the CPU): the parameters' `.grad` tensors are views into this buffer, so
//!   backward accumulates straight into the bytes the ring reduces and the optimizer reads:
//!   no gradient copy and no second model-sized allocation per step. (libtorch's gradient
//!   accumulation adds into an existing `.grad` in place when autograd is not recording,
//!   which it never is during backward.)
//! - **Staged** (a GPU): the gradients are views into one flat buffer on the device, as
//!   DDP's bucket views are, and this host buffer is its staging copy: a bucket crosses to
//!   the host in one copy when backward is done with it (pinned memory on a GPU, the copy
//!   on a side stream while backward goes on: `device/streams.rs`), and the
//!   reduced gradient goes back in one copy before the update, which then runs on the
//!   device. Host memory is only the inter-host leg's.
//! - **Copied**: each parameter's gradient its own tensor, copied into its place after
//!   backward, the update taking each parameter's averaged part back, so no model-sized
//!   tensor is made on the device. A job that shards its gradients then makes each device
//!   gradient undefined (`p.grad = None`, through `forget_grad.cpp`), so between its copy and
//!   the next backward the device holds none of them; a reproducible job's two buffers take
//!   the gradients in turn.
//!
//! The staged and copied ways run on the CPU too (the trainer's tests force them), where
//! they must train the bits of the views.

use crate::device::{Ready, SideStream};
use crate::TrainerError;
use tch::{Device, Kind, Tensor};

/// How the parameters' gradients reach the buffer (see the module's note).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Bind {
    /// Views of the host buffer itself.
    Views,
    /// Views of one flat buffer on this device, staged through the host buffer.
    Staged(Device),
    /// Each its own tensor, copied into the host buffer.
    Copied,
}

#[derive(Debug)]
pub(crate) struct GradBuffer {
    /// `n + 3` f32 values on the host, contiguous; owned here and never resized.
    flat: Tensor,
    /// Number of gradient values.
    n: usize,
    /// The parameters' gradients are views into `flat`.
    bound: bool,
    /// Staged: the `n` gradient values on the device, the parameters' gradients views of it.
    staged: Option<Tensor>,
    /// Staged: where the device's copies to this buffer are enqueued.
    side: Option<SideStream>,
}

impl GradBuffer {
    /// A zeroed buffer for `params` on `device`: their gradients views of it on the CPU, of a
    /// flat buffer on the device staged through it elsewhere, unless `own_gradients` (a job
    /// that gives its device gradients back between steps, or a reproducible job's buffers
    /// taking them in turn), when they stay their own and are copied in.
    pub(crate) fn new(
        params: &[(String, Tensor)],
        device: Device,
        own_gradients: bool,
    ) -> Result<Self, TrainerError> {
        let bind = match device {
            Device::Cpu => Bind::Views,
            _ if own_gradients => Bind::Copied,
            d => Bind::Staged(d),
        };
        Self::with_binding(params, bind)
    }

    /// A zeroed buffer for `params`, their gradients reaching it as `bind` says.
    pub(crate) fn with_binding(params: &[(String, Tensor)], bind: Bind) -> Result<Self, TrainerError> {
        let n: usize = params.iter().map(|(_, p)| p.numel()).sum();
        let mut flat = Tensor::f_zeros([n as i64 + 3], (Kind::Float, Device::Cpu))?;
        if let Bind::Staged(d @ Device::Cuda(_)) = bind {
            // Page-locked: a copy from the device lands without a bounce through a pageable
            // buffer of the driver's.
            flat = flat.f_pin_memory(d)?;
        }
        let mut buf = GradBuffer { flat, n, bound: false, staged: None, side: None };
        match bind {
            Bind::Views => buf.bind(params)?,
            Bind::Staged(d) => {
                let on_device = Tensor::f_zeros([n as i64], (Kind::Float, d))?;
                buf.bind_to(params, &on_device)?;
                buf.staged = Some(on_device);
                buf.side = Some(SideStream::of(d)?);
            }
            Bind::Copied => {}
        }
        Ok(buf)
    }

    /// Makes every trainable parameter's `.grad` a view of its place in the buffer.
    fn bind(&mut self, params: &[(String, Tensor)]) -> Result<(), TrainerError> {
        let flat = self.flat.shallow_clone();
        self.bind_to(params, &flat)?;
        self.bound = true;
        Ok(())
    }

    /// Makes every trainable parameter's `.grad` a view of its place in `target` (zeroed).
    fn bind_to(&mut self, params: &[(String, Tensor)], target: &Tensor) -> Result<(), TrainerError> {
        if !params.iter().any(|(_, p)| p.requires_grad()) {
            return Ok(());
        }
        // A `.grad` must exist to be rebound: a backward through each parameter's sum makes
        // its gradient, rebound at once, so no more than one parameter's gradient exists
        // beside the buffer (one backward through all of them made a model-sized second
        // copy, a start-up peak above the whole job's).
        let mut offset = 0i64;
        for (_, p) in params {
            let n = p.numel() as i64;
            if p.requires_grad() {
                p.sum(Kind::Float).f_backward()?;
                let g = p.grad();
                if p.kind() != Kind::Float || g.size() != p.size() {
                    return Err(TrainerError::Config(format!(
                        "parameter of kind {:?} and shape {:?}: gradients are f32 and shaped like their parameter",
                        p.kind(),
                        p.size()
                    )));
                }
                place(target, &g, p, offset)?;
            }
            offset += n;
        }
        let _ = target.shallow_clone().f_zero_()?;
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
        Ok(GradBuffer { flat, n: self.n, bound: false, staged: None, side: None })
    }

    /// Makes the parameters' gradients (which exist, f32 and shaped like their parameters)
    /// views of this buffer. When they were another's, that one keeps its values, and must no
    /// longer be zeroed or collected into as the gradients' (it believes itself bound).
    pub(crate) fn attach(&mut self, params: &[(String, Tensor)]) -> Result<(), TrainerError> {
        let mut offset = 0i64;
        for (_, p) in params {
            let n = p.numel() as i64;
            if p.requires_grad() {
                place(&self.flat, &p.grad(), p, offset)?;
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

    /// Zeroes gradients and scalars, before a step's backward passes accumulate; when
    /// `give_back`, by giving the buffer's pages back to the system (see [`release`]), so
    /// that only what backward writes is resident, and by making the device's gradients
    /// undefined (backward then creates each as it reaches it).
    pub(crate) fn zero(&mut self, params: &[(String, Tensor)], give_back: bool) -> Result<(), TrainerError> {
        if give_back {
            // Page-locked memory keeps its pages through the advice `release` gives: only a
            // buffer of its own (never staged) is given back.
            if self.staged.is_some() {
                return Err(TrainerError::Config(
                    "a staged gradient buffer cannot give its pages back".into(),
                ));
            }
            release(self.as_mut_slice());
        } else {
            let _ = self.flat.f_zero_()?;
        }
        if let Some(on_device) = &self.staged {
            let _ = on_device.shallow_clone().f_zero_()?;
            return Ok(());
        }
        if !self.bound {
            for (name, p) in params {
                if give_back {
                    forget_grad(name, p)?;
                    continue;
                }
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
    /// another, so the device never holds a model-sized temporary. When `forget`, each
    /// device gradient is made undefined once copied.
    pub(crate) fn collect(&mut self, params: &[(String, Tensor)], forget: bool) -> Result<(), TrainerError> {
        if self.bound {
            return Ok(());
        }
        if self.staged.is_some() {
            return self.stage_range(&(0..self.n))?.wait();
        }
        let mut offset = 0i64;
        for (name, p) in params {
            let n = p.numel() as i64;
            self.take(name, p, offset, forget)?;
            offset += n;
        }
        Ok(())
    }

    /// Copies `p`'s gradient into its place at `offset` (zeros when backward gave it none),
    /// then, when `forget`, makes it undefined. The copy into host memory is synchronous
    /// (pageable memory, the current stream), so the device memory is not in use when
    /// libtorch's allocator takes it back.
    fn take(&mut self, name: &str, p: &Tensor, offset: i64, forget: bool) -> Result<(), TrainerError> {
        let mut place = self.flat.narrow(0, offset, p.numel() as i64);
        let g = p.grad();
        if g.defined() {
            place.f_copy_(&g.detach().reshape([-1]))?;
        } else {
            let _ = place.f_zero_()?;
        }
        drop(g);
        if forget {
            forget_grad(name, p)?;
        }
        Ok(())
    }

    /// Brings the gradients of the parameters that lie in `range` of the buffer into it
    /// (nothing when they are views of it): what a step does for each bucket as backward
    /// finishes its blocks, before handing the bucket to the reduction. Writes nothing
    /// outside `range`, which the reduction may be summing meanwhile. Staged, the copy may
    /// still be in flight on the device's side stream: the host reads `range` only once the
    /// returned [`Ready`] is waited for.
    pub(crate) fn collect_range(
        &mut self,
        params: &[(String, Tensor)],
        range: &std::ops::Range<usize>,
        forget: bool,
    ) -> Result<Ready, TrainerError> {
        if self.bound {
            return Ok(Ready::done());
        }
        if self.staged.is_some() {
            return self.stage_range(&(range.start..range.end.min(self.n)));
        }
        let mut offset = 0usize;
        for (name, p) in params {
            let n = p.numel();
            let here = offset..offset + n;
            offset += n;
            if here.start < range.start || here.end > range.end {
                continue;
            }
            self.take(name, p, here.start as i64, forget)?;
        }
        Ok(Ready::done())
    }

    /// Staged: copies the device's values in `range` to the host buffer's, in one copy on
    /// the device's side stream, after the work enqueued so far (see `device/streams.rs`):
    /// the host reads them once the returned [`Ready`] is waited for.
    fn stage_range(&mut self, range: &std::ops::Range<usize>) -> Result<Ready, TrainerError> {
        let (Some(on_device), Some(side)) = (&self.staged, &self.side) else { return Ok(Ready::done()) };
        if range.is_empty() {
            return Ok(Ready::done());
        }
        let (at, len) = (range.start as i64, (range.end - range.start) as i64);
        side.copy_to_host(&self.flat.narrow(0, at, len), &on_device.narrow(0, at, len))
    }

    /// Whether the gradients are views of a device's buffer staged through this one.
    pub(crate) fn is_staged(&self) -> bool {
        self.staged.is_some()
    }

    /// Staged: the device's buffer of the `n` gradient values (the parameters' gradients are
    /// views of it), as backward left it.
    pub(crate) fn staged(&self) -> Option<&Tensor> {
        self.staged.as_ref()
    }

    /// The buffer's memory, to be handed out one region at a time (see [`RawBuffer`]).
    pub(crate) fn raw(&mut self) -> RawBuffer {
        RawBuffer { ptr: self.flat.data_ptr() as *mut f32, len: self.n + 3 }
    }

    /// The gradient part of the buffer, for the update: the host memory itself (the update
    /// takes each parameter's part to the parameter's device as it reaches it), or, staged,
    /// the device's buffer, once the host's values are copied back to it in one copy (the
    /// reduced sums, which the caller then averages and clips on the device, or values the
    /// host averaged and clipped already).
    pub(crate) fn grads(&self) -> Result<Tensor, TrainerError> {
        let host = self.flat.narrow(0, 0, self.n as i64);
        match &self.staged {
            Some(on_device) => {
                on_device.shallow_clone().f_copy_(&host)?;
                Ok(on_device.shallow_clone())
            }
            None => Ok(host),
        }
    }

    /// The gradient part of the buffer as the host holds it (what the ring reduced).
    pub(crate) fn host_grads(&self) -> Tensor {
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

/// Makes `grad` (parameter `p`'s) a view of `target`'s values from `offset`.
fn place(target: &Tensor, grad: &Tensor, p: &Tensor, offset: i64) -> Result<(), TrainerError> {
    grad.shallow_clone().f_set_data(&target.narrow(0, offset, p.numel() as i64).view_as(p))?;
    Ok(())
}

/// The buffer's memory as a pointer that may cross to the thread reducing it while this
/// rank's backward still writes other regions. It hands out disjoint regions: whoever calls
/// [`RawBuffer::region`] promises that nothing else reads or writes that region while the
/// slice lives (the overlapped step hands a bucket over only once backward has finished
/// writing it, and touches it again only after the summing task has ended).
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

extern "C" {
    /// `forget_grad.cpp`: resets the gradient of the tensor behind the handle; 0, or 1 when
    /// libtorch threw.
    fn limpet_forget_grad(t: *mut torch_sys::C_tensor) -> std::os::raw::c_int;
}

/// Makes `p`'s gradient undefined, as PyTorch's `p.grad = None`: its memory goes back to
/// the device's allocator (when no other handle holds it), and the next backward creates a
/// new one. tch exposes no way to do it.
pub(crate) fn forget_grad(name: &str, p: &Tensor) -> Result<(), TrainerError> {
    // A handle of our own to the same tensor: the gradient is the tensor's, not the handle's.
    let mut handle = p.shallow_clone();
    // SAFETY: `handle` is a live tch tensor for the whole call, and the function only resets
    // the gradient in its autograd metadata (the trainer's thread is the only one touching
    // this parameter's gradient: backward has finished with it, or not begun).
    #[allow(unsafe_code)]
    let failed = unsafe { limpet_forget_grad(handle.as_mut_ptr()) };
    match failed {
        0 => Ok(()),
        _ => Err(TrainerError::Torch(tch::TchError::Torch(format!(
            "libtorch threw while making parameter {name}'s gradient undefined"
        )))),
    }
}

/// Sets `values` to zero and gives the whole pages among them back to the system, which
/// maps them anew (zeroed) when next written: what sharded gradients do with the parts of
/// the buffer this rank no longer needs, so its resident size is what it holds and what
/// backward is writing rather than the whole model's gradient.
#[allow(unsafe_code)]
pub(crate) fn release(values: &mut [f32]) {
    let start = values.as_mut_ptr() as usize;
    let (lo, hi) = whole_pages(start, std::mem::size_of_val(values));
    if hi <= lo {
        values.fill(0.0);
        return;
    }
    // `start` is f32-aligned and a page a multiple of 4 bytes, so both cuts fall on values.
    let (a, b) = ((lo - start) / 4, (hi - start) / 4);
    values[..a].fill(0.0);
    values[b..].fill(0.0);
    // SAFETY: [lo, hi) is whole pages inside `values`, which this call borrows exclusively:
    // no other reference sees those bytes change. The buffer is private anonymous memory
    // (libtorch's CPU allocator takes it from malloc), whose pages MADV_DONTNEED drops and
    // maps again as zeros on the next access: as if zeros were written.
    let dropped = unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_DONTNEED) };
    // Shared memory would keep its values through the advice: a buffer from another
    // allocator than malloc's would then add the next step into this one's. Checked at the
    // first dropped value (reading it maps the system's zero page, no memory of its own).
    if dropped != 0 || values[a] != 0.0 {
        values[a..b].fill(0.0);
    }
}

/// The whole pages within the `bytes` bytes from address `at`: `lo..hi`, empty when none.
fn whole_pages(at: usize, bytes: usize) -> (usize, usize) {
    let page = page_size();
    (at.next_multiple_of(page), (at + bytes) / page * page)
}

/// The system's page size (4 KiB where it cannot be asked), asked once.
#[allow(unsafe_code)]
fn page_size() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf takes no pointers.
        let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(size).ok().filter(|s| s.is_power_of_two()).unwrap_or(4096)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `p.grad = None`: the gradient is undefined through every handle of the parameter, the
    /// next backward makes a new one (not added to the old), and a tensor that never had
    /// one, or is not a parameter, is left as it is.
    #[test]
    fn a_forgotten_gradient_is_undefined_until_the_next_backward() {
        let p = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
        let other_handle = p.shallow_clone();
        forget_grad("p", &p).unwrap();
        assert!(!p.grad().defined());
        (&p * 3.0).sum(Kind::Float).backward();
        let old = p.grad();
        assert_eq!(Vec::<f32>::try_from(&old).unwrap(), [3.0, 3.0]);
        forget_grad("p", &other_handle).unwrap();
        assert!(!p.grad().defined(), "the gradient is the tensor's, not the handle's");
        // The old gradient's own handle still reads its values: nothing was freed under it.
        assert_eq!(Vec::<f32>::try_from(&old).unwrap(), [3.0, 3.0]);
        (&p * 5.0).sum(Kind::Float).backward();
        assert_eq!(Vec::<f32>::try_from(&p.grad()).unwrap(), [5.0, 5.0]);
        // A tensor with no gradient, parameter or not, is left as it was.
        let plain = Tensor::from_slice(&[1.0f32]);
        forget_grad("plain", &plain).unwrap();
        assert!(!plain.requires_grad() && !plain.grad().defined());
        let fresh = Tensor::from_slice(&[1.0f32]).set_requires_grad(true);
        forget_grad("fresh", &fresh).unwrap();
        assert!(fresh.requires_grad() && !fresh.grad().defined());
    }

    #[test]
    fn release_zeroes_its_values_and_nothing_beside_them() {
        // Several pages, cut off-page on both sides; a range within one page; an empty one.
        let mut v: Vec<f32> = (0..40_000).map(|i| i as f32 + 1.0).collect();
        for range in [3..30_001, 35_000..35_010, 36_000..36_000] {
            release(&mut v[range.clone()]);
            assert!(v[range.clone()].iter().all(|&x| x == 0.0), "{range:?} not zero");
        }
        let kept = |i: usize| !(3..30_001).contains(&i) && !(35_000..35_010).contains(&i);
        for (i, &x) in v.iter().enumerate().filter(|(i, _)| kept(*i)) {
            assert_eq!(x, i as f32 + 1.0, "value {i} changed");
        }
        // Released pages are written again like any others.
        v[10_000] = 7.0;
        assert_eq!(v[10_000], 7.0);
    }

    /// The pages of this many bytes from `at` that are resident.
    #[allow(unsafe_code)]
    fn resident(at: *const f32, bytes: usize) -> usize {
        let (lo, hi) = whole_pages(at as usize, bytes);
        let mut map = vec![0u8; (hi - lo) / page_size()];
        // SAFETY: [lo, hi) is whole pages of a live allocation; `map` has a byte per page.
        let ok = unsafe { libc::mincore(lo as *mut libc::c_void, hi - lo, map.as_mut_ptr()) };
        assert_eq!(ok, 0, "mincore");
        map.iter().filter(|b| **b & 1 == 1).count()
    }

    #[test]
    fn released_pages_leave_memory_until_written_again() {
        // 8 MB: its own mapping, so its pages are this vector's alone.
        let mut v = vec![1.0f32; 2 << 20];
        let bytes = std::mem::size_of_val(&v[..]);
        let pages = bytes / page_size();
        assert!(resident(v.as_ptr(), bytes) >= pages - 1, "written, yet not resident");
        release(&mut v);
        // One page: the first released value, read back to check it is zero, maps the
        // system's zero page (shared, no memory of its own, but mapped).
        assert_eq!(resident(v.as_ptr(), bytes), 1, "released, yet resident");
        v[1 << 20] = 2.0;
        assert_eq!(resident(v.as_ptr(), bytes), 2, "one value written: one page back");
        assert!(v.iter().enumerate().all(|(i, &x)| x == if i == 1 << 20 { 2.0 } else { 0.0 }));
    }
}
