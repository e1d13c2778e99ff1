//! The `Handler` trait (message in, effects out) and the read scope a
//! handler reads through.
//!
//! The Wasm runtime is one `Handler`; [`NativeHandler`] (a Rust closure) is
//! another, used by tests and as the benchmark baseline. The protocol does
//! not know which one it drives.

use crate::schema::Schema;
use crate::store::{StoreError, Transaction};
use crate::value::{Effect, Message, Row, Value};
use async_trait::async_trait;
use std::collections::BTreeSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

/// Why an attempt of a message committed nothing. The variants tell the
/// message's own verdicts (each a *failure*, counted toward
/// `max_attempts`) from the host's own trouble ([`HandlerFailure::Host`]:
/// never counted; the message is deferred and runs again later).
#[derive(Debug, Clone, PartialEq)]
pub enum HandlerFailure {
    /// The handler asked to be retried later.
    Retry { reason: String, delay: Option<Duration> },
    /// The handler rejected the message: dead-letter it now.
    Reject(String),
    /// The guest crashed: a trap (a Rust panic ends as one), an uncaught
    /// exception; the text says what, and where when the guest told.
    Crash(String),
    /// The guest called `exit` with this code.
    Exit(i32),
    /// The call ran past its deadline (`queue.deadline`).
    Deadline(Duration),
    /// The guest grew past its memory limit (`queue.memory`), in bytes.
    Memory(usize),
    /// The call ran past its instruction budget (`queue.max_instructions`):
    /// deterministic, so the message is dead-lettered at once.
    Instructions(u64),
    /// A read the handler made was refused (even if it swallowed the error).
    Read(ReadError),
    /// An effect the handler returned was refused.
    Effect(super::EffectError),
    /// The database refused one of its writes (a constraint, a trigger).
    Refused(String),
    /// An outbox connector's receiver did not take the intent: for now
    /// (`retry`, after `after` if it said) or for good.
    Undelivered {
        reason: String,
        retry: bool,
        after: Option<Duration>,
    },
    /// Not the message's doing: see [`HostTrouble`].
    Host(HostTrouble),
}

/// How the guest SDKs (JavaScript, Python) report an exception the handler
/// did not catch: a `retry` whose reason starts with this (the WIT has no
/// crash case). The host reads it as the crash it is
/// ([`HandlerFailure::from_retry`]).
pub const UNCAUGHT: &str = "uncaught ";

/// The host's own trouble during an attempt. The message is not charged a
/// failure for it: it is deferred (visible again after a backoff), and a
/// warning says why.
#[derive(Debug, Clone, PartialEq)]
pub enum HostTrouble {
    /// The store failed the attempt (after its re-runs): unavailable,
    /// aborted by contention again and again, an unknown outcome, a fault
    /// of its own.
    Store(StoreError),
    /// A read did not answer within the handler's deadline.
    ReadStalled(Duration),
    /// The host could not start the handler: descriptors, memory or
    /// instance slots ran out.
    Resources(String),
}

impl HandlerFailure {
    /// What a handler's `retry` means: a retry it asked for, or, with the
    /// SDKs' [`UNCAUGHT`] reason, an exception it did not catch (a crash).
    pub fn from_retry(reason: String, delay: Option<Duration>) -> HandlerFailure {
        match (reason.strip_prefix(UNCAUGHT), delay) {
            (Some(what), None) => HandlerFailure::Crash(format!("uncaught {what}")),
            _ => HandlerFailure::Retry { reason, delay },
        }
    }

    /// A crash of the guest: the same message, logical time and seed crash
    /// it the same way again unless what it reads changed.
    pub fn is_crash(&self) -> bool {
        matches!(self, HandlerFailure::Crash(_) | HandlerFailure::Exit(_) | HandlerFailure::Memory(_))
    }

    /// A failure of the message's own (counted toward `max_attempts`), or
    /// the host's trouble (deferred, not counted).
    pub fn is_own(&self) -> bool {
        !matches!(self, HandlerFailure::Host(_))
    }

