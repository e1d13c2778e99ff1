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
//! The hosts run with the default `max_attempts` and `max_reruns`: a kill,
//! an expired lease or a lost answer is not the message's failure, so no
//! valid order may end in the dead-letter table. Each run prints one line:
//! lost, doubled and valid orders dead-lettered (all must be 0), and the
//! drain time.
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

/// `onceq run` in `dir` (with `--until-empty` when draining), with `env`.
fn host(dir: &Path, until_empty: bool, env: &[(&str, String)]) -> Child {
    let mut c = Command::new(env!("CARGO_BIN_EXE_onceq"));
    c.current_dir(dir).arg("run");
    if until_empty {
        c.arg("--until-empty");
    }
    // ONCEQ_CHAOS_LOG=<dir>: every host's log (RUST_LOG's level, else
    // warn) is appended to <dir>/<host>.log, to look at a run.
    let log = std::env::var_os("ONCEQ_CHAOS_LOG").map(|d| {
        let name = env
            .iter()
            .map(|(_, v)| v.replace([':', '/', '.'], "_"))
            .collect::<Vec<_>>()
            .join("-");
        let path = Path::new(&d).join(format!("{}{name}.log", if until_empty { "drain-" } else { "" }));
        std::fs::OpenOptions::new().create(true).append(true).open(path).unwrap()
    });
    c.envs(env.iter().map(|(k, v)| (k, v)))
        .env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()))
        .stdout(Stdio::null())
        .stderr(log.map_or_else(Stdio::null, Stdio::from))
        .spawn()
        .unwrap()
}

/// What the faults did.
struct Report {
    kills: u64,
    fault_phase: Duration,
    drain: Duration,
}

/// How the faults are dealt: the environment of host `i`, how often a
/// random host is SIGKILLed (per 0.5-2 s tick), and what else happens
/// each tick (`tick(true)`), and once the faults stop (`tick(false)`).
struct Faults<'a> {
    env: &'a dyn Fn(usize) -> Vec<(&'static str, String)>,
    kill_probability: f64,
    tick: &'a mut dyn FnMut(bool),
}

