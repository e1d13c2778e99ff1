//! The exactly-once protocol, per message. No Wasm in here: it drives any
//! [`Handler`] against any [`Store`].
//!
//! 1. **Lease** a batch (`Store::message_lease`): database time, new token,
//!    deliveries + 1. The workers of a queue that ask at the same time share
//!    one lease transaction (`lease.rs`). A lease is not a failure: a
//!    message whose deliveries pass `max_deliveries` without a verdict (it
//!    takes its host down every time) is parked in the dead-letter table,
//!    with a reason that says so.
//! 2. **Handle** inside a message transaction: the handler reads through a
//!    [`ReadScope`] served by the transaction. A worker handles the next
//!    message of its batch while the previous one commits (`worker.rs`).
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
//! 5. **Failures**: *retry* → roll back, then (guarded by the token)
//!    make the message visible after a backoff; *reject* → dead-letter now;
//!    a crash, deadline, memory-limit hit, bad effect or refused write →
//!    failures + 1 and retry with backoff until `max_attempts` failures,
//!    then dead-letter, with the reason, in one transaction. The host's own
//!    trouble (a failing or stalled store, contention that outlasts the
//!    re-runs, exhausted resources) is not the message's failure: it is
//!    deferred, uncounted ([`retry`]). A message pays only for its own
//!    effects: a neighbour in its group-commit batch that fails the whole
//!    batch makes the store commit each message alone.
//!
//! An error is never caught to commit "the rest": every path that does not
//! reach a successful commit with its ack leaves the database as it was.
//!
//! **Long-running work.** While a worker holds a batch, it renews the
//! leases of the messages not yet finished every third of the lease
//! (`Store::message_lease_renew`: each guarded by its token, the whole
//! batch in one transaction), so a
//! handler or a delivery slower than the lease is not handed to another
//! worker. If a renewal finds the lease gone, or no renewal succeeds before
//! the lease runs out, the message's work is cancelled (dropped: its
//! transaction rolls back) unless its commit is already under way, in which
//! case the commit's own guarded ack decides. A re-run cancelled so after
//! an unknown commit outcome asks the store whether that commit landed
//! (the message's row gone) and counts the message already committed if
//! so. Fast handlers never renew.
//!
//! # Files
//!
//! - `worker.rs`: the worker loop (lease a batch, process it, release at
//!   shutdown, back off while the queue is empty);
//! - `lease.rs`: the workers' lease requests, served by one transaction;
//! - `renew.rs`: lease renewal of the messages of a batch;
//! - `attempt.rs`: one message to its outcome (steps 2-5);
//! - `retry.rs`: the re-run and backoff rules ([`Policy::rerun`],
//!   [`Policy::backoff`], [`Policy::after_failure`]);
//! - `effects.rs`: checking and buffering a handler's effects;
//! - `handoff.rs`: follow-ups and intents for a queue of the same host,
//!   inserted leased and handed to its workers in memory (the crash
//!   windows are argued there);
//! - `handler.rs`: the [`Handler`] trait and the [`ReadScope`] reads go
//!   through;
//! - `metrics.rs`: the counters and histograms `/metrics` exports.

mod attempt;
pub mod effects;
pub mod handler;
mod handoff;
mod lease;
pub mod metrics;
mod renew;
pub mod retry;
mod slot;
mod spans;
mod worker;

pub use effects::{EffectError, EffectLimits, Grants};
pub use handler::{HandleOutput, Handler, HandlerFailure, HostTrouble, NativeHandler, ReadError, ReadScope, ScopeError};
pub use metrics::{Metrics, VersionCounts};
pub use retry::{jittered, Next, Rerun};

