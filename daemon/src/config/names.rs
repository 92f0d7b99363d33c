//! The configuration's closed sets of names, as serde enums: a value outside the set is a
//! parse error naming the key and the choices, and code matches them exhaustively.

use serde::Deserialize;

/// `[security].data_plane`.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DataPlaneMode {
    /// Encrypted and authenticated with node certificates.
    #[default]
    Tls,
    /// Authenticated by the cluster secret only.
    Secret,
}

/// `[node].log_format`.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// `[job].model`.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ModelName {
    /// A multi-layer perceptron.
    Mlp,
    /// A small convolutional network.
    Convnet,
    /// A character GPT.
    Gpt,
    /// A LLaMA-family decoder.
    Llama,
    /// A TorchScript module (`[model].path`).
    Torchscript,
}

impl ModelName {
    /// The name as written in the file.
    pub fn as_str(self) -> &'static str {
        match self {
            ModelName::Mlp => "mlp",
            ModelName::Convnet => "convnet",
            ModelName::Gpt => "gpt",
            ModelName::Llama => "llama",
            ModelName::Torchscript => "torchscript",
        }
    }

    /// The trainer's model kind.
    pub fn kind(self) -> limpet_trainer::ModelKind {
        use limpet_trainer::ModelKind;
        match self {
            ModelName::Mlp => ModelKind::Mlp,
            ModelName::Convnet => ModelKind::Convnet,
            ModelName::Gpt => ModelKind::Gpt,
            ModelName::Llama => ModelKind::Llama,
            ModelName::Torchscript => ModelKind::Torchscript,
        }
    }
}

/// `[job].optimizer`.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerName {
    /// AdamW.
    Adamw,
    /// SGD with momentum 0.9.
    Sgd,
}

/// A revocation source in `[revocation].sources`.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum SourceName {
    /// AWS IMDSv2 spot notices and rebalance recommendations.
    Aws,
    /// GCP preemption.
    Gcp,
    /// Azure scheduled events.
    Azure,
}
