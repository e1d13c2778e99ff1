//! A store wrapper that makes commits fail the two ways a network makes them
//! fail, for tests and for `onceq demo --faults`:
//!
//! - **landed, then error**: the commit is applied, then the caller gets
//!   [`StoreError::UnknownOutcome`] (a response lost after the server
//!   committed);
//! - **error before landing**: the commit is dropped and the caller gets
//!   `UnknownOutcome` too (the request never arrived).
//!
//! The caller cannot tell the two apart, exactly as in production; the
//! protocol must resolve both by re-running the message. It can also make
//! lease renewals fail and handler reads hang.

use super::*;
use rand::{RngExt, SeedableRng};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Fault rates, each a probability per commit.
#[derive(Debug, Clone, Default)]
pub struct FaultPlan {
    /// Commit lands, then the caller sees an unknown outcome.
    pub after_commit: f64,
    /// Commit is dropped, and the caller sees an unknown outcome.
    pub before_commit: f64,
    /// Stop injecting after this many faults (`None`: never stop).
    pub limit: Option<u64>,
    /// Every lease renewal fails with `Unavailable` (a worker cut off from
    /// the database while its handler runs).
    pub renewals_fail: bool,
    /// Every lease renewal waits this long before it runs (a store that
    /// stops answering a renewal without failing it).
    pub renewal_delay: Option<Duration>,
    /// Every handler read waits this long before it answers (a database
    /// that stops answering mid-transaction).
    pub read_delay: Option<Duration>,
    /// Every lease waits this long before it runs (a slow store: tests of
    /// lease coalescing).
    pub lease_delay: Option<Duration>,
    /// Every message commit waits this long before it runs (a slow disk or
    /// database: tests of work overlapping commits).
    pub commit_delay: Option<Duration>,
    /// Every handler read fails with this error.
    pub read_error: Option<StoreError>,
    /// This many failure records (retry later, dead letter) land, then
    /// report an unknown outcome.
    pub records_landed_unknown: u64,
    /// RNG seed, so a failing run can be replayed.
    pub seed: u64,
}

/// What was injected so far.
#[derive(Debug, Default)]
pub struct FaultCounts {
    pub after_commit: AtomicU64,
    pub before_commit: AtomicU64,
    /// Lease renewals asked for (refused with `renewals_fail`).
    pub renewals: AtomicU64,
    /// Lease calls passed through (tests count an idle queue's polls).
    pub leases: AtomicU64,
    /// Stats and backlog calls passed through (tests count `--until-empty`'s
    /// checks).
    pub stats: AtomicU64,
    /// Failure records that landed and reported an unknown outcome.
    pub records_landed: AtomicU64,
}

impl FaultCounts {
    pub fn total(&self) -> u64 {
        self.after_commit.load(Ordering::Relaxed) + self.before_commit.load(Ordering::Relaxed)
    }
}

struct Injector {
    plan: FaultPlan,
    rng: Mutex<rand::rngs::StdRng>,
    counts: Arc<FaultCounts>,
}

#[derive(Clone, Copy, PartialEq)]
enum Fault {
    None,
    AfterCommit,
    BeforeCommit,
}

impl Injector {
    /// After a failure record landed: an unknown outcome, while
    /// `records_landed_unknown` lasts.
    fn record_landed(&self) -> StoreResult<()> {
        let n = self.counts.records_landed.fetch_add(1, Ordering::Relaxed);
        if n < self.plan.records_landed_unknown {
            return Err(StoreError::UnknownOutcome("injected: the record landed, its answer lost".into()));
        }
        self.counts.records_landed.fetch_sub(1, Ordering::Relaxed);
        Ok(())
    }

