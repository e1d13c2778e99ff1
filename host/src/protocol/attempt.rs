//! One message to its final outcome: deliveries (handle inside a message
//! transaction, check and buffer the effects, ack, commit), re-runs after
//! aborts and unknown outcomes ([`super::retry`]), and step 5: retry
//! later, defer or dead-letter, guarded by the lease token.
//!
//! What a message is charged: a *failure* only for its own verdict (the
//! handler failed or asked to retry, or its effects were refused); the
//! host's trouble defers it uncounted; every lease is a *delivery*, and
//! `max_deliveries` parks a message that never reaches a verdict.

use super::metrics::hist_record;
use super::slot::Slot;
use super::spans::{Produced, RunSpan};
use super::{effects, retry, AttemptError, HandleOutput, Handler, HandlerFailure, Next, Outcome, QueueRunner, ReadScope, Rerun};
use crate::store::{DeadLetterParams, LeasedMessage, RetryParams, StoreError};
use crate::telemetry::{Active, CURRENT};
use std::sync::atomic::Ordering;
use tokio::time::Instant;
use tracing::{debug, info, info_span, warn, Instrument};

/// A message aborted by contention this many times in a row (its reads
/// changed by other messages' commits while it ran) runs its next re-run
/// with the committer held for it ([`crate::store::commit::Group::hold`]):
/// it reads after the last batch and commits first in the next, so a hot
/// row cannot starve it. Ordinary contention (a re-run or three) does not
/// stop the committer: each hold does, for the length of a handler call
/// (measured on the demo, whose inventory items are contended: holding
/// after two aborts cost about a tenth of its throughput).
pub(super) const PRIORITY_AFTER: u32 = 4;

/// Where a message goes after a failed delivery.
enum Step {
    Retry(RetryParams),
    Dead(String, bool),
}

impl QueueRunner {
    /// Process one leased message to its final outcome.
    pub async fn process(&self, lm: &LeasedMessage) -> Outcome {
        self.process_tracked(lm, &Slot::default()).await
    }

