//! Models as a sequence of blocks, so a pipeline stage can own a contiguous range of them.
//!
//! Parameters are named `bNN.<layer>.<tensor>` after their block, so a model built from a
//! block range has exactly the names (and initial values) those blocks have in the full model.
//! Initialization draws from a ChaCha stream keyed by the seed and the parameter's name rather
//! than from libtorch's global generator: it is the same on every host, thread and build.

mod gpt;
mod llama;
mod llama_spec;
mod memory;
mod presets;
pub mod script;

pub use llama_spec::{Family, LlamaSpec, RopeScaling, SlidingWindow, SpecialTokens};
pub use memory::MemoryPlan;
pub use presets::LLAMA_PRESETS;

use crate::data::DataInfo;
use crate::TrainerError;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use tch::nn::{self, ModuleT};
use tch::{Device, Kind, Reduction, Tensor};

/// The number format the forward and backward passes compute in. Parameters, optimizer
/// state, gradients and state images stay f32 either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything in f32.
    #[default]
    Fp32,
    /// Matrix products and attention in bfloat16, with f32 master weights, norms and loss.
    Bf16,
}

impl Precision {
    /// Parses `fp32` or `bf16`.
    pub fn parse(s: &str) -> Result<Self, crate::NotOneOf> {
        match s {
            "fp32" => Ok(Precision::Fp32),
            "bf16" => Ok(Precision::Bf16),
            other => Err(crate::NotOneOf { got: other.into(), choices: "fp32, bf16" }),
        }
    }

    /// The kind matrix products are cast to, if any.
    pub(crate) fn compute_kind(self) -> Option<Kind> {
        match self {
            Precision::Fp32 => None,
            Precision::Bf16 => Some(Kind::BFloat16),
        }
    }
}

/// What a classifier or regressor minimizes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Loss {
    /// Softmax cross-entropy against class labels.
    #[default]
    CrossEntropy,
    /// Mean squared error against float targets (per sample: the mean over its outputs).
    Mse,
}

impl Loss {
    fn is_cross_entropy(&self) -> bool {
        *self == Loss::CrossEntropy
    }
}

/// Architecture and sizes of a model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum ModelSpec {
    /// Linear+ReLU blocks, then a linear classifier (or regression) block.
    Mlp {
        /// Input features.
        inputs: usize,
        /// Width of each hidden block.
        hidden: Vec<usize>,
        /// Output classes (or regression outputs).
        classes: usize,
        /// The loss on the outputs (absent in older images: cross-entropy).
        #[serde(default, skip_serializing_if = "Loss::is_cross_entropy")]
        loss: Loss,
    },
    /// 3x3 conv blocks (the last one max-pools), a dense block, and a classifier block.
    Convnet {
        /// Image height.
        height: usize,
        /// Image width.
        width: usize,
        /// Output channels of each conv block.
        channels: Vec<usize>,
        /// Width of the dense block.
        hidden: usize,
        /// Output classes.
        classes: usize,
    },
    /// Token+position embedding block, pre-norm transformer blocks, and a norm+head block.
    Gpt {
        /// Vocabulary size.
        vocab: usize,
        /// Longest sequence.
        context: usize,
        /// Embedding width.
        width: usize,
        /// Transformer blocks.
        layers: usize,
        /// Attention heads (must divide `width`).
        heads: usize,
        /// Dropout probability after attention and MLP (0 keeps training exactly reproducible
        /// across world sizes).
        dropout: f64,
    },
    /// LLaMA-family decoder: embedding block, decoder-layer blocks, and a norm+head block.
    Llama(LlamaSpec),
    /// A TorchScript module (one block; its file holds the initial weights).
    Torchscript(script::ScriptSpec),
}

