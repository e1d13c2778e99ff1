//! The admin HTTP API of a running host (`onceq run`), on loopback by
//! default (`admin.listen`).
//!
//! | method | path | what |
//! |---|---|---|
//! | GET | `/healthz` | 200 while the process runs |
//! | GET | `/readyz` | 200 once serving, the store answers and can take a write, and no queue is held back by the host's own trouble; 503 saying why otherwise |
//! | GET | `/metrics` | Prometheus (OpenMetrics text) |
//! | GET | `/v1/stats` | queue and outbox counts, as `onceq stats --json` (the token's queues) |
//! | GET | `/v1/queues/{queue}/versions` | deployments, newest first, the active one marked |
//! | POST | `/v1/queues/{queue}/deploy[?label=L]` | body: the component (its minisign signature, base64, in `Onceq-Signature`); validated, then switched to |
//! | POST | `/v1/queues/{queue}/rollback` | back to the previous version |
//! | GET | `/v1/dead[?queue=Q&limit=N]` | dead letters (and dead intents), newest first |
//! | POST | `/v1/dead/{id}/replay` | back onto its queue |
//! | POST | `/v1/dead/{id}/discard` | deleted |
//! | GET | `/v1/audit[?queue=Q&limit=N]` | the audit trail, newest first |
//! | GET | `/v1/overview` | every queue's counts, paused or not, active version, this host's rates, latency and in-flight work, the oldest ready message's age; every connector's outbox with its retry backlog and last error; the hosts seen in the last hour (heartbeats every 10 s) serving the caller's queues |
//! | GET | `/v1/history?queue=Q` | the last hour of this host's samples of a queue (every 10 s): processed, failed, p50/p99, in flight |
//! | GET | `/v1/queues/{queue}/messages?state=ready\|delayed\|leased\|dead` | a page of messages in that state, along the queue's index (`after` = the previous page's `next`, `limit` ≤ 500); filters `field`+`value` (a payload JSON path), `contains`, `attr=name[=value]`, `error`, `reason` (a group of `/v1/dead/reasons`), `since`, `until`, `id`; a page reads at most 20,000 rows and says how many (`scanned`) |
//! | POST | `/v1/queues/{queue}/messages[?dedup_key=K&delay=30s]` | send the body as one message to a queue this host serves, in the caller's trace when a `traceparent` header comes with it (operator; audited) |
//! | POST | `/v1/queues/{queue}/pause`, `/resume` | a paused queue leases nothing on any host; what is in flight finishes (operator) |
//! | GET | `/v1/messages/{id}` | one message, live or dead: payload (exact bytes in base64 when not UTF-8), attributes, deliveries, failures, last error, lease expiry; the message that produced it, and what a processed message produced that is still stored |
//! | GET | `/v1/dead/reasons?queue=Q` | dead letters grouped by reason, numbers and long ids folded |
//! | POST | `/v1/dead/bulk` | `{"queue", "action": "replay"\|"discard", "ids": [...]` or `"filter": {...}, "dry_run"}`: settle a selection or everything matching (≤ 10,000), each in the audit trail; a dry run only counts |
//! | GET | `/v1/outbox/delivered?connector=C[&key=K]` | delivered intents within the retention, newest first, searchable by key |
//! | GET | `/console/` | the operator console: pages embedded in the binary, a client of the endpoints above ([`console`]) |
//!
//! Every `/v1` endpoint takes `Authorization: Bearer <token>`: a token of
//! `[[admin.tokens]]` (with a role and its queues, see [`crate::access`]),
//! or `admin.token` (an admin of every queue). A request a token's role or
//! queues do not allow is 403, naming what is missing. With no token
//! configured, reads are open (loopback by default) and mutations answer
//! 401 to everyone. The token is checked before a byte of the body is read
//! (a middleware in front of the handlers), and the body is then read up
//! to `admin.max_upload` (413 past it), so an unauthenticated client cannot
//! make the host buffer anything. Every mutation, and every refusal of an
//! authenticated one, is recorded in the audit trail (`onceq audit`).
//!
//! The server is bounded whatever its clients do: at most
//! `admin.max_connections` connections are served at once (more wait in
//! the kernel's backlog, costing the host no descriptor), and a connection
//! that has not sent a request's headers within `admin.header_timeout`
//! (idle between requests, or sending them slowly) is closed.

pub mod browse;
pub mod console;
mod send;

use crate::deploy::{DeployFailure, Deployer};
use crate::outbox;
use crate::protocol::QueueRunner;
use crate::store::Store;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Extension, Path, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

/// Handler latency histogram buckets, seconds.
const LATENCY_BUCKETS: [f64; 14] = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// What the admin API serves. It starts before the host serves (so
/// `/readyz` can say what the host waits for) and is given the store, the
/// runners and the deployer once they exist ([`Admin::serve_with`]).
pub struct Admin {
    pub tokens: crate::access::Tokens,
    /// Largest request body accepted (`admin.max_upload`), read only after
    /// the token was checked.
    pub max_upload: usize,
    serving: std::sync::OnceLock<Serving>,
    /// What the host is doing before it serves (`/readyz` says it).
    starting: std::sync::Mutex<String>,
    /// Set once the queues are being served.
    ready: AtomicBool,
    /// The console's logged-in sessions.
    sessions: console::Sessions,
    /// The last hour of each queue's books, for the console's charts.
    history: console::History,
}

