//! The embedded store: one SQLite file in WAL mode.
//!
//! ## How a message transaction runs here
//!
//! SQLite has one writer at a time, and a handler may run for up to its
//! deadline. Holding the write lock that long would stall every other worker
//! and process, so a message transaction is *optimistic*:
//!
//! 1. The handler's reads run on a pooled reader connection inside one read
//!    transaction (a consistent WAL snapshot); each read and its result is
//!    recorded.
//! 2. On commit, under the write lock (`BEGIN IMMEDIATE`), every recorded
//!    read is run again; if any result differs the transaction is
//!    [`StoreError::Aborted`] and the protocol re-runs the handler on fresh
//!    data. This makes the handler's reads and writes serializable.
//! 3. Still under the lock: the ack (`DELETE ... WHERE id = ? AND
//!    lease_token = ?`, and `changes() == 1` or roll back with
//!    [`StoreError::LeaseLost`] — SQLite's `ASSERT_ROWS_MODIFIED 1`), then
//!    the writes, intents and follow-ups, then `COMMIT`.
//!
//! In-process writers queue on an async mutex (no thread spins on
//! `SQLITE_BUSY`); other processes on the same file are handled by
//! `busy_timeout`.

use super::*;
use crate::schema::{column_type_from_decl, ColumnSchema, ColumnType};
use crate::value::{random_id, WriteOp};
use rusqlite::types::{Value as SqlValue, ValueRef};
use rusqlite::{params, Connection, ErrorCode, OptionalExtension, TransactionBehavior};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// SQLite's clock, in microseconds since the epoch. The store never uses
/// the host's clock for leases or visibility.
const NOW: &str = "CAST(unixepoch('subsec') * 1000000 AS INTEGER)";

const SYSTEM_DDL: &str = "
CREATE TABLE IF NOT EXISTS onceq_messages (
    id TEXT PRIMARY KEY,
    queue TEXT NOT NULL,
    payload BLOB NOT NULL,
    attributes TEXT NOT NULL DEFAULT '[]',
    attempt INTEGER NOT NULL DEFAULT 0,
    enqueued_at INTEGER NOT NULL,
    visible_at INTEGER NOT NULL,
    lease_token TEXT,
    last_error TEXT,
    failures INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS onceq_messages_visible ON onceq_messages (queue, visible_at, lease_token);
CREATE TABLE IF NOT EXISTS onceq_dead_letters (
    id TEXT PRIMARY KEY,
    queue TEXT NOT NULL,
    payload BLOB NOT NULL,
    attributes TEXT NOT NULL,
    attempts INTEGER NOT NULL,
    enqueued_at INTEGER NOT NULL,
    failed_at INTEGER NOT NULL,
    reason TEXT NOT NULL,
    handler_version TEXT,
    failures INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS onceq_dead_letters_queue ON onceq_dead_letters (queue, failed_at);
CREATE TABLE IF NOT EXISTS onceq_dedup (
    queue TEXT NOT NULL,
    dedup_key TEXT NOT NULL,
    message_id TEXT NOT NULL,
    expires_at INTEGER NOT NULL,
    PRIMARY KEY (queue, dedup_key)
);
CREATE INDEX IF NOT EXISTS onceq_dedup_expiry ON onceq_dedup (expires_at);
CREATE TABLE IF NOT EXISTS onceq_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT OR IGNORE INTO onceq_meta (key, value) VALUES ('schema_version', '2');
";

/// Databases made before failures were counted apart from deliveries
/// (schema 1: `attempt` counted every lease, and `max_attempts` bounded
/// it) get a `failures` column on open. A queued message starts with none
/// (what failed before is not known); a dead letter keeps its old count as
/// its failures, as it was reported then.
///
/// A database that has the columns is not written to: hosts opening one
/// file together take no write lock for this.
fn migrate_failures(conn: &mut Connection) -> rusqlite::Result<()> {
    fn has(conn: &Connection, table: &str) -> rusqlite::Result<bool> {
        conn.query_row(
            &format!("SELECT count(*) FROM pragma_table_info('{table}') WHERE name = 'failures'"),
            [],
            |r| r.get::<_, i64>(0),
        )
        .map(|n| n > 0)
    }
    if has(conn, "onceq_messages")? && has(conn, "onceq_dead_letters")? {
        return Ok(());
    }
    // Under the write lock, checked again: another host may have done it.
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    if !has(&tx, "onceq_messages")? {
        tx.execute_batch("ALTER TABLE onceq_messages ADD COLUMN failures INTEGER NOT NULL DEFAULT 0")?;
    }
    if !has(&tx, "onceq_dead_letters")? {
        tx.execute_batch(
            "ALTER TABLE onceq_dead_letters ADD COLUMN failures INTEGER NOT NULL DEFAULT 0;
             UPDATE onceq_dead_letters SET failures = attempts;",
        )?;
    }
    tx.execute_batch("INSERT OR REPLACE INTO onceq_meta (key, value) VALUES ('schema_version', '2')")?;
    tx.commit()
}

/// Databases made before the lease token joined the queue index get it on
/// open: the counts (`onceq stats`, the console's overview) are then read
/// from the index alone, by range, not from every message's row (on a
/// queue of 1,000,000 messages, 60 ms instead of 220 ms). It costs no
/// write: a lease, a renewal, a retry and an ack change `visible_at`, and
/// so the index entry, already. A database that has it is not written to.
fn migrate_lease_index(conn: &mut Connection) -> rusqlite::Result<()> {
    fn columns(conn: &Connection) -> rusqlite::Result<i64> {
        conn.query_row("SELECT count(*) FROM pragma_index_info('onceq_messages_visible')", [], |r| {
            r.get::<_, i64>(0)
        })
    }
    if columns(conn)? == 3 {
        return Ok(());
    }
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    if columns(&tx)? != 3 {
        tracing::info!("adding the lease token to the queue index (once; a big queue takes a few seconds)");
        tx.execute_batch(
            "DROP INDEX IF EXISTS onceq_messages_visible;
             CREATE INDEX onceq_messages_visible ON onceq_messages (queue, visible_at, lease_token);",
        )?;
    }
    tx.commit()
}

/// The processed counts (`onceq stats`), also created on open for databases
/// made before them.
const COUNTS_DDL: &str = "CREATE TABLE IF NOT EXISTS onceq_counts (
    queue TEXT PRIMARY KEY,
    processed INTEGER NOT NULL,
    last_at INTEGER NOT NULL
);";

/// The audit trail (`onceq audit`), also created on open for databases
/// made before it. `seq` is the rowid (newest is highest); not
/// AUTOINCREMENT, which would add SQLite's `sqlite_sequence` table beside
/// the business tables.
const AUDIT_DDL: &str = "CREATE TABLE IF NOT EXISTS onceq_audit (
    seq INTEGER PRIMARY KEY,
    at_us INTEGER NOT NULL,
    actor TEXT NOT NULL,
    action TEXT NOT NULL,
    queue TEXT,
    subject TEXT NOT NULL,
    signer TEXT,
    result TEXT NOT NULL
);";

/// Paused queues (`onceq pause`), also created on open for databases made
/// before pausing.
const PAUSED_DDL: &str = "CREATE TABLE IF NOT EXISTS onceq_paused (
    queue TEXT PRIMARY KEY,
    paused_at INTEGER NOT NULL,
    actor TEXT NOT NULL
);";

/// The hosts serving (`onceq run`'s heartbeats, the console's overview),
/// also created on open for databases made before them.
const HOSTS_DDL: &str = "CREATE TABLE IF NOT EXISTS onceq_hosts (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    pid INTEGER NOT NULL,
    version TEXT NOT NULL,
    started_at INTEGER NOT NULL,
    seen_at INTEGER NOT NULL,
    queues TEXT NOT NULL,
    in_flight INTEGER NOT NULL,
    finished INTEGER NOT NULL
);";

fn audit_insert(c: &Connection, e: &AuditEntry) -> StoreResult<()> {
    c.prepare_cached("INSERT INTO onceq_audit (at_us, actor, action, queue, subject, signer, result) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)")
        .and_then(|mut s| s.execute(params![e.at, e.actor, e.action, e.queue, e.subject, e.signer, e.result]))
        .map(|_| ())
        .map_err(classify)
}

/// Bytes of the database file mapped into memory per connection.
const MMAP_SIZE: u64 = 256 << 20;

struct Inner {
    path: PathBuf,
    writer: tokio::sync::Mutex<Connection>,
    readers: Mutex<Vec<Connection>>,
    schema: Arc<Schema>,
    options: StoreOptions,
    /// Message commits, grouped ([`commit::Group`]); leases, renewals and
    /// failure records run on its committer too.
    group: Arc<commit::Group>,
    /// Batches still to run with a savepoint per message, after one
    /// without them had to be redone (see [`Inner::commit_batch`]).
    savepoint_batches: std::sync::atomic::AtomicU32,
    /// Batches that failed as a whole and were committed again one message
    /// at a time (`CommitStats::split_batches`).
    splits: std::sync::atomic::AtomicU64,
    /// Leases asked for and not yet run ([`Inner::lease`]).
    lease_asks: Mutex<Vec<LeaseAsk>>,
    /// Leases committed inside a batch's transaction
    /// (`CommitStats::leases_in_batches`).
    leases_inside: std::sync::atomic::AtomicU64,
}

/// A lease asked for and not yet run: inside the next batch's transaction,
/// or in one of its own ([`Inner::lease`]).
struct LeaseAsk {
    params: LeaseParams,
    /// The leased messages' token; also names the ask.
    token: String,
    answer: tokio::sync::oneshot::Sender<StoreResult<Vec<LeasedMessage>>>,
}

/// Lease up to `p.limit` messages of `p.queue` for `p.lease`, with `token`:
/// one statement.
fn lease_rows(c: &Connection, p: &LeaseParams, token: &str) -> StoreResult<Vec<LeasedMessage>> {
    let mut stmt = c
        // The limit written in, not bound: see `select_sql`. By rowid: the
        // index that finds the messages holds it, so neither the search
        // nor the update looks up an id (`id IN (SELECT id ...)` read each
        // row for its id, then searched the id's index for its row).
        .prepare_cached(&format!(
            "UPDATE onceq_messages SET lease_token = ?1, visible_at = {NOW} + ?2, attempt = attempt + 1
             WHERE rowid IN (SELECT rowid FROM onceq_messages WHERE queue = ?3 AND visible_at <= {NOW} ORDER BY visible_at LIMIT {})
             RETURNING id, payload, attributes, attempt, enqueued_at, visible_at, failures",
            p.limit
        ))
        .map_err(classify)?;
    let rows = stmt
        .query_map(params![token, micros(p.lease), p.queue], |r| {
            Ok(LeasedMessage {
                message: Message {
                    id: r.get(0)?,
                    queue: p.queue.clone(),
                    payload: r.get(1)?,
                    attributes: attrs_from_json(&r.get::<_, String>(2)?),
                    attempt: r.get(3)?,
                    enqueued_at: r.get(4)?,
                },
                lease: Lease {
                    queue: p.queue.clone(),
                    message_id: r.get(0)?,
                    shard: 0,
                    token: token.to_owned(),
                },
                lease_until: r.get(5)?,
                failures: r.get(6)?,
            })
        })
        .map_err(classify)?;
    rows.collect::<Result<Vec<_>, _>>().map_err(classify)
}

