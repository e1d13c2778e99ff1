//! The Cloud Spanner store (Google's official client, `google-cloud-spanner`).
//!
//! ## Tables
//!
//! Queues are ordinary tables shaped like native Spanner queues (the emulator
//! does not parse `CREATE QUEUE`): random message ids, a visibility time, a
//! lease token. The primary key starts with a shard number derived from the
//! id (`shard = hash(id) % shards`), and workers lease from a random shard
//! first, so many hosts do not contend on one key range.
//!
//! Times are `INT64` microseconds taken from the database's clock
//! (`UNIX_MICROS(CURRENT_TIMESTAMP())`), never the host's.
//!
//! ## A message transaction
//!
//! As on SQLite, reads are optimistic: the handler's reads run in a
//! read-only (snapshot) transaction and are recorded; the commit is one
//! read-write transaction for a whole batch of messages (group commit,
//! [`commit`]). In it, a few calls whatever the batch's size
//! ([`read_ahead`]) read again every recorded read, the acked messages'
//! lease tokens, the dedup keys the batch claims, and the database's
//! clock; each message is then decided on them, in order
//! ([`commit::apply`]): reads unchanged (also by an earlier message of the
//! batch), its lease token still there. Only a decided message keeps
//! writes, all of them mutations applied at the commit: its ack (a delete
//! of the message row whose token it matched), its row writes, its dedup
//! claims and new messages. The reads hold their rows' locks until the
//! commit (another writer of them aborts this transaction or waits), so
//! what was decided is what commits. A batch of one message acks with
//! `DELETE ... WHERE ... AND lease_token = @token ASSERT_ROWS_MODIFIED 1`
//! instead, as onceq did before group commit. A failed statement or
//! mutation (`OUT_OF_RANGE` from the assertion, a refused write, an insert
//! of a row that exists) is returned out of the closure or fails the
//! commit, so the whole transaction rolls back: it is never caught to
//! commit the rest (a failed batch is committed again one message at a
//! time).
//!
//! ## Emulator
//!
//! The emulator has no multiplexed sessions, so concurrent transactions
//! through one client fail ("Transaction not found"). Each operation here
//! checks a client out of a small pool exclusively; on real Spanner one
//! shared client would do, and the pool is a setting (`clients`).

use super::*;
use crate::schema::{column_type_from_decl, ColumnSchema, ColumnType};
use crate::value::{random_id, WriteOp};
use google_cloud_spanner::client::{DatabaseClient, Spanner};
use google_cloud_spanner::key::{Key, KeyRange, KeySetBuilder};
use google_cloud_spanner::mutation::Mutation;
use google_cloud_spanner::statement::Statement;
use google_cloud_spanner::value::Value as SValue;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;

type RwTx = google_cloud_spanner::transaction::ReadWriteTransaction;

const NOW: &str = "UNIX_MICROS(CURRENT_TIMESTAMP())";

/// onceq's own tables, in GoogleSQL.
pub fn system_ddl() -> Vec<String> {
    [
        "CREATE TABLE onceq_messages (
            shard INT64 NOT NULL, id STRING(64) NOT NULL, queue STRING(256) NOT NULL,
            payload BYTES(MAX) NOT NULL, attributes STRING(MAX) NOT NULL, attempt INT64 NOT NULL,
            enqueued_at INT64 NOT NULL, visible_at INT64 NOT NULL, lease_token STRING(64), last_error STRING(MAX),
            failures INT64 NOT NULL DEFAULT (0)
         ) PRIMARY KEY (shard, id)",
        "CREATE INDEX onceq_messages_visible ON onceq_messages (queue, shard, visible_at)",
        "CREATE TABLE onceq_dead_letters (
            id STRING(64) NOT NULL, queue STRING(256) NOT NULL, payload BYTES(MAX) NOT NULL, attributes STRING(MAX) NOT NULL,
            attempts INT64 NOT NULL, enqueued_at INT64 NOT NULL, failed_at INT64 NOT NULL, reason STRING(MAX) NOT NULL,
            handler_version STRING(64), failures INT64 NOT NULL DEFAULT (0)
         ) PRIMARY KEY (id)",
        "CREATE TABLE onceq_dedup (
            queue STRING(256) NOT NULL, dedup_key STRING(MAX) NOT NULL, message_id STRING(64) NOT NULL, expires_at INT64 NOT NULL
         ) PRIMARY KEY (queue, dedup_key)",
        "CREATE INDEX onceq_dedup_expiry ON onceq_dedup (expires_at)",
        COUNTS_DDL,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The processed counts (`onceq stats`): a row per queue and per store
/// instance (`shard`), so hosts never contend for one row; stats add them.
const COUNTS_DDL: &str = "CREATE TABLE onceq_counts (
            queue STRING(256) NOT NULL, shard INT64 NOT NULL, processed INT64 NOT NULL, last_at INT64 NOT NULL
         ) PRIMARY KEY (queue, shard)";

/// Settings of the Spanner store.
#[derive(Debug, Clone)]
pub struct SpannerOptions {
    /// `projects/P/instances/I/databases/D`.
    pub database: String,
    /// Shards per queue table key range.
    pub shards: u32,
    /// Clients in the pool (at most this many concurrent operations) when
    /// `exclusive`.
    pub clients: usize,
    /// Check a client out exclusively per operation (the emulator has no
    /// multiplexed sessions); otherwise every operation shares one client,
    /// as real Spanner allows. `None`: exclusive only on the emulator.
    pub exclusive: Option<bool>,
    /// The deadline of every call ([`Pool::within`]).
    pub call_timeout: Duration,
}

fn classify(e: google_cloud_spanner::Error) -> StoreError {
    classify_ref(&e)
}

fn classify_ref(e: &google_cloud_spanner::Error) -> StoreError {
    use google_cloud_gax::error::rpc::Code;
    let text = e.to_string();
    if let Some(status) = e.status() {
        return match status.code {
            Code::Aborted => StoreError::Aborted(text),
            Code::OutOfRange => StoreError::AssertionFailed(text),
            Code::AlreadyExists | Code::NotFound | Code::FailedPrecondition | Code::InvalidArgument => StoreError::WriteRefused(text),
            Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown | Code::Internal => {
                StoreError::UnknownOutcome(text)
            }
            Code::ResourceExhausted => StoreError::Unavailable(text),
            _ => StoreError::Permanent(text),
        };
    }
    if e.is_timeout() || e.is_transport() || e.is_io() {
        StoreError::UnknownOutcome(text)
    } else {
        StoreError::Permanent(text)
    }
}

/// The clients of one database, and the connection they share.
///
/// Every call runs under a deadline (`spanner.call_timeout`, [`Pool::within`]).
/// Google's client sets no transport keepalive, so a connection whose peer
/// vanished (a NAT or proxy dropped the flow, a front end restarted) can
/// leave calls waiting forever; a call that misses its deadline therefore
/// replaces the connection: a new generation of clients on new channels,
/// while calls still holding an old client finish or miss their own
/// deadline.
struct Pool {
    exclusive: bool,
    database: String,
    max: usize,
    call_timeout: Duration,
    state: Mutex<Conn>,
    ready: tokio::sync::Notify,
    /// On the emulator, which runs one read-write transaction at a time and
    /// aborts any other at once, read-write transactions take turns, in
    /// this process and with the other processes of the machine, instead of
    /// aborting each other ([`super::turns`]; measured: 1 host drained 300
    /// payments messages in 31 s without the in-process turns).
    turns: Option<super::turns::Turns>,
}

/// One generation of the connection.
struct Conn {
    generation: u64,
    /// The channels; `None` after a replacement, until the next call.
    spanner: Option<Spanner>,
    /// Clients not lent out (exclusive mode), or the one shared client.
    free: Vec<DatabaseClient>,
    /// Clients of this generation created (or being created).
    made: usize,
    replaced_at: Option<tokio::time::Instant>,
}

/// A client checked out of the pool; returned on drop (clients are cheap
/// `Arc` clones).
struct Lent {
    pool: Arc<Pool>,
    client: DatabaseClient,
    generation: u64,
}

impl std::ops::Deref for Lent {
    type Target = DatabaseClient;
    fn deref(&self) -> &DatabaseClient {
        &self.client
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        if !self.pool.exclusive {
            return;
        }
        if let Ok(mut c) = self.pool.state.lock() {
            // A client of a replaced generation is dropped with its channels.
            if c.generation == self.generation {
                c.free.push(self.client.clone());
            }
        }
        self.pool.ready.notify_one();
    }
}

impl Pool {
    fn new(spanner: Spanner, opts: &SpannerOptions, exclusive: bool, emulator: bool) -> Pool {
        Pool {
            turns: emulator.then(|| super::turns::Turns::new(&opts.database)),
            exclusive,
            database: opts.database.clone(),
            max: if exclusive { opts.clients.max(1) } else { 1 },
            call_timeout: opts.call_timeout,
            state: Mutex::new(Conn {
                generation: 0,
                spanner: Some(spanner),
                free: Vec::new(),
                made: 0,
                replaced_at: None,
            }),
            ready: tokio::sync::Notify::new(),
        }
    }

    fn conn(&self) -> StoreResult<std::sync::MutexGuard<'_, Conn>> {
        self.state
            .lock()
            .map_err(|_| StoreError::Permanent("the Spanner client pool is poisoned".into()))
    }

    /// A client: a free one, a new one while fewer than `max` exist, or the
    /// next one returned (waiting at most the call deadline).
    async fn get(self: &Arc<Self>) -> StoreResult<Lent> {
        let waited = tokio::time::Instant::now();
        loop {
            let notified = self.ready.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let build = {
                let mut c = self.conn()?;
                let generation = c.generation;
                let free = if self.exclusive { c.free.pop() } else { c.free.first().cloned() };
                if let Some(client) = free {
                    return Ok(Lent {
                        pool: self.clone(),
                        client,
                        generation,
                    });
                }
                if c.made < self.max {
                    c.made += 1;
                    Some((generation, c.spanner.clone()))
                } else {
                    None
                }
            };
            let Some((generation, spanner)) = build else {
                let left = self.call_timeout.saturating_sub(waited.elapsed());
                if tokio::time::timeout(left, notified).await.is_err() {
                    return Err(StoreError::Unavailable(format!(
                        "no Spanner client came free within {} (spanner.call_timeout; spanner.clients = {})",
                        crate::names::duration(self.call_timeout),
                        self.max
                    )));
                }
                continue;
            };
            let created = self.create(spanner).await;
            let mut c = self.conn()?;
            let current = c.generation == generation;
            return match created {
                Ok((spanner, client)) => {
                    if current {
                        c.spanner.get_or_insert(spanner);
                        if !self.exclusive {
                            c.free.push(client.clone());
                        }
                    }
                    drop(c);
                    self.ready.notify_waiters();
                    Ok(Lent {
                        pool: self.clone(),
                        client,
                        generation,
                    })
                }
                Err(e) => {
                    if current {
                        c.made = c.made.saturating_sub(1);
                    }
                    drop(c);
                    self.ready.notify_one();
                    Err(e)
                }
            };
        }
    }

    /// A new client (and new channels when the connection was replaced),
    /// within the call deadline.
    async fn create(&self, spanner: Option<Spanner>) -> StoreResult<(Spanner, DatabaseClient)> {
        let make = async {
            let spanner = match spanner {
                Some(s) => s,
                None => Spanner::builder()
                    .build()
                    .await
                    .map_err(|e| StoreError::Unavailable(format!("connecting to Spanner: {e}")))?,
            };
            let client = spanner.database_client(self.database.clone()).build().await.map_err(classify)?;
            Ok((spanner, client))
        };
        match tokio::time::timeout(self.call_timeout, make).await {
            Ok(r) => r,
            Err(_) => {
                self.replace("creating a client");
                Err(StoreError::Unavailable(self.late("creating a client")))
            }
        }
    }

    fn late(&self, what: &str) -> String {
        format!(
            "Spanner did not answer {what} within {} (spanner.call_timeout); the connection is replaced",
            crate::names::duration(self.call_timeout)
        )
    }

    /// Drop this generation of clients and channels: the next call connects
    /// afresh. Once per deadline, however many calls missed it together.
    fn replace(&self, what: &str) {
        let Ok(mut c) = self.state.lock() else { return };
        let now = tokio::time::Instant::now();
        if c.replaced_at.is_some_and(|t| now.duration_since(t) < self.call_timeout) {
            return;
        }
        c.generation += 1;
        c.spanner = None;
        c.free.clear();
        c.made = 0;
        c.replaced_at = Some(now);
        drop(c);
        tracing::warn!(
            "Spanner did not answer {what} within {}: replacing the connection (calls still on the old one end at their deadline)",
            crate::names::duration(self.call_timeout)
        );
        self.ready.notify_waiters();
    }

    /// Run `call` under the call deadline. A call that misses it replaces
    /// the connection and fails: with an unknown outcome if it `writes`
    /// (it may have committed), else as unavailable (safe to retry).
    async fn within<T>(&self, what: &str, writes: bool, call: impl std::future::Future<Output = StoreResult<T>>) -> StoreResult<T> {
        match tokio::time::timeout(self.call_timeout, call).await {
            Ok(r) => r,
            Err(_) => {
                self.replace(what);
                let text = self.late(what);
                Err(if writes {
                    StoreError::UnknownOutcome(text)
                } else {
                    StoreError::Unavailable(text)
                })
            }
        }
    }
}

