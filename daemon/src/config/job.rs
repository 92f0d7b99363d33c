//! `[job]`: what is trained (model, data, device, batch policy) and the training keys it
//! shares with `limpet train`'s flags ([`JobKeys`], spelled once in `limpet_trainer::job_keys`:
//! their defaults, checks and effect are there). The file's `[job]` is read twice, as this
//! section and as [`JobKeys`] (see `Config::parse`): serde's `flatten` would lose the line a
//! flattened key's type error is on. A key neither reads is reported as unknown.

use super::{DataName, ModelName};
use limpet_agent::policy::BatchPolicy;
use limpet_trainer::device::DeviceChoice;
use limpet_trainer::job_keys::JobKeys;
use serde::Deserialize;
use std::path::PathBuf;

/// `[job]`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct JobSection {
    /// The model family.
    pub model: ModelName,
    /// `digits`, `chars`, `tokens`, `tensors` or `synthetic`.
    pub data: DataName,
    /// Data file or directory.
    pub data_path: Option<PathBuf>,
    /// `fixed-global` (default), `linear`, `sqrt` or `adascale`.
    #[serde(default = "default_policy")]
    pub policy: BatchPolicy,
    /// World size the batch and learning rate were tuned for (the policies scale from it;
    /// default: the number of founders).
    pub base_world: Option<u64>,
    /// Transformer blocks of the `gpt` model (default 2).
    pub layers: Option<usize>,
    /// `cpu`, `cuda`, `cuda:N` or `auto` (default `cpu`; `[node].devices` overrides it).
    #[serde(default = "default_device", deserialize_with = "limpet_agent::config_value::read")]
    pub device: DeviceChoice,
    /// The training keys (`steps`, `global_batch`, the optimizer, the schedule, ...):
    /// `steps` and `global_batch` are required in a file.
    #[serde(skip)]
    pub keys: JobKeys,
}

impl JobSection {
    /// The global batch (required, as `steps`).
    pub fn global_batch(&self) -> u64 {
        self.keys.global_batch.unwrap_or(1) as u64
    }
}

fn default_device() -> DeviceChoice {
    DeviceChoice::Cpu
}

fn default_policy() -> BatchPolicy {
    BatchPolicy::FixedGlobal
}
