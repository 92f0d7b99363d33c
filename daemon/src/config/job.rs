//! `[job]`: what is trained, and the training keys it shares with `limpet train` (their
//! defaults, checks and effect are `limpet_trainer::job_keys`; this is their spelling in a
//! file). `[job]` cannot embed `JobKeys` with serde's `flatten`: flatten does not combine with
//! `deny_unknown_fields`, and a flattened field's type error loses the key and line the
//! file's checks report. `config/job_tests.rs` holds the two spellings together.

use super::{ModelName, OptimizerName};
use limpet_agent::policy::BatchPolicy;
use serde::Deserialize;
use std::path::PathBuf;

/// `[job]`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct JobSection {
    /// The model family.
    pub model: ModelName,
    /// `digits`, `chars` or `synthetic`.
    pub data: String,
    /// Data file or directory.
    pub data_path: Option<PathBuf>,
    /// Total optimizer steps.
    pub steps: u64,
    /// Global batch.
    pub global_batch: u64,
    /// Largest micro-batch.
    pub micro_batch: Option<u64>,
    /// `fixed-global` (default), `linear`, `sqrt` or `adascale`.
    #[serde(default = "default_policy")]
    pub policy: BatchPolicy,
    /// Seed.
    #[serde(default)]
    pub seed: u64,
    /// `adamw` (default) or `sgd` (momentum 0.9; its own default learning rate, 0.05).
    pub optimizer: Option<OptimizerName>,
    /// Peak learning rate (the model's default when absent).
    pub lr: Option<f64>,
    /// Weight decay (the model's default when absent).
    pub weight_decay: Option<f64>,
    /// AdamW's `[beta1, beta2]` (default `[0.9, 0.999]`; LLM recipes use `[0.9, 0.95]`).
    pub betas: Option<[f64; 2]>,
    /// AdamW's epsilon (default 1e-8).
    pub eps: Option<f64>,
    /// Decay embeddings too (default false: matrices only, never norms or biases).
    pub decay_embeddings: Option<bool>,
    /// Linear warmup steps (default: a twentieth of `steps`).
    pub warmup: Option<u64>,
    /// Gradient global-norm clip (0: off; default: the model's, 1.0).
    pub clip: Option<f64>,
    /// The cosine schedule's floor as a fraction of the peak learning rate (default 0.1).
    pub min_lr_ratio: Option<f64>,
    /// Bit-identical results whatever the world size (policy `fixed-global`, no pipeline).
    pub reproducible: Option<bool>,
    /// A reproducible job's canonical shards per step (default 8).
    pub shards: Option<usize>,
    /// Recompute each block's activations in backward (model `llama`).
    pub activation_checkpointing: Option<bool>,
    /// Run the vocabulary head and loss this many positions at a time (model `llama`).
    pub loss_chunk: Option<usize>,
    /// Evaluate the held-out loss every this many steps.
    pub eval_every: Option<u64>,
    /// `none` (default) or `optimizer`: each rank keeps a shard of the optimizer state.
    pub shard_state: Option<String>,
    /// Other ranks holding a copy of each shard (default 1), so a `kill -9` loses none.
    pub shard_replicas: Option<usize>,
    /// Reduce each bucket of gradients while backward goes on (default true); `false`
    /// reduces the whole buffer after backward.
    pub overlap: Option<bool>,
    /// World size the batch and learning rate were tuned for (the policies scale from it;
    /// default: the number of founders).
    pub base_world: Option<u64>,
    /// Transformer blocks of the `gpt` model (default 2).
    pub layers: Option<usize>,
    /// `cpu`, `cuda`, `cuda:N` or `auto` (default `cpu`).
    #[serde(default = "default_device")]
    pub device: String,
    /// `fp32` (default) or `bf16` (model `llama`).
    #[serde(default = "default_precision")]
    pub precision: String,
}

impl JobSection {
    /// The keys this section shares with `limpet train`'s flags.
    pub fn keys(&self) -> limpet_trainer::job_keys::JobKeys {
        limpet_trainer::job_keys::JobKeys {
            steps: Some(self.steps),
            global_batch: Some(self.global_batch as usize),
            micro_batch: self.micro_batch.map(|m| m as usize),
            optimizer: self.optimizer,
            lr: self.lr,
            weight_decay: self.weight_decay,
            betas: self.betas.map(|[a, b]| (a, b)),
            eps: self.eps,
            decay_embeddings: self.decay_embeddings,
            warmup: self.warmup,
            clip: self.clip,
            min_lr_ratio: self.min_lr_ratio,
            seed: Some(self.seed),
            precision: Some(self.precision.clone()),
            reproducible: self.reproducible,
            shards: self.shards,
            activation_checkpointing: self.activation_checkpointing,
            loss_chunk: self.loss_chunk,
            eval_every: self.eval_every,
            shard_state: self.shard_state.clone(),
            shard_replicas: self.shard_replicas,
            overlap: self.overlap,
        }
    }
}

fn default_device() -> String {
    "cpu".into()
}

fn default_precision() -> String {
    "fp32".into()
}

fn default_policy() -> BatchPolicy {
    BatchPolicy::FixedGlobal
}