/// The Spanner store.
pub struct SpannerStore {
    pool: Arc<Pool>,
    schema: Arc<Schema>,
    options: StoreOptions,
    /// Message commits, grouped ([`commit::Group`]).
    group: Arc<commit::Group>,
    shards: u32,
    /// This instance's row of `onceq_counts`; `None` on a database made
    /// before the table (counting is then off, said once at open).
    counts: Option<i64>,
}

fn shard_of(id: &str, shards: u32) -> i64 {
    let mut h: u32 = 2_166_136_261;
    for b in id.as_bytes() {
        h = (h ^ u32::from(*b)).wrapping_mul(16_777_619);
    }
    i64::from(h % shards.max(1))
}

fn attrs_to_json(a: &[(String, String)]) -> String {
    serde_json::to_string(a).unwrap_or_else(|_| "[]".to_string())
}

fn attrs_from_json(s: &str) -> Vec<(String, String)> {
    serde_json::from_str(s).unwrap_or_default()
}

fn to_svalue(v: &Value) -> SValue {
    match v {
        Value::Null => SValue::null(),
        Value::Bool(b) => SValue::from(*b),
        Value::Int64(i) => SValue::from(*i),
        Value::Float64(f) => SValue::from(*f),
        Value::String(s) | Value::Json(s) => SValue::from(s.clone()),
        Value::Bytes(b) => SValue::from(b.clone()),
        Value::Timestamp(t) => {
            let ts = wkt::Timestamp::new(t.div_euclid(1_000_000), (t.rem_euclid(1_000_000) * 1000) as i32).unwrap_or_default();
            SValue::from(ts)
        }
    }
}

fn spanner_type(ty: ColumnType) -> google_cloud_spanner::types::Type {
    use google_cloud_spanner::types;
    match ty {
        ColumnType::Bool => types::bool(),
        ColumnType::Int64 => types::int64(),
        ColumnType::Float64 => types::float64(),
        ColumnType::String => types::string(),
        ColumnType::Bytes => types::bytes(),
        ColumnType::Json => types::json(),
        ColumnType::Timestamp => types::timestamp(),
    }
}

fn read_value(table: &str, col: &ColumnSchema, row: &google_cloud_spanner::result::Row, i: usize) -> StoreResult<Value> {
    let bad = |e: google_cloud_spanner::Error| StoreError::Permanent(format!("table {table}: column {}: {e}", col.name));
    Ok(match col.ty {
        ColumnType::Bool => row.get::<Option<bool>>(i).map_err(bad)?.map_or(Value::Null, Value::Bool),
        ColumnType::Int64 => row.get::<Option<i64>>(i).map_err(bad)?.map_or(Value::Null, Value::Int64),
        ColumnType::Float64 => row.get::<Option<f64>>(i).map_err(bad)?.map_or(Value::Null, Value::Float64),
        ColumnType::String => row.get::<Option<String>>(i).map_err(bad)?.map_or(Value::Null, Value::String),
        ColumnType::Bytes => row.get::<Option<Vec<u8>>>(i).map_err(bad)?.map_or(Value::Null, Value::Bytes),
        ColumnType::Json => row
            .get::<Option<serde_json::Value>>(i)
            .map_err(bad)?
            .map_or(Value::Null, |j| Value::Json(j.to_string())),
        ColumnType::Timestamp => row
            .get::<Option<wkt::Timestamp>>(i)
            .map_err(bad)?
            .map_or(Value::Null, |t| Value::Timestamp(micros_of(&t))),
    })
}

/// A Spanner timestamp in microseconds since the epoch.
fn micros_of(t: &wkt::Timestamp) -> i64 {
    t.seconds().saturating_mul(1_000_000).saturating_add(i64::from(t.nanos()) / 1000)
}

fn quote(ident: &str) -> String {
    format!("`{}`", ident.replace('`', ""))
}

fn select_stmt(table: &TableSchema, key: &[Value], limit: Option<usize>) -> Statement {
    let cols: Vec<String> = table.columns.iter().map(|c| quote(&c.name)).collect();
    let keys: Vec<&ColumnSchema> = table.key_columns().collect();
    let mut sql = format!("SELECT {} FROM {}", cols.join(", "), quote(&table.name));
    if !key.is_empty() {
        let conds: Vec<String> = keys
            .iter()
            .take(key.len())
            .enumerate()
            .map(|(i, k)| format!("{} = @k{i}", quote(&k.name)))
            .collect();
        sql.push_str(&format!(" WHERE {}", conds.join(" AND ")));
    }
    if let Some(n) = limit {
        sql.push_str(&format!(
            " ORDER BY {} LIMIT {n}",
            keys.iter().map(|k| quote(&k.name)).collect::<Vec<_>>().join(", ")
        ));
    }
    let mut b = Statement::builder(sql);
    for (i, (v, k)) in key.iter().zip(keys).enumerate() {
        b = b.add_typed_param(format!("k{i}"), to_svalue(v), spanner_type(k.ty));
    }
    b.build()
}

async fn collect(table: &TableSchema, mut rs: google_cloud_spanner::result::ResultSet) -> StoreResult<Vec<Row>> {
    let mut out = Vec::new();
    while let Some(r) = rs.next().await {
        let r = r.map_err(classify)?;
        let mut row = Vec::with_capacity(table.columns.len());
        for (i, col) in table.columns.iter().enumerate() {
            row.push((col.name.clone(), read_value(&table.name, col, &r, i)?));
        }
        out.push(row);
    }
    Ok(out)
}

fn mutation(table: &TableSchema, w: &ValidWrite) -> Mutation {
    if w.op == WriteOp::Delete {
        let key: Vec<SValue> = table
            .primary_key
            .iter()
            .map(|&k| w.values.get(k).cloned().flatten().map_or(SValue::null(), |v| to_svalue(&v)))
            .collect();
        return Mutation::delete(table.name.clone(), KeySetBuilder::new().add_key(Key::new(key)).build());
    }
    let mut b = match w.op {
        WriteOp::Insert => Mutation::new_insert_builder(table.name.clone()),
        WriteOp::Update => Mutation::new_update_builder(table.name.clone()),
        _ => Mutation::new_insert_or_update_builder(table.name.clone()),
    };
    for (i, v) in w.values.iter().enumerate() {
        if let (Some(v), Some(col)) = (v, table.columns.get(i)) {
            b = b.set(col.name.clone()).to(to_svalue(v));
        }
    }
    b.build()
}

