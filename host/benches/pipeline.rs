//! `make bench`: one run, side by side, on this machine.
//!
//! 1. dispatch: fresh instance + `handle` of the `payments` guest, reads
//!    served from memory (the per-message cost of the sandbox alone);
//! 2. the full pipeline on a SQLite file with the Wasm `payments` handler;
//! 3. the same pipeline with the same logic as a native Rust handler
//!    (Wasm/native = the sandbox's overhead);
//! 4. a raw rusqlite loop doing the same lease, read, writes, outbox message
//!    and delete per transaction with the same durability (onceq/raw = our
//!    distance to the physical limit).
//!
//! Ratios are what to compare: the machine is small and noisy.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use async_trait::async_trait;
use onceq::protocol::{
    EffectLimits, Grants, HandleOutput, Handler, HandlerFailure, NativeHandler, Policy, QueueRunner, QueueSpec, ReadScope,
};
use onceq::runtime::{HandlerLimits, Runtime, RuntimeConfig, WasmHandler};
use onceq::schema::{Schema, TableSchema, ValidWrite};
use onceq::store::sqlite::SqliteStore;
use onceq::store::{
    commit, DeadLetter, DeadLetterParams, DedupKey, LeaseParams, LeasedMessage, QueuedMessage, Queues, RetryParams, SendOutcome, Stats,
};
use onceq::store::{Lease, SendParams, Store, StoreOptions, StoreResult, Transaction};
use onceq::value::{Effect, Intent, Message, Row, RowWrite, Value, WriteOp};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "pipeline/console.rs"]
mod console;
#[path = "pipeline/history.rs"]
mod history;
#[path = "pipeline/telemetry.rs"]
mod telemetry;

const PAYMENTS_SQL: &str = include_str!("../../guest-examples/payments/schema.sql");
const ACCOUNTS: usize = 1000;

fn env_usize(k: &str, d: usize) -> usize {
    std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d)
}

fn quantile(v: &mut [u64], q: f64) -> u64 {
    v.sort_unstable();
    v[((v.len() as f64 - 1.0) * q) as usize]
}

/// A transaction that serves one account row from memory.
struct MemTx;

#[async_trait]
impl Transaction for MemTx {
    async fn row_get(&mut self, _t: &TableSchema, key: &[Value]) -> StoreResult<Option<Row>> {
        Ok(Some(vec![
            ("id".into(), key[0].clone()),
            ("balance".into(), Value::Int64(1_000_000)),
            ("updated_at".into(), Value::Null),
        ]))
    }
    async fn row_scan(&mut self, _t: &TableSchema, _p: &[Value], _l: usize) -> StoreResult<Vec<Row>> {
        Ok(vec![])
    }
    fn row_write(&mut self, _w: ValidWrite) {}
    fn message_enqueue(&mut self, _p: SendParams) {}
    fn dedup_hold(&mut self, _q: &str, _k: &str, _w: std::time::Duration) {}
    fn message_ack(&mut self, _l: &Lease) {}
    async fn commit(self: Box<Self>) -> StoreResult<()> {
        Ok(())
    }
    async fn commit_held(self: Box<Self>, _hold: onceq::store::commit::Hold) -> StoreResult<()> {
        Ok(())
    }
    async fn rollback(self: Box<Self>) {}
    async fn rehearse(self: Box<Self>) -> Option<StoreResult<()>> {
        None
    }
}

fn order_payload(i: usize) -> Vec<u8> {
    serde_json::json!({ "order_id": format!("o-{i}"), "account": format!("acct-{}", i % ACCOUNTS), "amount": 1 + (i % 50) as i64 })
        .to_string()
        .into_bytes()
}

async fn dispatch(handler: &dyn Handler, schema: Arc<Schema>, n: usize) -> (u64, u64) {
    let (d50, d99, _) = dispatch_counted(handler, schema, n).await;
    (d50, d99)
}

/// [`dispatch`], also giving the median instructions per call (0 when
/// the engine does not count them).
async fn dispatch_counted(handler: &dyn Handler, schema: Arc<Schema>, n: usize) -> (u64, u64, u64) {
    let tables: Arc<std::collections::BTreeSet<String>> = Arc::new(["accounts".to_string(), "orders".to_string()].into_iter().collect());
    let mut times = Vec::with_capacity(n);
    let mut counted = Vec::with_capacity(n);
    for i in 0..n {
        let msg = Message {
            id: format!("{i:032x}"),
            queue: "payments".into(),
            payload: order_payload(i),
            attributes: vec![],
            attempt: 1,
            enqueued_at: 1,
        };
        let scope = ReadScope::new(Box::new(MemTx), schema.clone(), tables.clone());
        let t = Instant::now();
        let out = handler.handle(&msg, scope).await;
        times.push(t.elapsed().as_nanos() as u64);
        assert!(out.result.is_ok(), "{:?}", out.result.err());
        counted.push(out.scope.instructions.unwrap_or(0));
    }
    (quantile(&mut times, 0.5), quantile(&mut times, 0.99), quantile(&mut counted, 0.5))
}

/// The payments logic as a native handler (same reads, same effects).
fn native_payments() -> NativeHandler {
    NativeHandler::new("native", |msg, mut scope: ReadScope| async move {
        let v: serde_json::Value = match serde_json::from_slice(&msg.payload) {
            Ok(v) => v,
            Err(e) => {
                return HandleOutput {
                    scope,
                    result: Err(HandlerFailure::Reject(e.to_string())),
                }
            }
        };
        let (order, account, amount) = (
            v["order_id"].as_str().unwrap_or("").to_string(),
            v["account"].as_str().unwrap_or("").to_string(),
            v["amount"].as_i64().unwrap_or(0),
        );
        let balance = match scope.get("accounts", &[Value::String(account.clone())]).await {
            Ok(Some(row)) => match &row[1].1 {
                Value::Int64(b) => *b,
                _ => 0,
            },
            Ok(None) => {
                return HandleOutput {
                    scope,
                    result: Err(HandlerFailure::Reject("unknown account".into())),
                }
            }
            Err(e) => {
                return HandleOutput {
                    scope,
                    result: Err(HandlerFailure::Crash(e.to_string())),
                }
            }
        };
        let now = Value::Timestamp(msg.enqueued_at);
        let effects = vec![
            Effect::Write(RowWrite {
                table: "orders".into(),
                op: WriteOp::Insert,
                columns: vec![
                    ("id".into(), Value::String(order.clone())),
                    ("account_id".into(), Value::String(account.clone())),
                    ("amount".into(), Value::Int64(amount)),
                    ("status".into(), Value::String("charged".into())),
                    ("created_at".into(), now.clone()),
                ],
            }),
            Effect::Write(RowWrite {
                table: "accounts".into(),
                op: WriteOp::Update,
                columns: vec![
                    ("id".into(), Value::String(account.clone())),
                    ("balance".into(), Value::Int64(balance - amount)),
                    ("updated_at".into(), now),
                ],
            }),
            Effect::Intent(Intent {
                connector: "charge".into(),
                idempotency_key: format!("charge-{order}"),
                payload: serde_json::json!({"order_id": order, "account": account, "amount": amount})
                    .to_string()
                    .into_bytes(),
                metadata: vec![],
            }),
        ];
        HandleOutput {
            scope,
            result: Ok(effects),
        }
    })
}

fn fresh_db(dir: &Path, name: &str) -> (Arc<dyn Store>, std::path::PathBuf) {
    fresh_db_with(dir, name, StoreOptions::default())
}

fn fresh_db_with(dir: &Path, name: &str, options: StoreOptions) -> (Arc<dyn Store>, std::path::PathBuf) {
    let path = dir.join(name);
    let mut ddl = PAYMENTS_SQL.to_string();
    for i in 0..ACCOUNTS {
        ddl.push_str(&format!("INSERT INTO accounts (id, balance) VALUES ('acct-{i}', 100000000);\n"));
    }
    (Arc::new(SqliteStore::init(&path, &ddl, &options).unwrap()), path)
}

struct Run {
    msgs_per_s: f64,
    p50_us: u64,
    p99_us: u64,
    /// Messages per database commit (group commit's batch size on
    /// average; what a raw loop commits at once).
    per_commit: f64,
}

/// The faster of two runs of one configuration (rounds interleave
/// configurations; each keeps its best).
fn best(a: Option<Run>, b: Run) -> Option<Run> {
    match a {
        Some(a) if a.msgs_per_s >= b.msgs_per_s => Some(a),
        _ => Some(b),
    }
}

/// A Markdown table row: throughput and latency quantiles.
fn row(name: &str, r: &Run) {
    println!(
        "| {name} | {:.0} | {:.2} ms | {:.2} ms |",
        r.msgs_per_s,
        r.p50_us as f64 / 1000.0,
        r.p99_us as f64 / 1000.0
    )
}

/// A row with the messages per commit.
fn row_per_commit(name: &str, r: &Run) {
    println!(
        "| {name} | {:.0} | {:.2} ms | {:.2} ms | {:.1} |",
        r.msgs_per_s,
        r.p50_us as f64 / 1000.0,
        r.p99_us as f64 / 1000.0,
        r.per_commit
    )
}

async fn pipeline(dir: &Path, name: &str, handler: Arc<dyn Handler>, n: usize, workers: usize) -> Run {
    pipeline_with(dir, name, handler, n, workers, StoreOptions::default()).await
}

async fn pipeline_with(dir: &Path, name: &str, handler: Arc<dyn Handler>, n: usize, workers: usize, options: StoreOptions) -> Run {
    let (store, _) = fresh_db_with(dir, name, options);
    queue_orders(store.as_ref(), n, 1000).await;
    pipeline_on(store, handler, n, workers).await
}

/// At-least-once on the same pipeline, to show what exactly-once costs:
/// the handler's writes, follow-ups and intents commit in one transaction,
/// the ack in a transaction of its own after it (both through the same
/// group commit), as a queue whose ack is not part of the business
/// transaction. A crash between the two would apply the message twice.
struct AckApart(Arc<dyn Store>);

