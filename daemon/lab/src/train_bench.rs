//! `limpet-lab bench train`: tokens per second of limpet's LLaMA training step in one process,
//! next to the same model in `transformers` (PyTorch eager, `bench/hf_train.py`) in the same
//! run, on equal settings: the same configuration (limpet writes the `config.json` both
//! build from), batch, context, libtorch threads, AdamW and gradient clipping at norm 1.
//!
//! limpet's side is the real training path: a [`Trainer`] reading windows of token shards
//! (random ids written for the run), computing gradients, flattening them into the buffer a
//! ring would reduce, and stepping its own AdamW. The peer draws random ids in memory.

use crate::dp_cmd::python;
use anyhow::Context;
use clap::Args;
use limpet_trainer::data::tokens::{write_dataset, write_manifest, Manifest, MANIFEST_FORMAT};
use limpet_trainer::data::{DataSpec, Dataset};
use limpet_trainer::model::{LlamaSpec, ModelSpec};
use limpet_trainer::{JobSpec, ModelKind, NoReduce, Trainer};
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::process::{Command, Stdio};
use std::time::Instant;

/// `limpet-lab bench train`.
#[derive(Debug, Args)]
pub struct BenchTrainArgs {
    /// LLaMA preset: tiny, small, 125m, 350m, 1b.
    #[arg(long, default_value = "small")]
    pub preset: String,
    /// Vocabulary size.
    #[arg(long, default_value_t = 8192)]
    pub vocab: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 256)]
    pub context: usize,
    /// Timed steps per side (after the warm-up steps).
    #[arg(long, default_value_t = 10)]
    pub steps: u64,
    /// Untimed steps first.
    #[arg(long, default_value_t = 2)]
    pub warmup: u64,
    /// libtorch threads on both sides.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Rounds, each timing both sides (in alternating order, so a machine whose speed drifts
    /// favours neither); the figures are the medians.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

/// What `limpet-lab bench train` measured.
#[derive(Debug, Serialize)]
pub struct TrainBenchReport {
    /// The model.
    pub model: LlamaSpec,
    /// Parameters.
    pub params: u64,
    /// Sequences per step, tokens per sequence, threads.
    pub batch: usize,
    /// Tokens per sequence.
    pub context: usize,
    /// libtorch threads.
    pub threads: usize,
    /// limpet's tokens per second.
    pub limpet_tokens_per_s: f64,
    /// transformers' tokens per second.
    pub transformers_tokens_per_s: f64,
    /// limpet / transformers (the median of the rounds' ratios).
    pub ratio: f64,
    /// Each round's (limpet, transformers) tokens per second.
    pub rounds: Vec<(f64, f64)>,
}

use crate::stats::median;

/// Random token shards (ids below `vocab`) for `windows` windows of `context` + 1 in `dir`.
pub(crate) fn random_shards(
    dir: &std::path::Path,
    vocab: usize,
    context: usize,
    windows: u64,
) -> limpet_daemon::Result<()> {
    let tokens = windows * (context as u64 + 1) + 1;
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let ids: Vec<u32> = (0..tokens).map(|_| rng.random_range(0..vocab as u32)).collect();
    write_dataset(dir, &ids, &[], vocab as u64, 1 << 26)?;
    Ok(())
}

/// Writes `spec`'s Hugging Face `config.json` and the peer's script into `dir`.
pub(crate) fn peer_files(
    dir: &std::path::Path,
    spec: &LlamaSpec,
    name: &str,
    script: &str,
) -> limpet_daemon::Result<(std::path::PathBuf, std::path::PathBuf)> {
    let cfg = dir.join("config.json");
    std::fs::write(&cfg, serde_json::to_vec(&limpet_trainer::hf::hf_config(spec))?)?;
    let path = dir.join(name);
    std::fs::write(&path, script)?;
    Ok((cfg, path))
}

