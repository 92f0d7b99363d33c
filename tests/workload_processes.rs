//! Users' workloads end to end with real processes: text tokenized into shards by
//! `limpet data tokenize`, a LLaMA trained on them by `limpetd` agents through a spot notice,
//! a join and a `kill -9` (and, pipelined, laid out 2x2), compared with one uninterrupted
//! `limpet train`; exported with `limpet export --hf`; bad data refused by the CLI with the
//! file named; and training on shards larger than the model reads them a window at a time.

use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "common.rs"]
mod common;
use common::{exe, max_rel_diff, params, scenario_json, train_alone, transition};

/// Shards of the machine's licence texts through a byte-level BPE of 384 tokens.
fn shards(dir: &Path) -> PathBuf {
    let out = dir.join("shards");
    let run = Command::new(exe())
        .args(["data", "tokenize", "/usr/share/common-licenses", "--train-bpe", "384", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let said = String::from_utf8_lossy(&run.stdout);
    assert!(said.contains("vocab 384") && said.contains("held out"), "{said}");
    out
}

/// The LLaMA of these tests: 2 decoder layers of width 64 with grouped-query attention.
const LLAMA: &[&str] = &["--model", "llama", "--data", "tokens", "--context", "32", "--layers", "2"];

/// Same tolerance and reasons as the MLP's elastic test (elastic_processes.rs): the elastic
/// run sums the same gradients in another order.
const PARAM_TOLERANCE: f64 = 1e-2;

#[test]
fn an_elastic_llama_on_token_shards_matches_one_uninterrupted_process() {
    let tmp = tempfile::tempdir().unwrap();
    let data = shards(tmp.path());
    let data_arg = data.to_str().unwrap();
    let steps = 400;
    let mut args = vec!["--nodes", "3", "--batch", "16", "--data-path", data_arg];
    args.extend_from_slice(LLAMA);
    let summary = scenario_json(
        &tmp.path().join("elastic"),
        &args,
        steps,
        "0.15:notice:node-2:20,0.4:join,0.7:kill:node-3",
    );
    assert_eq!(transition(&summary, "notice for node 2")["lost_steps"], 0, "{summary:#}");
    assert!(transition(&summary, "join of node 4")["fetched_bytes"].as_u64().unwrap() > 0, "{summary:#}");
    assert!(transition(&summary, "failure of node 3")["lost_steps"].as_u64().unwrap() <= 1, "{summary:#}");

    let single = tmp.path().join("single");
    let mut alone = vec!["--batch", "16", "--data-path", data_arg];
    alone.extend_from_slice(LLAMA);
    let report = train_alone(&single, &alone, steps);
    let (elastic_img, elastic) = params(&PathBuf::from(summary["checkpoint"].as_str().unwrap()));
    let (single_img, one) = params(&single.join("checkpoint.safetensors"));
    assert_eq!(elastic_img.meta().job, single_img.meta().job, "the two runs must train the same job");
    assert_eq!(elastic_img.meta().job["model"]["kind"], "llama");
    let diff = max_rel_diff(&elastic, &one);
    eprintln!("llama: largest relative parameter difference {diff:.2e}");
    assert!(diff < PARAM_TOLERANCE, "parameters differ by {diff:.3e} (tolerance {PARAM_TOLERANCE:e})");
    let (a, b) = (summary["test_loss"].as_f64().unwrap(), report["test_loss"].as_f64().unwrap());
    assert!((a - b).abs() <= 0.01 * b, "test loss {a} (elastic) vs {b} (one process)");
    assert!(b < (384f64).ln() - 0.5, "the model did not learn: test loss {b}");

    // The result leaves as a Hugging Face directory.
    let hf = tmp.path().join("hf");
    let run = Command::new(exe())
        .args(["export", "--hf"])
        .arg(&hf)
        .arg("--checkpoint")
        .arg(&single)
        .arg("--tokenizer")
        .arg(data.join("tokenizer.json"))
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(hf.join(f).exists(), "export wrote no {f}");
    }
}

#[test]
fn a_2x2_pipelined_llama_matches_one_uninterrupted_process() {
    let tmp = tempfile::tempdir().unwrap();
    let data = shards(tmp.path());
    let data_arg = data.to_str().unwrap();
    let steps = 200;
    let mut args = vec![
        "--nodes",
        "4",
        "--batch",
        "16",
        "--micro-batch",
        "4",
        "--pipeline",
        "2",
        "--data-path",
        data_arg,
    ];
    args.extend_from_slice(LLAMA);
    let summary = scenario_json(&tmp.path().join("pipe"), &args, steps, "");
    assert_eq!(summary["transitions"][0]["layout"], "2x2", "{summary:#}");
    let mut alone = vec!["--batch", "16", "--micro-batch", "4", "--data-path", data_arg];
    alone.extend_from_slice(LLAMA);
    let report = train_alone(&tmp.path().join("single"), &alone, steps);
    let (a, b) = (summary["test_loss"].as_f64().unwrap(), report["test_loss"].as_f64().unwrap());
    eprintln!("llama 2x2: test loss {a:.5} pipelined, {b:.5} in one process");
    assert!((a - b).abs() <= 0.01 * b, "test loss {a} (pipelined) vs {b} (one process)");
}

#[test]
fn bad_token_data_is_refused_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let data = shards(tmp.path());
    let train = |dir: &Path| {
        Command::new(exe())
            .args([
                "train",
                "--model",
                "llama",
                "--data",
                "tokens",
                "--steps",
                "2",
                "--context",
                "16",
                "--out",
            ])
            .arg(tmp.path().join("out"))
            .arg("--data-path")
            .arg(dir)
            .output()
            .unwrap()
    };
    // A truncated shard.
    let bin = data.join("train-00000.bin");
    let len = std::fs::metadata(&bin).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&bin).unwrap().set_len(len - 3).unwrap();
    let out = train(&data);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("train-00000.bin") && err.contains("truncated"), "{err}");
    // `limpet data verify` names the shard whose bytes changed.
    std::fs::OpenOptions::new().write(true).open(&bin).unwrap().set_len(len).unwrap();
    let mut bytes = std::fs::read(&bin).unwrap();
    bytes[100] ^= 1;
    std::fs::write(&bin, bytes).unwrap();
    let out = Command::new(exe()).args(["data", "verify"]).arg(&data).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("train-00000.bin: blake3"), "{err}");
    // Ids at or beyond the vocabulary, found by `limpet data index`.
    let raw = tmp.path().join("raw");
    std::fs::create_dir_all(&raw).unwrap();
    let ids: Vec<u8> = [1u16, 2, 3, 999, 4].iter().flat_map(|t| t.to_le_bytes()).collect();
    std::fs::write(raw.join("train.bin"), ids).unwrap();
    let out = Command::new(exe())
        .args(["data", "index", "--dtype", "uint16", "--vocab", "500"])
        .arg(&raw)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("train.bin: token 999 at byte offset 6 is not below --vocab 500"), "{err}");
    // A model whose vocabulary is smaller than the data's.
    let out = Command::new(exe())
        .args(["train", "--model", "llama", "--data", "tokens", "--vocab", "100", "--steps", "2", "--out"])
        .arg(tmp.path().join("out2"))
        .arg("--data-path")
        .arg(&data)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("vocab (100) is smaller than the data's vocabulary (384)"), "{err}");
}

