//! Rows held in memory, served to a handler as a message transaction's
//! reads: the fixtures of the handler test kit (`onceq-testkit`). Nothing
//! is ever committed; effects are only collected.

use super::*;
use crate::value::{RowWrite, WriteOp};
use std::cmp::Ordering;
use std::collections::BTreeMap;

/// Business tables and their rows, in memory.
#[derive(Debug, Clone)]
pub struct Fixture {
    schema: Arc<Schema>,
    rows: BTreeMap<String, Vec<Row>>,
    /// The schema files it was made from: a transaction's effects are then
    /// rehearsed on a scratch database made from them
    /// ([`Transaction::rehearse`]).
    ddl: Option<Arc<str>>,
}

/// Order of key values (same variants by value; otherwise by variant).
fn cmp_value(a: &Value, b: &Value) -> Ordering {
    use Value::*;
    match (a, b) {
        (Int64(x), Int64(y)) | (Timestamp(x), Timestamp(y)) => x.cmp(y),
        (String(x), String(y)) | (Json(x), Json(y)) => x.cmp(y),
        (Bytes(x), Bytes(y)) => x.cmp(y),
        (Bool(x), Bool(y)) => x.cmp(y),
        (Float64(x), Float64(y)) => x.total_cmp(y),
        _ => rank(a).cmp(&rank(b)),
    }
}

fn rank(v: &Value) -> u8 {
    match v {
        Value::Null => 0,
        Value::Bool(_) => 1,
        Value::Int64(_) => 2,
        Value::Float64(_) => 3,
        Value::Timestamp(_) => 4,
        Value::String(_) => 5,
        Value::Json(_) => 6,
        Value::Bytes(_) => 7,
    }
}

fn key_of(table: &TableSchema, row: &Row) -> Vec<Value> {
    table.primary_key.iter().map(|&i| row[i].1.clone()).collect()
}

fn cmp_keys(a: &[Value], b: &[Value]) -> Ordering {
    a.iter()
        .zip(b)
        .map(|(x, y)| cmp_value(x, y))
        .find(|o| o.is_ne())
        .unwrap_or(a.len().cmp(&b.len()))
}

impl Fixture {
    /// Empty tables from SQLite DDL (the schema file `onceq init` applies).
    /// Its transactions' effects are applied on a scratch SQLite database
    /// made from the same DDL ([`Transaction::rehearse`]): NOT NULL, CHECK,
    /// UNIQUE, triggers and defaults judge them as a real commit does.
    pub fn from_ddl(ddl: &str) -> anyhow::Result<Fixture> {
        Ok(Fixture {
            ddl: Some(Arc::from(ddl)),
            ..Fixture::new(sqlite::schema_from_ddl(ddl)?)
        })
    }

    /// Empty tables of `schema`, with no DDL to rehearse effects on: only
    /// the schema's own checks judge them.
    pub fn new(schema: Schema) -> Fixture {
        Fixture {
            schema: Arc::new(schema),
            rows: BTreeMap::new(),
            ddl: None,
        }
    }

    pub fn schema(&self) -> Arc<Schema> {
        self.schema.clone()
    }

    /// Add (or replace) a row; the columns are checked against the schema
    /// like a handler's insert, and the ones left out are NULL.
    pub fn insert<'a>(
        &mut self,
        table: &str,
        columns: impl IntoIterator<Item = (&'a str, Value)>,
    ) -> Result<&mut Self, crate::schema::SchemaError> {
        let t = self.schema.table(table)?.clone();
        let w = RowWrite {
            table: table.to_string(),
            op: WriteOp::Upsert,
            columns: columns.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        };
        let valid = t.check_write(&w)?;
        let row: Row = t
            .columns
            .iter()
            .zip(valid.values)
            .map(|(c, v)| (c.name.clone(), v.unwrap_or(Value::Null)))
            .collect();
        let key = key_of(&t, &row);
        let rows = self.rows.entry(table.to_string()).or_default();
        rows.retain(|r| cmp_keys(&key_of(&t, r), &key).is_ne());
        rows.push(row);
        rows.sort_by(|a, b| cmp_keys(&key_of(&t, a), &key_of(&t, b)));
        Ok(self)
    }

