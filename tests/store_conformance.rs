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
    StoreOptions {
        commit: onceq::store::commit::CommitOptions {
            max_batch: 64,
            max_wait: Duration::from_millis(200),
            faults: None,
        },
        ..Default::default()
    }
}