/// The SQLite store.
pub struct SqliteStore {
    inner: Arc<Inner>,
}

/// How long a connection waits in SQLite's busy handler for a lock.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

fn classify(e: rusqlite::Error) -> StoreError {
    match &e {
        rusqlite::Error::SqliteFailure(f, _) => match f.code {
            ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked => StoreError::Unavailable(e.to_string()),
            ErrorCode::ConstraintViolation => StoreError::WriteRefused(e.to_string()),
            _ => StoreError::Permanent(e.to_string()),
        },
        _ => StoreError::Permanent(e.to_string()),
    }
}

fn quote(ident: &str) -> String {
    let mut quoted = String::with_capacity(ident.len() + 2);
    push_quoted(&mut quoted, ident);
    quoted
}

/// An identifier, double-quoted (`"` doubled inside), into `sql`, where a
/// statement is being built.
fn push_quoted(sql: &mut String, ident: &str) {
    sql.push('"');
    for c in ident.chars() {
        if c == '"' {
            sql.push('"');
        }
        sql.push(c);
    }
    sql.push('"');
}

/// `?n` into `sql`.
fn push_param(sql: &mut String, n: usize) {
    sql.push('?');
    sql.push_str(&n.to_string());
}

/// `each` of `items` into `sql`, `sep` between them; `each` gets the
/// item's position.
fn push_joined<T>(sql: &mut String, items: impl IntoIterator<Item = T>, sep: &str, mut each: impl FnMut(&mut String, usize, T)) {
    for (n, item) in items.into_iter().enumerate() {
        if n > 0 {
            sql.push_str(sep);
        }
        each(sql, n, item);
    }
}

/// The columns' names, quoted, comma-separated, into `sql`.
fn push_names<'a>(sql: &mut String, columns: impl IntoIterator<Item = &'a ColumnSchema>) {
    push_joined(sql, columns, ", ", |sql, _, c| push_quoted(sql, &c.name));
}

/// `"k1" = ?first AND "k2" = ?first+1 ...` for `keys`, into `sql`.
fn push_key_cond<'a>(sql: &mut String, keys: impl IntoIterator<Item = &'a ColumnSchema>, first: usize) {
    push_joined(sql, keys, " AND ", |sql, n, k| {
        push_quoted(sql, &k.name);
        sql.push_str(" = ");
        push_param(sql, first + n);
    });
}

fn to_sql(v: &Value) -> SqlValue {
    match v {
        Value::Null => SqlValue::Null,
        Value::Bool(b) => SqlValue::Integer(i64::from(*b)),
        Value::Int64(i) | Value::Timestamp(i) => SqlValue::Integer(*i),
        Value::Float64(f) => SqlValue::Real(*f),
        Value::String(s) | Value::Json(s) => SqlValue::Text(s.clone()),
        Value::Bytes(b) => SqlValue::Blob(b.clone()),
    }
}

fn from_sql(table: &str, col: &ColumnSchema, v: ValueRef<'_>) -> StoreResult<Value> {
    let bad = || {
        StoreError::Permanent(format!(
            "table {table}: column {} is declared {} but holds a {:?} value",
            col.name,
            col.ty.name(),
            v.data_type()
        ))
    };
    Ok(match (col.ty, v) {
        (_, ValueRef::Null) => Value::Null,
        (ColumnType::Bool, ValueRef::Integer(i)) => Value::Bool(i != 0),
        (ColumnType::Int64, ValueRef::Integer(i)) => Value::Int64(i),
        (ColumnType::Timestamp, ValueRef::Integer(i)) => Value::Timestamp(i),
        (ColumnType::Float64, ValueRef::Real(f)) => Value::Float64(f),
        (ColumnType::Float64, ValueRef::Integer(i)) => Value::Float64(i as f64),
        (ColumnType::String, ValueRef::Text(t)) => Value::String(String::from_utf8_lossy(t).into_owned()),
        (ColumnType::Json, ValueRef::Text(t)) => Value::Json(String::from_utf8_lossy(t).into_owned()),
        (ColumnType::Bytes, ValueRef::Blob(b)) => Value::Bytes(b.to_vec()),
        _ => return Err(bad()),
    })
}

fn read_row(table: &TableSchema, r: &rusqlite::Row<'_>) -> StoreResult<Row> {
    let mut row = Vec::with_capacity(table.columns.len());
    for (i, col) in table.columns.iter().enumerate() {
        let v = r.get_ref(i).map_err(classify)?;
        row.push((col.name.clone(), from_sql(&table.name, col, v)?));
    }
    Ok(row)
}

/// A read by key (`limit` None) or a scan of at most `limit` rows in key
/// order. The limit is written into the statement, not bound: with a bound
/// `LIMIT ?` this SQLite build (STAT4) re-prepares the statement on every
/// run, the plan depending on the value (measured: every run of the lease
/// statement re-prepared, a third of a lease's time). A statement per
/// limit is cached instead; handlers use a few.
///
/// Built into one string, identifiers quoted in place: a handler's read
/// builds it again each time (the statement cache is looked up by text),
/// and a string per column and per key was 1.5% of a CLI run's CPU.
fn select_sql(table: &TableSchema, key_len: usize, limit: Option<usize>) -> String {
    let mut sql = String::with_capacity(128);
    sql.push_str("SELECT ");
    push_names(&mut sql, &table.columns);
    sql.push_str(" FROM ");
    push_quoted(&mut sql, &table.name);
    if key_len > 0 {
        sql.push_str(" WHERE ");
        push_key_cond(&mut sql, table.key_columns().take(key_len), 1);
    }
    if let Some(limit) = limit {
        sql.push_str(" ORDER BY ");
        push_names(&mut sql, table.key_columns());
        sql.push_str(" LIMIT ");
        sql.push_str(&limit.to_string());
    }
    sql
}

fn row_get_on(conn: &Connection, table: &TableSchema, key: &[Value]) -> StoreResult<Option<Row>> {
    let mut stmt = conn.prepare_cached(&select_sql(table, key.len(), None)).map_err(classify)?;
    let params: Vec<SqlValue> = key.iter().map(to_sql).collect();
    let mut rows = stmt.query(rusqlite::params_from_iter(params)).map_err(classify)?;
    match rows.next().map_err(classify)? {
        Some(r) => Ok(Some(read_row(table, r)?)),
        None => Ok(None),
    }
}

fn row_scan_on(conn: &Connection, table: &TableSchema, prefix: &[Value], limit: usize) -> StoreResult<Vec<Row>> {
    let mut stmt = conn
        .prepare_cached(&select_sql(table, prefix.len(), Some(limit)))
        .map_err(classify)?;
    let params: Vec<SqlValue> = prefix.iter().map(to_sql).collect();
    let mut rows = stmt.query(rusqlite::params_from_iter(params)).map_err(classify)?;
    let mut out = Vec::new();
    while let Some(r) = rows.next().map_err(classify)? {
        out.push(read_row(table, r)?);
    }
    Ok(out)
}

/// One business write. Its statement is built into one string (looked up
/// in the statement cache by its text): the committer builds one per
/// write, and a string per column was 3% of its time.
fn apply_write(conn: &Connection, table: &TableSchema, w: &ValidWrite) -> StoreResult<()> {
    let present: Vec<(usize, &Value)> = w
        .values
        .iter()
        .enumerate()
        .filter_map(|(i, v)| v.as_ref().map(|v| (i, v)))
        .collect();
    let name = |i: usize| table.columns.get(i).map_or("", |c| c.name.as_str());
    let is_key = |i: usize| table.primary_key.contains(&i);
    let key_vals = || -> Vec<SqlValue> {
        table
            .primary_key
            .iter()
            .map(|&k| w.values.get(k).cloned().flatten().map_or(SqlValue::Null, |v| to_sql(&v)))
            .collect()
    };
    let describe_key = || -> String {
        table
            .primary_key
            .iter()
            .map(|&k| {
                format!(
                    "{}={}",
                    table.columns.get(k).map_or("?", |c| c.name.as_str()),
                    w.values.get(k).cloned().flatten().unwrap_or(Value::Null)
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut sql = String::with_capacity(160);
    match w.op {
        WriteOp::Insert | WriteOp::Upsert => {
            sql.push_str("INSERT INTO ");
            push_quoted(&mut sql, &table.name);
            sql.push_str(" (");
            push_joined(&mut sql, &present, ", ", |sql, _, (i, _)| push_quoted(sql, name(*i)));
            sql.push_str(") VALUES (");
            push_joined(&mut sql, &present, ", ", |sql, n, _| push_param(sql, n + 1));
            sql.push(')');
            if w.op == WriteOp::Upsert {
                sql.push_str(" ON CONFLICT (");
                push_names(&mut sql, table.key_columns());
                sql.push(')');
                let mut sets = present.iter().filter(|(i, _)| !is_key(*i)).peekable();
                if sets.peek().is_none() {
                    sql.push_str(" DO NOTHING");
                } else {
                    sql.push_str(" DO UPDATE SET ");
                    push_joined(&mut sql, sets, ", ", |sql, _, (i, _)| {
                        push_quoted(sql, name(*i));
                        sql.push_str(" = excluded.");
                        push_quoted(sql, name(*i));
                    });
                }
            }
            let mut stmt = conn.prepare_cached(&sql).map_err(classify)?;
            stmt.execute(rusqlite::params_from_iter(present.iter().map(|(_, v)| to_sql(v))))
                .map_err(|e| match classify(e) {
                    StoreError::WriteRefused(m) => {
                        StoreError::WriteRefused(format!("{:?} into {} ({}): {m}", w.op, table.name, describe_key()))
                    }
                    other => other,
                })?;
        }
        WriteOp::Update => {
            let sets: Vec<(usize, &Value)> = present.iter().filter(|(i, _)| !is_key(*i)).cloned().collect();
            if sets.is_empty() {
                return Ok(());
            }
            sql.push_str("UPDATE ");
            push_quoted(&mut sql, &table.name);
            sql.push_str(" SET ");
            push_joined(&mut sql, &sets, ", ", |sql, n, (i, _)| {
                push_quoted(sql, name(*i));
                sql.push_str(" = ");
                push_param(sql, n + 1);
            });
            sql.push_str(" WHERE ");
            push_key_cond(&mut sql, table.key_columns(), sets.len() + 1);
            let mut params: Vec<SqlValue> = sets.iter().map(|(_, v)| to_sql(v)).collect();
            params.extend(key_vals());
            let mut stmt = conn.prepare_cached(&sql).map_err(classify)?;
            let n = stmt.execute(rusqlite::params_from_iter(params)).map_err(classify)?;
            if n != 1 {
                return Err(StoreError::WriteRefused(format!(
                    "update of {} ({}): no such row",
                    table.name,
                    describe_key()
                )));
            }
        }
        WriteOp::Delete => {
            sql.push_str("DELETE FROM ");
            push_quoted(&mut sql, &table.name);
            sql.push_str(" WHERE ");
            push_key_cond(&mut sql, table.key_columns(), 1);
            let mut stmt = conn.prepare_cached(&sql).map_err(classify)?;
            stmt.execute(rusqlite::params_from_iter(key_vals())).map_err(classify)?;
        }
    }
    Ok(())
}

/// `(queue, count)` rows of a `SELECT queue, COUNT(*) ... GROUP BY queue`.
fn counts_by_queue(c: &Connection, sql: &str) -> StoreResult<Vec<(String, u64)>> {
    let mut stmt = c.prepare_cached(sql).map_err(classify)?;
    let rows = stmt
        .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?.max(0) as u64)))
        .map_err(classify)?;
    rows.collect::<Result<Vec<_>, _>>().map_err(classify)
}

/// A `WHERE` condition on `queue` for a selection, with `?{n}` bound to
/// the returned text.
fn queue_condition(q: Queues<'_>, n: usize) -> (String, String) {
    match q {
        Queues::All => (format!("?{n} = ''"), String::new()),
        Queues::Named(name) => (format!("queue = ?{n}"), name.to_string()),
        Queues::Prefix(p) => (format!("substr(queue, 1, length(?{n})) = ?{n}"), p.to_string()),
    }
}

/// The statements of the commit path ([`commit::Executor`]) on one open
/// SQLite write transaction. They never wait: [`commit::run_now`] drives them.
struct SqliteExec<'c> {
    conn: &'c Connection,
    schema: &'c Schema,
}

