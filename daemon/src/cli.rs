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
    /// Choose a data x pipeline layout for a model and a set of hosts: profiles the model's
    /// blocks here, then prints the chosen layout, its predicted step time and the runners-up.
    Plan(crate::plan_cmd::PlanArgs),
    /// Run one rank of a data x pipeline layout (the pipeline benchmark starts these; the
    /// cluster secret comes from LIMPET_DP_SECRET).
    #[command(hide = true)]
    PipeWorker(crate::pipe_bench::PipeWorkerArgs),
    /// Token shards for `data = "tokens"`: tokenize text, index existing .bin files, verify.
    #[command(subcommand)]
    Data(crate::data_cmd::DataCommand),
    /// Write a LLaMA checkpoint as a Hugging Face directory that `transformers` loads.
    Export(crate::data_cmd::ExportArgs),
    /// Measure a part of limpet on this machine.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Show the cluster: nodes with role and status, leader, epoch, step, loss, throughput,
    /// and recent transitions with cause, idle time and lost steps.
    Status(crate::status::StatusArgs),
    /// Ask a node to leave at the next epoch boundary.
    Drain(crate::status::DrainArgs),
    /// Inject a revocation: a spot notice (--in SECS) or a kill without notice (--hard).
    Revoke(crate::status::RevokeArgs),
    /// Local clusters on loopback.
    #[command(subcommand)]
    Local(LocalCommand),
    /// The cluster's certificates: a CA, node and operator certificates (mutual TLS).
    #[command(subcommand)]
    Certs(crate::certs::CertsCommand),
    /// A cluster's spot capacity on EC2: launch, list, terminate.
    #[command(subcommand)]
    Fleet(crate::fleet_cmd::FleetCommand),
    /// The demo: 4 agents on real data through a spot notice, a join, a kill -9 and a drain.
    Demo(crate::demo::DemoArgs),
    /// Run a local cluster through a scripted scenario (the multi-process tests use it).
    #[command(hide = true)]
    Scenario(crate::demo::ScenarioArgs),
    /// Serve a fake cloud metadata service (AWS IMDSv2, GCP, Azure shapes) for local nodes.
    #[command(hide = true)]
    FakeMetadata {
        /// Listen address.
        #[arg(long)]
        listen: std::net::SocketAddr,
    },
}

/// `limpet local ...`.
#[derive(Debug, Subcommand)]
pub enum LocalCommand {
    /// Start N agents on loopback, each with a fake metadata service; runs until Ctrl-C.
    Up(LocalUpArgs),
}