struct AckApartTx {
    store: Arc<dyn Store>,
    inner: Box<dyn Transaction>,
    acks: Vec<Lease>,
}

impl AckApartTx {
    async fn ack(store: &dyn Store, acks: Vec<Lease>) -> StoreResult<()> {
        let mut tx = store.transaction_begin().await?;
        for l in &acks {
            tx.message_ack(l);
        }
        tx.commit().await
    }
}

#[async_trait]
impl Transaction for AckApartTx {
    async fn row_get(&mut self, t: &TableSchema, key: &[Value]) -> StoreResult<Option<Row>> {
        self.inner.row_get(t, key).await
    }
    async fn row_scan(&mut self, t: &TableSchema, prefix: &[Value], limit: usize) -> StoreResult<Vec<Row>> {
        self.inner.row_scan(t, prefix, limit).await
    }
    fn row_write(&mut self, w: ValidWrite) {
        self.inner.row_write(w)
    }
    fn message_enqueue(&mut self, p: SendParams) {
        self.inner.message_enqueue(p)
    }
    fn dedup_hold(&mut self, q: &str, k: &str, w: Duration) {
        self.inner.dedup_hold(q, k, w)
    }
    fn message_ack(&mut self, l: &Lease) {
        self.acks.push(l.clone())
    }
    async fn commit(self: Box<Self>) -> StoreResult<()> {
        self.inner.commit().await?;
        AckApartTx::ack(self.store.as_ref(), self.acks).await
    }
    async fn commit_held(self: Box<Self>, hold: commit::Hold) -> StoreResult<()> {
        self.inner.commit_held(hold).await?;
        AckApartTx::ack(self.store.as_ref(), self.acks).await
    }
    async fn rollback(self: Box<Self>) {
        self.inner.rollback().await
    }
    async fn rehearse(self: Box<Self>) -> Option<StoreResult<()>> {
        self.inner.rehearse().await
    }
}

#[async_trait]
impl Store for AckApart {
    fn kind(&self) -> &'static str {
        self.0.kind()
    }
    fn commit_stats(&self) -> Option<commit::CommitStats> {
        self.0.commit_stats()
    }
    fn handoff(&self) -> bool {
        self.0.handoff()
    }
    fn schema(&self) -> Arc<Schema> {
        self.0.schema()
    }
    async fn message_send(&self, p: Vec<SendParams>) -> StoreResult<Vec<SendOutcome>> {
        self.0.message_send(p).await
    }
    async fn message_lease(&self, p: LeaseParams) -> StoreResult<Vec<LeasedMessage>> {
        self.0.message_lease(p).await
    }
    async fn message_lease_collected(
        &self,
        queue: &str,
        lease: Duration,
        collect: &(dyn Fn() -> usize + Send + Sync),
    ) -> StoreResult<Vec<LeasedMessage>> {
        self.0.message_lease_collected(queue, lease, collect).await
    }
    async fn message_lease_renew(&self, leases: &[Lease], d: Duration) -> StoreResult<Vec<bool>> {
        self.0.message_lease_renew(leases, d).await
    }
    async fn message_release(&self, l: &Lease) -> StoreResult<()> {
        self.0.message_release(l).await
    }
    async fn message_retry_later(&self, l: &Lease, p: RetryParams) -> StoreResult<()> {
        self.0.message_retry_later(l, p).await
    }
    async fn message_dead_letter(&self, l: &Lease, p: DeadLetterParams) -> StoreResult<()> {
        self.0.message_dead_letter(l, p).await
    }
    async fn transaction_begin(&self) -> StoreResult<Box<dyn Transaction>> {
        Ok(Box::new(AckApartTx {
            store: self.0.clone(),
            inner: self.0.transaction_begin().await?,
            acks: Vec::new(),
        }))
    }
    async fn commit_hold(&self) -> StoreResult<Option<commit::Hold>> {
        self.0.commit_hold().await
    }
    async fn stats(&self) -> StoreResult<Stats> {
        self.0.stats().await
    }
    async fn close(&self) {
        self.0.close().await
    }
    async fn dead_letter_list(&self, q: Queues<'_>, limit: usize) -> StoreResult<Vec<DeadLetter>> {
        self.0.dead_letter_list(q, limit).await
    }
    async fn dead_letter_get(&self, id: &str) -> StoreResult<Option<DeadLetter>> {
        self.0.dead_letter_get(id).await
    }
    async fn dead_letter_replay(&self, id: &str) -> StoreResult<Option<String>> {
        self.0.dead_letter_replay(id).await
    }
    async fn dead_letter_settle(
        &self,
        id: &str,
        how: onceq::store::Settle,
        audit: Option<&onceq::store::AuditEntry>,
    ) -> StoreResult<Option<String>> {
        self.0.dead_letter_settle(id, how, audit).await
    }
    async fn audit_append(&self, entry: &onceq::store::AuditEntry) -> StoreResult<()> {
        self.0.audit_append(entry).await
    }
    async fn audit_list(&self, queues: Queues<'_>, limit: usize) -> StoreResult<Vec<onceq::store::AuditEntry>> {
        self.0.audit_list(queues, limit).await
    }
    async fn audit_prune(&self, age: Duration) -> StoreResult<u64> {
        self.0.audit_prune(age).await
    }
    async fn message_list(&self, q: Queues<'_>, limit: usize) -> StoreResult<Vec<QueuedMessage>> {
        self.0.message_list(q, limit).await
    }
    async fn message_get(&self, id: &str) -> StoreResult<Option<QueuedMessage>> {
        self.0.message_get(id).await
    }
    async fn message_browse(
        &self,
        queue: &str,
        state: onceq::store::LiveState,
        after: Option<&onceq::store::BrowseKey>,
        limit: usize,
    ) -> StoreResult<Vec<QueuedMessage>> {
        self.0.message_browse(queue, state, after, limit).await
    }
    async fn dead_letter_browse(&self, queue: &str, after: Option<&onceq::store::BrowseKey>, limit: usize) -> StoreResult<Vec<DeadLetter>> {
        self.0.dead_letter_browse(queue, after, limit).await
    }
    async fn queue_pause(&self, queue: &str, pause: bool, audit: Option<&onceq::store::AuditEntry>) -> StoreResult<bool> {
        self.0.queue_pause(queue, pause, audit).await
    }
    async fn queue_paused(&self) -> StoreResult<Vec<onceq::store::PausedQueue>> {
        self.0.queue_paused().await
    }
    async fn host_beat(&self, beat: &onceq::store::HostBeat) -> StoreResult<()> {
        self.0.host_beat(beat).await
    }
    async fn hosts_prune(&self, age: Duration) -> StoreResult<u64> {
        self.0.hosts_prune(age).await
    }
    async fn hosts_seen(&self, within: Duration) -> StoreResult<Vec<onceq::store::HostBeat>> {
        self.0.hosts_seen(within).await
    }
    async fn table_rows(&self, table: &str) -> StoreResult<Vec<Row>> {
        self.0.table_rows(table).await
    }
    async fn dedup_purge(&self) -> StoreResult<u64> {
        self.0.dedup_purge().await
    }
    async fn dedup_list(&self, q: Queues<'_>, within: Duration, limit: usize) -> StoreResult<Vec<DedupKey>> {
        self.0.dedup_list(q, within, limit).await
    }
}

/// The group-commit pipeline at `workers`, at-least-once ([`AckApart`]).
async fn at_least_once(dir: &Path, name: &str, handler: Arc<dyn Handler>, n: usize, workers: usize) -> Run {
    let (store, _) = fresh_db(dir, name);
    queue_orders(store.as_ref(), n, 1000).await;
    pipeline_on(Arc::new(AckApart(store)), handler, n, workers).await
}

/// Queue `n` payments orders, `per_send` to a send.
async fn queue_orders(store: &dyn Store, n: usize, per_send: usize) {
    let msgs: Vec<SendParams> = (0..n)
        .map(|i| SendParams {
            queue: "payments".into(),
            payload: order_payload(i),
            ..Default::default()
        })
        .collect();
    for c in msgs.chunks(per_send) {
        store.message_send(c.to_vec()).await.unwrap();
    }
}

/// The physical limit: the same statements in a plain rusqlite loop, one
/// commit per message.
fn raw_sqlite(dir: &Path, name: &str, n: usize) -> Run {
    raw_sqlite_batched(dir, name, n, 1)
}

/// The same loop committing every `per_commit` messages, a savepoint per
/// message (what group commit does), when `per_commit` > 1.
fn raw_sqlite_batched(dir: &Path, name: &str, n: usize, per_commit: usize) -> Run {
    raw_sqlite_full(dir, name, n, per_commit, None).0
}

/// Bytes this process has passed to `write(2)` and its kin so far
/// (`/proc/PID/io`'s `wchar`): SQLite's WAL frames, its checkpoints into
/// the database file, and a file connector's lines. Divided by the page
/// size and the messages, the pages a message costs the disk.
fn written_bytes(pid: u32) -> Option<u64> {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).ok()?;
    io.lines()
        .find_map(|l| l.strip_prefix("wchar:"))
        .and_then(|v| v.trim().parse().ok())
}

/// SQLite's page size: what a WAL frame holds.
const PAGE: f64 = 4096.0;

