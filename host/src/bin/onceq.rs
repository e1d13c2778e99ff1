//! The `onceq` binary: the command line is [`onceq::cli`].

fn main() -> std::process::ExitCode {
    onceq::cli::main()
}
