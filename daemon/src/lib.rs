//! limpet's product as a library: `limpetd` (the agent service: its configuration, metrics
//! endpoint and signals) and `limpet` (the operator's command line: status, drain, revoke,
//! certificates, fleet, training and data commands), with their output. `src/bin` only
//! calls into here. The demo, benchmarks and local clusters are the `limpet-lab` crate.
//!
//! One rule for the command line's modules: a command whose code is one file is
//! `<command>_cmd.rs` (`train_cmd`, `plan_cmd`, `export_cmd`, `fleet_cmd`, `data_cmd` with
//! `tokenize_cmd` for `data tokenize`, `credentials_cmd` for `limpetd fetch-credentials`,
//! `propose_cmd` for the commands that propose to the cluster's log: `drain`, `revoke` and
//! `certs revoke`); a command that is a room of its own is a folder or module named after it
//! (`status/`, `simulate/`, `certs`).

#![forbid(unsafe_code)]

pub mod args;
pub mod certs;
pub mod cli;
#[cfg(feature = "lab")]
pub mod cluster_file;

/// `--version` of `limpet` and `limpetd`: a build with the `lab` feature says so, and
/// `deploy/dist.sh` refuses to pack it (a workspace build turns the feature on for
/// limpet-lab's sake; `make dist` builds the product alone).
pub const VERSION: &str = if cfg!(feature = "lab") {
    concat!(env!("CARGO_PKG_VERSION"), " (lab build: local clusters, drills, chaos hooks; not for release)")
} else {
    env!("CARGO_PKG_VERSION")
};
pub mod config;
pub mod credentials_cmd;
pub mod data_cmd;
pub mod export_cmd;
pub mod failure;
pub mod fleet_cmd;
pub mod limpetd;
pub mod metrics;
pub mod plan_cmd;
pub mod plot;
pub mod propose_cmd;
pub mod reconciler;
pub mod simulate;
pub mod status;
pub mod text;
pub mod tokenize_cmd;
pub mod train_cmd;
pub mod watch_sources;

pub use failure::{Failure, Result, UsageError, Within, EXIT_DATA, EXIT_FAILURE, EXIT_USAGE};

/// Logs to stderr, filtered by `LIMPET_LOG` (default: info, raft-rs at warn).
pub fn init_tracing() {
    init_tracing_as(false);
}

/// Logs to stderr as text, or as one JSON object per line (`limpetd --log-format json`, for
/// journald or a log shipper), filtered by `LIMPET_LOG`.
pub fn init_tracing_as(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("LIMPET_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,raft=warn"));
    use std::io::IsTerminal;
    let fmt = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = if json {
        fmt.json().with_current_span(false).try_init()
    } else {
        fmt.with_ansi(std::io::stderr().is_terminal()).try_init()
    };
}

/// A binary's `main`: parses its arguments (clap's errors exit with [`EXIT_USAGE`], help and
/// version with 0), runs it, and maps an error to its exit status after printing it as
/// `NAME: error: cause`.
pub fn main_with<C: clap::Parser>(name: &str, run: impl FnOnce(C) -> Result<()>) -> std::process::ExitCode {
    // Deterministic cuBLAS (a reproducible job on a GPU) reads this when it starts, and the
    // environment may be changed only while the process has one thread: now.
    let (key, value) = limpet_trainer::device::CUBLAS_WORKSPACE;
    if std::env::var_os(key).is_none() {
        std::env::set_var(key, value);
    }
    let cli = match C::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let code = if e.use_stderr() { EXIT_USAGE } else { 0 };
            let _ = e.print();
            return std::process::ExitCode::from(code);
        }
    };
    match run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: {}", e.report());
            std::process::ExitCode::from(e.exit_code())
        }
    }
}
