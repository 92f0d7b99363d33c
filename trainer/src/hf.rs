//! Hugging Face interop for the LLaMA model, both ways: a `LlamaForCausalLM` directory
//! (`config.json` and `model.safetensors`, or shards listed by `model.safetensors.index.json`)
//! becomes a [`LlamaSpec`] and weights under limpet's names; a state image's parameters become
//! such a directory again, which `transformers` loads with `from_pretrained`.
//!
//! limpet's LLaMA computes what Hugging Face's does with the same tensor layout, so the
//! mapping is a renaming: `model.layers.{i}.self_attn.q_proj.weight` is block `i + 1`'s
//! `wq.weight`, and so on ([`limpet_name`], [`hf_name`]).

use crate::model::{LlamaSpec, ModelSpec};
use crate::TrainerError;
use limpet_snapshot::{RawTensor, StateImage};
use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView};
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Component, Path};
use tch::{Kind, Tensor};

/// The weights file of an unsharded checkpoint.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Largest size a `config.json` may give (a vocabulary, a width): far above any real model,
/// low enough that products of two sizes cannot overflow.
const MAX_SIZE: usize = 1 << 24;
/// Largest `config.json` or index accepted.
const JSON_MAX_BYTES: u64 = 16 << 20;

/// Per-layer tensors: (Hugging Face's name inside `model.layers.{i}.`, limpet's inside block `i + 1`).
const LAYER_NAMES: &[(&str, &str)] = &[
    ("self_attn.q_proj.weight", "wq.weight"),
    ("self_attn.k_proj.weight", "wk.weight"),
    ("self_attn.v_proj.weight", "wv.weight"),
    ("self_attn.o_proj.weight", "wo.weight"),
    ("mlp.gate_proj.weight", "w_gate.weight"),
    ("mlp.up_proj.weight", "w_up.weight"),
    ("mlp.down_proj.weight", "w_down.weight"),
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "mlp_norm.weight"),
];