/// A 4 GiB token dataset trains in a process whose data segment is capped at 1 GB
/// (`prlimit --data`): windows are read as needed, the sampler keeps no per-sample state, and
/// peak RSS stays that of the model. The same cap stops a loader that reads its file whole
/// (the byte corpus), so the cap is real.
#[test]
fn a_dataset_larger_than_the_process_may_hold_trains_with_bounded_memory() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("big");
    std::fs::create_dir_all(&dir).unwrap();
    // A sparse file: 2^31 tokens of id 0, on no disk at all.
    let bin = dir.join("train.bin");
    std::fs::File::create(&bin).unwrap().set_len(4 << 30).unwrap();
    let m = limpet_trainer::data::tokens::Manifest {
        format: limpet_trainer::data::tokens::MANIFEST_FORMAT.into(),
        version: 1,
        dtype: limpet_trainer::data::tokens::TokenDtype::Uint16,
        vocab: 384,
        tokenizer: None,
        train: vec![limpet_trainer::data::tokens::ShardEntry {
            file: "train.bin".into(),
            tokens: 2 << 30,
            blake3: limpet_trainer::data::tokens::hash_file(&bin, |_| {}).unwrap(),
        }],
        val: vec![],
    };
    limpet_trainer::data::tokens::write_manifest(&dir, &m).unwrap();
    let capped = |args: &[&str], out: &str| {
        Command::new("prlimit")
            .arg("--data=1000000000")
            .arg(exe())
            .args(["train", "--steps", "6", "--batch", "16", "--json", "--out"])
            .arg(tmp.path().join(out))
            .args(args)
            .arg("--data-path")
            .arg(if args.contains(&"chars") { bin.clone() } else { dir.clone() })
            .output()
            .unwrap()
    };
    let run = capped(&["--model", "llama", "--data", "tokens", "--context", "32"], "tokens");
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let report: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    let rss = report["peak_rss_bytes"].as_u64().unwrap();
    eprintln!("peak RSS training on 4 GiB of tokens: {} MiB", rss >> 20);
    assert!(rss > 0 && rss < 600 << 20, "peak RSS {rss} bytes");
    let whole = capped(&["--model", "gpt", "--data", "chars"], "chars");
    assert!(!whole.status.success(), "reading 4 GiB whole fit under the cap: the cap does not bite");
}