impl commit::Executor for SqliteExec<'_> {
    async fn reread(&mut self, read: &ReadRecord) -> StoreResult<Vec<Row>> {
        match read.limit {
            None => Ok(row_get_on(self.conn, &read.table, &read.key)?.into_iter().collect()),
            Some(limit) => row_scan_on(self.conn, &read.table, &read.key, limit),
        }
    }

    async fn delete_leased(&mut self, lease: &Lease) -> StoreResult<u64> {
        let n = self
            .conn
            .prepare_cached("DELETE FROM onceq_messages WHERE id = ?1 AND lease_token = ?2")
            .and_then(|mut s| s.execute(params![lease.message_id, lease.token]))
            .map_err(classify)?;
        Ok(n as u64)
    }

    async fn write(&mut self, w: &ValidWrite) -> StoreResult<()> {
        apply_write(self.conn, table_of(self.schema, w)?, w)
    }

    /// One statement claims a free or expired key; a live claim makes it a
    /// no-op, and then the holder's id is read.
    async fn dedup_claim(&mut self, queue: &str, key: &str, id: &str, window: Duration) -> StoreResult<Option<String>> {
        let claimed = self
            .conn
            .prepare_cached(&format!(
                "INSERT INTO onceq_dedup (queue, dedup_key, message_id, expires_at) VALUES (?1, ?2, ?3, {NOW} + ?4)
                 ON CONFLICT (queue, dedup_key) DO UPDATE SET message_id = excluded.message_id, expires_at = excluded.expires_at
                 WHERE onceq_dedup.expires_at <= {NOW}"
            ))
            .and_then(|mut s| s.execute(params![queue, key, id, micros(window)]))
            .map_err(classify)?;
        if claimed == 1 {
            return Ok(None);
        }
        self.conn
            .prepare_cached("SELECT message_id FROM onceq_dedup WHERE queue = ?1 AND dedup_key = ?2")
            .and_then(|mut s| s.query_row(params![queue, key], |r| r.get(0)))
            .map(Some)
            .map_err(classify)
    }

    async fn message_insert(&mut self, id: &str, p: &SendParams) -> StoreResult<()> {
        if let Some(h) = p.handoff.as_ref().filter(|_| p.delay.is_zero()) {
            // Leased to this host from the start: its first delivery. Its
            // times are bound, read from the clock SQLite's `unixepoch`
            // reads, not computed by SQLite and returned: `RETURNING` runs
            // as a trigger, so the insert opened a statement journal and an
            // ephemeral table for every row, 5% of the committer's time in
            // a CLI run (docs/src/benchmarks.md).
            let enqueued_at = super::now_micros();
            let lease_until = enqueued_at.saturating_add(micros(h.lease));
            self.conn
                .prepare_cached(
                    "INSERT INTO onceq_messages (id, queue, payload, attributes, attempt, enqueued_at, visible_at, lease_token)
                     VALUES (?1, ?2, ?3, ?4, 1, ?5, ?6, ?7)",
                )
                .and_then(|mut s| {
                    s.execute(params![
                        id,
                        p.queue,
                        p.payload,
                        attrs_to_json(&p.attributes),
                        enqueued_at,
                        lease_until,
                        h.token
                    ])
                })
                .map_err(classify)?;
            h.set_landed(Some(super::HandedOff {
                id: id.to_string(),
                enqueued_at,
                lease_until,
            }));
            return Ok(());
        }
        self.conn
            .prepare_cached(&format!(
                "INSERT INTO onceq_messages (id, queue, payload, attributes, attempt, enqueued_at, visible_at) VALUES (?1, ?2, ?3, ?4, 0, {NOW}, {NOW} + ?5)"
            ))
            .and_then(|mut s| s.execute(params![id, p.queue, p.payload, attrs_to_json(&p.attributes), micros(p.delay)]))
            .map_err(classify)?;
        Ok(())
    }

    async fn dedup_hold(&mut self, queue: &str, key: &str, window: Duration) -> StoreResult<()> {
        self.conn
            .prepare_cached(&format!(
                "UPDATE onceq_dedup SET expires_at = {NOW} + ?3 WHERE queue = ?1 AND dedup_key = ?2"
            ))
            .and_then(|mut s| s.execute(params![queue, key, micros(window)]))
            .map_err(classify)?;
        Ok(())
    }
}

fn configure(conn: &Connection, options: &StoreOptions) -> anyhow::Result<()> {
    let sync = match options.sqlite_synchronous.to_ascii_lowercase().as_str() {
        "full" => "FULL",
        "normal" => "NORMAL",
        "off" => "OFF",
        other => anyhow::bail!("sqlite synchronous must be full, normal or off, got {other:?}"),
    };
    // SQLite's own busy handler (sleeps of 1 to 100 ms): measured against
    // one of 50 us to 1 ms, three hosts on one file ran at 750 msg/s with
    // it and 540 with the short sleeps (the waiters took the CPU from the
    // writer on 2 cores); one host alone ran at 920.
    conn.busy_timeout(BUSY_TIMEOUT)?;
    let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        anyhow::bail!("could not switch the database to WAL mode (got {mode})");
    }
    conn.execute_batch(&format!(
        "PRAGMA synchronous = {sync}; PRAGMA foreign_keys = ON; PRAGMA mmap_size = {MMAP_SIZE};"
    ))?;
    conn.set_prepared_statement_cache_capacity(256);
    Ok(())
}

/// Read the business tables (every table not named `onceq_*`).
/// The business tables described by SQLite DDL, read the way a store
/// reads them (for fixtures: the handler test kit).
pub fn schema_from_ddl(ddl: &str) -> anyhow::Result<Schema> {
    super::refuse_reserved_tables(ddl)?;
    let conn = Connection::open_in_memory()?;
    conn.execute_batch(ddl).map_err(|e| anyhow::anyhow!("schema: {e}"))?;
    load_schema(&conn)
}

fn load_schema(conn: &Connection) -> anyhow::Result<Schema> {
    let mut stmt = conn.prepare(
        "SELECT name FROM sqlite_schema WHERE type = 'table' AND name NOT LIKE 'onceq\\_%' ESCAPE '\\' AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\' ORDER BY name",
    )?;
    let names: Vec<String> = stmt.query_map([], |r| r.get(0))?.collect::<Result<_, _>>()?;
    let mut schema = Schema::default();
    for name in names {
        let mut info = conn.prepare(&format!("PRAGMA table_info({})", quote(&name)))?;
        let mut columns = Vec::new();
        let mut pk: Vec<(i64, usize)> = Vec::new();
        let rows = info.query_map([], |r| {
            Ok((
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, i64>(3)?,
                r.get::<_, Option<String>>(4)?,
                r.get::<_, i64>(5)?,
            ))
        })?;
        for (i, row) in rows.enumerate() {
            let (col, decl, notnull, default, pk_pos) = row?;
            let ty = column_type_from_decl(&decl).ok_or_else(|| {
                anyhow::anyhow!(
                    "table {name}: column {col} has type {decl:?}, which onceq cannot map; use one of BOOL, INTEGER, REAL, TEXT, BLOB, JSON, TIMESTAMP"
                )
            })?;
            if pk_pos > 0 {
                pk.push((pk_pos, i));
            }
            columns.push(ColumnSchema {
                name: col,
                ty,
                nullable: notnull == 0 && pk_pos == 0,
                has_default: default.is_some(),
            });
        }
        pk.sort();
        if pk.is_empty() {
            anyhow::bail!("table {name} has no PRIMARY KEY: onceq addresses rows by primary key");
        }
        schema.tables.insert(
            name.clone(),
            TableSchema {
                name,
                columns,
                primary_key: pk.into_iter().map(|(_, i)| i).collect(),
            },
        );
    }
    Ok(schema)
}

impl SqliteStore {
    /// Create (or upgrade) a database: onceq's tables plus the user's DDL.
    pub fn init(path: &Path, business_ddl: &str, options: &StoreOptions) -> anyhow::Result<SqliteStore> {
        use anyhow::Context;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let mut conn = Connection::open(path).with_context(|| format!("opening {}", path.display()))?;
        configure(&conn, options)?;
        // One transaction (SQLite's DDL is transactional): a schema file
        // that fails half-way leaves no table behind.
        let tx = conn.transaction().context("starting the init transaction")?;
        tx.execute_batch(SYSTEM_DDL).context("creating onceq tables")?;
        tx.execute_batch(business_ddl)
            .context("applying the schema file(s); nothing was changed")?;
        // Repair times that overflowed to REAL before delays were bounded
        // (a `u64::MAX` ms delay): they made stats and readiness fail.
        let far = micros(MAX_SCHEDULE);
        tx.execute_batch(&format!(
            "UPDATE onceq_messages SET visible_at = {NOW} + {far} WHERE typeof(visible_at) <> 'integer';
             UPDATE onceq_dedup SET expires_at = {NOW} + {far} WHERE typeof(expires_at) <> 'integer';"
        ))
        .context("repairing overflowed times")?;
        // Types onceq cannot map are refused before anything is kept.
        load_schema(&tx).context("reading the new schema; nothing was changed")?;
        tx.commit().context("committing the init transaction")?;
        drop(conn);
        Self::open(path, options)
    }

