//! [`JobSpec`]: the complete, serializable description of a training job. It is stored in every
//! checkpoint, so a resumed or handed-off state can be checked against the job it joins.

use crate::data::{DataInfo, DataSpec, Dataset};
use crate::model::{ModelSpec, Precision};
use crate::optim::{OptimizerSpec, Schedule};
use crate::TrainerError;
use serde::{Deserialize, Serialize};

/// The most samples a step (or a micro-batch) may have.
pub const MAX_BATCH: usize = 1 << 24;

/// Model families; [`ModelSpec::for_data`] sizes one for a dataset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// Multi-layer perceptron for flat features.
    Mlp,
    /// Small convolutional net for images.
    Convnet,
    /// GPT-style character transformer.
    Gpt,
    /// LLaMA-family decoder (sized by a preset or by `[model]`).
    Llama,
    /// A TorchScript module from a file (`[model].path`).
    Torchscript,
}

/// Everything that determines a training run's result, besides the hardware.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// Architecture and sizes.
    pub model: ModelSpec,
    /// Which dataset.
    pub data: DataSpec,
    /// blake3 of the dataset's source bytes, so a state is never resumed on other data.
    pub data_fingerprint: String,
    /// Optimizer and its hyper-parameters.
    pub optimizer: OptimizerSpec,
    /// Learning-rate schedule.
    pub schedule: Schedule,
    /// Samples per optimizer step, summed over all ranks.
    pub global_batch: usize,
    /// Largest number of samples one forward pass takes; larger shares accumulate gradients.
    pub micro_batch: usize,
    /// Total optimizer steps (the schedule's horizon).
    pub steps: u64,
    /// Seed for initialization, sampling and the training RNG.
    pub seed: u64,
    /// Clip the averaged gradient to this global L2 norm.
    pub clip_norm: Option<f64>,
    /// The number format of forward and backward passes (absent in older images: f32).
    #[serde(default, skip_serializing_if = "is_fp32")]
    pub precision: Precision,
    /// blake3 of the weights the model started from when they were imported (`init_from`)
    /// rather than drawn from the seed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init: Option<String>,
    /// Bit-identical results whatever the world size, the transitions and the restarts:
    /// gradients of canonical shards summed in fixed point (`train/exact.rs`). Absent in
    /// older images: off.
    #[serde(default, skip_serializing_if = "is_off")]
    pub reproducible: bool,
    /// A reproducible job's canonical shards per step (default 8): each rank of a world of
    /// W runs ceil(shards / W) backward passes, so shards equal to the usual world size is
    /// the fastest, and more ranks than shards leaves some idle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shards: Option<usize>,
    /// Recompute each block's activations in backward instead of keeping them (model
    /// `llama`; the gradients are the same bits).
    #[serde(default, skip_serializing_if = "is_off")]
    pub activation_checkpointing: bool,
    /// Run the vocabulary head and the loss this many positions at a time, so no
    /// `[batch, context, vocab]` tensor is held (model `llama`; the loss rounds differently).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_chunk: Option<usize>,
    /// Evaluate the held-out loss every this many steps in `limpetd` (none: at the end only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_every: Option<u64>,
    /// Spread the optimizer state over the data-parallel ranks (`train/shard.rs`); absent in
    /// older images: whole on every rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard_state: Option<Sharding>,
    /// Reduce the gradients only once backward has ended (`[job].overlap = false`), instead
    /// of a bucket at a time while it runs (`train/overlap.rs`). Part of the job because the
    /// buckets change the order the ring sums in, and every rank must cut them alike.
    #[serde(default, skip_serializing_if = "is_off")]
    pub reduce_after_backward: bool,
    /// The number format gradients travel in between ranks (`[job].reduce_dtype`): bfloat16
    /// halves the ring's bytes, each rank summing in f32. Part of the job because every rank
    /// must send alike. Absent in older images: f32.
    #[serde(default, skip_serializing_if = "ReduceDtype::is_f32")]
    pub reduce_dtype: ReduceDtype,
}

/// How gradients travel between ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReduceDtype {
    /// As they are: the exact f32 sum of what every rank computed.
    #[default]
    Fp32,
    /// Rounded to bfloat16 on the wire, summed in f32 at each rank: every rank still applies
    /// the same bits, each value within a few bfloat16 roundings of the f32 sum.
    Bf16,
}

