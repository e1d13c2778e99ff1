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

/// A port of an example in another language, built by `make guests`.
fn port(lang: &str, name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../guest-examples/target")
        .join(lang)
        .join(format!("{name}.wasm"));
    let needs = if lang == "js" { "npm" } else { "python3" };
    assert!(p.exists(), "{} is missing: run `make guests` (needs {needs})", p.display());
    p
}

/// The JS and Python components take seconds to compile: tests share the
/// on-disk cache, as a handler author's tests would.
fn cached_kit() -> TestKit {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/onceq-test-cache");
    TestKit::with_cache(dir).unwrap()
}

/// Every case through the Rust example and its ports: same outcome, same
/// effects byte for byte, same number of reads.
fn ports_behave_like_rust(kit: &TestKit, name: &str, db: &Fixture, cases: &[&str]) {
    let rust = kit.load(guest(name)).unwrap();
    for lang in ["python", "js"] {
        let other = kit.load(port(lang, name)).unwrap();
        for payload in cases {
            let msg = kit.message(name, *payload);
            let (r, o) = (kit.run(&rust, db, &msg), kit.run(&other, db, &msg));
            assert_eq!(o.outcome, r.outcome, "{lang} {name} {payload}: {o:?}");
            assert_eq!(
                serde_json::to_value(&o.effects).unwrap(),
                serde_json::to_value(&r.effects).unwrap(),
                "{lang} {name} {payload}: same effects, byte for byte"
            );
            assert_eq!(o.reads, r.reads, "{lang} {name} {payload}");
            if r.outcome == "reject" {
                let (rr, or) = (r.reason.unwrap(), o.reason.unwrap());
                if rr.starts_with("malformed payload") {
                    // Parser messages differ by language.
                    assert!(or.starts_with("malformed payload"), "{lang} {name} {payload}: {or}");
                } else {
                    assert_eq!(or, rr, "{lang} {name} {payload}: the same reason");
                }
            }
        }
    }
}

#[test]
fn the_python_and_javascript_payments_ports_behave_like_the_rust_one() {
    let kit = cached_kit().connectors(&["charge"]);
    let cases = [
        r#"{"order_id": "o-1", "account": "acct-1", "amount": 60}"#,
        r#"{"order_id": "o-2", "account": "acct-1", "amount": 500}"#,
        r#"{"order_id": "o-3", "account": "acct-9", "amount": 5}"#,
        r#"{"order_id": "o-4", "account": "acct-1", "amount": -5}"#,
        r#"{"order_id": "o-5", "account": "acct-1"}"#,
        r#"{"order_id": "o-6", "account": "acct-1", "amount": 100}"#,
        "{",
        "5",
        "null",
    ];
    ports_behave_like_rust(&kit, "payments", &payments_db(), &cases);
}

#[test]
fn the_python_and_javascript_inventory_ports_behave_like_the_rust_one() {
    let kit = cached_kit();
    let mut db = Fixture::from_ddl(include_str!("../guest-examples/inventory/schema.sql")).unwrap();
    db.insert("items", [("sku", s("sku-1")), ("stock", Value::Int64(2))]).unwrap();
    let cases = [
        r#"{"order_id": "o-1", "sku": "sku-1", "qty": 2}"#,
        r#"{"order_id": "o-2", "sku": "sku-1", "qty": 3}"#,
        r#"{"order_id": "o-3", "sku": "sku-404", "qty": 1}"#,
        r#"{"order_id": "o-4", "sku": "sku-1", "qty": 0}"#,
        r#"{"order_id": "o-5", "qty": 1}"#,
        "not json",
        "null",
    ];
    ports_behave_like_rust(&kit, "inventory", &db, &cases);
}

