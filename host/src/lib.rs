//! onceq: exactly-once message handlers, shipped as WebAssembly components,
//! on queues stored in a database (an embedded SQLite file by default).
//!
//! # Layout
//!
//! Data flows one way: store -> protocol -> runtime -> protocol -> store.
//! The public modules are the engine and what the tests, the benchmarks
//! and the handler test kit (`onceq-testkit`) use; the rest is private.
//!
//! - [`store`]: the `Store` trait (queue backend), the commit contract
//!   (`store::commit`: group commit, the buffering transaction) and the
//!   stores: `sqlite` (the embedded default), `spanner`, `memory` (the
//!   test kit's fixtures); `faulty` injects unknown commit outcomes.
//! - [`protocol`]: lease -> handle -> apply + ack -> commit, re-runs,
//!   retries and dead-lettering. No Wasm in here: it drives any `Handler`.
//! - [`runtime`]: wasmtime engine, component validation, the deterministic
//!   WASI subset, per-message instances and limits. `WasmHandler` is a
//!   `Handler`.
//! - [`outbox`]: intents delivered after commit through connectors
//!   (webhook, file, log): outbox queues worked by the same protocol.
//! - [`host`]: the one way to assemble a host from its config and run it;
//!   [`shutdown`]: how every task hears that it should stop.
//! - [`deploy`]: hot swap: validated deploys, versions, rollback, the
//!   watched folder.
//! - [`config`] (`onceq.toml`), [`schema`] (business tables and write
//!   validation), [`value`] (messages, rows, effects).
//! - [`testcases`] and [`tryout`]: `onceq test` and `onceq try`.
//! - [`cli`]: the command line (the `onceq` binary only calls
//!   [`cli::main`]); privately, `app` (what the commands do), `admin` (the
//!   admin HTTP API), `demo`, `dev`, `scaffold`, `typegen`, `names` (names,
//!   keys and escaping; a leaf) and `gather` (requests served together; a
//!   leaf).

// The engine: what runs messages exactly once, public for the tests,
// the benchmarks and the handler test kit.
pub mod access;
pub mod config;
pub mod deploy;
pub mod host;
pub mod outbox;
pub mod protocol;
pub mod runtime;
pub mod schema;
pub mod shutdown;
pub mod signing;
pub mod store;
pub mod telemetry;
pub mod trace;
pub mod value;

// The authors' loop, public for the handler test kit and the docs' tests.
pub mod testcases;
pub mod tryout;

// The command line; the `onceq` binary only calls `cli::main`.
pub mod cli;

// The rest is onceq's own.
mod admin;
mod app;
mod demo;
mod dev;
mod gather;
mod names;
mod scaffold;
mod typegen;

/// What the library's public async entry points that other crates await
/// (store opening, the queue runners, deploys) return: a boxed future.
///
/// For build time, not for the callers (they `.await` it as before): an
/// `async fn`'s state machine counts as generic, so its body, and every
/// client call it awaits, is compiled again in each crate that awaits it.
/// The binary and the test binaries each compiled the Spanner client's and
/// wasmtime's async paths again (minutes apiece of a cold release build).
/// Boxed here, they are compiled once, in this crate.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;
