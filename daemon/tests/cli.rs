//! `limpet train` end to end, as a user runs it: real processes, real files.

use std::path::Path;
use std::process::{Command, Output};

fn limpet(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_limpet")).args(args).output().expect("limpet runs")
}

fn ok_json(args: &[&str]) -> serde_json::Value {
    let out = limpet(args);
    assert!(out.status.success(), "limpet {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("--json prints JSON")
}

fn fails(args: &[&str], code: i32, needle: &str) {
    let out = limpet(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "limpet {args:?}: {err}");
    assert!(err.contains(needle), "limpet {args:?}: expected '{needle}' in: {err}");
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn trains_digits_past_95_percent_and_writes_its_files() {
    let dir = tempfile::tempdir().unwrap();
    let r = ok_json(&[
        "train",
        "--model",
        "mlp",
        "--data",
        "digits",
        "--steps",
        "400",
        "--out",
        s(dir.path()),
        "--json",
    ]);
    assert!(r["test_accuracy"].as_f64().unwrap() >= 0.95, "{r}");
    assert_eq!(r["final_step"], 400);
    for f in ["checkpoint.safetensors", "steps.jsonl", "loss.svg"] {
        assert!(dir.path().join(f).exists(), "{f} missing");
    }
    let svg = std::fs::read_to_string(dir.path().join("loss.svg")).unwrap();
    assert!(svg.contains("<svg") && svg.contains("train loss"), "plot lacks its series");
}

#[test]
fn resume_continues_bit_exactly() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let common = ["train", "--model", "convnet", "--steps", "60", "--batch", "32", "--micro-batch", "12"];
    let whole = ok_json(&[&common[..], &["--out", s(a.path()), "--json"]].concat());
    let part = ok_json(&[&common[..], &["--out", s(b.path()), "--stop-at", "25", "--json"]].concat());
    assert_eq!(part["final_step"], 25);
    assert_ne!(part["content_hash"], whole["content_hash"]);
    let resumed = ok_json(&["train", "--resume", s(b.path()), "--json"]);
    assert_eq!(resumed["start_step"], 25);
    assert_eq!(resumed["content_hash"], whole["content_hash"], "resumed run differs from uninterrupted run");
    let log = std::fs::read_to_string(b.path().join("steps.jsonl")).unwrap();
    let steps: Vec<u64> = log
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (1..=60).collect::<Vec<_>>());
}

#[test]
fn checkpoint_loads_in_python_safetensors() {
    // LIMPET_PYTHON (make sets it), else the clone's `.limpet/python` from setup.
    let python = limpet_lab::dp_cmd::python();
    let dir = tempfile::tempdir().unwrap();
    ok_json(&["train", "--model", "gpt", "--steps", "3", "--batch", "4", "--out", s(dir.path()), "--json"]);
    let ckpt = dir.path().join("checkpoint.safetensors");
    let script = r#"
import json, sys
from safetensors import safe_open
from safetensors.torch import load_file
t = load_file(sys.argv[1])
with safe_open(sys.argv[1], "pt") as f:
    meta = json.loads(f.metadata()["limpet"])
print(json.dumps({"step": meta["step"], "tensors": {k: [list(v.shape), float(v.double().sum())] for k, v in t.items()}}))
"#;
    let out = Command::new(&python).args(["-c", script, s(&ckpt)]).output().expect("python runs");
    assert!(out.status.success(), "python: {}", String::from_utf8_lossy(&out.stderr));
    let py: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let img = limpet_snapshot::read_file(&ckpt).unwrap();
    assert_eq!(py["step"], 3);
    assert_eq!(py["tensors"].as_object().unwrap().len(), img.tensors().len());
    for (name, t) in img.tensors() {
        let sum: f64 = t.to_f32().unwrap().iter().map(|v| f64::from(*v)).sum();
        let p = &py["tensors"][name];
        assert_eq!(p[0], serde_json::json!(t.shape()), "{name}");
        assert!((p[1].as_f64().unwrap() - sum).abs() <= 1e-6 * (1.0 + sum.abs()), "{name}: {p} vs {sum}");
    }
}

