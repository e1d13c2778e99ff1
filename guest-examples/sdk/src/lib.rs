//! `onceq-guest`: write onceq message handlers in Rust.
//!
//! A handler is a type implementing [`Handler`]; it reads rows through the
//! [`Ctx`] (reads are served from the message's transaction) and *describes*
//! what should happen: row writes, follow-up messages and external intents.
//! The host applies all of them together with the acknowledgement of the
//! message, in one transaction, or none of them.
//!
//! ```ignore
//! use onceq_guest::{Ctx, Error, Handler, Message, Value};
//!
//! struct Greeter;
//!
//! impl Handler for Greeter {
//!     fn handle(ctx: &mut Ctx, msg: &Message) -> Result<(), Error> {
//!         let name: String = msg.json()?;
//!         ctx.upsert("greetings", [("name", Value::from(name.as_str())), ("count", Value::from(1))]);
//!         Ok(())
//!     }
//! }
//!
//! onceq_guest::export_handler!(Greeter);
//! ```
//!
//! Handlers must be deterministic: the same message and the same reads must
//! give the same effects. The host helps: the guest's clocks read the
//! message's logical time and its randomness is seeded from the message id.

#[doc(hidden)]
pub mod bindings {
    wit_bindgen::generate!({
        path: "../../wit",
        world: "queue-handler",
        pub_export_macro: true,
        default_bindings_module: "onceq_guest::bindings",
    });
}

use bindings::onceq::handler::types as wit;
pub use wit::{Effect, WriteOp};

/// A typed column value.
pub use wit::Value;

/// Log levels for [`Ctx::log`].
pub use bindings::onceq::handler::log::Level;

/// The message being handled.
#[derive(Debug, Clone)]
pub struct Message {
    pub id: String,
    pub queue: String,
    pub payload: Vec<u8>,
    pub attributes: Vec<(String, String)>,
    /// 1 on the first delivery.
    pub attempt: u32,
    /// Microseconds since the Unix epoch.
    pub enqueued_at: i64,
    /// The message's logical time (what `SystemTime::now()` returns inside
    /// the handler), microseconds since the Unix epoch.
    pub now: i64,
    /// Deterministic per-message seed.
    pub seed: u64,
}

impl Message {
    /// Decode the payload as JSON. A payload that does not decode is rejected
    /// (dead-lettered at once) with a reason naming the problem: retrying a
    /// malformed message can never succeed.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, Error> {
        serde_json::from_slice(&self.payload).map_err(|e| Error::reject(format!("malformed payload: {e}")))
    }

    /// An attribute by name.
    pub fn attribute(&self, name: &str) -> Option<&str> {
        self.attributes.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// Why a handler did not produce effects.
#[derive(Debug, Clone, PartialEq)]
pub enum Error {
    /// Roll back and try again later (counts as an attempt).
    Retry { reason: String, delay_ms: Option<u64> },
    /// Roll back and dead-letter the message now.
    Reject(String),
}

impl Error {
    /// Try again later, after the host's backoff.
    pub fn retry(reason: impl Into<String>) -> Self {
        Error::Retry {
            reason: reason.into(),
            delay_ms: None,
        }
    }
    /// Try again no earlier than `delay_ms` from now.
    pub fn retry_after(reason: impl Into<String>, delay_ms: u64) -> Self {
        Error::Retry {
            reason: reason.into(),
            delay_ms: Some(delay_ms),
        }
    }
    /// Dead-letter the message with this reason.
    pub fn reject(reason: impl Into<String>) -> Self {
        Error::Reject(reason.into())
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Retry { reason, .. } => write!(f, "retry: {reason}"),
            Error::Reject(reason) => write!(f, "reject: {reason}"),
        }
    }
}

/// A row returned by a read.
#[derive(Debug, Clone)]
pub struct Row(pub Vec<wit::Column>);

impl Row {
    /// A column's value, or `None` if the table has no such column.
    pub fn get(&self, column: &str) -> Option<&Value> {
        self.0.iter().find(|c| c.name == column).map(|c| &c.value)
    }
    /// An INT64 column (error if missing, NULL or another type).
    pub fn i64(&self, column: &str) -> Result<i64, Error> {
        match self.get(column) {
            Some(Value::Int64(v)) => Ok(*v),
            other => Err(Error::reject(format!("column {column}: expected int64, found {other:?}"))),
        }
    }
    /// A FLOAT64 column.
    pub fn f64(&self, column: &str) -> Result<f64, Error> {
        match self.get(column) {
            Some(Value::Float64(v)) => Ok(*v),
            other => Err(Error::reject(format!("column {column}: expected float64, found {other:?}"))),
        }
    }
    /// A STRING column.
    pub fn str(&self, column: &str) -> Result<&str, Error> {
        match self.get(column) {
            Some(Value::Text(v)) => Ok(v.as_str()),
            other => Err(Error::reject(format!("column {column}: expected text, found {other:?}"))),
        }
    }
    /// A BOOL column.
    pub fn bool(&self, column: &str) -> Result<bool, Error> {
        match self.get(column) {
            Some(Value::Boolean(v)) => Ok(*v),
            other => Err(Error::reject(format!("column {column}: expected bool, found {other:?}"))),
        }
    }
}

