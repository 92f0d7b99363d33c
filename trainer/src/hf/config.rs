//! `config.json` both ways for the LLaMA family: a checkpoint's config becomes a
//! [`LlamaSpec`] (every key that would change what is computed is read or refused, naming
//! the key), and a spec becomes the config its family's `from_pretrained` reads.

use crate::model::{Family, LlamaSpec, ModelSpec, RopeScaling, SlidingWindow, SpecialTokens};
use crate::Malformed;
use serde_json::{json, Map, Value};

/// Largest size a `config.json` may give (a vocabulary, a width): far above any real model,
/// low enough that products of two sizes cannot overflow.
const MAX_SIZE: usize = 1 << 24;

fn bad(key: &str, why: impl std::fmt::Display) -> Malformed {
    Malformed(format!("{key}: {why}"))
}

/// A LLaMA-family model from the JSON of a `config.json` (untrusted: a fuzz target and
/// property tests cover it) for sequences of `context` tokens (default: the checkpoint's
/// `max_position_embeddings`, which bounds it); the error names the key.
pub fn parse_config(cfg: &Value, context: Option<usize>) -> Result<LlamaSpec, Malformed> {
    let get = |key: &str| cfg.get(key).filter(|v| !v.is_null());
    let int = |key: &str| -> Result<usize, Malformed> {
        get(key)
            .and_then(Value::as_u64)
            .and_then(|v| usize::try_from(v).ok())
            .filter(|&v| v <= MAX_SIZE)
            .ok_or_else(|| bad(key, format!("missing, or not an integer within 0..={MAX_SIZE}")))
    };
    let opt_int = |key: &str| get(key).map(|_| int(key)).transpose();
    let flag = |key: &str| -> Result<bool, Malformed> {
        match get(key) {
            None => Ok(false),
            Some(v) => v.as_bool().ok_or_else(|| bad(key, "not true or false")),
        }
    };
    let model_type = get("model_type").and_then(Value::as_str).unwrap_or("");
    let family = Family::ALL.iter().find(|(n, _)| *n == model_type).map(|(_, f)| *f).ok_or_else(|| {
        let names: Vec<&str> = Family::ALL.iter().map(|(n, _)| *n).collect();
        bad(
            "model_type",
            format!("{model_type:?} is not one of {} (the LLaMA family limpet computes)", names.join(", ")),
        )
    })?;
    if let Some(act) = get("hidden_act") {
        if act.as_str() != Some("silu") {
            return Err(bad("hidden_act", format!("{act}: limpet's LLaMA uses silu")));
        }
    }
    if flag("mlp_bias")? {
        return Err(bad("mlp_bias", "biases in the MLP are not supported"));
    }
    let attention_bias = flag("attention_bias")?;
    let (qkv_bias, o_bias) = match family {
        // Qwen2 hard-codes biases on q, k and v (and none on o), whatever the config says.
        Family::Qwen2 => (true, false),
        Family::Mistral if attention_bias => {
            return Err(bad("attention_bias", "Mistral has no attention biases"));
        }
        _ => (attention_bias, attention_bias),
    };
    if let Some(f) = get("partial_rotary_factor") {
        if f.as_f64() != Some(1.0) {
            return Err(bad(
                "partial_rotary_factor",
                format!("{f}: only a rotation over the whole head is supported"),
            ));
        }
    }
    let (d_model, heads) = (int("hidden_size")?, int("num_attention_heads")?);
    let kv_heads = opt_int("num_key_value_heads")?.unwrap_or(heads);
    let head_dim = match opt_int("head_dim")? {
        Some(hd) if heads > 0 && hd * heads == d_model => None,
        Some(hd) => Some(hd),
        None => None,
    };
    let max_pos = int("max_position_embeddings")?;
    let context = context.unwrap_or(max_pos);
    if context > max_pos {
        return Err(bad(
            "max_position_embeddings",
            format!("{max_pos} is shorter than the job's context {context}"),
        ));
    }
    let (rope_theta, rope_scaling) = rope(cfg, max_pos)?;
    let sliding_window = sliding(cfg, family, int("num_hidden_layers")?)?;
    let spec = LlamaSpec {
        vocab: int("vocab_size")?,
        context,
        d_model,
        layers: int("num_hidden_layers")?,
        heads,
        kv_heads,
        ffn: int("intermediate_size")?,
        rope_theta,
        norm_eps: match get("rms_norm_eps") {
            None => 1e-6,
            Some(v) => v.as_f64().ok_or_else(|| bad("rms_norm_eps", "not a number"))?,
        },
        tie_embeddings: flag("tie_word_embeddings")?,
        head_dim,
        rope_scaling,
        qkv_bias,
        o_bias,
        qk_norm: family == Family::Qwen3,
        family,
        max_positions: (max_pos > context).then_some(max_pos),
        sliding_window,
        special_tokens: special_tokens(cfg)?,
        source_dtype: source_dtype(cfg)?,
    };
    ModelSpec::Llama(spec.clone()).validate().map_err(|e| e.to_string()).map_err(Malformed)?;
    Ok(spec)
}

