//! `limpet-lab bench dp`: samples per second of a cluster of `limpetd` agents (the whole agent:
//! Raft log, heartbeats, ring allreduce) training a LLaMA on token shards, next to
//! `torchrun` + DistributedDataParallel (gloo) training the same model in transformers on the
//! same global batch with as many ranks (`bench/ddp_llama.py`), one libtorch thread per rank on
//! both; with sharded state, PyTorch's `ZeroRedundancyOptimizer` is the peer.

use crate::dp_cmd::python;
use crate::train_bench::{peer_files, random_shards};
use anyhow::Context;
use clap::Args;
use limpet_trainer::model::LlamaSpec;
use serde::Serialize;
use std::process::{Command, Stdio};

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
    /// With sharded state: also run limpet with the whole state on every rank, as N agents
    /// (at most `--world`) each given as many samples a step as a rank of the sharded run
    /// (the global batch scaled by N / world), in the same run. A whole-state rank holds all
    /// of the state at any world, so a smaller N measures the same per-rank memory where
    /// `--world` whole-state ranks would not fit this machine's memory (350m at world 4 on
    /// 24 GB). Its samples per second are of N ranks, not comparable.
    #[arg(long, value_name = "N")]
    pub whole_world: Option<usize>,
    /// Run no torchrun peer: for what limpet compares with itself (`--whole-world`) at a
    /// size whose peer does not fit this machine's memory beside it.
    #[arg(long)]
    pub no_peer: bool,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

/// What one run of limpet's agents measured.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LimpetSide {
    /// Agents.
    pub agents: usize,
    /// Samples per second in the steady state.
    pub samples_per_s: f64,
    /// The largest peak resident memory of an agent through its last step.
    pub peak_rss_bytes: u64,
    /// The same through the job's final checkpoint.
    pub final_peak_rss_bytes: u64,
    /// The largest resident memory of an agent at the last step.
    pub rss_bytes: u64,
    /// The most optimizer state any agent's first rank holds (counted by the trainer).
    pub optim_state_bytes: u64,
    /// The whole optimizer state (every slot of every parameter).
    pub whole_optim_state_bytes: u64,
}

/// What the torchrun peer measured.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct TorchrunSide {
    /// Samples per second in the steady state.
    pub samples_per_s: f64,
    /// limpet's samples per second over these.
    pub ratio: f64,
    /// The largest peak resident memory of a rank.
    pub peak_rss_bytes: u64,
    /// The largest resident memory of a rank after its last step.
    pub rss_bytes: u64,
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
    /// torchrun + DDP (or ZeRO-1, with sharded state) in the same run, unless `--no-peer`.
    pub torchrun: Option<TorchrunSide>,
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
    /// The optimizer state the largest sharded (or whole) rank holds, counted by its trainer.
    pub limpet_optim_state_bytes: u64,
    /// The whole optimizer state.
    pub whole_optim_state_bytes: u64,
    /// What sharding should leave a rank of it: (1 + replicas) / world (1 unsharded).
    pub expected_optim_share: f64,
    /// With `--whole-world`: limpet with the whole state on every rank, in the same run.
    pub limpet_whole: Option<LimpetSide>,
}

/// One limpet side of `bench dp`: its samples per second in the steady state, the largest
/// resident memory of an agent and the optimizer state of its first rank. The run's final
/// checkpoints are removed once measured (at 350m a host's is 3.6 GB).
fn limpet_dp(
    a: &BenchDpArgs,
    dir: &std::path::Path,
    job: crate::local::LocalJob,
    agents: usize,
) -> limpet_daemon::Result<LimpetSide> {
    let batch = job.global_batch as f64;
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
    let side = LimpetSide {
        agents,
        samples_per_s: (t.len() - 1) as f64 * batch / span_s.max(1e-9),
        peak_rss_bytes: most_in_logs(dir, "training_peak_rss_bytes=")?,
        final_peak_rss_bytes: most_in_logs(dir, " peak_rss_bytes=")?,
        rss_bytes: most_in_logs(dir, " rss_bytes=")?,
        optim_state_bytes: most_in_logs(dir, " optim_state_bytes=")?,
        whole_optim_state_bytes: most_in_logs(dir, "whole_optim_state_bytes=")?,
    };
    for e in walkdir(dir) {
        if e.extension().is_some_and(|x| x == "safetensors") {
            std::fs::remove_file(&e).with_context(|| format!("removing {}", e.display()))?;
        }
    }
    Ok(side)
}

