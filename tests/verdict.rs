//! One verdict: what `onceq test` and the handler test kit say of a
//! message (fixture rows, effects rehearsed on a scratch database made from
//! the schema file), what `onceq try` says (the real database, rolled
//! back) and what a real run does are the same, for each thing the
//! database itself judges: NOT NULL, CHECK, a trigger, a UNIQUE index and
//! a DEFAULT.

use crate::common;

use common::*;
use onceq::protocol::{EffectLimits, HandleOutput, NativeHandler};
use onceq::store::memory::Fixture;
use onceq::store::Queues;
use onceq::value::{Effect, Message, RowWrite, Value, WriteOp};
use std::sync::Arc;
use std::time::Duration;

const SCHEMA: &str = "
CREATE TABLE points (
    id TEXT PRIMARY KEY,
    n INTEGER NOT NULL CHECK (n >= 0),
    tier TEXT NOT NULL DEFAULT 'bronze',
    email TEXT
);
CREATE UNIQUE INDEX points_email ON points (email);
CREATE TABLE frozen (id TEXT PRIMARY KEY);
CREATE TRIGGER points_not_frozen BEFORE INSERT ON points
    WHEN EXISTS (SELECT 1 FROM frozen WHERE id = NEW.id)
    BEGIN SELECT RAISE(ABORT, 'account is frozen'); END;
CREATE TABLE strict (id TEXT PRIMARY KEY, must TEXT NOT NULL);
";

/// The message names its case; the handler inserts what the case needs.
fn handler() -> Arc<NativeHandler> {
    Arc::new(NativeHandler::new("inserter", |m, scope| async move {
        let s = |v: &str| Value::String(v.into());
        let case = String::from_utf8_lossy(&m.payload).into_owned();
        let (table, columns) = match case.as_str() {
            "default" => ("points", vec![("id", s("fresh")), ("n", Value::Int64(3))]),
            "not-null" => ("strict", vec![("id", s("x"))]),
            "check" => ("points", vec![("id", s("negative")), ("n", Value::Int64(-1))]),
            "unique" => (
                "points",
                vec![("id", s("twin")), ("n", Value::Int64(1)), ("email", s("a@example.com"))],
            ),
            _ => ("points", vec![("id", s("ice")), ("n", Value::Int64(1))]),
        };
        let write = Effect::Write(RowWrite {
            table: table.into(),
            op: WriteOp::Insert,
            columns: columns.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        });
        HandleOutput {
            scope,
            result: Ok(vec![write]),
        }
    }))
}

fn message(case: &str) -> Message {
    Message {
        id: format!("m-{case}"),
        queue: "points".into(),
        payload: case.as_bytes().to_vec(),
        attributes: vec![],
        attempt: 1,
        enqueued_at: 1_700_000_000_000_000,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_try_and_a_real_run_give_one_verdict_on_what_the_database_judges() {
    let cases = ["default", "not-null", "check", "unique", "trigger"];
    let granted = grants(&["points", "frozen", "strict"], &[], &[]);
    let limits = EffectLimits::default();
    let h = handler();

    // The test kit's side: fixture rows in memory.
    let mut fixture = Fixture::from_ddl(SCHEMA).unwrap();
    fixture
        .insert(
            "points",
            [
                ("id", Value::String("taken".into())),
                ("n", Value::Int64(1)),
                ("tier", Value::String("gold".into())),
                ("email", Value::String("a@example.com".into())),
            ],
        )
        .unwrap();
    fixture.insert("frozen", [("id", Value::String("ice".into()))]).unwrap();

    // The real database, with the same rows.
    let db = TestDb::new(SCHEMA);
    db.sql()
        .execute_batch(
            "INSERT INTO points (id, n, tier, email) VALUES ('taken', 1, 'gold', 'a@example.com');
             INSERT INTO frozen (id) VALUES ('ice');",
        )
        .unwrap();

    let mut verdicts = Vec::new();
    for case in cases {
        let tested = onceq::tryout::run(&*h, message(case), fixture.transaction(), fixture.schema(), &granted, &limits).await;
        let tx = db.store.transaction_begin().await.unwrap();
        let tried = onceq::tryout::run(&*h, message(case), tx, db.store.schema(), &granted, &limits).await;
        assert_eq!(
            (&tested.outcome, &tested.reason),
            (&tried.outcome, &tried.reason),
            "{case}: the test kit and onceq try disagree"
        );
        verdicts.push((case, tested));
    }
    // Nothing `onceq try` did was kept.
    assert_eq!(db.count("SELECT count(*) FROM points"), 1);
    assert_eq!(db.count("SELECT count(*) FROM onceq_messages"), 0);

    let verdict = |case: &str| verdicts.iter().find(|(c, _)| *c == case).map(|(_, r)| r.clone()).unwrap();
    let reason = |case: &str| verdict(case).reason.unwrap_or_default();
    assert_eq!(verdict("default").outcome, "ok", "{:?}", verdict("default").reason);
    assert!(verdict("default").rehearsed);
    assert_eq!(verdict("not-null").outcome, "invalid-effects");
    assert!(
        reason("not-null").contains("insert needs NOT NULL column must"),
        "{}",
        reason("not-null")
    );
    for (case, says) in [
        ("check", "CHECK constraint failed"),
        ("unique", "UNIQUE constraint failed: points.email"),
        ("trigger", "account is frozen"),
    ] {
        assert_eq!(verdict(case).outcome, "failed", "{case}: {}", reason(case));
        assert!(
            reason(case).starts_with("write refused by the database: "),
            "{case}: {}",
            reason(case)
        );
        assert!(reason(case).contains(says), "{case}: {}", reason(case));
    }

    // A real run: what passed is kept (its DEFAULT applied), what failed
    // is dead-lettered with the reason the test and the try gave.
    db.send("points", cases.iter().map(|c| c.to_string())).await;
    let r = runner(&db.store, "points", h.clone(), granted.clone(), policy(2, 2));
    drain_within(&db.store, std::slice::from_ref(&r), Duration::from_secs(120)).await;
    assert_eq!(
        db.sql()
            .query_row("SELECT tier FROM points WHERE id = 'fresh'", [], |r| r.get::<_, String>(0))
            .unwrap(),
        "bronze"
    );
    let dead = db.store.dead_letter_list(Queues::All, 100).await.unwrap();
    assert_eq!(dead.len(), 4, "{dead:#?}");
    for d in &dead {
        let expected = reason(&d.payload_text);
        assert!(
            d.reason.starts_with(&expected),
            "{}: the real run recorded {:?}, the test said {:?}",
            d.payload_text,
            d.reason,
            expected
        );
    }
}
