//! The LLaMA family's description: sizes, the variants that open checkpoints use (rotary
//! scaling, an explicit head width, q/k/v biases, q/k norms, a sliding window) and what a
//! Hugging Face export writes back (the family, special token ids, the source's dtype).
//!
//! Llama 2/3, Mistral, Qwen2/2.5 and Qwen3 compute the same decoder up to these flags, so
//! one implementation ([`super::llama`]) serves them all; every new field defaults to what
//! the plain LLaMA had, so state images and jobs written before they existed read the same.

use crate::Malformed;
use crate::TrainerError;
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

/// The Hugging Face architecture a LLaMA-shaped model came from (and is exported as).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// `LlamaForCausalLM` (Llama 2, 3, 3.1, 3.2, 3.3).
    #[default]
    Llama,
    /// `MistralForCausalLM`.
    Mistral,
    /// `Qwen2ForCausalLM` (Qwen2, Qwen2.5): biases on q, k and v.
    Qwen2,
    /// `Qwen3ForCausalLM`: RMSNorm over each query and key head.
    Qwen3,
}

impl Family {
    /// All families, as `config.json`'s `model_type` spells them.
    pub const ALL: [(&'static str, Family); 4] = [
        ("llama", Family::Llama),
        ("mistral", Family::Mistral),
        ("qwen2", Family::Qwen2),
        ("qwen3", Family::Qwen3),
    ];

    /// `config.json`'s `model_type`.
    pub fn model_type(self) -> &'static str {
        Self::ALL.iter().find(|(_, f)| *f == self).map(|(n, _)| *n).expect("every family is listed")
    }

    /// `config.json`'s `architectures[0]`.
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    fn is_llama(&self) -> bool {
        *self == Family::Llama
    }
}

/// Rotary scaling, as Hugging Face's `rope_parameters` (`rope_scaling` before) names it. Each
/// variant rescales the default inverse frequencies the way `modeling_rope_utils` does.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "lowercase", deny_unknown_fields)]
pub enum RopeScaling {
    /// Positions divided by `factor` (Code Llama, "linear").
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// Dynamic NTK: the default frequencies at every length up to `max_position_embeddings`,
    /// which is all limpet trains at (a longer context is refused).
    Dynamic {
        /// Applies past `max_position_embeddings` only.
        factor: f64,
    },
    /// Llama 3.1's piecewise scaling of low and medium frequencies.
    Llama3 {
        /// Divisor of the low frequencies (8 in Llama 3.1).
        factor: f64,
        /// Wavelengths above `original / low_freq_factor` are divided by `factor`.
        low_freq_factor: f64,
        /// Wavelengths below `original / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The pretraining context (8192 in Llama 3.1).
        original_max_position_embeddings: usize,
    },
    /// YaRN: interpolation blended with extrapolation by a ramp over the dimensions, and cos/sin
    /// multiplied by `attention_factor`.
    Yarn {
        /// Context extension factor.
        factor: f64,
        /// The pretraining context.
        original_max_position_embeddings: usize,
        /// Rotations bounding the ramp from above (32 by default).
        beta_fast: f64,
        /// Rotations bounding the ramp from below (1 by default).
        beta_slow: f64,
        /// Scale of cos and sin (resolved from `mscale` when the source left it out).
        attention_factor: f64,
        /// Round the ramp's bounds to whole dimensions (the default).
        truncate: bool,
    },
}

impl RopeScaling {
    /// The factor cos and sin are multiplied by.
    pub fn attention_factor(&self) -> f64 {
        match self {
            RopeScaling::Yarn { attention_factor, .. } => *attention_factor,
            _ => 1.0,
        }
    }

