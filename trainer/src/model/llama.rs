//! The LLaMA-family decoder's blocks: token embedding, pre-norm decoder layers (RMSNorm,
//! grouped-query attention with rotary position embeddings through libtorch's
//! `scaled_dot_product_attention`, a SwiGLU MLP), and a final RMSNorm with the vocabulary head.
//!
//! The arithmetic follows Hugging Face's `LlamaForCausalLM` (rotate-half rotary layout, RMSNorm
//! in f32) and the variants of the same decoder its relatives use ([`LlamaSpec`]: rotary
//! scaling, biases on q/k/v, q/k norms, a head width of its own), so weights move between the
//! two by renaming alone ([`crate::hf`]).
//! Under [`Precision::Bf16`] the matrix products and attention run in bfloat16 while the
//! parameters, the residual stream, the norms and the loss stay in f32: what autocast does,
//! written out so that it runs the same on every device.

use super::{LlamaSpec, Precision, RopeScaling};
use tch::nn::{self, ModuleT};
use tch::{Kind, Tensor};

/// Builds block `i` of a LLaMA model under `root` (as `bNN`): 0 embeds, the last normalizes and projects to
/// the vocabulary, the rest are decoder layers. A tied head reuses block 0's embedding, which
/// must already be in the same var store (checked by the caller).
pub(super) fn block(spec: &LlamaSpec, precision: Precision, i: usize, root: &nn::Path) -> Box<dyn ModuleT> {
    let p = &(root / format!("b{i:02}"));
    let (v, d) = (spec.vocab as i64, spec.d_model as i64);
    let hd = spec.head_dim() as i64;
    let cast = precision.compute_kind();
    if i == 0 {
        let tok = (p / "tok_emb").var("weight", &[v, d], nn::Init::Const(0.0));
        return Box::new(Embed { tok });
    }
    // Values come from the model's own initialization (or a checkpoint) afterwards.
    let norm = |name: &str| (p / name).var("weight", &[d], nn::Init::Const(1.0));
    let lin = |name: &str, out: i64, inp: i64| (p / name).var("weight", &[out, inp], nn::Init::Const(0.0));
    if i <= spec.layers {
        let (h, kv, f) = (spec.heads as i64, spec.kv_heads as i64, spec.ffn as i64);
        let bias =
            |name: &str, n: i64, on: bool| on.then(|| (p / name).var("bias", &[n], nn::Init::Const(0.0)));
        let head_norm =
            |name: &str| spec.qk_norm.then(|| (p / name).var("weight", &[hd], nn::Init::Const(1.0)));
        Box::new(Layer {
            attn_norm: norm("attn_norm"),
            wq: lin("wq", h * hd, d),
            wk: lin("wk", kv * hd, d),
            wv: lin("wv", kv * hd, d),
            wo: lin("wo", d, h * hd),
            bq: bias("wq", h * hd, spec.qkv_bias),
            bk: bias("wk", kv * hd, spec.qkv_bias),
            bv: bias("wv", kv * hd, spec.qkv_bias),
            bo: bias("wo", d, spec.o_bias),
            q_norm: head_norm("q_norm"),
            k_norm: head_norm("k_norm"),
            mlp_norm: norm("mlp_norm"),
            w_gate: lin("w_gate", f, d),
            w_up: lin("w_up", f, d),
            w_down: lin("w_down", d, f),
            heads: h,
            kv_heads: kv,
            head_dim: hd,
            rope: Rope { theta: spec.rope_theta, scaling: spec.rope_scaling.clone() },
            eps: spec.norm_eps,
            cast,
        })
    } else {
        let head = if spec.tie_embeddings {
            (root / "b00" / "tok_emb").get("weight").expect("a tied head is built after its embedding")
        } else {
            lin("head", v, d)
        };
        Box::new(Head { norm: norm("norm"), head, eps: spec.norm_eps, cast })
    }
}

/// `x` times `w` transposed, computed in `cast` when given (the bf16 path). Through libtorch's
/// `linear`, whose backward produces the weight's gradient in the weight's own layout (a
/// `matmul` with `w.t()` produces its transpose, which then costs a strided copy into `.grad`).
fn linear(x: &Tensor, w: &Tensor, cast: Option<Kind>) -> Tensor {
    linear_b(x, w, None, cast)
}

