//! The example handlers behave as documented (each example has a test).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

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
    let h = Arc::new(wasm(&rt, "payments", HandlerLimits::default()));
    let r = runner(
        &db.store,
        "payments",
        h,
        grants(&["accounts", "orders"], &[], &["charge"]),
        policy(1, 3),
    );
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
    let keys: Vec<String> = db
        .sql()
        .prepare("SELECT idempotency_key FROM onceq_outbox ORDER BY 1")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(keys, ["charge-o-1", "charge-o-3"], "declined orders emit no intent");
    let payload: String = db
        .sql()
        .query_row(
            "SELECT CAST(payload AS TEXT) FROM onceq_outbox WHERE idempotency_key = 'charge-o-1'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    let payload: serde_json::Value = serde_json::from_str(&payload).unwrap();
    assert_eq!(payload["amount"], 60);
    let dead = db.store.dead_letter_list(None, 10).await.unwrap();
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
    let dead = db.store.dead_letter_list(None, 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert!(dead[0].reason.contains("unknown item sku-404"), "{}", dead[0].reason);
}