    /// The failure's class, as metrics and `onceq try` name it.
    pub fn class(&self) -> &'static str {
        match self {
            HandlerFailure::Retry { .. } => "retry_asked",
            HandlerFailure::Reject(_) => "rejected",
            HandlerFailure::Crash(_) => "crash",
            HandlerFailure::Exit(_) => "exit",
            HandlerFailure::Deadline(_) => "deadline",
            HandlerFailure::Memory(_) => "memory",
            HandlerFailure::Instructions(_) => "instructions",
            HandlerFailure::Read(_) => "read_refused",
            HandlerFailure::Effect(_) => "effect_refused",
            HandlerFailure::Refused(_) => "write_refused",
            HandlerFailure::Undelivered { .. } => "undelivered",
            HandlerFailure::Host(_) => "host_trouble",
        }
    }

    /// The reason a real run records for this failure: the host's trouble
    /// says it was deferred, uncounted.
    pub fn recorded_reason(&self) -> String {
        if self.is_own() {
            self.to_string()
        } else {
            format!("{self} (deferred, not counted as a failure)")
        }
    }

    /// A store error as the failure it is: a refused write is the
    /// message's own; anything else is the store's trouble.
    pub fn from_store(e: StoreError) -> HandlerFailure {
        match e {
            StoreError::WriteRefused(m) => HandlerFailure::Refused(m),
            other => HandlerFailure::Host(HostTrouble::Store(other)),
        }
    }
}

impl std::fmt::Display for HandlerFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HandlerFailure::Retry { reason, .. } => write!(f, "handler asked to retry: {reason}"),
            HandlerFailure::Reject(r) => write!(f, "rejected by handler: {r}"),
            HandlerFailure::Crash(r) => write!(f, "handler crashed: {r}"),
            HandlerFailure::Exit(code) => write!(f, "handler called exit({code})"),
            HandlerFailure::Deadline(d) => write!(
                f,
                "handler ran past its deadline of {} (setting queue.deadline)",
                crate::names::duration(*d)
            ),
            HandlerFailure::Memory(n) => write!(f, "handler grew past its memory limit of {} MiB (setting queue.memory)", n >> 20),
            HandlerFailure::Instructions(n) => write!(
                f,
                "handler ran past its budget of {} instructions (setting queue.max_instructions)",
                crate::names::thousands(*n)
            ),
            HandlerFailure::Read(e) => write!(f, "handler failed: {e}"),
            HandlerFailure::Effect(e) => write!(f, "handler failed: bad effect: {e}"),
            HandlerFailure::Refused(m) => write!(f, "write refused by the database: {m}"),
            HandlerFailure::Undelivered { reason, retry: true, .. } => write!(f, "delivery failed: {reason}"),
            HandlerFailure::Undelivered { reason, retry: false, .. } => write!(f, "delivery refused: {reason}"),
            HandlerFailure::Host(t) => write!(f, "{t}"),
        }
    }
}

impl std::fmt::Display for HostTrouble {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HostTrouble::Store(e) => write!(f, "store trouble: {e}"),
            HostTrouble::ReadStalled(d) => write!(
                f,
                "store trouble: a read did not answer within the handler's deadline of {}",
                crate::names::duration(*d)
            ),
            HostTrouble::Resources(m) => write!(f, "the host could not start the handler: {m}"),
        }
    }
}

/// A read refused by the scope, naming what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    #[error("read of table {table} is not granted to this queue (add it to the queue's `tables` in onceq.toml)")]
    NotGranted { table: String },
    /// The table is granted but not in the database's schema.
    #[error("{message}")]
    UnknownTable { table: String, message: String },
    /// The key does not fit the table's primary key (count, types).
    #[error("{message}")]
    BadKey { table: String, message: String },
    #[error("more than {limit} reads in one call (setting max_reads)")]
    TooManyReads { limit: u64 },
    #[error("reads returned more than {limit} bytes in one call (setting max_read_bytes)")]
    TooManyBytes { limit: usize },
}

impl ReadError {
    /// The same message would be refused the same way on every attempt
    /// (not granted, no such table, a malformed key); the limits depend on
    /// the data read.
    pub fn is_deterministic(&self) -> bool {
        matches!(
            self,
            ReadError::NotGranted { .. } | ReadError::UnknownTable { .. } | ReadError::BadKey { .. }
        )
    }
}

