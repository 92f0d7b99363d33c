//! Presets: the sizes limpet picks when a job names none, the named LLaMA sizes
//! (`[model].preset`) and each kind's default model for the data it trains on.

use super::{LlamaSpec, Loss, ModelSpec};
use crate::data::DataInfo;
use crate::{ModelKind, TrainerError};

/// Named LLaMA sizes, smallest first: `(name, layers, d_model, heads, kv_heads, ffn)`.
/// `1b` has the shape of Llama 3.2 1B (with the vocabulary the data brings).
pub const LLAMA_PRESETS: &[(&str, usize, usize, usize, usize, usize)] = &[
    ("tiny", 2, 64, 4, 2, 176),
    ("small", 4, 256, 8, 4, 688),
    ("125m", 12, 768, 12, 4, 2048),
    ("350m", 24, 1024, 16, 8, 2816),
    ("1b", 16, 2048, 32, 8, 8192),
];

impl LlamaSpec {
    /// The preset `name` for a vocabulary of `vocab` tokens and sequences of `context`.
    pub fn preset(name: &str, vocab: usize, context: usize) -> Result<Self, TrainerError> {
        let &(_, layers, d_model, heads, kv_heads, ffn) =
            LLAMA_PRESETS.iter().find(|p| p.0 == name).ok_or_else(|| {
                let names: Vec<&str> = LLAMA_PRESETS.iter().map(|p| p.0).collect();
                TrainerError::Config(format!("model.preset {name:?} is not one of {}", names.join(", ")))
            })?;
        Ok(Self::plain(vocab, context, (layers, d_model, heads, kv_heads, ffn)))
    }
}

impl ModelSpec {
    /// limpet's default model of `kind` for data shaped like `info`.
    pub fn for_data(kind: ModelKind, info: &DataInfo) -> Result<Self, TrainerError> {
        let spec = match (kind, info) {
            (ModelKind::Torchscript, _) => {
                return Err(TrainerError::Config(
                    "model 'torchscript' needs its module file ([model].path, or --script)".into(),
                ))
            }
            (ModelKind::Mlp, DataInfo::Classify { features, classes, .. }) => ModelSpec::Mlp {
                inputs: *features,
                hidden: vec![128, 128],
                classes: *classes,
                loss: Loss::CrossEntropy,
            },
            (ModelKind::Mlp, DataInfo::Regress { features, outputs }) => ModelSpec::Mlp {
                inputs: *features,
                hidden: vec![128, 128],
                classes: *outputs,
                loss: Loss::Mse,
            },
            (_, DataInfo::Regress { .. }) => {
                return Err(TrainerError::Config(
                    format!(
                        "model '{kind:?}' classifies or predicts tokens; regression targets need model 'mlp'"
                    )
                    .to_lowercase(),
                ))
            }
            (ModelKind::Convnet, DataInfo::Classify { classes, image: Some((h, w)), .. }) => {
                ModelSpec::Convnet {
                    height: *h,
                    width: *w,
                    channels: vec![16, 32],
                    hidden: 64,
                    classes: *classes,
                }
            }
            (ModelKind::Convnet, DataInfo::Classify { image: None, .. }) => {
                return Err(TrainerError::Config("model 'convnet' needs image data (digits)".into()))
            }
            (ModelKind::Llama, DataInfo::Tokens { vocab, context }) => {
                ModelSpec::Llama(LlamaSpec::preset("tiny", *vocab, *context)?)
            }
            (ModelKind::Gpt, DataInfo::Tokens { vocab, context }) => ModelSpec::Gpt {
                vocab: *vocab,
                context: *context,
                width: 64,
                layers: 2,
                heads: 4,
                dropout: 0.0,
            },
            (ModelKind::Gpt | ModelKind::Llama, DataInfo::Classify { .. }) => {
                return Err(TrainerError::Config(
                    format!("model '{kind:?}' needs token sequences (data 'chars' or 'tokens')")
                        .to_lowercase(),
                ))
            }
            (_, DataInfo::Tokens { .. }) => {
                return Err(TrainerError::Config(
                    format!("model '{kind:?}' classifies; token data needs model 'gpt' or 'llama'")
                        .to_lowercase(),
                ))
            }
        };
        Ok(spec)
    }
}