    /// Commit `tx` (held, if `hold`), with the faults drawn.
    async fn commit(&self, tx: Box<dyn Transaction>, hold: Option<commit::Hold>) -> StoreResult<()> {
        hang(self.plan.commit_delay).await;
        let commit = |tx: Box<dyn Transaction>, hold: Option<commit::Hold>| async move {
            match hold {
                Some(h) => tx.commit_held(h).await,
                None => tx.commit().await,
            }
        };
        match self.draw() {
            Fault::None => commit(tx, hold).await,
            Fault::AfterCommit => {
                // Only a commit that really landed counts as this fault.
                commit(tx, hold).await?;
                self.counts.after_commit.fetch_add(1, Ordering::Relaxed);
                Err(StoreError::UnknownOutcome("injected: commit landed, response lost".into()))
            }
            Fault::BeforeCommit => {
                self.counts.before_commit.fetch_add(1, Ordering::Relaxed);
                tx.rollback().await;
                Err(StoreError::UnknownOutcome("injected: commit request lost".into()))
            }
        }
    }

    fn draw(&self) -> Fault {
        if let Some(limit) = self.plan.limit {
            if self.counts.total() >= limit {
                return Fault::None;
            }
        }
        let x: f64 = match self.rng.lock() {
            Ok(mut r) => r.random(),
            Err(_) => return Fault::None,
        };
        if x < self.plan.after_commit {
            Fault::AfterCommit
        } else if x < self.plan.after_commit + self.plan.before_commit {
            Fault::BeforeCommit
        } else {
            Fault::None
        }
    }
}

/// Wraps a store; see the module docs.
pub struct FaultyStore {
    inner: Arc<dyn Store>,
    injector: Arc<Injector>,
}

impl FaultyStore {
    pub fn new(inner: Arc<dyn Store>, plan: FaultPlan) -> (FaultyStore, Arc<FaultCounts>) {
        let counts = Arc::new(FaultCounts::default());
        let injector = Arc::new(Injector {
            rng: Mutex::new(rand::rngs::StdRng::seed_from_u64(plan.seed)),
            plan,
            counts: counts.clone(),
        });
        (FaultyStore { inner, injector }, counts)
    }
}