/// Every file under `dir`.
fn walkdir(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => todo.push(e.path()),
                Ok(_) => out.push(e.path()),
                Err(_) => {}
            }
        }
    }
    out
}

/// Runs `limpet-lab bench dp`.
pub fn bench_dp(a: BenchDpArgs) -> limpet_daemon::Result<()> {
    let r = run_dp(&a)?;
    print_dp(&a, &r)
}

/// Runs what `limpet-lab bench dp` measures, printing only its progress.
pub fn run_dp(a: &BenchDpArgs) -> limpet_daemon::Result<DpBenchReport> {
    if a.world < 2 || a.batch < a.world || a.steps == 0 || a.context == 0 {
        return Err(limpet_daemon::UsageError(
            "--world must be at least 2, --batch at least --world, --steps and --context at least 1".into(),
        )
        .into());
    }
    if a.devices == 0 || a.world % a.devices != 0 {
        return Err(limpet_daemon::UsageError("--devices must divide --world".into()).into());
    }
    if let Some(n) = a.whole_world {
        if a.shard_replicas.is_none()
            || n < 2
            || n > a.world
            || n % a.devices != 0
            || (a.batch * n) % a.world != 0
        {
            return Err(limpet_daemon::UsageError(
                "--whole-world needs --shard-replicas, and must be from 2 to --world, a multiple of --devices, and give each rank as many samples as --batch over --world"
                    .into(),
            )
            .into());
        }
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
    let ours = limpet_dp(a, &tmp.path().join("limpet"), local, agents)?;
    let limpet_one_device_samples_per_s = if a.devices > 1 {
        eprintln!("limpet: {} agents of one device each, the same job", a.world);
        Some(limpet_dp(a, &tmp.path().join("limpet-one"), job.clone(), a.world)?.samples_per_s)
    } else {
        None
    };
    let limpet_whole = match a.whole_world {
        Some(n) => {
            // Each rank trains as many samples a step as a sharded one: its activations are
            // the same, and the state is all that differs.
            let global_batch = (a.batch * n / a.world) as u64;
            eprintln!(
                "limpet: the same job with the whole state on every rank, {n} ranks, global batch {global_batch}"
            );
            let whole =
                crate::local::LocalJob { devices: a.devices, shard_state: None, global_batch, ..job.clone() };
            Some(limpet_dp(a, &tmp.path().join("limpet-whole"), whole, n / a.devices)?)
        }
        None => None,
    };

    let limpet_no_overlap_samples_per_s = if a.overlap_both {
        eprintln!("limpet: the same job reducing after backward (overlap = false)");
        let after = crate::local::LocalJob { devices: a.devices, overlap: Some(false), ..job.clone() };
        Some(limpet_dp(a, &tmp.path().join("limpet-after"), after, agents)?.samples_per_s)
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
        let side = limpet_dp(a, &tmp.path().join("limpet-shards"), shared, agents)?;
        Some((side.samples_per_s, side.peak_rss_bytes))
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
            let side = limpet_dp(a, &tmp.path().join("limpet-zero2"), zero2, agents)?;
            Some((side.samples_per_s, side.peak_rss_bytes, side.rss_bytes))
        }
        _ => None,
    };
    let torchrun = if a.no_peer {
        None
    } else {
        let (theirs, peak_rss_bytes, rss_bytes) = torchrun_dp(a, tmp.path(), &spec)?;
        Some(TorchrunSide {
            samples_per_s: theirs,
            ratio: ours.samples_per_s / theirs,
            peak_rss_bytes,
            rss_bytes,
        })
    };
    let r = DpBenchReport {
        params: spec.num_params(),
        model: spec,
        world: a.world,
        batch: a.batch,
        context: a.context,
        limpet_samples_per_s: ours.samples_per_s,
        torchrun,
        shard_replicas: a.shard_replicas,
        limpet_peak_rss_bytes: ours.peak_rss_bytes,
        limpet_final_peak_rss_bytes: ours.final_peak_rss_bytes,
        limpet_rss_bytes: ours.rss_bytes,
        devices: a.devices,
        limpet_one_device_samples_per_s,
        limpet_no_overlap_samples_per_s,
        limpet_shards,
        limpet_sharded_gradients,
        limpet_optim_state_bytes: ours.optim_state_bytes,
        whole_optim_state_bytes: ours.whole_optim_state_bytes,
        expected_optim_share: a.shard_replicas.map_or(1.0, |r| ((1 + r) as f64 / a.world as f64).min(1.0)),
        limpet_whole,
    };
    Ok(r)
}

