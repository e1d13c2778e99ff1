//! The worker loop: lease a batch, process it in order with the leases of
//! the waiting messages renewed ([`super::renew`]), release what is left at
//! shutdown, back off while the queue is empty.

use super::{jittered, sleep_or_shutdown, QueueRunner};
use crate::store::{LeaseParams, LeasedMessage};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, warn};

impl QueueRunner {
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

    pub(super) async fn worker(&self, n: usize, mut shutdown: watch::Receiver<bool>) {
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
                    self.metrics.store_error(&e);
                    warn!(queue = %self.spec.name, class = e.class(), "lease failed: {e}");
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
    pub(super) async fn process_batch(&self, batch: &[LeasedMessage], leased_at: Instant, shutdown: &watch::Receiver<bool>) {
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
