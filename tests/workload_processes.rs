//! Users' workloads end to end with real processes: text tokenized into shards by
//! `limpet data tokenize`, a LLaMA trained on them by `limpetd` agents through a spot notice,
//! a join and a `kill -9` (and, pipelined, laid out 2x2), compared with one uninterrupted
//! `limpet train`; exported with `limpet export --hf`; bad data refused by the CLI with the
//! file named; and training on shards larger than the model reads them a window at a time.
//! (TorchScript modules are `torchscript_processes.rs`'s.)

use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "common.rs"]
mod common;
use common::{exe, max_rel_diff, notice_join_and_kill_were_survived, params, scenario_json, train_alone};

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

/// Runs tests/llama3_tokenizer.py with `args` (a Llama-3-style tokenizer and model made with
/// transformers); its standard output.
fn llama3_py(args: &[&std::ffi::OsStr]) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/llama3_tokenizer.py");
    let out =
        Command::new(common::python()).arg(&script).args(args).env("HF_HUB_OFFLINE", "1").output().unwrap();
    assert!(out.status.success(), "llama3_tokenizer.py: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// `limpet export --hf hf --checkpoint checkpoint --tokenizer tokenizer`, which must succeed.
fn export_hf(hf: &Path, checkpoint: &Path, tokenizer: &Path) {
    let run = Command::new(exe())
        .args(["export", "--hf"])
        .arg(hf)
        .arg("--checkpoint")
        .arg(checkpoint)
        .arg("--tokenizer")
        .arg(tokenizer)
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
}

#[test]
fn an_elastic_llama_on_token_shards_matches_one_uninterrupted_process() {
    let tmp = tempfile::tempdir().unwrap();
    let data = shards(tmp.path());
    let data_arg = data.to_str().unwrap();
    let steps = 400;
    let mut args = vec!["--nodes", "3", "--batch", "16", "--data-path", data_arg, "--eval-every", "100"];
    args.extend_from_slice(LLAMA);
    let summary = scenario_json(
        &tmp.path().join("elastic"),
        &args,
        steps,
        "0.15:notice:node-2:20,0.4:join,0.7:kill:node-3",
    );
    notice_join_and_kill_were_survived(&summary);
    // Held-out evaluations every 100 steps, one value per step whatever rank logged it
    // (the ranks' shares summed by one allreduce), falling as the model learns.
    let mut evals: std::collections::BTreeMap<u64, Vec<f64>> = Default::default();
    for e in std::fs::read_dir(tmp.path().join("elastic")).unwrap().flatten() {
        if e.file_name().to_string_lossy().ends_with(".steps.jsonl") {
            for line in std::fs::read_to_string(e.path()).unwrap().lines() {
                let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { continue };
                if let Some(l) = v["eval_loss"].as_f64() {
                    evals.entry(v["step"].as_u64().unwrap() + 1).or_default().push(l);
                }
            }
        }
    }
    // The one at step 300 is lost when the kill (at step 280, found a few steps later) breaks
    // its collective: an evaluation a failure interrupts is skipped, not retried.
    let at: Vec<u64> = evals.keys().copied().collect();
    assert!(
        at.iter().all(|s| [100, 200, 300, 400].contains(s))
            && at.contains(&100)
            && at.contains(&200)
            && at.contains(&400),
        "{evals:?}"
    );
    for (step, ls) in &evals {
        assert!(ls.iter().all(|l| *l == ls[0]), "step {step}: ranks logged different held-out losses {ls:?}");
    }
    assert!(evals[&400][0] < evals[&100][0], "held-out loss did not fall: {evals:?}");

    let single = tmp.path().join("single");
    let mut alone = vec!["--batch", "16", "--data-path", data_arg, "--eval-every", "100"];
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
    export_hf(&hf, &single, &data.join("tokenizer.json"));
    for f in ["config.json", "model.safetensors", "tokenizer.json", "generation_config.json"] {
        assert!(hf.join(f).exists(), "export wrote no {f}");
    }
    // Trained from scratch, the model names no end token: the tokenizer's goes out with it.
    let gen: serde_json::Value =
        serde_json::from_slice(&std::fs::read(hf.join("generation_config.json")).unwrap()).unwrap();
    assert!(gen["eos_token_id"].is_u64(), "{gen}");
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
    // Files that hold more than flat tokens are named, not misread: an llm.c shard (a 256-int
    // header first) and a Megatron indexed dataset (a .idx beside the .bin).
    let index = |dir: &Path| {
        let out = Command::new(exe())
            .args(["data", "index", "--dtype", "uint16", "--vocab", "50000"])
            .arg(dir)
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let llmc = tmp.path().join("llmc");
    std::fs::create_dir_all(&llmc).unwrap();
    let mut header = vec![0i32; 256];
    (header[0], header[1], header[2]) = (20240520, 1, 3);
    let mut bytes: Vec<u8> = header.iter().flat_map(|v| v.to_le_bytes()).collect();
    bytes.extend([7u16, 8, 9].iter().flat_map(|t| t.to_le_bytes()));
    std::fs::write(llmc.join("fineweb_train_000001.bin"), bytes).unwrap();
    let err = index(&llmc);
    assert!(err.contains("an llm.c shard (magic 20240520, version 1)"), "{err}");
    let megatron = tmp.path().join("megatron");
    std::fs::create_dir_all(&megatron).unwrap();
    std::fs::write(megatron.join("corpus_text_document.bin"), [1u8, 0, 2, 0]).unwrap();
    std::fs::write(megatron.join("corpus_text_document.idx"), b"MMIDIDX\x00\x00\x01\x00").unwrap();
    let err = index(&megatron);
    assert!(err.contains("a Megatron indexed dataset"), "{err}");
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

/// `limpet data tokenize` frames documents the way the tokenizer says: with a Llama-3-style
/// tokenizer saved by transformers (made locally), every JSONL record becomes exactly what
/// transformers' tokenizer gives it (`<|begin_of_text|>` from the post-processor) followed by
/// the configured `<|end_of_text|>`, held-out chunks included; blank-line documents of a text
/// file are counted one by one; overrides apply, and an unknown token is refused by its flag.
/// The same records as a Parquet column give the same shards, and train the same BPE.
#[test]
fn tokenize_frames_documents_as_the_tokenizer_says() {
    let tmp = tempfile::tempdir().unwrap();
    let tok = tmp.path().join("tok");
    let py = llama3_py;
    let licence = Path::new("/usr/share/common-licenses/GPL-3");
    py(&["make".as_ref(), tok.as_os_str(), licence.as_os_str()]);
    // Paragraphs of every licence as JSONL records: enough tokens for held-out chunks.
    let mut paragraphs = Vec::new();
    let mut names: Vec<_> =
        std::fs::read_dir("/usr/share/common-licenses").unwrap().map(|e| e.unwrap().path()).collect();
    names.sort();
    for f in names.iter().filter(|p| p.is_file() && !p.is_symlink()) {
        let text = String::from_utf8_lossy(&std::fs::read(f).unwrap()).to_string();
        paragraphs.extend(text.split("\n\n").filter(|p| !p.trim().is_empty()).map(str::to_string));
    }
    let docs = tmp.path().join("docs.jsonl");
    let lines: Vec<String> =
        paragraphs.iter().map(|p| serde_json::json!({ "text": p }).to_string()).collect();
    std::fs::write(&docs, lines.join("\n") + "\n").unwrap();
    let tokenize = |input: &Path, out: &Path, extra: &[&str]| {
        Command::new(exe())
            .args(["data", "tokenize"])
            .arg(input)
            .arg("--tokenizer")
            .arg(tok.join("tokenizer.json"))
            .arg("--out")
            .arg(out)
            .args(extra)
            .output()
            .unwrap()
    };
    let shards = tmp.path().join("shards");
    let run = tokenize(&docs, &shards, &[]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let said = String::from_utf8_lossy(&run.stdout);
    assert!(
        said.contains(&format!(
            "{} documents (begin <|begin_of_text|>, end <|end_of_text|>)",
            paragraphs.len()
        )),
        "{said}"
    );
    assert!(!said.contains(" 0 held out"), "{said}");
    let checked = py(&["check".as_ref(), tok.as_os_str(), shards.as_os_str(), docs.as_os_str()]);
    assert!(checked.contains(&format!("{} documents", paragraphs.len())), "{checked}");
    // The same shards whatever the number of threads encoding them.
    let one = tmp.path().join("one-thread");
    let run = Command::new(exe())
        .args(["data", "tokenize"])
        .arg(&docs)
        .arg("--tokenizer")
        .arg(tok.join("tokenizer.json"))
        .arg("--out")
        .arg(&one)
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let manifest = |d: &Path| std::fs::read(d.join("limpet-tokens.json")).unwrap();
    assert_eq!(manifest(&one), manifest(&shards), "one thread wrote other shards");

    // Blank-line blocks of a text file, with the framing overridden.
    let blocks = String::from_utf8_lossy(&std::fs::read(licence).unwrap())
        .split("\n\n")
        .filter(|p| !p.trim().is_empty())
        .count();
    let run = tokenize(licence, &tmp.path().join("blocks"), &["--documents", "blank-lines", "--bos", "none"]);
    let said = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success()
            && said.contains(&format!("{blocks} documents (begin none, end <|end_of_text|>)")),
        "{said}"
    );
    let run = tokenize(licence, &tmp.path().join("bad"), &["--eos", "<|nope|>"]);
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(
        !run.status.success() && err.contains("--eos: \"<|nope|>\" is not a token of the tokenizer"),
        "{err}"
    );
    // The same records as a Parquet column (pyarrow's files, snappy and zstd, several row
    // groups) give the same shards; a missing or non-text column is named.
    for codec in ["snappy", "zstd"] {
        let pq = tmp.path().join(format!("docs-{codec}.parquet"));
        py(&["parquet".as_ref(), docs.as_os_str(), pq.as_os_str(), codec.as_ref()]);
        let out = tmp.path().join(format!("from-{codec}"));
        let run = tokenize(&pq, &out, &[]);
        assert!(run.status.success(), "{codec}: {}", String::from_utf8_lossy(&run.stderr));
        assert_eq!(manifest(&out), manifest(&shards), "{codec} Parquet gave other shards than JSONL");
        for shard in std::fs::read_dir(&shards).unwrap().map(|e| e.unwrap().file_name()) {
            assert_eq!(
                std::fs::read(out.join(&shard)).ok(),
                std::fs::read(shards.join(&shard)).ok(),
                "{shard:?}"
            );
        }
    }
    let pq = tmp.path().join("docs-snappy.parquet");
    for (field, want) in [
        ("body", "no column \"body\" (--field); its columns are [\"n\", \"text\"]"),
        ("n", "column \"n\" does not hold strings"),
    ] {
        let run = tokenize(&pq, &tmp.path().join(format!("bad-{field}")), &["--field", field]);
        let err = String::from_utf8_lossy(&run.stderr);
        assert!(!run.status.success() && err.contains(want), "{err}");
    }
    // A BPE trained on the Parquet column is the one trained on the JSONL records: trained
    // on the documents, not on the files' bytes (JSON syntax, compressed pages).
    let bpe = |input: &Path, out: &Path| {
        let run = Command::new(exe())
            .args(["data", "tokenize"])
            .arg(input)
            .args(["--train-bpe", "400", "--out"])
            .arg(out)
            .output()
            .unwrap();
        assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
        std::fs::read_to_string(out.join("tokenizer.json")).unwrap()
    };
    let from_jsonl = bpe(&docs, &tmp.path().join("bpe-jsonl"));
    assert_eq!(from_jsonl, bpe(&pq, &tmp.path().join("bpe-parquet")));
    assert!(!from_jsonl.contains(r#""{\"""#), "the BPE learned the records' JSON syntax");

    let bad = tmp.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"fine\"}\n{\"body\": \"no text\"}\n").unwrap();
    let run = tokenize(&bad, &tmp.path().join("bad2"), &[]);
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success() && err.contains("bad.jsonl:2: no string field \"text\""), "{err}");
}

/// The worked example of docs/workloads.md as a test: a Llama-3-shaped checkpoint (llama3
/// rotary scaling trained past its original context, GQA 4:1, tied, bf16, made by
/// transformers) fine-tuned by three agents on text tokenized with a Llama-3-style tokenizer,
/// through a spot notice, a join and a `kill -9`; exported in the source's dtype with the
/// tokenizer beside it; transformers generates from the export and knows its end token.
#[test]
fn a_llama3_shaped_checkpoint_fine_tunes_through_a_notice_a_join_and_a_kill() {
    let tmp = tempfile::tempdir().unwrap();
    let py = llama3_py;
    let (tok, base) = (tmp.path().join("tok"), tmp.path().join("base"));
    let licences = Path::new("/usr/share/common-licenses");
    py(&["make".as_ref(), tok.as_os_str(), licences.join("GPL-3").as_os_str()]);
    py(&["model".as_ref(), base.as_os_str(), tok.as_os_str()]);
    let shards = tmp.path().join("shards");
    let run = Command::new(exe())
        .args(["data", "tokenize"])
        .arg(licences)
        .args(["--documents", "blank-lines", "--tokenizer"])
        .arg(tok.join("tokenizer.json"))
        .arg("--out")
        .arg(&shards)
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let base_arg = base.to_str().unwrap();
    let data_arg = shards.to_str().unwrap();
    let args = [
        "--nodes",
        "3",
        "--batch",
        "16",
        "--model",
        "llama",
        "--data",
        "tokens",
        "--context",
        "64",
        "--data-path",
        data_arg,
        "--init-from",
        base_arg,
        "--eval-every",
        "100",
    ];
    let summary =
        scenario_json(&tmp.path().join("run"), &args, 300, "0.15:notice:node-2:20,0.4:join,0.7:kill:node-3");
    notice_join_and_kill_were_survived(&summary);
    let checkpoint = PathBuf::from(summary["checkpoint"].as_str().unwrap());
    let (image, _) = params(&checkpoint);
    assert_eq!(image.meta().job["model"]["rope_scaling"]["rope_type"], "llama3", "{:#}", image.meta().job);
    let hf = tmp.path().join("hf");
    export_hf(&hf, &checkpoint, &shards.join("tokenizer.json"));
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(hf.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        (cfg["torch_dtype"].as_str(), cfg["eos_token_id"].as_u64()),
        (Some("bfloat16"), Some(1)),
        "{cfg:#}"
    );
    let said = py(&["generate".as_ref(), hf.as_os_str(), "This program is free software".as_ref()]);
    let g: serde_json::Value = serde_json::from_str(said.trim()).unwrap();
    assert!(g["tokens"].as_u64().unwrap() > 0 && g["eos"] == 1, "{g}");
}
