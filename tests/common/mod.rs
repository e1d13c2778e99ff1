//! Shared test helpers: real SQLite files in temp folders, built guest
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! components, runners, and waiting on conditions (never on fixed sleeps).
#![allow(dead_code)]

use onceq::protocol::{EffectLimits, Grants, Handler, Policy, QueueRunner, QueueSpec};
use onceq::runtime::{HandlerLimits, Runtime, RuntimeConfig, WasmHandler};
use onceq::store::sqlite::SqliteStore;
use onceq::store::{SendParams, Store, StoreOptions};
use onceq::value::{Row, Value};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub mod conformance;
pub mod grpc_proxy;
pub mod host;
pub mod http;
pub mod otlp;
pub mod proxy;
pub mod spanner;

pub const PAYMENTS_SQL: &str = include_str!("../../guest-examples/payments/schema.sql");
pub const INVENTORY_SQL: &str = include_str!("../../guest-examples/inventory/schema.sql");
pub const CHAOS_SQL: &str = "
CREATE TABLE chaos_log (id TEXT PRIMARY KEY, note TEXT, n INTEGER, data BLOB);
CREATE TABLE secrets (id TEXT PRIMARY KEY, note TEXT, n INTEGER, data BLOB);
";

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("host/ has a parent")
        .to_path_buf()
}

/// A built guest component (`make guests` builds them).
pub fn guest(name: &str) -> PathBuf {
    let p = repo_root()
        .join("guest-examples/target/wasm32-wasip2/release")
        .join(format!("{name}.wasm"));
    assert!(p.exists(), "{} is missing: run `make guests` first", p.display());
    p
}

/// Default store options, with `ONCEQ_TEST_MAX_BATCH` applied.
pub fn test_store_options() -> StoreOptions {
    let mut o = StoreOptions::default();
    if let Some(n) = std::env::var("ONCEQ_TEST_MAX_BATCH").ok().and_then(|v| v.parse().ok()) {
        o.commit.max_batch = n;
    }
    o
}

/// A fresh SQLite database file (WAL) with the given business schema.
pub struct TestDb {
    pub dir: tempfile::TempDir,
    pub path: PathBuf,
    pub store: Arc<dyn Store>,
}

impl TestDb {
    /// A database with the default options, but for `commit.max_batch`,
    /// taken from `ONCEQ_TEST_MAX_BATCH` when set (`make test` runs the
    /// exactly-once and outbox tests again with 1: every message alone).
    pub fn new(ddl: &str) -> TestDb {
        Self::with_options(ddl, test_store_options())
    }

    pub fn with_options(ddl: &str, options: StoreOptions) -> TestDb {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("test.db");
        let store: Arc<dyn Store> = Arc::new(SqliteStore::init(&path, ddl, &options).expect("init store"));
        TestDb { dir, path, store }
    }

    /// A plain rusqlite connection to the same file, for assertions.
    pub fn sql(&self) -> rusqlite::Connection {
        rusqlite::Connection::open(&self.path).expect("open db")
    }

    pub fn count(&self, sql: &str) -> i64 {
        self.sql().query_row(sql, [], |r| r.get(0)).expect(sql)
    }

    pub async fn send(&self, queue: &str, payloads: impl IntoIterator<Item = String>) {
        let msgs: Vec<SendParams> = payloads
            .into_iter()
            .map(|p| SendParams {
                queue: queue.into(),
                payload: p.into_bytes(),
                ..Default::default()
            })
            .collect();
        for chunk in msgs.chunks(500) {
            self.store.message_send(chunk.to_vec()).await.expect("send");
        }
    }

    pub async fn rows(&self, table: &str) -> Vec<Row> {
        self.store.table_rows(table).await.expect("table rows")
    }
}

fn test_runtime_config() -> RuntimeConfig {
    RuntimeConfig {
        max_instances: 64,
        max_memory: 64 << 20,
        ..Default::default()
    }
}

pub fn runtime() -> Runtime {
    Runtime::new(test_runtime_config()).expect("runtime")
}

/// [`runtime`] with the on-disk compiled-component cache the tests share
/// (`target/onceq-test-cache`): the JS and Python components compile once.
pub fn runtime_cached() -> Runtime {
    Runtime::new(RuntimeConfig {
        cache_dir: Some(repo_root().join("target/onceq-test-cache")),
        ..test_runtime_config()
    })
    .expect("runtime")
}

pub fn wasm(runtime: &Runtime, name: &str, limits: HandlerLimits) -> WasmHandler {
    runtime.load_file(&guest(name), limits).expect("load guest")
}

pub fn grants(tables: &[&str], queues: &[&str], connectors: &[&str]) -> Grants {
    Grants {
        tables: tables.iter().map(|s| s.to_string()).collect(),
        queues: queues.iter().map(|s| s.to_string()).collect(),
        connectors: connectors.iter().map(|s| s.to_string()).collect(),
    }
}

