//! The batch commit: one read-write transaction for many messages. A few
//! reads whatever the batch's size ([`read_ahead`]), each message decided
//! on them ([`commit::apply`] over [`SpannerExec`]), everything it keeps
//! written as mutations at the commit.

use super::*;
use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;

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
pub(super) struct Seen {
    /// Each pending's recorded reads, run again, in the pending's order.
    pub(super) reads: Vec<std::collections::VecDeque<Vec<Row>>>,
    /// The lease token of each acked message still queued, by (shard, id)
    /// (read only for batches of more than one message).
    pub(super) leases: HashMap<(i64, String), Option<String>>,
    /// The dedup rows of the keys the batch claims or holds, by (queue,
    /// key): the holding message, and whether its claim is live. Updated as
    /// messages claim and hold, so a later message of the batch sees them.
    pub(super) dedup: HashMap<(String, String), (String, bool)>,
    /// The database's clock (microseconds), read in the transaction: the
    /// times the batch writes (claims, holds, new messages, counts).
    pub(super) now: i64,
    /// This store instance's processed counts, by queue, of the queues
    /// the batch acks (a queue with no row yet is missing).
    pub(super) counts: HashMap<String, i64>,
}

/// A point read of `keys` of `table` through Spanner's read API: no SQL
/// to parse and plan (measured on the emulator: a read of 12 keys took
/// 1 ms, a query of the same 12 rows 20-30 ms, a query of one row 2-3 ms).
pub(super) fn point_read<'k>(table: &TableSchema, keys: impl IntoIterator<Item = &'k [Value]>) -> google_cloud_spanner::read::ReadRequest {
    let mut set = KeySetBuilder::new();
    for key in keys {
        set = set.add_key(Key::new(key.iter().map(to_svalue).collect()));
    }
    google_cloud_spanner::read::ReadRequest::builder(table.name.clone(), table.columns.iter().map(|c| c.name.clone()))
        .with_keys(set.build())
        .build()
}

/// The primary keys, `(shard, id)`, of the leased messages' rows.
pub(super) fn message_keys<'l>(leases: impl IntoIterator<Item = &'l Lease>) -> google_cloud_spanner::key::KeySet {
    let mut keys = KeySetBuilder::new();
    for l in leases {
        keys = keys.add_key(Key::new(vec![SValue::from(l.shard), SValue::from(l.message_id.clone())]));
    }
    keys.build()
}

/// Most keys in one [`point_read`] of a batch.
pub(super) const KEYS_PER_READ: usize = 256;

