//! `limpet-lab bench activations`: what activation checkpointing and a chunked loss buy. Runs
//! `limpet train` on the same LLaMA, data and steps four times (neither, checkpointing, a
//! chunked loss, both) and reports each run's peak RSS over the training steps, its speed and
//! its first-step loss, so the memory saved, the compute it costs and the loss it keeps are
//! read side by side.

use anyhow::Context;
use clap::Args;
use limpet_trainer::data::tokens::write_dataset;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::process::{Command, Stdio};

/// `limpet-lab bench activations`.
#[derive(Debug, Args)]
pub struct BenchActivationsArgs {
    /// LLaMA preset: tiny, small, 125m, 350m, 1b.
    #[arg(long, default_value = "small")]
    pub preset: String,
    /// Vocabulary size (Llama 3's is 128,256).
    #[arg(long, default_value_t = 128_256)]
    pub vocab: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 512)]
    pub context: usize,
    /// Steps per run.
    #[arg(long, default_value_t = 3)]
    pub steps: u64,
    /// Positions per chunk of the chunked loss.
    #[arg(long, default_value_t = 256)]
    pub loss_chunk: usize,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

/// One run of the benchmark.
#[derive(Debug, Serialize)]
pub struct ActivationRun {
    /// What it enabled.
    pub setting: String,
    /// Peak RSS over the training steps, bytes.
    pub train_peak_rss_bytes: u64,
    /// Samples per second over the run.
    pub samples_per_s: f64,
    /// The loss `limpet train` reports for the run (the same data and start for every run).
    pub train_loss: f64,
}

/// Runs `limpet-lab bench activations`.
pub fn run(a: BenchActivationsArgs) -> limpet_daemon::Result<()> {
    if a.batch == 0 || a.context == 0 || a.steps == 0 || a.loss_chunk == 0 || a.vocab < 2 {
        return Err(limpet_daemon::UsageError(
            "--batch, --context, --steps and --loss-chunk must be at least 1, --vocab at least 2".into(),
        )
        .into());
    }
    let tmp = tempfile::tempdir()?;
    let data = tmp.path().join("data");
    std::fs::create_dir_all(&data)?;
    let windows = (a.steps + 2) * a.batch as u64 * 2;
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let ids: Vec<u32> =
        (0..windows * (a.context as u64 + 1) + 1).map(|_| rng.random_range(0..a.vocab as u32)).collect();
    write_dataset(&data, &ids, &[], a.vocab as u64, 1 << 26)?;
    let exe = crate::local::limpet_path()?;
    let chunk = a.loss_chunk.to_string();
    let settings: [(&str, Vec<&str>); 4] = [
        ("neither", vec![]),
        ("activation checkpointing", vec!["--activation-checkpointing"]),
        ("chunked loss", vec!["--loss-chunk", &chunk]),
        ("both", vec!["--activation-checkpointing", "--loss-chunk", &chunk]),
    ];
    let mut runs = Vec::new();
    for (i, (setting, flags)) in settings.iter().enumerate() {
        eprintln!("bench activations: {setting} ({} of 4)", i + 1);
        let out = Command::new(&exe)
            .args(["train", "--model", "llama", "--data", "tokens", "--json", "--preset", &a.preset])
            .args(["--vocab", &a.vocab.to_string(), "--context", &a.context.to_string()])
            .args(["--batch", &a.batch.to_string(), "--steps", &a.steps.to_string(), "--warmup", "0"])
            .args(flags)
            .arg("--out")
            .arg(tmp.path().join(format!("run{i}")))
            .arg("--data-path")
            .arg(&data)
            .stderr(Stdio::inherit())
            .output()?;
        if !out.status.success() {
            limpet_daemon::fail!("limpet train ({setting}) failed ({})", out.status);
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        runs.push(ActivationRun {
            setting: setting.to_string(),
            train_peak_rss_bytes: v["train_peak_rss_bytes"].as_u64().context("no train_peak_rss_bytes")?,
            samples_per_s: v["samples_per_s"].as_f64().context("no samples_per_s")?,
            train_loss: v["train_loss"].as_f64().context("no train_loss")?,
        });
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&runs)?);
        return Ok(());
    }
    println!(
        "bench activations: LLaMA {} with a vocabulary of {}, batch {} x {} tokens, {} steps",
        a.preset, a.vocab, a.batch, a.context, a.steps
    );
    let base = &runs[0];
    for r in &runs {
        println!(
            "  {:<26} peak RSS {:>7.0} MiB ({:+5.1}%)  {:>7.2} samples/s ({:+5.1}%)  loss {:.6}",
            r.setting,
            r.train_peak_rss_bytes as f64 / (1 << 20) as f64,
            100.0 * (r.train_peak_rss_bytes as f64 / base.train_peak_rss_bytes as f64 - 1.0),
            r.samples_per_s,
            100.0 * (r.samples_per_s / base.samples_per_s - 1.0),
            r.train_loss
        );
    }
    Ok(())
}