/// Why a read through the [`ReadScope`] failed: refused by the scope
/// (grants, schema, limits), or failed by the store. The guest gets its
/// text (the WIT's `string`); the protocol decides on the failure the
/// scope recorded.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScopeError {
    #[error("{0}")]
    Refused(ReadError),
    #[error("{0}")]
    Store(StoreError),
}

/// What a handler call returns: the read scope (handed back so the protocol
/// can commit its transaction) and the effects or the failure.
pub struct HandleOutput {
    pub scope: ReadScope,
    pub result: Result<Vec<Effect>, HandlerFailure>,
}

/// A message handler.
#[async_trait]
pub trait Handler: Send + Sync {
    /// The version of the code (content hash for a component).
    fn version(&self) -> &str;

    /// Handle one message, reading through `scope`.
    async fn handle(&self, msg: &Message, scope: ReadScope) -> HandleOutput;

    /// Whether a worker may run the messages of its leased batch through
    /// this handler at once (up to the messages it keeps going), rather
    /// than one handler at a time. No for a component: each run holds a
    /// live instance and a core. Yes for the outbox's dispatcher of a
    /// connector that allows it, which mostly waits for the connector: a
    /// worker's intents then share its round trip (one write and
    /// `fdatasync` of a `file` connector) instead of waiting for one each,
    /// in turn.
    fn runs_together(&self) -> bool {
        false
    }
}

/// The reads a handler may make for one message: checked against the
/// queue's grants and the schema, served from the message's transaction.
pub struct ReadScope {
    tx: Box<dyn Transaction>,
    schema: Arc<Schema>,
    tables: Arc<BTreeSet<String>>,
    /// The first refused read (ungranted or unknown table, bad key, a
    /// limit): the attempt fails even if the handler swallows the error.
    pub violation: Option<ReadError>,
    /// A store failure during a read: the attempt is re-run or failed by
    /// the protocol according to its class.
    pub store_error: Option<StoreError>,
    /// Number of reads served.
    pub reads: u64,
    /// A read is waiting for the store: if the handler's deadline cuts the
    /// call now, the store stalled, not the handler.
    pub reading: bool,
    /// Bytes of rows returned so far.
    pub read_bytes: usize,
    /// Instructions the call ran (instantiation included), when the
    /// runtime counts them.
    pub instructions: Option<u64>,
    /// The call's `log` lines (level, line), kept only when its span is
    /// recorded (telemetry on): they become the span's events.
    pub logs: Option<Vec<(&'static str, String)>>,
    /// Effects the handler emitted during the call (the WIT's
    /// `encoded.emit`): they come before those it returns.
    pub emitted: Vec<Effect>,
    /// The first refused emit (malformed, or over a limit): the attempt
    /// fails even if the handler swallows the error.
    pub emit_error: Option<super::EffectError>,
    emitted_bytes: usize,
    emits: usize,
    max_reads: u64,
    max_read_bytes: usize,
    max_effects: usize,
    max_effect_bytes: usize,
}

impl ReadScope {
    pub fn new(tx: Box<dyn Transaction>, schema: Arc<Schema>, tables: Arc<BTreeSet<String>>) -> ReadScope {
        ReadScope {
            tx,
            schema,
            tables,
            violation: None,
            store_error: None,
            reads: 0,
            reading: false,
            read_bytes: 0,
            instructions: None,
            logs: None,
            emitted: Vec::new(),
            emit_error: None,
            emitted_bytes: 0,
            emits: 0,
            max_reads: super::EffectLimits::default().max_reads,
            max_read_bytes: super::EffectLimits::default().max_read_bytes,
            max_effects: super::EffectLimits::default().max_effects,
            max_effect_bytes: super::EffectLimits::default().max_bytes,
        }
    }