#[test]
fn bad_flags_exit_64_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let out = s(dir.path());
    fails(&["train", "--batch", "0", "--out", out], 64, "--batch: must be at least 1");
    fails(&["train", "--lr=-1", "--out", out], 64, "--lr: -1 is not a positive number");
    fails(
        &["train", "--steps", "10", "--warmup", "11", "--out", out],
        64,
        "--warmup: 11 exceeds the job's 10 steps",
    );
    fails(&["train", "--min-lr-ratio", "2", "--out", out], 64, "--min-lr-ratio: 2 is not within 0..=1");
    fails(&["train", "--shards", "4", "--out", out], 64, "--shards: applies to a reproducible job only");
    fails(
        &["train", "--precision", "bf16", "--out", out],
        64,
        "--precision: \"bf16\" is available for model",
    );
    fails(&["train", "--steps", "10", "--stop-at", "11", "--out", out], 64, "--stop-at 11 is beyond");
    fails(&["train", "--model", "gpt", "--data", "digits", "--out", out], 64, "needs token sequences");
    fails(&["train", "--context", "8", "--out", out], 64, "--context applies only to --data chars");
    fails(&["train", "--steps", "10"], 64, "--out DIR is required");
    fails(&["train", "--bogus"], 64, "--bogus");
    fails(&["train", "--threads", "0", "--out", out], 64, "--threads");
}

#[test]
fn resume_refuses_changed_job_and_broken_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let d = s(dir.path());
    ok_json(&["train", "--steps", "20", "--stop-at", "10", "--out", d, "--json"]);
    fails(&["train", "--resume", d, "--steps", "30"], 64, "steps: 20 vs 30");
    fails(&["train", "--resume", d, "--model", "gpt"], 64, "--model gpt differs");

    let ckpt = dir.path().join("checkpoint.safetensors");
    let good = std::fs::read(&ckpt).unwrap();
    let mut flipped = good.clone();
    let n = flipped.len();
    flipped[n - 3] ^= 0x10;
    std::fs::write(&ckpt, &flipped).unwrap();
    fails(&["train", "--resume", d], 65, "is corrupted: checksum");
    std::fs::write(&ckpt, &good[..good.len() / 2]).unwrap();
    fails(&["train", "--resume", d], 65, "not a valid safetensors file");
    std::fs::write(&ckpt, b"").unwrap();
    fails(&["train", "--resume", d], 65, "checkpoint.safetensors");
    let empty = tempfile::tempdir().unwrap();
    fails(&["train", "--resume", s(empty.path())], 65, "read");
    // The refused resumes left the damaged file for inspection instead of replacing it.
    assert_eq!(std::fs::read(&ckpt).unwrap(), b"");
}

#[test]
fn missing_data_file_names_the_path() {
    let dir = tempfile::tempdir().unwrap();
    fails(
        &["train", "--data-path", "/nonexistent/digits.csv.gz", "--out", s(dir.path())],
        65,
        "/nonexistent/digits.csv.gz",
    );
}

#[test]
fn plan_profiles_the_model_and_respects_memory() {
    let dir = tempfile::tempdir().unwrap();
    let profile = dir.path().join("profile.json");
    let common = ["plan", "--model", "gpt", "--layers", "2", "--batch", "16", "--reps", "1"];
    let common = [&common[..], &["--link-gbps", "1", "--latency-ms", "0.05", "--json"]].concat();
    let r = ok_json(&[&common[..], &["--hosts", "4", "--save-profile", s(&profile)]].concat());
    assert_eq!(r["input"]["profile"]["blocks"].as_array().unwrap().len(), 4, "{r}");
    let best = &r["report"]["best"];
    let stages = best["layout"]["stages"].as_array().unwrap();
    assert_eq!(stages.first().unwrap()["start"], 0);
    assert_eq!(stages.last().unwrap()["end"], 4);
    // Hosts too small for the whole model's weights, gradients and optimizer state force a
    // pipeline, whatever the micro-batch.
    let blocks = r["input"]["profile"]["blocks"].as_array().unwrap();
    let fixed: u64 = blocks
        .iter()
        .map(|b| 2 * b["param_bytes"].as_u64().unwrap() + b["optim_bytes"].as_u64().unwrap())
        .sum();
    let one_sample = |b: &serde_json::Value| b["saved_bytes"].as_u64().unwrap() / 16;
    let all_activations: u64 = blocks.iter().map(one_sample).sum();
    let largest = blocks.iter().map(one_sample).max().unwrap();
    // Room for every weight but not for every activation of even one sample: an unsplit
    // model does not fit.
    assert!(largest < all_activations);
    let need = fixed + largest;
    let hosts = format!("4x1.0:{need}");
    let split = ok_json(&[&common[..], &["--profile", s(&profile), "--hosts", &hosts]].concat());
    let best = &split["report"]["best"];
    assert!(best["layout"]["stages"].as_array().unwrap().len() >= 2, "{best}");
    for st in best["stages"].as_array().unwrap() {
        assert!(st["mem_bytes"].as_u64().unwrap() <= need, "{best}");
    }
    // A forced layout is predicted, not searched.
    let forced = ok_json(
        &[&common[..], &["--profile", s(&profile), "--hosts", "2", "--layout", "0..1@h0|1..4@h1"]].concat(),
    );
    assert_eq!(forced["forced"]["layout"]["stages"][1]["start"], 1);
    // Hosts of four devices: the forced pipeline's micro-batches are a device's, a quarter of
    // the host's share (16 samples on one replica: 4 a device).
    let per_device = ok_json(
        &[
            &common[..],
            &["--profile", s(&profile), "--hosts", "2", "--layout", "0..1@h0|1..4@h1", "--devices", "4"],
        ]
        .concat(),
    );
    assert_eq!(per_device["input"]["local_ranks"], 4, "{per_device}");
    let f = &per_device["forced"];
    let samples = f["layout"]["micro_batch"].as_u64().unwrap() * f["micro_batches"].as_u64().unwrap();
    assert_eq!(samples, 4, "{f}");
    fails(&["plan", "--devices", "0"], 64, "--devices");
    fails(&["plan", "--devices", "9"], 64, "--devices");
    fails(
        &[&common[..], &["--profile", s(&profile), "--hosts", "4x1.0:100K"]].concat(),
        1,
        "even the largest block alone needs",
    );
    fails(&["plan", "--hosts", "2xfast"], 64, "speed \"fast\"");
    fails(&["plan", "--hosts", "2", "--layout", "0..9@h0"], 64, "--layout");
    fails(&["plan", "--model", "mlp", "--layers", "3"], 64, "--layers: applies to models gpt and llama only");
}