/// The host being served.
pub struct Serving {
    pub store: Arc<dyn Store>,
    pub runners: Vec<Arc<QueueRunner>>,
    pub deployer: Arc<Deployer>,
    /// How long delivered intents' keys are kept (`outbox.retention`).
    pub outbox_retention: Duration,
    /// Where the producer spans of messages sent through the API go.
    pub telemetry: crate::telemetry::Telemetry,
}

impl std::fmt::Debug for Admin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admin")
            .field("queues", &self.serving.get().map_or(0, |s| s.runners.len()))
            .finish()
    }
}

impl Admin {
    pub fn new(tokens: crate::access::Tokens, max_upload: usize) -> Admin {
        Admin {
            tokens,
            max_upload,
            serving: std::sync::OnceLock::new(),
            starting: std::sync::Mutex::new("starting".into()),
            ready: AtomicBool::new(false),
            sessions: console::Sessions::default(),
            history: console::History::default(),
        }
    }

    /// Say what the host is waiting for (shown by `/readyz` until it serves).
    pub fn starting(&self, what: impl Into<String>) {
        if let Ok(mut s) = self.starting.lock() {
            *s = what.into();
        }
    }

    /// The host is assembled: its endpoints answer from now on.
    pub fn serve_with(&self, serving: Serving) {
        let _ = self.serving.set(serving);
    }

    /// Its queues are being worked: `/readyz` may say ready.
    pub fn set_ready(&self) {
        self.ready.store(true, Relaxed);
    }

    // The error is the route's own answer, returned as it is.
    #[allow(clippy::result_large_err)]
    fn serving(&self) -> Result<&Serving, Response> {
        self.serving.get().ok_or_else(|| {
            let what = self.starting.lock().map(|s| s.clone()).unwrap_or_default();
            error(StatusCode::SERVICE_UNAVAILABLE, format!("not serving yet: {what}"))
        })
    }
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(serde_json::json!({ "error": message.into() }))).into_response()
}

/// Who a request comes from.
#[derive(Clone, Debug)]
pub enum Caller {
    /// No token is configured on this host: reads only.
    Open,
    Token(Arc<crate::access::Token>),
}

impl Caller {
    /// The name the audit trail records.
    fn name(&self) -> &str {
        match self {
            Caller::Open => "anonymous",
            Caller::Token(t) => &t.name,
        }
    }

    fn check(&self, action: Action, queue: Option<&str>) -> Result<(), String> {
        match (self, action) {
            (Caller::Open, Action::Read) => Ok(()),
            (Caller::Open, _) => Err("no admin token is configured on this host".into()),
            (Caller::Token(t), _) => t.check(action, queue),
        }
    }

    fn covers(&self, queue: &str) -> bool {
        match self {
            Caller::Open => true,
            Caller::Token(t) => t.covers(queue),
        }
    }

    fn is_admin(&self) -> bool {
        match self {
            Caller::Open => true,
            Caller::Token(t) => t.role == crate::access::Role::Admin && t.covers("*"),
        }
    }
}

use crate::access::Action;

/// The caller of a request, or the refusal (401).
#[allow(clippy::result_large_err)]
fn caller(admin: &Admin, headers: &HeaderMap, reading: bool) -> Result<Caller, Response> {
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if presented.is_none() {
        if let Some(session) = console::session_caller(admin, headers, reading) {
            return session;
        }
    }
    match presented {
        Some(t) => match admin.tokens.find(t) {
            Some(token) => Ok(Caller::Token(Arc::new(token.clone()))),
            None => Err(error(StatusCode::UNAUTHORIZED, "wrong bearer token")),
        },
        None if admin.tokens.is_empty() && reading => Ok(Caller::Open),
        None if admin.tokens.is_empty() => Err(error(
            StatusCode::UNAUTHORIZED,
            "no admin token is configured on this host: set admin.token, [[admin.tokens]], or the variable named by admin.token_env (default ONCEQ_ADMIN_TOKEN)",
        )),
        None => Err(error(StatusCode::UNAUTHORIZED, "missing Authorization: Bearer <token>")),
    }
}

/// Record `entry` in the audit trail; a failure to is logged, not the
/// caller's answer (the action happened, or was refused, already).
async fn audit(store: &dyn Store, entry: crate::store::AuditEntry) {
    if let Err(e) = store.audit_append(&entry).await {
        tracing::warn!(action = %entry.action, actor = %entry.actor, "recording the audit entry failed: {e}");
    }
}

/// 403 for `caller` doing `action` on `queue`, recorded in the audit trail.
async fn forbidden(store: &dyn Store, caller: &Caller, action: &str, queue: Option<&str>, subject: &str, why: String) -> Response {
    audit(
        store,
        crate::store::AuditEntry::now(caller.name(), action, queue, subject).with_result(format!("refused: {why}")),
    )
    .await;
    error(StatusCode::FORBIDDEN, why)
}

