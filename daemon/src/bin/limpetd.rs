//! `limpetd`: the limpet agent service. Parses arguments and hands them to the library.

fn main() -> std::process::ExitCode {
    limpet_daemon::main_with("limpetd", limpet_daemon::limpetd::main)
}
