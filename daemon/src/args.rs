//! Arguments shared by several commands (the job flags of `limpet train`, `limpet plan`
//! and the lab's benchmarks), and how a value is spelled on the command line.

use clap::{Args, ValueEnum};
use std::path::PathBuf;

/// Model families.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModelArg {
    /// Multi-layer perceptron.
    Mlp,
    /// Small convolutional net.
    Convnet,
    /// GPT-style character transformer.
    Gpt,
    /// LLaMA-family decoder (sized by --preset and the size flags, or by --init-from).
    Llama,
    /// A TorchScript module (--module FILE, --loss).
    Torchscript,
}

/// Datasets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DataArg {
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

/// Optimizers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OptimizerArg {
    /// AdamW.
    Adamw,
    /// SGD with momentum 0.9.
    Sgd,
}

/// The job flags `limpet train` and `limpet plan` share. Optional so that `--resume` can
/// tell which ones were given.
#[derive(Debug, Clone, Args)]
pub struct JobArgs {
    /// Model family [default: mlp].
    #[arg(long, value_enum)]
    pub model: Option<ModelArg>,
    /// Dataset [default: digits; chars for gpt, tokens for llama, tensors for torchscript].
    #[arg(long, value_enum)]
    pub data: Option<DataArg>,
    /// Data file or directory (digits: a digits.csv.gz; chars: a text file or a directory).
    #[arg(long, value_name = "PATH")]
    pub data_path: Option<PathBuf>,
    /// Total optimizer steps of the job.
    #[arg(long)]
    pub steps: Option<u64>,
    /// Global batch size.
    #[arg(long)]
    pub batch: Option<usize>,
    /// Largest micro-batch; larger shares accumulate gradients [default: --batch].
    #[arg(long)]
    pub micro_batch: Option<usize>,
    /// Optimizer [default: adamw].
    #[arg(long, value_enum)]
    pub optimizer: Option<OptimizerArg>,
    /// Peak learning rate.
    #[arg(long)]
    pub lr: Option<f64>,
    /// Weight decay.
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// AdamW's betas as BETA1,BETA2 [default: 0.9,0.999].
    #[arg(long, value_parser = parse_betas)]
    pub betas: Option<(f64, f64)>,
    /// AdamW's epsilon [default: 1e-8].
    #[arg(long)]
    pub eps: Option<f64>,
    /// Decay embeddings too [default: matrices only].
    #[arg(long)]
    pub decay_embeddings: bool,
    /// Linear warmup steps.
    #[arg(long)]
    pub warmup: Option<u64>,
    /// Clip the gradient's global norm to this value (0 turns clipping off).
    #[arg(long)]
    pub clip: Option<f64>,
    /// The cosine schedule's floor as a fraction of the peak learning rate [default: 0.1].
    #[arg(long)]
    pub min_lr_ratio: Option<f64>,
    /// The same bits whatever the number of ranks: canonical shards summed in fixed point.
    #[arg(long)]
    pub reproducible: bool,
    /// Canonical shards per step of a --reproducible job [default: 8].
    #[arg(long)]
    pub shards: Option<usize>,
    /// Recompute each block's activations in backward (--model llama).
    #[arg(long)]
    pub activation_checkpointing: bool,
    /// Run the vocabulary head and loss this many positions at a time (--model llama).
    #[arg(long)]
    pub loss_chunk: Option<usize>,
    /// Evaluate on the held-out split every N steps.
    #[arg(long, value_name = "N")]
    pub eval_every: Option<u64>,
    /// Seed of initialization, sampling and the training RNG.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Tokens per sample for --data chars and tokens [default: 64 and 128].
    #[arg(long)]
    pub context: Option<usize>,
    /// Layers of --model gpt [default: 2] or llama [default: the preset's].
    #[arg(long)]
    pub layers: Option<usize>,
    /// The LLaMA model's sizes.
    #[command(flatten)]
    pub llama: LlamaFlags,
    /// cpu, cuda, cuda:N or auto [default: cpu].
    #[arg(long)]
    pub device: Option<String>,
    /// fp32 or bf16 (--model llama) [default: fp32].
    #[arg(long)]
    pub precision: Option<String>,
}

fn parse_betas(s: &str) -> Result<(f64, f64), String> {
    let parse = |v: &str| v.trim().parse::<f64>().map_err(|e| format!("{v:?}: {e}"));
    match s.split_once(',') {
        Some((a, b)) => Ok((parse(a)?, parse(b)?)),
        None => Err(format!("{s:?} is not BETA1,BETA2 (for example 0.9,0.95)")),
    }
}