impl ModelSpec {
    /// Checks that this model reads the data shaped like `info`.
    pub fn check_data(&self, info: &DataInfo) -> Result<(), TrainerError> {
        let fits = match (self, info) {
            (
                ModelSpec::Mlp { inputs, classes, loss, .. },
                DataInfo::Classify { features, classes: c, .. },
            ) => inputs == features && classes == c && *loss == Loss::CrossEntropy,
            (ModelSpec::Mlp { inputs, classes, loss, .. }, DataInfo::Regress { features, outputs }) => {
                inputs == features && classes == outputs && *loss == Loss::Mse
            }
            (
                ModelSpec::Convnet { height, width, classes, .. },
                DataInfo::Classify { image, classes: c, .. },
            ) => *image == Some((*height, *width)) && classes == c,
            (ModelSpec::Gpt { vocab, context, .. }, DataInfo::Tokens { vocab: v, context: t }) => {
                vocab == v && context >= t
            }
            (ModelSpec::Torchscript(s), info) => match (s.loss, info) {
                (script::ScriptLoss::Module, _) => true,
                (script::ScriptLoss::Mse, DataInfo::Regress { .. }) => true,
                (script::ScriptLoss::CrossEntropy, DataInfo::Classify { .. } | DataInfo::Tokens { .. }) => {
                    true
                }
                (loss, _) => {
                    return Err(TrainerError::Config(format!(
                        "[model].loss {:?} does not fit data shaped {info:?} (cross_entropy takes class labels or tokens, mse takes float targets)",
                        format!("{loss:?}").to_lowercase()
                    )))
                }
            },
            (ModelSpec::Llama(l), DataInfo::Tokens { vocab: v, context: t }) => {
                if l.vocab < *v {
                    return Err(TrainerError::Config(format!(
                        "model vocab ({}) is smaller than the data's vocabulary ({v}): token ids up to {} would be out of range",
                        l.vocab,
                        v - 1
                    )));
                }
                if l.context < *t {
                    return Err(TrainerError::Config(format!(
                        "model context ({}) is shorter than the data's windows ({t})",
                        l.context
                    )));
                }
                true
            }
            _ => false,
        };
        if fits {
            Ok(())
        } else {
            Err(TrainerError::Config(format!("model {self:?} cannot read data shaped {info:?}")))
        }
    }

    /// Number of blocks.
    pub fn num_blocks(&self) -> usize {
        match self {
            ModelSpec::Mlp { hidden, .. } => hidden.len() + 1,
            ModelSpec::Convnet { channels, .. } => channels.len() + 2,
            ModelSpec::Gpt { layers, .. } => layers + 2,
            ModelSpec::Llama(l) => l.layers + 2,
            ModelSpec::Torchscript(_) => 1,
        }
    }

    /// Bytes block `i`'s backward pass keeps per sample: the inputs of its matrix products
    /// and the outputs of its nonlinearities, counted from the architecture (libtorch's CPU
    /// allocator does not report what autograd holds). The planner's memory estimate.
    pub fn saved_bytes_per_sample(&self, i: usize) -> u64 {
        let floats = match self {
            ModelSpec::Mlp { inputs, hidden, classes, .. } => {
                let fan_in = if i == 0 { *inputs } else { hidden[i - 1] };
                let out = hidden.get(i).unwrap_or(classes);
                fan_in + 2 * out
            }
            ModelSpec::Convnet { height, width, channels, hidden, classes } => {
                let px = height * width;
                if i < channels.len() {
                    let cin = if i == 0 { 1 } else { channels[i - 1] };
                    let pool = if i + 1 == channels.len() { channels[i] * px / 4 } else { 0 };
                    cin * px + 2 * channels[i] * px + pool
                } else if i == channels.len() {
                    channels.last().copied().unwrap_or(0) * px / 4 + 2 * hidden
                } else {
                    hidden + 2 * classes
                }
            }
            ModelSpec::Gpt { vocab, context, width, layers, heads, .. } => {
                let (t, d) = (*context, *width);
                if i == 0 {
                    t * d + t
                } else if i <= *layers {
                    // ln1, qkv, scores and probabilities, attention output, projection,
                    // residual, ln2, fc and gelu (4d each), output.
                    t * (19 * d + 2 * heads * t)
                } else {
                    t * (2 * d + 2 * vocab)
                }
            }
            ModelSpec::Llama(l) => {
                let (t, d, f) = (l.context, l.d_model, l.ffn);
                if i == 0 {
                    t
                } else if i <= l.layers {
                    // Norm input and output, q, k, v, rotated q and k, attention output and its
                    // log-sum-exp, projection; norm, gate, up, silu, product, down.
                    let (kvd, qd) = (l.kv_heads * l.head_dim(), l.q_dim());
                    t * (6 * d + 2 * qd + 4 * kvd + l.heads + 4 * f)
                } else {
                    t * (2 * d + 2 * l.vocab)
                }
            }
            // A script's graph is opaque: the planner cannot estimate it (and never splits it).
            ModelSpec::Torchscript(_) => 0,
        };
        (floats as u64).saturating_mul(4)
    }

