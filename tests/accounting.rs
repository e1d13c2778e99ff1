//! What a message is charged. A valid message is never dead-lettered for
//! the host's own trouble: a failure counts only the message's own verdict
//! (the handler failed or asked to retry, its effects were refused), a
//! lease is a delivery, and each of these would have dead-lettered good
//! messages before:
//!
//! - hosts killed while the handler runs, then one real failure;
//! - a poison message whose trigger or `ON CONFLICT ROLLBACK` ends the
//!   whole batch's transaction (its neighbours commit);
//! - one hot counter row read and written by 64 workers;
//! - idle connections to the admin port taking the host's descriptors;
//! - a webhook receiver answering an error with an endless body.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use common::*;
use onceq::protocol::{HandleOutput, NativeHandler, Policy};
use onceq::store::Queues;
use onceq::value::{Effect, RowWrite, Value, WriteOp};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

/// A project folder for `onceq run` with the `chaos` fixture on queue
/// `chaos`, its `onceq.toml` holding `settings` under `[[queue]]`.
fn chaos_project(settings: &str, admin: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("schema.sql"), CHAOS_SQL).unwrap();
    std::fs::write(
        dir.path().join("onceq.toml"),
        format!(
            r#"store = "sqlite://db/onceq.db"
schema = "schema.sql"

[[queue]]
name = "chaos"
handler = "{}"
tables = ["chaos_log"]
{settings}

[admin]
{admin}
"#,
            guest("chaos").display()
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_onceq"))
        .current_dir(dir.path())
        .arg("init")
        .output()
        .unwrap();
    assert!(out.status.success(), "init: {}", String::from_utf8_lossy(&out.stderr));
    dir
}

fn sqlite(dir: &Path) -> rusqlite::Connection {
    let c = rusqlite::Connection::open(dir.join("db/onceq.db")).unwrap();
    c.busy_timeout(Duration::from_secs(10)).unwrap();
    c
}

fn send(dir: &Path, queue: &str, payload: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_onceq"))
        .current_dir(dir)
        .args(["send", queue, "--payload", payload])
        .output()
        .unwrap();
    assert!(out.status.success(), "send: {}", String::from_utf8_lossy(&out.stderr));
}

/// The issue's measurement, with the default `max_attempts` (5): a host
/// killed six times while the handler runs, then a real failure. Before,
/// every lease counted as an attempt and the first failure dead-lettered
/// the message ("gave up after 7 attempts"); now the kills are deliveries
/// without a verdict, and the message gets its five failures. (The chaos
/// handler's failure is a panic: a crash, retried here because the queue
/// sets `retry_crashes`; by default a crash is dead-lettered at once.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hosts_killed_mid_handler_do_not_use_up_the_attempts() {
    let dir = chaos_project(
        "lease = \"1s\"\ndeadline = \"60s\"\nworkers = 1\nbatch = 1\nbackoff_initial = \"20ms\"\nbackoff_max = \"50ms\"\nretry_crashes = true",
        "listen = \"off\"",
    );
    send(dir.path(), "chaos", r#"{"do": "spin-until", "n": 7}"#);
    let deliveries = |dir: &Path| -> (i64, bool) {
        sqlite(dir)
            .query_row("SELECT attempt, lease_token IS NOT NULL FROM onceq_messages", [], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .unwrap_or((-1, false))
    };
    for kill in 1..=6 {
        let mut host = Command::new(env!("CARGO_BIN_EXE_onceq"))
            .current_dir(dir.path())
            .arg("run")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // The handler is running (spinning) on delivery `kill`.
        let d = dir.path().to_path_buf();
        wait_until(&format!("delivery {kill} to be under way"), Duration::from_secs(60), || {
            let d = d.clone();
            async move { deliveries(&d) == (kill, true) }
        })
        .await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        host.kill().unwrap(); // SIGKILL
        host.wait().unwrap();
    }
    // The seventh delivery fails for real, and so do the next four.
    let drained = Command::new(env!("CARGO_BIN_EXE_onceq"))
        .current_dir(dir.path())
        .args(["run", "--until-empty"])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(drained.status.success(), "{}", String::from_utf8_lossy(&drained.stderr));
    let (failures, deliveries, reason): (i64, i64, String) = sqlite(dir.path())
        .query_row("SELECT failures, attempts, reason FROM onceq_dead_letters", [], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })
        .unwrap();
    assert_eq!(
        (failures, deliveries),
        (5, 11),
        "six deliveries lost to kills, then five failures: {reason}"
    );
    assert!(
        reason.contains("chaos: failed on delivery 11") && reason.contains("gave up after 5 failed attempts"),
        "{reason}"
    );
}

/// Triggers and conflict clauses that end the whole transaction of a
/// group-commit batch. Only the poison message fails; its neighbours, in
/// the same batches, all commit.
const POISON_SQL: &str = "
CREATE TABLE good (id TEXT PRIMARY KEY);
CREATE TABLE strict (id TEXT PRIMARY KEY ON CONFLICT ROLLBACK);
INSERT INTO strict (id) VALUES ('taken');
CREATE TRIGGER poison_rollback BEFORE INSERT ON good WHEN NEW.id LIKE 'rollback-%'
    BEGIN SELECT RAISE(ROLLBACK, 'poison row refused by trigger (rollback)'); END;
CREATE TRIGGER poison_abort BEFORE INSERT ON good WHEN NEW.id LIKE 'abort-%'
    BEGIN SELECT RAISE(ABORT, 'poison row refused by trigger (abort)'); END;
CREATE TRIGGER poison_fail AFTER INSERT ON good WHEN NEW.id LIKE 'fail-%'
    BEGIN SELECT RAISE(FAIL, 'poison row refused by trigger (fail)'); END;
";

/// Inserts the payload as the row id: into `strict` when it starts with
/// `strict-` (as the taken key, so the conflict clause rolls back), else
/// into `good`.
fn inserter() -> Arc<NativeHandler> {
    Arc::new(NativeHandler::new("inserter", |m, scope| async move {
        let id = String::from_utf8_lossy(&m.payload).into_owned();
        let (table, id) = match id.strip_prefix("strict-") {
            Some(_) => ("strict", "taken".to_string()),
            None => ("good", id),
        };
        let write = Effect::Write(RowWrite {
            table: table.into(),
            op: WriteOp::Insert,
            columns: vec![("id".into(), Value::String(id))],
        });
        HandleOutput {
            scope,
            result: Ok(vec![write]),
        }
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_that_ends_the_batch_fails_alone() {
    for kind in ["rollback", "abort", "fail", "strict"] {
        let db = TestDb::new(POISON_SQL);
        // 400 good messages, 80 poison ones mixed in.
        let payloads: Vec<String> = (0..480)
            .map(|i| if i % 6 == 5 { format!("{kind}-{i}") } else { format!("good-{i}") })
            .collect();
        db.send("q", payloads).await;
        let mut p = policy(16, 3);
        p.batch = 8;
        let r = runner(&db.store, "q", inserter(), grants(&["good", "strict"], &[], &[]), p);
        drain_within(&db.store, std::slice::from_ref(&r), Duration::from_secs(120)).await;
        assert_eq!(
            db.count("SELECT COUNT(*) FROM good WHERE id LIKE 'good-%'"),
            400,
            "{kind}: every good message committed"
        );
        let dead = db.store.dead_letter_list(Queues::All, 1000).await.unwrap();
        assert_eq!(dead.len(), 80, "{kind}: only the poison messages dead-lettered");
        for d in &dead {
            assert!(
                d.payload_text.starts_with(kind),
                "{kind}: a good message was dead-lettered: {}",
                d.reason
            );
            let own = match kind {
                "strict" => "UNIQUE constraint failed: strict.id".to_string(),
                k => format!("poison row refused by trigger ({k})"),
            };
            assert!(
                d.reason.contains(&own) && d.reason.contains("gave up after 3 failed attempts"),
                "{kind}: {}",
                d.reason
            );
            assert_eq!(d.failures, 3, "{kind}: {}", d.reason);
        }
        assert_eq!(db.count("SELECT COUNT(*) FROM onceq_messages"), 0);
        let splits = db.store.commit_stats().map_or(0, |s| s.split_batches);
        match kind {
            // The transaction is gone with the statement: the batch is
            // committed again one message at a time, and counted.
            "rollback" | "strict" => assert!(splits > 0, "{kind}: batches split: {splits}"),
            // Only the statement failed: the batch runs again with a
            // savepoint per message, as one transaction.
            _ => assert_eq!(splits, 0, "{kind}: batches split: {splits}"),
        }
    }
}

/// One counter row, read and written by every message, with 64 workers
/// and the default policy: messages of one batch abort each other
/// (correctly) and re-run; a message that keeps losing gets the committer
/// held for it. None is ever charged a failure or deferred.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_counter_with_64_workers_never_charges_a_failure() {
    let db = TestDb::new("CREATE TABLE counter (id TEXT PRIMARY KEY, n INTEGER NOT NULL);");
    let n = 2000;
    db.send("q", (0..n).map(|i| format!("{i}"))).await;
    let handler = Arc::new(NativeHandler::new("counter", |_m, mut scope| async move {
        let current = match scope.get("counter", &[Value::String("hot".into())]).await {
            Ok(Some(row)) => match col(&row, "n") {
                Value::Int64(n) => *n,
                _ => 0,
            },
            _ => 0,
        };
        let write = Effect::Write(RowWrite {
            table: "counter".into(),
            op: WriteOp::Upsert,
            columns: vec![("id".into(), Value::String("hot".into())), ("n".into(), Value::Int64(current + 1))],
        });
        HandleOutput {
            scope,
            result: Ok(vec![write]),
        }
    }));
    let p = Policy {
        workers: 64,
        ..Policy::default()
    };
    let r = runner(&db.store, "q", handler, grants(&["counter"], &[], &[]), p);
    drain_within(&db.store, std::slice::from_ref(&r), Duration::from_secs(300)).await;
    let m = &r.metrics;
    eprintln!(
        "processed {}, aborted re-runs {}, failures {}, deferred {}",
        m.processed.load(Relaxed),
        m.aborted_reruns.load(Relaxed),
        m.failures.load(Relaxed),
        m.deferred.load(Relaxed)
    );
    assert_eq!(db.count("SELECT n FROM counter"), n, "every increment exactly once");
    assert_eq!(m.failures.load(Relaxed), 0, "contention is not a failure of the message's");
    assert_eq!(
        m.deferred.load(Relaxed),
        0,
        "contention makes progress: nothing outlasted its re-runs"
    );
    assert_eq!(db.count("SELECT COUNT(*) FROM onceq_dead_letters"), 0);
}

/// Idle connections to the admin port (no token needed) used to stay open
/// for good and take every descriptor the host had: with `RLIMIT_NOFILE`
/// low, no instance could be made and every message was dead-lettered.
/// Now the server serves a bounded number and closes those that send no
/// request in `admin.header_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_admin_connections_cannot_take_the_hosts_descriptors() {
    let dir = chaos_project(
        "workers = 4\nbackoff_initial = \"20ms\"\nbackoff_max = \"50ms\"",
        "listen = \"127.0.0.1:0\"\nheader_timeout = \"1s\"\nmax_connections = 64",
    );
    // A host with 256 descriptors (a payments host uses about 30).
    let mut host = tokio::process::Command::new("sh")
        .current_dir(dir.path())
        .args(["-c", &format!("ulimit -n 256 && exec {} run", env!("CARGO_BIN_EXE_onceq"))])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let addr_file = dir.path().join(".onceq/admin.addr");
    wait_until("the admin API to listen", Duration::from_secs(60), || {
        let f = addr_file.clone();
        async move { f.exists() }
    })
    .await;
    let addr: std::net::SocketAddr = std::fs::read_to_string(&addr_file).unwrap().trim().parse().unwrap();
    // 400 connections that never send a byte.
    let mut idle = Vec::new();
    for _ in 0..400 {
        idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
    }
    let n = 300;
    let lines: Vec<String> = (0..n).map(|i| format!(r#"{{"do": "ok", "n": {i}}}"#)).collect();
    std::fs::write(dir.path().join("batch.jsonl"), lines.join("\n")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_onceq"))
        .current_dir(dir.path())
        .args(["send", "chaos", "--jsonl", "batch.jsonl"])
        .output()
        .unwrap();
    assert!(out.status.success(), "send: {}", String::from_utf8_lossy(&out.stderr));
    let d = dir.path().to_path_buf();
    wait_until("every message processed", Duration::from_secs(120), || {
        let d = d.clone();
        async move {
            sqlite(&d)
                .query_row("SELECT COUNT(*) FROM chaos_log", [], |r| r.get::<_, i64>(0))
                .unwrap()
                == n
        }
    })
    .await;
    let dead: i64 = sqlite(dir.path())
        .query_row("SELECT COUNT(*) FROM onceq_dead_letters", [], |r| r.get(0))
        .unwrap();
    assert_eq!(dead, 0, "no message paid for the idle connections");
    // The first connections were served, sent nothing, and were closed.
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(Duration::from_secs(30), idle[0].read(&mut buf)).await;
    assert!(matches!(read, Ok(Ok(0))), "an idle connection is closed by the server: {read:?}");
    // And the API still answers.
    let ready = reqwest::Client::new()
        .get(format!("http://{addr}/readyz"))
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    host.kill().await.unwrap();
}

/// A receiver that answers 500 with a 1 TiB body, streamed: the host reads
/// the excerpt it keeps for the reason and drops the connection (before,
/// it buffered the body whole: 4-5 GB of RSS).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_error_body_is_read_only_as_far_as_its_excerpt() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counted = sent.clone();
    let server = tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.unwrap();
        let mut req = vec![0u8; 64 << 10];
        let _ = sock.read(&mut req).await;
        sock.write_all(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 1099511627776\r\n\r\nthe receiver is down; ")
            .await
            .unwrap();
        let chunk = vec![b'x'; 64 << 10];
        while sock.write_all(&chunk).await.is_ok() {
            counted.fetch_add(chunk.len() as u64, Relaxed);
        }
    });
    let hook = onceq::outbox::ConnectorConfig::Webhook {
        url: format!("http://{addr}/hook"),
        timeout: Duration::from_secs(300),
        headers: vec![],
        bearer_token_env: None,
    }
    .build("hook")
    .unwrap();
    let intent = onceq::outbox::Intent {
        connector: "hook".into(),
        idempotency_key: "k-1".into(),
        payload: b"{}".to_vec(),
        metadata: vec![],
        source_queue: "q".into(),
        source_message_id: "m".into(),
        source_version: None,
        traceparent: None,
        tracestate: None,
        id: "i".into(),
        attempt: 1,
    };
    match hook.deliver(&intent).await {
        onceq::outbox::Delivery::Retry { reason, .. } => {
            assert!(reason.contains("HTTP 500") && reason.contains("the receiver is down"), "{reason}");
            assert!(reason.len() < 1024, "the excerpt is bounded: {} bytes", reason.len());
        }
        other => panic!("a 500 is retried: {other:?}"),
    }
    // The host hung up: the server's writes fail after what the socket
    // buffers held, far below the body's size.
    tokio::time::timeout(Duration::from_secs(60), server).await.unwrap().unwrap();
    let bytes = sent.load(Relaxed);
    assert!(bytes < 64 << 20, "the host read {bytes} bytes of the endless body");
}