    /// Open an existing database created by `onceq init`.
    pub fn open(path: &Path, options: &StoreOptions) -> anyhow::Result<SqliteStore> {
        use anyhow::Context;
        if !path.exists() {
            anyhow::bail!("database {} does not exist: run `onceq init` first", path.display());
        }
        let mut conn = Connection::open(path).with_context(|| format!("opening {}", path.display()))?;
        configure(&conn, options)?;
        let has_tables: bool = conn
            .query_row("SELECT count(*) FROM sqlite_schema WHERE name = 'onceq_messages'", [], |r| {
                r.get::<_, i64>(0)
            })
            .map(|n| n == 1)?;
        if !has_tables {
            anyhow::bail!(
                "{} is not an onceq database (no onceq_messages table): run `onceq init` first",
                path.display()
            );
        }
        // Databases made before processed counts get their table here, and
        // those made before failures were counted apart, the column.
        conn.execute_batch(COUNTS_DDL)
            .with_context(|| format!("adding the processed counts to {}", path.display()))?;
        conn.execute_batch(AUDIT_DDL)
            .with_context(|| format!("adding the audit trail to {}", path.display()))?;
        conn.execute_batch(PAUSED_DDL)
            .with_context(|| format!("adding the paused queues to {}", path.display()))?;
        conn.execute_batch(HOSTS_DDL)
            .with_context(|| format!("adding the hosts table to {}", path.display()))?;
        migrate_failures(&mut conn).with_context(|| format!("adding the failure counts to {}", path.display()))?;
        migrate_lease_index(&mut conn).with_context(|| format!("adding the lease token to the queue index of {}", path.display()))?;
        let schema = load_schema(&conn).with_context(|| format!("reading the schema of {}", path.display()))?;
        // The writer keeps its temporary files in memory (after the
        // migrations above, whose index builds may sort a big queue). A
        // batch commit's savepoint per message makes SQLite journal every
        // page a message touches again after an earlier message of the
        // batch touched it; past 64 KiB that sub-journal spilled to a new
        // file under /var/tmp for every batch: 13.5 of the 16.2 pages a
        // message wrote through the CLI, and a `pwrite` per page
        // (docs/src/benchmarks.md). It is bounded by the batch (at most
        // `commit.max_batch` messages) and freed at its commit.
        conn.execute_batch("PRAGMA temp_store = MEMORY")
            .with_context(|| format!("keeping temporary files of {} in memory", path.display()))?;
        // The committer holds the store weakly: dropping the store stops it.
        let inner = Arc::new_cyclic(|weak: &std::sync::Weak<Inner>| Inner {
            path: path.to_path_buf(),
            writer: tokio::sync::Mutex::new(conn),
            readers: Mutex::new(Vec::new()),
            schema: Arc::new(schema),
            group: Arc::new(commit::Group::new(options.commit, Arc::new(SqliteBatch(weak.clone())))),
            options: options.clone(),
            savepoint_batches: std::sync::atomic::AtomicU32::new(0),
            splits: std::sync::atomic::AtomicU64::new(0),
            lease_asks: Mutex::new(Vec::new()),
            leases_inside: std::sync::atomic::AtomicU64::new(0),
        });
        Ok(SqliteStore { inner })
    }

    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Run `f` in a write transaction (`BEGIN IMMEDIATE`), committing if it
    /// returns `Ok`, rolling back otherwise.
    async fn write<T>(&self, f: impl FnOnce(&Connection) -> StoreResult<T>) -> StoreResult<T> {
        self.inner.write(f).await
    }

    fn read<T>(&self, f: impl FnOnce(&Connection) -> StoreResult<T>) -> StoreResult<T> {
        let conn = self.inner.reader()?;
        let out = f(&conn);
        self.inner.reader_return(conn);
        out
    }
}

/// SQLite's batch commit: one write transaction for the batch. A message
/// whose reads changed (also by an earlier message of the batch: the
/// re-read sees its writes), whose ack finds no row or whose write is
/// refused gets its own error, its effects undone (in the batch run again
/// with a savepoint per message, if it had changed a row: see
/// [`Inner::commit_batch`]); the others commit together, with one fsync.
///
/// Its statements and fsync block: the committer runs them on a thread of
/// its own ([`commit::BatchCommit::blocks`]), so they never stall the
/// runtime's threads running handlers. Leases run there too, inside the
/// next batch's transaction when one is coming ([`Inner::lease`]);
/// renewals and failure records between batches ([`Inner::on_committer`]);
/// sends, reads and the tools' statements take the writer from the async
/// workers.
///
/// The committer holds the store weakly: dropping the store stops it.
struct SqliteBatch(std::sync::Weak<Inner>);

#[async_trait]
impl commit::BatchCommit for SqliteBatch {
    async fn commit_batch(&self, batch: Vec<commit::Pending>) -> Vec<StoreResult<()>> {
        let Some(inner) = self.0.upgrade() else {
            return batch
                .iter()
                .map(|_| Err(StoreError::Unavailable("the store was closed".into())))
                .collect();
        };
        let mut conn = inner.writer.lock().await;
        inner.commit_batch(&mut conn, batch)
    }

    async fn commit_collected(&self, collect: &(dyn Fn() -> Vec<commit::Pending> + Send + Sync)) -> Vec<StoreResult<()>> {
        self.commit_batch(collect()).await
    }

    fn blocks(&self) -> bool {
        true
    }

    async fn rehearse(&self, p: commit::Pending) -> Option<StoreResult<()>> {
        let Some(inner) = self.0.upgrade() else {
            return Some(Err(StoreError::Unavailable("the store was closed".into())));
        };
        let mut conn = inner.writer.lock().await;
        Some(inner.rehearse(&mut conn, &p))
    }
}

/// The verdict of `p`'s effects on a scratch database: in memory, made
/// from `ddl` (the schema files `onceq init` applies) with onceq's own
/// tables, as the store configures its file (foreign keys on), holding
/// `rows` (a test case's fixture; the columns left NULL are left out, so
/// their DEFAULT applies). Then `p` is applied and committed there, so
/// deferred constraints are checked too. `onceq test` and the handler
/// test kit give it: the verdict of the real commit path on the same data.
pub fn rehearse_on_scratch(
    ddl: &str,
    schema: &Schema,
    rows: &std::collections::BTreeMap<String, Vec<Row>>,
    p: &commit::Pending,
) -> StoreResult<()> {
    let scratch = |what: &str, e: rusqlite::Error| StoreError::Permanent(format!("the scratch database for the case: {what}: {e}"));
    let mut conn = Connection::open_in_memory().map_err(|e| scratch("opening it", e))?;
    conn.execute_batch("PRAGMA foreign_keys = ON")
        .and_then(|()| conn.execute_batch(SYSTEM_DDL))
        .and_then(|()| conn.execute_batch(ddl))
        .map_err(|e| scratch("the schema files", e))?;
    let fixture = conn.transaction().map_err(|e| scratch("starting it", e))?;
    for (table, rows) in rows {
        let t = schema.table(table).map_err(|e| StoreError::Permanent(e.to_string()))?;
        for row in rows {
            let w = ValidWrite {
                table: table.clone(),
                op: WriteOp::Insert,
                values: row
                    .iter()
                    .map(|(_, v)| Some(v.clone()).filter(|v| !matches!(v, Value::Null)))
                    .collect(),
            };
            apply_write(&fixture, t, &w).map_err(|e| StoreError::Permanent(format!("the case's rows do not fit the schema files: {e}")))?;
        }
    }
    fixture
        .commit()
        .map_err(|e| StoreError::Permanent(format!("the case's rows do not fit the schema files: {e}")))?;
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(classify)?;
    let mut ex = SqliteExec { conn: &tx, schema };
    commit::run_now(commit::apply(&mut ex, p, Duration::from_secs(3600)))?;
    tx.commit().map_err(classify)
}

/// Run `f` in a write transaction (`BEGIN IMMEDIATE`) on the writer,
/// committing if it returns `Ok`, rolling back otherwise.
fn write_on<T>(conn: &mut Connection, f: impl FnOnce(&Connection) -> StoreResult<T>) -> StoreResult<T> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(classify)?;
    let out = f(&tx)?; // dropping `tx` on error rolls back
    tx.commit().map_err(|e| match classify(e) {
        // A commit that fails for I/O reasons may or may not be durable.
        StoreError::Permanent(m) => StoreError::UnknownOutcome(m),
        other => other,
    })?;
    Ok(out)
}

/// Why a batch's transaction was given up.
enum BatchLost {
    /// A message failed after it had changed a row, in a batch run
    /// without savepoints: nothing to roll it back to alone. The batch is
    /// run again with a savepoint per message.
    Unisolated(StoreError),
    /// The batch failed as a whole, not message by message (the
    /// transaction ended under a savepoint, a savepoint could not be
    /// rolled back, the commit was refused): its messages are committed
    /// again alone.
    Whole(StoreError),
}

impl From<StoreError> for BatchLost {
    fn from(e: StoreError) -> Self {
        BatchLost::Whole(e)
    }
}

/// After a batch without savepoints had to be redone, how many batches
/// run with them: a handler whose writes are refused is seldom refused
/// once, and each redo costs a batch's statements twice.
const SAVEPOINT_BATCHES_AFTER_REDO: u32 = 64;

/// Add the batch's acks to the processed counts, in its transaction.
fn count_processed(tx: &Connection, batch: &[commit::Pending], results: &[StoreResult<()>]) -> StoreResult<()> {
    for (queue, n) in commit::processed_by_queue(batch, results) {
        tx.prepare_cached(&format!(
            "INSERT INTO onceq_counts (queue, processed, last_at) VALUES (?1, ?2, {NOW})
             ON CONFLICT (queue) DO UPDATE SET processed = processed + excluded.processed, last_at = excluded.last_at"
        ))
        .and_then(|mut st| st.execute(params![queue, n]))
        .map_err(classify)?;
    }
    Ok(())
}