fn deploy_error(e: DeployFailure) -> Response {
    let status = match &e {
        DeployFailure::UnknownQueue(_) => StatusCode::NOT_FOUND,
        DeployFailure::Refused { .. } => StatusCode::UNPROCESSABLE_ENTITY,
        DeployFailure::NothingToRollBack(_) => StatusCode::CONFLICT,
        DeployFailure::BadLabel { .. } => StatusCode::BAD_REQUEST,
        DeployFailure::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    error(status, e.to_string())
}

async fn healthz() -> &'static str {
    "ok\n"
}

/// How long a queue may go on deferring messages for the host's own
/// trouble, with no commit since, before `/readyz` says so.
pub const HELD_BACK_AFTER: Duration = Duration::from_secs(30);

async fn readyz(State(admin): State<Arc<Admin>>) -> Response {
    let unready = |text: String| (StatusCode::SERVICE_UNAVAILABLE, format!("{text}\n")).into_response();
    let serving = match admin.serving() {
        Ok(s) if admin.ready.load(Relaxed) => s,
        _ => {
            return unready(format!(
                "starting: {}",
                admin.starting.lock().map(|s| s.clone()).unwrap_or_default()
            ))
        }
    };
    // A small read (the paused queues): the counts would read every
    // queue's index (a million messages: 60 ms on SQLite, more on
    // Spanner) on every probe.
    match tokio::time::timeout(Duration::from_secs(2), serving.store.queue_paused()).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return unready(format!("store error: {e}")),
        Err(_) => return unready("store did not answer within 2s".into()),
    }
    // Reads can go on while another process holds the write lock (WAL):
    // readiness needs a write to be possible too.
    match tokio::time::timeout(
        crate::store::WRITE_CHECK_WITHIN + Duration::from_secs(1),
        serving.store.write_check(),
    )
    .await
    {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return unready(format!("store cannot be written: {e}")),
        Err(_) => return unready("store's write check did not finish within 3s".into()),
    }
    // A queue that only defers for the host's trouble makes no progress.
    let held: Vec<String> = serving
        .runners
        .iter()
        .filter_map(|r| {
            r.metrics
                .held_back(HELD_BACK_AFTER)
                .map(|(secs, why)| format!("queue {}: deferring messages for {secs:.0}s: {why}", r.spec.name))
        })
        .collect();
    if !held.is_empty() {
        return unready(held.join("\n"));
    }
    (StatusCode::OK, "ready\n").into_response()
}