/// Split a GoogleSQL DDL file into statements (on `;`, dropping `--`
/// comments and blank statements).
pub fn split_ddl(ddl: &str) -> Vec<String> {
    let text: String = ddl
        .lines()
        .map(|l| l.split("--").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    text.split(';')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

/// `projects/P/instances/I/databases/D` -> (P, I, D).
pub fn parse_database(path: &str) -> anyhow::Result<(String, String, String)> {
    let parts: Vec<&str> = path.split('/').collect();
    match parts.as_slice() {
        ["projects", p, "instances", i, "databases", d] if !p.is_empty() && !i.is_empty() && !d.is_empty() => {
            Ok((p.to_string(), i.to_string(), d.to_string()))
        }
        _ => anyhow::bail!("Spanner database {path:?}: expected projects/PROJECT/instances/INSTANCE/databases/DATABASE"),
    }
}

/// The REST admin endpoint: `ONCEQ_SPANNER_ADMIN_ENDPOINT` (the emulator's
/// gateway_main), else the client's default.
fn admin_endpoint() -> Option<String> {
    std::env::var("ONCEQ_SPANNER_ADMIN_ENDPOINT").ok().filter(|s| !s.is_empty())
}

/// The database admin client, at [`admin_endpoint`] if set.
async fn database_admin(spanner: &Spanner) -> anyhow::Result<google_cloud_spanner::client::DatabaseAdmin> {
    let mut b = spanner.database_admin_builder();
    if let Some(ep) = admin_endpoint() {
        b = b.with_endpoint(ep);
    }
    b.build().await.map_err(|e| anyhow::anyhow!("database admin: {e}"))
}

/// A start-up query, retried while the failure is transient (no answer
/// within the call deadline, unavailable): each failure logged at WARN with
/// its pause, up to about a minute and a half in all, before the host gives
/// up with the last error.
async fn retrying<T, Fut: std::future::Future<Output = StoreResult<T>>>(what: &str, mut call: impl FnMut() -> Fut) -> StoreResult<T> {
    const TRIES: u32 = 8;
    let mut pause = Duration::from_millis(200);
    for attempt in 1..=TRIES {
        match call().await {
            Err(e) if (e.is_retryable() || e.is_unknown_outcome()) && attempt < TRIES => {
                tracing::warn!(
                    "{what} failed (try {attempt} of {TRIES}, again in {}): {e}",
                    crate::names::duration(pause)
                );
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(30));
            }
            other => return other,
        }
    }
    Err(StoreError::Unavailable(format!("{what}: no try left")))
}

/// Apply `statements` to `database` and wait for them, within five minutes.
async fn update_ddl(database: &str, statements: Vec<String>) -> anyhow::Result<()> {
    use google_cloud_lro::Poller;
    let spanner = Spanner::builder()
        .build()
        .await
        .map_err(|e| anyhow::anyhow!("connecting to Spanner: {e}"))?;
    let admin = database_admin(&spanner).await?;
    let update = admin
        .update_database_ddl()
        .set_database(database)
        .set_statements(statements.clone())
        .poller()
        .until_done();
    tokio::time::timeout(Duration::from_secs(300), update)
        .await
        .map_err(|_| anyhow::anyhow!("updating the schema of {database}: no answer within 5m"))?
        .map_err(|e| anyhow::anyhow!("updating the schema of {database} ({}): {e}", statements.join("; ")))?;
    Ok(())
}

impl SpannerStore {
    /// `onceq init` on Spanner: on the emulator also create the instance;
    /// create the database with onceq's tables and the business DDL.
    pub fn init<'a>(
        opts: &'a SpannerOptions,
        business_ddl: &'a str,
        options: &'a StoreOptions,
    ) -> crate::BoxFuture<'a, anyhow::Result<SpannerStore>> {
        Box::pin(async move {
            // Creating a database on real Spanner takes up to a minute or two.
            const INIT_DEADLINE: Duration = Duration::from_secs(300);
            tokio::time::timeout(INIT_DEADLINE, Self::create(opts, business_ddl))
                .await
                .map_err(|_| anyhow::anyhow!("creating database {}: no answer from Spanner within 5m", opts.database))??;
            Self::open(opts, options).await
        })
    }

    /// The emulator's instance (on the emulator) and the database.
    async fn create(opts: &SpannerOptions, business_ddl: &str) -> anyhow::Result<()> {
        use google_cloud_lro::Poller;
        let (project, instance, database) = parse_database(&opts.database)?;
        let spanner = Spanner::builder()
            .build()
            .await
            .map_err(|e| anyhow::anyhow!("connecting to Spanner: {e}"))?;
        let emulator = std::env::var("SPANNER_EMULATOR_HOST").is_ok_and(|s| !s.is_empty());
        if emulator {
            let mut b = spanner.instance_admin_builder();
            if let Some(ep) = admin_endpoint() {
                b = b.with_endpoint(ep);
            }
            let admin = b.build().await.map_err(|e| anyhow::anyhow!("instance admin: {e}"))?;
            let created = admin
                .create_instance()
                .set_parent(format!("projects/{project}"))
                .set_instance_id(instance.clone())
                .set_instance(
                    google_cloud_spanner_admin_instance_v1::model::Instance::new()
                        .set_config(format!("projects/{project}/instanceConfigs/emulator-config"))
                        .set_display_name(instance.clone())
                        .set_node_count(1),
                )
                .poller()
                .until_done()
                .await;
            if let Err(e) = created {
                if !e.to_string().contains("lready exists") {
                    anyhow::bail!("creating emulator instance {instance}: {e}");
                }
            }
        }
        let admin = database_admin(&spanner).await?;
        let mut ddl = system_ddl();
        ddl.extend(split_ddl(business_ddl));
        admin
            .create_database()
            .set_parent(format!("projects/{project}/instances/{instance}"))
            .set_create_statement(format!("CREATE DATABASE `{database}`"))
            .set_extra_statements(ddl)
            .poller()
            .until_done()
            .await
            .map_err(|e| anyhow::anyhow!("creating database {}: {e}", opts.database))?;
        Ok(())
    }

    /// Drop `database` (`projects/P/instances/I/databases/D`), within a
    /// minute: what the bench does after each run on the emulator, so its
    /// databases do not pile up there.
    pub async fn drop_database(database: &str) -> anyhow::Result<()> {
        let spanner = Spanner::builder()
            .build()
            .await
            .map_err(|e| anyhow::anyhow!("connecting to Spanner: {e}"))?;
        let admin = database_admin(&spanner).await?;
        tokio::time::timeout(Duration::from_secs(60), admin.drop_database().set_database(database).send())
            .await
            .map_err(|_| anyhow::anyhow!("dropping database {database}: no answer within 1m"))?
            .map_err(|e| anyhow::anyhow!("dropping database {database}: {e}"))
    }

    /// Connect to an existing database.
    pub async fn open(opts: &SpannerOptions, options: &StoreOptions) -> anyhow::Result<SpannerStore> {
        let spanner = Spanner::builder()
            .build()
            .await
            .map_err(|e| anyhow::anyhow!("connecting to Spanner: {e}"))?;
        let emulator = std::env::var("SPANNER_EMULATOR_HOST").is_ok_and(|s| !s.is_empty());
        let pool = Arc::new(Pool::new(spanner, opts, opts.exclusive.unwrap_or(emulator), emulator));
        let schema = retrying("the schema query", || {
            pool.within("the schema query", false, Self::load_schema(&pool))
        })
        .await
        .map_err(|e| anyhow::Error::new(e).context(format!("reading the schema of {}", opts.database)))?;
        let tables = retrying("the system tables query", || {
            pool.within("the system tables query", false, Self::system_columns(&pool))
        })
        .await
        .map_err(|e| anyhow::Error::new(e).context(format!("reading onceq's tables in {}", opts.database)))?;
        Self::migrate(&pool, &opts.database, &tables).await?;
        let counts = match tables.contains(&("onceq_counts".to_string(), "processed".to_string())) {
            true => Some(shard_of(&random_id(), u32::MAX)),
            false => {
                tracing::warn!(
                    "{} has no onceq_counts table (made by an older onceq): `onceq stats` will not count processed messages; add it with: {}",
                    opts.database,
                    COUNTS_DDL.split_whitespace().collect::<Vec<_>>().join(" ")
                );
                None
            }
        };
        Ok(SpannerStore {
            pool,
            schema: Arc::new(schema),
            group: Arc::new(commit::Group::new(options.commit)),
            options: options.clone(),
            shards: opts.shards.max(1),
            counts,
        })
    }

    /// onceq's own tables and their columns, as (table, column).
    async fn system_columns(pool: &Arc<Pool>) -> StoreResult<BTreeSet<(String, String)>> {
        let c = pool.get().await?;
        let mut rs = c
            .single_use()
            .build()
            .execute_query(
                Statement::builder(
                    "SELECT TABLE_NAME, COLUMN_NAME FROM INFORMATION_SCHEMA.COLUMNS
                     WHERE TABLE_SCHEMA = '' AND STARTS_WITH(TABLE_NAME, 'onceq_')",
                )
                .build(),
            )
            .await
            .map_err(classify)?;
        let mut out = BTreeSet::new();
        while let Some(r) = rs.next().await {
            let r = r.map_err(classify)?;
            out.insert((r.get::<String>(0).map_err(classify)?, r.get::<String>(1).map_err(classify)?));
        }
        Ok(out)
    }

    /// Bring a database made by an older onceq up to date: the `failures`
    /// columns (failures counted apart from deliveries). A queued message
    /// starts with none; a dead letter keeps its old count as its failures.
    async fn migrate(pool: &Arc<Pool>, database: &str, tables: &BTreeSet<(String, String)>) -> anyhow::Result<()> {
        let has = |t: &str, c: &str| tables.contains(&(t.to_string(), c.to_string()));
        let mut ddl = Vec::new();
        for table in ["onceq_messages", "onceq_dead_letters"] {
            if has(table, "id") && !has(table, "failures") {
                ddl.push(format!("ALTER TABLE {table} ADD COLUMN failures INT64 NOT NULL DEFAULT (0)"));
            }
        }
        if ddl.is_empty() {
            return Ok(());
        }
        tracing::info!(%database, "adding the failure counts to onceq's tables: {}", ddl.join("; "));
        update_ddl(database, ddl).await?;
        if has("onceq_dead_letters", "id") && !has("onceq_dead_letters", "failures") {
            let stmt = Statement::builder("UPDATE onceq_dead_letters SET failures = attempts WHERE failures = 0").build();
            pool.rw("the dead letters' failure counts", move |tx| {
                let stmt = stmt.clone();
                async move { tx.execute_update(stmt).await }
            })
            .await
            .map_err(|e| anyhow::Error::new(e).context(format!("setting the failure counts of old dead letters in {database}")))?;
        }
        Ok(())
    }

    async fn load_schema(pool: &Arc<Pool>) -> StoreResult<Schema> {
        let c = pool.get().await?;
        let tx = c.single_use().build();
        let mut rs = tx
            .execute_query(
                Statement::builder(
                    "SELECT TABLE_NAME, COLUMN_NAME, SPANNER_TYPE, IS_NULLABLE FROM INFORMATION_SCHEMA.COLUMNS
                 WHERE TABLE_SCHEMA = '' AND NOT STARTS_WITH(TABLE_NAME, 'onceq_') ORDER BY TABLE_NAME, ORDINAL_POSITION",
                )
                .build(),
            )
            .await
            .map_err(classify)?;
        let mut schema = Schema::default();
        while let Some(r) = rs.next().await {
            let r = r.map_err(classify)?;
            let (t, c, ty, nullable): (String, String, String, String) = (
                r.get(0).map_err(classify)?,
                r.get(1).map_err(classify)?,
                r.get(2).map_err(classify)?,
                r.get(3).map_err(classify)?,
            );
            let ty = column_type_from_decl(&ty)
                .ok_or_else(|| StoreError::Permanent(format!("table {t}: column {c} has type {ty}, which onceq cannot map")))?;
            schema
                .tables
                .entry(t.clone())
                .or_insert_with(|| TableSchema {
                    name: t.clone(),
                    columns: vec![],
                    primary_key: vec![],
                })
                .columns
                .push(ColumnSchema {
                    name: c,
                    ty,
                    nullable: nullable == "YES",
                });
        }
        let tx = c.single_use().build();
        let mut rs = tx
            .execute_query(
                Statement::builder(
                    "SELECT TABLE_NAME, COLUMN_NAME FROM INFORMATION_SCHEMA.INDEX_COLUMNS
                 WHERE TABLE_SCHEMA = '' AND INDEX_TYPE = 'PRIMARY_KEY' AND NOT STARTS_WITH(TABLE_NAME, 'onceq_')
                 ORDER BY TABLE_NAME, ORDINAL_POSITION",
                )
                .build(),
            )
            .await
            .map_err(classify)?;
        while let Some(r) = rs.next().await {
            let r = r.map_err(classify)?;
            let (t, c): (String, String) = (r.get(0).map_err(classify)?, r.get(1).map_err(classify)?);
            if let Some(table) = schema.tables.get_mut(&t) {
                if let Some(i) = table.columns.iter().position(|col| col.name == c) {
                    table.primary_key.push(i);
                    if let Some(col) = table.columns.get_mut(i) {
                        col.nullable = false;
                    }
                }
            }
        }
        Ok(schema)
    }

    /// Run `work` in a read-write transaction on a pooled client. `work` is
    /// called again when Spanner aborts the transaction; each call returns a
    /// future that owns what it needs.
    ///
    /// Under the call deadline; a transaction that misses it has an unknown
    /// outcome (`what` names it in the error).
    async fn rw<T, F, Fut>(&self, what: &str, work: F) -> StoreResult<T>
    where
        F: FnMut(RwTx) -> Fut + Send + Clone,
        Fut: std::future::Future<Output = google_cloud_spanner::Result<T>> + Send,
        T: Send,
    {
        self.pool.rw(what, work).await
    }
}

impl Pool {
    /// Start `work` once this host's turn at the emulator came, and run it
    /// holding the turn (its read-write transactions take none of their
    /// own), so what `work` collects when it starts includes what arrived
    /// during the wait. Without turns (real Spanner) it starts at once; if
    /// no turn came within the call deadline, it starts anyway and its
    /// transactions ask for their own (and report the wait if they time
    /// out too).
    async fn in_turn<T, Fut: std::future::Future<Output = T>>(&self, work: impl FnOnce() -> Fut) -> T {
        let Some(turns) = &self.turns else { return work().await };
        match turns.take(self.call_timeout).await {
            Ok(turn) => {
                let out = TURN_HELD.scope((), work()).await;
                drop(turn);
                out
            }
            Err(_) => work().await,
        }
    }

