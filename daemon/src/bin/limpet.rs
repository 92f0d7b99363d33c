//! `limpet`: the cluster command line. Parses arguments and hands them to the library.

fn main() -> std::process::ExitCode {
    limpet_daemon::main_with("limpet", limpet_daemon::cli::run)
}
