//! The training keys `limpetd`'s `[job]` and `limpet train`'s flags share, spelled once: one
//! struct ([`JobKeys`]) is both the keys of the file (serde) and the flags (clap), and this
//! is the one place they become part of a [`JobSpec`] (defaults, checks, how each key changes
//! the job), so a job written in a file and the same job written as flags train identically.
//! A file writes `betas = [0.9, 0.95]` and `reproducible = true` where a command line writes
//! `--betas 0.9,0.95` and `--reproducible`; `global_batch` is `--batch`. Adding a key is a
//! field here plus its effect in [`JobKeys::apply`].
//!
//! Every key is optional; an absent key keeps the model's default from
//! [`JobSpec::defaults_with`]. Errors name the key as `[job].name`; the command line shows
//! them as its flags (see [`JobKeyError::as_flag`]).

use crate::model::{ModelSpec, Precision};
use crate::optim::OptimizerSpec;
use crate::JobSpec;
use serde::{Deserialize, Serialize};

/// `[job].optimizer` / `--optimizer`.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerName {
    /// AdamW.
    Adamw,
    /// SGD with momentum 0.9.
    Sgd,
}

/// The peak learning rate a job gets when it switches to SGD without naming one: SGD's
/// steps are not normalized like Adam's, so Adam's rate would barely move it.
pub const SGD_LR: f64 = 0.05;
/// The peak learning rate a job gets when it switches to AdamW without naming one.
pub const ADAMW_LR: f64 = 3e-3;

/// The shared keys. Each doc comment's first line is the flag's help.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, clap::Args)]
pub struct JobKeys {
    /// Total optimizer steps of the job.
    #[arg(long)]
    pub steps: Option<u64>,
    /// Global batch size.
    #[arg(long = "batch", value_name = "SAMPLES")]
    pub global_batch: Option<usize>,
    /// Largest micro-batch; larger shares accumulate gradients [default: the global batch].
    #[arg(long)]
    pub micro_batch: Option<usize>,
    /// Optimizer [default: adamw]; switching it also switches to its default learning rate.
    #[arg(long, value_enum)]
    pub optimizer: Option<OptimizerName>,
    /// Peak learning rate [default: the model's].
    #[arg(long)]
    pub lr: Option<f64>,
    /// Weight decay [default: the model's].
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// AdamW's betas as BETA1,BETA2 [default: 0.9,0.999; LLM recipes use 0.9,0.95].
    #[arg(long, value_parser = parse_betas)]
    pub betas: Option<(f64, f64)>,
    /// AdamW's epsilon [default: 1e-8].
    #[arg(long)]
    pub eps: Option<f64>,
    /// Decay embeddings too [default: matrices only, as nanoGPT, torchtitan and HF Trainer].
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub decay_embeddings: Option<bool>,
    /// Linear warmup steps [default: a twentieth of the steps].
    #[arg(long)]
    pub warmup: Option<u64>,
    /// Clip the gradient's global norm to this value; 0 turns clipping off [default: 1.0].
    #[arg(long)]
    pub clip: Option<f64>,
    /// The cosine schedule's floor as a fraction of the peak learning rate [default: 0.1].
    #[arg(long)]
    pub min_lr_ratio: Option<f64>,
    /// Seed of initialization, sampling and the training RNG [default: 0].
    #[arg(long)]
    pub seed: Option<u64>,
    /// fp32 or bf16 (model llama) [default: fp32].
    #[arg(long)]
    pub precision: Option<String>,
    /// The same bits whatever the number of ranks: canonical shards summed in fixed point.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub reproducible: Option<bool>,
    /// Canonical shards per step of a reproducible job [default: 8].
    #[arg(long)]
    pub shards: Option<usize>,
    /// Recompute each block's activations in backward (model llama).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "true", value_name = "BOOL")]
    pub activation_checkpointing: Option<bool>,
    /// Run the vocabulary head and loss this many positions at a time (model llama).
    #[arg(long)]
    pub loss_chunk: Option<usize>,
    /// Evaluate on the held-out split every N steps.
    #[arg(long, value_name = "N")]
    pub eval_every: Option<u64>,
    /// `none`, `optimizer` (ZeRO-1) or `optimizer+gradients` (ZeRO-2): spread the optimizer
    /// state, and the reduced gradients, over the ranks (limpetd only: one rank shards nothing).
    #[arg(skip)]
    pub shard_state: Option<String>,
    /// Other ranks holding each rank's shard [default: 1] (limpetd only).
    #[arg(skip)]
    pub shard_replicas: Option<usize>,
    /// Reduce each bucket of gradients while backward goes on [default: true] (limpetd only:
    /// one rank reduces nothing).
    #[arg(skip)]
    pub overlap: Option<bool>,
    /// `fp32` or `bf16`: the number format gradients travel in between ranks, bf16 halving
    /// the bytes, each rank summing in f32 [default: fp32] (limpetd only).
    #[arg(skip)]
    pub reduce_dtype: Option<String>,
}