pub use crate::shutdown::{Shutdown, Stop};
use crate::store::{Store, StoreError};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How a queue is worked.
#[derive(Debug, Clone)]
pub struct Policy {
    /// Lease duration for each message.
    pub lease: Duration,
    /// After this many failures of its own a message is dead-lettered.
    pub max_attempts: u32,
    /// After this many deliveries of any kind (leases that ended in a
    /// crash, an expiry or a kill included) a message is parked in the
    /// dead-letter table.
    pub max_deliveries: u32,
    /// First retry delay; doubles per attempt.
    pub backoff_initial: Duration,
    /// Retry delay cap.
    pub backoff_max: Duration,
    /// Concurrent workers (tokio tasks) on this queue; each worker holds
    /// one live instance at most. The default, 16, by measurement through
    /// the CLI and on the Spanner emulator (docs/src/benchmarks.md); a
    /// config on a SQLite store defaults to 32
    /// ([`crate::config::SQLITE_WORKERS`]).
    pub workers: usize,
    /// Messages leased per round trip.
    pub batch: usize,
    /// How many times one delivery's transaction is re-run after aborts or
    /// unknown outcomes before the message is deferred (`max_reruns`; not
    /// a failure of the message's).
    pub max_reruns: u32,
    /// Longest pause between polls of an empty queue.
    pub poll_max: Duration,
    /// Retry crashes (a trap, a panic, an uncaught exception, `exit`, the
    /// memory limit) like other failures (`retry_crashes`). Off, a crash
    /// dead-letters at once: a re-run gets the same message, logical time
    /// and seed, so it crashes the same way unless what it reads changed.
    pub retry_crashes: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            lease: Duration::from_secs(10),
            max_attempts: 5,
            max_deliveries: 50,
            backoff_initial: Duration::from_secs(1),
            backoff_max: Duration::from_secs(300),
            workers: 16,
            batch: 8,
            max_reruns: 20,
            poll_max: Duration::from_millis(200),
            retry_crashes: false,
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

/// The final outcome of one leased message.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Acked,
    /// An earlier commit with unknown outcome had landed.
    AlreadyCommitted,
    RetryLater(String),
    /// Visible again later, not counted as a failure (the host's trouble).
    Deferred(String),
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
    /// The last lease of any worker found the queue empty: only then does
    /// `--until-empty` ask the store whether work is left.
    drained: AtomicBool,
    /// Messages this queue's workers hold (leased, their outcome not yet
    /// settled): while any are, `--until-empty` knows work is left without
    /// asking the store. The last one settling wakes it ([`idle`](Self::idle)).
    held: AtomicUsize,
    /// Paused (`onceq pause`): workers lease nothing; what they hold
    /// finishes.
    paused: AtomicBool,
    /// Held by the one worker polling an idle queue; holds the backoff
    /// ([`worker`]).
    poll_gate: tokio::sync::Mutex<Duration>,
    /// The workers' lease requests, served together ([`lease`]).
    leases: lease::LeaseGroup,
    /// Where this queue's spans go (off unless [`QueueRunner::set_telemetry`]).
    telemetry: std::sync::OnceLock<crate::telemetry::Telemetry>,
    /// Messages handed to this queue's workers in memory ([`handoff`]).
    inbox: Arc<handoff::Inbox>,
    /// The queues of this host this queue's sends may be handed to (set by
    /// [`run_queues`] on a store that supports it).
    handoffs: std::sync::OnceLock<Arc<handoff::Targets>>,
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
            drained: AtomicBool::new(false),
            held: AtomicUsize::new(0),
            paused: AtomicBool::new(false),
            poll_gate: tokio::sync::Mutex::new(worker::IDLE_BACKOFF_MIN),
            leases: lease::LeaseGroup::default(),
            telemetry: std::sync::OnceLock::new(),
            inbox: Arc::default(),
            handoffs: std::sync::OnceLock::new(),
        }
    }

    /// The last lease found the queue empty, and none of its messages is
    /// held here (by a worker, or handed over and not yet taken).
    fn settled(&self) -> bool {
        self.drained.load(Ordering::Relaxed) && self.held.load(Ordering::Acquire) == 0 && self.inbox.is_empty()
    }

    /// Export this queue's spans through `telemetry` (once: a runner's
    /// first telemetry stays).
    pub fn set_telemetry(&self, telemetry: crate::telemetry::Telemetry) {
        let _ = self.telemetry.set(telemetry);
    }

    fn telemetry(&self) -> &crate::telemetry::Telemetry {
        static OFF: crate::telemetry::Telemetry = crate::telemetry::Telemetry::off();
        self.telemetry.get().unwrap_or(&OFF)
    }

    /// Pause or resume this host's leases of the queue; returns whether
    /// that changed anything.
    pub fn set_paused(&self, paused: bool) -> bool {
        self.paused.swap(paused, Ordering::Relaxed) != paused
    }

    pub fn is_paused(&self) -> bool {
        self.paused.load(Ordering::Relaxed)
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
}

async fn sleep_or_shutdown(shutdown: &mut Shutdown, d: Duration) {
    shutdown.sleep(d).await;
}

