//! Command-line definitions of `limpet-lab` and dispatch: the demo, scripted scenarios,
//! benchmarks, local clusters on loopback, and the worker processes benchmarks and tests
//! start. None of it is needed to run a cluster; `limpet` and `limpetd` hold what is.

use clap::{Args, Parser, Subcommand};
use limpet_daemon::args::{value_name, DataName, ModelName};
use std::path::PathBuf;

/// limpet-lab: the demo, scenarios, benchmarks and local clusters of limpet.
#[derive(Debug, Parser)]
#[command(name = "limpet-lab", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// The demo: 4 agents on real data through a spot notice, a join, a kill -9 and a drain.
    Demo(crate::demo::DemoArgs),
    /// Run a local cluster through a scripted scenario (the multi-process tests use it).
    Scenario(crate::demo::ScenarioArgs),
    /// Replay a preemption trace against a local cluster, compressed in time, and compare
    /// what it trained with the simulation of the same segment.
    Chaos(crate::chaos::ChaosArgs),
    /// Measure a part of limpet on this machine.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Local clusters on loopback.
    #[command(subcommand)]
    Local(LocalCommand),
    /// Run one membership-log node (Raft over gRPC, sled storage) without training; the
    /// benchmarks and multi-process tests start these.
    RaftNode(crate::raft_cmd::RaftNodeArgs),
    /// Run one rank of a data-plane group (benchmarks and multi-process tests start these;
    /// the cluster secret comes from LIMPET_DP_SECRET).
    DpWorker(crate::dp_cmd::DpWorkerArgs),
    /// Run one rank of a data x pipeline layout (the pipeline benchmark starts these; the
    /// cluster secret comes from LIMPET_DP_SECRET).
    PipeWorker(crate::pipe_bench::PipeWorkerArgs),
    /// Serve a fake cloud metadata service (AWS IMDSv2, GCP, Azure shapes) for local nodes.
    FakeMetadata {
        /// Listen address.
        #[arg(long)]
        listen: std::net::SocketAddr,
    },
}

/// `limpet-lab local ...`.
#[derive(Debug, Subcommand)]
pub enum LocalCommand {
    /// Start N agents on loopback, each with a fake metadata service; runs until Ctrl-C.
    Up(LocalUpArgs),
}

/// `limpet-lab local up`.
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
    pub model: ModelName,
    /// Dataset.
    #[arg(long, value_enum, default_value = "digits")]
    pub data: DataName,
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

/// `limpet-lab bench ...`.
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
    Dp(crate::dp_bench::BenchDpArgs),
    /// Peak RSS of training on a large token dataset against the model's own footprint.
    Memory(crate::train_bench::BenchMemoryArgs),
    /// Peak RSS and speed of a LLaMA step with and without activation checkpointing and a
    /// chunked loss, at a large vocabulary.
    Activations(crate::act_bench::BenchActivationsArgs),
    /// Step time with one slow host: equal shares against shares by measured speed, next to
    /// the same cluster without it.
    Straggler(crate::straggler_bench::BenchStragglerArgs),
    /// What running limpet costs as the fleet grows: control traffic and CPU per node and
    /// on the leader, commit latency, a mass revocation and a wave of joins, per fleet size.
    Scale(crate::scale_bench::BenchScaleArgs),
    /// Barrier and allreduce time against the world size, up to a thousand ranks in one
    /// process: as the group picks (butterfly or ring) next to the ring alone.
    Collectives(crate::collectives_bench::BenchCollectivesArgs),
    /// What a steady round of the leader's controller costs against the fleet size, a
    /// pipelined job's layout kept between rounds next to worked out afresh.
    Round(crate::round_bench::BenchRoundArgs),
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> limpet_daemon::Result<()> {
    match cli.command {
        Command::Demo(args) => crate::demo::run(args),
        Command::Scenario(args) => crate::demo::scenario(args),
        Command::Chaos(args) if args.runs.runs.is_some() => crate::chaos_runs::run(&args),
        Command::Chaos(args) => crate::chaos::run(args),
        Command::Local(LocalCommand::Up(args)) => local_up(args),
        Command::RaftNode(args) => crate::raft_cmd::run_node(args),
        Command::DpWorker(args) => crate::dp_cmd::run_worker(args),
        Command::PipeWorker(args) => crate::pipe_bench::run_worker(args),
        Command::FakeMetadata { listen } => fake_metadata(listen),
        Command::Bench(BenchCommand::Raft(args)) => crate::raft_cmd::bench(args),
        Command::Bench(BenchCommand::Allreduce(args)) => crate::dp_cmd::bench_allreduce(args),
        Command::Bench(BenchCommand::Handoff(args)) => crate::dp_cmd::bench_handoff(args),
        Command::Bench(BenchCommand::Elastic(args)) => crate::elastic_bench::bench(args),
        Command::Bench(BenchCommand::Pipeline(args)) => crate::pipe_bench::bench(*args),
        Command::Bench(BenchCommand::Train(args)) => crate::train_bench::bench(args),
        Command::Bench(BenchCommand::Dp(args)) => crate::dp_bench::bench_dp(args),
        Command::Bench(BenchCommand::Memory(args)) => {
            let sharded = match args.sharded_world {
                Some(n) => Some(crate::dp_bench::sharded_memory(&args, n as usize)?),
                None => None,
            };
            crate::train_bench::bench_memory(args, sharded)
        }
        Command::Bench(BenchCommand::Activations(args)) => crate::act_bench::run(args),
        Command::Bench(BenchCommand::Straggler(args)) => crate::straggler_bench::run(args),
        Command::Bench(BenchCommand::Scale(args)) => crate::scale_bench::run(args),
        Command::Bench(BenchCommand::Collectives(args)) => crate::collectives_bench::run(args),
        Command::Bench(BenchCommand::Round(args)) => crate::round_bench::run(args),
    }
}

fn local_up(a: LocalUpArgs) -> limpet_daemon::Result<()> {
    if !["fixed-global", "linear", "sqrt", "adascale"].contains(&a.policy.as_str()) {
        return Err(limpet_daemon::UsageError(format!(
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
        Ok::<_, limpet_daemon::Failure>(())
    })?;
    cluster.down();
    Ok(())
}

fn fake_metadata(listen: std::net::SocketAddr) -> limpet_daemon::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let md = crate::fake_metadata::FakeMetadata::start(listen).await?;
        eprintln!("fake metadata at {}", md.url());
        std::future::pending::<()>().await;
        Ok::<_, limpet_daemon::Failure>(())
    })
}