/// `--betas BETA1,BETA2`.
fn parse_betas(s: &str) -> Result<(f64, f64), String> {
    let parse = |v: &str| v.trim().parse::<f64>().map_err(|e| format!("{v:?}: {e}"));
    match s.split_once(',') {
        Some((a, b)) => Ok((parse(a)?, parse(b)?)),
        None => Err(format!("{s:?} is not BETA1,BETA2 (for example 0.9,0.95)")),
    }
}

/// A key with a bad value.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("[job].{key}: {detail}")]
pub struct JobKeyError {
    /// The key's name in `[job]`.
    pub key: &'static str,
    /// What is wrong.
    pub detail: String,
}

impl JobKeyError {
    /// The same error speaking of the command line's flag (`--batch` for `global_batch`).
    pub fn as_flag(&self) -> String {
        let flag = match self.key {
            "global_batch" => "batch".to_string(),
            k => k.replace('_', "-"),
        };
        format!("--{flag}: {}", self.detail)
    }
}

impl JobKeys {
    /// Checks each value on its own and against the others given (no model needed, so
    /// `limpetd validate` runs it).
    pub fn check(&self) -> Result<(), JobKeyError> {
        let bad = |key, detail: String| Err(JobKeyError { key, detail });
        if self.steps == Some(0) {
            return bad("steps", "must be at least 1".into());
        }
        if self.global_batch == Some(0) {
            return bad("global_batch", "must be at least 1".into());
        }
        if let Some(m) = self.micro_batch {
            let top = self.global_batch.unwrap_or(usize::MAX);
            if m == 0 || m > top {
                return bad("micro_batch", format!("{m} is not within 1..={top}"));
            }
        }
        if let Some(lr) = self.lr.filter(|lr| !(lr.is_finite() && *lr > 0.0)) {
            return bad("lr", format!("{lr} is not a positive number"));
        }
        if let Some(wd) = self.weight_decay.filter(|wd| !(wd.is_finite() && *wd >= 0.0)) {
            return bad("weight_decay", format!("{wd} is not zero or a positive number"));
        }
        if let Some((b1, b2)) = self.betas {
            for b in [b1, b2] {
                if !(0.0..1.0).contains(&b) {
                    return bad("betas", format!("[{b1}, {b2}]: each must be within [0, 1)"));
                }
            }
            if self.optimizer == Some(OptimizerName::Sgd) {
                return bad("betas", "applies to optimizer adamw".into());
            }
        }
        if let Some(e) = self.eps {
            if !(e.is_finite() && e > 0.0) {
                return bad("eps", format!("{e} is not a positive number"));
            }
            if self.optimizer == Some(OptimizerName::Sgd) {
                return bad("eps", "applies to optimizer adamw".into());
            }
        }
        if let (Some(w), Some(s)) = (self.warmup, self.steps) {
            if w > s {
                return bad("warmup", format!("{w} exceeds the job's {s} steps"));
            }
        }
        if let Some(c) = self.clip.filter(|c| !(c.is_finite() && *c >= 0.0)) {
            return bad("clip", format!("{c} is not zero (off) or a positive number"));
        }
        if let Some(r) = self.min_lr_ratio.filter(|r| !(0.0..=1.0).contains(r)) {
            return bad("min_lr_ratio", format!("{r} is not within 0..=1"));
        }
        if let Some(p) = &self.precision {
            Precision::parse(p).map_err(|e| JobKeyError { key: "precision", detail: e.to_string() })?;
        }
        if self.loss_chunk == Some(0) {
            return bad("loss_chunk", "must be at least 1".into());
        }
        if self.eval_every == Some(0) {
            return bad("eval_every", "must be at least 1".into());
        }
        let sharded = match self.shard_state.as_deref() {
            None | Some("none") => false,
            Some("optimizer" | "optimizer+gradients") => true,
            Some(other) => {
                return bad(
                    "shard_state",
                    format!("{other:?} is not \"none\", \"optimizer\" or \"optimizer+gradients\""),
                )
            }
        };
        if self.shard_replicas.is_some() && !sharded {
            return bad(
                "shard_replicas",
                "applies with sharded state only (shard_state = \"optimizer\" or \"optimizer+gradients\")"
                    .into(),
            );
        }
        if self.shard_replicas == Some(0) {
            return bad(
                "shard_replicas",
                "must be at least 1: a shard with no copy is lost with its rank, even one that leaves with notice".into(),
            );
        }
        if let Some(k) = self.shards {
            let most = crate::MAX_SHARDS;
            if k == 0 || k > most || self.global_batch.is_some_and(|b| k > b) {
                let top = match self.global_batch {
                    Some(b) => b.min(most).to_string(),
                    None => format!("the global batch (at most {most})"),
                };
                return Err(JobKeyError { key: "shards", detail: format!("{k} is not within 1..={top}") });
            }
            if self.reproducible != Some(true) {
                return Err(JobKeyError {
                    key: "shards",
                    detail: "applies to a reproducible job only".into(),
                });
            }
        }
        if let Some(d) = &self.reduce_dtype {
            let dtype = crate::ReduceDtype::parse(d)
                .map_err(|e| JobKeyError { key: "reduce_dtype", detail: e.to_string() })?;
            if dtype == crate::ReduceDtype::Bf16 && self.reproducible == Some(true) {
                return bad(
                    "reduce_dtype",
                    "\"bf16\" does not apply to a reproducible job, whose gradients travel as exact integers"
                        .into(),
                );
            }
        }
        Ok(())
    }

