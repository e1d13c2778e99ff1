//! The operator console: one page, its script and its style, embedded in
//! the binary (`host/console/`) and served by the admin server under
//! `/console/`. It is a client of the public admin API: every figure it
//! shows and every action it takes is a documented `/v1` endpoint.
//!
//! **Sessions.** `POST /console/login` takes an admin token (JSON, so a
//! form on another site cannot post it) and answers with an `HttpOnly`,
//! `SameSite=Strict` cookie naming a random session that expires after
//! [`SESSION_TTL`]. The session acts as its token: same role, same queues.
//! A mutation through a session must also carry the session's CSRF token
//! in `X-Onceq-CSRF` (the page reads it from `GET /console/session`);
//! bearer tokens need none. Sessions live in the host's memory: a restart
//! logs everybody out.
//!
//! **Inert by construction.** The script builds the page with DOM nodes
//! and `textContent`, never HTML from strings; every response carries a
//! Content-Security-Policy allowing only the host's own script and style
//! (no inline script, no `eval`), and is not framed.

use super::{error, Admin, Caller};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The session cookie's name.
pub const SESSION_COOKIE: &str = "onceq_session";
/// The header a session's mutation carries its CSRF token in.
pub const CSRF_HEADER: &str = "x-onceq-csrf";
/// How long a console login lasts.
pub const SESSION_TTL: Duration = Duration::from_secs(8 * 3600);
/// Most sessions held at once (logins past it are refused until some expire).
const MAX_SESSIONS: usize = 10_000;

/// The Content-Security-Policy of every admin response.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

const INDEX_HTML: &str = include_str!("../../console/index.html");
const APP_JS: &str = include_str!("../../console/app.js");
const APP_CSS: &str = include_str!("../../console/app.css");

struct Session {
    token: Arc<crate::access::Token>,
    csrf: String,
    expires: Instant,
}

/// The console's logged-in sessions.
#[derive(Default)]
pub struct Sessions(Mutex<HashMap<String, Session>>);

fn secret() -> String {
    format!("{:032x}{:032x}", rand::random::<u128>(), rand::random::<u128>())
}

impl Sessions {
    /// A new session acting as `token`: its id and CSRF token; `None`
    /// when too many are open.
    fn open(&self, token: crate::access::Token) -> Option<(String, String)> {
        let mut map = self.0.lock().ok()?;
        let now = Instant::now();
        map.retain(|_, s| s.expires > now);
        if map.len() >= MAX_SESSIONS {
            return None;
        }
        let (id, csrf) = (secret(), secret());
        map.insert(
            id.clone(),
            Session {
                token: Arc::new(token),
                csrf: csrf.clone(),
                expires: now + SESSION_TTL,
            },
        );
        Some((id, csrf))
    }

    /// The token and CSRF token of a live session.
    fn find(&self, id: &str) -> Option<(Arc<crate::access::Token>, String)> {
        let map = self.0.lock().ok()?;
        map.get(id)
            .filter(|s| s.expires > Instant::now())
            .map(|s| (s.token.clone(), s.csrf.clone()))
    }

    fn close(&self, id: &str) {
        if let Ok(mut map) = self.0.lock() {
            map.remove(id);
        }
    }
}

/// The session cookie's value in a request.
fn cookie(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .find_map(|pair| pair.trim().strip_prefix(SESSION_COOKIE)?.strip_prefix('='))
}

fn same(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The caller of a request made through a console session, if it carries
/// one: `Err` (403) for a mutation without the session's CSRF token.
#[allow(clippy::result_large_err)]
pub(super) fn session_caller(admin: &Admin, headers: &HeaderMap, reading: bool) -> Option<Result<Caller, Response>> {
    let (token, csrf) = admin.sessions.find(cookie(headers)?)?;
    if !reading {
        let presented = headers.get(CSRF_HEADER).and_then(|v| v.to_str().ok()).unwrap_or("");
        if !same(presented, &csrf) {
            return Some(Err(error(
                StatusCode::FORBIDDEN,
                "a console session's change needs its CSRF token in X-Onceq-CSRF (reload the console)",
            )));
        }
    }
    Some(Ok(Caller::Token(token)))
}

/// Security headers on every response of the admin server.
pub(super) async fn secure_headers(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let h = response.headers_mut();
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.entry(header::CACHE_CONTROL).or_insert(HeaderValue::from_static("no-store"));
    response
}

fn asset(kind: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, kind), (header::CACHE_CONTROL, "no-cache")], body).into_response()
}

pub(super) async fn index() -> Response {
    asset("text/html; charset=utf-8", INDEX_HTML)
}

pub(super) async fn script() -> Response {
    asset("text/javascript; charset=utf-8", APP_JS)
}

pub(super) async fn style() -> Response {
    asset("text/css; charset=utf-8", APP_CSS)
}

pub(super) async fn to_index() -> Response {
    (StatusCode::PERMANENT_REDIRECT, [(header::LOCATION, "/console/")]).into_response()
}

#[derive(serde::Deserialize)]
pub(super) struct Login {
    token: String,
}

fn session_cookie(value: &str, max_age: u64) -> HeaderValue {
    HeaderValue::from_str(&format!(
        "{SESSION_COOKIE}={value}; HttpOnly; SameSite=Strict; Path=/; Max-Age={max_age}"
    ))
    .unwrap_or_else(|_| HeaderValue::from_static("onceq_session=; Max-Age=0"))
}