/// The raw loop with every part of onceq's work: when `deliver` names a
/// file, after each commit the batch's intents are leased from the outbox
/// queue, appended to that file with one `fdatasync`, then deleted and
/// their keys held in one commit (what a file connector's delivery does).
/// Returns the run and the bytes this process wrote during it.
fn raw_sqlite_full(dir: &Path, name: &str, n: usize, per_commit: usize, deliver: Option<&Path>) -> (Run, u64) {
    use rusqlite::params;
    let mut sink = deliver.map(|p| std::fs::OpenOptions::new().create(true).append(true).open(p).unwrap());
    let (store, path) = fresh_db(dir, name);
    drop(store);
    let mut c = rusqlite::Connection::open(&path).unwrap();
    // temp_store as onceq's writer has it: a savepoint per message's
    // sub-journal stays in memory instead of spilling to a file.
    c.execute_batch("PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL; PRAGMA temp_store = MEMORY;")
        .unwrap();
    const NOW: &str = "CAST(unixepoch('subsec') * 1000000 AS INTEGER)";
    {
        let tx = c.transaction().unwrap();
        for i in 0..n {
            tx.execute(
                &format!("INSERT INTO onceq_messages (id, queue, payload, attributes, attempt, enqueued_at, visible_at) VALUES (?1, 'payments', ?2, '[]', 0, {NOW}, {NOW})"),
                params![format!("{i:032x}"), order_payload(i)],
            )
            .unwrap();
        }
        tx.commit().unwrap();
    }
    let mut lat = Vec::with_capacity(n);
    let mut open: Vec<Instant> = Vec::with_capacity(per_commit);
    let written = written_bytes(std::process::id()).unwrap_or(0);
    let t = Instant::now();
    let mut done = 0;
    while done < n {
        let token = format!("{:032x}", rand::random::<u128>());
        let batch: Vec<(String, Vec<u8>)> = {
            let mut s = c
                .prepare_cached(&format!(
                    "UPDATE onceq_messages SET lease_token = ?1, visible_at = {NOW} + 10000000, attempt = attempt + 1
                     WHERE id IN (SELECT id FROM onceq_messages WHERE queue = 'payments' AND visible_at <= {NOW} ORDER BY visible_at LIMIT 16)
                     RETURNING id, payload"
                ))
                .unwrap();
            s.query_map(params![token], |r| Ok((r.get(0)?, r.get(1)?)))
                .unwrap()
                .map(Result::unwrap)
                .collect()
        };
        for (id, payload) in batch {
            let t1 = Instant::now();
            let v: serde_json::Value = serde_json::from_slice(&payload).unwrap();
            let (order, account, amount) = (
                v["order_id"].as_str().unwrap(),
                v["account"].as_str().unwrap(),
                v["amount"].as_i64().unwrap(),
            );
            if open.is_empty() {
                c.execute_batch("BEGIN IMMEDIATE").unwrap();
            }
            if per_commit > 1 {
                c.execute_batch("SAVEPOINT m").unwrap();
            }
            let tx = &c;
            let balance: i64 = tx
                .prepare_cached("SELECT balance FROM accounts WHERE id = ?1")
                .unwrap()
                .query_row(params![account], |r| r.get(0))
                .unwrap();
            tx.prepare_cached("INSERT INTO orders (id, account_id, amount, status, created_at) VALUES (?1, ?2, ?3, 'charged', 1)")
                .unwrap()
                .execute(params![order, account, amount])
                .unwrap();
            tx.prepare_cached("UPDATE accounts SET balance = ?1, updated_at = 1 WHERE id = ?2")
                .unwrap()
                .execute(params![balance - amount, account])
                .unwrap();
            // The outbox: a message on the connector's queue, its key
            // claimed in the dedup table (what onceq writes for an intent).
            // Ordered by creation, as onceq's ids are, after every
            // message id.
            let intent_id = format!("{:032x}", (1u128 << 64) + done as u128);
            let key = format!("charge-{order}");
            let claimed = tx
                .prepare_cached(&format!(
                    "INSERT INTO onceq_dedup (queue, dedup_key, message_id, expires_at) VALUES ('onceq.outbox.charge', ?1, ?2, {NOW} + 3153600000000000)
                     ON CONFLICT (queue, dedup_key) DO NOTHING"
                ))
                .unwrap()
                .execute(params![key, intent_id])
                .unwrap();
            assert_eq!(claimed, 1);
            tx.prepare_cached(&format!(
                "INSERT INTO onceq_messages (id, queue, payload, attributes, attempt, enqueued_at, visible_at)
                 VALUES (?1, 'onceq.outbox.charge', ?2, ?3, 0, {NOW}, {NOW})"
            ))
            .unwrap()
            .execute(params![
                intent_id,
                payload,
                serde_json::json!([["onceq.idempotency-key", key], ["onceq.source-message", id]]).to_string()
            ])
            .unwrap();
            let gone = tx
                .prepare_cached("DELETE FROM onceq_messages WHERE id = ?1 AND lease_token = ?2")
                .unwrap()
                .execute(params![id, token])
                .unwrap();
            assert_eq!(gone, 1);
            if per_commit > 1 {
                c.execute_batch("RELEASE m").unwrap();
            }
            open.push(t1);
            if open.len() == per_commit || done + 1 == n {
                c.execute_batch("COMMIT").unwrap();
                if let Some(sink) = sink.as_mut() {
                    raw_deliver(&mut c, sink, open.len());
                }
                lat.extend(open.drain(..).map(|t| t.elapsed().as_micros() as u64));
            }
            done += 1;
        }
    }
    // Closed, as onceq closes its database: the last checkpoint counts.
    drop(c);
    let written = written_bytes(std::process::id()).unwrap_or(0).saturating_sub(written);
    let secs = t.elapsed().as_secs_f64();
    let run = Run {
        msgs_per_s: n as f64 / secs,
        p50_us: quantile(&mut lat, 0.5),
        p99_us: quantile(&mut lat, 0.99),
        per_commit: per_commit as f64,
    };
    (run, written)
}