#[async_trait]
impl Store for FaultyStore {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    fn commit_stats(&self) -> Option<commit::CommitStats> {
        self.inner.commit_stats()
    }
    fn handoff(&self) -> bool {
        self.inner.handoff()
    }
    fn commit_observe(&self, observer: commit::BatchObserver) {
        self.inner.commit_observe(observer)
    }
    fn schema(&self) -> Arc<Schema> {
        self.inner.schema()
    }
    async fn message_send(&self, params: Vec<SendParams>) -> StoreResult<Vec<SendOutcome>> {
        self.inner.message_send(params).await
    }
    async fn message_lease(&self, params: LeaseParams) -> StoreResult<Vec<LeasedMessage>> {
        self.injector.counts.leases.fetch_add(1, Ordering::Relaxed);
        hang(self.injector.plan.lease_delay).await;
        self.inner.message_lease(params).await
    }
    async fn message_lease_collected(
        &self,
        queue: &str,
        lease: Duration,
        collect: &(dyn Fn() -> usize + Send + Sync),
    ) -> StoreResult<Vec<LeasedMessage>> {
        self.injector.counts.leases.fetch_add(1, Ordering::Relaxed);
        match self.injector.plan.lease_delay {
            // A slow lease: the requests are gathered when it starts, then
            // it takes its time.
            Some(delay) => {
                let n = collect();
                tokio::time::sleep(delay).await;
                self.inner.message_lease_collected(queue, lease, &|| n).await
            }
            None => self.inner.message_lease_collected(queue, lease, collect).await,
        }
    }
    async fn message_lease_renew(&self, leases: &[Lease], duration: Duration) -> StoreResult<Vec<bool>> {
        self.injector.counts.renewals.fetch_add(1, Ordering::Relaxed);
        if self.injector.plan.renewals_fail {
            return Err(StoreError::Unavailable("injected: lease renewal failed".into()));
        }
        hang(self.injector.plan.renewal_delay).await;
        self.inner.message_lease_renew(leases, duration).await
    }
    async fn message_release(&self, lease: &Lease) -> StoreResult<()> {
        self.inner.message_release(lease).await
    }
    async fn message_retry_later(&self, lease: &Lease, p: RetryParams) -> StoreResult<()> {
        self.inner.message_retry_later(lease, p).await?;
        self.injector.record_landed()
    }
    async fn message_dead_letter(&self, lease: &Lease, params: DeadLetterParams) -> StoreResult<()> {
        self.inner.message_dead_letter(lease, params).await?;
        self.injector.record_landed()
    }
    async fn commit_hold(&self) -> StoreResult<Option<commit::Hold>> {
        self.inner.commit_hold().await
    }
    async fn close(&self) {
        self.inner.close().await
    }
    async fn transaction_begin(&self) -> StoreResult<Box<dyn Transaction>> {
        Ok(Box::new(FaultyTransaction {
            inner: self.inner.transaction_begin().await?,
            injector: self.injector.clone(),
        }))
    }
    async fn stats(&self) -> StoreResult<Stats> {
        self.injector.counts.stats.fetch_add(1, Ordering::Relaxed);
        self.inner.stats().await
    }
    async fn backlog(&self) -> StoreResult<Stats> {
        self.injector.counts.stats.fetch_add(1, Ordering::Relaxed);
        self.inner.backlog().await
    }
    async fn write_check(&self) -> StoreResult<()> {
        self.inner.write_check().await
    }
    async fn dead_letter_list(&self, queues: Queues<'_>, limit: usize) -> StoreResult<Vec<DeadLetter>> {
        self.inner.dead_letter_list(queues, limit).await
    }
    async fn dead_letter_get(&self, id: &str) -> StoreResult<Option<DeadLetter>> {
        self.inner.dead_letter_get(id).await
    }
    async fn dead_letter_settle(&self, id: &str, how: Settle, audit: Option<&AuditEntry>) -> StoreResult<Option<String>> {
        self.inner.dead_letter_settle(id, how, audit).await
    }
    async fn audit_append(&self, entry: &AuditEntry) -> StoreResult<()> {
        self.inner.audit_append(entry).await
    }
    async fn audit_list(&self, queues: Queues<'_>, limit: usize) -> StoreResult<Vec<AuditEntry>> {
        self.inner.audit_list(queues, limit).await
    }
    async fn audit_prune(&self, age: Duration) -> StoreResult<u64> {
        self.inner.audit_prune(age).await
    }
    async fn message_list(&self, queues: Queues<'_>, limit: usize) -> StoreResult<Vec<QueuedMessage>> {
        self.inner.message_list(queues, limit).await
    }
    async fn message_get(&self, id: &str) -> StoreResult<Option<QueuedMessage>> {
        self.inner.message_get(id).await
    }
    async fn message_browse(
        &self,
        queue: &str,
        state: LiveState,
        after: Option<&BrowseKey>,
        limit: usize,
    ) -> StoreResult<Vec<QueuedMessage>> {
        self.inner.message_browse(queue, state, after, limit).await
    }
    async fn dead_letter_browse(&self, queue: &str, after: Option<&BrowseKey>, limit: usize) -> StoreResult<Vec<DeadLetter>> {
        self.inner.dead_letter_browse(queue, after, limit).await
    }
    async fn queue_pause(&self, queue: &str, pause: bool, audit: Option<&AuditEntry>) -> StoreResult<bool> {
        self.inner.queue_pause(queue, pause, audit).await
    }
    async fn queue_paused(&self) -> StoreResult<Vec<PausedQueue>> {
        self.inner.queue_paused().await
    }
    async fn host_beat(&self, beat: &HostBeat) -> StoreResult<()> {
        self.inner.host_beat(beat).await
    }
    async fn hosts_prune(&self, age: Duration) -> StoreResult<u64> {
        self.inner.hosts_prune(age).await
    }
    async fn hosts_seen(&self, within: Duration) -> StoreResult<Vec<HostBeat>> {
        self.inner.hosts_seen(within).await
    }
    async fn table_rows(&self, table: &str) -> StoreResult<Vec<Row>> {
        self.inner.table_rows(table).await
    }
    async fn dedup_purge(&self) -> StoreResult<u64> {
        self.inner.dedup_purge().await
    }