    /// `inv_freq` (the default inverse frequencies of a `dim`-wide head, f32) rescaled.
    pub(crate) fn rescale(&self, inv_freq: &Tensor, theta: f64, dim: i64) -> Tensor {
        match self {
            RopeScaling::Linear { factor } => inv_freq / *factor,
            RopeScaling::Dynamic { .. } => inv_freq.shallow_clone(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: old,
            } => {
                let old = *old as f64;
                let wavelen = inv_freq.reciprocal() * (2.0 * std::f64::consts::PI);
                let (low_wl, high_wl) = (old / low, old / high);
                let long = wavelen.gt(low_wl);
                let scaled = (inv_freq / *factor).where_self(&long, inv_freq);
                let smooth = (wavelen.reciprocal() * old - *low) / (high - low);
                let smoothed = (smooth.ones_like() - &smooth) * &scaled / *factor + &smooth * &scaled;
                let medium = wavelen.ge(high_wl).logical_and(&wavelen.le(low_wl));
                smoothed.where_self(&medium, &scaled)
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                let orig = *original_max_position_embeddings as f64;
                let d = dim as f64;
                let correction = |rotations: f64| {
                    (d * (orig / (rotations * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * theta.ln())
                };
                let (mut low, mut high) = (correction(*beta_fast), correction(*beta_slow));
                if *truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
                if low == high {
                    high += 0.001; // as the reference does, against a zero-width ramp
                }
                let ramp = ((Tensor::arange(dim / 2, (Kind::Float, inv_freq.device())) - low) / (high - low))
                    .clamp(0.0, 1.0);
                let extrapolate = ramp.ones_like() - ramp;
                let interpolated = inv_freq / *factor;
                &interpolated * (extrapolate.ones_like() - &extrapolate) + inv_freq * &extrapolate
            }
        }
    }

    fn validate(&self, max_positions: usize, context: usize) -> Result<(), Malformed> {
        // Factors outside [1e-3, 1e6] are no real model's and make the frequencies infinite.
        let positive = |name: &str, v: f64| {
            if v.is_finite() && (1e-3..=1e6).contains(&v) {
                Ok(())
            } else {
                Err(Malformed(format!("rope_scaling.{name} ({v}) must be a number within [0.001, 1e6]")))
            }
        };
        match self {
            RopeScaling::Linear { factor } => positive("factor", *factor),
            RopeScaling::Dynamic { factor } => {
                positive("factor", *factor)?;
                if context > max_positions {
                    return Err(Malformed(format!(
                        "rope_scaling.rope_type \"dynamic\": the context {context} exceeds max_position_embeddings {max_positions}, where dynamic scaling changes with the length (only shorter contexts are computed exactly)"
                    )));
                }
                Ok(())
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                positive("factor", *factor)?;
                positive("low_freq_factor", *low_freq_factor)?;
                positive("high_freq_factor", *high_freq_factor)?;
                if high_freq_factor <= low_freq_factor {
                    return Err(Malformed(format!(
                        "rope_scaling.high_freq_factor ({high_freq_factor}) must exceed low_freq_factor ({low_freq_factor})"
                    )));
                }
                if *original_max_position_embeddings == 0 {
                    return Err(Malformed(
                        "rope_scaling.original_max_position_embeddings must be at least 1".into(),
                    ));
                }
                Ok(())
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                ..
            } => {
                positive("factor", *factor)?;
                positive("beta_fast", *beta_fast)?;
                positive("beta_slow", *beta_slow)?;
                positive("attention_factor", *attention_factor)?;
                if *original_max_position_embeddings == 0 {
                    return Err(Malformed(
                        "rope_scaling.original_max_position_embeddings must be at least 1".into(),
                    ));
                }
                Ok(())
            }
        }
    }
}

/// A sliding attention window (Mistral; Qwen with `use_sliding_window`). limpet computes full
/// causal attention, which is the same thing while the context fits the window, so a longer
/// context is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlidingWindow {
    /// Tokens a position may attend to.
    pub window: usize,
    /// The first decoder layer (0-based) that slides (Qwen's `max_window_layers`).
    pub first_layer: usize,
}

/// The special token ids a checkpoint's `config.json` names (export writes them back, so
/// `generate` stops where the tokenizer says).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpecialTokens {
    /// Beginning of sequence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bos: Option<u32>,
    /// End of sequence (Llama 3 instruct models name several).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub eos: Vec<u32>,
    /// Padding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pad: Option<u32>,
}

