//! `onceq test`: a handler's test cases, written in a TOML file next to it
//! in any language, run against the built component with the verdicts of a
//! real run.
//!
//! A case gives fixture rows, a message and what should come of it: the
//! outcome (`ok`, `retry`, `reject`, `failed`, `invalid-effects`), part of
//! the reason, and the writes, follow-up messages and intents expected (each
//! a partial match: the fields given must match, the others may be
//! anything; `exact = true` also refuses effects not listed). The message
//! runs through [`crate::tryout::run`], the code of `onceq try` and the
//! handler test kit: reads served from the fixture rows, effects checked
//! against the schema and the queue's grants from `onceq.toml`, nothing
//! committed, no database server.
//!
//! ```toml
//! queue = "counter"               # a [[queue]] of onceq.toml (default: the only one)
//!
//! [[case]]
//! name = "adds to an existing count"
//! rows.counters = [{ key = "signup", count = 41 }]
//! message = { key = "signup", by = 1 }
//! writes = [{ table = "counters", row = { key = "signup", count = 42 } }]
//!
//! [[case]]
//! name = "refuses a negative step"
//! message = { key = "signup", by = -1 }
//! expect = "reject"
//! reason = "by must be positive"
//! ```

use crate::config::{Config, QueueConfig};
use crate::protocol::Handler;
use crate::schema::{ColumnType, Schema, TableSchema};
use crate::store::memory::Fixture;
use crate::tryout::TryReport;
use crate::value::{Effect, FollowUp, Intent, Message, RowWrite, Value};
use anyhow::{bail, Context};
use serde::Deserialize;
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, UNIX_EPOCH};

/// Logical time of a case's message unless it sets `at`:
/// 2026-01-01T00:00:00Z, in microseconds (the test kit's too).
pub const TEST_TIME: i64 = 1_767_225_600_000_000;

/// Outcomes a case can expect: a real run's verdicts.
pub const OUTCOMES: &[&str] = &["ok", "retry", "reject", "failed", "invalid-effects"];

/// A test file: `*.test.toml`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CaseFile {
    /// The `[[queue]]` of `onceq.toml` whose handler, grants and limits
    /// apply (default: the only queue there is).
    pub queue: Option<String>,
    /// The component to run instead of the queue's `handler` (relative to
    /// the test file).
    pub component: Option<PathBuf>,
    #[serde(default, rename = "case")]
    pub cases: Vec<Case>,
}

/// One message and what should come of it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Case {
    pub name: String,
    /// The payload as JSON (any TOML value: a table, an array, a string...).
    pub message: Option<Json>,
    /// The payload as raw text, instead of `message`.
    pub payload: Option<String>,
    #[serde(default)]
    pub attributes: BTreeMap<String, String>,
    /// Message id (default `m-1`); it seeds the handler's randomness.
    pub id: Option<String>,
    /// Delivery attempt (default 1).
    pub attempt: Option<u32>,
    /// The message's time, RFC 3339 (default 2026-01-01T00:00:00Z): the
    /// handler's clock.
    pub at: Option<Json>,
    /// Fixture rows by table: what the handler's reads see.
    #[serde(default)]
    pub rows: BTreeMap<String, Vec<serde_json::Map<String, Json>>>,
    /// Expected outcome (default `ok`).
    pub expect: Option<String>,
    /// A part of the expected reason (retry, reject, failure).
    pub reason: Option<String>,
    /// For `retry`: the delay the handler asks for ("30s").
    pub retry_after: Option<String>,
    #[serde(default)]
    pub writes: Vec<WriteMatch>,
    #[serde(default)]
    pub enqueued: Vec<EnqueueMatch>,
    #[serde(default)]
    pub intents: Vec<IntentMatch>,
    /// The listed effects are all of them (default: at least these).
    #[serde(default)]
    pub exact: bool,
    /// The call may run at most this many instructions (instantiation
    /// included): a budget the handler's authors hold themselves to, below
    /// the queue's `max_instructions`.
    pub max_instructions: Option<u64>,
}

