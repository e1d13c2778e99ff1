//! The integration tests as one binary: each file of this folder is a
//! module here (`cargo test --test integration -- cli::` runs one file).
//! One binary links wasmtime and the Spanner client once instead of once per
//! file, which is most of `make test`'s build time. The harness runs two tests
//! at a time across all files; every test waits on its own conditions.
//!
//! `spanner_faults.rs` is its own binary: its tests point the process-wide
//! `SPANNER_EMULATOR_HOST` at their proxy.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

mod accounting;
mod chaos;
mod cli;
mod console;
mod deploy;
mod docs;
mod exactly_once;
mod examples;
mod hostile;
mod layering;
mod outbox;
mod sandbox;
mod spanner;
mod store_conformance;
mod teams;
mod telemetry;
mod verdict;