/// limpet's parameter name for Hugging Face's `hf` in a model of `layers` decoder layers.
pub fn limpet_name(hf: &str, layers: usize) -> Option<String> {
    let head = layers + 1;
    match hf {
        "model.embed_tokens.weight" => return Some("b00.tok_emb.weight".into()),
        "model.norm.weight" => return Some(format!("b{head:02}.norm.weight")),
        "lm_head.weight" => return Some(format!("b{head:02}.head.weight")),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (i, inner) = rest.split_once('.')?;
    let i: usize = i.parse().ok().filter(|&i| i < layers)?;
    let (_, ours) = LAYER_NAMES.iter().find(|(theirs, _)| *theirs == inner)?;
    Some(format!("b{:02}.{ours}", i + 1))
}

/// Hugging Face's name for limpet's parameter `ours` in a model of `layers` decoder layers.
pub fn hf_name(ours: &str, layers: usize) -> Option<String> {
    let (block, inner) = ours.split_once('.')?;
    let b: usize = block.strip_prefix('b')?.parse().ok()?;
    match (b, inner) {
        (0, "tok_emb.weight") => Some("model.embed_tokens.weight".into()),
        (b, "norm.weight") if b == layers + 1 => Some("model.norm.weight".into()),
        (b, "head.weight") if b == layers + 1 => Some("lm_head.weight".into()),
        (b, _) if (1..=layers).contains(&b) => {
            let (theirs, _) = LAYER_NAMES.iter().find(|(_, o)| *o == inner)?;
            Some(format!("model.layers.{}.{theirs}", b - 1))
        }
        _ => None,
    }
}

fn hf_err(path: &Path, detail: impl Into<String>) -> TrainerError {
    TrainerError::Data { path: path.to_path_buf(), detail: detail.into() }
}

fn read_json(path: &Path) -> Result<Value, TrainerError> {
    let len = std::fs::metadata(path).map_err(|e| hf_err(path, e.to_string()))?.len();
    if len > JSON_MAX_BYTES {
        return Err(hf_err(path, format!("{len} bytes is too large for this file")));
    }
    let bytes = std::fs::read(path).map_err(|e| hf_err(path, e.to_string()))?;
    serde_json::from_slice(&bytes).map_err(|e| hf_err(path, format!("not JSON: {e}")))
}

/// Reads `dir/config.json` as a LLaMA model of sequences up to `context` tokens (at most
/// the checkpoint's `max_position_embeddings`).
pub fn read_config(dir: &Path, context: Option<usize>) -> Result<LlamaSpec, TrainerError> {
    let path = dir.join("config.json");
    let cfg = read_json(&path)?;
    parse_config(&cfg, context).map_err(|m| hf_err(&path, m))
}

/// A LLaMA from the JSON of a `config.json` (untrusted: a fuzz target and property tests
/// cover it); the error names the key.
pub fn parse_config(cfg: &Value, context: Option<usize>) -> Result<LlamaSpec, String> {
    let bad = |key: &str, why: String| format!("{key}: {why}");
    let int = |key: &str| -> Result<usize, String> {
        cfg.get(key)
            .and_then(Value::as_u64)
            .and_then(|v| usize::try_from(v).ok())
            .filter(|&v| v <= MAX_SIZE)
            .ok_or_else(|| bad(key, format!("missing, or not an integer within 0..={MAX_SIZE}")))
    };
    let model_type = cfg.get("model_type").and_then(Value::as_str).unwrap_or("");
    if model_type != "llama" {
        return Err(bad(
            "model_type",
            format!("{model_type:?} is not \"llama\" (limpet imports LlamaForCausalLM)"),
        ));
    }
    if let Some(act) = cfg.get("hidden_act").and_then(Value::as_str) {
        if act != "silu" {
            return Err(bad("hidden_act", format!("{act:?}: limpet's LLaMA uses silu")));
        }
    }
    for key in ["attention_bias", "mlp_bias"] {
        if cfg.get(key).and_then(Value::as_bool) == Some(true) {
            return Err(bad(key, "biases are not supported".into()));
        }
    }
    let rope = cfg.get("rope_parameters").or_else(|| cfg.get("rope_scaling")).filter(|v| !v.is_null());
    if let Some(kind) =
        rope.and_then(|r| r.get("rope_type").or_else(|| r.get("type"))).and_then(Value::as_str)
    {
        if kind != "default" {
            return Err(bad(
                "rope_parameters.rope_type",
                format!("{kind:?}: only the default rotary embedding is supported"),
            ));
        }
    }
    let theta = rope
        .and_then(|r| r.get("rope_theta"))
        .or_else(|| cfg.get("rope_theta"))
        .and_then(Value::as_f64)
        .unwrap_or(10_000.0);
    let (d_model, heads) = (int("hidden_size")?, int("num_attention_heads")?);
    let kv_heads = if cfg.get("num_key_value_heads").is_some() { int("num_key_value_heads")? } else { heads };
    if let Some(hd) = cfg.get("head_dim").and_then(Value::as_u64) {
        if heads == 0 || hd.checked_mul(heads as u64) != Some(d_model as u64) {
            return Err(bad(
                "head_dim",
                format!("{hd} is not hidden_size / num_attention_heads ({d_model} / {heads})"),
            ));
        }
    }
    let max_pos = int("max_position_embeddings")?;
    let context = context.unwrap_or(max_pos);
    if context > max_pos {
        return Err(bad(
            "max_position_embeddings",
            format!("{max_pos} is shorter than the job's context {context}"),
        ));
    }
    let spec = LlamaSpec {
        vocab: int("vocab_size")?,
        context,
        d_model,
        layers: int("num_hidden_layers")?,
        heads,
        kv_heads,
        ffn: int("intermediate_size")?,
        rope_theta: theta,
        norm_eps: cfg.get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-6),
        tie_embeddings: cfg.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false),
    };
    ModelSpec::Llama(spec.clone()).validate().map_err(|e| e.to_string())?;
    Ok(spec)
}

