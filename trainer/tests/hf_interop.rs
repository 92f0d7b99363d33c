//! Hugging Face interop against the real other side: `transformers` from PyPI (installed by
//! deploy/setup.sh) saves a tiny random `LlamaForCausalLM`, limpet loads it and computes the
//! same logits; limpet trains, exports, and `transformers` loads the export and computes the
//! logits limpet does. Bad directories give errors that name the tensor or key.

use limpet_trainer::data::tokens::write_dataset;
use limpet_trainer::data::{DataSpec, Dataset};
use limpet_trainer::model::{Model, ModelSpec};
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

const TOKENS: &str =
    "[[5, 17, 3, 96, 0, 41, 41, 8, 77, 12, 60, 2], [90, 1, 1, 33, 7, 58, 19, 4, 4, 70, 11, 29]]";

fn tokens() -> Tensor {
    let v: Vec<Vec<i64>> = serde_json::from_str(TOKENS).unwrap();
    let flat: Vec<i64> = v.concat();
    Tensor::from_slice(&flat).view([2, 12])
}

/// Logits `transformers` computes for [`TOKENS`] with the model in `dir`.
fn hf_logits(dir: &Path) -> Tensor {
    let out = dir.join("hf-logits.safetensors");
    hf_side(&["logits", dir.to_str().unwrap(), TOKENS, out.to_str().unwrap()]);
    let t = Tensor::read_safetensors(&out).unwrap();
    t.into_iter().find(|(n, _)| n == "logits").unwrap().1
}

fn rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    let d = (a - b).norm().double_value(&[]);
    d / b.norm().double_value(&[])
}

fn imported(dir: &Path) -> Model {
    let w = hf::read_weights(dir, None).unwrap();
    let spec = ModelSpec::Llama(w.spec.clone());
    let m = Model::new(&spec, 0).unwrap();
    m.load_named(&w.tensors).unwrap();
    m
}

#[test]
fn a_transformers_checkpoint_gives_the_same_logits_in_limpet() {
    for (tied, shard) in [("untied", "100KB"), ("tied", "10GB")] {
        let dir = tempfile::tempdir().unwrap();
        hf_side(&["make", dir.path().to_str().unwrap(), tied, shard]);
        let sharded = dir.path().join(hf::INDEX_FILE).exists();
        assert_eq!(sharded, tied == "untied", "the untied model is saved in shards, the tied one whole");
        let m = imported(dir.path());
        let ModelSpec::Llama(l) = m.spec() else { unreachable!() };
        assert_eq!((l.layers, l.d_model, l.heads, l.kv_heads, l.ffn, l.vocab), (2, 64, 4, 2, 176, 97));
        assert_eq!(l.tie_embeddings, tied == "tied");
        let ours = tch::no_grad(|| m.forward_t(&tokens(), false));
        let theirs = hf_logits(dir.path());
        let rel = rel_diff(&ours, &theirs);
        assert!(rel <= 1e-4, "{tied}: logits differ by {rel:e} relative");
    }
}

/// Token shards of `n` pseudo-random ids below 97.
fn shard_dir(dir: &Path, n: usize) {
    let ids: Vec<u32> = (0..n as u32).map(|i| (i * 7919 + i / 3) % 97).collect();
    write_dataset(dir, &ids, &[], 97, 1 << 20).unwrap();
}

#[test]
fn limpets_export_after_training_loads_in_transformers_with_the_same_logits() {
    let hf_dir = tempfile::tempdir().unwrap();
    hf_side(&["make", hf_dir.path().to_str().unwrap(), "untied", "10GB"]);
    let data_dir = tempfile::tempdir().unwrap();
    shard_dir(data_dir.path(), 4000);
    let data = Dataset::load(&DataSpec::Tokens { context: 12 }, Some(data_dir.path())).unwrap();
    // Start from the Hugging Face weights, train, export.
    let section = ModelSection { init_from: Some(hf_dir.path().to_path_buf()), ..Default::default() };
    let mut job = job_for(ModelKind::Llama, &data, &section).unwrap();
    job.global_batch = 8;
    job.micro_batch = 8;
    job.steps = 5;
    job.schedule.warmup_steps = 1;
    let mut t = Trainer::try_new(job, data).unwrap();
    t.init_from_hf(hf_dir.path()).unwrap();
    let before = tch::no_grad(|| t.model().forward_t(&tokens(), false));
    for _ in 0..5 {
        t.train_step(0, 1, &mut NoReduce).unwrap();
    }
    let ours = tch::no_grad(|| t.model().forward_t(&tokens(), false));
    assert!(rel_diff(&ours, &before) > 1e-3, "training changed nothing");
    let out = tempfile::tempdir().unwrap();
    hf::export(&t.image().unwrap(), out.path()).unwrap();
    let theirs = hf_logits(out.path());
    let rel = rel_diff(&ours, &theirs);
    assert!(rel <= 1e-4, "the export's logits in transformers differ by {rel:e} relative");
    // And limpet reads its own export back to the same model.
    let back = imported(out.path());
    let again = tch::no_grad(|| back.forward_t(&tokens(), false));
    assert!(again.allclose(&ours, 1e-6, 1e-6, false));
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
    let dir = tempfile::tempdir().unwrap();
    hf_side(&["make", dir.path().to_str().unwrap(), "untied", "10GB"]);
    let copy = |name: &str| {
        let d = tempfile::tempdir().unwrap();
        for f in ["config.json", hf::WEIGHTS_FILE] {
            std::fs::copy(dir.path().join(f), d.path().join(f)).unwrap();
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
        e.contains("tensor 'model.layers.0.self_attn.q_proj.bias' is not a LLaMA weight limpet knows"),
        "{e}"
    );

    let d = copy("config");
    let cfg = std::fs::read_to_string(d.path().join("config.json")).unwrap();
    std::fs::write(
        d.path().join("config.json"),
        cfg.replace("\"model_type\": \"llama\"", "\"model_type\": \"mistral\""),
    )
    .unwrap();
    let e = load(d.path());
    assert!(e.contains("config.json") && e.contains("model_type: \"mistral\" is not \"llama\""), "{e}");

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
    let section = ModelSection { init_from: Some(dir.path().to_path_buf()), ..Default::default() };
    let mut job = job_for(ModelKind::Llama, &data, &section).unwrap();
    job.init = Some("0".repeat(64));
    let mut t = Trainer::try_new(job, data).unwrap();
    let e = t.init_from_hf(dir.path()).unwrap_err().to_string();
    assert!(e.contains("the job records"), "{e}");
    // Sizes given beside init_from are refused, naming the key.
    let data = Dataset::load(&DataSpec::Tokens { context: 12 }, Some(data_dir.path())).unwrap();
    let section =
        ModelSection { init_from: Some(dir.path().to_path_buf()), layers: Some(3), ..Default::default() };
    let e = job_for(ModelKind::Llama, &data, &section).unwrap_err().to_string();
    assert!(e.contains("[model].layers: the model's sizes come from init_from"), "{e}");
}
