//! OpenTelemetry traces against a real OTLP receiver (the official
//! protobufs, decoded in this process): one message followed from
//! `onceq send` through a re-run after an unknown commit outcome, its
//! follow-up and its intent, to the traceparent the webhook receives; and
//! nothing exported unless telemetry is on.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
use crate::common;
use common::http::Receiver;
use common::otlp::{attr, Got, Otlp};
use common::*;
use onceq::outbox::ConnectorConfig;
use onceq::protocol::{Policy, QueueRunner, QueueSpec};
use onceq::runtime::HandlerLimits;
use onceq::store::faulty::{FaultPlan, FaultyStore};
use onceq::store::Store;
use onceq::telemetry::{Telemetry, TelemetryConfig};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

const HOSTILE_SQL: &str = "CREATE TABLE hostile_log (id TEXT PRIMARY KEY, note TEXT, x REAL);";

/// A config for `onceq send` and `onceq run` on `db`: `hostile` (sends
/// follow-ups to `ledger`, intents to `hook`), `ledger`, and `hook`
/// delivering to `url`.
fn config(dir: &Path, db: &Path, url: &str, telemetry: &str) -> std::path::PathBuf {
    let hostile = guest("hostile");
    let text = format!(
        r#"store = "{db}"
[admin]
listen = "off"
{telemetry}
[defaults]
backoff_initial = "10ms"
[[queue]]
name = "hostile"
handler = "{h}"
tables = ["hostile_log"]
enqueue = ["ledger"]
connectors = ["hook"]
[[queue]]
name = "ledger"
handler = "{h}"
tables = ["hostile_log"]
[[connector]]
name = "hook"
kind = "webhook"
url = "{url}"
timeout = "5s"
[outbox]
backoff_initial = "10ms"
"#,
        db = db.display(),
        h = hostile.display(),
    );
    let path = dir.join("onceq.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// `onceq send` of the raw payload `text` to `hostile`, with `env`.
async fn send(dir: &Path, text: &str, env: &[(&str, &str)]) {
    let file = dir.join("payload.txt");
    std::fs::write(&file, text).unwrap();
    let mut c = onceq_command(dir, &["send", "hostile", "--file", file.to_str().unwrap()]);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().await.unwrap();
    assert!(out.status.success(), "send: {}", String::from_utf8_lossy(&out.stderr));
}

fn one(spans: &[Got], what: &str) -> Got {
    assert_eq!(spans.len(), 1, "one {what} span expected: {spans:#?}");
    spans[0].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_runs_from_send_through_a_re_run_to_the_webhook_s_traceparent() {
    let otlp = Otlp::start().await;
    let hook = Receiver::start(29).await;
    let db = TestDb::new(HOSTILE_SQL);
    let dir = db.dir.path();
    config(dir, &db.path, &hook.url(), "");
    // The producer: `onceq send`, exporting by the OTEL_* variables.
    send(
        dir,
        "trace ledger",
        &[
            ("OTEL_TRACES_EXPORTER", "otlp"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp.http_url()),
            ("OTEL_SERVICE_NAME", "checkout"),
        ],
    )
    .await;
    // The host, in this process: its first commit lands but its answer is
    // lost (an unknown outcome), so the message is run again.
    let (faulty, counts) = FaultyStore::new(
        db.store.clone(),
        FaultPlan {
            after_commit: 1.0,
            limit: Some(1),
            ..FaultPlan::default()
        },
    );
    let store: Arc<dyn Store> = Arc::new(faulty);
    let telemetry = Telemetry::start(&otlp.config()).unwrap();
    assert!(telemetry.is_on());
    telemetry.observe_commits(store.as_ref());
    let rt = runtime();
    let queue = |name: &str, queues: &[&str], connectors: &[&str]| {
        Arc::new(QueueRunner::new(
            QueueSpec {
                name: name.into(),
                handler: Arc::new(wasm(&rt, "hostile", HandlerLimits::default())),
                grants: grants(&["hostile_log"], queues, connectors),
                limits: Default::default(),
                policy: Policy { batch: 1, ..policy(1, 3) },
            },
            store.clone(),
        ))
    };
    let hostile = queue("hostile", &["ledger"], &["hook"]);
    let ledger = queue("ledger", &[], &[]);
    let c = ConnectorConfig::Webhook {
        url: hook.url(),
        timeout: Duration::from_secs(5),
        headers: vec![],
        bearer_token_env: None,
    }
    .build("hook")
    .unwrap();
    let dispatcher = Arc::new(onceq::outbox::runner(store.clone(), "hook", c, &fast_outbox()));
    for r in [&hostile, &ledger, &dispatcher] {
        r.set_telemetry(telemetry.clone());
    }
    drain(&store, &[hostile.clone(), ledger.clone(), dispatcher.clone()]).await;
    telemetry.shutdown().await;
    assert_eq!(counts.after_commit.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert_eq!(hostile.metrics.already_committed.load(std::sync::atomic::Ordering::Relaxed), 1);

    // Every span is in, once the delivery's client span is.
    wait_until("the delivery's span", Duration::from_secs(30), || async {
        !otlp.named("send hook").is_empty()
    })
    .await;
    let spans = otlp.spans();
    // The picture in the docs (`make trace-picture`).
    let out = repo_root().join("target/telemetry");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("trace.svg"), common::otlp::render_svg(&spans)).unwrap();
    // The producer's span: its id is the message's creation context.
    let sent = one(&otlp.named("send hostile"), "send hostile");
    assert_eq!(sent.service, "checkout", "OTEL_SERVICE_NAME names the producer");
    assert_eq!(sent.span.kind, 4, "PRODUCER");
    assert_eq!(sent.attr("messaging.system").as_deref(), Some("onceq"));
    assert_eq!(sent.attr("messaging.destination.name").as_deref(), Some("hostile"));
    assert_eq!(sent.attr("messaging.operation.type").as_deref(), Some("send"));
    let trace = sent.trace_id();
    for s in &spans {
        if s.span.name != "commit" {
            assert_eq!(s.trace_id(), trace, "one trace: {} is in another", s.span.name);
            assert_eq!(s.attr("messaging.system").as_deref(), Some("onceq"), "{}", s.span.name);
        }
    }

    // Two runs: the first's commit outcome was unknown, the second's ack
    // was refused because the first had landed.
    let mut runs = otlp.named("process hostile");
    assert_eq!(runs.len(), 2, "a process span per run: {runs:#?}");
    runs.sort_by_key(|r| r.span.start_time_unix_nano);
    for r in &runs {
        assert_eq!(r.span.kind, 5, "CONSUMER");
        assert_eq!(r.parent(), sent.span_id(), "a child of the send");
        assert_eq!(r.links(), vec![sent.span_id()], "linked to the creation context");
        assert_eq!(r.attr("messaging.operation.type").as_deref(), Some("process"));
        assert_eq!(r.attr("messaging.destination.name").as_deref(), Some("hostile"));
        assert_eq!(r.attr("messaging.message.delivery_count").as_deref(), Some("1"));
    }
    let id = runs[0].attr("messaging.message.id").unwrap();
    assert_eq!(runs[1].attr("messaging.message.id"), Some(id.clone()));
    let names = |g: &Got| g.events().into_iter().map(|(n, _)| n).collect::<Vec<_>>();
    assert!(
        names(&runs[0]).contains(&"commit outcome unknown".to_string()),
        "{:?}",
        names(&runs[0])
    );
    assert_eq!(runs[1].attr("onceq.outcome").as_deref(), Some("already committed"));
    assert!(names(&runs[1]).contains(&"already committed".to_string()), "{:?}", names(&runs[1]));

    // Each run's handler call, with the handler's log line as an event.
    let calls = otlp.named("handle hostile");
    assert_eq!(calls.len(), 2);
    for c in &calls {
        assert!(runs.iter().any(|r| r.span_id() == c.parent()), "under a run");
        let logs: Vec<_> = c
            .events()
            .into_iter()
            .filter(|(n, _)| n == "log")
            .map(|(_, a)| attr(&a, "log.message").unwrap())
            .collect();
        assert_eq!(logs, vec![format!("tracing {id}")]);
    }
    // Each run settled (the ack with the effects), in a group commit
    // whose span links to it.
    let settles = otlp.named("settle hostile");
    assert_eq!(settles.len(), 2);
    let commits = otlp.named("commit");
    for s in &settles {
        assert_eq!(s.span.kind, 3, "CLIENT");
        let batch = commits
            .iter()
            .find(|c| c.links().contains(&s.span_id()))
            .unwrap_or_else(|| panic!("no commit span links to the settle: {commits:#?}"));
        let count: i64 = batch.attr("messaging.batch.message_count").unwrap().parse().unwrap();
        assert!(count >= 1 && count as usize >= batch.links().len());
    }

    // The follow-up: a producer span (once: the run that landed) whose id
    // is the follow-up's context, and its own process span under it.
    let follow = one(&otlp.named("send ledger"), "send ledger");
    assert_eq!(follow.span.kind, 4);
    let ledger_run = one(&otlp.named("process ledger"), "process ledger");
    assert_eq!(ledger_run.parent(), follow.span_id());
    assert!(runs.iter().any(|r| r.span_id() == follow.parent()), "the follow-up is the run's");

    // The intent: created by the run, delivered under the outbox queue's
    // process span by a client span, whose context the webhook received.
    let created = one(&otlp.named("create hook"), "create hook");
    let outbox_run = one(&otlp.named("process onceq.outbox.hook"), "process onceq.outbox.hook");
    assert_eq!(outbox_run.parent(), created.span_id());
    let delivery = one(&otlp.named("send hook"), "send hook");
    assert_eq!(delivery.span.kind, 3, "CLIENT");
    let seen = hook.seen();
    let key = format!("k-{id}");
    let header = seen[&key]
        .headers
        .iter()
        .find(|(k, _)| k == "traceparent")
        .map(|(_, v)| v.clone())
        .expect("the webhook got a traceparent");
    assert_eq!(header, format!("00-{trace}-{}-01", delivery.span_id()));
    let call = one(
        &spans
            .iter()
            .filter(|s| s.span_id() == delivery.parent())
            .cloned()
            .collect::<Vec<_>>(),
        "delivery parent",
    );
    assert_eq!(call.span.name, "handle onceq.outbox.hook");
    assert_eq!(call.parent(), outbox_run.span_id());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_exported_unless_telemetry_is_on() {
    let otlp = Otlp::start().await;
    let hook = Receiver::start(30).await;
    let db = TestDb::new(HOSTILE_SQL);
    let dir = db.dir.path();
    // An endpoint in the environment does not turn export on.
    config(dir, &db.path, &hook.url(), "");
    let env = [("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.http_url())];
    send(dir, "trace ledger", &[(env[0].0, env[0].1.as_str())]).await;
    let mut run = onceq_command(dir, &["run", "--until-empty"]);
    run.env(env[0].0, &env[0].1);
    let out = run.output().await.unwrap();
    assert!(out.status.success(), "run: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(hook.seen().len(), 1, "the intent was delivered");
    assert_eq!(otlp.requests(), 0, "no export request: {:#?}", otlp.spans());

    // `[telemetry] enabled = true`, over gRPC: the host's spans arrive
    // (so the check above could fail).
    config(
        dir,
        &db.path,
        &hook.url(),
        &format!(
            "[telemetry]\nenabled = true\nprotocol = \"grpc\"\nendpoint = \"{}\"\nservice_name = \"payments-host\"",
            otlp.grpc_url()
        ),
    );
    send(dir, "trace ledger", &[]).await;
    let mut run = onceq_command(dir, &["run", "--until-empty", "--log-format", "json"]);
    run.env(env[0].0, &env[0].1).env("RUST_LOG", "info");
    let out = run.output().await.unwrap();
    assert!(out.status.success(), "run: {}", String::from_utf8_lossy(&out.stderr));
    wait_until("the host's spans", Duration::from_secs(30), || async {
        !otlp.named("send hook").is_empty()
    })
    .await;
    let spans = otlp.spans();
    let sent = one(&otlp.named("send hostile"), "send hostile");
    assert_eq!(sent.service, "payments-host");
    let run = one(&otlp.named("process hostile"), "process hostile");
    assert_eq!((run.trace_id(), run.parent()), (sent.trace_id(), sent.span_id()));
    assert!(spans.iter().any(|s| s.span.name == "commit"), "the batch commit span");
    assert_eq!(hook.seen().len(), 2);
    // The handler's log line, as JSON, carries the run's trace and span.
    let log = String::from_utf8_lossy(&out.stderr);
    let line = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|l| l["fields"]["message"].as_str().is_some_and(|m| m.starts_with("tracing ")))
        .unwrap_or_else(|| panic!("the handler's log line: {log}"));
    assert_eq!(line["span"]["trace_id"].as_str(), Some(run.trace_id().as_str()), "{line}");
    assert_eq!(line["span"]["span_id"].as_str(), Some(run.span_id().as_str()), "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_message_s_lease_renewals_are_spans_linked_to_it() {
    let otlp = Otlp::start().await;
    let db = TestDb::new(HOSTILE_SQL);
    let created = onceq::trace::TraceParent::root();
    db.store
        .message_send(vec![onceq::store::SendParams {
            queue: "slow".into(),
            payload: b"x".to_vec(),
            attributes: vec![(onceq::trace::TRACEPARENT_ATTRIBUTE.into(), created.to_string())],
            ..Default::default()
        }])
        .await
        .unwrap();
    let telemetry = Telemetry::start(&TelemetryConfig {
        propagation: onceq::telemetry::Propagation::Link,
        ..otlp.config()
    })
    .unwrap();
    // A handler that takes 1.5 leases: renewed every third of one.
    let slow = onceq::protocol::NativeHandler::new("slow", |_m, mut scope| async move {
        let read = scope.get("hostile_log", &[onceq::value::Value::String("x".into())]).await;
        assert_eq!(read.unwrap(), None);
        tokio::time::sleep(Duration::from_millis(900)).await;
        onceq::protocol::HandleOutput { scope, result: Ok(vec![]) }
    });
    let r = runner(
        &db.store,
        "slow",
        Arc::new(slow),
        grants(&["hostile_log"], &[], &[]),
        Policy {
            lease: Duration::from_millis(600),
            ..policy(1, 3)
        },
    );
    r.set_telemetry(telemetry.clone());
    drain(&db.store, std::slice::from_ref(&r)).await;
    telemetry.shutdown().await;
    assert_eq!(r.metrics.processed.load(std::sync::atomic::Ordering::Relaxed), 1);
    wait_until("the spans", Duration::from_secs(30), || async {
        !otlp.named("process slow").is_empty()
    })
    .await;
    let renewals = otlp.named("renew slow");
    assert!(!renewals.is_empty(), "renewal spans: {:#?}", otlp.spans());
    for s in &renewals {
        assert_eq!(s.span.kind, 3, "CLIENT");
        assert_eq!(s.links(), vec![created.span_id_hex()], "linked to the message");
        assert_eq!(s.attr("onceq.renewed").as_deref(), Some("1"));
        assert_eq!(s.attr("messaging.operation.type").as_deref(), Some("renew"));
    }
    // propagation = "link": the run is a trace of its own, linked.
    let run = one(&otlp.named("process slow"), "process slow");
    assert_ne!(run.trace_id(), created.trace_id_hex());
    assert_eq!(run.parent(), "");
    assert_eq!(run.links(), vec![created.span_id_hex()]);
    // Its store read, under the handler call.
    let call = one(&otlp.named("handle slow"), "handle slow");
    assert_eq!(call.parent(), run.span_id());
    assert_eq!(call.attr("onceq.reads").as_deref(), Some("1"));
    let read = one(&otlp.named("get hostile_log"), "get hostile_log");
    assert_eq!((read.parent(), read.span.kind), (call.span_id(), 3));
    assert_eq!(read.attr("db.collection.name").as_deref(), Some("hostile_log"));
    assert_eq!(read.attr("db.response.returned_rows").as_deref(), Some("0"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_sends_a_message_in_the_caller_s_trace() {
    let otlp = Otlp::start().await;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("schema.sql"), HOSTILE_SQL).unwrap();
    let sha = |s: &str| common::otlp::hex(&onceq::access::digest(s));
    std::fs::write(
        d.join("onceq.toml"),
        format!(
            r#"store = "db.sqlite"
schema = "schema.sql"
[admin]
listen = "127.0.0.1:0"
[[admin.tokens]]
name = "ops"
role = "operator"
queues = ["hostile"]
sha256 = "{ops}"
[[admin.tokens]]
name = "watcher"
role = "viewer"
sha256 = "{viewer}"
[telemetry]
enabled = true
endpoint = "{otlp}"
[[queue]]
name = "hostile"
handler = "{h}"
tables = ["hostile_log"]
"#,
            ops = sha("ops-secret"),
            viewer = sha("viewer-secret"),
            otlp = otlp.http_url(),
            h = guest("hostile").display(),
        ),
    )
    .unwrap();
    let mut host = common::host::Host::new(dir);
    host.ok(&["init"]).await;
    host.start().await;
    let post = |token: &str, headers: &[(&str, &str)], query: &str, queue: &str| {
        let mut req = host
            .http
            .post(host.url(&format!("/v1/queues/{queue}/messages{query}")))
            .bearer_auth(token)
            .body("ok");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        req.send()
    };
    let caller = onceq::trace::TraceParent::root();
    let r = post(
        "ops-secret",
        &[("traceparent", &caller.to_string()), ("tracestate", "team=pay")],
        "",
        "hostile",
    )
    .await
    .unwrap();
    assert_eq!(r.status(), 200);
    let sent: serde_json::Value = r.json().await.unwrap();
    let context = onceq::trace::TraceParent::parse(sent["traceparent"].as_str().unwrap()).unwrap();
    assert_eq!(context.trace_id, caller.trace_id, "in the caller's trace");
    assert_ne!(context.span_id, caller.span_id);
    // Refusals name the problem; nothing is sent.
    let r = post("ops-secret", &[("traceparent", "00-nope")], "", "hostile").await.unwrap();
    assert_eq!(r.status(), 400);
    assert!(r.text().await.unwrap().contains("traceparent header"));
    let r = post("viewer-secret", &[], "", "hostile").await.unwrap();
    assert_eq!(r.status(), 403);
    assert!(r.text().await.unwrap().contains("may not send messages"));
    let r = post("ops-secret", &[], "", "elsewhere").await.unwrap();
    assert_eq!(r.status(), 403, "outside the token's queues");
    let r = post("ops-secret", &[], "?delay=soon", "hostile").await.unwrap();
    assert_eq!(r.status(), 400);

    // The producer span is the message's context, a child of the caller's;
    // the run is its child.
    wait_until("the run's span", Duration::from_secs(60), || async {
        !otlp.named("process hostile").is_empty()
    })
    .await;
    let send = one(&otlp.named("send hostile"), "send hostile");
    assert_eq!(send.trace_id(), caller.trace_id_hex());
    assert_eq!(send.span_id(), context.span_id_hex());
    assert_eq!(send.parent(), caller.span_id_hex());
    let run = one(&otlp.named("process hostile"), "process hostile");
    assert_eq!((run.trace_id(), run.parent()), (caller.trace_id_hex(), context.span_id_hex()));
    host.token = Some("ops-secret".into());
    let (status, audit) = host.get("/v1/audit").await;
    assert_eq!(status, 200);
    let audit: Vec<serde_json::Value> = serde_json::from_str(&audit).unwrap();
    assert!(
        audit.iter().any(|e| e["action"] == "send"
            && e["actor"] == "ops"
            && e["subject"].as_str().unwrap().starts_with(sent["id"].as_str().unwrap())),
        "{audit:#?}"
    );
    host.stop().await;
}