/// An expected row write: its table, its operation if given, and the
/// columns given (the others may hold anything).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WriteMatch {
    pub table: String,
    pub op: Option<String>,
    #[serde(default)]
    pub row: serde_json::Map<String, Json>,
}

/// An expected follow-up message.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnqueueMatch {
    pub queue: Option<String>,
    /// JSON: the fields given must be in the payload.
    pub payload: Option<Json>,
    #[serde(default)]
    pub attributes: BTreeMap<String, String>,
    pub delay: Option<String>,
    pub dedup_key: Option<String>,
}

/// An expected intent.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IntentMatch {
    pub connector: Option<String>,
    /// The idempotency key.
    pub key: Option<String>,
    /// JSON: the fields given must be in the payload.
    pub payload: Option<Json>,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
}

/// What one case did.
#[derive(Debug, serde::Serialize)]
pub struct CaseResult {
    pub name: String,
    pub passed: bool,
    /// What did not match, one line each.
    pub problems: Vec<String>,
    pub report: Option<TryReport>,
    pub millis: f64,
}

/// What one test file did.
#[derive(Debug, serde::Serialize)]
pub struct FileResult {
    pub file: PathBuf,
    pub queue: String,
    pub component: PathBuf,
    pub cases: Vec<CaseResult>,
}

impl FileResult {
    pub fn failed(&self) -> usize {
        self.cases.iter().filter(|c| !c.passed).count()
    }
}

/// Test files found for a project: `*.test.toml` in the folder of
/// `onceq.toml` and in its `tests/` folder, in name order.
pub fn discover(project: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for dir in [project.to_path_buf(), project.join("tests")] {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        let mut here: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.ends_with(".test.toml")))
            .collect();
        here.sort();
        // "x.test.toml", not "./x.test.toml", when the project is here.
        found.extend(here.into_iter().map(|p| p.strip_prefix(".").map(Path::to_path_buf).unwrap_or(p)));
    }
    found
}

/// Read and check a test file: every error names the file and the case.
pub fn load(path: &Path) -> anyhow::Result<CaseFile> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let file: CaseFile = toml::from_str(&text).with_context(|| format!("{}: not a test file", path.display()))?;
    if file.cases.is_empty() {
        bail!("{}: no [[case]] in it", path.display());
    }
    for c in &file.cases {
        let expect = c.expect.as_deref().unwrap_or("ok");
        if !OUTCOMES.contains(&expect) {
            bail!(
                "{}: case {:?}: expect = {expect:?}; use one of {}",
                path.display(),
                c.name,
                OUTCOMES.join(", ")
            );
        }
        if c.message.is_some() && c.payload.is_some() {
            bail!(
                "{}: case {:?}: give the payload once, as `message` (JSON) or `payload` (text)",
                path.display(),
                c.name
            );
        }
        let effects = !c.writes.is_empty() || !c.enqueued.is_empty() || !c.intents.is_empty();
        if effects && expect != "ok" {
            bail!(
                "{}: case {:?}: expects effects and outcome {expect}; only an ok message has effects",
                path.display(),
                c.name
            );
        }
    }
    Ok(file)
}

/// The schema the cases' rows and effects are checked against: the
/// config's schema files (SQLite DDL), as `onceq init` applies them.
/// Empty tables of the project's schema files, for [`run_case`].
pub fn fixture(cfg: &Config) -> anyhow::Result<Fixture> {
    Fixture::from_ddl(&cfg.schema_ddl()?).context("onceq test reads the schema files as SQLite DDL")
}

pub fn schema(cfg: &Config) -> anyhow::Result<Schema> {
    crate::store::sqlite::schema_from_ddl(&cfg.schema_ddl()?).context("onceq test reads the schema files as SQLite DDL")
}