impl ReduceDtype {
    fn is_f32(&self) -> bool {
        *self == ReduceDtype::Fp32
    }

    /// Parses `fp32` or `bf16`.
    pub fn parse(s: &str) -> Result<Self, crate::NotOneOf> {
        match s {
            "fp32" => Ok(ReduceDtype::Fp32),
            "bf16" => Ok(ReduceDtype::Bf16),
            other => Err(crate::NotOneOf { got: other.into(), choices: "fp32, bf16" }),
        }
    }
}

/// How a job spreads its state over the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sharding {
    /// Other ranks holding each rank's shard (in host memory, updated each step), so that a
    /// killed rank's shard survives.
    pub replicas: usize,
    /// Each rank also keeps only the reduced gradients of the blocks it holds (ZeRO-2): the
    /// rest of its gradient buffer is given back to the system as soon as it is reduced.
    /// The same sums and updates as without, so the same bits; the parameters' allgather
    /// goes a window at a time. Absent in older images: off.
    #[serde(default, skip_serializing_if = "is_off")]
    pub gradients: bool,
}

fn is_off(b: &bool) -> bool {
    !*b
}

fn is_fp32(p: &Precision) -> bool {
    *p == Precision::Fp32
}

impl JobSpec {
    /// A job with limpet's defaults for `kind` on `data`.
    pub fn defaults_for(kind: ModelKind, data: &Dataset) -> Result<Self, TrainerError> {
        Ok(Self::defaults_with(kind, ModelSpec::for_data(kind, &data.info)?, data))
    }

    /// A job with limpet's defaults for `kind` on `data`, training `model`.
    pub fn defaults_with(kind: ModelKind, model: ModelSpec, data: &Dataset) -> Self {
        let (optimizer, steps, global_batch) = match (kind, &data.info) {
            (ModelKind::Gpt, _) => (OptimizerSpec::adamw(3e-3, 0.01), 600, 32),
            (ModelKind::Llama, _) => (OptimizerSpec::adamw(1e-3, 0.1), 600, 16),
            (_, DataInfo::Classify { .. } | DataInfo::Regress { .. }) => {
                (OptimizerSpec::adamw(3e-3, 1e-4), 400, 64)
            }
            (_, DataInfo::Tokens { .. }) => (OptimizerSpec::adamw(3e-3, 0.01), 600, 32),
        };
        JobSpec {
            model,
            data: data.spec.clone(),
            data_fingerprint: data.fingerprint.clone(),
            optimizer,
            schedule: Schedule { warmup_steps: steps / 20, min_lr_ratio: 0.1 },
            global_batch,
            micro_batch: global_batch,
            steps,
            seed: 0,
            clip_norm: Some(1.0),
            precision: Precision::Fp32,
            init: None,
            reproducible: false,
            shards: None,
            activation_checkpointing: false,
            loss_chunk: None,
            eval_every: None,
            shard_state: None,
            reduce_after_backward: false,
            reduce_dtype: ReduceDtype::Fp32,
        }
    }

    /// How each micro-batch trades compute for memory.
    pub fn memory_plan(&self) -> crate::model::MemoryPlan {
        crate::model::MemoryPlan { checkpoint: self.activation_checkpointing, loss_chunk: self.loss_chunk }
    }

    /// Checks the job on its own and against the data it will read.
    pub fn validate(&self, data: &Dataset) -> Result<(), TrainerError> {
        let bad = |m: String| Err(TrainerError::Config(m));
        if self.global_batch == 0 {
            return bad("global_batch must be at least 1".into());
        }
        if self.micro_batch == 0 {
            return bad("micro_batch must be at least 1".into());
        }
        // A step's sample positions are held at once: a batch past this is a typo, and would
        // abort the process allocating them instead of being named.
        for (key, n) in [("global_batch", self.global_batch), ("micro_batch", self.micro_batch)] {
            if n > MAX_BATCH {
                return bad(format!("{key} ({n}) is above {MAX_BATCH} samples"));
            }
        }
        if self.steps == 0 {
            return bad("steps must be at least 1".into());
        }
        if self.schedule.warmup_steps > self.steps {
            return bad(format!(
                "schedule.warmup_steps ({}) exceeds steps ({})",
                self.schedule.warmup_steps, self.steps
            ));
        }
        if !(0.0..=1.0).contains(&self.schedule.min_lr_ratio) {
            return bad(format!(
                "schedule.min_lr_ratio ({}) must be within [0, 1]",
                self.schedule.min_lr_ratio
            ));
        }
        if let Some(c) = self.clip_norm {
            if !(c.is_finite() && c > 0.0) {
                return bad(format!("clip_norm ({c}) must be a positive number"));
            }
        }
        self.optimizer.validate().map_err(|e| TrainerError::Config(e.to_string()))?;
        let llama = matches!(self.model, ModelSpec::Llama(_));
        if self.activation_checkpointing && !llama {
            return bad("activation_checkpointing applies to model llama".into());
        }
        match self.loss_chunk {
            Some(_) if !llama => return bad("loss_chunk applies to model llama".into()),
            Some(0) => return bad("loss_chunk must be at least 1".into()),
            _ => {}
        }
        if self.eval_every == Some(0) {
            return bad("eval_every must be at least 1".into());
        }
        if data.fingerprint != self.data_fingerprint {
            return Err(TrainerError::Mismatch(format!(
                "job was made for data with fingerprint {}, but {} has fingerprint {}",
                self.data_fingerprint, data.source, data.fingerprint
            )));
        }
        self.model.check_data(&data.info)
    }

