//! `limpet-lab bench train`: tokens per second of limpet's LLaMA training step in one process,
//! next to the same model in `transformers` (PyTorch eager, `bench/hf_train.py`) in the same
//! run, on equal settings: the same configuration (limpet writes the `config.json` both
//! build from), batch, context, libtorch threads, AdamW and gradient clipping at norm 1.
//!
//! `limpet-lab bench dp`: samples per second of a cluster of `limpetd` agents (the whole agent:
//! Raft log, heartbeats, ring allreduce) training that LLaMA on token shards, next to
//! `torchrun` + DistributedDataParallel (gloo) training the transformers model on the same
//! global batch with as many ranks (`bench/ddp_llama.py`), one libtorch thread per rank on both.
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
fn random_shards(
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
fn peer_files(
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

/// `limpet-lab bench dp`.
#[derive(Debug, Args)]
pub struct BenchDpArgs {
    /// LLaMA preset: tiny, small, 125m, 350m, 1b.
    #[arg(long, default_value = "small")]
    pub preset: String,
    /// Vocabulary size.
    #[arg(long, default_value_t = 8192)]
    pub vocab: usize,
    /// Global batch (sequences per step over all ranks).
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 128)]
    pub context: usize,
    /// Agents on limpet's side, ranks on torchrun's.
    #[arg(long, default_value_t = 2)]
    pub world: usize,
    /// Timed steps (after the warm-up steps).
    #[arg(long, default_value_t = 30)]
    pub steps: u64,
    /// Untimed steps first.
    #[arg(long, default_value_t = 5)]
    pub warmup: u64,
    /// Shard the optimizer state, each shard on N more ranks (`[job].shard_state`); the
    /// peer then runs PyTorch's `ZeroRedundancyOptimizer`.
    #[arg(long, value_name = "N")]
    pub shard_replicas: Option<usize>,
    /// limpet's ranks as world/N agents of N devices each (`[node].devices`, CPU ranks here),
    /// measured beside world agents of one device in the same run.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub devices: usize,
    /// Also run limpet with `[job].overlap = false` (the gradients reduced once backward has
    /// ended, not a bucket at a time while it runs), in the same run.
    #[arg(long)]
    pub overlap_both: bool,
    /// limpet writes a checkpoint every N steps (0: none but the final one).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub checkpoint_every: u64,
    /// With sharded state and `--checkpoint-every`: also run limpet with one shared
    /// checkpoint directory (`[checkpoint].shared`), each rank writing its shard, beside every
    /// rank gathering the state for each checkpoint, in the same run.
    #[arg(long)]
    pub shards_both: bool,
    /// With sharded state: also run limpet with the gradients sharded too
    /// (`shard_state = "optimizer+gradients"`, ZeRO-2), in the same run.
    #[arg(long)]
    pub gradients_both: bool,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

/// What `limpet-lab bench dp` measured.
#[derive(Debug, Serialize)]
pub struct DpBenchReport {
    /// The model.
    pub model: LlamaSpec,
    /// Parameters.
    pub params: u64,
    /// Ranks on each side.
    pub world: usize,
    /// Global batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub context: usize,
    /// limpet agents' samples per second in the steady state.
    pub limpet_samples_per_s: f64,
    /// torchrun + DDP's samples per second.
    pub torchrun_samples_per_s: f64,
    /// limpet / torchrun.
    pub ratio: f64,
    /// Optimizer state sharded (limpet: replicas of each shard; the peer:
    /// `ZeroRedundancyOptimizer`), or `None`: whole on every rank.
    pub shard_replicas: Option<usize>,
    /// The largest peak resident memory of a limpet agent process through its last step
    /// (what the peer's figure covers: training, no checkpoint).
    pub limpet_peak_rss_bytes: u64,
    /// The same through the job's final checkpoint (a sharded job gathers its state whole
    /// for it, and the checkpoint's image and file are written from memory).
    pub limpet_final_peak_rss_bytes: u64,
    /// The largest resident memory of a limpet agent at the last step (the steady state).
    pub limpet_rss_bytes: u64,
    /// The largest peak resident memory of a torchrun rank.
    pub torchrun_peak_rss_bytes: u64,
    /// The largest resident memory of a torchrun rank after its last step.
    pub torchrun_rss_bytes: u64,
    /// Devices (local ranks) per limpet agent: the figures above are of world/devices agents.
    pub devices: usize,
    /// With several devices per agent: world agents of one device each, in the same run.
    pub limpet_one_device_samples_per_s: Option<f64>,
    /// With `--overlap-both`: limpet reducing after backward (`overlap = false`), in the
    /// same run.
    pub limpet_no_overlap_samples_per_s: Option<f64>,
    /// With `--shards-both`: limpet writing its checkpoints as shards into a shared
    /// directory, in the same run: samples per second and the largest training peak.
    pub limpet_shards: Option<(f64, u64)>,
    /// With `--gradients-both`: limpet's samples per second, peak and last-step resident
    /// memory (largest rank) with the gradients sharded too (ZeRO-2).
    pub limpet_sharded_gradients: Option<(f64, u64, u64)>,
}

/// One limpet side of `bench dp`: its samples per second in the steady state, and the
/// largest (training peak, final peak, last-step) resident memory of an agent.
fn limpet_dp(
    a: &BenchDpArgs,
    dir: &std::path::Path,
    job: crate::local::LocalJob,
    agents: usize,
) -> limpet_daemon::Result<(f64, u64, u64, u64)> {
    crate::demo::run_scenario(dir, agents, job, &[], std::time::Duration::from_secs(1800), !a.json)?;
    let lines = crate::steplog::step_logs_in(dir)?;
    // Rank 0's completions after the warm-up: (steps - 1) intervals of the steady state.
    let mut t: Vec<(u64, u64)> =
        lines.iter().filter(|l| l.rank == 0 && l.step >= a.warmup).map(|l| (l.step, l.wall_ms)).collect();
    t.sort_unstable();
    t.dedup_by_key(|x| x.0);
    if t.len() < 2 {
        limpet_daemon::fail!("limpet's step logs hold {} timed steps", t.len());
    }
    let span_s = (t[t.len() - 1].1 - t[0].1) as f64 / 1e3;
    Ok((
        (t.len() - 1) as f64 * a.batch as f64 / span_s.max(1e-9),
        most_in_logs(dir, "training_peak_rss_bytes=")?,
        most_in_logs(dir, " peak_rss_bytes=")?,
        most_in_logs(dir, " rss_bytes=")?,
    ))
}

/// Runs `limpet-lab bench dp`.
pub fn bench_dp(a: BenchDpArgs) -> limpet_daemon::Result<()> {
    if a.world < 2 || a.batch < a.world || a.steps == 0 || a.context == 0 {
        return Err(limpet_daemon::UsageError(
            "--world must be at least 2, --batch at least --world, --steps and --context at least 1".into(),
        )
        .into());
    }
    if a.devices == 0 || a.world % a.devices != 0 {
        return Err(limpet_daemon::UsageError("--devices must divide --world".into()).into());
    }
    let spec = LlamaSpec::preset(&a.preset, a.vocab, a.context)
        .map_err(|e| limpet_daemon::UsageError(e.to_string()))?;
    let tmp = tempfile::tempdir()?;
    let shards = tmp.path().join("shards");
    std::fs::create_dir_all(&shards)?;
    random_shards(&shards, a.vocab, a.context, (a.steps + a.warmup + 1) * a.batch as u64)?;
    let steps = a.steps + a.warmup;
    let job = crate::local::LocalJob {
        model: "llama".into(),
        data: "tokens".into(),
        steps,
        global_batch: a.batch as u64,
        data_path: Some(shards.clone()),
        data_section: limpet_trainer::workload::DataSection { context: Some(a.context) },
        model_section: limpet_trainer::workload::ModelSection {
            preset: Some(a.preset.clone()),
            vocab: Some(a.vocab),
            ..Default::default()
        },
        shard_state: a.shard_replicas.map(|r| ("optimizer".to_string(), r)),
        checkpoint_every: a.checkpoint_every,
        ..crate::local::LocalJob::default()
    };
    let agents = a.world / a.devices;
    eprintln!(
        "limpet: {agents} agents of {} device(s), LLaMA {} on token shards, global batch {}, {steps} steps{}",
        a.devices,
        a.preset,
        a.batch,
        a.shard_replicas.map_or(String::new(), |r| format!(", optimizer state sharded ({r} replica)"))
    );
    let local = crate::local::LocalJob { devices: a.devices, ..job.clone() };
    let (ours, limpet_peak_rss_bytes, limpet_final_peak_rss_bytes, limpet_rss_bytes) =
        limpet_dp(&a, &tmp.path().join("limpet"), local, agents)?;
    let limpet_one_device_samples_per_s = if a.devices > 1 {
        eprintln!("limpet: {} agents of one device each, the same job", a.world);
        Some(limpet_dp(&a, &tmp.path().join("limpet-one"), job.clone(), a.world)?.0)
    } else {
        None
    };

    let limpet_no_overlap_samples_per_s = if a.overlap_both {
        eprintln!("limpet: the same job reducing after backward (overlap = false)");
        let after = crate::local::LocalJob { devices: a.devices, overlap: Some(false), ..job.clone() };
        Some(limpet_dp(&a, &tmp.path().join("limpet-after"), after, agents)?.0)
    } else {
        None
    };
    let limpet_shards = if a.shards_both && a.shard_replicas.is_some() && a.checkpoint_every > 0 {
        eprintln!("limpet: the same job writing its checkpoints as shards into one shared directory");
        let shared = crate::local::LocalJob {
            devices: a.devices,
            checkpoint_dir: Some(tmp.path().join("shared-checkpoints")),
            checkpoint_shared: true,
            ..job.clone()
        };
        let (speed, peak, _, _) = limpet_dp(&a, &tmp.path().join("limpet-shards"), shared, agents)?;
        Some((speed, peak))
    } else {
        None
    };
    let limpet_sharded_gradients = match a.shard_replicas {
        Some(r) if a.gradients_both => {
            eprintln!("limpet: the same job with the gradients sharded too (optimizer+gradients)");
            let zero2 = crate::local::LocalJob {
                devices: a.devices,
                shard_state: Some(("optimizer+gradients".to_string(), r)),
                ..job.clone()
            };
            let (speed, peak, _, last) = limpet_dp(&a, &tmp.path().join("limpet-zero2"), zero2, agents)?;
            Some((speed, peak, last))
        }
        _ => None,
    };
    let (theirs, torchrun_peak_rss_bytes, torchrun_rss_bytes) = torchrun_dp(&a, tmp.path(), &spec)?;
    let r = DpBenchReport {
        params: spec.num_params(),
        model: spec,
        world: a.world,
        batch: a.batch,
        context: a.context,
        limpet_samples_per_s: ours,
        torchrun_samples_per_s: theirs,
        ratio: ours / theirs,
        shard_replicas: a.shard_replicas,
        limpet_peak_rss_bytes,
        limpet_final_peak_rss_bytes,
        limpet_rss_bytes,
        torchrun_peak_rss_bytes,
        torchrun_rss_bytes,
        devices: a.devices,
        limpet_one_device_samples_per_s,
        limpet_no_overlap_samples_per_s,
        limpet_shards,
        limpet_sharded_gradients,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!(
            "bench dp: LLaMA {} ({:.1}M parameters), {} ranks, global batch {} x {} tokens, 1 thread per rank",
            a.preset,
            r.params as f64 / 1e6,
            r.world,
            r.batch,
            r.context
        );
        let mib = |b: u64| b as f64 / f64::from(1 << 20);
        let peer = if r.shard_replicas.is_some() { "torchrun + ZeRO-1" } else { "torchrun + DDP  " };
        println!(
            "  limpet agents    {:>8.2} samples/s, RSS at the last step {:>5.0} MiB, peak {:>5.0} MiB (largest rank; {:.0} MiB with the final checkpoint){}",
            r.limpet_samples_per_s,
            mib(r.limpet_rss_bytes),
            mib(r.limpet_peak_rss_bytes),
            mib(r.limpet_final_peak_rss_bytes),
            r.shard_replicas.map_or(String::new(), |n| format!(", state sharded, {n} replica"))
                + &if r.devices > 1 { format!(", an agent holds {} ranks", r.devices) } else { String::new() }
        );
        println!(
            "  {peer} {:>8.2} samples/s, RSS at the last step {:>5.0} MiB, peak {:>5.0} MiB (largest rank)",
            r.torchrun_samples_per_s,
            mib(r.torchrun_rss_bytes),
            mib(r.torchrun_peak_rss_bytes)
        );
        println!("  ratio            {:>8.2}x (goal: at least 1.0)", r.ratio);
        if let Some(after) = r.limpet_no_overlap_samples_per_s {
            println!(
                "  limpet, reducing after backward {:>8.2} samples/s: overlapping is {:.2}x that",
                after,
                r.limpet_samples_per_s / after
            );
        }
        if let Some((speed, peak)) = r.limpet_shards {
            println!(
                "  limpet, checkpoints as shards in a shared directory {:>8.2} samples/s, peak {:>5.0} MiB (largest rank; {:.0} MiB gathering the state for each)",
                speed,
                mib(peak),
                mib(r.limpet_peak_rss_bytes)
            );
        }
        if let Some((speed, peak, last)) = r.limpet_sharded_gradients {
            println!(
                "  limpet, gradients sharded too (ZeRO-2) {:>8.2} samples/s, RSS at the last step {:>5.0} MiB, peak {:>5.0} MiB (largest rank)",
                speed,
                mib(last),
                mib(peak)
            );
        }
        if let Some(one) = r.limpet_one_device_samples_per_s {
            println!(
                "  limpet, {} agents of one device {:>8.2} samples/s: {} agents of {} devices are {:.2}x that (goal: at least 1.0)",
                r.world,
                one,
                r.world / r.devices,
                r.devices,
                r.limpet_samples_per_s / one
            );
        }
    }
    Ok(())
}

/// The same job under torchrun with DDP (gloo) on the same LLaMA in transformers: its
/// steady-state samples per second.
fn torchrun_dp(
    a: &BenchDpArgs,
    tmp: &std::path::Path,
    spec: &LlamaSpec,
) -> limpet_daemon::Result<(f64, u64, u64)> {
    let (cfg, script) = peer_files(tmp, spec, "ddp_llama.py", include_str!("../../../bench/ddp_llama.py"))?;
    let optimizer = if a.shard_replicas.is_some() { "zero" } else { "adamw" };
    eprintln!(
        "torchrun: {} ranks, DDP (gloo), the same LLaMA in transformers, optimizer {optimizer}",
        a.world
    );
    let py = python();
    let port = crate::raft_cmd::free_port()?;
    let out = Command::new(&py)
        .args(["-m", "torch.distributed.run", "--standalone", "--nnodes", "1"])
        .arg(format!("--nproc_per_node={}", a.world))
        .arg(format!("--master_port={port}"))
        .arg(&script)
        .arg(&cfg)
        .args([a.batch, a.context, a.steps as usize, a.warmup as usize].map(|v| v.to_string()))
        .arg(optimizer)
        .env("OMP_NUM_THREADS", "1")
        .env("HF_HUB_OFFLINE", "1")
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| {
            format!("running torchrun with {} (set LIMPET_PYTHON, or run `make setup`)", py.display())
        })?;
    if !out.status.success() {
        limpet_daemon::fail!("torchrun failed ({})", out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().rev().find(|l| l.starts_with('{')).context("no result line from torchrun")?;
    let theirs: serde_json::Value = serde_json::from_str(line)?;
    let peak = theirs["peak_rss_bytes"].as_u64().context("no peak_rss_bytes from torchrun")?;
    let rss = theirs["rss_bytes"].as_u64().context("no rss_bytes from torchrun")?;
    let theirs = theirs["samples_per_s"].as_f64().context("no samples_per_s from torchrun")?;
    Ok((theirs, peak, rss))
}

/// The largest value of `key` (`peak_rss_bytes=`, ` rss_bytes=`) the agents' logs in `dir`
/// report.
fn most_in_logs(dir: &std::path::Path, key: &str) -> limpet_daemon::Result<u64> {
    let mut most = 0;
    for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))?.flatten() {
        if e.path().extension().is_some_and(|x| x == "log") {
            let text = std::fs::read_to_string(e.path())?;
            for v in text.split(key).skip(1) {
                let digits: String = v.chars().take_while(char::is_ascii_digit).collect();
                most = most.max(digits.parse::<u64>().unwrap_or(0));
            }
        }
    }
    if most == 0 {
        limpet_daemon::fail!("no agent log in {} reports {key:?}", dir.display());
    }
    Ok(most)
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
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

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
pub fn bench_memory(a: BenchMemoryArgs) -> limpet_daemon::Result<()> {
    let vocab = 8192usize;
    let spec = LlamaSpec::preset(&a.preset, vocab, a.context)
        .map_err(|e| limpet_daemon::UsageError(e.to_string()))?;
    let tmp = tempfile::tempdir()?;
    let (large, small) = (tmp.path().join("large"), tmp.path().join("small"));
    eprintln!("writing and hashing a {} GiB token dataset (sparse)", a.dataset_gib);
    sparse_shards(&large, a.dataset_gib << 30, vocab as u64)?;
    sparse_shards(&small, 1 << 20, vocab as u64)?;
    let exe = crate::local::limpet_path()?;
    let peak = |data: &std::path::Path, out: &str| -> limpet_daemon::Result<(u64, u64)> {
        let run = Command::new(&exe)
            .args(["train", "--model", "llama", "--data", "tokens", "--json", "--preset", &a.preset])
            .args(["--vocab", &vocab.to_string(), "--context", &a.context.to_string()])
            .args(["--batch", &a.batch.to_string(), "--steps", &a.steps.to_string(), "--out"])
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
        Ok((get("peak_rss_bytes")?, get("train_peak_rss_bytes")?))
    };
    let (peak_rss_large, train_peak_rss_large) = peak(&large, "large")?;
    let (peak_rss_small, _) = peak(&small, "small")?;
    let params = spec.num_params();
    let r = MemoryBenchReport {
        params,
        model_bytes: 16 * params,
        dataset_bytes: a.dataset_gib << 30,
        peak_rss_large,
        train_peak_rss_large,
        peak_rss_small,
        ratio_to_model: train_peak_rss_large as f64 / (16 * params) as f64,
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
        println!(
            "  peak RSS, 1 MiB dataset             {:>8.0} MiB (with the final checkpoint)",
            mib(peak_rss_small)
        );
    }
    Ok(())
}