/// The queue a file tests: its own `queue`, or the config's only queue.
pub fn queue_of<'a>(cfg: &'a Config, file: &CaseFile, path: &Path) -> anyhow::Result<&'a QueueConfig> {
    match &file.queue {
        Some(name) => cfg.queue(name).map_err(|_| {
            anyhow::anyhow!(
                "{}: queue = {name:?} is not a [[queue]] of the config{} (queues: {})",
                path.display(),
                crate::names::did_you_mean(name, cfg.queue_names()),
                cfg.queue_list()
            )
        }),
        None => match cfg.queues.as_slice() {
            [one] => Ok(one),
            [] => bail!("{}: the config has no [[queue]] to test", path.display()),
            _ => bail!(
                "{}: say which queue it tests (queue = \"...\"; queues: {})",
                path.display(),
                cfg.queue_list()
            ),
        },
    }
}

/// Run one case through `handler` with the queue's grants and limits.
///
/// `tables` is the empty fixture of the project's schema files
/// ([`fixture`]): the case's rows are added to a copy, and the effects are
/// rehearsed on a scratch database made from the same files.
pub async fn run_case(handler: &dyn Handler, tables: &Fixture, queue: &QueueConfig, case: &Case) -> CaseResult {
    let started = Instant::now();
    let schema = &*tables.schema();
    let outcome = match build(tables, queue, case) {
        Ok((fixture, message)) => {
            let report = crate::tryout::run(
                handler,
                message,
                fixture.transaction(),
                fixture.schema(),
                &queue.grants,
                &queue.effect_limits,
            )
            .await;
            let problems = check(schema, case, &report);
            (problems, Some(report))
        }
        Err(e) => (vec![format!("bad case: {e}")], None),
    };
    CaseResult {
        name: case.name.clone(),
        passed: outcome.0.is_empty(),
        problems: outcome.0,
        report: outcome.1,
        millis: started.elapsed().as_secs_f64() * 1000.0,
    }
}

/// The fixture rows and the message of a case.
fn build(tables: &Fixture, queue: &QueueConfig, case: &Case) -> Result<(Fixture, Message), String> {
    let schema = tables.schema();
    let mut fixture = tables.clone();
    for (table, rows) in &case.rows {
        let t = schema.table(table).map_err(|e| format!("rows: {e}"))?;
        for (i, row) in rows.iter().enumerate() {
            let mut columns = Vec::new();
            for (name, v) in row {
                let value = typed(t, name, v).map_err(|e| format!("rows.{table}[{i}]: {e}"))?;
                columns.push((name.as_str(), value));
            }
            fixture.insert(table, columns).map_err(|e| format!("rows.{table}[{i}]: {e}"))?;
        }
    }
    let payload = match (&case.message, &case.payload) {
        (Some(m), _) => serde_json::to_vec(&plain(m)).map_err(|e| format!("message: {e}"))?,
        (None, Some(p)) => p.clone().into_bytes(),
        (None, None) => Vec::new(),
    };
    let enqueued_at = match &case.at {
        None => TEST_TIME,
        Some(v) => timestamp(&plain(v)).map_err(|e| format!("at: {e}"))?,
    };
    let message = Message {
        id: case.id.clone().unwrap_or_else(|| "m-1".into()),
        queue: queue.name.clone(),
        payload,
        attributes: case.attributes.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        attempt: case.attempt.unwrap_or(1),
        enqueued_at,
    };
    Ok((fixture, message))
}

/// TOML dates come through serde as a one-key table: make them strings.
fn plain(v: &Json) -> Json {
    match v {
        Json::Object(m) if m.len() == 1 && m.contains_key("$__toml_private_datetime") => m.values().next().cloned().unwrap_or(Json::Null),
        Json::Object(m) => Json::Object(m.iter().map(|(k, v)| (k.clone(), plain(v))).collect()),
        Json::Array(a) => Json::Array(a.iter().map(plain).collect()),
        other => other.clone(),
    }
}

/// RFC 3339 text, or microseconds since the epoch.
fn timestamp(v: &Json) -> Result<i64, String> {
    match v {
        Json::String(s) => humantime::parse_rfc3339_weak(s)
            .map_err(|e| format!("{s:?} is not an RFC 3339 time ({e})"))?
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_micros() as i64)
            .map_err(|_| format!("{s:?} is before 1970")),
        Json::Number(n) => n.as_i64().ok_or_else(|| format!("{n} is not whole microseconds")),
        other => Err(format!("{other} is not a time: use RFC 3339 text")),
    }
}

