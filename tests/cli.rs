//! The `onceq` binary, as a user runs it: init, send, run, stats, dlq,
//! check, try; a host killed with SIGKILL mid-run and restarted; graceful
//! shutdown on SIGTERM.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const ACCOUNTS: usize = 20;
const BALANCE: i64 = 1_000_000;

struct Project {
    dir: tempfile::TempDir,
}

impl Project {
    fn new(extra_queue_settings: &str) -> Project {
        let dir = tempfile::tempdir().unwrap();
        let mut schema = PAYMENTS_SQL.to_string();
        for i in 0..ACCOUNTS {
            schema.push_str(&format!("INSERT INTO accounts (id, balance) VALUES ('acct-{i}', {BALANCE});\n"));
        }
        std::fs::write(dir.path().join("schema.sql"), schema).unwrap();
        std::fs::write(
            dir.path().join("onceq.toml"),
            format!(
                r#"store = "sqlite://db/onceq.db"
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
{extra_queue_settings}

[[connector]]
name = "charge"
kind = "file"
path = "charges.jsonl"

[outbox]
backoff_initial = "10ms"

[admin]
listen = "127.0.0.1:0"
"#,
                guest("payments").display()
            ),
        )
        .unwrap();
        Project { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_onceq"));
        c.current_dir(self.path()).args(args).env("RUST_LOG", "warn");
        c
    }

    fn run(&self, args: &[&str]) -> Output {
        self.cmd(args).stdin(Stdio::null()).output().unwrap()
    }

    fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "onceq {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn fails(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(!out.status.success(), "onceq {args:?} should have failed");
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
    }

    fn db(&self) -> rusqlite::Connection {
        rusqlite::Connection::open(self.path().join("db/onceq.db")).unwrap()
    }

    fn count(&self, sql: &str) -> i64 {
        self.db().query_row(sql, [], |r| r.get(0)).unwrap()
    }

    fn orders_file(&self, n: usize) -> PathBuf {
        let p = self.path().join("orders.jsonl");
        let lines: Vec<String> = (0..n).map(|i| order(i, i % ACCOUNTS, 1 + (i as i64 % 90))).collect();
        std::fs::write(&p, lines.join("\n")).unwrap();
        p
    }

    fn assert_exactly_once(&self, n: usize) {
        assert_eq!(self.count("SELECT COUNT(*) FROM onceq_messages"), 0, "queue drained");
        assert_eq!(self.count("SELECT COUNT(*) FROM onceq_dead_letters"), 0);
        assert_eq!(self.count("SELECT COUNT(*) FROM orders"), n as i64, "every order exactly once");
        let charged = self.count("SELECT COALESCE(SUM(amount), 0) FROM orders WHERE status = 'charged'");
        assert_eq!(
            self.count("SELECT SUM(balance) FROM accounts") + charged,
            ACCOUNTS as i64 * BALANCE,
            "money conserved"
        );
        // Intents are delivered at least once (a kill can repeat one), each
        // key once per charged order.
        let lines = file_lines(&self.path().join("charges.jsonl"));
        let keys: std::collections::BTreeSet<&str> = lines.iter().map(|l| l["idempotency_key"].as_str().unwrap()).collect();
        assert_eq!(
            keys.len() as i64,
            self.count("SELECT COUNT(*) FROM orders WHERE status = 'charged'"),
            "one charge delivered per charged order"
        );
        assert_eq!(
            self.count("SELECT COUNT(*) FROM onceq_dedup WHERE queue = 'onceq.outbox.charge'"),
            keys.len() as i64,
            "delivered keys are kept for the retention window"
        );
    }
}

fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn sigkill_mid_run_then_restart_loses_nothing_and_doubles_nothing() {
    let p = Project::new("workers = 4\nbatch = 32");
    p.ok(&["init"]);
    let n = 6000;
    let file = p.orders_file(n);
    let out = p.ok(&["send", "payments", "--jsonl", file.to_str().unwrap()]);
    assert!(out.contains(&format!("sent {n} message(s)")), "{out}");

    let mut child = p.cmd(&["run"]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    wait_for("the first orders to be processed", Duration::from_secs(60), || {
        p.count("SELECT COUNT(*) FROM orders") >= 100
    });
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let done = p.count("SELECT COUNT(*) FROM orders");
    assert!(done < n as i64, "the kill must land mid-run (processed {done} of {n})");
    assert_eq!(
        p.count("SELECT COUNT(*) FROM onceq_messages WHERE queue = 'payments'") + done,
        n as i64,
        "ack and writes are atomic at the kill"
    );

    // Restart: leases held by the dead process expire (1 s) and the new
    // process finishes the work.
    let out = p.ok(&["run", "--until-empty"]);
    assert!(out.contains("payments: processed"), "{out}");
    p.assert_exactly_once(n);
}

/// `onceq stats --json | head -c 10`: a reader that goes away ends onceq
/// quietly (141, as SIGPIPE ends other tools), not with a panic (101).
#[test]
fn a_closed_stdout_ends_onceq_quietly() {
    let p = Project::new("");
    p.ok(&["init"]);
    for args in [&["stats", "--json"][..], &["peek", "payments"][..], &["stats"][..]] {
        let mut child = p.cmd(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        // The reader goes away before onceq prints (it opens the store first).
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(
            matches!(out.status.code(), Some(141) | Some(0)),
            "{args:?}: {:?} {stderr}",
            out.status
        );
    }
}

#[test]
fn sigterm_finishes_in_flight_work_and_exits_zero() {
    let p = Project::new("workers = 2\nbatch = 64");
    p.ok(&["init"]);
    let n = 6000;
    let file = p.orders_file(n);
    p.ok(&["send", "payments", "--jsonl", file.to_str().unwrap()]);
    let mut child = p.cmd(&["run"]).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap();
    wait_for("the first orders", Duration::from_secs(60), || {
        p.count("SELECT COUNT(*) FROM orders") >= 100
    });
    let status = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(status.success());
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "did not exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(status.success(), "exit 0 after SIGTERM, got {status}");
    let stats: serde_json::Value = serde_json::from_str(&p.ok(&["stats", "--json"])).unwrap();
    let q = &stats["queues"][0];
    assert_eq!(q["leased"], 0, "nothing left leased: unstarted messages were released ({stats})");
    let left = q["ready"].as_u64().unwrap();
    assert!(left > 0, "shutdown happened mid-run");
    assert_eq!(p.count("SELECT COUNT(*) FROM orders") + left as i64, n as i64);
    assert_eq!(
        p.count("SELECT MAX(attempt) FROM onceq_messages WHERE queue = 'payments'"),
        0,
        "released messages do not count an attempt"
    );
    p.ok(&["run", "--until-empty"]);
    p.assert_exactly_once(n);
}

#[test]
fn commands_work_end_to_end() {
    let p = Project::new("");
    // before init
    let e = p.fails(&["stats"]);
    assert!(e.contains("does not exist: run `onceq init` first"), "{e}");
    let out = p.ok(&["init"]);
    assert!(out.contains("business tables: accounts, orders"), "{out}");

    // send: one with a dedup key twice, a bad payload, a bad JSON-lines file
    p.ok(&["send", "payments", "--payload", &order(1, 1, 10), "--dedup-key", "k1"]);
    let out = p.ok(&["send", "payments", "--payload", &order(1, 1, 10), "--dedup-key", "k1"]);
    assert!(
        out.contains("sent 0 message(s)") && out.contains("1 dropped as duplicates"),
        "{out}"
    );
    let e = p.fails(&["send", "payments", "--payload", "{nope"]);
    assert!(e.contains("--payload is not valid JSON"), "{e}");
    let bad = p.path().join("bad.jsonl");
    std::fs::write(&bad, format!("{}\n{}\n{{oops\n", order(2, 2, 5), order(3, 3, 5))).unwrap();
    let e = p.fails(&["send", "payments", "--jsonl", bad.to_str().unwrap()]);
    assert!(e.contains("line 3: not valid JSON"), "{e}");
    assert_eq!(
        p.count("SELECT COUNT(*) FROM onceq_messages"),
        1,
        "nothing from the bad file was sent"
    );
    p.ok(&[
        "send",
        "payments",
        "--payload",
        r#"{"order_id": "o-x", "account": "acct-nobody", "amount": 5}"#,
    ]);
    p.ok(&["send", "payments", "--payload", &order(9, 2, 7), "--delay", "1h"]);

    let stats: serde_json::Value = serde_json::from_str(&p.ok(&["stats", "--json"])).unwrap();
    assert_eq!(stats["queues"][0]["ready"], 2);
    assert_eq!(stats["queues"][0]["delayed"], 1);

    // peek: the queue's messages, what they carry and when they are due
    let out = p.ok(&["peek", "payments"]);
    assert_eq!(out.matches("  ready  failures=0 deliveries=0").count(), 2, "{out}");
    assert_eq!(out.matches("  delayed until ").count(), 1, "{out}");
    assert!(
        out.contains(r#"payload: {"order_id": "o-x", "account": "acct-nobody", "amount": 5}"#),
        "{out}"
    );
    let out = p.ok(&["peek", "paymnets"]);
    assert!(
        out.contains("no messages on paymnets (no [[queue]] named paymnets (did you mean payments?)"),
        "{out}"
    );

    // try: effects printed, nothing committed
    let msg = p.path().join("msg.json");
    std::fs::write(&msg, order(42, 3, 25)).unwrap();
    let out = p.ok(&[
        "try",
        guest("payments").to_str().unwrap(),
        "--message",
        msg.to_str().unwrap(),
        "--queue",
        "payments",
    ]);
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["outcome"], "ok");
    assert!(out.contains("charge-o-42"), "{out}");
    assert_eq!(report["reads"], 1);
    assert_eq!(p.count("SELECT COUNT(*) FROM orders"), 0, "try commits nothing");
    // The message from stdin; without --queue, the config's only queue's
    // grants (its connector among them).
    let out = p
        .cmd(&["try", guest("payments").to_str().unwrap(), "--message", "-"])
        .stdin(std::fs::File::open(&msg).unwrap())
        .output()
        .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["outcome"], "ok", "{report}");
    assert_eq!(report["message"]["queue"], "payments");

    // run until empty: the message delayed by an hour is not waited for
    let out = p.ok(&["run", "--until-empty"]);
    assert!(out.contains("payments: processed 1,") && out.contains("dead-lettered 1"), "{out}");
    assert_eq!(p.count("SELECT COUNT(*) FROM orders"), 1);
    // stats after the run: what was processed, not only what is left
    let stats: serde_json::Value = serde_json::from_str(&p.ok(&["stats", "--json"])).unwrap();
    let q = &stats["queues"][0];
    assert_eq!(
        (&q["queue"], &q["processed"], &q["dead"], &q["delayed"]),
        (&"payments".into(), &1.into(), &1.into(), &1.into()),
        "{stats}"
    );
    let out = p.ok(&["stats"]);
    assert!(out.contains("PROCESSED") && out.contains("LAST PROCESSED"), "{out}");

    // dlq: the unknown account was rejected
    let out = p.ok(&["dlq", "list"]);
    assert!(out.contains("unknown account acct-nobody"), "{out}");
    let id = out.split_whitespace().next().unwrap().to_string();
    let shown: serde_json::Value = serde_json::from_str(&p.ok(&["dlq", "show", &id])).unwrap();
    assert_eq!((&shown["failures"], &shown["deliveries"]), (&1.into(), &1.into()), "{shown}");
    assert!(shown["failed"].as_str().unwrap().ends_with('Z'), "a time for people: {shown}");
    assert!(shown["payload_text"].as_str().unwrap().contains("acct-nobody"));
    let out = p.ok(&["dlq", "replay", &id]);
    assert!(out.contains(&format!("replayed {id}")), "{out}");
    assert_eq!(p.count("SELECT COUNT(*) FROM onceq_dead_letters"), 0);
    let e = p.fails(&["dlq", "show", "no-such-id"]);
    assert!(e.contains("no dead letter with id no-such-id"), "{e}");

    // check: a good component, a forbidden one
    let out = p.ok(&["check", guest("payments").to_str().unwrap()]);
    assert!(
        out.contains("onceq:handler/handler@0.1.0") && out.contains("ok: fits the onceq:handler world"),
        "{out}"
    );
    let out = p.fails(&["check", guest("forbidden").to_str().unwrap()]);
    assert!(out.contains("✗ wasi:filesystem/") && out.contains("refused"), "{out}");
}

#[test]
fn a_paused_queue_is_left_alone_until_resumed() {
    let p = Project::new("");
    p.ok(&["init"]);
    let orders = p.orders_file(5);
    p.ok(&["send", "payments", "--jsonl", orders.to_str().unwrap()]);
    let out = p.ok(&["pause", "payments"]);
    assert!(out.contains("paused payments: hosts lease nothing from it"), "{out}");
    let out = p.ok(&["pause", "payments"]);
    assert!(out.contains("payments was paused already"), "{out}");
    // `--until-empty` does not wait for a paused queue: it says what is left.
    let out = p.run(&["run", "--until-empty"]);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    assert!(text.contains("paused: its 5 ready and 0 delayed messages are left"), "{text}");
    assert_eq!(p.count("SELECT COUNT(*) FROM orders"), 0, "nothing of a paused queue is processed");
    assert_eq!(p.count("SELECT COUNT(*) FROM onceq_messages WHERE attempt > 0"), 0, "nor leased");
    let audit = p.ok(&["audit", "--queue", "payments"]);
    assert!(audit.contains("pause") && audit.contains("local:"), "{audit}");
    let out = p.ok(&["resume", "payments"]);
    assert!(out.contains("resumed payments"), "{out}");
    p.ok(&["run", "--until-empty"]);
    p.assert_exactly_once(5);
}

#[test]
fn a_sent_message_s_trace_follows_it_to_its_intent() {
    let p = Project::new("");
    p.ok(&["init"]);
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    // Inside a trace (TRACEPARENT, as CI jobs and scripts carry it).
    let out = p
        .cmd(&["send", "payments", "--payload", &order(1, 1, 10)])
        .env("TRACEPARENT", parent)
        .env("TRACESTATE", "ci=1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Outside one: each message starts its own.
    p.ok(&["send", "payments", "--payload", &order(2, 2, 10)]);
    p.ok(&["send", "payments", "--payload", &order(3, 3, 10)]);
    // A malformed one is refused, naming it, and nothing is sent.
    let out = p
        .cmd(&["send", "payments", "--payload", &order(4, 4, 10)])
        .env("TRACEPARENT", "00-nonsense")
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && e.contains("TRACEPARENT=00-nonsense: not a W3C traceparent"),
        "{e}"
    );
    assert_eq!(p.count("SELECT COUNT(*) FROM onceq_messages"), 3);
    p.ok(&["run", "--until-empty"]);
    let lines = file_lines(&p.path().join("charges.jsonl"));
    let context = |order: &str| {
        let line = lines
            .iter()
            .find(|l| l["idempotency_key"] == format!("charge-{order}"))
            .unwrap_or_else(|| panic!("no charge for {order}: {lines:?}"));
        onceq::trace::TraceParent::parse(line["traceparent"].as_str().unwrap()).unwrap()
    };
    let (one, two, three) = (context("o-1"), context("o-2"), context("o-3"));
    let parent = onceq::trace::TraceParent::parse(parent).unwrap();
    assert_eq!(one.trace_id, parent.trace_id, "the intent is in the sender's trace");
    assert_ne!(one.span_id, parent.span_id);
    assert_ne!(two.trace_id, three.trace_id, "a trace per message sent outside one");
    assert_ne!(two.trace_id, parent.trace_id);
}

#[test]
fn bad_config_is_a_clear_error() {
    let p = Project::new("");
    let cfg = p.path().join("onceq.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, text.replace("lease = \"1s\"", "lease = \"1s\"\nleese = \"2s\"")).unwrap();
    let e = p.fails(&["init"]);
    assert!(e.contains("unknown field `leese`"), "{e}");
    std::fs::write(&cfg, text.replace("lease = \"1s\"", "lease = \"soon\"")).unwrap();
    let e = p.fails(&["init"]);
    assert!(e.contains("lease: \"soon\" is not a duration"), "{e}");
    std::fs::write(
        &cfg,
        text.replace("tables = [\"accounts\", \"orders\"]", "tables = [\"accounts\", \"ordrs\"]"),
    )
    .unwrap();
    p.ok(&["init"]);
    let e = p.fails(&["run", "--until-empty"]);
    assert!(
        e.contains("queue payments is granted table ordrs, which is not in the database"),
        "{e}"
    );
}