    /// Bound the reads of this call (`max_reads`, `max_read_bytes`): every
    /// read is recorded for the commit-time check, so a handler that reads
    /// without end would make the host hold it all.
    pub fn with_limits(mut self, limits: &super::EffectLimits) -> ReadScope {
        self.max_reads = limits.max_reads;
        self.max_read_bytes = limits.max_read_bytes;
        self.max_effects = limits.max_effects;
        self.max_effect_bytes = limits.max_bytes;
        self
    }

    /// Take one `emit` of effects decoded by `decode`, which is given how
    /// many more the call may emit and the limit (`max_effects`) and must
    /// stop at the first over. Their bytes count against
    /// `max_effect_bytes` as they arrive, so the host never holds more
    /// than the queue allows. A refusal is kept (the attempt fails even if
    /// the guest swallows it) and every later emit of the call is refused.
    pub fn emit(&mut self, decode: impl FnOnce(usize, usize) -> Result<Vec<Effect>, String>) -> Result<(), String> {
        if let Some(e) = &self.emit_error {
            return Err(e.to_string());
        }
        self.emits += 1;
        let room = self.max_effects.saturating_sub(self.emitted.len());
        let refused = match decode(room, self.max_effects) {
            Err(problem) => super::EffectError::Encoded { call: self.emits, problem },
            Ok(effects) => {
                self.emitted_bytes = effects.iter().map(Effect::size).fold(self.emitted_bytes, usize::saturating_add);
                if self.emitted_bytes <= self.max_effect_bytes {
                    self.emitted.extend(effects);
                    return Ok(());
                }
                super::EffectError::TooLarge {
                    bytes: self.emitted_bytes,
                    limit: self.max_effect_bytes,
                }
            }
        };
        self.emitted = Vec::new();
        let text = refused.to_string();
        self.emit_error = Some(refused);
        Err(text)
    }

    /// A read's span, under the handler call's, when the call is traced
    /// (its logs are kept only then).
    fn read_span(&self, op: &'static str, table: &str) -> crate::telemetry::Active {
        if self.logs.is_none() {
            return crate::telemetry::Active::default();
        }
        crate::telemetry::current().read(op, table)
    }

    /// Keep a `log` line of the handler for its span, if the span is
    /// recorded.
    pub fn note_log(&mut self, level: &'static str, line: &str) {
        if let Some(logs) = &mut self.logs {
            logs.push((level, line.to_string()));
        }
    }

    /// Count a read against `max_reads`.
    fn count_read(&mut self) -> Result<(), ScopeError> {
        if self.reads >= self.max_reads {
            return Err(self.refuse(ReadError::TooManyReads { limit: self.max_reads }));
        }
        self.reads += 1;
        Ok(())
    }

    /// Count returned rows against `max_read_bytes`.
    fn count_bytes<'r>(&mut self, rows: impl IntoIterator<Item = &'r Row>) -> Result<(), ScopeError> {
        let n: usize = rows
            .into_iter()
            .map(|r| {
                r.iter()
                    .map(|(k, v)| crate::value::ITEM_OVERHEAD + k.len() + v.size())
                    .sum::<usize>()
            })
            .sum();
        self.read_bytes = self.read_bytes.saturating_add(n);
        if self.read_bytes > self.max_read_bytes {
            return Err(self.refuse(ReadError::TooManyBytes {
                limit: self.max_read_bytes,
            }));
        }
        Ok(())
    }

    /// Give the transaction back (for commit or rollback).
    pub fn into_transaction(self) -> Box<dyn Transaction> {
        self.tx
    }

    pub fn transaction(&mut self) -> &mut dyn Transaction {
        &mut *self.tx
    }

    /// What the handler did that the scope refused, whatever the handler
    /// returned: a refused read first, then a refused emit. (A store error
    /// during a read, which the caller weighs before this, is not the
    /// handler's doing.)
    pub fn refusal(&self) -> Option<HandlerFailure> {
        match (&self.violation, &self.emit_error) {
            (Some(v), _) => Some(HandlerFailure::Read(v.clone())),
            (None, Some(e)) => Some(HandlerFailure::Effect(e.clone())),
            (None, None) => None,
        }
    }

