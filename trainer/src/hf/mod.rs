//! Hugging Face interop for the LLaMA family (Llama, Mistral, Qwen2, Qwen3), both ways: a
//! checkpoint directory (`config.json` and `model.safetensors`, shards listed by
//! `model.safetensors.index.json`, or PyTorch's `pytorch_model.bin` files) becomes a
//! [`LlamaSpec`] and weights under limpet's names; a state image's parameters become such a
//! directory again (safetensors shards of at most 5 GB, in f32, bf16 or f16, with
//! `generation_config.json`), which `transformers` loads with `from_pretrained`.
//!
//! limpet's LLaMA computes what Hugging Face's does with the same tensor layout, so the
//! mapping is a renaming: `model.layers.{i}.self_attn.q_proj.weight` is block `i + 1`'s
//! `wq.weight`, and so on ([`limpet_name`], [`hf_name`]).

mod config;
pub mod pickle;

pub use config::{
    generation_config, hf_config, hf_config_as, parse_config, special_token_text, tokenizer_special_tokens,
};

#[cfg(test)]
use crate::model::{Family, RopeScaling};
use crate::model::{LlamaSpec, ModelSpec};
use crate::TrainerError;
use limpet_snapshot::StateImage;
use safetensors::tensor::{Dtype as StDtype, SafeTensors, TensorView};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Component, Path};
use tch::{Kind, Tensor};

/// The weights file of an unsharded checkpoint.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// PyTorch's unsharded weights file (read when there is no safetensors file).
pub const BIN_FILE: &str = "pytorch_model.bin";
/// PyTorch's shard index.
pub const BIN_INDEX_FILE: &str = "pytorch_model.bin.index.json";
/// The largest safetensors shard export writes (`save_pretrained`'s default).
pub const MAX_SHARD_BYTES: u64 = 5_000_000_000;
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
    ("self_attn.q_proj.bias", "wq.bias"),
    ("self_attn.k_proj.bias", "wk.bias"),
    ("self_attn.v_proj.bias", "wv.bias"),
    ("self_attn.o_proj.bias", "wo.bias"),
    ("self_attn.q_norm.weight", "q_norm.weight"),
    ("self_attn.k_norm.weight", "k_norm.weight"),
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

/// The format of a checkpoint's weight files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Safetensors,
    /// `torch.save` zip archives, read by [`pickle`], which rebuilds tensors and plain
    /// containers only (what `torch.load(weights_only=True)` allows) and never runs code.
    Pickle,
}

/// The weight files of `dir` and their format: safetensors when there are any (the index's
/// files in name order, or the single file), else PyTorch's `.bin` files likewise.
fn weight_files(dir: &Path) -> Result<(Format, Vec<String>), TrainerError> {
    for (format, index, single) in
        [(Format::Safetensors, INDEX_FILE, WEIGHTS_FILE), (Format::Pickle, BIN_INDEX_FILE, BIN_FILE)]
    {
        let index = dir.join(index);
        if index.exists() {
            return Ok((format, index_files(&index)?));
        }
        if dir.join(single).exists() {
            return Ok((format, vec![single.to_string()]));
        }
    }
    Err(hf_err(
        dir,
        format!("no weights: none of {WEIGHTS_FILE}, {INDEX_FILE}, {BIN_FILE}, {BIN_INDEX_FILE}"),
    ))
}