impl Inner {
    /// One write transaction for the batch. It first runs without a
    /// savepoint per message: a savepoint copies every page it touches to
    /// a sub-journal, about a tenth of the committer's time
    /// (docs/src/benchmarks.md). A message that fails before it changed a
    /// row needs nothing undone; one that fails after (its ack landed,
    /// then its write was refused) cannot be undone alone, so the batch is
    /// rolled back and run again with a savepoint per message, and so are
    /// the next [`SAVEPOINT_BATCHES_AFTER_REDO`] batches. If the batch as
    /// a whole fails ([`BatchLost::Whole`]), every message is committed
    /// again alone, so each gets the verdict of its own effects.
    fn commit_batch(&self, conn: &mut Connection, batch: Vec<commit::Pending>) -> Vec<StoreResult<()>> {
        use std::sync::atomic::Ordering::Relaxed;
        // One batch fewer with savepoints, never below zero.
        let savepoints = self.savepoint_batches.fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1)).is_ok();
        let mut outcome = self.commit_together(conn, &batch, savepoints);
        if let Err(BatchLost::Unisolated(why)) = &outcome {
            tracing::debug!(
                messages = batch.len(),
                "a message failed after it changed a row ({why}); running the batch again with a savepoint per message"
            );
            self.savepoint_batches.store(SAVEPOINT_BATCHES_AFTER_REDO, Relaxed);
            outcome = self.commit_together(conn, &batch, true);
        }
        match outcome {
            Ok(results) => results,
            Err(BatchLost::Whole(why) | BatchLost::Unisolated(why)) => {
                tracing::debug!(
                    messages = batch.len(),
                    "batch commit failed as a whole ({why}); committing each message alone"
                );
                self.splits.fetch_add(1, Relaxed);
                batch.iter().map(|p| self.commit_alone(conn, p)).collect()
            }
        }
    }

    /// The batch in one transaction; with `savepoints`, one per message
    /// (see [`Self::commit_batch`]).
    fn commit_together(
        &self,
        conn: &mut Connection,
        batch: &[commit::Pending],
        savepoints: bool,
    ) -> Result<Vec<StoreResult<()>>, BatchLost> {
        let tx = match conn.transaction_with_behavior(TransactionBehavior::Immediate) {
            Ok(tx) => tx,
            // Nothing started (the file is busy, say): every message gets
            // the error, and the protocol re-runs it.
            Err(e) => {
                let e = classify(e);
                return Ok(batch.iter().map(|_| Err(e.clone())).collect());
            }
        };
        let window = self.options.dedup_window;
        let mut results = Vec::with_capacity(batch.len());
        // The savepoint statements are prepared once (`prepare_cached`):
        // parsed again for every message, they cost more than a message's
        // own statements.
        let run = |sql: &str| -> Result<(), BatchLost> {
            tx.prepare_cached(sql)
                .and_then(|mut s| s.execute([]))
                .map(drop)
                .map_err(|e| BatchLost::Whole(classify(e)))
        };
        for p in batch {
            let changed_before = if savepoints {
                run("SAVEPOINT onceq_message")?;
                0
            } else {
                tx.total_changes()
            };
            let mut ex = SqliteExec {
                conn: &tx,
                schema: &self.schema,
            };
            let r = commit::run_now(commit::apply(&mut ex, p, window));
            // A statement can end the whole transaction, not only itself: a
            // trigger's RAISE(ROLLBACK), a constraint declared ON CONFLICT
            // ROLLBACK, some I/O errors. The messages before it are gone
            // with it.
            if tx.is_autocommit() {
                return Err(BatchLost::Whole(
                    r.err().unwrap_or_else(|| StoreError::Permanent("the transaction ended".into())),
                ));
            }
            match (&r, savepoints) {
                (Ok(()), true) => run("RELEASE onceq_message")?,
                (Err(_), true) => {
                    run("ROLLBACK TO onceq_message")?;
                    run("RELEASE onceq_message")?;
                }
                (Ok(()), false) => {}
                // Failed before it changed a row (a failed statement undoes
                // itself): nothing to undo.
                (Err(_), false) if tx.total_changes() == changed_before => {}
                // Its ack or a write landed before it failed, with nothing
                // to roll back to.
                (Err(e), false) => return Err(BatchLost::Unisolated(e.clone())),
            }
            results.push(r);
        }
        count_processed(&tx, batch, &results)?;
        let leased = self.lease_inside(&tx)?;
        match tx.commit() {
            Ok(()) => {
                self.leases_inside
                    .fetch_add(leased.len() as u64, std::sync::atomic::Ordering::Relaxed);
                for (ask, messages) in leased {
                    let _ = ask.answer.send(Ok(messages));
                }
                Ok(results)
            }
            Err(e) => {
                // Not committed, or not known to be: run again (a lease
                // that landed all the same keeps its messages until it
                // expires, as a lost answer would).
                self.ask_again(leased.into_iter().map(|(ask, _)| ask));
                match classify(e) {
                    // A commit that fails for I/O reasons may or may not be
                    // durable: every message is re-run, and its ack decides.
                    StoreError::Permanent(m) => Ok(results
                        .into_iter()
                        .map(|r| r.and(Err(StoreError::UnknownOutcome(m.clone()))))
                        .collect()),
                    // Refused at commit (a deferred foreign key, say): whose
                    // effects, only the messages alone can tell.
                    other => Err(BatchLost::Whole(other)),
                }
            }
        }
    }

    /// Lease up to `p.limit` messages of `p.queue`, on the committer: inside
    /// the transaction of a batch of message commits when one is coming,
    /// else in a transaction of its own.
    ///
    /// The ask waits in `lease_asks`, and a job on the committer serves it.
    /// When commits are queued, the job leaves it to their batch: the batch
    /// runs every waiting lease after its messages and answers them once it
    /// committed. A lease in a transaction of its own wrote its own WAL
    /// frames (the same queue pages the batch wrote again a moment later),
    /// and its BEGIN and COMMIT: 12% of the committer's samples through
    /// the CLI, and 18.6% fewer samples in all once leases rode in the
    /// batches (docs/src/benchmarks.md).
    ///
    /// With no commit queued, the job serves it at once, with every other
    /// lease waiting then, in one transaction ([`Self::serve_asks`]). When
    /// the batch left it (one that failed as a whole puts its leases back),
    /// a second job does: a lease is deferred once at most, so it never
    /// waits on a batch that does not come. A lease inside a batch is as
    /// durable as its messages; one of its own is undurable, as before
    /// ([`Self::write_undurable`]).
    async fn lease(self: &Arc<Self>, params: LeaseParams) -> StoreResult<Vec<LeasedMessage>> {
        use tokio::sync::oneshot::error::TryRecvError;
        let token = random_id();
        let (answer, mut answered) = tokio::sync::oneshot::channel();
        self.asks().push(LeaseAsk {
            params,
            token: token.clone(),
            answer,
        });
        for batch_may_serve in [true, false] {
            let inner = self.clone();
            if let Err(e) = self.group.run(async move { inner.serve_asks(batch_may_serve).await }).await {
                self.asks().retain(|a| a.token != token);
                // A batch may have run it before the committer stopped.
                return answered.try_recv().unwrap_or(Err(e));
            }
            match answered.try_recv() {
                Ok(leased) => return leased,
                Err(TryRecvError::Empty) => {}
                Err(TryRecvError::Closed) => break,
            }
        }
        // The second job serves every lease still waiting: none is left.
        self.asks().retain(|a| a.token != token);
        Err(StoreError::Invariant("a lease was left unanswered".into()))
    }

    fn asks(&self) -> std::sync::MutexGuard<'_, Vec<LeaseAsk>> {
        self.lease_asks.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Run the leases waiting, in one undurable transaction, and answer
    /// them; with `batch_may_serve`, leave them to the next batch when
    /// commits are queued (see [`Self::lease`]).
    async fn serve_asks(&self, batch_may_serve: bool) -> StoreResult<()> {
        if self.asks().is_empty() || (batch_may_serve && self.group.commits_queued() > 0) {
            return Ok(());
        }
        let mut conn = self.writer.lock().await;
        let asks = std::mem::take(&mut *self.asks());
        if asks.is_empty() {
            return Ok(());
        }
        let run = self.undurable(&mut conn, |c| {
            Ok(asks.iter().map(|a| lease_rows(c, &a.params, &a.token)).collect::<Vec<_>>())
        });
        match run {
            Ok(results) => {
                for (ask, leased) in asks.into_iter().zip(results) {
                    let _ = ask.answer.send(leased);
                }
            }
            Err(e) => {
                for ask in asks {
                    let _ = ask.answer.send(Err(e.clone()));
                }
            }
        }
        Ok(())
    }

    /// The leases waiting, run in a batch's transaction `tx`; those whose
    /// statement failed wait again, and so do all of them if a statement
    /// ended the transaction (the batch is then lost as a whole).
    fn lease_inside(&self, tx: &Connection) -> Result<Vec<(LeaseAsk, Vec<LeasedMessage>)>, BatchLost> {
        let asks = std::mem::take(&mut *self.asks());
        let mut leased = Vec::with_capacity(asks.len());
        let mut again = Vec::new();
        for ask in asks {
            match lease_rows(tx, &ask.params, &ask.token) {
                Ok(messages) => leased.push((ask, messages)),
                Err(_) => again.push(ask),
            }
        }
        if tx.is_autocommit() {
            self.ask_again(leased.into_iter().map(|(ask, _)| ask).chain(again));
            return Err(BatchLost::Whole(StoreError::Permanent(
                "the transaction ended during its leases".into(),
            )));
        }
        self.ask_again(again);
        Ok(leased)
    }

    /// Leases a batch ran but did not commit: waiting again, first.
    fn ask_again(&self, asks: impl IntoIterator<Item = LeaseAsk>) {
        let mut waiting = self.asks();
        let later = std::mem::take(&mut *waiting);
        waiting.extend(asks);
        waiting.extend(later);
    }

    /// [`Self::commit_alone`] rolled back at the end: the verdict without
    /// the commit. A constraint deferred to the commit (a foreign key
    /// declared `DEFERRABLE INITIALLY DEFERRED`) is not seen.
    fn rehearse(&self, conn: &mut Connection, p: &commit::Pending) -> StoreResult<()> {
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(classify)?;
        let mut ex = SqliteExec {
            conn: &tx,
            schema: &self.schema,
        };
        commit::run_now(commit::apply(&mut ex, p, self.options.dedup_window))
        // dropping `tx` rolls back
    }

    /// One message in a write transaction of its own: its result is the
    /// verdict of its own effects.
    fn commit_alone(&self, conn: &mut Connection, p: &commit::Pending) -> StoreResult<()> {
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(classify)?;
        let mut ex = SqliteExec {
            conn: &tx,
            schema: &self.schema,
        };
        commit::run_now(commit::apply(&mut ex, p, self.options.dedup_window))?; // dropping `tx` rolls back
        count_processed(&tx, std::slice::from_ref(p), &[Ok(())])?;
        tx.commit().map_err(|e| match classify(e) {
            // A commit that fails for I/O reasons may or may not be durable.
            StoreError::Permanent(m) => StoreError::UnknownOutcome(m),
            other => other,
        })
    }

    /// [`Self::write`] for what may be lost on a power failure without
    /// breaking exactly-once: a lease or its renewal. Lost, the message is
    /// simply visible again (its attempt count one lower), and the old
    /// token acks nothing. So its commit does not wait for an fsync
    /// (`synchronous = NORMAL` for this transaction when the database runs
    /// FULL); the next durable commit syncs the write-ahead log, this one
    /// included. A crash of the process loses nothing (the operating
    /// system has the write): only an OS crash or a power cut can. Leases
    /// were otherwise a third of all fsyncs, each stalling an async worker
    /// thread (docs/src/benchmarks.md).
    ///
    /// It runs on the committer's thread, between two batches
    /// ([`commit::Group::run`]).
    async fn write_undurable<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&Connection) -> StoreResult<T> + Send + 'static,
    ) -> StoreResult<T> {
        let inner = self.clone();
        self.group
            .run(async move {
                let mut conn = inner.writer.lock().await;
                inner.undurable(&mut conn, f)
            })
            .await
    }

    /// [`Self::write`], run on the committer between two batches: the
    /// failure records (retry later, dead letter, release) take the write
    /// lock where the batches take it, not beside them.
    async fn on_committer<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&Connection) -> StoreResult<T> + Send + 'static,
    ) -> StoreResult<T> {
        let inner = self.clone();
        self.group.run(async move { write_on(&mut *inner.writer.lock().await, f) }).await
    }

    fn undurable<T>(&self, conn: &mut Connection, f: impl FnOnce(&Connection) -> StoreResult<T>) -> StoreResult<T> {
        let full = self.options.sqlite_synchronous.eq_ignore_ascii_case("full");
        if full {
            conn.execute_batch("PRAGMA synchronous = NORMAL").map_err(classify)?;
        }
        let out = write_on(conn, f);
        if full {
            if let Err(e) = conn.execute_batch("PRAGMA synchronous = FULL") {
                // Never leave the writer undurable for the commits after.
                tracing::error!("restoring synchronous = FULL failed: {e}");
                return Err(StoreError::Permanent(format!("restoring synchronous = FULL: {e}")));
            }
        }
        out
    }

    async fn write<T>(&self, f: impl FnOnce(&Connection) -> StoreResult<T>) -> StoreResult<T> {
        write_on(&mut *self.writer.lock().await, f)
    }

    fn reader(&self) -> StoreResult<Connection> {
        let pooled = self.readers.lock().ok().and_then(|mut p| p.pop());
        if let Some(c) = pooled {
            return Ok(c);
        }
        let c = Connection::open(&self.path).map_err(classify)?;
        c.busy_timeout(BUSY_TIMEOUT).map_err(classify)?;
        // Not mapped: another connection's commit resets a reader's page
        // cache, and a mapped reader then unmaps the whole file at its next
        // read transaction and maps it again (an munmap, with TLB
        // shootdowns on the other cores, per handler read: 2.8% of a CLI
        // run's CPU in `unixUnmapfile`). Re-reading a few B-tree pages
        // with `pread` costs less (docs/src/benchmarks.md).
        c.execute_batch("PRAGMA mmap_size = 0;").map_err(classify)?;
        c.set_prepared_statement_cache_capacity(256);
        Ok(c)
    }

    fn reader_return(&self, conn: Connection) {
        if conn.is_autocommit() {
            if let Ok(mut p) = self.readers.lock() {
                p.push(conn);
            }
        }
    }
}

