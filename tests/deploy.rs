//! Hot swap and the admin API: versions deployed back and forth under load
//! without losing or double-processing a message, broken components refused
//! while the old version keeps serving, rollback, the watched folder, the
//! bearer token, Prometheus metrics that parse and move, and a restart that
//! keeps the deployed version and reuses the compiled-component cache.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use common::host::Host;
use common::*;
use onceq::config::Config;
use onceq::deploy::{version_of, DeployFailure, Deployer};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

const TALLY_SQL: &str = "CREATE TABLE tally (id TEXT PRIMARY KEY, n INTEGER NOT NULL, build TEXT NOT NULL);";

fn tally_rows(db: &rusqlite::Connection) -> Vec<(String, i64, String)> {
    let mut st = db.prepare("SELECT id, n, build FROM tally").unwrap();
    st.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_swapped_under_load_process_every_message_once_by_one_version() {
    let db = TestDb::new(TALLY_SQL);
    // Enough to keep the workers busy through several swaps on a fast
    // machine (2,000 drained in a third of a second here).
    let n = 10_000;
    db.send("tally", (0..n).map(|i| format!("{{\"i\": {i}}}"))).await;
    let state = db.dir.path().join("state");
    let cfg = Config::parse(
        &format!(
            r#"store = "{}"
state_dir = "{}"
[[queue]]
name = "tally"
handler = "{}"
tables = ["tally"]
workers = 4
batch = 4
"#,
            db.path.display(),
            state.display(),
            guest("tally_v1").display()
        ),
        Path::new("/"),
    )
    .unwrap();
    let runtime = Arc::new(onceq::runtime::Runtime::new(cfg.runtime.clone()).unwrap());
    let (deployer, runners) = Deployer::open(&cfg, &db.store, runtime).unwrap();
    let v1 = std::fs::read(guest("tally_v1")).unwrap();
    let v2 = std::fs::read(guest("tally_v2")).unwrap();
    let (h1, h2) = (version_of(&v1), version_of(&v2));
    assert_eq!(deployer.active()["tally"], h1, "starts on the config's handler");

    let store = db.store.clone();
    let r = runners.clone();
    let drained = tokio::spawn(async move { drain_within(&store, &r, Duration::from_secs(120)).await });
    let mut swaps = 0;
    let mut refused = 0;
    while !drained.is_finished() {
        let (bytes, label) = if swaps % 2 == 0 { (v2.clone(), "v2") } else { (v1.clone(), "v1") };
        let d = deployer.deploy("tally", bytes, Some(label.into()), "api").await.unwrap();
        assert_eq!(deployer.active()["tally"], d.version, "the switch is immediate");
        swaps += 1;
        if swaps % 5 == 0 {
            // A broken component mid-run: refused, the running version stays.
            let before = deployer.active()["tally"].clone();
            let bad = std::fs::read(guest("forbidden")).unwrap();
            match deployer.deploy("tally", bad, None, "api").await {
                Err(DeployFailure::Refused { reason, .. }) => assert!(reason.contains("wasi:filesystem"), "{reason}"),
                other => panic!("a forbidden component must be refused, got {other:?}"),
            }
            match deployer.deploy("tally", b"\0asm garbage".to_vec(), None, "api").await {
                Err(DeployFailure::Refused { .. }) => {}
                other => panic!("garbage must be refused, got {other:?}"),
            }
            assert_eq!(deployer.active()["tally"], before);
            refused += 2;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    drained.await.unwrap();
    assert!(swaps >= 6, "swapped {swaps} times while draining");

    let rows = tally_rows(&db.sql());
    assert_eq!(rows.len(), n, "none lost");
    assert!(rows.iter().all(|(_, c, _)| *c == 1), "none processed twice");
    let mut by_build: BTreeMap<String, usize> = BTreeMap::new();
    for (_, _, b) in &rows {
        *by_build.entry(b.clone()).or_default() += 1;
    }
    assert!(
        by_build.len() == 2 && by_build.values().all(|&c| c > 0),
        "both versions processed messages: {by_build:?}"
    );
    // The protocol's per-version counts agree with what the handlers wrote.
    let versions = runners[0].metrics.versions();
    assert_eq!(versions.get(&h1).map_or(0, |c| c.processed) as usize, by_build["tally-v1"]);
    assert_eq!(versions.get(&h2).map_or(0, |c| c.processed) as usize, by_build["tally-v2"]);
    eprintln!("{swaps} swaps, {refused} refused deploys, by version: {by_build:?}");

    // History, newest first; rollback returns to the previous version.
    let list = deployer.versions("tally").await.unwrap();
    assert!(list[0].active && list.iter().filter(|v| v.active).count() == 1);
    assert_eq!(
        list.len(),
        (swaps + 1).min(onceq::deploy::MAX_HISTORY),
        "the config's version, then one entry per deploy (the last MAX_HISTORY)"
    );
    if swaps < onceq::deploy::MAX_HISTORY {
        assert_eq!(list.last().unwrap().deployment.source, "config");
    }
    let active = list[0].deployment.version.clone();
    let back = deployer.rollback("tally").await.unwrap();
    assert_ne!(back.version, active);
    assert_eq!(back.source, "rollback");
    assert_eq!(deployer.active()["tally"], back.version);
    assert!(matches!(
        deployer.deploy("nope", v1.clone(), None, "api").await,
        Err(DeployFailure::UnknownQueue(_))
    ));

    // Rollbacks back and forth: the history keeps the last MAX_HISTORY
    // entries, and the stored components are those it names.
    for _ in 0..onceq::deploy::MAX_HISTORY + 10 {
        deployer.rollback("tally").await.unwrap();
    }
    let list = deployer.versions("tally").await.unwrap();
    assert_eq!(list.len(), onceq::deploy::MAX_HISTORY, "bounded history");
    let stored: Vec<String> = std::fs::read_dir(state.join("components"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(stored.len(), 2, "the two versions the history names: {stored:?}");

    // A label that would drive a terminal, or a huge one, is refused and
    // changes nothing.
    let active = deployer.active()["tally"].clone();
    for label in ["v3\u{1b}]8;;http://evil.example\u{7}click\u{1b}[2J", "v\u{202e}3", &"x".repeat(200)] {
        match deployer.deploy("tally", v1.clone(), Some(label.to_string()), "api").await {
            Err(e @ DeployFailure::BadLabel { .. }) => assert!(e.to_string().starts_with("label "), "{e}"),
            other => panic!("label {label:?} must be refused, got {other:?}"),
        }
    }
    assert_eq!(deployer.active()["tally"], active);
    assert_eq!(deployer.versions("tally").await.unwrap().len(), onceq::deploy::MAX_HISTORY);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_deploys_with_a_token_serves_metrics_and_a_watched_folder_swaps() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("schema.sql"), TALLY_SQL).unwrap();
    std::fs::create_dir(dir.path().join("handlers")).unwrap();
    std::fs::write(
        dir.path().join("onceq.toml"),
        format!(
            r#"store = "onceq.db"
schema = "schema.sql"

[admin]
listen = "127.0.0.1:0"
token = "s3cret"

[deploy]
watch = "handlers"
poll = "100ms"

[[queue]]
name = "tally"
handler = "{}"
tables = ["tally"]
"#,
            guest("tally_v1").display()
        ),
    )
    .unwrap();
    let mut host = Host::new(dir);
    host.token = Some("s3cret".into());
    host.ok(&["init"]).await;
    host.start().await;
    let (v1, v2) = (guest("tally_v1"), guest("tally_v2"));
    let (h1, h2) = (version_of(&std::fs::read(&v1).unwrap()), version_of(&std::fs::read(&v2).unwrap()));

    assert_eq!(host.get("/healthz").await, (200, "ok\n".to_string()));
    assert_eq!(host.get("/readyz").await.0, 200);
    let before = host.metrics().await;
    assert_eq!(before[&format!("onceq_handler_version{{queue=\"tally\",version=\"{h1}\"}}")], 1.0);

    // Mutations need the token. The host refuses an upload without reading
    // its body and then closes the connection: these requests ask for a
    // connection of their own, so the next request is not sent on one the
    // host is closing (seen once as IncompleteMessage on a loaded machine).
    let deploy = host.url("/v1/queues/tally/deploy");
    let body = std::fs::read(&v2).unwrap();
    let r = host
        .http
        .post(&deploy)
        .header("connection", "close")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    assert!(r.text().await.unwrap().contains("missing Authorization"));
    let r = host
        .http
        .post(&deploy)
        .header("connection", "close")
        .bearer_auth("wrong")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let r = host.http.post(host.url("/v1/queues/tally/rollback")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    assert_eq!(host.active().await["version"], h1.as_str(), "nothing changed");

    // The CLI reads the token from the config and finds the host.
    let out = host.ok(&["deploy", "tally", v2.to_str().unwrap(), "--label", "v2"]).await;
    assert!(out.contains(&format!("deployed {h2} to tally (v2)")), "{out}");
    let (ok, out) = host.onceq(&["deploy", "tally", guest("forbidden").to_str().unwrap()]).await;
    assert!(!ok && out.contains("component refused") && out.contains("wasi:filesystem"), "{out}");
    assert!(
        host.log().contains("deploy refused, the running version keeps serving") && host.log().contains("wasi:filesystem"),
        "the host logs a refused deploy too: {}",
        host.log()
    );
    let (ok, out) = host.onceq(&["deploy", "nope", v2.to_str().unwrap()]).await;
    assert!(!ok && out.contains("no queue named nope"), "{out}");
    let out = host.ok(&["versions", "tally"]).await;
    assert!(
        out.lines().any(|l| l.starts_with('*') && l.contains(&h2) && l.contains("v2")),
        "{out}"
    );

    // Messages go through v2; the metrics move.
    let lines: Vec<String> = (0..50).map(|i| format!("{{\"i\": {i}}}")).collect();
    std::fs::write(host.dir.path().join("m.jsonl"), lines.join("\n")).unwrap();
    host.ok(&["send", "tally", "--jsonl", "m.jsonl"]).await;
    let processed = format!("onceq_messages_processed_total{{queue=\"tally\",version=\"{h2}\"}}");
    wait_until("50 messages processed by v2", Duration::from_secs(30), || {
        let h = &host;
        let key = processed.clone();
        async move { h.metrics().await.get(&key).copied().unwrap_or(0.0) >= 50.0 }
    })
    .await;
    let m = host.metrics().await;
    assert!(m[r#"onceq_message_duration_seconds_count{queue="tally"}"#] >= 50.0);
    assert!(m[r#"onceq_handler_duration_seconds_count{queue="tally"}"#] >= 50.0);
    assert!(m[r#"onceq_handler_duration_seconds_bucket{le="+Inf",queue="tally"}"#] >= 50.0);
    assert_eq!(m[r#"onceq_in_flight{queue="tally"}"#], 0.0);
    let key = format!("onceq_handler_instructions{{queue=\"tally\",version=\"{h2}\",quantile=\"0.5\"}}");
    let ran = *m
        .get(&key)
        .unwrap_or_else(|| panic!("{key} in {:?}", m.keys().filter(|k| k.contains("instr")).collect::<Vec<_>>()));
    assert!(ran > 100.0, "instructions per call are exported per version: {ran}");
    let (batches, committed) = (m["onceq_commit_batches_total"], m["onceq_commit_messages_total"]);
    assert!(
        batches >= 1.0 && committed >= 50.0,
        "the group commit's counts move: {batches} batches, {committed} messages"
    );
    assert!(committed >= batches, "a batch holds at least one message");
    assert_eq!(
        m.get("onceq_commit_split_batches_total"),
        Some(&0.0),
        "no write was refused, so no batch was committed again message by message"
    );
    assert!(
        m.contains_key("onceq_commit_leases_in_batches_total"),
        "the leases run inside batches are counted"
    );
    let (_, stats) = host.get("/v1/stats").await;
    let stats: serde_json::Value = serde_json::from_str(&stats).unwrap();
    assert_eq!(stats["active_versions"]["tally"], h2.as_str());

    // Rollback through the CLI.
    let out = host.ok(&["rollback", "tally"]).await;
    assert!(out.contains(&format!("rolled tally back to {h1}")), "{out}");
    assert_eq!(host.active().await["source"], "rollback");

    // The watched folder: a new file is deployed, a broken one is refused.
    std::fs::copy(&v2, host.dir.path().join("handlers/tally.wasm")).unwrap();
    wait_until("the watched file to be deployed", Duration::from_secs(30), || {
        let h = &host;
        let h2 = h2.clone();
        async move {
            let a = h.active().await;
            a["version"] == h2.as_str() && a["source"] == "watch"
        }
    })
    .await;
    std::fs::write(host.dir.path().join("handlers/tally.wasm"), b"not wasm at all").unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(host.active().await["version"], h2.as_str(), "a broken watched file is refused");

    // A restart keeps the deployed version, from the compiled cache.
    host.stop().await;
    let cached = std::fs::read_dir(host.dir.path().join(".onceq/cache")).unwrap().count();
    assert!(cached > 0, "compiled components are cached on disk");
    std::fs::remove_file(host.dir.path().join("handlers/tally.wasm")).unwrap();
    host.start().await;
    assert_eq!(
        host.active().await["version"],
        h2.as_str(),
        "the deployed version survives a restart"
    );
    let rows = tally_rows(&rusqlite::Connection::open(host.dir.path().join("onceq.db")).unwrap());
    assert_eq!(rows.len(), 50);
    assert!(rows.iter().all(|(_, n, b)| *n == 1 && b == "tally-v2"));
    host.stop().await;
}

/// A tally test case that expects the row a build of that name writes.
fn tally_case(build: &str) -> String {
    format!(
        "[[case]]\nname = \"counts a message\"\nmessage = {{}}\n\
         writes = [{{ table = \"tally\", row = {{ id = \"m-1\", n = 1, build = \"{build}\" }} }}]\n"
    )
}

/// `onceq dev` running in the host's folder, its output in a file.
struct Dev {
    child: tokio::process::Child,
    out: std::path::PathBuf,
    _logs: tempfile::TempDir,
}

impl Dev {
    fn start(host: &Host, args: &[&str]) -> Dev {
        let logs = tempfile::tempdir().unwrap();
        let out = logs.path().join("dev.out");
        let child = host
            .cmd(&[&["dev"][..], args].concat())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(logs.path().join("dev.err")).unwrap())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        Dev { child, out, _logs: logs }
    }

    fn text(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    /// Wait until `n` rounds ended (each says it is watching); their output.
    async fn rounds(&self, n: usize, what: &str) -> String {
        wait_until(what, Duration::from_secs(120), || {
            let text = self.text();
            async move { text.matches("watching").count() >= n }
        })
        .await;
        self.text()
    }
}

/// `onceq dev`, the author's loop, against a running host: it builds with
/// the project's command, runs the test cases, and hot-swaps the component
/// only when they pass; a change of the component or of a test file starts
/// a new round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_builds_tests_and_hot_swaps_only_what_passes() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("schema.sql"), TALLY_SQL).unwrap();
    std::fs::create_dir_all(d.join("src")).unwrap();
    std::fs::create_dir_all(d.join("build")).unwrap();
    std::fs::copy(guest("tally_v1"), d.join("src/handler.wasm")).unwrap();
    std::fs::copy(guest("tally_v1"), d.join("build/tally.wasm")).unwrap();
    std::fs::write(
        d.join("onceq.toml"),
        "store = \"onceq.db\"\nschema = \"schema.sql\"\n\n[admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"s3cret\"\n\n\
         [[queue]]\nname = \"tally\"\nhandler = \"build/tally.wasm\"\ntables = [\"tally\"]\n",
    )
    .unwrap();
    std::fs::write(d.join("tally.test.toml"), tally_case("tally-v1")).unwrap();
    let mut host = Host::new(dir);
    host.token = Some("s3cret".into());
    host.ok(&["init"]).await;
    host.start().await;
    let (h1, h2) = (
        version_of(&std::fs::read(guest("tally_v1")).unwrap()),
        version_of(&std::fs::read(guest("tally_v2")).unwrap()),
    );

    let mut dev = Dev::start(&host, &["--build", "cp src/handler.wasm build/tally.wasm", "--poll", "100ms"]);
    let text = dev.rounds(1, "dev's first round").await;
    assert!(
        text.contains("building: cp src/handler.wasm build/tally.wasm") && text.contains("1 case passed"),
        "{text}"
    );
    assert!(
        text.contains(&format!("deployed {h1} to tally")) && text.contains("ok: watching"),
        "{text}"
    );

    // A new build whose test case fails: reported, not deployed.
    std::fs::copy(guest("tally_v2"), host.dir.path().join("src/handler.wasm")).unwrap();
    let text = dev.rounds(2, "dev's second round").await;
    assert!(text.contains("changed: src/handler.wasm"), "{text}");
    assert!(
        text.contains("FAIL  counts a message") && text.contains(r#"build: "tally-v2""#),
        "{text}"
    );
    assert!(text.contains("FAILED: watching"), "{text}");
    assert_eq!(host.active().await["version"], h1.as_str(), "a failing build is not deployed");

    // The case updated to the new behaviour: it passes and is deployed.
    std::fs::write(host.dir.path().join("tally.test.toml"), tally_case("tally-v2")).unwrap();
    let text = dev.rounds(3, "dev's third round").await;
    assert!(text.contains(&format!("deployed {h2} to tally")), "{text}");
    assert_eq!(host.active().await["version"], h2.as_str());

    // Cases that pass on another component than the queue's handler: what
    // no case ran is not deployed.
    std::fs::copy(guest("tally_v1"), host.dir.path().join("other.wasm")).unwrap();
    std::fs::write(
        host.dir.path().join("tally.test.toml"),
        format!("component = \"other.wasm\"\n{}", tally_case("tally-v1")),
    )
    .unwrap();
    let text = dev.rounds(4, "dev's fourth round").await;
    let round4 = text.rsplit("changed:").next().unwrap_or_default();
    assert!(round4.contains("1 case passed"), "{text}");
    assert!(
        round4.contains("not deployed to tally: no test case ran") && round4.contains("build/tally.wasm as built now"),
        "{text}"
    );
    assert!(!round4.contains(&format!("deployed {h2} to")), "{text}");
    dev.child.kill().await.unwrap();
    host.stop().await;
}

/// `onceq dev` in watch mode with two queues, one of whose components is not
/// built yet: the round says which and keeps watching; once it is built, the
/// next round tests it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_waits_for_a_component_not_built_yet() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("schema.sql"), TALLY_SQL).unwrap();
    std::fs::create_dir_all(d.join("build")).unwrap();
    std::fs::copy(guest("tally_v1"), d.join("build/tally.wasm")).unwrap();
    std::fs::write(
        d.join("onceq.toml"),
        "store = \"onceq.db\"\nschema = \"schema.sql\"\n\n\
         [[queue]]\nname = \"tally\"\nhandler = \"build/tally.wasm\"\ntables = [\"tally\"]\n\n\
         [[queue]]\nname = \"later\"\nhandler = \"build/later.wasm\"\ntables = [\"tally\"]\n",
    )
    .unwrap();
    std::fs::write(d.join("tally.test.toml"), format!("queue = \"tally\"\n{}", tally_case("tally-v1"))).unwrap();
    std::fs::write(d.join("later.test.toml"), format!("queue = \"later\"\n{}", tally_case("tally-v2"))).unwrap();
    let host = Host::new(dir);

    let mut dev = Dev::start(
        &host,
        &[
            "--no-deploy",
            "--build",
            "test ! -f src/later.wasm || cp src/later.wasm build/later.wasm",
            "--poll",
            "100ms",
        ],
    );
    let text = dev.rounds(1, "dev's first round").await;
    assert!(
        text.contains("the component build/later.wasm is not built yet") && text.contains("FAILED: watching"),
        "{text}"
    );
    assert!(dev.child.try_wait().unwrap().is_none(), "dev keeps watching: {text}");

    // Its source written, the build makes it: the next round runs both
    // queues' cases.
    std::fs::create_dir_all(host.dir.path().join("src")).unwrap();
    std::fs::copy(guest("tally_v2"), host.dir.path().join("src/later.wasm")).unwrap();
    let text = dev.rounds(2, "dev's second round").await;
    let round2 = text.rsplit("changed:").next().unwrap_or_default();
    assert!(round2.contains("src/later.wasm"), "{text}");
    assert!(round2.contains("2 cases passed") && round2.contains("ok: watching"), "{text}");
    dev.child.kill().await.unwrap();
}
