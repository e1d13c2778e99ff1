//! Lease renewal: while a worker holds a batch, the leases of the messages
//! not yet finished are renewed every third of the lease, so a handler or a
//! delivery slower than the lease is not handed to another worker. A
//! renewal that finds a lease gone, or no renewal in time, cancels that
//! message's work (its transaction rolls back) unless its commit is under
//! way: then the commit's own guarded ack decides. "In time" is decided by
//! the clock, not by the renewal's answer: a renewal call that hangs is
//! abandoned at the lease's end (less a tenth), and the work with it.

use super::slot::Slot;
use super::QueueRunner;
use crate::store::LeasedMessage;
use std::sync::atomic::Ordering;
use tokio::time::Instant;
use tracing::warn;

impl QueueRunner {
    /// Renew the leases of `batch` every third of the lease, from
    /// `leased_at`: those of its messages not finished, not lost and not
    /// committing (`slots`, in the batch's order), together in one
    /// transaction. Marks a message lost when its lease is gone, or all of
    /// them when no renewal came in time (a lost message's watcher wakes on
    /// it, [`Slot::cancelled`]). Runs until dropped.
    pub(super) async fn renew_batch(&self, batch: &[LeasedMessage], slots: &[Slot], leased_at: Instant) {
        let lease = self.spec.policy.lease;
        let mut renewed_at = leased_at;
        let mut next = renewed_at + lease / 3;
        loop {
            tokio::time::sleep_until(next).await;
            let round = Instant::now();
            let due: Vec<usize> = (0..batch.len())
                .filter(|&j| slots.get(j).is_some_and(Slot::needs_renewal))
                .collect();
            let leases: Vec<_> = due.iter().filter_map(|&j| batch.get(j).map(|lm| lm.lease.clone())).collect();
            // Past this, another host may own these messages: the
            // renewal must have answered by then.
            let deadline = renewed_at + lease - lease / 10;
            let started = self.telemetry().is_on().then(std::time::SystemTime::now);
            let mut outcome = (0, 0, None);
            let all_ok = leases.is_empty()
                || match tokio::time::timeout_at(deadline, self.store.message_lease_renew(&leases, lease))
                    .await
                    .unwrap_or_else(|_| {
                        Err(crate::store::StoreError::Unavailable(
                            "the lease renewal did not answer before the lease's end".into(),
                        ))
                    }) {
                    Ok(held) => {
                        for (&j, held) in due.iter().zip(held) {
                            if held {
                                self.metrics.lease_renewals.fetch_add(1, Ordering::Relaxed);
                                outcome.0 += 1;
                            } else if let Some(slot) = slots.get(j) {
                                slot.lose();
                                outcome.1 += 1;
                            }
                        }
                        true
                    }
                    Err(e) => {
                        outcome.2 = Some(e.to_string());
                        self.metrics.store_error(&e);
                        warn!(queue = %self.spec.name, leases = leases.len(), class = e.class(), "lease renewal failed (will retry): {e}");
                        false
                    }
                };
            if let (Some(started), false) = (started, leases.is_empty()) {
                let members: Vec<_> = due
                    .iter()
                    .filter_map(|&j| batch.get(j).and_then(|lm| crate::trace::of(&lm.message.attributes)))
                    .collect();
                let (held, lost, error) = outcome;
                self.telemetry().renewed(&self.spec.name, started, &members, held, lost, error);
            }
            if all_ok {
                renewed_at = round;
                next = round + lease / 3;
            } else if Instant::now() >= deadline {
                // No renewal in time: another worker may hold these now.
                for slot in slots {
                    slot.lose();
                }
                next = Instant::now() + lease / 3;
            } else {
                next = Instant::now() + lease / 12;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::super::testing::*;
    use crate::store::faulty::{FaultPlan, FaultyStore};
    use crate::store::Store;
    use std::sync::atomic::Ordering::Relaxed;
    use std::sync::Arc;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn renewal_keeps_messages_slower_than_their_lease() {
        let (_dir, store) = store();
        let lease = Duration::from_secs(3);
        // Two messages, each handled in 10 s: the second waits 10 s in its
        // batch, then takes 10 s itself.
        let batch = leased(&store, 2, lease).await;
        let r = runner(&store, slow_writer(Duration::from_secs(10)), lease);
        let rx = crate::shutdown::Shutdown::never();
        let started = tokio::time::Instant::now();
        r.process_batch(&batch, started, &rx).await;
        assert_eq!(r.metrics.processed.load(Relaxed), 2, "both committed");
        assert_eq!(r.metrics.cancelled.load(Relaxed), 0);
        // 20 s of work under a 3 s lease renewed every 1 s: about 20
        // renewals of the current message and 10 of the waiting one.
        let renewals = r.metrics.lease_renewals.load(Relaxed);
        assert!((25..=35).contains(&renewals), "{renewals} renewals");
        assert_eq!(rows(&store).await, 2);
        assert!(started.elapsed() >= Duration::from_secs(20));
    }

    /// A renewal that hangs (the store takes the call and never answers)
    /// does not keep the work going past the lease: it is cancelled before
    /// the lease could run out, whatever the call is doing.
    #[tokio::test(start_paused = true)]
    async fn a_renewal_that_hangs_past_the_lease_cancels_the_work_in_time() {
        let (_dir, base) = store();
        let plan = FaultPlan {
            renewal_delay: Some(Duration::from_secs(3600)),
            ..FaultPlan::default()
        };
        let (faulty, counts) = FaultyStore::new(base.clone(), plan);
        let store: Arc<dyn Store> = Arc::new(faulty);
        let lease = Duration::from_secs(9);
        let batch = leased(&store, 1, lease).await;
        let r = runner(&store, slow_writer(Duration::from_secs(60)), lease);
        let rx = crate::shutdown::Shutdown::never();
        let started = tokio::time::Instant::now();
        r.process_batch(&batch, started, &rx).await;
        assert_eq!(r.metrics.cancelled.load(Relaxed), 1, "the work was cancelled");
        assert_eq!(r.metrics.processed.load(Relaxed), 0);
        assert_eq!(rows(&base).await, 0, "nothing committed");
        assert_eq!(counts.renewals.load(Relaxed), 1, "one renewal, which never answered");
        // Cancelled at the lease's end less a tenth (8.1 s), not an hour on.
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(8000) && took < lease, "{took:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_message_whose_lease_cannot_be_renewed_is_cancelled_and_commits_nothing() {
        let (_dir, base) = store();
        let plan = FaultPlan {
            renewals_fail: true,
            ..FaultPlan::default()
        };
        let (faulty, counts) = FaultyStore::new(base.clone(), plan);
        let store: Arc<dyn Store> = Arc::new(faulty);
        let lease = Duration::from_secs(3);
        let batch = leased(&store, 1, lease).await;
        let r = runner(&store, slow_writer(Duration::from_secs(60)), lease);
        let rx = crate::shutdown::Shutdown::never();
        let started = tokio::time::Instant::now();
        r.process_batch(&batch, started, &rx).await;
        assert_eq!(r.metrics.cancelled.load(Relaxed), 1, "the work was cancelled");
        assert_eq!(r.metrics.processed.load(Relaxed), 0);
        assert_eq!(rows(&base).await, 0, "nothing committed");
        assert!(counts.renewals.load(Relaxed) >= 2, "renewals were tried");
        // Cancelled before the lease ran out (at most lease - lease/10 in).
        assert!(started.elapsed() < lease, "{:?}", started.elapsed());
        // The message stays on its queue for the next lease holder.
        assert_eq!(base.stats().await.unwrap().queues[0].leased, 1);
    }
}
