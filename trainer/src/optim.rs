//! Optimizers whose state limpet owns: SGD with momentum and AdamW, written over plain tensors
//! so every slot can be saved, hashed and sent to another host; the warmup + cosine learning-rate
//! schedule; and global-norm gradient clipping (`optim/clip.rs`).

mod clip;

pub use clip::{
    clip_global_norm, clip_to_norm, device_squares, device_sum_of_squares, scale_and_clip_on_device,
    sum_of_squares,
};
use serde::{Deserialize, Serialize};
use tch::Tensor;

/// Optimizer and hyper-parameters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum OptimizerSpec {
    /// SGD with heavy-ball momentum and L2 weight decay, as `torch.optim.SGD`.
    Sgd {
        /// Peak learning rate.
        lr: f64,
        /// Momentum factor.
        momentum: f64,
        /// L2 penalty added to the gradient.
        weight_decay: f64,
        /// Decay embeddings too (absent in older jobs, which did).
        #[serde(default = "yes", skip_serializing_if = "is_true")]
        decay_embeddings: bool,
    },
    /// Adam with decoupled weight decay, as `torch.optim.AdamW`.
    Adamw {
        /// Peak learning rate.
        lr: f64,
        /// First-moment decay.
        beta1: f64,
        /// Second-moment decay.
        beta2: f64,
        /// Denominator term.
        eps: f64,
        /// Decoupled weight decay.
        weight_decay: f64,
        /// Decay embeddings too (absent in older jobs, which did).
        #[serde(default = "yes", skip_serializing_if = "is_true")]
        decay_embeddings: bool,
    },
}

fn yes() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

/// True when weight decay applies to parameter `name` of shape rank `dim`: matrices and
/// filters only, never biases and norm scales (as nanoGPT and Hugging Face's Trainer group
/// them), and embeddings only when asked (nanoGPT and the Trainer decay them; OLMo-style
/// recipes do not, and a decayed embedding of rare tokens shrinks toward zero).
pub fn decays(name: &str, dim: usize, decay_embeddings: bool) -> bool {
    dim >= 2 && (decay_embeddings || !name.contains("emb."))
}

impl OptimizerSpec {
    /// AdamW with PyTorch's default betas and eps, no decay of embeddings.
    pub fn adamw(lr: f64, weight_decay: f64) -> Self {
        OptimizerSpec::Adamw {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay,
            decay_embeddings: false,
        }
    }

    /// SGD with momentum 0.9, no decay of embeddings.
    pub fn sgd(lr: f64, weight_decay: f64) -> Self {
        OptimizerSpec::Sgd { lr, momentum: 0.9, weight_decay, decay_embeddings: false }
    }

    /// Whether embeddings are decayed.
    pub fn decay_embeddings(&self) -> bool {
        match self {
            OptimizerSpec::Sgd { decay_embeddings, .. } | OptimizerSpec::Adamw { decay_embeddings, .. } => {
                *decay_embeddings
            }
        }
    }

    /// Sets whether embeddings are decayed.
    pub fn set_decay_embeddings(&mut self, value: bool) {
        match self {
            OptimizerSpec::Sgd { decay_embeddings, .. } | OptimizerSpec::Adamw { decay_embeddings, .. } => {
                *decay_embeddings = value
            }
        }
    }