    /// True when the model predicts every position of a sequence (per-sample loss is a mean
    /// over positions).
    pub fn is_sequence(&self) -> bool {
        matches!(self, ModelSpec::Gpt { .. } | ModelSpec::Llama(_))
    }

    /// Checks the sizes; the error names the field.
    pub fn validate(&self) -> Result<(), TrainerError> {
        let bad = |m: &str| Err(TrainerError::Config(format!("model: {m}")));
        match self {
            ModelSpec::Mlp { inputs, hidden, classes, .. } => {
                if *inputs == 0 || *classes == 0 || hidden.contains(&0) {
                    return bad("mlp sizes must be at least 1");
                }
            }
            ModelSpec::Convnet { height, width, channels, hidden, classes } => {
                if *height < 2
                    || *width < 2
                    || channels.is_empty()
                    || channels.contains(&0)
                    || *hidden == 0
                    || *classes == 0
                {
                    return bad("convnet needs an image of at least 2x2 and non-zero sizes");
                }
            }
            ModelSpec::Gpt { vocab, context, width, layers, heads, dropout } => {
                if *vocab == 0 || *context == 0 || *layers == 0 || *heads == 0 || width % heads != 0 {
                    return bad("gpt needs non-zero sizes and heads dividing width");
                }
                if !(0.0..1.0).contains(dropout) {
                    return bad("gpt dropout must be within [0, 1)");
                }
            }
            ModelSpec::Llama(l) => l.validate()?,
            ModelSpec::Torchscript(s) => {
                if s.blake3.len() != 64 || !s.blake3.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return bad("torchscript blake3 must be 64 hex digits");
                }
            }
        }
        Ok(())
    }
}

/// The generator stochastic layers draw from, owned by one model and reseeded by the trainer.
pub(crate) type DropoutRng = Arc<Mutex<ChaCha8Rng>>;

/// Builds block `i` of `spec` under path `p`.
fn build_block(
    spec: &ModelSpec,
    precision: Precision,
    i: usize,
    root: &nn::Path,
    rng: &DropoutRng,
) -> Box<dyn ModuleT> {
    let p = &(root / format!("b{i:02}"));
    let lin = |p: nn::Path, a: usize, b: usize| nn::linear(p, a as i64, b as i64, Default::default());
    match spec {
        ModelSpec::Mlp { inputs, hidden, classes, .. } => {
            let fan_in = if i == 0 { *inputs } else { hidden[i - 1] };
            if i < hidden.len() {
                Box::new(nn::seq_t().add(lin(p / "fc", fan_in, hidden[i])).add_fn(|x| x.relu()))
            } else {
                Box::new(lin(p / "fc", fan_in, *classes))
            }
        }
        ModelSpec::Convnet { height, width, channels, hidden, classes } => {
            let (h, w) = (*height as i64, *width as i64);
            let conv_cfg = nn::ConvConfig { padding: 1, ..Default::default() };
            if i < channels.len() {
                let cin = if i == 0 { 1 } else { channels[i - 1] as i64 };
                let conv = nn::conv2d(p / "conv", cin, channels[i] as i64, 3, conv_cfg);
                let last = i + 1 == channels.len();
                let first = i == 0;
                Box::new(
                    nn::seq_t()
                        .add_fn(move |x| if first { x.view([-1, 1, h, w]) } else { x.shallow_clone() })
                        .add(conv)
                        .add_fn(move |x| if last { x.relu().max_pool2d_default(2) } else { x.relu() }),
                )
            } else if i == channels.len() {
                let flat = *channels.last().expect("validated non-empty") as i64 * (h / 2) * (w / 2);
                Box::new(
                    nn::seq_t()
                        .add_fn(|x| x.flatten(1, -1))
                        .add(lin(p / "fc", flat as usize, *hidden))
                        .add_fn(|x| x.relu()),
                )
            } else {
                Box::new(lin(p / "fc", *hidden, *classes))
            }
        }
        ModelSpec::Gpt { .. } => gpt::block(spec, i, p, rng),
        ModelSpec::Llama(l) => llama::block(l, precision, i, root),
        ModelSpec::Torchscript(_) => unreachable!("a TorchScript block is loaded by Model::build"),
    }
}