impl From<i64> for Value {
    fn from(v: i64) -> Self {
        Value::Int64(v)
    }
}
impl From<f64> for Value {
    fn from(v: f64) -> Self {
        Value::Float64(v)
    }
}
impl From<bool> for Value {
    fn from(v: bool) -> Self {
        Value::Boolean(v)
    }
}
impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Value::Text(v.to_string())
    }
}
impl From<String> for Value {
    fn from(v: String) -> Self {
        Value::Text(v)
    }
}
impl From<Vec<u8>> for Value {
    fn from(v: Vec<u8>) -> Self {
        Value::Bytes(v)
    }
}
impl<T: Into<Value>> From<Option<T>> for Value {
    fn from(v: Option<T>) -> Self {
        v.map_or(Value::Null, Into::into)
    }
}

/// A follow-up message under construction; see [`Ctx::enqueue`].
pub struct FollowUp<'a> {
    ctx: &'a mut Ctx,
    index: usize,
}

impl FollowUp<'_> {
    fn get(&mut self) -> &mut wit::FollowUp {
        match &mut self.ctx.effects[self.index] {
            Effect::Enqueue(f) => f,
            // The index always points at the follow-up this builder created.
            _ => unreachable!("follow-up index points at another effect"),
        }
    }
    /// Deliver no earlier than `ms` milliseconds after commit.
    pub fn delay_ms(mut self, ms: u64) -> Self {
        self.get().delay_ms = Some(ms);
        self
    }
    /// Drop this follow-up if one with the same key was enqueued on the same
    /// queue within the dedup window.
    pub fn dedup_key(mut self, key: impl Into<String>) -> Self {
        self.get().dedup_key = Some(key.into());
        self
    }
    /// Add an attribute.
    pub fn attribute(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.get().attributes.push((name.into(), value.into()));
        self
    }
}

/// An intent under construction; see [`Ctx::intent`].
pub struct IntentBuilder<'a> {
    ctx: &'a mut Ctx,
    index: usize,
}

impl IntentBuilder<'_> {
    /// Add a metadata entry (sent as an HTTP header by a webhook).
    pub fn metadata(self, name: impl Into<String>, value: impl Into<String>) -> Self {
        if let Effect::Intent(i) = &mut self.ctx.effects[self.index] {
            i.metadata.push((name.into(), value.into()));
        }
        self
    }
}

/// The handler's view of the world for one message: reads, and the effects
/// it has described so far.
#[derive(Default)]
pub struct Ctx {
    effects: Vec<Effect>,
}

fn columns<'a>(cols: impl IntoIterator<Item = (&'a str, Value)>) -> Vec<wit::Column> {
    cols.into_iter()
        .map(|(name, value)| wit::Column {
            name: name.to_string(),
            value,
        })
        .collect()
}

impl Ctx {
    /// Read one row by primary key. A read the host refuses (unknown or
    /// ungranted table, wrong key) fails the attempt.
    pub fn get(&self, table: &str, key: &[Value]) -> Result<Option<Row>, Error> {
        bindings::onceq::handler::store::get(table, key)
            .map(|r| r.map(Row))
            .map_err(|e| Error::retry(format!("read of {table} failed: {e}")))
    }

    /// Read up to `limit` rows whose primary key starts with `prefix`.
    pub fn scan(&self, table: &str, prefix: &[Value], limit: u32) -> Result<Vec<Row>, Error> {
        bindings::onceq::handler::store::scan(table, prefix, limit)
            .map(|rows| rows.into_iter().map(Row).collect())
            .map_err(|e| Error::retry(format!("scan of {table} failed: {e}")))
    }

