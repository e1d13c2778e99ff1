//! The Wasm sandbox with real components: deploy-time refusals, limits,
//! determinism, isolation, grants, effect validation. Each misbehaviour is a
//! clear error and loses nothing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use common::*;
use onceq::protocol::{EffectLimits, Handler, HandlerFailure, QueueRunner, QueueSpec, ReadScope};
use onceq::runtime::{DeployError, HandlerLimits, Runtime, RuntimeConfig};
use onceq::store::LeaseParams;
use onceq::value::{Effect, Message, Value};
use std::sync::Arc;
use std::time::Duration;

fn msg(id: &str, payload: &str) -> Message {
    Message {
        id: id.into(),
        queue: "chaos".into(),
        payload: payload.as_bytes().to_vec(),
        attributes: vec![],
        attempt: 1,
        enqueued_at: 1_700_000_000_000_000,
    }
}

/// Call a handler once against the database (no commit).
async fn call(db: &TestDb, h: &dyn Handler, m: &Message, tables: &[&str]) -> (Result<Vec<Effect>, HandlerFailure>, Option<String>) {
    let tx = db.store.transaction_begin().await.unwrap();
    let scope = ReadScope::new(tx, db.store.schema(), Arc::new(tables.iter().map(|s| s.to_string()).collect()));
    let out = h.handle(m, scope).await;
    let violation = out.scope.violation.as_ref().map(ToString::to_string);
    out.scope.into_transaction().rollback().await;
    (out.result, violation)
}

