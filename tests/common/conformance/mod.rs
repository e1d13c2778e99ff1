//! The store conformance suite: one set of behaviours every `Store` must
//! show, run unchanged against each backend (see tests/store_conformance.rs).
//! The store passed in has the [`SCHEMA_SQLITE`] tables (or their
//! equivalent) and no messages. Split by area (after River's driver
//! suite): one file per part of the `Store` contract.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
// spanner_faults.rs links common/ without using the suite.
#![allow(unused_imports)]

use super::wait_until;
use onceq::outbox;
use onceq::schema::TableSchema;
use onceq::store::{DeadLetterParams, LeaseParams, Queues, RetryParams, SendOutcome, SendParams, Store, StoreError};
use onceq::value::{RowWrite, Value, WriteOp};
use std::sync::Arc;
use std::time::Duration;

pub const SCHEMA_SQLITE: &str = "
CREATE TABLE typed (id TEXT PRIMARY KEY, b BOOL, i INTEGER, f REAL, s TEXT, by BLOB, j JSON, t TIMESTAMP);
CREATE TABLE pairs (a TEXT NOT NULL, n INTEGER NOT NULL, v TEXT, PRIMARY KEY (a, n));
";

pub fn send(queue: &str, payload: &str) -> SendParams {
    SendParams {
        queue: queue.into(),
        payload: payload.as_bytes().to_vec(),
        ..Default::default()
    }
}

pub async fn lease(store: &dyn Store, queue: &str, limit: usize, ms: u64) -> Vec<onceq::store::LeasedMessage> {
    store
        .message_lease(LeaseParams {
            queue: queue.into(),
            limit,
            lease: Duration::from_millis(ms),
        })
        .await
        .unwrap()
}

pub async fn ack(store: &dyn Store, l: &onceq::store::Lease) -> Result<(), StoreError> {
    let mut tx = store.transaction_begin().await.unwrap();
    tx.message_ack(l);
    tx.commit().await
}

/// The payloads waiting on `queue`, sorted.
pub async fn payloads(store: &dyn Store, queue: &str) -> Vec<String> {
    let mut left: Vec<String> = store
        .message_list(Queues::Named(queue), 100)
        .await
        .unwrap()
        .iter()
        .map(|m| String::from_utf8_lossy(&m.payload).to_string())
        .collect();
    left.sort();
    left
}

fn table(store: &dyn Store, name: &str) -> TableSchema {
    store.schema().table(name).unwrap().clone()
}

fn intent(connector: &str, key: &str) -> onceq::value::Intent {
    onceq::value::Intent {
        connector: connector.into(),
        idempotency_key: key.into(),
        payload: br#"{"amount": 5}"#.to_vec(),
        metadata: vec![("m".into(), "1".into())],
    }
}

fn source() -> onceq::value::Message {
    onceq::value::Message {
        id: "m-1".into(),
        queue: "payments".into(),
        payload: vec![],
        attributes: vec![],
        attempt: 1,
        enqueued_at: 0,
    }
}

mod batches;
mod intents;
mod leases;
mod sending;
mod writes;

pub use batches::*;
pub use intents::*;
pub use leases::*;
pub use sending::*;
pub use writes::*;
