//! Outbox delivery and long-running work, for real: a webhook connector
//! posting to a real HTTP server (which deduplicates by `Idempotency-Key`
//! and fails in every way a real endpoint does), the dispatcher killed with
//! SIGKILL and restarted, `onceq outbox list|show|replay`, background lease
//! renewal for handlers and deliveries slower than their lease, and a
//! worker that loses its lease.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use common::http::{Faults, Receiver};
use common::*;
use onceq::outbox::{self, ConnectorConfig, OutboxSettings};
use onceq::protocol::{HandleOutput, NativeHandler, QueueRunner};
use onceq::store::faulty::{FaultPlan, FaultyStore};
use onceq::store::Store;
use onceq::value::{Effect, Intent, RowWrite, Value, WriteOp};
use std::collections::BTreeSet;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const ACCOUNTS: usize = 10;
const BALANCE: i64 = 1_000_000;

fn webhook(store: &Arc<dyn Store>, url: &str, timeout: Duration, settings: &OutboxSettings) -> Arc<QueueRunner> {
    let c = ConnectorConfig::Webhook {
        url: url.to_string(),
        timeout,
        headers: vec![("x-team".into(), "payments".into())],
        bearer_token_env: None,
    }
    .build("charge")
    .unwrap();
    Arc::new(outbox::runner(store.clone(), "charge", c, settings))
}

/// Keys of the charged orders in the database.
async fn charged_keys(store: &dyn Store) -> BTreeSet<String> {
    store
        .table_rows("orders")
        .await
        .unwrap()
        .iter()
        .filter(|r| matches!(col(r, "status"), Value::String(s) if s == "charged"))
        .map(|r| match col(r, "id") {
            Value::String(id) => format!("charge-{id}"),
            other => panic!("order id {other:?}"),
        })
        .collect()
}

