//! One message to its final outcome: attempts (handle inside a message
//! transaction, check and buffer the effects, ack, commit), re-runs after
//! aborts and unknown outcomes ([`super::retry`]), and step 5: retry later
//! or dead-letter, guarded by the lease token.

use super::metrics::hist_record;
use super::worker::Slot;
use super::{effects, retry, AttemptError, HandleOutput, Handler, HandlerFailure, Next, Outcome, QueueRunner, ReadScope, Rerun};
use crate::store::{DeadLetterParams, LeasedMessage, StoreError};
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::time::Instant;
use tracing::{debug, info, info_span, warn, Instrument};

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
            attempt = lm.message.attempt,
            version = %version,
            outcome = tracing::field::Empty,
        );
        let started = Instant::now();
        let m = &self.metrics;
        m.in_flight.fetch_add(1, Ordering::Relaxed);
        let outcome = self.process_inner(lm, &*handler, slot).instrument(span.clone()).await;
        m.in_flight.fetch_sub(1, Ordering::Relaxed);
        span.record("outcome", tracing::field::debug(&outcome));
        match &outcome {
            Outcome::Acked => {
                m.committed_now();
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
        let mut unknown_seen = false;
        let mut reruns = 0u32;
        loop {
            let err = match self.attempt(lm, handler, slot).await {
                Ok(()) => return Outcome::Acked,
                Err(e) => e,
            };
            if let AttemptError::Store(e) = &err {
                self.metrics.store_error(e);
            }
            match err {
                AttemptError::Store(e) if e.is_retryable() || e.is_unknown_outcome() => match self.spec.policy.rerun(&e, reruns) {
                    Rerun::Now => {
                        reruns += 1;
                        unknown_seen = true;
                        self.metrics.unknown_outcomes.fetch_add(1, Ordering::Relaxed);
                        warn!(
                            class = e.class(),
                            "commit outcome unknown, re-running the message (its ack decides): {e}"
                        );
                    }
                    Rerun::After(pause) => {
                        reruns += 1;
                        self.metrics.aborted_reruns.fetch_add(1, Ordering::Relaxed);
                        debug!("transaction aborted, re-running: {e}");
                        tokio::time::sleep(pause).await;
                    }
                    Rerun::Stop => {
                        warn!(class = e.class(), "store failing after {reruns} re-runs: {e}");
                        return self.fail(lm, handler, HandlerFailure::Store(e), unknown_seen).await;
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
                AttemptError::Store(e) => return self.fail(lm, handler, HandlerFailure::Store(e), unknown_seen).await,
                AttemptError::Handler(f) => return self.fail(lm, handler, f, unknown_seen).await,
            }
        }
    }

    /// One run of steps 2-4.
    pub(super) async fn attempt(&self, lm: &LeasedMessage, handler: &dyn Handler, slot: &Slot) -> Result<(), AttemptError> {
        let turn = slot.handler_turn().await;
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
            None => violation.map(|v| AttemptError::Handler(HandlerFailure::Read(v))),
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
                return Err(AttemptError::Handler(HandlerFailure::Effect(reason)));
            }
        };
        tx.message_ack(&lm.lease);
        drop(turn); // the worker's next message may run its handler now
        slot.commit_started();
        let committed = tx.commit().await;
        slot.commit_ended();
        committed.map_err(AttemptError::Store)?;
        let m = &self.metrics;
        m.writes.fetch_add(counts.writes, Ordering::Relaxed);
        m.intents.fetch_add(counts.intents, Ordering::Relaxed);
        m.enqueued.fetch_add(counts.enqueued, Ordering::Relaxed);
        Ok(())
    }

    /// Step 5: retry later or dead-letter, guarded by the lease token.
    pub(super) async fn fail(&self, lm: &LeasedMessage, handler: &dyn Handler, failure: HandlerFailure, mut unknown_seen: bool) -> Outcome {
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
            Next::DeadLetter if attempt < self.spec.policy.max_attempts => Step::Dead(crate::names::reason(&format!(
                "{failure} (not retried: every attempt would fail the same way)"
            ))),
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
                            warn!("attempt {attempt} failed, next in {d:?}: {reason}");
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
                    self.metrics.store_error(&e);
                    if e.is_unknown_outcome() {
                        warn!(class = e.class(), "recording the failure: outcome unknown, trying again: {e}");
                    }
                    tries += 1;
                    unknown_seen |= e.is_unknown_outcome();
                    tokio::time::sleep(retry::rerun_pause(tries)).await;
                }
                Err(e) => {
                    self.metrics.store_error(&e);
                    warn!(
                        class = e.class(),
                        "could not record the failure (the lease will expire and the message will be retried): {e}; failure was: {failure}"
                    );
                    return Outcome::LeaseLost;
                }
            }
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
                result: Err(HandlerFailure::Failed("boom".into())),
            }
        }))
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
            Outcome::DeadLettered(reason) => assert!(reason.contains("boom (gave up after 1 attempt)"), "{reason}"),
            other => panic!("expected a dead letter, got {other:?}"),
        }
        let dead = store.dead_letter_list(Queues::All, 10).await.unwrap();
        assert_eq!(dead.len(), 1);
        assert!(dead[0].reason.contains("boom"));
    }
}