/// A fast policy for tests: short backoff, small batches; re-runs and
/// deliveries bounded as by default.
pub fn policy(workers: usize, max_attempts: u32) -> Policy {
    Policy {
        lease: Duration::from_secs(10),
        max_attempts,
        backoff_initial: Duration::from_millis(5),
        backoff_max: Duration::from_millis(50),
        workers,
        batch: 8,
        poll_max: Duration::from_millis(20),
        ..Policy::default()
    }
}

pub fn runner(store: &Arc<dyn Store>, queue: &str, handler: Arc<dyn Handler>, grants: Grants, policy: Policy) -> Arc<QueueRunner> {
    Arc::new(QueueRunner::new(
        QueueSpec {
            name: queue.into(),
            handler,
            grants,
            limits: EffectLimits::default(),
            policy,
        },
        store.clone(),
    ))
}

/// The `payments` example on `store`, granted its tables and the `charge`
/// connector.
pub fn payments_runner(store: &Arc<dyn Store>, rt: &Runtime, policy: Policy) -> Arc<QueueRunner> {
    runner(
        store,
        "payments",
        Arc::new(wasm(rt, "payments", HandlerLimits::default())),
        grants(&["accounts", "orders"], &[], &["charge"]),
        policy,
    )
}

/// The `onceq` binary, run in `dir` (killed if the test drops it).
pub fn onceq_command(dir: &Path, args: &[&str]) -> tokio::process::Command {
    let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_onceq"));
    c.current_dir(dir).args(args).env("RUST_LOG", "warn").kill_on_drop(true);
    c
}

/// Outbox settings for tests: short backoff, short leases.
pub fn fast_outbox() -> onceq::outbox::OutboxSettings {
    onceq::outbox::OutboxSettings {
        workers: Some(2),
        batch: 4,
        lease: Duration::from_secs(5),
        max_attempts: 10,
        backoff_initial: Duration::from_millis(20),
        backoff_max: Duration::from_millis(200),
        retention: Duration::from_secs(3600),
    }
}

/// A dispatcher for `connector`'s outbox queue, delivering to a JSON-lines
/// file.
pub fn file_dispatcher(store: &Arc<dyn Store>, connector: &str, path: &Path) -> Arc<QueueRunner> {
    let c = onceq::outbox::ConnectorConfig::File { path: path.to_path_buf() }
        .build(connector)
        .unwrap();
    Arc::new(onceq::outbox::runner(store.clone(), connector, c, &fast_outbox()))
}

/// The lines of a `file` connector's output, parsed.
pub fn file_lines(path: &Path) -> Vec<serde_json::Value> {
    match std::fs::read_to_string(path) {
        Ok(t) => t.lines().map(|l| serde_json::from_str(l).unwrap()).collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => vec![],
        Err(e) => panic!("reading {}: {e}", path.display()),
    }
}

/// Run the runners until their queues are drained (60 s at most).
pub async fn drain(store: &Arc<dyn Store>, runners: &[Arc<QueueRunner>]) {
    drain_within(store, runners, Duration::from_secs(60)).await
}

/// Run the runners until their queues are drained, failing after `limit`.
pub async fn drain_within(store: &Arc<dyn Store>, runners: &[Arc<QueueRunner>], limit: Duration) {
    let (stop, _) = onceq::shutdown::channel();
    let run = onceq::host::Host::of(store.clone(), runners.to_vec()).run(stop, true, limit);
    let started = Instant::now();
    tokio::time::timeout(limit, run)
        .await
        .unwrap_or_else(|_| panic!("queues did not drain within {limit:?}"));
    eprintln!("drained in {:.1?}", started.elapsed());
}