/// Runs the benchmark.
pub fn bench(a: BenchTrainArgs) -> limpet_daemon::Result<()> {
    if a.batch == 0 || a.context == 0 || a.steps == 0 || a.threads == 0 || a.rounds == 0 {
        return Err(limpet_daemon::UsageError(
            "--batch, --context, --steps, --threads and --rounds must be at least 1".into(),
        )
        .into());
    }
    let spec = LlamaSpec::preset(&a.preset, a.vocab, a.context)
        .map_err(|e| limpet_daemon::UsageError(e.to_string()))?;
    let tmp = tempfile::tempdir()?;
    // Enough random tokens for every step's windows, written as shards.
    random_shards(tmp.path(), a.vocab, a.context, (a.steps + a.warmup + 1) * a.batch as u64)?;
    let data = Dataset::load(&DataSpec::Tokens { context: a.context }, Some(tmp.path()))?;
    let mut job = JobSpec::defaults_for(ModelKind::Llama, &data)?;
    job.model = ModelSpec::Llama(spec.clone());
    job.global_batch = a.batch;
    job.micro_batch = a.batch;
    job.steps = a.steps + a.warmup;
    job.schedule.warmup_steps = 0;
    job.optimizer = limpet_trainer::optim::OptimizerSpec::adamw(1e-3, 0.1);

    limpet_trainer::set_threads(a.threads);
    let ours = || -> limpet_daemon::Result<f64> {
        let mut t = Trainer::try_new(job.clone(), data.shallow_clone())?;
        let mut secs = 0.0;
        for s in 0..a.steps + a.warmup {
            let started = Instant::now();
            t.train_step(0, 1, &mut NoReduce)?;
            if s >= a.warmup {
                secs += started.elapsed().as_secs_f64();
            }
        }
        Ok((a.batch * a.context) as f64 * a.steps as f64 / secs)
    };
    let (cfg, script) =
        peer_files(tmp.path(), &spec, "hf_train.py", include_str!("../../../bench/hf_train.py"))?;
    let py = python();
    let theirs = || -> limpet_daemon::Result<f64> {
        let out = Command::new(&py)
            .arg(&script)
            .arg(&cfg)
            .args([a.batch, a.context, a.steps as usize, a.warmup as usize, a.threads].map(|v| v.to_string()))
            .env("OMP_NUM_THREADS", a.threads.to_string())
            .env("HF_HUB_OFFLINE", "1")
            .stderr(Stdio::inherit())
            .output()
            .with_context(|| format!("running {} (set LIMPET_PYTHON, or run `make setup`)", py.display()))?;
        if !out.status.success() {
            limpet_daemon::fail!("the transformers side failed ({})", out.status);
        }
        let v: serde_json::Value =
            serde_json::from_slice(&out.stdout).context("the transformers side's output")?;
        Ok(v["tokens_per_s"].as_f64().context("no tokens_per_s from the transformers side")?)
    };
    let mut rounds = Vec::with_capacity(a.rounds);
    for r in 0..a.rounds {
        let pair = if r % 2 == 0 {
            let o = ours()?;
            (o, theirs()?)
        } else {
            let t = theirs()?;
            (ours()?, t)
        };
        if !a.json {
            eprintln!("  round {}: limpet {:.0}, transformers {:.0} tokens/s", r + 1, pair.0, pair.1);
        }
        rounds.push(pair);
    }
    let r = TrainBenchReport {
        params: spec.num_params(),
        model: spec,
        batch: a.batch,
        context: a.context,
        threads: a.threads,
        limpet_tokens_per_s: median(rounds.iter().map(|p| p.0).collect()),
        transformers_tokens_per_s: median(rounds.iter().map(|p| p.1).collect()),
        ratio: median(rounds.iter().map(|p| p.0 / p.1).collect()),
        rounds,
    };
    print_train(&a, &r)
}

fn print_train(a: &BenchTrainArgs, r: &TrainBenchReport) -> limpet_daemon::Result<()> {
    if a.json {
        println!("{}", serde_json::to_string_pretty(r)?);
    } else {
        println!(
            "bench train: LLaMA {} ({:.1}M parameters), batch {} x {} tokens, {} thread(s)",
            a.preset,
            r.params as f64 / 1e6,
            r.batch,
            r.context,
            r.threads
        );
        println!("  limpet        {:>10.0} tokens/s", r.limpet_tokens_per_s);
        println!("  transformers  {:>10.0} tokens/s", r.transformers_tokens_per_s);
        println!(
            "  ratio         {:>10.2}x (median of {} rounds; goal: at least 1.0)",
            r.ratio,
            r.rounds.len()
        );
    }
    Ok(())
}