    async fn dedup_list(&self, queues: Queues<'_>, within: Duration, limit: usize) -> StoreResult<Vec<DedupKey>> {
        self.inner.dedup_list(queues, within, limit).await
    }
}

struct FaultyTransaction {
    inner: Box<dyn Transaction>,
    injector: Arc<Injector>,
}

/// Wait `delay`, if any (a store that stops answering).
async fn hang(delay: Option<Duration>) {
    if let Some(d) = delay {
        tokio::time::sleep(d).await;
    }
}

#[async_trait]
impl Transaction for FaultyTransaction {
    async fn row_get(&mut self, table: &TableSchema, key: &[Value]) -> StoreResult<Option<Row>> {
        hang(self.injector.plan.read_delay).await;
        if let Some(e) = &self.injector.plan.read_error {
            return Err(e.clone());
        }
        self.inner.row_get(table, key).await
    }
    async fn row_scan(&mut self, table: &TableSchema, prefix: &[Value], limit: usize) -> StoreResult<Vec<Row>> {
        hang(self.injector.plan.read_delay).await;
        if let Some(e) = &self.injector.plan.read_error {
            return Err(e.clone());
        }
        self.inner.row_scan(table, prefix, limit).await
    }
    fn row_write(&mut self, write: ValidWrite) {
        self.inner.row_write(write)
    }
    fn message_enqueue(&mut self, params: SendParams) {
        self.inner.message_enqueue(params)
    }
    fn dedup_hold(&mut self, queue: &str, key: &str, window: Duration) {
        self.inner.dedup_hold(queue, key, window)
    }
    fn message_ack(&mut self, lease: &Lease) {
        self.inner.message_ack(lease)
    }
    fn trace(&mut self, span: crate::trace::TraceParent) {
        self.inner.trace(span)
    }
    async fn commit(self: Box<Self>) -> StoreResult<()> {
        let injector = self.injector.clone();
        injector.commit(self.inner, None).await
    }
    async fn commit_held(self: Box<Self>, hold: commit::Hold) -> StoreResult<()> {
        let injector = self.injector.clone();
        injector.commit(self.inner, Some(hold)).await
    }
    async fn rollback(self: Box<Self>) {
        self.inner.rollback().await
    }
    async fn rehearse(self: Box<Self>) -> Option<StoreResult<()>> {
        self.inner.rehearse().await
    }
}

#[cfg(feature = "fault-injection")]
pub use batch::{BatchFaultCounts, BatchFaults, FaultyBatch};

/// Faults on the group commit's batches: a test hook, compiled only with
/// the `fault-injection` feature (the tests enable it; `onceq` does not).
#[cfg(feature = "fault-injection")]
mod batch {
    use super::*;

    /// Unknown outcomes on whole batches of the group commit
    /// ([`commit::CommitOptions::faults`]): a batch that commits and then
    /// reports an unknown outcome to every message in it, or one that reports
    /// it without committing. Each message must then be re-run, and its ack
    /// decides between *already committed* and *applied now*.
    #[derive(Debug, Clone, Copy, PartialEq, Default)]
    pub struct BatchFaults {
        /// The batch lands, then every message sees an unknown outcome.
        pub after_commit: f64,
        /// The batch is dropped, and every message sees an unknown outcome.
        pub before_commit: f64,
        /// The batch is aborted past the client's own re-runs (Spanner's
        /// ABORTED): nothing written, every message sees `Aborted`.
        pub aborted: f64,
        /// A batch of several is refused as a whole (Spanner's
        /// INVALID_ARGUMENT, as when one mutation cannot apply), drawn by
        /// the store itself, which then commits its messages one at a time
        /// (`CommitStats::split_batches`). Only the Spanner store draws it.
        pub refused: f64,
        pub seed: u64,
    }

    /// What [`BatchFaults`] injected: batches, and the messages in them.
    #[derive(Debug, Default)]
    pub struct BatchFaultCounts {
        pub landed_batches: AtomicU64,
        pub landed_messages: AtomicU64,
        pub dropped_batches: AtomicU64,
        pub dropped_messages: AtomicU64,
        pub aborted_batches: AtomicU64,
        pub aborted_messages: AtomicU64,
    }

