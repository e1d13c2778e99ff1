//! The exactly-once protocol, per message. No Wasm in here: it drives any
//! [`Handler`] against any [`Store`].
//!
//! 1. **Lease** a batch (`Store::message_lease`): database time, new token,
//!    attempt + 1.
//! 2. **Handle** inside a message transaction: the handler reads through a
//!    [`ReadScope`] served by the transaction.
//! 3. **Apply + ack**: check the effects against grants, schema and limits;
//!    buffer the writes, outbox intents and follow-ups; buffer the ack
//!    (delete the message, guarded by its lease token, asserting one row).
//! 4. **Commit**:
//!    - success: acked;
//!    - aborted / unavailable: re-run from step 2 (bounded, with backoff);
//!    - unknown outcome: re-run from step 2. If the first commit landed, the
//!      ack now fails with `LeaseLost`, the store rolls everything back, and
//!      the message is counted as *already committed*: its effects were
//!      applied exactly once, by the first commit;
//!    - lease lost: rolled back, nothing written; the new holder processes it.
//! 5. **Handler failures**: *retry* → roll back, then (guarded by the token)
//!    make the message visible after a backoff; *reject* → dead-letter now;
//!    a trap, deadline, memory-limit hit or bad effect → retry with backoff
//!    until `max_attempts`, then dead-letter, with the reason, in one
//!    transaction.
//!
//! An error is never caught to commit "the rest": every path that does not
//! reach a successful commit with its ack leaves the database as it was.
//!
//! **Long-running work.** While a worker holds a batch, it renews the
//! leases of the messages not yet finished every third of the lease
//! (`Store::message_lease_renew`: guarded by the token, one row), so a
//! handler or a delivery slower than the lease is not handed to another
//! worker. If a renewal finds the lease gone, or no renewal succeeds before
//! the lease runs out, the message's work is cancelled (dropped: its
//! transaction rolls back) unless its commit is already under way, in which
//! case the commit's own guarded ack decides. Fast handlers never renew.

pub mod effects;
pub mod handler;
pub mod retry;

pub use effects::{EffectLimits, Grants};
pub use handler::{HandleOutput, Handler, HandlerFailure, NativeHandler, ReadScope};
pub use retry::{jittered, Next, Rerun};

use crate::store::{DeadLetterParams, LeaseParams, LeasedMessage, Store, StoreError};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tracing::{debug, info, info_span, warn, Instrument};

/// How a queue is worked.
#[derive(Debug, Clone)]
pub struct Policy {
    /// Lease duration for each message.
    pub lease: Duration,
    /// After this many attempts a failing message is dead-lettered.
    pub max_attempts: u32,
    /// First retry delay; doubles per attempt.
    pub backoff_initial: Duration,
    /// Retry delay cap.
    pub backoff_max: Duration,
    /// Concurrent workers (tokio tasks) on this queue.
    pub workers: usize,
    /// Messages leased per round trip.
    pub batch: usize,
    /// How many times one attempt's transaction is re-run after aborts or
    /// unknown outcomes before the attempt counts as failed.
    pub max_reruns: u32,
    /// Longest pause between polls of an empty queue.
    pub poll_max: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            lease: Duration::from_secs(10),
            max_attempts: 5,
            backoff_initial: Duration::from_secs(1),
            backoff_max: Duration::from_secs(300),
            workers: 4,
            batch: 8,
            max_reruns: 20,
            poll_max: Duration::from_millis(200),
        }
    }
}

/// Everything the protocol needs to work one queue.
pub struct QueueSpec {
    pub name: String,
    /// The first handler; [`QueueRunner::swap_handler`] replaces it.
    pub handler: Arc<dyn Handler>,
    pub grants: Grants,
    pub limits: EffectLimits,
    pub policy: Policy,
}