/// The raw loop's delivery of up to `n` intents: leased, appended to
/// `sink` with one `fdatasync`, then deleted with their keys held (for
/// the dedup window, here a day) in one commit.
fn raw_deliver(c: &mut rusqlite::Connection, sink: &mut std::fs::File, n: usize) {
    use rusqlite::params;
    use std::io::Write as _;
    const NOW: &str = "CAST(unixepoch('subsec') * 1000000 AS INTEGER)";
    let token = format!("{:032x}", rand::random::<u128>());
    let leased: Vec<(String, Vec<u8>, String)> = {
        let mut s = c
            .prepare_cached(&format!(
                "UPDATE onceq_messages SET lease_token = ?1, visible_at = {NOW} + 30000000, attempt = attempt + 1
                 WHERE id IN (SELECT id FROM onceq_messages WHERE queue = 'onceq.outbox.charge' AND visible_at <= {NOW} ORDER BY visible_at LIMIT {n})
                 RETURNING id, payload, attributes"
            ))
            .unwrap();
        s.query_map(params![token], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    };
    let mut lines = Vec::new();
    let key_of = |attributes: &str| -> String {
        let attrs: Vec<(String, String)> = serde_json::from_str(attributes).unwrap();
        attrs.into_iter().find(|(k, _)| k == "onceq.idempotency-key").unwrap().1
    };
    let keys: Vec<String> = leased.iter().map(|(_, _, attributes)| key_of(attributes)).collect();
    for ((id, payload, _), key) in leased.iter().zip(&keys) {
        lines.extend_from_slice(
            serde_json::json!({"id": id, "key": key, "payload": String::from_utf8_lossy(payload)})
                .to_string()
                .as_bytes(),
        );
        lines.push(b'\n');
    }
    sink.write_all(&lines).unwrap();
    sink.sync_data().unwrap();
    let tx = c.transaction().unwrap();
    for ((id, _, _), key) in leased.iter().zip(&keys) {
        let gone = tx
            .prepare_cached("DELETE FROM onceq_messages WHERE id = ?1 AND lease_token = ?2")
            .unwrap()
            .execute(params![id, token])
            .unwrap();
        assert_eq!(gone, 1);
        tx.prepare_cached(&format!(
            "UPDATE onceq_dedup SET expires_at = {NOW} + 86400000000 WHERE queue = 'onceq.outbox.charge' AND dedup_key = ?1"
        ))
        .unwrap()
        .execute(params![key])
        .unwrap();
    }
    tx.commit().unwrap();
}

/// Spanner (emulator): a hand-written worker with the same client doing the
/// same lease, read, writes, outbox insert and asserted delete, no Wasm.
async fn raw_spanner(database: &str, n: usize) -> Run {
    use google_cloud_spanner::client::Spanner;
    use google_cloud_spanner::mutation::Mutation;
    use google_cloud_spanner::statement::Statement;
    const NOW: &str = "UNIX_MICROS(CURRENT_TIMESTAMP())";
    let spanner = Spanner::builder().build().await.unwrap();
    let client = spanner.database_client(database.to_string()).build().await.unwrap();
    let mut lat = Vec::with_capacity(n);
    let t = Instant::now();
    let mut done = 0;
    while done < n {
        let token = format!("{:032x}", rand::random::<u128>());
        let tk = token.clone();
        let batch: Vec<(i64, String, Vec<u8>)> = client
            .read_write_transaction()
            .build()
            .run(move |tx: google_cloud_spanner::transaction::ReadWriteTransaction| {
                let tk = tk.clone();
                async move {
                    let mut rs = tx
                        .execute_query(Statement::builder(format!(
                            "SELECT shard, id FROM onceq_messages@{{FORCE_INDEX=onceq_messages_visible}} WHERE queue = 'payments' AND visible_at <= {NOW} ORDER BY visible_at LIMIT 16"
                        )).build())
                        .await?;
                    let mut ids = Vec::new();
                    while let Some(r) = rs.next().await {
                        let r = r?;
                        ids.push((r.get::<i64>(0)?, r.get::<String>(1)?));
                    }
                    let mut out = Vec::new();
                    for (shard, id) in ids {
                        let mut rs = tx
                            .execute_query(
                                Statement::builder(format!(
                                    "UPDATE onceq_messages SET lease_token = @t, visible_at = {NOW} + 10000000, attempt = attempt + 1
                                     WHERE shard = @s AND id = @id THEN RETURN payload"
                                ))
                                .add_param("t", tk.clone())
                                .add_param("s", shard)
                                .add_param("id", id.clone())
                                .build(),
                            )
                            .await?;
                        while let Some(r) = rs.next().await {
                            out.push((shard, id.clone(), r?.get::<Vec<u8>>(0)?));
                        }
                    }
                    Ok(out)
                }
            })
            .await
            .unwrap()
            .into_inner();
        for (shard, id, payload) in batch {
            let t1 = Instant::now();
            let v: serde_json::Value = serde_json::from_slice(&payload).unwrap();
            let (order, account, amount) = (
                v["order_id"].as_str().unwrap().to_string(),
                v["account"].as_str().unwrap().to_string(),
                v["amount"].as_i64().unwrap(),
            );
            let balance: i64 = {
                let mut rs = client
                    .single_use()
                    .build()
                    .execute_query(
                        Statement::builder("SELECT balance FROM accounts WHERE id = @a")
                            .add_param("a", account.clone())
                            .build(),
                    )
                    .await
                    .unwrap();
                rs.next().await.unwrap().unwrap().get(0).unwrap()
            };
            let token = token.clone();
            client
                .read_write_transaction()
                .build()
                .run(move |tx: google_cloud_spanner::transaction::ReadWriteTransaction| {
                    let (order, account, id, token, payload) = (order.clone(), account.clone(), id.clone(), token.clone(), payload.clone());
                    async move {
                        let mut rs = tx
                            .execute_query(
                                Statement::builder("SELECT balance FROM accounts WHERE id = @a")
                                    .add_param("a", account.clone())
                                    .build(),
                            )
                            .await?;
                        let now: i64 = rs.next().await.unwrap()?.get(0)?;
                        assert_eq!(now, balance);
                        tx.execute_update(
                            Statement::builder(
                                "DELETE FROM onceq_messages WHERE shard = @s AND id = @id AND lease_token = @t ASSERT_ROWS_MODIFIED 1",
                            )
                            .add_param("s", shard)
                            .add_param("id", id.clone())
                            .add_param("t", token)
                            .build(),
                        )
                        .await?;
                        // The outbox: a message on the connector's queue,
                        // its key claimed in the dedup table.
                        let intent_id = format!("{:032x}", rand::random::<u128>());
                        let key = format!("charge-{order}");
                        tx.execute_update(
                            Statement::builder(format!(
                                "INSERT INTO onceq_dedup (queue, dedup_key, message_id, expires_at)
                                 VALUES ('onceq.outbox.charge', @k, @id, {NOW} + 3153600000000000)"
                            ))
                            .add_param("k", key.clone())
                            .add_param("id", intent_id.clone())
                            .build(),
                        )
                        .await?;
                        tx.execute_update(
                            Statement::builder(format!(
                                "INSERT INTO onceq_messages (shard, id, queue, payload, attributes, attempt, enqueued_at, visible_at)
                                 VALUES (0, @id, 'onceq.outbox.charge', @p, @a, 0, {NOW}, {NOW})"
                            ))
                            .add_param("id", intent_id)
                            .add_param("p", payload)
                            .add_param(
                                "a",
                                serde_json::json!([["onceq.idempotency-key", key], ["onceq.source-message", id]]).to_string(),
                            )
                            .build(),
                        )
                        .await?;
                        tx.buffer([
                            Mutation::new_update_builder("accounts")
                                .set("id")
                                .to(account.clone())
                                .set("balance")
                                .to(balance - amount)
                                .build(),
                            Mutation::new_insert_builder("orders")
                                .set("id")
                                .to(order.clone())
                                .set("account_id")
                                .to(account)
                                .set("amount")
                                .to(amount)
                                .set("status")
                                .to("charged".to_string())
                                .set("created_at")
                                .to(std::time::SystemTime::now())
                                .build(),
                        ])?;
                        Ok(())
                    }
                })
                .await
                .unwrap();
            lat.push(t1.elapsed().as_micros() as u64);
            done += 1;
        }
    }
    let secs = t.elapsed().as_secs_f64();
    Run {
        msgs_per_s: n as f64 / secs,
        p50_us: quantile(&mut lat, 0.5),
        p99_us: quantile(&mut lat, 0.99),
        per_commit: 1.0,
    }
}

/// A fresh emulator database with the payments tables, `n` orders queued.
async fn spanner_db(n: usize) -> (Arc<dyn Store>, String) {
    spanner_db_with(n, StoreOptions::default()).await
}

/// The same with `options` (`commit.max_batch = 1`, say).
async fn spanner_db_with(n: usize, options: StoreOptions) -> (Arc<dyn Store>, String) {
    use onceq::store::spanner::{SpannerOptions, SpannerStore};
    let database = format!("projects/onceq/instances/bench/databases/b{:x}", rand::random::<u32>());
    let ddl = include_str!("../../guest-examples/payments/schema.spanner.sql");
    let opts = SpannerOptions {
        database: database.clone(),
        shards: 8,
        clients: 4,
        exclusive: None,
        call_timeout: StoreOptions::default().spanner_call_timeout,
    };
    let store: Arc<dyn Store> = Arc::new(SpannerStore::init(&opts, ddl, &options).await.unwrap());
    let schema = store.schema();
    let mut tx = store.transaction_begin().await.unwrap();
    for i in 0..ACCOUNTS {
        let w = RowWrite {
            table: "accounts".into(),
            op: WriteOp::Insert,
            columns: vec![
                ("id".into(), Value::String(format!("acct-{i}"))),
                ("balance".into(), Value::Int64(100_000_000)),
            ],
        };
        tx.row_write(schema.table("accounts").unwrap().check_write(&w).unwrap());
    }
    tx.commit().await.unwrap();
    queue_orders(store.as_ref(), n, 200).await;
    (store, database)
}

/// Drain `n` queued payments messages with `workers` workers; every one must be acked.
async fn pipeline_on(store: Arc<dyn Store>, handler: Arc<dyn Handler>, n: usize, workers: usize) -> Run {
    let grants = Grants {
        tables: ["accounts", "orders"].iter().map(|s| s.to_string()).collect(),
        connectors: ["charge".to_string()].into(),
        ..Default::default()
    };
    let policy = Policy {
        workers,
        batch: 16,
        poll_max: Duration::from_millis(5),
        ..Default::default()
    };
    let runner = Arc::new(QueueRunner::new(
        QueueSpec {
            name: "payments".into(),
            handler,
            grants,
            limits: EffectLimits::default(),
            policy,
        },
        store.clone(),
    ));
    let (stop, _) = onceq::shutdown::channel();
    let t = Instant::now();
    onceq::host::Host::of(store.clone(), vec![runner.clone()])
        .run(stop, true, Duration::from_secs(30))
        .await;
    let secs = t.elapsed().as_secs_f64();
    let m = &runner.metrics;
    assert_eq!(
        m.processed.load(std::sync::atomic::Ordering::Relaxed),
        n as u64,
        "every message processed"
    );
    let per_commit = store.commit_stats().map_or(1.0, |s| s.messages as f64 / s.batches.max(1) as f64);
    Run {
        msgs_per_s: n as f64 / secs,
        p50_us: m.latency_quantile(0.5),
        p99_us: m.latency_quantile(0.99),
        per_commit,
    }
}

/// A new engine as a host configures one (`runtime.cache`,
/// `runtime.reset_dirty_pages`), and `path` loaded on it: the load's time
/// in milliseconds, the handler, and the engine (drop it or keep it).
fn load_on_new_engine(path: &Path, cache_dir: Option<&Path>, reset_dirty_pages: bool) -> (f64, WasmHandler, Runtime) {
    load_counting(path, cache_dir, reset_dirty_pages, false)
}

/// [`load_on_new_engine`] on an engine that counts instructions or not
/// (`runtime.count_instructions`).
fn load_counting(path: &Path, cache_dir: Option<&Path>, reset_dirty_pages: bool, count_instructions: bool) -> (f64, WasmHandler, Runtime) {
    let runtime = Runtime::new(RuntimeConfig {
        cache_dir: cache_dir.map(Path::to_path_buf),
        reset_dirty_pages,
        count_instructions,
        ..RuntimeConfig::default()
    })
    .unwrap();
    let t = Instant::now();
    let handler = runtime.load_file(path, HandlerLimits::default()).unwrap();
    (t.elapsed().as_secs_f64() * 1000.0, handler, runtime)
}

/// What counting instructions costs (`runtime.count_instructions`, on by
/// itself when a queue has `max_instructions`): per language, dispatch
/// with and without, the instructions a payments message runs, and the
/// Rust pipeline (1 worker) with and without, interleaved, best of 2.
async fn instruction_counting(root: &Path, component: &Path, dir: &Path, schema: Arc<Schema>, calls: usize) {
    let n = env_usize("ONCEQ_BENCH_LANG_MESSAGES", 2_000);
    let lang_calls = (calls / 10).max(200);
    println!(
        "\n| payments in | instructions per message (median) | dispatch median, not counted | dispatch median, counted | counted / not |"
    );
    println!("|---|---|---|---|---|");
    for (lang, key, path) in payments_components(root, component) {
        if !path.exists() {
            println!("| {lang} | not built ({}) | | | |", path.display());
            continue;
        }
        let cache = dir.join(format!("cache-fuel-{}", lang.len()));
        let (_, off, _e1) = load_counting(&path, Some(&cache), true, false);
        let (_, on, _e2) = load_counting(&path, Some(&cache), true, true);
        let (mut best_off, mut best_on, mut ran) = (u64::MAX, u64::MAX, 0);
        for _ in 0..2 {
            best_off = best_off.min(warm_dispatch(&off, schema.clone(), lang_calls).await.0);
            let _ = dispatch(&on, schema.clone(), lang_calls / 10).await;
            let (d50, _, i50) = dispatch_counted(&on, schema.clone(), lang_calls).await;
            best_on = best_on.min(d50);
            ran = i50;
        }
        println!(
            "| {lang} | {ran} | {:.1} µs | {:.1} µs | {:.2} |",
            best_off as f64 / 1000.0,
            best_on as f64 / 1000.0,
            best_on as f64 / best_off.max(1) as f64
        );
        history::record(&format!("{key}_instructions_per_message"), ran as f64);
        history::record(&format!("{key}_counted_dispatch_ratio"), best_on as f64 / best_off.max(1) as f64);
    }
    let cache = dir.join("cache-fuel-pipeline");
    let (mut off_best, mut on_best): (Option<Run>, Option<Run>) = (None, None);
    for r in 0..2 {
        let (_, off, _e1) = load_counting(component, Some(&cache), true, false);
        off_best = best(off_best, pipeline(dir, &format!("fuel-off-{r}.db"), Arc::new(off), n, 1).await);
        let (_, on, _e2) = load_counting(component, Some(&cache), true, true);
        on_best = best(on_best, pipeline(dir, &format!("fuel-on-{r}.db"), Arc::new(on), n, 1).await);
    }
    if let (Some(off), Some(on)) = (off_best, on_best) {
        println!(
            "\nRust pipeline, 1 worker ({n} messages): {:.0} msg/s not counted, {:.0} counted: {:.2}\n",
            off.msgs_per_s,
            on.msgs_per_s,
            on.msgs_per_s / off.msgs_per_s
        );
        history::record("counted_pipeline_ratio", on.msgs_per_s / off.msgs_per_s);
    }
}

/// The payments handler in each guest language: its name, its history
/// key, its component.
fn payments_components(root: &Path, component: &Path) -> [(&'static str, &'static str, std::path::PathBuf); 3] {
    [
        ("Rust", "rust", component.to_path_buf()),
        (
            "Python (componentize-py)",
            "python",
            root.join("guest-examples/target/python/payments.wasm"),
        ),
        (
            "JavaScript (componentize-js)",
            "js",
            root.join("guest-examples/target/js/payments.wasm"),
        ),
    ]
}

/// Median and p99 of `calls` dispatches, after a tenth as many to warm up.
async fn warm_dispatch(handler: &dyn Handler, schema: Arc<Schema>, calls: usize) -> (u64, u64) {
    let _ = dispatch(handler, schema.clone(), calls / 10).await;
    dispatch(handler, schema, calls).await
}

/// The same payments handler in each guest language: size, load (compile,
/// then from the on-disk cache after a restart), fresh instance + call, and
/// the SQLite pipeline (1 worker).
async fn languages(root: &Path, component: &Path, dir: &Path, schema: Arc<Schema>, calls: usize) {
    let ln = env_usize("ONCEQ_BENCH_LANG_MESSAGES", 2_000);
    let lang_calls = (calls / 10).max(200);
    println!("\n| payments in | component | compile (cold) | load after a restart (cache) | dispatch median | dispatch p99 | dispatch median, `reset_dirty_pages = false` | pipeline, 1 worker ({ln} messages) |");
    println!("|---|---|---|---|---|---|---|---|");
    for (lang, key, path) in payments_components(root, component) {
        if !path.exists() {
            println!("| {lang} | not built ({}) | | | | | | |", path.display());
            continue;
        }
        let size_mb = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0) as f64 / 1e6;
        let cache = dir.join(format!("cache-{}", lang.len()));
        let (cold, _, _) = load_on_new_engine(&path, Some(&cache), true);
        let (warm, handler, _) = load_on_new_engine(&path, Some(&cache), true);
        let wholesale = {
            let (_, h, _engine) = load_on_new_engine(&path, Some(&cache), false);
            warm_dispatch(&h, schema.clone(), lang_calls).await.0
        };
        let handler: Arc<dyn Handler> = Arc::new(handler);
        let (d50, d99) = warm_dispatch(handler.as_ref(), schema.clone(), lang_calls).await;
        let run = pipeline(dir, &format!("lang-{}.db", lang.len()), handler, ln, 1).await;
        println!(
            "| {lang} | {size_mb:.1} MB | {cold:.0} ms | {warm:.1} ms | {:.1} µs | {:.1} µs | {:.1} µs | {:.0} msg/s |",
            d50 as f64 / 1000.0,
            d99 as f64 / 1000.0,
            wholesale as f64 / 1000.0,
            run.msgs_per_s
        );
        history::record(&format!("{key}_dispatch_us"), d50 as f64 / 1000.0);
        history::record(&format!("{key}_pipeline_msgs_per_s"), run.msgs_per_s);
    }
}