/// How far ahead `--until-empty` looks for delayed messages: a retry due
/// within this window is waited for; a message delayed longer is left.
pub const UNTIL_EMPTY_HORIZON: Duration = Duration::from_secs(10);

/// How often, at most, `--until-empty` asks the store whether work is left
/// once every queue came up empty on this host and the answer was "not
/// yet" (another host holds the last messages). Each check is a count per
/// queue: cheap on SQLite, not on a busy Spanner emulator.
pub const UNTIL_EMPTY_POLL: Duration = Duration::from_millis(500);

/// The first pause between two of those checks, doubled up to
/// [`UNTIL_EMPTY_POLL`]: a run's last batches are usually settled within
/// a few of them.
pub const UNTIL_EMPTY_MIN_GAP: Duration = Duration::from_millis(5);

/// How often a host reads which queues are paused: a pause made elsewhere
/// stops its leases within this.
pub const PAUSE_POLL: Duration = Duration::from_secs(2);

/// Set each runner's pause from the store's list, saying what changed.
async fn refresh_paused(store: &dyn Store, runners: &[Arc<QueueRunner>]) {
    let paused = match tokio::time::timeout(PAUSE_POLL * 5, store.queue_paused()).await {
        Ok(Ok(list)) => list,
        Ok(Err(e)) => {
            tracing::debug!("reading the paused queues failed: {e}");
            return;
        }
        Err(_) => {
            tracing::debug!("reading the paused queues took over {:?}", PAUSE_POLL * 5);
            return;
        }
    };
    for r in runners {
        let by = paused.iter().find(|p| p.queue == r.spec.name);
        if r.set_paused(by.is_some()) {
            match by {
                Some(p) => tracing::warn!(queue = %r.spec.name, by = %p.by, "queue paused: nothing is leased from it until `onceq resume`"),
                None => tracing::info!(queue = %r.spec.name, "queue resumed"),
            }
        }
    }
}

/// Run several queues until `stop` is requested (by the caller, on a
/// signal say). With `until_empty`, also request it once no queue has a
/// ready or leased message, nor a delayed one due within
/// [`UNTIL_EMPTY_HORIZON`].
pub fn run_queues(store: Arc<dyn Store>, runners: Vec<Arc<QueueRunner>>, stop: Stop, until_empty: bool) -> crate::BoxFuture<'static, ()> {
    Box::pin(async move {
        let rx = stop.subscribe();
        let mut tasks = tokio::task::JoinSet::new();
        if store.handoff() {
            let targets = handoff::Targets::of(&runners);
            for r in &runners {
                let _ = r.handoffs.set(targets.clone());
            }
        }
        // Paused queues (`onceq pause`, by any host or tool) are read
        // before the first lease, then every PAUSE_POLL.
        refresh_paused(store.as_ref(), &runners).await;
        {
            let (store, runners, mut rx) = (store.clone(), runners.clone(), rx.clone());
            tasks.spawn(async move {
                while !rx.is_requested() {
                    tokio::select! {
                        () = tokio::time::sleep(PAUSE_POLL) => refresh_paused(store.as_ref(), &runners).await,
                        () = rx.requested() => break,
                    }
                }
            });
        }
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
            let runners = runners.clone();
            tasks.spawn(async move {
                let _forwarders = forwarders; // stop with the watcher
                let mut gap = UNTIL_EMPTY_MIN_GAP;
                while !rx.is_requested() {
                    // The store is asked only once every queue came up empty
                    // here and this host holds none of their messages: the
                    // counts read the whole queue table (`Store::backlog`),
                    // which a busy Spanner emulator feels (checks on every idle moment of
                    // the outbox took much of its CPU; checks while the
                    // last messages of a 300-message run were re-run and
                    // committed took 4 queries each at its one transaction
                    // and delayed those commits). The last held message
                    // settling wakes this at once.
                    // A paused queue is done here: nothing of it is leased
                    // until it is resumed, and waiting for it never ends.
                    let asked = runners.iter().all(|r| r.is_paused() || r.settled());
                    if !asked {
                        gap = UNTIL_EMPTY_MIN_GAP;
                    } else if let Ok(stats) = store.backlog().await {
                        let horizon = UNTIL_EMPTY_HORIZON.as_millis() as u64;
                        let paused = |queue: &str| runners.iter().any(|r| r.spec.name == queue && r.is_paused());
                        let busy = stats
                            .queues
                            .iter()
                            .filter(|q| names.contains(&q.queue) && !paused(&q.queue))
                            .any(|q| q.ready + q.leased > 0 || q.next_due_ms.is_some_and(|ms| ms <= horizon));
                        if !busy {
                            for q in stats.queues.iter().filter(|q| paused(&q.queue) && q.ready + q.delayed > 0) {
                                tracing::warn!(
                                    queue = %crate::names::printable(&q.queue),
                                    "paused: its {} ready and {} delayed messages are left (`onceq resume` to go on)",
                                    q.ready,
                                    q.delayed
                                );
                            }
                            stop.request();
                            return;
                        }
                    }
                    // At most one check per gap, however many workers report an
                    // empty queue meanwhile; the gap grows while other hosts
                    // (or this host's last batches) still hold the last
                    // messages. Without a check there is nothing to space
                    // out: the next idle worker is waited for at once (a
                    // fixed 50 ms pause here was 40-50 ms of every drained
                    // run's exit, 3% of 20,000 messages through the CLI).
                    if asked {
                        sleep_or_shutdown(&mut rx, gap).await;
                        gap = (gap * 2).min(UNTIL_EMPTY_POLL);
                    }
                    tokio::select! {
                        _ = idle.notified() => {}
                        _ = sleep_or_shutdown(&mut rx, UNTIL_EMPTY_POLL) => {}
                    }
                }
            });
        }
        while tasks.join_next().await.is_some() {}
    })
}

