//! Hugging Face interop against the real other side: `transformers` from PyPI (installed by
//! deploy/setup.sh) saves a tiny random `LlamaForCausalLM`, limpet loads it and computes the
//! same logits; limpet trains, exports, and `transformers` loads the export and computes the
//! logits limpet does. Bad directories give errors that name the tensor or key.

use limpet_trainer::data::tokens::write_dataset;
use limpet_trainer::data::{DataSpec, Dataset};
use limpet_trainer::model::{Family, LlamaSpec, Model, ModelSpec, RopeScaling};
use limpet_trainer::workload::{job_for, ModelSection};
use limpet_trainer::{hf, ModelKind, NoReduce, Trainer};
use std::path::{Path, PathBuf};
use std::process::Command;
use tch::{Kind, Tensor};

/// The setup's venv Python: `LIMPET_PYTHON`, else the clone's `.limpet/python` wrapper.
fn python() -> PathBuf {
    std::env::var_os("LIMPET_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.limpet/python"))
}

fn hf_side(args: &[&str]) {
    let out = Command::new(python())
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/hf_llama.py"))
        .args(args)
        .env("OMP_NUM_THREADS", "1")
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("the setup's Python (make setup installs transformers)");
    assert!(out.status.success(), "hf_llama.py {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Every variant the Python side makes: each exercises what its family computes differently.
const VARIANTS: &[&str] =
    &["untied", "tied", "bin", "bf16", "llama3", "yarn", "linear", "dynamic", "mistral", "qwen2", "qwen3"];

/// Tokens per sequence: past the llama3 variant's original context (40) and yarn's (16).
const T: i64 = 48;

/// Two pseudo-random sequences of [`T`] ids below 97, as JSON and as a tensor.
fn tokens() -> (String, Tensor) {
    let rows: Vec<Vec<i64>> =
        (0..2).map(|r| (0..T).map(|i| (i * 7919 + r * 31 + i / 3) % 97).collect()).collect();
    let flat: Vec<i64> = rows.concat();
    (serde_json::to_string(&rows).unwrap(), Tensor::from_slice(&flat).view([2, T]))
}

/// Makes `variants` under `root` (shards of at most `shard`).
fn make(root: &Path, shard: &str, variants: &[&str]) {
    let mut args = vec!["make", root.to_str().unwrap(), shard];
    args.extend_from_slice(variants);
    hf_side(&args);
}

/// Logits `transformers` computes for [`tokens`] with the model in each of `dirs`.
fn hf_logits(dirs: &[PathBuf]) -> Vec<Tensor> {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("hf-logits.safetensors");
    let (json, _) = tokens();
    let mut args = vec!["logits".to_string(), json, out.to_str().unwrap().to_string()];
    args.extend(dirs.iter().map(|d| d.to_str().unwrap().to_string()));
    hf_side(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let mut ts = Tensor::read_safetensors(&out).unwrap();
    ts.sort_by_key(|(n, _)| n.parse::<usize>().unwrap());
    ts.into_iter().map(|(_, t)| t).collect()
}

fn rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    let d = (a - b).norm().double_value(&[]);
    d / b.norm().double_value(&[])
}

fn imported(dir: &Path) -> Model {
    let w = hf::read_weights(dir, Some(T as usize)).unwrap();
    let spec = ModelSpec::Llama(w.spec.clone());
    let m = Model::new(&spec, 0).unwrap();
    m.load_named(&w.tensors).unwrap();
    m
}

fn llama(m: &Model) -> &LlamaSpec {
    let ModelSpec::Llama(l) = m.spec() else { unreachable!() };
    l
}

#[test]
fn every_family_from_transformers_gives_the_same_logits_in_limpet() {
    let root = tempfile::tempdir().unwrap();
    make(root.path(), "10GB", VARIANTS);
    let dirs: Vec<PathBuf> = VARIANTS.iter().map(|v| root.path().join(v)).collect();
    let theirs = hf_logits(&dirs);
    for ((v, dir), theirs) in VARIANTS.iter().zip(&dirs).zip(&theirs) {
        let m = imported(dir);
        let l = llama(&m);
        let ours = tch::no_grad(|| m.forward_t(&tokens().1, false));
        let rel = rel_diff(&ours, theirs);
        assert!(rel <= 1e-4, "{v}: logits differ by {rel:e} relative");
        // What each variant is there to exercise was read, not ignored.
        match *v {
            "tied" | "bin" => assert!(l.tie_embeddings, "{v}"),
            "bf16" => assert_eq!(l.source_dtype.as_deref(), Some("bfloat16")),
            "llama3" => {
                assert!(matches!(
                    l.rope_scaling,
                    Some(RopeScaling::Llama3 { original_max_position_embeddings: 40, .. })
                ));
                assert_eq!((l.heads, l.kv_heads, l.rope_theta), (8, 1, 500_000.0));
                assert_eq!(
                    (l.special_tokens.bos, l.special_tokens.eos.as_slice()),
                    (Some(96), &[95, 94][..])
                );
            }
            "yarn" => assert!(matches!(l.rope_scaling, Some(RopeScaling::Yarn { .. }))),
            "linear" => assert!(matches!(l.rope_scaling, Some(RopeScaling::Linear { .. }))),
            "dynamic" => assert!(matches!(l.rope_scaling, Some(RopeScaling::Dynamic { .. }))),
            "mistral" => assert_eq!(l.family, Family::Mistral),
            "qwen2" => assert!(l.family == Family::Qwen2 && l.qkv_bias && !l.o_bias && l.tie_embeddings),
            "qwen3" => {
                assert!(l.family == Family::Qwen3 && l.qk_norm && l.head_dim() == 32 && l.q_dim() == 128)
            }
            _ => {}
        }
        if ["llama3", "yarn", "linear", "dynamic"].contains(v) {
            // The scaling matters at these lengths: without it the logits are another model's.
            let mut plain = l.clone();
            plain.rope_scaling = None;
            let p = Model::new(&ModelSpec::Llama(plain), 0).unwrap();
            p.load_named(&hf::read_weights(dir, Some(T as usize)).unwrap().tensors).unwrap();
            let unscaled = tch::no_grad(|| p.forward_t(&tokens().1, false));
            let off = rel_diff(&unscaled, theirs);
            assert!(off > 1e-3 || *v == "dynamic", "{v}: the scaling changed nothing ({off:e})");
        }
    }
}

/// Llama 3.1's own `config.json` spells the scaling as `rope_scaling` beside a top-level
/// `rope_theta` (transformers before 5): the same model.
#[test]
fn the_older_rope_spelling_reads_as_the_same_model() {
    let root = tempfile::tempdir().unwrap();
    make(root.path(), "10GB", &["llama3"]);
    let dir = root.path().join("llama3");
    let new = hf::read_config(&dir, None).unwrap();
    let path = dir.join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let mut rope = cfg["rope_parameters"].take();
    let theta = rope.as_object_mut().unwrap().remove("rope_theta").unwrap();
    cfg.as_object_mut().unwrap().remove("rope_parameters");
    cfg["rope_theta"] = theta;
    cfg["rope_scaling"] = rope;
    std::fs::write(&path, serde_json::to_vec(&cfg).unwrap()).unwrap();
    assert_eq!(hf::read_config(&dir, None).unwrap(), new);
}

/// Token shards of `n` pseudo-random ids below 97.
fn shard_dir(dir: &Path, n: usize) {
    let ids: Vec<u32> = (0..n as u32).map(|i| (i * 7919 + i / 3) % 97).collect();
    write_dataset(dir, &ids, &[], 97, 1 << 20).unwrap();
}

/// Starts from the checkpoint in `dir`, trains five steps; the trainer.
fn trained_from(dir: &Path) -> Trainer {
    let data_dir = tempfile::tempdir().unwrap();
    shard_dir(data_dir.path(), 4000);
    let data = Dataset::load(&DataSpec::Tokens { context: T as usize }, Some(data_dir.path())).unwrap();
    let section = ModelSection { init_from: Some(dir.to_path_buf()), ..Default::default() };
    let mut job = job_for(ModelKind::Llama, &data, &section).unwrap();
    job.global_batch = 4;
    job.micro_batch = 4;
    job.steps = 5;
    job.schedule.warmup_steps = 1;
    let mut t = Trainer::try_new(job, data).unwrap();
    t.init_from_hf(dir).unwrap();
    let before = tch::no_grad(|| t.model().forward_t(&tokens().1, false));
    for _ in 0..5 {
        t.train_step(0, 1, &mut NoReduce).unwrap();
    }
    let after = tch::no_grad(|| t.model().forward_t(&tokens().1, false));
    assert!(rel_diff(&after, &before) > 1e-3, "training changed nothing");
    t
}

/// `init_from` → train → export → `from_pretrained`, for every family: transformers computes
/// the logits limpet does, the config names the family, the scaling and the special tokens,
/// and limpet reads its own export back to the same model.
#[test]
fn every_family_round_trips_through_training_and_export() {
    let root = tempfile::tempdir().unwrap();
    let variants = ["llama3", "yarn", "mistral", "qwen2", "qwen3", "bin"];
    make(root.path(), "10GB", &variants);
    let out = tempfile::tempdir().unwrap();
    let mut ours = Vec::new();
    let mut exports = Vec::new();
    for v in variants {
        let t = trained_from(&root.path().join(v));
        let dst = out.path().join(v);
        hf::export_with(&t.image().unwrap(), &dst, Some(hf::ExportDtype::F32), hf::MAX_SHARD_BYTES, None)
            .unwrap();
        let logits = tch::no_grad(|| t.model().forward_t(&tokens().1, false));
        let back = imported(&dst);
        let again = tch::no_grad(|| back.forward_t(&tokens().1, false));
        assert!(again.allclose(&logits, 1e-6, 1e-6, false), "{v}: limpet reads its export as another model");
        // The same model; the dtype is what export wrote (f32 here).
        let (mut read, mut trained) = (llama(&back).clone(), llama(t.model()).clone());
        (read.source_dtype, trained.source_dtype) = (None, None);
        assert_eq!(read, trained, "{v}: the export's config is not the model trained");
        ours.push(logits);
        exports.push(dst);
    }
    for ((v, ours), theirs) in variants.iter().zip(&ours).zip(hf_logits(&exports)) {
        let rel = rel_diff(ours, &theirs);
        assert!(rel <= 1e-4, "{v}: the export's logits in transformers differ by {rel:e} relative");
    }
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(exports[0].join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["rope_parameters"]["rope_type"], "llama3");
    assert_eq!(cfg["max_position_embeddings"], 64, "the source's, not the training context");
    let gen: serde_json::Value =
        serde_json::from_slice(&std::fs::read(exports[0].join("generation_config.json")).unwrap()).unwrap();
    assert_eq!(
        (gen["bos_token_id"].clone(), gen["eos_token_id"].clone()),
        (96.into(), serde_json::json!([95, 94]))
    );
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(exports[3].join("config.json")).unwrap()).unwrap();
    assert_eq!(
        (cfg["model_type"].as_str(), cfg["architectures"][0].as_str()),
        (Some("qwen2"), Some("Qwen2ForCausalLM"))
    );
}

/// A bf16 source exports as bf16 (its `torch_dtype`) unless asked otherwise; a small shard
/// limit writes an index that transformers follows.
#[test]
fn exports_keep_the_source_dtype_and_shard_at_the_limit() {
    let root = tempfile::tempdir().unwrap();
    make(root.path(), "10GB", &["bf16"]);
    let t = trained_from(&root.path().join("bf16"));
    let image = t.image().unwrap();
    let out = tempfile::tempdir().unwrap();
    let (whole, sharded) = (out.path().join("whole"), out.path().join("sharded"));
    hf::export(&image, &whole).unwrap();
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(whole.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["torch_dtype"], "bfloat16");
    let written = Tensor::read_safetensors(whole.join(hf::WEIGHTS_FILE)).unwrap();
    let q = written.iter().find(|(n, _)| n == "model.layers.0.self_attn.q_proj.weight").unwrap();
    assert_eq!(q.1.kind(), Kind::BFloat16);
    let trained = t.model().params().iter().find(|(n, _)| n == "b01.wq.weight").unwrap().1.detach();
    assert!(
        q.1.to_kind(Kind::Float).equal(&trained.to_kind(Kind::BFloat16).to_kind(Kind::Float)),
        "not rounded from the trained f32"
    );
    hf::export_with(&image, &sharded, Some(hf::ExportDtype::F32), 40_000, None).unwrap();
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(sharded.join(hf::INDEX_FILE)).unwrap()).unwrap();
    let files: std::collections::BTreeSet<&str> =
        index["weight_map"].as_object().unwrap().values().map(|v| v.as_str().unwrap()).collect();
    assert!(files.len() > 2, "{files:?}");
    for f in &files {
        // At the limit (plus the header), unless one tensor alone is larger.
        let len = std::fs::metadata(sharded.join(f)).unwrap().len();
        let tensors = index["weight_map"].as_object().unwrap().values().filter(|v| v == f).count();
        assert!(len <= 40_000 + 4096 || tensors == 1, "{f}: {len} bytes in {tensors} tensors");
    }
    let ours = tch::no_grad(|| t.model().forward_t(&tokens().1, false));
    let theirs = hf_logits(&[whole, sharded]);
    assert!(rel_diff(&ours, &theirs[1]) <= 1e-4, "sharded f32 export");
    let rel = rel_diff(&ours, &theirs[0]);
    assert!(rel > 0.0 && rel < 2e-2, "bf16 export: {rel:e}");
}