/// Process one message through the whole protocol with one attempt allowed;
/// returns the dead-letter reason.
async fn dead_letter_reason(db: &TestDb, payload: &str, limits: HandlerLimits, effect_limits: EffectLimits, tables: &[&str]) -> String {
    db.send("chaos", [payload.to_string()]).await;
    let rt = runtime();
    let h = Arc::new(wasm(&rt, "chaos", limits));
    let r = Arc::new(QueueRunner::new(
        QueueSpec {
            name: "chaos".into(),
            handler: h,
            grants: grants(tables, &[], &[]),
            limits: effect_limits,
            policy: policy(1, 1),
        },
        db.store.clone(),
    ));
    drain(&db.store, std::slice::from_ref(&r)).await;
    assert_eq!(db.count("SELECT COUNT(*) FROM onceq_messages"), 0, "message must not be lost");
    assert_eq!(db.count("SELECT COUNT(*) FROM chaos_log"), 0, "no writes from a failed attempt");
    let dead = db.store.dead_letter_list(onceq::store::Queues::All, 10).await.unwrap();
    assert_eq!(dead.len(), 1, "the message is kept in the dead-letter table");
    dead[0].reason.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trap_is_a_handler_failure_with_the_guest_panic_message() {
    let db = TestDb::new(CHAOS_SQL);
    let reason = dead_letter_reason(
        &db,
        &chaos("trap"),
        HandlerLimits::default(),
        EffectLimits::default(),
        &["chaos_log"],
    )
    .await;
    assert!(reason.contains("trap") && reason.contains("chaos: asked to trap"), "{reason}");
    assert!(
        reason.contains(", at fixtures/chaos/src/lib.rs:"),
        "the panic's file and line: {reason}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn infinite_loop_hits_the_deadline() {
    let db = TestDb::new(CHAOS_SQL);
    let limits = HandlerLimits {
        deadline: Duration::from_millis(200),
        ..Default::default()
    };
    let started = std::time::Instant::now();
    let reason = dead_letter_reason(&db, &chaos("loop"), limits, EffectLimits::default(), &["chaos_log"]).await;
    assert!(
        reason.contains("ran past its deadline of 200ms (setting queue.deadline)"),
        "{reason}"
    );
    assert!(started.elapsed() < Duration::from_secs(20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_bomb_hits_the_memory_limit() {
    let db = TestDb::new(CHAOS_SQL);
    let limits = HandlerLimits {
        memory: 16 << 20,
        ..Default::default()
    };
    let reason = dead_letter_reason(&db, &chaos("alloc"), limits, EffectLimits::default(), &["chaos_log"]).await;
    assert!(
        reason.contains("grew past its memory limit of 16 MiB (setting queue.memory)"),
        "{reason}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_is_a_failure() {
    let db = TestDb::new(CHAOS_SQL);
    let reason = dead_letter_reason(
        &db,
        &chaos("exit"),
        HandlerLimits::default(),
        EffectLimits::default(),
        &["chaos_log"],
    )
    .await;
    // wasi:cli/exit carries only ok/err: the guest's exit(3) arrives as 1.
    assert!(reason.contains("handler called exit(1)"), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ungranted_table_write_and_read_are_refused() {
    let db = TestDb::new(CHAOS_SQL);
    let payload = serde_json::json!({"do": "write", "table": "secrets"}).to_string();
    let reason = dead_letter_reason(&db, &payload, HandlerLimits::default(), EffectLimits::default(), &["chaos_log"]).await;
    assert!(reason.contains("write to table secrets is not granted to queue chaos"), "{reason}");
    assert!(
        reason.contains("add it to the queue's `tables` in onceq.toml"),
        "says how to grant it: {reason}"
    );
    assert_eq!(db.count("SELECT COUNT(*) FROM secrets"), 0);

    let db = TestDb::new(CHAOS_SQL);
    let payload = serde_json::json!({"do": "read", "table": "secrets"}).to_string();
    let reason = dead_letter_reason(&db, &payload, HandlerLimits::default(), EffectLimits::default(), &["chaos_log"]).await;
    assert!(reason.contains("read of table secrets is not granted"), "{reason}");

    let db = TestDb::new(CHAOS_SQL);
    let payload = serde_json::json!({"do": "enqueue", "queue": "elsewhere"}).to_string();
    let reason = dead_letter_reason(&db, &payload, HandlerLimits::default(), EffectLimits::default(), &["chaos_log"]).await;
    assert!(reason.contains("enqueue on queue elsewhere is not granted"), "{reason}");

    // A table that does not exist is a typo, not a missing grant: named as
    // unknown, with the granted table it was probably meant to be.
    for action in ["read", "write"] {
        let db = TestDb::new(CHAOS_SQL);
        let payload = serde_json::json!({"do": action, "table": "chaos_logs"}).to_string();
        let reason = dead_letter_reason(&db, &payload, HandlerLimits::default(), EffectLimits::default(), &["chaos_log"]).await;
        assert!(
            reason.contains("unknown table chaos_logs (did you mean chaos_log?)"),
            "{action}: {reason}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversize_effect_list_and_effect_bytes_are_refused() {
    let db = TestDb::new(CHAOS_SQL);
    let limits = EffectLimits {
        max_effects: 100,
        max_bytes: 1 << 20,
        ..Default::default()
    };
    let payload = serde_json::json!({"do": "effects", "n": 101}).to_string();
    let reason = dead_letter_reason(&db, &payload, HandlerLimits::default(), limits, &["chaos_log"]).await;
    assert!(reason.contains("101 effects returned, over the limit of 100"), "{reason}");
    assert_eq!(db.count("SELECT COUNT(*) FROM onceq_messages"), 0, "no follow-up was enqueued");

    let db = TestDb::new(CHAOS_SQL);
    let limits = EffectLimits {
        max_effects: 100,
        max_bytes: 64 << 10,
        ..Default::default()
    };
    let payload = serde_json::json!({"do": "big", "n": 100_000}).to_string();
    let reason = dead_letter_reason(&db, &payload, HandlerLimits::default(), limits, &["chaos_log"]).await;
    assert!(reason.contains("over the limit of 65536 bytes"), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_payload_and_wrong_types_are_clear_errors() {
    let db = TestDb::new(CHAOS_SQL);
    let reason = dead_letter_reason(&db, "{\"do\": ", HandlerLimits::default(), EffectLimits::default(), &["chaos_log"]).await;
    assert!(reason.contains("malformed payload"), "{reason}");

    let db = TestDb::new(CHAOS_SQL);
    let reason = dead_letter_reason(
        &db,
        &chaos("badtype"),
        HandlerLimits::default(),
        EffectLimits::default(),
        &["chaos_log"],
    )
    .await;
    assert!(reason.contains("table chaos_log: column n is int64, got string"), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clocks_and_randomness_are_fixed_per_message() {
    let db = TestDb::new(CHAOS_SQL);
    let rt = runtime();
    let h = wasm(&rt, "chaos", HandlerLimits::default());
    let m = msg("message-1", &chaos("clock"));
    let (a, _) = call(&db, &h, &m, &["chaos_log"]).await;
    let (b, _) = call(&db, &h, &m, &["chaos_log"]).await;
    let (a, b) = (format!("{:?}", a.unwrap()), format!("{:?}", b.unwrap()));
    assert_eq!(a, b, "same message, same effects");
    // The wall clock reads the message's logical time.
    assert!(a.contains("wall=1700000000000000"), "{a}");
    assert!(a.contains("elapsed=0"), "{a}");
    let (c, _) = call(&db, &h, &msg("message-2", &chaos("clock")), &["chaos_log"]).await;
    let c = format!("{:?}", c.unwrap());
    let data = |s: &str| s.split("Bytes(").nth(1).map(|d| d.to_string());
    assert_ne!(data(&a), data(&c), "another message id gives other random numbers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn environment_is_empty_and_each_message_gets_a_fresh_instance() {
    let db = TestDb::new(CHAOS_SQL);
    let rt = runtime();
    let h = wasm(&rt, "chaos", HandlerLimits::default());
    let (env, _) = call(&db, &h, &msg("m", &chaos("env")), &["chaos_log"]).await;
    assert!(format!("{:?}", env.unwrap()).contains("vars=[] args=[]"));
    // Both ways of resetting a finished instance's memory (the dirty-page
    // scan, the default, and wholesale: `runtime.reset_dirty_pages = false`).
    let wholesale = Runtime::new(RuntimeConfig {
        max_instances: 4,
        reset_dirty_pages: false,
        ..Default::default()
    })
    .unwrap();
    let h2 = wasm(&wholesale, "chaos", HandlerLimits::default());
    let logged = |effects: &[Effect]| {
        let Effect::Write(w) = &effects[0] else {
            panic!("expected a write")
        };
        w.columns.iter().find(|(k, _)| k == "n").unwrap().1.clone()
    };
    for h in [&h, &h2] {
        for i in 0..3 {
            let (r, _) = call(&db, h, &msg(&format!("s{i}"), &chaos("static")), &["chaos_log"]).await;
            assert_eq!(
                logged(&r.unwrap()),
                Value::Int64(1),
                "a static counter starts at 1 in every call: no state leaks between messages"
            );
        }
        // Pages dirtied far apart, more runs of them than the scan returns
        // at once (wasmtime 48.0.8 stopped after 32) and over more memory
        // than it resets in place (1 MiB): each message finds them clean.
        for (i, pages) in [600, 1024, 50, 1024].into_iter().enumerate() {
            let payload = serde_json::json!({ "do": "scatter", "n": pages }).to_string();
            let (r, _) = call(&db, h, &msg(&format!("p{i}"), &payload), &["chaos_log"]).await;
            assert_eq!(
                logged(&r.unwrap()),
                Value::Int64(0),
                "pages a previous message wrote ({pages} touched) are reset"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_log_and_reads_work() {
    let db = TestDb::new(CHAOS_SQL);
    let rt = runtime();
    let h = wasm(&rt, "chaos", HandlerLimits::default());
    let (r, v) = call(&db, &h, &msg("m", &chaos("log")), &["chaos_log"]).await;
    assert!(r.is_ok() && v.is_none());
    let (r, v) = call(&db, &h, &msg("m", &chaos("count")), &["chaos_log"]).await;
    assert!(v.is_none(), "{v:?}");
    assert_eq!(r.unwrap().len(), 2);
}

#[test]
fn forbidden_imports_are_refused_by_name() {
    let rt = runtime();
    let err = rt
        .load_file(&guest("forbidden"), HandlerLimits::default())
        .err()
        .expect("must be refused")
        .to_string();
    assert!(err.contains("imports interfaces a handler may not use"), "{err}");
    assert!(err.contains("wasi:filesystem/"), "names the filesystem import: {err}");
    assert!(err.contains("handlers have no filesystem"), "{err}");
}

#[test]
fn bad_bytes_core_modules_and_wrong_worlds_are_clear_errors() {
    let rt = runtime();
    let l = HandlerLimits::default();
    assert!(matches!(rt.load(b"hello world, not wasm", l), Err(DeployError::NotWasm)));
    assert!(matches!(rt.load(b"\0asm\x01\0\0\0", l), Err(DeployError::CoreModule)));
    let mut truncated = std::fs::read(guest("payments")).unwrap();
    truncated.truncate(truncated.len() / 2);
    let e = rt.load(&truncated, l).err().expect("truncated component refused");
    assert!(matches!(e, DeployError::Invalid(_)), "{e}");
    let command = std::fs::read(guest("not-a-handler")).unwrap();
    let e = rt.load(&command, l).err().expect("command refused").to_string();
    assert!(
        e.contains("does not export onceq:handler/handler") && e.contains("wasi:cli/run"),
        "{e}"
    );
    // and the good ones load
    rt.load_file(&guest("payments"), l).unwrap();
    rt.load_file(&guest("inventory"), l).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trap_does_not_disturb_other_messages_on_the_same_worker() {
    let db = TestDb::new(CHAOS_SQL);
    db.send(
        "chaos",
        [chaos("trap"), chaos("ok"), chaos("loop"), chaos("ok"), chaos("alloc"), chaos("ok")],
    )
    .await;
    let rt = runtime();
    let h = Arc::new(wasm(
        &rt,
        "chaos",
        HandlerLimits {
            deadline: Duration::from_millis(100),
            memory: 16 << 20,
            ..Default::default()
        },
    ));
    let r = runner(&db.store, "chaos", h, grants(&["chaos_log"], &[], &[]), policy(1, 1));
    let leased = db
        .store
        .message_lease(LeaseParams {
            queue: "chaos".into(),
            limit: 10,
            lease: Duration::from_secs(30),
        })
        .await
        .unwrap();
    for lm in &leased {
        r.process(lm).await;
    }
    assert_eq!(db.count("SELECT COUNT(*) FROM chaos_log WHERE note = 'ok'"), 3);
    assert_eq!(db.count("SELECT COUNT(*) FROM onceq_dead_letters"), 3);
}

#[test]
fn compiled_components_are_cached_and_a_bad_entry_is_recompiled() {
    let dir = tempfile::tempdir().unwrap();
    let cached_runtime = || {
        Runtime::new(RuntimeConfig {
            max_instances: 4,
            cache_dir: Some(dir.path().to_path_buf()),
            ..Default::default()
        })
        .unwrap()
    };
    let entries = || -> Vec<std::path::PathBuf> {
        let mut v: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "cwasm"))
            .collect();
        v.sort();
        v
    };
    let first = wasm(&cached_runtime(), "payments", HandlerLimits::default());
    let stored = entries();
    assert_eq!(stored.len(), 1, "one compiled entry");
    let size = std::fs::metadata(&stored[0]).unwrap().len();
    // A restart (a new engine) loads the entry: same version, no new entry.
    let again = wasm(&cached_runtime(), "payments", HandlerLimits::default());
    assert_eq!(again.version(), first.version());
    assert_eq!(entries(), stored);
    // A damaged entry is refused, removed and replaced by a fresh compile.
    std::fs::write(&stored[0], b"not wasmtime code").unwrap();
    let healed = wasm(&cached_runtime(), "payments", HandlerLimits::default());
    assert_eq!(healed.version(), first.version());
    assert_eq!(entries(), stored);
    assert_eq!(std::fs::metadata(&stored[0]).unwrap().len(), size, "rewritten whole");
    // 1,000 bytes flipped in the middle of the compiled code (wasmtime's
    // header intact): found by the checksum, recompiled, and the handler
    // runs, where running the damaged code killed the host with SIGILL.
    let mut code = std::fs::read(&stored[0]).unwrap();
    let mid = code.len() / 2;
    for b in &mut code[mid..mid + 1000] {
        *b = !*b;
    }
    std::fs::write(&stored[0], &code).unwrap();
    let healed = wasm(&cached_runtime(), "payments", HandlerLimits::default());
    assert_eq!(healed.version(), first.version());
    assert_eq!(std::fs::read(&stored[0]).unwrap().len() as u64, size, "rewritten whole");
    assert_ne!(std::fs::read(&stored[0]).unwrap(), code, "the damaged entry replaced");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (result, violation) = rt.block_on(async {
        let db = TestDb::new(PAYMENTS_SQL);
        db.sql()
            .execute("INSERT INTO accounts (id, balance) VALUES ('acct-1', 100)", [])
            .unwrap();
        let m = Message {
            queue: "payments".into(),
            ..msg("m-1", r#"{"order_id": "o-1", "account": "acct-1", "amount": 5}"#)
        };
        call(&db, &healed, &m, &["accounts", "orders"]).await
    });
    let effects = result.expect("the recompiled handler runs");
    assert!(violation.is_none() && !effects.is_empty(), "{effects:?} {violation:?}");
}
