//! What a user writes to describe a workload (`[model]` and `[data]` in `limpetd`'s TOML,
//! the same keys as `limpet train` flags) and how it becomes a [`JobSpec`] on loaded data.
//! One place, so the file and the flags cannot drift apart.

use crate::data::{DataInfo, DataSpec, Dataset};
use crate::model::script::{self, ScriptLoss, ScriptSpec};
use crate::model::{LlamaSpec, ModelSpec};
use crate::{JobSpec, ModelKind, TrainerError};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// `[model]`: sizes of the model (each key overrides the preset or the default), and the
/// same keys as `limpet train`'s flags (one definition for both; `layers` is the job's
/// `--layers` there, and the model's `context` defaults to the data's window).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, clap::Args)]
pub struct ModelSection {
    /// LLaMA size preset: tiny, small, 125m, 350m, 1b [default: tiny].
    #[serde(skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub preset: Option<String>,
    /// Layers (LLaMA decoder layers, GPT transformer blocks).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[arg(skip)]
    pub layers: Option<usize>,
    /// LLaMA residual width.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub d_model: Option<usize>,
    /// LLaMA query heads.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub heads: Option<usize>,
    /// LLaMA key/value heads (fewer than the query heads: grouped-query attention).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// LLaMA SwiGLU hidden width.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub ffn: Option<usize>,
    /// Vocabulary size [default: the data's].
    #[serde(skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Longest sequence [default: the data's window].
    #[serde(skip_serializing_if = "Option::is_none")]
    #[arg(skip)]
    pub context: Option<usize>,
    /// LLaMA rotary base.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub rope_theta: Option<f64>,
    /// LLaMA RMSNorm epsilon.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub norm_eps: Option<f64>,
    /// LLaMA: share the embedding with the head (one pipeline stage only).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub tie_embeddings: Option<bool>,
    /// Start a LLaMA from a Hugging Face directory (config.json + safetensors): its config
    /// sizes the model and its weights replace the seed's.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[arg(long, value_name = "DIR")]
    pub init_from: Option<PathBuf>,
    /// Model torchscript: the module's file, torch.jit.script or trace, saved (`path` in a
    /// file, `--module` as a flag).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[arg(long = "module", value_name = "FILE")]
    pub path: Option<PathBuf>,
    /// Model torchscript: cross_entropy or mse on its output, or module (forward(x, y)
    /// returns each sample's loss) [default: mse for float targets, else cross_entropy].
    #[serde(skip_serializing_if = "Option::is_none")]
    #[arg(long)]
    pub loss: Option<String>,
}

impl ModelSection {
    /// The same keys with `layers` (the job's `--layers` on the command line).
    pub fn with_layers(&self, layers: Option<usize>) -> ModelSection {
        ModelSection { layers, ..self.clone() }
    }
}

/// `[data]`: how samples are cut from the data.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct DataSection {
    /// Tokens per sample for `chars` and `tokens` (default 64 and 128).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub context: Option<usize>,
}

/// The data a kind names, with the section's window length.
pub fn data_spec(kind: &str, data: &DataSection, seed: u64) -> Result<DataSpec, TrainerError> {
    if data.context == Some(0) {
        return Err(TrainerError::Key { key: "[data].context".into(), detail: "must be at least 1".into() });
    }
    Ok(match kind {
        "digits" => DataSpec::Digits,
        "chars" => DataSpec::Chars { context: data.context.unwrap_or(64) },
        "tokens" => DataSpec::Tokens { context: data.context.unwrap_or(128) },
        "tensors" => DataSpec::Tensors,
        "synthetic" => DataSpec::Synthetic { samples: 4096, features: 32, classes: 8, seed },
        other => {
            return Err(TrainerError::Key {
                key: "[job].data".into(),
                detail: format!("{other:?} is not one of digits, chars, tokens, tensors, synthetic"),
            })
        }
    })
}

impl ModelSection {
    /// The size keys and whether each is set (`layers` first; `context` and `init_from` apart).
    fn size_keys(&self) -> [(&'static str, bool); 10] {
        [
            ("layers", self.layers.is_some()),
            ("preset", self.preset.is_some()),
            ("d_model", self.d_model.is_some()),
            ("heads", self.heads.is_some()),
            ("kv_heads", self.kv_heads.is_some()),
            ("ffn", self.ffn.is_some()),
            ("vocab", self.vocab.is_some()),
            ("rope_theta", self.rope_theta.is_some()),
            ("norm_eps", self.norm_eps.is_some()),
            ("tie_embeddings", self.tie_embeddings.is_some()),
        ]
    }

    /// The first key set that only LLaMA reads.
    fn llama_only_key(&self) -> Option<&'static str> {
        let extra = [("context", self.context.is_some()), ("init_from", self.init_from.is_some())];
        self.size_keys()[1..].iter().chain(&extra).find_map(|&(k, set)| set.then_some(k))
    }