    /// Peak learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            OptimizerSpec::Sgd { lr, .. } | OptimizerSpec::Adamw { lr, .. } => *lr,
        }
    }

    /// The weight decay.
    pub fn weight_decay(&self) -> f64 {
        match self {
            OptimizerSpec::Sgd { weight_decay, .. } | OptimizerSpec::Adamw { weight_decay, .. } => {
                *weight_decay
            }
        }
    }

    /// Sets the peak learning rate.
    pub fn set_lr(&mut self, value: f64) {
        match self {
            OptimizerSpec::Sgd { lr, .. } | OptimizerSpec::Adamw { lr, .. } => *lr = value,
        }
    }

    /// Sets the weight decay.
    pub fn set_weight_decay(&mut self, value: f64) {
        match self {
            OptimizerSpec::Sgd { weight_decay, .. } | OptimizerSpec::Adamw { weight_decay, .. } => {
                *weight_decay = value
            }
        }
    }

    /// Names of the per-parameter state slots.
    pub fn slots(&self) -> &'static [&'static str] {
        match self {
            OptimizerSpec::Sgd { .. } => &["momentum"],
            OptimizerSpec::Adamw { .. } => &["exp_avg", "exp_avg_sq"],
        }
    }

    /// Checks that the hyper-parameters are usable; the message names the bad one.
    pub fn validate(&self) -> Result<(), OutOfRange> {
        let check = |name: &'static str, value: f64, ok: bool| {
            if ok && value.is_finite() {
                Ok(())
            } else {
                Err(OutOfRange { name, value })
            }
        };
        match *self {
            OptimizerSpec::Sgd { lr, momentum, weight_decay, .. } => {
                check("lr", lr, lr > 0.0)?;
                check("momentum", momentum, (0.0..1.0).contains(&momentum))?;
                check("weight_decay", weight_decay, weight_decay >= 0.0)
            }
            OptimizerSpec::Adamw { lr, beta1, beta2, eps, weight_decay, .. } => {
                check("lr", lr, lr > 0.0)?;
                check("beta1", beta1, (0.0..1.0).contains(&beta1))?;
                check("beta2", beta2, (0.0..1.0).contains(&beta2))?;
                check("eps", eps, eps > 0.0)?;
                check("weight_decay", weight_decay, weight_decay >= 0.0)
            }
        }
    }
}

/// A hyper-parameter outside the range it makes sense in.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("optimizer.{name} = {value} is out of range")]
pub struct OutOfRange {
    /// The hyper-parameter.
    pub name: &'static str,
    /// Its value.
    pub value: f64,
}

/// Linear warmup to the peak learning rate, then cosine decay to `min_lr_ratio` of it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Schedule {
    /// Steps of linear warmup.
    pub warmup_steps: u64,
    /// Final learning rate as a fraction of the peak.
    pub min_lr_ratio: f64,
}

impl Schedule {
    /// Learning-rate multiplier for `step` (0-based) of `total`.
    pub fn factor(&self, step: u64, total: u64) -> f64 {
        if step < self.warmup_steps {
            return (step + 1) as f64 / self.warmup_steps as f64;
        }
        let span = total.saturating_sub(self.warmup_steps).max(1) as f64;
        let progress = ((step - self.warmup_steps) as f64 / span).min(1.0);
        let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine
    }
}

/// Optimizer state: one tensor per (slot, parameter), in parameter order.
#[derive(Debug)]
pub struct Optimizer {
    spec: OptimizerSpec,
    slots: Vec<Vec<Tensor>>,
    /// Work space as large as the largest parameter, made at the first update and reused:
    /// AdamW's update then runs in place, with no model-sized allocation per step (a fresh
    /// allocation of that size costs a page fault per 4 KiB on the host).
    scratch: Option<Tensor>,
    /// The state was dropped (it is sharded elsewhere): `slots` are empty.
    released: bool,
}

impl Optimizer {
    /// Zero state for `params`, each tensor a view of one zero (stride 0): it takes no memory
    /// until the first update or load writes it, so a trainer that shards its state before
    /// its first step never holds the whole of it.
    pub fn new(spec: &OptimizerSpec, params: &[(String, Tensor)]) -> Self {
        let zero = |p: &Tensor| Tensor::zeros([0i64; 0], (p.kind(), p.device())).expand(p.size(), false);
        let slots = spec.slots().iter().map(|_| params.iter().map(|(_, p)| zero(p)).collect()).collect();
        Optimizer { spec: spec.clone(), slots, scratch: None, released: false }
    }

    /// Gives every state tensor memory of its own (see [`Optimizer::new`]) before it is
    /// written in place.
    pub(crate) fn materialize(&mut self) {
        for t in self.slots.iter_mut().flatten() {
            if !t.is_contiguous() {
                *t = t.zeros_like().contiguous();
            }
        }
    }

    /// The hyper-parameters.
    pub fn spec(&self) -> &OptimizerSpec {
        &self.spec
    }