/// Poll `cond` until it holds (or fail after `timeout`).
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !cond().await {
        assert!(start.elapsed() < timeout, "timed out after {timeout:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub fn col<'a>(row: &'a Row, name: &str) -> &'a Value {
    &row.iter().find(|(k, _)| k == name).unwrap_or_else(|| panic!("no column {name}")).1
}

/// Seed `n` accounts with `balance` each through the store.
pub async fn seed_accounts(store: &dyn Store, n: usize, balance: i64) {
    let schema = store.schema();
    let table = schema.table("accounts").unwrap();
    let mut tx = store.transaction_begin().await.unwrap();
    for i in 0..n {
        let w = onceq::value::RowWrite {
            table: "accounts".into(),
            op: onceq::value::WriteOp::Insert,
            columns: vec![
                ("id".into(), Value::String(format!("acct-{i}"))),
                ("balance".into(), Value::Int64(balance)),
            ],
        };
        tx.row_write(table.check_write(&w).unwrap());
    }
    tx.commit().await.unwrap();
}

/// `onceq.toml` for `onceq run` hosts serving the payments example (two
/// workers in batches of 8; charge intents delivered to `charges.jsonl`; an
/// admin API on a free port). `head` is the store and its sections,
/// `defaults` the body of `[defaults]`.
pub fn payments_hosts_config(head: &str, defaults: &str) -> String {
    format!(
        r#"{head}

[defaults]
{defaults}

[[queue]]
name = "payments"
handler = "{}"
tables = ["accounts", "orders"]
connectors = ["charge"]
workers = 2
batch = 8

# Every host also delivers the charge intents, to one file.
[[connector]]
name = "charge"
kind = "file"
path = "charges.jsonl"

[outbox]
workers = 1
backoff_initial = "20ms"

[admin]
listen = "127.0.0.1:0"
"#,
        guest("payments").display()
    )
}

pub fn order(id: usize, account: usize, amount: i64) -> String {
    serde_json::json!({ "order_id": format!("o-{id}"), "account": format!("acct-{account}"), "amount": amount }).to_string()
}

pub fn chaos(action: &str) -> String {
    serde_json::json!({ "do": action }).to_string()
}

pub const PAYMENTS_SPANNER_SQL: &str = include_str!("../../guest-examples/payments/schema.spanner.sql");

fn int_col(row: &Row, name: &str) -> i64 {
    match col(row, name) {
        Value::Int64(i) => *i,
        other => panic!("column {name}: expected int64, got {other:?}"),
    }
}

fn str_col<'a>(row: &'a Row, name: &str) -> &'a str {
    match col(row, name) {
        Value::String(s) => s,
        other => panic!("column {name}: expected string, got {other:?}"),
    }
}

/// The payments invariants through the `Store` trait (any backend): the
/// queue drained, each order row exactly once, money conserved, one charge
/// intent per charged order, keyed by its order id (waiting in the outbox).
pub async fn check_payments_exactly_once(store: &dyn Store, n: usize, accounts: usize, balance: i64) {
    check_payments(store, n, accounts, balance, None).await
}

/// [`check_payments_exactly_once`], with the charges delivered by a `file`
/// connector to `delivered` instead of waiting in the outbox.
pub async fn check_payments(store: &dyn Store, n: usize, accounts: usize, balance: i64, delivered: Option<&Path>) {
    let stats = store.stats().await.unwrap();
    let left: u64 = stats
        .queues
        .iter()
        .filter(|q| onceq::outbox::connector_of(&q.queue).is_none())
        .map(|q| q.ready + q.leased + q.delayed)
        .sum();
    assert_eq!(left, 0, "queue drained: {stats:?}");
    assert_eq!(stats.queues.iter().map(|q| q.dead).sum::<u64>(), 0, "nothing dead-lettered");
    let orders = store.table_rows("orders").await.unwrap();
    assert_eq!(orders.len(), n, "each order row exactly once");
    let charged: Vec<&Row> = orders.iter().filter(|r| str_col(r, "status") == "charged").collect();
    let charged_sum: i64 = charged.iter().map(|r| int_col(r, "amount")).sum();
    let balances: i64 = store
        .table_rows("accounts")
        .await
        .unwrap()
        .iter()
        .map(|r| int_col(r, "balance"))
        .sum();
    assert_eq!(
        balances + charged_sum,
        accounts as i64 * balance,
        "every debit applied exactly once"
    );
    let keys: std::collections::BTreeSet<String> = match delivered {
        None => {
            let intents = onceq::outbox::inspect::list(store, Some("charge"), false, usize::MAX >> 2)
                .await
                .unwrap();
            assert_eq!(intents.len(), charged.len(), "one charge intent per charged order");
            intents.iter().map(|i| i.intent.idempotency_key.clone()).collect()
        }
        Some(path) => {
            let keys: std::collections::BTreeSet<String> = file_lines(path)
                .iter()
                .map(|l| l["idempotency_key"].as_str().unwrap().to_string())
                .collect();
            assert_eq!(keys.len(), charged.len(), "one charge delivered per charged order");
            keys
        }
    };
    for r in &charged {
        assert!(
            keys.contains(&format!("charge-{}", str_col(r, "id"))),
            "intent keyed by order {}",
            str_col(r, "id")
        );
    }
}

/// Send `n` payment orders over `accounts` accounts.
pub async fn send_orders(store: &dyn Store, n: usize, accounts: usize) {
    let msgs: Vec<SendParams> = (0..n)
        .map(|i| SendParams {
            queue: "payments".into(),
            payload: order(i, i % accounts, 1 + (i as i64 % 50)).into_bytes(),
            ..Default::default()
        })
        .collect();
    for chunk in msgs.chunks(200) {
        store.message_send(chunk.to_vec()).await.unwrap();
    }
}

/// The files under `dir` (recursively) whose extension is `ext`, sorted.
pub fn files_with_extension(dir: &Path, ext: &str) -> Vec<PathBuf> {
    fn walk(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, ext, out);
            } else if p.extension().is_some_and(|x| x == ext) {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, ext, &mut out);
    out.sort();
    out
}