/// Prints what `limpet-lab bench dp` measured (`--json`: as JSON).
fn print_dp(a: &BenchDpArgs, r: &DpBenchReport) -> limpet_daemon::Result<()> {
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
        if let Some(t) = &r.torchrun {
            println!(
                "  {peer} {:>8.2} samples/s, RSS at the last step {:>5.0} MiB, peak {:>5.0} MiB (largest rank)",
                t.samples_per_s,
                mib(t.rss_bytes),
                mib(t.peak_rss_bytes)
            );
            println!("  ratio            {:>8.2}x (goal: at least 1.0)", t.ratio);
        }
        let share = r.limpet_optim_state_bytes as f64 / r.whole_optim_state_bytes.max(1) as f64;
        println!(
            "  optimizer state  {:>8.0} MiB on the largest rank of {:.0} MiB whole: {:.3} of it (expected {:.3}{})",
            mib(r.limpet_optim_state_bytes),
            mib(r.whole_optim_state_bytes),
            share,
            r.expected_optim_share,
            r.shard_replicas.map_or(String::new(), |n| format!(": 1/{} plus {n} replica", r.world))
        );
        if let Some(w) = &r.limpet_whole {
            // What sharding saves a rank over training, against what it should: the
            // optimizer state the rank no longer holds.
            let per = |b: u64| mib(b) / r.devices as f64;
            let expected = mib(w.optim_state_bytes.saturating_sub(r.limpet_optim_state_bytes));
            println!(
                "  limpet, whole state on {} ranks {:>8.2} samples/s, RSS at the last step {:>5.0} MiB, peak {:>5.0} MiB ({:.0} with the final checkpoint)",
                w.agents * r.devices,
                w.samples_per_s,
                mib(w.rss_bytes),
                mib(w.peak_rss_bytes),
                mib(w.final_peak_rss_bytes)
            );
            println!(
                "  sharding saves a rank {:>5.0} MiB at the last step, {:>5.0} MiB at the peak; the optimizer state it no longer holds is {expected:.0} MiB",
                per(w.rss_bytes) - per(r.limpet_rss_bytes),
                per(w.peak_rss_bytes) - per(r.limpet_peak_rss_bytes),
            );
        }
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

/// `bench memory --sharded-world N`: the same model at world `n` (its agents on random
/// tokens, `--batch` sequences a rank), sharded with one replica, then whole, in one run.
pub fn sharded_memory(
    a: &crate::train_bench::BenchMemoryArgs,
    n: usize,
) -> limpet_daemon::Result<crate::train_bench::ShardedMemory> {
    let dp = BenchDpArgs {
        preset: a.preset.clone(),
        vocab: crate::train_bench::MEMORY_VOCAB,
        batch: a.batch * n,
        context: a.context,
        world: n,
        steps: a.steps.max(1),
        warmup: 1,
        shard_replicas: Some(1),
        devices: 1,
        overlap_both: false,
        checkpoint_every: 0,
        shards_both: false,
        gradients_both: false,
        whole_world: Some(n),
        no_peer: true,
        json: false,
    };
    let r = run_dp(&dp)?;
    let whole = r.limpet_whole.context("bench dp measured no whole-state side")?;
    Ok(crate::train_bench::ShardedMemory {
        world: n,
        sharded_peak_rss_bytes: r.limpet_peak_rss_bytes,
        whole_peak_rss_bytes: whole.peak_rss_bytes,
        sharded_optim_state_bytes: r.limpet_optim_state_bytes,
        whole_optim_state_bytes: r.whole_optim_state_bytes,
        expected_optim_share: r.expected_optim_share,
    })
}