/// A handler that emits an intent and a write the database refuses (an
/// order id that exists): its transaction always rolls back, so the intent
/// must never be sent.
fn doomed_handler() -> NativeHandler {
    NativeHandler::new("doomed-v1", |msg, scope| async move {
        let key = format!("doomed-{}", String::from_utf8_lossy(&msg.payload));
        let effects = vec![
            Effect::Intent(Intent {
                connector: "charge".into(),
                idempotency_key: key,
                payload: b"{}".to_vec(),
                metadata: vec![],
            }),
            Effect::Write(RowWrite {
                table: "orders".into(),
                op: WriteOp::Insert,
                columns: vec![
                    ("id".into(), Value::String("o-taken".into())),
                    ("account_id".into(), Value::String("acct-0".into())),
                    ("amount".into(), Value::Int64(1)),
                    ("status".into(), Value::String("charged".into())),
                    ("created_at".into(), Value::Timestamp(0)),
                ],
            }),
        ];
        HandleOutput {
            scope,
            result: Ok(effects),
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_applies_each_intent_once_through_500s_timeouts_and_cut_connections() {
    let server = Receiver::start(11).await;
    server.set_faults(Faults {
        error_500: 0.15,
        too_many_429: 0.05,
        slow_after_apply: 0.05,
        slow: Duration::from_millis(800),
        close_before_apply: 0.05,
        close_after_apply: 0.05,
    });
    let db = TestDb::new(PAYMENTS_SQL);
    seed_accounts(db.store.as_ref(), ACCOUNTS, BALANCE).await;
    // An order row the doomed handler will collide with.
    db.sql()
        .execute(
            "INSERT INTO orders (id, account_id, amount, status, created_at) VALUES ('o-taken', 'acct-0', 1, 'declined', 0)",
            [],
        )
        .unwrap();
    let n = 300;
    db.send("payments", (0..n).map(|i| order(i, i % ACCOUNTS, 1 + (i as i64 % 50))))
        .await;
    db.send("doomed", (0..5).map(|i| i.to_string())).await;

    // Unknown outcomes on the dispatcher's acks too: a delivery whose ack
    // may or may not have landed is delivered again, with the same key.
    let (faulty, counts) = FaultyStore::new(
        db.store.clone(),
        FaultPlan {
            after_commit: 0.05,
            before_commit: 0.05,
            seed: 5,
            ..Default::default()
        },
    );
    let store: Arc<dyn Store> = Arc::new(faulty);
    let rt = runtime();
    let payments = payments_runner(&store, &rt, policy(2, 5));
    let doomed = runner(
        &store,
        "doomed",
        Arc::new(doomed_handler()),
        grants(&["orders"], &[], &["charge"]),
        policy(1, 3),
    );
    let settings = OutboxSettings {
        max_attempts: 50,
        ..fast_outbox()
    };
    let dispatcher = webhook(&store, &server.url(), Duration::from_millis(300), &settings);
    drain_within(
        &store,
        &[payments.clone(), doomed.clone(), dispatcher.clone()],
        Duration::from_secs(120),
    )
    .await;

    let expected = charged_keys(db.store.as_ref()).await;
    assert!(expected.len() > 200, "most orders are charged ({})", expected.len());
    let seen = server.seen();
    let delivered: BTreeSet<String> = seen.keys().cloned().collect();
    let doomed_sent: Vec<&String> = delivered.iter().filter(|k| k.starts_with("doomed-")).collect();
    assert!(
        doomed_sent.is_empty(),
        "intents of rolled-back transactions were sent: {doomed_sent:?}"
    );
    assert_eq!(delivered, expected, "every charge reached the server, and nothing else");
    assert!(seen.values().all(|s| s.applied == 1), "the server applied each key once");
    let repeats: u64 = seen.values().map(|s| s.requests - 1).sum();
    let injected = server.state.faults_injected.load(Relaxed);
    eprintln!(
        "{} intents, {} requests, {injected} server faults, {repeats} repeated deliveries, {} store faults, dispatcher retried {}",
        expected.len(),
        server.state.requests.load(Relaxed),
        counts.total(),
        dispatcher.metrics.retried.load(Relaxed)
    );
    assert!(injected >= 20, "the server misbehaved often enough ({injected})");
    assert!(
        repeats >= 1,
        "lost responses and lost acks caused repeated deliveries, deduplicated by key"
    );
    assert_eq!(server.state.without_key.load(Relaxed), 0, "every request carried its key");

    // What the server got: the handler's payload, its key, the configured
    // headers.
    let one = &seen["charge-o-1"];
    let payload: serde_json::Value = serde_json::from_str(&one.payload).unwrap();
    assert_eq!(payload["order_id"], "o-1");
    let header = |name: &str| one.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str());
    assert_eq!(header("content-type"), Some("application/json"));
    assert_eq!(header("x-team"), Some("payments"));
    assert_eq!(header("idempotency-key"), Some("charge-o-1"));

    // Everything accounted for: the doomed messages dead-lettered, the
    // outbox empty, and each delivered key kept for the retention window.
    let stats = db.store.stats().await.unwrap();
    let (queues, connectors) = onceq::outbox::inspect::split_stats(&stats);
    assert_eq!(queues.iter().find(|q| q.queue == "doomed").unwrap().dead, 5);
    let charge = connectors.iter().find(|c| c.connector == "charge").unwrap();
    assert_eq!(
        (charge.pending, charge.in_flight, charge.dead, charge.delivered_retained),
        (0, 0, 0, expected.len() as u64)
    );

    // A duplicate emission within the retention window is dropped.
    let before = server.state.requests.load(Relaxed);
    server.faults_off();
    let replay = runner(
        &db.store,
        "replay",
        Arc::new(NativeHandler::new("re-emit-v1", |_msg, scope| async move {
            HandleOutput {
                scope,
                result: Ok(vec![Effect::Intent(Intent {
                    connector: "charge".into(),
                    idempotency_key: "charge-o-1".into(),
                    payload: b"{}".to_vec(),
                    metadata: vec![],
                })]),
            }
        })),
        grants(&[], &[], &["charge"]),
        policy(1, 3),
    );
    db.send("replay", ["again".to_string()]).await;
    drain(
        &db.store,
        &[
            replay.clone(),
            webhook(&db.store, &server.url(), Duration::from_secs(2), &fast_outbox()),
        ],
    )
    .await;
    assert_eq!(replay.metrics.processed.load(Relaxed), 1);
    assert_eq!(
        server.state.requests.load(Relaxed),
        before,
        "a re-emitted delivered key is not sent again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_intents_are_dead_lettered_with_the_response_and_can_be_replayed() {
    let server = Receiver::start(3).await;
    server.state.refuse.lock().unwrap().insert("charge-o-2".into());
    let db = TestDb::new(PAYMENTS_SQL);
    seed_accounts(db.store.as_ref(), ACCOUNTS, BALANCE).await;
    db.send("payments", (0..4).map(|i| order(i, i, 10))).await;
    let rt = runtime();
    let payments = payments_runner(&db.store, &rt, policy(1, 3));
    let dispatcher = webhook(&db.store, &server.url(), Duration::from_secs(2), &fast_outbox());
    drain(&db.store, &[payments, dispatcher.clone()]).await;
    assert_eq!(server.seen().len(), 3);
    assert_eq!(dispatcher.metrics.dead_lettered.load(Relaxed), 1, "a 422 is not retried");

    let dead = onceq::outbox::inspect::list(db.store.as_ref(), Some("charge"), true, 10)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1);
    let d = &dead[0];
    assert_eq!((d.state, d.intent.idempotency_key.as_str()), ("dead", "charge-o-2"));
    let reason = d.reason.as_deref().unwrap();
    assert!(reason.contains("HTTP 422") && reason.contains("refused: charge-o-2"), "{reason}");
    // The receiver refused it, not the handler.
    assert!(reason.starts_with("delivery refused: POST "), "{reason}");
    let shown = onceq::outbox::inspect::get(db.store.as_ref(), &d.intent.id).await.unwrap();
    assert_eq!(shown.payload, d.payload);
    let e = onceq::outbox::inspect::get(db.store.as_ref(), "nope")
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("no undelivered intent with id nope"), "{e}");

    // The endpoint is fixed; the intent is replayed with the same key.
    server.state.refuse.lock().unwrap().clear();
    onceq::outbox::inspect::replay(db.store.as_ref(), &d.intent.id).await.unwrap();
    let e = onceq::outbox::inspect::replay(db.store.as_ref(), &d.intent.id)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("only dead intents can be replayed"), "{e}");
    drain(
        &db.store,
        &[webhook(&db.store, &server.url(), Duration::from_secs(2), &fast_outbox())],
    )
    .await;
    assert_eq!(server.seen()["charge-o-2"].applied, 1);
    assert!(onceq::outbox::inspect::list(db.store.as_ref(), None, false, 10)
        .await
        .unwrap()
        .is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_slower_than_its_lease_finishes_without_a_second_delivery() {
    let db = TestDb::new(CHAOS_SQL);
    let calls: Arc<Mutex<std::collections::BTreeMap<String, u32>>> = Default::default();
    let c2 = calls.clone();
    let handler = Arc::new(NativeHandler::new("slow-v1", move |msg, scope| {
        let calls = c2.clone();
        async move {
            *calls.lock().unwrap().entry(msg.id.clone()).or_default() += 1;
            tokio::time::sleep(Duration::from_millis(1500)).await;
            HandleOutput {
                scope,
                result: Ok(vec![Effect::Write(RowWrite {
                    table: "chaos_log".into(),
                    op: WriteOp::Insert,
                    columns: vec![
                        ("id".into(), Value::String(msg.id.clone())),
                        ("note".into(), Value::String("slow".into())),
                    ],
                })]),
            }
        }
    }));
    db.send("slow", (0..3).map(|i| i.to_string())).await;
    // Lease 400 ms, handler 1.5 s, batches of 2: the second message of a
    // batch waits 1.5 s on its lease too. Three workers would take over
    // any expired lease at once.
    let mut p = policy(3, 3);
    p.lease = Duration::from_millis(400);
    p.batch = 2;
    let r = runner(&db.store, "slow", handler, grants(&["chaos_log"], &[], &[]), p);
    drain(&db.store, std::slice::from_ref(&r)).await;
    let calls = calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 3);
    assert!(calls.values().all(|&n| n == 1), "each message handled once: {calls:?}");
    let m = &r.metrics;
    assert_eq!(m.processed.load(Relaxed), 3);
    assert_eq!((m.lease_lost.load(Relaxed), m.cancelled.load(Relaxed)), (0, 0));
    assert!(m.lease_renewals.load(Relaxed) >= 6, "renewed {}", m.lease_renewals.load(Relaxed));
    assert_eq!(db.count("SELECT COUNT(*) FROM chaos_log"), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_slower_than_its_lease_is_not_sent_twice() {
    let server = Receiver::start(5).await;
    server
        .state
        .slow_keys
        .lock()
        .unwrap()
        .insert("charge-o-0".into(), Duration::from_millis(1500));
    let db = TestDb::new(PAYMENTS_SQL);
    seed_accounts(db.store.as_ref(), ACCOUNTS, BALANCE).await;
    db.send("payments", (0..3).map(|i| order(i, i, 10))).await;
    let rt = runtime();
    let payments = payments_runner(&db.store, &rt, policy(1, 3));
    drain(&db.store, &[payments]).await;
    let settings = OutboxSettings {
        lease: Duration::from_millis(400),
        workers: Some(3),
        batch: 1,
        ..fast_outbox()
    };
    let dispatcher = webhook(&db.store, &server.url(), Duration::from_secs(5), &settings);
    drain(&db.store, std::slice::from_ref(&dispatcher)).await;
    let seen = server.seen();
    assert_eq!(seen.len(), 3);
    assert_eq!(seen["charge-o-0"].requests, 1, "the slow delivery kept its lease: sent once");
    assert!(dispatcher.metrics.lease_renewals.load(Relaxed) >= 2);
    assert_eq!(dispatcher.metrics.processed.load(Relaxed), 3);
}

/// A connector that delivers its first `warm_up` intents at once, then
/// holds each delivery until `expected` have arrived (or `patience`
/// passed), counting how many it held at once and each key.
struct Gathering {
    together: bool,
    warm_up: u64,
    expected: u64,
    patience: Duration,
    arrived: AtomicU64,
    held: AtomicU64,
    most_held: AtomicU64,
    keys: Mutex<Vec<String>>,
}

#[async_trait::async_trait]
impl outbox::Connector for Gathering {
    fn kind(&self) -> &'static str {
        "gathering"
    }

    fn delivers_together(&self) -> bool {
        self.together
    }

    async fn deliver(&self, intent: &outbox::Intent) -> outbox::Delivery {
        if self.arrived.fetch_add(1, Relaxed) < self.warm_up {
            self.keys.lock().unwrap().push(intent.idempotency_key.clone());
            return outbox::Delivery::Delivered("warming up".into());
        }
        let held = self.held.fetch_add(1, Relaxed) + 1;
        self.most_held.fetch_max(held, Relaxed);
        let until = tokio::time::Instant::now() + self.patience;
        while self.arrived.load(Relaxed) < self.expected && tokio::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.keys.lock().unwrap().push(intent.idempotency_key.clone());
        self.held.fetch_sub(1, Relaxed);
        outbox::Delivery::Delivered("gathered".into())
    }
}

/// One outbox worker delivers the intents of its leased batch at once
/// when its connector allows it (a `file` connector's deliveries then
/// share one write and `fdatasync` instead of waiting for one each), and
/// one after another otherwise (a webhook's receiver is asked to take
/// `outbox.workers` at once, no more). Each is delivered once, with its
/// key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_worker_delivers_its_batch_together_where_its_connector_allows() {
    for (together, patience, most) in [(true, Duration::from_secs(3), 4), (false, Duration::from_millis(300), 1)] {
        let db = TestDb::new(PAYMENTS_SQL);
        seed_accounts(db.store.as_ref(), ACCOUNTS, BALANCE).await;
        db.send("payments", (0..6).map(|i| order(i, i, 10))).await;
        let rt = runtime();
        let payments = payments_runner(&db.store, &rt, policy(1, 3));
        drain(&db.store, &[payments]).await;
        let gathering = Arc::new(Gathering {
            together,
            // A worker leases one message before it has measured its
            // pace, and its second lease starts before the first batch
            // is measured: two batches of one, then the other four.
            warm_up: 2,
            expected: 6,
            patience,
            arrived: AtomicU64::new(0),
            held: AtomicU64::new(0),
            most_held: AtomicU64::new(0),
            keys: Mutex::new(Vec::new()),
        });
        let settings = OutboxSettings {
            workers: Some(1),
            batch: 4,
            ..fast_outbox()
        };
        let dispatcher = Arc::new(outbox::runner(db.store.clone(), "charge", gathering.clone(), &settings));
        drain(&db.store, std::slice::from_ref(&dispatcher)).await;
        assert_eq!(
            gathering.most_held.load(Relaxed),
            most,
            "deliveries at once by one worker with a batch of four intents (together: {together})"
        );
        let mut keys = gathering.keys.lock().unwrap().clone();
        keys.sort();
        assert_eq!(keys, (0..6).map(|i| format!("charge-o-{i}")).collect::<Vec<_>>());
        assert_eq!(dispatcher.metrics.processed.load(Relaxed), 6);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_loses_its_lease_cannot_commit() {
    let db = TestDb::new(CHAOS_SQL);
    let calls = Arc::new(AtomicU64::new(0));
    let c2 = calls.clone();
    // A counter: read n, write n + 1, slowly.
    let handler = Arc::new(NativeHandler::new("counter-v1", move |_msg, mut scope| {
        let calls = c2.clone();
        async move {
            calls.fetch_add(1, Relaxed);
            let n = match scope.get("chaos_log", &[Value::String("counter".into())]).await.unwrap() {
                Some(row) => match col(&row, "n") {
                    Value::Int64(n) => *n,
                    _ => 0,
                },
                None => 0,
            };
            tokio::time::sleep(Duration::from_millis(1200)).await;
            HandleOutput {
                scope,
                result: Ok(vec![Effect::Write(RowWrite {
                    table: "chaos_log".into(),
                    op: WriteOp::Upsert,
                    columns: vec![("id".into(), Value::String("counter".into())), ("n".into(), Value::Int64(n + 1))],
                })]),
            }
        }
    }));
    db.send("count", ["one".to_string()]).await;
    let mut p = policy(1, 5);
    p.lease = Duration::from_millis(400);
    // Worker A is cut off from the database for renewals: its lease runs
    // out while the handler works.
    let (cut_off, counts) = FaultyStore::new(
        db.store.clone(),
        FaultPlan {
            renewals_fail: true,
            ..Default::default()
        },
    );
    let cut_off: Arc<dyn Store> = Arc::new(cut_off);
    let a = runner(&cut_off, "count", handler.clone(), grants(&["chaos_log"], &[], &[]), p.clone());
    let (stop_a, rx_a) = onceq::shutdown::channel();
    let run_a = tokio::spawn(a.clone().run(rx_a));
    wait_until("worker A to lease the message", Duration::from_secs(10), || {
        let c = calls.clone();
        async move { c.load(Relaxed) >= 1 }
    })
    .await;
    // Worker B, healthy, takes the message over once the lease expires.
    let b = runner(&db.store, "count", handler, grants(&["chaos_log"], &[], &[]), p);
    drain(&db.store, std::slice::from_ref(&b)).await;
    stop_a.request();
    run_a.await.unwrap();

    assert!(counts.renewals.load(Relaxed) >= 1, "A tried to renew");
    // A may lease the message again after a cancel (its leasing works; its
    // renewals do not), and is cancelled again each time.
    let cancelled = a.metrics.cancelled.load(Relaxed);
    assert!(cancelled >= 1, "A's work was cancelled when its lease ran out");
    assert_eq!(a.metrics.processed.load(Relaxed), 0, "A committed nothing");
    assert_eq!(b.metrics.processed.load(Relaxed), 1);
    assert_eq!(
        calls.load(Relaxed),
        cancelled + 1,
        "handled by A (cancelled each time) and once by B"
    );
    assert_eq!(
        db.count("SELECT n FROM chaos_log WHERE id = 'counter'"),
        1,
        "the counter moved once: A's stale write never landed"
    );
}

fn onceq(dir: &std::path::Path, args: &[&str]) -> tokio::process::Command {
    onceq_command(dir, args)
}

async fn onceq_ok(dir: &std::path::Path, args: &[&str]) -> String {
    let out = onceq(dir, args).output().await.unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "onceq {args:?} failed: {text}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatcher_killed_mid_run_and_restarted_delivers_every_intent_once_per_key() {
    let server = Receiver::start(21).await;
    server.set_faults(Faults {
        error_500: 0.1,
        close_after_apply: 0.05,
        close_before_apply: 0.05,
        ..Default::default()
    });
    let dir = tempfile::tempdir().unwrap();
    let mut schema = PAYMENTS_SQL.to_string();
    for i in 0..ACCOUNTS {
        schema.push_str(&format!("INSERT INTO accounts (id, balance) VALUES ('acct-{i}', {BALANCE});\n"));
    }
    std::fs::write(dir.path().join("schema.sql"), schema).unwrap();
    std::fs::write(
        dir.path().join("onceq.toml"),
        format!(
            r#"store = "onceq.db"
schema = "schema.sql"

[defaults]
lease = "1s"
backoff_initial = "10ms"
backoff_max = "100ms"

[[queue]]
name = "payments"
handler = "{}"
tables = ["accounts", "orders"]
connectors = ["charge"]

[[connector]]
name = "charge"
kind = "webhook"
url = "{}"
timeout = "2s"

[outbox]
workers = 4
lease = "1s"
backoff_initial = "10ms"
backoff_max = "200ms"
max_attempts = 100

[admin]
listen = "127.0.0.1:0"
"#,
            guest("payments").display(),
            server.url()
        ),
    )
    .unwrap();
    let d = dir.path();
    onceq_ok(d, &["init"]).await;
    let n = 1500;
    let lines: Vec<String> = (0..n).map(|i| order(i, i % ACCOUNTS, 1 + (i as i64 % 50))).collect();
    std::fs::write(d.join("orders.jsonl"), lines.join("\n")).unwrap();
    onceq_ok(d, &["send", "payments", "--jsonl", "orders.jsonl"]).await;

    let mut child = onceq(d, &["run"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_until("the first deliveries", Duration::from_secs(60), || {
        let s = server.state.clone();
        async move { s.keys.lock().unwrap().len() >= 50 }
    })
    .await;
    child.kill().await.unwrap(); // SIGKILL
    let at_kill = server.seen().len();
    let db = rusqlite::Connection::open(d.join("onceq.db")).unwrap();
    let count = |sql: &str| -> i64 { db.query_row(sql, [], |r| r.get(0)).unwrap() };
    let undelivered = count("SELECT COUNT(*) FROM onceq_messages WHERE queue = 'onceq.outbox.charge'");
    let unprocessed = count("SELECT COUNT(*) FROM onceq_messages WHERE queue = 'payments'");
    assert!(
        undelivered + unprocessed > 0,
        "the kill must land mid-run ({at_kill} delivered, nothing left)"
    );

    let out = onceq_ok(d, &["run", "--until-empty"]).await;
    assert!(out.contains("onceq.outbox.charge: processed"), "{out}");
    let charged: BTreeSet<String> = {
        let mut st = db.prepare("SELECT 'charge-' || id FROM orders WHERE status = 'charged'").unwrap();
        st.query_map([], |r| r.get(0)).unwrap().map(Result::unwrap).collect()
    };
    let seen = server.seen();
    assert_eq!(
        seen.keys().cloned().collect::<BTreeSet<_>>(),
        charged,
        "every charge delivered, nothing else"
    );
    assert!(seen.values().all(|s| s.applied == 1));
    eprintln!(
        "{} intents; {at_kill} delivered before the kill; {} requests; {} server faults",
        charged.len(),
        server.state.requests.load(Relaxed),
        server.state.faults_injected.load(Relaxed)
    );

    let out = onceq_ok(d, &["outbox", "list"]).await;
    assert!(out.contains("no undelivered intents"), "{out}");
    let stats: serde_json::Value = serde_json::from_str(&onceq_ok(d, &["stats", "--json"]).await).unwrap();
    assert_eq!(stats["outbox"][0]["connector"], "charge");
    assert_eq!(stats["outbox"][0]["delivered_retained"], charged.len() as u64);
    assert_eq!(
        stats["outbox"][0]["delivered"],
        charged.len() as u64,
        "each intent's delivery committed once, across the kill"
    );
    assert_eq!(stats["outbox"][0]["pending"], 0);
    let text = onceq_ok(d, &["stats"]).await;
    assert!(text.contains("OUTBOX") && text.contains("DELIVERED"), "{text}");
    // The delivered intents, by key, with their delivery times.
    let listed: Vec<serde_json::Value> =
        serde_json::from_str(&onceq_ok(d, &["outbox", "delivered", "--limit", "100000", "--json"]).await).unwrap();
    let keys: BTreeSet<String> = listed.iter().map(|e| e["idempotency_key"].as_str().unwrap().to_string()).collect();
    assert_eq!(keys, charged, "`onceq outbox delivered` lists every delivered intent");
    assert!(listed
        .iter()
        .all(|e| e["connector"] == "charge" && e["delivered_at"].as_i64() < e["key_kept_until"].as_i64()));
    let text = onceq_ok(d, &["outbox", "delivered", "--limit", "3"]).await;
    assert!(text.contains("KEY KEPT UNTIL") && text.lines().count() == 4, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_webhook_receives_the_message_s_trace_as_traceparent() {
    // A message sent inside a trace: the intent its handler emits carries
    // the same trace to the receiver, in a span of its own (derived, so a
    // re-run sends the same), with the tracestate as it came.
    let server = Receiver::start(12).await;
    let db = TestDb::new(PAYMENTS_SQL);
    seed_accounts(db.store.as_ref(), ACCOUNTS, BALANCE).await;
    let sent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    db.store
        .message_send(vec![onceq::store::SendParams {
            queue: "payments".into(),
            payload: order(1, 1, 10).into_bytes(),
            attributes: vec![
                ("onceq.traceparent".into(), sent.into()),
                ("onceq.tracestate".into(), "vendor=1".into()),
            ],
            ..Default::default()
        }])
        .await
        .unwrap();
    db.send("payments", [order(2, 2, 10)]).await;
    let rt = runtime();
    let payments = payments_runner(&db.store, &rt, policy(1, 1));
    let dispatcher = webhook(&db.store, &server.url(), Duration::from_millis(300), &fast_outbox());
    drain_within(&db.store, &[payments, dispatcher], Duration::from_secs(60)).await;
    let seen = server.seen();
    let header = |key: &str, name: &str| seen[key].headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    let got = header("charge-o-1", "traceparent").expect("a traceparent header");
    let parsed = onceq::trace::TraceParent::parse(&got).expect("a valid traceparent");
    let parent = onceq::trace::TraceParent::parse(sent).unwrap();
    assert_eq!(parsed.trace_id, parent.trace_id, "the same trace: {got}");
    assert_ne!(parsed.span_id, parent.span_id, "a span of its own: {got}");
    assert_eq!(parsed.flags, 1);
    assert_eq!(header("charge-o-1", "tracestate").as_deref(), Some("vendor=1"));
    assert_eq!(
        header("charge-o-2", "traceparent"),
        None,
        "a message without a trace passes none on"
    );
}