/// Run `hosts` hosts in `dir` for `seconds` of faults, then every host
/// with `--until-empty`, which must all exit 0 within `bound`.
fn run_with_faults(dir: &Path, hosts: usize, seconds: u64, bound: Duration, faults: Faults<'_>) -> Report {
    let mut rng = rand::rng();
    let mut running: Vec<Child> = (0..hosts).map(|i| host(dir, false, &(faults.env)(i))).collect();
    let started = Instant::now();
    let mut kills = 0;
    while started.elapsed() < Duration::from_secs(seconds) {
        std::thread::sleep(Duration::from_millis(rng.random_range(500..2000)));
        (faults.tick)(true);
        if rng.random_bool(faults.kill_probability) {
            let victim = rng.random_range(0..hosts);
            running[victim].kill().unwrap(); // SIGKILL
            running[victim].wait().unwrap();
            kills += 1;
            running[victim] = host(dir, false, &(faults.env)(victim));
        }
    }
    for mut h in running {
        h.kill().unwrap();
        h.wait().unwrap();
    }
    (faults.tick)(false);
    let fault_phase = started.elapsed();
    let draining = Instant::now();
    let finishing: Vec<Child> = (0..hosts).map(|i| host(dir, true, &(faults.env)(i))).collect();
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

/// What the audit counts against the database: each must be 0.
struct Verdict {
    /// Valid orders neither applied nor dead-lettered (the queues drained).
    lost: i64,
    /// Money debited twice (balances plus charges short of what the
    /// accounts held).
    doubled: i64,
    /// Valid orders in the dead-letter table.
    valid_dead: i64,
}

impl Verdict {
    fn new(n: usize, orders: i64, dead_valid: i64, balances: i64, charged_sum: i64) -> Verdict {
        let valid = (0..n).filter(|&i| !is_invalid(i)).count() as i64;
        Verdict {
            lost: valid - orders - dead_valid,
            doubled: ACCOUNTS as i64 * BALANCE - (balances + charged_sum),
            valid_dead: dead_valid,
        }
    }

    /// The report's line, then the assertions.
    fn check(&self, store: &str, report: &Report) {
        eprintln!(
            "chaos ({store}) verdict: lost {}, doubled {}, valid dead-lettered {}; drained {:.1?} after the faults stopped",
            self.lost, self.doubled, self.valid_dead, report.drain
        );
        assert_eq!(self.lost, 0, "no valid order lost");
        assert_eq!(self.doubled, 0, "no debit applied twice");
        assert_eq!(self.valid_dead, 0, "no valid order dead-lettered for the host's own trouble");
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

/// The delivered charges are exactly the charged orders' keys, each at
/// least once; returns the repeated deliveries and the torn lines.
fn audit_deliveries(path: &Path, charged: &BTreeSet<String>) -> (u64, u64) {
    let (delivered, torn) = deliveries(path);
    let keys: BTreeSet<String> = delivered.keys().cloned().collect();
    assert_eq!(
        &keys, charged,
        "one intent key per charged order, none for a declined or rolled-back one"
    );
    (delivered.values().map(|d| d - 1).sum(), torn)
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
            "lease = \"2s\"\nbackoff_initial = \"20ms\"\nbackoff_max = \"500ms\"",
        ),
    )
    .unwrap();

    let bound = Duration::from_secs(60 + n as u64 / 20);
    let report = tokio::task::spawn_blocking({
        let dir = dir.path().to_path_buf();
        move || {
            let faults = Faults {
                env: &|_| vec![],
                kill_probability: 1.0,
                tick: &mut |_| {},
            };
            run_with_faults(&dir, hosts, seconds, bound, faults)
        }
    })
    .await
    .unwrap();

    // The audit: the file itself, read with rusqlite.
    let c = rusqlite::Connection::open_with_flags(&db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
    let count = |sql: &str| -> i64 { c.query_row(sql, [], |r| r.get(0)).unwrap() };
    assert_eq!(count("SELECT COUNT(*) FROM onceq_messages"), 0, "every queue drained (outbox too)");
    Verdict::new(
        n,
        count("SELECT COUNT(*) FROM orders"),
        count("SELECT COUNT(*) FROM onceq_dead_letters WHERE reason NOT LIKE '%amount must be positive%'"),
        count("SELECT SUM(balance) FROM accounts"),
        count("SELECT COALESCE(SUM(amount), 0) FROM orders WHERE status = 'charged'"),
    )
    .check("SQLite", &report);
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
    let (repeats, torn) = audit_deliveries(&dir.path().join("charges.jsonl"), &charged);
    eprintln!(
        "chaos (SQLite): {n} messages, {hosts} hosts, {} SIGKILLs in {:.0?}; drained {:.1?} after the faults stopped; \
         {} orders charged, {invalid} dead-lettered; {repeats} repeated deliveries (at least once, each with its key), {torn} torn lines",
        report.kills,
        report.fault_phase,
        report.drain,
        charged.len()
    );
}

/// The same on the Spanner emulator, each host behind its own fault proxy
/// that switches at random, per tick, between passing, cutting connections
/// mid-response (commits with an unknown outcome) and silencing them
/// (half-open connections), while hosts are SIGKILLed; the emulator itself
/// runs one read-write transaction at a time. Audited with Google's client
/// directly, not through onceq's store code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_hosts_behind_fault_proxies_and_killed_process_each_message_exactly_once() {
    use common::proxy::Proxy;
    use common::spanner::{spanner_db, Audit};
    use std::sync::atomic::Ordering::Relaxed;
    let n = setting("ONCEQ_CHAOS_SPANNER_MESSAGES", 120) as usize;
    let seconds = setting("ONCEQ_CHAOS_SPANNER_SECONDS", 20);
    let hosts = setting("ONCEQ_CHAOS_HOSTS", 3) as usize;
    let (store, database) = spanner_db(PAYMENTS_SPANNER_SQL, StoreOptions::default()).await;
    seed_accounts(store.as_ref(), ACCOUNTS, BALANCE).await;
    send_chaos_orders(store.as_ref(), n).await;
    drop(store);
    let emulator: std::net::SocketAddr = std::env::var("SPANNER_EMULATOR_HOST").unwrap().parse().unwrap();
    let mut proxies = Vec::new();
    for i in 0..hosts {
        proxies.push(Proxy::start(emulator, 0.2, 7 + i as u64).await);
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("onceq.toml"),
        payments_hosts_config(
            &format!("store = \"spanner://{database}\"\n\n[spanner]\nshards = 4\nclients = 2\ncall_timeout = \"2s\""),
            "lease = \"3s\"\nbackoff_initial = \"20ms\"\nbackoff_max = \"500ms\"",
        ),
    )
    .unwrap();

    let addrs: Vec<String> = proxies.iter().map(|p| p.addr.to_string()).collect();
    let switches: Vec<_> = proxies.iter().map(|p| (p.enabled.clone(), p.blackhole.clone())).collect();
    let bound = Duration::from_secs(120 + n as u64 / 2);
    let report = tokio::task::spawn_blocking({
        let dir = dir.path().to_path_buf();
        move || {
            let mut rng = rand::rng();
            let env = move |i: usize| vec![("SPANNER_EMULATOR_HOST", addrs[i].clone())];
            let mut tick = |faults_on: bool| {
                for (cut, silence) in &switches {
                    let roll: f64 = if faults_on { rng.random() } else { 0.0 };
                    // pass 60%, cut connections mid-response 25%, silence 15%
                    cut.store((0.6..0.85).contains(&roll), Relaxed);
                    silence.store(roll >= 0.85, Relaxed);
                }
            };
            let faults = Faults {
                env: &env,
                kill_probability: 0.3,
                tick: &mut tick,
            };
            run_with_faults(&dir, hosts, seconds, bound, faults)
        }
    })
    .await
    .unwrap();

    let db = Audit::new(&database).await;
    assert_eq!(
        db.int("SELECT COUNT(*) FROM onceq_messages").await,
        0,
        "every queue drained (outbox too)"
    );
    Verdict::new(
        n,
        db.int("SELECT COUNT(*) FROM orders").await,
        db.int("SELECT COUNT(*) FROM onceq_dead_letters WHERE reason NOT LIKE '%amount must be positive%'")
            .await,
        db.int("SELECT SUM(balance) FROM accounts").await,
        db.int("SELECT COALESCE(SUM(amount), 0) FROM orders WHERE status = 'charged'").await,
    )
    .check("Spanner emulator", &report);
    let invalid = (0..n).filter(|&i| is_invalid(i)).count() as i64;
    assert_eq!(
        db.int("SELECT COUNT(*) FROM orders").await,
        n as i64 - invalid,
        "one order row per valid order"
    );
    assert_eq!(
        db.int("SELECT COUNT(*) FROM onceq_dead_letters").await,
        invalid,
        "only the invalid orders dead-lettered"
    );
    assert_eq!(
        db.int("SELECT COUNT(*) FROM onceq_dead_letters WHERE reason NOT LIKE '%amount must be positive%'")
            .await,
        0,
        "each dead letter carries its reason"
    );
    let charged_sum = db.int("SELECT COALESCE(SUM(amount), 0) FROM orders WHERE status = 'charged'").await;
    let balances = db.int("SELECT SUM(balance) FROM accounts").await;
    assert_eq!(
        balances + charged_sum,
        ACCOUNTS as i64 * BALANCE,
        "every debit applied exactly once"
    );
    let charged: BTreeSet<String> = db
        .strings("SELECT CONCAT('charge-', id) FROM orders WHERE status = 'charged'")
        .await
        .into_iter()
        .collect();
    let (repeats, torn) = audit_deliveries(&dir.path().join("charges.jsonl"), &charged);
    let cuts: u64 = proxies.iter().map(|p| p.cuts.load(Relaxed)).sum();
    let silenced: u64 = proxies.iter().map(|p| p.silenced.load(Relaxed)).sum();
    eprintln!(
        "chaos (Spanner emulator): {n} messages, {hosts} hosts, {} SIGKILLs, {cuts} connections cut and {silenced} silenced in {:.0?}; \
         drained {:.1?} after the faults stopped; {} orders charged, {invalid} dead-lettered; {repeats} repeated deliveries, {torn} torn lines",
        report.kills,
        report.fault_phase,
        report.drain,
        charged.len()
    );
}