    /// [`SpannerStore::rw`]: a read-write transaction on a lent client,
    /// each attempt under the call deadline.
    ///
    /// Aborted attempts are re-run here rather than in the client (whose
    /// backoff grows to a second): after a short jittered pause, for up to
    /// the call deadline. On the emulator, which aborts every transaction
    /// but one at once, transactions also take turns ([`Pool::turns`]);
    /// hosts on other machines still abort each other, and a short pause
    /// keeps the emulator busy instead of idle while the losers sleep.
    async fn rw<T, F, Fut>(self: &Arc<Self>, what: &str, work: F) -> StoreResult<T>
    where
        F: FnMut(RwTx) -> Fut + Send + Clone,
        Fut: std::future::Future<Output = google_cloud_spanner::Result<T>> + Send,
        T: Send,
    {
        let asked = tokio::time::Instant::now();
        let held = TURN_HELD.try_with(|_| ()).is_ok();
        let _turn = match &self.turns {
            _ if held => None,
            None => None,
            Some(turns) => match turns.take(self.call_timeout).await {
                Ok(turn) => Some(turn),
                Err(waited_for) => {
                    return Err(StoreError::Unavailable(format!(
                        "{what}: waited {} for {waited_for} at the emulator (spanner.call_timeout)",
                        crate::names::duration(self.call_timeout)
                    )))
                }
            },
        };
        let started = tokio::time::Instant::now();
        let mut aborts = 0u32;
        loop {
            let attempt = self
                .within(what, true, async {
                    let c = self.get().await?;
                    run_rw(&c, self.call_timeout, work.clone()).await
                })
                .await;
            match attempt {
                Err(StoreError::Aborted(_)) if started.elapsed() < self.call_timeout => {
                    aborts += 1;
                    tokio::time::sleep(abort_pause(aborts)).await;
                }
                other => {
                    tracing::trace!(
                        what,
                        turn_us = (started - asked).as_micros() as u64,
                        took_us = started.elapsed().as_micros() as u64,
                        aborts,
                        ok = other.is_ok(),
                        "read-write transaction"
                    );
                    return other;
                }
            }
        }
    }
}

/// The pause before re-running an aborted transaction: 2 ms growing by
/// half per abort up to 50 ms, jittered (full jitter).
fn abort_pause(aborts: u32) -> Duration {
    let cap = (2.0 * 1.5f64.powi(aborts.min(20) as i32)).min(50.0);
    Duration::from_micros((rand::random::<f64>() * cap * 1000.0) as u64)
}

/// Run a read-write transaction with an ordinary closure returning an owned
/// future (which is an `AsyncFnMut` through the standard library's blanket
/// impl, without the lifetime trouble of borrowing async closures).
///
/// The client's own transaction timeout ends it a little before the call
/// deadline: re-runs after aborts stop, and what was begun is rolled back
/// (on the emulator an abandoned transaction would hold its locks until it
/// expires).
async fn run_rw<T, F, Fut>(client: &DatabaseClient, deadline: Duration, mut work: F) -> StoreResult<T>
where
    F: FnMut(RwTx) -> Fut + Send,
    Fut: std::future::Future<Output = google_cloud_spanner::Result<T>> + Send,
    T: Send,
{
    client
        .read_write_transaction()
        .with_transaction_timeout(deadline.mul_f64(0.8))
        // One attempt: aborts are re-run by `Pool::rw`.
        .with_retry_policy(google_cloud_spanner::transaction::BasicTransactionRetryPolicy::new().with_max_attempts(1))
        .build()
        .run(move |tx: RwTx| work(tx))
        .await
        .map(|r| r.into_inner())
        .map_err(classify)
}

/// Map `OUT_OF_RANGE` from an `ASSERT_ROWS_MODIFIED 1` on a lease to
/// `LeaseLost`.
fn lease_error(e: StoreError, lease: &Lease) -> StoreError {
    match e {
        StoreError::AssertionFailed(_) => StoreError::LeaseLost {
            message_id: lease.message_id.clone(),
        },
        other => other,
    }
}

/// The columns a lease reads of each candidate's row, in
/// [`message_from_row`]'s order.
const LEASED_COLUMNS: [&str; 9] = [
    "shard",
    "id",
    "payload",
    "attributes",
    "attempt",
    "enqueued_at",
    "visible_at",
    "queue",
    "failures",
];

/// A row of [`LEASED_COLUMNS`], leased with `token` until `until` as its
/// attempt `attempt` (the values the lease writes).
fn message_from_row(
    queue: &str,
    token: &str,
    r: &google_cloud_spanner::result::Row,
    attempt: i64,
    until: i64,
) -> StoreResult<LeasedMessage> {
    let shard: i64 = r.get(0).map_err(classify)?;
    let id: String = r.get(1).map_err(classify)?;
    let attributes: String = r.get(3).map_err(classify)?;
    let failures: i64 = r.get(8).map_err(classify)?;
    Ok(LeasedMessage {
        message: Message {
            id: id.clone(),
            queue: queue.to_string(),
            payload: r.get(2).map_err(classify)?,
            attributes: attrs_from_json(&attributes),
            attempt: u32::try_from(attempt).unwrap_or(u32::MAX),
            enqueued_at: r.get(5).map_err(classify)?,
        },
        lease: Lease {
            queue: queue.to_string(),
            message_id: id.clone(),
            shard,
            token: token.to_string(),
        },
        lease_until: until,
        failures: u32::try_from(failures).unwrap_or(u32::MAX),
    })
}

/// What a transaction of the commit path read before deciding its
/// messages ([`read_ahead`]): a few statements whatever the batch's size,
/// instead of a statement per recorded read, per ack and per dedup key.
/// Every statement is a round trip during which the transaction holds its
/// locks; on the emulator each also costs about 2-3 ms of its CPU, and its
/// one busy core is what limits every host on it.
///
/// These reads run in the read-write transaction: their rows stay locked
/// until it commits (a commit of anyone else in between aborts it), so
/// deciding on them is deciding on what the commit will find.
#[derive(Default)]
struct Seen {
    /// Each pending's recorded reads, run again, in the pending's order.
    reads: Vec<std::collections::VecDeque<Vec<Row>>>,
    /// The lease token of each acked message still queued, by (shard, id)
    /// (read only for batches of more than one message).
    leases: HashMap<(i64, String), Option<String>>,
    /// The dedup rows of the keys the batch claims or holds, by (queue,
    /// key): the holding message, and whether its claim is live. Updated as
    /// messages claim and hold, so a later message of the batch sees them.
    dedup: HashMap<(String, String), (String, bool)>,
    /// The database's clock (microseconds), read in the transaction: the
    /// times the batch writes (claims, holds, new messages, counts).
    now: i64,
    /// This store instance's processed counts, by queue, of the queues
    /// the batch acks (a queue with no row yet is missing).
    counts: HashMap<String, i64>,
}

/// onceq's own failure inside a transaction's closure, as the client's
/// error (the transaction rolls back): `FAILED_PRECONDITION`.
fn refused(text: String) -> google_cloud_spanner::Error {
    use google_cloud_gax::error::rpc::{Code, Status};
    google_cloud_spanner::Error::service(Status::default().set_code(Code::FailedPrecondition).set_message(text))
}

/// A point read of `keys` of `table` through Spanner's read API: no SQL
/// to parse and plan (measured on the emulator: a read of 12 keys took
/// 1 ms, a query of the same 12 rows 20-30 ms, a query of one row 2-3 ms).
fn point_read<'k>(table: &TableSchema, keys: impl IntoIterator<Item = &'k [Value]>) -> google_cloud_spanner::read::ReadRequest {
    let mut set = KeySetBuilder::new();
    for key in keys {
        set = set.add_key(Key::new(key.iter().map(to_svalue).collect()));
    }
    google_cloud_spanner::read::ReadRequest::builder(table.name.clone(), table.columns.iter().map(|c| c.name.clone()))
        .with_keys(set.build())
        .build()
}

/// The primary keys, `(shard, id)`, of the leased messages' rows.
fn message_keys<'l>(leases: impl IntoIterator<Item = &'l Lease>) -> google_cloud_spanner::key::KeySet {
    let mut keys = KeySetBuilder::new();
    for l in leases {
        keys = keys.add_key(Key::new(vec![SValue::from(l.shard), SValue::from(l.message_id.clone())]));
    }
    keys.build()
}

/// Most keys in one [`point_read`] of a batch.
const KEYS_PER_READ: usize = 256;

/// Read what deciding `batch` needs, in the transaction: every recorded
/// read again (one read per table for the point reads, a query per scan),
/// the lease tokens of its acks (one read; not for a batch of one, whose
/// ack asserts its row instead), the dedup rows of the keys it claims or
/// holds, and those of `sends` (sends outside a message: `onceq send`),
/// in one read, and the database's clock with this store instance's
/// counts rows of the acked queues (`counts`), in one query.
async fn read_ahead(
    tx: &RwTx,
    batch: &[commit::Pending],
    sends: &[SendParams],
    leases: bool,
    counts: Option<i64>,
) -> google_cloud_spanner::Result<Seen> {
    let mut answers: Vec<Vec<Vec<Row>>> = batch.iter().map(|p| vec![Vec::new(); p.reads.len()]).collect();
    // Point reads by table: (pending, its read), the read.
    type Place<'b> = ((usize, usize), &'b ReadRecord);
    let mut points: BTreeMap<&str, Vec<Place>> = BTreeMap::new();
    for (i, p) in batch.iter().enumerate() {
        for (j, read) in p.reads.iter().enumerate() {
            match read.limit {
                None => points.entry(read.table.name.as_str()).or_default().push(((i, j), read)),
                Some(n) => {
                    let rs = tx.execute_query(select_stmt(&read.table, &read.key, Some(n))).await?;
                    answers[i][j] = collect(&read.table, rs).await.map_err(|e| refused(e.to_string()))?;
                }
            }
        }
    }
    for reads in points.values() {
        let table = &reads[0].1.table;
        // Rows are matched to reads by key, exactly: a table keyed by a
        // float (where 0.0 and -0.0, or NaNs, are one key to Spanner)
        // reads each key alone instead.
        let by_key = !table.key_columns().any(|c| c.ty == ColumnType::Float64);
        let per_read = if by_key { KEYS_PER_READ } else { 1 };
        for chunk in reads.chunks(per_read) {
            let rs = tx
                .execute_read(point_read(table, chunk.iter().map(|(_, r)| r.key.as_slice())))
                .await?;
            for row in collect(table, rs).await.map_err(|e| refused(e.to_string()))? {
                for ((i, j), read) in chunk {
                    let matches = !by_key
                        || table
                            .primary_key
                            .iter()
                            .zip(&read.key)
                            .all(|(&c, v)| row.get(c).is_some_and(|(_, got)| got.same(v)));
                    if matches {
                        answers[*i][*j].push(row.clone());
                    }
                }
            }
        }
    }
    let mut seen = Seen {
        reads: answers.into_iter().map(Into::into).collect(),
        ..Seen::default()
    };
    let acks: Vec<&Lease> = batch.iter().filter_map(|p| p.ack.as_ref()).collect();
    if leases && !acks.is_empty() {
        let read = google_cloud_spanner::read::ReadRequest::builder("onceq_messages", ["shard", "id", "lease_token"])
            .with_keys(message_keys(acks.iter().copied()))
            .build();
        let mut rs = tx.execute_read(read).await?;
        while let Some(r) = rs.next().await {
            let r = r?;
            seen.leases
                .insert((r.get::<i64>(0)?, r.get::<String>(1)?), r.get::<Option<String>>(2)?);
        }
    }
    let mut expiring = Vec::new();
    let mut keys: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    let all_sends = batch.iter().flat_map(|p| &p.sends).chain(sends);
    for s in all_sends {
        if let Some(k) = &s.dedup_key {
            keys.entry(s.queue.as_str()).or_default().insert(k.as_str());
        }
    }
    for (q, k, _) in batch.iter().flat_map(|p| &p.holds) {
        keys.entry(q.as_str()).or_default().insert(k.as_str());
    }
    if !keys.is_empty() {
        // By key through the read API (measured on the emulator: the same
        // keys as one query of `dedup_key IN UNNEST(...)` cost 15-45 ms, a
        // scan of the table).
        let mut set = KeySetBuilder::new();
        for (queue, ks) in &keys {
            for k in ks {
                set = set.add_key(Key::new(vec![SValue::from(queue.to_string()), SValue::from(k.to_string())]));
            }
        }
        let read = google_cloud_spanner::read::ReadRequest::builder("onceq_dedup", ["queue", "dedup_key", "message_id", "expires_at"])
            .with_keys(set.build())
            .build();
        let mut rs = tx.execute_read(read).await?;
        while let Some(r) = rs.next().await {
            let r = r?;
            expiring.push((r.get::<String>(0)?, r.get::<String>(1)?, r.get::<String>(2)?, r.get::<i64>(3)?));
        }
    }
    // The clock, and this instance's counts rows of the acked queues, in
    // one query (a left join keeps the clock's row when no count is there).
    let queues: BTreeSet<&str> = acks.iter().map(|l| l.queue.as_str()).collect();
    let clock = match counts {
        Some(shard) if !queues.is_empty() => Statement::builder(format!(
            "SELECT {NOW}, c.queue, c.processed FROM (SELECT 1) AS one
             LEFT JOIN onceq_counts AS c ON c.shard = @s AND c.queue IN UNNEST(@q)"
        ))
        .add_param("s", shard)
        .add_typed_param(
            "q",
            queues.iter().map(|q| q.to_string()).collect::<Vec<_>>(),
            google_cloud_spanner::types::array(google_cloud_spanner::types::string()),
        )
        .build(),
        _ => Statement::builder(format!("SELECT {NOW}, CAST(NULL AS STRING), CAST(NULL AS INT64)")).build(),
    };
    let mut rs = tx.execute_query(clock).await?;
    let mut clocked = false;
    while let Some(r) = rs.next().await {
        let r = r?;
        seen.now = r.get::<i64>(0)?;
        clocked = true;
        if let (Some(queue), Some(n)) = (r.get::<Option<String>>(1)?, r.get::<Option<i64>>(2)?) {
            seen.counts.insert(queue, n);
        }
    }
    if !clocked {
        return Err(refused("the database's clock: the query returned no row".into()));
    }
    for (queue, key, id, expires_at) in expiring {
        seen.dedup.insert((queue, key), (id, expires_at > seen.now));
    }
    Ok(seen)
}