    /// Checks that every key set applies to `model` (`llama`, `gpt`, or another name); the
    /// error names the key. Needs no data, so `limpetd validate` runs it.
    pub fn check_keys(&self, model: &str) -> Result<(), TrainerError> {
        let bad = |key: &str, why: &str| {
            Err(TrainerError::Key { key: format!("[model].{key}"), detail: why.into() })
        };
        if model == "torchscript" {
            if self.path.is_none() {
                return bad("path", "model torchscript needs its module file");
            }
            if let Some(l) = &self.loss {
                ScriptLoss::parse(l)
                    .map_err(|e| TrainerError::Key { key: "[model].loss".into(), detail: e.to_string() })?;
            }
            if let Some(key) = self.llama_only_key().or(self.layers.map(|_| "layers")) {
                return bad(key, "a TorchScript module's sizes are its own");
            }
            return Ok(());
        }
        for (key, set) in [("path", self.path.is_some()), ("loss", self.loss.is_some())] {
            if set {
                return bad(key, "applies to model torchscript only");
            }
        }
        if model == "llama" {
            return Ok(());
        }
        if let Some(key) = self.llama_only_key() {
            return bad(key, "applies to model llama only");
        }
        if model != "gpt" && self.layers.is_some() {
            return bad("layers", "applies to models gpt and llama only");
        }
        Ok(())
    }

    /// The model of `kind` for `data`, sized by this section. For `init_from`, also the
    /// fingerprint of the weights (recorded in the job so every rank starts from the same).
    pub fn model_for(
        &self,
        kind: ModelKind,
        data: &Dataset,
    ) -> Result<(ModelSpec, Option<String>), TrainerError> {
        if kind == ModelKind::Torchscript {
            self.check_keys("torchscript")?;
            let path = self.path.as_deref().expect("checked: torchscript has a path");
            let loss = match &self.loss {
                Some(l) => ScriptLoss::parse(l).expect("checked"),
                None if matches!(data.info, DataInfo::Regress { .. }) => ScriptLoss::Mse,
                None => ScriptLoss::CrossEntropy,
            };
            let spec = ModelSpec::Torchscript(ScriptSpec { blake3: script::register(path)?, loss });
            spec.check_data(&data.info)?;
            return Ok((spec, None));
        }
        let mut spec = ModelSpec::for_data(kind, &data.info)?;
        let bad = |key: &str, detail: String| TrainerError::Key { key: format!("[model].{key}"), detail };
        match &mut spec {
            ModelSpec::Llama(l) => {
                let DataInfo::Tokens { context: window, .. } = data.info else {
                    unreachable!("llama reads tokens")
                };
                if let Some(dir) = &self.init_from {
                    if let Some(key) = self.size_keys().iter().find_map(|&(k, set)| set.then_some(k)) {
                        return Err(bad(
                            key,
                            format!("the model's sizes come from init_from ({})", dir.display()),
                        ));
                    }
                    let imported = crate::hf::read_config(dir, Some(self.context.unwrap_or(window)))?;
                    *l = imported;
                    let fp = crate::hf::fingerprint(dir)?;
                    return Ok((spec, Some(fp)));
                }
                if let Some(p) = &self.preset {
                    *l =
                        LlamaSpec::preset(p, l.vocab, l.context).map_err(|e| bad("preset", e.to_string()))?;
                }
                let set = |slot: &mut usize, v: Option<usize>| {
                    if let Some(v) = v {
                        *slot = v;
                    }
                };
                set(&mut l.layers, self.layers);
                set(&mut l.d_model, self.d_model);
                set(&mut l.heads, self.heads);
                set(&mut l.kv_heads, self.kv_heads);
                set(&mut l.ffn, self.ffn);
                set(&mut l.vocab, self.vocab);
                set(&mut l.context, self.context);
                if let Some(t) = self.rope_theta {
                    l.rope_theta = t;
                }
                if let Some(e) = self.norm_eps {
                    l.norm_eps = e;
                }
                if let Some(t) = self.tie_embeddings {
                    l.tie_embeddings = t;
                }
            }
            ModelSpec::Gpt { layers, .. } => {
                self.check_keys("gpt")?;
                if let Some(n) = self.layers {
                    *layers = n;
                }
            }
            _ => self.check_keys("other")?,
        }
        spec.validate()?;
        spec.check_data(&data.info)?;
        Ok((spec, None))
    }
}

/// A job with limpet's defaults for `kind` on `data`, its model sized by `model`.
pub fn job_for(kind: ModelKind, data: &Dataset, model: &ModelSection) -> Result<JobSpec, TrainerError> {
    let (spec, init) = model.model_for(kind, data)?;
    let mut job = JobSpec::defaults_with(kind, spec, data);
    job.init = init;
    Ok(job)
}