#[async_trait]
impl Store for SqliteStore {
    fn kind(&self) -> &'static str {
        "sqlite"
    }

    fn commit_stats(&self) -> Option<commit::CommitStats> {
        let mut stats = self.inner.group.stats();
        stats.split_batches = self.inner.splits.load(std::sync::atomic::Ordering::Relaxed);
        stats.leases_in_batches = self.inner.leases_inside.load(std::sync::atomic::Ordering::Relaxed);
        Some(stats)
    }

    fn handoff(&self) -> bool {
        self.inner.options.commit.handoff
    }

    fn commit_observe(&self, observer: commit::BatchObserver) {
        self.inner.group.observe(observer)
    }

    fn schema(&self) -> Arc<Schema> {
        self.inner.schema.clone()
    }

    async fn message_send(&self, params: Vec<SendParams>) -> StoreResult<Vec<SendOutcome>> {
        let window = self.inner.options.dedup_window;
        let schema = self.inner.schema.clone();
        self.write(|c| {
            let mut ex = SqliteExec { conn: c, schema: &schema };
            params.iter().map(|p| commit::run_now(commit::send(&mut ex, p, window))).collect()
        })
        .await
    }

    async fn message_lease(&self, p: LeaseParams) -> StoreResult<Vec<LeasedMessage>> {
        let mut leased = self.inner.lease(p).await?;
        super::oldest_first(&mut leased);
        Ok(leased)
    }

    async fn message_lease_collected(
        &self,
        queue: &str,
        lease: Duration,
        collect: &(dyn Fn() -> usize + Send + Sync),
    ) -> StoreResult<Vec<LeasedMessage>> {
        self.message_lease(LeaseParams {
            queue: queue.to_owned(),
            limit: collect(),
            lease,
        })
        .await
    }

    async fn message_lease_renew(&self, leases: &[Lease], duration: Duration) -> StoreResult<Vec<bool>> {
        let sql = format!("UPDATE onceq_messages SET visible_at = {NOW} + ?3 WHERE id = ?1 AND lease_token = ?2");
        let leases = leases.to_vec();
        self.inner
            .write_undurable(move |c| {
                let mut stmt = c.prepare_cached(&sql).map_err(classify)?;
                leases
                    .iter()
                    .map(|l| {
                        stmt.execute(params![l.message_id, l.token, micros(duration)])
                            .map(|n| n == 1)
                            .map_err(classify)
                    })
                    .collect()
            })
            .await
    }

    async fn message_release(&self, lease: &Lease) -> StoreResult<()> {
        self.guarded_update(
            lease,
            &format!("visible_at = {NOW}, lease_token = NULL, attempt = MAX(attempt - 1, 0)"),
            None,
            None,
        )
        .await
    }

    async fn message_retry_later(&self, lease: &Lease, p: RetryParams) -> StoreResult<()> {
        let failures = if p.failed { "failures = failures + 1, " } else { "" };
        self.guarded_update(
            lease,
            &format!("{failures}visible_at = {NOW} + ?3, lease_token = NULL, last_error = ?4"),
            Some(SqlValue::Integer(micros(p.delay))),
            Some(SqlValue::Text(p.reason)),
        )
        .await
    }

    async fn message_dead_letter(&self, lease: &Lease, p: DeadLetterParams) -> StoreResult<()> {
        let lease = lease.clone();
        self.inner.on_committer(move |c| {
            let n = c
                .prepare_cached(&format!(
                    "INSERT INTO onceq_dead_letters (id, queue, payload, attributes, attempts, enqueued_at, failed_at, reason, handler_version, failures)
                     SELECT id, queue, payload, attributes, attempt, enqueued_at, {NOW}, ?3, ?4, failures + ?5 FROM onceq_messages
                     WHERE id = ?1 AND lease_token = ?2
                     ON CONFLICT (id) DO UPDATE SET failed_at = excluded.failed_at, reason = excluded.reason,
                        attempts = excluded.attempts, handler_version = excluded.handler_version, failures = excluded.failures"
                ))
                .and_then(|mut s| s.execute(params![lease.message_id, lease.token, p.reason, p.handler_version, i64::from(p.failed)]))
                .map_err(classify)?;
            if n != 1 {
                return Err(StoreError::LeaseLost { message_id: lease.message_id.clone() });
            }
            c.prepare_cached("DELETE FROM onceq_messages WHERE id = ?1 AND lease_token = ?2")
                .and_then(|mut s| s.execute(params![lease.message_id, lease.token]))
                .map_err(classify)?;
            Ok(())
        })
        .await
    }

    async fn commit_hold(&self) -> StoreResult<Option<commit::Hold>> {
        self.inner.group.hold().await.map(Some)
    }

    async fn close(&self) {
        self.inner.group.stop().await
    }

    async fn transaction_begin(&self) -> StoreResult<Box<dyn Transaction>> {
        let snapshot = SqliteSnapshot {
            inner: self.inner.clone(),
            reader: None,
        };
        Ok(Box::new(commit::Buffered::new(snapshot, self.inner.group.clone())))
    }

    async fn write_check(&self) -> StoreResult<()> {
        // On the writer, in turn with this host's own writes (so only
        // another process can hold the lock), trying without SQLite's busy
        // handler and pausing between tries, so no thread blocks.
        // The bound starts before waiting for the writer: while another
        // process holds the lock, this host's own writer may be the one
        // waiting for it (a lease, a commit, in SQLite's busy handler).
        let deadline = tokio::time::Instant::now() + WRITE_CHECK_WITHIN;
        let Ok(writer) = tokio::time::timeout_at(deadline, self.inner.writer.lock()).await else {
            return Err(StoreError::Unavailable(format!(
                "the database's write lock was not free for {}s (this host's own writer waited for it all along): is another process holding it?",
                WRITE_CHECK_WITHIN.as_secs()
            )));
        };
        writer.busy_timeout(Duration::ZERO).map_err(classify)?;
        let out = loop {
            match writer.execute_batch("BEGIN IMMEDIATE; ROLLBACK").map_err(classify) {
                Ok(()) => break Ok(()),
                Err(StoreError::Unavailable(m)) if tokio::time::Instant::now() >= deadline => {
                    break Err(StoreError::Unavailable(format!(
                        "the database's write lock was not free for {}s ({m}): is another process holding it?",
                        WRITE_CHECK_WITHIN.as_secs()
                    )))
                }
                Err(StoreError::Unavailable(_)) => tokio::time::sleep(Duration::from_millis(20)).await,
                Err(e) => break Err(e),
            }
        };
        writer.busy_timeout(BUSY_TIMEOUT).map_err(classify)?;
        out
    }

    async fn stats(&self) -> StoreResult<Stats> {
        self.read(|c| {
            let mut by_queue: std::collections::BTreeMap<String, QueueStats> = Default::default();
            // Queue by queue, by range of the (queue, visible_at,
            // lease_token) index alone: the queues found by skipping along
            // it, then what is due and what is not. One `GROUP BY` over
            // the table read every message's row (220 ms on 1,000,000).
            let mut next_queue = c
                .prepare_cached("SELECT queue FROM onceq_messages WHERE queue > ?1 ORDER BY queue LIMIT 1")
                .map_err(classify)?;
            let mut due = c
                .prepare_cached(&format!(
                    "SELECT COUNT(*), COUNT(lease_token) FROM onceq_messages WHERE queue = ?1 AND visible_at <= {NOW}"
                ))
                .map_err(classify)?;
            let mut later = c
                .prepare_cached(&format!(
                    "SELECT COUNT(lease_token), COUNT(*) - COUNT(lease_token),
                            MIN(CASE WHEN lease_token IS NULL THEN (visible_at - {NOW}) / 1000 END)
                     FROM onceq_messages WHERE queue = ?1 AND visible_at > {NOW}"
                ))
                .map_err(classify)?;
            let mut after = String::new();
            while let Some(q) = next_queue
                .query_row([&after], |r| r.get::<_, String>(0))
                .optional()
                .map_err(classify)?
            {
                let (ready, expired) = due
                    .query_row([&q], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?)))
                    .map_err(classify)?;
                let (leased, delayed, next_due) = later
                    .query_row([&q], |r| {
                        Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?, r.get::<_, Option<i64>>(2)?))
                    })
                    .map_err(classify)?;
                let e = queue_entry(&mut by_queue, q.clone());
                e.ready = ready as u64;
                e.leased = leased as u64;
                e.delayed = delayed as u64;
                e.next_due_ms = next_due.map(|ms| ms.max(0) as u64);
                e.expired_leases = expired as u64;
                after = q;
            }
            let mut stmt = c
                .prepare_cached("SELECT queue, processed, last_at FROM onceq_counts")
                .map_err(classify)?;
            let rows = stmt
                .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?, r.get::<_, i64>(2)?)))
                .map_err(classify)?;
            for row in rows {
                let (q, n, at) = row.map_err(classify)?;
                let e = queue_entry(&mut by_queue, q);
                e.processed = n.max(0) as u64;
                e.last_processed_at = Some(at);
            }
            for (q, n) in counts_by_queue(c, "SELECT queue, COUNT(*) FROM onceq_dead_letters GROUP BY queue")? {
                queue_entry(&mut by_queue, q).dead = n;
            }
            for (q, n) in counts_by_queue(
                c,
                &format!("SELECT queue, COUNT(*) FROM onceq_dedup WHERE expires_at > {NOW} GROUP BY queue"),
            )? {
                queue_entry(&mut by_queue, q).dedup_keys = n;
            }
            Ok(Stats {
                queues: by_queue.into_values().collect(),
            })
        })
    }

    async fn dead_letter_list(&self, queues: Queues<'_>, limit: usize) -> StoreResult<Vec<DeadLetter>> {
        let (cond, q) = queue_condition(queues, 1);
        self.read(|c| {
            let mut stmt = c
                .prepare_cached(&format!(
                    "SELECT {DEAD_COLUMNS}
                     FROM onceq_dead_letters WHERE {cond} ORDER BY failed_at DESC, id LIMIT ?2"
                ))
                .map_err(classify)?;
            let rows = stmt
                .query_map(params![q, limit.min(i64::MAX as usize) as i64], dead_letter_from_row)
                .map_err(classify)?;
            rows.collect::<Result<Vec<_>, _>>().map_err(classify)
        })
    }

    async fn dead_letter_get(&self, id: &str) -> StoreResult<Option<DeadLetter>> {
        self.read(|c| {
            c.prepare_cached(&format!("SELECT {DEAD_COLUMNS} FROM onceq_dead_letters WHERE id = ?1"))
                .and_then(|mut s| s.query_row(params![id], dead_letter_from_row).optional())
                .map_err(classify)
        })
    }

    async fn dead_letter_settle(&self, id: &str, how: Settle, audit: Option<&AuditEntry>) -> StoreResult<Option<String>> {
        self.write(|c| {
            if how == Settle::Replay {
                let n = c
                    .prepare_cached(&format!(
                        "INSERT INTO onceq_messages (id, queue, payload, attributes, attempt, enqueued_at, visible_at, failures)
                         SELECT id, queue, payload, attributes, 0, enqueued_at, {NOW}, 0 FROM onceq_dead_letters WHERE id = ?1"
                    ))
                    .and_then(|mut s| s.execute(params![id]))
                    .map_err(classify)?;
                if n == 0 {
                    return Ok(None);
                }
            }
            let n = c
                .prepare_cached("DELETE FROM onceq_dead_letters WHERE id = ?1")
                .and_then(|mut s| s.execute(params![id]))
                .map_err(classify)?;
            if n == 0 {
                return Ok(None);
            }
            if let Some(e) = audit {
                audit_insert(c, e)?;
            }
            Ok(Some(id.to_string()))
        })
        .await
    }

    async fn audit_append(&self, entry: &AuditEntry) -> StoreResult<()> {
        self.write(|c| audit_insert(c, entry)).await
    }

    async fn message_browse(
        &self,
        queue: &str,
        state: LiveState,
        after: Option<&BrowseKey>,
        limit: usize,
    ) -> StoreResult<Vec<QueuedMessage>> {
        let cond = match state {
            LiveState::Ready => format!("visible_at <= {NOW}"),
            LiveState::Delayed => format!("visible_at > {NOW} AND lease_token IS NULL"),
            LiveState::Leased => format!("visible_at > {NOW} AND lease_token IS NOT NULL"),
        };
        let (at, id) = after.map_or((i64::MIN, ""), |k| (k.at, k.id.as_str()));
        self.read(|c| {
            // `visible_at >= ?2` bounds the index range; the OR only breaks
            // ties within one microsecond.
            let mut stmt = c
                .prepare_cached(&format!(
                    "SELECT {QUEUED_COLUMNS} FROM onceq_messages
                     WHERE queue = ?1 AND {cond} AND visible_at >= ?2 AND (visible_at > ?2 OR id > ?3)
                     ORDER BY visible_at, id LIMIT ?4"
                ))
                .map_err(classify)?;
            let rows = stmt
                .query_map(params![queue, at, id, limit.min(i64::MAX as usize) as i64], queued_from_row)
                .map_err(classify)?;
            rows.collect::<Result<Vec<_>, _>>().map_err(classify)
        })
    }

    async fn dead_letter_browse(&self, queue: &str, after: Option<&BrowseKey>, limit: usize) -> StoreResult<Vec<DeadLetter>> {
        let (at, id) = after.map_or((i64::MAX, ""), |k| (k.at, k.id.as_str()));
        self.read(|c| {
            let mut stmt = c
                .prepare_cached(&format!(
                    "SELECT {DEAD_COLUMNS} FROM onceq_dead_letters
                     WHERE queue = ?1 AND failed_at <= ?2 AND (failed_at < ?2 OR id > ?3)
                     ORDER BY failed_at DESC, id LIMIT ?4"
                ))
                .map_err(classify)?;
            let rows = stmt
                .query_map(params![queue, at, id, limit.min(i64::MAX as usize) as i64], dead_letter_from_row)
                .map_err(classify)?;
            rows.collect::<Result<Vec<_>, _>>().map_err(classify)
        })
    }

    async fn queue_pause(&self, queue: &str, pause: bool, audit: Option<&AuditEntry>) -> StoreResult<bool> {
        let by = audit.map_or_else(local_actor, |e| e.actor.clone());
        self.write(|c| {
            let n = if pause {
                c.prepare_cached(&format!(
                    "INSERT INTO onceq_paused (queue, paused_at, actor) VALUES (?1, {NOW}, ?2) ON CONFLICT (queue) DO NOTHING"
                ))
                .and_then(|mut s| s.execute(params![queue, by]))
            } else {
                c.prepare_cached("DELETE FROM onceq_paused WHERE queue = ?1")
                    .and_then(|mut s| s.execute(params![queue]))
            }
            .map_err(classify)?;
            if let Some(e) = audit {
                audit_insert(c, e)?;
            }
            Ok(n > 0)
        })
        .await
    }

    async fn queue_paused(&self) -> StoreResult<Vec<PausedQueue>> {
        self.read(|c| {
            let mut stmt = c
                .prepare_cached("SELECT queue, paused_at, actor FROM onceq_paused ORDER BY queue")
                .map_err(classify)?;
            let rows = stmt
                .query_map([], |r| {
                    Ok(PausedQueue {
                        queue: r.get(0)?,
                        paused_at: r.get(1)?,
                        by: r.get(2)?,
                    })
                })
                .map_err(classify)?;
            rows.collect::<Result<Vec<_>, _>>().map_err(classify)
        })
    }

    async fn host_beat(&self, beat: &HostBeat) -> StoreResult<()> {
        let queues = serde_json::to_string(&beat.queues).unwrap_or_else(|_| "[]".into());
        let beat = beat.clone();
        // A heartbeat is not worth an fsync: a lost one is the next's.
        self.inner
            .write_undurable(move |c| {
                c.prepare_cached(&format!(
                    "INSERT INTO onceq_hosts (id, name, pid, version, started_at, seen_at, queues, in_flight, finished)
                     VALUES (?1, ?2, ?3, ?4, ?5, {NOW}, ?6, ?7, ?8)
                     ON CONFLICT (id) DO UPDATE SET seen_at = excluded.seen_at, queues = excluded.queues,
                         in_flight = excluded.in_flight, finished = excluded.finished"
                ))
                .and_then(|mut s| {
                    s.execute(params![
                        beat.id,
                        beat.name,
                        beat.pid,
                        beat.version,
                        beat.started_at,
                        queues,
                        beat.in_flight,
                        beat.finished
                    ])
                })
                .map_err(classify)?;
                Ok(())
            })
            .await
    }

    async fn hosts_seen(&self, within: Duration) -> StoreResult<Vec<HostBeat>> {
        let within = micros(within);
        self.read(|c| {
            let mut stmt = c
                .prepare_cached(&format!(
                    "SELECT id, name, pid, version, started_at, seen_at, queues, in_flight, finished FROM onceq_hosts
                     WHERE seen_at >= {NOW} - ?1 ORDER BY seen_at DESC, id"
                ))
                .map_err(classify)?;
            let rows = stmt
                .query_map(params![within], |r| {
                    Ok(HostBeat {
                        id: r.get(0)?,
                        name: r.get(1)?,
                        pid: r.get(2)?,
                        version: r.get(3)?,
                        started_at: r.get(4)?,
                        seen_at: r.get(5)?,
                        queues: serde_json::from_str(&r.get::<_, String>(6)?).unwrap_or_default(),
                        in_flight: r.get(7)?,
                        finished: r.get(8)?,
                    })
                })
                .map_err(classify)?;
            rows.collect::<Result<Vec<_>, _>>().map_err(classify)
        })
    }

    async fn audit_list(&self, queues: Queues<'_>, limit: usize) -> StoreResult<Vec<AuditEntry>> {
        let (cond, q) = queue_condition(queues, 1);
        self.read(|c| {
            let mut stmt = c
                .prepare_cached(&format!(
                    "SELECT at_us, actor, action, queue, subject, signer, result FROM onceq_audit WHERE {cond} ORDER BY seq DESC LIMIT ?2"
                ))
                .map_err(classify)?;
            let rows = stmt
                .query_map(params![q, limit.min(i64::MAX as usize) as i64], |r| {
                    Ok(AuditEntry {
                        at: r.get(0)?,
                        actor: r.get(1)?,
                        action: r.get(2)?,
                        queue: r.get(3)?,
                        subject: r.get(4)?,
                        signer: r.get(5)?,
                        result: r.get(6)?,
                    })
                })
                .map_err(classify)?;
            rows.collect::<Result<Vec<_>, _>>().map_err(classify)
        })
    }

    async fn hosts_prune(&self, age: Duration) -> StoreResult<u64> {
        self.inner
            .write_undurable(move |c| {
                c.execute(&format!("DELETE FROM onceq_hosts WHERE seen_at < {NOW} - ?1"), params![micros(age)])
                    .map(|n| n as u64)
                    .map_err(classify)
            })
            .await
    }

    async fn audit_prune(&self, age: Duration) -> StoreResult<u64> {
        self.write(|c| {
            c.execute(&format!("DELETE FROM onceq_audit WHERE at_us < {NOW} - ?1"), params![micros(age)])
                .map(|n| n as u64)
                .map_err(classify)
        })
        .await
    }

    async fn message_list(&self, queues: Queues<'_>, limit: usize) -> StoreResult<Vec<QueuedMessage>> {
        let (cond, q) = queue_condition(queues, 1);
        self.read(|c| {
            let mut stmt = c
                .prepare_cached(&format!(
                    "SELECT {QUEUED_COLUMNS} FROM onceq_messages WHERE {cond} ORDER BY enqueued_at, id LIMIT ?2"
                ))
                .map_err(classify)?;
            let rows = stmt
                .query_map(params![q, limit.min(i64::MAX as usize) as i64], queued_from_row)
                .map_err(classify)?;
            rows.collect::<Result<Vec<_>, _>>().map_err(classify)
        })
    }

    async fn message_get(&self, id: &str) -> StoreResult<Option<QueuedMessage>> {
        self.read(|c| {
            c.prepare_cached(&format!("SELECT {QUEUED_COLUMNS} FROM onceq_messages WHERE id = ?1"))
                .and_then(|mut s| s.query_row(params![id], queued_from_row).optional())
                .map_err(classify)
        })
    }

    async fn table_rows(&self, table: &str) -> StoreResult<Vec<Row>> {
        let t = self
            .inner
            .schema
            .table(table)
            .map_err(|e| StoreError::Permanent(e.to_string()))?
            .clone();
        self.read(|c| row_scan_on(c, &t, &[], i64::MAX as usize))
    }

    async fn dedup_purge(&self) -> StoreResult<u64> {
        self.write(|c| {
            c.execute(&format!("DELETE FROM onceq_dedup WHERE expires_at <= {NOW}"), [])
                .map(|n| n as u64)
                .map_err(classify)
        })
        .await
    }

    async fn dedup_list(&self, queues: Queues<'_>, within: Duration, limit: usize) -> StoreResult<Vec<DedupKey>> {
        let (cond, q) = queue_condition(queues, 1);
        self.read(|c| {
            let mut stmt = c
                .prepare_cached(&format!(
                    "SELECT queue, dedup_key, message_id, expires_at FROM onceq_dedup
                     WHERE {cond} AND expires_at > {NOW} AND expires_at <= {NOW} + ?3
                     ORDER BY expires_at DESC, queue, dedup_key LIMIT ?2"
                ))
                .map_err(classify)?;
            let rows = stmt
                .query_map(params![q, limit.min(i64::MAX as usize) as i64, micros(within)], |r| {
                    Ok(DedupKey {
                        queue: r.get(0)?,
                        key: r.get(1)?,
                        message_id: r.get(2)?,
                        expires_at: r.get(3)?,
                    })
                })
                .map_err(classify)?;
            rows.collect::<Result<Vec<_>, _>>().map_err(classify)
        })
    }
}