/// A model, or a contiguous range of its blocks, with its parameters.
#[derive(Debug)]
pub struct Model {
    spec: ModelSpec,
    blocks: Range<usize>,
    layers: Vec<Box<dyn ModuleT>>,
    params: Vec<(String, Tensor)>,
    device: Device,
    dropout_rng: DropoutRng,
    /// The module, when the model is TorchScript (also the one block in `layers`).
    script: Option<Arc<script::Scripted>>,
    // Owns the variables the layers refer to.
    _vs: nn::VarStore,
}

impl Model {
    /// Builds the whole model with parameters initialized from `seed`.
    pub fn new(spec: &ModelSpec, seed: u64) -> Result<Self, TrainerError> {
        Self::with_blocks(spec, 0..spec.num_blocks(), seed)
    }

    /// Builds blocks `blocks` of the model (a pipeline stage) on the CPU in f32.
    pub fn with_blocks(spec: &ModelSpec, blocks: Range<usize>, seed: u64) -> Result<Self, TrainerError> {
        Self::build(spec, blocks, seed, Device::Cpu, Precision::Fp32)
    }

    /// Builds blocks `blocks` of the model with its parameters on `device`, computing in
    /// `precision`.
    pub fn build(
        spec: &ModelSpec,
        blocks: Range<usize>,
        seed: u64,
        device: Device,
        precision: Precision,
    ) -> Result<Self, TrainerError> {
        spec.validate()?;
        if blocks.start >= blocks.end || blocks.end > spec.num_blocks() {
            return Err(TrainerError::Config(format!(
                "block range {blocks:?} is not within the model's {} blocks",
                spec.num_blocks()
            )));
        }
        if let ModelSpec::Llama(l) = spec {
            if l.tie_embeddings && blocks.end == spec.num_blocks() && blocks.start > 0 {
                return Err(TrainerError::Config(format!(
                    "model.tie_embeddings: the head shares block 0's embedding, so blocks {blocks:?} cannot be a stage of their own (untie it to split the model)"
                )));
            }
        }
        if precision == Precision::Bf16 && !matches!(spec, ModelSpec::Llama(_)) {
            return Err(TrainerError::Config(
                "precision \"bf16\" is available for model 'llama' only".into(),
            ));
        }
        let vs = nn::VarStore::new(device);
        let root = vs.root();
        let dropout_rng = Arc::new(Mutex::new(ChaCha8Rng::seed_from_u64(seed)));
        let (layers, script) = if let ModelSpec::Torchscript(s) = spec {
            let m = Arc::new(script::Scripted::load(s, &root)?);
            let block: Box<dyn ModuleT> = Box::new(script::ScriptBlock(Arc::clone(&m)));
            (vec![block], Some(m))
        } else {
            (blocks.clone().map(|i| build_block(spec, precision, i, &root, &dropout_rng)).collect(), None)
        };
        let mut params: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        // A script starts from the weights its file holds.
        if script.is_none() {
            let hf_init = matches!(spec, ModelSpec::Llama(_));
            for (name, t) in &params {
                init_param(name, t, seed, hf_init);
            }
        }
        Ok(Model { spec: spec.clone(), blocks, layers, params, device, dropout_rng, script, _vs: vs })
    }

