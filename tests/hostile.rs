//! The hostile suite: an attacker's handler (`guest-examples/fixtures/
//! hostile`, written against the raw WIT, not our SDK), an impostor
//! component, and hostile producers and HTTP clients.
//!
//! Each case asserts what an operator would check: the clear error (naming
//! the limit and its setting where there is one), that the host stays up and
//! goes on processing (a harmless `ok` message sent after each attack is
//! acked), and that nothing is lost (the attack is acked or dead-lettered,
//! never left parked).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use common::host::Host;
use common::http::Receiver;
use common::*;
use onceq::protocol::{EffectLimits, Policy};
use onceq::runtime::HandlerLimits;
use onceq::store::faulty::{FaultPlan, FaultyStore};
use onceq::store::{Queues, Store};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const HOSTILE_SQL: &str = "CREATE TABLE hostile_log (id TEXT PRIMARY KEY, note TEXT, x REAL);";

/// How one attack ended.
struct Fate {
    /// Dead-letter reasons of the attack (empty: it was acked).
    dead: Vec<String>,
    /// Notes the handler wrote (the `ok` message writes "ok").
    notes: Vec<String>,
    db: TestDb,
}

impl Fate {
    fn reason(&self) -> &str {
        assert_eq!(
            self.dead.len(),
            1,
            "one dead letter expected: {:?} (notes {:?})",
            self.dead,
            self.notes
        );
        &self.dead[0]
    }

    /// The attack was refused with a reason containing each of `needles`.
    fn refused(&self, needles: &[&str]) {
        let r = self.reason();
        for n in needles {
            assert!(r.contains(n), "expected {n:?} in the reason: {r}");
        }
        assert!(
            self.notes.is_empty() || self.notes == ["ok"],
            "no write of the attack landed: {:?}",
            self.notes
        );
    }
}

/// Wraps the test database's store (a fault injector, say).
type WrapStore = Box<dyn FnOnce(Arc<dyn Store>) -> Arc<dyn Store>>;

struct Attack<'a> {
    payload: &'a str,
    handler: HandlerLimits,
    effects: EffectLimits,
    tables: &'a [&'a str],
    queues: &'a [&'a str],
    connectors: &'a [&'a str],
    store: Option<WrapStore>,
    seed_rows: usize,
    /// `queue.max_deliveries` (default: the queue default).
    max_deliveries: Option<u32>,
}