#[test]
fn init_is_atomic_and_names_schema_drift() {
    let dir = tempfile::tempdir().unwrap();
    let write = |schema: &str| std::fs::write(dir.path().join("schema.sql"), schema).unwrap();
    std::fs::write(
        dir.path().join("onceq.toml"),
        "store = \"sqlite://data/onceq.db\"\nschema = \"schema.sql\"\n",
    )
    .unwrap();
    let users = "CREATE TABLE IF NOT EXISTS users (id TEXT PRIMARY KEY, name TEXT NOT NULL);\n";
    write(users);
    let (ok, out) = onceq_in(dir.path(), &["init"]);
    assert!(ok && out.contains("business tables: users"), "{out}");
    let tables = || -> Vec<String> {
        let db = rusqlite::Connection::open(dir.path().join("data/onceq.db")).unwrap();
        let mut q = db
            .prepare("SELECT name FROM sqlite_schema WHERE type = 'table' AND name NOT LIKE 'onceq%' ORDER BY name")
            .unwrap();
        q.query_map([], |r| r.get(0)).unwrap().map(Result::unwrap).collect()
    };

    // A file whose second table has a type onceq cannot map: refused, and
    // its first new table is not left behind either.
    write(&format!(
        "{users}CREATE TABLE IF NOT EXISTS events (id TEXT PRIMARY KEY, at TIMESTAMP);\n\
         CREATE TABLE IF NOT EXISTS money (id TEXT PRIMARY KEY, amount DECIMAL(10,2));\n"
    ));
    let (ok, out) = onceq_in(dir.path(), &["init"]);
    assert!(!ok && out.contains("column amount has type \"DECIMAL(10,2)\""), "{out}");
    assert!(out.contains("nothing was changed"), "{out}");
    assert_eq!(tables(), ["users"], "a failed init changes nothing");

    // A column added to an existing table: init says it cannot add it, and how.
    write("CREATE TABLE IF NOT EXISTS users (id TEXT PRIMARY KEY, name TEXT NOT NULL, email TEXT);\n");
    let (ok, out) = onceq_in(dir.path(), &["init"]);
    assert!(
        !ok && out.contains("table users: column email TEXT is in the schema files but not in the database")
            && out.contains("add it with ALTER TABLE users ADD COLUMN email TEXT"),
        "{out}"
    );

    // A NOT NULL column: the fix init gives works as given (it needs a
    // DEFAULT for the rows already there).
    {
        let db = rusqlite::Connection::open(dir.path().join("data/onceq.db")).unwrap();
        db.execute("INSERT INTO users (id, name) VALUES ('u1', 'Ann')", []).unwrap();
    }
    write("CREATE TABLE IF NOT EXISTS users (id TEXT PRIMARY KEY, name TEXT NOT NULL, tier TEXT NOT NULL);\n");
    let (ok, out) = onceq_in(dir.path(), &["init"]);
    assert!(!ok && out.contains("column tier TEXT NOT NULL is in the schema files"), "{out}");
    let fix = out
        .split("add it with ")
        .nth(1)
        .and_then(|rest| rest.split(" (choose").next())
        .unwrap_or_else(|| panic!("init gives the statement: {out}"));
    assert_eq!(fix, "ALTER TABLE users ADD COLUMN tier TEXT NOT NULL DEFAULT ''");
    rusqlite::Connection::open(dir.path().join("data/onceq.db"))
        .unwrap()
        .execute_batch(fix)
        .unwrap_or_else(|e| panic!("the fix as given: {fix}: {e}"));
    let (ok, out) = onceq_in(dir.path(), &["init"]);
    assert!(ok, "after the fix init passes: {out}");

    // A table only the database has: noted, not refused.
    write("CREATE TABLE IF NOT EXISTS other (id TEXT PRIMARY KEY);\n");
    let (ok, out) = onceq_in(dir.path(), &["init"]);
    assert!(
        ok && out.contains("note: table users is in the database but in no schema file"),
        "{out}"
    );
    assert_eq!(tables(), ["other", "users"]);
}