    /// The first field where two jobs differ, as `path: ours vs theirs`, or `None` if equal.
    pub fn diff(&self, other: &JobSpec) -> Option<String> {
        let a = serde_json::to_value(self).expect("JobSpec serializes");
        let b = serde_json::to_value(other).expect("JobSpec serializes");
        first_difference("", &a, &b)
    }

    /// The first difference between this job and a job document as the cluster's log
    /// records it (this spec as JSON, with a pipelined job's `pipeline` settings beside it,
    /// which are not compared), as `path: ours vs theirs`, or `None` if they are the same job.
    /// The document is read as this version reads a job (a field an older writer left out
    /// takes its default), so only what the two jobs train differently counts; one this
    /// version cannot read is a difference, named.
    pub fn diff_document(&self, doc: &serde_json::Value) -> Option<String> {
        let mut theirs = doc.clone();
        if let Some(o) = theirs.as_object_mut() {
            // What the log keeps beside the job: the leader's pipeline profile and a
            // reproducible job's class of device (checked on its own).
            o.remove("pipeline");
            o.remove("device_class");
        }
        match serde_json::from_value::<JobSpec>(theirs) {
            Ok(theirs) => self.diff(&theirs),
            Err(e) => Some(format!("the log's job does not read as one: {e}")),
        }
    }
}

fn first_difference(path: &str, a: &serde_json::Value, b: &serde_json::Value) -> Option<String> {
    use serde_json::Value;
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<_> = x.keys().chain(y.keys()).collect();
            keys.into_iter().find_map(|k| {
                let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                first_difference(&p, x.get(k).unwrap_or(&Value::Null), y.get(k).unwrap_or(&Value::Null))
            })
        }
        _ if a == b => None,
        _ => Some(format!("{path}: {a} vs {b}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_document_differs_by_its_first_field_and_not_by_its_pipeline() {
        let data = crate::data::Dataset::load(
            &crate::data::DataSpec::Synthetic { samples: 60, features: 4, classes: 2, seed: 1 },
            None,
        )
        .unwrap();
        let job = JobSpec::defaults_for(ModelKind::Mlp, &data).unwrap();
        let mut doc = serde_json::to_value(&job).unwrap();
        doc["pipeline"] = serde_json::json!({ "depth": 2 });
        assert_eq!(job.diff_document(&doc), None);
        doc["steps"] = serde_json::json!(job.steps + 1);
        let want = format!("steps: {} vs {}", job.steps, job.steps + 1);
        assert_eq!(job.diff_document(&doc), Some(want));
        // A field the log's writer wrote at its default (where this version leaves it out)
        // is the same job; one it gave otherwise differs.
        let mut doc = serde_json::to_value(&job).unwrap();
        doc["reduce_after_backward"] = serde_json::json!(false);
        assert_eq!(job.diff_document(&doc), None);
        doc["shard_state"] = serde_json::json!({ "replicas": 1 });
        assert_eq!(job.diff_document(&doc), Some("shard_state: null vs {\"replicas\":1}".into()));
        // A document this version cannot read is refused, saying why.
        doc["steps"] = serde_json::json!("many");
        assert!(job.diff_document(&doc).unwrap().starts_with("the log's job does not read as one"));
    }
}
