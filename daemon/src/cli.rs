//! Command-line definitions of `limpet`, the operator's tool, and dispatch to the
//! commands. Demo, scenarios, benchmarks, local clusters and test workers are `limpet-lab`.

use crate::args::TrainArgs;
use clap::{Parser, Subcommand};

/// limpet: elastic training that survives spot revocations.
#[derive(Debug, Parser)]
#[command(name = "limpet", version = crate::VERSION, about)]
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
    /// Choose a data x pipeline layout for a model and a set of hosts: profiles the model's
    /// blocks here, then prints the chosen layout, its predicted step time and the runners-up.
    Plan(crate::plan_cmd::PlanArgs),
    /// Token shards for `data = "tokens"`: tokenize text, index existing .bin files, verify.
    #[command(subcommand)]
    Data(crate::data_cmd::DataCommand),
    /// Write a LLaMA checkpoint as a Hugging Face directory that `transformers` loads.
    Export(crate::export_cmd::ExportArgs),
    /// Show the cluster: nodes with role and status, leader, epoch, step, loss, throughput,
    /// and recent transitions with cause, idle time and lost steps.
    Status(crate::status::StatusArgs),
    /// Ask a node to leave at the next epoch boundary.
    Drain(crate::propose_cmd::DrainArgs),
    /// Inject a revocation: a spot notice (--in SECS) or a kill without notice (--hard).
    Revoke(crate::propose_cmd::RevokeArgs),
    /// The cluster's certificates: a CA, node and operator certificates (mutual TLS).
    #[command(subcommand)]
    Certs(crate::certs::CertsCommand),
    /// A cluster's spot capacity on EC2: launch, list, terminate.
    #[command(subcommand)]
    Fleet(crate::fleet_cmd::FleetCommand),
    /// What a job costs over a preemption trace: limpet, checkpoint-restart and on-demand.
    Simulate(crate::simulate::SimulateArgs),
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> crate::Result<()> {
    match cli.command {
        Command::Train(args) => crate::train_cmd::run(args),
        Command::Data(cmd) => crate::data_cmd::run(cmd),
        Command::Export(args) => crate::export_cmd::export(args),
        Command::Plan(args) => crate::plan_cmd::run(args),
        Command::Status(args) => crate::status::status(args),
        Command::Drain(args) => crate::propose_cmd::drain(args),
        Command::Revoke(args) => crate::propose_cmd::revoke(args),
        Command::Fleet(cmd) => crate::fleet_cmd::run(cmd),
        Command::Certs(cmd) => crate::certs::run(cmd),
        Command::Simulate(args) => crate::simulate::run(args),
    }
}