const QUEUED_COLUMNS: &str =
    "id, queue, payload, attributes, attempt, enqueued_at, visible_at, lease_token IS NOT NULL AND visible_at > unixepoch('subsec') * 1000000, last_error, failures";

const DEAD_COLUMNS: &str = "id, queue, payload, attributes, attempts, enqueued_at, failed_at, reason, handler_version, failures";

fn queued_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<QueuedMessage> {
    let payload: Vec<u8> = r.get(2)?;
    Ok(QueuedMessage {
        id: r.get(0)?,
        queue: r.get(1)?,
        payload_text: String::from_utf8_lossy(&payload).into_owned(),
        payload,
        attributes: attrs_from_json(&r.get::<_, String>(3)?),
        deliveries: r.get(4)?,
        failures: r.get(9)?,
        enqueued_at: r.get(5)?,
        visible_at: r.get(6)?,
        leased: r.get(7)?,
        last_error: r.get(8)?,
    })
}

fn dead_letter_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<DeadLetter> {
    let payload: Vec<u8> = r.get(2)?;
    Ok(DeadLetter {
        id: r.get(0)?,
        queue: r.get(1)?,
        payload_text: String::from_utf8_lossy(&payload).into_owned(),
        payload,
        attributes: attrs_from_json(&r.get::<_, String>(3)?),
        deliveries: r.get(4)?,
        failures: r.get(9)?,
        enqueued_at: r.get(5)?,
        failed_at: r.get(6)?,
        reason: r.get(7)?,
        handler_version: r.get(8)?,
    })
}

