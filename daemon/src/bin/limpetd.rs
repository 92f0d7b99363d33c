//! `limpetd`: the limpet agent service. Parses arguments and hands them to the library.

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = match limpet_daemon::limpetd::LimpetdCli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let code = if e.use_stderr() { limpet_daemon::EXIT_USAGE } else { 0 };
            let _ = e.print();
            return std::process::ExitCode::from(code);
        }
    };
    match limpet_daemon::limpetd::main(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("limpetd: {e:#}");
            std::process::ExitCode::from(limpet_daemon::exit_code(&e))
        }
    }
}