/// The weight files of `dir`: the index's files in name order, or the single file.
fn weight_files(dir: &Path) -> Result<Vec<String>, TrainerError> {
    let index = dir.join(INDEX_FILE);
    if !index.exists() {
        return Ok(vec![WEIGHTS_FILE.to_string()]);
    }
    let v = read_json(&index)?;
    let map = v
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| hf_err(&index, "weight_map: missing or not an object"))?;
    let mut files = BTreeSet::new();
    for (name, file) in map {
        let f = file.as_str().ok_or_else(|| hf_err(&index, format!("weight_map.{name}: not a file name")))?;
        if !Path::new(f).components().all(|c| matches!(c, Component::Normal(_))) {
            return Err(hf_err(
                &index,
                format!("weight_map.{name}: {f:?} is not a file inside the directory"),
            ));
        }
        files.insert(f.to_string());
    }
    Ok(files.into_iter().collect())
}

/// Weights read from a Hugging Face directory, renamed to limpet's parameters, as f32.
#[derive(Debug)]
pub struct HfWeights {
    /// The model they belong to.
    pub spec: LlamaSpec,
    /// limpet's parameter name to its values.
    pub tensors: BTreeMap<String, Tensor>,
    /// blake3 over the weight files' bytes (in file-name order): recorded in the job.
    pub fingerprint: String,
}

/// Reads a Hugging Face LLaMA directory. Every tensor must be one limpet knows; missing ones
/// are reported by [`crate::model::Model::load_named`] when the weights are loaded.
pub fn read_weights(dir: &Path, context: Option<usize>) -> Result<HfWeights, TrainerError> {
    let spec = read_config(dir, context)?;
    let mut tensors = BTreeMap::new();
    let mut hasher = blake3::Hasher::new();
    for file in weight_files(dir)? {
        let path = dir.join(&file);
        let bytes = std::fs::read(&path).map_err(|e| hf_err(&path, e.to_string()))?;
        hasher.update(&bytes);
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| hf_err(&path, format!("not a safetensors file: {e}")))?;
        for (name, view) in st.tensors() {
            if name.ends_with("rotary_emb.inv_freq") {
                continue; // a buffer older checkpoints saved; limpet computes it
            }
            let ours = limpet_name(&name, spec.layers).ok_or_else(|| {
                hf_err(
                    &path,
                    format!(
                        "tensor '{name}' is not a LLaMA weight limpet knows (for {} layers)",
                        spec.layers
                    ),
                )
            })?;
            let kind = match view.dtype() {
                StDtype::F32 => Kind::Float,
                StDtype::BF16 => Kind::BFloat16,
                StDtype::F16 => Kind::Half,
                other => {
                    return Err(hf_err(
                        &path,
                        format!("tensor '{name}' has dtype {other:?}; limpet reads F32, BF16 and F16"),
                    ))
                }
            };
            let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
            let t = Tensor::f_from_data_size(view.data(), &shape, kind)?.to_kind(Kind::Float);
            if tensors.insert(ours, t).is_some() {
                return Err(hf_err(&path, format!("tensor '{name}' appears twice")));
            }
        }
    }
    Ok(HfWeights { spec, tensors, fingerprint: hasher.finalize().to_hex().to_string() })
}

