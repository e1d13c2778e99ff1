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
}

impl Pending {
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
    /// Insert a new message with this id.
    async fn message_insert(&mut self, id: &str, p: &SendParams) -> StoreResult<()>;
    /// Keep an existing claim of `key` on `queue` for `window` from now.
    async fn dedup_hold(&mut self, queue: &str, key: &str, window: Duration) -> StoreResult<()>;
}

/// Send one message: claim its dedup key first (the one dedup rule of
/// every store: a live claim drops the send), then insert it.
pub async fn send<E: Executor + ?Sized>(ex: &mut E, p: &SendParams, default_window: Duration) -> StoreResult<SendOutcome> {
    let id = crate::value::message_id();
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
    /// Unknown outcomes injected on whole batches (tests and the demo;
    /// never set by `onceq.toml`): see [`super::faulty::FaultyBatch`].
    pub faults: Option<super::faulty::BatchFaults>,
}

impl Default for CommitOptions {
    fn default() -> Self {
        CommitOptions {
            max_batch: 64,
            max_wait: Duration::ZERO,
            faults: None,
        }
    }
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
pub struct Group {
    options: CommitOptions,
    /// The committer's queue, made (and the committer started) on first use
    /// (on its own thread, or in the caller's tokio runtime); made anew if that committer is gone.
    queue: Mutex<Option<mpsc::UnboundedSender<Job>>>,
    /// Batches committed and messages in them (for `make bench`).
    pub batches: Arc<std::sync::atomic::AtomicU64>,
    pub messages: Arc<std::sync::atomic::AtomicU64>,
    /// What `options.faults` injected.
    pub faults: Arc<super::faulty::BatchFaultCounts>,
}

impl Group {
    pub fn new(options: CommitOptions) -> Group {
        Group {
            options: CommitOptions {
                max_batch: options.max_batch.max(1),
                ..options
            },
            queue: Mutex::new(None),
            batches: Default::default(),
            messages: Default::default(),
            faults: Default::default(),
        }
    }

    pub fn options(&self) -> CommitOptions {
        self.options
    }

    /// Commit `p` with whatever else is being committed now; its own result.
    /// `driver` is used if this call starts the committer: it must not own
    /// the store strongly (the committer would keep it alive).
    pub async fn commit(&self, driver: impl Fn() -> Arc<dyn BatchCommit>, p: Pending) -> StoreResult<()> {
        let (tx, rx) = oneshot::channel();
        self.send(driver, Job::Commit(p, tx))?;
        rx.await.unwrap_or_else(|_| {
            Err(StoreError::UnknownOutcome(
                "the committer stopped during this message's batch".into(),
            ))
        })
    }

    /// Run `work` on the committer, after the batch being committed: for a
    /// store whose committer has a thread of its own (SQLite), the other
    /// writes of the hot path (leases, renewals) then take the write lock
    /// there, with no hand-off between threads. Measured with 16 workers:
    /// a lease run on the runtime held the next batch back by about 270 µs
    /// (the time for the lease's task to be scheduled once the lock was
    /// its), a fifth of the committer's time.
    pub async fn run<T: Send + 'static>(
        &self,
        driver: impl Fn() -> Arc<dyn BatchCommit>,
        work: impl Future<Output = StoreResult<T>> + Send + 'static,
    ) -> StoreResult<T> {
        let (tx, rx) = oneshot::channel();
        self.send(
            driver,
            Job::Run(Box::pin(async move {
                let _ = tx.send(work.await);
            })),
        )?;
        rx.await
            .unwrap_or_else(|_| Err(StoreError::Unavailable("the committer stopped before this write ended".into())))
    }

    /// Wait until the committer is between two batches and keep it there:
    /// for a message that lost to contention again and again (its reads
    /// changed by the batches committed while it ran). Read after this, and
    /// committed through the [`Hold`], it goes first in the next batch, and
    /// nothing can change what it read in between (on this host). Holds
    /// are served one at a time, in order.
    pub async fn hold(&self, driver: impl Fn() -> Arc<dyn BatchCommit>) -> StoreResult<Hold> {
        let (tx, rx) = oneshot::channel();
        self.send(driver, Job::Hold(tx))?;
        rx.await
            .map_err(|_| StoreError::Unavailable("the committer stopped before it could hold".into()))
    }

