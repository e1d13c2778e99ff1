//! The store conformance suite (tests/common/conformance.rs), unchanged,
//! against the Spanner store on the Cloud Spanner emulator.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use common::conformance as suite;
use common::spanner::{spanner_db, spanner_options, Audit};
use onceq::store::StoreOptions;
use std::time::Duration;

pub const SCHEMA_SPANNER: &str = "
CREATE TABLE typed (id STRING(MAX) NOT NULL, b BOOL, i INT64, f FLOAT64, s STRING(MAX), `by` BYTES(MAX), j JSON, t TIMESTAMP) PRIMARY KEY (id);
CREATE TABLE pairs (a STRING(MAX) NOT NULL, n INT64 NOT NULL, v STRING(MAX)) PRIMARY KEY (a, n);
";

async fn db() -> std::sync::Arc<dyn onceq::store::Store> {
    spanner_db(SCHEMA_SPANNER, StoreOptions::default()).await.0
}

/// Concurrent messages' reads by key of one table go to Spanner together:
/// 40 transactions reading at once (32 rows of a two-column key, 8 keys
/// with no row) each get their own row, or none, from a handful of read
/// calls, not 40.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_concurrent_point_reads_are_served_by_shared_reads() {
    use onceq::value::{RowWrite, Value, WriteOp};
    let store = db().await;
    let pairs = store.schema().table("pairs").unwrap().clone();
    let mut tx = store.transaction_begin().await.unwrap();
    for n in 0..32 {
        let w = RowWrite {
            table: "pairs".into(),
            op: WriteOp::Insert,
            columns: vec![
                ("a".into(), Value::String("k".into())),
                ("n".into(), Value::Int64(n)),
                ("v".into(), Value::String(format!("v{n}"))),
            ],
        };
        tx.row_write(pairs.check_write(&w).unwrap());
    }
    tx.commit().await.unwrap();
    let before = store.commit_stats().unwrap();
    let start = Arc::new(tokio::sync::Barrier::new(40));
    let reads: Vec<_> = (0..40)
        .map(|n| {
            let (store, pairs, start) = (store.clone(), pairs.clone(), start.clone());
            tokio::spawn(async move {
                let mut tx = store.transaction_begin().await.unwrap();
                start.wait().await;
                let row = tx.row_get(&pairs, &[Value::String("k".into()), Value::Int64(n)]).await.unwrap();
                tx.rollback().await;
                (n, row.map(|r| r.into_iter().find(|(c, _)| c == "v").unwrap().1))
            })
        })
        .collect();
    for r in reads {
        let (n, v) = r.await.unwrap();
        let want = (n < 32).then(|| Value::String(format!("v{n}")));
        assert_eq!(v, want, "the row of key ({{k}}, {n})");
    }
    let after = store.commit_stats().unwrap();
    let (keys, calls) = (
        after.point_reads - before.point_reads,
        after.point_read_calls - before.point_read_calls,
    );
    assert_eq!(keys, 40);
    assert!(calls <= 10, "{calls} read calls for 40 reads made at once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_lease_and_ack() {
    suite::lease_and_ack(db().await).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_expiry_and_token_fencing() {
    suite::expiry_and_token_fencing(db().await).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_renew_keeps_the_lease() {
    suite::renew_keeps_the_lease(db().await).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_retry_later_and_release() {
    suite::retry_later_and_release(db().await).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_dead_letter_and_replay() {
    suite::dead_letter_and_replay(db().await).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_browse_and_pause() {
    suite::browse_and_pause(db().await).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_host_heartbeats() {
    suite::host_heartbeats(db().await).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_failures_and_deliveries_are_counted_apart() {
    suite::failures_and_deliveries_are_counted_apart(db().await).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_dead_letters_count_failures_and_deliveries() {
    suite::dead_letters_count_failures_and_deliveries(db().await).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_dedup_window() {
    let window = Duration::from_millis(500);
    let (store, _) = spanner_db(
        SCHEMA_SPANNER,
        StoreOptions {
            dedup_window: window,
            ..Default::default()
        },
    )
    .await;
    suite::dedup_window(store, window).await
}

/// Without a row deletion policy (`spanner.expiry = "purge"`), every
/// purge that is due deletes the expired keys (here every call is).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_purge_forgets_every_expired_key_and_keeps_the_live_ones() {
    let (store, _) = spanner_db(SCHEMA_SPANNER, purge_every(Duration::ZERO)).await;
    suite::purge_forgets_every_expired_key_and_keeps_the_live_ones(store).await
}

fn purge_every(every: Duration) -> StoreOptions {
    StoreOptions {
        spanner_expiry: onceq::store::SpannerExpiry::Purge,
        spanner_purge_every: every,
        ..Default::default()
    }
}

/// A database made by onceq deletes expired dedup keys itself (a row
/// deletion policy): the purge has nothing to do and leaves them, and an
/// expired key is no key from the moment it expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_the_database_forgets_expired_keys_itself() {
    use onceq::store::{SendOutcome, SendParams};
    let (store, database) = spanner_db("", StoreOptions::default()).await;
    let db = Audit::new(&database).await;
    let policy = db
        .strings(
            "SELECT IFNULL(ROW_DELETION_POLICY_EXPRESSION, 'none') FROM INFORMATION_SCHEMA.TABLES WHERE TABLE_SCHEMA = '' AND TABLE_NAME = 'onceq_dedup'",
        )
        .await;
    assert_eq!(policy, ["OLDER_THAN(expires, INTERVAL 0 DAY)"]);
    let keyed = || SendParams {
        queue: "q".into(),
        payload: b"x".to_vec(),
        dedup_key: Some("k".into()),
        dedup_window: Some(Duration::from_millis(300)),
        ..Default::default()
    };
    assert!(matches!(
        store.message_send(vec![keyed()]).await.unwrap()[..],
        [SendOutcome::Sent { .. }]
    ));
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(store.dedup_purge().await.unwrap(), 0, "no purge where the database expires keys");
    let rows = db.strings("SELECT dedup_key FROM onceq_dedup").await;
    assert_eq!(rows, ["k"], "the purge left the expired key to the database");
    assert!(
        matches!(store.message_send(vec![keyed()]).await.unwrap()[..], [SendOutcome::Sent { .. }]),
        "an expired key is no key"
    );
}

/// No index of onceq's tables leads with a time: an index on a monotonic
/// column alone takes every insert at its tail, one split (Spanner's
/// schema guidance). `onceq_dedup_expiry (expires_at)` did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_no_index_of_onceqs_leads_with_a_time() {
    for expiry in [onceq::store::SpannerExpiry::Ttl, onceq::store::SpannerExpiry::Purge] {
        let options = StoreOptions {
            spanner_expiry: expiry,
            ..Default::default()
        };
        let (_, database) = spanner_db("", options).await;
        let leading = Audit::new(&database)
            .await
            .strings(
                "SELECT CONCAT(INDEX_NAME, ' (', COLUMN_NAME, ')') FROM INFORMATION_SCHEMA.INDEX_COLUMNS
                 WHERE TABLE_SCHEMA = '' AND STARTS_WITH(TABLE_NAME, 'onceq_') AND INDEX_TYPE = 'INDEX' AND ORDINAL_POSITION = 1",
            )
            .await;
        assert_eq!(leading, ["onceq_messages_visible (queue)"], "{expiry:?}");
    }
}

/// 100,000 expired dedup keys (hours of a busy host's sends) and 5 live
/// ones; two hosts purge at once. One of them takes the turn and deletes
/// every expired key in one Partitioned DML statement, without an error
/// (one DELETE in one transaction needed twice Spanner's 80,000
/// mutations a commit); the other skips; the live keys stay; and no host
/// purges again before the next turn is due.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_a_purge_of_100000_expired_keys_runs_on_one_host_and_never_fails() {
    use google_cloud_spanner::mutation::Mutation;
    use onceq::store::spanner::SpannerStore;
    let options = purge_every(Duration::from_secs(3600));
    let (_, database) = spanner_db("", options.clone()).await;
    let db = Audit::new(&database).await;
    let (expired, live) = (100_000usize, 5usize);
    let started = std::time::Instant::now();
    for chunk in (0..expired + live).collect::<Vec<_>>().chunks(10_000) {
        let rows: Vec<Mutation> = chunk
            .iter()
            .map(|&i| {
                let expires_at: i64 = if i < expired { 1_000_000 } else { i64::MAX / 2 };
                Mutation::new_insert_builder("onceq_dedup")
                    .set("queue")
                    .to("q".to_string())
                    .set("dedup_key")
                    .to(format!("k{i}"))
                    .set("message_id")
                    .to(format!("m{i}"))
                    .set("expires_at")
                    .to(expires_at)
                    .build()
            })
            .collect();
        db.write(rows).await;
    }
    eprintln!("{} keys written in {:?}", expired + live, started.elapsed());
    let opts = spanner_options(&database, 4);
    let hosts = [
        SpannerStore::open(&opts, &options).await.unwrap(),
        SpannerStore::open(&opts, &options).await.unwrap(),
    ];
    let started = std::time::Instant::now();
    let (a, b) = tokio::join!(hosts[0].dedup_purge(), hosts[1].dedup_purge());
    let mut purged = [a.unwrap(), b.unwrap()];
    eprintln!("purged {purged:?} in {:?}", started.elapsed());
    purged.sort();
    assert_eq!(
        purged,
        [0, expired as u64],
        "one host purged every expired key, the other skipped its turn"
    );
    let left = db.strings("SELECT dedup_key FROM onceq_dedup ORDER BY dedup_key").await;
    let want: Vec<String> = (expired..expired + live).map(|i| format!("k{i}")).collect();
    assert_eq!(left, want, "the live keys stay");
    assert_eq!(hosts[0].dedup_purge().await.unwrap() + hosts[1].dedup_purge().await.unwrap(), 0);
}

/// `onceq_counts` does not grow with restarts: 40 store instances (a host
/// started 40 times), each acking a message, leave at most as many rows
/// as configured for the queue (16 here; there was a row per instance),
/// and the counts add up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_counts_rows_do_not_grow_with_restarts() {
    use onceq::store::spanner::SpannerStore;
    let (_, database) = spanner_db("", StoreOptions::default()).await;
    let opts = spanner_options(&database, 4);
    let restarts = 40;
    let options = StoreOptions {
        spanner_count_rows: 16,
        ..Default::default()
    };
    for i in 0..restarts {
        let s = SpannerStore::open(&opts, &options).await.unwrap();
        s.message_send(vec![suite::send("q", &format!("{i}"))]).await.unwrap();
        let got = suite::lease(&s, "q", 1, 60_000).await;
        suite::ack(&s, &got[0].lease).await.unwrap();
    }
    let rows = Audit::new(&database)
        .await
        .int("SELECT COUNT(*) FROM onceq_counts WHERE queue = 'q'")
        .await;
    assert!(rows <= 16, "{rows} counts rows after {restarts} restarts");
    let s = SpannerStore::open(&opts, &StoreOptions::default()).await.unwrap();
    let stats = s.stats().await.unwrap();
    assert_eq!(stats.queues.iter().find(|q| q.queue == "q").unwrap().processed, restarts as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_batched_commits_isolate_each_message() {
    let (store, _) = spanner_db(SCHEMA_SPANNER, batched()).await;
    suite::batched_commits_isolate_each_message(store).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_batched_dedup_keys_and_scans() {
    let (store, _) = spanner_db(SCHEMA_SPANNER, batched()).await;
    suite::batched_dedup_keys_and_scans(store).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_delayed_messages_in_due_order() {
    suite::delayed_messages_become_visible_in_due_order(db().await).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_typed_values_round_trip() {
    suite::typed_values_round_trip(db().await).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_writes_scans_and_atomicity() {
    suite::writes_scans_and_atomicity(db().await).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_outbox_intents() {
    // The case counts what the purge deletes: without a row deletion
    // policy (with one, the database deletes them and the purge counts 0).
    let (store, _) = spanner_db(SCHEMA_SPANNER, purge_every(Duration::ZERO)).await;
    suite::outbox_intents(store).await
}

// ---- the exactly-once protocol on Spanner ----

use common::*;
use onceq::protocol::QueueRunner;
use onceq::store::faulty::{FaultCounts, FaultPlan, FaultyStore};
use onceq::store::Store;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

const ACCOUNTS: usize = 10;
const BALANCE: i64 = 1_000_000;

async fn payments_db() -> Arc<dyn Store> {
    let (store, _) = spanner_db(PAYMENTS_SPANNER_SQL, StoreOptions::default()).await;
    seed_accounts(store.as_ref(), ACCOUNTS, BALANCE).await;
    store
}

/// Drain `n` payments orders from `base` through a store that injects
/// unknown commit outcomes (`plan`), with `workers` workers; check every
/// order applied once and every ack accounted for.
async fn payments_exactly_once_under(
    base: Arc<dyn Store>,
    n: usize,
    workers: usize,
    plan: FaultPlan,
) -> (Arc<QueueRunner>, Arc<FaultCounts>) {
    send_orders(base.as_ref(), n, ACCOUNTS).await;
    let (faulty, counts) = FaultyStore::new(base.clone(), plan);
    let store: Arc<dyn Store> = Arc::new(faulty);
    let rt = runtime();
    let r = payments_runner(&store, &rt, policy(workers, 5));
    drain(&store, std::slice::from_ref(&r)).await;
    assert!(counts.after_commit.load(Relaxed) > 0, "faults injected");
    check_payments_exactly_once(base.as_ref(), n, ACCOUNTS, BALANCE).await;
    assert_eq!(r.metrics.already_committed.load(Relaxed), counts.after_commit.load(Relaxed));
    assert_eq!(
        r.metrics.processed.load(Relaxed) + r.metrics.already_committed.load(Relaxed),
        n as u64
    );
    (r, counts)
}

/// The times a commit writes are the database's clock, never ahead of it:
/// 200 orders drained by 4 workers in back-to-back batch commits (which
/// take the clock from the last commit's timestamp instead of asking) left
/// their charge intents in the outbox, each enqueued at its commit, and
/// the counts' last commit; all lie between the database's clock read
/// before the run and after it (before it by at most a commit's answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_commit_times_are_the_databases_clock() {
    const NOW: &str = "SELECT UNIX_MICROS(CURRENT_TIMESTAMP())";
    let (store, database) = spanner_db(PAYMENTS_SPANNER_SQL, StoreOptions::default()).await;
    seed_accounts(store.as_ref(), ACCOUNTS, BALANCE).await;
    send_orders(store.as_ref(), 200, ACCOUNTS).await;
    let audit = Audit::new(&database).await;
    let before = audit.int(NOW).await;
    let rt = runtime();
    let r = payments_runner(&store, &rt, policy(4, 5));
    drain(&store, std::slice::from_ref(&r)).await;
    let after = audit.int(NOW).await;
    check_payments_exactly_once(store.as_ref(), 200, ACCOUNTS, BALANCE).await;
    let intents = audit.int("SELECT COUNT(*) FROM onceq_messages").await;
    assert!(intents > 0, "charges wait in the outbox");
    let first = audit.int("SELECT MIN(enqueued_at) FROM onceq_messages").await;
    let last = audit.int("SELECT MAX(enqueued_at) FROM onceq_messages").await;
    let counted = audit.int("SELECT MAX(last_at) FROM onceq_counts").await;
    for (what, t) in [("first intent", first), ("last intent", last), ("last count", counted)] {
        assert!(
            t <= after,
            "{what} enqueued at {t}, after the database's clock read after the run ({after})"
        );
        assert!(
            t > before - 1_000_000,
            "{what} enqueued at {t}, long before the run began ({before})"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_payments_exactly_once_under_unknown_commit_outcomes() {
    let plan = FaultPlan {
        after_commit: 0.2,
        before_commit: 0.1,
        seed: 11,
        ..Default::default()
    };
    let (_, counts) = payments_exactly_once_under(payments_db().await, 120, 2, plan).await;
    assert!(
        counts.after_commit.load(Relaxed) > 5 && counts.before_commit.load(Relaxed) > 2,
        "faults injected"
    );
}

/// Unknown outcomes on whole batches: a batch commit that landed, and one
/// that was dropped, each reported to every message of the batch; the acks
/// decide per message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_batch_commits_with_unknown_outcomes_apply_each_order_once() {
    use onceq::store::commit::CommitOptions;
    use onceq::store::faulty::BatchFaults;
    let (store, _) = spanner_db(
        PAYMENTS_SPANNER_SQL,
        StoreOptions {
            commit: CommitOptions {
                max_batch: 64,
                max_wait: Duration::from_millis(20),
                faults: Some(BatchFaults {
                    after_commit: 0.3,
                    before_commit: 0.3,
                    aborted: 0.0,
                    refused: 0.0,
                    seed: 9,
                }),
                ..CommitOptions::default()
            },
            ..StoreOptions::default()
        },
    )
    .await;
    // An account per order: no message of a batch reads what another one
    // writes (that aborts it, and a batch with an aborted message is not
    // counted as landed), so the faults fall on whole batches.
    let n = 160;
    seed_accounts(store.as_ref(), n, BALANCE).await;
    send_orders(store.as_ref(), n, n).await;
    let rt = runtime();
    let r = payments_runner(&store, &rt, policy(3, 10));
    drain(&store, std::slice::from_ref(&r)).await;
    check_payments_exactly_once(store.as_ref(), n, n, BALANCE).await;
    let f = &store.commit_stats().unwrap().faults;
    let (landed, landed_msgs) = (f.landed_batches.load(Relaxed), f.landed_messages.load(Relaxed));
    let (dropped, dropped_msgs) = (f.dropped_batches.load(Relaxed), f.dropped_messages.load(Relaxed));
    eprintln!("landed {landed} batches ({landed_msgs} messages), dropped {dropped} ({dropped_msgs})");
    assert!(landed >= 2 && dropped >= 2, "faults injected on both sides");
    assert!(
        landed_msgs + dropped_msgs > landed + dropped,
        "some faulted batches held several messages"
    );
    assert_eq!(r.metrics.already_committed.load(Relaxed), landed_msgs);
    assert_eq!(r.metrics.acked(), n as u64);
}

/// The production mode for real Spanner: one shared client (multiplexed
/// sessions there) instead of a client checked out per transaction. The
/// emulator runs one transaction at a time on a shared client, so one
/// worker; unknown outcomes still resolve to exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_shared_client_mode_processes_payments_exactly_once() {
    let (base, _) = spanner_db(
        PAYMENTS_SPANNER_SQL,
        StoreOptions {
            spanner_exclusive_clients: Some(false),
            ..StoreOptions::default()
        },
    )
    .await;
    seed_accounts(base.as_ref(), ACCOUNTS, BALANCE).await;
    let plan = FaultPlan {
        after_commit: 0.15,
        before_commit: 0.1,
        seed: 5,
        ..Default::default()
    };
    payments_exactly_once_under(base, 40, 1, plan).await;
}

/// Three `onceq run` processes (each its own client pool) on one emulator
/// database drain 300 messages (`ONCEQ_TEST_MESSAGES`): none lost, none
/// processed twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_three_hosts_drain_one_queue_exactly_once() {
    let (store, database) = spanner_db(PAYMENTS_SPANNER_SQL, StoreOptions::default()).await;
    seed_accounts(store.as_ref(), ACCOUNTS, BALANCE).await;
    let n: usize = std::env::var("ONCEQ_TEST_MESSAGES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    send_orders(store.as_ref(), n, ACCOUNTS).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("onceq.toml"),
        payments_hosts_config(
            &format!("store = \"spanner://{database}\"\n\n[spanner]\nshards = 8\nclients = 4"),
            "lease = \"5s\"\nbackoff_initial = \"20ms\"\nbackoff_max = \"200ms\"\nmax_attempts = 20",
        ),
    )
    .unwrap();
    let n_hosts: usize = std::env::var("ONCEQ_TEST_HOSTS").ok().and_then(|s| s.parse().ok()).unwrap_or(3);
    let hosts: Vec<_> = (0..n_hosts)
        .map(|_| {
            std::process::Command::new(env!("CARGO_BIN_EXE_onceq"))
                .current_dir(dir.path())
                .args(["run", "--until-empty"])
                .env("RUST_LOG", "warn")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let started = std::time::Instant::now();
    let mut per_host = Vec::new();
    for h in hosts {
        let out = tokio::task::spawn_blocking(move || h.wait_with_output()).await.unwrap().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: String = stderr.chars().rev().take(3000).collect::<Vec<_>>().into_iter().rev().collect();
        eprintln!("host: {stdout}{tail}");
        assert!(
            out.status.success(),
            "host failed: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let processed: u64 = stdout
            .split("processed ")
            .nth(1)
            .and_then(|s| s.split(',').next())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or_else(|| panic!("no summary in {stdout}"));
        per_host.push(processed);
    }
    eprintln!("{n} messages by {n_hosts} hosts in {:?}: {per_host:?}", started.elapsed());
    check_payments(store.as_ref(), n, ACCOUNTS, BALANCE, Some(&dir.path().join("charges.jsonl"))).await;
    assert_eq!(per_host.iter().sum::<u64>(), n as u64, "acks across hosts add up: {per_host:?}");
    assert!(
        per_host.iter().filter(|&&p| p > 0).count() >= 2,
        "the work was shared: {per_host:?}"
    );
}

/// `n` payments orders on a fresh database, seeded without faults, and a
/// store on it that injects `faults` in its batch commits.
async fn payments_under_batch_faults(n: usize, faults: onceq::store::faulty::BatchFaults) -> Arc<dyn Store> {
    use onceq::store::commit::CommitOptions;
    use onceq::store::spanner::SpannerStore;
    let (seeder, database) = spanner_db(PAYMENTS_SPANNER_SQL, StoreOptions::default()).await;
    seed_accounts(seeder.as_ref(), ACCOUNTS, BALANCE).await;
    send_orders(seeder.as_ref(), n, ACCOUNTS).await;
    let options = StoreOptions {
        commit: CommitOptions {
            max_batch: 64,
            max_wait: Duration::from_millis(20),
            faults: Some(faults),
            ..CommitOptions::default()
        },
        ..StoreOptions::default()
    };
    let opts = spanner_options(&database, 4);
    Arc::new(SpannerStore::open(&opts, &options).await.unwrap())
}

/// Drain `store`'s payments: every order applied once, none charged.
async fn payments_applied_once_and_nothing_charged(store: &Arc<dyn Store>, n: usize) {
    let rt = runtime();
    // The default max_attempts: a fault charged to a message would show.
    let r = payments_runner(store, &rt, policy(1, onceq::protocol::Policy::default().max_attempts));
    drain(store, std::slice::from_ref(&r)).await;
    check_payments_exactly_once(store.as_ref(), n, ACCOUNTS, BALANCE).await;
    assert_eq!(r.metrics.acked(), n as u64);
    let dead = store.dead_letter_list(onceq::store::Queues::All, 10).await.unwrap();
    assert!(dead.is_empty(), "a fault charged a message: {dead:?}");
    assert_eq!(r.metrics.failures.load(Relaxed), 0, "a fault counted as a failure");
}

/// Batch commits aborted past the client's own re-runs (Spanner's
/// ABORTED, half of them here): nothing of an aborted batch is written,
/// each of its messages runs again without being charged, and every order
/// is applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_aborted_batch_commits_apply_each_order_once_and_charge_nothing() {
    use onceq::store::faulty::BatchFaults;
    let n = 120;
    let faults = BatchFaults {
        aborted: 0.5,
        seed: 5,
        ..BatchFaults::default()
    };
    let store = payments_under_batch_faults(n, faults).await;
    payments_applied_once_and_nothing_charged(&store, n).await;
    let f = &store.commit_stats().unwrap().faults;
    let aborted = f.aborted_messages.load(Relaxed);
    eprintln!("aborted {} batches ({aborted} messages)", f.aborted_batches.load(Relaxed));
    assert!(aborted >= 10, "aborts injected: {aborted}");
}

/// Batches refused as a whole (Spanner's INVALID_ARGUMENT, drawn by the
/// store for half of its batches of several): each is committed again one
/// message at a time, every order is applied once, and nothing is charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_batches_refused_as_a_whole_split_and_charge_nothing() {
    use onceq::store::faulty::BatchFaults;
    let n = 120;
    let faults = BatchFaults {
        refused: 0.5,
        seed: 3,
        ..BatchFaults::default()
    };
    let store = payments_under_batch_faults(n, faults).await;
    payments_applied_once_and_nothing_charged(&store, n).await;
    let splits = store.commit_stats().unwrap().split_batches;
    eprintln!("{splits} batches refused and split");
    assert!(splits >= 2, "refusals injected: {splits}");
}

/// Commits grouped: a batch waits 300 ms for more, so messages committed
/// together in a test land in one batch.
fn batched() -> StoreOptions {
    StoreOptions {
        commit: onceq::store::commit::CommitOptions {
            max_batch: 64,
            max_wait: Duration::from_millis(300),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// 48 messages each inserting a row, every sixth a key that exists
/// (`bad-*`), through a store with `options`, each message tried up to
/// `attempts` times: the 40 good rows (and the seed's) each once, only the
/// 8 bad messages dead-lettered, each charged `attempts` refused writes.
/// The store, for what the caller checks besides.
async fn bad_inserts_fail_alone(options: StoreOptions, attempts: u32) -> Arc<dyn Store> {
    use onceq::protocol::{HandleOutput, NativeHandler};
    use onceq::value::{Effect, RowWrite, Value, WriteOp};
    let (store, _) = spanner_db("CREATE TABLE good (id STRING(MAX) NOT NULL) PRIMARY KEY (id);", options).await;
    store
        .message_send(vec![onceq::store::SendParams {
            queue: "seed".into(),
            payload: b"taken".to_vec(),
            ..Default::default()
        }])
        .await
        .unwrap();
    let inserter = Arc::new(NativeHandler::new("inserter", |m, scope| async move {
        let id = String::from_utf8_lossy(&m.payload).into_owned();
        let id = if id.starts_with("bad-") { "taken".to_string() } else { id };
        let write = Effect::Write(RowWrite {
            table: "good".into(),
            op: WriteOp::Insert,
            columns: vec![("id".into(), Value::String(id))],
        });
        HandleOutput {
            scope,
            result: Ok(vec![write]),
        }
    }));
    // The key every bad message inserts, there first.
    let seed = runner(&store, "seed", inserter.clone(), grants(&["good"], &[], &[]), policy(1, 1));
    drain(&store, std::slice::from_ref(&seed)).await;
    let sends: Vec<onceq::store::SendParams> = (0..48)
        .map(|i| onceq::store::SendParams {
            queue: "q".into(),
            payload: if i % 6 == 5 { format!("bad-{i}") } else { format!("good-{i}") }.into_bytes(),
            ..Default::default()
        })
        .collect();
    store.message_send(sends).await.unwrap();
    let r = runner(&store, "q", inserter, grants(&["good"], &[], &[]), policy(4, attempts));
    drain_within(&store, std::slice::from_ref(&r), std::time::Duration::from_secs(240)).await;
    let rows = store.table_rows("good").await.unwrap();
    assert_eq!(rows.len(), 41, "the 40 good messages and the seed, each once");
    let dead = store.dead_letter_list(onceq::store::Queues::Named("q"), 100).await.unwrap();
    assert_eq!(dead.len(), 8, "only the bad messages dead-lettered");
    for d in &dead {
        assert!(d.payload_text.starts_with("bad-"), "a good message was dead-lettered: {}", d.reason);
        assert!(d.reason.contains("write refused by the database"), "{}", d.reason);
        assert_eq!(d.failures, attempts, "{}", d.reason);
    }
    store
}

/// A message that inserts a key that exists fails the whole batch's commit
/// (a mutation that cannot apply fails them all). Its neighbours must not
/// pay for it: the batch is committed again message by message, the good
/// ones commit, and only the bad one is charged, with its own reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_a_bad_insert_fails_only_its_own_message() {
    bad_inserts_fail_alone(StoreOptions::default(), 2).await;
}

/// A message the database refused (a duplicate key) is remembered: when
/// it runs again it commits alone, instead of failing another batch that
/// must then commit one message at a time (holding the emulator's turn
/// meanwhile). Eight bad messages of 48, ten attempts each, batches
/// gathered for 300 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_a_refused_message_commits_alone_when_it_runs_again() {
    let store = bad_inserts_fail_alone(batched(), 10).await;
    // A bad message's first run fails its batch (which then commits its
    // messages one by one): at most eight splits. Their nine re-runs each
    // commit alone, where each one failed another batch before (about 20
    // splits).
    let splits = store.commit_stats().unwrap().split_batches;
    eprintln!("{splits} batches split");
    assert!(splits <= 8, "{splits} batches split: re-runs of refused messages joined batches");
}

/// The shard count is the database's, fixed by the first host: a host
/// configured with another count uses the database's, so every message
/// sent by one host is leased by another (with its own count, a host
/// with 1 shard would never see what a host with 4 sent to shards 1-3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_a_host_configured_with_other_shards_still_sees_every_message() {
    use onceq::store::spanner::SpannerStore;
    let (four, database) = spanner_db("", StoreOptions::default()).await;
    four.message_send((0..40).map(|i| suite::send("q", &format!("{i}"))).collect())
        .await
        .unwrap();
    let one = SpannerStore::open(&spanner_options(&database, 1), &StoreOptions::default())
        .await
        .unwrap();
    let got = suite::lease(&one, "q", 100, 60_000).await;
    assert_eq!(got.len(), 40, "the messages on every shard are leased");
}

/// Two hosts leasing from one shard at the same moment read the same
/// oldest rows. The one whose lease transaction comes second finds them
/// taken; before, it answered "nothing ready" and its workers backed off
/// from a full queue (every other round here). Now it reads again, and it
/// mostly picks other rows in the first place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_leasers_on_one_shard_never_see_a_full_queue_as_empty() {
    use onceq::store::spanner::SpannerStore;
    use onceq::store::{LeaseParams, SendParams};
    let one_shard = spanner_options(&common::spanner::database_name(), 1);
    let options = StoreOptions::default();
    let hosts: Vec<Arc<dyn Store>> = vec![
        Arc::new(SpannerStore::init(&one_shard, "", &options).await.unwrap()),
        Arc::new(SpannerStore::open(&one_shard, &options).await.unwrap()),
    ];
    let total = 240;
    let sends: Vec<SendParams> = (0..total)
        .map(|i| SendParams {
            queue: "q".into(),
            payload: format!("m{i}").into_bytes(),
            ..Default::default()
        })
        .collect();
    hosts[0].message_send(sends).await.unwrap();
    let (limit, mut taken, mut empty_while_full, mut rounds) = (8, std::collections::BTreeSet::new(), 0, 0);
    // Both hosts lease at once, round after round, while at least two
    // full leases' worth is ready.
    while total - taken.len() >= 2 * limit {
        rounds += 1;
        let barrier = Arc::new(tokio::sync::Barrier::new(2));
        let leases: Vec<_> = hosts
            .iter()
            .map(|h| {
                let (h, barrier) = (h.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    h.message_lease(LeaseParams {
                        queue: "q".into(),
                        limit,
                        lease: Duration::from_secs(600),
                    })
                    .await
                    .unwrap()
                })
            })
            .collect();
        for l in leases {
            let got = l.await.unwrap();
            if got.is_empty() {
                empty_while_full += 1;
            }
            for m in got {
                assert!(taken.insert(m.message.id.clone()), "{} leased twice", m.message.id);
            }
        }
        assert!(rounds < 100, "{} of {total} leased after {rounds} rounds", taken.len());
    }
    eprintln!("{rounds} rounds, {empty_while_full} empty leases, {} leased", taken.len());
    assert_eq!(
        empty_while_full, 0,
        "a lease answered 'nothing ready' {empty_while_full} times in {rounds} rounds while the queue held messages"
    );
}

/// The real-Spanner check kit (tools/spanner-check/run.sh) on the
/// emulator, briefly: two hosts SIGKILLed at random while a producer
/// sends, drained, audited with gcloud from the database. It is meant for
/// a real instance (30 minutes, Spanner's lock and transaction
/// statistics); here it proves the script itself works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_the_real_spanner_check_kit_passes_on_the_emulator() {
    let work = tempfile::tempdir().unwrap();
    let database = format!("projects/onceq/instances/onceq-check/databases/k{:x}", rand::random::<u32>());
    let out = tokio::process::Command::new("bash")
        .arg(repo_root().join("tools/spanner-check/run.sh"))
        .env("DATABASE", &database)
        .env("HOSTS", "2")
        .env("SECONDS_TO_RUN", "20")
        .env("RATE", "20")
        .env("ACCOUNTS", "50")
        .env("KILL_EVERY", "8")
        .env("ONCEQ", env!("CARGO_BIN_EXE_onceq"))
        .env("GUEST", guest("payments"))
        .env("WORK", work.path())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(600), out)
        .await
        .expect("the kit ran for 10 minutes")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the kit failed:\n{stdout}\n{stderr}");
    for check in [
        "ok    orders, each once",
        "ok    money",
        "ok    queues drained",
        "ok    dead letters: 0",
        "ok    every charge delivered",
    ] {
        assert!(stdout.contains(check), "no '{check}' in:\n{stdout}");
    }
    let sent: u64 = stdout
        .split("sent ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert!(sent >= 100, "the producer sent {sent} orders in 20 s:\n{stdout}");
}

/// Telemetry on Spanner: every message's run in its own trace (a child of
/// its creation context), its read of the account as a span under the
/// handler call, and the group commits' spans linking the messages they
/// committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spanner_runs_and_batch_commits_are_traced() {
    use common::otlp::Otlp;
    use onceq::store::commit::CommitOptions;
    use onceq::telemetry::Telemetry;
    let otlp = Otlp::start().await;
    let (store, _) = spanner_db(
        PAYMENTS_SPANNER_SQL,
        StoreOptions {
            commit: CommitOptions {
                max_batch: 64,
                max_wait: Duration::from_millis(20),
                faults: None,
                ..CommitOptions::default()
            },
            ..StoreOptions::default()
        },
    )
    .await;
    let n = 12;
    seed_accounts(store.as_ref(), n, BALANCE).await;
    let contexts: Vec<_> = (0..n).map(|_| onceq::trace::TraceParent::root()).collect();
    store
        .message_send(
            contexts
                .iter()
                .enumerate()
                .map(|(i, c)| onceq::store::SendParams {
                    queue: "payments".into(),
                    payload: order(i, i, 10).into_bytes(),
                    attributes: vec![(onceq::trace::TRACEPARENT_ATTRIBUTE.into(), c.to_string())],
                    ..Default::default()
                })
                .collect(),
        )
        .await
        .unwrap();
    let telemetry = Telemetry::start(&otlp.config()).unwrap();
    telemetry.observe_commits(store.as_ref());
    let rt = runtime();
    let r = payments_runner(&store, &rt, policy(4, 10));
    r.set_telemetry(telemetry.clone());
    drain(&store, std::slice::from_ref(&r)).await;
    telemetry.shutdown().await;
    check_payments_exactly_once(store.as_ref(), n, n, BALANCE).await;
    wait_until("a process span per message", Duration::from_secs(30), || async {
        otlp.named("process payments").len() >= n
    })
    .await;
    let runs = otlp.named("process payments");
    let acked: Vec<_> = runs
        .iter()
        .filter(|r| r.attr("onceq.outcome").as_deref() == Some("acked"))
        .collect();
    assert_eq!(acked.len(), n, "one acked run per message");
    for c in &contexts {
        assert!(
            acked
                .iter()
                .any(|r| r.trace_id() == c.trace_id_hex() && r.parent() == c.span_id_hex()),
            "the run of {c} is its child"
        );
    }
    let reads = otlp.named("get accounts");
    let calls = otlp.named("handle payments");
    assert!(reads.len() >= n, "a read span per run");
    assert!(reads.iter().all(|g| calls.iter().any(|c| c.span_id() == g.parent())));
    // Every acked run's settle is linked from a commit span.
    let commits = otlp.named("commit");
    let linked: std::collections::BTreeSet<String> = commits.iter().flat_map(|c| c.links()).collect();
    let settles = otlp.named("settle payments");
    for run in &acked {
        let settle = settles.iter().find(|s| s.parent() == run.span_id()).expect("the run's settle span");
        assert!(linked.contains(&settle.span_id()), "a commit span links {}", settle.span_id());
    }
    let committed: i64 = commits
        .iter()
        .map(|c| c.attr("messaging.batch.message_count").unwrap().parse::<i64>().unwrap())
        .sum();
    assert!(committed >= n as i64, "{committed} messages in commit spans");
}