/// A run whose loss diverged (NaN, written `null` in the step log) finishes and resumes; a
/// new run is not trained over another run's checkpoint without `--overwrite`; an export
/// does not replace a model (the one a job was fine-tuned from, say) without it either.
#[test]
fn a_diverged_run_resumes_and_nothing_is_overwritten_unasked() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let diverge = ["train", "--model", "mlp", "--steps", "4", "--lr", "1e30", "--out", s(&out)];
    ok_json(&[&diverge[..], &["--stop-at", "2", "--json"]].concat());
    let log = std::fs::read_to_string(out.join("steps.jsonl")).unwrap();
    assert!(log.contains("\"loss\":null"), "the run was meant to diverge: {log}");
    let resumed = ok_json(&["train", "--resume", s(&out), "--json"]);
    assert_eq!((resumed["start_step"].as_u64(), resumed["final_step"].as_u64()), (Some(2), Some(4)));
    let before = std::fs::read(out.join("checkpoint.safetensors")).unwrap();
    fails(
        &["train", "--model", "mlp", "--steps", "2", "--out", s(&out)],
        64,
        "pass --overwrite to replace it",
    );
    assert_eq!(std::fs::read(out.join("checkpoint.safetensors")).unwrap(), before, "the refused run wrote");
    ok_json(&["train", "--model", "mlp", "--steps", "2", "--out", s(&out), "--overwrite", "--json"]);
    assert_ne!(std::fs::read(out.join("checkpoint.safetensors")).unwrap(), before);
    // An export into a model's directory: refused before the checkpoint is even read.
    let model = dir.path().join("base-model");
    std::fs::create_dir(&model).unwrap();
    std::fs::write(model.join("config.json"), "{}").unwrap();
    let missing = dir.path().join("no-checkpoint");
    fails(&["export", "--hf", s(&model), "--checkpoint", s(&missing)], 64, "holds a model (config.json)");
    let out = limpet(&["export", "--hf", s(&model), "--checkpoint", s(&missing), "--overwrite"]);
    assert!(!String::from_utf8_lossy(&out.stderr).contains("--overwrite"), "--overwrite was not taken");
    assert_eq!(std::fs::read_to_string(model.join("config.json")).unwrap(), "{}");
    let file = model.join("config.json");
    fails(&["export", "--hf", s(&file), "--checkpoint", s(&missing), "--overwrite"], 64, "is a file");
}

/// Tokenizing a directory into a shard directory inside it, twice: the second run reads the
/// same documents, not the shards, tokenizer and manifest the first one wrote there.
#[test]
fn tokenizing_again_does_not_read_its_own_shards() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("corpus");
    std::fs::create_dir(&corpus).unwrap();
    for i in 0..3 {
        let text = format!("document {i}: the quick brown fox jumps over the lazy dog.\n").repeat(200);
        std::fs::write(corpus.join(format!("doc{i}.txt")), text).unwrap();
    }
    let shards = corpus.join("shards");
    let args = ["data", "tokenize", s(&corpus), "--out", s(&shards), "--train-bpe", "300"];
    for run in 0..2 {
        let out = limpet(&args);
        let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && text.contains(": 3 files, 3 documents"), "run {run}: {text}");
    }
    fails(
        &["data", "tokenize", s(&corpus), "--out", s(&shards), "--train-bpe", "99999999999"],
        64,
        "at most",
    );
}