/// `limpet local up`.
#[derive(Debug, Args)]
pub struct LocalUpArgs {
    /// Founding agents.
    #[arg(long, default_value_t = 3)]
    pub nodes: usize,
    /// Directory for configurations, state, logs and cluster.json (must not hold a cluster).
    #[arg(long)]
    pub dir: PathBuf,
    /// Model family.
    #[arg(long, value_enum, default_value = "mlp")]
    pub model: ModelArg,
    /// Dataset.
    #[arg(long, value_enum, default_value = "digits")]
    pub data: DataArg,
    /// Total steps.
    #[arg(long, default_value_t = 2000)]
    pub steps: u64,
    /// Global batch.
    #[arg(long, default_value_t = 64)]
    pub batch: u64,
    /// Batch / learning-rate policy: fixed-global, linear, sqrt, adascale.
    #[arg(long, default_value = "fixed-global")]
    pub policy: String,
    /// Run with certificates (a CA and certificates in DIR/certs; mutual TLS everywhere).
    #[arg(long)]
    pub tls: bool,
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
    /// Idle time and lost steps of a spot notice, a join and a kill -9 of the leader's host,
    /// next to torchrun recovering from a killed worker in the same run.
    Elastic(crate::elastic_bench::BenchElasticArgs),
    /// Planner accuracy (predicted against measured step time of the chosen layout and
    /// others) and pipelined throughput against plain data parallelism, N processes.
    Pipeline(Box<crate::pipe_bench::BenchPipelineArgs>),
    /// Tokens per second of limpet's LLaMA training step next to the same model in
    /// transformers (PyTorch eager), same threads, batch and context, in the same run.
    Train(crate::train_bench::BenchTrainArgs),
    /// Samples per second of limpet agents training a LLaMA, next to torchrun + DDP (gloo)
    /// with as many ranks on the same model and global batch, in the same run.
    Dp(crate::train_bench::BenchDpArgs),
    /// Peak RSS of training on a large token dataset against the model's own footprint.
    Memory(crate::train_bench::BenchMemoryArgs),
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
    /// Instead of training, write the job's sample order to FILE ('-': stdout), one JSON
    /// line per step: its samples (array rows, or shard file and token) and learning rate.
    #[arg(long, value_name = "FILE")]
    pub print_order: Option<PathBuf>,
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Train(args) => crate::train_cmd::run(args),
        Command::Data(cmd) => crate::data_cmd::run(cmd),
        Command::Export(args) => crate::data_cmd::export(args),
        Command::Plan(args) => crate::plan_cmd::run(args),
        Command::PipeWorker(args) => crate::pipe_bench::run_worker(args),
        Command::Bench(BenchCommand::Pipeline(args)) => crate::pipe_bench::bench(*args),
        Command::Bench(BenchCommand::Train(args)) => crate::train_bench::bench(args),
        Command::Bench(BenchCommand::Dp(args)) => crate::train_bench::bench_dp(args),
        Command::Bench(BenchCommand::Memory(args)) => crate::train_bench::bench_memory(args),
        Command::RaftNode(args) => crate::raft_cmd::run_node(args),
        Command::Bench(BenchCommand::Raft(args)) => crate::raft_cmd::bench(args),
        Command::DpWorker(args) => crate::dp_cmd::run_worker(args),
        Command::Bench(BenchCommand::Allreduce(args)) => crate::dp_cmd::bench_allreduce(args),
        Command::Bench(BenchCommand::Handoff(args)) => crate::dp_cmd::bench_handoff(args),
        Command::Bench(BenchCommand::Elastic(args)) => crate::elastic_bench::bench(args),
        Command::Status(args) => crate::status::status(args),
        Command::Drain(args) => crate::status::drain(args),
        Command::Revoke(args) => crate::status::revoke(args),
        Command::Local(LocalCommand::Up(args)) => local_up(args),
        Command::Fleet(cmd) => crate::fleet_cmd::run(cmd),
        Command::Certs(cmd) => crate::certs::run(cmd),
        Command::Demo(args) => crate::demo::run(args),
        Command::Scenario(args) => crate::demo::scenario(args),
        Command::FakeMetadata { listen } => fake_metadata(listen),
    }
}

/// The command-line spelling of a value.
pub fn value_name<T: ValueEnum>(v: T) -> String {
    v.to_possible_value().map(|p| p.get_name().to_string()).unwrap_or_default()
}

fn local_up(a: LocalUpArgs) -> anyhow::Result<()> {
    if !["fixed-global", "linear", "sqrt", "adascale"].contains(&a.policy.as_str()) {
        return Err(crate::UsageError(format!(
            "--policy {:?} is not one of fixed-global, linear, sqrt, adascale",
            a.policy
        ))
        .into());
    }
    let job = crate::local::LocalJob {
        model: value_name(a.model),
        data: value_name(a.data),
        steps: a.steps,
        global_batch: a.batch,
        policy: a.policy.clone(),
        tls: a.tls,
        ..crate::local::LocalJob::default()
    };
    let mut cluster = crate::local::LocalCluster::up(&a.dir, a.nodes, job)?;
    println!(
        "{} agents up in {}; `limpet status --dir {}` shows them. Ctrl-C stops them.",
        a.nodes,
        a.dir.display(),
        a.dir.display()
    );
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        anyhow::Ok(())
    })?;
    cluster.down();
    Ok(())
}

fn fake_metadata(listen: std::net::SocketAddr) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let md = limpet_agent::fake_metadata::FakeMetadata::start(listen).await?;
        eprintln!("fake metadata at {}", md.url());
        std::future::pending::<()>().await;
        anyhow::Ok(())
    })
}
