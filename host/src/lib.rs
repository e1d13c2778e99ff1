//! onceq: exactly-once message handlers, shipped as WebAssembly components,
//! on queues stored in a database (an embedded SQLite file by default).
//!
//! # Layout
//!
//! Data flows one way: store -> protocol -> runtime -> protocol -> store.
//!
//! - [`store`]: the `Store` trait (queue backend) and its implementations;
//!   `sqlite` is the embedded default; `faulty` injects unknown commit
//!   outcomes for tests.
//! - [`protocol`]: lease -> handle -> apply + ack -> commit, re-runs, retries
//!   and dead-lettering. No Wasm in here: it drives any `Handler`.
//! - [`outbox`]: intents delivered after commit through connectors
//!   (webhook, file, log): outbox queues worked by the same protocol.
//! - [`runtime`]: wasmtime engine, component validation, the deterministic
//!   WASI subset, per-message instances and limits. `WasmHandler` is a
//!   `Handler`.
//! - [`schema`]: business tables as read from the database, and write
//!   validation.
//! - [`config`]: the `onceq.toml` file.
//! - [`deploy`]: hot swap: validated deploys, versions, rollback, the
//!   watched folder.
//! - [`admin`]: the admin HTTP API (health, Prometheus metrics, stats,
//!   deploy/rollback/versions behind a bearer token).
//! - [`names`]: queue, connector and key names, the reserved `onceq.`
//!   namespace, and escaping what handlers and producers chose (a leaf:
//!   it imports nothing of onceq's).
//! - [`app`]: what the CLI commands do; [`cli`]: the command line itself
//!   (argument parsing and printing; the `onceq` binary only calls
//!   [`cli::main`]).

pub mod admin;
pub mod app;
pub mod cli;
pub mod config;
pub mod demo;
pub mod deploy;
pub mod dev;
pub mod gather;
pub mod host;
pub mod names;
pub mod outbox;
pub mod protocol;
pub mod runtime;
pub mod scaffold;
pub mod schema;
pub mod shutdown;
pub mod store;
pub mod testcases;
pub mod tryout;
pub mod typegen;
pub mod value;

/// What the library's public async entry points that other crates await
/// (store opening, the queue runners, deploys) return: a boxed future.
///
/// For build time, not for the callers (they `.await` it as before): an
/// `async fn`'s state machine counts as generic, so its body, and every
/// client call it awaits, is compiled again in each crate that awaits it.
/// The binary and the test binaries each compiled the Spanner client's and
/// wasmtime's async paths again (measured: about 250-300 s apiece of a cold
/// release build). Boxed here, they are compiled once, in this crate.
pub type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;
