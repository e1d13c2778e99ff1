//! The store conformance suite (tests/common/conformance.rs) against the
//! SQLite store, on a real WAL file.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use common::conformance as suite;
use common::TestDb;
use onceq::store::StoreOptions;
use std::time::Duration;

fn db() -> TestDb {
    TestDb::new(suite::SCHEMA_SQLITE)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_lease_and_ack() {
    suite::lease_and_ack(db().store).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_expiry_and_token_fencing() {
    suite::expiry_and_token_fencing(db().store).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_renew_keeps_the_lease() {
    suite::renew_keeps_the_lease(db().store).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_retry_later_and_release() {
    suite::retry_later_and_release(db().store).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_dead_letter_and_replay() {
    suite::dead_letter_and_replay(db().store).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_browse_and_pause() {
    suite::browse_and_pause(db().store).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_host_heartbeats() {
    suite::host_heartbeats(db().store).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_failures_and_deliveries_are_counted_apart() {
    suite::failures_and_deliveries_are_counted_apart(db().store).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_dead_letters_count_failures_and_deliveries() {
    suite::dead_letters_count_failures_and_deliveries(db().store).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_dedup_window() {
    let window = Duration::from_millis(300);
    let db = TestDb::with_options(
        suite::SCHEMA_SQLITE,
        StoreOptions {
            dedup_window: window,
            ..Default::default()
        },
    );
    suite::dedup_window(db.store, window).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_purge_forgets_every_expired_key() {
    suite::purge_forgets_every_expired_key_and_keeps_the_live_ones(db().store).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_delayed_messages_in_due_order() {
    suite::delayed_messages_become_visible_in_due_order(db().store).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_typed_values_round_trip() {
    suite::typed_values_round_trip(db().store).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_writes_scans_and_atomicity() {
    suite::writes_scans_and_atomicity(db().store).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_outbox_intents() {
    suite::outbox_intents(db().store).await
}

#[test]
fn sqlite_database_is_a_wal_file() {
    let db = db();
    let mode: String = db.sql().query_row("PRAGMA journal_mode", [], |r| r.get(0)).unwrap();
    assert_eq!(mode, "wal");
    assert!(db.path.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_batched_commits_isolate_each_message() {
    let db = TestDb::with_options(suite::SCHEMA_SQLITE, batched());
    suite::batched_commits_isolate_each_message(db.store).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_batched_dedup_keys_and_scans() {
    let db = TestDb::with_options(suite::SCHEMA_SQLITE, batched());
    suite::batched_dedup_keys_and_scans(db.store).await
}

/// Commits grouped: a batch waits 200 ms for more, so messages committed
/// together in a test land in one batch.
fn batched() -> StoreOptions {
    batched_after(Duration::from_millis(200))
}

/// Commits grouped, a batch waiting `wait` for more.
fn batched_after(wait: Duration) -> StoreOptions {
    StoreOptions {
        commit: onceq::store::commit::CommitOptions {
            max_batch: 64,
            max_wait: wait,
            ..Default::default()
        },
        ..Default::default()
    }
}

/// A database made before failures were counted apart from deliveries
/// (schema 1: `attempt` counted every lease) is upgraded when a host opens
/// it: queued messages start with no failure, dead letters keep their old
/// count as their failures, and a second open writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_database_from_before_failure_counts_is_upgraded_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("old.db");
    {
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch(
            "PRAGMA journal_mode = WAL;
             CREATE TABLE onceq_messages (id TEXT PRIMARY KEY, queue TEXT NOT NULL, payload BLOB NOT NULL,
                 attributes TEXT NOT NULL DEFAULT '[]', attempt INTEGER NOT NULL DEFAULT 0, enqueued_at INTEGER NOT NULL,
                 visible_at INTEGER NOT NULL, lease_token TEXT, last_error TEXT);
             CREATE INDEX onceq_messages_visible ON onceq_messages (queue, visible_at);
             CREATE TABLE onceq_dead_letters (id TEXT PRIMARY KEY, queue TEXT NOT NULL, payload BLOB NOT NULL,
                 attributes TEXT NOT NULL, attempts INTEGER NOT NULL, enqueued_at INTEGER NOT NULL, failed_at INTEGER NOT NULL,
                 reason TEXT NOT NULL, handler_version TEXT);
             CREATE TABLE onceq_dedup (queue TEXT NOT NULL, dedup_key TEXT NOT NULL, message_id TEXT NOT NULL,
                 expires_at INTEGER NOT NULL, PRIMARY KEY (queue, dedup_key));
             CREATE TABLE onceq_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
             INSERT INTO onceq_meta (key, value) VALUES ('schema_version', '1');
             CREATE TABLE t (id TEXT PRIMARY KEY);
             INSERT INTO onceq_messages (id, queue, payload, attempt, enqueued_at, visible_at) VALUES ('m', 'q', x'00', 3, 1, 1);
             INSERT INTO onceq_dead_letters (id, queue, payload, attributes, attempts, enqueued_at, failed_at, reason)
                 VALUES ('d', 'q', x'00', '[]', 4, 1, 2, 'gave up after 4 attempts');",
        )
        .unwrap();
    }
    let store = onceq::store::sqlite::SqliteStore::open(&path, &StoreOptions::default()).unwrap();
    let m = store.message_get("m").await.unwrap().unwrap();
    assert_eq!((m.deliveries, m.failures), (3, 0));
    let d = store.dead_letter_get("d").await.unwrap().unwrap();
    assert_eq!((d.deliveries, d.failures), (4, 4));
    drop(store);
    let version = || -> String {
        rusqlite::Connection::open(&path)
            .unwrap()
            .query_row("SELECT value FROM onceq_meta WHERE key = 'schema_version'", [], |r| r.get(0))
            .unwrap()
    };
    assert_eq!(version(), "2");
    let indexed: Vec<String> = rusqlite::Connection::open(&path)
        .unwrap()
        .prepare("SELECT name FROM pragma_index_info('onceq_messages_visible') ORDER BY seqno")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(
        indexed,
        ["queue", "visible_at", "lease_token"],
        "the counts are read from the index"
    );
    // Opened again: nothing to do, and the counts are as they were.
    let store = onceq::store::sqlite::SqliteStore::open(&path, &StoreOptions::default()).unwrap();
    use onceq::store::Store;
    assert_eq!(store.dead_letter_get("d").await.unwrap().unwrap().failures, 4);
}

/// A batch runs without savepoints first. A message whose hold fails
/// after its ack landed (a trigger refuses it) must not keep that ack: the
/// batch is committed again, the failed message stays on its queue, and
/// the others land. One whose lease is
/// gone fails before it writes, and its hold is not applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_batched_ack_without_writes_keeps_nothing_when_it_fails() {
    use onceq::store::{SendOutcome, SendParams, StoreError};
    let db = TestDb::with_options(suite::SCHEMA_SQLITE, batched());
    let s = db.store.as_ref();
    db.sql()
        .execute_batch(
            "CREATE TRIGGER refuse_hold BEFORE UPDATE ON onceq_dedup WHEN NEW.dedup_key = 'refused'
             BEGIN SELECT RAISE(ABORT, 'hold refused'); END",
        )
        .unwrap();
    let claim = |key: &str, window: Duration| SendParams {
        dedup_key: Some(key.into()),
        dedup_window: Some(window),
        ..suite::send("k", key)
    };
    s.message_send(vec![
        claim("held", Duration::from_millis(1)),
        claim("refused", Duration::from_secs(3600)),
        claim("not-held", Duration::from_millis(1)),
    ])
    .await
    .unwrap();
    s.message_send(["a", "b", "c", "d"].iter().map(|p| suite::send("q", p)).collect())
        .await
        .unwrap();
    let mut ms = suite::lease(s, "q", 4, 60_000).await;
    ms.sort_by(|x, y| x.message.payload.cmp(&y.message.payload));
    assert_eq!(ms.len(), 4);
    suite::ack(s, &ms[3].lease).await.unwrap(); // d's lease is gone

    let ack_and_hold = |m: &onceq::store::LeasedMessage, key: &str| {
        let (lease, key) = (m.lease.clone(), key.to_string());
        async move {
            let mut tx = s.transaction_begin().await.unwrap();
            tx.message_ack(&lease);
            tx.dedup_hold("k", &key, Duration::from_secs(3600));
            tx.commit().await
        }
    };
    let clean = async {
        let mut tx = s.transaction_begin().await.unwrap();
        tx.message_ack(&ms[2].lease);
        tx.message_enqueue(suite::send("next", "from c"));
        tx.commit().await
    };
    let (a, b, c, d) = tokio::join!(
        ack_and_hold(&ms[0], "held"),
        ack_and_hold(&ms[1], "refused"),
        clean,
        ack_and_hold(&ms[3], "not-held")
    );
    assert!(a.is_ok(), "{a:?}");
    assert!(matches!(b, Err(StoreError::WriteRefused(_))), "the refused hold: {b:?}");
    assert!(c.is_ok(), "{c:?}");
    assert!(matches!(d, Err(StoreError::LeaseLost { .. })), "{d:?}");

    assert_eq!(
        suite::payloads(s, "q").await,
        ["b"],
        "b's ack went with its refused hold; a and c are acked"
    );
    assert_eq!(suite::payloads(s, "next").await, ["from c"]);
    // The claims of 1 ms are long expired: a's was held for an hour, d's
    // was not.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let again = s
        .message_send(vec![
            claim("held", Duration::from_secs(1)),
            claim("not-held", Duration::from_secs(1)),
        ])
        .await
        .unwrap();
    assert!(matches!(again[0], SendOutcome::Duplicate { .. }), "a's hold landed: {:?}", again[0]);
    assert!(matches!(again[1], SendOutcome::Sent { .. }), "d's hold did not: {:?}", again[1]);
}

/// Commits grouped after a whole second's wait for more: what a test asks
/// meanwhile finds the batch still to come, however loaded the machine.
fn batched_slowly() -> StoreOptions {
    batched_after(Duration::from_secs(1))
}

/// The leases committed inside a batch's transaction so far.
fn leases_in_batches(s: &dyn onceq::store::Store) -> u64 {
    s.commit_stats().unwrap().leases_in_batches
}

/// Ack `leases`, each in a transaction of its own, from a task (their
/// commits go together, in one batch).
fn ack_later(
    s: &std::sync::Arc<dyn onceq::store::Store>,
    leases: Vec<onceq::store::Lease>,
) -> tokio::task::JoinHandle<Result<(), onceq::store::StoreError>> {
    let s = s.clone();
    tokio::spawn(async move {
        let mut acks = tokio::task::JoinSet::new();
        for l in leases {
            let s = s.clone();
            acks.spawn(async move { suite::ack(s.as_ref(), &l).await });
        }
        let mut out = Ok(());
        while let Some(r) = acks.join_next().await {
            out = out.and(r.unwrap());
        }
        out
    })
}

/// A lease asked while a batch of commits gathers runs inside that batch's
/// transaction (it is answered once the batch committed); one asked with
/// no commit coming runs alone. Either way its messages are leased once,
/// and its token acks them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_lease_asked_while_a_batch_gathers_rides_in_its_transaction() {
    let db = TestDb::with_options(suite::SCHEMA_SQLITE, batched_slowly());
    let s = db.store.clone();
    s.message_send((0..6).map(|i| suite::send("q", &format!("m{i}"))).collect())
        .await
        .unwrap();
    let first = suite::lease(s.as_ref(), "q", 2, 60_000).await;
    assert_eq!(first.len(), 2);
    assert_eq!(leases_in_batches(s.as_ref()), 0, "no commit was coming: the lease ran alone");

    let acked = ack_later(&s, vec![first[0].lease.clone()]);
    // The ack's batch waits a second for more: it is on its way by now.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let second = suite::lease(s.as_ref(), "q", 3, 60_000).await;
    acked.await.unwrap().unwrap();
    assert_eq!(leases_in_batches(s.as_ref()), 1, "the lease ran inside the ack's batch");
    let mut ids: Vec<&str> = first.iter().chain(&second).map(|m| m.message.id.as_str()).collect();
    assert_eq!(ids.len(), 5);
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 5, "a message leased twice");

    ack_later(&s, second.iter().map(|m| m.lease.clone()).collect())
        .await
        .unwrap()
        .unwrap();
    let rest = suite::lease(s.as_ref(), "q", 10, 60_000).await;
    assert_eq!(rest.len(), 1, "6 sent, 5 leased: {rest:?}");
    assert_eq!(
        suite::payloads(s.as_ref(), "q").await.len(),
        2,
        "first[1] and the one just leased are left"
    );
}

/// A lease that ran inside a batch whose commit was refused (a foreign key
/// checked at the commit) is not lost with it: it runs again alone and is
/// answered, while the batch's messages get their own verdicts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_lease_in_a_refused_batch_runs_again_alone() {
    use onceq::store::StoreError;
    use onceq::value::{RowWrite, Value, WriteOp};
    let ddl = format!(
        "{}CREATE TABLE parents (id TEXT PRIMARY KEY);
         CREATE TABLE kids (id TEXT PRIMARY KEY, parent TEXT NOT NULL REFERENCES parents (id) DEFERRABLE INITIALLY DEFERRED);",
        suite::SCHEMA_SQLITE
    );
    let db = TestDb::with_options(&ddl, batched_slowly());
    let s = db.store.clone();
    s.message_send((0..4).map(|i| suite::send("q", &format!("m{i}"))).collect())
        .await
        .unwrap();
    let first = suite::lease(s.as_ref(), "q", 2, 60_000).await;
    assert_eq!(first.len(), 2);
    let kids = s.schema().table("kids").unwrap().clone();
    let orphan = kids
        .check_write(&RowWrite {
            table: "kids".into(),
            op: WriteOp::Insert,
            columns: vec![
                ("id".to_string(), Value::String("k".into())),
                ("parent".to_string(), Value::String("nobody".into())),
            ],
        })
        .unwrap();
    let refused = {
        let (s, lease) = (s.clone(), first[0].lease.clone());
        tokio::spawn(async move {
            let mut tx = s.transaction_begin().await.unwrap();
            tx.row_write(orphan);
            tx.message_ack(&lease);
            tx.commit().await
        })
    };
    let clean = ack_later(&s, vec![first[1].lease.clone()]);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let second = suite::lease(s.as_ref(), "q", 2, 60_000).await;
    let refused = refused.await.unwrap();
    assert!(matches!(refused, Err(StoreError::WriteRefused(_))), "the orphan: {refused:?}");
    clean.await.unwrap().unwrap();
    assert_eq!(second.len(), 2, "the lease was answered with its messages");
    assert!(
        second.iter().all(|m| first.iter().all(|f| f.message.id != m.message.id)),
        "a message leased twice"
    );
    assert_eq!(leases_in_batches(s.as_ref()), 0, "the batch that ran it did not commit");
    assert!(s.commit_stats().unwrap().split_batches >= 1);
    // Its lease holds: its token acks both, and nothing else is left to lease.
    ack_later(&s, second.iter().map(|m| m.lease.clone()).collect())
        .await
        .unwrap()
        .unwrap();
    assert!(suite::lease(s.as_ref(), "q", 10, 60_000).await.is_empty());
    assert_eq!(
        suite::payloads(s.as_ref(), "q").await,
        [String::from_utf8_lossy(&first[0].message.payload)],
        "the refused message stays, leased"
    );
}