    /// A read whose query did not decode (the WIT's `encoded.get` and
    /// `scan`): refused as a malformed key is, so the attempt fails even if
    /// the guest swallows the error. Returns the text the guest gets.
    pub fn refuse_malformed(&mut self, message: String) -> String {
        self.refuse(ReadError::BadKey {
            table: String::new(),
            message,
        })
        .to_string()
    }

    /// Record the first refusal; the guest gets it back.
    fn refuse(&mut self, e: ReadError) -> ScopeError {
        self.violation.get_or_insert(e.clone());
        ScopeError::Refused(e)
    }

    fn check(&mut self, table: &str, key: &[Value], prefix: bool) -> Result<crate::schema::TableSchema, ScopeError> {
        if !self.tables.contains(table) {
            // A table that does not exist is a typo, not a missing grant:
            // say so, suggesting among the tables this queue may read.
            if !self.schema.tables.contains_key(table) {
                let message = format!(
                    "unknown table {table}{}",
                    crate::names::did_you_mean(table, self.tables.iter().map(String::as_str))
                );
                return Err(self.refuse(ReadError::UnknownTable {
                    table: table.to_string(),
                    message,
                }));
            }
            return Err(self.refuse(ReadError::NotGranted { table: table.to_string() }));
        }
        let schema = self.schema.clone();
        let t = match schema.table(table) {
            Ok(t) => t,
            Err(e) => {
                return Err(self.refuse(ReadError::UnknownTable {
                    table: table.to_string(),
                    message: e.to_string(),
                }))
            }
        };
        if let Err(e) = t.check_key(key, prefix) {
            return Err(self.refuse(ReadError::BadKey {
                table: table.to_string(),
                message: e.to_string(),
            }));
        }
        Ok(t.clone())
    }

    /// Point read by primary key.
    pub async fn get(&mut self, table: &str, key: &[Value]) -> Result<Option<Row>, ScopeError> {
        let t = self.check(table, key, false)?;
        self.count_read()?;
        self.reading = true;
        let span = self.read_span("get", table);
        let read = self.tx.row_get(&t, key).await;
        span.read_done(read.as_ref().map(|r| r.iter().count()).map_err(|e| e.to_string()));
        self.reading = false;
        match read {
            Ok(r) => {
                self.count_bytes(r.iter())?;
                Ok(r)
            }
            Err(e) => {
                self.store_error.get_or_insert(e.clone());
                Err(ScopeError::Store(e))
            }
        }
    }

    /// Prefix scan, at most `limit` rows (the store caps it at
    /// [`crate::store::MAX_SCAN_ROWS`]).
    pub async fn scan(&mut self, table: &str, prefix: &[Value], limit: u32) -> Result<Vec<Row>, ScopeError> {
        let t = self.check(table, prefix, true)?;
        self.count_read()?;
        self.reading = true;
        let span = self.read_span("scan", table);
        let read = self.tx.row_scan(&t, prefix, limit as usize).await;
        span.read_done(read.as_ref().map(Vec::len).map_err(|e| e.to_string()));
        self.reading = false;
        match read {
            Ok(r) => {
                self.count_bytes(r.iter())?;
                Ok(r)
            }
            Err(e) => {
                self.store_error.get_or_insert(e.clone());
                Err(ScopeError::Store(e))
            }
        }
    }
}

type NativeFn = dyn Fn(Message, ReadScope) -> Pin<Box<dyn Future<Output = HandleOutput> + Send>> + Send + Sync;

/// A handler written as a Rust async closure (tests, benchmarks).
pub struct NativeHandler {
    version: String,
    f: Box<NativeFn>,
}

impl NativeHandler {
    pub fn new<F, Fut>(version: &str, f: F) -> NativeHandler
    where
        F: Fn(Message, ReadScope) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = HandleOutput> + Send + 'static,
    {
        NativeHandler {
            version: version.to_string(),
            f: Box::new(move |m, s| Box::pin(f(m, s))),
        }
    }
}

#[async_trait]
impl Handler for NativeHandler {
    fn version(&self) -> &str {
        &self.version
    }
    async fn handle(&self, msg: &Message, scope: ReadScope) -> HandleOutput {
        (self.f)(msg.clone(), scope).await
    }
}
