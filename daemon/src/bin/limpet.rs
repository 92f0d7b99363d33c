//! `limpet`: the cluster command line. Parses arguments and hands them to the library.

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = match limpet_daemon::cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let code = if e.use_stderr() { limpet_daemon::EXIT_USAGE } else { 0 };
            let _ = e.print();
            return std::process::ExitCode::from(code);
        }
    };
    match limpet_daemon::cli::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("limpet: {e:#}");
            std::process::ExitCode::from(limpet_daemon::exit_code(&e))
        }
    }
}
