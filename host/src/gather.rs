//! Requests served together by whoever's turn it is.
//!
//! Callers [`push`](Gather::push) a request and wait for its answer. The
//! one serving them (the worker whose turn it is to lease)
//! makes a [`Collector`] and calls [`Collector::take`] at the last moment,
//! once the store can start at once (on the Spanner emulator: once its
//! turn came), so requests made while it waited join; then it answers
//! each taken request, in order, with [`Collector::answer`].
//!
//! Used by the lease coalescing (`protocol::lease`). (The group commit
//! keeps its own channel of jobs: on it, a committer that took commits
//! from a `Gather` committed batches half the size, measured with the
//! demo, and lost a tenth of its throughput.) A leaf: it imports nothing
//! of onceq's.

use std::collections::VecDeque;
use std::sync::Mutex;
use tokio::sync::oneshot;

/// Requests waiting to be served, oldest first.
pub struct Gather<Req, Resp> {
    waiting: Mutex<VecDeque<(Req, oneshot::Sender<Resp>)>>,
}

impl<Req, Resp> Default for Gather<Req, Resp> {
    fn default() -> Self {
        Gather {
            waiting: Mutex::new(VecDeque::new()),
        }
    }
}

impl<Req, Resp> Gather<Req, Resp> {
    /// Queue `req`; its answer comes through the receiver (closed if the
    /// request was dropped unanswered).
    pub fn push(&self, req: Req) -> oneshot::Receiver<Resp> {
        let (tx, rx) = oneshot::channel();
        self.waiting().push_back((req, tx));
        rx
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.waiting().is_empty()
    }

    /// A collector taking at most `max` requests.
    pub fn collector(&self, max: usize) -> Collector<'_, Req, Resp> {
        Collector {
            gather: self,
            max,
            taken: Mutex::new(Vec::new()),
        }
    }

    fn waiting(&self) -> std::sync::MutexGuard<'_, VecDeque<(Req, oneshot::Sender<Resp>)>> {
        // Nothing panics while holding it; a poisoned queue is still whole.
        self.waiting.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// What one server took from a [`Gather`], and owes answers to.
pub struct Collector<'g, Req, Resp> {
    gather: &'g Gather<Req, Resp>,
    max: usize,
    taken: Mutex<Vec<oneshot::Sender<Resp>>>,
}

impl<Req, Resp> Collector<'_, Req, Resp> {
    /// Take what waits now (up to what is left of `max`), oldest first;
    /// an answer is owed to each. Called when the serving can start at
    /// once; may be called again (a request made since joins).
    pub fn take(&self) -> Vec<Req> {
        let mut taken = self.taken.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let room = self.max.saturating_sub(taken.len());
        let mut waiting = self.gather.waiting();
        let n = room.min(waiting.len());
        let mut out = Vec::with_capacity(n);
        for (req, tx) in waiting.drain(..n) {
            out.push(req);
            taken.push(tx);
        }
        out
    }

    /// How many requests were taken.
    pub fn len(&self) -> usize {
        self.taken.lock().map_or(0, |t| t.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Answer the taken requests in the order taken: one answer each from
    /// `answers`, and `rest()` for those it leaves without one. A requester
    /// that is gone is skipped.
    pub fn answer(self, answers: impl IntoIterator<Item = Resp>, mut rest: impl FnMut() -> Resp) {
        let taken = self.taken.into_inner().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut answers = answers.into_iter();
        for tx in taken {
            let _ = tx.send(answers.next().unwrap_or_else(&mut rest));
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;

    #[tokio::test]
    async fn requests_made_before_the_take_join_and_each_gets_its_own_answer() {
        let g: Gather<u32, u32> = Gather::default();
        let a = g.push(1);
        let c = g.collector(10);
        let b = g.push(2); // made after the collector, before the take: joins
        assert_eq!(c.take(), vec![1, 2]);
        let late = g.push(3); // after the take: waits for the next one
        c.answer([10, 20], || 0);
        assert_eq!((a.await.unwrap(), b.await.unwrap()), (10, 20));
        assert!(!g.is_empty());
        let c = g.collector(10);
        assert_eq!(c.take(), vec![3]);
        c.answer([], || 99);
        assert_eq!(late.await.unwrap(), 99, "no answer given: the rest's");
    }

    #[tokio::test]
    async fn at_most_max_oldest_first() {
        let g: Gather<u32, ()> = Gather::default();
        let _r: Vec<_> = (100..101).chain(0..5).map(|i| g.push(i)).collect();
        let c = g.collector(3);
        assert_eq!(c.take(), vec![100, 0, 1]);
        assert_eq!(c.take(), Vec::<u32>::new(), "max reached");
        assert_eq!(c.len(), 3);
        c.answer([(), (), ()], || ());
        assert_eq!(g.collector(10).take(), vec![2, 3, 4]);
    }

    #[tokio::test]
    async fn a_request_dropped_unanswered_closes_its_receiver() {
        let g: Gather<u32, u32> = Gather::default();
        let r = g.push(1);
        drop(g);
        assert!(r.await.is_err());
    }
}