    /// State tensors named `optim/<slot>/<param>`.
    pub fn named_state<'a>(
        &'a self,
        params: &'a [(String, Tensor)],
    ) -> impl Iterator<Item = (String, &'a Tensor)> + 'a {
        self.spec.slots().iter().zip(&self.slots).flat_map(move |(slot, ts)| {
            params.iter().zip(ts).map(move |((name, _), t)| (format!("optim/{slot}/{name}"), t))
        })
    }

    /// The state tensor of `slot` for parameter index `i`, to read.
    pub fn slot(&self, slot: usize, i: usize) -> &Tensor {
        &self.slots[slot][i]
    }

    /// Applies one update with the averaged gradient `grad` (flat, in parameter order, on the
    /// host or the parameters' device), at learning rate `lr`; `t` is the 1-based update count
    /// (for Adam's bias correction). `kernels` says how AdamW runs (see [`Kernels`]).
    pub fn apply(
        &mut self,
        params: &[(String, Tensor)],
        grad: &Tensor,
        lr: f64,
        t: u64,
        kernels: Kernels,
    ) -> Result<(), FusedError> {
        self.materialize();
        let largest = params.iter().map(|(_, p)| p.numel()).max().unwrap_or(0);
        let device = params.first().map_or(tch::Device::Cpu, |(_, p)| p.device());
        let scratch = scratch_for(&mut self.scratch, largest, device);
        let decay_embeddings = self.spec.decay_embeddings();
        let mut offset = 0i64;
        let parts = params.iter().enumerate().map(|(i, (name, p))| {
            let n = p.numel() as i64;
            // The gradient may be the host buffer: each parameter's part goes to the
            // parameter's device alone (a no-op on the same device).
            let g = grad.narrow(0, offset, n).view_as(p).to_device(p.device());
            offset += n;
            Part {
                p: p.shallow_clone(),
                g,
                slots: self.slots.iter().map(|s| s[i].shallow_clone()).collect(),
                decays: decays(name, p.dim(), decay_embeddings),
            }
        });
        let parts: Vec<Part> = tch::no_grad(|| parts.collect());
        update_all(&self.spec, kernels, parts, &scratch, lr, t)
    }

    /// Drops the state (a sharded trainer keeps only its blocks', elsewhere).
    pub fn release(&mut self) {
        self.slots.iter_mut().for_each(Vec::clear);
        self.scratch = None;
        self.released = true;
    }

    /// Whether the state was released.
    pub fn is_released(&self) -> bool {
        self.released
    }

    /// Replaces the state with `slots` (per slot, one tensor per parameter).
    pub fn restore(&mut self, slots: Vec<Vec<Tensor>>) {
        self.slots = slots;
        self.released = false;
    }
}

/// The work space, made or grown to `numel` values on `device`.
pub(crate) fn scratch_for(scratch: &mut Option<Tensor>, numel: usize, device: tch::Device) -> Tensor {
    let fits = scratch.as_ref().is_some_and(|s| s.numel() >= numel && s.device() == device);
    if !fits {
        *scratch = Some(Tensor::zeros([numel.max(1) as i64], (tch::Kind::Float, device)));
    }
    scratch.as_ref().expect("made above").shallow_clone()
}

/// How an AdamW update runs. SGD always runs as [`update`] does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernels {
    /// limpet's own eight passes per tensor ([`update`]): the bits a reproducible job is
    /// pinned to, the same whatever slice of a tensor they run on.
    Exact,
    /// libtorch's fused AdamW (`torch.optim.AdamW(fused=True)`): one pass per tensor, on a
    /// GPU one launch for many tensors; the exact passes' values to float tolerance over a
    /// few steps.
    Fused,
}

impl Kernels {
    /// Fused on a GPU, where eight launches per tensor cost; the exact passes on the CPU and
    /// in a reproducible job. On the CPU libtorch's fused kernel agrees with the formulas over
    /// a few steps, but a digits MLP trained 3000 steps with it ended 20% (relative L2) away
    /// from the exact passes' parameters, and three agents' run as far from one process's,
    /// where the exact passes keep both within 2e-4: not understood, so not used there.
    pub fn for_job(reproducible: bool, device: tch::Device) -> Self {
        match (reproducible, device) {
            (false, tch::Device::Cuda(_)) => Kernels::Fused,
            _ => Kernels::Exact,
        }
    }
}