/// Arrays as numpy and PyTorch users have them: `np.save`'d `x.npy`/`y.npy` (a separable
/// 3-class problem) train an MLP classifier; a safetensors file from `safetensors.torch`
/// with float targets trains a regressor.
#[test]
fn numpy_and_safetensors_arrays_train_a_classifier_and_a_regressor() {
    let tmp = tempfile::tempdir().unwrap();
    let script = r#"
import sys, numpy as np, torch
from safetensors.torch import save_file
rng = np.random.default_rng(0)
x = rng.normal(size=(3000, 8)).astype(np.float32)
w = rng.normal(size=(8, 3)).astype(np.float32)
np.save(sys.argv[1] + "/x.npy", x)
np.save(sys.argv[1] + "/y.npy", (x @ w).argmax(1).astype(np.int64))
xt = torch.from_numpy(x)
save_file({"x": xt, "y": (xt @ torch.from_numpy(w))[:, :2].contiguous()}, sys.argv[2])
"#;
    let npy = tmp.path().join("npy");
    std::fs::create_dir_all(&npy).unwrap();
    let st = tmp.path().join("reg.safetensors");
    let out = Command::new(common::python()).args(["-c", script]).arg(&npy).arg(&st).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let train = |path: &Path, out: &str| -> serde_json::Value {
        let run = Command::new(exe())
            .args(["train", "--model", "mlp", "--data", "tensors", "--steps", "300", "--json", "--out"])
            .arg(tmp.path().join(out))
            .arg("--data-path")
            .arg(path)
            .output()
            .unwrap();
        assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
        serde_json::from_slice(&run.stdout).unwrap()
    };
    let c = train(&npy, "classify");
    assert!(c["test_accuracy"].as_f64().unwrap() > 0.9, "{c:#}");
    let r = train(&st, "regress");
    assert_eq!(r["model"]["loss"], "mse", "{r:#}");
    // Targets have variance about 8 (a sum of 8 unit normals): the regressor must do far better.
    assert!(r["test_loss"].as_f64().unwrap() < 0.5, "{r:#}");
}
