//! The worker loop: lease a batch, process it in order with the leases of
//! the waiting messages renewed ([`super::renew`]), release what is left at
//! shutdown, back off while the queue is empty. A worker runs one handler
//! at a time and starts its next message once the previous one is
//! committing, so with group commit its handler runs while that commit is
//! in flight ([`IN_FLIGHT`]). Its next lease starts when the last message
//! of the batch is committing ([`QueueRunner::process_batch_then`]): the
//! lease waits for the committer during that commit instead of after it.
//!
//! A worker leases no more messages than it finishes, at its measured pace,
//! in a third of the lease ([`Pace`]), up to the queue's `batch`; workers
//! asking at the same time share one lease transaction ([`super::lease`]). So the
//! messages of a batch are done before their first renewal is due, and
//! messages the worker could not start soon stay on the queue for other
//! workers and hosts instead of waiting, renewed, in its batch (on the
//! Spanner emulator, where a message can take hundreds of milliseconds,
//! renewals of waiting messages otherwise compete with the commits for its
//! one transaction at a time; docs/src/benchmarks.md has the figures).
//!
//! An idle queue is polled by one worker at a time (the runner's poll gate,
//! which holds the backoff): the others wait behind it, and when it finds
//! work the next one polls at once. So an idle host asks the store once per
//! backoff per queue, not once per worker (idle polls are what an idle
//! host costs its store; docs/src/benchmarks.md has the figures).

use super::lease::Leased;
use super::slot::Slot;
use super::{jittered, sleep_or_shutdown, QueueRunner, Shutdown};
use crate::store::LeasedMessage;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tracing::{debug, warn};

/// The first pause of an idle queue's polls, doubled after each empty lease
/// up to the queue's `poll_max`.
pub(super) const IDLE_BACKOFF_MIN: Duration = Duration::from_millis(2);

/// How often a worker of a paused queue looks whether it was resumed.
const PAUSED_NAP: Duration = Duration::from_millis(200);

/// One lease in this many of a worker asks the table before its inbox
/// ([`QueueRunner::lease_next`]): what is only in the table is not starved
/// by a stream of handoffs.
const TABLE_FIRST: u32 = 8;

