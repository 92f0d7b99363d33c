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
    /// which other threads of the process advance).
    fn dropout(&self, x: Tensor, train: bool) -> Tensor {
        if !train || self.dropout == 0.0 {
            return x;
        }
        let keep = 1.0 - self.dropout;
        let scale = (1.0 / keep) as f32;
        let mut rng = self.rng.lock().expect("dropout generator lock");
        let mask: Vec<f32> =
            (0..x.numel()).map(|_| if rng.random::<f64>() < keep { scale } else { 0.0 }).collect();
        let shape = x.size();
        x * Tensor::from_slice(&mask).view(shape.as_slice())
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
