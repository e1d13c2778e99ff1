//! The deterministic, capability-free WASI subset.
//!
//! Ordinary guests (Rust with `std`, and later JS and Python) import a few
//! WASI interfaces even when they never touch the outside world. We provide
//! exactly those, made deterministic per message:
//!
//! - `wasi:cli/environment`: no variables, no arguments, no cwd;
//! - `wasi:cli/stdin`: empty; `stdout`/`stderr`: captured into the message's
//!   log; `exit`: ends the call as a failure;
//! - `wasi:clocks/*`: both clocks read the message's logical time; a
//!   pollable on the monotonic clock (what `sleep` waits on) is ready at
//!   once: logical time does not pass during a call, so there is nothing
//!   to wait for, and a sleeping guest cannot hold a worker;
//! - `wasi:random/*`: seeded from the message id;
//! - `wasi:io/*`: the streams and pollables the above need.
//!
//! Everything else (filesystem, sockets, http, unknown packages) is refused
//! at deploy time with an error naming each import ([`check_imports`]).

use super::HostState;
use rand::SeedableRng;
use std::time::Duration;
use wasmtime::component::{HasData, Linker, ResourceTable};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{HostMonotonicClock, HostWallClock, WasiCtx, WasiCtxBuilder};

/// Interfaces a handler component may import (package/interface, any
/// version of the package).
pub const ALLOWED_IMPORTS: &[&str] = &[
    "onceq:handler/types",
    "onceq:handler/store",
    "onceq:handler/log",
    "onceq:handler/encoded",
    "wasi:io/error",
    "wasi:io/poll",
    "wasi:io/streams",
    "wasi:clocks/wall-clock",
    "wasi:clocks/monotonic-clock",
    "wasi:random/random",
    "wasi:random/insecure",
    "wasi:random/insecure-seed",
    "wasi:cli/environment",
    "wasi:cli/exit",
    "wasi:cli/stdin",
    "wasi:cli/stdout",
    "wasi:cli/stderr",
    "wasi:cli/terminal-input",
    "wasi:cli/terminal-output",
    "wasi:cli/terminal-stdin",
    "wasi:cli/terminal-stdout",
    "wasi:cli/terminal-stderr",
];

/// `wasi:random/random@0.2.6` -> `wasi:random/random`.
pub fn unversioned(name: &str) -> &str {
    name.split('@').next().unwrap_or(name)
}

/// The imports of a component that are not allowed, with a hint each.
pub fn check_imports<'a>(imports: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    imports
        .into_iter()
        .filter(|i| !ALLOWED_IMPORTS.contains(&unversioned(i)))
        .map(|i| {
            let why = match unversioned(i).split('/').next().unwrap_or("") {
                "wasi:filesystem" => "handlers have no filesystem",
                "wasi:sockets" | "wasi:http" => "handlers have no network; emit an intent for the outbox instead",
                _ => "not provided by onceq",
            };
            format!("{i} ({why})")
        })
        .collect()
}

/// Capacity of the captured stdout/stderr per message; writing more traps.
pub const STDIO_CAPACITY: usize = 1 << 20;

struct FixedWall(Duration);

impl HostWallClock for FixedWall {
    fn resolution(&self) -> Duration {
        Duration::from_micros(1)
    }
    fn now(&self) -> Duration {
        self.0
    }
}

struct FixedMonotonic(u64);

impl HostMonotonicClock for FixedMonotonic {
    fn resolution(&self) -> u64 {
        1_000
    }
    fn now(&self) -> u64 {
        self.0
    }
}

/// Per-message WASI state.
pub struct DeterministicWasi {
    pub ctx: WasiCtx,
    /// What the monotonic clock reads, nanoseconds.
    pub monotonic_ns: u64,
    pub stdout: MemoryOutputPipe,
    pub stderr: MemoryOutputPipe,
}

impl DeterministicWasi {
    /// `now_us`: the message's logical time; `seed`: from the message id.
    pub fn new(now_us: i64, seed: u64) -> DeterministicWasi {
        let stdout = MemoryOutputPipe::new(STDIO_CAPACITY);
        let stderr = MemoryOutputPipe::new(STDIO_CAPACITY);
        let now = Duration::from_micros(u64::try_from(now_us).unwrap_or(0));
        let monotonic_ns = u64::try_from(now.as_nanos()).unwrap_or(u64::MAX);
        let ctx = WasiCtxBuilder::new()
            .stdout(stdout.clone())
            .stderr(stderr.clone())
            .wall_clock(FixedWall(now))
            .monotonic_clock(FixedMonotonic(monotonic_ns))
            .secure_random(rand::rngs::StdRng::seed_from_u64(seed))
            .insecure_random(rand::rngs::StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15))
            .insecure_random_seed(u128::from(seed))
            .build();
        DeterministicWasi {
            ctx,
            monotonic_ns,
            stdout,
            stderr,
        }
    }
}