impl QueueRunner {
    /// Run `workers` tasks until `shutdown` turns true; in-flight messages
    /// finish, leased-but-unstarted ones are released.
    pub fn run(self: Arc<Self>, shutdown: Shutdown) -> crate::BoxFuture<'static, ()> {
        Box::pin(async move {
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
            // Handed over, never taken: back to the table.
            self.release_inbox(true).await;
        })
    }

    /// The next batch, and when its lease began: from the inbox
    /// ([`super::handoff`]) when it holds messages, except every
    /// [`TABLE_FIRST`]th time; from the table otherwise, or when the table
    /// had none. `None` while the queue is paused: asked here, right
    /// before the lease, so a worker that waited for its turn to poll an
    /// idle queue (or finished a batch) looks again after a pause.
    async fn lease_next(&self, limit: usize, turns: &mut u32) -> Option<(Leased, Instant)> {
        if self.is_paused() {
            return None;
        }
        *turns = turns.wrapping_add(1);
        let handed = || {
            self.inbox.take(limit).map(|(batch, at)| {
                (
                    Leased {
                        share: Ok(batch),
                        led: false,
                    },
                    at,
                )
            })
        };
        if !turns.is_multiple_of(TABLE_FIRST) {
            if let Some(l) = handed() {
                return Some(l);
            }
        }
        let at = Instant::now();
        let leased = self
            .leases
            .lease(self.store.as_ref(), &self.spec.name, limit, self.spec.policy.lease)
            .await;
        if matches!(&leased.share, Ok(b) if b.is_empty()) {
            if let Some(l) = handed() {
                return Some(l);
            }
        }
        Some((leased, at))
    }

    pub(super) async fn worker(&self, n: usize, mut shutdown: Shutdown) {
        let p = &self.spec.policy;
        let mut pace = Pace::default();
        let mut found_empty = false;
        let mut turns = 0u32;
        debug!(queue = %self.spec.name, worker = n, "worker started");
        // The next batch, leased while the last messages of this one were
        // committing.
        let mut prefetched: Option<(Leased, Instant)> = None;
        loop {
            let (leased, leased_at, mut gate) = match prefetched.take() {
                // Processed even at shutdown: its messages are released.
                Some((leased, at)) => (leased, at, None),
                None => {
                    if shutdown.is_requested() {
                        break;
                    }
                    if self.is_paused() {
                        self.release_inbox(false).await;
                        sleep_or_shutdown(&mut shutdown, PAUSED_NAP).await;
                        continue;
                    }
                    // After an empty lease, poll again only through the
                    // gate: one worker of the queue at a time, after the
                    // shared backoff.
                    // A message handed over ends the wait.
                    let mut gate = None;
                    if found_empty && self.inbox.is_empty() {
                        let backoff = tokio::select! {
                            g = self.poll_gate.lock() => g,
                            () = shutdown.requested() => break,
                        };
                        if self.inbox.is_empty() {
                            tokio::select! {
                                () = sleep_or_shutdown(&mut shutdown, jittered(*backoff)) => {}
                                () = self.inbox.arrived.notified() => {}
                            }
                        }
                        gate = Some(backoff);
                        if shutdown.is_requested() {
                            break;
                        }
                    }
                    // Paused meanwhile: no lease (the top of the loop naps).
                    let Some((leased, leased_at)) = self.lease_next(pace.limit(p.batch, p.lease), &mut turns).await else {
                        continue;
                    };
                    (leased, leased_at, gate)
                }
            };
            let batch = match leased.share {
                Ok(b) => b,
                Err(e) => {
                    // The worker that ran the lease reports it, once.
                    if leased.led {
                        self.metrics.store_error(&e);
                        warn!(queue = %self.spec.name, class = e.class(), "lease failed: {e}");
                    }
                    sleep_or_shutdown(&mut shutdown, jittered(p.poll_max)).await;
                    continue;
                }
            };
            found_empty = batch.is_empty();
            self.drained.store(found_empty, Ordering::Relaxed);
            if let Some(backoff) = gate.as_mut() {
                **backoff = if found_empty {
                    (**backoff * 2).min(p.poll_max)
                } else {
                    IDLE_BACKOFF_MIN
                };
            }
            drop(gate); // the next idle worker polls (at once if this one found work)
            if found_empty {
                self.idle.notify_one();
                continue;
            }
            let limit = pace.limit(p.batch, p.lease);
            // Paused meanwhile: no next batch.
            let next = self.lease_next(limit, &mut turns);
            let held = Held::new(self, batch.len());
            let (lost, next) = self.process_batch_then(&batch, leased_at, &shutdown, next).await;
            drop(held);
            pace.record(batch.len(), lost, leased_at.elapsed());
            prefetched = next.flatten();
            if lost > 0 {
                // Its leases ran out before its work did (a slow store or
                // handler, a stall): lease less, and not at once.
                if let Some((leased, _)) = prefetched.take() {
                    self.release_all(leased).await;
                }
                sleep_or_shutdown(&mut shutdown, jittered((p.lease / 10).min(Duration::from_secs(1)))).await;
            }
        }
        debug!(queue = %self.spec.name, worker = n, "worker stopped");
    }

    /// [`Self::process_batch_then`] with no next lease (tests).
    #[cfg(test)]
    pub(super) async fn process_batch(&self, batch: &[LeasedMessage], leased_at: Instant, shutdown: &Shutdown) -> usize {
        self.process_batch_then(batch, leased_at, shutdown, std::future::ready(())).await.0
    }

    /// Process a leased batch in order (at once, for a handler that runs
    /// together), renewing the leases of the messages not yet finished in
    /// the background; at shutdown, release the rest.
    ///
    /// A message starts once the one before it is committing (or done), so
    /// its handler runs while that commit is in flight: a worker runs one
    /// handler at a time, and keeps up to [`IN_FLIGHT`] messages going. With
    /// group commit, the messages waiting for one batch's commit then form
    /// the next batch: measured with 16 workers, batches of 8 messages
    /// when a worker waited for each commit, 14 with two messages going,
    /// 23 with four. A handler that [runs together](super::Handler::runs_together)
    /// (the outbox's dispatcher) has up to [`IN_FLIGHT`] messages started
    /// at once instead: through the CLI (20,000 payments messages, intents
    /// to a `file` connector) a worker's four intents had waited for four
    /// `fdatasync`s in turn; started at once, the run took 4-15% less time
    /// (medians of alternated pairs, docs/src/benchmarks.md).
    ///
    /// Returns how many of the batch's messages lost their lease before
    /// their outcome (skipped, or cancelled while their handler ran), and
    /// what `then_lease` gave if it ran.
    ///
    /// `then_lease` (the worker's next lease) starts once the batch's last
    /// message moved on (its commit started): the lease's wait for the
    /// committer overlaps that commit, where the worker used to wait for
    /// the commit, then for the lease. Not started at shutdown, nor if the
    /// batch ended first; once started, it is awaited to its end. The
    /// batch it leases is processed only after this one, with its own
    /// handler turn: a worker still runs one handler at a time.
    pub(super) async fn process_batch_then<T>(
        &self,
        batch: &[LeasedMessage],
        leased_at: Instant,
        shutdown: &Shutdown,
        then_lease: impl Future<Output = T>,
    ) -> (usize, Option<T>) {
        // One handler at a time, each message after the one before it;
        // or, for a handler that mostly waits, the messages kept going
        // all at once ([`super::Handler::runs_together`]).
        let together = self.handler().runs_together();
        let turn = Arc::new(Semaphore::new(if together { IN_FLIGHT } else { 1 }));
        let slots: Vec<Slot> = batch.iter().map(|_| Slot::taking_turns(turn.clone())).collect();
        let work = async {
            let mut running: Vec<Pin<Box<dyn Future<Output = ()> + Send + '_>>> = Vec::new();
            let mut next = 0;
            std::future::poll_fn(|cx| loop {
                while running.len() < IN_FLIGHT && next < batch.len() {
                    let before = next.checked_sub(1).and_then(|j| slots.get(j)).filter(|_| !together);
                    if let (Some(lm), Some(slot)) = (batch.get(next), slots.get(next)) {
                        running.push(Box::pin(self.process_in_batch(lm, slot, before, shutdown)));
                    }
                    next += 1;
                }
                let before = running.len();
                running.retain_mut(|f| f.as_mut().poll(cx).is_pending());
                if running.is_empty() && next >= batch.len() {
                    return Poll::Ready(());
                }
                if running.len() == before {
                    return Poll::Pending;
                }
            })
            .await
        };
        let processed = async {
            tokio::select! {
                biased;
                () = work => {}
                () = self.renew_batch(batch, &slots, leased_at) => {}
            }
        };
        // Set once `then_lease` began: from then on it is awaited to its end.
        let began = std::sync::atomic::AtomicBool::new(false);
        let then = async {
            let last = slots.last()?;
            last.moved_on().await;
            if shutdown.is_requested() {
                return None;
            }
            began.store(true, Ordering::Relaxed);
            Some(then_lease.await)
        };
        tokio::pin!(processed, then);
        let (mut processed_done, mut then_done, mut out) = (false, false, None);
        loop {
            tokio::select! {
                () = &mut processed, if !processed_done => processed_done = true,
                r = &mut then, if !then_done => {
                    out = r;
                    then_done = true;
                }
            }
            if processed_done && (then_done || !began.load(Ordering::Relaxed)) {
                break;
            }
        }
        (slots.iter().filter(|s| s.lost_before_outcome()).count(), out)
    }

    /// Release every message of a lease not processed.
    async fn release_all(&self, leased: super::lease::Leased) {
        if let Ok(batch) = leased.share {
            for lm in &batch {
                self.release(lm).await;
            }
        }
    }

    /// One message of a batch: after `before` (the message ahead of it)
    /// is committing or done, to its outcome, unless its lease is lost
    /// first (skipped) or while its handler runs (cancelled: nothing
    /// commits); released at shutdown.
    async fn process_in_batch(&self, lm: &LeasedMessage, slot: &Slot, before: Option<&Slot>, shutdown: &Shutdown) {
        if let Some(before) = before {
            before.moved_on().await;
        }
        let mut done = false;
        if shutdown.is_requested() {
            self.release(lm).await;
        } else if slot.state().lost {
            self.metrics.lease_lost.fetch_add(1, Ordering::Relaxed);
            warn!(queue = %self.spec.name, message_id = %lm.message.id, "lease lost while the message waited in its batch; skipped");
        } else {
            tokio::select! {
                biased;
                _ = self.process_tracked(lm, slot) => done = true,
                () = slot.cancelled() => {
                    self.metrics.lease_lost.fetch_add(1, Ordering::Relaxed);
                    self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                    if slot.state().uncertain {
                        self.resolve_uncertain(lm).await;
                    } else {
                        warn!(
                            queue = %self.spec.name,
                            message_id = %lm.message.id,
                            "lease lost while the handler ran: work cancelled, nothing committed; the new lease holder will process it"
                        );
                    }
                }
            }
        }
        slot.end(done);
    }

    /// A message whose commit had an unknown outcome lost its lease while
    /// it re-ran (its work is cancelled): did that commit land? Its row
    /// tells. Gone: the commit landed (it is counted already committed; a
    /// new holder cannot have leased it, unless one did after the lease
    /// ran out and finished it meanwhile, a window of the time this check
    /// takes). There: it did not, and the new holder processes it. The
    /// answer changes only what is counted: the acks are guarded either
    /// way.
    async fn resolve_uncertain(&self, lm: &LeasedMessage) {
        let (queue, id) = (&self.spec.name, &lm.message.id);
        for tries in 1..=3 {
            match self.store.message_get(id).await {
                Ok(None) => {
                    self.metrics.already_committed.fetch_add(1, Ordering::Relaxed);
                    warn!(queue = %queue, message_id = %id, "lease lost while re-running after an unknown commit outcome; the message is gone: the earlier commit landed");
                    return;
                }
                Ok(Some(_)) => {
                    warn!(queue = %queue, message_id = %id, "lease lost while re-running after an unknown commit outcome; the message is still queued: the earlier commit did not land, the new lease holder will process it");
                    return;
                }
                Err(e) if tries < 3 => {
                    debug!(queue = %queue, message_id = %id, "asking whether an uncertain commit landed failed: {e}");
                    tokio::time::sleep(jittered(self.spec.policy.poll_max)).await;
                }
                Err(e) => {
                    self.metrics.store_error(&e);
                    warn!(queue = %queue, message_id = %id, class = e.class(), "lease lost while re-running after an unknown commit outcome, and the store could not say whether that commit landed: {e}; it is counted nowhere (its effects were applied once or not at all)");
                }
            }
        }
    }

    pub(super) async fn release(&self, lm: &LeasedMessage) {
        match self.store.message_release(&lm.lease).await {
            Ok(()) => {
                self.metrics.released.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                self.metrics.store_error(&e);
                warn!(queue = %self.spec.name, message_id = %lm.message.id, class = e.class(), "release failed (the lease will expire): {e}")
            }
        }
    }
}