/// The commit path ([`commit::Executor`]) inside one Spanner read-write
/// transaction, deciding each message on what [`read_ahead`] read and
/// keeping what to write until [`SpannerExec::write_all`] buffers it at
/// the end, all as mutations whatever the batch's size (the emulator's
/// cost is per statement: measured, a batch of 15 took 75-120 ms to write
/// with a statement per ack and per dedup claim).
///
/// Writes are mutations, applied at commit, which reads of the same
/// transaction would not see; reads are answered from before the batch
/// wrote anything. So a message that read a row an earlier message of the
/// batch wrote is aborted (its handler re-runs on fresh data) instead of
/// deciding on a stale read.
struct SpannerExec<'t> {
    schema: &'t Schema,
    seen: Seen,
    /// The pending being decided (its answers in `seen.reads`).
    at: usize,
    /// A batch of one: its ack asserts its row (`ASSERT_ROWS_MODIFIED 1`,
    /// the whole transaction fails otherwise) instead of being decided on
    /// a read.
    assert_one: bool,
    /// (table, primary key) written by the messages so far.
    written: Vec<(String, Vec<Value>)>,
    /// The acks, each decided on its row's token as read in this
    /// transaction.
    acks: Vec<Lease>,
    mutations: Vec<Mutation>,
    /// Dedup keys claimed: (queue, key, message id, window), each key once.
    claims: Vec<(String, String, String, Duration)>,
    /// Dedup keys held: (queue, key, window), each existing and held after
    /// any claim of it in the batch.
    holds: Vec<(String, String, Duration)>,
    /// Messages to insert (follow-ups, intents, sends).
    inserts: Vec<(String, SendParams)>,
}

impl<'t> SpannerExec<'t> {
    fn new(schema: &'t Schema, seen: Seen, assert_one: bool) -> Self {
        SpannerExec {
            schema,
            seen,
            at: 0,
            assert_one,
            written: Vec::new(),
            acks: Vec::new(),
            mutations: Vec::new(),
            claims: Vec::new(),
            holds: Vec::new(),
            inserts: Vec::new(),
        }
    }

    /// How much is kept to write (a message that fails must have added
    /// nothing: see [`SpannerBatch::commit_all`]).
    fn kept(&self) -> [usize; 5] {
        [
            self.acks.len(),
            self.mutations.len(),
            self.claims.len(),
            self.holds.len(),
            self.inserts.len(),
        ]
    }

    /// Send what the decided messages write, as mutations applied at the
    /// commit: the row writes, the acks, the dedup claims then the holds,
    /// the new messages and, with `counts` (this instance's counts row and
    /// what the batch processed, by queue), the processed counts; times
    /// are the database's clock as read in the transaction. A batch of one
    /// asserts its ack's row by DML instead.
    ///
    /// No DML: the emulator plans and scans for each statement (measured:
    /// a batch DML of the claims, inserts and counts cost 40-85 ms with
    /// 3,000 orders queued, one of 64 holds 50-200 ms), and on Spanner
    /// mutations need no round trip before the commit. A mutation that
    /// cannot apply (an insert of an id that exists) fails the commit as a
    /// whole, which is then run again one message at a time.
    async fn write_all(self, tx: &RwTx, shards: u32, counts: Option<(i64, &BTreeMap<&str, i64>)>) -> google_cloud_spanner::Result<()> {
        let now = self.seen.now;
        let mut writes = self.mutations;
        if self.assert_one {
            for lease in &self.acks {
                // OUT_OF_RANGE if the lease is lost or the message already
                // acked: the whole transaction rolls back.
                tx.execute_update(
                    Statement::builder(
                        "DELETE FROM onceq_messages WHERE shard = @s AND id = @id AND lease_token = @t ASSERT_ROWS_MODIFIED 1",
                    )
                    .add_param("s", lease.shard)
                    .add_param("id", lease.message_id.clone())
                    .add_param("t", lease.token.clone())
                    .build(),
                )
                .await?;
            }
        } else if !self.acks.is_empty() {
            // Their rows were read with their tokens in this transaction,
            // and matched: locked until the commit, so deleting them by key
            // is deleting them guarded. (One `DELETE` of them all is a
            // full scan on the emulator: measured with 2,000 queued, 80-100
            // ms for a batch of 30.)
            writes.push(Mutation::delete("onceq_messages", message_keys(&self.acks)));
        }
        for (queue, key, id, window) in self.claims {
            writes.push(
                Mutation::new_insert_or_update_builder("onceq_dedup")
                    .set("queue")
                    .to(queue)
                    .set("dedup_key")
                    .to(key)
                    .set("message_id")
                    .to(id)
                    .set("expires_at")
                    .to(now.saturating_add(micros(window)))
                    .build(),
            );
        }
        // A key is held only if its row was read in this transaction
        // (locked until the commit); a key held twice keeps the later
        // hold's window, mutations applying in order.
        for (queue, key, window) in self.holds {
            writes.push(
                Mutation::new_update_builder("onceq_dedup")
                    .set("queue")
                    .to(queue)
                    .set("dedup_key")
                    .to(key)
                    .set("expires_at")
                    .to(now.saturating_add(micros(window)))
                    .build(),
            );
        }
        for (id, p) in self.inserts {
            writes.push(
                Mutation::new_insert_builder("onceq_messages")
                    .set("shard")
                    .to(shard_of(&id, shards))
                    .set("id")
                    .to(id)
                    .set("queue")
                    .to(p.queue)
                    .set("payload")
                    .to(p.payload)
                    .set("attributes")
                    .to(attrs_to_json(&p.attributes))
                    .set("attempt")
                    .to(0i64)
                    .set("enqueued_at")
                    .to(now)
                    .set("visible_at")
                    .to(now.saturating_add(micros(p.delay)))
                    .build(),
            );
        }
        if let Some((shard, by_queue)) = counts {
            for (queue, n) in by_queue {
                let before = self.seen.counts.get(*queue).copied().unwrap_or(0);
                writes.push(
                    Mutation::new_insert_or_update_builder("onceq_counts")
                        .set("queue")
                        .to(queue.to_string())
                        .set("shard")
                        .to(shard)
                        .set("processed")
                        .to(before.saturating_add(*n))
                        .set("last_at")
                        .to(now)
                        .build(),
                );
            }
        }
        if !writes.is_empty() {
            tx.buffer(writes)?;
        }
        Ok(())
    }
}

impl commit::Executor for SpannerExec<'_> {
    async fn reread(&mut self, read: &ReadRecord) -> StoreResult<Vec<Row>> {
        let stale = self.written.iter().any(|(t, key)| {
            *t == read.table.name
                && match read.limit {
                    None => *key == read.key,
                    Some(_) => key.starts_with(&read.key),
                }
        });
        let answer = self.seen.reads.get_mut(self.at).and_then(|a| a.pop_front());
        if stale {
            return Err(StoreError::Aborted(format!(
                "a row of {} read by the handler is written by an earlier message of the same commit",
                read.table.name
            )));
        }
        answer.ok_or_else(|| StoreError::Permanent(format!("a read of {} was not read again", read.table.name)))
    }

    async fn delete_leased(&mut self, lease: &Lease) -> StoreResult<u64> {
        if !self.assert_one {
            let key = (lease.shard, lease.message_id.clone());
            match self.seen.leases.get(&key) {
                Some(Some(token)) if *token == lease.token => {
                    self.seen.leases.remove(&key); // acked once
                }
                _ => return Ok(0),
            }
        }
        self.acks.push(lease.clone());
        Ok(1)
    }

    async fn write(&mut self, w: &ValidWrite) -> StoreResult<()> {
        let table = self.schema.table(&w.table).map_err(StoreError::Permanent)?;
        let key: Vec<Value> = table
            .primary_key
            .iter()
            .map(|&i| w.values.get(i).cloned().flatten().unwrap_or(Value::Null))
            .collect();
        self.mutations.push(mutation(table, w));
        self.written.push((w.table.clone(), key));
        Ok(())
    }

    async fn dedup_claim(&mut self, queue: &str, key: &str, id: &str, window: Duration) -> StoreResult<Option<String>> {
        let k = (queue.to_string(), key.to_string());
        if let Some((existing, true)) = self.seen.dedup.get(&k) {
            return Ok(Some(existing.clone()));
        }
        self.seen.dedup.insert(k, (id.to_string(), true));
        self.claims.push((queue.to_string(), key.to_string(), id.to_string(), window));
        Ok(None)
    }

    async fn message_insert(&mut self, id: &str, p: &SendParams) -> StoreResult<()> {
        self.inserts.push((id.to_string(), p.clone()));
        Ok(())
    }

    async fn dedup_hold(&mut self, queue: &str, key: &str, window: Duration) -> StoreResult<()> {
        // A key with no row holds nothing (an `UPDATE` of no row); one
        // with a row is live from now on, so no later claim of the batch
        // can replace it, and its hold runs after the batch's claims.
        if let Some((_, live)) = self.seen.dedup.get_mut(&(queue.to_string(), key.to_string())) {
            *live = true;
            self.holds.push((queue.to_string(), key.to_string(), window));
        }
        Ok(())
    }
}

