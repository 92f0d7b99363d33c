//! The GPT-style character transformer's blocks: embeddings, pre-norm causal self-attention
//! with an MLP, and a final norm with the vocabulary head.

use super::{DropoutRng, ModelSpec};
use rand::Rng;
use tch::nn::{self, Module, ModuleT};
use tch::{Kind, Tensor};

/// Builds block `i`: 0 embeds, the last projects to the vocabulary, the rest are layers.
pub(super) fn block(spec: &ModelSpec, i: usize, p: &nn::Path, rng: &DropoutRng) -> Box<dyn ModuleT> {
    let ModelSpec::Gpt { vocab, context, width, layers, heads, dropout } = *spec else {
        unreachable!("gpt::block called for another model")
    };
    let (v, t, d) = (vocab as i64, context as i64, width as i64);
    if i == 0 {
        Box::new(Embed {
            tok: nn::embedding(p / "tok_emb", v, d, Default::default()),
            pos: nn::embedding(p / "pos_emb", t, d, Default::default()),
        })
    } else if i <= layers {
        Box::new(Layer {
            ln1: nn::layer_norm(p / "ln1", vec![d], Default::default()),
            qkv: nn::linear(p / "qkv", d, 3 * d, Default::default()),
            proj: nn::linear(p / "proj", d, d, Default::default()),
            ln2: nn::layer_norm(p / "ln2", vec![d], Default::default()),
            fc: nn::linear(p / "fc", d, 4 * d, Default::default()),
            out: nn::linear(p / "out", 4 * d, d, Default::default()),
            heads: heads as i64,
            dropout,
            rng: rng.clone(),
        })
    } else {
        Box::new(nn::seq_t().add(nn::layer_norm(p / "ln_f", vec![d], Default::default())).add(nn::linear(
            p / "head",
            d,
            v,
            Default::default(),
        )))
    }
}

#[derive(Debug)]
struct Embed {
    tok: nn::Embedding,
    pos: nn::Embedding,
}

impl ModuleT for Embed {
    fn forward_t(&self, xs: &Tensor, _train: bool) -> Tensor {
        let t = xs.size()[1];
        let pos = Tensor::arange(t, (Kind::Int64, xs.device()));
        self.tok.forward(xs) + self.pos.forward(&pos)
    }
}

#[derive(Debug)]
struct Layer {
    ln1: nn::LayerNorm,
    qkv: nn::Linear,
    proj: nn::Linear,
    ln2: nn::LayerNorm,
    fc: nn::Linear,
    out: nn::Linear,
    heads: i64,
    dropout: f64,
    rng: DropoutRng,
}

impl Layer {
    /// Inverted dropout with masks from the model's own generator (not libtorch's global one,
    /// which other threads of the process advance): one draw from it seeds a counter-based
    /// hash of each element's index, computed where the activation is. The mask is then made
    /// on the activation's device without a host value per element, and its bits are the
    /// same on every device (integer arithmetic only).
    fn dropout(&self, x: Tensor, train: bool) -> Tensor {
        if !train || self.dropout == 0.0 {
            return x;
        }
        let keep = 1.0 - self.dropout;
        let seed = self.rng.lock().expect("dropout generator lock").random::<u64>();
        let mask = keep_mask(seed, &x.size(), keep, x.device()).to_kind(x.kind());
        x * mask * (1.0 / keep)
    }

    fn attention(&self, x: &Tensor) -> Tensor {
        let (b, t, d) = x.size3().expect("[batch, time, width]");
        let hd = d / self.heads;
        let qkv = self.qkv.forward(x).view([b, t, 3, self.heads, hd]).permute([2, 0, 3, 1, 4]);
        let (q, k, v) = (qkv.get(0), qkv.get(1), qkv.get(2));
        let att = q.matmul(&k.transpose(-2, -1)) * (1.0 / (hd as f64).sqrt());
        // Position i may attend to positions <= i only.
        let future = Tensor::ones([t, t], (Kind::Bool, x.device())).triu(1);
        let att = att.masked_fill(&future, f64::NEG_INFINITY).softmax(-1, Kind::Float);
        let y = att.matmul(&v).transpose(1, 2).contiguous().view([b, t, d]);
        self.proj.forward(&y)
    }
}