impl JobArgs {
    /// The training keys these flags share with `[job]` in `limpetd`'s file.
    pub fn keys(&self) -> limpet_trainer::job_keys::JobKeys {
        use limpet_trainer::job_keys::OptimizerName;
        limpet_trainer::job_keys::JobKeys {
            steps: self.steps,
            global_batch: self.batch,
            micro_batch: self.micro_batch,
            optimizer: self.optimizer.map(|o| match o {
                OptimizerArg::Adamw => OptimizerName::Adamw,
                OptimizerArg::Sgd => OptimizerName::Sgd,
            }),
            lr: self.lr,
            weight_decay: self.weight_decay,
            betas: self.betas,
            eps: self.eps,
            decay_embeddings: self.decay_embeddings.then_some(true),
            warmup: self.warmup,
            clip: self.clip,
            min_lr_ratio: self.min_lr_ratio,
            seed: self.seed,
            precision: self.precision.clone(),
            reproducible: self.reproducible.then_some(true),
            shards: self.shards,
            activation_checkpointing: self.activation_checkpointing.then_some(true),
            loss_chunk: self.loss_chunk,
            eval_every: self.eval_every,
            // `limpet train` runs one rank: nothing to shard.
            shard_state: None,
            shard_replicas: None,
            // One rank reduces nothing.
            overlap: None,
        }
    }
}

/// Sizes of `--model llama`: the `[model]` keys of limpetd's configuration as flags.
#[derive(Debug, Clone, Default, Args)]
pub struct LlamaFlags {
    /// LLaMA size preset: tiny, small, 125m, 350m, 1b [default: tiny].
    #[arg(long)]
    pub preset: Option<String>,
    /// LLaMA residual width.
    #[arg(long)]
    pub d_model: Option<usize>,
    /// LLaMA query heads.
    #[arg(long)]
    pub heads: Option<usize>,
    /// LLaMA key/value heads (fewer than --heads: grouped-query attention).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// LLaMA SwiGLU width.
    #[arg(long)]
    pub ffn: Option<usize>,
    /// LLaMA vocabulary [default: the data's].
    #[arg(long)]
    pub vocab: Option<usize>,
    /// LLaMA: share the embedding with the head.
    #[arg(long)]
    pub tie_embeddings: bool,
    /// Start --model llama from a Hugging Face LLaMA directory (config.json + safetensors).
    #[arg(long, value_name = "DIR")]
    pub init_from: Option<PathBuf>,
    /// --model torchscript: the module's file (torch.jit.script or trace, saved).
    #[arg(long, value_name = "FILE")]
    pub module: Option<PathBuf>,
    /// --model torchscript: cross_entropy or mse on its output, or module (forward(x, y)
    /// returns each sample's loss) [default: mse for float targets, else cross_entropy].
    #[arg(long)]
    pub loss: Option<String>,
}

impl LlamaFlags {
    /// The `[model]` section these flags (and `--layers`) describe.
    pub fn section(&self, layers: Option<usize>) -> limpet_trainer::workload::ModelSection {
        limpet_trainer::workload::ModelSection {
            preset: self.preset.clone(),
            layers,
            d_model: self.d_model,
            heads: self.heads,
            kv_heads: self.kv_heads,
            ffn: self.ffn,
            vocab: self.vocab,
            context: None,
            rope_theta: None,
            norm_eps: None,
            tie_embeddings: self.tie_embeddings.then_some(true),
            init_from: self.init_from.clone(),
            path: self.module.clone(),
            loss: self.loss.clone(),
        }
    }
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

/// Parses a byte size (`512M`, `16G`, `1.5GiB`, `4096`), for every flag and key that takes
/// one. K, M, G and T count in powers of 1024 whether written `G`, `GB` or `GiB`, as memory
/// is counted; the number and unit are bytesize's.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    if t.starts_with('-') {
        return Err(format!("{s:?} is negative: a size is a positive number like 512M or 16G"));
    }
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = match unit.trim().to_ascii_uppercase().trim_end_matches("IB").trim_end_matches('B') {
        "" => "B".to_string(),
        u @ ("K" | "M" | "G" | "T") => format!("{u}iB"),
        _ => return Err(format!("{s:?} has unknown unit {:?} (use K, M, G or T)", unit.trim())),
    };
    let size: bytesize::ByteSize =
        format!("{num} {unit}").parse().map_err(|_| format!("{s:?} is not a size like 512M or 16G"))?;
    if size.as_u64() == 0 {
        return Err(format!("{s:?} is not a positive size"));
    }
    // Sizes past an exbibyte are typos (and a saturated one would read as "everything").
    if size.as_u64() > 1 << 60 {
        return Err(format!("{s:?} is more than 1024 PiB"));
    }
    Ok(size.as_u64())
}
