//! Handoff: a follow-up or an outbox intent bound for a queue this host
//! works skips the table's lease.
//!
//! Without it such a message is inserted ready, and a worker of the target
//! queue leases it from the table (an update of its row, in a write
//! transaction of its own) after the queue's next poll. With it (SQLite,
//! `commit.handoff`, on by default):
//!
//! 1. While the producing message's effects are buffered, a send bound for
//!    a queue of this host's, not delayed, not paused, whose [`Inbox`] has
//!    room, gets a [`Handoff`]: a lease token and the target queue's lease
//!    length. The store inserts the message *already leased* with them
//!    (first delivery), in the producer's transaction, and tells the
//!    handoff what it wrote.
//! 2. Once that transaction committed, the message goes to the target
//!    queue's inbox as a [`LeasedMessage`], and a worker of that queue
//!    takes it as it would a leased batch: processed, renewed, acked (its
//!    ack deletes the row, guarded by the token), retried or
//!    dead-lettered exactly as one leased from the table.
//!
//! The table stays the source of truth; memory only saves the lease. The
//! windows where the two part:
//!
//! - **crash after the commit** (before or after the inbox, before the
//!   ack): the row is leased to a host that is gone. Its lease expires
//!   (the target queue's `lease`) and any host leases it from the table, as
//!   after a crash mid-lease. Its first delivery counts as one.
//! - **unknown commit outcome**: the producer never hands over what an
//!   uncertain commit may have written. It releases each such message by
//!   its token at once (a no-op where the commit did not land) and re-runs
//!   as always; the re-run's own sends are fresh messages, and if the first
//!   commit had landed, its ack fails and the re-run writes nothing.
//! - **a batch re-committed one message at a time**: the store clears what
//!   an application told the handoff before each new one, so only the
//!   insert of the application that committed is handed over.
//! - **a duplicate** (an intent's key already held): nothing is inserted,
//!   nothing handed over.
//! - **shutdown, pause**: an inbox closed at shutdown, or holding messages
//!   when its queue is paused, releases them to the table (token-guarded,
//!   the delivery uncounted); a send finding the inbox closed releases its
//!   message the same way.
//! - **a slow taker**: a message waits in the inbox with its lease running
//!   from before the commit; the worker that takes it renews from that
//!   time, and a lease that ran out meanwhile is found lost by the renewal
//!   (token-guarded) and skipped, as for a batch leased from the table.
//!
//! An inbox holds at most a queue's `workers` × `batch` messages (reserved
//! before the commit, so it never overflows); past that, sends are
//! inserted ready and leased from the table. One lease in eight of a
//! worker goes to the table first even while its inbox has messages, so
//! messages that are only in the table (sent by producers, retried,
//! expired) are never starved by a stream of handoffs.

use crate::store::{HandedOff, Handoff, Lease, LeasedMessage, SendParams};
use crate::value::Message;
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::QueueRunner;

/// Leased messages handed to one queue's workers in memory.
#[derive(Default)]
pub(super) struct Inbox {
    state: Mutex<State>,
    /// Places taken: reserved by a send not yet committed, or holding a
    /// message not yet taken.
    taken: AtomicUsize,
    /// Signalled when a message arrives (an idle worker stops waiting).
    pub(super) arrived: Notify,
}

#[derive(Default)]
struct State {
    waiting: VecDeque<(LeasedMessage, Instant)>,
    closed: bool,
}

/// A place in an [`Inbox`], given back when dropped unless a message
/// took it ([`Inbox::push`]; then given back when the message is taken).
pub(super) struct Place(Option<Arc<Inbox>>);