impl<'a> Attack<'a> {
    fn new(payload: &'a str) -> Attack<'a> {
        Attack {
            payload,
            handler: HandlerLimits::default(),
            effects: EffectLimits::default(),
            tables: &["hostile_log"],
            queues: &[],
            connectors: &[],
            store: None,
            seed_rows: 0,
            max_deliveries: None,
        }
    }

    /// Send the attack, then a harmless `ok` message on the same queue,
    /// and run one worker (one attempt each) until both reached an outcome.
    async fn run(self) -> Fate {
        let db = TestDb::new(HOSTILE_SQL);
        if self.seed_rows > 0 {
            let conn = db.sql();
            let note = "n".repeat(1000);
            for i in 0..self.seed_rows {
                conn.execute(
                    "INSERT INTO hostile_log (id, note) VALUES (?1, ?2)",
                    rusqlite::params![format!("seed-{i:05}"), note],
                )
                .unwrap();
            }
        }
        db.send("hostile", [self.payload.to_string()]).await;
        db.send("hostile", ["ok".to_string()]).await;
        let store = match self.store {
            Some(wrap) => wrap(db.store.clone()),
            None => db.store.clone(),
        };
        let rt = runtime();
        let h = Arc::new(wasm(&rt, "hostile", self.handler));
        let mut policy = Policy { batch: 1, ..policy(1, 1) };
        if let Some(n) = self.max_deliveries {
            policy.max_deliveries = n;
        }
        let r = Arc::new(onceq::protocol::QueueRunner::new(
            onceq::protocol::QueueSpec {
                name: "hostile".into(),
                handler: h,
                grants: grants(self.tables, self.queues, self.connectors),
                limits: self.effects,
                policy,
            },
            store.clone(),
        ));
        drain_within(&store, &[r], Duration::from_secs(120)).await;
        let dead = db
            .store
            .dead_letter_list(Queues::All, 10)
            .await
            .unwrap()
            .into_iter()
            .map(|d| d.reason)
            .collect();
        let notes = db
            .rows("hostile_log")
            .await
            .iter()
            .filter(|r| !matches!(col(r, "id"), onceq::value::Value::String(s) if s.starts_with("seed-")))
            .map(|r| match col(r, "note") {
                onceq::value::Value::String(s) => s.clone(),
                other => format!("{other:?}"),
            })
            .collect::<Vec<_>>();
        assert!(
            notes.contains(&"ok".to_string()),
            "the host went on to process the next message: {notes:?}"
        );
        Fate { dead, notes, db }
    }
}

// ---- time: sleeping, waiting, hanging host calls -------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sleeping_handler_returns_at_once_on_logical_time() {
    // `sleep(3600 s)` waits on a clock pollable: logical time does not pass
    // inside a call, so the pollable is ready at once and the message is
    // processed (the whole drain is bounded by 120 s, far below an hour).
    let f = Attack::new("sleep").run().await;
    assert!(f.dead.is_empty(), "{:?}", f.dead);
    assert!(f.notes.contains(&"slept".to_string()), "{:?}", f.notes);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_for_time_to_pass_hits_the_deadline() {
    let f = Attack {
        handler: HandlerLimits {
            deadline: Duration::from_millis(300),
            ..Default::default()
        },
        ..Attack::new("sleep-until")
    }
    .run()
    .await;
    f.refused(&["ran past its deadline of 300ms"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_that_never_answers_is_stopped_at_the_deadline_and_not_charged() {
    // A store that stops answering mid-read: the guest is blocked in a host
    // call, where the epoch deadline cannot see it; the call's timer does.
    // The stall is the store's, not the message's: every delivery is
    // deferred uncounted (max_attempts is 1 here), and only
    // max_deliveries parks it, saying why.
    let started = Instant::now();
    let f = Attack {
        handler: HandlerLimits {
            deadline: Duration::from_millis(300),
            ..Default::default()
        },
        store: Some(Box::new(|s: Arc<dyn Store>| {
            let plan = FaultPlan {
                read_delay: Some(Duration::from_secs(3600)),
                ..Default::default()
            };
            Arc::new(FaultyStore::new(s, plan).0) as Arc<dyn Store>
        })),
        max_deliveries: Some(3),
        ..Attack::new("get-flood 1")
    }
    .run()
    .await;
    f.refused(&[
        "parked after 3 deliveries, 3 of them ended without a verdict",
        "and 0 with a failure",
    ]);
    let dead = f.db.store.dead_letter_list(Queues::All, 10).await.unwrap();
    assert_eq!(
        (dead[0].deliveries, dead[0].failures),
        (4, 0),
        "three deferred deliveries, then the one that parked it"
    );
    eprintln!("hung read stopped; both messages done in {:.1?}", started.elapsed());
}

// ---- delays ----------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follow_up_delayed_past_max_delay_is_refused_naming_the_setting() {
    let f = Attack::new("delay-max").run().await;
    f.refused(&["follow-up delay of", "over the limit of 365d", "(setting max_delay)"]);
    let stats = f.db.store.stats().await.expect("stats still work");
    assert_eq!(stats.queues.iter().map(|q| q.ready + q.leased + q.delayed).sum::<u64>(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_of_u64_max_ms_is_capped_and_the_host_stays_ready() {
    let db = TestDb::new(HOSTILE_SQL);
    db.send("hostile", ["retry-max".to_string()]).await;
    let rt = runtime();
    let effects = EffectLimits {
        max_delay: Duration::from_secs(7 * 24 * 3600),
        ..Default::default()
    };
    let r = Arc::new(onceq::protocol::QueueRunner::new(
        onceq::protocol::QueueSpec {
            name: "hostile".into(),
            handler: Arc::new(wasm(&rt, "hostile", HandlerLimits::default())),
            grants: grants(&["hostile_log"], &[], &[]),
            limits: effects,
            policy: policy(1, 5),
        },
        db.store.clone(),
    ));
    drain(&db.store, std::slice::from_ref(&r)).await;
    assert_eq!(r.metrics.retried.load(std::sync::atomic::Ordering::Relaxed), 1);
    // Stored as an integer a week ahead, not an overflowed REAL.
    let (ty, ahead): (String, i64) = db
        .sql()
        .query_row(
            "SELECT typeof(visible_at), visible_at - CAST(unixepoch('subsec') * 1000000 AS INTEGER) FROM onceq_messages",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(ty, "integer");
    let week = 7 * 24 * 3600 * 1_000_000i64;
    assert!(
        ahead <= week && ahead > week - 600 * 1_000_000,
        "visible in about a week: {ahead} µs"
    );
    let stats = db.store.stats().await.expect("stats still work");
    assert_eq!(stats.queues[0].delayed, 1, "{stats:?}");
}

// ---- the export's type -----------------------------------------------------

#[test]
fn a_handle_export_with_the_wrong_signature_is_refused_at_load() {
    let rt = runtime();
    let e = rt
        .load_file(&guest("wrong_signature"), HandlerLimits::default())
        .err()
        .expect("refused")
        .to_string();
    assert!(e.contains("does not match wit/handler.wit"), "{e}");
    assert!(e.contains("handle is func(msg: string) -> string"), "{e}");
    // The hostile guest has the right signature: it loads.
    rt.load_file(&guest("hostile"), HandlerLimits::default()).unwrap();
}

// ---- logs ------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdout_past_its_capacity_fails_the_call_with_a_reason() {
    let f = Attack::new("stdout-flood 40").run().await;
    assert_eq!(f.dead.len(), 1, "{:?}", f.dead);
    eprintln!("stdout flood: {}", f.reason());
}

// ---- effects ---------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_attribute_and_metadata_pairs_count_against_max_effect_bytes() {
    let f = Attack::new("empty-attrs 300000").run().await;
    f.refused(&["over the limit of 1048576 bytes (setting max_effect_bytes)"]);
    assert_eq!(f.db.count("SELECT COUNT(*) FROM onceq_messages"), 0, "no follow-up stored");
    let f = Attack {
        connectors: &["hook"],
        ..Attack::new("empty-meta 300000")
    }
    .run()
    .await;
    f.refused(&["(setting max_effect_bytes)"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provenance_attributes_cannot_be_forged() {
    let f = Attack::new("forge-provenance").run().await;
    f.refused(&["\"onceq.source-queue\" is reserved for onceq"]);
    assert_eq!(f.db.count("SELECT COUNT(*) FROM onceq_messages"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follow_ups_carry_provenance_the_handler_neither_sees_nor_forges_by_forwarding() {
    // Two hops forwarding every attribute they see, then a follow-up to an
    // unserved queue: nothing refused (the host's onceq.* provenance is not
    // shown to the handler, so forwarding cannot forge it), and the parked
    // message names the message that produced it.
    let f = Attack {
        queues: &["parked"],
        ..Attack::new("forward 2 parked")
    }
    .run()
    .await;
    assert!(f.dead.is_empty(), "{:?}", f.dead);
    assert!(f.notes.contains(&"saw hop=2,hop=1".to_string()), "{:?}", f.notes);
    let (attributes, source): (String, String) =
        f.db.sql()
            .query_row(
                "SELECT attributes, json_extract(attributes, '$[2][1]') FROM onceq_messages WHERE queue = 'parked'",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
    let attrs: Vec<(String, String)> = serde_json::from_str(&attributes).unwrap();
    let names: Vec<&str> = attrs.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(names, ["hop", "hop", "onceq.source-queue", "onceq.source-message"], "{attributes}");
    assert_eq!(attrs[2].1, "hostile");
    assert_eq!(source, "hostile");
    let producer = &attrs[3].1;
    assert_eq!(
        f.db.count(&format!(
            "SELECT COUNT(*) FROM hostile_log WHERE id = '{producer}' AND note = 'saw hop=2,hop=1'"
        )),
        1,
        "the provenance names the message whose handler emitted it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_keys_that_could_split_a_header_or_flood_are_refused() {
    let f = Attack {
        connectors: &["hook"],
        ..Attack::new("key-crlf")
    }
    .run()
    .await;
    f.refused(&["idempotency key", "must be visible ASCII"]);
    let f = Attack {
        connectors: &["hook"],
        ..Attack::new("key-long 100000")
    }
    .run()
    .await;
    f.refused(&["100000 bytes long, over the limit of 512"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserved_strange_and_huge_queue_names_are_refused() {
    for payload in ["queue ONCEQ.outbox.hook", "queue ../../etc/passwd", "queue-long"] {
        // Even when granted: the name itself is refused.
        let long = "q".repeat(100_000);
        let granted: &[&str] = &["ONCEQ.outbox.hook", "../../etc/passwd", &long];
        let f = Attack {
            queues: granted,
            ..Attack::new(payload)
        }
        .run()
        .await;
        let r = f.reason().to_string();
        assert!(
            r.contains("reserved for onceq") || r.contains("use letters, digits") || r.contains("over the limit of 128"),
            "{payload}: {r}"
        );
        assert!(r.len() < 400, "the reason stays short: {r}");
        assert_eq!(f.db.count("SELECT COUNT(*) FROM onceq_messages"), 0, "{payload}: nothing parked");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nan_is_refused_instead_of_stored_as_null() {
    let f = Attack::new("nan").run().await;
    f.refused(&["column x: NaN cannot be stored"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_bomb_is_bounded_by_max_effects() {
    let f = Attack::new("fork 1001").run().await;
    f.refused(&["1001 effects returned, over the limit of 1000 (setting max_effects)"]);
    assert_eq!(f.db.count("SELECT COUNT(*) FROM onceq_messages"), 0);
}

// ---- effects as JSON (the WIT's `encoded` interface) ----------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_encoded_effects_fail_the_attempt_even_when_the_guest_ignores_the_error() {
    for (json, needle) in [
        (
            r#"[{"write": {"table": "hostile_log", "op": "insert", "columns": [["id", "a"], ["x", 1.5]]}}]"#,
            "bare number 1.5 has a fraction or an exponent: give a float64 as {\"float64\": 1.5}",
        ),
        (r#"[{"write": {"table": "hostile_log""#, "EOF while parsing"),
        (
            r#"[{"launch": {}}]"#,
            "unknown variant `launch`, expected one of `write`, `enqueue`, `intent`",
        ),
        (
            r#"[{"write": {"table": "hostile_log", "op": "insert", "columns": [["id", {"int64": "99999999999999999999"}]]}}]"#,
            "\"99999999999999999999\" is not an int64",
        ),
        (r#"[] trailing"#, "trailing characters"),
    ] {
        let f = Attack::new(&format!("emit-raw {json}")).run().await;
        // Dead-lettered with the decoder's words, and the row the guest
        // returned after ignoring the error was not written.
        f.refused(&["encoded effects (emit 1 of the call): ", needle]);
    }
    // A read's query likewise.
    let f = Attack::new(r#"get-raw {"table": "hostile_log", "key": [0.5]}"#).run().await;
    f.refused(&["malformed get: bare number 0.5 has a fraction or an exponent"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encoded_effects_are_bounded_by_max_effects_and_max_effect_bytes_as_they_arrive() {
    let many = vec![r#"{"enqueue": {"queue": "hostile", "payload": ""}}"#; 1001].join(",");
    let f = Attack::new(&format!("emit-raw [{many}]")).run().await;
    f.refused(&["more than 1000 effects in one call, over the limit (setting max_effects)"]);
    // Twenty emits of 64 KiB: refused at the one that crosses 1 MiB; the
    // guest's later emits and its returned row are refused with it.
    let f = Attack::new("emit-flood 20").run().await;
    f.refused(&["over the limit of 1048576 bytes (setting max_effect_bytes)"]);
    assert_eq!(f.db.count("SELECT COUNT(*) FROM onceq_messages"), 0, "no intent was enqueued");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emitted_effects_commit_with_the_returned_ones() {
    let f = Attack::new("emit-then-return").run().await;
    assert!(f.dead.is_empty(), "{:?}", f.dead);
    assert!(
        f.notes.contains(&"emitted".to_string()) && f.notes.contains(&"returned".to_string()),
        "both the emitted and the returned row landed: {:?}",
        f.notes
    );
    assert_eq!(
        f.db.count("SELECT COUNT(*) FROM hostile_log WHERE note = 'emitted' AND x = 1.5"),
        1,
        "the emitted row kept its float64"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_reject_reason_with_terminal_escapes_is_cut_when_stored() {
    let f = Attack::new("reject-escape").run().await;
    let r = f.reason();
    assert!(r.len() < 4200, "stored reason is bounded: {} bytes", r.len());
    assert!(r.contains("cut: "), "says it was cut");
}

// ---- reads -----------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endless_gets_stop_at_max_reads() {
    let f = Attack {
        handler: HandlerLimits {
            deadline: Duration::from_secs(60),
            ..Default::default()
        },
        ..Attack::new("get-flood 1000000")
    }
    .run()
    .await;
    f.refused(&["more than 10000 reads in one call (setting max_reads)"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_scans_stop_at_max_read_bytes() {
    let f = Attack {
        handler: HandlerLimits {
            deadline: Duration::from_secs(60),
            ..Default::default()
        },
        seed_rows: 1000,
        ..Attack::new("scan-flood 150")
    }
    .run()
    .await;
    f.refused(&["reads returned more than 16777216 bytes in one call (setting max_read_bytes)"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stack_overflow_is_a_trap_not_a_crash() {
    let f = Attack::new("recurse").run().await;
    f.refused(&["trap"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trap_the_guest_explains_nowhere_names_what_the_sandbox_lacks() {
    let f = Attack::new("unreachable").run().await;
    f.refused(&["unreachable", "fetch()", "open()", "ctx.get/scan", "intent"]);
}

// ---- intents reaching a webhook -------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn intent_metadata_cannot_set_the_operators_or_the_hosts_headers() {
    // Credentials, routing and framing headers are refused at the effect.
    for (name, value) in [
        ("authorization", "Bearer forged"),
        ("Host", "evil.example"),
        ("content-length", "0"),
        ("Idempotency-Key", "other"),
        ("x-forwarded-for", "10.0.0.1"),
        // Names a CGI/WSGI receiver sees as the protected header
        // (HTTP_IDEMPOTENCY_KEY, HTTP_X_FORWARDED_FOR) and httpoxy's Proxy.
        ("Idempotency_Key", "other"),
        ("X_Forwarded_For", "10.0.0.1"),
        ("Proxy", "http://evil.example:3128"),
        ("PROXY_AUTHORIZATION", "Basic forged"),
        // The trace context is the message's, set by the host.
        ("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        ("TraceState", "forged=1"),
    ] {
        let f = Attack {
            connectors: &["hook"],
            ..Attack::new(&format!("meta {name} {value}"))
        }
        .run()
        .await;
        f.refused(&["names a header only the host sets"]);
    }

    // A header the operator configured wins over the handler's metadata;
    // other metadata reach the receiver.
    let receiver = Receiver::start(1).await;
    let db = TestDb::new(HOSTILE_SQL);
    db.send(
        "hostile",
        [
            "meta x-team forged".to_string(),
            "meta X_TEAM forged".to_string(),
            "meta x-trace abc123".to_string(),
        ],
    )
    .await;
    let rt = runtime();
    let r = runner(
        &db.store,
        "hostile",
        Arc::new(wasm(&rt, "hostile", HandlerLimits::default())),
        grants(&["hostile_log"], &[], &["hook"]),
        policy(1, 1),
    );
    let hook = onceq::outbox::ConnectorConfig::Webhook {
        url: receiver.url(),
        timeout: Duration::from_secs(5),
        headers: vec![("X-Team".into(), "payments".into())],
        bearer_token_env: None,
    }
    .build("hook")
    .unwrap();
    let d = Arc::new(onceq::outbox::runner(db.store.clone(), "hook", hook, &fast_outbox()));
    drain(&db.store, &[r, d]).await;
    let seen = receiver.seen();
    assert_eq!(seen.len(), 3, "every intent delivered: {seen:?}");
    for s in seen.values() {
        let team: Vec<&str> = s.headers.iter().filter(|(k, _)| k == "x-team").map(|(_, v)| v.as_str()).collect();
        assert_eq!(team, ["payments"], "the operator's header, once: {:?}", s.headers);
        assert!(
            !s.headers.iter().any(|(k, _)| k == "x_team"),
            "a name the receiver reads as the operator's header is not sent: {:?}",
            s.headers
        );
        assert_eq!(s.payload, "{\"charge\":1}", "payload intact");
    }
    assert!(
        seen.values()
            .any(|s| s.headers.iter().any(|(k, v)| k == "x-trace" && v == "abc123")),
        "ordinary metadata still reach the receiver"
    );
}

// ---- a real host process: SIGTERM, logs, the admin API, the CLI -----------

fn project(extra: &str) -> Host {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("schema.sql"), HOSTILE_SQL).unwrap();
    std::fs::write(
        dir.path().join("onceq.toml"),
        format!(
            r#"store = "onceq.db"
schema = "schema.sql"
{extra}

[admin]
listen = "127.0.0.1:0"
token = "s3cret"
max_upload = "1MiB"

[[queue]]
name = "hostile"
handler = "{}"
tables = ["hostile_log"]
max_attempts = 1
workers = 1
"#,
            guest("hostile").display()
        ),
    )
    .unwrap();
    Host::new(dir)
}

/// A started host of [`project`] with `extra` settings and a message in
/// its handler that may compute for an hour, in flight; and its process.
async fn busy_host(extra: &str) -> (Host, tokio::process::Child) {
    let mut host = project(&format!("{extra}\n[defaults]\ndeadline = \"1h\""));
    host.ok(&["init"]).await;
    // The payload is the command itself, not JSON: sent from a file.
    std::fs::write(host.dir.path().join("m.txt"), "sleep-until").unwrap();
    host.ok(&["send", "hostile", "--file", "m.txt"]).await;
    host.start().await;
    wait_until("the handler to be in flight", Duration::from_secs(60), || {
        let h = &host;
        async move {
            let m = h.metrics().await;
            m.iter().any(|(k, v)| k.starts_with("onceq_in_flight") && *v >= 1.0)
        }
    })
    .await;
    let child = host.child.take().unwrap();
    (host, child)
}

/// Send the host's process SIG`name` (`TERM`, `HUP`, `INT`).
fn signal(child: &tokio::process::Child, name: &str) {
    let pid = child.id().unwrap().to_string();
    assert!(std::process::Command::new("kill")
        .args([&format!("-{name}"), &pid])
        .status()
        .unwrap()
        .success());
}

/// Send SIG`name`, then wait (at most a minute) for the process to exit.
async fn signal_and_wait(child: &mut tokio::process::Child, name: &str) -> std::process::ExitStatus {
    signal(child, name);
    tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .unwrap_or_else(|_| panic!("no exit within a minute of SIG{name}"))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_the_host_within_the_shutdown_grace_whatever_the_handler_does() {
    // A handler allowed to compute for an hour, and a one-second grace.
    let (host, mut child) = busy_host("shutdown_grace = \"1s\"").await;
    let signalled = Instant::now();
    let status = signal_and_wait(&mut child, "TERM").await;
    eprintln!("exited {:.1?} after SIGTERM", signalled.elapsed());
    assert!(status.success(), "exit 0: {status}");
    let log = host.log();
    assert!(log.contains("shutdown grace of 1s over (setting shutdown_grace)"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_business_table_in_onceqs_namespace_is_refused_in_any_case() {
    let host = project("");
    std::fs::write(
        host.dir.path().join("schema.sql"),
        format!("{HOSTILE_SQL}\nCREATE TABLE Onceq_Orders (id TEXT PRIMARY KEY, amount INTEGER NOT NULL);\n"),
    )
    .unwrap();
    let (ok, text) = host.onceq(&["init"]).await;
    assert!(!ok, "init refused: {text}");
    assert!(
        text.contains("table \"Onceq_Orders\": names starting with \"onceq_\" (in any case) are reserved"),
        "{text}"
    );
    assert!(!host.dir.path().join("onceq.db").exists(), "nothing created");
    // The author's tools say the same (the types, the checks).
    let (ok, text) = host.onceq(&["types", "--lang", "rust"]).await;
    assert!(!ok && text.contains("Onceq_Orders"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_or_a_device_in_the_watched_folder_is_refused_unread() {
    let mut host = project("[deploy]\nwatch = \"handlers\"\npoll = \"100ms\"");
    let watched = host.dir.path().join("handlers");
    std::fs::create_dir(&watched).unwrap();
    let target = watched.join("hostile.wasm");
    assert!(std::process::Command::new("mkfifo").arg(&target).status().unwrap().success());
    host.ok(&["init"]).await;
    host.start().await;
    wait_until("the FIFO to be refused", Duration::from_secs(60), || {
        let h = &host;
        async move { h.log().contains("watched handler not read: a FIFO, not a component file") }
    })
    .await;
    // A link to an endless device: refused without reading a byte.
    std::fs::remove_file(&target).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &target).unwrap();
    wait_until("the device to be refused", Duration::from_secs(60), || {
        let h = &host;
        async move { h.log().contains("watched handler not read: a device, not a component file") }
    })
    .await;
    assert!(host.rss_bytes() < 200 << 20, "RSS {} bytes", host.rss_bytes());
    // The CLI refuses them too, by name.
    let (ok, out) = host.onceq(&["check", target.to_str().unwrap()]).await;
    assert!(!ok && out.contains("a device, not a component file"), "{out}");
    // And SIGTERM still ends the host.
    let mut child = host.child.take().unwrap();
    let status = signal_and_wait(&mut child, "TERM").await;
    assert!(status.success(), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_shuts_the_host_down_gracefully() {
    let (host, mut child) = busy_host("shutdown_grace = \"1s\"").await;
    let status = signal_and_wait(&mut child, "HUP").await;
    assert!(status.success(), "a graceful exit (0), not death by SIGHUP: {status}");
    let log = host.log();
    assert!(log.contains("SIGHUP: shutting down"), "{log}");
    assert!(log.contains("shutdown grace of 1s over (setting shutdown_grace)"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_ends_a_long_shutdown_at_once() {
    // An hour's grace: only the second signal can end this in time.
    let (host, mut child) = busy_host("shutdown_grace = \"1h\"").await;
    signal(&child, "TERM");
    wait_until("the shutdown to start", Duration::from_secs(60), || {
        let h = &host;
        async move { h.log().contains("SIGTERM: shutting down") }
    })
    .await;
    assert!(child.try_wait().unwrap().is_none(), "still finishing its message");
    let status = signal_and_wait(&mut child, "INT").await;
    assert_eq!(status.code(), Some(130), "{status}");
    let log = host.log();
    assert!(log.contains("SIGINT during shutdown: exiting now"), "{log}");
    // The message was not charged: still queued for the next run, not
    // dead-lettered.
    let db = rusqlite::Connection::open(host.dir.path().join("onceq.db")).unwrap();
    let count = |sql: &str| db.query_row(sql, [], |r| r.get::<_, i64>(0)).unwrap();
    assert_eq!(count("SELECT COUNT(*) FROM onceq_messages WHERE queue = 'hostile'"), 1);
    assert_eq!(count("SELECT COUNT(*) FROM onceq_dead_letters"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_says_when_another_process_holds_the_databases_write_lock() {
    let mut host = project("");
    host.ok(&["init"]).await;
    host.start().await;
    wait_until("ready", Duration::from_secs(60), || {
        let h = &host;
        async move { h.get("/readyz").await.0 == 200 }
    })
    .await;
    // Another process's exclusive transaction: in WAL mode reads go on
    // (stats answer), every write waits.
    let other = rusqlite::Connection::open(host.dir.path().join("onceq.db")).unwrap();
    other.execute_batch("BEGIN EXCLUSIVE").unwrap();
    let (status, body) = host.get("/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("store cannot be written") && body.contains("is another process holding it?"),
        "{body}"
    );
    other.execute_batch("ROLLBACK").unwrap();
    wait_until("ready again once the lock is released", Duration::from_secs(60), || {
        let h = &host;
        async move { h.get("/readyz").await.0 == 200 }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_checks_the_token_before_reading_an_upload() {
    let mut host = project("");
    host.ok(&["init"]).await;
    host.start().await;
    let before = host.rss_bytes();
    let addr = host.url("").trim_start_matches("http://").to_string();

    // Eight unauthenticated clients each try to stream 64 MiB.
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let addr = addr.clone();
        clients.spawn(async move {
            let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
            s.write_all(b"POST /v1/queues/hostile/deploy HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
                .await
                .unwrap();
            let (mut rd, mut wr) = s.into_split();
            let writer = tokio::spawn(async move {
                let chunk = vec![b'A'; 64 << 10];
                let mut sent = 0usize;
                while sent < 64 << 20 {
                    let head = format!("{:x}\r\n", chunk.len());
                    if wr.write_all(head.as_bytes()).await.is_err()
                        || wr.write_all(&chunk).await.is_err()
                        || wr.write_all(b"\r\n").await.is_err()
                    {
                        break;
                    }
                    sent += chunk.len();
                }
                sent
            });
            let mut answer = vec![0u8; 512];
            let n = tokio::time::timeout(Duration::from_secs(60), rd.read(&mut answer))
                .await
                .expect("an answer")
                .unwrap();
            writer.abort();
            String::from_utf8_lossy(&answer[..n]).to_string()
        });
    }
    while let Some(answer) = clients.join_next().await {
        let answer = answer.unwrap();
        assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    }
    let after = host.rss_bytes();
    eprintln!(
        "host RSS {} MiB before, {} MiB after the unauthenticated uploads",
        before >> 20,
        after >> 20
    );
    assert!(
        after < before + (64 << 20),
        "the host did not buffer the uploads: {before} -> {after} bytes"
    );

    // The CLI without the host's token, or with another: the refusal says
    // where the token comes from.
    let elsewhere = tempfile::tempdir().unwrap();
    std::fs::write(elsewhere.path().join("onceq.toml"), "store = \"x.db\"\n").unwrap();
    let component = guest("hostile");
    let admin = host.url("");
    for (token, says) in [
        (None, "no token was sent: set ONCEQ_ADMIN_TOKEN"),
        (Some("wrong"), "is not the host's"),
    ] {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_onceq"));
        cmd.current_dir(elsewhere.path())
            .args(["deploy", "hostile", component.to_str().unwrap(), "--admin", &admin])
            .env_remove("ONCEQ_ADMIN_TOKEN");
        if let Some(t) = token {
            cmd.env("ONCEQ_ADMIN_TOKEN", t);
        }
        let out = cmd.output().await.unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(
            !out.status.success() && text.contains("401") && text.contains(says),
            "{token:?}: {text}"
        );
    }

    // With the token, a body over admin.max_upload is refused (413). The
    // server answers once the limit is passed and closes the connection:
    // a client still writing the rest may see that close (a broken pipe, or
    // a reset that discards the answer) before it reads the 413. Either way
    // the upload was refused before the host read it whole.
    let r = host
        .http
        .post(host.url("/v1/queues/hostile/deploy"))
        .bearer_auth("s3cret")
        .body(vec![0u8; 2 << 20])
        .send()
        .await;
    match r {
        Ok(r) => assert_eq!(r.status().as_u16(), 413),
        Err(e) => assert!(e.is_request() && !e.is_connect() && !e.is_timeout(), "the oversized upload: {e:?}"),
    }
    // `onceq deploy` of a component over the limit names the limit, however
    // the refusal reached it.
    let big = elsewhere.path().join("big.wasm");
    std::fs::write(&big, vec![0u8; 2 << 20]).unwrap();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_onceq"))
        .current_dir(elsewhere.path())
        .args(["deploy", "hostile", big.to_str().unwrap(), "--admin", &admin])
        .env("ONCEQ_ADMIN_TOKEN", "s3cret")
        .output()
        .await
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success() && text.contains("admin.max_upload"), "{text}");
    // A new connection: the server closes the one whose body it refused.
    let ready = reqwest::Client::new().get(host.url("/readyz")).send().await.unwrap();
    assert_eq!(ready.status().as_u16(), 200, "still ready");
    host.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_refuses_bad_names_and_delays_and_never_prints_a_handlers_escapes() {
    let host = project("");
    host.ok(&["init"]).await;
    let long = "q".repeat(100_000);
    for (queue, needle) in [
        ("", "queue name is empty"),
        ("a b", "use letters, digits"),
        ("../../etc/passwd", "use letters, digits"),
        (long.as_str(), "over the limit of 128"),
        ("ONCEQ.outbox.x", "reserved for onceq"),
    ] {
        let (ok, out) = host.onceq(&["send", queue, "--payload", "{}"]).await;
        assert!(!ok && out.contains(needle), "send to {:.20}: {out:.300}", queue);
    }
    let (ok, out) = host.onceq(&["send", "hostile", "--payload", "{}", "--delay", "300000years"]).await;
    assert!(
        !ok && out.contains("over the limit of 365d (the queue's max_delay setting)"),
        "{out}"
    );
    let (ok, out) = host.onceq(&["send", "nobody", "--payload", "{}"]).await;
    assert!(ok && out.contains("warning: no [[queue]] named nobody"), "{out}");

    // A reject reason full of terminal escapes, a log line forging another
    // line and clearing the screen, a 100 MiB log flood.
    for (i, cmd) in ["reject-escape", "log-escape", "log-flood 100"].iter().enumerate() {
        std::fs::write(host.dir.path().join(format!("m{i}.txt")), cmd).unwrap();
        host.ok(&["send", "hostile", "--file", &format!("m{i}.txt")]).await;
    }
    let out = host.cmd(&["run", "--until-empty"]).env("RUST_LOG", "info").output().await.unwrap();
    assert!(out.status.success());
    let stderr = out.stderr;
    assert!(!stderr.contains(&0x1b), "no raw escape reached the terminal");
    assert!(stderr.len() < 3 << 20, "the log flood was cut: {} bytes of log", stderr.len());
    let text = String::from_utf8_lossy(&stderr);
    assert!(text.contains("setting max_log_bytes"), "the cut is announced");
    assert!(text.contains("fake\\u{1b}[2J"), "the escape is shown escaped");

    let list = host.cmd(&["dlq", "list"]).output().await.unwrap();
    assert!(list.status.success());
    assert!(!list.stdout.contains(&0x1b), "dlq list prints no raw escape");
    let shown = String::from_utf8_lossy(&list.stdout);
    assert!(shown.contains("bad order \\u{1b}]8;;http://evil.example"), "{shown:.300}");
    assert_eq!(shown.lines().count(), 1, "one dead letter, one line");
}

/// A binary payload keeps its bytes in the JSON views (`payload_base64`,
/// where `payload_text` is lossy), a 100 KB attribute is cut in the text
/// view (whole in `--json`), and a format character in an attribute is
/// shown escaped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_payloads_keep_their_bytes_in_json_and_long_values_are_cut_in_text() {
    use base64::Engine;
    let host = project("");
    host.ok(&["init"]).await;
    let bytes: Vec<u8> = vec![0xff, 0x00, 0xfe, b'o', b'k', 0x80];
    std::fs::write(host.dir.path().join("bin"), &bytes).unwrap();
    let long = "v".repeat(100_000);
    host.ok(&[
        "send",
        "parked",
        "--file",
        "bin",
        "-a",
        &format!("big={long}"),
        "-a",
        "hidden=a\u{2063}b",
    ])
    .await;
    let json: serde_json::Value = serde_json::from_str(&host.ok(&["peek", "parked", "--json"]).await).unwrap();
    let m = &json[0];
    assert_eq!(
        m["payload_base64"],
        base64::engine::general_purpose::STANDARD.encode(&bytes),
        "{m:.300}"
    );
    assert!(m["attributes"].to_string().contains(&long), "--json has the whole value");
    let text = host.ok(&["peek", "parked"]).await;
    assert!(text.len() < 2_000, "{} bytes of text for one message", text.len());
    assert!(text.contains("(cut: 100000 bytes in all)"), "{text}");
    assert!(text.contains("a\\u{2063}b"), "the invisible separator is shown escaped: {text}");
    host.ok(&["send", "parked", "--payload", "{\"x\": 1}"]).await;
    let json: serde_json::Value = serde_json::from_str(&host.ok(&["peek", "parked", "--json"]).await).unwrap();
    let utf8 = json.as_array().unwrap().iter().find(|m| m["payload_text"] == "{\"x\": 1}").unwrap();
    assert!(utf8.get("payload_base64").is_none(), "a UTF-8 payload needs no base64: {utf8}");
}

#[test]
fn onceq_check_notes_stubbed_capabilities_and_the_missing_network() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("onceq.toml"), "store = \"x.db\"\n").unwrap();
    let check = |component: &std::path::Path| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_onceq"))
            .current_dir(dir.path())
            .args(["check", component.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    // A Python component (built with --stub-wasi): both notes.
    let py = check(&repo_root().join("guest-examples/target/python/payments.wasm"));
    assert!(
        py.contains("note: it imports no WASI at all") && py.contains("urllib traps"),
        "{py}"
    );
    assert!(py.contains("note: the sandbox offers no network and no files"), "{py}");
    // A Rust component imports WASI: only the sandbox note.
    let rust = check(&guest("payments"));
    assert!(!rust.contains("imports no WASI") && rust.contains("offers no network"), "{rust}");
}

#[test]
fn onceq_check_refuses_the_impostor_component() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("onceq.toml"), "store = \"x.db\"\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_onceq"))
        .current_dir(dir.path())
        .args(["check", guest("wrong_signature").to_str().unwrap()])
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "check fails: {text}");
    assert!(text.contains("does not match wit/handler.wit"), "{text}");
}

// ---- instruction budgets --------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_past_its_instruction_budget_is_dead_lettered_at_once_with_the_count_named() {
    let db = TestDb::new(HOSTILE_SQL);
    db.send("hostile", ["spin 50000000".to_string(), "spin 1000".to_string()]).await;
    let rt = runtime();
    let limits = HandlerLimits {
        // The wall-clock deadline is far away: only the budget can stop it.
        deadline: Duration::from_secs(120),
        max_instructions: Some(2_000_000),
        ..Default::default()
    };
    let h = Arc::new(wasm(&rt, "hostile", limits));
    // Five attempts allowed: a budget spent is not retried blindly.
    let r = runner(&db.store, "hostile", h, grants(&["hostile_log"], &[], &[]), policy(1, 5));
    drain_within(&db.store, std::slice::from_ref(&r), Duration::from_secs(120)).await;
    let dead = db.store.dead_letter_list(Queues::All, 10).await.unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].payload_text, "spin 50000000");
    assert!(
        dead[0]
            .reason
            .contains("ran past its budget of 2,000,000 instructions (setting queue.max_instructions)"),
        "{}",
        dead[0].reason
    );
    assert_eq!((dead[0].deliveries, dead[0].failures), (1, 1), "dead-lettered on its first failure");
    let notes: Vec<String> = db
        .rows("hostile_log")
        .await
        .iter()
        .map(|r| format!("{:?}", col(r, "note")))
        .collect();
    assert_eq!(notes.len(), 1, "the message within its budget was processed: {notes:?}");
    // Instructions per version, for the metrics.
    let counted = r.metrics.instruction_quantiles();
    let (calls, p50, p99) = counted.values().next().copied().unwrap();
    assert_eq!(calls, 2);
    // The budget's run stopped at 2,000,000; the small spin ran far fewer.
    assert!(p50 > 1_000 && p99 >= 1_900_000, "{counted:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_message_runs_the_same_instructions_on_an_idle_and_a_loaded_machine() {
    use onceq::protocol::{Handler, ReadScope};
    let db = TestDb::new(HOSTILE_SQL);
    let rt = runtime();
    let h = wasm(&rt, "hostile", HandlerLimits::default());
    let message = onceq::value::Message {
        id: "m-1".into(),
        queue: "hostile".into(),
        payload: b"spin 200000".to_vec(),
        attributes: vec![],
        attempt: 1,
        enqueued_at: 1,
    };
    let tables: Arc<std::collections::BTreeSet<String>> = Arc::new(["hostile_log".to_string()].into_iter().collect());
    let mut counts = Vec::new();
    for loaded in [false, true, false] {
        // Two threads burning both cores while the loaded call runs.
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let burners: Vec<_> = (0..if loaded { 2 } else { 0 })
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut x = 0u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        x = std::hint::black_box(x.wrapping_add(1));
                    }
                })
            })
            .collect();
        let tx = db.store.transaction_begin().await.unwrap();
        let out = h.handle(&message, ReadScope::new(tx, db.store.schema(), tables.clone())).await;
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for b in burners {
            b.join().unwrap();
        }
        assert!(out.result.is_ok(), "{:?}", out.result.err());
        counts.push(out.scope.instructions.expect("instructions are counted by default"));
        out.scope.into_transaction().rollback().await;
    }
    assert!(counts[0] > 200_000, "the loop's instructions are counted: {counts:?}");
    assert!(counts.iter().all(|c| *c == counts[0]), "the same count each time: {counts:?}");
}