    /// The spec this model was built from.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Where the parameters live.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Which blocks this model holds.
    pub fn blocks(&self) -> Range<usize> {
        self.blocks.clone()
    }

    /// Parameters sorted by name.
    pub fn params(&self) -> &[(String, Tensor)] {
        &self.params
    }

    /// Total number of parameter elements.
    pub fn num_elements(&self) -> usize {
        self.params.iter().map(|(_, t)| t.numel()).sum()
    }

    /// True when training-mode forward passes draw random numbers (dropout).
    pub fn is_stochastic(&self) -> bool {
        matches!(self.spec, ModelSpec::Gpt { dropout, .. } if dropout > 0.0)
    }

    /// Restarts the stochastic layers' generator at `seed`.
    pub fn seed_dropout(&self, seed: u64) {
        *self.dropout_rng.lock().expect("dropout generator lock") = ChaCha8Rng::seed_from_u64(seed);
    }

    /// Replaces the parameters with `tensors` (by limpet's names, f32, on any device):
    /// imported weights. Every parameter this model holds must be there with its shape;
    /// tensors of blocks it does not hold (another stage's) are not used. Nothing changes
    /// when one does not fit.
    pub fn load_named(&self, tensors: &BTreeMap<String, Tensor>) -> Result<(), TrainerError> {
        for (name, p) in &self.params {
            let t = tensors.get(name).ok_or_else(|| {
                TrainerError::Mismatch(format!("tensor '{name}' is missing from the imported weights"))
            })?;
            if t.size() != p.size() {
                return Err(TrainerError::Mismatch(format!(
                    "tensor '{name}' has shape {:?}, the model needs {:?}",
                    t.size(),
                    p.size()
                )));
            }
        }
        tch::no_grad(|| -> Result<(), TrainerError> {
            for (name, p) in &self.params {
                p.shallow_clone().f_copy_(&tensors[name].to_kind(Kind::Float))?;
            }
            Ok(())
        })
    }

    /// Runs block `i` (an index into the whole model; it must be one this model holds).
    pub fn block_forward(&self, i: usize, xs: &Tensor, train: bool) -> Tensor {
        assert!(self.blocks.contains(&i), "block {i} is not among {:?}", self.blocks);
        self.layers[i - self.blocks.start].forward_t(xs, train)
    }

    /// Parameters of block `i`, sorted by name.
    pub fn block_params(&self, i: usize) -> Vec<(String, Tensor)> {
        let prefix = format!("b{i:02}.");
        self.params
            .iter()
            .filter(|(n, _)| n.starts_with(&prefix))
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect()
    }

