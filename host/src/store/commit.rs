//! The one commit path, for every store.
//!
//! A message transaction buffers what it wants committed in a [`Pending`]:
//! the reads to re-check, the guarded ack, the row writes, the messages to
//! send (follow-ups and outbox intents) and the dedup keys to hold. One
//! routine, [`apply`], decides and applies a pending over a narrow
//! per-driver [`Executor`] (re-run a read, delete a message if its lease
//! holds, apply a write, claim a dedup key, insert a message, hold a key),
//! always in the same order:
//!
//! 1. every recorded read is run again; a changed answer is
//!    [`StoreError::Aborted`] (the handler is re-run on fresh data);
//! 2. the ack: the message is deleted only if its lease token still
//!    matches, and exactly one row must go, else [`StoreError::LeaseLost`]
//!    (SQL's `ASSERT_ROWS_MODIFIED 1`);
//! 3. only then the writes, the sends (a dedup key is claimed first: a live
//!    claim drops the send) and the holds.
//!
//! So a message is *decided* (reads unchanged, lease held) before anything
//! of it is written, on every store. A driver wraps `apply` in whatever
//! isolates one message from the others of its batch: a savepoint on
//! SQLite; on Spanner nothing is needed, because nothing of a message is
//! written until it is decided, and any statement error fails the batch,
//! which is then committed again one message at a time.
//!
//! [`Group`] collects the pendings of concurrent transactions and commits
//! them together ("group commit"): one committer per store commits what is
//! queued (up to `commit.max_batch`) and hands every message its own
//! result; what arrives while a batch commits forms the next batch. A lone
//! message waits for nothing (`commit.max_wait` is zero by default). A
//! store whose commits block (SQLite) gets a committer thread of its own,
//! and runs its leases there too, between batches ([`Group::run`]).
//!
//! That committer also *gathers*: when it finds fewer than
//! [`GATHER_ENOUGH`] commits queued while other transactions of the store
//! are open (handlers running, whose commits are on their way), it waits
//! for them up to [`CommitOptions::gather`] (half a millisecond; less when
//! none comes for a quarter of it), so a busy host commits fewer, larger
//! batches instead of chasing each message with a transaction and an
//! fsync of its own. A message with no other transaction open waits for
//! nothing. What a commit decides does not change: only when its batch
//! starts.
//! The driver decides when the batch is collected
//! ([`BatchCommit::commit_collected`]): at once, or on the Spanner
//! emulator once its transaction's turn came, so what finished during the
//! wait is in it.

use super::*;
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use tokio::sync::{mpsc, oneshot};

/// What one message transaction asks to commit.
#[derive(Debug, Default, Clone)]
pub struct Pending {
    pub reads: Vec<ReadRecord>,
    pub writes: Vec<ValidWrite>,
    pub sends: Vec<SendParams>,
    /// (queue, key, window): keep a dedup key for `window` from commit.
    pub holds: Vec<(String, String, Duration)>,
    pub ack: Option<Lease>,
    /// The span this message's commit is part of (its `settle` span), for
    /// the batch's span when telemetry is on ([`BatchReport`]).
    pub trace: Option<crate::trace::TraceParent>,
}

/// One group commit, told to the [`BatchObserver`] (the telemetry's
/// `commit` span): when it started, the traced members, how many messages
/// and how many of them failed.
#[derive(Debug, Clone)]
pub struct BatchReport {
    pub started: std::time::SystemTime,
    pub members: Vec<crate::trace::TraceParent>,
    pub count: usize,
    pub failed: usize,
}

/// Told of every batch the committer commits.
pub type BatchObserver = Arc<dyn Fn(BatchReport) + Send + Sync>;

/// Most [`Pending::mutations`] one batch commits, whatever `max_batch`
/// says: half of Spanner's 80,000 mutations a commit, the rest left for
/// the business tables' secondary indexes, which onceq does not count. A
/// message heavier than this alone still commits alone (its own
/// transaction is then the database's to refuse).
pub const MAX_BATCH_MUTATIONS: usize = 40_000;

/// Most [`Pending::bytes`] one batch commits: a third of Spanner's 100 MB
/// a commit (index entries repeat key columns, which onceq does not
/// count). A message heavier than this commits alone.
pub const MAX_BATCH_BYTES: usize = 32 << 20;

impl Pending {
    /// What committing this costs in Spanner's mutations, estimated: a
    /// cell per written column (one for a delete), a message row
    /// (`onceq_messages`' 10 columns and its index) and a dedup claim per
    /// send, a held key, the ack.
    pub fn mutations(&self) -> usize {
        let writes: usize = self
            .writes
            .iter()
            .map(|w| match w.op {
                crate::value::WriteOp::Delete => 1,
                _ => w.values.iter().filter(|v| v.is_some()).count().max(1),
            })
            .sum();
        let sends: usize = self.sends.iter().map(|p| 12 + if p.dedup_key.is_some() { 6 } else { 0 }).sum();
        writes + sends + 3 * self.holds.len() + 2
    }

    /// What committing this writes, in bytes, estimated: every written
    /// value (8 for a number or a time), each send's payload and
    /// attributes and key, a few hundred bytes of onceq's own columns per
    /// row.
    pub fn bytes(&self) -> usize {
        let value = |v: &Value| match v {
            Value::Null | Value::Bool(_) => 1,
            Value::Int64(_) | Value::Float64(_) | Value::Timestamp(_) => 8,
            Value::String(s) | Value::Json(s) => s.len(),
            Value::Bytes(b) => b.len(),
        };
        let writes: usize = self
            .writes
            .iter()
            .map(|w| w.values.iter().flatten().map(value).sum::<usize>() + 64)
            .sum();
        let sends: usize = self
            .sends
            .iter()
            .map(|p| {
                let attrs: usize = p.attributes.iter().map(|(k, v)| k.len() + v.len() + 6).sum();
                p.payload.len() + attrs + p.queue.len() + p.dedup_key.as_ref().map_or(0, |k| 2 * k.len()) + 256
            })
            .sum();
        let holds: usize = self.holds.iter().map(|(q, k, _)| q.len() + k.len() + 64).sum();
        writes + sends + holds + 128
    }

    /// Record a read the handler made (re-checked at commit).
    pub fn read(&mut self, table: &TableSchema, key: &[Value], limit: Option<usize>, result: Vec<Row>) {
        self.reads.push(ReadRecord {
            table: table.clone(),
            key: key.to_vec(),
            limit,
            result,
        });
    }

    /// The buffering half of [`Transaction`], the same for every store.
    pub fn write(&mut self, w: ValidWrite) {
        self.writes.push(w);
    }
    pub fn send(&mut self, p: SendParams) {
        self.sends.push(p);
    }
    pub fn hold(&mut self, queue: &str, key: &str, window: Duration) {
        self.holds.push((queue.to_string(), key.to_string(), window));
    }
    pub fn ack(&mut self, lease: &Lease) {
        self.ack = Some(lease.clone());
    }