fn onceq_in(cwd: &Path, args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_onceq"))
        .current_dir(cwd)
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    (
        out.status.success(),
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
    )
}

/// What a new project's author does after building it: check, init, try,
/// send three events, run until empty; the counter must read 6.
fn scaffolded_project_counts(project: &Path, component: &str, queue: &str) {
    let (ok, out) = onceq_in(project, &["check", component]);
    assert!(ok && out.contains("ok: fits the onceq:handler world"), "{out}");
    let cfg = project.join("onceq.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, format!("{text}\n[admin]\nlisten = \"127.0.0.1:0\"\n")).unwrap();
    let (ok, out) = onceq_in(project, &["init"]);
    assert!(ok, "{out}");
    let (ok, out) = onceq_in(project, &["try", component, "--message", "message.json", "--queue", queue]);
    assert!(ok && out.contains("\"outcome\": \"ok\"") && out.contains("counters"), "{out}");
    for _ in 0..3 {
        let (ok, out) = onceq_in(project, &["send", queue, "--payload", r#"{"key": "signup", "by": 2}"#]);
        assert!(ok, "{out}");
    }
    let (ok, out) = onceq_in(project, &["send", queue, "--payload", r#"{"key": "signup", "by": -1}"#]);
    assert!(ok, "{out}");
    let (ok, out) = onceq_in(project, &["run", "--until-empty"]);
    assert!(
        ok && out.contains(&format!("{queue}: processed 3")) && out.contains("dead-lettered 1"),
        "{out}"
    );
    let db = rusqlite::Connection::open(project.join("data/onceq.db")).unwrap();
    let count: i64 = db
        .query_row("SELECT count FROM counters WHERE key = 'signup'", [], |r| r.get(0))
        .unwrap();
    assert_eq!(count, 6, "three events of 2; the negative one dead-lettered");
}

fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{cmd:?} failed: {text}");
    text
}

/// Scaffold `name` in a temp folder, then move the project elsewhere, as a
/// team shares or clones it: it must build where it lands.
fn scaffold_and_move(args: &[&str], name: &str) -> (tempfile::TempDir, PathBuf, String) {
    let dir = tempfile::tempdir().unwrap();
    let (ok, out) = onceq_in(dir.path(), args);
    assert!(ok && out.contains("created"), "{out}");
    std::fs::create_dir(dir.path().join("moved")).unwrap();
    let project = dir.path().join("moved").join(name);
    std::fs::rename(dir.path().join(name), &project).unwrap();
    (dir, project, out)
}

/// The language's own test command ran the project's test cases with
/// `onceq test` (its output is `out`); then a wrong expectation makes
/// `onceq test` fail with a report that shows the difference.
fn scaffolded_tests_pass_then_fail_readably(project: &Path, out: &str, test_file: &str) {
    assert!(out.contains("4 cases passed"), "{out}");
    let (ok, out) = onceq_in(project, &["test"]);
    assert!(ok && out.contains("ok    adds to an existing count"), "{out}");
    let path = project.join(test_file);
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replace("count = 42", "count = 43")).unwrap();
    let (ok, out) = onceq_in(project, &["test"]);
    assert!(!ok, "a failing case fails the run: {out}");
    for part in [
        "FAIL  adds to an existing count",
        r#"expected a write to counters with key = "signup", count = 43"#,
        "the handler's effects:",
        r#"upsert counters {key: "signup", count: 42, updated_at: 2026-01-01T00:00:00"#,
        "4 cases: 3 passed, 1 failed",
    ] {
        assert!(out.contains(part), "missing {part:?} in:\n{out}");
    }
    std::fs::write(&path, text).unwrap();
}

/// A schema change, as an author makes one: a `notes` table added.
fn add_notes_table(project: &Path) {
    let schema = project.join("schema.sql");
    let ddl = std::fs::read_to_string(&schema).unwrap();
    std::fs::write(
        &schema,
        format!("{ddl}CREATE TABLE IF NOT EXISTS notes (id TEXT PRIMARY KEY, body TEXT NOT NULL);\n"),
    )
    .unwrap();
}

/// The `onceq` binary, for projects' test commands (`$ONCEQ`).
fn onceq_bin() -> &'static str {
    env!("CARGO_BIN_EXE_onceq")
}