/// Group commit, side by side in one run: onceq with the default
/// `commit.max_batch` and with 1, 1 and 4 workers, against the raw loop one
/// commit per message and batched with a savepoint per message.
async fn group_commit(dir: &Path, wasm: Arc<dyn Handler>, n: usize) {
    let opts = |max_batch: usize| {
        let mut o = StoreOptions::default();
        o.commit.max_batch = max_batch;
        o
    };
    let rounds = env_usize("ONCEQ_BENCH_ROUNDS", 2).max(1);
    let (mut g1, mut g4, mut g16, mut s1, mut s4, mut raw1, mut raw16, mut raw64) = (None, None, None, None, None, None, None, None);
    let (mut alo1, mut alo16) = (None, None);
    for r in 0..rounds {
        alo1 = best(alo1, at_least_once(dir, &format!("alo1-{r}.db"), wasm.clone(), n, 1).await);
        alo16 = best(alo16, at_least_once(dir, &format!("alo16-{r}.db"), wasm.clone(), n, 16).await);
        g1 = best(g1, pipeline_with(dir, &format!("g1-{r}.db"), wasm.clone(), n, 1, opts(64)).await);
        g4 = best(g4, pipeline_with(dir, &format!("g4-{r}.db"), wasm.clone(), n, 4, opts(64)).await);
        g16 = best(g16, pipeline_with(dir, &format!("g16-{r}.db"), wasm.clone(), n, 16, opts(64)).await);
        s1 = best(s1, pipeline_with(dir, &format!("s1-{r}.db"), wasm.clone(), n, 1, opts(1)).await);
        s4 = best(s4, pipeline_with(dir, &format!("s4-{r}.db"), wasm.clone(), n, 4, opts(1)).await);
        raw1 = best(raw1, raw_sqlite_batched(dir, &format!("r1-{r}.db"), n, 1));
        raw16 = best(raw16, raw_sqlite_batched(dir, &format!("r16-{r}.db"), n, 16));
        raw64 = best(raw64, raw_sqlite_batched(dir, &format!("r64-{r}.db"), n, 64));
    }
    let [g1, g4, g16, s1, s4, raw1, raw16, raw64, alo1, alo16] = [g1, g4, g16, s1, s4, raw1, raw16, raw64, alo1, alo16].map(Option::unwrap);
    println!("\n| group commit ({n} payments messages, Wasm handler, synchronous=FULL, best of {rounds}) | messages/s | p50 | p99 | messages per commit |");
    println!("|---|---|---|---|---|");
    row_per_commit("onceq, group commit (max_batch 64), 1 worker", &g1);
    row_per_commit("onceq, group commit (max_batch 64), 4 workers", &g4);
    row_per_commit("onceq, group commit (max_batch 64), 16 workers", &g16);
    row_per_commit(
        "onceq at-least-once (ack in its own transaction after the business commit), 1 worker",
        &alo1,
    );
    row_per_commit(
        "onceq at-least-once (ack in its own transaction after the business commit), 16 workers",
        &alo16,
    );
    row_per_commit("onceq, max_batch 1, 1 worker", &s1);
    row_per_commit("onceq, max_batch 1, 4 workers", &s4);
    row_per_commit("raw loop, one commit per message", &raw1);
    row_per_commit("raw loop, savepoint per message, commit per 16", &raw16);
    row_per_commit("raw loop, savepoint per message, commit per 64", &raw64);
    println!("\n| ratio | value | target |");
    println!("|---|---|---|");
    println!(
        "| group commit 16 workers / raw batched 16 | {:.2} | >= 0.7 |",
        g16.msgs_per_s / raw16.msgs_per_s
    );
    println!(
        "| group commit 4 workers / max_batch 1, 4 workers | {:.2} | >= 4 |",
        g4.msgs_per_s / s4.msgs_per_s
    );
    println!(
        "| group commit 16 workers / max_batch 1, 4 workers | {:.2} | >= 4 |",
        g16.msgs_per_s / s4.msgs_per_s
    );
    println!(
        "| group commit: 4 workers / 1 worker | {:.2} | >= 1.5 |",
        g4.msgs_per_s / g1.msgs_per_s
    );
    println!(
        "| exactly-once / at-least-once, 1 worker | {:.2} | >= 0.9 |",
        g1.msgs_per_s / alo1.msgs_per_s
    );
    println!(
        "| exactly-once / at-least-once, 16 workers | {:.2} | >= 0.9 |",
        g16.msgs_per_s / alo16.msgs_per_s
    );
    history::record("exactly_once_over_at_least_once", g16.msgs_per_s / alo16.msgs_per_s);

    // Memory with 1,024 messages in flight: 64 workers leasing 16 each.
    let before = status_mib("VmRSS:");
    let reset = std::fs::write("/proc/self/clear_refs", "5").is_ok(); // resets VmHWM
    let r = pipeline_with(dir, "rss.db", wasm.clone(), n, 64, opts(64)).await;
    match (before, status_mib("VmHWM:")) {
        (Some(before), Some(peak)) if reset => println!(
            "\nhost RSS with 1,024 messages in flight (64 workers leasing 16 each, {:.0} msg/s): peak {peak:.0} MiB, {before:.0} MiB before (this whole bench process; target <= 150 MiB)",
            r.msgs_per_s
        ),
        _ => println!("\nhost RSS: not measured (needs Linux /proc)"),
    }
}