/// libtorch refused a fused update (its message).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("libtorch's fused AdamW failed: {0}")]
pub struct FusedError(pub String);

/// One tensor to update: a parameter (or a slice of one), its gradient and its state slots,
/// all of one shape, and whether weight decay applies to it.
pub(crate) struct Part {
    pub(crate) p: Tensor,
    pub(crate) g: Tensor,
    pub(crate) slots: Vec<Tensor>,
    pub(crate) decays: bool,
}

/// Updates every part in place, with `scratch` a work space at least as large as the
/// largest (the exact passes' only).
pub(crate) fn update_all(
    spec: &OptimizerSpec,
    kernels: Kernels,
    parts: Vec<Part>,
    scratch: &Tensor,
    lr: f64,
    t: u64,
) -> Result<(), FusedError> {
    tch::no_grad(|| {
        let (fused, exact): (Vec<Part>, Vec<Part>) = match (kernels, spec) {
            (Kernels::Fused, OptimizerSpec::Adamw { .. }) => parts.into_iter().partition(fusable),
            _ => (Vec::new(), parts),
        };
        for mut part in exact {
            let s = scratch.narrow(0, 0, part.p.numel() as i64).view_as(&part.p);
            update(spec, part.decays, &part.p, &part.g, &mut part.slots, &s, lr, t);
        }
        if let OptimizerSpec::Adamw { beta1, beta2, eps, weight_decay, .. } = *spec {
            // Decay is one number per call: the decayed tensors in one, the rest in another.
            let (decayed, plain): (Vec<Part>, Vec<Part>) = fused.into_iter().partition(|p| p.decays);
            fused_adamw(decayed, lr, beta1, beta2, weight_decay, eps, t)?;
            fused_adamw(plain, lr, beta1, beta2, 0.0, eps, t)?;
        }
        Ok(())
    })
}

/// Whether libtorch's fused kernel takes the part: every tensor contiguous and of one
/// floating kind, device and shape (limpet's models keep f32 parameters; a TorchScript module
/// may not, and runs the exact passes). The kernel itself checks kinds only: it walks the
/// parameter's elements through the other tensors' memory, whatever their sizes or strides.
fn fusable(part: &Part) -> bool {
    let (kind, device, size) = (part.p.kind(), part.p.device(), part.p.size());
    matches!(kind, tch::Kind::Float | tch::Kind::BFloat16 | tch::Kind::Half | tch::Kind::Double)
        && std::iter::once(&part.p)
            .chain([&part.g])
            .chain(&part.slots)
            .all(|t| t.kind() == kind && t.device() == device && t.is_contiguous() && t.size() == size)
}

extern "C" {
    /// `fused_adamw.cpp`: libtorch's fused AdamW over `n` tensors; 0, or 1 when libtorch
    /// threw (its message in `err`).
    fn limpet_fused_adamw(
        params: *mut *mut torch_sys::C_tensor,
        grads: *mut *mut torch_sys::C_tensor,
        exp_avgs: *mut *mut torch_sys::C_tensor,
        exp_avg_sqs: *mut *mut torch_sys::C_tensor,
        n: std::os::raw::c_int,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        step: f64,
        err: *mut std::os::raw::c_char,
        err_len: std::os::raw::c_int,
    ) -> std::os::raw::c_int;
}

