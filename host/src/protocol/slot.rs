//! Where one message of a worker's batch is ([`Slot`]), shared by the
//! worker (which starts the messages in order), the lease renewal (which
//! renews those still waiting or being handled) and the attempt (which
//! says when a commit starts and ends).
//!
//! Its state is one small value behind a lock, with a [`Notify`] beside
//! it, so whoever waits on a
//! change (the next message waiting for this one to move on, a handler to
//! be cancelled when its lease is lost) is woken by the change itself:
//!
//! ```text
//! waiting/handling --commit_started--> committing --commit_ended--> handling (a re-run)
//!        |                                  |                           |
//!        +------------- lose ---------------+---- lose (its ack decides) +
//!        |
//!        +--end--> ended (an outcome, skipped, cancelled or released)
//! ```
//!
//! A message *moves on* (the one after it may start) when its first commit
//! starts or it ends; it is *cancelled* when its lease is lost while no
//! commit of it is in flight.

use std::sync::Arc;
use tokio::sync::{Notify, Semaphore, SemaphorePermit};

/// A message's state, as one value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct State {
    /// A commit of it is in flight: renewal leaves it alone, its ack
    /// decides.
    pub committing: bool,
    /// Its first commit started, or it ended: the message after it may
    /// start.
    pub moved_on: bool,
    /// Its lease is gone (or could not be renewed in time).
    pub lost: bool,
    /// It reached an outcome of its own (not skipped or cancelled).
    pub done: bool,
    /// It ended, one way or another.
    pub ended: bool,
    /// A commit of it had an unknown outcome: if its work is cancelled
    /// now, whether that commit landed must be asked of the store
    /// ([`super::QueueRunner::resolve_uncertain`]).
    pub uncertain: bool,
}

/// See the module docs.
#[derive(Debug)]
pub(super) struct Slot {
    /// Changed only by [`Slot::modify`], which wakes every waiter. (A watch
    /// channel did the same: its send wakes eight shards of waiters, each
    /// behind a lock of its own, three times a message; about 2% of the
    /// workers' time in a CLI run.)
    state: std::sync::Mutex<State>,
    changed: Notify,
    /// The worker's handler turn, shared by the slots of a batch: held from
    /// an attempt's start to its commit, so a worker never runs two
    /// handlers at once (a re-run waits for the next message's handler),
    /// nor holds more than one live instance (`runtime.max_instances`).
    /// A handler that runs together (the outbox's dispatcher) has as many
    /// turns as messages going.
    turn: Arc<Semaphore>,
}

impl Default for Slot {
    fn default() -> Slot {
        Slot::taking_turns(Arc::new(Semaphore::new(1)))
    }
}

impl Slot {
    pub(super) fn taking_turns(turn: Arc<Semaphore>) -> Slot {
        Slot {
            state: Default::default(),
            changed: Notify::new(),
            turn,
        }
    }

    pub(super) fn state(&self) -> State {
        // Nothing panics while holding it; a poisoned state is still whole.
        *self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn modify(&self, f: impl FnOnce(&mut State)) {
        f(&mut self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        self.changed.notify_waiters();
    }

    /// Wait until `ready` holds: registered for the next change before
    /// looking, so a change between the look and the wait is not missed.
    async fn wait_for(&self, ready: impl Fn(&State) -> bool) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if ready(&self.state()) {
                return;
            }
            changed.await;
        }
    }

    /// Wait for the worker's handler turn (see `turn`); `None` if the turn
    /// is closed, which never happens (then no turn is taken).
    pub(super) async fn handler_turn(&self) -> Option<SemaphorePermit<'_>> {
        self.turn.acquire().await.ok()
    }

    /// A commit of this message starts.
    pub(super) fn commit_started(&self) {
        self.modify(|s| {
            s.committing = true;
            s.moved_on = true;
        });
    }

    /// Its commit ended (whatever the result).
    pub(super) fn commit_ended(&self) {
        self.modify(|s| s.committing = false);
    }

    /// A commit of it had an unknown outcome.
    pub(super) fn uncertain(&self) {
        self.modify(|s| s.uncertain = true);
    }

    /// Its lease is gone.
    pub(super) fn lose(&self) {
        self.modify(|s| s.lost = true);
    }

    /// It ended; `done` if with an outcome of its own.
    pub(super) fn end(&self, done: bool) {
        self.modify(|s| {
            s.ended = true;
            s.moved_on = true;
            s.done |= done;
        });
    }

    /// Its lease is still to be renewed: not ended, lost or committing.
    pub(super) fn needs_renewal(&self) -> bool {
        let s = self.state();
        !(s.ended || s.lost || s.committing)
    }

    /// Lost its lease before an outcome of its own.
    pub(super) fn lost_before_outcome(&self) -> bool {
        let s = self.state();
        s.lost && !s.done
    }

    /// Wait until it moved on.
    pub(super) async fn moved_on(&self) {
        self.wait_for(|s| s.moved_on).await;
    }

    /// Wait until its work must be cancelled: lease lost, no commit in
    /// flight.
    pub(super) async fn cancelled(&self) {
        self.wait_for(|s| s.lost && !s.committing).await;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use std::time::Duration;

    async fn within(f: impl std::future::Future<Output = ()>) -> bool {
        tokio::time::timeout(Duration::from_secs(1), f).await.is_ok()
    }

    #[tokio::test(start_paused = true)]
    async fn the_next_message_starts_once_this_one_commits_or_ends() {
        let a = Slot::default();
        assert!(!within(a.moved_on()).await, "waiting: not moved on");
        a.commit_started();
        assert!(within(a.moved_on()).await);
        a.commit_ended();
        assert!(
            within(a.moved_on()).await,
            "a re-run after a commit does not hold the next one back again"
        );
        let b = Slot::default();
        b.end(false);
        assert!(within(b.moved_on()).await, "skipped: moved on");
    }

    #[tokio::test(start_paused = true)]
    async fn a_lost_lease_cancels_only_when_no_commit_is_in_flight() {
        let s = Slot::default();
        s.commit_started();
        s.lose();
        assert!(!within(s.cancelled()).await, "its ack decides");
        assert!(!s.needs_renewal());
        s.commit_ended();
        assert!(within(s.cancelled()).await, "then, with no commit going, it is cancelled");
        assert!(s.lost_before_outcome());
        let done = Slot::default();
        done.end(true);
        done.lose();
        assert!(!done.lost_before_outcome(), "an outcome reached before the loss counts");
    }

    #[tokio::test(start_paused = true)]
    async fn renewal_is_for_messages_waiting_or_handled() {
        let s = Slot::default();
        assert!(s.needs_renewal());
        s.commit_started();
        assert!(!s.needs_renewal());
        s.commit_ended();
        assert!(s.needs_renewal(), "a re-run is handled again");
        s.end(true);
        assert!(!s.needs_renewal());
    }

    #[tokio::test(start_paused = true)]
    async fn one_handler_at_a_time_per_worker() {
        let turn = Arc::new(Semaphore::new(1));
        let (a, b) = (Slot::taking_turns(turn.clone()), Slot::taking_turns(turn));
        let held = a.handler_turn().await.unwrap();
        assert!(tokio::time::timeout(Duration::from_secs(1), b.handler_turn()).await.is_err());
        drop(held);
        assert!(b.handler_turn().await.is_some());
    }
}