/// Spanner's batch commit: one read-write transaction for the batch; each
/// message decided (reads unchanged, ack's row there with its token) before
/// anything of it is kept to write, so a message that loses gets its own
/// error and leaves nothing behind; then everything kept is written as
/// mutations. A failed statement or commit fails the batch as a whole;
/// unless the outcome is unknown (every message re-runs and its ack
/// decides) or the failure retryable, the batch is then committed again
/// one message at a time, so only the guilty message gets the error.
///
/// Calls per batch, whatever its size: a read by key per table read (and
/// a query per scan), a read of the acked messages' leases, a read of the
/// dedup keys, a query of the clock and the counts rows, the commit.
struct SpannerBatch {
    pool: Arc<Pool>,
    schema: Arc<Schema>,
    shards: u32,
    window: Duration,
    /// The store instance's row of `onceq_counts`, if the table exists.
    counts: Option<i64>,
}

impl SpannerBatch {
    /// The batch in one transaction. `lost` is told which messages the
    /// transaction's last run found with their lease gone: a decision that
    /// holds even when the transaction then fails as a whole.
    async fn commit_all(&self, batch: Arc<Vec<commit::Pending>>, lost: Arc<Mutex<Vec<bool>>>) -> StoreResult<Vec<StoreResult<()>>> {
        let (schema, shards, window, counts) = (self.schema.clone(), self.shards, self.window, self.counts);
        let assert_one = batch.len() == 1;
        self.pool
            .rw("a commit", move |tx| {
                let (batch, schema, lost) = (batch.clone(), schema.clone(), lost.clone());
                async move {
                    let seen = read_ahead(&tx, &batch, &[], !assert_one, counts).await?;
                    let mut ex = SpannerExec::new(&schema, seen, assert_one);
                    let mut results = Vec::with_capacity(batch.len());
                    for (i, p) in batch.iter().enumerate() {
                        ex.at = i;
                        let before = ex.kept();
                        let r = commit::apply(&mut ex, p, window).await;
                        if let Err(e) = &r {
                            if ex.kept() != before {
                                // Decided, then failed: never expected (the
                                // rest cannot fail); what it kept cannot be
                                // told apart, so the batch fails as a whole.
                                return Err(refused(format!("a message failed after it was decided: {e}")));
                            }
                        }
                        results.push(r);
                    }
                    if let Ok(mut lost) = lost.lock() {
                        *lost = results.iter().map(|r| matches!(r, Err(StoreError::LeaseLost { .. }))).collect();
                    }
                    let by_queue = commit::processed_by_queue(&batch, &results);
                    ex.write_all(&tx, shards, counts.map(|shard| (shard, &by_queue))).await?;
                    Ok(results)
                }
            })
            .await
    }
}

tokio::task_local! {
    /// Set while work holds this host's turn at the emulator
    /// ([`Pool::in_turn`]): [`Pool::rw`] takes none of its own.
    static TURN_HELD: ();
}

#[async_trait]
impl commit::BatchCommit for SpannerBatch {
    /// On the emulator, take the turn first and collect the batch then:
    /// messages that finished while this host waited for its turn (measured
    /// with three hosts: 170 ms on average) join this batch instead of
    /// waiting for the next turn.
    async fn commit_collected(&self, collect: &(dyn Fn() -> Vec<commit::Pending> + Send + Sync)) -> Vec<StoreResult<()>> {
        self.pool.in_turn(|| self.commit_batch(collect())).await
    }

    fn blocks(&self) -> bool {
        false
    }

    async fn commit_batch(&self, batch: Vec<commit::Pending>) -> Vec<StoreResult<()>> {
        let n = batch.len();
        let batch = Arc::new(batch);
        let lost = Arc::new(Mutex::new(Vec::new()));
        let e = match self.commit_all(batch.clone(), lost.clone()).await {
            Ok(results) => return results,
            Err(e) => e,
        };
        // A message decided as lease-lost stays lost whatever became of
        // the batch: it hears that, not the batch's error.
        let lost: Vec<bool> = lost.lock().map(|l| l.clone()).unwrap_or_default();
        let lost_or = |i: usize, e: &StoreError| match batch.get(i).and_then(|p| p.ack.as_ref()) {
            Some(lease) if lost.get(i).copied().unwrap_or(false) => StoreError::LeaseLost {
                message_id: lease.message_id.clone(),
            },
            _ => e.clone(),
        };
        if n == 1 {
            let r = match &batch[0].ack {
                Some(lease) => lease_error(e, lease),
                None => e,
            };
            return vec![Err(r)];
        }
        if e.is_unknown_outcome() || e.is_retryable() {
            return (0..n).map(|i| Err(lost_or(i, &e))).collect();
        }
        tracing::debug!("a batch of {n} failed ({e}); committing its messages one by one");
        let mut out = Vec::with_capacity(n);
        for (i, p) in batch.iter().enumerate() {
            if lost.get(i).copied().unwrap_or(false) {
                out.push(Err(lost_or(i, &e)));
                continue;
            }
            let one = Arc::new(vec![p.clone()]);
            out.push(match self.commit_all(one, Arc::new(Mutex::new(Vec::new()))).await {
                Ok(mut r) => r.pop().unwrap_or(Ok(())),
                Err(e) => Err(match &p.ack {
                    Some(lease) => lease_error(e, lease),
                    None => e,
                }),
            });
        }
        out
    }
}

impl SpannerStore {
    /// `UPDATE onceq_messages SET <set> WHERE <lease>`: exactly one row, or
    /// `LeaseLost`.
    async fn guarded_update(&self, what: &str, lease: &Lease, set: &str, n: i64, text: Option<String>) -> StoreResult<()> {
        let (shard, id) = (lease.shard, lease.message_id.clone());
        let sql = format!("UPDATE onceq_messages SET {set} WHERE shard = @s AND id = @id AND lease_token = @t");
        let token = lease.token.clone();
        let id2 = id.clone();
        let count = self
            .rw(what, move |tx| {
                let mut b = Statement::builder(sql.clone())
                    .add_param("s", shard)
                    .add_param("id", id2.clone())
                    .add_param("t", token.clone())
                    .add_param("n", n);
                if let Some(t) = &text {
                    b = b.add_param("x", t.clone());
                }
                let stmt = b.build();
                async move { tx.execute_update(stmt).await }
            })
            .await?;
        if count == 1 {
            Ok(())
        } else {
            Err(StoreError::LeaseLost { message_id: id })
        }
    }

    async fn query_rows(&self, stmt: Statement, table: &TableSchema) -> StoreResult<Vec<Row>> {
        self.pool
            .within(&format!("a query of {}", table.name), false, async {
                let c = self.pool.get().await?;
                let rs = c.single_use().build().execute_query(stmt).await.map_err(classify)?;
                collect(table, rs).await
            })
            .await
    }

    /// The queue counts ([`Store::stats`]), without the deadline.
    async fn stats_now(&self) -> StoreResult<Stats> {
        let c = self.pool.get().await?;
        let mut by_queue: std::collections::BTreeMap<String, QueueStats> = Default::default();
        let mut rs = c
            .single_use()
            .build()
            .execute_query(
                Statement::builder(format!(
                    "SELECT queue, COUNTIF(visible_at <= {NOW}), COUNTIF(visible_at > {NOW} AND lease_token IS NOT NULL),
                        COUNTIF(visible_at > {NOW} AND lease_token IS NULL),
                        MIN(IF(visible_at > {NOW} AND lease_token IS NULL, DIV(visible_at - {NOW}, 1000), NULL)),
                        COUNTIF(visible_at <= {NOW} AND lease_token IS NOT NULL)
                 FROM onceq_messages GROUP BY queue"
                ))
                .build(),
            )
            .await
            .map_err(classify)?;
        while let Some(r) = rs.next().await {
            let r = r.map_err(classify)?;
            let q: String = r.get(0).map_err(classify)?;
            let e = queue_entry(&mut by_queue, q);
            e.ready = r.get::<i64>(1).map_err(classify)? as u64;
            e.leased = r.get::<i64>(2).map_err(classify)? as u64;
            e.delayed = r.get::<i64>(3).map_err(classify)? as u64;
            e.next_due_ms = r.get::<Option<i64>>(4).map_err(classify)?.map(|ms| ms.max(0) as u64);
            e.expired_leases = r.get::<i64>(5).map_err(classify)? as u64;
        }
        if self.counts.is_some() {
            let mut rs = c
                .single_use()
                .build()
                .execute_query(Statement::builder("SELECT queue, SUM(processed), MAX(last_at) FROM onceq_counts GROUP BY queue").build())
                .await
                .map_err(classify)?;
            while let Some(r) = rs.next().await {
                let r = r.map_err(classify)?;
                let e = queue_entry(&mut by_queue, r.get::<String>(0).map_err(classify)?);
                e.processed = r.get::<i64>(1).map_err(classify)?.max(0) as u64;
                e.last_processed_at = r.get::<Option<i64>>(2).map_err(classify)?;
            }
        }
        for (q, n) in counts_by_queue(&c, "SELECT queue, COUNT(*) FROM onceq_dead_letters GROUP BY queue".to_string()).await? {
            queue_entry(&mut by_queue, q).dead = n;
        }
        for (q, n) in counts_by_queue(
            &c,
            format!("SELECT queue, COUNT(*) FROM onceq_dedup WHERE expires_at > {NOW} GROUP BY queue"),
        )
        .await?
        {
            queue_entry(&mut by_queue, q).dedup_keys = n;
        }
        Ok(Stats {
            queues: by_queue.into_values().collect(),
        })
    }

    /// A pseudo-schema for onceq's own tables, to reuse the typed reader.
    fn system_table(name: &str, cols: &[(&str, ColumnType)]) -> TableSchema {
        TableSchema {
            name: name.into(),
            columns: cols
                .iter()
                .map(|(n, t)| ColumnSchema {
                    name: n.to_string(),
                    ty: *t,
                    nullable: true,
                })
                .collect(),
            primary_key: vec![0],
        }
    }
}

fn dead_letter_table() -> TableSchema {
    use ColumnType::*;
    SpannerStore::system_table(
        "onceq_dead_letters",
        &[
            ("id", String),
            ("queue", String),
            ("payload", Bytes),
            ("attributes", String),
            ("attempts", Int64),
            ("enqueued_at", Int64),
            ("failed_at", Int64),
            ("reason", String),
            ("handler_version", String),
            ("failures", Int64),
        ],
    )
}

const DEAD_COLUMNS: &str = "id, queue, payload, attributes, attempts, enqueued_at, failed_at, reason, handler_version, failures";

fn dead_letter_from(row: Row) -> DeadLetter {
    let get = |i: usize| row.get(i).map(|(_, v)| v.clone()).unwrap_or(Value::Null);
    let s = |i: usize| match get(i) {
        Value::String(s) => s,
        _ => std::string::String::new(),
    };
    let n = |i: usize| match get(i) {
        Value::Int64(n) => n,
        _ => 0,
    };
    let payload = match get(2) {
        Value::Bytes(b) => b,
        _ => vec![],
    };
    DeadLetter {
        id: s(0),
        queue: s(1),
        payload_text: std::string::String::from_utf8_lossy(&payload).into_owned(),
        payload,
        attributes: attrs_from_json(&s(3)),
        deliveries: u32::try_from(n(4)).unwrap_or(0),
        failures: u32::try_from(n(9)).unwrap_or(0),
        enqueued_at: n(5),
        failed_at: n(6),
        reason: s(7),
        handler_version: match get(8) {
            Value::String(v) => Some(v),
            _ => None,
        },
    }
}