/// `POST /console/login` `{"token": "..."}`: a session cookie.
pub(super) async fn login(State(admin): State<Arc<Admin>>, headers: HeaderMap, body: axum::body::Bytes) -> Response {
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !json {
        return error(StatusCode::UNSUPPORTED_MEDIA_TYPE, "log in with a JSON body {\"token\": \"...\"}");
    }
    let Ok(login) = serde_json::from_slice::<Login>(&body) else {
        return error(StatusCode::BAD_REQUEST, "log in with a JSON body {\"token\": \"...\"}");
    };
    if admin.tokens.is_empty() {
        return error(
            StatusCode::CONFLICT,
            "no admin token is configured on this host: the console is open read-only without logging in",
        );
    }
    let Some(token) = admin.tokens.find(login.token.trim()).cloned() else {
        tracing::warn!("console: a login with a wrong token");
        return error(StatusCode::UNAUTHORIZED, "wrong token");
    };
    let Some((id, csrf)) = admin.sessions.open(token.clone()) else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many console sessions are open; try again later",
        );
    };
    if let Ok(serving) = admin.serving() {
        super::audit(
            serving.store.as_ref(),
            crate::store::AuditEntry::now(&token.name, "login", None, "console"),
        )
        .await;
    }
    let mut response = Json(describe(&Caller::Token(Arc::new(token)), Some(csrf))).into_response();
    response
        .headers_mut()
        .insert(header::SET_COOKIE, session_cookie(&id, SESSION_TTL.as_secs()));
    response
}

/// `POST /console/logout`: the session ends.
pub(super) async fn logout(State(admin): State<Arc<Admin>>, headers: HeaderMap) -> Response {
    if let Some(id) = cookie(&headers) {
        admin.sessions.close(id);
    }
    let mut response = StatusCode::NO_CONTENT.into_response();
    response.headers_mut().insert(header::SET_COOKIE, session_cookie("", 0));
    response
}

fn describe(caller: &Caller, csrf: Option<String>) -> serde_json::Value {
    match caller {
        Caller::Open => serde_json::json!({
            "name": "anonymous", "role": "viewer", "queues": ["*"], "open": true, "csrf": null,
        }),
        Caller::Token(t) => serde_json::json!({
            "name": t.name, "role": t.role, "queues": t.queues, "open": false, "csrf": csrf,
        }),
    }
}

/// `GET /console/session`: who the console acts as (401 when logged out
/// on a host with tokens; the open, read-only caller on one without).
pub(super) async fn session(State(admin): State<Arc<Admin>>, headers: HeaderMap) -> Response {
    if let Some(id) = cookie(&headers) {
        if let Some((token, csrf)) = admin.sessions.find(id) {
            return Json(describe(&Caller::Token(token), Some(csrf))).into_response();
        }
    }
    if admin.tokens.is_empty() {
        return Json(describe(&Caller::Open, None)).into_response();
    }
    error(StatusCode::UNAUTHORIZED, "not logged in")
}

/// One sample of a queue's books on this host.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Sample {
    /// Unix seconds.
    pub t: u64,
    pub processed: u64,
    pub failures: u64,
    pub dead_lettered: u64,
    /// Lease-to-outcome latency quantiles so far, milliseconds.
    pub p50_ms: f64,
    pub p99_ms: f64,
}

/// How often the console's charts are sampled, and how many are kept.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(10);
const SAMPLES: usize = 360;

/// The last hour of each queue's books on this host, for the charts:
/// read from the runners' counters (no store call), so a host nobody
/// watches pays a few atomic reads every ten seconds.
#[derive(Default)]
pub struct History(Mutex<HashMap<String, std::collections::VecDeque<Sample>>>);

impl History {
    pub fn sample(&self, runners: &[Arc<crate::protocol::QueueRunner>]) {
        use std::sync::atomic::Ordering::Relaxed;
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let Ok(mut map) = self.0.lock() else { return };
        for r in runners {
            let m = &r.metrics;
            let ring = map.entry(r.spec.name.clone()).or_default();
            if ring.len() >= SAMPLES {
                ring.pop_front();
            }
            ring.push_back(Sample {
                t,
                processed: m.processed.load(Relaxed) + m.already_committed.load(Relaxed),
                failures: m.failures.load(Relaxed),
                dead_lettered: m.dead_lettered.load(Relaxed),
                p50_ms: m.latency_quantile(0.5) as f64 / 1000.0,
                p99_ms: m.latency_quantile(0.99) as f64 / 1000.0,
            });
        }
    }

    pub fn of(&self, queue: &str) -> Vec<Sample> {
        self.0
            .lock()
            .ok()
            .and_then(|m| m.get(queue).map(|r| r.iter().copied().collect()))
            .unwrap_or_default()
    }
}

/// Sample every [`SAMPLE_EVERY`] while the admin server runs.
pub(super) async fn sampler(admin: Arc<Admin>, mut stop: crate::shutdown::Shutdown) {
    loop {
        if let Some(serving) = admin.serving.get() {
            admin.history.sample(&serving.runners);
        }
        tokio::select! {
            () = tokio::time::sleep(SAMPLE_EVERY) => {}
            () = stop.requested() => return,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_session_cookie_is_found_among_others() {
        let mut h = HeaderMap::new();
        h.insert(header::COOKIE, HeaderValue::from_static("a=b; onceq_session=abc123; c=d"));
        assert_eq!(cookie(&h), Some("abc123"));
        h.insert(header::COOKIE, HeaderValue::from_static("onceq_session_x=1"));
        assert_eq!(cookie(&h), None, "a cookie whose name only starts the same is another cookie");
    }

    #[test]
    fn the_cookie_is_httponly_strict_and_expires() {
        let c = session_cookie("x", 60);
        let c = c.to_str().unwrap();
        assert!(
            c.contains("HttpOnly") && c.contains("SameSite=Strict") && c.contains("Max-Age=60"),
            "{c}"
        );
    }
}