/// AdamW's update of `parts` through libtorch's fused kernel, all with `weight_decay`.
fn fused_adamw(
    mut parts: Vec<Part>,
    lr: f64,
    beta1: f64,
    beta2: f64,
    weight_decay: f64,
    eps: f64,
    t: u64,
) -> Result<(), FusedError> {
    if parts.is_empty() {
        return Ok(());
    }
    let mut handles: [Vec<*mut torch_sys::C_tensor>; 4] = Default::default();
    for part in &mut parts {
        let [p, g, m, v] = &mut handles;
        p.push(part.p.as_mut_ptr());
        g.push(part.g.as_mut_ptr());
        let (first, rest) = part.slots.split_at_mut(1);
        m.push(first[0].as_mut_ptr());
        v.push(rest[0].as_mut_ptr());
    }
    let mut err = vec![0u8; 512];
    let n = parts.len() as std::os::raw::c_int;
    let [p, g, m, v] = &mut handles;
    // SAFETY: every handle is a live tch tensor owned by `parts` for the whole call, each list
    // holds `n` of them, and `err` is `err.len()` writable bytes; the kernel writes only the
    // tensors' values and `err`.
    #[allow(unsafe_code)]
    let failed = unsafe {
        limpet_fused_adamw(
            p.as_mut_ptr(),
            g.as_mut_ptr(),
            m.as_mut_ptr(),
            v.as_mut_ptr(),
            n,
            lr,
            beta1,
            beta2,
            weight_decay,
            eps,
            t as f64,
            err.as_mut_ptr().cast(),
            err.len() as std::os::raw::c_int,
        )
    };
    match failed {
        0 => Ok(()),
        _ => {
            let end = err.iter().position(|b| *b == 0).unwrap_or(err.len());
            Err(FusedError(String::from_utf8_lossy(&err[..end]).into_owned()))
        }
    }
}

