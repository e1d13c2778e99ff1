//! The handler test kit (`onceq-testkit`), as a handler author uses it: the
//! Rust `payments`, `inventory` and `report` examples tested with fixture
//! rows in memory, no database, no host process.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use onceq_testkit::{column, Effects, Fixture, TestKit, Value, WriteOp};
use std::path::PathBuf;

fn guest(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../guest-examples/target/wasm32-wasip2/release")
        .join(format!("{name}.wasm"));
    assert!(p.exists(), "{} is missing: run `make guests` first", p.display());
    p
}

fn s(v: &str) -> Value {
    Value::String(v.into())
}

fn payments_db() -> Fixture {
    let mut db = Fixture::from_ddl(include_str!("../guest-examples/payments/schema.sql")).unwrap();
    db.insert("accounts", [("id", s("acct-1")), ("balance", Value::Int64(100))])
        .unwrap();
    db
}

#[test]
fn payments_debits_records_the_order_and_emits_a_charge_keyed_by_the_order() {
    let kit = TestKit::new().unwrap().connectors(&["charge"]);
    let payments = kit.load(guest("payments")).unwrap();
    let db = payments_db();
    let msg = kit.message("payments", r#"{"order_id": "o-1", "account": "acct-1", "amount": 60}"#);
    let report = kit.run(&payments, &db, &msg);
    assert!(report.is_ok(), "{report:?}");
    assert_eq!(report.reads, 1);
    let writes: Vec<_> = report.writes().collect();
    let debit = writes.iter().find(|w| w.table == "accounts").unwrap();
    assert_eq!((debit.op, column(debit, "balance")), (WriteOp::Update, Some(&Value::Int64(40))));
    let order = writes.iter().find(|w| w.table == "orders").unwrap();
    assert_eq!(column(order, "status"), Some(&s("charged")));
    assert_eq!(
        column(order, "created_at"),
        Some(&Value::Timestamp(onceq_testkit::TEST_TIME)),
        "the message's logical time"
    );
    let intents: Vec<_> = report.intents().collect();
    assert_eq!(intents.len(), 1);
    assert_eq!(
        (intents[0].connector.as_str(), intents[0].idempotency_key.as_str()),
        ("charge", "charge-o-1")
    );
    // Deterministic: the same message gives the same effects.
    let again = kit.run(&payments, &db, &msg);
    assert_eq!(
        serde_json::to_string(&again.effects).unwrap(),
        serde_json::to_string(&report.effects).unwrap()
    );
    // The database is untouched: fixtures are never written.
    assert_eq!(db.rows("orders").len(), 0);
}

#[test]
fn payments_declines_rejects_and_needs_its_grant() {
    let kit = TestKit::new().unwrap().connectors(&["charge"]);
    let payments = kit.load(guest("payments")).unwrap();
    let db = payments_db();
    let declined = kit.run(
        &payments,
        &db,
        &kit.message("payments", r#"{"order_id": "o-2", "account": "acct-1", "amount": 500}"#),
    );
    assert!(declined.is_ok());
    assert_eq!(declined.intents().count(), 0, "a declined order charges nothing");
    let unknown = kit.run(
        &payments,
        &db,
        &kit.message("payments", r#"{"order_id": "o-3", "account": "acct-9", "amount": 5}"#),
    );
    assert_eq!(unknown.outcome, "reject");
    assert!(unknown.reason.as_deref().unwrap().contains("unknown account acct-9"));
    let malformed = kit.run(&payments, &db, &kit.message("payments", "{"));
    assert_eq!(malformed.outcome, "reject");
    assert!(malformed.reason.as_deref().unwrap().contains("malformed payload"));
    // Without the connector grant the host would refuse the effects.
    let ungranted = TestKit::new().unwrap();
    let p = ungranted.load(guest("payments")).unwrap();
    let r = ungranted.run(
        &p,
        &db,
        &ungranted.message("payments", r#"{"order_id": "o-1", "account": "acct-1", "amount": 60}"#),
    );
    assert_eq!(r.outcome, "invalid-effects");
    assert!(r.reason.as_deref().unwrap().contains("connector charge is not granted"), "{r:?}");
}

#[test]
fn inventory_reserves_backorders_and_rejects_unknown_items() {
    let kit = TestKit::new().unwrap();
    let inventory = kit.load(guest("inventory")).unwrap();
    let mut db = Fixture::from_ddl(include_str!("../guest-examples/inventory/schema.sql")).unwrap();
    db.insert("items", [("sku", s("sku-1")), ("stock", Value::Int64(2))]).unwrap();
    let ok = kit.run(
        &inventory,
        &db,
        &kit.message("inventory", r#"{"order_id": "o-1", "sku": "sku-1", "qty": 2}"#),
    );
    assert!(ok.is_ok(), "{ok:?}");
    let stock = ok.writes().find(|w| w.table == "items").unwrap();
    assert_eq!(column(stock, "stock"), Some(&Value::Int64(0)));
    let big = kit.run(
        &inventory,
        &db,
        &kit.message("inventory", r#"{"order_id": "o-2", "sku": "sku-1", "qty": 3}"#),
    );
    let res = big.writes().find(|w| w.table == "reservations").unwrap();
    assert_eq!(column(res, "status"), Some(&s("backordered")));
    let ghost = kit.run(
        &inventory,
        &db,
        &kit.message("inventory", r#"{"order_id": "o-3", "sku": "sku-404", "qty": 1}"#),
    );
    assert_eq!(ghost.outcome, "reject");
}

#[test]
fn report_checkpoints_a_step_and_reschedules_itself() {
    let kit = TestKit::new().unwrap().connectors(&["report-ready"]);
    let report = kit.load(guest("report")).unwrap();
    let mut db = Fixture::from_ddl(include_str!("../guest-examples/report/schema.sql")).unwrap();
    for seq in 0..3 {
        db.insert(
            "sales",
            [("day", s("2026-11-01")), ("seq", Value::Int64(seq)), ("amount", Value::Int64(10))],
        )
        .unwrap();
    }
    let msg = kit.message(
        "reports",
        r#"{"report_id": "r-1", "days": ["2026-11-01", "2026-11-02"], "pause_ms": 250}"#,
    );
    let step = kit.run(&report, &db, &msg);
    assert!(step.is_ok(), "{step:?}");
    let progress = step.writes().find(|w| w.table == "reports").unwrap();
    assert_eq!(
        (column(progress, "days_done"), column(progress, "total"), column(progress, "status")),
        (Some(&Value::Int64(1)), Some(&Value::Int64(30)), Some(&s("running")))
    );
    let next: Vec<_> = step.enqueued().collect();
    assert_eq!(next.len(), 1, "ack now, continue later");
    assert_eq!((next[0].queue.as_str(), next[0].delay_ms), ("reports", Some(250)));
    let state: serde_json::Value = serde_json::from_slice(&next[0].payload).unwrap();
    assert_eq!((state["step"].as_u64(), state["total"].as_i64()), (Some(1), Some(30)));
    assert_eq!(step.intents().count(), 0, "not done yet");
}

fn python_guest(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../guest-examples/target/python")
        .join(format!("{name}.wasm"));
    assert!(p.exists(), "{} is missing: run `make guests` (needs python3)", p.display());
    p
}

#[test]
fn the_python_payments_port_behaves_like_the_rust_one() {
    let kit = TestKit::new().unwrap().connectors(&["charge"]);
    let rust = kit.load(guest("payments")).unwrap();
    let python = kit.load(python_guest("payments")).unwrap();
    let db = payments_db();
    let cases = [
        r#"{"order_id": "o-1", "account": "acct-1", "amount": 60}"#,
        r#"{"order_id": "o-2", "account": "acct-1", "amount": 500}"#,
        r#"{"order_id": "o-3", "account": "acct-9", "amount": 5}"#,
        r#"{"order_id": "o-4", "account": "acct-1", "amount": -5}"#,
        r#"{"order_id": "o-5", "account": "acct-1"}"#,
        "{",
    ];
    for payload in cases {
        let msg = kit.message("payments", payload);
        let (r, p) = (kit.run(&rust, &db, &msg), kit.run(&python, &db, &msg));
        assert_eq!(p.outcome, r.outcome, "{payload}: {p:?}");
        assert_eq!(
            serde_json::to_value(&p.effects).unwrap(),
            serde_json::to_value(&r.effects).unwrap(),
            "{payload}: same effects, byte for byte"
        );
        assert_eq!(p.reads, r.reads, "{payload}");
    }
}
