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
//! (`UNIX_MICROS(CURRENT_TIMESTAMP())`), never the host's. A batch commit
//! within a second of this process's last commit takes that commit's
//! timestamp instead, advanced by the host's monotonic clock since its
//! answer came ([`pool::Pool::clock`]): still the database's clock, behind
//! it by that answer's latency and never ahead, without a query in the
//! commit (on the emulator 3-8 ms of its one read-write turn, a fifth of a
//! 16-worker commit).
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

mod admin;
mod batch;
mod codec;
mod error;
mod lease;
mod pool;
mod reads;
mod store;
mod transaction;
mod turns;

pub use admin::{parse_database, split_ddl, system_ddl};
use batch::*;
use codec::*;
use error::*;
use pool::*;
use transaction::*;

type RwTx = google_cloud_spanner::transaction::ReadWriteTransaction;

const NOW: &str = "UNIX_MICROS(CURRENT_TIMESTAMP())";

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

/// The Spanner store.
pub struct SpannerStore {
    pool: Arc<Pool>,
    schema: Arc<Schema>,
    options: StoreOptions,
    /// Message commits, grouped ([`commit::Group`]).
    group: Arc<commit::Group>,
    shards: u32,
    /// Whether `onceq_counts` exists; not on a database made before the
    /// table (counting is then off, said once at open).
    counts: bool,
    /// Whether the database deletes expired dedup keys itself (a row
    /// deletion policy on `onceq_dedup`); else the purge does, from one
    /// host at a time ([`SpannerStore::dedup_purge`]).
    ttl: bool,
    /// This store instance, as the holder of a chore's turn.
    instance: String,
    /// Batches that failed as a whole and were committed one by one.
    splits: Arc<std::sync::atomic::AtomicU64>,
    /// Handlers' point reads, coalesced ([`reads`]).
    reads: Arc<reads::PointReads>,
}

fn shard_of(id: &str, shards: u32) -> i64 {
    let mut h: u32 = 2_166_136_261;
    for b in id.as_bytes() {
        h = (h ^ u32::from(*b)).wrapping_mul(16_777_619);
    }
    i64::from(h % shards.max(1))
}

impl SpannerStore {
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