fn index_files(index: &Path) -> Result<Vec<String>, TrainerError> {
    let v = read_json(index)?;
    let map = v
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| hf_err(index, "weight_map: missing or not an object"))?;
    let mut files = BTreeSet::new();
    for (name, file) in map {
        let f = file.as_str().ok_or_else(|| hf_err(index, format!("weight_map.{name}: not a file name")))?;
        if !Path::new(f).components().all(|c| matches!(c, Component::Normal(_))) {
            return Err(hf_err(
                index,
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

/// True when `ours` (limpet's name) is a parameter of `spec`: a bias or a head norm only
/// where the family has one.
fn is_parameter(spec: &LlamaSpec, ours: &str) -> bool {
    let inner = ours.split_once('.').map_or("", |(_, i)| i);
    match inner {
        "wq.bias" | "wk.bias" | "wv.bias" => spec.qkv_bias,
        "wo.bias" => spec.o_bias,
        "q_norm.weight" | "k_norm.weight" => spec.qk_norm,
        "head.weight" => !spec.tie_embeddings,
        _ => true,
    }
}

/// The tensors of one weight file, by their names in the file, as f32.
fn file_tensors(
    path: &Path,
    format: Format,
    hasher: &mut blake3::Hasher,
) -> Result<Vec<(String, Tensor)>, TrainerError> {
    let bytes = std::fs::read(path).map_err(|e| hf_err(path, e.to_string()))?;
    hasher.update(&bytes);
    if format == Format::Pickle {
        return pickle::read_archive(&bytes).map_err(|e| {
            hf_err(
                path,
                format!("not a PyTorch weights archive of plain tensors (torch.save of a state dict): {e}"),
            )
        });
    }
    let st =
        SafeTensors::deserialize(&bytes).map_err(|e| hf_err(path, format!("not a safetensors file: {e}")))?;
    let mut out = Vec::new();
    for (name, view) in st.tensors() {
        let kind = match view.dtype() {
            StDtype::F32 => Kind::Float,
            StDtype::BF16 => Kind::BFloat16,
            StDtype::F16 => Kind::Half,
            other => {
                return Err(hf_err(
                    path,
                    format!("tensor '{name}' has dtype {other:?}; limpet reads F32, BF16 and F16"),
                ))
            }
        };
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        out.push((name, Tensor::f_from_data_size(view.data(), &shape, kind)?.to_kind(Kind::Float)));
    }
    Ok(out)
}

/// blake3 over `dir`'s weight files' bytes, in the order [`read_weights`] reads them (its
/// `fingerprint`), without parsing them: what a job records of the weights it starts from.
pub fn fingerprint(dir: &Path) -> Result<String, TrainerError> {
    let mut hasher = blake3::Hasher::new();
    for file in weight_files(dir)?.1 {
        let path = dir.join(&file);
        let f = std::fs::File::open(&path).map_err(|e| hf_err(&path, e.to_string()))?;
        hasher.update_reader(f).map_err(|e| hf_err(&path, e.to_string()))?;
    }
    Ok(hasher.finalize().to_hex().to_string())
}

/// Reads a Hugging Face LLaMA-family directory. Every tensor must be one the model has;
/// missing ones are reported by [`crate::model::Model::load_named`] when the weights are
/// loaded.
pub fn read_weights(dir: &Path, context: Option<usize>) -> Result<HfWeights, TrainerError> {
    let spec = read_config(dir, context)?;
    let mut tensors = BTreeMap::new();
    let mut hasher = blake3::Hasher::new();
    let (format, files) = weight_files(dir)?;
    for file in files {
        let path = dir.join(&file);
        for (name, t) in file_tensors(&path, format, &mut hasher)? {
            if name.ends_with("rotary_emb.inv_freq") {
                continue; // a buffer older checkpoints saved; limpet computes it
            }
            if name == "lm_head.weight" && spec.tie_embeddings {
                continue; // a tied head saved anyway (older `.bin` files do): it is the embedding
            }
            let ours =
                limpet_name(&name, spec.layers).filter(|o| is_parameter(&spec, o)).ok_or_else(|| {
                    hf_err(
                        &path,
                        format!(
                            "tensor '{name}' is not a weight of this {} model (for {} layers)",
                            spec.family.architecture(),
                            spec.layers
                        ),
                    )
                })?;
            if tensors.insert(ours, t).is_some() {
                return Err(hf_err(&path, format!("tensor '{name}' appears twice")));
            }
        }
    }
    Ok(HfWeights { spec, tensors, fingerprint: hasher.finalize().to_hex().to_string() })
}

/// How [`export_with`] writes weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportDtype {
    /// f32, as limpet trains.
    F32,
    /// bfloat16 (rounded to nearest even).
    Bf16,
    /// float16.
    F16,
}

impl ExportDtype {
    /// Parses `f32`/`float32`, `bf16`/`bfloat16` or `f16`/`float16`.
    pub fn parse(s: &str) -> Result<Self, crate::NotOneOf> {
        match s {
            "f32" | "float32" => Ok(ExportDtype::F32),
            "bf16" | "bfloat16" => Ok(ExportDtype::Bf16),
            "f16" | "float16" => Ok(ExportDtype::F16),
            other => Err(crate::NotOneOf { got: other.into(), choices: "f32, bf16, f16" }),
        }
    }

    /// `config.json`'s spelling.
    pub fn torch_name(self) -> &'static str {
        match self {
            ExportDtype::F32 => "float32",
            ExportDtype::Bf16 => "bfloat16",
            ExportDtype::F16 => "float16",
        }
    }

    fn kinds(self) -> (Kind, StDtype) {
        match self {
            ExportDtype::F32 => (Kind::Float, StDtype::F32),
            ExportDtype::Bf16 => (Kind::BFloat16, StDtype::BF16),
            ExportDtype::F16 => (Kind::Half, StDtype::F16),
        }
    }
}

/// Writes the LLaMA parameters of `image` (a whole model's state, as a checkpoint holds it)
/// as a Hugging Face directory in the dtype the source checkpoint had (f32 for a model
/// trained from scratch), in shards of at most 5 GB.
pub fn export(image: &StateImage, dir: &Path) -> Result<(), TrainerError> {
    export_with(image, dir, None, MAX_SHARD_BYTES, None)
}

fn spec_of(image: &StateImage) -> Result<LlamaSpec, TrainerError> {
    let job: crate::JobSpec = serde_json::from_value(image.meta().job.clone())
        .map_err(|e| TrainerError::Mismatch(format!("the checkpoint's job spec is unreadable: {e}")))?;
    match job.model {
        ModelSpec::Llama(spec) => Ok(spec),
        _ => Err(TrainerError::Config("only model 'llama' exports to Hugging Face's format".into())),
    }
}

/// [`export`] in `dtype` (default: the source's) with shards of at most `max_shard` bytes
/// (a tensor larger than that gets a shard of its own, as `save_pretrained` does), and
/// `special` tokens when the model names none (a model trained from scratch: its
/// tokenizer's, see [`tokenizer_special_tokens`]).
pub fn export_with(
    image: &StateImage,
    dir: &Path,
    dtype: Option<ExportDtype>,
    max_shard: u64,
    special: Option<&crate::model::SpecialTokens>,
) -> Result<(), TrainerError> {
    let mut spec = spec_of(image)?;
    if let Some(t) = special.filter(|_| spec.special_tokens == Default::default()) {
        spec.special_tokens = t.clone();
    }
    let dtype = dtype
        .or_else(|| spec.source_dtype.as_deref().and_then(|d| ExportDtype::parse(d).ok()))
        .unwrap_or(ExportDtype::F32);
    let (kind, st_dtype) = dtype.kinds();
    let mut out: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let mut shapes: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for (name, t) in image.tensors() {
        let Some(param) = name.strip_prefix("param/") else { continue };
        let theirs = hf_name(param, spec.layers).ok_or_else(|| {
            TrainerError::Mismatch(format!(
                "tensor '{name}' has no Hugging Face name in a {}-layer LLaMA",
                spec.layers
            ))
        })?;
        let bytes = if dtype == ExportDtype::F32 {
            t.data().to_vec()
        } else {
            let shape: Vec<i64> = t.shape().iter().map(|&d| d as i64).collect();
            let f = Tensor::f_from_data_size(t.data(), &shape, Kind::Float)?.to_kind(kind);
            let mut b = vec![0u8; f.numel() * kind.elt_size_in_bytes()];
            f.f_copy_data_u8(&mut b, f.numel())?;
            b
        };
        shapes.insert(theirs.clone(), t.shape().to_vec());
        out.insert(theirs, bytes);
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
    // Shards in name order, each closed before it would pass `max_shard`.
    let mut shards: Vec<Vec<&String>> = vec![Vec::new()];
    let mut size = 0u64;
    for (name, bytes) in &out {
        let n = bytes.len() as u64;
        if size > 0 && size + n > max_shard {
            shards.push(Vec::new());
            size = 0;
        }
        shards.last_mut().expect("one shard at least").push(name);
        size += n;
    }
    let count = shards.len();
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let mut weight_map = serde_json::Map::new();
    let mut total = 0u64;
    for (i, names) in shards.iter().enumerate() {
        let file = if count == 1 {
            WEIGHTS_FILE.to_string()
        } else {
            format!("model-{:05}-of-{count:05}.safetensors", i + 1)
        };
        let views = names
            .iter()
            .map(|name| {
                total += out[*name].len() as u64;
                weight_map.insert((*name).clone(), Value::String(file.clone()));
                TensorView::new(st_dtype, shapes[*name].clone(), &out[*name])
                    .map(|v| ((*name).clone(), v))
                    .map_err(|e| TrainerError::Mismatch(format!("tensor '{name}': {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let bytes = safetensors::serialize(views, Some(meta.clone()))
            .map_err(|e| TrainerError::Mismatch(e.to_string()))?;
        limpet_snapshot::write_atomic(&dir.join(&file), &bytes)?;
    }
    if count > 1 {
        let index = serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
        write_json(&dir.join(INDEX_FILE), &index)?;
    } else if dir.join(INDEX_FILE).exists() {
        // A sharded export written here before would name shards this one does not have.
        std::fs::remove_file(dir.join(INDEX_FILE)).map_err(|e| hf_err(dir, e.to_string()))?;
    }
    write_json(&dir.join("config.json"), &hf_config_as(&spec, dtype.torch_name()))?;
    write_json(&dir.join("generation_config.json"), &generation_config(&spec))?;
    Ok(())
}

fn write_json(path: &Path, v: &Value) -> Result<(), TrainerError> {
    let mut text = serde_json::to_vec_pretty(v).expect("JSON serializes");
    text.push(b'\n');
    limpet_snapshot::write_atomic(path, &text)?;
    Ok(())
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

        /// What limpet writes as `config.json` reads back as the same model, for every
        /// family and rotary scaling; a key gone or wrong is an error naming it.
        #[test]
        fn written_configs_read_back(
            layers in 1usize..40, heads in 1usize..16, group in 1usize..4, hd in 1usize..32,
            ffn in 1usize..5000, vocab in 1usize..200_000, context in 1usize..8192, tie in any::<bool>(),
            drop in 0usize..6, family in 0usize..4, scaling in 0usize..5, wide_heads in any::<bool>(),
            eos in proptest::collection::vec(0u32..200_000, 0..3), extra in 0usize..5000,
        ) {
            let mut spec = LlamaSpec::plain(vocab, context, (layers, heads * group * hd * 2, heads * group, heads, ffn));
            spec.rope_theta = 500_000.0;
            spec.norm_eps = 1e-5;
            spec.tie_embeddings = tie;
            spec.family = Family::ALL[family].1;
            spec.qkv_bias = spec.family == Family::Qwen2;
            spec.qk_norm = spec.family == Family::Qwen3;
            if wide_heads {
                spec.head_dim = Some(hd * 4);
            }
            spec.max_positions = (extra > 0).then_some(context + extra);
            let orig = (context / 2).max(1);
            spec.rope_scaling = match scaling {
                1 => Some(RopeScaling::Linear { factor: 2.0 }),
                2 => Some(RopeScaling::Dynamic { factor: 4.0 }),
                3 => Some(RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: orig }),
                4 => Some(RopeScaling::Yarn { factor: 4.0, original_max_position_embeddings: orig, beta_fast: 32.0, beta_slow: 1.0, attention_factor: 1.1386, truncate: true }),
                _ => None,
            };
            spec.special_tokens.eos = eos;
            spec.special_tokens.bos = Some(1);
            spec.source_dtype = Some("float32".into());
            let mut cfg = hf_config(&spec);
            prop_assert_eq!(parse_config(&cfg, Some(context)).unwrap(), spec);
            let key = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings"][drop];
            cfg.as_object_mut().unwrap().remove(key);
            let err = parse_config(&cfg, None).unwrap_err().to_string();
            prop_assert!(err.starts_with(key), "{}", err);
        }
    }

    /// Configs an attacker (or a sloppy converter) writes: refused naming the key, or read
    /// as transformers reads them; never a panic, never a silently different model.
    #[test]
    fn odd_configs_are_named_or_read_as_transformers_reads_them() {
        let base = || {
            let mut c = hf_config(&LlamaSpec::plain(97, 32, (2, 64, 4, 2, 176)));
            c["max_position_embeddings"] = 64.into();
            c
        };
        let err = |edit: &dyn Fn(&mut Value)| {
            let mut c = base();
            edit(&mut c);
            parse_config(&c, None).unwrap_err().to_string()
        };
        let e = err(&|c| {
            c["model_type"] = "qwen2".into();
            c["use_sliding_window"] = true.into();
            c["sliding_window"] = 64.into();
            c["layer_types"] = serde_json::json!([]);
        });
        assert!(e.starts_with("layer_types: 0 entries for 2 layers"), "{e}");
        assert!(err(&|c| c["rms_norm_eps"] = "tiny".into()).starts_with("rms_norm_eps"));
        let e = err(&|c| {
            c["model_type"] = "qwen2".into();
            c["sliding_window"] = 64.into();
            c["use_sliding_window"] = 1.into();
        });
        assert!(e.starts_with("use_sliding_window: not true or false"), "{e}");
        let e = err(&|c| {
            c["vocab_size"] = (1 << 24).into();
            c["hidden_size"] = (1 << 24).into();
            c["num_attention_heads"] = 1.into();
            c["num_key_value_heads"] = 1.into();
            c["head_dim"] = 64.into();
        });
        assert!(e.contains("elements in one tensor"), "{e}");
        let e = err(&|c| c["head_dim"] = (1 << 20).into());
        assert!(e.contains("head width (1048576) exceeds"), "{e}");
        let e = err(&|c| c["rope_parameters"] = serde_json::json!({"rope_type": "linear", "factor": 1e-300}));
        assert!(e.contains("rope_scaling.factor"), "{e}");
        // `rope_type: null` beside the older `type`, and a null theta inside the object.
        let mut c = base();
        c["rope_parameters"] =
            serde_json::json!({"rope_type": null, "type": "linear", "factor": 2.0, "rope_theta": null});
        c["rope_theta"] = 500_000.0.into();
        let l = parse_config(&c, None).unwrap();
        assert_eq!((l.rope_scaling, l.rope_theta), (Some(RopeScaling::Linear { factor: 2.0 }), 500_000.0));
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
        assert_eq!(limpet_name("model.layers.0.self_attn.q_proj.bias", 3).unwrap(), "b01.wq.bias");
        let mut qwen2 = LlamaSpec::plain(10, 8, (3, 8, 2, 1, 16));
        assert!(!is_parameter(&qwen2, "b01.wq.bias"), "a Llama has no q bias");
        qwen2.qkv_bias = true;
        assert!(is_parameter(&qwen2, "b01.wq.bias") && !is_parameter(&qwen2, "b01.wo.bias"));
        assert!(!is_parameter(&qwen2, "b01.q_norm.weight"));
        assert_eq!(hf_name("b05.norm.weight", 3), None);
    }
}