    /// [`Self::process`], telling `slot` when a commit starts and ends.
    pub(super) async fn process_tracked(&self, lm: &LeasedMessage, slot: &Slot) -> Outcome {
        let handler = self.handler();
        let version = handler.version().to_string();
        let span = info_span!(
            "message",
            messaging.system = "onceq",
            otel.kind = "consumer",
            queue = %lm.message.queue,
            message_id = %lm.message.id,
            delivery = lm.message.attempt,
            failures = lm.failures,
            version = %version,
            trace_id = tracing::field::Empty,
            span_id = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        if let Some(t) = crate::trace::of(&lm.message.attributes) {
            span.record("trace_id", tracing::field::display(t.trace_id_hex()));
        }
        let started = Instant::now();
        let m = &self.metrics;
        m.in_flight.fetch_add(1, Ordering::Relaxed);
        m.record_version(&version, |c| c.in_flight += 1);
        m.deliveries.fetch_add(1, Ordering::Relaxed);
        let outcome = self.process_inner(lm, &*handler, slot).instrument(span.clone()).await;
        m.in_flight.fetch_sub(1, Ordering::Relaxed);
        // The version's counts in one go: no longer in flight, and how it ended.
        m.record_version(&version, |c| {
            c.in_flight = c.in_flight.saturating_sub(1);
            match &outcome {
                Outcome::Acked => c.processed += 1,
                Outcome::AlreadyCommitted => c.already_committed += 1,
                Outcome::RetryLater(_) => c.retried += 1,
                Outcome::DeadLettered(_) => c.dead_lettered += 1,
                Outcome::Deferred(_) | Outcome::LeaseLost | Outcome::Released => {}
            }
        });
        span.record("outcome", tracing::field::debug(&outcome));
        match &outcome {
            Outcome::Acked => {
                m.committed_now();
                m.processed.fetch_add(1, Ordering::Relaxed);
                m.record_latency(started.elapsed());
            }
            Outcome::AlreadyCommitted => {
                m.already_committed.fetch_add(1, Ordering::Relaxed);
                m.record_latency(started.elapsed());
            }
            Outcome::RetryLater(_) => {
                m.retried.fetch_add(1, Ordering::Relaxed);
            }
            Outcome::Deferred(reason) => {
                m.deferred.fetch_add(1, Ordering::Relaxed);
                m.deferred_now(reason);
            }
            Outcome::DeadLettered(reason) => {
                m.dead_lettered.fetch_add(1, Ordering::Relaxed);
                warn!(parent: &span, "dead-lettered: {reason}");
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

    pub(super) async fn process_inner(&self, lm: &LeasedMessage, handler: &dyn Handler, slot: &Slot) -> Outcome {
        let policy = &self.spec.policy;
        if lm.message.attempt > policy.max_deliveries {
            return self.park(lm, handler, &Active::default()).await;
        }
        let mut unknown_seen = false;
        let mut reruns = 0u32;
        // Aborts in a row: contention (reads changed before commit).
        let mut contended = 0u32;
        // The follow-ups and intents of the last run (for their spans), and
        // of the last run whose commit outcome was unknown: if the message
        // turns out already committed, that commit is what landed.
        let mut produced = Vec::new();
        let mut uncertain = Vec::new();
        // This run's `process` span (none when telemetry is off).
        let mut run = Active::default();
        let outcome = loop {
            let priority = contended >= PRIORITY_AFTER;
            run.end();
            run = self.process_span(lm, handler);
            produced.clear();
            let err = match self.attempt(lm, handler, slot, priority, &run, &mut produced).await {
                Ok(()) => {
                    run.produced_all(&produced);
                    break Outcome::Acked;
                }
                Err(e) => e,
            };
            if let AttemptError::Store(e) = &err {
                self.metrics.store_error(e);
                // A commit whose outcome is unknown may have landed with
                // this run's effects (a run that failed before its commit
                // checked none, and leaves the last ones standing).
                if e.is_unknown_outcome() && !produced.is_empty() {
                    uncertain = std::mem::take(&mut produced);
                }
            }
            run.run_failed(&err);
            match err {
                AttemptError::Store(e) if e.is_retryable() || e.is_unknown_outcome() => match policy.rerun(&e, reruns) {
                    Rerun::Now => {
                        reruns += 1;
                        contended = 0;
                        unknown_seen = true;
                        slot.uncertain();
                        self.metrics.unknown_outcomes.fetch_add(1, Ordering::Relaxed);
                        warn!(
                            class = e.class(),
                            "commit outcome unknown, re-running the message (its ack decides): {e}"
                        );
                    }
                    Rerun::After(pause) => {
                        reruns += 1;
                        contended = if matches!(e, StoreError::Aborted(_)) { contended + 1 } else { 0 };
                        self.metrics.aborted_reruns.fetch_add(1, Ordering::Relaxed);
                        debug!("transaction aborted, re-running: {e}");
                        tokio::time::sleep(pause).await;
                    }
                    Rerun::Stop => {
                        warn!(
                            class = e.class(),
                            "store failing after {reruns} re-runs (setting queue.max_reruns): {e}; deferring the message, not counted as its failure"
                        );
                        break self.fail(lm, handler, HandlerFailure::from_store(e), unknown_seen, &run).await;
                    }
                },
                AttemptError::Store(StoreError::LeaseLost { .. }) => {
                    break if unknown_seen {
                        info!("ack refused after an unknown commit outcome: the earlier commit landed");
                        Outcome::AlreadyCommitted
                    } else {
                        warn!("lease lost before commit; rolled back, the new lease holder will process the message");
                        Outcome::LeaseLost
                    };
                }
                AttemptError::Store(e) => break self.fail(lm, handler, HandlerFailure::from_store(e), unknown_seen, &run).await,
                AttemptError::Handler(f) => break self.fail(lm, handler, f, unknown_seen, &run).await,
            }
        };
        if outcome == Outcome::AlreadyCommitted {
            run.produced_all(&uncertain);
        }
        run.outcome(&outcome);
        run.end();
        outcome
    }

    /// One run of steps 2-4. With `priority`, the store's committer is
    /// held for this message from before its reads to its commit (see
    /// [`PRIORITY_AFTER`]).
    pub(super) async fn attempt(
        &self,
        lm: &LeasedMessage,
        handler: &dyn Handler,
        slot: &Slot,
        priority: bool,
        run: &Active,
        produced: &mut Vec<Produced>,
    ) -> Result<(), AttemptError> {
        let turn = slot.handler_turn().await;
        let hold = if priority {
            match self.store.commit_hold().await {
                Ok(hold) => hold,
                Err(e) => {
                    debug!("could not hold the committer for a contended message: {e}");
                    None
                }
            }
        } else {
            None
        };
        let tx = self.store.transaction_begin().await.map_err(AttemptError::Store)?;
        let schema = self.store.schema();
        let mut scope = ReadScope::new(tx, schema.clone(), self.tables.clone()).with_limits(&self.spec.limits);
        let called = Instant::now();
        let HandleOutput { scope, result } = if run.is_recording() {
            scope.logs = Some(Vec::new());
            let call = run.handle(&lm.message.queue);
            let out = CURRENT.scope(call.clone(), handler.handle(&lm.message, scope)).await;
            call.handled(&out);
            out
        } else {
            handler.handle(&lm.message, scope).await
        };
        hist_record(&self.metrics.handler_us, called.elapsed());
        if let Some(n) = scope.instructions {
            self.metrics.record_instructions(handler.version(), n);
        }
        let store_error = scope.store_error.clone();
        let refusal = scope.refusal();
        let mut tx = scope.into_transaction();
        let failure = match store_error {
            Some(e) => Some(AttemptError::Store(e)),
            None => refusal.map(AttemptError::Handler),
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
        if run.is_recording() {
            *produced = Produced::of(&lm.message, &effects);
        }
        let mut handing = Vec::new();
        let counts = match effects::check_and_buffer(
            &lm.message,
            handler.version(),
            effects,
            &self.spec.grants,
            &self.spec.limits,
            &schema,
            &mut *tx,
            &mut |p| handing.extend(self.hand(p)),
        ) {
            Ok(c) => c,
            Err(reason) => {
                tx.rollback().await;
                return Err(AttemptError::Handler(HandlerFailure::Effect(reason)));
            }
        };
        tx.message_ack(&lm.lease);
        drop(turn); // the worker's next message may run its handler now
        slot.commit_started();
        let settle = run.settle(&lm.message.queue, "ack");
        if let Some(t) = settle.traceparent() {
            tx.trace(t);
        }
        let committed = match hold {
            Some(hold) => tx.commit_held(hold).await,
            None => tx.commit().await,
        };
        settle.settled(&committed);
        slot.commit_ended();
        match committed {
            Ok(()) => self.handed(handing).await,
            Err(e) => {
                self.not_handed(handing, e.is_unknown_outcome()).await;
                return Err(AttemptError::Store(e));
            }
        }
        let m = &self.metrics;
        m.writes.fetch_add(counts.writes, Ordering::Relaxed);
        m.intents.fetch_add(counts.intents, Ordering::Relaxed);
        m.enqueued.fetch_add(counts.enqueued, Ordering::Relaxed);
        Ok(())
    }

    /// Step 5: retry later (a failure counted), defer (the host's trouble,
    /// not counted) or dead-letter, guarded by the lease token.
    pub(super) async fn fail(
        &self,
        lm: &LeasedMessage,
        handler: &dyn Handler,
        failure: HandlerFailure,
        unknown_seen: bool,
        run: &Active,
    ) -> Outcome {
        let failures = lm.failures;
        let policy = &self.spec.policy;
        // A reason is stored and shown: keep it bounded, whatever its source.
        let reason = |text: String| crate::names::reason(&text);
        let step = match policy.after_failure(&failure, failures, lm.message.attempt, self.spec.limits.max_delay) {
            Next::RetryAfter(delay) => Step::Retry(RetryParams {
                delay,
                reason: reason(failure.to_string()),
                failed: true,
            }),
            Next::Defer(delay) => Step::Retry(RetryParams {
                delay,
                reason: reason(failure.recorded_reason()),
                failed: false,
            }),
            Next::DeadLetter if matches!(failure, HandlerFailure::Reject(_) | HandlerFailure::Undelivered { .. }) => {
                Step::Dead(reason(failure.to_string()), true)
            }
            Next::DeadLetter if failure.is_crash() && failures.saturating_add(1) < policy.max_attempts => Step::Dead(
                reason(format!(
                    "{failure} (not retried: the same message crashes the same way; set queue.retry_crashes = true to retry crashes)"
                )),
                true,
            ),
            Next::DeadLetter if failures.saturating_add(1) < policy.max_attempts => Step::Dead(
                reason(format!("{failure} (not retried: every attempt would fail the same way)")),
                true,
            ),
            Next::DeadLetter => {
                let n = failures.saturating_add(1);
                Step::Dead(
                    reason(format!(
                        "{failure} (gave up after {n} failed attempt{})",
                        if n == 1 { "" } else { "s" }
                    )),
                    true,
                )
            }
        };
        self.record(lm, handler, step, unknown_seen, run).await
    }

    /// Park a message delivered more than `max_deliveries` times without
    /// reaching a verdict (a handler that takes its host down, leases that
    /// keep expiring): dead-lettered without running it again.
    async fn park(&self, lm: &LeasedMessage, handler: &dyn Handler, run: &Active) -> Outcome {
        let before = lm.message.attempt.saturating_sub(1);
        let without = before.saturating_sub(lm.failures);
        let reason = format!(
            "parked after {before} deliveries, {without} of them ended without a verdict (the host crashed or was killed, the lease expired, or the host deferred it for its own trouble) and {} with a failure (setting queue.max_deliveries = {})",
            lm.failures, self.spec.policy.max_deliveries
        );
        warn!("{reason}");
        self.record(lm, handler, Step::Dead(reason, false), false, run).await
    }

    /// Write `step`, guarded by the lease token, re-trying what the store
    /// lets re-try.
    async fn record(&self, lm: &LeasedMessage, handler: &dyn Handler, step: Step, unknown_seen: bool, run: &Active) -> Outcome {
        let settle = run.settle(
            &lm.message.queue,
            match &step {
                Step::Retry(p) if p.failed => "retry",
                Step::Retry(_) => "defer",
                Step::Dead(..) => "dead-letter",
            },
        );
        let outcome = self.record_step(lm, handler, step, unknown_seen).await;
        settle.end();
        outcome
    }

    async fn record_step(&self, lm: &LeasedMessage, handler: &dyn Handler, step: Step, unknown_seen: bool) -> Outcome {
        let failures = lm.failures;
        let version = Some(handler.version().to_string());
        let mut tries = 0;
        // This record's own write may have landed although it failed.
        let mut record_unknown = false;
        loop {
            let r = match &step {
                Step::Retry(p) => self.store.message_retry_later(&lm.lease, p.clone()).await,
                Step::Dead(reason, failed) => {
                    self.store
                        .message_dead_letter(
                            &lm.lease,
                            DeadLetterParams {
                                reason: reason.clone(),
                                handler_version: version.clone(),
                                failed: *failed,
                            },
                        )
                        .await
                }
            };
            match r {
                Ok(()) => return self.recorded(step, failures),
                Err(StoreError::LeaseLost { .. }) if record_unknown => {
                    // Either this record landed before, or the message left
                    // (an earlier commit landed, or another holder). Ask.
                    return match self.record_landed(lm, &step).await {
                        Some(true) => self.recorded(step, failures),
                        _ if unknown_seen => Outcome::AlreadyCommitted,
                        _ => Outcome::LeaseLost,
                    };
                }
                Err(StoreError::LeaseLost { .. }) => {
                    return if unknown_seen {
                        Outcome::AlreadyCommitted
                    } else {
                        Outcome::LeaseLost
                    };
                }
                Err(e) if (e.is_retryable() || e.is_unknown_outcome()) && tries < self.spec.policy.max_reruns => {
                    self.metrics.store_error(&e);
                    if e.is_unknown_outcome() {
                        warn!(class = e.class(), "recording the outcome: outcome unknown, trying again: {e}");
                    }
                    tries += 1;
                    record_unknown |= e.is_unknown_outcome();
                    tokio::time::sleep(retry::rerun_pause(tries)).await;
                }
                Err(e) => {
                    self.metrics.store_error(&e);
                    let what = match &step {
                        Step::Retry(p) => p.reason.clone(),
                        Step::Dead(reason, _) => reason.clone(),
                    };
                    warn!(
                        class = e.class(),
                        "could not record the outcome (the lease will expire and the message will be delivered again): {e}; outcome was: {what}"
                    );
                    return Outcome::LeaseLost;
                }
            }
        }
    }

    fn recorded(&self, step: Step, failures: u32) -> Outcome {
        if matches!(&step, Step::Retry(RetryParams { failed: true, .. }) | Step::Dead(_, true)) {
            self.metrics.failures.fetch_add(1, Ordering::Relaxed);
        }
        match step {
            Step::Retry(p) if p.failed => {
                warn!(
                    "failure {} of {}, next delivery in {}: {}",
                    failures.saturating_add(1),
                    self.spec.policy.max_attempts,
                    crate::names::duration(p.delay),
                    p.reason
                );
                Outcome::RetryLater(p.reason)
            }
            Step::Retry(p) => {
                warn!("next delivery in {}: {}", crate::names::duration(p.delay), p.reason);
                Outcome::Deferred(p.reason)
            }
            Step::Dead(reason, _) => Outcome::DeadLettered(reason),
        }
    }

    /// After a record whose outcome was unknown found the lease gone: did
    /// that record land (`Some(true)`), or did the message go another way
    /// (`Some(false)`)? `None` if the store cannot say now.
    async fn record_landed(&self, lm: &LeasedMessage, step: &Step) -> Option<bool> {
        match step {
            Step::Dead(..) => self.store.dead_letter_get(&lm.message.id).await.ok().map(|d| d.is_some()),
            // Back on its queue and not leased: the retry landed (another
            // holder would have it leased, or have finished it).
            Step::Retry(_) => self
                .store
                .message_get(&lm.message.id)
                .await
                .ok()
                .map(|m| m.is_some_and(|m| !m.leased)),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::super::testing::*;
    use super::super::{HandleOutput, HandlerFailure, NativeHandler, Outcome};
    use crate::store::faulty::{FaultPlan, FaultyStore};
    use crate::store::{Queues, Store};
    use std::sync::atomic::Ordering::Relaxed;
    use std::sync::Arc;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn a_commit_that_landed_with_an_unknown_outcome_is_found_already_committed() {
        let (_dir, base) = store();
        let plan = FaultPlan {
            after_commit: 1.0,
            limit: Some(1),
            ..FaultPlan::default()
        };
        let (faulty, counts) = FaultyStore::new(base.clone(), plan);
        let store: Arc<dyn Store> = Arc::new(faulty);
        let lease = Duration::from_secs(10);
        let batch = leased(&store, 1, lease).await;
        let r = runner(&store, slow_writer(Duration::ZERO), lease);
        assert_eq!(r.process(&batch[0]).await, Outcome::AlreadyCommitted);
        assert_eq!(counts.after_commit.load(Relaxed), 1);
        assert_eq!(r.metrics.unknown_outcomes.load(Relaxed), 1);
        assert_eq!(rows(&base).await, 1, "written once, by the first commit");
    }

    fn failing() -> Arc<NativeHandler> {
        Arc::new(NativeHandler::new("failing", |_m, scope| async move {
            HandleOutput {
                scope,
                result: Err(HandlerFailure::Refused("boom".into())),
            }
        }))
    }

    /// A failure record whose write landed but whose answer was lost: the
    /// retry that follows finds the lease gone, and the outcome is the
    /// record's (a retry, a dead letter), not "already committed".
    #[tokio::test(start_paused = true)]
    async fn a_failure_record_that_landed_unanswered_is_reported_as_what_it_was() {
        for max_attempts in [5, 1] {
            let (_dir, base) = store();
            let plan = FaultPlan {
                records_landed_unknown: 1,
                ..FaultPlan::default()
            };
            let (faulty, counts) = FaultyStore::new(base.clone(), plan);
            let store: Arc<dyn Store> = Arc::new(faulty);
            let lease = Duration::from_secs(10);
            let mut r = runner(&store, failing(), lease);
            Arc::get_mut(&mut r).unwrap().spec.policy.max_attempts = max_attempts;
            let batch = leased(&store, 1, lease).await;
            let outcome = r.process(&batch[0]).await;
            assert_eq!(counts.records_landed.load(Relaxed), 1);
            match (max_attempts, &outcome) {
                (5, Outcome::RetryLater(reason)) | (1, Outcome::DeadLettered(reason)) => assert!(reason.contains("boom"), "{reason}"),
                _ => panic!("max_attempts {max_attempts}: {outcome:?}"),
            }
            assert_eq!(r.metrics.already_committed.load(Relaxed), 0);
            let q = &base.stats().await.unwrap().queues[0];
            assert_eq!((q.delayed + q.dead, q.processed), (1, 0), "the record, once; nothing committed");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_failing_handler_is_retried_after_a_backoff_then_dead_lettered_on_its_last_attempt() {
        let (_dir, store) = store();
        let lease = Duration::from_secs(10);
        let r = runner(&store, failing(), lease);
        let batch = leased(&store, 1, lease).await;
        match r.process(&batch[0]).await {
            Outcome::RetryLater(reason) => assert!(reason.contains("boom"), "{reason}"),
            other => panic!("expected a retry, got {other:?}"),
        }
        let q = &store.stats().await.unwrap().queues[0];
        assert_eq!((q.ready, q.delayed), (0, 1), "hidden by the backoff (database time)");

        // The same failure on the last attempt dead-letters, with the reason.
        let (_dir2, store) = super::super::testing::store();
        let last = Arc::new(super::super::QueueRunner::new(
            super::super::QueueSpec {
                policy: super::super::Policy {
                    max_attempts: 1,
                    ..r.spec.policy.clone()
                },
                handler: failing(),
                name: r.spec.name.clone(),
                grants: r.spec.grants.clone(),
                limits: r.spec.limits,
            },
            store.clone(),
        ));
        let batch = leased(&store, 1, lease).await;
        match last.process(&batch[0]).await {
            Outcome::DeadLettered(reason) => assert!(reason.contains("boom (gave up after 1 failed attempt)"), "{reason}"),
            other => panic!("expected a dead letter, got {other:?}"),
        }
        let dead = store.dead_letter_list(Queues::All, 10).await.unwrap();
        assert_eq!(dead.len(), 1);
        assert!(dead[0].reason.contains("boom"));
    }
}