async fn metrics(State(admin): State<Arc<Admin>>) -> Response {
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register_collector(Box::new(Collector(admin.clone())));
    let mut text = String::new();
    match prometheus_client::encoding::text::encode(&mut text, &registry) {
        Ok(()) => (
            [(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
            text,
        )
            .into_response(),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, format!("encoding metrics: {e}")),
    }
}

async fn stats(State(admin): State<Arc<Admin>>, Extension(caller): Extension<Caller>) -> Response {
    let serving = match admin.serving() {
        Ok(s) => s,
        Err(r) => return r,
    };
    match serving.store.stats().await {
        Ok(s) => {
            // The token's queues only (an outbox by its queue's name).
            let (mut queues, mut outbox) = outbox::inspect::split_stats(&s);
            queues.retain(|q| caller.covers(&q.queue));
            outbox.retain(|c| caller.covers(&crate::names::outbox_queue(&c.connector)));
            let mut active = serving.deployer.active();
            active.retain(|q, _| caller.covers(q));
            Json(serde_json::json!({ "queues": queues, "outbox": outbox, "active_versions": active })).into_response()
        }
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

async fn versions(State(admin): State<Arc<Admin>>, Extension(caller): Extension<Caller>, Path(queue): Path<String>) -> Response {
    let serving = match admin.serving() {
        Ok(s) => s,
        Err(r) => return r,
    };
    if let Err(why) = caller.check(Action::Read, Some(&queue)) {
        return error(StatusCode::FORBIDDEN, why);
    }
    match serving.deployer.versions(&queue).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => deploy_error(e),
    }
}

#[derive(serde::Deserialize)]
struct DeployQuery {
    label: Option<String>,
}

/// In front of every `/v1` route: who is calling, refused (401) before
/// the body is read.
async fn authenticate(State(admin): State<Arc<Admin>>, mut request: Request, next: Next) -> Response {
    let reading = request.method() == axum::http::Method::GET;
    match caller(&admin, request.headers(), reading) {
        Ok(c) => {
            // A deploy's, a rollback's and a send's role and queue are
            // checked here, before the body is read: a viewer's upload is
            // not buffered.
            let path = request.uri().path().to_string();
            let target = path.strip_prefix("/v1/queues/").and_then(|rest| {
                let (queue, action) = rest.split_once('/')?;
                match action {
                    "deploy" | "rollback" => Some((queue, action, Action::Deploy)),
                    "messages" => Some((queue, "send", Action::Send)),
                    _ => None,
                }
            });
            if let (false, Some((queue, action, needs)), Ok(serving)) = (reading, target, admin.serving()) {
                // Checked as the route will see it: a queue name never
                // needs percent-encoding, so an encoded one is refused
                // rather than matched against the token's patterns raw.
                if queue.contains('%') {
                    return error(
                        StatusCode::BAD_REQUEST,
                        "a queue name is letters, digits, '.', '-' and '_': nothing to percent-encode",
                    );
                }
                if let Err(why) = c.check(needs, Some(queue)) {
                    return forbidden(serving.store.as_ref(), &c, action, Some(queue), "", why).await;
                }
            }
            request.extensions_mut().insert(c);
            next.run(request).await
        }
        Err(r) => r,
    }
}

/// The header carrying a deploy's signature: the `.minisig` file, base64.
pub const SIGNATURE_HEADER: &str = "onceq-signature";

async fn deploy(
    State(admin): State<Arc<Admin>>,
    Extension(caller): Extension<Caller>,
    Path(queue): Path<String>,
    Query(q): Query<DeployQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let serving = match admin.serving() {
        Ok(s) => s,
        Err(r) => return r,
    };
    // Role and queue were checked by `authenticate`.
    let version = crate::deploy::version_of(&body);
    if body.is_empty() {
        return error(StatusCode::BAD_REQUEST, "the request body must be the component's bytes");
    }
    let signature = match headers.get(SIGNATURE_HEADER) {
        None => None,
        Some(v) => {
            use base64::Engine;
            match v
                .to_str()
                .ok()
                .and_then(|s| base64::engine::general_purpose::STANDARD.decode(s.trim()).ok())
                .and_then(|b| String::from_utf8(b).ok())
            {
                Some(s) => Some(s),
                None => {
                    return error(
                        StatusCode::BAD_REQUEST,
                        format!("{SIGNATURE_HEADER}: not the base64 of a .minisig file"),
                    )
                }
            }
        }
    };
    let upload = crate::deploy::Upload {
        bytes: body.to_vec(),
        label: q.label,
        source: "api".into(),
        signature,
        by: Some(caller.name().to_string()),
    };
    let r = serving.deployer.upload(&queue, upload).await;
    deployed(serving, &caller, "deploy", &queue, &version, r).await
}

/// Answer a deploy or rollback, recording it in the audit trail.
async fn deployed(
    serving: &Serving,
    caller: &Caller,
    action: &str,
    queue: &str,
    version: &str,
    r: Result<crate::deploy::Deployment, DeployFailure>,
) -> Response {
    let entry = |subject: &str| crate::store::AuditEntry::now(caller.name(), action, Some(queue), subject);
    match r {
        Ok(d) => {
            audit(
                serving.store.as_ref(),
                entry(&d.version).with_signer(d.signer.as_ref().map(|s| s.to_string())),
            )
            .await;
            Json(d).into_response()
        }
        Err(e) => {
            audit(serving.store.as_ref(), entry(version).with_result(format!("failed: {e}"))).await;
            deploy_error(e)
        }
    }
}

async fn rollback(State(admin): State<Arc<Admin>>, Extension(caller): Extension<Caller>, Path(queue): Path<String>) -> Response {
    let serving = match admin.serving() {
        Ok(s) => s,
        Err(r) => return r,
    };
    // Role and queue were checked by `authenticate`.
    let r = serving.deployer.rollback_by(&queue, Some(caller.name().to_string())).await;
    deployed(serving, &caller, "rollback", &queue, "", r).await
}

#[derive(serde::Deserialize)]
struct ListQuery {
    queue: Option<String>,
    limit: Option<usize>,
}

fn listing(q: &ListQuery) -> crate::store::Queues<'_> {
    match &q.queue {
        Some(name) => crate::store::Queues::Named(name),
        None => crate::store::Queues::All,
    }
}

/// Most entries a listing returns.
const MAX_LIST: usize = 1000;

async fn dead_letters(State(admin): State<Arc<Admin>>, Extension(caller): Extension<Caller>, Query(q): Query<ListQuery>) -> Response {
    let serving = match admin.serving() {
        Ok(s) => s,
        Err(r) => return r,
    };
    if let Some(name) = &q.queue {
        if let Err(why) = caller.check(Action::Read, Some(name)) {
            return error(StatusCode::FORBIDDEN, why);
        }
    }
    match serving
        .store
        .dead_letter_list(listing(&q), q.limit.unwrap_or(50).min(MAX_LIST))
        .await
    {
        Ok(mut list) => {
            list.retain(|d| caller.covers(&d.queue));
            Json(list).into_response()
        }
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

async fn settle(admin: Arc<Admin>, caller: Caller, id: String, how: crate::store::Settle) -> Response {
    let serving = match admin.serving() {
        Ok(s) => s,
        Err(r) => return r,
    };
    let action = match how {
        crate::store::Settle::Replay => "replay",
        crate::store::Settle::Discard => "discard",
    };
    let dead = match serving.store.dead_letter_get(&id).await {
        Ok(Some(d)) => d,
        Ok(None) => return error(StatusCode::NOT_FOUND, format!("no dead letter {}", crate::names::printable(&id))),
        Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    };
    if let Err(why) = caller.check(Action::Operate, Some(&dead.queue)) {
        return forbidden(serving.store.as_ref(), &caller, action, Some(&dead.queue), &id, why).await;
    }
    let entry = crate::store::AuditEntry::now(caller.name(), action, Some(&dead.queue), &id);
    match serving.store.dead_letter_settle(&id, how, Some(&entry)).await {
        Ok(Some(_)) => Json(serde_json::json!({ "id": id, "queue": dead.queue, "action": action })).into_response(),
        Ok(None) => error(
            StatusCode::NOT_FOUND,
            format!("dead letter {} was replayed or discarded meanwhile", crate::names::printable(&id)),
        ),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

async fn replay(State(admin): State<Arc<Admin>>, Extension(caller): Extension<Caller>, Path(id): Path<String>) -> Response {
    settle(admin, caller, id, crate::store::Settle::Replay).await
}

async fn discard(State(admin): State<Arc<Admin>>, Extension(caller): Extension<Caller>, Path(id): Path<String>) -> Response {
    settle(admin, caller, id, crate::store::Settle::Discard).await
}

/// The audit trail: a token sees the entries of its queues; entries about
/// no queue, an admin of every queue only.
async fn audit_trail(State(admin): State<Arc<Admin>>, Extension(caller): Extension<Caller>, Query(q): Query<ListQuery>) -> Response {
    let serving = match admin.serving() {
        Ok(s) => s,
        Err(r) => return r,
    };
    match serving.store.audit_list(listing(&q), q.limit.unwrap_or(50).min(MAX_LIST)).await {
        Ok(mut list) => {
            list.retain(|e| match &e.queue {
                Some(queue) => caller.covers(queue),
                None => caller.is_admin(),
            });
            Json(list).into_response()
        }
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

/// The admin API's routes.
pub fn router(admin: Arc<Admin>) -> Router {
    let v1 = Router::new()
        .route("/v1/stats", get(stats))
        .route("/v1/queues/{queue}/versions", get(versions))
        .route("/v1/queues/{queue}/deploy", post(deploy))
        .route("/v1/queues/{queue}/rollback", post(rollback))
        .route("/v1/dead", get(dead_letters))
        .route("/v1/dead/{id}/replay", post(replay))
        .route("/v1/dead/{id}/discard", post(discard))
        .route("/v1/audit", get(audit_trail))
        .route("/v1/overview", get(browse::overview))
        .route("/v1/history", get(browse::history))
        .route("/v1/queues/{queue}/messages", get(browse::messages).post(send::send))
        .route("/v1/queues/{queue}/pause", post(browse::pause))
        .route("/v1/queues/{queue}/resume", post(browse::resume))
        .route("/v1/messages/{id}", get(browse::message))
        .route("/v1/dead/reasons", get(browse::reasons))
        .route("/v1/dead/bulk", post(browse::bulk))
        .route("/v1/outbox/delivered", get(browse::delivered))
        .layer(DefaultBodyLimit::max(admin.max_upload))
        .route_layer(axum::middleware::from_fn_with_state(admin.clone(), authenticate));
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/console", get(console::to_index))
        .route("/console/", get(console::index))
        .route("/console/app.js", get(console::script))
        .route("/console/app.css", get(console::style))
        .route("/console/login", post(console::login))
        .route("/console/logout", post(console::logout))
        .route("/console/session", get(console::session))
        .merge(v1)
        .layer(axum::middleware::from_fn(console::secure_headers))
        .with_state(admin)
}

pub use crate::config::ServeLimits;

/// Serve until `stop` turns true, then finish the requests under way.
///
/// hyper serves each connection (HTTP/1.1, its header-read timeout on a
/// tokio timer); a semaphore bounds how many are open, so idle clients
/// cannot take the host's descriptors (measured before: 1,100 idle
/// connections with `RLIMIT_NOFILE` 1024 left the host unable to make an
/// instance for any message).
pub async fn serve(admin: Arc<Admin>, listener: tokio::net::TcpListener, limits: ServeLimits, mut stop: crate::shutdown::Shutdown) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    tokio::spawn(console::sampler(admin.clone(), stop.clone()));
    let router = router(admin);
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
    let mut accept_errors = 0u64;
    loop {
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
            () = stop.requested() => break,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors, say: say so (once in a while),
                    // wait, and try again; the connection stays queued.
                    accept_errors += 1;
                    if accept_errors.is_power_of_two() {
                        tracing::warn!(errors = accept_errors, "admin API: accepting a connection failed: {e}");
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = stop.requested() => break,
        };
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        let connection = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!("admin API connection: {e}");
            }
            drop(slot);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// Reads the runners' counters at each scrape (no second set of books).
#[derive(Debug)]
struct Collector(Arc<Admin>);

type Labels = Vec<(&'static str, String)>;

/// One labelled value per runner.
fn rows<'a, T>(
    runners: impl IntoIterator<Item = &'a Arc<QueueRunner>>,
    label: impl Fn(&QueueRunner) -> Labels,
    value: impl Fn(&crate::protocol::Metrics) -> T,
) -> Vec<(Labels, T)> {
    runners.into_iter().map(|r| (label(r), value(&r.metrics))).collect()
}

fn counters(e: &mut DescriptorEncoder, name: &str, help: &str, rows: &[(Labels, u64)]) -> std::fmt::Result {
    let mut m = e.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, v) in rows {
        ConstCounter::new(*v).encode(m.encode_family(labels)?)?;
    }
    Ok(())
}

fn gauges(e: &mut DescriptorEncoder, name: &str, help: &str, rows: &[(Labels, i64)]) -> std::fmt::Result {
    let mut m = e.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, v) in rows {
        ConstGauge::new(*v).encode(m.encode_family(labels)?)?;
    }
    Ok(())
}

type Buckets = (f64, u64, Vec<(f64, u64)>);

fn histograms(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    runners: &[Arc<QueueRunner>],
    f: impl Fn(&crate::protocol::Metrics) -> Buckets,
) -> std::fmt::Result {
    let mut m = e.encode_descriptor(name, help, None, MetricType::Histogram)?;
    for r in runners {
        let (sum, count, buckets) = f(&r.metrics);
        let labels: Labels = vec![("queue", r.spec.name.clone())];
        m.encode_family(&labels)?
            .encode_histogram::<NoLabelSet>(sum, count, &buckets, None)?;
    }
    Ok(())
}

impl prometheus_client::collector::Collector for Collector {
    fn encode(&self, mut e: DescriptorEncoder) -> std::fmt::Result {
        let Some(serving) = self.0.serving.get() else {
            return Ok(());
        };
        let runners = &serving.runners;
        let (queues, outboxes): (Vec<_>, Vec<_>) = runners.iter().partition(|r| outbox::connector_of(&r.spec.name).is_none());
        outcomes(&mut e, &queues)?;
        health(&mut e, runners, &queues)?;
        deliveries(&mut e, &outboxes)?;
        {
            let mut m = e.encode_descriptor(
                "onceq_handler_version",
                "The handler version new leases use (1 per queue)",
                None,
                MetricType::Gauge,
            )?;
            for (queue, version) in serving.deployer.active() {
                let labels: Labels = vec![("queue", queue), ("version", version)];
                ConstGauge::new(1i64).encode(m.encode_family(&labels)?)?;
            }
        }
        if let Some(stats) = serving.store.commit_stats() {
            let m = e.encode_descriptor(
                "onceq_commit_batches",
                "Group-commit batches committed by this host (each one database transaction)",
                None,
                MetricType::Counter,
            )?;
            ConstCounter::new(stats.batches).encode(m)?;
            let m = e.encode_descriptor(
                "onceq_commit_messages",
                "Messages committed in those batches (divided by the batches: the mean batch size)",
                None,
                MetricType::Counter,
            )?;
            ConstCounter::new(stats.messages).encode(m)?;
            let m = e.encode_descriptor(
                "onceq_commit_split_batches",
                "Batches that failed as a whole and were committed again one message at a time (a write the database refused; on SQLite only one that ends the transaction, a trigger's RAISE(ROLLBACK) or an ON CONFLICT ROLLBACK clause)",
                None,
                MetricType::Counter,
            )?;
            ConstCounter::new(stats.split_batches).encode(m)?;
            let m = e.encode_descriptor(
                "onceq_commit_leases_in_batches",
                "Leases run inside a batch's transaction, with its messages, instead of in a transaction of their own (SQLite)",
                None,
                MetricType::Counter,
            )?;
            ConstCounter::new(stats.leases_in_batches).encode(m)?;
        }
        {
            let mut m = e.encode_descriptor(
                "onceq_handler_instructions",
                "Instructions per handler call (instantiation included), per queue and version, at quantiles 0.5 and 0.99 (not counted with runtime.count_instructions = false)",
                None,
                MetricType::Gauge,
            )?;
            for r in runners {
                for (version, (_, p50, p99)) in r.metrics.instruction_quantiles() {
                    for (q, v) in [("0.5", p50), ("0.99", p99)] {
                        let labels: Labels = vec![("queue", r.spec.name.clone()), ("version", version.clone()), ("quantile", q.into())];
                        ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX)).encode(m.encode_family(&labels)?)?;
                    }
                }
            }
        }
        histograms(
            &mut e,
            "onceq_message_duration_seconds",
            "Lease-to-outcome time of acked messages (handler, reads and commit)",
            runners,
            |m| m.latency_buckets(&LATENCY_BUCKETS),
        )?;
        histograms(
            &mut e,
            "onceq_handler_duration_seconds",
            "Time in the handler call per attempt (instantiation, reads, the call)",
            runners,
            |m| m.handler_buckets(&LATENCY_BUCKETS),
        )?;
        Ok(())
    }
}

fn queue_label(r: &QueueRunner) -> Labels {
    vec![("queue", r.spec.name.clone())]
}

/// Message outcomes per queue and handler version.
fn outcomes(e: &mut DescriptorEncoder, queues: &[&Arc<QueueRunner>]) -> std::fmt::Result {
    let per_version = |f: fn(&crate::protocol::VersionCounts) -> u64| -> Vec<(Labels, u64)> {
        queues
            .iter()
            .flat_map(|r| {
                r.metrics
                    .versions()
                    .into_iter()
                    .map(|(v, c)| (vec![("queue", r.spec.name.clone()), ("version", v)], f(&c)))
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    counters(
        e,
        "onceq_messages_processed",
        "Messages committed with their ack, per queue and handler version",
        &per_version(|c| c.processed),
    )?;
    counters(
        e,
        "onceq_messages_already_committed",
        "Messages found already committed after an unknown commit outcome",
        &per_version(|c| c.already_committed),
    )?;
    counters(
        e,
        "onceq_messages_retried",
        "Attempts that ended in a retry later",
        &per_version(|c| c.retried),
    )?;
    counters(
        e,
        "onceq_messages_dead_lettered",
        "Messages moved to the dead-letter table",
        &per_version(|c| c.dead_lettered),
    )?;
    let queue = queue_label;
    counters(
        e,
        "onceq_message_deliveries",
        "Leases taken: every delivery of a message, whatever its end",
        &rows(queues.iter().copied(), queue, |m| m.deliveries.load(Relaxed)),
    )?;
    counters(
        e,
        "onceq_message_failures",
        "Failures of the messages' own (counted toward max_attempts)",
        &rows(queues.iter().copied(), queue, |m| m.failures.load(Relaxed)),
    )?;
    counters(
        e,
        "onceq_messages_deferred",
        "Deliveries deferred for the host's own trouble (store, contention, resources), not counted as failures",
        &rows(queues.iter().copied(), queue, |m| m.deferred.load(Relaxed)),
    )
}

/// Whether queues make progress: unknown outcomes, leases, store errors,
/// time since the last commit, work in flight.
fn health(e: &mut DescriptorEncoder, runners: &[Arc<QueueRunner>], queues: &[&Arc<QueueRunner>]) -> std::fmt::Result {
    let queue = queue_label;
    counters(
        e,
        "onceq_unknown_outcomes",
        "Commits whose outcome was unknown (each resolved by re-running)",
        &rows(queues.iter().copied(), queue, |m| m.unknown_outcomes.load(Relaxed)),
    )?;
    counters(
        e,
        "onceq_lease_renewals",
        "Leases extended while a message waited or was handled",
        &rows(runners, queue, |m| m.lease_renewals.load(Relaxed)),
    )?;
    counters(
        e,
        "onceq_handed_off",
        "Messages handed to the queue's workers in memory by the commit that sent them, not leased from the table (commit.handoff)",
        &rows(runners, queue, |m| m.handed_off.load(Relaxed)),
    )?;
    counters(
        e,
        "onceq_leases_lost",
        "Leases lost (expired and taken by another worker, or renewal failed)",
        &rows(runners, queue, |m| m.lease_lost.load(Relaxed)),
    )?;
    let store_errors: Vec<(Labels, u64)> = runners
        .iter()
        .flat_map(|r| {
            r.metrics
                .store_errors()
                .into_iter()
                .map(|(class, n)| (vec![("queue", r.spec.name.clone()), ("class", class.to_string())], n))
                .collect::<Vec<_>>()
        })
        .collect();
    counters(
        e,
        "onceq_store_errors",
        "Failed store calls (lease, commit, renewal, release, retry, dead letter) by error class",
        &store_errors,
    )?;
    {
        let mut m = e.encode_descriptor(
            "onceq_seconds_since_last_commit",
            "Seconds since the queue last committed a message (absent until its first commit)",
            None,
            MetricType::Gauge,
        )?;
        for r in runners {
            if let Some(secs) = r.metrics.seconds_since_commit() {
                ConstGauge::new(secs).encode(m.encode_family(&queue(r))?)?;
            }
        }
    }
    gauges(
        e,
        "onceq_in_flight",
        "Messages (and intents) being processed now",
        &rows(runners, queue, |m| m.in_flight.load(Relaxed)),
    )
}

/// The outbox: deliveries per connector.
fn deliveries(e: &mut DescriptorEncoder, outboxes: &[&Arc<QueueRunner>]) -> std::fmt::Result {
    let connector = |r: &QueueRunner| vec![("connector", outbox::connector_of(&r.spec.name).unwrap_or_default().to_string())];
    counters(
        e,
        "onceq_outbox_delivered",
        "Intents delivered (acked after the connector accepted them)",
        &rows(outboxes.iter().copied(), connector, crate::protocol::Metrics::acked),
    )?;
    counters(
        e,
        "onceq_outbox_failed",
        "Delivery attempts that failed (retried later, or dead-lettered)",
        &rows(outboxes.iter().copied(), connector, |m| {
            m.retried.load(Relaxed) + m.dead_lettered.load(Relaxed)
        }),
    )?;
    counters(
        e,
        "onceq_outbox_dead_lettered",
        "Intents refused for good or out of attempts",
        &rows(outboxes.iter().copied(), connector, |m| m.dead_lettered.load(Relaxed)),
    )
}

/// Talks to a running host's admin API (the `deploy`, `versions` and
/// `rollback` commands).
pub struct Client {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
}

impl Client {
    pub fn new(base: &str, token: Option<String>) -> anyhow::Result<Client> {
        let base = if base.starts_with("http://") || base.starts_with("https://") {
            base.trim_end_matches('/').to_string()
        } else {
            format!("http://{}", base.trim_end_matches('/'))
        };
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(600))
            .build()
            .map_err(|e| anyhow::anyhow!("building the HTTP client: {e}"))?;
        Ok(Client { http, base, token })
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> anyhow::Result<serde_json::Value> {
        let req = match &self.token {
            Some(t) => req.bearer_auth(t),
            None => req,
        };
        let req = req
            .build()
            .map_err(|e| anyhow::anyhow!("building a request to the admin API at {}: {e}", self.base))?;
        let upload = req.body().is_some();
        let resp = self.http.execute(req).await.map_err(|e| {
            if e.is_connect() || e.is_timeout() || !upload {
                anyhow::anyhow!("the admin API at {} did not answer (is `onceq run` running?): {e}", self.base)
            } else {
                // The host refuses a body over its limit as soon as it is
                // passed and closes the connection: a client still sending
                // may see the close before the 413.
                anyhow::anyhow!(
                    "the admin API at {} closed the connection before it answered (an upload larger than the host's \
                     admin.max_upload is refused this way): {e}",
                    self.base
                )
            }
        })?;
        let status = resp.status();
        if status == reqwest::StatusCode::PAYLOAD_TOO_LARGE {
            anyhow::bail!("the upload is larger than the host's admin.max_upload (HTTP {status})");
        }
        let body: serde_json::Value = resp.json().await.unwrap_or(serde_json::Value::Null);
        if !status.is_success() {
            let msg = body["error"].as_str().unwrap_or("no details");
            if status == reqwest::StatusCode::UNAUTHORIZED {
                let hint = match self.token {
                    None => "no token was sent: set ONCEQ_ADMIN_TOKEN (or admin.token in the config) to the host's token",
                    Some(_) => "the token sent (ONCEQ_ADMIN_TOKEN or admin.token) is not the host's",
                };
                anyhow::bail!("{msg} (HTTP {status}): {hint}");
            }
            anyhow::bail!("{msg} (HTTP {status})");
        }
        Ok(body)
    }

    pub async fn deploy(&self, queue: &str, component: Vec<u8>, label: Option<&str>) -> anyhow::Result<crate::deploy::Deployment> {
        self.deploy_signed(queue, component, label, None).await
    }

    /// [`Self::deploy`] with the component's `.minisig` text.
    pub async fn deploy_signed(
        &self,
        queue: &str,
        component: Vec<u8>,
        label: Option<&str>,
        signature: Option<&str>,
    ) -> anyhow::Result<crate::deploy::Deployment> {
        let mut req = self.http.post(format!("{}/v1/queues/{queue}/deploy", self.base)).body(component);
        if let Some(l) = label {
            req = req.query(&[("label", l)]);
        }
        if let Some(s) = signature {
            use base64::Engine;
            req = req.header(SIGNATURE_HEADER, base64::engine::general_purpose::STANDARD.encode(s));
        }
        Ok(serde_json::from_value(self.send(req).await?)?)
    }

    /// Pause or resume a queue.
    pub async fn pause(&self, queue: &str, pause: bool) -> anyhow::Result<serde_json::Value> {
        let action = if pause { "pause" } else { "resume" };
        self.send(self.http.post(format!("{}/v1/queues/{queue}/{action}", self.base))).await
    }

    /// Replay (`replay`) or discard (`discard`) a dead letter.
    pub async fn settle(&self, id: &str, action: &str) -> anyhow::Result<serde_json::Value> {
        let req = self.http.post(format!("{}/v1/dead/{id}/{action}", self.base));
        self.send(req).await
    }

    pub async fn audit(&self, queue: Option<&str>, limit: usize) -> anyhow::Result<Vec<crate::store::AuditEntry>> {
        let mut req = self
            .http
            .get(format!("{}/v1/audit", self.base))
            .query(&[("limit", limit.to_string())]);
        if let Some(q) = queue {
            req = req.query(&[("queue", q)]);
        }
        Ok(serde_json::from_value(self.send(req).await?)?)
    }

    pub async fn rollback(&self, queue: &str) -> anyhow::Result<crate::deploy::Deployment> {
        let req = self.http.post(format!("{}/v1/queues/{queue}/rollback", self.base));
        Ok(serde_json::from_value(self.send(req).await?)?)
    }

    pub async fn versions(&self, queue: &str) -> anyhow::Result<Vec<crate::deploy::VersionInfo>> {
        let req = self.http.get(format!("{}/v1/queues/{queue}/versions", self.base));
        Ok(serde_json::from_value(self.send(req).await?)?)
    }
}