/// Writes the LLaMA parameters of `image` (a whole model's state, as a checkpoint holds it)
/// as a Hugging Face directory: `config.json` and `model.safetensors` in f32.
pub fn export(image: &StateImage, dir: &Path) -> Result<(), TrainerError> {
    let job: crate::JobSpec = serde_json::from_value(image.meta().job.clone())
        .map_err(|e| TrainerError::Mismatch(format!("the checkpoint's job spec is unreadable: {e}")))?;
    let ModelSpec::Llama(spec) = &job.model else {
        return Err(TrainerError::Config("only model 'llama' exports to Hugging Face's format".into()));
    };
    let mut out: BTreeMap<String, &RawTensor> = BTreeMap::new();
    for (name, t) in image.tensors() {
        let Some(param) = name.strip_prefix("param/") else { continue };
        let theirs = hf_name(param, spec.layers).ok_or_else(|| {
            TrainerError::Mismatch(format!(
                "tensor '{name}' has no Hugging Face name in a {}-layer LLaMA",
                spec.layers
            ))
        })?;
        out.insert(theirs, t);
    }
    let blocks = spec.layers + 2;
    let has_all_blocks =
        (0..blocks).all(|b| image.tensors().keys().any(|k| k.starts_with(&format!("param/b{b:02}."))));
    if !has_all_blocks {
        return Err(TrainerError::Mismatch(
            "the image holds only some of the model's blocks (a pipeline stage's part); export a whole checkpoint".into(),
        ));
    }
    std::fs::create_dir_all(dir).map_err(|e| hf_err(dir, e.to_string()))?;
    let views = out
        .iter()
        .map(|(name, t)| {
            TensorView::new(StDtype::F32, t.shape().to_vec(), t.data())
                .map(|v| (name.clone(), v))
                .map_err(|e| TrainerError::Mismatch(format!("tensor '{name}': {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let bytes =
        safetensors::serialize(views, Some(meta)).map_err(|e| TrainerError::Mismatch(e.to_string()))?;
    limpet_snapshot::write_atomic(&dir.join(WEIGHTS_FILE), &bytes)?;
    let config = hf_config(spec);
    let mut text = serde_json::to_vec_pretty(&config).expect("a config serializes");
    text.push(b'\n');
    limpet_snapshot::write_atomic(&dir.join("config.json"), &text)?;
    Ok(())
}

/// `config.json` for `spec`, as `LlamaConfig.to_dict()` writes it (the rope theta both where
/// transformers 5 and where earlier versions look).
pub fn hf_config(spec: &LlamaSpec) -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": spec.vocab,
        "hidden_size": spec.d_model,
        "intermediate_size": spec.ffn,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim(),
        "max_position_embeddings": spec.context,
        "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_parameters": { "rope_type": "default", "rope_theta": spec.rope_theta },
        "tie_word_embeddings": spec.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "dtype": "float32",
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any bytes that are JSON: a spec or an error naming a key, never a panic.
        #[test]
        fn config_parsing_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
            if let Ok(v) = serde_json::from_slice::<Value>(&bytes) {
                let _ = parse_config(&v, None);
            }
        }

        /// What limpet writes as `config.json` reads back as the same model; a key gone or
        /// wrong is an error naming it.
        #[test]
        fn written_configs_read_back(
            layers in 1usize..40, heads in 1usize..16, group in 1usize..4, hd in 1usize..32,
            ffn in 1usize..5000, vocab in 1usize..200_000, context in 1usize..8192, tie in any::<bool>(),
            drop in 0usize..6,
        ) {
            let spec = LlamaSpec {
                vocab, context, d_model: heads * group * hd * 2, layers, heads: heads * group, kv_heads: heads,
                ffn, rope_theta: 500_000.0, norm_eps: 1e-5, tie_embeddings: tie,
            };
            let mut cfg = hf_config(&spec);
            prop_assert_eq!(parse_config(&cfg, None).unwrap(), spec);
            let key = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings"][drop];
            cfg.as_object_mut().unwrap().remove(key);
            let err = parse_config(&cfg, None).unwrap_err();
            prop_assert!(err.starts_with(key), "{}", err);
        }
    }

    #[test]
    fn names_map_both_ways() {
        let layers = 3;
        for hf in [
            "model.embed_tokens.weight",
            "model.norm.weight",
            "lm_head.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.2.mlp.down_proj.weight",
            "model.layers.1.post_attention_layernorm.weight",
        ] {
            let ours = limpet_name(hf, layers).unwrap();
            assert_eq!(hf_name(&ours, layers).as_deref(), Some(hf), "{ours}");
        }
        assert_eq!(limpet_name("model.layers.0.self_attn.q_proj.weight", 3).unwrap(), "b01.wq.weight");
        assert_eq!(limpet_name("lm_head.weight", 3).unwrap(), "b04.head.weight");
        assert_eq!(limpet_name("model.layers.3.mlp.up_proj.weight", 3), None, "layer beyond the model");
        assert_eq!(limpet_name("model.layers.0.self_attn.q_proj.bias", 3), None);
        assert_eq!(hf_name("b05.norm.weight", 3), None);
    }
}
