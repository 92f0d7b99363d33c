//! `limpet-lab bench straggler`: what one slow host costs a data-parallel job, with equal
//! shares and with shares by measured speed, next to the same cluster without a slow host,
//! all in the same run on the same job.

use crate::demo::{read_step_logs, run_scenario};
use crate::local::LocalJob;
use clap::Args;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// `limpet-lab bench straggler`.
#[derive(Debug, Args)]
pub struct BenchStragglerArgs {
    /// Agents.
    #[arg(long, default_value_t = 3)]
    pub nodes: usize,
    /// Model (`convnet`, `mlp`, `gpt`).
    #[arg(long, default_value = "convnet")]
    pub model: String,
    /// Steps per run.
    #[arg(long, default_value_t = 1000)]
    pub steps: u64,
    /// Global batch.
    #[arg(long, default_value_t = 64)]
    pub batch: u64,
    /// How much slower the last node is: microseconds of sleep per sample it computes.
    #[arg(long, default_value_t = 400)]
    pub slow_us: u64,
    /// Where the runs go (default: a temporary directory).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// Mean milliseconds per step of node-1 over the last epoch, its first 20 steps left out.
fn steady_step_ms(dir: &Path) -> anyhow::Result<f64> {
    let lines = read_step_logs(&[dir.join("node-1.steps.jsonl")])?;
    let last = lines.iter().map(|l| l.epoch).max().unwrap_or(0);
    let mut at: Vec<u64> = lines.iter().filter(|l| l.epoch == last).map(|l| l.wall_ms).collect();
    at.sort_unstable();
    let at = &at[20.min(at.len())..];
    anyhow::ensure!(at.len() > 20, "too few steps in the last epoch of {}", dir.display());
    Ok((at[at.len() - 1] - at[0]) as f64 / (at.len() - 1) as f64)
}

/// Runs the benchmark.
pub fn run(a: BenchStragglerArgs) -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let root = a.dir.clone().unwrap_or_else(|| tmp.path().to_path_buf());
    let slow_node = format!("node-{}", a.nodes);
    let data = if a.model == "gpt" { "chars" } else { "digits" };
    let runs = [
        ("no slow host", None, 0.0),
        ("slow host, equal shares", Some((slow_node.clone(), a.slow_us)), 0.0),
        ("slow host, shares by speed", Some((slow_node.clone(), a.slow_us)), 1.3),
    ];
    let mut rows = Vec::new();
    for (i, (name, slow, ratio)) in runs.iter().enumerate() {
        let job = LocalJob {
            model: a.model.clone(),
            data: data.into(),
            steps: a.steps,
            global_batch: a.batch,
            slow: slow.clone(),
            straggler_ratio: *ratio,
            ..LocalJob::default()
        };
        let dir = root.join(format!("run-{i}"));
        eprintln!("{name} ...");
        let summary = run_scenario(&dir, a.nodes, job, &[], Duration::from_secs(1200), false)?;
        let ms = steady_step_ms(&dir)?;
        let shares = summary.transitions.last().map(|t| t.shares.clone()).unwrap_or_default();
        rows.push((name.to_string(), ms, shares));
    }
    let base = rows[0].1;
    println!(
        "{} agents, {} (batch {}), {} sleeping {} us per sample it computes\n",
        a.nodes, a.model, a.batch, slow_node, a.slow_us
    );
    println!("{:<28} {:>10} {:>12} {:>14}  SHARES", "RUN", "STEP (ms)", "SAMPLES/S", "OF NO SLOW");
    for (name, ms, shares) in &rows {
        println!(
            "{name:<28} {ms:>10.2} {:>12.0} {:>13.0}%  {}",
            a.batch as f64 / ms * 1e3,
            base / ms * 100.0,
            if shares.is_empty() { "equal".to_string() } else { format!("{shares:?}") }
        );
    }
    Ok(())
}
