//! Command-line definitions of `limpet` and dispatch to the commands.

use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

/// limpet: elastic training that survives spot revocations.
#[derive(Debug, Parser)]
#[command(name = "limpet", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train a model in this process, checkpointing to --out.
    Train(TrainArgs),
    /// Run one membership-log node (Raft over gRPC, sled storage) without training; the
    /// benchmarks and multi-process tests start these.
    RaftNode(crate::raft_cmd::RaftNodeArgs),
    /// Run one rank of a data-plane group (benchmarks and multi-process tests start these;
    /// the cluster secret comes from LIMPET_DP_SECRET).
    DpWorker(crate::dp_cmd::DpWorkerArgs),
    /// Measure a part of limpet on this machine.
    #[command(subcommand)]
    Bench(BenchCommand),
}

/// `limpet bench ...`.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Commit latency (p50, p99) and throughput of membership proposals, N node processes on
    /// loopback.
    Raft(crate::raft_cmd::BenchRaftArgs),
    /// Ring allreduce bandwidth (algbw, busbw) of N processes on loopback, next to
    /// torch.distributed's gloo backend in the same run.
    Allreduce(crate::dp_cmd::BenchAllreduceArgs),
    /// A verified state transfer next to a plain TCP copy of the same bytes.
    Handoff(crate::dp_cmd::BenchHandoffArgs),
}

/// Model families.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ModelArg {
    /// Multi-layer perceptron.
    Mlp,
    /// Small convolutional net.
    Convnet,
    /// GPT-style character transformer.
    Gpt,
}

/// Datasets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DataArg {
    /// scikit-learn's 8x8 handwritten digits.
    Digits,
    /// Bytes of a text corpus (default: /usr/share/common-licenses).
    Chars,
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

/// `limpet train`: job flags are optional so that `--resume` can tell which ones were given.
#[derive(Debug, Args)]
pub struct TrainArgs {
    /// Model family [default: mlp].
    #[arg(long, value_enum)]
    pub model: Option<ModelArg>,
    /// Dataset [default: digits, or chars for gpt].
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
    /// Linear warmup steps.
    #[arg(long)]
    pub warmup: Option<u64>,
    /// Clip the gradient's global norm to this value (0 turns clipping off).
    #[arg(long)]
    pub clip: Option<f64>,
    /// Seed of initialization, sampling and the training RNG.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Context length in bytes for --data chars.
    #[arg(long)]
    pub context: Option<usize>,
    /// Directory for checkpoint.safetensors, steps.jsonl and loss.svg [default: --resume DIR].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Continue the job checkpointed in DIR, bit-exactly.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Stop after this many steps (the job's schedule still spans --steps).
    #[arg(long, value_name = "STEP")]
    pub stop_at: Option<u64>,
    /// Also checkpoint every N steps.
    #[arg(long, value_name = "N")]
    pub checkpoint_every: Option<u64>,
    /// Evaluate on the test split every N steps.
    #[arg(long, value_name = "N")]
    pub eval_every: Option<u64>,
    /// libtorch threads.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub threads: u16,
    /// Print the final report as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Train(args) => crate::train_cmd::run(args),
        Command::RaftNode(args) => crate::raft_cmd::run_node(args),
        Command::Bench(BenchCommand::Raft(args)) => crate::raft_cmd::bench(args),
        Command::DpWorker(args) => crate::dp_cmd::run_worker(args),
        Command::Bench(BenchCommand::Allreduce(args)) => crate::dp_cmd::bench_allreduce(args),
        Command::Bench(BenchCommand::Handoff(args)) => crate::dp_cmd::bench_handoff(args),
    }
}