/// A TOML value as the column's type, or why it does not fit.
fn typed(table: &TableSchema, column: &str, v: &Json) -> Result<Value, String> {
    let Some((_, col)) = table.column(column) else {
        return Err(format!(
            "table {} has no column {column}{}",
            table.name,
            crate::names::did_you_mean(column, table.columns.iter().map(|c| c.name.as_str()))
        ));
    };
    let v = plain(v);
    let bad = || format!("column {}.{column} is {}, got {v}", table.name, col.ty.name());
    Ok(match (col.ty, &v) {
        (_, Json::Null) => Value::Null,
        (ColumnType::Bool, Json::Bool(b)) => Value::Bool(*b),
        (ColumnType::Int64, Json::Number(n)) => Value::Int64(n.as_i64().ok_or_else(bad)?),
        (ColumnType::Float64, Json::Number(n)) => Value::Float64(n.as_f64().ok_or_else(bad)?),
        (ColumnType::String, Json::String(s)) => Value::String(s.clone()),
        (ColumnType::Bytes, Json::String(s)) => Value::Bytes(s.clone().into_bytes()),
        (ColumnType::Json, doc) => Value::Json(doc.to_string()),
        (ColumnType::Timestamp, t) => Value::Timestamp(timestamp(t).map_err(|e| format!("column {}.{column}: {e}", table.name))?),
        _ => return Err(bad()),
    })
}

/// Everything about `report` that does not match `case`.
fn check(schema: &Schema, case: &Case, report: &TryReport) -> Vec<String> {
    let mut problems = Vec::new();
    let expect = case.expect.as_deref().unwrap_or("ok");
    if report.outcome != expect {
        let why = report.reason.as_deref().map(|r| format!(": {r}")).unwrap_or_default();
        problems.push(format!("expected outcome {expect}, got {}{why}", report.outcome));
        return problems;
    }
    if let Some(part) = &case.reason {
        match &report.reason {
            Some(r) if r.contains(part.as_str()) => {}
            Some(r) => problems.push(format!("expected a reason containing {part:?}, got {r:?}")),
            None => problems.push(format!("expected a reason containing {part:?}, got none")),
        }
    }
    if let Some(d) = &case.retry_after {
        match humantime::parse_duration(d) {
            Err(e) => problems.push(format!("retry_after = {d:?}: {e}")),
            Ok(want) => {
                let got = report.retry_after_ms.map(Duration::from_millis);
                if got != Some(want) {
                    problems.push(format!(
                        "expected a retry after {d}, got {}",
                        got.map_or("none".into(), crate::names::duration)
                    ));
                }
            }
        }
    }
    if let (Some(max), Some(ran)) = (case.max_instructions, report.instructions) {
        if ran > max {
            problems.push(format!(
                "ran {} instructions, more than max_instructions = {}",
                crate::names::thousands(ran),
                crate::names::thousands(max)
            ));
        }
    }
    let mut used = vec![false; report.effects.len()];
    for w in &case.writes {
        let table = schema.table(&w.table);
        let found = match &table {
            Ok(t) => claim(report, &mut used, |e| matches!(e, Effect::Write(a) if write_matches(t, w, a))),
            Err(e) => {
                problems.push(format!("writes: {e}"));
                continue;
            }
        };
        if !found {
            problems.push(format!("expected {}", describe_write(w, table.ok())));
        }
    }
    for m in &case.enqueued {
        if !claim(report, &mut used, |e| matches!(e, Effect::Enqueue(f) if enqueue_matches(m, f))) {
            problems.push(format!("expected {}", describe_enqueue(m)));
        }
    }
    for m in &case.intents {
        if !claim(report, &mut used, |e| matches!(e, Effect::Intent(i) if intent_matches(m, i))) {
            problems.push(format!("expected {}", describe_intent(m)));
        }
    }
    // Effects nobody expected, with `exact` (when an expected one is
    // missing, the full list below says it all).
    if case.exact && problems.is_empty() {
        for (e, _) in report.effects.iter().zip(&used).filter(|(_, u)| !**u) {
            problems.push(format!("unexpected {}", crate::tryout::show_effect(e)));
        }
    }
    if !problems.is_empty() && !report.effects.is_empty() {
        problems.push("the handler's effects:".into());
        problems.extend(report.effects.iter().map(|e| format!("  {}", crate::tryout::show_effect(e))));
    } else if !problems.is_empty() {
        problems.push("the handler had no effects".into());
    }
    problems
}