/// Messages of its batch a worker keeps going at once: one handler running,
/// the ones before it committing. Four beat two on every worker count
/// measured, at the price of a few more messages re-run (one that read
/// what a message before it writes); docs/src/benchmarks.md has the
/// figures.
pub(super) const IN_FLIGHT: usize = 4;

/// A worker's measured time per message (lease to outcome, averaged over
/// its recent batches), and from it how many messages it leases at once.
#[derive(Debug, Default)]
pub(super) struct Pace {
    per_message: Option<Duration>,
    /// At most this many, after batches that lost leases: halved by each
    /// such batch, doubled back by each clean one.
    cap: Option<usize>,
}

impl Pace {
    /// As many messages as this worker finishes in a third of `lease` (the
    /// first renewal), at least one and at most `batch`. Before anything was
    /// measured: one.
    pub(super) fn limit(&self, batch: usize, lease: Duration) -> usize {
        let batch = batch.max(1);
        let paced = match self.per_message {
            None => 1,
            Some(d) if d.is_zero() => batch,
            Some(d) => ((lease / 3).as_secs_f64() / d.as_secs_f64()).floor().clamp(1.0, batch as f64) as usize,
        };
        paced.min(self.cap.unwrap_or(usize::MAX)).max(1)
    }

    /// Of `leased` messages, `lost` lost their lease before their outcome;
    /// all took `took` (lease included). Lost ones do not count as done,
    /// and a batch that lost leases halves what the worker leases next;
    /// clean batches double it back.
    pub(super) fn record(&mut self, leased: usize, lost: usize, took: Duration) {
        let finished = leased.saturating_sub(lost);
        let Ok(n) = u32::try_from(finished.max(1)) else { return };
        let now = took / n;
        self.per_message = Some(match self.per_message {
            None => now,
            Some(before) => before.mul_f64(0.7) + now.mul_f64(0.3),
        });
        self.cap = if lost > 0 {
            Some((leased / 2).max(1))
        } else {
            self.cap.and_then(|c| c.checked_mul(2)).filter(|&c| c < 1 << 16)
        };
    }
}

