//! The single-process driver: train a job to its last step (or an earlier stop), checkpoint
//! atomically, evaluate, and report. Progress goes to a callback so the CLI can draw a bar and
//! tests can watch.

use crate::{Eval, NoReduce, StepStats, Trainer, TrainerError};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// File name of the checkpoint inside a run directory.
pub const CHECKPOINT_FILE: &str = "checkpoint.safetensors";

/// File name of a checkpoint written before the step it holds is known to be the job's end
/// (a sharded job's final one, written at its last step by the ranks together), moved to
/// [`CHECKPOINT_FILE`] by [`place_checkpoint`] once it is.
pub const PENDING_CHECKPOINT_FILE: &str = "checkpoint.pending.safetensors";

/// How far to run and where to write.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Directory for the checkpoint.
    pub out: PathBuf,
    /// Stop after this step count instead of the job's last step (to resume later).
    pub stop_at: Option<u64>,
    /// Also checkpoint every this many steps.
    pub checkpoint_every: Option<u64>,
    /// Evaluate on the test split every this many steps (and always at the end).
    pub eval_every: Option<u64>,
}

/// Events reported while running.
#[derive(Debug, Clone)]
pub enum Progress {
    /// A step was applied.
    Step(StepStats),
    /// The test split was evaluated after `step` steps.
    Eval {
        /// Steps applied.
        step: u64,
        /// The metrics.
        eval: Eval,
    },
    /// A checkpoint was written after `step` steps.
    Checkpoint {
        /// Steps applied.
        step: u64,
        /// The file.
        path: PathBuf,
    },
}

/// The outcome of a run, also printed as JSON by `limpet train --json`.
#[derive(Debug, Clone, Serialize)]
pub struct RunReport {
    /// Model family and sizes.
    pub model: serde_json::Value,
    /// Dataset.
    pub data: serde_json::Value,
    /// Step the run started from (0 unless resumed).
    pub start_step: u64,
    /// Steps applied when the run ended.
    pub final_step: u64,
    /// The job's total steps.
    pub total_steps: u64,
    /// Mean training loss of the last step.
    pub train_loss: Option<f64>,
    /// Mean test loss at the end.
    pub test_loss: f64,
    /// Test accuracy at the end.
    pub test_accuracy: f64,
    /// Wall-clock seconds spent training (evaluation and checkpoints included).
    pub elapsed_s: f64,
    /// Training samples per second.
    pub samples_per_s: f64,
    /// Where the final checkpoint is.
    pub checkpoint: PathBuf,
    /// Content hash of the final state.
    pub content_hash: String,
    /// The process's peak resident memory (Linux's VmHWM), bytes; 0 where unknown.
    pub peak_rss_bytes: u64,
    /// The same, read after the last step and before the final evaluation and checkpoint
    /// (which holds a copy of the whole state as it encodes it).
    pub train_peak_rss_bytes: u64,
    /// On a GPU, the device allocator's peak of bytes held for tensors through the last
    /// step (libtorch's `max_memory_allocated`); absent on the CPU, whose resident size
    /// above tells.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub train_peak_device_bytes: Option<u64>,
}

/// The process's peak resident set size so far, from `/proc/self/status`.
pub fn peak_rss_bytes() -> u64 {
    status_bytes("VmHWM:")
}

/// This process's resident memory now, in bytes (0 where `/proc` does not say).
pub fn rss_bytes() -> u64 {
    status_bytes("VmRSS:")
}