    /// Everything [`apply`] reads from the store to decide this pending:
    /// its recorded reads, run again; its ack's lease; the dedup keys its
    /// sends claim and its holds keep. A store that reads ahead of the
    /// decisions (Spanner, in a few calls for a whole batch) reads exactly
    /// this, so the two cannot drift: a step added to `apply` that reads
    /// something else fails `needs_cover_every_read_of_apply`.
    pub fn needs(&self) -> Needs<'_> {
        let claims = self
            .sends
            .iter()
            .filter_map(|s| s.dedup_key.as_deref().map(|k| (s.queue.as_str(), k)));
        let holds = self.holds.iter().map(|(q, k, _)| (q.as_str(), k.as_str()));
        Needs {
            reads: &self.reads,
            ack: self.ack.as_ref(),
            dedup_keys: claims.chain(holds).collect(),
        }
    }
}

/// What [`apply`] reads to decide one pending ([`Pending::needs`]).
#[derive(Debug)]
pub struct Needs<'p> {
    /// The handler's reads, each run again.
    pub reads: &'p [ReadRecord],
    /// The lease whose token the ack checks.
    pub ack: Option<&'p Lease>,
    /// `(queue, key)` of every dedup key claimed or held.
    pub dedup_keys: Vec<(&'p str, &'p str)>,
}

/// Where a message transaction's reads are served from: a consistent
/// snapshot of the store, opened on first use (SQLite: a reader
/// connection in a read transaction; Spanner: a read-only transaction).
#[async_trait]
pub trait Snapshot: Send {
    /// One row by primary key.
    async fn get(&mut self, table: &TableSchema, key: &[Value]) -> StoreResult<Option<Row>>;
    /// Up to `limit` rows whose key starts with `prefix`, in key order.
    async fn scan(&mut self, table: &TableSchema, prefix: &[Value], limit: usize) -> StoreResult<Vec<Row>>;
}

/// The message transaction of every store with a group committer: reads
/// served by a [`Snapshot`] and recorded, effects and the ack buffered in
/// a [`Pending`], the whole committed through the store's [`Group`]. The
/// snapshot is closed (dropped) before the commit waits.
pub struct Buffered<S: Snapshot> {
    snapshot: Option<S>,
    pending: Pending,
    group: Arc<Group>,
    /// Its commit is on its way, for a gathering committer.
    expected: Expected,
}

impl<S: Snapshot> Buffered<S> {
    pub fn new(snapshot: S, group: Arc<Group>) -> Buffered<S> {
        Buffered {
            snapshot: Some(snapshot),
            pending: Pending::default(),
            expected: group.expect(),
            group,
        }
    }

    /// The transaction ends: its snapshot is closed (before any commit
    /// waits), the rest handed out.
    fn close(self) -> (Pending, Arc<Group>, Expected) {
        let Buffered {
            snapshot,
            pending,
            group,
            expected,
        } = self;
        drop(snapshot);
        (pending, group, expected)
    }

    fn snapshot(&mut self) -> StoreResult<&mut S> {
        self.snapshot
            .as_mut()
            .ok_or_else(|| StoreError::Invariant("a read after the transaction ended".into()))
    }
}

#[async_trait]
impl<S: Snapshot + 'static> Transaction for Buffered<S> {
    async fn row_get(&mut self, table: &TableSchema, key: &[Value]) -> StoreResult<Option<Row>> {
        let result = self.snapshot()?.get(table, key).await?;
        self.pending.read(table, key, None, result.iter().cloned().collect());
        Ok(result)
    }

    async fn row_scan(&mut self, table: &TableSchema, prefix: &[Value], limit: usize) -> StoreResult<Vec<Row>> {
        let limit = limit.min(MAX_SCAN_ROWS);
        let result = self.snapshot()?.scan(table, prefix, limit).await?;
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

    fn trace(&mut self, span: crate::trace::TraceParent) {
        self.pending.trace = Some(span);
    }

    async fn commit(self: Box<Self>) -> StoreResult<()> {
        let (pending, group, expected) = self.close();
        group.commit_expected(pending, Some(expected)).await
    }

    async fn commit_held(self: Box<Self>, hold: Hold) -> StoreResult<()> {
        let (pending, group, expected) = self.close();
        // The committer is waiting for this one: nothing to gather for.
        drop(expected);
        match hold.commit(pending).await {
            Ok(result) => result,
            Err(pending) => group.commit(pending).await,
        }
    }

    async fn rollback(self: Box<Self>) {}

    async fn rehearse(self: Box<Self>) -> Option<StoreResult<()>> {
        let (pending, group, expected) = self.close();
        drop(expected);
        group.rehearse(pending).await
    }
}

/// The statements a driver offers the commit routine, all inside one open
/// read-write transaction.
#[allow(async_fn_in_trait)] // crate-internal; drivers' futures are checked where used
pub trait Executor {
    /// Run a recorded read again, in the write transaction.
    async fn reread(&mut self, read: &ReadRecord) -> StoreResult<Vec<Row>>;
    /// Delete the message of `lease` if its token still matches; the number
    /// of rows deleted.
    async fn delete_leased(&mut self, lease: &Lease) -> StoreResult<u64>;
    /// Apply a checked row write (insert, update, upsert, delete).
    async fn write(&mut self, w: &ValidWrite) -> StoreResult<()>;
    /// Claim `key` on `queue` for message `id` for `window`, unless a live
    /// claim exists: `None` if claimed, else the id of the message holding it.
    async fn dedup_claim(&mut self, queue: &str, key: &str, id: &str, window: Duration) -> StoreResult<Option<String>>;
    /// Insert a new message with this id: ready (or delayed), or, for a
    /// send with a [`SendParams::handoff`] on a store that supports it,
    /// leased with the handoff's token (then told to the handoff).
    async fn message_insert(&mut self, id: &str, p: &SendParams) -> StoreResult<()>;
    /// Keep an existing claim of `key` on `queue` for `window` from now.
    async fn dedup_hold(&mut self, queue: &str, key: &str, window: Duration) -> StoreResult<()>;
}

/// Send one message: claim its dedup key first (the one dedup rule of
/// every store: a live claim drops the send), then insert it.
pub async fn send<E: Executor + ?Sized>(ex: &mut E, p: &SendParams, default_window: Duration) -> StoreResult<SendOutcome> {
    let id = crate::value::message_id();
    if let Some(h) = &p.handoff {
        // Applied again (the batch re-committed one by one): only this
        // application's insert counts.
        h.set_landed(None);
    }
    if let Some(key) = &p.dedup_key {
        let window = p.dedup_window.unwrap_or(default_window);
        if let Some(existing_id) = ex.dedup_claim(&p.queue, key, &id, window).await? {
            return Ok(SendOutcome::Duplicate { existing_id });
        }
    }
    ex.message_insert(&id, p).await?;
    Ok(SendOutcome::Sent { id })
}