/// [`linear`] with an optional bias (cast with the weight).
fn linear_b(x: &Tensor, w: &Tensor, b: Option<&Tensor>, cast: Option<Kind>) -> Tensor {
    match cast {
        Some(k) => x.to_kind(k).linear(&w.to_kind(k), b.map(|b| b.to_kind(k))),
        None => x.linear(w, b),
    }
}

/// RMSNorm as Hugging Face computes it: in f32, `w * x / sqrt(mean(x^2) + eps)`.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    let x = x.to_kind(Kind::Float);
    let var = x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
    w * (x * (var + eps).rsqrt())
}

#[derive(Debug)]
struct Embed {
    tok: Tensor,
}

impl ModuleT for Embed {
    fn forward_t(&self, xs: &Tensor, _train: bool) -> Tensor {
        Tensor::embedding(&self.tok, xs, -1, false, false)
    }
}

#[derive(Debug)]
struct Layer {
    attn_norm: Tensor,
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    wo: Tensor,
    bq: Option<Tensor>,
    bk: Option<Tensor>,
    bv: Option<Tensor>,
    bo: Option<Tensor>,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    mlp_norm: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
    rope: Rope,
    eps: f64,
    cast: Option<Kind>,
}

/// The rotary embedding's base and scaling.
#[derive(Debug)]
struct Rope {
    theta: f64,
    scaling: Option<RopeScaling>,
}

impl Rope {
    /// The tables for `t` positions: cos and sin of shape `[t, head_dim]`, in f32, with the
    /// frequencies repeated over both halves (Hugging Face's layout) and scaled as the
    /// checkpoint's `rope_parameters` say.
    fn tables(&self, t: i64, head_dim: i64, device: tch::Device) -> (Tensor, Tensor) {
        let opts = (Kind::Float, device);
        let exponents = Tensor::arange_start_step(0, head_dim, 2, opts) / head_dim as f64;
        // Filled on the device: a host scalar copied there would wait for the device (a
        // synchronization in every layer's forward).
        let base = Tensor::full([0_i64; 0], f64::from(self.theta as f32), opts);
        let mut inv_freq = base.pow(&exponents).reciprocal();
        let mut scale = 1.0;
        if let Some(s) = &self.scaling {
            inv_freq = s.rescale(&inv_freq, self.theta, head_dim);
            scale = s.attention_factor();
        }
        let freqs = Tensor::arange(t, opts).unsqueeze(1) * inv_freq.unsqueeze(0);
        let emb = Tensor::cat(&[&freqs, &freqs], -1);
        if scale == 1.0 {
            (emb.cos(), emb.sin())
        } else {
            (emb.cos() * scale, emb.sin() * scale)
        }
    }
}

/// Causal attention of `q` (`[b, h, t, hd]`) over `k` and `v` (`[b, kv, t, hd]`, `kv`
/// dividing `h`): each group of `h / kv` query heads shares one K/V head, either through
/// SDPA's own grouping or, with `expand`, by repeating each K/V head for its query heads
/// first (the same values: what lets a fused kernel run where SDPA's grouping would not).
fn attend(q: &Tensor, k: &Tensor, v: &Tensor, expand: bool) -> Tensor {
    let (h, kv) = (q.size()[1], k.size()[1]);
    if !expand || h == kv {
        return Tensor::scaled_dot_product_attention::<Tensor>(q, k, v, None, 0.0, true, None, h != kv);
    }
    let repeat = |x: &Tensor| {
        let (b, _, t, hd) = x.size4().expect("[batch, heads, time, head dim]");
        x.unsqueeze(2).expand([b, kv, h / kv, t, hd], false).reshape([b, h, t, hd])
    };
    Tensor::scaled_dot_product_attention::<Tensor>(q, &repeat(k), &repeat(v), None, 0.0, true, None, false)
}

/// `x * cos + rotate_half(x) * sin` over the last dimension of `[b, h, t, hd]`.
fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let half = x.size()[3] / 2;
    let (x1, x2) = (x.narrow(-1, 0, half), x.narrow(-1, half, half));
    let rotated = Tensor::cat(&[&x2.neg(), &x1], -1);
    x * cos + rotated * sin
}