#[async_trait]
impl Store for SpannerStore {
    fn kind(&self) -> &'static str {
        "spanner"
    }

    fn commit_group(&self) -> Option<&commit::Group> {
        Some(self.group.as_ref())
    }

    fn schema(&self) -> Arc<Schema> {
        self.schema.clone()
    }

    async fn message_send(&self, params: Vec<SendParams>) -> StoreResult<Vec<SendOutcome>> {
        let (shards, window, schema) = (self.shards, self.options.dedup_window, self.schema.clone());
        let params = Arc::new(params);
        self.rw("a send", move |tx| {
            let (params, schema) = (params.clone(), schema.clone());
            async move {
                let seen = read_ahead(&tx, &[], &params, false, None).await?;
                let mut ex = SpannerExec::new(&schema, seen, false);
                let mut out = Vec::with_capacity(params.len());
                for p in params.iter() {
                    // Claims and inserts are kept, never run here: no error.
                    out.push(commit::send(&mut ex, p, window).await.map_err(|e| refused(e.to_string()))?);
                }
                ex.write_all(&tx, shards, None).await?;
                Ok(out)
            }
        })
        .await
    }

    /// On the emulator, take the turn first and collect the requests then
    /// (as [`SpannerBatch::commit_collected`] does for commits).
    async fn message_lease_collected(
        &self,
        queue: &str,
        lease: Duration,
        collect: &(dyn Fn() -> usize + Send + Sync),
    ) -> StoreResult<Vec<LeasedMessage>> {
        let params = |limit| LeaseParams {
            queue: queue.to_owned(),
            limit,
            lease,
        };
        self.pool.in_turn(|| self.message_lease(params(collect()))).await
    }

    async fn message_lease(&self, p: LeaseParams) -> StoreResult<Vec<LeasedMessage>> {
        let token = random_id();
        // Start at a random shard (hosts spread over key ranges) and fill the
        // batch from the following shards, oldest first within each.
        let first = i64::from(rand::random::<u32>() % self.shards);
        // Candidates come from a strong read-only transaction: an empty
        // queue costs no read-write transaction (idle workers of many hosts
        // poll it). Its read timestamp is the database's clock; the queue's
        // index is read by key range up to it, shard by shard from `first`,
        // at most `limit` rows: what is visible now, oldest first within a
        // shard, and never more rows than asked for. (Measured on the
        // emulator with 3,000 queued: the same candidates as one query
        // ordered by shard and visibility cost 30-40 ms, a scan; on Spanner
        // that query read every visible entry of the queue's index.)
        let (candidates, now) = self
            .pool
            .within("a lease query", false, async {
                use google_cloud_spanner::transaction::BeginTransactionOption;
                let c = self.pool.get().await?;
                let ro = c
                    .read_only_transaction()
                    .set_begin_transaction_option(BeginTransactionOption::ExplicitBegin)
                    .build()
                    .await
                    .map_err(classify)?;
                let now = ro
                    .read_timestamp()
                    .map(|t| micros_of(&t))
                    .ok_or_else(|| StoreError::Permanent("a read-only transaction began without a read timestamp".into()))?;
                let shards = i64::from(self.shards);
                let (mut keys, mut n) = (KeySetBuilder::new(), 0usize);
                for range in [first..shards, 0..first] {
                    if n >= p.limit || range.is_empty() {
                        continue;
                    }
                    let mut visible = KeySetBuilder::new();
                    for shard in range {
                        let q = || SValue::from(p.queue.clone());
                        visible = visible.add_range(KeyRange::closed_closed(
                            Key::new(vec![q(), SValue::from(shard)]),
                            Key::new(vec![q(), SValue::from(shard), SValue::from(now)]),
                        ));
                    }
                    let read = google_cloud_spanner::read::ReadRequest::builder("onceq_messages", ["shard", "id"])
                        .with_index("onceq_messages_visible", visible.build())
                        .set_limit((p.limit - n) as i64)
                        .build();
                    let mut rs = ro.execute_read(read).await.map_err(classify)?;
                    while let Some(r) = rs.next().await {
                        let r = r.map_err(classify)?;
                        let (shard, id) = (r.get::<i64>(0).map_err(classify)?, r.get::<String>(1).map_err(classify)?);
                        keys = keys.add_key(Key::new(vec![SValue::from(shard), SValue::from(id)]));
                        n += 1;
                    }
                }
                Ok((if n == 0 { None } else { Some(keys.build()) }, now))
            })
            .await?;
        let Some(candidates) = candidates else {
            return Ok(Vec::new());
        };
        // The candidates' rows are read by key in the read-write
        // transaction (locked until it commits) and those still visible at
        // the query's time taken by mutations: no statement to plan or
        // scan (measured on the emulator: the same lease as one `UPDATE
        // ... THEN RETURN` of its ids cost 25-200 ms, a scan of the queue).
        // A row visible then is visible now. The lease runs from the
        // candidates' read timestamp plus the time since (this host's
        // monotonic clock), so an attempt that waited (aborted and re-run)
        // does not get a shorter lease.
        let read_at = std::time::Instant::now();
        let lease = micros(p.lease);
        let read = google_cloud_spanner::read::ReadRequest::builder("onceq_messages", LEASED_COLUMNS)
            .with_keys(candidates)
            .build();
        let (queue, lease_token) = (p.queue.clone(), token.clone());
        let leased = self
            .rw("a lease", move |tx| {
                let (read, queue, token) = (read.clone(), queue.clone(), lease_token.clone());
                async move {
                    let since = i64::try_from(read_at.elapsed().as_micros()).unwrap_or(i64::MAX);
                    let until = now.saturating_add(since).saturating_add(lease);
                    let mut rs = tx.execute_read(read).await?;
                    let mut rows = Vec::new();
                    let mut writes = Vec::new();
                    while let Some(r) = rs.next().await {
                        let r = r?;
                        if r.get::<String>(7)? != queue || r.get::<i64>(6)? > now {
                            continue; // leased (or re-queued) since the query
                        }
                        let attempt = r.get::<i64>(4)?.saturating_add(1);
                        writes.push(
                            Mutation::new_update_builder("onceq_messages")
                                .set("shard")
                                .to(r.get::<i64>(0)?)
                                .set("id")
                                .to(&r.get::<String>(1)?)
                                .set("lease_token")
                                .to(&token)
                                .set("visible_at")
                                .to(until)
                                .set("attempt")
                                .to(attempt)
                                .build(),
                        );
                        rows.push((r, attempt));
                    }
                    if !writes.is_empty() {
                        tx.buffer(writes)?;
                    }
                    Ok((rows, until))
                }
            })
            .await?;
        let (leased, until) = leased;
        let mut out = leased
            .iter()
            .map(|(r, attempt)| message_from_row(&p.queue, &token, r, *attempt, until))
            .collect::<StoreResult<Vec<_>>>()?;
        out.sort_by_key(|m| m.message.enqueued_at);
        Ok(out)
    }

    async fn message_lease_renew(&self, leases: &[Lease], duration: Duration) -> StoreResult<Vec<bool>> {
        let sql = format!("UPDATE onceq_messages SET visible_at = {NOW} + @n WHERE shard = @s AND id = @id AND lease_token = @t");
        let stmts: Arc<Vec<Statement>> = Arc::new(
            leases
                .iter()
                .map(|l| {
                    Statement::builder(sql.clone())
                        .add_param("s", l.shard)
                        .add_param("id", l.message_id.clone())
                        .add_param("t", l.token.clone())
                        .add_param("n", micros(duration))
                        .build()
                })
                .collect(),
        );
        self.rw("a lease renewal", move |tx| {
            let stmts = stmts.clone();
            async move {
                let mut held = Vec::with_capacity(stmts.len());
                for stmt in stmts.iter() {
                    held.push(tx.execute_update(stmt.clone()).await? == 1);
                }
                Ok(held)
            }
        })
        .await
    }

    async fn message_release(&self, lease: &Lease) -> StoreResult<()> {
        self.guarded_update(
            "a release",
            lease,
            &format!("visible_at = {NOW} + @n, lease_token = NULL, attempt = GREATEST(attempt - 1, 0)"),
            0,
            None,
        )
        .await
    }

    async fn message_retry_later(&self, lease: &Lease, p: RetryParams) -> StoreResult<()> {
        let failures = if p.failed { "failures = failures + 1, " } else { "" };
        self.guarded_update(
            "a retry later",
            lease,
            &format!("{failures}visible_at = {NOW} + @n, lease_token = NULL, last_error = @x"),
            micros(p.delay),
            Some(p.reason),
        )
        .await
    }

    async fn message_dead_letter(&self, lease: &Lease, p: DeadLetterParams) -> StoreResult<()> {
        let (shard, id) = (lease.shard, lease.message_id.clone());
        let clear = Statement::builder("DELETE FROM onceq_dead_letters WHERE id = @id")
            .add_param("id", id.clone())
            .build();
        let copy = Statement::builder(format!(
            "INSERT INTO onceq_dead_letters (id, queue, payload, attributes, attempts, enqueued_at, failed_at, reason, handler_version, failures)
             SELECT id, queue, payload, attributes, attempt, enqueued_at, {NOW}, @r, @v, failures + @f FROM onceq_messages
             WHERE shard = @s AND id = @id AND lease_token = @t"
        ))
        .add_param("f", i64::from(p.failed))
        .add_param("s", shard)
        .add_param("id", id.clone())
        .add_param("t", lease.token.clone())
        .add_typed_param("r", p.reason.clone(), google_cloud_spanner::types::string())
        .add_typed_param("v", p.handler_version.clone(), google_cloud_spanner::types::string())
        .build();
        let delete =
            Statement::builder("DELETE FROM onceq_messages WHERE shard = @s AND id = @id AND lease_token = @t ASSERT_ROWS_MODIFIED 1")
                .add_param("s", shard)
                .add_param("id", id)
                .add_param("t", lease.token.clone())
                .build();
        self.rw("a dead letter", move |tx| {
            let (clear, copy, delete) = (clear.clone(), copy.clone(), delete.clone());
            async move {
                tx.execute_update(clear).await?;
                tx.execute_update(copy).await?;
                tx.execute_update(delete).await
            }
        })
        .await
        .map(|_| ())
        .map_err(|e| lease_error(e, lease))
    }

    async fn commit_hold(&self) -> StoreResult<Option<commit::Hold>> {
        let driver = batch_driver(&self.pool, &self.schema, self.shards, self.options.dedup_window, self.counts);
        self.group.hold(driver).await.map(Some)
    }

    async fn transaction_begin(&self) -> StoreResult<Box<dyn Transaction>> {
        Ok(Box::new(SpannerTransaction {
            pool: self.pool.clone(),
            group: self.group.clone(),
            shards: self.shards,
            window: self.options.dedup_window,
            counts: self.counts,
            snapshot: None,
            pending: commit::Pending::default(),
            schema: self.schema.clone(),
        }))
    }

    async fn stats(&self) -> StoreResult<Stats> {
        self.pool.within("the stats queries", false, self.stats_now()).await
    }

    async fn dead_letter_list(&self, queues: Queues<'_>, limit: usize) -> StoreResult<Vec<DeadLetter>> {
        let t = dead_letter_table();
        let (cond, q) = queue_condition(queues);
        let stmt = Statement::builder(format!(
            "SELECT {DEAD_COLUMNS} FROM onceq_dead_letters
             WHERE {cond} ORDER BY failed_at DESC, id LIMIT @n"
        ))
        .add_param("q", q)
        .add_param("n", limit.min(i64::MAX as usize) as i64)
        .build();
        Ok(self.query_rows(stmt, &t).await?.into_iter().map(dead_letter_from).collect())
    }

    async fn dead_letter_get(&self, id: &str) -> StoreResult<Option<DeadLetter>> {
        let t = dead_letter_table();
        let stmt = Statement::builder(format!("SELECT {DEAD_COLUMNS} FROM onceq_dead_letters WHERE id = @id"))
            .add_param("id", id.to_string())
            .build();
        Ok(self.query_rows(stmt, &t).await?.into_iter().next().map(dead_letter_from))
    }

    async fn dead_letter_replay(&self, id: &str) -> StoreResult<Option<String>> {
        let shard = shard_of(id, self.shards);
        let copy = Statement::builder(format!(
            "INSERT INTO onceq_messages (shard, id, queue, payload, attributes, attempt, enqueued_at, visible_at, failures)
             SELECT @s, id, queue, payload, attributes, 0, enqueued_at, {NOW}, 0 FROM onceq_dead_letters WHERE id = @id"
        ))
        .add_param("s", shard)
        .add_param("id", id.to_string())
        .build();
        let delete = Statement::builder("DELETE FROM onceq_dead_letters WHERE id = @id")
            .add_param("id", id.to_string())
            .build();
        let id = id.to_string();
        self.rw("a replay", move |tx| {
            let (copy, delete, id) = (copy.clone(), delete.clone(), id.clone());
            async move {
                if tx.execute_update(copy).await? == 0 {
                    return Ok(None);
                }
                tx.execute_update(delete).await?;
                Ok(Some(id))
            }
        })
        .await
    }

    async fn message_list(&self, queues: Queues<'_>, limit: usize) -> StoreResult<Vec<QueuedMessage>> {
        let (cond, q) = queue_condition(queues);
        let stmt = Statement::builder(format!(
            "SELECT {QUEUED_COLUMNS} FROM onceq_messages WHERE {cond} ORDER BY enqueued_at, id LIMIT @n"
        ))
        .add_param("q", q)
        .add_param("n", limit.min(i64::MAX as usize) as i64)
        .build();
        let rows = self.query_rows(stmt, &queued_table()).await?;
        Ok(rows.into_iter().map(queued_from).collect())
    }

    async fn message_get(&self, id: &str) -> StoreResult<Option<QueuedMessage>> {
        let stmt = Statement::builder(format!("SELECT {QUEUED_COLUMNS} FROM onceq_messages WHERE shard = @s AND id = @id"))
            .add_param("s", shard_of(id, self.shards))
            .add_param("id", id.to_string())
            .build();
        let rows = self.query_rows(stmt, &queued_table()).await?;
        Ok(rows.into_iter().next().map(queued_from))
    }

    async fn table_rows(&self, table: &str) -> StoreResult<Vec<Row>> {
        let t = self.schema.table(table).map_err(StoreError::Permanent)?.clone();
        self.query_rows(select_stmt(&t, &[], Some(usize::MAX >> 2)), &t).await
    }

    async fn dedup_purge(&self) -> StoreResult<u64> {
        let n = self
            .rw("the dedup purge", |tx| async move {
                tx.execute_update(Statement::builder(format!("DELETE FROM onceq_dedup WHERE expires_at <= {NOW}")).build())
                    .await
            })
            .await?;
        Ok(n.max(0) as u64)
    }

    async fn dedup_list(&self, queues: Queues<'_>, within: Duration, limit: usize) -> StoreResult<Vec<DedupKey>> {
        use ColumnType::*;
        let t = Self::system_table(
            "onceq_dedup",
            &[
                ("queue", String),
                ("dedup_key", String),
                ("message_id", String),
                ("expires_at", Int64),
            ],
        );
        let (cond, q) = queue_condition(queues);
        let stmt = Statement::builder(format!(
            "SELECT queue, dedup_key, message_id, expires_at FROM onceq_dedup
             WHERE {cond} AND expires_at > {NOW} AND expires_at <= {NOW} + @w
             ORDER BY expires_at DESC, queue, dedup_key LIMIT @n"
        ))
        .add_param("q", q)
        .add_param("w", micros(within))
        .add_param("n", limit.min(i64::MAX as usize) as i64)
        .build();
        Ok(self
            .query_rows(stmt, &t)
            .await?
            .into_iter()
            .map(|row| {
                let get = |i: usize| row.get(i).map(|(_, v)| v.clone()).unwrap_or(Value::Null);
                let text = |i: usize| match get(i) {
                    Value::String(s) => s,
                    _ => std::string::String::new(),
                };
                DedupKey {
                    queue: text(0),
                    key: text(1),
                    message_id: text(2),
                    expires_at: match get(3) {
                        Value::Int64(n) => n,
                        _ => 0,
                    },
                }
            })
            .collect())
    }
}

