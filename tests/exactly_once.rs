//! Exactly-once under faults, on a real SQLite file: commits that land and
//! then report an unknown outcome, commits that never land, lease expiry
//! under a slow handler, handler retry/reject, poison messages.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use common::*;
use onceq::protocol::{HandleOutput, HandlerFailure, NativeHandler, Outcome};
use onceq::runtime::HandlerLimits;
use onceq::store::faulty::{FaultPlan, FaultyStore};
use onceq::store::{LeaseParams, Store};
use onceq::value::{Effect, RowWrite, Value, WriteOp};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

const ACCOUNTS: usize = 20;
const BALANCE: i64 = 1_000_000;

/// Orders, balances and charge intents after `n` payment messages: each
/// order applied exactly once, money conserved, one intent per order.
async fn assert_payments_exactly_once(db: &TestDb, n: usize) {
    check_payments_exactly_once(db.store.as_ref(), n, ACCOUNTS, BALANCE).await;
}

async fn payments_under_faults(
    plan: FaultPlan,
    n: usize,
) -> (TestDb, Arc<onceq::protocol::QueueRunner>, Arc<onceq::store::faulty::FaultCounts>) {
    let db = TestDb::new(PAYMENTS_SQL);
    seed_accounts(db.store.as_ref(), ACCOUNTS, BALANCE).await;
    db.send("payments", (0..n).map(|i| order(i, i % ACCOUNTS, 1 + (i as i64 % 50))))
        .await;
    let (faulty, counts) = FaultyStore::new(db.store.clone(), plan);
    let store: Arc<dyn Store> = Arc::new(faulty);
    let rt = runtime();
    let r = payments_runner(&store, &rt, policy(4, 5));
    drain(&store, std::slice::from_ref(&r)).await;
    (db, r, counts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_lands_then_errors_is_applied_once() {
    let n = 200;
    let (db, r, counts) = payments_under_faults(
        FaultPlan {
            after_commit: 0.3,
            seed: 1,
            ..Default::default()
        },
        n,
    )
    .await;
    let injected = counts.after_commit.load(Relaxed);
    assert!(injected >= 20, "expected many injected faults, got {injected}");
    assert_payments_exactly_once(&db, n).await;
    let m = &r.metrics;
    assert_eq!(
        m.already_committed.load(Relaxed),
        injected,
        "each landed-then-lost commit resolved as already committed"
    );
    assert_eq!(m.processed.load(Relaxed) + m.already_committed.load(Relaxed), n as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_fails_before_landing_is_applied_once() {
    let n = 200;
    let (db, r, counts) = payments_under_faults(
        FaultPlan {
            before_commit: 0.3,
            seed: 2,
            ..Default::default()
        },
        n,
    )
    .await;
    let injected = counts.before_commit.load(Relaxed);
    assert!(injected >= 20, "expected many injected faults, got {injected}");
    assert_payments_exactly_once(&db, n).await;
    let m = &r.metrics;
    assert_eq!(m.already_committed.load(Relaxed), 0, "nothing had landed");
    assert_eq!(m.processed.load(Relaxed), n as u64, "every message committed by a re-run");
    assert_eq!(m.unknown_outcomes.load(Relaxed), injected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_faults_and_concurrency_apply_each_order_once() {
    let n = 300;
    let (db, _r, counts) = payments_under_faults(
        FaultPlan {
            after_commit: 0.15,
            before_commit: 0.15,
            seed: 3,
            ..Default::default()
        },
        n,
    )
    .await;
    assert!(counts.total() > 30);
    assert_payments_exactly_once(&db, n).await;
}

/// Unknown outcomes on whole batches of the group commit: batches that
/// landed and batches that were dropped, each reported to every message in
/// it. Every message re-runs; its ack decides, per message, between
/// already committed and applied now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_commits_with_unknown_outcomes_apply_each_order_once() {
    use onceq::store::commit::CommitOptions;
    use onceq::store::faulty::BatchFaults;
    let n = 600; // enough batches for faults of both kinds on a busy machine
    let db = TestDb::with_options(
        PAYMENTS_SQL,
        onceq::store::StoreOptions {
            commit: CommitOptions {
                max_batch: 64,
                // Let the four workers' commits meet in one batch.
                max_wait: Duration::from_millis(5),
                faults: Some(BatchFaults {
                    after_commit: 0.2,
                    before_commit: 0.2,
                    aborted: 0.0,
                    refused: 0.0,
                    seed: 4,
                }),
                ..CommitOptions::default()
            },
            ..Default::default()
        },
    );
    seed_accounts(db.store.as_ref(), ACCOUNTS, BALANCE).await;
    db.send("payments", (0..n).map(|i| order(i, i % ACCOUNTS, 1 + (i as i64 % 50))))
        .await;
    let rt = runtime();
    let r = payments_runner(&db.store, &rt, policy(4, 5));
    drain(&db.store, std::slice::from_ref(&r)).await;
    assert_payments_exactly_once(&db, n).await;
    let f = &db.store.commit_stats().expect("the SQLite store groups its commits").faults;
    let (landed, landed_msgs) = (f.landed_batches.load(Relaxed), f.landed_messages.load(Relaxed));
    let (dropped, dropped_msgs) = (f.dropped_batches.load(Relaxed), f.dropped_messages.load(Relaxed));
    eprintln!("landed {landed} batches ({landed_msgs} messages), dropped {dropped} ({dropped_msgs})");
    // How many batches there are depends on how the workers' commits meet
    // (a busy machine makes fewer, larger ones): at least one of each.
    assert!(landed >= 1 && dropped >= 1, "faults injected on both sides");
    assert!(
        landed_msgs + dropped_msgs > landed + dropped,
        "some faulted batches held several messages"
    );
    let m = &r.metrics;
    assert_eq!(
        m.already_committed.load(Relaxed),
        landed_msgs,
        "each message of a landed batch found already committed"
    );
    assert_eq!(m.processed.load(Relaxed) + m.already_committed.load(Relaxed), n as u64);
}

/// An upsert: unlike an insert, a second application would not fail on a
/// duplicate key, so only the ack stands between a re-run and a double write.
fn log_write(id: &str, note: &str) -> Effect {
    Effect::Write(RowWrite {
        table: "chaos_log".into(),
        op: WriteOp::Upsert,
        columns: vec![("id".into(), Value::String(id.into())), ("note".into(), Value::String(note.into()))],
    })
}

/// A read-modify-write counter with upserts only: no key conflict can catch
/// a double application, so this proves the ack (delete guarded by the lease
/// token, asserting one row) rolls back a re-run whose first commit landed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counter_increments_exactly_once_per_message_under_unknown_outcomes() {
    let db = TestDb::new(CHAOS_SQL);
    let n = 150;
    db.send("count", (0..n).map(|_| chaos("count"))).await;
    let handler = Arc::new(NativeHandler::new("counter-v1", |_msg, mut scope| async move {
        let current = match scope.get("chaos_log", &[Value::String("counter".into())]).await {
            Ok(Some(row)) => match col(&row, "n") {
                Value::Int64(n) => *n,
                _ => 0,
            },
            Ok(None) => 0,
            Err(e) => {
                return HandleOutput {
                    scope,
                    result: Err(HandlerFailure::Crash(e.to_string())),
                }
            }
        };
        let write = Effect::Write(RowWrite {
            table: "chaos_log".into(),
            op: WriteOp::Upsert,
            columns: vec![
                ("id".into(), Value::String("counter".into())),
                ("n".into(), Value::Int64(current + 1)),
            ],
        });
        HandleOutput {
            scope,
            result: Ok(vec![write]),
        }
    }));
    let (faulty, counts) = FaultyStore::new(
        db.store.clone(),
        FaultPlan {
            after_commit: 0.25,
            before_commit: 0.1,
            seed: 4,
            ..Default::default()
        },
    );
    let store: Arc<dyn Store> = Arc::new(faulty);
    let r = runner(&store, "count", handler, grants(&["chaos_log"], &[], &[]), policy(3, 5));
    drain(&store, std::slice::from_ref(&r)).await;
    assert!(counts.after_commit.load(Relaxed) > 10, "faults were injected");
    assert_eq!(
        db.count("SELECT n FROM chaos_log WHERE id = 'counter'"),
        n as i64,
        "one increment per message"
    );
    assert_eq!(r.metrics.already_committed.load(Relaxed), counts.after_commit.load(Relaxed));
    assert!(
        r.metrics.aborted_reruns.load(Relaxed) > 0,
        "3 workers on one counter row conflict: reads are validated at commit"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_worker_after_lease_expiry_cannot_commit() {
    let db = TestDb::new(CHAOS_SQL);
    db.send("slow", [chaos("ok")]).await;
    let started = Arc::new(tokio::sync::Notify::new());
    let release = Arc::new(tokio::sync::Notify::new());
    let (s2, r2) = (started.clone(), release.clone());
    // The first delivery blocks until released; later ones finish at once.
    let handler = Arc::new(NativeHandler::new("slow-v1", move |msg, scope| {
        let (started, release) = (s2.clone(), r2.clone());
        async move {
            if msg.attempt == 1 {
                started.notify_one();
                release.notified().await;
                return HandleOutput {
                    scope,
                    result: Ok(vec![log_write(&msg.id, "stale worker")]),
                };
            }
            HandleOutput {
                scope,
                result: Ok(vec![log_write(&msg.id, "new lease holder")]),
            }
        }
    }));
    let r = runner(&db.store, "slow", handler, grants(&["chaos_log"], &[], &[]), policy(1, 5));
    let lease = Duration::from_millis(300);
    let first = db
        .store
        .message_lease(LeaseParams {
            queue: "slow".into(),
            limit: 1,
            lease,
        })
        .await
        .unwrap();
    assert_eq!(first.len(), 1);
    let stale = {
        let r = r.clone();
        let lm = first[0].clone();
        tokio::spawn(async move { r.process(&lm).await })
    };
    started.notified().await;
    // While the first worker is stuck, its lease expires and another worker
    // leases the same message.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let second = loop {
        let got = db
            .store
            .message_lease(LeaseParams {
                queue: "slow".into(),
                limit: 1,
                lease,
            })
            .await
            .unwrap();
        if !got.is_empty() {
            break got;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the message was never leased again after its lease expired"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(second[0].message.attempt, 2);
    assert_eq!(r.process(&second[0]).await, Outcome::Acked);
    release.notify_one();
    assert_eq!(stale.await.unwrap(), Outcome::LeaseLost, "the stale worker's ack must be refused");
    let rows = db.rows("chaos_log").await;
    assert_eq!(rows.len(), 1, "processed once");
    assert_eq!(
        col(&rows[0], "note"),
        &Value::String("new lease holder".into()),
        "the stale worker's writes are not visible"
    );
    assert_eq!(db.count("SELECT COUNT(*) FROM onceq_messages"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_retry_then_success() {
    let db = TestDb::new(CHAOS_SQL);
    db.send("flaky", [chaos("ok")]).await;
    let handler = Arc::new(NativeHandler::new("flaky-v1", |msg, scope| async move {
        if msg.attempt < 3 {
            return HandleOutput {
                scope,
                result: Err(HandlerFailure::Retry {
                    reason: "downstream busy".into(),
                    delay: Some(Duration::from_millis(5)),
                }),
            };
        }
        HandleOutput {
            scope,
            result: Ok(vec![log_write(&msg.id, &format!("done on attempt {}", msg.attempt))]),
        }
    }));
    let r = runner(&db.store, "flaky", handler, grants(&["chaos_log"], &[], &[]), policy(1, 5));
    drain(&db.store, std::slice::from_ref(&r)).await;
    assert_eq!(r.metrics.retried.load(Relaxed), 2);
    assert_eq!(r.metrics.processed.load(Relaxed), 1);
    let rows = db.rows("chaos_log").await;
    assert_eq!(rows.len(), 1);
    assert_eq!(col(&rows[0], "note"), &Value::String("done on attempt 3".into()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_dead_letters_at_once_and_retry_gives_up_after_max_attempts() {
    let db = TestDb::new(CHAOS_SQL);
    db.send("chaos", [chaos("reject"), serde_json::json!({"do": "retry", "n": 1}).to_string()])
        .await;
    let rt = runtime();
    let handler = Arc::new(wasm(&rt, "chaos", HandlerLimits::default()));
    let r = runner(&db.store, "chaos", handler, grants(&["chaos_log"], &[], &[]), policy(2, 3));
    drain(&db.store, std::slice::from_ref(&r)).await;
    let dead = db.store.dead_letter_list(onceq::store::Queues::Named("chaos"), 10).await.unwrap();
    assert_eq!(dead.len(), 2);
    let reject = dead.iter().find(|d| d.payload_text.contains("reject")).unwrap();
    assert_eq!(
        (reject.failures, reject.deliveries),
        (1, 1),
        "reject dead-letters on the first attempt"
    );
    assert!(
        reject.reason.contains("rejected by handler: chaos: asked to reject"),
        "{}",
        reject.reason
    );
    assert!(reject.handler_version.is_some());
    let retry = dead.iter().find(|d| d.payload_text.contains("retry")).unwrap();
    assert_eq!((retry.failures, retry.deliveries), (3, 3));
    assert!(
        retry.reason.contains("asked to retry") && retry.reason.contains("gave up after 3 failed attempts"),
        "{}",
        retry.reason
    );
    assert_eq!(db.count("SELECT COUNT(*) FROM chaos_log"), 0, "no writes from failed attempts");
    assert_eq!(db.count("SELECT COUNT(*) FROM onceq_messages"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_message_goes_to_dlq_at_once_or_after_max_attempts_and_can_be_replayed() {
    let db = TestDb::new(CHAOS_SQL);
    db.send("chaos", [chaos("trap"), chaos("ok")]).await;
    let rt = runtime();
    let handler: Arc<dyn onceq::protocol::Handler> = Arc::new(wasm(&rt, "chaos", HandlerLimits::default()));
    let r = runner(&db.store, "chaos", handler.clone(), grants(&["chaos_log"], &[], &[]), policy(2, 4));
    drain(&db.store, std::slice::from_ref(&r)).await;
    assert_eq!(
        r.metrics.processed.load(Relaxed),
        1,
        "the good message is not held up by the poison one"
    );
    // A crash (the guest panics) is dead-lettered at once: a re-run of the
    // same message would crash the same way.
    let dead = db.store.dead_letter_list(onceq::store::Queues::All, 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].failures, dead[0].deliveries), (1, 1));
    assert!(
        dead[0].reason.contains("chaos: asked to trap"),
        "reason names the guest's panic: {}",
        dead[0].reason
    );
    assert!(
        dead[0]
            .reason
            .contains("not retried: the same message crashes the same way; set queue.retry_crashes = true"),
        "{}",
        dead[0].reason
    );
    // Replay puts it back with its counts reset; on a queue that retries
    // crashes it fails its max_attempts times, then is dead-lettered.
    let id = db.store.dead_letter_replay(&dead[0].id).await.unwrap().expect("replayed");
    assert_eq!(db.count("SELECT COUNT(*) FROM onceq_dead_letters"), 0);
    assert_eq!(
        db.count(&format!("SELECT attempt + failures FROM onceq_messages WHERE id = '{id}'")),
        0
    );
    let retrying = onceq::protocol::Policy {
        retry_crashes: true,
        ..policy(2, 4)
    };
    let r2 = runner(&db.store, "chaos", handler, grants(&["chaos_log"], &[], &[]), retrying);
    drain(&db.store, std::slice::from_ref(&r2)).await;
    let dead = db.store.dead_letter_list(onceq::store::Queues::All, 10).await.unwrap();
    assert_eq!((dead[0].failures, dead[0].deliveries), (4, 4));
    assert!(dead[0].reason.contains("gave up after 4 failed attempts"), "{}", dead[0].reason);
}