/// A size line of `/proc/self/status` (`VmRSS:`, `VmHWM:`) in MiB.
fn status_mib(field: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

fn main() {
    let n = env_usize("ONCEQ_BENCH_MESSAGES", 10_000);
    let calls = env_usize("ONCEQ_BENCH_CALLS", 20_000);
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    let component = root.join("guest-examples/target/wasm32-wasip2/release/payments.wasm");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    history::start(&root);
    rt.block_on(async {
        // ONCEQ_BENCH_RESET_DIRTY_PAGES=false: the main engine resets memory
        // wholesale (`runtime.reset_dirty_pages = false`) instead of
        // scanning for the pages an instance dirtied, the default.
        let reset_dirty_pages = std::env::var("ONCEQ_BENCH_RESET_DIRTY_PAGES").as_deref() != Ok("false");
        let (compile_ms, wasm, _engine) = load_on_new_engine(&component, None, reset_dirty_pages);
        let wasm: Arc<dyn Handler> = Arc::new(wasm);
        // The on-disk compiled-component cache: a cold load compiles and
        // stores, a second engine (a restart) loads the stored code.
        let cache_dir = dir.path().join("cache");
        let cached_load = || load_on_new_engine(&component, Some(&cache_dir), true).0;
        let (cold_ms, warm_ms) = (cached_load(), cached_load());
        let native: Arc<dyn Handler> = Arc::new(native_payments());
        let (schema_store, _) = fresh_db(dir.path(), "schema.db");
        let schema = schema_store.schema();

        if std::env::var("ONCEQ_BENCH_ONLY").as_deref() == Ok("history") {
            history::redraw(&root);
            return;
        }
        if let Some(ns) = std::env::var("ONCEQ_BENCH_ONLY").ok().and_then(|v| v.strip_prefix("hosts=")?.parse().ok()) {
            hosts_on_emulator(dir.path(), &component, ns).await;
            return;
        }
        if std::env::var("ONCEQ_BENCH_ONLY").as_deref() == Ok("console") {
            tokio::task::block_in_place(|| console::console(dir.path(), &component));
            return;
        }
        if std::env::var("ONCEQ_BENCH_ONLY").as_deref() == Ok("telemetry") {
            tokio::task::block_in_place(|| telemetry::telemetry(dir.path(), &component));
            return;
        }
        if std::env::var("ONCEQ_BENCH_ONLY").as_deref() == Ok("cli") {
            tokio::task::block_in_place(|| through_the_cli(dir.path(), &component, env_usize("ONCEQ_BENCH_CLI_MESSAGES", 20_000)));
            return;
        }
        if std::env::var("ONCEQ_BENCH_ONLY").as_deref() == Ok("emulator") {
            on_emulator(wasm.clone(), env_usize("ONCEQ_BENCH_SPANNER_MESSAGES", 300)).await;
            return;
        }
        if std::env::var("ONCEQ_BENCH_ONLY").as_deref() == Ok("native") {
            // for profiling the pipeline without the sandbox
            let r = pipeline(dir.path(), "only.db", native.clone(), n, 1).await;
            println!("native pipeline: {:.0} messages/s", r.msgs_per_s);
            return;
        }
        if std::env::var("ONCEQ_BENCH_ONLY").as_deref() == Ok("wasm") {
            let r = pipeline(dir.path(), "only.db", wasm.clone(), n, 1).await;
            println!("wasm pipeline: {:.0} messages/s", r.msgs_per_s);
            return;
        }
        if std::env::var("ONCEQ_BENCH_ONLY").as_deref() == Ok("dispatch") {
            let (w50, w99) = warm_dispatch(wasm.as_ref(), schema.clone(), calls).await;
            println!("dispatch: median {:.1} µs, p99 {:.1} µs", w50 as f64 / 1000.0, w99 as f64 / 1000.0);
            return;
        }
        // One guest's fresh-instance dispatch alone (for a profiler):
        // ONCEQ_BENCH_ONLY=dispatch=guest-examples/target/js/payments.wasm
        if let Some(p) = std::env::var("ONCEQ_BENCH_ONLY").ok().and_then(|v| Some(v.strip_prefix("dispatch=")?.to_owned())) {
            let (_, h, _engine) = load_on_new_engine(&root.join(p), Some(&dir.path().join("cache")), reset_dirty_pages);
            let (d50, d99) = warm_dispatch(&h, schema.clone(), calls).await;
            println!("dispatch: median {:.1} µs, p99 {:.1} µs", d50 as f64 / 1000.0, d99 as f64 / 1000.0);
            return;
        }
        if std::env::var("ONCEQ_BENCH_ONLY").as_deref() == Ok("instructions") {
            instruction_counting(&root, &component, dir.path(), schema.clone(), calls).await;
            return;
        }
        if std::env::var("ONCEQ_BENCH_ONLY").as_deref() == Ok("languages") {
            languages(&root, &component, dir.path(), schema.clone(), calls).await;
            return;
        }
        if std::env::var("ONCEQ_BENCH_ONLY").as_deref() == Ok("group") {
            group_commit(dir.path(), wasm.clone(), n).await;
            return;
        }
        // One group-commit pipeline alone (for a profiler): its workers.
        if let Some(w) = std::env::var("ONCEQ_BENCH_ONLY").ok().and_then(|v| v.strip_prefix("group-workers=")?.parse().ok()) {
            let r = pipeline_with(dir.path(), "one.db", wasm.clone(), n, w, StoreOptions::default()).await;
            println!(
                "group commit, {w} workers: {:.0} messages/s, {:.1} messages per commit",
                r.msgs_per_s, r.per_commit
            );
            return;
        }
        if std::env::var("ONCEQ_BENCH_ONLY").as_deref() == Ok("raw") {
            let r = raw_sqlite(dir.path(), "only-raw.db", n);
            println!("raw loop: {:.0} messages/s", r.msgs_per_s);
            return;
        }
        let (w50, w99) = warm_dispatch(wasm.as_ref(), schema.clone(), calls).await;
        let (n50, n99) = dispatch(native.as_ref(), schema.clone(), calls).await;
        // The same on an engine with the other reset: wholesale instead of
        // the dirty-page scan (or the scan, with
        // ONCEQ_BENCH_RESET_DIRTY_PAGES=false).
        let (_, other_wasm, _other_engine) = load_on_new_engine(&component, None, !reset_dirty_pages);
        let (o50, o99) = warm_dispatch(&other_wasm, schema.clone(), calls).await;

        // Interleave the configurations over a few rounds and keep each
        // one's best: on a noisy 2-core VM the disk and the neighbours drift.
        let rounds = env_usize("ONCEQ_BENCH_ROUNDS", 2).max(1);
        let (mut wasm1, mut native1, mut wasm4, mut native4, mut raw) = (None, None, None, None, None);
        for r in 0..rounds {
            wasm1 = best(wasm1, pipeline(dir.path(), &format!("wasm1-{r}.db"), wasm.clone(), n, 1).await);
            native1 = best(
                native1,
                pipeline(dir.path(), &format!("native1-{r}.db"), native.clone(), n, 1).await,
            );
            raw = best(raw, raw_sqlite(dir.path(), &format!("raw-{r}.db"), n));
            wasm4 = best(wasm4, pipeline(dir.path(), &format!("wasm4-{r}.db"), wasm.clone(), n, 4).await);
            native4 = best(
                native4,
                pipeline(dir.path(), &format!("native4-{r}.db"), native.clone(), n, 4).await,
            );
        }
        let (wasm1, native1, wasm4, native4, raw) = (wasm1.unwrap(), native1.unwrap(), wasm4.unwrap(), native4.unwrap(), raw.unwrap());

        println!(
            "## onceq bench ({n} payments messages, SQLite WAL synchronous=FULL, {} cores, best of {rounds} interleaved rounds)\n",
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)
        );
        println!(
            "load payments.wasm: compile {compile_ms:.1} ms; with the on-disk cache: cold {cold_ms:.1} ms, after a restart {warm_ms:.1} ms\n"
        );
        println!("| dispatch (fresh instance + handle, reads from memory) | median | p99 |");
        println!("|---|---|---|");
        println!("| Wasm payments | {:.1} µs | {:.1} µs |", w50 as f64 / 1000.0, w99 as f64 / 1000.0);
        println!(
            "| Wasm payments, `runtime.reset_dirty_pages = {}` | {:.1} µs | {:.1} µs |",
            !reset_dirty_pages,
            o50 as f64 / 1000.0,
            o99 as f64 / 1000.0
        );
        println!(
            "| native payments | {:.1} µs | {:.1} µs |\n",
            n50 as f64 / 1000.0,
            n99 as f64 / 1000.0
        );
        println!("| pipeline | messages/s | p50 | p99 |");
        println!("|---|---|---|---|");
        row("onceq, Wasm handler, 1 worker", &wasm1);
        row("onceq, native handler, 1 worker", &native1);
        row("onceq, Wasm handler, 4 workers", &wasm4);
        row("onceq, native handler, 4 workers", &native4);
        row("raw rusqlite loop (same statements)", &raw);
        println!();
        println!("| ratio | value | target |");
        println!("|---|---|---|");
        println!(
            "| Wasm / native throughput, 1 worker | {:.2} | >= 0.8 |",
            wasm1.msgs_per_s / native1.msgs_per_s
        );
        println!(
            "| Wasm / native throughput, 4 workers | {:.2} | >= 0.8 |",
            wasm4.msgs_per_s / native4.msgs_per_s
        );
        println!(
            "| onceq (native, 1 worker) / raw SQLite | {:.2} | (the pipeline without the sandbox) |",
            native1.msgs_per_s / raw.msgs_per_s
        );
        println!(
            "| onceq (Wasm, best) / raw SQLite | {:.2} | >= 0.7 |",
            wasm1.msgs_per_s.max(wasm4.msgs_per_s) / raw.msgs_per_s
        );
        println!("| dispatch median | {:.1} µs | <= 10 µs |", w50 as f64 / 1000.0);
        println!(
            "| dispatch median, `runtime.reset_dirty_pages = {}` | {:.1} µs | <= 10 µs |",
            !reset_dirty_pages,
            o50 as f64 / 1000.0
        );

        group_commit(dir.path(), wasm.clone(), n).await;
        tokio::task::block_in_place(|| through_the_cli(dir.path(), &component, env_usize("ONCEQ_BENCH_CLI_MESSAGES", 20_000)));
        tokio::task::block_in_place(|| console::console(dir.path(), &component));
        tokio::task::block_in_place(|| telemetry::telemetry(dir.path(), &component));

        languages(&root, &component, dir.path(), schema.clone(), calls).await;
        instruction_counting(&root, &component, dir.path(), schema.clone(), calls).await;

        if std::env::var("SPANNER_EMULATOR_HOST").is_ok() {
            let ns = env_usize("ONCEQ_BENCH_SPANNER_MESSAGES", 300);
            on_emulator(wasm.clone(), ns).await;
            // Enough orders that draining them, not the start of three
            // processes, is what is measured.
            hosts_on_emulator(dir.path(), &component, env_usize("ONCEQ_BENCH_HOSTS_ORDERS", 3000)).await;
        }
        history::append_and_draw(&root);
    });
}