/// `limpet-lab bench memory`.
#[derive(Debug, Args)]
pub struct BenchMemoryArgs {
    /// LLaMA preset: tiny, small, 125m, 350m, 1b.
    #[arg(long, default_value = "small")]
    pub preset: String,
    /// Size of the large token dataset, GiB (a sparse file: it takes no disk).
    #[arg(long, default_value_t = 4)]
    pub dataset_gib: u64,
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128)]
    pub context: usize,
    /// Steps of each run.
    #[arg(long, default_value_t = 20)]
    pub steps: u64,
    /// Where `limpet train` trains (`cpu`, `cuda:N`, `auto`): on a GPU the report adds the
    /// device allocator's peak.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Also measure each rank's memory at world N (3 or more: at 2 one replica of each shard
    /// is the whole state) with its optimizer state sharded (each shard on one more rank)
    /// against the whole state on every rank: N agents each, on this machine, `--batch`
    /// sequences a rank, on small random token shards rather than `--dataset-gib`, each agent
    /// with its own overhead (`bench dp --shard-replicas 1 --whole-world N --no-peer`).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(3..=8))]
    pub sharded_world: Option<u64>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Per-rank memory with sharded and with whole optimizer state, in one run.
#[derive(Debug, Serialize)]
pub struct ShardedMemory {
    /// Ranks (agents) of each side.
    pub world: usize,
    /// The largest peak resident memory of an agent through its last step, sharded.
    pub sharded_peak_rss_bytes: u64,
    /// The same with the whole state on every rank.
    pub whole_peak_rss_bytes: u64,
    /// The optimizer state the largest sharded rank holds, counted by its trainer.
    pub sharded_optim_state_bytes: u64,
    /// The whole optimizer state.
    pub whole_optim_state_bytes: u64,
    /// What sharding should leave a rank of it: (1 + replicas) / world.
    pub expected_optim_share: f64,
}

/// The vocabulary of `bench memory`'s model.
pub const MEMORY_VOCAB: usize = 8192;

/// What `limpet-lab bench memory` measured.
#[derive(Debug, Serialize)]
pub struct MemoryBenchReport {
    /// Parameters of the model.
    pub params: u64,
    /// Its own footprint: f32 parameters, gradients and AdamW's two slots (16 bytes each).
    pub model_bytes: u64,
    /// The large dataset's size.
    pub dataset_bytes: u64,
    /// Peak RSS of `limpet train` on the large dataset.
    pub peak_rss_large: u64,
    /// Its peak over the training steps alone (before the final evaluation and checkpoint).
    pub train_peak_rss_large: u64,
    /// Peak RSS of `limpet train` on a 1 MiB dataset, the same model and batch.
    pub peak_rss_small: u64,
    /// `train_peak_rss_large / model_bytes`.
    pub ratio_to_model: f64,
    /// On a GPU: the device allocator's peak through the steps on the large dataset.
    pub train_peak_device_large: Option<u64>,
    /// With `--sharded-world`: each rank's memory, sharded against whole.
    pub sharded: Option<ShardedMemory>,
}

/// A token-shard directory of `bytes` bytes of id 0 (a sparse file) with its manifest.
fn sparse_shards(dir: &std::path::Path, bytes: u64, vocab: u64) -> limpet_daemon::Result<()> {
    std::fs::create_dir_all(dir)?;
    let bin = dir.join("train.bin");
    std::fs::File::create(&bin)?.set_len(bytes)?;
    let bar = indicatif::ProgressBar::new(bytes);
    let blake3 = limpet_trainer::data::tokens::hash_file(&bin, |n| bar.inc(n))?;
    bar.finish_and_clear();
    let entry =
        limpet_trainer::data::tokens::ShardEntry { file: "train.bin".into(), tokens: bytes / 2, blake3 };
    let m = Manifest {
        format: MANIFEST_FORMAT.into(),
        version: 1,
        dtype: limpet_trainer::data::tokens::TokenDtype::Uint16,
        vocab,
        tokenizer: None,
        train: vec![entry],
        val: vec![],
    };
    write_manifest(dir, &m)?;
    Ok(())
}