/// Counters for one queue (also what `make run` summarizes).
#[derive(Debug, Default)]
pub struct Metrics {
    /// Committed with their ack.
    pub processed: AtomicU64,
    /// Found already committed after an unknown outcome.
    pub already_committed: AtomicU64,
    /// Attempts that ended in a retry (handler asked, or failed).
    pub retried: AtomicU64,
    pub dead_lettered: AtomicU64,
    /// Transactions re-run after an abort.
    pub aborted_reruns: AtomicU64,
    /// Commits with an unknown outcome (each re-run).
    pub unknown_outcomes: AtomicU64,
    /// Lost leases (another worker holds the message now).
    pub lease_lost: AtomicU64,
    /// Released unprocessed at shutdown.
    pub released: AtomicU64,
    /// Leases extended while their message waited or was being handled.
    pub lease_renewals: AtomicU64,
    /// Work cancelled because its lease was lost (or could not be renewed).
    pub cancelled: AtomicU64,
    /// Messages being processed right now.
    pub in_flight: AtomicI64,
    /// Final outcomes per handler version.
    pub by_version: Mutex<BTreeMap<String, VersionCounts>>,
    pub writes: AtomicU64,
    pub intents: AtomicU64,
    pub enqueued: AtomicU64,
    /// Lease-to-outcome latency, microseconds.
    pub latency_us: Mutex<Option<hdrhistogram::Histogram<u64>>>,
    /// Time inside the handler call (instantiation, reads, the call),
    /// microseconds, per attempt.
    pub handler_us: Mutex<Option<hdrhistogram::Histogram<u64>>>,
}

type Hist = Mutex<Option<hdrhistogram::Histogram<u64>>>;

fn hist_record(h: &Hist, d: Duration) {
    if let Ok(mut h) = h.lock() {
        if h.is_none() {
            *h = hdrhistogram::Histogram::new(3).ok();
        }
        if let Some(h) = h.as_mut() {
            let _ = h.record(d.as_micros().max(1) as u64);
        }
    }
}

/// (sum in seconds, count, per-bucket counts for `bounds` in seconds, then
/// the rest under `f64::MAX`), as Prometheus histograms want them.
fn hist_buckets(h: &Hist, bounds: &[f64]) -> (f64, u64, Vec<(f64, u64)>) {
    let guard = h.lock();
    let Some(h) = guard.as_ref().ok().and_then(|g| g.as_ref()) else {
        return (
            0.0,
            0,
            bounds.iter().map(|b| (*b, 0)).chain(std::iter::once((f64::MAX, 0))).collect(),
        );
    };
    let count = h.len();
    let sum = h.mean() * count as f64 / 1e6;
    let mut out = Vec::with_capacity(bounds.len() + 1);
    let mut below = 0;
    for b in bounds {
        let upto = h.count_between(0, (b * 1e6) as u64);
        out.push((*b, upto.saturating_sub(below)));
        below = upto.max(below);
    }
    out.push((f64::MAX, count.saturating_sub(below)));
    (sum, count, out)
}

/// Final outcomes of the messages one handler version processed.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct VersionCounts {
    pub processed: u64,
    pub already_committed: u64,
    pub retried: u64,
    pub dead_lettered: u64,
}

impl Metrics {
    fn record_version(&self, version: &str, f: impl FnOnce(&mut VersionCounts)) {
        if let Ok(mut m) = self.by_version.lock() {
            match m.get_mut(version) {
                Some(c) => f(c),
                None => f(m.entry(version.to_string()).or_default()),
            }
        }
    }

    /// Outcomes per version so far.
    pub fn versions(&self) -> BTreeMap<String, VersionCounts> {
        self.by_version.lock().map(|m| m.clone()).unwrap_or_default()
    }

    fn record_latency(&self, d: Duration) {
        hist_record(&self.latency_us, d)
    }

    /// Lease-to-outcome latency as histogram buckets (see [`hist_buckets`]).
    pub fn latency_buckets(&self, bounds: &[f64]) -> (f64, u64, Vec<(f64, u64)>) {
        hist_buckets(&self.latency_us, bounds)
    }

    /// Handler-call time as histogram buckets.
    pub fn handler_buckets(&self, bounds: &[f64]) -> (f64, u64, Vec<(f64, u64)>) {
        hist_buckets(&self.handler_us, bounds)
    }