    /// The rows of a table, in key order.
    pub fn rows(&self, table: &str) -> &[Row] {
        self.rows.get(table).map(Vec::as_slice).unwrap_or(&[])
    }

    /// A transaction whose reads are served from these rows.
    pub fn transaction(&self) -> Box<dyn Transaction> {
        Box::new(FixtureTransaction {
            fixture: self.clone(),
            effects: Default::default(),
        })
    }
}

struct FixtureTransaction {
    fixture: Fixture,
    effects: commit::Pending,
}

#[async_trait]
impl Transaction for FixtureTransaction {
    async fn row_get(&mut self, table: &TableSchema, key: &[Value]) -> StoreResult<Option<Row>> {
        Ok(self
            .fixture
            .rows(&table.name)
            .iter()
            .find(|r| cmp_keys(&key_of(table, r), key).is_eq())
            .cloned())
    }

    async fn row_scan(&mut self, table: &TableSchema, prefix: &[Value], limit: usize) -> StoreResult<Vec<Row>> {
        Ok(self
            .fixture
            .rows(&table.name)
            .iter()
            .filter(|r| cmp_keys(&key_of(table, r)[..prefix.len()], prefix).is_eq())
            .take(limit.min(MAX_SCAN_ROWS))
            .cloned()
            .collect())
    }

    fn row_write(&mut self, write: ValidWrite) {
        self.effects.write(write);
    }

    fn message_enqueue(&mut self, params: SendParams) {
        self.effects.send(params);
    }

    fn dedup_hold(&mut self, queue: &str, key: &str, window: Duration) {
        self.effects.hold(queue, key, window);
    }

    fn message_ack(&mut self, lease: &Lease) {
        self.effects.ack(lease);
    }

    async fn commit(self: Box<Self>) -> StoreResult<()> {
        Err(StoreError::Permanent("a fixture transaction is never committed".into()))
    }

    async fn commit_held(self: Box<Self>, _hold: crate::store::commit::Hold) -> StoreResult<()> {
        self.commit().await
    }

    async fn rollback(self: Box<Self>) {}

    async fn rehearse(self: Box<Self>) -> Option<StoreResult<()>> {
        let ddl = self.fixture.ddl.as_deref()?;
        Some(sqlite::rehearse_on_scratch(
            ddl,
            &self.fixture.schema,
            &self.fixture.rows,
            &self.effects,
        ))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn fixture_rows_are_read_by_key_and_prefix_in_key_order() {
        let mut f = Fixture::from_ddl("CREATE TABLE t (a TEXT NOT NULL, n INTEGER NOT NULL, v TEXT, PRIMARY KEY (a, n));").unwrap();
        for (a, n) in [("x", 10), ("x", 9), ("y", 1)] {
            f.insert("t", [("a", Value::String(a.into())), ("n", Value::Int64(n))]).unwrap();
        }
        f.insert(
            "t",
            [
                ("a", Value::String("x".into())),
                ("n", Value::Int64(9)),
                ("v", Value::String("new".into())),
            ],
        )
        .unwrap();
        let t = f.schema().table("t").unwrap().clone();
        let mut tx = f.transaction();
        let row = tx
            .row_get(&t, &[Value::String("x".into()), Value::Int64(9)])
            .await
            .unwrap()
            .unwrap();
        assert_eq!(row[2].1, Value::String("new".into()), "insert replaces by key");
        let xs = tx.row_scan(&t, &[Value::String("x".into())], 10).await.unwrap();
        let ns: Vec<&Value> = xs.iter().map(|r| &r[1].1).collect();
        assert_eq!(ns, [&Value::Int64(9), &Value::Int64(10)], "numeric key order");
        assert!(f.insert("t", [("a", Value::Int64(1))]).unwrap_err().to_string().contains("a"));
        assert!(f.insert("nope", []).is_err());
    }
}