impl SpecialTokens {
    fn is_empty(&self) -> bool {
        *self == SpecialTokens::default()
    }
}

/// Sizes of a LLaMA-family decoder (the names are Hugging Face's `LlamaConfig` fields where
/// one exists: `d_model` is `hidden_size`, `ffn` is `intermediate_size`, `kv_heads` is
/// `num_key_value_heads`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlamaSpec {
    /// Vocabulary size.
    pub vocab: usize,
    /// Longest sequence.
    pub context: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads (must divide `d_model` unless `head_dim` is given).
    pub heads: usize,
    /// Key/value heads (must divide `heads`; fewer than `heads` is grouped-query attention).
    pub kv_heads: usize,
    /// Hidden width of the SwiGLU MLP.
    pub ffn: usize,
    /// Base of the rotary embedding's frequencies.
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// RMSNorm's epsilon.
    #[serde(default = "default_norm_eps")]
    pub norm_eps: f64,
    /// The vocabulary head reuses the token embedding (the whole model must be one stage).
    #[serde(default)]
    pub tie_embeddings: bool,
    /// Width of one attention head when it is not `d_model / heads` (Qwen3, Gemma-style).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// Rotary scaling (none: the default frequencies).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    /// Biases on the q, k and v projections (Qwen2; `attention_bias`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub qkv_bias: bool,
    /// A bias on the output projection (`attention_bias` in Llama and Qwen3).
    #[serde(default, skip_serializing_if = "is_false")]
    pub o_bias: bool,
    /// RMSNorm over each query and key head before the rotation (Qwen3).
    #[serde(default, skip_serializing_if = "is_false")]
    pub qk_norm: bool,
    /// Which architecture this is (for export).
    #[serde(default, skip_serializing_if = "Family::is_llama")]
    pub family: Family,
    /// The checkpoint's `max_position_embeddings` when it exceeds `context` (export keeps it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_positions: Option<usize>,
    /// The sliding window the source declares.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<SlidingWindow>,
    /// Special token ids (from the checkpoint, or the tokenizer a from-scratch job read).
    #[serde(default, skip_serializing_if = "SpecialTokens::is_empty")]
    pub special_tokens: SpecialTokens,
    /// The source weights' dtype (`bfloat16`, `float16`, `float32`): export's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_dtype: Option<String>,
}

/// Widest attention head accepted (real models use 64 to 256).
const MAX_HEAD_DIM: usize = 2048;
/// Most elements one tensor of a model may have (2^36: 256 GiB in f32, past any GPU).
const MAX_TENSOR_ELEMENTS: u64 = 1 << 36;

fn is_false(b: &bool) -> bool {
    !*b
}

pub(super) fn default_rope_theta() -> f64 {
    10_000.0
}

fn default_norm_eps() -> f64 {
    1e-5
}

