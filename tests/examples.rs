//! The example handlers behave as documented (each example has a test).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use common::*;
use onceq::runtime::HandlerLimits;
use std::sync::Arc;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn payments_charges_declines_and_rejects() {
    let db = TestDb::new(PAYMENTS_SQL);
    seed_accounts(db.store.as_ref(), 2, 100).await;
    db.send(
        "payments",
        [
            order(1, 0, 60),                                                         // charged
            order(2, 0, 60),                                                         // declined: 40 left
            order(3, 1, 100),                                                        // charged, to zero
            r#"{"order_id": "o-4", "account": "acct-9", "amount": 5}"#.to_string(),  // unknown account
            r#"{"order_id": "o-5", "account": "acct-1", "amount": -5}"#.to_string(), // bad amount
            r#"{"order_id": "o-6", "account": "acct-1"}"#.to_string(),               // malformed
        ],
    )
    .await;
    let rt = runtime();
    let r = payments_runner(&db.store, &rt, policy(1, 3));
    drain(&db.store, std::slice::from_ref(&r)).await;

    let status = |id: &str| {
        db.sql()
            .query_row("SELECT status FROM orders WHERE id = ?1", [id], |r| r.get::<_, String>(0))
            .unwrap()
    };
    assert_eq!(status("o-1"), "charged");
    assert_eq!(status("o-2"), "declined");
    assert_eq!(status("o-3"), "charged");
    assert_eq!(db.count("SELECT balance FROM accounts WHERE id = 'acct-0'"), 40);
    assert_eq!(db.count("SELECT balance FROM accounts WHERE id = 'acct-1'"), 0);
    // The charge intents wait in the outbox until a dispatcher delivers
    // them; here through a file connector.
    let charges = db.dir.path().join("charges.jsonl");
    assert!(file_lines(&charges).is_empty(), "nothing is delivered before the dispatcher runs");
    drain(&db.store, &[file_dispatcher(&db.store, "charge", &charges)]).await;
    let lines = file_lines(&charges);
    let mut keys: Vec<&str> = lines.iter().map(|l| l["idempotency_key"].as_str().unwrap()).collect();
    keys.sort();
    assert_eq!(keys, ["charge-o-1", "charge-o-3"], "declined orders emit no intent");
    let payload = &lines.iter().find(|l| l["idempotency_key"] == "charge-o-1").unwrap()["payload"];
    assert_eq!(lines[0]["source_queue"], "payments");
    assert_eq!(payload["amount"], 60);
    let dead = db.store.dead_letter_list(onceq::store::Queues::All, 10).await.unwrap();
    let reasons: Vec<&str> = dead.iter().map(|d| d.reason.as_str()).collect();
    assert_eq!(dead.len(), 3, "{reasons:?}");
    assert!(reasons.iter().any(|r| r.contains("unknown account acct-9")));
    assert!(reasons.iter().any(|r| r.contains("amount must be positive")));
    assert!(reasons
        .iter()
        .any(|r| r.contains("malformed payload") && r.contains("missing field `amount`")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inventory_never_oversells_under_concurrent_workers() {
    let db = TestDb::new(INVENTORY_SQL);
    db.sql()
        .execute_batch("INSERT INTO items (sku, stock) VALUES ('sku-1', 150), ('sku-2', 3);")
        .unwrap();
    // 200 orders of one unit each for sku-1 (only 150 in stock), from 4
    // workers: each read of the stock is re-validated at commit.
    let mut msgs: Vec<String> = (0..200)
        .map(|i| serde_json::json!({"order_id": format!("o-{i}"), "sku": "sku-1", "qty": 1}).to_string())
        .collect();
    msgs.push(serde_json::json!({"order_id": "o-big", "sku": "sku-2", "qty": 5}).to_string());
    msgs.push(serde_json::json!({"order_id": "o-ghost", "sku": "sku-404", "qty": 1}).to_string());
    db.send("inventory", msgs).await;
    let rt = runtime();
    let h = Arc::new(wasm(&rt, "inventory", HandlerLimits::default()));
    let r = runner(
        &db.store,
        "inventory",
        h,
        grants(&["items", "reservations"], &[], &[]),
        policy(4, 3),
    );
    drain(&db.store, std::slice::from_ref(&r)).await;
    assert_eq!(db.count("SELECT stock FROM items WHERE sku = 'sku-1'"), 0);
    assert_eq!(
        db.count("SELECT COUNT(*) FROM reservations WHERE sku = 'sku-1' AND status = 'reserved'"),
        150
    );
    assert_eq!(
        db.count("SELECT COUNT(*) FROM reservations WHERE sku = 'sku-1' AND status = 'backordered'"),
        50
    );
    assert_eq!(
        db.count("SELECT stock FROM items WHERE sku = 'sku-2'"),
        3,
        "an order larger than the stock is backordered"
    );
    assert_eq!(
        db.count("SELECT COUNT(*) FROM reservations WHERE order_id = 'o-big' AND status = 'backordered'"),
        1
    );
    let dead = db.store.dead_letter_list(onceq::store::Queues::All, 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert!(dead[0].reason.contains("unknown item sku-404"), "{}", dead[0].reason);
}

const REPORT_SQL: &str = include_str!("../guest-examples/report/schema.sql");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_runs_as_checkpointed_steps_with_ack_and_reschedule() {
    let db = TestDb::new(REPORT_SQL);
    let days: Vec<String> = (1..=4).map(|d| format!("2026-11-0{d}")).collect();
    let (mut count, mut total) = (0i64, 0i64);
    {
        let c = db.sql();
        for (d, day) in days.iter().enumerate() {
            for seq in 0..(10 * (d as i64 + 1)) {
                c.execute(
                    "INSERT INTO sales (day, seq, amount) VALUES (?1, ?2, ?3)",
                    rusqlite::params![day, seq, seq + 1],
                )
                .unwrap();
                count += 1;
                total += seq + 1;
            }
        }
    }
    db.send(
        "reports",
        [
            serde_json::json!({ "report_id": "r-1", "days": days, "pause_ms": 50 }).to_string(),
            serde_json::json!({ "report_id": "r-empty", "days": [] }).to_string(),
        ],
    )
    .await;
    let rt = runtime();
    let r = runner(
        &db.store,
        "reports",
        Arc::new(wasm(&rt, "report", HandlerLimits::default())),
        grants(&["sales", "reports"], &[], &["report-ready"]),
        policy(1, 3),
    );

    // One step by hand: its checkpoint is committed with its ack, and the
    // next step is waiting on the queue.
    let leased = db
        .store
        .message_lease(onceq::store::LeaseParams {
            queue: "reports".into(),
            limit: 2,
            lease: std::time::Duration::from_secs(10),
        })
        .await
        .unwrap();
    for lm in &leased {
        r.process(lm).await;
    }
    let row = |col_: &str| db.count(&format!("SELECT {col_} FROM reports WHERE id = 'r-1'"));
    assert_eq!((row("days_done"), row("sales"), row("total")), (1, 10, 55), "step 1 checkpointed");
    let status: String = db
        .sql()
        .query_row("SELECT status FROM reports WHERE id = 'r-1'", [], |r| r.get(0))
        .unwrap();
    assert_eq!(status, "running");
    assert_eq!(
        db.count("SELECT COUNT(*) FROM onceq_messages WHERE queue = 'reports'"),
        1,
        "the next step is enqueued, nothing else"
    );
    let dead = db.store.dead_letter_list(onceq::store::Queues::Named("reports"), 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert!(dead[0].reason.contains("report r-empty: no days"), "{}", dead[0].reason);

    drain(&db.store, std::slice::from_ref(&r)).await;
    assert_eq!(
        (row("days_done"), row("days_total"), row("sales"), row("total")),
        (4, 4, count, total)
    );
    let status: String = db
        .sql()
        .query_row("SELECT status FROM reports WHERE id = 'r-1'", [], |r| r.get(0))
        .unwrap();
    assert_eq!(status, "done");
    let m = &r.metrics;
    assert_eq!(m.processed.load(std::sync::atomic::Ordering::Relaxed), 4, "one message per step");
    assert_eq!(
        m.enqueued.load(std::sync::atomic::Ordering::Relaxed),
        3,
        "each step but the last rescheduled the job"
    );

    // The last step's intent, delivered once.
    let ready = db.dir.path().join("ready.jsonl");
    drain(&db.store, &[file_dispatcher(&db.store, "report-ready", &ready)]).await;
    let lines = file_lines(&ready);
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0]["idempotency_key"], "report-r-1");
    assert_eq!(lines[0]["payload"]["total"], total);
    assert_eq!(lines[0]["metadata"]["x-report-days"], "4");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_python_and_javascript_payments_leave_the_same_database_state() {
    let port = |lang: &str| {
        let p = repo_root().join(format!("guest-examples/target/{lang}/payments.wasm"));
        assert!(p.exists(), "{} is missing: run `make guests` (needs python3 and npm)", p.display());
        p
    };
    let (py, js) = (port("python"), port("js"));
    let rt = runtime_cached();
    let mut states = Vec::new();
    for handler in [
        Arc::new(wasm(&rt, "payments", HandlerLimits::default())),
        Arc::new(rt.load_file(&py, HandlerLimits::default()).unwrap()),
        Arc::new(rt.load_file(&js, HandlerLimits::default()).unwrap()),
    ] {
        let db = TestDb::new(PAYMENTS_SQL);
        // The end state must not depend on the order two workers take the
        // messages in: no account's orders add up to its balance (at most
        // 7 x 99 < 1000), and every tenth order is over any balance, so it
        // is declined whenever it runs.
        seed_accounts(db.store.as_ref(), 5, 1000).await;
        let mut msgs: Vec<String> = (0..40)
            .map(|i| order(i, i % 6, if i % 10 == 9 { 5000 } else { 10 + (i as i64 * 7) % 90 }))
            .collect();
        msgs.push(r#"{"order_id": "o-bad", "account": "acct-1", "amount": 0}"#.to_string());
        db.send("payments", msgs).await;
        let r = runner(
            &db.store,
            "payments",
            handler,
            grants(&["accounts", "orders"], &[], &["charge"]),
            policy(2, 3),
        );
        drain(&db.store, std::slice::from_ref(&r)).await;
        let dump = |sql: &str| -> Vec<String> {
            let c = db.sql();
            let mut st = c.prepare(sql).unwrap();
            let n = st.column_count();
            st.query_map([], |row| {
                Ok((0..n)
                    .map(|i| format!("{:?}", row.get_ref(i).unwrap()))
                    .collect::<Vec<_>>()
                    .join("|"))
            })
            .unwrap()
            .map(Result::unwrap)
            .collect()
        };
        let intents = onceq::outbox::inspect::list(db.store.as_ref(), Some("charge"), false, 1000)
            .await
            .unwrap();
        let mut intents: Vec<(String, String)> = intents.into_iter().map(|i| (i.intent.idempotency_key, i.payload)).collect();
        intents.sort();
        states.push((
            dump("SELECT id, account_id, amount, status FROM orders ORDER BY id"),
            dump("SELECT id, balance FROM accounts ORDER BY id"),
            intents,
            db.store.dead_letter_list(onceq::store::Queues::All, 10).await.unwrap().len(),
        ));
    }
    assert!(
        states[0].2.len() + 2 <= states[0].0.len(),
        "declined orders are recorded but charge nothing: {} intents for {} orders",
        states[0].2.len(),
        states[0].0.len()
    );
    // acct-5 does not exist: those orders are rejected, like the bad amount.
    assert!(
        states[0].0.len() >= 30 && states[0].3 >= 2,
        "orders and rejections: {} orders, {} dead",
        states[0].0.len(),
        states[0].3
    );
    assert_eq!(
        states[0], states[1],
        "Rust and Python payments: same orders, balances, intents and dead letters"
    );
    assert_eq!(
        states[0], states[2],
        "Rust and JavaScript payments: same orders, balances, intents and dead letters"
    );
}