/// Mark the first unused effect that fits `fits`.
fn claim(report: &TryReport, used: &mut [bool], fits: impl Fn(&Effect) -> bool) -> bool {
    for (i, e) in report.effects.iter().enumerate() {
        if !used[i] && fits(e) {
            used[i] = true;
            return true;
        }
    }
    false
}

fn write_matches(table: &TableSchema, want: &WriteMatch, got: &RowWrite) -> bool {
    got.table == want.table
        && want
            .op
            .as_deref()
            .is_none_or(|op| op.eq_ignore_ascii_case(crate::tryout::op_name(got)))
        && want.row.iter().all(|(name, v)| {
            let Ok(expected) = typed(table, name, v) else { return false };
            let actual = got.columns.iter().find(|(k, _)| k == name).map(|(_, v)| v);
            actual.is_some_and(|a| a.same(&expected))
        })
}

fn enqueue_matches(want: &EnqueueMatch, got: &FollowUp) -> bool {
    want.queue.as_ref().is_none_or(|q| *q == got.queue)
        && want.payload.as_ref().is_none_or(|p| payload_matches(p, &got.payload))
        && want
            .attributes
            .iter()
            .all(|(k, v)| got.attributes.iter().any(|(a, b)| a == k && b == v))
        && want.dedup_key.as_ref().is_none_or(|k| got.dedup_key.as_ref() == Some(k))
        && want
            .delay
            .as_ref()
            .is_none_or(|d| humantime::parse_duration(d).is_ok_and(|d| got.delay_ms == Some(d.as_millis() as u64)))
}

fn intent_matches(want: &IntentMatch, got: &Intent) -> bool {
    want.connector.as_ref().is_none_or(|c| *c == got.connector)
        && want.key.as_ref().is_none_or(|k| *k == got.idempotency_key)
        && want.payload.as_ref().is_none_or(|p| payload_matches(p, &got.payload))
        && want
            .metadata
            .iter()
            .all(|(k, v)| got.metadata.iter().any(|(a, b)| a == k && b == v))
}

/// A JSON payload holds what is expected (objects: the keys given, with
/// matching values; anything else: equal); a text payload equals an
/// expected string.
fn payload_matches(want: &Json, got: &[u8]) -> bool {
    let want = plain(want);
    match serde_json::from_slice::<Json>(got) {
        Ok(doc) => json_contains(&doc, &want),
        Err(_) => want.as_str().is_some_and(|s| s.as_bytes() == got),
    }
}

fn json_contains(got: &Json, want: &Json) -> bool {
    match (got, want) {
        (Json::Object(g), Json::Object(w)) => w.iter().all(|(k, v)| g.get(k).is_some_and(|gv| json_contains(gv, v))),
        (Json::Array(g), Json::Array(w)) => g.len() == w.len() && g.iter().zip(w).all(|(a, b)| json_contains(a, b)),
        (Json::Number(a), Json::Number(b)) => a.as_f64() == b.as_f64(),
        (a, b) => a == b,
    }
}