fn status_bytes(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// Checkpoints `trainer` to `dir`/[`CHECKPOINT_FILE`] atomically, straight from its tensors
/// ([`Trainer::write_state_file`]); returns the file's path and content hash.
pub fn save_checkpoint(trainer: &Trainer, dir: &Path) -> Result<(PathBuf, String), TrainerError> {
    let path = checkpoint_path(dir)?;
    let hash = trainer.write_state_file(&path)?;
    Ok((path, hash))
}

/// Writes `image` (a trainer's, or one gathered from sharded state) to
/// `dir`/[`CHECKPOINT_FILE`] atomically.
pub fn save_image(image: &limpet_snapshot::StateImage, dir: &Path) -> Result<PathBuf, TrainerError> {
    let path = checkpoint_path(dir)?;
    // Streamed into the file: the encoding is never held beside the image.
    limpet_snapshot::write_image_atomic(&path, image)?;
    Ok(path)
}

/// `dir`/[`PENDING_CHECKPOINT_FILE`], with `dir` made if it is not there.
pub fn pending_checkpoint_path(dir: &Path) -> Result<PathBuf, TrainerError> {
    Ok(checkpoint_path(dir)?.with_file_name(PENDING_CHECKPOINT_FILE))
}

/// Moves the checkpoint written at `pending` (by [`Trainer::write_gathered_file`]) to
/// `dir`/[`CHECKPOINT_FILE`] durably; returns its path.
pub fn place_checkpoint(pending: &Path, dir: &Path) -> Result<PathBuf, TrainerError> {
    let path = checkpoint_path(dir)?;
    limpet_snapshot::rename_durable(pending, &path)?;
    Ok(path)
}

/// `dir`/[`CHECKPOINT_FILE`], with `dir` made if it is not there.
fn checkpoint_path(dir: &Path) -> Result<PathBuf, TrainerError> {
    std::fs::create_dir_all(dir)
        .map_err(|e| TrainerError::Data { path: dir.to_path_buf(), detail: e.to_string() })?;
    Ok(dir.join(CHECKPOINT_FILE))
}

/// Trains in this process until the job's last step or `opts.stop_at`.
pub fn run_local(
    trainer: &mut Trainer,
    opts: &RunOptions,
    mut on_progress: impl FnMut(&Progress),
) -> Result<RunReport, TrainerError> {
    let start_step = trainer.step();
    let end = opts.stop_at.unwrap_or(trainer.job().steps).min(trainer.job().steps);
    let started = Instant::now();
    let (mut last_loss, mut samples) = (None, 0usize);
    while trainer.step() < end {
        let stats = trainer.train_step(0, 1, &mut NoReduce)?;
        last_loss = Some(stats.loss);
        samples += stats.samples;
        on_progress(&Progress::Step(stats));
        let done = trainer.step();
        if opts.eval_every.is_some_and(|k| k > 0 && done % k == 0 && done < end) {
            on_progress(&Progress::Eval { step: done, eval: trainer.evaluate()? });
        }
        if opts.checkpoint_every.is_some_and(|k| k > 0 && done % k == 0 && done < end) {
            let (path, _) = save_checkpoint(trainer, &opts.out)?;
            on_progress(&Progress::Checkpoint { step: done, path });
        }
    }
    let train_peak_rss_bytes = peak_rss_bytes();
    // A figure, not the run: a failed read is left out of the report.
    let train_peak_device_bytes =
        crate::device::device_memory(trainer.model().device(), false).ok().flatten().map(|(_, peak)| peak);
    let eval = trainer.evaluate()?;
    on_progress(&Progress::Eval { step: trainer.step(), eval });
    let (checkpoint, content_hash) = save_checkpoint(trainer, &opts.out)?;
    on_progress(&Progress::Checkpoint { step: trainer.step(), path: checkpoint.clone() });
    let elapsed_s = started.elapsed().as_secs_f64();
    let job = trainer.job();
    Ok(RunReport {
        model: serde_json::to_value(&job.model).expect("serializes"),
        data: serde_json::to_value(&job.data).expect("serializes"),
        start_step,
        final_step: trainer.step(),
        total_steps: job.steps,
        train_loss: last_loss,
        test_loss: eval.loss,
        test_accuracy: eval.accuracy,
        elapsed_s,
        samples_per_s: samples as f64 / elapsed_s.max(1e-9),
        checkpoint,
        content_hash,
        peak_rss_bytes: peak_rss_bytes(),
        train_peak_rss_bytes,
        train_peak_device_bytes,
    })
}