/// The monotonic clock of a call: fixed at the message's logical time, its
/// pollables ready at once ([`ReadyAtOnce`]).
pub struct LogicalClock;

impl HasData for LogicalClock {
    type Data<'a> = LogicalClockView<'a>;
}

pub struct LogicalClockView<'a> {
    now_ns: u64,
    table: &'a mut ResourceTable,
}

/// A pollable that is ready at once; it yields to tokio the first time
/// (as wasmtime-wasi's zero-duration deadline does) so a guest polling in
/// a loop does not starve other tasks. The epoch deadline bounds the loop.
struct ReadyAtOnce {
    yielded: bool,
}

#[async_trait::async_trait]
impl wasmtime_wasi_io::poll::Pollable for ReadyAtOnce {
    async fn ready(&mut self) {
        if !self.yielded {
            self.yielded = true;
            tokio::task::yield_now().await;
        }
    }
}

impl LogicalClockView<'_> {
    fn ready(&mut self) -> wasmtime::Result<wasmtime::component::Resource<wasmtime_wasi_io::poll::DynPollable>> {
        let r = self.table.push(ReadyAtOnce { yielded: false })?;
        wasmtime_wasi_io::poll::subscribe(self.table, r)
    }
}

impl wasmtime_wasi::p2::bindings::clocks::monotonic_clock::Host for LogicalClockView<'_> {
    fn now(&mut self) -> wasmtime::Result<u64> {
        Ok(self.now_ns)
    }
    fn resolution(&mut self) -> wasmtime::Result<u64> {
        Ok(1_000)
    }
    fn subscribe_instant(&mut self, _when: u64) -> wasmtime::Result<wasmtime::component::Resource<wasmtime_wasi_io::poll::DynPollable>> {
        self.ready()
    }
    fn subscribe_duration(&mut self, _d: u64) -> wasmtime::Result<wasmtime::component::Resource<wasmtime_wasi_io::poll::DynPollable>> {
        self.ready()
    }
}

struct HasIo;

impl HasData for HasIo {
    type Data<'a> = &'a mut ResourceTable;
}

/// Add the subset to a linker, interface by interface (a linker cannot
/// drop interfaces, so the full WASI set is never added).
fn cli_view(t: &mut HostState) -> wasmtime_wasi::cli::WasiCliCtxView<'_> {
    wasmtime_wasi::cli::WasiCliView::cli(t)
}

pub fn add_to_linker(l: &mut Linker<HostState>) -> wasmtime::Result<()> {
    use wasmtime_wasi::cli::WasiCli;
    use wasmtime_wasi::clocks::WasiClocks;
    use wasmtime_wasi::p2::bindings::{cli, clocks, random};
    use wasmtime_wasi::random::{WasiRandom, WasiRandomView};
    use wasmtime_wasi_io::bindings::wasi::io;
    io::error::add_to_linker::<HostState, HasIo>(l, |t| &mut t.table)?;
    io::poll::add_to_linker::<HostState, HasIo>(l, |t| &mut t.table)?;
    io::streams::add_to_linker::<HostState, HasIo>(l, |t| &mut t.table)?;
    clocks::wall_clock::add_to_linker::<HostState, WasiClocks>(l, wasmtime_wasi::clocks::WasiClocksView::clocks)?;
    clocks::monotonic_clock::add_to_linker::<HostState, LogicalClock>(l, |t| LogicalClockView {
        now_ns: t.wasi.monotonic_ns,
        table: &mut t.table,
    })?;
    random::random::add_to_linker::<HostState, WasiRandom>(l, |t| WasiRandomView::random(t))?;
    random::insecure::add_to_linker::<HostState, WasiRandom>(l, |t| WasiRandomView::random(t))?;
    random::insecure_seed::add_to_linker::<HostState, WasiRandom>(l, |t| WasiRandomView::random(t))?;
    cli::exit::add_to_linker::<HostState, WasiCli>(l, cli_view)?;
    cli::environment::add_to_linker::<HostState, WasiCli>(l, cli_view)?;
    cli::stdin::add_to_linker::<HostState, WasiCli>(l, cli_view)?;
    cli::stdout::add_to_linker::<HostState, WasiCli>(l, cli_view)?;
    cli::stderr::add_to_linker::<HostState, WasiCli>(l, cli_view)?;
    cli::terminal_input::add_to_linker::<HostState, WasiCli>(l, cli_view)?;
    cli::terminal_output::add_to_linker::<HostState, WasiCli>(l, cli_view)?;
    cli::terminal_stdin::add_to_linker::<HostState, WasiCli>(l, cli_view)?;
    cli::terminal_stdout::add_to_linker::<HostState, WasiCli>(l, cli_view)?;
    cli::terminal_stderr::add_to_linker::<HostState, WasiCli>(l, cli_view)?;
    Ok(())
}