/// Decide and apply one pending (see the module docs for the order).
pub async fn apply<E: Executor + ?Sized>(ex: &mut E, p: &Pending, dedup_window: Duration) -> StoreResult<()> {
    for read in &p.reads {
        let now = ex.reread(read).await?;
        if !read.unchanged(&now) {
            return Err(StoreError::Aborted(format!(
                "a row of {} read by the handler changed before commit",
                read.table.name
            )));
        }
    }
    if let Some(lease) = &p.ack {
        if ex.delete_leased(lease).await? != 1 {
            return Err(StoreError::LeaseLost {
                message_id: lease.message_id.clone(),
            });
        }
    }
    for w in &p.writes {
        ex.write(w).await?;
    }
    for s in &p.sends {
        send(ex, s, dedup_window).await?;
    }
    for (queue, key, window) in &p.holds {
        ex.dedup_hold(queue, key, *window).await?;
    }
    Ok(())
}

/// The acks of a batch that succeeded, per queue: what the driver adds to
/// the processed counts (`onceq_counts`) in the batch's own transaction,
/// so `onceq stats` counts each processed message exactly once.
pub fn processed_by_queue<'a>(batch: &'a [Pending], results: &[StoreResult<()>]) -> std::collections::BTreeMap<&'a str, i64> {
    let mut by_queue = std::collections::BTreeMap::new();
    for (p, r) in batch.iter().zip(results) {
        if let (Some(lease), Ok(())) = (&p.ack, r) {
            *by_queue.entry(lease.queue.as_str()).or_insert(0) += 1;
        }
    }
    by_queue
}

/// How pendings are grouped (`[commit]` in `onceq.toml`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CommitOptions {
    /// Most messages in one database transaction (`commit.max_batch`); 1
    /// commits every message alone.
    pub max_batch: usize,
    /// How long a leader waits for more messages before it commits
    /// (`commit.max_wait`); zero commits what is queued at once.
    pub max_wait: Duration,
    /// Hand follow-ups and intents bound for a queue this host works to
    /// its workers in memory, inserted already leased (`commit.handoff`;
    /// SQLite only).
    pub handoff: bool,
    /// The longest a committer with a thread of its own waits for the
    /// commits of transactions still open when fewer than
    /// [`GATHER_ENOUGH`] are queued (see the module docs); zero never
    /// waits. Unused with a `max_wait`, and where the committer is a task
    /// of the runtime (Spanner), whose thread it would block.
    pub gather: Duration,
    /// Unknown outcomes injected on whole batches (tests only, with the
    /// `fault-injection` feature): see [`super::faulty::FaultyBatch`].
    #[cfg(feature = "fault-injection")]
    pub faults: Option<super::faulty::BatchFaults>,
}

impl Default for CommitOptions {
    fn default() -> Self {
        CommitOptions {
            max_batch: 64,
            max_wait: Duration::ZERO,
            handoff: true,
            gather: GATHER_MAX,
            #[cfg(feature = "fault-injection")]
            faults: None,
        }
    }
}

/// What a store's group commit did so far (`onceq_commit_batches`,
/// `onceq_commit_messages`, `onceq_commit_split_batches` and
/// `onceq_commit_leases_in_batches` on the admin API's metrics).
#[derive(Debug, Clone)]
pub struct CommitStats {
    /// Batches committed (each one database transaction).
    pub batches: u64,
    /// Messages committed in them.
    pub messages: u64,
    /// Batches that failed as a whole and were committed one message at a
    /// time (Spanner: a write the database refused fails the whole commit;
    /// SQLite: a statement that ended the transaction, or a refused commit).
    /// `onceq_commit_split_batches` on the admin API's metrics.
    pub split_batches: u64,
    /// SQLite: leases run inside a batch's transaction, not in one of
    /// their own (`onceq_commit_leases_in_batches`).
    pub leases_in_batches: u64,
    /// Spanner: handlers' point reads, and the read calls that served them
    /// (reads of concurrent messages are coalesced, `store/spanner/reads.rs`).
    pub point_reads: u64,
    pub point_read_calls: u64,
    /// What `CommitOptions::faults` injected.
    #[cfg(feature = "fault-injection")]
    pub faults: Arc<super::faulty::BatchFaultCounts>,
}

/// Run a future that never waits (a driver whose statements are
/// synchronous, like SQLite's) to its end, on this thread: polled once.
pub fn run_now<T>(f: impl Future<Output = StoreResult<T>>) -> StoreResult<T> {
    let mut f = std::pin::pin!(f);
    match f.as_mut().poll(&mut std::task::Context::from_waker(std::task::Waker::noop())) {
        std::task::Poll::Ready(v) => v,
        std::task::Poll::Pending => Err(StoreError::Permanent("a synchronous store statement waited".into())),
    }
}

/// A driver's batch commit: one database transaction for all of `batch`,
/// one result per pending, in order.
#[async_trait]
pub trait BatchCommit: Send + Sync {
    async fn commit_batch(&self, batch: Vec<Pending>) -> Vec<StoreResult<()>>;

    /// Commit the batch `collect` gathers (one result per pending, in
    /// order), calling it once the transaction can start at once. A store
    /// whose transactions wait their turn (the Spanner emulator) waits first,
    /// so what was queued meanwhile joins this batch instead of waiting a
    /// whole turn more. A store without turns collects at once.
    ///
    /// No method here has a default: a decorator must forward each one.
    async fn commit_collected(&self, collect: &(dyn Fn() -> Vec<Pending> + Send + Sync)) -> Vec<StoreResult<()>>;

    /// Its commits block the thread they run on (SQLite's statements and
    /// fsync): the committer then runs on a thread of its own, not on the
    /// runtime whose threads run the handlers (on a multi-threaded runtime,
    /// as `onceq run` has; a single-threaded one runs it as a task).
    fn blocks(&self) -> bool;

    /// Apply `p` in a transaction of its own and roll it back: the result
    /// its commit would have ([`Transaction::rehearse`]); `None` if the
    /// store cannot apply without committing.
    async fn rehearse(&self, p: Pending) -> Option<StoreResult<()>>;
}

/// What the committer is given: a message to commit with others, other
/// work to run between two batches ([`Group::run`]), or a request to stop
/// between two batches for a message that must go first ([`Group::hold`]).
enum Job {
    Commit(Pending, oneshot::Sender<StoreResult<()>>),
    Run(Pin<Box<dyn Future<Output = ()> + Send>>),
    Hold(oneshot::Sender<Hold>),
}

type Submission = (Pending, oneshot::Sender<StoreResult<()>>);

/// The committer stopped between two batches for one message
/// ([`Group::hold`]): what the message reads now, no batch changes before
/// its commit, which is the first of the next batch. Dropping it lets the
/// committer go on; so does [`HOLD_MAX`] passing.
pub struct Hold {
    submit: oneshot::Sender<Submission>,
}