/// The rotary base and scaling, from `rope_parameters` (transformers 5) or `rope_scaling`
/// and `rope_theta` (earlier), whichever the file has.
fn rope(cfg: &Value, max_pos: usize) -> Result<(f64, Option<RopeScaling>), Malformed> {
    let (r, key) = match cfg.get("rope_parameters").filter(|v| !v.is_null()) {
        Some(r) => (Some(r), "rope_parameters"),
        None => (cfg.get("rope_scaling").filter(|v| !v.is_null()), "rope_scaling"),
    };
    let empty = Map::new();
    let r = match r {
        None => &empty,
        Some(v) => v.as_object().ok_or_else(|| bad(key, "not an object"))?,
    };
    if r.keys().any(|k| k.ends_with("_attention")) {
        return Err(bad(key, "rotary parameters per layer type are not supported"));
    }
    let theta = r
        .get("rope_theta")
        .filter(|v| !v.is_null())
        .or_else(|| cfg.get("rope_theta"))
        .filter(|v| !v.is_null())
        .map(|v| v.as_f64().ok_or_else(|| bad("rope_theta", "not a number")))
        .transpose()?
        .unwrap_or(10_000.0);
    let named = |k: &str| r.get(k).filter(|v| !v.is_null());
    let kind = match named("rope_type").or_else(|| named("type")) {
        None => "default",
        Some(v) => {
            v.as_str().ok_or_else(|| bad(&format!("{key}.rope_type"), format!("{v} is not a name")))?
        }
    };
    let num = |name: &str| -> Result<Option<f64>, Malformed> {
        match r.get(name).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| bad(&format!("{key}.{name}"), "not a number")),
        }
    };
    let need = |name: &str| {
        num(name)?
            .ok_or_else(|| bad(&format!("{key}.{name}"), format!("missing (rope_type {kind:?} needs it)")))
    };
    let original = || -> Result<usize, Malformed> {
        let v =
            r.get("original_max_position_embeddings").or_else(|| cfg.get("original_max_position_embeddings"));
        match v.filter(|v| !v.is_null()) {
            None => Ok(max_pos),
            Some(v) => v
                .as_u64()
                .and_then(|v| usize::try_from(v).ok())
                .filter(|&v| (1..=MAX_SIZE).contains(&v))
                .ok_or_else(|| {
                    bad(&format!("{key}.original_max_position_embeddings"), "not a positive integer")
                }),
        }
    };
    let scaling = match kind {
        "default" => None,
        "linear" => Some(RopeScaling::Linear { factor: need("factor")? }),
        "dynamic" => Some(RopeScaling::Dynamic { factor: need("factor")? }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: need("factor")?,
            low_freq_factor: need("low_freq_factor")?,
            high_freq_factor: need("high_freq_factor")?,
            original_max_position_embeddings: original()?,
        }),
        "yarn" => {
            let orig = original()?;
            let factor = num("factor")?.unwrap_or(max_pos as f64 / orig as f64);
            let mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
            let attention_factor = match (num("attention_factor")?, num("mscale")?, num("mscale_all_dim")?) {
                (Some(a), _, _) => a,
                (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                    mscale(factor, m) / mscale(factor, all)
                }
                _ => mscale(factor, 1.0),
            };
            let truncate = match r.get("truncate").filter(|v| !v.is_null()) {
                None => true,
                Some(v) => v.as_bool().ok_or_else(|| bad(&format!("{key}.truncate"), "not true or false"))?,
            };
            // The reference treats 0 like absent (`or 32`).
            let beta = |name: &str, default: f64| {
                Ok::<_, String>(num(name)?.filter(|b| *b != 0.0).unwrap_or(default))
            };
            Some(RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: orig,
                beta_fast: beta("beta_fast", 32.0).map_err(Malformed)?,
                beta_slow: beta("beta_slow", 1.0).map_err(Malformed)?,
                attention_factor,
                truncate,
            })
        }
        other => {
            return Err(bad(
                &format!("{key}.rope_type"),
                format!("{other:?} is not one of default, linear, dynamic, llama3, yarn"),
            ))
        }
    };
    Ok((theta, scaling))
}