/// An expected write in words, its columns in table order.
fn describe_write(w: &WriteMatch, table: Option<&TableSchema>) -> String {
    let op = w.op.as_deref().map(|o| format!(" ({o})")).unwrap_or_default();
    if w.row.is_empty() {
        return format!("a write to {}{op}", w.table);
    }
    let mut row: Vec<(&String, &Json)> = w.row.iter().collect();
    if let Some(t) = table {
        row.sort_by_key(|(name, _)| t.column(name).map_or(usize::MAX, |(i, _)| i));
    }
    let shown: Vec<String> = row.iter().map(|(k, v)| format!("{k} = {}", plain(v))).collect();
    format!("a write to {}{op} with {}", w.table, shown.join(", "))
}

fn describe_enqueue(m: &EnqueueMatch) -> String {
    let mut s = format!("a follow-up on {}", m.queue.as_deref().unwrap_or("any queue"));
    if let Some(p) = &m.payload {
        s.push_str(&format!(" with payload {}", plain(p)));
    }
    for (k, v) in &m.attributes {
        s.push_str(&format!(", attribute {k} = {v:?}"));
    }
    if let Some(d) = &m.delay {
        s.push_str(&format!(", delay {d}"));
    }
    if let Some(k) = &m.dedup_key {
        s.push_str(&format!(", dedup key {k:?}"));
    }
    s
}

fn describe_intent(m: &IntentMatch) -> String {
    let mut s = format!("an intent for {}", m.connector.as_deref().unwrap_or("any connector"));
    if let Some(k) = &m.key {
        s.push_str(&format!(" keyed {k:?}"));
    }
    if let Some(p) = &m.payload {
        s.push_str(&format!(" with payload {}", plain(p)));
    }
    for (k, v) in &m.metadata {
        s.push_str(&format!(", metadata {k} = {v:?}"));
    }
    s
}

/// Run test files: each file's component loaded once (from the compiled
/// cache when it is there), its cases in order. `filter` keeps the cases
/// whose name contains it. `progress` hears about slow steps.
pub async fn run(cfg: &Config, files: &[PathBuf], filter: Option<&str>, progress: &dyn Fn(&str)) -> anyhow::Result<Vec<FileResult>> {
    let tables = fixture(cfg)?;
    // Instructions are always counted here: each case reports them.
    let runtime = crate::runtime::Runtime::new(crate::runtime::RuntimeConfig {
        max_instances: 2,
        count_instructions: true,
        ..cfg.runtime.clone()
    })?;
    let mut results = Vec::new();
    for path in files {
        let file = load(path)?;
        let queue = queue_of(cfg, &file, path)?;
        let component = match &file.component {
            Some(c) => path.parent().unwrap_or(Path::new(".")).join(c),
            None => queue.handler.clone(),
        };
        if !component.exists() {
            bail!(
                "{}: the component {} is not built yet: build it first (queue {}'s handler in the config)",
                path.display(),
                component.display(),
                queue.name
            );
        }
        let handler = load_component(&runtime, &component, queue, progress)?;
        let mut cases = Vec::new();
        for case in file.cases.iter().filter(|c| filter.is_none_or(|f| c.name.contains(f))) {
            cases.push(run_case(&handler, &tables, queue, case).await);
        }
        results.push(FileResult {
            file: path.clone(),
            queue: queue.name.clone(),
            component,
            cases,
        });
    }
    Ok(results)
}

fn load_component(
    runtime: &crate::runtime::Runtime,
    component: &Path,
    queue: &QueueConfig,
    progress: &dyn Fn(&str),
) -> anyhow::Result<crate::runtime::WasmHandler> {
    runtime
        .load_file_reporting(component, queue.limits, progress)
        .with_context(|| format!("loading {}", component.display()))
}