    /// A batch committer injecting [`BatchFaults`].
    pub struct FaultyBatch {
        inner: Arc<dyn commit::BatchCommit>,
        plan: BatchFaults,
        rng: Mutex<rand::rngs::StdRng>,
        counts: Arc<BatchFaultCounts>,
    }

    impl FaultyBatch {
        pub fn wrap(inner: Arc<dyn commit::BatchCommit>, plan: BatchFaults, counts: Arc<BatchFaultCounts>) -> Arc<dyn commit::BatchCommit> {
            Arc::new(FaultyBatch {
                inner,
                plan,
                rng: Mutex::new(rand::rngs::StdRng::seed_from_u64(plan.seed)),
                counts,
            })
        }
    }

    impl FaultyBatch {
        fn roll(&self) -> f64 {
            self.rng.lock().map(|mut r| r.random()).unwrap_or(1.0)
        }

        /// What the batch's messages see: `results` as they are, or every one
        /// an unknown outcome when `roll` says the batch landed and the answer
        /// was lost.
        fn landed(&self, roll: f64, results: Vec<StoreResult<()>>) -> Vec<StoreResult<()>> {
            let n = results.len();
            if roll < self.plan.before_commit + self.plan.after_commit && n > 0 && results.iter().all(Result::is_ok) {
                self.counts.landed_batches.fetch_add(1, Ordering::Relaxed);
                self.counts.landed_messages.fetch_add(n as u64, Ordering::Relaxed);
                return (0..n)
                    .map(|_| Err(StoreError::UnknownOutcome(format!("injected: a batch of {n} landed"))))
                    .collect();
            }
            results
        }

        /// Whether `roll` aborts the batch (drawn after the other faults).
        fn aborts(&self, roll: f64) -> bool {
            let from = self.plan.before_commit + self.plan.after_commit;
            roll >= from && roll < from + self.plan.aborted
        }

        fn aborted(&self, n: usize) -> Vec<StoreResult<()>> {
            self.counts.aborted_batches.fetch_add(1, Ordering::Relaxed);
            self.counts.aborted_messages.fetch_add(n as u64, Ordering::Relaxed);
            (0..n)
                .map(|_| Err(StoreError::Aborted(format!("injected: a batch of {n} aborted"))))
                .collect()
        }

        fn dropped(&self, n: usize) -> Vec<StoreResult<()>> {
            self.counts.dropped_batches.fetch_add(1, Ordering::Relaxed);
            self.counts.dropped_messages.fetch_add(n as u64, Ordering::Relaxed);
            (0..n)
                .map(|_| Err(StoreError::UnknownOutcome(format!("injected: a batch of {n} was dropped"))))
                .collect()
        }
    }

    #[async_trait]
    impl commit::BatchCommit for FaultyBatch {
        async fn commit_batch(&self, batch: Vec<commit::Pending>) -> Vec<StoreResult<()>> {
            let roll = self.roll();
            if roll < self.plan.before_commit {
                return self.dropped(batch.len());
            }
            if self.aborts(roll) {
                return self.aborted(batch.len());
            }
            let results = self.inner.commit_batch(batch).await;
            self.landed(roll, results)
        }

        /// The driver's own collecting commit (the emulator's turn), with the
        /// same faults: a dropped batch is collected and answered without
        /// being committed.
        async fn commit_collected(&self, collect: &(dyn Fn() -> Vec<commit::Pending> + Send + Sync)) -> Vec<StoreResult<()>> {
            let roll = self.roll();
            if roll < self.plan.before_commit {
                return self.dropped(collect().len());
            }
            if self.aborts(roll) {
                return self.aborted(collect().len());
            }
            let results = self.inner.commit_collected(collect).await;
            self.landed(roll, results)
        }

        fn blocks(&self) -> bool {
            self.inner.blocks()
        }

        async fn rehearse(&self, p: commit::Pending) -> Option<StoreResult<()>> {
            self.inner.rehearse(p).await
        }
    }
}