/// The ordinary clock and randomness APIs of a language, through its SDK
/// and build: the message's logical time, randomness seeded per message;
/// no state carried between messages; an uncaught exception is a crash
/// whose reason names it.
fn clock_and_randomness_are_the_message_s(lang: &str, bug: &str) {
    let kit = cached_kit();
    let component = kit.load(port(lang, "fixtures/sdk")).unwrap();
    let db = Fixture::from_ddl("CREATE TABLE clock (id TEXT PRIMARY KEY, seen TEXT NOT NULL);").unwrap();
    let seen = |msg: &onceq_testkit::Message| {
        let r = kit.run(&component, &db, msg);
        assert!(r.is_ok(), "{lang}: {r:?}");
        let w = r.writes().next().unwrap().clone();
        let seen = match column(&w, "seen") {
            Some(Value::String(s)) => s.clone(),
            other => panic!("seen column: {other:?}"),
        };
        serde_json::from_str::<serde_json::Value>(&seen).unwrap()
    };
    let msg = kit.message("clock", "{}");
    let first = seen(&msg);
    // The wall clock is the message's logical time, in milliseconds.
    assert_eq!(first["now"].as_i64(), Some(onceq_testkit::TEST_TIME / 1000), "{lang}: {first}");
    // The same message gives the same numbers; another message others.
    assert_eq!(seen(&msg), first, "{lang}: a re-run sees the same clock and randomness");
    let mut other = kit.message("clock", "{}");
    other.id = "m-2".into();
    let second = seen(&other);
    for key in ["random", "crypto"] {
        assert_ne!(second[key], first[key], "{lang}: {key} is seeded per message");
    }
    // A module-level counter the handler bumps: every message starts from
    // the module as built, in a fresh instance.
    assert_eq!(
        (first["calls"].as_i64(), second["calls"].as_i64()),
        (Some(1), Some(1)),
        "{lang}: state carried from one message to the next"
    );
    let failed = kit.run(&component, &db, &kit.message("clock", r#"{"throw": true}"#));
    // A crash, named as one (not a retry the handler asked for).
    assert_eq!(failed.outcome, "failed", "{lang}: {failed:?}");
    let reason = failed.reason.unwrap();
    assert!(reason.contains(&format!("handler crashed: uncaught {bug}")), "{lang}: {reason}");
    assert!(!reason.contains("asked to retry"), "{lang}: {reason}");
    // Frames name the project's files, not the builder's folders.
    assert!(
        !reason.contains("/tmp/") && !reason.contains("file://") && !reason.contains("/0/"),
        "{lang}: {reason}"
    );
    if lang == "python" {
        assert!(reason.contains("  app.py:"), "{lang}: the handler's frame: {reason}");
    }
    // What the sandbox does not offer (Python's open(), JavaScript's
    // fetch()) is a crash that says so and where, not a bare trap.
    let failed = kit.run(&component, &db, &kit.message("clock", r#"{"sandbox": true}"#));
    assert_eq!(failed.outcome, "failed", "{lang}: {failed:?}");
    let reason = failed.reason.unwrap();
    let (call, file) = if lang == "python" {
        ("open('/etc/passwd')", "app.py:")
    } else {
        ("fetch(\"https://example.com/\")", "app.js:")
    };
    assert!(
        reason.contains(&format!("{call} is not available in onceq's sandbox")),
        "{lang}: {reason}"
    );
    assert!(reason.contains(file) && !reason.contains("unreachable"), "{lang}: {reason}");
}

#[test]
fn javascript_clock_and_randomness_are_the_message_s_and_bugs_name_themselves() {
    // Date.now(), Math.random(), crypto.getRandomValues(); a TypeError.
    clock_and_randomness_are_the_message_s("js", "TypeError");
}

#[test]
fn python_clock_and_randomness_are_the_message_s_and_bugs_name_themselves() {
    // time.time(), random.random(), os.urandom() (and uuid4); a KeyError.
    clock_and_randomness_are_the_message_s("python", "KeyError: 'missing'");
}

/// What the JavaScript SDK reads it writes back unchanged, every value type
/// included (its reads and effects cross as JSON: an int64 past 2^53, a
/// float64 with no fraction, bytes, a JSON document, a timestamp), and an
/// object's inherited properties are not columns.
#[test]
fn javascript_reads_and_writes_back_every_value_type_unchanged() {
    let kit = cached_kit();
    let mut db = Fixture::from_ddl(
        "CREATE TABLE kv (k TEXT NOT NULL, n INTEGER NOT NULL, f REAL, j JSON, b BLOB, t TIMESTAMP, flag BOOLEAN, note TEXT, PRIMARY KEY (k, n));",
    )
    .unwrap();
    let big = 1i64 << 60;
    let original = [
        ("k", s("full")),
        ("n", Value::Int64(big)),
        ("f", Value::Float64(2.0)),
        ("j", Value::Json(r#"{"a":[1,2.5,"x"]}"#.into())),
        ("b", Value::Bytes(vec![0, 127, 255])),
        ("t", Value::Timestamp(onceq_testkit::TEST_TIME)),
        ("flag", Value::Bool(false)),
        ("note", s("é \"quoted\" \u{1F600}")),
    ];
    db.insert("kv", original.clone()).unwrap();
    let r = kit.run(
        &kit.load(port("js", "fixtures/sdk")).unwrap(),
        &db,
        &kit.message("sdk", r#"{"echo": "full"}"#),
    );
    assert!(r.is_ok(), "{r:?}");
    let copy = r.writes().find(|w| column(w, "k") == Some(&s("copy"))).unwrap();
    for (name, v) in &original[1..] {
        assert_eq!(column(copy, name), Some(v), "column {name} of {copy:?}");
    }
    // As the handler saw them: an int64 past 2^53 as a BigInt, the rest
    // as plain values.
    let types = r.writes().find(|w| column(w, "k") == Some(&s("types"))).unwrap();
    assert_eq!(
        column(types, "note"),
        Some(&s("string bigint number string bytes number boolean string"))
    );
}

/// Every SDK call, in JavaScript and Python: the same effects, byte for
/// byte, and the ones the fixture asked for (names, types, options).
#[test]
fn the_javascript_and_python_sdks_emit_every_effect_alike() {
    let kit = cached_kit().enqueue(&["next"]).connectors(&["hook"]);
    let mut db = Fixture::from_ddl(
        "CREATE TABLE clock (id TEXT PRIMARY KEY, seen TEXT NOT NULL);
         CREATE TABLE kv (k TEXT NOT NULL, n INTEGER NOT NULL, f REAL, j JSON, b BLOB, t TIMESTAMP, flag BOOLEAN, note TEXT, PRIMARY KEY (k, n));",
    )
    .unwrap();
    for (k, n) in [("a", 1), ("a", 2), ("b", 1)] {
        db.insert("kv", [("k", s(k)), ("n", Value::Int64(n))]).unwrap();
    }
    let msg = kit.message("sdk", r#"{"sdk": true}"#);
    let mut reports = Vec::new();
    for lang in ["js", "python"] {
        let r = kit.run(&kit.load(port(lang, "fixtures/sdk")).unwrap(), &db, &msg);
        assert!(r.is_ok(), "{lang}: {r:?}");
        reports.push(r);
    }
    let (js, py) = (&reports[0], &reports[1]);
    assert_eq!(
        serde_json::to_value(&js.effects).unwrap(),
        serde_json::to_value(&py.effects).unwrap(),
        "same effects from both SDKs"
    );
    let writes: Vec<_> = js.writes().collect();
    let up = writes.iter().find(|w| w.op == WriteOp::Upsert).unwrap();
    assert_eq!(column(up, "n"), Some(&Value::Int64(2)), "scan by prefix saw the two `a` rows");
    assert_eq!(column(up, "f"), Some(&Value::Float64(3.0)));
    assert_eq!(column(up, "j"), Some(&Value::Json(r#"{"a":[1,2],"z":1}"#.into())));
    assert_eq!(column(up, "b"), Some(&Value::Bytes(vec![1, 2, 3])));
    assert_eq!(column(up, "t"), Some(&Value::Timestamp(onceq_testkit::TEST_TIME)));
    assert_eq!(column(up, "flag"), Some(&Value::Bool(true)));
    assert_eq!(column(up, "note"), Some(&Value::Null));
    let del = writes.iter().find(|w| w.op == WriteOp::Delete).unwrap();
    assert_eq!((del.table.as_str(), column(del, "k")), ("kv", Some(&s("b"))));
    let next: Vec<_> = js.enqueued().collect();
    assert_eq!(next.len(), 1);
    assert_eq!(
        (next[0].queue.as_str(), next[0].delay_ms, next[0].dedup_key.as_deref()),
        ("next", Some(250), Some("d-1"))
    );
    assert_eq!(next[0].attributes, vec![("x".to_string(), "y".to_string())]);
    assert_eq!(next[0].payload, br#"{"a":1,"b":2}"#.to_vec(), "sorted, compact JSON");
    let hook: Vec<_> = js.intents().collect();
    assert_eq!(
        (
            hook[0].connector.as_str(),
            hook[0].idempotency_key.as_str(),
            hook[0].payload.as_slice()
        ),
        ("hook", "key-1", br#"{"k":"v"}"#.as_slice())
    );
    assert_eq!(hook[0].metadata, vec![("m".to_string(), "n".to_string())]);
}