/// Runs `limpet-lab bench memory`: peak RSS of training on a large token dataset against the
/// model's own footprint and against the same training on a small dataset.
/// `sharded`: what `--sharded-world` measured (by the data-parallel bench, which runs agents).
pub fn bench_memory(a: BenchMemoryArgs, sharded: Option<ShardedMemory>) -> limpet_daemon::Result<()> {
    let vocab = MEMORY_VOCAB;
    let spec = LlamaSpec::preset(&a.preset, vocab, a.context)
        .map_err(|e| limpet_daemon::UsageError(e.to_string()))?;
    let tmp = tempfile::tempdir()?;
    let (large, small) = (tmp.path().join("large"), tmp.path().join("small"));
    eprintln!("writing and hashing a {} GiB token dataset (sparse)", a.dataset_gib);
    sparse_shards(&large, a.dataset_gib << 30, vocab as u64)?;
    sparse_shards(&small, 1 << 20, vocab as u64)?;
    let exe = crate::local::limpet_path()?;
    let peak = |data: &std::path::Path, out: &str| -> limpet_daemon::Result<(u64, u64, Option<u64>)> {
        let run = Command::new(&exe)
            .args(["train", "--model", "llama", "--data", "tokens", "--json", "--preset", &a.preset])
            .args(["--vocab", &vocab.to_string(), "--context", &a.context.to_string()])
            .args(["--batch", &a.batch.to_string(), "--steps", &a.steps.to_string(), "--device", &a.device])
            .arg("--out")
            .arg(tmp.path().join(out))
            .arg("--data-path")
            .arg(data)
            .stderr(Stdio::inherit())
            .output()?;
        if !run.status.success() {
            limpet_daemon::fail!("limpet train on {} failed ({})", data.display(), run.status);
        }
        let v: serde_json::Value = serde_json::from_slice(&run.stdout)?;
        let get = |k: &str| v[k].as_u64().with_context(|| format!("no {k} in the report"));
        Ok((get("peak_rss_bytes")?, get("train_peak_rss_bytes")?, v["train_peak_device_bytes"].as_u64()))
    };
    let (peak_rss_large, train_peak_rss_large, train_peak_device_large) = peak(&large, "large")?;
    let (peak_rss_small, ..) = peak(&small, "small")?;
    let params = spec.num_params();
    let r = MemoryBenchReport {
        params,
        model_bytes: 16 * params,
        dataset_bytes: a.dataset_gib << 30,
        peak_rss_large,
        train_peak_rss_large,
        peak_rss_small,
        ratio_to_model: train_peak_rss_large as f64 / (16 * params) as f64,
        train_peak_device_large,
        sharded,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        println!(
            "bench memory: LLaMA {} ({:.1}M parameters), batch {} x {}",
            a.preset,
            params as f64 / 1e6,
            a.batch,
            a.context
        );
        println!("  model (params, grads, AdamW slots)  {:>8.0} MiB", mib(r.model_bytes));
        println!(
            "  peak RSS over the steps, {} GiB data {:>8.0} MiB ({:.2}x the model; goal at most 1.5x)",
            a.dataset_gib,
            mib(train_peak_rss_large),
            r.ratio_to_model
        );
        println!("  peak RSS with the final checkpoint  {:>8.0} MiB", mib(peak_rss_large));
        if let Some(d) = train_peak_device_large {
            println!(
                "  device peak over the steps ({})    {:>8.0} MiB ({:.2}x the model)",
                a.device,
                mib(d),
                d as f64 / (16 * params) as f64
            );
        }
        println!(
            "  peak RSS, 1 MiB dataset             {:>8.0} MiB (with the final checkpoint)",
            mib(peak_rss_small)
        );
        if let Some(s) = &r.sharded {
            println!(
                "  agents at world {} (random tokens), {} sequences a rank: peak RSS of a rank {:.0} MiB sharded (optimizer state {:.0} of {:.0} MiB, {:.3}; expected {:.3}), {:.0} MiB whole: {:.2}x",
                s.world,
                a.batch,
                mib(s.sharded_peak_rss_bytes),
                mib(s.sharded_optim_state_bytes),
                mib(s.whole_optim_state_bytes),
                s.sharded_optim_state_bytes as f64 / s.whole_optim_state_bytes.max(1) as f64,
                s.expected_optim_share,
                mib(s.whole_peak_rss_bytes),
                s.sharded_peak_rss_bytes as f64 / s.whole_peak_rss_bytes.max(1) as f64
            );
        }
    }
    Ok(())
}
