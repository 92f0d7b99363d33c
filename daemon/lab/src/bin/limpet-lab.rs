//! `limpet-lab`: the demo, scenarios, benchmarks and local clusters. Parses arguments and
//! hands them to the library.

fn main() -> std::process::ExitCode {
    limpet_daemon::main_with("limpet-lab", limpet_lab::cli::run)
}