impl Drop for Place {
    fn drop(&mut self) {
        if let Some(inbox) = self.0.take() {
            inbox.taken.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Inbox {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place, if fewer than `capacity` are taken and the inbox is open.
    fn reserve(self: &Arc<Self>, capacity: usize) -> Option<Place> {
        if self.state().closed {
            return None;
        }
        self.taken
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < capacity).then_some(n + 1))
            .ok()
            .map(|_| Place(Some(self.clone())))
    }

    /// Hand `lm` (leased at `at`) to a worker; given back if the inbox
    /// closed. Its place is given back when a worker takes it.
    fn push(&self, lm: LeasedMessage, at: Instant, mut place: Place) -> Option<LeasedMessage> {
        {
            let mut s = self.state();
            if s.closed {
                return Some(lm);
            }
            s.waiting.push_back((lm, at));
            // The place stays taken until the message is.
            place.0 = None;
        }
        self.arrived.notify_one();
        None
    }

    /// Up to `limit` messages, first handed first, and when the oldest
    /// of them was leased; `None` if there are none.
    pub(super) fn take(&self, limit: usize) -> Option<(Vec<LeasedMessage>, Instant)> {
        let mut s = self.state();
        let n = s.waiting.len().min(limit.max(1));
        if n == 0 {
            return None;
        }
        let mut oldest = None;
        let batch: Vec<LeasedMessage> = s
            .waiting
            .drain(..n)
            .map(|(lm, at)| {
                oldest = Some(oldest.map_or(at, |o: Instant| o.min(at)));
                lm
            })
            .collect();
        drop(s);
        self.taken.fetch_sub(batch.len(), Ordering::AcqRel);
        Some((batch, oldest.unwrap_or_else(Instant::now)))
    }

    /// Everything waiting; with `close`, nothing is accepted from now on.
    pub(super) fn drain(&self, close: bool) -> Vec<LeasedMessage> {
        let mut s = self.state();
        s.closed |= close;
        let all: Vec<LeasedMessage> = s.waiting.drain(..).map(|(lm, _)| lm).collect();
        drop(s);
        self.taken.fetch_sub(all.len(), Ordering::AcqRel);
        all
    }

    pub(super) fn is_empty(&self) -> bool {
        self.state().waiting.is_empty()
    }
}

/// The queues of one host that take handoffs, by name.
#[derive(Default)]
pub(super) struct Targets(BTreeMap<String, Weak<QueueRunner>>);

impl Targets {
    pub(super) fn of(runners: &[Arc<QueueRunner>]) -> Arc<Targets> {
        Arc::new(Targets(runners.iter().map(|r| (r.spec.name.clone(), Arc::downgrade(r))).collect()))
    }
}

/// A send of the message being committed that is to be handed over.
pub(super) struct Handing {
    handoff: Arc<Handoff>,
    target: Arc<QueueRunner>,
    place: Place,
    queue: String,
    payload: Vec<u8>,
    attributes: Vec<(String, String)>,
    /// Before the insert: the lease runs from no earlier than this.
    at: Instant,
}

impl QueueRunner {
    /// Mark `p` to be inserted leased and handed over, if it goes to a
    /// queue of this host that can take it now.
    pub(super) fn hand(&self, p: &mut SendParams) -> Option<Handing> {
        if !p.delay.is_zero() || p.handoff.is_some() {
            return None;
        }
        let target = self.handoffs.get()?.0.get(&p.queue)?.upgrade()?;
        if target.is_paused() {
            return None;
        }
        let policy = &target.spec.policy;
        let place = target.inbox.reserve(policy.workers.max(1) * policy.batch.max(1))?;
        let handoff = Arc::new(Handoff::new(policy.lease));
        p.handoff = Some(handoff.clone());
        Some(Handing {
            handoff,
            target,
            place,
            queue: p.queue.clone(),
            payload: p.payload.clone(),
            attributes: p.attributes.clone(),
            at: Instant::now(),
        })
    }

