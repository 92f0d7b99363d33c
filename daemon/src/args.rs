//! Arguments shared by several commands (the job flags of `limpet train`, `limpet plan`
//! and the lab's benchmarks), and how a value is spelled on the command line.

use clap::{Args, ValueEnum};
use std::path::PathBuf;

pub use limpet_trainer::job_keys::OptimizerName;
use serde::Deserialize;

/// `[job].model` / `--model`: the model families.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ModelName {
    /// Multi-layer perceptron.
    Mlp,
    /// Small convolutional net.
    Convnet,
    /// GPT-style character transformer.
    Gpt,
    /// LLaMA-family decoder (sized by [model] / --preset and the size flags, or by init_from).
    Llama,
    /// A TorchScript module ([model].path / --module FILE, and its loss).
    Torchscript,
}

/// `[job].data` / `--data`: the kinds of data.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DataName {
    /// scikit-learn's 8x8 handwritten digits.
    Digits,
    /// Bytes of a text corpus (default: /usr/share/common-licenses).
    Chars,
    /// Token shards (a directory with limpet-tokens.json; see `limpet data tokenize`).
    Tokens,
    /// x and y arrays: a directory of x.npy and y.npy, or a safetensors file.
    Tensors,
    /// Seeded synthetic classification data.
    Synthetic,
}

impl DataName {
    /// The name as written in the file.
    pub fn as_str(self) -> &'static str {
        match self {
            DataName::Digits => "digits",
            DataName::Chars => "chars",
            DataName::Tokens => "tokens",
            DataName::Tensors => "tensors",
            DataName::Synthetic => "synthetic",
        }
    }

    /// Whether its samples are windows of a sequence (`[data].context` applies).
    pub fn is_sequence(self) -> bool {
        matches!(self, DataName::Chars | DataName::Tokens)
    }
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

/// The job flags `limpet train` and `limpet plan` share. Optional so that `--resume` can
/// tell which ones were given.
#[derive(Debug, Clone, Args)]
pub struct JobArgs {
    /// Model family [default: mlp].
    #[arg(long, value_enum)]
    pub model: Option<ModelName>,
    /// Dataset [default: digits; chars for gpt, tokens for llama, tensors for torchscript].
    #[arg(long, value_enum)]
    pub data: Option<DataName>,
    /// Data file or directory (digits: a digits.csv.gz; chars: a text file or a directory).
    #[arg(long, value_name = "PATH")]
    pub data_path: Option<PathBuf>,
    /// The training keys, spelled as in `[job]` (`--batch` is `global_batch`).
    #[command(flatten)]
    pub keys: limpet_trainer::job_keys::JobKeys,
    /// Tokens per sample for --data chars and tokens [default: 64 and 128].
    #[arg(long)]
    pub context: Option<usize>,
    /// Layers of --model gpt [default: 2] or llama [default: the preset's].
    #[arg(long)]
    pub layers: Option<usize>,
    /// The model's keys, spelled as in `[model]` (`--module` is `path`).
    #[command(flatten)]
    pub model_keys: limpet_trainer::workload::ModelSection,
    /// cpu, cuda, cuda:N or auto [default: cpu].
    #[arg(long)]
    pub device: Option<String>,
}

/// `limpet train`.
#[derive(Debug, Args)]
pub struct TrainArgs {
    /// The job.
    #[command(flatten)]
    pub job: JobArgs,
    /// Directory for checkpoint.safetensors, steps.jsonl and loss.svg [default: --resume DIR].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Continue the job checkpointed in DIR, bit-exactly.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Train into an --out directory that holds another run's checkpoint, replacing it and
    /// its step log (without this, such a directory is refused).
    #[arg(long)]
    pub overwrite: bool,
    /// Stop after this many steps (the job's schedule still spans --steps).
    #[arg(long, value_name = "STEP")]
    pub stop_at: Option<u64>,
    /// Also checkpoint every N steps.
    #[arg(long, value_name = "N")]
    pub checkpoint_every: Option<u64>,
    /// libtorch threads.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub threads: u16,
    /// Print the final report as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// Instead of training, write the job's sample order to FILE ('-': stdout), one JSON
    /// line per step: its samples (array rows, or shard file and token) and learning rate.
    #[arg(long, value_name = "FILE")]
    pub print_order: Option<PathBuf>,
}

/// The command-line spelling of a value.
pub fn value_name<T: ValueEnum>(v: T) -> String {
    v.to_possible_value().map(|p| p.get_name().to_string()).unwrap_or_default()
}

pub use limpet_agent::config_value::parse_bytes;