#[test]
fn run_warns_of_enqueue_targets_no_queue_serves() {
    let p = Project::new(r#"enqueue = ["paymnts"]"#);
    p.ok(&["init"]);
    let out = p.run(&["run", "--until-empty"]);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("queue payments may enqueue on paymnts (did you mean payments?), which no [[queue]] of this config serves"),
        "{text}"
    );
}

#[test]
fn onceq_new_scaffolds_a_rust_handler_that_builds_tests_checks_and_counts() {
    let dir = tempfile::tempdir().unwrap();
    let (ok, out) = onceq_in(dir.path(), &["new", "hello-counter"]);
    assert!(
        ok && out.contains("created") && out.contains("cargo handler") && out.contains("cargo test"),
        "{out}"
    );
    let (ok, out) = onceq_in(dir.path(), &["new", "hello-counter"]);
    assert!(!ok && out.contains("already exists"), "{out}");
    let (ok, out) = onceq_in(dir.path(), &["new", "other", "--lang", "cobol"]);
    assert!(
        !ok && out.contains("--lang cobol: onceq scaffolds rust, js, python handlers"),
        "{out}"
    );
    let (ok, out) = onceq_in(dir.path(), &["new", "Bad Name"]);
    assert!(!ok && out.contains("lowercase letters"), "{out}");

    // Moved elsewhere, it builds on its own copy of the SDK; `cargo test`
    // (on this machine, not wasm) builds the component and runs the test
    // cases through `onceq test`. The examples' lock file pins the same
    // dependency versions (no new download).
    let (_dir, project, _) = scaffold_and_move(&["new", "hello-counter"], "hello-counter");
    let toml = std::fs::read_to_string(project.join("Cargo.toml")).unwrap();
    assert!(toml.contains(r#"onceq-guest = { path = "onceq-guest" }"#), "{toml}");
    // It ships the lock file the examples are built with: the same pinned
    // versions, no resolution on the first build.
    assert_eq!(
        std::fs::read_to_string(project.join("Cargo.lock")).unwrap(),
        std::fs::read_to_string(repo_root().join("guest-examples/Cargo.lock")).unwrap()
    );
    // `make guests` compiled these dependencies for wasm with the same
    // profile, flags and pins: a copy of that target folder spares this
    // test a second compile of them (cargo reuses what matches and builds
    // the rest, so the project still builds on its own).
    let examples = repo_root().join("guest-examples/target");
    std::fs::create_dir_all(project.join("target")).unwrap();
    for sub in ["release", "wasm32-wasip2"] {
        if examples.join(sub).is_dir() {
            run_ok(Command::new("cp").arg("-a").arg(examples.join(sub)).arg(project.join("target")));
        }
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = run_ok(
        Command::new(cargo)
            .current_dir(&project)
            .arg("test")
            .env("ONCEQ", onceq_bin())
            .env_remove("CARGO_TARGET_DIR")
            .env_remove("RUSTFLAGS"),
    );
    scaffolded_tests_pass_then_fail_readably(&project, &out, "hello_counter.test.toml");
    scaffolded_project_counts(&project, "target/wasm32-wasip2/release/hello_counter.wasm", "hello-counter");
    rust_typed_tables_compile_and_catch_mistakes(&project);
}

/// The handler uses `src/schema.rs` (`onceq types --lang rust`): a wrong
/// column or value type does not compile, naming it; a schema of every
/// column type, keywords and hostile names gives a module that compiles;
/// a stale module is named by `onceq test`.
fn rust_typed_tables_compile_and_catch_mistakes(project: &Path) {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let build = || {
        Command::new(&cargo)
            .current_dir(project)
            .args(["build", "--release", "--target", "wasm32-wasip2"])
            .env_remove("CARGO_TARGET_DIR")
            .env_remove("RUSTFLAGS")
            .output()
            .unwrap()
    };
    let lib = project.join("src/lib.rs");
    let good = std::fs::read_to_string(&lib).unwrap();
    for (from, to, says) in [
        ("Some(row) => row.count", "Some(row) => row.cont", "no field `cont`"),
        ("updated_at: Some(msg.now)", "updated_at: Some(\"now\")", "mismatched types"),
        ("counters::get(ctx", "countres::get(ctx", "countres"),
    ] {
        assert!(good.contains(from), "{good}");
        std::fs::write(&lib, good.replace(from, to)).unwrap();
        let out = build();
        let text = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && text.contains(says), "{to}: {text}");
    }
    std::fs::write(&lib, &good).unwrap();

    let schema = project.join("schema.sql");
    let mut ddl = std::fs::read_to_string(&schema).unwrap();
    ddl.push_str(
        r#"CREATE TABLE "every type" (
    "type" TEXT NOT NULL,
    "2nd" INTEGER NOT NULL,
    flag BOOL,
    ratio REAL NOT NULL DEFAULT 1.5,
    blob BLOB,
    doc JSON,
    at TIMESTAMP NOT NULL,
    "self" TEXT,
    "a""b */ } fn x() {}" TEXT,
    PRIMARY KEY ("type", "2nd", at)
);
"#,
    );
    std::fs::write(&schema, ddl).unwrap();
    let (ok, out) = onceq_in(project, &["test"]);
    assert!(
        ok && out.contains("src/schema.rs is out of date") && out.contains("onceq types --lang rust"),
        "{out}"
    );
    let (ok, out) = onceq_in(project, &["types", "--lang", "rust", "--out", "src/schema.rs"]);
    assert!(ok, "{out}");
    let out = build();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (ok, out) = onceq_in(project, &["test"]);
    assert!(ok && !out.contains("out of date"), "{out}");

    // A panic is a crash, named once with its location (not again as the
    // guest's stderr logged beside it), with the default log level.
    std::fs::write(
        &lib,
        good.replace(
            "if event.by <= 0 {",
            "if event.key == \"boom\" {\n            panic!(\"boom for {}\", event.key);\n        }\n        if event.by <= 0 {",
        ),
    )
    .unwrap();
    let out = build();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::write(
        project.join("boom.test.toml"),
        "queue = \"hello-counter\"\n[[case]]\nname = \"boom\"\nmessage = { key = \"boom\" }\nexpect = \"failed\"\nreason = \"handler crashed\"\n",
    )
    .unwrap();
    let out = Command::new(onceq_bin())
        .current_dir(project)
        .args(["test", "boom.test.toml", "--json"])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    assert_eq!(text.matches("boom for boom").count(), 1, "{text}");
    assert!(text.contains("boom for boom, at src/lib.rs:"), "{text}");
    std::fs::write(&lib, &good).unwrap();
    std::fs::remove_file(project.join("boom.test.toml")).unwrap();
}

#[test]
fn onceq_new_scaffolds_a_javascript_handler_that_builds_tests_checks_and_counts() {
    let (_dir, project, out) = scaffold_and_move(&["new", "hello-js", "--lang", "js"], "hello-js");
    assert!(
        out.contains("npm install") && out.contains("npm run build") && out.contains("npm test"),
        "{out}"
    );
    // `npm install` would fetch the pinned builder its package.json names;
    // the examples' copy (same pins) stands in for it, then the project's
    // own build script runs.
    let tools = repo_root().join("guest-examples/js");
    let pinned = |p: &Path| -> serde_json::Value {
        serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(p.join("package.json")).unwrap()).unwrap()["devDependencies"]
            .clone()
    };
    assert_eq!(pinned(&project), pinned(&tools), "the scaffold pins the builder the examples use");
    std::os::unix::fs::symlink(tools.join("node_modules"), project.join("node_modules")).unwrap();
    run_ok(Command::new("npm").current_dir(&project).args(["run", "check"]));
    // The types generated from schema.sql: a wrong table, column or value
    // type fails the author's own type check, naming it.
    let app = project.join("src/app.js");
    let good = std::fs::read_to_string(&app).unwrap();
    for (from, to, says) in [
        ("ctx.get('counters'", "ctx.get('countres'", "countres"),
        ("count: count + by", "cont: count + by", "'cont' does not exist"),
        (
            "updated_at: new Timestamp(msg.now)",
            "updated_at: 'now'",
            "is not assignable to type",
        ),
    ] {
        assert!(good.contains(from), "{good}");
        std::fs::write(&app, good.replace(from, to)).unwrap();
        let out = Command::new("npm").current_dir(&project).args(["run", "check"]).output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(!out.status.success() && text.contains(says), "{to}: {text}");
    }
    std::fs::write(&app, &good).unwrap();
    // After a schema change, `npm run types` declares the new table.
    add_notes_table(&project);
    run_ok(
        Command::new("npm")
            .current_dir(&project)
            .args(["run", "types"])
            .env("ONCEQ", onceq_bin()),
    );
    let declared = std::fs::read_to_string(project.join("src/schema.d.ts")).unwrap();
    assert!(
        declared.contains("notes: {") && declared.contains("insert: { id: string; body: string };"),
        "{declared}"
    );
    run_ok(Command::new("npm").current_dir(&project).args(["run", "check"]));
    let out = run_ok(Command::new("npm").current_dir(&project).arg("test").env("ONCEQ", onceq_bin()));
    scaffolded_tests_pass_then_fail_readably(&project, &out, "hello_js.test.toml");
    scaffolded_project_counts(&project, "build/hello_js.wasm", "hello-js");
    // `npm run build` is keyed on its inputs: unchanged sources build
    // nothing (the same bytes: onceq's compile cache hits, `onceq dev` sees
    // the same version); an edited source builds again.
    let wasm = project.join("build/hello_js.wasm");
    let built = std::fs::read(&wasm).unwrap();
    let npm_build = || run_ok(Command::new("npm").current_dir(&project).args(["run", "build"]));
    let out = npm_build();
    assert!(out.contains("build/hello_js.wasm is up to date"), "{out}");
    assert_eq!(std::fs::read(&wasm).unwrap(), built);
    std::fs::write(&app, format!("{good}// edited\n")).unwrap();
    let out = npm_build();
    assert!(!out.contains("up to date"), "{out}");
    assert_ne!(std::fs::read(&wasm).unwrap(), built, "an edited source is built again");
    std::fs::write(&app, &good).unwrap();
    // A schema change the typed tables do not know yet: check and test say
    // so, with the command that fixes it.
    let schema = project.join("schema.sql");
    let ddl = std::fs::read_to_string(&schema).unwrap();
    std::fs::write(&schema, format!("{ddl}CREATE TABLE IF NOT EXISTS tags (id TEXT PRIMARY KEY);\n")).unwrap();
    for args in [&["check", "build/hello_js.wasm"][..], &["test"][..]] {
        let (_, out) = onceq_in(&project, args);
        assert!(
            out.contains("warning: src/schema.d.ts is out of date with the schema files") && out.contains("run `npm run types`"),
            "{args:?}: {out}"
        );
    }
}

