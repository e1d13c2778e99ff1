//! Host-side domain types: values, rows, messages and effects.
//!
//! They mirror the WIT types in `wit/handler.wit` but belong to the host, so
//! the store and the protocol never depend on Wasm bindings (a native Rust
//! handler produces the same types).

use std::fmt;

/// A typed column value (WIT `value`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "type", content = "value", rename_all = "lowercase")]
pub enum Value {
    Null,
    Bool(bool),
    Int64(i64),
    Float64(f64),
    String(String),
    Bytes(Vec<u8>),
    /// A JSON document as text.
    Json(String),
    /// Microseconds since the Unix epoch.
    Timestamp(i64),
}

impl Value {
    /// Equality for read validation: exact, and NaN equal to itself (so a
    /// NaN read does not abort a transaction for ever).
    pub fn same(&self, other: &Value) -> bool {
        match (self, other) {
            (Value::Float64(a), Value::Float64(b)) => a.to_bits() == b.to_bits(),
            // Databases normalize JSON (key order, spacing): compare documents.
            (Value::Json(a), Value::Json(b)) => {
                a == b
                    || matches!(
                        (serde_json::from_str::<serde_json::Value>(a), serde_json::from_str::<serde_json::Value>(b)),
                        (Ok(x), Ok(y)) if x == y
                    )
            }
            _ => self == other,
        }
    }

    /// The name of this value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::Null => "null",
            Value::Bool(_) => "bool",
            Value::Int64(_) => "int64",
            Value::Float64(_) => "float64",
            Value::String(_) => "string",
            Value::Bytes(_) => "bytes",
            Value::Json(_) => "json",
            Value::Timestamp(_) => "timestamp",
        }
    }

    /// Approximate encoded size, for the effect-bytes limit.
    pub fn size(&self) -> usize {
        match self {
            Value::String(s) | Value::Json(s) => s.len(),
            Value::Bytes(b) => b.len(),
            _ => 8,
        }
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Null => write!(f, "NULL"),
            Value::Bool(v) => write!(f, "{v}"),
            Value::Int64(v) => write!(f, "{v}"),
            Value::Float64(v) => write!(f, "{v}"),
            Value::String(v) | Value::Json(v) => write!(f, "{v:?}"),
            Value::Bytes(v) => write!(f, "<{} bytes>", v.len()),
            Value::Timestamp(v) => write!(f, "@{v}us"),
        }
    }
}

/// A row: `(column name, value)` in table column order.
pub type Row = Vec<(String, Value)>;

/// Compare two rows for read validation.
pub fn rows_same(a: &Row, b: &Row) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|((ka, va), (kb, vb))| ka == kb && va.same(vb))
}

/// A message as handed to a handler.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Message {
    pub id: String,
    pub queue: String,
    #[serde(serialize_with = "serialize_payload")]
    pub payload: Vec<u8>,
    pub attributes: Vec<(String, String)>,
    /// 1 on the first delivery.
    pub attempt: u32,
    /// Database time at send, microseconds since the Unix epoch.
    pub enqueued_at: i64,
}

fn serialize_payload<S: serde::Serializer>(p: &[u8], s: S) -> Result<S::Ok, S::Error> {
    match std::str::from_utf8(p) {
        Ok(text) => s.serialize_str(text),
        Err(_) => s.serialize_str(&format!("<{} binary bytes>", p.len())),
    }
}

impl Message {
    /// The handler's logical time: fixed for the life of the message.
    pub fn logical_now(&self) -> i64 {
        self.enqueued_at
    }

    /// The deterministic per-message seed (FNV-1a of the id).
    pub fn seed(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in self.id.as_bytes() {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h
    }
}

/// WIT `write-op`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WriteOp {
    Insert,
    Update,
    Upsert,
    Delete,
}

/// WIT `row-write`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RowWrite {
    pub table: String,
    pub op: WriteOp,
    pub columns: Vec<(String, Value)>,
}

/// WIT `follow-up`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FollowUp {
    pub queue: String,
    #[serde(serialize_with = "serialize_payload")]
    pub payload: Vec<u8>,
    pub attributes: Vec<(String, String)>,
    pub delay_ms: Option<u64>,
    pub dedup_key: Option<String>,
}

/// WIT `external-intent`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Intent {
    pub connector: String,
    pub idempotency_key: String,
    #[serde(serialize_with = "serialize_payload")]
    pub payload: Vec<u8>,
    pub metadata: Vec<(String, String)>,
}

/// WIT `effect`.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "lowercase", tag = "effect")]
pub enum Effect {
    Write(RowWrite),
    Enqueue(FollowUp),
    Intent(Intent),
}

impl Effect {
    /// Size in bytes, for the effect-bytes limit: what is stored, plus
    /// [`ITEM_OVERHEAD`] per effect, column and attribute/metadata pair, so
    /// that empty items are not free (an attribute list is stored as JSON;
    /// a row as one value per column).
    pub fn size(&self) -> usize {
        let pairs = |p: &[(String, String)]| p.iter().map(|(k, v)| ITEM_OVERHEAD + k.len() + v.len()).sum::<usize>();
        ITEM_OVERHEAD
            + match self {
                Effect::Write(w) => w.table.len() + w.columns.iter().map(|(k, v)| ITEM_OVERHEAD + k.len() + v.size()).sum::<usize>(),
                Effect::Enqueue(f) => f.queue.len() + f.payload.len() + pairs(&f.attributes) + f.dedup_key.as_ref().map_or(0, String::len),
                Effect::Intent(i) => i.connector.len() + i.idempotency_key.len() + i.payload.len() + pairs(&i.metadata),
            }
    }
}

/// Bytes counted for each effect, column, attribute and metadata pair on
/// top of its contents (an empty pair still costs `["",""],` and an index
/// entry).
pub const ITEM_OVERHEAD: usize = 16;

/// A new random id: 128 bits, hex (lease tokens, and ids that need not
/// sort: see [`message_id`]).
pub fn random_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// A new message id: 128 bits, hex, ordered by creation time: 48 bits of
/// milliseconds since the epoch, then 80 random bits (UUIDv7's layout).
///
/// Messages are leased oldest first and deleted when acked, so on SQLite
/// time-ordered ids keep the id index's inserts on its last page and its
/// deletes on its first pages, where random ids touched a page of their
/// own per message in every commit. On Spanner the key is
/// `(shard, id)` with the shard a hash of the whole id, so keys still
/// spread over the shards; within a shard they grow, as Spanner's
/// documentation advises for a hash-prefixed key.
pub fn message_id() -> String {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
        & ((1 << 48) - 1);
    format!("{ms:012x}{:020x}", rand::random::<u128>() >> 48)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    /// Message ids are 32 hex digits, distinct, and sort by creation time.
    #[test]
    fn message_ids_sort_by_creation_time() {
        let first = super::message_id();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let later: Vec<String> = (0..1000).map(|_| super::message_id()).collect();
        for id in std::iter::once(&first).chain(&later) {
            assert!(id.len() == 32 && id.chars().all(|c| c.is_ascii_hexdigit()), "{id}");
        }
        assert!(later.iter().all(|id| *id > first), "an id made later sorts after {first}");
        let distinct: std::collections::BTreeSet<&String> = later.iter().collect();
        assert_eq!(distinct.len(), later.len());
    }
}