    /// Queue `job` for the committer, starting one if there is none (or it
    /// is gone).
    fn send(&self, driver: impl Fn() -> Arc<dyn BatchCommit>, job: Job) -> StoreResult<()> {
        let mut job = Some(job);
        for _ in 0..2 {
            let sender = {
                let mut q = self
                    .queue
                    .lock()
                    .map_err(|_| StoreError::Permanent("commit queue poisoned".into()))?;
                match q.as_ref().filter(|s| !s.is_closed()) {
                    Some(s) => s.clone(),
                    None => {
                        let (s, r) = mpsc::unbounded_channel();
                        let driver = match self.options.faults {
                            Some(plan) => super::faulty::FaultyBatch::wrap(driver(), plan, self.faults.clone()),
                            None => driver(),
                        };
                        let runtime = tokio::runtime::Handle::try_current()
                            .map_err(|e| StoreError::Unavailable(format!("no runtime to start the committer on: {e}")))?;
                        // On a single-threaded runtime (tests with a paused
                        // clock) the committer shares its one thread anyway.
                        let own_thread = driver.blocks() && runtime.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread;
                        let run = committer(r, driver, self.options, self.batches.clone(), self.messages.clone());
                        if own_thread {
                            on_own_thread(run)?;
                        } else {
                            runtime.spawn(run);
                        }
                        *q = Some(s.clone());
                        s
                    }
                }
            };
            match sender.send(job.take().ok_or_else(|| StoreError::Permanent("job sent twice".into()))?) {
                Ok(()) => return Ok(()),
                Err(mpsc::error::SendError(j)) => job = Some(j), // the committer is gone: start another
            }
        }
        Err(StoreError::Unavailable("the committer could not be started".into()))
    }
}

/// Run a committer whose commits block on a thread of its own, on a
/// single-threaded runtime there; it ends with the committer (when every
/// sender is gone). Measured with SQLite (16 workers, 10,000 payments
/// messages): each batch on tokio's blocking pool instead waited for a
/// pool thread, then for a runtime thread free of handlers to take its
/// results, and the committer, the serial part, spent a third of its time
/// outside its commits.
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
    mut rx: mpsc::UnboundedReceiver<Job>,
    driver: Arc<dyn BatchCommit>,
    options: CommitOptions,
    batches: Arc<std::sync::atomic::AtomicU64>,
    messages: Arc<std::sync::atomic::AtomicU64>,
) {
    // Work and holds met while collecting a batch, for after it, in order.
    let mut carried: std::collections::VecDeque<Job> = std::collections::VecDeque::new();
    loop {
        let job = match carried.pop_front() {
            Some(job) => job,
            None => match rx.recv().await {
                Some(job) => job,
                None => break,
            },
        };
        let first = match job {
            Job::Commit(p, tx) => (p, tx),
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
        let collect = || {
            let mut q = queue.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            let (first, rx, senders, later) = &mut *q;
            let mut batch = Vec::new();
            let mut next = first.take();
            while let Some((p, tx)) = next {
                batch.push(p);
                senders.push(tx);
                next = None;
                while senders.len() < options.max_batch {
                    match rx.try_recv() {
                        Ok(Job::Commit(p, tx)) => {
                            next = Some((p, tx));
                            break;
                        }
                        Ok(other) => later.push_back(other),
                        Err(_) => break,
                    }
                }
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
        let mut results = results.into_iter();
        for tx in senders {
            let r = results
                .next()
                .unwrap_or_else(|| Err(StoreError::Permanent("batch commit returned too few results".into())));
            let _ = tx.send(r);
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
            false
        }
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

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_commits_are_grouped_and_each_gets_its_own_result() {
        let group = Arc::new(Group::new(CommitOptions {
            max_batch: 16,
            max_wait: Duration::from_millis(20),
            faults: None,
        }));
        let rec = Arc::new(Recorder {
            sizes: Mutex::new(vec![]),
            calls: AtomicUsize::new(0),
        });
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..40 {
            let (g, r) = (group.clone(), rec.clone());
            let id = if i % 10 == 3 { format!("lost-{i}") } else { format!("m-{i}") };
            tasks.spawn(async move { (id.clone(), g.commit(|| r.clone() as Arc<dyn BatchCommit>, pending(&id)).await) });
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

    #[tokio::test]
    async fn max_batch_one_commits_each_message_alone() {
        let group = Group::new(CommitOptions {
            max_batch: 1,
            max_wait: Duration::ZERO,
            faults: None,
        });
        let rec = Arc::new(Recorder {
            sizes: Mutex::new(vec![]),
            calls: AtomicUsize::new(0),
        });
        let d = || rec.clone() as Arc<dyn BatchCommit>;
        let (a, b) = tokio::join!(group.commit(d, pending("a")), group.commit(d, pending("b")));
        assert!(a.is_ok() && b.is_ok());
        assert_eq!(*rec.sizes.lock().unwrap(), vec![1, 1]);
    }
}
