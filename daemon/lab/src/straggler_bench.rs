//! `limpet-lab bench straggler`: what one slow host costs a data-parallel job, with equal
//! shares and with shares by measured speed, next to the same cluster without a slow host,
//! all in the same run on the same job. With `--pipeline N`, a pipelined job instead: the
//! slow host placed as if it were the profiled one, and placed by its measured speed.

use crate::demo::run_scenario;
use crate::local::LocalJob;
use crate::steplog::read_step_logs;
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
    /// A pipelined job of this many stages (a GPT of `--layers` blocks); the last node then
    /// computes `--slow-factor` times slower.
    #[arg(long)]
    pub pipeline: Option<usize>,
    /// The pipelined job's transformer layers.
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// How many times slower the last node computes, with `--pipeline`.
    #[arg(long, default_value_t = 3.0)]
    pub slow_factor: f64,
    /// Where the runs go (default: a temporary directory).
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// Mean milliseconds per step of node-1 over the last epoch, its first 20 steps left out.
fn steady_step_ms(dir: &Path) -> limpet_daemon::Result<f64> {
    let lines = read_step_logs(&[dir.join("node-1.steps.jsonl")])?;
    let last = lines.iter().map(|l| l.epoch).max().unwrap_or(0);
    let mut at: Vec<u64> = lines.iter().filter(|l| l.epoch == last).map(|l| l.wall_ms).collect();
    at.sort_unstable();
    let at = &at[20.min(at.len())..];
    if at.len() <= 20 {
        limpet_daemon::fail!("too few steps in the last epoch of {}", dir.display());
    }
    Ok((at[at.len() - 1] - at[0]) as f64 / (at.len() - 1) as f64)
}

/// One run of the benchmark: its name, how the slow node is slowed, the straggler ratio.
type Run = (&'static str, Option<(String, u64)>, Option<(String, f64)>, f64);

/// Runs the benchmark.
pub fn run(a: BenchStragglerArgs) -> limpet_daemon::Result<()> {
    let tmp = tempfile::tempdir()?;
    let root = a.dir.clone().unwrap_or_else(|| tmp.path().to_path_buf());
    let slow_node = format!("node-{}", a.nodes);
    let pipelined = a.pipeline.is_some();
    let model = if pipelined { "gpt".to_string() } else { a.model.clone() };
    let data = if model == "gpt" { "chars" } else { "digits" };
    let (us, factor) = (Some((slow_node.clone(), a.slow_us)), Some((slow_node.clone(), a.slow_factor)));
    let runs: Vec<Run> = if pipelined {
        vec![
            ("no slow host", None, None, 0.0),
            ("slow host, as profiled", None, factor.clone(), 0.0),
            ("slow host, placed by speed", None, factor, 1.3),
        ]
    } else {
        vec![
            ("no slow host", None, None, 0.0),
            ("slow host, equal shares", us.clone(), None, 0.0),
            ("slow host, shares by speed", us, None, 1.3),
        ]
    };
    let mut rows = Vec::new();
    for (i, (name, slow, slow_factor, ratio)) in runs.into_iter().enumerate() {
        let job = LocalJob {
            model: model.clone(),
            data: data.into(),
            steps: a.steps,
            global_batch: a.batch,
            micro_batch: pipelined.then_some(8),
            pipeline: a.pipeline.map(|p| p.to_string()),
            layers: pipelined.then_some(a.layers),
            slow,
            slow_factor,
            straggler_ratio: ratio,
            ..LocalJob::default()
        };
        let dir = root.join(format!("run-{i}"));
        eprintln!("{name} ...");
        let summary = run_scenario(&dir, a.nodes, job, &[], Duration::from_secs(1200), false)?;
        let ms = steady_step_ms(&dir)?;
        let last = summary.transitions.last();
        let how = match last {
            Some(t) if pipelined => format!("{} cuts {:?} ranks {:?}", t.layout, t.cuts, t.ranks),
            Some(t) if !t.shares.is_empty() => format!("{:?}", t.shares),
            _ => "equal".to_string(),
        };
        rows.push((name.to_string(), ms, how));
    }
    let base = rows[0].1;
    let slowness = if pipelined {
        format!("computing {}x slower", a.slow_factor)
    } else {
        format!("sleeping {} us per sample it computes", a.slow_us)
    };
    println!("{} agents, {model} (batch {}), {slow_node} {slowness}\n", a.nodes, a.batch);
    let last = if pipelined { "LAYOUT" } else { "SHARES" };
    println!("{:<28} {:>10} {:>12} {:>14}  {last}", "RUN", "STEP (ms)", "SAMPLES/S", "OF NO SLOW");
    for (name, ms, how) in &rows {
        println!(
            "{name:<28} {ms:>10.2} {:>12.0} {:>13.0}%  {how}",
            a.batch as f64 / ms * 1e3,
            base / ms * 100.0
        );
    }
    Ok(())
}