/// The sliding window in force, if any layer slides.
fn sliding(cfg: &Value, family: Family, layers: usize) -> Result<Option<SlidingWindow>, Malformed> {
    let window = match cfg.get("sliding_window").filter(|v| !v.is_null()) {
        None => return Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| bad("sliding_window", "not a positive integer or null"))?,
    };
    let first_layer = match family {
        Family::Llama => return Err(bad("sliding_window", "a Llama model does not slide")),
        Family::Mistral => 0,
        Family::Qwen2 | Family::Qwen3 => {
            match cfg.get("use_sliding_window").filter(|v| !v.is_null()) {
                None | Some(Value::Bool(false)) => return Ok(None),
                Some(Value::Bool(true)) => {}
                Some(_) => return Err(bad("use_sliding_window", "not true or false")),
            }
            match cfg.get("layer_types").filter(|v| !v.is_null()) {
                Some(types) => {
                    let types = types.as_array().ok_or_else(|| bad("layer_types", "not a list"))?;
                    if types.len() != layers {
                        return Err(bad(
                            "layer_types",
                            format!("{} entries for {layers} layers", types.len()),
                        ));
                    }
                    let slides: Vec<bool> =
                        types.iter().map(|t| t.as_str() == Some("sliding_attention")).collect();
                    let first = slides.iter().position(|s| *s).unwrap_or(layers);
                    if slides[first..].iter().any(|s| !s) {
                        return Err(bad(
                            "layer_types",
                            "full attention after a sliding layer is not supported",
                        ));
                    }
                    first
                }
                None => match cfg.get("max_window_layers").filter(|v| !v.is_null()) {
                    None => 28,
                    Some(v) => v
                        .as_u64()
                        .and_then(|v| usize::try_from(v).ok())
                        .ok_or_else(|| bad("max_window_layers", "not a non-negative integer"))?,
                },
            }
        }
    };
    Ok(Some(SlidingWindow { window, first_layer }))
}

fn special_tokens(cfg: &Value) -> Result<SpecialTokens, Malformed> {
    let id = |key: &str, v: &Value| {
        v.as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .ok_or_else(|| bad(key, format!("{v} is not a token id")))
    };
    let one = |key: &str| cfg.get(key).filter(|v| !v.is_null()).map(|v| id(key, v)).transpose();
    let eos = match cfg.get("eos_token_id").filter(|v| !v.is_null()) {
        None => Vec::new(),
        Some(Value::Array(ids)) => ids.iter().map(|v| id("eos_token_id", v)).collect::<Result<_, _>>()?,
        Some(v) => vec![id("eos_token_id", v)?],
    };
    Ok(SpecialTokens { bos: one("bos_token_id")?, eos, pad: one("pad_token_id")? })
}

fn source_dtype(cfg: &Value) -> Result<Option<String>, Malformed> {
    let named = |k: &'static str| cfg.get(k).filter(|v| !v.is_null()).map(|v| (k, v));
    let Some((key, v)) = named("dtype").or_else(|| named("torch_dtype")) else { return Ok(None) };
    match v.as_str() {
        Some(d @ ("float32" | "bfloat16" | "float16")) => Ok(Some(d.to_string())),
        _ => Err(bad(key, format!("{v} is not one of float32, bfloat16, float16"))),
    }
}

/// The `rope_parameters` object for `spec` (both spellings' keys: `rope_type` and `type`).
fn rope_json(spec: &LlamaSpec) -> Value {
    let mut r = match &spec.rope_scaling {
        None => json!({ "rope_type": "default" }),
        Some(s) => serde_json::to_value(s).expect("a rope scaling serializes"),
    };
    r["rope_theta"] = json!(spec.rope_theta);
    r
}

/// `config.json` for `spec` in its family's spelling, as `to_dict()` writes it (the rotary
/// parameters both where transformers 5 and where earlier versions look), with `dtype` the
/// weights' dtype.
pub fn hf_config(spec: &LlamaSpec) -> Value {
    hf_config_as(spec, "float32")
}