/// A batch's messages counted as held by their queue ([`QueueRunner::held`])
/// while a worker processes them; the last settling wakes `--until-empty`.
struct Held<'r> {
    runner: &'r QueueRunner,
    n: usize,
}

impl<'r> Held<'r> {
    fn new(runner: &'r QueueRunner, n: usize) -> Held<'r> {
        runner.held.fetch_add(n, Ordering::AcqRel);
        Held { runner, n }
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if self.runner.held.fetch_sub(self.n, Ordering::AcqRel) == self.n {
            self.runner.idle.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::super::testing::*;
    use super::super::Policy;
    use super::Pace;
    use crate::store::faulty::{FaultCounts, FaultPlan, FaultyStore};
    use crate::store::Store;
    use std::sync::atomic::Ordering::Relaxed;
    use std::sync::Arc;
    use std::time::Duration;

    /// A queue of `workers` workers taking one message at a time, each
    /// `per_message` long (tokio time), polling at most every 200 ms when
    /// idle, on a store that counts the calls made to it.
    fn counted_slow_writers(
        workers: usize,
        per_message: Duration,
    ) -> (tempfile::TempDir, Arc<dyn Store>, Arc<FaultCounts>, Arc<super::QueueRunner>) {
        let (dir, base) = store();
        let (faulty, counts) = FaultyStore::new(base, FaultPlan::default());
        let store: Arc<dyn Store> = Arc::new(faulty);
        let mut r = runner(&store, slow_writer(per_message), Duration::from_secs(30));
        Arc::get_mut(&mut r).unwrap().spec.policy = Policy {
            lease: Duration::from_secs(30),
            workers,
            batch: 1,
            poll_max: Duration::from_millis(200),
            ..Policy::default()
        };
        (dir, store, counts, r)
    }

    /// `--until-empty` does not ask the store whether work is left while a
    /// worker of this host still holds a message (the host knows some is),
    /// and asks once the last one settled: on the Spanner emulator each
    /// check is four queries at its one transaction, which delayed the last
    /// commits of a run.
    #[tokio::test(start_paused = true)]
    async fn until_empty_asks_the_store_only_once_nothing_is_held_here() {
        let (_dir, store, counts, r) = counted_slow_writers(2, Duration::from_secs(3));
        send(&store, 1).await;
        let (stop, _rx) = crate::shutdown::channel();
        let run = super::super::run_queues(store.clone(), vec![r.clone()], stop, true);
        tokio::time::timeout(Duration::from_secs(60), run).await.expect("the run ended");
        assert_eq!(r.metrics.processed.load(Relaxed), 1);
        assert_eq!(rows(&store).await, 1);
        // The other worker found the queue empty at once and polled it
        // all along; the store was asked only after the 3 s message.
        assert!(counts.leases.load(Relaxed) >= 5, "the idle worker polled");
        assert_eq!(counts.stats.load(Relaxed), 1, "store checks of a run whose one message took 3 s");
    }

    /// An idle queue is polled by one worker at a time, at the backoff;
    /// work that arrives is still taken up by every worker at once.
    #[tokio::test(start_paused = true)]
    async fn an_idle_queue_is_polled_by_one_worker_at_a_time() {
        let (_dir, store, counts, r) = counted_slow_writers(4, Duration::from_secs(1));
        let (tx, rx) = crate::shutdown::channel();
        let running = tokio::spawn(r.clone().run(rx));
        tokio::time::sleep(Duration::from_secs(20)).await;
        // Four workers polling on their own would lease about 4 x 20 s /
        // 200 ms = 400 times; one at a time, about 100 (the jittered
        // backoff is 160-240 ms), plus the ramp up to it.
        let polls = counts.leases.load(Relaxed);
        assert!((80..=150).contains(&polls), "{polls} polls of an idle queue in 20 s");

        // Eight messages of 1 s each: the four workers share them (about
        // 2 s), where one worker alone would take 8 s.
        send(&store, 8).await;
        let sent = tokio::time::Instant::now();
        while r.metrics.processed.load(Relaxed) < 8 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(sent.elapsed() < Duration::from_secs(4), "8 messages took {:?}", sent.elapsed());
        assert_eq!(rows(&store).await, 8);
        tx.request();
        running.await.unwrap();
    }

    /// A pause stops this host's leases at once, also for the workers
    /// already waiting for their turn to poll an idle queue: they look
    /// again before they lease. (They used to lease once more each, so a
    /// dead letter replayed onto a just-paused queue could be taken.)
    #[tokio::test(start_paused = true)]
    async fn a_pause_stops_the_workers_waiting_to_poll_an_idle_queue() {
        let (_dir, store, _counts, r) = counted_slow_writers(4, Duration::from_millis(10));
        let (tx, rx) = crate::shutdown::channel();
        let running = tokio::spawn(r.clone().run(rx));
        // Idle: the workers wait their turns at the poll gate.
        tokio::time::sleep(Duration::from_secs(2)).await;
        r.set_paused(true);
        send(&store, 3).await;
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(r.metrics.processed.load(Relaxed), 0, "processed from a paused queue");
        assert_eq!(rows(&store).await, 0);
        // Resumed, they are taken.
        r.set_paused(false);
        while r.metrics.processed.load(Relaxed) < 3 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(rows(&store).await, 3);
        tx.request();
        running.await.unwrap();
    }

    /// A SQLite store (`base`) and the same store with every commit taking
    /// 1 s.
    fn slow_commits() -> (tempfile::TempDir, Arc<dyn Store>, Arc<dyn Store>) {
        let (dir, base) = store();
        let plan = FaultPlan {
            commit_delay: Some(Duration::from_secs(1)),
            ..FaultPlan::default()
        };
        let (faulty, _) = FaultyStore::new(base.clone(), plan);
        (dir, base, Arc::new(faulty))
    }

    /// A worker's next message runs its handler while the previous one
    /// commits, one handler at a time, and the messages still commit in
    /// order of their batch.
    #[tokio::test(start_paused = true)]
    async fn the_next_message_is_handled_while_the_previous_one_commits() {
        let (_dir, base, store) = slow_commits();
        let lease = Duration::from_secs(30);
        let batch = leased(&store, 4, lease).await;
        // A 1 s handler that counts how many of it run at once.
        let running = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let most = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (now, peak) = (running.clone(), most.clone());
        let inner = slow_writer(Duration::from_secs(1));
        let handler = Arc::new(crate::protocol::NativeHandler::new("counting", move |m, scope| {
            let (now, peak, inner) = (now.clone(), peak.clone(), inner.clone());
            async move {
                peak.fetch_max(now.fetch_add(1, Relaxed) + 1, Relaxed);
                let out = inner.handle(&m, scope).await;
                now.fetch_sub(1, Relaxed);
                out
            }
        }));
        let r = runner(&store, handler, lease);
        let rx = crate::shutdown::Shutdown::never();
        let started = tokio::time::Instant::now();
        r.process_batch(&batch, started, &rx).await;
        assert_eq!(r.metrics.processed.load(Relaxed), 4);
        assert_eq!(rows(&base).await, 4);
        assert_eq!(most.load(Relaxed), 1, "one handler at a time");
        // One after the other: 4 x (1 s handler + 1 s commit) = 8 s. Each
        // handler after the first runs during the commit before it: 5 s.
        let took = started.elapsed();
        assert!(took >= Duration::from_secs(5) && took < Duration::from_secs(6), "{took:?}");
    }

    /// The worker's next lease starts while its batch's last message
    /// commits, not after: with 1 s handlers and 1 s commits, the lease
    /// (here 1.5 s) ends half a second after the batch; and a lease begun
    /// is finished even though the batch ended first.
    #[tokio::test(start_paused = true)]
    async fn the_next_lease_overlaps_the_last_commit() {
        let (_dir, base, store) = slow_commits();
        let lease = Duration::from_secs(30);
        let batch = leased(&store, 2, lease).await;
        let r = runner(&store, slow_writer(Duration::from_secs(1)), lease);
        let rx = crate::shutdown::Shutdown::never();
        let started = tokio::time::Instant::now();
        let began = std::sync::Mutex::new(None);
        let (lost, next) = r
            .process_batch_then(&batch, started, &rx, async {
                *began.lock().unwrap() = Some(started.elapsed());
                tokio::time::sleep(Duration::from_millis(1500)).await;
                "leased"
            })
            .await;
        assert_eq!((lost, next), (0, Some("leased")));
        assert_eq!(rows(&base).await, 2);
        // Handler 1 (0-1 s), commit 1 and handler 2 (1-2 s), commit 2
        // (2-3 s): the lease began when commit 2 did, and ended at 3.5 s.
        let began = began.lock().unwrap().unwrap();
        assert!(began >= Duration::from_secs(2) && began < Duration::from_millis(2100), "{began:?}");
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(3500) && took < Duration::from_millis(3600),
            "{took:?}"
        );

        // At shutdown, no next lease.
        let batch = leased(&store, 1, lease).await;
        let (stop, rx) = crate::shutdown::channel();
        stop.request();
        let (_, next) = r
            .process_batch_then(&batch, tokio::time::Instant::now(), &rx, async { "leased" })
            .await;
        assert_eq!(next, None);
    }

    /// A commit that landed with an unknown outcome, then a re-run
    /// cancelled because its lease could not be renewed: the message is
    /// gone, so it is counted already committed, not left uncounted.
    #[tokio::test(start_paused = true)]
    async fn a_re_run_cancelled_after_a_landed_unknown_commit_counts_it_committed() {
        let (_dir, base) = store();
        let plan = FaultPlan {
            after_commit: 1.0,
            limit: Some(1),
            renewals_fail: true,
            ..FaultPlan::default()
        };
        let (faulty, counts) = FaultyStore::new(base.clone(), plan);
        let store: Arc<dyn Store> = Arc::new(faulty);
        let lease = Duration::from_secs(3);
        let batch = leased(&store, 1, lease).await;
        // The first run is quick; the re-run outlasts the lease.
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (c, inner) = (calls.clone(), slow_writer(Duration::ZERO));
        let handler = Arc::new(crate::protocol::NativeHandler::new("slow-re-run", move |m, scope| {
            let (c, inner) = (c.clone(), inner.clone());
            async move {
                if c.fetch_add(1, Relaxed) > 0 {
                    tokio::time::sleep(Duration::from_secs(60)).await;
                }
                inner.handle(&m, scope).await
            }
        }));
        let r = runner(&store, handler, lease);
        let lost = r
            .process_batch(&batch, tokio::time::Instant::now(), &crate::shutdown::Shutdown::never())
            .await;
        assert_eq!(counts.after_commit.load(Relaxed), 1, "the fault was injected");
        assert_eq!((lost, calls.load(Relaxed)), (1, 2), "re-run, then cancelled");
        assert_eq!(r.metrics.cancelled.load(Relaxed), 1);
        assert_eq!(r.metrics.already_committed.load(Relaxed), 1);
        assert_eq!(r.metrics.processed.load(Relaxed), 0);
        assert_eq!(rows(&base).await, 1, "applied once");
    }

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_worker_leases_what_it_finishes_in_a_third_of_the_lease() {
        let lease = Duration::from_secs(3);
        let mut pace = Pace::default();
        assert_eq!(pace.limit(8, lease), 1, "one message until the pace is known");
        // Fast messages: the whole batch.
        pace.record(1, 0, 2 * MS);
        assert_eq!(pace.limit(8, lease), 8);
        // 400 ms a message (the emulator under contention): 1 s / 400 ms = 2,
        // once the average has moved there.
        for _ in 0..20 {
            pace.record(4, 0, 1600 * MS);
        }
        assert_eq!(pace.limit(8, lease), 2);
        // Slower than the first renewal: still one at a time.
        for _ in 0..20 {
            pace.record(1, 0, 5000 * MS);
        }
        assert_eq!(pace.limit(8, lease), 1);
        // Fast again: back to the batch within a few batches.
        for _ in 0..20 {
            pace.record(8, 0, 8 * MS);
        }
        assert_eq!(pace.limit(8, lease), 8);
        assert_eq!(pace.limit(0, lease), 1, "a batch setting of 0 still leases");
    }

    /// Messages that lost their lease are not work done: a worker whose
    /// batch of eight lost seven leases quickly (a stall) leases fewer next,
    /// where counting them as finished made it look fast.
    #[test]
    fn lost_leases_shrink_the_next_lease() {
        let lease = Duration::from_secs(3);
        let mut pace = Pace::default();
        for _ in 0..20 {
            pace.record(8, 0, 8 * MS);
        }
        assert_eq!(pace.limit(8, lease), 8);
        pace.record(8, 7, 80 * MS);
        assert_eq!(pace.limit(8, lease), 4);
        pace.record(4, 4, 3000 * MS);
        assert!(pace.limit(8, lease) <= 2, "{}", pace.limit(8, lease));
        // Lost again and again: down to one at a time.
        for _ in 0..10 {
            pace.record(1, 1, 3000 * MS);
        }
        assert_eq!(pace.limit(8, lease), 1);
        // Clean batches of fast messages win it back.
        for _ in 0..30 {
            pace.record(8, 0, 8 * MS);
        }
        assert_eq!(pace.limit(8, lease), 8);
    }
}