    /// Latency quantile in microseconds (0 when nothing was recorded).
    pub fn latency_quantile(&self, q: f64) -> u64 {
        self.latency_us
            .lock()
            .ok()
            .and_then(|h| h.as_ref().map(|h| h.value_at_quantile(q)))
            .unwrap_or(0)
    }

    /// Messages acked exactly once (by this worker's commit, or by an
    /// earlier commit found after an unknown outcome).
    pub fn acked(&self) -> u64 {
        self.processed.load(Ordering::Relaxed) + self.already_committed.load(Ordering::Relaxed)
    }

    /// Messages that reached a final outcome (acked once or dead-lettered).
    pub fn finished(&self) -> u64 {
        self.acked() + self.dead_lettered.load(Ordering::Relaxed)
    }
}

/// The final outcome of one leased message.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Acked,
    /// An earlier commit with unknown outcome had landed.
    AlreadyCommitted,
    RetryLater(String),
    DeadLettered(String),
    LeaseLost,
    Released,
}

/// Works one queue: leases, runs the handler, commits.
pub struct QueueRunner {
    pub spec: QueueSpec,
    /// The handler new leases use (swapped atomically by a deploy; a message
    /// keeps the handler it started with through all its re-runs).
    handler: std::sync::RwLock<Arc<dyn Handler>>,
    store: Arc<dyn Store>,
    tables: Arc<BTreeSet<String>>,
    pub metrics: Arc<Metrics>,
    /// Signalled when a worker finds the queue empty, so `--until-empty`
    /// checks at once instead of waiting for its next poll.
    idle: Arc<tokio::sync::Notify>,
}

enum AttemptError {
    Store(StoreError),
    Handler(HandlerFailure),
}

impl QueueRunner {
    pub fn new(spec: QueueSpec, store: Arc<dyn Store>) -> QueueRunner {
        let tables = Arc::new(spec.grants.tables.clone());
        QueueRunner {
            handler: std::sync::RwLock::new(spec.handler.clone()),
            spec,
            store,
            tables,
            metrics: Arc::new(Metrics::default()),
            idle: Arc::new(tokio::sync::Notify::new()),
        }
    }