/// [`hf_config`] for weights written as `dtype`.
pub fn hf_config_as(spec: &LlamaSpec, dtype: &str) -> Value {
    let rope = rope_json(spec);
    let mut c = json!({
        "architectures": [spec.family.architecture()],
        "model_type": spec.family.model_type(),
        "vocab_size": spec.vocab,
        "hidden_size": spec.d_model,
        "intermediate_size": spec.ffn,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim(),
        "max_position_embeddings": spec.max_positions(),
        "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_parameters": rope,
        "tie_word_embeddings": spec.tie_embeddings,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "torch_dtype": dtype,
        "dtype": dtype,
    });
    let o = c.as_object_mut().expect("an object");
    if spec.rope_scaling.is_some() {
        let mut old = o["rope_parameters"].clone();
        old["type"] = old["rope_type"].clone();
        o.insert("rope_scaling".into(), old);
    }
    match spec.family {
        Family::Qwen2 => {}
        Family::Mistral => {}
        Family::Llama | Family::Qwen3 => {
            o.insert("attention_bias".into(), json!(spec.o_bias));
        }
    }
    if spec.family == Family::Llama {
        o.insert("mlp_bias".into(), json!(false));
    }
    match (spec.family, spec.sliding_window) {
        (Family::Mistral, w) => {
            o.insert("sliding_window".into(), json!(w.map(|w| w.window)));
        }
        (Family::Qwen2 | Family::Qwen3, Some(w)) => {
            o.insert("use_sliding_window".into(), json!(true));
            o.insert("sliding_window".into(), json!(w.window));
            o.insert("max_window_layers".into(), json!(w.first_layer));
        }
        (Family::Qwen2 | Family::Qwen3, None) => {
            o.insert("use_sliding_window".into(), json!(false));
        }
        (Family::Llama, _) => {}
    }
    let t = &spec.special_tokens;
    if let Some(b) = t.bos {
        o.insert("bos_token_id".into(), json!(b));
    }
    match t.eos.as_slice() {
        [] => {}
        [one] => {
            o.insert("eos_token_id".into(), json!(one));
        }
        many => {
            o.insert("eos_token_id".into(), json!(many));
        }
    }
    if let Some(p) = t.pad {
        o.insert("pad_token_id".into(), json!(p));
    }
    c
}

/// `generation_config.json` for `spec`: the special tokens `generate` needs.
pub fn generation_config(spec: &LlamaSpec) -> Value {
    let c = hf_config(spec);
    let mut g = json!({ "_from_model_config": true });
    for key in ["bos_token_id", "eos_token_id", "pad_token_id"] {
        if let Some(v) = c.get(key) {
            g[key] = v.clone();
        }
    }
    g
}

/// A special token's text as `tokenizer_config.json` gives it: a string, or an object with
/// its `content`.
pub fn special_token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// The special tokens of the tokenizer in `dir` (`tokenizer.json`, and the
/// `tokenizer_config.json` beside it, which `limpet data tokenize` copies beside the shards):
/// its `bos_token` and `eos_token` (or a trained BPE's `<|endoftext|>`) as ids of its added
/// tokens. What `limpet export --tokenizer` writes for a model trained from scratch, so
/// `generate` stops where the text does.
/// Unreadable or absent files give no tokens: these ids are metadata, not the data.
pub fn tokenizer_special_tokens(dir: &std::path::Path) -> SpecialTokens {
    let read = |name: &str| -> Option<Value> {
        let path = dir.join(name);
        let len = std::fs::metadata(&path).ok()?.len();
        if len > 64 << 20 {
            return None;
        }
        serde_json::from_slice(&std::fs::read(path).ok()?).ok()
    };
    let Some(tok) = read("tokenizer.json") else { return SpecialTokens::default() };
    let added = tok.get("added_tokens").and_then(Value::as_array).cloned().unwrap_or_default();
    let id_of = |text: &str| {
        added
            .iter()
            .find(|t| t.get("content").and_then(Value::as_str) == Some(text))
            .and_then(|t| t.get("id").and_then(Value::as_u64).and_then(|i| u32::try_from(i).ok()))
    };
    let cfg = read("tokenizer_config.json");
    let text = |key: &str| special_token_text(cfg.as_ref().and_then(|c| c.get(key)));
    let eos = text("eos_token").and_then(|t| id_of(&t)).or_else(|| id_of("<|endoftext|>"));
    SpecialTokens {
        bos: text("bos_token").and_then(|t| id_of(&t)),
        eos: eos.into_iter().collect(),
        pad: None,
    }
}