    /// The producer's commit succeeded: every send it inserted leased goes
    /// to its queue's inbox.
    pub(super) async fn handed(&self, handing: Vec<Handing>) {
        for h in handing {
            let Some(HandedOff {
                id,
                enqueued_at,
                lease_until,
            }) = h.handoff.landed()
            else {
                continue; // a duplicate: nothing inserted
            };
            let lm = LeasedMessage {
                message: Message {
                    id: id.clone(),
                    queue: h.queue.clone(),
                    payload: h.payload,
                    attributes: h.attributes,
                    attempt: 1,
                    enqueued_at,
                },
                lease: Lease {
                    queue: h.queue,
                    message_id: id,
                    shard: 0,
                    token: h.handoff.token.clone(),
                },
                lease_until,
                failures: 0,
            };
            match h.target.inbox.push(lm, h.at, h.place) {
                None => {
                    h.target.metrics.handed_off.fetch_add(1, Ordering::Relaxed);
                }
                Some(lm) => h.target.release(&lm).await,
            }
        }
    }

    /// The producer's commit failed. After an unknown outcome, what it
    /// may have inserted leased is released (a no-op where it did not
    /// land): never handed over from an uncertain commit.
    pub(super) async fn not_handed(&self, handing: Vec<Handing>, unknown: bool) {
        if !unknown {
            return;
        }
        for h in handing {
            let Some(landed) = h.handoff.landed() else { continue };
            let lease = Lease {
                queue: h.queue,
                message_id: landed.id,
                shard: 0,
                token: h.handoff.token.clone(),
            };
            if let Err(e) = self.store.message_release(&lease).await {
                // Not there (the commit did not land) or the store failed:
                // either way the lease expires and the table has it.
                tracing::debug!(message_id = %lease.message_id, "release of a handoff after an unknown outcome: {e}");
            }
        }
    }