/// The `onceq.toml` of the payments example on `store`, with `extra`
/// top-level settings, its intents delivered to the file `charges`.
fn payments_config(store: &str, extra: &str, component: &Path, charges: &str) -> String {
    format!(
        "store = \"{store}\"\n{extra}\n[[queue]]\nname = \"payments\"\nhandler = \"{}\"\n\
         tables = [\"accounts\", \"orders\"]\nconnectors = [\"charge\"]\n\n\
         [[connector]]\nname = \"charge\"\nkind = \"file\"\npath = \"{charges}\"\n\n\
         [admin]\nlisten = \"127.0.0.1:0\"\n",
        component.display()
    )
}

/// How soon a charge reaches the outside world on a host with little to
/// do: `onceq run` on an empty queue, one payments message sent every
/// 370 ms with `onceq send` (slower than the idle polls' backoff, so each
/// finds the host idle), timed from the send's return to its intent's line
/// in the file; `commit.handoff` on (the default) and off.
fn intent_latency(work: &Path, component: &Path) {
    let sends = env_usize("ONCEQ_BENCH_LATENCY_SENDS", 25);
    println!("\n| an intent's latency on an idle host: `onceq send` returned to the line delivered, {sends} sends 370 ms apart | median ms | p90 ms |");
    println!("|---|---|---|");
    for (label, extra) in [
        ("default (`commit.handoff = true`)", ""),
        ("`commit.handoff = false`", "[commit]\nhandoff = false\n"),
    ] {
        let name = if extra.is_empty() { "latency-on" } else { "latency-off" };
        let (store, db) = fresh_db(work, &format!("{name}.db"));
        drop(store);
        let charges = work.join(format!("{name}.jsonl"));
        let config = payments_config(&db.display().to_string(), extra, component, &charges.display().to_string());
        std::fs::write(work.join("onceq.toml"), config).unwrap();
        let mut host = std::process::Command::new(env!("CARGO_BIN_EXE_onceq"))
            .current_dir(work)
            .arg("run")
            .env("RUST_LOG", "error")
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let lines = || std::fs::read_to_string(&charges).map_or(0, |s| s.lines().count());
        let mut took = Vec::new();
        // The first send waits for the host to be up; not counted.
        for i in 0..=sends {
            std::thread::sleep(Duration::from_millis(370));
            let sent = std::process::Command::new(env!("CARGO_BIN_EXE_onceq"))
                .current_dir(work)
                .args(["send", "payments", "--payload"])
                .arg(String::from_utf8(order_payload(i)).unwrap())
                .env("RUST_LOG", "error")
                .stdout(std::process::Stdio::null())
                .status()
                .unwrap();
            assert!(sent.success(), "onceq send failed");
            let at = Instant::now();
            let deadline = at + Duration::from_secs(60);
            while lines() <= i {
                assert!(Instant::now() < deadline, "intent {i} not delivered in a minute");
                std::thread::sleep(Duration::from_millis(1));
            }
            if i > 0 {
                took.push(at.elapsed().as_secs_f64() * 1000.0);
            }
        }
        let _ = host.kill();
        let _ = host.wait();
        took.sort_by(f64::total_cmp);
        let (median, p90) = (took[took.len() / 2], took[took.len() * 9 / 10]);
        println!("| {label} | {median:.0} | {p90:.0} |");
        if extra.is_empty() {
            history::record("intent_latency_idle_ms", median);
        }
    }
}

/// `onceq run --until-empty` in `work` (its `onceq.toml`), logging errors only.
fn until_empty(work: &Path) -> std::process::Command {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_onceq"));
    c.current_dir(work)
        .args(["run", "--until-empty"])
        .env("RUST_LOG", "error")
        .stdout(std::process::Stdio::null());
    c
}

/// As a user runs it: `onceq run --until-empty` with default settings
/// ([`onceq::config::SQLITE_WORKERS`] workers, 64 deliveries at once to the file connector, group commit, `synchronous = full`) on a SQLite file with
/// `n` payments messages queued, intents delivered to a file connector;
/// the same with `commit.max_batch = 1`; and in the same run the raw loop,
/// one commit per message and batched. The host's time counts from its
/// start (the component comes from the folder's compiled cache, warmed by
/// a first run) to its exit, every intent delivered.
fn through_the_cli(dir: &Path, component: &Path, n: usize) {
    // ONCEQ_BENCH_CLI_DIR: work there and keep it (to look at a run).
    let work = std::env::var_os("ONCEQ_BENCH_CLI_DIR").map_or_else(|| dir.join("cli"), std::path::PathBuf::from);
    std::fs::create_dir_all(&work).unwrap();
    let rt = tokio::runtime::Handle::current();
    let drain_with = |name: &str, extra: &str, n: usize, component: &Path| -> (f64, u64) {
        let db = work.join(format!("{name}.db"));
        {
            let (store, _) = fresh_db(&work, &format!("{name}.db"));
            rt.block_on(queue_orders(store.as_ref(), n, 1000));
        }
        if std::env::var_os("ONCEQ_BENCH_CLI_DIR").is_some() {
            // Kept, to run the same work again by hand (under a profiler).
            std::fs::copy(&db, work.join(format!("{name}.db.queued"))).unwrap();
        }
        let charges = work.join(format!("{name}.jsonl"));
        let config = payments_config(&db.display().to_string(), extra, component, &charges.display().to_string());
        std::fs::write(work.join("onceq.toml"), config).unwrap();
        let started = Instant::now();
        let mut child = until_empty(&work).spawn().unwrap();
        // What it wrote, read until it exits (the last 5 ms are not seen:
        // a few pages in a run of thousands of messages). Polled every 5 ms:
        // the exit is seen up to a poll late, and the run is timed to it.
        let mut written = 0;
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            written = written_bytes(child.id()).unwrap_or(written);
            std::thread::sleep(Duration::from_millis(5));
        };
        let secs = started.elapsed().as_secs_f64();
        assert!(status.success(), "onceq run failed");
        if n > 0 {
            let delivered = std::fs::read_to_string(&charges).unwrap().lines().count();
            assert!(delivered >= n * 9 / 10, "intents delivered: {delivered} of about {n}");
        }
        (secs, written)
    };
    let drain = |name: &str, extra: &str, n: usize| drain_with(name, extra, n, component);
    drain("warm", "", 0); // compiles the component into the folder's cache
    let rounds = env_usize("ONCEQ_BENCH_ROUNDS", 2).max(1);
    let (mut cli, mut alone, mut raw1, mut raw16, mut raw64, mut full) = (f64::MAX, f64::MAX, None, None, None, None);
    let mut table_only = f64::MAX;
    let (mut cli_written, mut full_written) = (u64::MAX, u64::MAX);
    for r in 0..rounds {
        // ONCEQ_BENCH_CLI_SETTINGS: onceq.toml lines for the default run (to try settings).
        let settings = std::env::var("ONCEQ_BENCH_CLI_SETTINGS").unwrap_or_default().replace("\\n", "\n");
        let (secs, written) = drain(&format!("default-{r}"), &settings, n);
        cli = cli.min(secs);
        cli_written = cli_written.min(written);
        alone = alone.min(drain(&format!("alone-{r}"), "[commit]\nmax_batch = 1\n", n).0);
        table_only = table_only.min(drain(&format!("table-only-{r}"), "[commit]\nhandoff = false\n", n).0);
        raw1 = best(raw1, raw_sqlite_batched(&work, &format!("raw1-{r}.db"), n, 1));
        raw16 = best(raw16, raw_sqlite_batched(&work, &format!("raw16-{r}.db"), n, 16));
        raw64 = best(raw64, raw_sqlite_batched(&work, &format!("raw64-{r}.db"), n, 64));
        let sink = work.join(format!("raw-full-{r}.jsonl"));
        let (run, written) = raw_sqlite_full(&work, &format!("raw-full-{r}.db"), n, 64, Some(&sink));
        full = best(full, run);
        full_written = full_written.min(written);
    }
    let [raw1, raw16, raw64, full] = [raw1, raw16, raw64, full].map(Option::unwrap);
    let (cli_pages, full_pages) = (cli_written as f64 / PAGE / n as f64, full_written as f64 / PAGE / n as f64);
    let (cli, alone, table_only) = (n as f64 / cli, n as f64 / alone, n as f64 / table_only);
    println!("\n| through the CLI: `onceq run --until-empty`, {n} payments messages, intents to a file connector, best of {rounds} | messages/s |");
    println!("|---|---|");
    println!(
        "| onceq, default settings ({} workers, 64 file deliveries at once, group commit), start to exit | {cli:.0} |",
        onceq::config::SQLITE_WORKERS
    );
    println!("| onceq, `commit.max_batch = 1` | {alone:.0} |");
    println!("| onceq, `commit.handoff = false` (every intent leased from the table) | {table_only:.0} |");
    println!("| raw loop, one commit per message (no delivery) | {:.0} |", raw1.msgs_per_s);
    println!(
        "| raw loop, savepoint per message, commit per 16 (no delivery) | {:.0} |",
        raw16.msgs_per_s
    );
    println!(
        "| raw loop, savepoint per message, commit per 64 (no delivery) | {:.0} |",
        raw64.msgs_per_s
    );
    println!(
        "| raw loop, savepoint per message, commit per 64, each batch's intents delivered to a file (the full work) | {:.0} |",
        full.msgs_per_s
    );
    println!("\n| written per message (`/proc/PID/io` wchar: WAL frames, checkpoints, delivered lines), in 4 KiB pages | pages |");
    println!("|---|---|");
    println!("| onceq, default settings | {cli_pages:.1} |");
    println!("| raw loop, full work, commit per 64 | {full_pages:.1} |");
    println!("\n| ratio | value | target |");
    println!("|---|---|---|");
    println!("| CLI default / raw batched 16 | {:.2} | >= 0.7 |", cli / raw16.msgs_per_s);
    println!(
        "| CLI default / raw batched 64 | {:.2} | (issue 10 measured 0.04) |",
        cli / raw64.msgs_per_s
    );
    println!("| CLI default / CLI `commit.max_batch = 1` | {:.2} | >= 4 |", cli / alone);
    println!("| CLI default / CLI `commit.handoff = false` | {:.2} | |", cli / table_only);
    println!("| CLI default / raw full work batched 64 | {:.2} | >= 0.8 |", cli / full.msgs_per_s);
    println!("| pages written per message, CLI default | {cli_pages:.1} | <= 12 |");
    history::record("cli_msgs_per_s", cli);
    history::record("raw_full_msgs_per_s", full.msgs_per_s);
    history::record("cli_over_raw_full", cli / full.msgs_per_s);
    history::record("cli_pages_per_message", cli_pages);
    intent_latency(&work, component);

    // What a team gets in each language: the same handler built with each
    // SDK, through the CLI with the defaults (ONCEQ_BENCH_CLI_GUEST_MESSAGES
    // each, 3,000 by default; interpreted guests are slower), the compiled
    // cache warmed by a first run of each.
    let m = env_usize("ONCEQ_BENCH_CLI_GUEST_MESSAGES", 3_000);
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let guests = [
        ("Rust", component.to_path_buf(), "cli_rust_guest_msgs_per_s"),
        (
            "JavaScript",
            root.join("guest-examples/target/js/payments.wasm"),
            "cli_js_msgs_per_s",
        ),
        (
            "Python",
            root.join("guest-examples/target/python/payments.wasm"),
            "cli_python_msgs_per_s",
        ),
    ];
    println!("\n| through the CLI by language: {m} payments messages, default settings, best of {rounds} | messages/s | of Rust |");
    println!("|---|---|---|");
    let mut rust = None;
    for (lang, path, metric) in &guests {
        if !path.exists() {
            println!("| {lang} | ({} not built) | |", path.display());
            continue;
        }
        drain_with(&format!("warm-{lang}"), "", 0, path);
        let secs = (0..rounds)
            .map(|r| drain_with(&format!("{lang}-{r}"), "", m, path).0)
            .fold(f64::MAX, f64::min);
        let rate = m as f64 / secs;
        let of = *rust.get_or_insert(rate);
        println!("| {lang} | {rate:.0} | {:.2} |", rate / of);
        history::record(metric, rate);
    }
}