/// One tensor's update, in place: `p` (a parameter or a slice of one) from its gradient `g`
/// and its state `slots` (SGD's momentum; AdamW's moments), all of one shape, with `s` a
/// work space of that shape. Elementwise, so a slice updates exactly as it would within its
/// whole tensor: what sharded state relies on.
#[allow(clippy::too_many_arguments)]
pub(crate) fn update(
    spec: &OptimizerSpec,
    decays: bool,
    p: &Tensor,
    g: &Tensor,
    slots: &mut [Tensor],
    s: &Tensor,
    lr: f64,
    t: u64,
) {
    let mut p = p.shallow_clone();
    match *spec {
        OptimizerSpec::Sgd { momentum, weight_decay, .. } => {
            let g = if decays && weight_decay > 0.0 { g + &p * weight_decay } else { g.shallow_clone() };
            let buf = &mut slots[0];
            let _ = buf.g_mul_scalar_(momentum).g_add_(&g);
            let _ = p.g_sub_(&(&*buf * lr));
        }
        OptimizerSpec::Adamw { beta1, beta2, eps, weight_decay, .. } => {
            if decays && weight_decay > 0.0 {
                let _ = p.g_mul_scalar_(1.0 - lr * weight_decay);
            }
            let (m, rest) = slots.split_at_mut(1);
            let (m, v) = (&mut m[0], &mut rest[0]);
            let mut s = s.shallow_clone();
            let _ = m.lerp_(g, 1.0 - beta1);
            let _ = g.square_out(&s);
            let _ = v.lerp_(&s, 1.0 - beta2);
            let step_size = lr / (1.0 - beta1.powi(t as i32));
            if step_size == 0.0 {
                // A zero learning rate moves nothing (and would divide by zero).
                return;
            }
            let bc2_sqrt = (1.0 - beta2.powi(t as i32)).sqrt();
            let _ = v.sqrt_out(&s);
            let _ = s.g_mul_scalar_(-1.0 / (bc2_sqrt * step_size));
            let _ = s.g_add_scalar_(-eps / step_size);
            let _ = p.addcdiv_(m, &s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays_to_the_floor() {
        let s = Schedule { warmup_steps: 10, min_lr_ratio: 0.1 };
        assert!((s.factor(0, 100) - 0.1).abs() < 1e-12);
        assert!((s.factor(9, 100) - 1.0).abs() < 1e-12);
        assert!((s.factor(10, 100) - 1.0).abs() < 1e-12);
        assert!((s.factor(55, 100) - 0.55).abs() < 1e-12);
        assert!((s.factor(100, 100) - 0.1).abs() < 1e-12);
        assert!((1..100).all(|i| s.factor(i + 10, 100) <= s.factor(i + 9, 100)));
    }

    /// AdamW's update gives each element the same bits whatever slice of its tensor it runs
    /// on (libtorch's vectorised loop and its scalar remainder agree): what lets sharded state,
    /// whose blocks cut tensors anywhere, train the bits of whole state in a reproducible job.
    #[test]
    fn the_update_does_not_depend_on_where_a_block_cuts_a_tensor() {
        let spec = OptimizerSpec::adamw(0.01, 0.1);
        let n = 100_003i64;
        tch::manual_seed(7);
        let opts = (tch::Kind::Float, tch::Device::Cpu);
        let (p, m, v) = (Tensor::randn([n], opts), Tensor::randn([n], opts) * 0.1, Tensor::rand([n], opts));
        let (whole, cut) = ([p.copy(), m.copy(), v.copy()], [p.copy(), m.copy(), v.copy()]);
        let cuts = [0, 5, 17, 40_001, 77_777, 99_990, n];
        for t in 1..=3 {
            let g = Tensor::randn([n], opts);
            let scratch = Tensor::zeros([n], opts);
            let mut slots = [whole[1].shallow_clone(), whole[2].shallow_clone()];
            update(&spec, true, &whole[0], &g, &mut slots, &scratch, 0.003, t);
            for w in cuts.windows(2) {
                let (a, len) = (w[0], w[1] - w[0]);
                let mut slots = [cut[1].narrow(0, a, len), cut[2].narrow(0, a, len)];
                let (pc, gc, sc) = (cut[0].narrow(0, a, len), g.narrow(0, a, len), scratch.narrow(0, a, len));
                update(&spec, true, &pc, &gc, &mut slots, &sc, 0.003, t);
            }
        }
        for (what, (a, b)) in
            ["parameters", "first moment", "second moment"].iter().zip(whole.iter().zip(&cut))
        {
            assert!(a.equal(b), "the {what} depend on where the tensor was cut");
        }
    }

    /// A new optimizer's state is zero without memory of its own (each tensor one zero seen
    /// with stride 0), reads as zeros of the parameter's shape, and gets memory of its own
    /// at the first update.
    #[test]
    fn new_state_takes_no_memory_until_written() {
        let w = Tensor::zeros([64, 32], (tch::Kind::Float, tch::Device::Cpu));
        let params = vec![("w".to_string(), w)];
        let mut adam = Optimizer::new(&OptimizerSpec::adamw(0.01, 0.0), &params);
        for (_, s) in adam.named_state(&params) {
            assert_eq!((s.size(), s.stride()), (vec![64, 32], vec![0, 0]));
            assert_eq!(s.abs().sum(tch::Kind::Float).double_value(&[]), 0.0);
        }
        adam.apply(
            &params,
            &Tensor::ones([64 * 32], (tch::Kind::Float, tch::Device::Cpu)),
            0.01,
            1,
            Kernels::Exact,
        )
        .unwrap();
        for (name, s) in adam.named_state(&params) {
            assert_eq!(s.stride(), vec![32, 1], "{name}");
            assert!(s.abs().min().double_value(&[]) > 0.0, "{name} was written");
        }
    }

    /// Two steps of each optimizer match the closed-form updates torch.optim computes.
    #[test]
    fn updates_match_reference_formulas() {
        let w = Tensor::from_slice(&[1.0f32, -2.0, 0.5, 4.0]).view([2, 2]).set_requires_grad(true);
        let params = vec![("w".to_string(), w)];
        let g = Tensor::from_slice(&[0.1f32, 0.2, -0.3, 0.4]);
        let mut sgd = Optimizer::new(&OptimizerSpec::sgd(0.1, 0.0), &params);
        let before = params[0].1.detach().copy();
        sgd.apply(&params, &g, 0.1, 1, Kernels::Exact).unwrap();
        sgd.apply(&params, &g, 0.1, 2, Kernels::Exact).unwrap();
        // buf1 = g, buf2 = 1.9 g; p = p0 - 0.1 * 2.9 g
        let want = &before - g.view([2, 2]) * 0.29;
        assert!(params[0].1.allclose(&want, 1e-6, 1e-6, false));

        let w = Tensor::from_slice(&[1.0f32, -2.0, 0.5, 4.0]).view([2, 2]).set_requires_grad(true);
        let params = vec![("w".to_string(), w)];
        let mut adam = Optimizer::new(&OptimizerSpec::adamw(0.01, 0.0), &params);
        adam.apply(&params, &g, 0.01, 1, Kernels::Exact).unwrap();
        // Adam's first bias-corrected step moves each weight by lr * sign(g) (up to eps).
        let want = Tensor::from_slice(&[0.99f32, -2.01, 0.51, 3.99]).view([2, 2]);
        assert!(params[0].1.allclose(&want, 1e-5, 1e-6, false), "{:?}", params[0].1);
        let names: Vec<_> = adam.named_state(&params).map(|(n, _)| n).collect();
        assert_eq!(names, ["optim/exp_avg/w", "optim/exp_avg_sq/w"]);
    }

    /// Several AdamW updates of parameters of different sizes (the work space is cut to
    /// each) follow the textbook formulas computed in f64, decay included; a zero learning
    /// rate still advances the moments.
    #[test]
    fn adamw_in_place_matches_f64_formulas_over_steps() {
        adamw_matches_f64_formulas(Kernels::Exact);
    }

    /// libtorch's fused AdamW follows the same formulas, decayed and undecayed tensors alike.
    #[test]
    fn fused_adamw_matches_f64_formulas_over_steps() {
        adamw_matches_f64_formulas(Kernels::Fused);
    }

    /// The fused update is libtorch's own (not the exact passes under another name): its
    /// values differ from the exact passes' in the last bits somewhere over a model-sized
    /// tensor, and a tensor it cannot take reaches libtorch's check, whose message comes back.
    /// A part of another size than its parameter (which libtorch would not check) or of
    /// another kind is left to the exact passes.
    #[test]
    fn the_fused_update_is_libtorchs_and_its_errors_come_back() {
        let opts = (tch::Kind::Float, tch::Device::Cpu);
        tch::manual_seed(3);
        let w = Tensor::randn([256, 257], opts);
        let g = Tensor::randn([256 * 257], opts);
        let run = |kernels| {
            let params = vec![("b01.w".to_string(), w.copy())];
            let mut adam = Optimizer::new(&OptimizerSpec::adamw(0.01, 0.1), &params);
            for t in 1..=3 {
                adam.apply(&params, &g, 0.01, t, kernels).unwrap();
            }
            params[0].1.shallow_clone()
        };
        let (exact, fused) = (run(Kernels::Exact), run(Kernels::Fused));
        assert!(exact.allclose(&fused, 1e-5, 1e-6, false));
        assert!(!exact.equal(&fused), "the fused update gave the exact passes' bits: was it run?");
        let part = |g: Tensor| Part {
            p: Tensor::zeros([4], opts),
            g,
            slots: vec![Tensor::zeros([4], opts), Tensor::zeros([4], opts)],
            decays: true,
        };
        let double = Tensor::zeros([4], (tch::Kind::Double, tch::Device::Cpu));
        let err = fused_adamw(vec![part(double.shallow_clone())], 0.01, 0.9, 0.99, 0.1, 1e-8, 1).unwrap_err();
        assert!(err.0.contains("Double"), "{err}");
        assert!(!fusable(&part(double)) && !fusable(&part(Tensor::zeros([5], opts))));
        assert!(fusable(&part(Tensor::zeros([4], opts))));
    }

    /// Fused where a GPU trains an ordinary job; the exact passes on the CPU and in every
    /// reproducible job.
    #[test]
    fn the_kernels_follow_the_device_and_the_job() {
        use tch::Device::{Cpu, Cuda};
        assert_eq!(Kernels::for_job(false, Cuda(0)), Kernels::Fused);
        assert_eq!(Kernels::for_job(true, Cuda(1)), Kernels::Exact);
        assert_eq!(Kernels::for_job(false, Cpu), Kernels::Exact);
        assert_eq!(Kernels::for_job(true, Cpu), Kernels::Exact);
    }

    fn adamw_matches_f64_formulas(kernels: Kernels) {
        let (b1, b2, eps, wd) = (0.9, 0.95, 1e-8, 0.1);
        let shapes: [&[i64]; 3] = [&[3, 4], &[5], &[2, 2]];
        let params: Vec<(String, Tensor)> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| (format!("layers.{i}.w"), Tensor::randn(*s, (tch::Kind::Float, tch::Device::Cpu))))
            .collect();
        let mut spec = OptimizerSpec::adamw(0.01, wd);
        if let OptimizerSpec::Adamw { beta2, .. } = &mut spec {
            *beta2 = b2;
        }
        let mut adam = Optimizer::new(&spec, &params);
        let n: i64 = params.iter().map(|(_, p)| p.numel() as i64).sum();
        let to_vec = |t: &Tensor| Vec::<f32>::try_from(t.reshape([-1])).unwrap();
        // Per parameter: its values, m and v, in f64.
        let mut want: Vec<[Vec<f64>; 3]> = params
            .iter()
            .map(|(_, p)| {
                let p: Vec<f64> = to_vec(p).into_iter().map(f64::from).collect();
                [p.clone(), vec![0.0; p.len()], vec![0.0; p.len()]]
            })
            .collect();
        for (t, lr) in [(1u64, 0.01), (2, 0.005), (3, 0.0), (4, 0.02)] {
            let g = Tensor::randn([n], (tch::Kind::Float, tch::Device::Cpu));
            adam.apply(&params, &g, lr, t, kernels).unwrap();
            let g = to_vec(&g);
            let mut off = 0;
            for (i, [p, m, v]) in want.iter_mut().enumerate() {
                let d = params[i].1.dim() >= 2;
                for j in 0..p.len() {
                    let gj = f64::from(g[off + j]);
                    if d {
                        p[j] *= 1.0 - lr * wd;
                    }
                    m[j] = b1 * m[j] + (1.0 - b1) * gj;
                    v[j] = b2 * v[j] + (1.0 - b2) * gj * gj;
                    let mh = m[j] / (1.0 - b1.powi(t as i32));
                    let vh = v[j] / (1.0 - b2.powi(t as i32));
                    p[j] -= lr * mh / (vh.sqrt() + eps);
                }
                off += p.len();
            }
        }
        for ((_, got), [want, ..]) in params.iter().zip(&want) {
            for (a, b) in to_vec(got).iter().zip(want) {
                assert!((f64::from(*a) - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} vs {b}");
            }
        }
    }

    /// Decay reaches matrices only: not norms, biases or (unless asked) embeddings; a job
    /// written before the setting existed keeps decaying embeddings.
    #[test]
    fn weight_decay_skips_norms_biases_and_embeddings() {
        assert!(decays("b01.wq.weight", 2, false));
        assert!(!decays("b01.attn_norm.weight", 1, false) && !decays("b01.wq.bias", 1, true));
        assert!(!decays("b00.tok_emb.weight", 2, false) && decays("b00.tok_emb.weight", 2, true));
        let params = vec![
            ("b00.tok_emb.weight".to_string(), Tensor::ones([2, 2], (tch::Kind::Float, tch::Device::Cpu))),
            ("b01.fc.weight".to_string(), Tensor::ones([2, 2], (tch::Kind::Float, tch::Device::Cpu))),
        ];
        let mut adam = Optimizer::new(&OptimizerSpec::adamw(0.1, 0.5), &params);
        adam.apply(
            &params,
            &Tensor::zeros([8], (tch::Kind::Float, tch::Device::Cpu)),
            0.1,
            1,
            Kernels::Exact,
        )
        .unwrap();
        assert_eq!(params[0].1.double_value(&[0, 0]), 1.0, "the embedding decayed");
        assert!((params[1].1.double_value(&[0, 0]) - 0.95).abs() < 1e-6, "the matrix did not decay");
        let old: OptimizerSpec = serde_json::from_str(
            r#"{"kind":"adamw","lr":0.1,"beta1":0.9,"beta2":0.999,"eps":1e-8,"weight_decay":0.1}"#,
        )
        .unwrap();
        assert!(old.decay_embeddings(), "an older job decayed embeddings and must keep doing so");
    }
}