impl LlamaSpec {
    /// A plain LLaMA of these sizes (default rotary base and norm epsilon, no variants).
    pub fn plain(
        vocab: usize,
        context: usize,
        (layers, d_model, heads, kv_heads, ffn): (usize, usize, usize, usize, usize),
    ) -> Self {
        LlamaSpec {
            vocab,
            context,
            d_model,
            layers,
            heads,
            kv_heads,
            ffn,
            rope_theta: default_rope_theta(),
            norm_eps: default_norm_eps(),
            tie_embeddings: false,
            head_dim: None,
            rope_scaling: None,
            qkv_bias: false,
            o_bias: false,
            qk_norm: false,
            family: Family::Llama,
            max_positions: None,
            sliding_window: None,
            special_tokens: SpecialTokens::default(),
            source_dtype: None,
        }
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.d_model / self.heads.max(1))
    }

    /// Width of all query heads together (`d_model` unless `head_dim` says otherwise).
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim()
    }

    /// `max_position_embeddings`: the checkpoint's, or the context.
    pub fn max_positions(&self) -> usize {
        self.max_positions.unwrap_or(self.context).max(self.context)
    }

    /// Number of parameter elements.
    pub fn num_params(&self) -> u64 {
        let (v, d, f) = (self.vocab as u64, self.d_model as u64, self.ffn as u64);
        let kvd = (self.kv_heads * self.head_dim()) as u64;
        let qd = self.q_dim() as u64;
        let mut layer = 2 * d + 2 * d * qd + 2 * d * kvd + 3 * d * f;
        if self.qkv_bias {
            layer += qd + 2 * kvd;
        }
        if self.o_bias {
            layer += d;
        }
        if self.qk_norm {
            layer += 2 * self.head_dim() as u64;
        }
        let head = if self.tie_embeddings { 0 } else { v * d };
        v * d + self.layers as u64 * layer + d + head
    }

    pub(super) fn validate(&self) -> Result<(), TrainerError> {
        let bad = |m: String| Err(TrainerError::Config(format!("model: {m}")));
        for (name, v) in [
            ("vocab", self.vocab),
            ("context", self.context),
            ("d_model", self.d_model),
            ("layers", self.layers),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("ffn", self.ffn),
        ] {
            if v == 0 {
                return bad(format!("llama {name} must be at least 1"));
            }
        }
        match self.head_dim {
            Some(0) => return bad("llama head_dim must be at least 1".into()),
            Some(_) => {}
            None if self.d_model % self.heads != 0 => {
                return bad(format!("llama heads ({}) must divide d_model ({})", self.heads, self.d_model))
            }
            None => {}
        }
        if self.heads % self.kv_heads != 0 {
            return bad(format!("llama kv_heads ({}) must divide heads ({})", self.kv_heads, self.heads));
        }
        if self.head_dim() % 2 != 0 {
            return bad(format!("llama head width ({}) must be even for rotary embeddings", self.head_dim()));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return bad(format!("llama rope_theta ({}) must be a number above 1", self.rope_theta));
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return bad(format!("llama norm_eps ({}) must be a positive number", self.norm_eps));
        }
        let max_positions = self.max_positions.unwrap_or(self.context);
        if self.context > max_positions {
            return bad(format!(
                "llama context ({}) exceeds max_position_embeddings ({max_positions})",
                self.context
            ));
        }
        if let Some(r) = &self.rope_scaling {
            r.validate(max_positions, self.context)
                .map_err(|m| TrainerError::Config(format!("model: {m}")))?;
        }
        // Each size is bounded alone; their products must be too (a tensor of 2^48 elements
        // passes every size check and then aborts the process that allocates it).
        if self.head_dim() > MAX_HEAD_DIM {
            return bad(format!("llama head width ({}) exceeds {MAX_HEAD_DIM}", self.head_dim()));
        }
        let d = self.d_model as u64;
        for (what, elements) in [
            ("vocab x d_model", (self.vocab as u64).checked_mul(d)),
            ("heads x head width x d_model", (self.q_dim() as u64).checked_mul(d)),
            ("ffn x d_model", (self.ffn as u64).checked_mul(d)),
            ("context x head width", (self.context as u64).checked_mul(self.head_dim() as u64)),
        ] {
            if elements.is_none_or(|e| e > MAX_TENSOR_ELEMENTS) {
                return bad(format!(
                    "llama {what} is more than {MAX_TENSOR_ELEMENTS} elements in one tensor"
                ));
            }
        }
        if let Some(w) = self.sliding_window {
            if w.first_layer < self.layers && self.context > w.window {
                return bad(format!(
                    "sliding_window: the context {} exceeds the window of {} tokens (limpet computes full attention, which equals windowed attention only within the window)",
                    self.context, w.window
                ));
            }
        }
        Ok(())
    }
}