impl SqliteStore {
    /// `UPDATE onceq_messages SET <set> WHERE id = ?1 AND lease_token = ?2`,
    /// asserting one row.
    ///
    /// A failure record: run on the committer, between two batches.
    async fn guarded_update(&self, lease: &Lease, set: &str, p3: Option<SqlValue>, p4: Option<SqlValue>) -> StoreResult<()> {
        let sql = format!("UPDATE onceq_messages SET {set} WHERE id = ?1 AND lease_token = ?2");
        let lease = lease.clone();
        self.inner
            .on_committer(move |c| {
                let mut params: Vec<SqlValue> = vec![SqlValue::Text(lease.message_id.clone()), SqlValue::Text(lease.token.clone())];
                params.extend(p3);
                params.extend(p4);
                let n = c
                    .prepare_cached(&sql)
                    .and_then(|mut s| s.execute(rusqlite::params_from_iter(params)))
                    .map_err(classify)?;
                if n == 1 {
                    Ok(())
                } else {
                    Err(StoreError::LeaseLost {
                        message_id: lease.message_id.clone(),
                    })
                }
            })
            .await
    }
}

/// A message transaction's reads: a pooled reader connection in a read
/// transaction (one WAL snapshot for all of them), opened on the first
/// read, ended when dropped ([`commit::Buffered`] drops it before the
/// commit waits: the connection is not `Sync`).
struct SqliteSnapshot {
    inner: Arc<Inner>,
    reader: Option<Connection>,
}

impl SqliteSnapshot {
    fn open(&mut self) -> StoreResult<&Connection> {
        if self.reader.is_none() {
            let c = self.inner.reader()?;
            // Cached: parsed once per connection, not per message.
            c.prepare_cached("BEGIN DEFERRED")
                .and_then(|mut st| st.execute([]))
                .map_err(classify)?;
            self.reader = Some(c);
        }
        self.reader
            .as_ref()
            .ok_or_else(|| StoreError::Invariant("reader connection missing".into()))
    }
}

impl Drop for SqliteSnapshot {
    fn drop(&mut self) {
        if let Some(c) = self.reader.take() {
            if c.prepare_cached("ROLLBACK").and_then(|mut st| st.execute([])).is_ok() {
                self.inner.reader_return(c);
            }
        }
    }
}

fn table_of<'a>(schema: &'a Schema, w: &ValidWrite) -> StoreResult<&'a TableSchema> {
    schema.table(&w.table).map_err(|e| StoreError::Invariant(e.to_string()))
}

#[async_trait]
impl commit::Snapshot for SqliteSnapshot {
    async fn get(&mut self, table: &TableSchema, key: &[Value]) -> StoreResult<Option<Row>> {
        row_get_on(self.open()?, table, key)
    }

    async fn scan(&mut self, table: &TableSchema, prefix: &[Value], limit: usize) -> StoreResult<Vec<Row>> {
        row_scan_on(self.open()?, table, prefix, limit)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::schema::{ColumnSchema, ColumnType};

    #[test]
    fn select_statements_quote_every_identifier_and_follow_the_key() {
        let col = |name: &str| ColumnSchema {
            name: name.into(),
            ty: ColumnType::String,
            nullable: false,
            has_default: false,
        };
        let table = TableSchema {
            name: "odd \"table\"".into(),
            columns: vec![col("v"), col("b"), col("a\"1")],
            primary_key: vec![2, 1],
        };
        assert_eq!(
            select_sql(&table, 2, None),
            r#"SELECT "v", "b", "a""1" FROM "odd ""table""" WHERE "a""1" = ?1 AND "b" = ?2"#
        );
        assert_eq!(
            select_sql(&table, 1, Some(7)),
            r#"SELECT "v", "b", "a""1" FROM "odd ""table""" WHERE "a""1" = ?1 ORDER BY "a""1", "b" LIMIT 7"#
        );
        assert_eq!(
            select_sql(&table, 0, Some(3)),
            r#"SELECT "v", "b", "a""1" FROM "odd ""table""" ORDER BY "a""1", "b" LIMIT 3"#
        );
    }

    /// The bundled SQLite is built as `.cargo/config.toml` says
    /// (`LIBSQLITE3_FLAGS`): no memory statistics, and no page cache
    /// shared by every connection behind one mutex. A build that missed
    /// the file (run from elsewhere, the variable overridden) would be
    /// slower, not wrong: this test says so, where a bench would only be
    /// slower.
    #[test]
    fn the_bundled_sqlite_is_built_with_the_repository_flags() {
        let conn = Connection::open_in_memory().unwrap();
        let options: Vec<String> = conn
            .prepare("PRAGMA compile_options")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert!(
            options.iter().any(|o| o == "DEFAULT_MEMSTATUS=0"),
            "built with memory statistics: {options:?}"
        );
        assert!(
            !options.iter().any(|o| o == "ENABLE_MEMORY_MANAGEMENT"),
            "built with one page cache for every connection: {options:?}"
        );
    }
}