impl Hold {
    /// Commit `p` first in the next batch; its own result. `Err(p)` if the
    /// committer stopped waiting (after [`HOLD_MAX`]): commit it the usual
    /// way then.
    pub async fn commit(self, p: Pending) -> Result<StoreResult<()>, Pending> {
        let (tx, rx) = oneshot::channel();
        match self.submit.send((p, tx)) {
            Ok(()) => Ok(rx.await.unwrap_or_else(|_| {
                Err(StoreError::UnknownOutcome(
                    "the committer stopped during this message's batch".into(),
                ))
            })),
            Err((p, _)) => Err(p),
        }
    }
}

/// The longest the committer waits for a held message ([`Group::hold`])
/// before it goes on with the others: a handler that reads a hot row and
/// computes for longer than this loses its turn (it is then committed as
/// usual).
pub const HOLD_MAX: Duration = Duration::from_millis(500);

/// Group commit: see the module docs. One committer per store takes
/// what is queued (up to `max_batch`) and commits it while the workers go
/// on handling messages; a worker waits only for its own message's result.
///
/// It is built with its driver and starts its committer on first use (on
/// a thread of its own when the driver blocks, else as a task of the
/// caller's runtime). Its backlog is bounded ([`BACKLOG_PER_BATCH`] batches
/// of jobs): a caller waits while it is full. [`Group::stop`] lets the
/// committer commit what is queued and end.
pub struct Group {
    options: CommitOptions,
    /// The store's batch commit (with the injected faults of
    /// `options.faults`, if any).
    driver: Arc<dyn BatchCommit>,
    /// The committer's queue, and its end, once started.
    queue: Mutex<Option<Committer>>,
    /// [`Group::stop`] was called: nothing more is taken.
    stopped: std::sync::atomic::AtomicBool,
    /// Batches committed and messages in them (`/metrics`, `make bench`).
    batches: Arc<std::sync::atomic::AtomicU64>,
    messages: Arc<std::sync::atomic::AtomicU64>,
    /// Told of each batch, once set ([`Group::observe`]).
    observer: Arc<std::sync::OnceLock<BatchObserver>>,
    /// Transactions open whose commit is still to come ([`Expected`]).
    open: Arc<std::sync::atomic::AtomicUsize>,
    /// Commits queued for the committer and not yet taken by it
    /// ([`Group::commits_queued`]).
    queued: Arc<std::sync::atomic::AtomicUsize>,
    #[cfg(feature = "fault-injection")]
    faults: Arc<super::faulty::BatchFaultCounts>,
}

/// A running committer: where jobs go, and what says it ended.
struct Committer {
    jobs: mpsc::Sender<Job>,
    ended: tokio::sync::watch::Receiver<bool>,
}

/// The committer's backlog, in batches of `max_batch` jobs: callers wait
/// when more is queued.
pub const BACKLOG_PER_BATCH: usize = 4;

/// [`CommitOptions::gather`] by default. Through the CLI (20,000 payments
/// messages, 16 workers, file delivery) a committer that never waited ran
/// 2,600 batches, 1,569 of them under 8 messages, and spent a third of its
/// time on those; waiting up to 0.1, 0.3, 0.5 or 1 ms for 4, 8, 12, 32 or
/// 64 queued commits, 0.5 ms for 8 did best, 4-7% faster with 6-8% less
/// CPU (docs/src/benchmarks.md).
pub const GATHER_MAX: Duration = Duration::from_micros(500);

/// Queued commits enough for the committer not to wait for more.
pub const GATHER_ENOUGH: usize = 8;

/// How often a gathering committer looks at its queue again.
const GATHER_POLL: Duration = Duration::from_micros(20);

/// A transaction of the store is open: its commit may come soon, and a
/// gathering committer waits for it (within [`CommitOptions::gather`]).
/// Dropped when the commit was queued, or when the transaction ended
/// without one.
pub struct Expected {
    open: Arc<std::sync::atomic::AtomicUsize>,
}