    /// Release what waits in this queue's inbox (paused, or at shutdown
    /// with `close`): back to the table, the delivery uncounted.
    pub(super) async fn release_inbox(&self, close: bool) {
        for lm in self.inbox.drain(close) {
            self.release(&lm).await;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::super::testing::{rows, send, store, DDL};
    use super::super::{run_queues, Grants, HandleOutput, Handler, NativeHandler, QueueRunner};
    use super::Targets;
    use crate::store::faulty::{FaultPlan, FaultyStore};
    use crate::store::sqlite::SqliteStore;
    use crate::store::{LeaseParams, Store, StoreOptions};
    use crate::value::{Effect, FollowUp, Intent, RowWrite, Value, WriteOp};
    use std::sync::atomic::Ordering::Relaxed;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    const LEASE: Duration = Duration::from_secs(30);

    fn row(id: &str) -> Effect {
        Effect::Write(RowWrite {
            table: "t".into(),
            op: WriteOp::Insert,
            columns: vec![("id".into(), Value::String(id.to_string())), ("n".into(), Value::Int64(1))],
        })
    }

    /// Writes its row and sends one follow-up to `next`.
    fn producer() -> Arc<dyn Handler> {
        Arc::new(NativeHandler::new("producer", |m, scope| async move {
            let next = Effect::Enqueue(FollowUp {
                queue: "next".into(),
                payload: m.payload.clone(),
                attributes: vec![],
                delay_ms: None,
                dedup_key: None,
            });
            HandleOutput {
                scope,
                result: Ok(vec![row(&m.id), next]),
            }
        }))
    }

    /// Emits an intent with key `k` for connector `c`.
    fn intent_emitter() -> Arc<dyn Handler> {
        Arc::new(NativeHandler::new("intents", |_m, scope| async move {
            let intent = Effect::Intent(Intent {
                connector: "c".into(),
                idempotency_key: "k".into(),
                payload: b"{}".to_vec(),
                metadata: vec![],
            });
            HandleOutput {
                scope,
                result: Ok(vec![intent]),
            }
        }))
    }

    /// Writes its row and records (payload, delivery) of each message.
    fn consumer(seen: Arc<Mutex<Vec<(String, u32)>>>) -> Arc<dyn Handler> {
        Arc::new(NativeHandler::new("consumer", move |m, scope| {
            seen.lock()
                .unwrap()
                .push((String::from_utf8_lossy(&m.payload).into_owned(), m.attempt));
            async move {
                HandleOutput {
                    scope,
                    result: Ok(vec![row(&m.id)]),
                }
            }
        }))
    }

    fn runner(store: &Arc<dyn Store>, name: &str, handler: Arc<dyn Handler>) -> Arc<QueueRunner> {
        let r = super::super::testing::runner(store, handler, LEASE);
        let mut spec = Arc::into_inner(r).unwrap().spec;
        spec.name = name.into();
        spec.grants = Grants {
            tables: ["t".to_string()].into(),
            queues: ["next".to_string()].into(),
            connectors: ["c".to_string()].into(),
        };
        Arc::new(QueueRunner::new(spec, store.clone()))
    }

    /// Run `runners` until no work is left (a minute at most).
    async fn drain(store: &Arc<dyn Store>, runners: &[Arc<QueueRunner>]) {
        let (stop, _rx) = crate::shutdown::channel();
        let run = run_queues(store.clone(), runners.to_vec(), stop, true);
        tokio::time::timeout(Duration::from_secs(60), run)
            .await
            .expect("work left after a minute");
    }

    /// Follow-ups for a queue of the same host reach its workers from
    /// memory: each processed once, on its first delivery, nothing left
    /// in the table; with `commit.handoff = false`, all from the table.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn follow_ups_for_a_queue_of_this_host_are_handed_over_in_memory() {
        for handoff in [true, false] {
            let dir = tempfile::tempdir().unwrap();
            let mut options = StoreOptions::default();
            options.commit.handoff = handoff;
            let store: Arc<dyn Store> = Arc::new(SqliteStore::init(&dir.path().join("t.db"), DDL, &options).unwrap());
            let seen = Arc::new(Mutex::new(Vec::new()));
            let (q, next) = (runner(&store, "q", producer()), runner(&store, "next", consumer(seen.clone())));
            send(&store, 40).await;
            drain(&store, &[q.clone(), next.clone()]).await;

            let mut payloads: Vec<String> = seen.lock().unwrap().iter().map(|(p, _)| p.clone()).collect();
            payloads.sort_by_key(|p| p.parse::<u32>().unwrap());
            let expected: Vec<String> = (0..40).map(|i| i.to_string()).collect();
            assert_eq!(payloads, expected, "each follow-up processed once (handoff {handoff})");
            assert!(seen.lock().unwrap().iter().all(|&(_, delivery)| delivery == 1));
            assert_eq!(rows(&store).await, 80);
            assert_eq!(
                store.stats().await.unwrap().queues.iter().map(|q| q.ready + q.leased).sum::<u64>(),
                0
            );
            let handed = next.metrics.handed_off.load(Relaxed);
            if handoff {
                assert!(handed > 0, "no follow-up was handed over");
            } else {
                assert_eq!(handed, 0);
            }
            assert_eq!(next.metrics.processed.load(Relaxed), 40);
        }
    }

    /// A commit whose outcome is unknown hands nothing over: what it
    /// inserted leased is released at once and leased from the table, so
    /// the follow-up is processed once, on its first counted delivery
    /// (not after its lease ran out).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unknown_outcome_hands_nothing_over_and_releases_what_landed() {
        let (_dir, base) = store();
        let plan = FaultPlan {
            after_commit: 1.0,
            limit: Some(1),
            ..FaultPlan::default()
        };
        let (faulty, counts) = FaultyStore::new(base.clone(), plan);
        let store: Arc<dyn Store> = Arc::new(faulty);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (q, next) = (runner(&store, "q", producer()), runner(&store, "next", consumer(seen.clone())));
        send(&store, 1).await;
        let started = std::time::Instant::now();
        drain(&store, &[q.clone(), next.clone()]).await;
        assert_eq!(counts.after_commit.load(Relaxed), 1, "the fault was injected");
        assert_eq!(q.metrics.already_committed.load(Relaxed), 1);
        assert_eq!(next.metrics.handed_off.load(Relaxed), 0);
        assert_eq!(*seen.lock().unwrap(), [("0".to_string(), 1)]);
        assert_eq!(rows(&base).await, 2);
        assert!(started.elapsed() < LEASE, "waited for the lease to run out");
    }

