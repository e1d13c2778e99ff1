//! Chaos: several `onceq run` processes on one database, killed with
//! SIGKILL at random and started again, with leases short enough to expire
//! under load; then every host restarted with `--until-empty`, and an audit
//! that reads the database file directly (rusqlite, not onceq's store code):
//!
//! - each valid order applied exactly once (balances plus charges add up to
//!   what the accounts held; one order row each);
//! - nothing lost: the queues are empty, every invalid order dead-lettered
//!   with its reason, no other dead letter;
//! - one idempotency key per intent, an intent for every charged order and
//!   none for a declined one (a rolled-back attempt leaves no intent);
//! - drained within a bound after the faults stop.
//!
//! `make test` runs a short version; `make chaos` a long one
//! (`ONCEQ_CHAOS_MESSAGES`, `ONCEQ_CHAOS_SECONDS`, `ONCEQ_CHAOS_HOSTS`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use common::*;
use onceq::store::{SendParams, Store, StoreOptions};
use rand::RngExt;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const ACCOUNTS: usize = 20;
const BALANCE: i64 = 1_000_000;

fn setting(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// One in a hundred orders is invalid (amount 0): the handler rejects it,
/// so it must be dead-lettered with its reason, once.
fn is_invalid(i: usize) -> bool {
    i % 100 == 7
}

async fn send_chaos_orders(store: &dyn Store, n: usize) {
    let msgs: Vec<SendParams> = (0..n)
        .map(|i| SendParams {
            queue: "payments".into(),
            payload: order(i, i % ACCOUNTS, if is_invalid(i) { 0 } else { 1 + (i as i64 % 50) }).into_bytes(),
            ..Default::default()
        })
        .collect();
    for chunk in msgs.chunks(1000) {
        store.message_send(chunk.to_vec()).await.unwrap();
    }
}

fn host(dir: &Path, until_empty: bool) -> Child {
    let mut c = Command::new(env!("CARGO_BIN_EXE_onceq"));
    c.current_dir(dir).arg("run");
    if until_empty {
        c.arg("--until-empty");
    }
    c.env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// What the faults did.
struct Report {
    kills: u64,
    fault_phase: Duration,
    drain: Duration,
}

/// Run `hosts` hosts in `dir` for `seconds` of faults (a random host
/// SIGKILLed and restarted every 0.5-2 s), then every host with
/// `--until-empty`, which must all exit 0 within `bound`.
fn run_with_kills(dir: &Path, hosts: usize, seconds: u64, bound: Duration) -> Report {
    let mut rng = rand::rng();
    let mut running: Vec<Child> = (0..hosts).map(|_| host(dir, false)).collect();
    let started = Instant::now();
    let mut kills = 0;
    while started.elapsed() < Duration::from_secs(seconds) {
        std::thread::sleep(Duration::from_millis(rng.random_range(500..2000)));
        let victim = rng.random_range(0..hosts);
        running[victim].kill().unwrap(); // SIGKILL
        running[victim].wait().unwrap();
        kills += 1;
        running[victim] = host(dir, false);
    }
    for mut h in running {
        h.kill().unwrap();
        h.wait().unwrap();
    }
    let fault_phase = started.elapsed();
    let draining = Instant::now();
    let finishing: Vec<Child> = (0..hosts).map(|_| host(dir, true)).collect();
    for mut h in finishing {
        loop {
            if let Some(status) = h.try_wait().unwrap() {
                assert!(status.success(), "a host exited with {status} while draining");
                break;
            }
            if draining.elapsed() > bound {
                h.kill().unwrap();
                panic!("the queue did not drain within {bound:?} after the faults stopped");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    Report {
        kills,
        fault_phase,
        drain: draining.elapsed(),
    }
}

/// The audit's reading of the delivered charges: key -> deliveries. A line
/// torn by a SIGKILL mid-write is skipped (its intent was not acked, so it
/// is delivered again) and counted.
fn deliveries(path: &Path) -> (BTreeMap<String, u64>, u64) {
    let mut out = BTreeMap::new();
    let mut torn = 0;
    for line in std::fs::read_to_string(path).unwrap_or_default().lines() {
        match serde_json::from_str::<serde_json::Value>(line)
            .ok()
            .and_then(|v| v["idempotency_key"].as_str().map(str::to_string))
        {
            Some(key) => *out.entry(key).or_default() += 1,
            None => torn += 1,
        }
    }
    (out, torn)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_hosts_killed_at_random_process_each_message_exactly_once() {
    let n = setting("ONCEQ_CHAOS_MESSAGES", 3000) as usize;
    let seconds = setting("ONCEQ_CHAOS_SECONDS", 15);
    let hosts = setting("ONCEQ_CHAOS_HOSTS", 3) as usize;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("chaos.db");
    let store: Arc<dyn Store> = onceq::store::init(
        db.to_str().unwrap(),
        include_str!("../guest-examples/payments/schema.sql"),
        &StoreOptions::default(),
    )
    .await
    .unwrap();
    seed_accounts(store.as_ref(), ACCOUNTS, BALANCE).await;
    send_chaos_orders(store.as_ref(), n).await;
    drop(store);
    std::fs::write(
        dir.path().join("onceq.toml"),
        payments_hosts_config(
            &format!("store = \"sqlite://{}\"", db.display()),
            "lease = \"2s\"\nbackoff_initial = \"20ms\"\nbackoff_max = \"500ms\"\nmax_attempts = 50",
        ),
    )
    .unwrap();

    let bound = Duration::from_secs(60 + n as u64 / 20);
    let report = tokio::task::spawn_blocking({
        let dir = dir.path().to_path_buf();
        move || run_with_kills(&dir, hosts, seconds, bound)
    })
    .await
    .unwrap();

    // The audit: the file itself, read with rusqlite.
    let c = rusqlite::Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
    let count = |sql: &str| -> i64 { c.query_row(sql, [], |r| r.get(0)).unwrap() };
    assert_eq!(count("SELECT COUNT(*) FROM onceq_messages"), 0, "every queue drained (outbox too)");
    let invalid = (0..n).filter(|&i| is_invalid(i)).count() as i64;
    assert_eq!(
        count("SELECT COUNT(*) FROM orders"),
        n as i64 - invalid,
        "one order row per valid order"
    );
    assert_eq!(
        count("SELECT COUNT(*) FROM onceq_dead_letters"),
        invalid,
        "only the invalid orders dead-lettered"
    );
    assert_eq!(
        count("SELECT COUNT(*) FROM onceq_dead_letters WHERE reason NOT LIKE '%amount must be positive%'"),
        0,
        "each dead letter carries its reason"
    );
    let charged_sum = count("SELECT COALESCE(SUM(amount), 0) FROM orders WHERE status = 'charged'");
    let balances = count("SELECT SUM(balance) FROM accounts");
    assert_eq!(
        balances + charged_sum,
        ACCOUNTS as i64 * BALANCE,
        "every debit applied exactly once"
    );
    let charged: BTreeSet<String> = c
        .prepare("SELECT 'charge-' || id FROM orders WHERE status = 'charged'")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let (delivered, torn) = deliveries(&dir.path().join("charges.jsonl"));
    let keys: BTreeSet<String> = delivered.keys().cloned().collect();
    assert_eq!(
        keys, charged,
        "one intent key per charged order, none for a declined or rolled-back one"
    );
    let repeats: u64 = delivered.values().map(|d| d - 1).sum();
    eprintln!(
        "chaos (SQLite): {n} messages, {hosts} hosts, {} SIGKILLs in {:.0?}; drained {:.1?} after the faults stopped; \
         {} orders charged, {invalid} dead-lettered; {repeats} repeated deliveries (at least once, each with its key), {torn} torn lines",
        report.kills,
        report.fault_phase,
        report.drain,
        charged.len()
    );
}