/// On the Spanner emulator (one read-write transaction at a time), `n`
/// orders each: onceq with group commit (1, 4 and 16 workers), onceq with
/// every message committed alone (`commit.max_batch = 1`, 1 worker), and a
/// hand-written worker on the same client (one transaction per message),
/// interleaved over the bench's rounds, each one's best.
async fn on_emulator(wasm: Arc<dyn Handler>, n: usize) {
    let alone = StoreOptions {
        commit: onceq::store::commit::CommitOptions {
            max_batch: 1,
            ..Default::default()
        },
        ..Default::default()
    };
    let rounds = env_usize("ONCEQ_BENCH_ROUNDS", 2).max(1);
    let (mut g1, mut g4, mut g16, mut one, mut raw) = (None, None, None, None, None);
    for _ in 0..rounds {
        let (store, _) = spanner_db(n).await;
        g1 = best(g1, pipeline_on(store, wasm.clone(), n, 1).await);
        let (store, _) = spanner_db(n).await;
        g4 = best(g4, pipeline_on(store, wasm.clone(), n, 4).await);
        let (store, _) = spanner_db(n).await;
        g16 = best(g16, pipeline_on(store, wasm.clone(), n, 16).await);
        let (store, _) = spanner_db_with(n, alone.clone()).await;
        one = best(one, pipeline_on(store, wasm.clone(), n, 1).await);
        let (_, database) = spanner_db(n).await;
        raw = best(raw, raw_spanner(&database, n).await);
    }
    let (g1, g4, g16, one, raw) = (g1.unwrap(), g4.unwrap(), g16.unwrap(), one.unwrap(), raw.unwrap());
    println!("\n| Spanner emulator ({n} messages, best of {rounds}) | messages/s | p50 | p99 | messages per commit |");
    println!("|---|---|---|---|---|");
    row_per_commit("onceq, group commit, 1 worker", &g1);
    row_per_commit("onceq, group commit, 4 workers", &g4);
    row_per_commit("onceq, group commit, 16 workers", &g16);
    row_per_commit("onceq, `commit.max_batch = 1`, 1 worker", &one);
    row_per_commit("hand-written worker, same client, no Wasm", &raw);
    let best_group = g1.msgs_per_s.max(g4.msgs_per_s).max(g16.msgs_per_s);
    history::record("emulator_16_workers_msgs_per_s", g16.msgs_per_s);
    println!("\n| ratio | value | target |");
    println!("|---|---|---|");
    println!(
        "| onceq group commit (best) / 42 msg/s (onceq before group commit, issue 10) | {:.1} | >= 10 |",
        best_group / 42.0
    );
    println!(
        "| onceq group commit (best) / `commit.max_batch = 1` | {:.1} | |",
        best_group / one.msgs_per_s
    );
    println!(
        "| onceq `commit.max_batch = 1` / hand-written (one transaction per message each) | {:.2} | >= 0.9 |",
        one.msgs_per_s / raw.msgs_per_s
    );
}

/// One and three `onceq run --until-empty` processes (default settings)
/// draining `n` orders from a fresh emulator database each: the emulator
/// runs one read-write transaction at a time, so three hosts cannot be
/// faster than one, and must not be slower. Runs in the order 1, 3, 3, 1,
/// each database dropped after its run: runs drift slower over the
/// emulator's life (measured, also with the databases dropped), and the
/// order cancels a steady drift.
async fn hosts_on_emulator(dir: &Path, component: &Path, n: usize) {
    let work = dir.join("hosts");
    std::fs::create_dir_all(&work).unwrap();
    let drain = |database: &str, hosts: usize| {
        let config = payments_config(&format!("spanner://{database}"), "", component, "charges.jsonl");
        std::fs::write(work.join("onceq.toml"), config).unwrap();
        let started = Instant::now();
        // ONCEQ_BENCH_HOSTS_LOG=<dir>: each host logs (at RUST_LOG's level,
        // else info) to <dir>/<hosts>-<i>.log; the last run of each count
        // is kept.
        let log = std::env::var_os("ONCEQ_BENCH_HOSTS_LOG").map(std::path::PathBuf::from);
        let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into());
        let running: Vec<_> = (0..hosts)
            .map(|i| {
                let mut c = until_empty(&work);
                match &log {
                    Some(dir) => c
                        .env("RUST_LOG", &filter)
                        .stderr(std::fs::File::create(dir.join(format!("{hosts}-{i}.log"))).unwrap()),
                    None => c.stderr(std::process::Stdio::null()),
                };
                c.spawn().unwrap()
            })
            .collect();
        let mut running: Vec<_> = running.into_iter().map(Some).collect();
        let mut exits = Vec::new();
        while running.iter().any(Option::is_some) {
            for slot in running.iter_mut() {
                if let Some(h) = slot {
                    if let Some(status) = h.try_wait().unwrap() {
                        assert!(status.success(), "a host failed");
                        exits.push(started.elapsed().as_secs_f64());
                        *slot = None;
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        eprintln!("hosts exited at {exits:.2?} s");
        started.elapsed().as_secs_f64()
    };
    // The first run compiles the component into the folder's cache.
    let (_, empty) = spanner_db(0).await;
    tokio::task::block_in_place(|| drain(&empty, 1));
    let mut secs = [0.0f64; 2];
    for hosts in [1usize, 3, 3, 1] {
        let (store, database) = spanner_db(n).await;
        secs[usize::from(hosts == 3)] += tokio::task::block_in_place(|| drain(&database, hosts));
        let left: u64 = store.stats().await.unwrap().queues.iter().map(|q| q.ready + q.leased).sum();
        assert_eq!(left, 0, "the hosts drained the queue");
        drop(store);
        onceq::store::spanner::SpannerStore::drop_database(&database).await.unwrap();
    }
    println!("\n| Spanner emulator, `onceq run --until-empty` ({n} orders, two runs each) | seconds | messages/s |");
    println!("|---|---|---|");
    for (name, s) in [("1 host", secs[0]), ("3 hosts", secs[1])] {
        println!("| {name} | {:.1} | {:.1} |", s / 2.0, 2.0 * n as f64 / s);
    }
    println!("\n| ratio | value | target |");
    println!("|---|---|---|");
    println!("| 3 hosts / 1 host (Spanner emulator) | {:.2} | >= 1.0 |", secs[0] / secs[1]);
}
