//! The `onceq` binary: the command line is [`onceq::cli`].

/// mimalloc, not the system allocator: through the CLI (20,000 payments
/// messages, intents delivered, four alternated pairs) 3-8% more messages
/// a second and a fifth less user CPU, for about 15 MB more peak RSS
/// (docs/src/benchmarks.md, 2026-12-05). `malloc` and `free` were a tenth
/// of the host's samples.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    onceq::cli::main()
}
