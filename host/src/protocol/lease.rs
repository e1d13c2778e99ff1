//! Lease coalescing: the workers of a queue that need messages at the same
//! time get them from one lease transaction.
//!
//! A worker asks for as many messages as its pace allows ([`super::worker`]).
//! The requests wait in the queue's [`LeaseGroup`]; one lease transaction of
//! the queue runs at a time, and the worker that gets its turn leases the sum
//! of every waiting request and hands each its share (first asked, first
//! served; a share may be short or empty when the queue holds less). A
//! worker whose request was served while it waited for the turn takes its
//! share and never leases itself. On the Spanner emulator the requests are
//! gathered after the transaction's turn came
//! ([`Store::message_lease_collected`]), so those made while it waited join.
//!
//! Why: on the Spanner emulator, which runs one read-write transaction at a
//! time, three hosts lease in smaller batches than one (each worker's pace
//! slows as the hosts take turns), so lease transactions per message grew
//! with the hosts and three hosts drained slower than one. Coalesced, a
//! host's workers cost one lease transaction per round, whatever the pace.
//! On SQLite it saves write transactions in the single writer. Each leased
//! message keeps its own lease token, so what a worker does with its share
//! (renew, ack, release) is unchanged.

use crate::gather::Gather;
use crate::store::{LeasedMessage, Store, StoreResult};
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::oneshot;

type Share = StoreResult<Vec<LeasedMessage>>;

/// The lease requests of one queue's workers (see the module docs).
#[derive(Default)]
pub(super) struct LeaseGroup {
    /// Requests no leader has taken yet: how many messages each wants.
    waiting: Gather<usize, Share>,
    /// Held while this queue's lease transaction is in flight.
    turn: tokio::sync::Mutex<()>,
}

/// A worker's answer from [`LeaseGroup::lease`].
pub(super) struct Leased {
    pub share: Share,
    /// This worker ran the lease transaction: an error is its to report
    /// (the others got the same error and only back off).
    pub led: bool,
}

impl LeaseGroup {
    /// Up to `limit` messages of `queue`, leased for `lease`, from this
    /// worker's own lease transaction or another worker's.
    pub(super) async fn lease(&self, store: &dyn Store, queue: &str, limit: usize, lease: Duration) -> Leased {
        let mut rx = self.waiting.push(limit);
        let turn = tokio::select! {
            biased;
            share = &mut rx => return Leased { share: share.unwrap_or_else(|_| Ok(Vec::new())), led: false },
            turn = self.turn.lock() => turn,
        };
        // A leader answers every request it took before it gives up the
        // turn: no answer here means this request is still waiting.
        match rx.try_recv() {
            Ok(share) => return Leased { share, led: false },
            Err(oneshot::error::TryRecvError::Closed) => {
                return Leased {
                    share: Ok(Vec::new()),
                    led: false,
                }
            }
            Err(oneshot::error::TryRecvError::Empty) => {}
        }
        // The store collects when the lease can start at once (after the
        // emulator's turn): the requests made until then join it.
        let collector = self.waiting.collector(usize::MAX);
        let wanted = Mutex::new(Vec::new());
        let collect = || {
            let mut wanted = wanted.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            wanted.extend(collector.take());
            wanted.iter().sum::<usize>().max(1)
        };
        let leased = store.message_lease_collected(queue, lease, &collect).await;
        if collector.is_empty() {
            // The store failed before it collected: these requests get its answer.
            collect();
        }
        match leased {
            Ok(messages) => {
                // First asked, first served; a requester that is gone (shut
                // down) leaves its share leased: the lease expires and the
                // messages come back.
                let mut messages = messages.into_iter();
                let wanted = wanted.into_inner().unwrap_or_else(|poisoned| poisoned.into_inner());
                let shares: Vec<Share> = wanted.iter().map(|&n| Ok(messages.by_ref().take(n).collect())).collect();
                collector.answer(shares, || Ok(Vec::new()));
            }
            Err(e) => collector.answer(std::iter::empty(), || Err(e.clone())),
        }
        drop(turn);
        let share = rx.try_recv().unwrap_or_else(|_| Ok(Vec::new()));
        Leased { share, led: true }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::super::testing::{send, store};
    use super::LeaseGroup;
    use crate::store::faulty::{FaultPlan, FaultyStore};
    use crate::store::Store;
    use std::collections::BTreeSet;
    use std::sync::atomic::Ordering::Relaxed;
    use std::sync::Arc;
    use std::time::Duration;

    const LEASE: Duration = Duration::from_secs(30);

    /// A store whose leases take 100 ms, and its lease count.
    fn slow_leases() -> (tempfile::TempDir, Arc<dyn Store>, Arc<crate::store::faulty::FaultCounts>) {
        let (dir, base) = store();
        let plan = FaultPlan {
            lease_delay: Some(Duration::from_millis(100)),
            ..FaultPlan::default()
        };
        let (faulty, counts) = FaultyStore::new(base, plan);
        (dir, Arc::new(faulty), counts)
    }

    /// Ask for `limits` at once, each from its own task; the shares in the
    /// order asked.
    async fn ask(group: &Arc<LeaseGroup>, store: &Arc<dyn Store>, limits: &[usize]) -> Vec<(Vec<String>, bool)> {
        let tasks: Vec<_> = limits
            .iter()
            .map(|&n| {
                let (group, store) = (group.clone(), store.clone());
                tokio::spawn(async move {
                    let l = group.lease(store.as_ref(), "q", n, LEASE).await;
                    (l.share.unwrap().into_iter().map(|m| m.message.id).collect::<Vec<_>>(), l.led)
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    }

    /// Eight workers asking while a lease is in flight get their shares
    /// from one more lease transaction, not eight; no message is handed
    /// out twice.
    #[tokio::test(start_paused = true)]
    async fn workers_asking_together_share_one_lease_transaction() {
        let (_dir, store, counts) = slow_leases();
        send(&store, 30).await;
        let group = Arc::new(LeaseGroup::default());
        let shares = ask(&group, &store, &[2; 8]).await;
        // The first asker leases alone (nobody waited yet); the other seven
        // queued behind it and the next turn served them all.
        assert_eq!(counts.leases.load(Relaxed), 2);
        assert_eq!(shares.iter().filter(|(_, led)| *led).count(), 2);
        let ids: Vec<&String> = shares.iter().flat_map(|(ids, _)| ids).collect();
        assert!(shares.iter().all(|(ids, _)| ids.len() == 2), "{shares:?}");
        assert_eq!(ids.iter().collect::<BTreeSet<_>>().len(), 16, "a message leased twice: {shares:?}");
    }

    /// When the queue holds less than the sum asked, the first askers get
    /// full shares, a later one a short share, and the rest nothing (the
    /// queue is empty for them).
    #[tokio::test(start_paused = true)]
    async fn a_short_queue_serves_the_first_askers_first() {
        let (_dir, store, counts) = slow_leases();
        send(&store, 7).await;
        let group = Arc::new(LeaseGroup::default());
        let shares: Vec<usize> = ask(&group, &store, &[2, 3, 3, 3, 3])
            .await
            .into_iter()
            .map(|(ids, _)| ids.len())
            .collect();
        assert_eq!(shares, [2, 3, 2, 0, 0]);
        assert_eq!(counts.leases.load(Relaxed), 2);
    }
}