impl ModuleT for Layer {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let h = xs + self.dropout(self.attention(&self.ln1.forward(xs)), train);
        let m = self.out.forward(&self.fc.forward(&self.ln2.forward(&h)).gelu("none"));
        &h + self.dropout(m, train)
    }
}

/// Which elements of a `shape` tensor dropout keeps (a Bool tensor on `device`), each with
/// probability `keep`: a 32-bit hash of the element's index and `seed` (Wellons' lowbias32,
/// with 31-bit multipliers so every product fits an i64 and no device's overflow behaviour
/// matters), compared with `keep` scaled to 2^32.
pub(super) fn keep_mask(seed: u64, shape: &[i64], keep: f64, device: tch::Device) -> Tensor {
    const LOW: i64 = 0xffff_ffff;
    let n: i64 = shape.iter().product();
    let mix = |x: Tensor| {
        let x = x.bitwise_xor_tensor(&x.bitwise_right_shift_tensor_scalar(16));
        let x = (x * 0x7feb_352d_i64).bitwise_and(LOW);
        let x = x.bitwise_xor_tensor(&x.bitwise_right_shift_tensor_scalar(15));
        let x = (x * 0x5bd1_e995_i64).bitwise_and(LOW);
        x.bitwise_xor_tensor(&x.bitwise_right_shift_tensor_scalar(16))
    };
    let index = Tensor::arange(n, (Kind::Int64, device));
    // Both halves of the seed enter: the low one with the index, the high one after a round.
    let x = mix(index.bitwise_and(LOW).bitwise_xor(seed as i64 & LOW));
    let x = mix(x
        .bitwise_xor((seed >> 32) as i64)
        .bitwise_xor_tensor(&index.bitwise_right_shift_tensor_scalar(32)));
    let threshold = (keep * 4_294_967_296.0).round() as i64;
    x.lt(threshold).view(shape)
}

#[cfg(test)]
mod tests {
    use super::keep_mask;
    use tch::{Device, Kind};

    /// A mask keeps about `keep` of the elements, the same ones for the same seed, and
    /// others for a seed that differs in either half; the device the activation is on makes
    /// it (here the CPU; the bits are integer arithmetic, the same on a GPU).
    #[test]
    fn a_dropout_mask_is_a_pure_function_of_its_seed() {
        let shape = [4, 128, 256];
        let m = keep_mask(7, &shape, 0.9, Device::Cpu);
        assert_eq!((m.size(), m.kind(), m.device()), (shape.to_vec(), Kind::Bool, Device::Cpu));
        let kept = m.to_kind(Kind::Float).mean(Kind::Float).double_value(&[]);
        assert!((kept - 0.9).abs() < 0.005, "kept {kept}");
        assert!(m.equal(&keep_mask(7, &shape, 0.9, Device::Cpu)));
        for other in [8, 7 | (1 << 40)] {
            let same = m.eq_tensor(&keep_mask(other, &shape, 0.9, Device::Cpu));
            let agree = same.to_kind(Kind::Float).mean(Kind::Float).double_value(&[]);
            // Two independent masks at 0.9 agree on 0.9² + 0.1² = 0.82 of the elements.
            assert!((agree - 0.82).abs() < 0.01, "seed {other}: agree {agree}");
        }
        let half = keep_mask(1, &[100_000], 0.5, Device::Cpu).to_kind(Kind::Float);
        // Neighbouring elements are not correlated (a weak hash would make runs).
        let pairs = (half.narrow(0, 0, 99_999) * half.narrow(0, 1, 99_999)).mean(Kind::Float);
        assert!((pairs.double_value(&[]) - 0.25).abs() < 0.01);
    }
}