    /// What waits in an inbox when its queue stops goes back to the table,
    /// ready and its delivery uncounted; a send that finds the inbox
    /// closed is released the same way.
    #[tokio::test]
    async fn an_inbox_closed_at_shutdown_releases_what_waits_in_it() {
        let (_dir, store) = store();
        let (q, next) = (runner(&store, "q", producer()), runner(&store, "next", consumer(Arc::default())));
        let targets = Targets::of(&[q.clone(), next.clone()]);
        q.handoffs.set(targets).ok().unwrap();
        send(&store, 2).await;
        let leased = store
            .message_lease(LeaseParams {
                queue: "q".into(),
                limit: 2,
                lease: LEASE,
            })
            .await
            .unwrap();
        assert_eq!(q.process(&leased[0]).await, super::super::Outcome::Acked);
        assert_eq!(next.metrics.handed_off.load(Relaxed), 1);
        let waiting = next.inbox.take(8).unwrap().0;
        let got = store.message_get(&waiting[0].message.id).await.unwrap().unwrap();
        assert!(got.leased, "handed over leased");
        next.inbox
            .push(waiting[0].clone(), tokio::time::Instant::now(), next.inbox.reserve(8).unwrap());

        next.release_inbox(true).await;
        assert_eq!(next.inbox.taken.load(Relaxed), 0);
        let got = store.message_get(&waiting[0].message.id).await.unwrap().unwrap();
        assert!(!got.leased && got.deliveries == 0, "{got:?}");
        // Closed: the next follow-up is released by its producer.
        assert_eq!(q.process(&leased[1]).await, super::super::Outcome::Acked);
        assert_eq!(next.metrics.handed_off.load(Relaxed), 1);
        let ready = store
            .message_lease(LeaseParams {
                queue: "next".into(),
                limit: 8,
                lease: LEASE,
            })
            .await
            .unwrap();
        assert_eq!(ready.len(), 2, "both follow-ups ready in the table");
        assert!(ready.iter().all(|m| m.message.attempt == 1));
    }

    /// An intent whose key is already held inserts nothing and hands
    /// nothing over; its place in the inbox is given back.
    #[tokio::test]
    async fn a_duplicate_intent_is_not_handed_over() {
        let (_dir, store) = store();
        let outbox = crate::names::outbox_queue("c");
        let (q, dispatcher) = (
            runner(&store, "q", intent_emitter()),
            runner(&store, &outbox, consumer(Arc::default())),
        );
        q.handoffs.set(Targets::of(&[q.clone(), dispatcher.clone()])).ok().unwrap();
        send(&store, 2).await;
        let leased = store
            .message_lease(LeaseParams {
                queue: "q".into(),
                limit: 2,
                lease: LEASE,
            })
            .await
            .unwrap();
        for lm in &leased {
            assert_eq!(q.process(lm).await, super::super::Outcome::Acked);
        }
        assert_eq!(dispatcher.metrics.handed_off.load(Relaxed), 1);
        assert_eq!(dispatcher.inbox.taken.load(Relaxed), 1, "the duplicate's place was given back");
        let (batch, _) = dispatcher.inbox.take(8).unwrap();
        assert_eq!(batch.len(), 1);
        assert_eq!(batch[0].message.attributes.first().map(|(_, v)| v.as_str()), Some("k"));
        assert_eq!(dispatcher.inbox.taken.load(Relaxed), 0);
    }
}