    /// Runs the blocks in order.
    pub fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.layers.iter().fold(xs.shallow_clone(), |x, l| l.forward_t(&x, train))
    }

    /// The model's outputs for `x` (none when a TorchScript module computes its own loss)
    /// and the sum over samples of each sample's loss against `y`. Errors are a module's
    /// (TorchScript checks shapes and types only when it runs).
    pub fn forward_loss(
        &self,
        x: &Tensor,
        y: &Tensor,
        train: bool,
    ) -> Result<(Option<Tensor>, Tensor), TrainerError> {
        if let Some(m) = &self.script {
            if m.loss() == script::ScriptLoss::Module {
                return Ok((None, m.loss_sum(x, y, train)?));
            }
            let out = m.forward(x, train)?;
            let loss = self.checked_loss(&out, y)?;
            return Ok((Some(out), loss));
        }
        let out = self.forward_t(x, train);
        let loss = self.loss_sum(&out, y);
        Ok((Some(out), loss))
    }

    /// [`Model::loss_sum`] for a module's outputs, whose shapes are whatever it made.
    fn checked_loss(&self, out: &Tensor, y: &Tensor) -> Result<Tensor, TrainerError> {
        let (os, ys) = (out.size(), y.size());
        let fits = if self.is_regression() {
            out.numel() == y.numel() && os.first() == ys.first()
        } else {
            os.len() == ys.len() + 1 && os[..ys.len()] == ys[..]
        };
        if !fits {
            return Err(TrainerError::Config(format!(
                "the TorchScript module returned shape {os:?} for targets of shape {ys:?}: {}",
                if self.is_regression() {
                    "mse needs one prediction per target value"
                } else {
                    "cross_entropy needs the targets' shape plus a class dimension"
                }
            )));
        }
        Ok(self.loss_sum(out, y))
    }

    fn is_regression(&self) -> bool {
        matches!(
            self.spec,
            ModelSpec::Mlp { loss: Loss::Mse, .. }
                | ModelSpec::Torchscript(script::ScriptSpec { loss: script::ScriptLoss::Mse, .. })
        )
    }

    /// Sum over samples of each sample's loss (mean over positions for sequence models).
    /// Summing, not averaging, is what makes gradients of shares add up to the global batch's.
    pub fn loss_sum(&self, logits: &Tensor, targets: &Tensor) -> Tensor {
        if self.is_regression() {
            let per_sample = (targets.numel() / targets.size()[0].max(1) as usize).max(1);
            let diff = logits - targets.to_kind(Kind::Float).view_as(logits);
            return (&diff * &diff).sum(Kind::Float) / per_sample as f64;
        }
        let v = *logits.size().last().expect("logits have a class dimension");
        let ce = logits.view([-1, v]).cross_entropy_loss::<Tensor>(
            &targets.view(-1),
            None,
            Reduction::Sum,
            -100,
            0.0,
        );
        if self.spec.is_sequence() || targets.dim() == 2 {
            ce / targets.size()[1] as f64
        } else {
            ce
        }
    }

    /// Sum over samples of the fraction of positions predicted right (1 or 0 for classifiers).
    pub fn correct(&self, logits: &Tensor, targets: &Tensor) -> f64 {
        if self.is_regression() {
            return 0.0; // regression has no right or wrong; its test loss is the MSE
        }
        let hits = logits.argmax(-1, false).eq_tensor(targets).to_kind(Kind::Double).sum(Kind::Double);
        let per = if targets.dim() == 2 { targets.size()[1] as f64 } else { 1.0 };
        hits.double_value(&[]) / per
    }
}

/// Fills one parameter: weights of rank >= 2 from U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (PyTorch's
/// default for linear and conv layers), or from N(0, 0.02) with `hf_init` (what Hugging Face's
/// `LlamaPreTrainedModel` draws from its `initializer_range`, which LLaMA recipes train from);
/// embeddings from N(0, 0.02) (GPT-2); norm scales with 1; biases with 0.
fn init_param(name: &str, t: &Tensor, seed: u64, hf_init: bool) {
    let shape = t.size();
    let n = t.numel();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(u64::from_le_bytes(
        blake3::hash(name.as_bytes()).as_bytes()[..8].try_into().expect("8 bytes"),
    ));
    let normal = |rng: &mut ChaCha8Rng| 0.02 * rng.sample::<f32, _>(rand_distr::StandardNormal);
    let values: Vec<f32> =
        if name.contains("emb") || (hf_init && name.ends_with("weight") && shape.len() >= 2) {
            (0..n).map(|_| normal(&mut rng)).collect()
        } else if name.ends_with("weight") && shape.len() >= 2 {
            let bound = 1.0 / (shape[1..].iter().product::<i64>() as f32).sqrt();
            (0..n).map(|_| rng.random_range(-bound..bound)).collect()
        } else if name.ends_with("weight") {
            vec![1.0; n]
        } else {
            vec![0.0; n]
        };
    tch::no_grad(|| {
        let mut t = t.shallow_clone();
        t.copy_(&Tensor::from_slice(&values).view(shape.as_slice()));
    });
}

#[cfg(test)]
mod tests;