/// `(queue, count)` rows of a `SELECT queue, COUNT(*) ... GROUP BY queue`.
async fn counts_by_queue(c: &DatabaseClient, sql: String) -> StoreResult<Vec<(String, u64)>> {
    let mut rs = c
        .single_use()
        .build()
        .execute_query(Statement::builder(sql).build())
        .await
        .map_err(classify)?;
    let mut out = Vec::new();
    while let Some(r) = rs.next().await {
        let r = r.map_err(classify)?;
        out.push((
            r.get::<String>(0).map_err(classify)?,
            r.get::<i64>(1).map_err(classify)?.max(0) as u64,
        ));
    }
    Ok(out)
}

/// A `WHERE` condition on `queue` for a selection, with `@q` bound to the
/// returned text.
fn queue_condition(q: Queues<'_>) -> (&'static str, String) {
    match q {
        Queues::All => ("@q = ''", String::new()),
        Queues::Named(name) => ("queue = @q", name.to_string()),
        Queues::Prefix(p) => ("STARTS_WITH(queue, @q)", p.to_string()),
    }
}

const QUEUED_COLUMNS: &str = "id, queue, payload, attributes, attempt, enqueued_at, visible_at,
    lease_token IS NOT NULL AND visible_at > UNIX_MICROS(CURRENT_TIMESTAMP()), last_error, failures";

fn queued_table() -> TableSchema {
    use ColumnType::*;
    SpannerStore::system_table(
        "onceq_messages",
        &[
            ("id", String),
            ("queue", String),
            ("payload", Bytes),
            ("attributes", String),
            ("attempt", Int64),
            ("enqueued_at", Int64),
            ("visible_at", Int64),
            ("leased", Bool),
            ("last_error", String),
            ("failures", Int64),
        ],
    )
}

fn queued_from(row: Row) -> QueuedMessage {
    let mut it = row.into_iter().map(|(_, v)| v);
    let mut next = || it.next().unwrap_or(Value::Null);
    let text = |v: Value| match v {
        Value::String(s) => s,
        _ => std::string::String::new(),
    };
    let int = |v: Value| match v {
        Value::Int64(n) => n,
        _ => 0,
    };
    let id = text(next());
    let queue = text(next());
    let payload = match next() {
        Value::Bytes(b) => b,
        _ => Vec::new(),
    };
    let attributes = attrs_from_json(&text(next()));
    let deliveries = u32::try_from(int(next())).unwrap_or(u32::MAX);
    let enqueued_at = int(next());
    let visible_at = int(next());
    let leased = matches!(next(), Value::Bool(true));
    let last_error = match next() {
        Value::String(s) => Some(s),
        _ => None,
    };
    let failures = u32::try_from(int(next())).unwrap_or(u32::MAX);
    QueuedMessage {
        id,
        queue,
        payload_text: std::string::String::from_utf8_lossy(&payload).into_owned(),
        payload,
        attributes,
        deliveries,
        failures,
        enqueued_at,
        visible_at,
        leased,
        last_error,
    }
}

/// What [`commit::Group`] starts its committer with, if it has none.
fn batch_driver(
    pool: &Arc<Pool>,
    schema: &Arc<Schema>,
    shards: u32,
    window: Duration,
    counts: Option<i64>,
) -> impl Fn() -> Arc<dyn commit::BatchCommit> {
    let (pool, schema) = (pool.clone(), schema.clone());
    move || {
        Arc::new(SpannerBatch {
            pool: pool.clone(),
            schema: schema.clone(),
            shards,
            window,
            counts,
        }) as Arc<dyn commit::BatchCommit>
    }
}

impl SpannerTransaction {
    fn driver(&self) -> impl Fn() -> Arc<dyn commit::BatchCommit> {
        batch_driver(&self.pool, &self.schema, self.shards, self.window, self.counts)
    }
}

struct SpannerTransaction {
    pool: Arc<Pool>,
    /// The store's commit group.
    group: Arc<commit::Group>,
    schema: Arc<Schema>,
    shards: u32,
    window: Duration,
    counts: Option<i64>,
    /// The read-only snapshot serving the handler's reads, with its client.
    snapshot: Option<(Lent, google_cloud_spanner::transaction::MultiUseReadOnlyTransaction)>,
    /// What the commit will re-check and apply.
    pending: commit::Pending,
}

impl SpannerTransaction {
    async fn snapshot(&mut self) -> StoreResult<&google_cloud_spanner::transaction::MultiUseReadOnlyTransaction> {
        if self.snapshot.is_none() {
            let c = self.pool.get().await?;
            let ro = c.read_only_transaction().build().await.map_err(classify)?;
            self.snapshot = Some((c, ro));
        }
        match &self.snapshot {
            Some((_, ro)) => Ok(ro),
            None => Err(StoreError::Permanent("snapshot missing".into())),
        }
    }

    /// A handler's read in the snapshot, under the call deadline.
    async fn snapshot_rows(&mut self, table: &TableSchema, key: &[Value], limit: Option<usize>) -> StoreResult<Vec<Row>> {
        let pool = self.pool.clone();
        let what = format!("a read of {}", table.name);
        pool.within(&what, false, async {
            let snapshot = self.snapshot().await?;
            let rs = match limit {
                None => snapshot.execute_read(point_read(table, [key])).await,
                Some(_) => snapshot.execute_query(select_stmt(table, key, limit)).await,
            }
            .map_err(classify)?;
            collect(table, rs).await
        })
        .await
    }
}

#[async_trait]
impl Transaction for SpannerTransaction {
    async fn row_get(&mut self, table: &TableSchema, key: &[Value]) -> StoreResult<Option<Row>> {
        let result = self.snapshot_rows(table, key, None).await?.into_iter().next();
        self.pending.read(table, key, None, result.iter().cloned().collect());
        Ok(result)
    }

    async fn row_scan(&mut self, table: &TableSchema, prefix: &[Value], limit: usize) -> StoreResult<Vec<Row>> {
        let limit = limit.min(MAX_SCAN_ROWS);
        let result = self.snapshot_rows(table, prefix, Some(limit)).await?;
        self.pending.read(table, prefix, Some(limit), result.clone());
        Ok(result)
    }

    fn row_write(&mut self, write: ValidWrite) {
        self.pending.write(write)
    }

    fn message_enqueue(&mut self, params: SendParams) {
        self.pending.send(params)
    }

    fn dedup_hold(&mut self, queue: &str, key: &str, window: Duration) {
        self.pending.hold(queue, key, window)
    }

    fn message_ack(&mut self, lease: &Lease) {
        self.pending.ack(lease)
    }

    async fn commit(mut self: Box<Self>) -> StoreResult<()> {
        // The snapshot's client goes back to the pool; the committer
        // takes one for the whole batch.
        self.snapshot = None;
        let pending = std::mem::take(&mut self.pending);
        self.group.commit(self.driver(), pending).await
    }

    async fn commit_held(mut self: Box<Self>, hold: commit::Hold) -> StoreResult<()> {
        self.snapshot = None;
        let pending = std::mem::take(&mut self.pending);
        match hold.commit(pending).await {
            Ok(result) => result,
            Err(pending) => self.group.commit(self.driver(), pending).await,
        }
    }

    async fn rollback(self: Box<Self>) {}
}