    fn write<'a>(&mut self, table: &str, op: WriteOp, cols: impl IntoIterator<Item = (&'a str, Value)>) {
        self.effects.push(Effect::Write(wit::RowWrite {
            table: table.to_string(),
            op,
            columns: columns(cols),
        }));
    }

    /// Insert a row (the attempt fails if the key exists).
    pub fn insert<'a>(&mut self, table: &str, cols: impl IntoIterator<Item = (&'a str, Value)>) {
        self.write(table, WriteOp::Insert, cols)
    }
    /// Update the given columns of an existing row (key columns included).
    pub fn update<'a>(&mut self, table: &str, cols: impl IntoIterator<Item = (&'a str, Value)>) {
        self.write(table, WriteOp::Update, cols)
    }
    /// Insert or update.
    pub fn upsert<'a>(&mut self, table: &str, cols: impl IntoIterator<Item = (&'a str, Value)>) {
        self.write(table, WriteOp::Upsert, cols)
    }
    /// Delete a row by its key columns.
    pub fn delete<'a>(&mut self, table: &str, key: impl IntoIterator<Item = (&'a str, Value)>) {
        self.write(table, WriteOp::Delete, key)
    }

    /// Enqueue a follow-up message (JSON payload, keys sorted: the bytes the
    /// JavaScript and Python SDKs write) in the same transaction as
    /// the ack. Chain `.delay_ms(..)` / `.dedup_key(..)` on the result.
    pub fn enqueue(&mut self, queue: &str, payload: &impl serde::Serialize) -> FollowUp<'_> {
        self.enqueue_bytes(queue, json_bytes(payload))
    }

    /// Enqueue a follow-up message with a raw payload.
    pub fn enqueue_bytes(&mut self, queue: &str, payload: Vec<u8>) -> FollowUp<'_> {
        self.effects.push(Effect::Enqueue(wit::FollowUp {
            queue: queue.to_string(),
            payload,
            attributes: Vec::new(),
            delay_ms: None,
            dedup_key: None,
        }));
        let index = self.effects.len() - 1;
        FollowUp { ctx: self, index }
    }

    /// Record an external side effect for the outbox: after the commit, the
    /// host delivers `payload` through `connector`, at least once, always
    /// with `key`. `key` must be derived from the message (an order id,
    /// say), never from a random value, so a re-run emits the same key and
    /// the receiver can drop repeats. Chain `.metadata(..)` on the result
    /// (a webhook sends metadata as HTTP headers).
    pub fn intent(&mut self, connector: &str, key: impl Into<String>, payload: &impl serde::Serialize) -> IntentBuilder<'_> {
        self.effects.push(Effect::Intent(wit::ExternalIntent {
            connector: connector.to_string(),
            idempotency_key: key.into(),
            payload: json_bytes(payload),
            metadata: Vec::new(),
        }));
        let index = self.effects.len() - 1;
        IntentBuilder { ctx: self, index }
    }

    /// Ack this message and continue later: enqueue `state` as a new
    /// message on this message's queue, visible after `delay_ms`, in the
    /// same transaction as the ack and this step's writes. A long job runs
    /// as a chain of short steps, each checkpointing its progress: a crash
    /// repeats at most the step in flight, never one already committed.
    pub fn reschedule(&mut self, msg: &Message, delay_ms: u64, state: &impl serde::Serialize) -> FollowUp<'_> {
        let queue = msg.queue.clone();
        self.enqueue(&queue, state).delay_ms(delay_ms)
    }

    /// Write a line to the message's log on the host.
    pub fn log(&self, level: Level, message: &str) {
        bindings::onceq::handler::log::log(level, message)
    }

    /// The effects described so far.
    pub fn effects(&self) -> &[Effect] {
        &self.effects
    }
}

/// Implement this and export it with [`export_handler!`].
pub trait Handler {
    fn handle(ctx: &mut Ctx, msg: &Message) -> Result<(), Error>;
}

#[doc(hidden)]
pub fn __run<H: Handler>(msg: wit::Message) -> Result<Vec<Effect>, wit::HandlerError> {
    let msg = Message {
        id: msg.id,
        queue: msg.queue,
        payload: msg.payload,
        attributes: msg.attributes,
        attempt: msg.attempt,
        enqueued_at: msg.enqueued_at,
        now: msg.now,
        seed: msg.seed,
    };
    let mut ctx = Ctx::default();
    match H::handle(&mut ctx, &msg) {
        Ok(()) => Ok(ctx.effects),
        Err(Error::Retry { reason, delay_ms }) => Err(wit::HandlerError::Retry(wit::RetryLater { reason, delay_ms })),
        Err(Error::Reject(reason)) => Err(wit::HandlerError::Reject(reason)),
    }
}

/// Export a [`Handler`] as the component's `onceq:handler/handler`.
#[macro_export]
macro_rules! export_handler {
    ($handler:ty) => {
        #[doc(hidden)]
        pub struct __OnceqExport;

        impl $crate::bindings::exports::onceq::handler::handler::Guest for __OnceqExport {
            fn handle(
                msg: $crate::bindings::onceq::handler::types::Message,
            ) -> ::core::result::Result<
                ::std::vec::Vec<$crate::bindings::onceq::handler::types::Effect>,
                $crate::bindings::onceq::handler::types::HandlerError,
            > {
                $crate::__run::<$handler>(msg)
            }
        }

        $crate::bindings::export!(__OnceqExport with_types_in $crate::bindings);
    };
}

/// A payload as JSON with object keys sorted at every level (through
/// `serde_json::Value`, whose maps are ordered), so a struct's field order
/// does not change the bytes: the JavaScript and Python SDKs sort too.
/// Serializing plain data cannot fail; `null` stands in if it does.
fn json_bytes(payload: &impl serde::Serialize) -> Vec<u8> {
    serde_json::to_value(payload)
        .and_then(|v| serde_json::to_vec(&v))
        .unwrap_or_else(|_| b"null".to_vec())
}