/// The report a person reads: a line per case, what did not match under a
/// failed one, and a total.
pub fn render(results: &[FileResult]) -> String {
    let mut out = String::new();
    let (mut passed, mut failed) = (0, 0);
    for f in results {
        // Case names, reasons and values come from test files and handlers:
        // printed with their control and invisible characters escaped.
        let shown = |t: &str| crate::names::printable(t);
        out.push_str(&format!(
            "{} (queue {}, {})\n",
            shown(&f.file.display().to_string()),
            shown(&f.queue),
            shown(&f.component.display().to_string())
        ));
        for c in &f.cases {
            let mark = if c.passed { "ok  " } else { "FAIL" };
            let ran = match c.report.as_ref().and_then(|r| r.instructions) {
                Some(n) => format!(", {} instructions", crate::names::thousands(n)),
                None => String::new(),
            };
            out.push_str(&format!("  {mark}  {} ({:.0} ms{ran})\n", shown(&c.name), c.millis));
            for p in &c.problems {
                for line in p.lines() {
                    out.push_str(&format!("          {}\n", shown(line)));
                }
            }
            if c.passed {
                passed += 1
            } else {
                failed += 1
            }
        }
    }
    let total = passed + failed;
    let cases = if total == 1 { "case" } else { "cases" };
    if failed == 0 {
        out.push_str(&format!("{total} {cases} passed\n"));
    } else {
        out.push_str(&format!("{total} {cases}: {passed} passed, {failed} failed\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use crate::protocol::{HandleOutput, HandlerFailure, NativeHandler};
    use crate::value::WriteOp;

    const DDL: &str = "CREATE TABLE counters (key TEXT PRIMARY KEY, count INTEGER NOT NULL, updated_at TIMESTAMP);";

    /// The scaffold's counter, natively: read the key's count, write count + by.
    fn counter() -> NativeHandler {
        NativeHandler::new("counter", |m, mut scope| async move {
            let event: Json = serde_json::from_slice(&m.payload).unwrap_or(Json::Null);
            let (Some(key), by) = (event["key"].as_str(), event["by"].as_i64().unwrap_or(1)) else {
                return HandleOutput {
                    scope,
                    result: Err(HandlerFailure::Reject("missing field `key`".into())),
                };
            };
            if by <= 0 {
                let reason = format!("by must be positive, got {by}");
                return HandleOutput {
                    scope,
                    result: Err(HandlerFailure::Reject(reason)),
                };
            }
            let row = scope.get("counters", &[Value::String(key.into())]).await.unwrap();
            let count = row
                .and_then(|r| r.into_iter().find(|(c, _)| c == "count"))
                .and_then(|(_, v)| if let Value::Int64(n) = v { Some(n) } else { None })
                .unwrap_or(0);
            let write = RowWrite {
                table: "counters".into(),
                op: WriteOp::Upsert,
                columns: vec![
                    ("key".into(), Value::String(key.into())),
                    ("count".into(), Value::Int64(count + by)),
                    ("updated_at".into(), Value::Timestamp(m.enqueued_at)),
                ],
            };
            HandleOutput {
                scope,
                result: Ok(vec![Effect::Write(write)]),
            }
        })
    }

    fn config() -> Config {
        Config::parse(
            "store = \"sqlite://x.db\"\n[[queue]]\nname = \"counter\"\nhandler = \"counter.wasm\"\ntables = [\"counters\"]\n",
            Path::new("/nowhere"),
        )
        .unwrap()
    }

    async fn run_text(text: &str) -> Vec<CaseResult> {
        let file: CaseFile = toml::from_str(text).unwrap();
        let cfg = config();
        let tables = Fixture::from_ddl(DDL).unwrap();
        let handler = counter();
        let mut out = Vec::new();
        for case in &file.cases {
            out.push(run_case(&handler, &tables, &cfg.queues[0], case).await);
        }
        out
    }

    #[tokio::test]
    async fn cases_pass_and_fail_on_what_the_handler_did() {
        let results = run_text(
            r#"
[[case]]
name = "adds"
rows.counters = [{ key = "a", count = 41 }]
message = { key = "a", by = 1 }
writes = [{ table = "counters", op = "upsert", row = { key = "a", count = 42, updated_at = 2026-01-01T00:00:00Z } }]
exact = true

[[case]]
name = "wrong count"
message = { key = "a" }
writes = [{ table = "counters", row = { count = 5 } }]

[[case]]
name = "rejects"
message = { key = "a", by = 0 }
expect = "reject"
reason = "by must be positive"

[[case]]
name = "wrong reason"
message = { by = 1 }
expect = "reject"
reason = "by must be positive"

[[case]]
name = "wrong outcome"
message = { by = 1 }
"#,
        )
        .await;
        let by_name = |n: &str| results.iter().find(|r| r.name == n).unwrap();
        assert!(by_name("adds").passed, "{:?}", by_name("adds").problems);
        assert!(by_name("rejects").passed, "{:?}", by_name("rejects").problems);

        let wrong = by_name("wrong count");
        assert!(!wrong.passed);
        assert_eq!(wrong.problems[0], "expected a write to counters with count = 5");
        assert_eq!(wrong.problems[1], "the handler's effects:");
        assert!(
            wrong.problems[2].contains(r#"upsert counters {key: "a", count: 1, updated_at: 2026-01-01T00:00:00"#),
            "{:?}",
            wrong.problems
        );
        let reason = by_name("wrong reason");
        assert_eq!(
            reason.problems[0],
            r#"expected a reason containing "by must be positive", got "missing field `key`""#
        );
        let outcome = by_name("wrong outcome");
        assert_eq!(outcome.problems[0], "expected outcome ok, got reject: missing field `key`");
    }

    #[tokio::test]
    async fn a_bad_case_names_the_row_and_the_column() {
        let results = run_text(
            r#"
[[case]]
name = "typo"
rows.counters = [{ key = "a", cuont = 41 }]
message = { key = "a" }

[[case]]
name = "wrong type"
rows.counters = [{ key = "a", count = "many" }]
message = { key = "a" }

[[case]]
name = "no such table"
rows.counter = [{ key = "a" }]
message = { key = "a" }
"#,
        )
        .await;
        let problems: Vec<&str> = results.iter().map(|r| r.problems[0].as_str()).collect();
        assert_eq!(
            problems,
            [
                "bad case: rows.counters[0]: table counters has no column cuont (did you mean count?)",
                "bad case: rows.counters[0]: column counters.count is int64, got \"many\"",
                "bad case: rows: unknown table counter (did you mean counters?)",
            ]
        );
    }

    #[test]
    fn a_bad_file_is_refused_naming_the_file_and_the_case() {
        let dir = tempfile::tempdir().unwrap();
        let write = |text: &str| {
            let p = dir.path().join("x.test.toml");
            std::fs::write(&p, text).unwrap();
            format!("{:#}", load(&p).unwrap_err())
        };
        let e = write("[[case]]\nname = \"a\"\nexpect = \"okay\"\n");
        assert!(
            e.contains("case \"a\": expect = \"okay\"; use one of ok, retry, reject, failed, invalid-effects"),
            "{e}"
        );
        let e = write("[[case]]\nname = \"a\"\nwrties = []\n");
        assert!(e.contains("unknown field `wrties`"), "{e}");
        let e = write("queue = \"x\"\n");
        assert!(e.contains("no [[case]]"), "{e}");
        let e = write("[[case]]\nname = \"a\"\nexpect = \"reject\"\nwrites = [{ table = \"t\" }]\n");
        assert!(e.contains("only an ok message has effects"), "{e}");
    }

    #[test]
    fn the_report_escapes_what_handlers_and_test_files_chose() {
        let result = FileResult {
            file: "t.test.toml".into(),
            queue: "q".into(),
            component: "h.wasm".into(),
            cases: vec![CaseResult {
                name: "case \u{1b}]0;owned\u{7}".into(),
                passed: false,
                problems: vec!["reason: \u{1b}[2Jcleared\u{202e}txt.exe\nsecond line".into()],
                report: None,
                millis: 1.0,
            }],
        };
        let out = render(&[result]);
        assert!(
            !out.contains('\u{1b}') && !out.contains('\u{7}') && !out.contains('\u{202e}'),
            "{out}"
        );
        assert!(out.contains("\\u{1b}[2Jcleared"), "escaped, still readable: {out}");
        assert!(out.contains("          second line\n"), "one problem line per line: {out}");
    }
}