/// Read what deciding `batch` needs, in the transaction: every recorded
/// read again (one read per table for the point reads, a query per scan),
/// the lease tokens of its acks (one read; not for a batch of one, whose
/// ack asserts its row instead), the dedup rows of the keys it claims or
/// holds, and those of `sends` (sends outside a message: `onceq send`),
/// in one read, the database's clock (one query, unless `clock` is known:
/// [`Pool::clock`]), and this store instance's counts rows of the acked
/// queues (`counts`), by key.
pub(super) async fn read_ahead(
    tx: &RwTx,
    batch: &[commit::Pending],
    sends: &[SendParams],
    leases: bool,
    counts: Option<i64>,
    clock: Option<i64>,
) -> google_cloud_spanner::Result<Seen> {
    // What deciding each pending reads: the one description `apply`
    // keeps to (`commit::Pending::needs`).
    let needs: Vec<commit::Needs> = batch.iter().map(commit::Pending::needs).collect();
    let mut answers: Vec<Vec<Vec<Row>>> = needs.iter().map(|n| vec![Vec::new(); n.reads.len()]).collect();
    // Point reads by table: (pending, its read), the read.
    type Place<'b> = ((usize, usize), &'b ReadRecord);
    let mut points: BTreeMap<&str, Vec<Place>> = BTreeMap::new();
    for (i, n) in needs.iter().enumerate() {
        for (j, read) in n.reads.iter().enumerate() {
            match read.limit {
                None => points.entry(read.table.name.as_str()).or_default().push(((i, j), read)),
                Some(n) => {
                    let rs = tx.execute_query(select_stmt(&read.table, &read.key, Some(n))).await?;
                    answers[i][j] = collect(&read.table, rs).await.map_err(carried)?;
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
            for row in collect(table, rs).await.map_err(carried)? {
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
    let acks: Vec<&Lease> = needs.iter().filter_map(|n| n.ack).collect();
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
    let claimed_outside = sends.iter().filter_map(|s| s.dedup_key.as_deref().map(|k| (s.queue.as_str(), k)));
    for (q, k) in needs.iter().flat_map(|n| n.dedup_keys.iter().copied()).chain(claimed_outside) {
        keys.entry(q).or_default().insert(k);
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
    // The clock: known without asking ([`Pool::clock`]), or one query (on
    // the emulator a query is 3-8 ms of the one read-write turn).
    seen.now = match clock {
        Some(now) => now,
        None => {
            let mut rs = tx.execute_query(Statement::builder(format!("SELECT {NOW}")).build()).await?;
            match rs.next().await {
                Some(r) => r?.get::<i64>(0)?,
                None => return Err(invariant("the database's clock: the query returned no row".into())),
            }
        }
    };
    // This instance's counts rows of the acked queues, by key.
    let queues: BTreeSet<&str> = acks.iter().map(|l| l.queue.as_str()).collect();
    if let Some(shard) = counts.filter(|_| !queues.is_empty()) {
        let mut set = KeySetBuilder::new();
        for q in &queues {
            set = set.add_key(Key::new(vec![SValue::from(q.to_string()), SValue::from(shard)]));
        }
        let read = google_cloud_spanner::read::ReadRequest::builder("onceq_counts", ["queue", "processed"])
            .with_keys(set.build())
            .build();
        let mut rs = tx.execute_read(read).await?;
        while let Some(r) = rs.next().await {
            let r = r?;
            seen.counts.insert(r.get::<String>(0)?, r.get::<i64>(1)?);
        }
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
pub(super) struct SpannerExec<'t> {
    pub(super) schema: &'t Schema,
    pub(super) seen: Seen,
    /// The pending being decided (its answers in `seen.reads`).
    pub(super) at: usize,
    /// A batch of one: its ack asserts its row (`ASSERT_ROWS_MODIFIED 1`,
    /// the whole transaction fails otherwise) instead of being decided on
    /// a read.
    pub(super) assert_one: bool,
    /// (table, primary key) written by the messages so far.
    pub(super) written: Vec<(String, Vec<Value>)>,
    /// The acks, each decided on its row's token as read in this
    /// transaction.
    pub(super) acks: Vec<Lease>,
    pub(super) mutations: Vec<Mutation>,
    /// Dedup keys claimed: (queue, key, message id, window), each key once.
    pub(super) claims: Vec<(String, String, String, Duration)>,
    /// Dedup keys held: (queue, key, window), each existing and held after
    /// any claim of it in the batch.
    pub(super) holds: Vec<(String, String, Duration)>,
    /// Messages to insert (follow-ups, intents, sends).
    pub(super) inserts: Vec<(String, SendParams)>,
}

impl<'t> SpannerExec<'t> {
    pub(super) fn new(schema: &'t Schema, seen: Seen, assert_one: bool) -> Self {
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
    pub(super) fn kept(&self) -> [usize; 5] {
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
    /// No DML: the emulator plans and scans for each statement (tens of
    /// milliseconds per batch DML with a few thousand messages queued), and
    /// on Spanner mutations need no round trip before the commit. A mutation that
    /// cannot apply (an insert of an id that exists) fails the commit as a
    /// whole, which is then run again one message at a time.
    pub(super) async fn write_all(
        self,
        tx: &RwTx,
        shards: u32,
        counts: Option<(i64, &BTreeMap<&str, i64>)>,
    ) -> google_cloud_spanner::Result<()> {
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
        let table = self.schema.table(&w.table).map_err(|e| StoreError::Invariant(e.to_string()))?;
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
pub(super) struct SpannerBatch {
    pub(super) pool: Arc<Pool>,
    pub(super) schema: Arc<Schema>,
    pub(super) shards: u32,
    pub(super) window: Duration,
    /// Whether `onceq_counts` exists (a database made by an older onceq
    /// may lack it).
    pub(super) counts: bool,
    /// Its rows per queue (`StoreOptions::spanner_count_rows`).
    pub(super) count_rows: u32,
    /// Messages whose writes the database refused when committed alone:
    /// when they run again they commit alone, rather than fail another
    /// batch and make it commit one message at a time (most recent last,
    /// at most [`SUSPECTS`]).
    pub(super) suspects: Mutex<VecDeque<String>>,
    /// Batches that failed as a whole and were committed one by one.
    pub(super) splits: Arc<AtomicU64>,
    /// `BatchFaults::refused`: how often a batch of several is refused as
    /// a whole, and the draws.
    #[cfg(feature = "fault-injection")]
    pub(super) refuse: Option<(f64, Mutex<rand::rngs::StdRng>)>,
}

/// Most suspects remembered (a message is dead-lettered after a few).
const SUSPECTS: usize = 4_096;

impl SpannerBatch {
    /// The batch in one transaction. `lost` is told which messages the
    /// transaction's last run found with their lease gone: a decision that
    /// holds even when the transaction then fails as a whole.
    pub(super) async fn commit_all(
        &self,
        batch: Arc<Vec<commit::Pending>>,
        lost: Arc<Mutex<Vec<bool>>>,
    ) -> StoreResult<Vec<StoreResult<()>>> {
        let (schema, shards, window) = (self.schema.clone(), self.shards, self.window);
        // Each commit counts in one of `count_rows` rows per queue, at
        // random: hosts seldom meet on a row, and the table never grows
        // past that many rows a queue however often hosts restart.
        let counts = self.counts.then(|| i64::from(rand::random::<u32>() % self.count_rows.max(1)));
        let assert_one = batch.len() == 1;
        let pool = self.pool.clone();
        self.pool
            .rw("a commit", move |tx| {
                let (batch, schema, lost, pool) = (batch.clone(), schema.clone(), lost.clone(), pool.clone());
                async move {
                    let seen = read_ahead(&tx, &batch, &[], !assert_one, counts, pool.clock()).await?;
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
                                return Err(invariant(format!("a message failed after it was decided: {e}")));
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

/// Spanner's limits on one commit: mutations and bytes.
const COMMIT_MUTATIONS: usize = 80_000;
const COMMIT_BYTES: usize = 100_000_000;

/// Why Spanner could not commit `p` even alone, if it could not: its
/// estimated mutations or bytes over a commit's limits. The message is
/// charged a refused write (its effects must shrink), rather than sent to
/// the database to be refused with a generic error after a round trip.
pub(super) fn over_commit_limits(p: &commit::Pending) -> Option<String> {
    let (mutations, bytes) = (p.mutations(), p.bytes());
    if mutations > COMMIT_MUTATIONS {
        Some(format!(
            "the message's effects need about {mutations} mutations in one commit; Spanner commits at most {COMMIT_MUTATIONS} (emit fewer effects per message, or carry the rest in follow-up messages)"
        ))
    } else if bytes > COMMIT_BYTES {
        Some(format!(
            "the message's effects write about {} MB in one commit; Spanner commits at most 100 MB (emit fewer or smaller effects per message)",
            bytes / 1_000_000
        ))
    } else {
        None
    }
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

    /// Spanner applies a transaction's writes as mutations when it commits
    /// them: there is nothing to apply and roll back.
    async fn rehearse(&self, _p: commit::Pending) -> Option<StoreResult<()>> {
        None
    }

    /// The batch, less its suspects (each of those alone: a message the
    /// database refused once is likely refused again, and in a batch it
    /// fails everybody's commit).
    async fn commit_batch(&self, batch: Vec<commit::Pending>) -> Vec<StoreResult<()>> {
        let suspect: Vec<bool> = batch.iter().map(|p| self.is_suspect(p)).collect();
        if batch.len() < 2 || !suspect.contains(&true) {
            return self.commit_together(batch).await;
        }
        let mut out: Vec<Option<StoreResult<()>>> = vec![None; batch.len()];
        let (mut rest, mut rest_at) = (Vec::new(), Vec::new());
        for (i, (p, s)) in batch.into_iter().zip(suspect).enumerate() {
            if s {
                out[i] = Some(self.commit_one(&p).await);
            } else {
                rest.push(p);
                rest_at.push(i);
            }
        }
        if !rest.is_empty() {
            for (i, r) in rest_at.into_iter().zip(self.commit_together(rest).await) {
                out[i] = Some(r);
            }
        }
        out.into_iter()
            .map(|r| r.unwrap_or_else(|| Err(StoreError::Permanent("a message of the batch got no result".into()))))
            .collect()
    }
}

impl SpannerBatch {
    /// `BatchFaults::refused`, drawn for a batch of `n` (never one alone).
    fn injected_refusal(&self, n: usize) -> Option<StoreError> {
        #[cfg(feature = "fault-injection")]
        if let Some((p, rng)) = &self.refuse {
            use rand::RngExt;
            if n > 1 && rng.lock().is_ok_and(|mut r| r.random::<f64>() < *p) {
                return Some(StoreError::WriteRefused(format!("injected: a batch of {n} refused as a whole")));
            }
        }
        let _ = n;
        None
    }

    fn is_suspect(&self, p: &commit::Pending) -> bool {
        let Some(lease) = &p.ack else { return false };
        self.suspects.lock().map(|s| s.contains(&lease.message_id)).unwrap_or(false)
    }

    /// Remember (`refused`) or forget `p` as a suspect.
    fn suspect(&self, p: &commit::Pending, refused: bool) {
        let (Some(lease), Ok(mut s)) = (&p.ack, self.suspects.lock()) else {
            return;
        };
        s.retain(|id| id != &lease.message_id);
        if refused {
            if s.len() >= SUSPECTS {
                s.pop_front();
            }
            s.push_back(lease.message_id.clone());
        }
    }

    /// `p` in a transaction of its own; a refused write makes it a
    /// suspect, anything else clears it.
    async fn commit_one(&self, p: &commit::Pending) -> StoreResult<()> {
        // Alone (anything near the limits is), a message Spanner would
        // refuse is refused here, in words, without a transaction.
        if let Some(why) = over_commit_limits(p) {
            return Err(StoreError::WriteRefused(why));
        }
        let r = match self.commit_all(Arc::new(vec![p.clone()]), Arc::new(Mutex::new(Vec::new()))).await {
            Ok(mut r) => r.pop().unwrap_or(Ok(())),
            Err(e) => Err(match &p.ack {
                Some(lease) => lease_error(e, lease),
                None => e,
            }),
        };
        self.suspect(p, matches!(r, Err(StoreError::WriteRefused(_))));
        r
    }

    async fn commit_together(&self, batch: Vec<commit::Pending>) -> Vec<StoreResult<()>> {
        let n = batch.len();
        if let [p] = &batch[..] {
            return vec![self.commit_one(p).await];
        }
        let batch = Arc::new(batch);
        let lost = Arc::new(Mutex::new(Vec::new()));
        let e = match self.injected_refusal(n) {
            Some(e) => e,
            None => match self.commit_all(batch.clone(), lost.clone()).await {
                Ok(results) => return results,
                Err(e) => e,
            },
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
        if e.is_unknown_outcome() || e.is_retryable() {
            return (0..n).map(|i| Err(lost_or(i, &e))).collect();
        }
        tracing::debug!("a batch of {n} failed ({e}); committing its messages one by one");
        self.splits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut out = Vec::with_capacity(n);
        for (i, p) in batch.iter().enumerate() {
            if lost.get(i).copied().unwrap_or(false) {
                out.push(Err(lost_or(i, &e)));
                continue;
            }
            out.push(self.commit_one(p).await);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    /// 7,000 follow-ups (84,002 mutations) are over Spanner's 80,000 a
    /// commit: refused in words naming the limit; 6,000 are not.
    #[test]
    fn a_message_over_a_commits_limits_is_refused_in_words() {
        let with = |n| commit::Pending {
            sends: vec![SendParams::default(); n],
            ..commit::Pending::default()
        };
        let why = over_commit_limits(&with(7_000)).unwrap();
        assert!(why.contains("84002 mutations") && why.contains("80000"), "{why}");
        assert_eq!(over_commit_limits(&with(6_000)), None);
        let bulky = commit::Pending {
            sends: vec![
                SendParams {
                    payload: vec![0; 1 << 20],
                    ..SendParams::default()
                };
                101
            ],
            ..commit::Pending::default()
        };
        let why = over_commit_limits(&bulky).unwrap();
        assert!(why.contains("100 MB"), "{why}");
    }
}