/// Helpers for the protocol's unit tests: a real SQLite file in a temp
/// folder, native handlers, a runner on one queue.
#[cfg(test)]
pub(crate) mod testing {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use crate::store::sqlite::SqliteStore;
    use crate::store::{LeaseParams, LeasedMessage, SendParams, StoreOptions};
    use crate::value::{Effect, RowWrite, Value, WriteOp};

    pub const DDL: &str = "CREATE TABLE t (id TEXT PRIMARY KEY, n INTEGER);";

    /// A fresh database with table `t`, and the folder that holds it.
    pub fn store() -> (tempfile::TempDir, Arc<dyn Store>) {
        let dir = tempfile::tempdir().unwrap();
        let s = SqliteStore::init(&dir.path().join("t.db"), DDL, &StoreOptions::default()).unwrap();
        (dir, Arc::new(s))
    }

    /// A handler that waits `d` (tokio time), then writes row `id = message id`.
    pub fn slow_writer(d: Duration) -> Arc<dyn Handler> {
        Arc::new(NativeHandler::new("slow-writer", move |m, scope| async move {
            tokio::time::sleep(d).await;
            let write = Effect::Write(RowWrite {
                table: "t".into(),
                op: WriteOp::Insert,
                columns: vec![("id".into(), Value::String(m.id.clone())), ("n".into(), Value::Int64(1))],
            });
            HandleOutput {
                scope,
                result: Ok(vec![write]),
            }
        }))
    }

    pub fn runner(store: &Arc<dyn Store>, handler: Arc<dyn Handler>, lease: Duration) -> Arc<QueueRunner> {
        Arc::new(QueueRunner::new(
            QueueSpec {
                name: "q".into(),
                handler,
                grants: Grants {
                    tables: ["t".to_string()].into(),
                    ..Grants::default()
                },
                limits: EffectLimits::default(),
                policy: Policy {
                    lease,
                    workers: 1,
                    batch: 4,
                    ..Policy::default()
                },
            },
            store.clone(),
        ))
    }

    /// Send `n` messages on queue `q`.
    pub async fn send(store: &Arc<dyn Store>, n: usize) {
        let msgs = (0..n)
            .map(|i| SendParams {
                queue: "q".into(),
                payload: format!("{i}").into_bytes(),
                ..SendParams::default()
            })
            .collect();
        store.message_send(msgs).await.unwrap();
    }

    /// Send `n` messages on queue `q` and lease them all.
    pub async fn leased(store: &Arc<dyn Store>, n: usize, lease: Duration) -> Vec<LeasedMessage> {
        send(store, n).await;
        let batch = store
            .message_lease(LeaseParams {
                queue: "q".into(),
                limit: n,
                lease,
            })
            .await
            .unwrap();
        assert_eq!(batch.len(), n);
        batch
    }

    pub async fn rows(store: &Arc<dyn Store>) -> usize {
        store.table_rows("t").await.unwrap().len()
    }
}