    /// Overlays the keys given on `job` (made by [`crate::workload::job_for`]).
    pub fn apply(&self, job: &mut JobSpec) -> Result<(), JobKeyError> {
        self.check()?;
        if let Some(steps) = self.steps {
            job.steps = steps;
            job.schedule.warmup_steps = steps / 20;
        }
        if let Some(b) = self.global_batch {
            job.global_batch = b;
            job.micro_batch = b;
        }
        if let Some(m) = self.micro_batch {
            if m > job.global_batch {
                let detail = format!("{m} is not within 1..={}", job.global_batch);
                return Err(JobKeyError { key: "micro_batch", detail });
            }
            job.micro_batch = m;
        }
        if let Some(o) = self.optimizer {
            let wd = job.optimizer.weight_decay();
            job.optimizer = match (o, &job.optimizer) {
                (OptimizerName::Sgd, OptimizerSpec::Sgd { .. })
                | (OptimizerName::Adamw, OptimizerSpec::Adamw { .. }) => job.optimizer.clone(),
                (OptimizerName::Sgd, _) => OptimizerSpec::sgd(SGD_LR, wd),
                (OptimizerName::Adamw, _) => OptimizerSpec::adamw(ADAMW_LR, wd),
            };
        }
        if let Some(lr) = self.lr {
            job.optimizer.set_lr(lr);
        }
        if let Some(wd) = self.weight_decay {
            job.optimizer.set_weight_decay(wd);
        }
        if let Some(d) = self.decay_embeddings {
            job.optimizer.set_decay_embeddings(d);
        }
        if self.betas.is_some() || self.eps.is_some() {
            let OptimizerSpec::Adamw { beta1, beta2, eps, .. } = &mut job.optimizer else {
                let key = if self.betas.is_some() { "betas" } else { "eps" };
                return Err(JobKeyError { key, detail: "applies to optimizer adamw".into() });
            };
            if let Some((b1, b2)) = self.betas {
                (*beta1, *beta2) = (b1, b2);
            }
            if let Some(e) = self.eps {
                *eps = e;
            }
        }
        if let Some(w) = self.warmup {
            if w > job.steps {
                return Err(JobKeyError {
                    key: "warmup",
                    detail: format!("{w} exceeds the job's {} steps", job.steps),
                });
            }
            job.schedule.warmup_steps = w;
        }
        if let Some(c) = self.clip {
            job.clip_norm = (c > 0.0).then_some(c);
        }
        if let Some(r) = self.min_lr_ratio {
            job.schedule.min_lr_ratio = r;
        }
        if let Some(s) = self.seed {
            job.seed = s;
        }
        if let Some(r) = self.reproducible {
            job.reproducible = r;
        }
        if let Some(k) = self.shards {
            job.shards = Some(k);
        }
        if let Some(e) = self.eval_every {
            job.eval_every = Some(e);
        }
        if let Some(mode @ ("optimizer" | "optimizer+gradients")) = self.shard_state.as_deref() {
            job.shard_state = Some(crate::Sharding {
                replicas: self.shard_replicas.unwrap_or(1),
                gradients: mode == "optimizer+gradients",
            });
        }
        if let Some(o) = self.overlap {
            job.reduce_after_backward = !o;
        }
        if let Some(d) = &self.reduce_dtype {
            job.reduce_dtype = crate::ReduceDtype::parse(d)
                .map_err(|e| JobKeyError { key: "reduce_dtype", detail: e.to_string() })?;
        }
        let llama = matches!(job.model, ModelSpec::Llama(_));
        if let Some(a) = self.activation_checkpointing {
            if a && !llama {
                return Err(JobKeyError {
                    key: "activation_checkpointing",
                    detail: "applies to model llama".into(),
                });
            }
            job.activation_checkpointing = a;
        }
        if let Some(c) = self.loss_chunk {
            if !llama {
                return Err(JobKeyError { key: "loss_chunk", detail: "applies to model llama".into() });
            }
            job.loss_chunk = Some(c);
        }
        if job.reproducible {
            // Canonical shards are the unit of computation. A micro-batch smaller than a shard
            // raises their count (each is one forward and backward, and must fit as the
            // micro-batch does); any other would only make two equal jobs look different.
            let whole = crate::train::shard_count(job.shards, job.global_batch, job.global_batch);
            if crate::train::shard_count(job.shards, job.global_batch, job.micro_batch) == whole {
                job.micro_batch = job.global_batch;
            }
        }
        if let Some(p) = &self.precision {
            job.precision =
                Precision::parse(p).map_err(|e| JobKeyError { key: "precision", detail: e.to_string() })?;
            if job.precision == Precision::Bf16 && !matches!(job.model, ModelSpec::Llama(_)) {
                let detail = "\"bf16\" is available for model \"llama\" only".to_string();
                return Err(JobKeyError { key: "precision", detail });
            }
        }
        Ok(())
    }
}