impl Drop for Expected {
    fn drop(&mut self) {
        self.open.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Group {
    pub fn new(options: CommitOptions, driver: Arc<dyn BatchCommit>) -> Group {
        #[cfg(feature = "fault-injection")]
        let faults: Arc<super::faulty::BatchFaultCounts> = Default::default();
        #[cfg(feature = "fault-injection")]
        let driver = match options.faults {
            Some(plan) => super::faulty::FaultyBatch::wrap(driver, plan, faults.clone()),
            None => driver,
        };
        Group {
            options: CommitOptions {
                max_batch: options.max_batch.max(1),
                ..options
            },
            driver,
            queue: Mutex::new(None),
            stopped: std::sync::atomic::AtomicBool::new(false),
            batches: Default::default(),
            messages: Default::default(),
            observer: Default::default(),
            open: Default::default(),
            queued: Default::default(),
            #[cfg(feature = "fault-injection")]
            faults,
        }
    }

    /// Commits queued that the committer has not taken yet: when there are
    /// some, a batch is coming, and work that can ride in its transaction
    /// (a SQLite lease) may wait for it. A hint: a committer that stopped
    /// leaves its queued commits counted, so never wait on it alone.
    pub fn commits_queued(&self) -> usize {
        self.queued.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A transaction opened: its commit is expected until the guard is
    /// dropped ([`Group::commit_expected`] drops it once the commit is
    /// queued).
    pub fn expect(&self) -> Expected {
        self.open.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Expected { open: self.open.clone() }
    }

    /// Tell `observer` of every batch from now on (the first observer
    /// stays: one per store).
    pub fn observe(&self, observer: BatchObserver) {
        let _ = self.observer.set(observer);
    }

    pub fn options(&self) -> CommitOptions {
        self.options
    }

    /// What it committed so far.
    pub fn stats(&self) -> CommitStats {
        CommitStats {
            batches: self.batches.load(std::sync::atomic::Ordering::Relaxed),
            messages: self.messages.load(std::sync::atomic::Ordering::Relaxed),
            split_batches: 0,
            leases_in_batches: 0,
            point_reads: 0,
            point_read_calls: 0,
            #[cfg(feature = "fault-injection")]
            faults: self.faults.clone(),
        }
    }

    /// The verdict `p`'s commit would have, nothing kept
    /// ([`BatchCommit::rehearse`]).
    pub async fn rehearse(&self, p: Pending) -> Option<StoreResult<()>> {
        self.driver.rehearse(p).await
    }

    /// Commit `p` with whatever else is being committed now; its own result.
    pub async fn commit(&self, p: Pending) -> StoreResult<()> {
        self.commit_expected(p, None).await
    }

    /// [`Self::commit`] for a transaction that was [`Self::expect`]ed: no
    /// longer expected once its commit is queued (not before, so a
    /// gathering committer never misses it in between).
    pub async fn commit_expected(&self, p: Pending, expected: Option<Expected>) -> StoreResult<()> {
        let (tx, rx) = oneshot::channel();
        self.queued.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let sent = self.send(Job::Commit(p, tx)).await;
        drop(expected);
        if sent.is_err() {
            self.queued.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
        sent?;
        rx.await.unwrap_or_else(|_| {
            Err(StoreError::UnknownOutcome(
                "the committer stopped during this message's batch".into(),
            ))
        })
    }

    /// Run `work` on the committer, after the batch being committed: for a
    /// store whose committer has a thread of its own (SQLite), the other
    /// writes (leases, renewals, failure records) then take the write lock
    /// there, with no hand-off between threads (a lease run on the runtime
    /// held the next batch back while its task waited to be scheduled).
    pub async fn run<T: Send + 'static>(&self, work: impl Future<Output = StoreResult<T>> + Send + 'static) -> StoreResult<T> {
        let (tx, rx) = oneshot::channel();
        self.send(Job::Run(Box::pin(async move {
            let _ = tx.send(work.await);
        })))
        .await?;
        rx.await
            .unwrap_or_else(|_| Err(StoreError::Unavailable("the committer stopped before this write ended".into())))
    }

    /// Wait until the committer is between two batches and keep it there:
    /// for a message that lost to contention again and again (its reads
    /// changed by the batches committed while it ran). Read after this, and
    /// committed through the [`Hold`], it goes first in the next batch, and
    /// nothing can change what it read in between (on this host). Holds
    /// are served one at a time, in order.
    pub async fn hold(&self) -> StoreResult<Hold> {
        let (tx, rx) = oneshot::channel();
        self.send(Job::Hold(tx)).await?;
        rx.await
            .map_err(|_| StoreError::Unavailable("the committer stopped before it could hold".into()))
    }

    /// Take nothing more, let the committer commit what is queued, and
    /// wait for it to end. Commits asked for after this fail (unavailable:
    /// nothing was written).
    pub async fn stop(&self) {
        self.stopped.store(true, std::sync::atomic::Ordering::Relaxed);
        let ended = match self.queue.lock() {
            // Dropping the sender: the committer ends once the queue is empty.
            Ok(mut q) => q.take().map(|c| c.ended),
            Err(_) => None,
        };
        if let Some(mut ended) = ended {
            let _ = ended.wait_for(|e| *e).await;
        }
    }

    /// Queue `job` for the committer, starting one if there is none (or it
    /// is gone); waits while the backlog is full.
    async fn send(&self, job: Job) -> StoreResult<()> {
        let mut job = Some(job);
        for _ in 0..2 {
            if self.stopped.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(StoreError::Unavailable("the store is closing: its committer has stopped".into()));
            }
            let sender = self.sender()?;
            match sender
                .send(job.take().ok_or_else(|| StoreError::Invariant("job sent twice".into()))?)
                .await
            {
                Ok(()) => return Ok(()),
                Err(mpsc::error::SendError(j)) => job = Some(j), // the committer is gone: start another
            }
        }
        Err(StoreError::Unavailable("the committer could not be started".into()))
    }

    /// The running committer's queue, starting it if needed.
    fn sender(&self) -> StoreResult<mpsc::Sender<Job>> {
        let mut q = self
            .queue
            .lock()
            .map_err(|_| StoreError::Invariant("commit queue poisoned".into()))?;
        if let Some(c) = q.as_ref().filter(|c| !c.jobs.is_closed()) {
            return Ok(c.jobs.clone());
        }
        let (jobs, r) = mpsc::channel(self.options.max_batch.saturating_mul(BACKLOG_PER_BATCH).max(16));
        let (ended_tx, ended) = tokio::sync::watch::channel(false);
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|e| StoreError::Unavailable(format!("no runtime to start the committer on: {e}")))?;
        // On a single-threaded runtime (tests with a paused clock) the
        // committer shares its one thread anyway.
        let own_thread = self.driver.blocks() && runtime.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread;
        // Gathering waits on the committer's thread: only where it has one.
        let o = &self.options;
        let gather = (own_thread && o.max_wait.is_zero() && o.max_batch > 1 && !o.gather.is_zero()).then(|| (o.gather, self.open.clone()));
        let run = committer(
            r,
            self.driver.clone(),
            self.options,
            gather,
            (self.batches.clone(), self.messages.clone(), self.queued.clone()),
            self.observer.clone(),
        );
        let run = async move {
            run.await;
            ended_tx.send_replace(true);
        };
        if own_thread {
            on_own_thread(run)?;
        } else {
            runtime.spawn(run);
        }
        *q = Some(Committer { jobs: jobs.clone(), ended });
        Ok(jobs)
    }
}

/// Run a committer whose commits block on a thread of its own, on a
/// single-threaded runtime there; it ends with the committer (when every
/// sender is gone). On tokio's blocking pool instead, each batch waited
/// for a pool thread, then for a runtime thread free of handlers to take
/// its results, and the committer, the serial part, spent much of its time
/// outside its commits (docs/src/benchmarks.md).
fn on_own_thread(run: impl Future<Output = ()> + Send + 'static) -> StoreResult<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(|e| StoreError::Unavailable(format!("could not start the committer's runtime: {e}")))?;
    std::thread::Builder::new()
        .name("onceq-committer".into())
        .spawn(move || rt.block_on(run))
        .map(drop)
        .map_err(|e| StoreError::Unavailable(format!("could not start the committer thread: {e}")))
}

/// The committer: take what is queued (up to `max_batch`, after waiting
/// `max_wait` for more), commit it, hand out the results, then run the
/// other work queued meanwhile and serve the holds; until every sender is
/// gone (the store was dropped).
async fn committer(
    mut rx: mpsc::Receiver<Job>,
    driver: Arc<dyn BatchCommit>,
    options: CommitOptions,
    gather: Option<(Duration, Arc<std::sync::atomic::AtomicUsize>)>,
    (batches, messages, queued): (
        Arc<std::sync::atomic::AtomicU64>,
        Arc<std::sync::atomic::AtomicU64>,
        Arc<std::sync::atomic::AtomicUsize>,
    ),
    observer: Arc<std::sync::OnceLock<BatchObserver>>,
) {
    // A commit taken from the queue is no longer queued (carried ones were
    // counted off when first taken).
    let taken = || {
        queued.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    };
    // Work and holds met while collecting a batch, for after it, in order.
    let mut carried: std::collections::VecDeque<Job> = std::collections::VecDeque::new();
    loop {
        let job = match carried.pop_front() {
            Some(job) => job,
            None => match rx.recv().await {
                Some(job) => {
                    if matches!(job, Job::Commit(..)) {
                        taken();
                    }
                    job
                }
                None => break,
            },
        };
        let first = match job {
            Job::Commit(p, tx) => {
                if let Some((most, open)) = &gather {
                    gather_queued(&rx, open, *most);
                }
                (p, tx)
            }
            Job::Run(work) => {
                work.await;
                continue;
            }
            Job::Hold(grant) => match held(grant).await {
                Some(first) => first,
                None => continue,
            },
        };
        if !options.max_wait.is_zero() {
            tokio::time::sleep(options.max_wait).await;
        }
        // The first job, then the commits queued when the driver collects
        // (up to max_batch), their senders in the same order, and the other
        // jobs queued among them, for after the batch.
        let queue = Mutex::new((Some(first), &mut rx, Vec::new(), &mut carried));
        // The traced members, when someone observes the batches.
        let observer = observer.get();
        let traced = Mutex::new(Vec::new());
        let started = observer.map(|_| std::time::SystemTime::now());
        let collect = || {
            let mut q = queue.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            let (first, rx, senders, later) = &mut *q;
            let mut batch = Vec::new();
            let (mut mutations, mut bytes) = (0, 0);
            let mut next = first.take().map(|(p, tx)| ((p.mutations(), p.bytes()), p, tx));
            while let Some(((m, b), p, tx)) = next {
                (mutations, bytes) = (mutations + m, bytes + b);
                batch.push(p);
                senders.push(tx);
                next = None;
                while senders.len() < options.max_batch {
                    match rx.try_recv() {
                        Ok(Job::Commit(p, tx)) => {
                            taken();
                            let (m, b) = (p.mutations(), p.bytes());
                            if mutations + m > MAX_BATCH_MUTATIONS || bytes + b > MAX_BATCH_BYTES {
                                // Too heavy for this batch: the first of the next.
                                later.push_back(Job::Commit(p, tx));
                            } else {
                                next = Some(((m, b), p, tx));
                            }
                            break;
                        }
                        Ok(other) => later.push_back(other),
                        Err(_) => break,
                    }
                }
            }
            if observer.is_some() {
                traced
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .extend(batch.iter().filter_map(|p| p.trace));
            }
            batch
        };
        let results = driver.commit_collected(&collect).await;
        let (first, _, senders, _) = queue.into_inner().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some((_, tx)) = first {
            // The driver never collected: it has no result for this job.
            let _ = tx.send(Err(StoreError::Permanent("the batch commit collected nothing".into())));
        }
        batches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        messages.fetch_add(senders.len() as u64, std::sync::atomic::Ordering::Relaxed);
        if let (Some(observe), Some(started)) = (observer, started) {
            observe(BatchReport {
                started,
                members: traced.into_inner().unwrap_or_else(|poisoned| poisoned.into_inner()),
                count: senders.len(),
                failed: results.iter().filter(|r| r.is_err()).count(),
            });
        }
        let mut results = results.into_iter();
        for tx in senders {
            let r = results
                .next()
                .unwrap_or_else(|| Err(StoreError::Permanent("batch commit returned too few results".into())));
            let _ = tx.send(r);
        }
    }
}

/// Wait (on the committer's own thread, which nothing else uses) while
/// fewer than [`GATHER_ENOUGH`] jobs are queued behind the first, a
/// transaction of the store is still open, and jobs keep coming (one came
/// within the last quarter of `most`), up to `most`. Other jobs count
/// toward enough too (a lease waits behind the batch, its worker idle).
/// The open
/// transactions may be slow ones (an outbox delivery to a webhook): when
/// nothing comes for a while, the batch goes without them instead of the
/// committer sleeping through the whole bound. Through the CLI (20,000
/// messages, medians of 10) both ran alike: 1.26 and 1.255 s.
fn gather_queued(rx: &mpsc::Receiver<Job>, open: &std::sync::atomic::AtomicUsize, most: Duration) {
    let started = std::time::Instant::now();
    let (until, quiet) = (started + most, most / 4);
    let (mut queued, mut came) = (rx.len(), started);
    while queued + 1 < GATHER_ENOUGH && open.load(std::sync::atomic::Ordering::Relaxed) > 0 {
        std::thread::sleep(GATHER_POLL);
        let now = std::time::Instant::now();
        let len = rx.len();
        if len > queued {
            (queued, came) = (len, now);
        }
        if now >= until || now.duration_since(came) >= quiet {
            break;
        }
    }
}

/// Serve a hold: grant it, then wait (at most [`HOLD_MAX`]) for the held
/// message, which then starts the next batch. `None` if it never came.
async fn held(grant: oneshot::Sender<Hold>) -> Option<Submission> {
    let (submit, submitted) = oneshot::channel();
    grant.send(Hold { submit }).ok()?;
    match tokio::time::timeout(HOLD_MAX, submitted).await {
        Ok(Ok(first)) => Some(first),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Commits nothing; records batch sizes; fails pendings with an ack of
    /// a message id starting with "lost".
    struct Recorder {
        sizes: Mutex<Vec<usize>>,
        calls: AtomicUsize,
        /// Says its commits block: the committer gets a thread of its own
        /// (and gathers).
        blocks: bool,
    }

    impl Recorder {
        fn new() -> Arc<Recorder> {
            Recorder::built(false)
        }

        fn blocking() -> Arc<Recorder> {
            Recorder::built(true)
        }

        fn built(blocks: bool) -> Arc<Recorder> {
            Arc::new(Recorder {
                sizes: Mutex::new(vec![]),
                calls: AtomicUsize::new(0),
                blocks,
            })
        }
    }

    #[async_trait]
    impl BatchCommit for Recorder {
        async fn commit_batch(&self, batch: Vec<Pending>) -> Vec<StoreResult<()>> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            self.sizes.lock().unwrap().push(batch.len());
            tokio::task::yield_now().await;
            batch
                .iter()
                .map(|p| match &p.ack {
                    Some(l) if l.message_id.starts_with("lost") => Err(StoreError::LeaseLost {
                        message_id: l.message_id.clone(),
                    }),
                    _ => Ok(()),
                })
                .collect()
        }

        async fn commit_collected(&self, collect: &(dyn Fn() -> Vec<Pending> + Send + Sync)) -> Vec<StoreResult<()>> {
            self.commit_batch(collect()).await
        }

        fn blocks(&self) -> bool {
            self.blocks
        }

        async fn rehearse(&self, _p: Pending) -> Option<StoreResult<()>> {
            None
        }
    }

    /// A committer with a thread of its own waits, while a transaction of
    /// its store is open, for that transaction's commit to join the batch;
    /// it stops waiting once the commit is queued. The gathering bound is
    /// long here (the test never reaches it, nor a quarter of it with no
    /// commit coming), so a loaded machine changes nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_committer_gathers_the_commits_of_open_transactions() {
        let rec = Recorder::blocking();
        let options = CommitOptions {
            gather: Duration::from_secs(60),
            ..CommitOptions::default()
        };
        let group = Arc::new(Group::new(options, rec.clone()));
        let open = group.expect();
        let g = group.clone();
        let first = tokio::spawn(async move { g.commit(pending("m-1")).await });
        // Queued, and waiting for the open transaction.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            rec.sizes.lock().unwrap().is_empty(),
            "committed before the open transaction's commit came"
        );
        assert!(!first.is_finished());
        group.commit_expected(pending("m-2"), Some(open)).await.unwrap();
        first.await.unwrap().unwrap();
        assert_eq!(rec.sizes.lock().unwrap().clone(), vec![2], "one batch for both");
    }

    /// It waits for nothing when no other transaction is open, nor once
    /// enough commits are queued, however long the bound; and a committer
    /// on the runtime (no thread of its own) never gathers.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_committer_gathers_only_while_it_has_too_few_and_more_are_coming() {
        let options = CommitOptions {
            gather: Duration::from_secs(600),
            ..CommitOptions::default()
        };
        let bound = Duration::from_secs(60);
        let rec = Recorder::blocking();
        let group = Arc::new(Group::new(options, rec.clone()));
        tokio::time::timeout(bound, group.commit(pending("alone")))
            .await
            .expect("a lone commit waited")
            .unwrap();
        // A transaction stays open, but enough come: the committer waits
        // for them (no more), and they go together.
        let _open = group.expect();
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..GATHER_ENOUGH {
            let g = group.clone();
            tasks.spawn(async move { g.commit(pending(&format!("m-{i}"))).await });
        }
        tokio::time::timeout(bound, async {
            while let Some(r) = tasks.join_next().await {
                r.unwrap().unwrap();
            }
        })
        .await
        .expect("enough queued, and still waiting for the open transaction");
        assert_eq!(rec.sizes.lock().unwrap().clone(), vec![1, GATHER_ENOUGH]);
        let on_runtime = Recorder::new();
        let group = Group::new(options, on_runtime.clone());
        let _open = group.expect();
        tokio::time::timeout(bound, group.commit(pending("task")))
            .await
            .expect("a committer without a thread of its own gathered")
            .unwrap();
    }

    fn pending(id: &str) -> Pending {
        Pending {
            ack: Some(Lease {
                queue: "q".into(),
                message_id: id.into(),
                shard: 0,
                token: "t".into(),
            }),
            ..Pending::default()
        }
    }

    /// What [`apply`] asked the store, recorded.
    #[derive(Default)]
    struct Recording {
        asked: Vec<String>,
    }

    impl Executor for Recording {
        async fn reread(&mut self, read: &ReadRecord) -> StoreResult<Vec<Row>> {
            self.asked.push(format!("read {} {:?} {:?}", read.table.name, read.key, read.limit));
            Ok(read.result.clone())
        }
        async fn delete_leased(&mut self, lease: &Lease) -> StoreResult<u64> {
            self.asked.push(format!("lease {}", lease.message_id));
            Ok(1)
        }
        async fn write(&mut self, _w: &ValidWrite) -> StoreResult<()> {
            Ok(())
        }
        async fn dedup_claim(&mut self, queue: &str, key: &str, _id: &str, _window: Duration) -> StoreResult<Option<String>> {
            self.asked.push(format!("dedup {queue} {key}"));
            Ok(None)
        }
        async fn message_insert(&mut self, _id: &str, _p: &SendParams) -> StoreResult<()> {
            Ok(())
        }
        async fn dedup_hold(&mut self, queue: &str, key: &str, _window: Duration) -> StoreResult<()> {
            self.asked.push(format!("dedup {queue} {key}"));
            Ok(())
        }
    }

    /// `apply` reads exactly what `needs` says, for every kind of pending:
    /// Spanner's read-ahead reads `needs` before deciding, so a read added
    /// to `apply` without it would be answered wrong there.
    #[tokio::test]
    async fn needs_cover_every_read_of_apply() {
        let table = TableSchema {
            name: "t".into(),
            columns: vec![crate::schema::ColumnSchema {
                name: "id".into(),
                ty: crate::schema::ColumnType::String,
                nullable: false,
                has_default: false,
            }],
            primary_key: vec![0],
        };
        let mut full = pending("m-1");
        full.read(&table, &[Value::String("a".into())], None, vec![]);
        full.read(&table, &[], Some(10), vec![]);
        full.send(SendParams {
            queue: "next".into(),
            dedup_key: Some("k-1".into()),
            ..SendParams::default()
        });
        full.send(SendParams {
            queue: "next".into(),
            ..SendParams::default()
        });
        full.hold("onceq.outbox.hook", "k-2", Duration::from_secs(1));
        for p in [Pending::default(), pending("m-2"), full] {
            let mut ex = Recording::default();
            apply(&mut ex, &p, Duration::from_secs(60)).await.unwrap();
            let needs = p.needs();
            let mut needed: Vec<String> = needs
                .reads
                .iter()
                .map(|r| format!("read {} {:?} {:?}", r.table.name, r.key, r.limit))
                .chain(needs.ack.map(|l| format!("lease {}", l.message_id)))
                .chain(needs.dedup_keys.iter().map(|(q, k)| format!("dedup {q} {k}")))
                .collect();
            let mut asked = ex.asked;
            needed.sort();
            asked.sort();
            assert_eq!(asked, needed, "apply read what needs() does not name, or the other way");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_commits_are_grouped_and_each_gets_its_own_result() {
        let rec = Recorder::new();
        let options = CommitOptions {
            max_batch: 16,
            max_wait: Duration::from_millis(20),
            ..CommitOptions::default()
        };
        let group = Arc::new(Group::new(options, rec.clone()));
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..40 {
            let g = group.clone();
            let id = if i % 10 == 3 { format!("lost-{i}") } else { format!("m-{i}") };
            tasks.spawn(async move { (id.clone(), g.commit(pending(&id)).await) });
        }
        let mut ok = 0;
        while let Some(r) = tasks.join_next().await {
            let (id, res) = r.unwrap();
            match res {
                Ok(()) => ok += 1,
                Err(StoreError::LeaseLost { message_id }) => assert_eq!(message_id, id),
                Err(e) => panic!("{id}: {e}"),
            }
        }
        assert_eq!(ok, 36, "each message its own outcome");
        let sizes = rec.sizes.lock().unwrap().clone();
        assert_eq!(sizes.iter().sum::<usize>(), 40, "every pending committed once: {sizes:?}");
        assert!(sizes.iter().all(|&n| n <= 16), "max_batch holds: {sizes:?}");
        assert!(sizes.len() < 40, "grouped: {sizes:?}");
        assert_eq!(group.messages.load(Ordering::Relaxed), 40);
    }

    /// Heavy messages (1,500 follow-ups each: 18,002 mutations) fill a
    /// batch by weight long before `max_batch`: two to a batch at most,
    /// each message committed once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_holds_at_most_max_batch_mutations() {
        let rec = Recorder::new();
        let options = CommitOptions {
            max_batch: 64,
            max_wait: Duration::from_millis(50),
            ..CommitOptions::default()
        };
        let heavy = |id: &str| Pending {
            sends: vec![SendParams::default(); 1_500],
            ..pending(id)
        };
        assert_eq!(heavy("x").mutations(), 18_002);
        let group = Arc::new(Group::new(options, rec.clone()));
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..8 {
            let (g, p) = (group.clone(), heavy(&format!("m-{i}")));
            tasks.spawn(async move { g.commit(p).await });
        }
        while let Some(r) = tasks.join_next().await {
            r.unwrap().unwrap();
        }
        let sizes = rec.sizes.lock().unwrap().clone();
        assert_eq!(sizes.iter().sum::<usize>(), 8, "every pending committed once: {sizes:?}");
        assert!(
            sizes.iter().all(|&n| n <= 2),
            "at most {MAX_BATCH_MUTATIONS} mutations a batch: {sizes:?}"
        );
        // A message heavier than the bound still commits, alone.
        let huge = Pending {
            sends: vec![SendParams::default(); 5_000],
            ..pending("huge")
        };
        group.commit(huge).await.unwrap();
        assert_eq!(rec.sizes.lock().unwrap().last(), Some(&1));
    }

    /// The worst `max_effects` allows by bytes (1,000 follow-ups of 1 KiB:
    /// 1.25 MB a message) fills a batch by bytes: 64 of them would be 80
    /// MB, near Spanner's 100 MB a commit; a batch stops at 32 MiB.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_holds_at_most_max_batch_bytes() {
        let rec = Recorder::new();
        let options = CommitOptions {
            max_batch: 64,
            max_wait: Duration::from_millis(50),
            ..CommitOptions::default()
        };
        let big = |id: &str| Pending {
            sends: vec![
                SendParams {
                    queue: "q".into(),
                    payload: vec![b'x'; 1024],
                    ..SendParams::default()
                };
                1_000
            ],
            ..pending(id)
        };
        let (m, b) = (big("x").mutations(), big("x").bytes());
        assert!(m < MAX_BATCH_MUTATIONS / 3 && b > 1_000_000, "{m} mutations, {b} bytes");
        let group = Arc::new(Group::new(options, rec.clone()));
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..64 {
            let (g, p) = (group.clone(), big(&format!("m-{i}")));
            tasks.spawn(async move { g.commit(p).await });
        }
        while let Some(r) = tasks.join_next().await {
            r.unwrap().unwrap();
        }
        let sizes = rec.sizes.lock().unwrap().clone();
        assert_eq!(sizes.iter().sum::<usize>(), 64, "every pending committed once: {sizes:?}");
        let most = MAX_BATCH_BYTES / b;
        assert!(sizes.iter().all(|&n| n <= most), "at most {most} a batch by bytes: {sizes:?}");
    }

    /// Payments: about 26 mutations and well under a kilobyte a message,
    /// so 64 of them are one batch by either bound.
    #[test]
    fn a_payments_message_is_light_by_both_bounds() {
        let p = Pending {
            writes: vec![
                ValidWrite {
                    table: "accounts".into(),
                    op: crate::value::WriteOp::Update,
                    values: vec![Some(Value::String("acct-17".into())), Some(Value::Int64(950))],
                },
                ValidWrite {
                    table: "orders".into(),
                    op: crate::value::WriteOp::Insert,
                    values: vec![
                        Some(Value::String("order-1".into())),
                        Some(Value::String("acct-17".into())),
                        Some(Value::Int64(50)),
                    ],
                },
            ],
            sends: vec![SendParams {
                queue: "onceq_outbox_webhook".into(),
                payload: br#"{"order":"order-1","amount":50}"#.to_vec(),
                dedup_key: Some("charge-order-1".into()),
                ..SendParams::default()
            }],
            ..pending("m")
        };
        assert!(64 * p.mutations() <= MAX_BATCH_MUTATIONS, "{}", p.mutations());
        assert!(64 * p.bytes() <= MAX_BATCH_BYTES, "{}", p.bytes());
    }

    #[tokio::test]
    async fn max_batch_one_commits_each_message_alone() {
        let rec = Recorder::new();
        let options = CommitOptions {
            max_batch: 1,
            max_wait: Duration::ZERO,
            ..CommitOptions::default()
        };
        let group = Group::new(options, rec.clone());
        let (a, b) = tokio::join!(group.commit(pending("a")), group.commit(pending("b")));
        assert!(a.is_ok() && b.is_ok());
        assert_eq!(*rec.sizes.lock().unwrap(), vec![1, 1]);
    }

    /// `stop` lets the committer commit what was queued, then end; a
    /// commit asked for after it is refused without being written.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stop_commits_what_is_queued_then_refuses() {
        let rec = Recorder::new();
        let group = Arc::new(Group::new(CommitOptions::default(), rec.clone()));
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..20 {
            let g = group.clone();
            tasks.spawn(async move { g.commit(pending(&format!("m-{i}"))).await });
        }
        // Let the commits queue, then stop.
        while group.messages.load(Ordering::Relaxed) == 0 {
            tokio::task::yield_now().await;
        }
        group.stop().await;
        while let Some(r) = tasks.join_next().await {
            assert!(r.unwrap().is_ok(), "a commit queued before the stop is committed");
        }
        assert_eq!(rec.sizes.lock().unwrap().iter().sum::<usize>(), 20);
        let late = group.commit(pending("late")).await;
        assert!(matches!(late, Err(StoreError::Unavailable(_))), "{late:?}");
        assert_eq!(
            rec.sizes.lock().unwrap().iter().sum::<usize>(),
            20,
            "nothing committed after the stop"
        );
    }

    /// A full backlog makes callers wait, not grow it: with a committer
    /// slower than its callers, at most the bound is queued at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_backlog_is_bounded() {
        struct Slow(Arc<std::sync::atomic::AtomicUsize>);
        #[async_trait]
        impl BatchCommit for Slow {
            async fn commit_batch(&self, batch: Vec<Pending>) -> Vec<StoreResult<()>> {
                self.0.fetch_add(batch.len(), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
                batch.iter().map(|_| Ok(())).collect()
            }
            async fn commit_collected(&self, collect: &(dyn Fn() -> Vec<Pending> + Send + Sync)) -> Vec<StoreResult<()>> {
                self.commit_batch(collect()).await
            }
            fn blocks(&self) -> bool {
                false
            }
            async fn rehearse(&self, _p: Pending) -> Option<StoreResult<()>> {
                None
            }
        }
        let committed = Arc::new(AtomicUsize::new(0));
        let options = CommitOptions {
            max_batch: 2,
            max_wait: Duration::ZERO,
            ..CommitOptions::default()
        };
        let group = Arc::new(Group::new(options, Arc::new(Slow(committed.clone()))));
        let sent = Arc::new(AtomicUsize::new(0));
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..200 {
            let (g, s) = (group.clone(), sent.clone());
            tasks.spawn(async move {
                let (tx, _rx) = oneshot::channel();
                g.send(Job::Commit(pending(&format!("m-{i}")), tx)).await.unwrap();
                s.fetch_add(1, Ordering::Relaxed);
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let queued = sent.load(Ordering::Relaxed).saturating_sub(committed.load(Ordering::Relaxed));
        // The queue holds at most max(2 x 4, 16) jobs, one batch is being
        // committed, and a few senders may be between their send and count.
        assert!(queued <= 16 + 2 + 4, "{queued} jobs queued beyond the committer");
        tasks.abort_all();
    }
}