/// Rewrites `dir`'s single weights file through `edit` of its tensors.
fn edit_weights(dir: &Path, edit: impl FnOnce(&mut Vec<(String, Tensor)>)) {
    let path = dir.join(hf::WEIGHTS_FILE);
    let mut ts = Tensor::read_safetensors(&path).unwrap();
    edit(&mut ts);
    Tensor::write_safetensors(&ts, &path).unwrap();
}

#[test]
fn broken_checkpoints_are_refused_naming_the_tensor_or_key() {
    let root = tempfile::tempdir().unwrap();
    make(root.path(), "10GB", &["untied"]);
    let dir = root.path().join("untied");
    let copy = |name: &str| {
        let d = tempfile::tempdir().unwrap();
        for f in ["config.json", hf::WEIGHTS_FILE] {
            std::fs::copy(dir.join(f), d.path().join(f)).unwrap();
        }
        let _ = name;
        d
    };
    let load = |d: &Path| -> String {
        match hf::read_weights(d, None) {
            Err(e) => e.to_string(),
            Ok(w) => {
                let m = Model::new(&ModelSpec::Llama(w.spec.clone()), 0).unwrap();
                m.load_named(&w.tensors).unwrap_err().to_string()
            }
        }
    };
    let d = copy("missing");
    edit_weights(d.path(), |ts| ts.retain(|(n, _)| n != "model.layers.1.mlp.up_proj.weight"));
    let e = load(d.path());
    assert!(e.contains("tensor 'b02.w_up.weight' is missing"), "{e}");

    let d = copy("shape");
    edit_weights(d.path(), |ts| {
        for (n, t) in ts.iter_mut() {
            if n == "model.layers.0.self_attn.k_proj.weight" {
                *t = Tensor::zeros([16, 64], (Kind::Float, tch::Device::Cpu));
            }
        }
    });
    let e = load(d.path());
    assert!(e.contains("tensor 'b01.wk.weight' has shape [16, 64], the model needs [32, 64]"), "{e}");

    let d = copy("unknown");
    edit_weights(d.path(), |ts| {
        ts.push((
            "model.layers.0.self_attn.q_proj.bias".into(),
            Tensor::zeros([64], (Kind::Float, tch::Device::Cpu)),
        ))
    });
    let e = load(d.path());
    assert!(
        e.contains(
            "tensor 'model.layers.0.self_attn.q_proj.bias' is not a weight of this LlamaForCausalLM model"
        ),
        "{e}"
    );

    // Configs that would compute something else are refused naming the key.
    let edit_config = |d: &Path, edit: &dyn Fn(&mut serde_json::Value)| {
        let path = d.join("config.json");
        let mut cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        edit(&mut cfg);
        std::fs::write(&path, serde_json::to_vec(&cfg).unwrap()).unwrap();
    };
    type Edit<'a> = &'a dyn Fn(&mut serde_json::Value);
    let cases: [(&str, Edit, &str); 5] = [
        (
            "gemma",
            &|c| c["model_type"] = "gemma".into(),
            "model_type: \"gemma\" is not one of llama, mistral, qwen2, qwen3",
        ),
        (
            "longrope",
            &|c| c["rope_parameters"]["rope_type"] = "longrope".into(),
            "rope_parameters.rope_type: \"longrope\" is not one of",
        ),
        (
            "llama3 factors",
            &|c| c["rope_parameters"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0}),
            "rope_parameters.low_freq_factor: missing",
        ),
        (
            "window",
            &|c| {
                c["model_type"] = "mistral".into();
                c["sliding_window"] = 8.into();
            },
            "sliding_window: the context 64 exceeds the window of 8 tokens",
        ),
        ("partial", &|c| c["partial_rotary_factor"] = 0.5.into(), "partial_rotary_factor"),
    ];
    for (what, edit, want) in cases {
        let d = copy(what);
        edit_config(d.path(), edit);
        let e = load(d.path());
        assert!(e.contains("config.json") && e.contains(want), "{what}: {e}");
    }

    let d = copy("kv");
    let cfg = std::fs::read_to_string(d.path().join("config.json")).unwrap();
    std::fs::write(
        d.path().join("config.json"),
        cfg.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"),
    )
    .unwrap();
    let e = load(d.path());
    assert!(e.contains("kv_heads (3) must divide heads (4)"), "{e}");

    // A job whose recorded fingerprint is not these weights' is refused at init.
    let data_dir = tempfile::tempdir().unwrap();
    shard_dir(data_dir.path(), 2000);
    let data = Dataset::load(&DataSpec::Tokens { context: 12 }, Some(data_dir.path())).unwrap();
    let section = ModelSection { init_from: Some(dir.clone()), ..Default::default() };
    let mut job = job_for(ModelKind::Llama, &data, &section).unwrap();
    job.init = Some("0".repeat(64));
    let mut t = Trainer::try_new(job, data).unwrap();
    let e = t.init_from_hf(&dir).unwrap_err().to_string();
    assert!(e.contains("the job records"), "{e}");
    // Sizes given beside init_from are refused, naming the key.
    let data = Dataset::load(&DataSpec::Tokens { context: 12 }, Some(data_dir.path())).unwrap();
    let section = ModelSection { init_from: Some(dir.clone()), layers: Some(3), ..Default::default() };
    let e = job_for(ModelKind::Llama, &data, &section).unwrap_err().to_string();
    assert!(e.contains("[model].layers: the model's sizes come from init_from"), "{e}");
}

/// A `.bin` whose unpickling would run code is refused, and the code never runs: libtorch's
/// unpickler rebuilds tensors and containers only.
#[test]
fn a_pickle_that_would_run_code_is_refused_without_running_it() {
    let root = tempfile::tempdir().unwrap();
    make(root.path(), "10GB", &["bin"]);
    let dir = root.path().join("bin");
    let marker = root.path().join("ran");
    hf_side(&["evil", dir.join(hf::BIN_FILE).to_str().unwrap(), marker.to_str().unwrap()]);
    let e = hf::read_weights(&dir, None).unwrap_err().to_string();
    assert!(e.contains("pytorch_model.bin") && e.contains("not a PyTorch weights archive"), "{e}");
    assert!(!marker.exists(), "unpickling ran the archive's code");
    std::fs::remove_file(dir.join(hf::BIN_FILE)).unwrap();
    let e = hf::read_weights(&dir, None).unwrap_err().to_string();
    assert!(e.contains("no weights: none of model.safetensors"), "{e}");
}