impl Layer {
    fn attention(&self, x: &Tensor) -> Tensor {
        let (b, t, _) = x.size3().expect("[batch, time, width]");
        let (h, kv, hd) = (self.heads, self.kv_heads, self.head_dim);
        let eps = self.eps;
        let split = |w: &Tensor, bias: &Option<Tensor>, norm: &Option<Tensor>, n: i64| {
            let y = linear_b(x, w, bias.as_ref(), self.cast).view([b, t, n, hd]);
            // Qwen3 normalizes each head (in f32, as its RMSNorm does) before the rotation.
            let y = match norm {
                Some(w) => rms_norm(&y, w, eps).to_kind(y.kind()),
                None => y,
            };
            y.transpose(1, 2)
        };
        let q = split(&self.wq, &self.bq, &self.q_norm, h);
        let k = split(&self.wk, &self.bk, &self.k_norm, kv);
        let v = split(&self.wv, &self.bv, &None, kv);
        let (cos, sin) = self.rope.tables(t, hd, x.device());
        let kind = q.kind();
        let (cos, sin) = (cos.to_kind(kind), sin.to_kind(kind));
        let (q, k) = (rotate(&q, &cos, &sin), rotate(&k, &cos, &sin));
        // In f32 on a GPU, SDPA's fused kernels take no grouped K/V (flash and cuDNN are
        // 16-bit only, the memory-efficient one has no GQA), so it would fall back to the
        // math kernel and keep every B x H x T x T probability for backward: K/V are
        // expanded to every query head there instead.
        let expand = h != kv && kind == Kind::Float && x.device() != tch::Device::Cpu;
        let y = attend(&q, &k, &v, expand);
        let y = y.transpose(1, 2).contiguous().view([b, t, h * hd]);
        linear_b(&y, &self.wo, self.bo.as_ref(), self.cast).to_kind(Kind::Float)
    }

    fn mlp(&self, x: &Tensor) -> Tensor {
        let gate = linear(x, &self.w_gate, self.cast).silu();
        let up = linear(x, &self.w_up, self.cast);
        linear(&(gate * up), &self.w_down, self.cast).to_kind(Kind::Float)
    }
}

impl ModuleT for Layer {
    fn forward_t(&self, xs: &Tensor, _train: bool) -> Tensor {
        let h = xs + self.attention(&rms_norm(xs, &self.attn_norm, self.eps));
        &h + self.mlp(&rms_norm(&h, &self.mlp_norm, self.eps))
    }
}

#[derive(Debug)]
struct Head {
    norm: Tensor,
    head: Tensor,
    eps: f64,
    cast: Option<Kind>,
}

impl ModuleT for Head {
    fn forward_t(&self, xs: &Tensor, _train: bool) -> Tensor {
        linear(&rms_norm(xs, &self.norm, self.eps), &self.head, self.cast).to_kind(Kind::Float)
    }
}

#[cfg(test)]
mod tests {
    use super::attend;
    use tch::{Device, Kind, Tensor};

    /// K/V heads expanded to every query head attend as SDPA's own grouping does, forward and
    /// backward (the GPU path in f32; the CPU runs both ways here).
    #[test]
    fn expanded_kv_heads_attend_as_grouped_ones() {
        tch::manual_seed(3);
        let opts = (Kind::Float, Device::Cpu);
        let q = Tensor::randn([2, 8, 16, 8], opts).set_requires_grad(true);
        let k = Tensor::randn([2, 2, 16, 8], opts).set_requires_grad(true);
        let v = Tensor::randn([2, 2, 16, 8], opts).set_requires_grad(true);
        let mut grads = Vec::new();
        let mut outs = Vec::new();
        for expand in [false, true] {
            let y = attend(&q, &k, &v, expand);
            (&y * &y).sum(Kind::Float).backward();
            grads.push([&q, &k, &v].map(|t| {
                let g = t.grad().copy();
                let _ = t.grad().zero_();
                g
            }));
            outs.push(y.detach());
        }
        assert!(outs[0].allclose(&outs[1], 1e-5, 1e-6, false), "outputs differ");
        for (a, b) in grads[0].iter().zip(&grads[1]) {
            assert!(a.allclose(b, 1e-4, 1e-5, false), "gradients differ");
        }
        // Each query head of a group sees its group's K/V head: not another's.
        let swapped = attend(&q, &k.flip([1]), &v.flip([1]), true);
        assert!(!outs[1].allclose(&swapped.detach(), 1e-3, 1e-3, false));
    }
}