#[test]
fn onceq_new_scaffolds_a_python_handler_that_builds_tests_checks_and_counts() {
    let (_dir, project, out) = scaffold_and_move(&["new", "hello-py", "--lang", "python"], "hello-py");
    assert!(out.contains("make") && out.contains("make test"), "{out}");
    let ignored = std::fs::read_to_string(project.join(".gitignore")).unwrap();
    assert!(ignored.contains("__pycache__/"), "{ignored}");
    // The project's Makefile would install componentize-py (pinned in its
    // requirements.txt) into .venv; the copy `make guests` installed (same
    // pin) stands in for it.
    let pin = std::fs::read_to_string(project.join("requirements.txt")).unwrap();
    let makefile = std::fs::read_to_string(repo_root().join("Makefile")).unwrap();
    let version = pin.lines().find_map(|l| l.strip_prefix("componentize-py==")).unwrap();
    assert!(
        makefile.contains(&format!("COMPONENTIZE_PY_VERSION := {version}")),
        "same pin as the examples"
    );
    let componentize = repo_root().join("tools/python/bin/componentize-py");
    let out = run_ok(
        Command::new("make")
            .current_dir(&project)
            .arg("test")
            .arg(format!("COMPONENTIZE_PY={}", componentize.display()))
            .arg(format!("ONCEQ={}", onceq_bin())),
    );
    scaffolded_tests_pass_then_fail_readably(&project, &out, "hello_py.test.toml");
    // `make check`: mypy with the types generated from schema.sql; a wrong
    // table, column or value type fails, naming it.
    let mypy = repo_root().join("tools/python/bin/mypy");
    let make = |target: &str| {
        Command::new("make")
            .current_dir(&project)
            .arg(target)
            .arg(format!("COMPONENTIZE_PY={}", componentize.display()))
            .arg(format!("MYPY={}", mypy.display()))
            .arg(format!("ONCEQ={}", onceq_bin()))
            .output()
            .unwrap()
    };
    let text = |o: &std::process::Output| format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    let out = make("check");
    assert!(out.status.success() && text(&out).contains("no issues found"), "{}", text(&out));
    assert!(
        pin.contains(&format!(
            "mypy=={}",
            makefile.split("MYPY_VERSION := ").nth(1).unwrap().lines().next().unwrap()
        )),
        "{pin}"
    );
    // After a schema change, `make types` declares the new table.
    add_notes_table(&project);
    let out = make("types");
    assert!(out.status.success(), "{}", text(&out));
    let declared = std::fs::read_to_string(project.join("src/schema_types.pyi")).unwrap();
    assert!(
        declared.contains(r#"NotesInsert = TypedDict("NotesInsert", {"id": str, "body": str})"#),
        "{declared}"
    );
    let out = make("check");
    assert!(out.status.success(), "{}", text(&out));
    // With two tables, mypy still names each mistake (ctx.tables.NAME), and
    // the sandbox check names open() with its line.
    let app = project.join("src/app.py");
    let good = std::fs::read_to_string(&app).unwrap();
    for (from, to, says) in [
        (
            "ctx.tables.counters",
            "ctx.tables.countres",
            r#""Tables" has no attribute "countres""#,
        ),
        (
            "count=count + by",
            "cont=count + by",
            r#"Unexpected keyword argument "cont" for "upsert" of "CountersTable""#,
        ),
        (
            "updated_at=Timestamp(msg.now)",
            r#"updated_at="now""#,
            r#"Argument "updated_at" to "upsert" of "CountersTable" has incompatible type "str""#,
        ),
        (
            "count=count + by, ",
            "",
            r#"Missing named argument "count" for "upsert" of "CountersTable""#,
        ),
        (
            "    counters = ctx.tables.counters",
            "    open(\"notes.txt\")\n    counters = ctx.tables.counters",
            "src/app.py:23: open(): the sandbox has no files",
        ),
    ] {
        assert!(good.contains(from), "{good}");
        std::fs::write(&app, good.replace(from, to)).unwrap();
        let out = make("check");
        assert!(!out.status.success() && text(&out).contains(says), "{to}: {}", text(&out));
    }
    std::fs::write(&app, &good).unwrap();
    scaffolded_project_counts(&project, "build/hello_py.wasm", "hello-py");
}

#[test]
fn try_and_test_report_instructions_and_a_case_can_cap_them() {
    let p = Project::new("");
    p.ok(&["init"]);
    std::fs::write(p.path().join("order.json"), order(1, 1, 10)).unwrap();
    let report = |out: &str| -> serde_json::Value { serde_json::from_str(out).unwrap() };
    let a = report(&p.ok(&["try", guest("payments").to_str().unwrap(), "--message", "order.json", "--id", "m-1"]));
    let ran = a["instructions"].as_u64().expect("try reports instructions");
    assert!(ran > 1_000, "{a}");

    let case = |name: &str, max: u64| {
        format!("[[case]]\nname = \"{name}\"\nmessage = {{ order_id = \"o-1\", account = \"acct-x\", amount = 10 }}\nrows.accounts = [{{ id = \"acct-x\", balance = 100 }}]\nmax_instructions = {max}\n")
    };
    std::fs::write(
        p.path().join("budget.test.toml"),
        format!("{}{}", case("roomy", 100 * ran), case("tight", 10)),
    )
    .unwrap();
    let out = p.fails(&["test", "budget.test.toml"]);
    assert!(out.contains("ok    roomy") && out.contains(" instructions)"), "{out}");
    assert!(out.contains("FAIL  tight"), "{out}");
    assert!(out.contains("instructions, more than max_instructions = 10"), "{out}");
    assert!(out.contains("2 cases: 1 passed, 1 failed"), "{out}");
}

/// The instructions `onceq try` reports for one payments order through
/// `component` (a port of the payments example) in `p`, initialised here;
/// the order is charged (3 effects).
fn payments_order_instructions(p: &Project, component: &Path) -> u64 {
    p.ok(&["init"]);
    std::fs::write(p.path().join("order.json"), order(1, 1, 10)).unwrap();
    let report: serde_json::Value =
        serde_json::from_str(&p.ok(&["try", component.to_str().unwrap(), "--message", "order.json", "--id", "m-1"])).unwrap();
    assert_eq!(report["outcome"], "ok", "{report}");
    assert_eq!(report["effects"].as_array().map(Vec::len), Some(3), "{report}");
    report["instructions"].as_u64().expect("try reports instructions")
}

/// The JavaScript SDK warms the engine when the component is built
/// (componentize-js snapshots it after the module ran): the builtins of
/// the handler's global and of the generated bindings' own global are made
/// once there, not in every message's fresh instance. One payments message
/// then runs about 0.9 million instructions (its reads and effects cross
/// as JSON bytes); without the warm-up an empty handler alone ran 1.1
/// million (docs/src/benchmarks.md). Instruction counts do not depend on
/// the machine or its load.
#[test]
fn a_javascript_message_does_not_pay_for_the_engine_s_builtins() {
    let js = repo_root().join("guest-examples/target/js/payments.wasm");
    assert!(js.exists(), "{} is missing: run `make guests`", js.display());
    let ran = payments_order_instructions(&Project::new(""), &js);
    assert!(
        (500_000..1_100_000).contains(&ran),
        "a JavaScript payments message ran {ran} instructions: the SDK's build-time warm-up (onceq-guest.js) no longer takes effect"
    );
}

/// `runtime.perf_map = true` names a handler's compiled functions to
/// `perf` in `/tmp/perf-PID.map` (the guest's own function names, from its
/// name section), so a profile of `onceq run` or `onceq try` shows where
/// the guest spends its time instead of `[unknown]`. Off by default: no
/// file is written.
#[test]
fn perf_map_names_the_guest_s_functions_to_perf() {
    let p = Project::new("");
    p.ok(&["init"]);
    std::fs::write(p.path().join("order.json"), order(1, 1, 10)).unwrap();
    let try_once = |p: &Project| -> (u32, String) {
        let child = p
            .cmd(&["try", guest("payments").to_str().unwrap(), "--message", "order.json", "--id", "m-1"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "onceq try failed: {}", String::from_utf8_lossy(&out.stderr));
        (pid, String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let map = |pid: u32| PathBuf::from(format!("/tmp/perf-{pid}.map"));

    let (pid, _) = try_once(&p);
    assert!(!map(pid).exists(), "{} written without runtime.perf_map", map(pid).display());

    let config = std::fs::read_to_string(p.path().join("onceq.toml")).unwrap();
    std::fs::write(p.path().join("onceq.toml"), format!("{config}\n[runtime]\nperf_map = true\n")).unwrap();
    let (pid, out) = try_once(&p);
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["outcome"], "ok", "{report}");
    let written = std::fs::read_to_string(map(pid));
    let _ = std::fs::remove_file(map(pid));
    let written = written.unwrap_or_else(|e| panic!("{}: {e}", map(pid).display()));
    // perf's format: start address and size in hex, then the name.
    let lines: Vec<&str> = written.lines().collect();
    assert!(
        lines.iter().all(|l| {
            let f: Vec<&str> = l.splitn(3, ' ').collect();
            f.len() == 3 && u64::from_str_radix(f[0].trim_start_matches("0x"), 16).is_ok() && u64::from_str_radix(f[1], 16).is_ok()
        }),
        "not perf's map format: {:?}",
        &lines[..lines.len().min(3)]
    );
    // Every function the guest defines: the Rust payments guest defines
    // 283 (stripped of names, so each is `wasm[0]::function[N]`;
    // docs/src/handlers/testing.md says how to keep them).
    let guest_functions = lines.iter().filter(|l| l.contains(" wasm[0]::function[")).count();
    assert!(
        guest_functions >= 283,
        "{guest_functions} functions of the payments guest named: {:?}",
        &lines[..lines.len().min(5)]
    );
}

/// The Python SDK runs its own per-message code a few times when the
/// component is built (componentize-py snapshots the interpreter after the
/// modules ran): CPython's specialised bytecode and attribute caches are in
/// the snapshot, not rebuilt in every message's fresh instance. One
/// payments message then runs about 600,000 instructions; it ran 795,000
/// before (docs/src/benchmarks.md). Instruction counts do not depend on the
/// machine or its load.
#[test]
fn a_python_message_does_not_pay_for_the_sdk_s_first_run() {
    let py = repo_root().join("guest-examples/target/python/payments.wasm");
    assert!(py.exists(), "{} is missing: run `make guests`", py.display());
    let p = Project::new("");
    // The compiled component is kept beside the build (a Python component
    // takes a while to compile); `try` reads nothing else of the state folder.
    let cache = repo_root().join("target/onceq-test-state-python-try");
    let config = std::fs::read_to_string(p.path().join("onceq.toml")).unwrap();
    std::fs::write(
        p.path().join("onceq.toml"),
        format!("state_dir = {:?}\n{config}", cache.display().to_string()),
    )
    .unwrap();
    let ran = payments_order_instructions(&p, &py);
    assert!(
        (300_000..700_000).contains(&ran),
        "a Python payments message ran {ran} instructions: the SDK's build-time warm-up (onceq_guest.py) no longer takes effect"
    );
}