    /// The handler messages leased from now on are given to.
    pub fn handler(&self) -> Arc<dyn Handler> {
        match self.handler.read() {
            Ok(h) => h.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Switch to `new` atomically: messages that start from now on run on
    /// it; messages in flight finish on the handler they started with.
    /// Returns the handler it replaced.
    pub fn swap_handler(&self, new: Arc<dyn Handler>) -> Arc<dyn Handler> {
        let mut guard = match self.handler.write() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        std::mem::replace(&mut *guard, new)
    }

    /// Run `workers` tasks until `shutdown` turns true; in-flight messages
    /// finish, leased-but-unstarted ones are released.
    pub async fn run(self: Arc<Self>, shutdown: watch::Receiver<bool>) {
        let mut tasks = tokio::task::JoinSet::new();
        for w in 0..self.spec.policy.workers.max(1) {
            let me = self.clone();
            let sd = shutdown.clone();
            tasks.spawn(async move { me.worker(w, sd).await });
        }
        while let Some(r) = tasks.join_next().await {
            if let Err(e) = r {
                warn!(queue = %self.spec.name, "worker task ended abnormally: {e}");
            }
        }
    }

    async fn worker(&self, n: usize, mut shutdown: watch::Receiver<bool>) {
        let p = &self.spec.policy;
        let mut idle = Duration::from_millis(2);
        debug!(queue = %self.spec.name, worker = n, "worker started");
        loop {
            if *shutdown.borrow() {
                break;
            }
            let leased_at = Instant::now();
            let leased = self
                .store
                .message_lease(LeaseParams {
                    queue: self.spec.name.clone(),
                    limit: p.batch.max(1),
                    lease: p.lease,
                })
                .await;
            let batch = match leased {
                Ok(b) => b,
                Err(e) => {
                    warn!(queue = %self.spec.name, "lease failed: {e}");
                    sleep_or_shutdown(&mut shutdown, jittered(p.poll_max)).await;
                    continue;
                }
            };
            if batch.is_empty() {
                self.idle.notify_one();
                sleep_or_shutdown(&mut shutdown, jittered(idle)).await;
                idle = (idle * 2).min(p.poll_max);
                continue;
            }
            idle = Duration::from_millis(2);
            self.process_batch(&batch, leased_at, &shutdown).await;
        }
        debug!(queue = %self.spec.name, worker = n, "worker stopped");
    }

    /// Process a leased batch in order, renewing the leases of the messages
    /// not yet finished in the background; at shutdown, release the rest.
    async fn process_batch(&self, batch: &[LeasedMessage], leased_at: Instant, shutdown: &watch::Receiver<bool>) {
        let lost: Vec<AtomicBool> = batch.iter().map(|_| AtomicBool::new(false)).collect();
        let mut renewed_at = leased_at;
        for (i, lm) in batch.iter().enumerate() {
            if *shutdown.borrow() {
                for lm in &batch[i..] {
                    self.release(lm).await;
                }
                return;
            }
            if lost[i].load(Ordering::Relaxed) {
                self.metrics.lease_lost.fetch_add(1, Ordering::Relaxed);
                warn!(queue = %self.spec.name, message_id = %lm.message.id, "lease lost while the message waited in its batch; skipped");
                continue;
            }
            let committing = AtomicBool::new(false);
            tokio::select! {
                biased;
                _ = self.process_tracked(lm, &committing) => {}
                () = self.renew_leases(&batch[i..], &lost[i..], &mut renewed_at, &committing) => {
                    self.metrics.lease_lost.fetch_add(1, Ordering::Relaxed);
                    self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                    warn!(
                        queue = %self.spec.name,
                        message_id = %lm.message.id,
                        "lease lost while the handler ran: work cancelled, nothing committed; the new lease holder will process it"
                    );
                }
            }
        }
    }

    /// Renew the leases of `rest` (the current message first) every third
    /// of the lease. Returns (to cancel the current message's work) once its
    /// lease is lost or could not be renewed in time, unless its commit is
    /// under way; otherwise runs until dropped.
    async fn renew_leases(&self, rest: &[LeasedMessage], lost: &[AtomicBool], renewed_at: &mut Instant, committing: &AtomicBool) {
        let lease = self.spec.policy.lease;
        let mut next = *renewed_at + lease / 3;
        loop {
            tokio::time::sleep_until(next.into()).await;
            let round = Instant::now();
            let mut all_ok = true;
            for (j, lm) in rest.iter().enumerate() {
                if lost[j].load(Ordering::Relaxed) || (j == 0 && committing.load(Ordering::Acquire)) {
                    continue;
                }
                match self.store.message_lease_renew(&lm.lease, lease).await {
                    Ok(()) => {
                        self.metrics.lease_renewals.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(StoreError::LeaseLost { .. }) => lost[j].store(true, Ordering::Relaxed),
                    Err(e) => {
                        all_ok = false;
                        warn!(queue = %self.spec.name, message_id = %lm.message.id, "lease renewal failed (will retry): {e}");
                    }
                }
            }
            if all_ok {
                *renewed_at = round;
                next = round + lease / 3;
            } else if Instant::now() + lease / 10 >= *renewed_at + lease {
                // No renewal in time: another worker may hold these now.
                for l in lost {
                    l.store(true, Ordering::Relaxed);
                }
                next = Instant::now() + lease / 3;
            } else {
                next = Instant::now() + lease / 12;
            }
            if lost[0].load(Ordering::Relaxed) && !committing.load(Ordering::Acquire) {
                return;
            }
        }
    }

    async fn release(&self, lm: &LeasedMessage) {
        match self.store.message_release(&lm.lease).await {
            Ok(()) => {
                self.metrics.released.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => warn!(queue = %self.spec.name, message_id = %lm.message.id, "release failed (the lease will expire): {e}"),
        }
    }

    /// Process one leased message to its final outcome.
    pub async fn process(&self, lm: &LeasedMessage) -> Outcome {
        self.process_tracked(lm, &AtomicBool::new(false)).await
    }

    /// [`Self::process`], setting `committing` while a commit is in flight.
    async fn process_tracked(&self, lm: &LeasedMessage, committing: &AtomicBool) -> Outcome {
        let handler = self.handler();
        let version = handler.version().to_string();
        let span = info_span!(
            "message",
            messaging.system = "onceq",
            otel.kind = "consumer",
            queue = %lm.message.queue,
            message_id = %lm.message.id,
            attempt = lm.message.attempt,
            version = %version,
            outcome = tracing::field::Empty,
        );
        let started = Instant::now();
        let m = &self.metrics;
        m.in_flight.fetch_add(1, Ordering::Relaxed);
        let outcome = self.process_inner(lm, &*handler, committing).instrument(span.clone()).await;
        m.in_flight.fetch_sub(1, Ordering::Relaxed);
        span.record("outcome", tracing::field::debug(&outcome));
        match &outcome {
            Outcome::Acked => {
                m.processed.fetch_add(1, Ordering::Relaxed);
                m.record_version(&version, |c| c.processed += 1);
                m.record_latency(started.elapsed());
            }
            Outcome::AlreadyCommitted => {
                m.already_committed.fetch_add(1, Ordering::Relaxed);
                m.record_version(&version, |c| c.already_committed += 1);
                m.record_latency(started.elapsed());
            }
            Outcome::RetryLater(_) => {
                m.retried.fetch_add(1, Ordering::Relaxed);
                m.record_version(&version, |c| c.retried += 1);
            }
            Outcome::DeadLettered(reason) => {
                m.dead_lettered.fetch_add(1, Ordering::Relaxed);
                m.record_version(&version, |c| c.dead_lettered += 1);
                info!(parent: &span, "dead-lettered: {reason}");
            }
            Outcome::LeaseLost => {
                m.lease_lost.fetch_add(1, Ordering::Relaxed);
            }
            Outcome::Released => {
                m.released.fetch_add(1, Ordering::Relaxed);
            }
        }
        outcome
    }

    async fn process_inner(&self, lm: &LeasedMessage, handler: &dyn Handler, committing: &AtomicBool) -> Outcome {
        let mut unknown_seen = false;
        let mut reruns = 0u32;
        loop {
            let err = match self.attempt(lm, handler, committing).await {
                Ok(()) => return Outcome::Acked,
                Err(e) => e,
            };
            match err {
                AttemptError::Store(e) if e.is_retryable() || e.is_unknown_outcome() => match self.spec.policy.rerun(&e, reruns) {
                    Rerun::Now => {
                        reruns += 1;
                        unknown_seen = true;
                        self.metrics.unknown_outcomes.fetch_add(1, Ordering::Relaxed);
                        info!("commit outcome unknown, re-running the message: {e}");
                    }
                    Rerun::After(pause) => {
                        reruns += 1;
                        self.metrics.aborted_reruns.fetch_add(1, Ordering::Relaxed);
                        debug!("transaction aborted, re-running: {e}");
                        tokio::time::sleep(pause).await;
                    }
                    Rerun::Stop => {
                        return self
                            .fail(lm, handler, HandlerFailure::Failed(format!("store error: {e}")), unknown_seen)
                            .await;
                    }
                },
                AttemptError::Store(StoreError::LeaseLost { .. }) => {
                    return if unknown_seen {
                        info!("ack refused after an unknown commit outcome: the earlier commit landed");
                        Outcome::AlreadyCommitted
                    } else {
                        warn!("lease lost before commit; rolled back, the new lease holder will process the message");
                        Outcome::LeaseLost
                    };
                }
                AttemptError::Store(StoreError::WriteRefused(m)) => {
                    return self
                        .fail(lm, handler, HandlerFailure::Failed(format!("write refused: {m}")), unknown_seen)
                        .await;
                }
                AttemptError::Store(e) => {
                    return self
                        .fail(lm, handler, HandlerFailure::Failed(format!("store error: {e}")), unknown_seen)
                        .await;
                }
                AttemptError::Handler(f) => return self.fail(lm, handler, f, unknown_seen).await,
            }
        }
    }

    /// One run of steps 2-4.
    async fn attempt(&self, lm: &LeasedMessage, handler: &dyn Handler, committing: &AtomicBool) -> Result<(), AttemptError> {
        let tx = self.store.transaction_begin().await.map_err(AttemptError::Store)?;
        let schema = self.store.schema();
        let scope = ReadScope::new(tx, schema.clone(), self.tables.clone()).with_limits(&self.spec.limits);
        let called = Instant::now();
        let HandleOutput { scope, result } = handler.handle(&lm.message, scope).await;
        hist_record(&self.metrics.handler_us, called.elapsed());
        let violation = scope.violation.clone();
        let store_error = scope.store_error.clone();
        let mut tx = scope.into_transaction();
        let failure = match store_error {
            Some(e) => Some(AttemptError::Store(e)),
            None => violation.map(|v| AttemptError::Handler(HandlerFailure::Failed(v))),
        };
        let effects = match (failure, result) {
            (Some(f), _) => {
                tx.rollback().await;
                return Err(f);
            }
            (None, Err(f)) => {
                tx.rollback().await;
                return Err(AttemptError::Handler(f));
            }
            (None, Ok(e)) => e,
        };
        let counts = match effects::check_and_buffer(
            &lm.message,
            handler.version(),
            effects,
            &self.spec.grants,
            &self.spec.limits,
            &schema,
            &mut *tx,
        ) {
            Ok(c) => c,
            Err(reason) => {
                tx.rollback().await;
                return Err(AttemptError::Handler(HandlerFailure::Failed(format!("bad effect: {reason}"))));
            }
        };
        tx.message_ack(&lm.lease);
        committing.store(true, Ordering::Release);
        let committed = tx.commit().await;
        committing.store(false, Ordering::Release);
        committed.map_err(AttemptError::Store)?;
        let m = &self.metrics;
        m.writes.fetch_add(counts.writes, Ordering::Relaxed);
        m.intents.fetch_add(counts.intents, Ordering::Relaxed);
        m.enqueued.fetch_add(counts.enqueued, Ordering::Relaxed);
        Ok(())
    }

    /// Step 5: retry later or dead-letter, guarded by the lease token.
    async fn fail(&self, lm: &LeasedMessage, handler: &dyn Handler, failure: HandlerFailure, mut unknown_seen: bool) -> Outcome {
        let attempt = lm.message.attempt;
        let version = Some(handler.version().to_string());
        enum Step {
            Retry(Duration, String),
            Dead(String),
        }
        // A reason is stored and shown: keep it bounded, whatever its source.
        let step = match self.spec.policy.after_failure(&failure, attempt, self.spec.limits.max_delay) {
            Next::RetryAfter(d) => Step::Retry(d, crate::names::reason(&failure.to_string())),
            Next::DeadLetter if matches!(failure, HandlerFailure::Reject(_)) => Step::Dead(crate::names::reason(&failure.to_string())),
            Next::DeadLetter => Step::Dead(crate::names::reason(&format!(
                "{failure} (gave up after {attempt} attempt{})",
                if attempt == 1 { "" } else { "s" }
            ))),
        };
        let mut tries = 0;
        loop {
            let r = match &step {
                Step::Retry(d, reason) => self.store.message_retry_later(&lm.lease, *d, reason).await,
                Step::Dead(reason) => {
                    self.store
                        .message_dead_letter(
                            &lm.lease,
                            DeadLetterParams {
                                reason: reason.clone(),
                                handler_version: version.clone(),
                            },
                        )
                        .await
                }
            };
            match r {
                Ok(()) => {
                    return match step {
                        Step::Retry(d, reason) => {
                            info!("attempt {attempt} failed, next in {d:?}: {reason}");
                            Outcome::RetryLater(reason)
                        }
                        Step::Dead(reason) => Outcome::DeadLettered(reason),
                    }
                }
                Err(StoreError::LeaseLost { .. }) => {
                    return if unknown_seen {
                        Outcome::AlreadyCommitted
                    } else {
                        Outcome::LeaseLost
                    };
                }
                Err(e) if (e.is_retryable() || e.is_unknown_outcome()) && tries < self.spec.policy.max_reruns => {
                    tries += 1;
                    unknown_seen |= e.is_unknown_outcome();
                    tokio::time::sleep(retry::rerun_pause(tries)).await;
                }
                Err(e) => {
                    warn!(
                        "could not record the failure (the lease will expire and the message will be retried): {e}; failure was: {failure}"
                    );
                    return Outcome::LeaseLost;
                }
            }
        }
    }
}

async fn sleep_or_shutdown(shutdown: &mut watch::Receiver<bool>, d: Duration) {
    tokio::select! {
        _ = tokio::time::sleep(d) => {}
        _ = shutdown.changed() => {}
    }
}

/// How far ahead `--until-empty` looks for delayed messages: a retry due
/// within this window is waited for; a message delayed longer is left.
pub const UNTIL_EMPTY_HORIZON: Duration = Duration::from_secs(10);

/// How often `--until-empty` asks the store whether work is left when no
/// worker reports an empty queue (each check is a count per queue: cheap on
/// SQLite, not on a busy Spanner emulator).
pub const UNTIL_EMPTY_POLL: Duration = Duration::from_millis(500);

/// Shortest pause between two of those checks.
pub const UNTIL_EMPTY_MIN_GAP: Duration = Duration::from_millis(50);

/// Run several queues until `shutdown` turns true (the caller sends it, on a
/// signal say). With `until_empty`, also send it once no queue has a ready
/// or leased message, nor a delayed one due within [`UNTIL_EMPTY_HORIZON`].
pub async fn run_queues(store: Arc<dyn Store>, runners: Vec<Arc<QueueRunner>>, shutdown: Arc<watch::Sender<bool>>, until_empty: bool) {
    let rx = shutdown.subscribe();
    let mut tasks = tokio::task::JoinSet::new();
    for r in &runners {
        let r = r.clone();
        let rx = rx.clone();
        tasks.spawn(async move { r.run(rx).await });
    }
    if until_empty {
        let names: BTreeSet<String> = runners.iter().map(|r| r.spec.name.clone()).collect();
        // Any runner going idle wakes the watcher.
        let idle = Arc::new(tokio::sync::Notify::new());
        let mut forwarders = tokio::task::JoinSet::new();
        for r in &runners {
            let (mine, any) = (r.idle.clone(), idle.clone());
            forwarders.spawn(async move {
                loop {
                    mine.notified().await;
                    any.notify_one();
                }
            });
        }
        let mut rx = rx.clone();
        tasks.spawn(async move {
            let _forwarders = forwarders; // stop with the watcher
            while !*rx.borrow() {
                if let Ok(stats) = store.stats().await {
                    let horizon = UNTIL_EMPTY_HORIZON.as_millis() as u64;
                    let busy = stats
                        .queues
                        .iter()
                        .filter(|q| names.contains(&q.queue))
                        .any(|q| q.ready + q.leased > 0 || q.next_due_ms.is_some_and(|ms| ms <= horizon));
                    if !busy {
                        let _ = shutdown.send(true);
                        return;
                    }
                }
                // At most one check per UNTIL_EMPTY_MIN_GAP, however many
                // workers report an empty queue meanwhile.
                sleep_or_shutdown(&mut rx, UNTIL_EMPTY_MIN_GAP).await;
                tokio::select! {
                    _ = idle.notified() => {}
                    _ = sleep_or_shutdown(&mut rx, UNTIL_EMPTY_POLL) => {}
                }
            }
        });
    }
    while tasks.join_next().await.is_some() {}
}
