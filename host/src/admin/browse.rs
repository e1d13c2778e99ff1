//! The admin API's views for operators (and the console): an overview of
//! every queue, messages browsed and searched page by page, one message
//! in detail, dead letters grouped by reason and settled in bulk, pause
//! and resume.
//!
//! Browsing walks a queue's index in pages ([`Store::message_browse`]),
//! never the whole queue: a page reads at most [`SCAN_BUDGET`] rows, and
//! a search that has not found a page's worth of matches by then answers
//! with what it found and where to go on (`next`), saying how many rows
//! it read (`scanned`). Filters (a payload JSON field, text in the
//! payload or the last error, an attribute, a time range) are evaluated
//! by the host, the same on every store.

use super::{error, forbidden, Admin, Caller};
use crate::access::Action;
use crate::store::{BrowseKey, DeadLetter, LiveState, QueuedMessage, Settle, Store, StoreError};
use axum::extract::{Extension, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::sync::Arc;

/// Most rows one page of a search reads.
pub const SCAN_BUDGET: usize = 20_000;
/// Rows read per store call while scanning.
const CHUNK: usize = 1_000;
/// Most messages a page returns.
const MAX_PAGE: usize = 500;
/// Most dead letters one bulk action settles.
pub const MAX_BULK: usize = 10_000;

/// Which messages a browse lists: a live state, or dead letters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ready,
    Delayed,
    Leased,
    Dead,
}

impl Status {
    fn live(self) -> Option<LiveState> {
        match self {
            Status::Ready => Some(LiveState::Ready),
            Status::Delayed => Some(LiveState::Delayed),
            Status::Leased => Some(LiveState::Leased),
            Status::Dead => None,
        }
    }
}

/// A message as the console shows it, whatever its state.
#[derive(Debug, Clone, serde::Serialize)]
pub struct View {
    pub id: String,
    pub queue: String,
    pub state: Status,
    /// The payload as text (lossy when it is not UTF-8: then
    /// `payload_base64` has the exact bytes).
    pub payload_text: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub payload_base64: Option<String>,
    pub attributes: Vec<(String, String)>,
    pub deliveries: u32,
    pub failures: u32,
    pub enqueued_at: i64,
    /// Ready or delayed: when it is (was) visible; leased: when the lease
    /// expires; dead: when it died (µs, database time).
    pub at: i64,
    /// The last attempt's error, or why it is dead.
    pub error: Option<String>,
    pub handler_version: Option<String>,
    #[serde(skip)]
    payload: Vec<u8>,
}

fn base64_if_binary(bytes: &[u8]) -> Option<String> {
    use base64::Engine;
    std::str::from_utf8(bytes)
        .is_err()
        .then(|| base64::engine::general_purpose::STANDARD.encode(bytes))
}

impl View {
    fn live(m: QueuedMessage, state: Status) -> View {
        View {
            payload_base64: base64_if_binary(&m.payload),
            id: m.id,
            queue: m.queue,
            state,
            payload_text: m.payload_text,
            attributes: m.attributes,
            deliveries: m.deliveries,
            failures: m.failures,
            enqueued_at: m.enqueued_at,
            at: m.visible_at,
            error: m.last_error,
            handler_version: None,
            payload: m.payload,
        }
    }

    fn dead(d: DeadLetter) -> View {
        View {
            payload_base64: base64_if_binary(&d.payload),
            id: d.id,
            queue: d.queue,
            state: Status::Dead,
            payload_text: d.payload_text,
            attributes: d.attributes,
            deliveries: d.deliveries,
            failures: d.failures,
            enqueued_at: d.enqueued_at,
            at: d.failed_at,
            error: Some(d.reason),
            handler_version: d.handler_version,
            payload: d.payload,
        }
    }

    fn key(&self) -> BrowseKey {
        BrowseKey {
            at: self.at,
            id: self.id.clone(),
        }
    }

    fn attribute(&self, name: &str) -> Option<&str> {
        self.attributes.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// A search's filters, as query parameters (all optional, all must hold).
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct Filter {
    /// A payload JSON field, as a dotted path (`customer.id`, `items.0.sku`;
    /// a leading `$.` is allowed).
    pub field: Option<String>,
    /// The field's value: JSON (`42`, `true`, `"a b"`) or plain text
    /// (compared with a string field). Without it, the field exists.
    pub value: Option<String>,
    /// Text anywhere in the payload.
    pub contains: Option<String>,
    /// `name=value`, or `name` (the attribute is set).
    pub attr: Option<String>,
    /// Text in the last error (a dead letter's reason).
    pub error: Option<String>,
    /// The last error's group: its text with numbers and long ids folded
    /// ([`reason_group`]), as `GET /v1/dead/reasons` lists them.
    pub reason: Option<String>,
    /// Enqueued at or after (RFC 3339, or µs since the epoch).
    pub since: Option<String>,
    /// Enqueued before.
    pub until: Option<String>,
}

/// A [`Filter`] checked and ready to test messages.
#[derive(Debug, Default)]
pub struct Matcher {
    path: Option<Vec<String>>,
    value: Option<(serde_json::Value, String)>,
    contains: Option<String>,
    attr: Option<(String, Option<String>)>,
    error: Option<String>,
    reason: Option<String>,
    since: Option<i64>,
    until: Option<i64>,
}

fn time(name: &str, s: &str) -> Result<i64, String> {
    if let Ok(us) = s.trim().parse::<i64>() {
        return Ok(us);
    }
    humantime::parse_rfc3339_weak(s.trim())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
        .ok_or_else(|| format!("{name} = {s:?} is neither a time (2026-12-01T10:00:00Z) nor microseconds since the epoch"))
}

fn nonempty(s: &Option<String>) -> Option<&str> {
    s.as_deref().filter(|s| !s.is_empty())
}

impl Filter {
    pub fn matcher(&self) -> Result<Matcher, String> {
        let path = nonempty(&self.field).map(|f| f.strip_prefix("$.").unwrap_or(f).split('.').map(str::to_string).collect::<Vec<_>>());
        let value = match nonempty(&self.value) {
            Some(_) if path.is_none() => return Err("value needs a field (the payload JSON field to compare)".into()),
            Some(v) => Some((
                serde_json::from_str(v).unwrap_or(serde_json::Value::String(v.to_string())),
                v.to_string(),
            )),
            None => None,
        };
        Ok(Matcher {
            path,
            value,
            contains: nonempty(&self.contains).map(str::to_string),
            attr: nonempty(&self.attr).map(|a| match a.split_once('=') {
                Some((k, v)) => (k.to_string(), Some(v.to_string())),
                None => (a.to_string(), None),
            }),
            error: nonempty(&self.error).map(str::to_string),
            reason: nonempty(&self.reason).map(str::to_string),
            since: nonempty(&self.since).map(|s| time("since", s)).transpose()?,
            until: nonempty(&self.until).map(|s| time("until", s)).transpose()?,
        })
    }
}

impl Matcher {
    /// Only the attribute `name` = `value`.
    fn attribute(name: &str, value: &str) -> Matcher {
        Matcher {
            attr: Some((name.to_string(), Some(value.to_string()))),
            ..Matcher::default()
        }
    }

    pub fn matches(&self, v: &View) -> bool {
        if self.since.is_some_and(|t| v.enqueued_at < t) || self.until.is_some_and(|t| v.enqueued_at >= t) {
            return false;
        }
        if let Some(text) = &self.contains {
            if !v.payload_text.contains(text.as_str()) {
                return false;
            }
        }
        if let Some(text) = &self.error {
            if !v.error.as_deref().is_some_and(|e| e.contains(text.as_str())) {
                return false;
            }
        }
        if let Some(group) = &self.reason {
            if v.error.as_deref().is_none_or(|e| reason_group(e) != *group) {
                return false;
            }
        }
        if let Some((k, want)) = &self.attr {
            match (v.attribute(k), want) {
                (None, _) => return false,
                (Some(got), Some(want)) if got != want => return false,
                _ => {}
            }
        }
        if let Some(path) = &self.path {
            let Ok(doc) = serde_json::from_slice::<serde_json::Value>(&v.payload) else {
                return false;
            };
            let mut at = &doc;
            for seg in path {
                let next = match at {
                    serde_json::Value::Object(o) => o.get(seg),
                    serde_json::Value::Array(a) => seg.parse::<usize>().ok().and_then(|i| a.get(i)),
                    _ => None,
                };
                match next {
                    Some(n) => at = n,
                    None => return false,
                }
            }
            if let Some((json, raw)) = &self.value {
                if at != json && at.as_str() != Some(raw.as_str()) {
                    return false;
                }
            }
        }
        true
    }
}

/// A reason's group: runs of digits become `#`, and words of 16 or more
/// hex digits (ids, versions) `…`, so "order o-6: amount must be
/// positive, got -6" and "order o-7: ... got -7" are one group.
pub fn reason_group(reason: &str) -> String {
    let mut out = String::with_capacity(reason.len());
    for word in reason.split_inclusive(|c: char| !c.is_ascii_alphanumeric()) {
        let (core, tail) = match word.char_indices().last() {
            Some((at, c)) if !c.is_ascii_alphanumeric() => (&word[..at], &word[at..]),
            _ => (word, ""),
        };
        if core.len() >= 16 && core.bytes().all(|b| b.is_ascii_hexdigit()) {
            out.push('…');
        } else {
            let mut digits = false;
            for c in core.chars() {
                if c.is_ascii_digit() {
                    if !digits {
                        out.push('#');
                    }
                    digits = true;
                } else {
                    out.push(c);
                    digits = false;
                }
            }
        }
        out.push_str(tail);
    }
    out
}

/// One page of a search.
#[derive(Debug, serde::Serialize)]
pub struct Page {
    pub queue: String,
    pub state: Status,
    pub messages: Vec<View>,
    /// Where the next page starts (`after`), or `null` at the queue's end.
    pub next: Option<String>,
    /// Rows read for this page.
    pub scanned: usize,
}

fn cursor(k: &BrowseKey) -> String {
    format!("{}:{}", k.at, k.id)
}

fn parse_cursor(s: &str) -> Result<BrowseKey, String> {
    let (at, id) = s.split_once(':').ok_or("after is the `next` of a page")?;
    Ok(BrowseKey {
        at: at.parse().map_err(|_| "after is the `next` of a page")?,
        id: id.to_string(),
    })
}

/// One store call's rows of `queue` in `state`, after `after`.
async fn chunk(store: &dyn Store, queue: &str, state: Status, after: Option<&BrowseKey>, n: usize) -> Result<Vec<View>, StoreError> {
    Ok(match state.live() {
        Some(live) => store
            .message_browse(queue, live, after, n)
            .await?
            .into_iter()
            .map(|m| View::live(m, state))
            .collect(),
        None => store
            .dead_letter_browse(queue, after, n)
            .await?
            .into_iter()
            .map(View::dead)
            .collect(),
    })
}

/// Up to `limit` messages of `queue` in `state` matching `m`, reading at
/// most `budget` rows after `after`.
pub async fn search(
    store: &dyn Store,
    queue: &str,
    state: Status,
    mut after: Option<BrowseKey>,
    m: &Matcher,
    limit: usize,
    budget: usize,
) -> Result<Page, StoreError> {
    let mut page = Page {
        queue: queue.to_string(),
        state,
        messages: Vec::new(),
        next: None,
        scanned: 0,
    };
    loop {
        let n = CHUNK.min(budget - page.scanned);
        if n == 0 {
            page.next = after.as_ref().map(cursor);
            return Ok(page);
        }
        let rows = chunk(store, queue, state, after.as_ref(), n).await?;
        let end = rows.len() < n;
        for v in rows {
            page.scanned += 1;
            after = Some(v.key());
            if m.matches(&v) {
                page.messages.push(v);
                if page.messages.len() >= limit {
                    page.next = after.as_ref().map(cursor);
                    return Ok(page);
                }
            }
        }
        if end {
            return Ok(page);
        }
    }
}

#[derive(serde::Deserialize)]
pub(super) struct BrowseQuery {
    state: Option<Status>,
    after: Option<String>,
    limit: Option<usize>,
    id: Option<String>,
    #[serde(flatten)]
    filter: Filter,
}

fn unavailable(e: StoreError) -> Response {
    error(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
}

/// `GET /v1/queues/{queue}/messages`: a page of a queue's messages in one
/// state (`ready` by default), filtered.
pub(super) async fn messages(
    State(admin): State<Arc<Admin>>,
    Extension(caller): Extension<Caller>,
    Path(queue): Path<String>,
    Query(q): Query<BrowseQuery>,
) -> Response {
    let serving = match admin.serving() {
        Ok(s) => s,
        Err(r) => return r,
    };
    if let Err(why) = caller.check(Action::Read, Some(&queue)) {
        return error(StatusCode::FORBIDDEN, why);
    }
    let state = q.state.unwrap_or(Status::Ready);
    let matcher = match q.filter.matcher() {
        Ok(m) => m,
        Err(why) => return error(StatusCode::BAD_REQUEST, why),
    };
    if let Some(id) = nonempty(&q.id) {
        // One message by id: found where it is, whatever the state asked.
        return match find(serving.store.as_ref(), id).await {
            Ok(found) => {
                let messages: Vec<View> = found.into_iter().filter(|v| v.queue == queue && matcher.matches(v)).collect();
                Json(Page {
                    queue,
                    state,
                    scanned: messages.len(),
                    messages,
                    next: None,
                })
                .into_response()
            }
            Err(e) => unavailable(e),
        };
    }
    let after = match q.after.as_deref().filter(|s| !s.is_empty()).map(parse_cursor).transpose() {
        Ok(a) => a,
        Err(why) => return error(StatusCode::BAD_REQUEST, why),
    };
    let limit = q.limit.unwrap_or(50).clamp(1, MAX_PAGE);
    match search(serving.store.as_ref(), &queue, state, after, &matcher, limit, SCAN_BUDGET).await {
        Ok(page) => Json(page).into_response(),
        Err(e) => unavailable(e),
    }
}

/// A message by id, on its queue or dead.
async fn find(store: &dyn Store, id: &str) -> Result<Option<View>, StoreError> {
    if let Some(m) = store.message_get(id).await? {
        let now = crate::store::now_micros();
        let state = if m.leased {
            Status::Leased
        } else if m.visible_at > now {
            Status::Delayed
        } else {
            Status::Ready
        };
        return Ok(Some(View::live(m, state)));
    }
    Ok(store.dead_letter_get(id).await?.map(View::dead))
}

/// `GET /v1/messages/{id}`: one message, where it came from (the message
/// whose handler emitted it), and what it produced that is still queued
/// or dead (follow-ups and intents carry their source's id).
///
/// A message still queued or dead has produced nothing: effects commit
/// with the ack, which removes it. So only the id of a message that is
/// gone (processed) is looked up among what it produced, on the queues
/// this host serves (its handlers' queues and connectors' outboxes),
/// within one scan budget in all.
pub(super) async fn message(State(admin): State<Arc<Admin>>, Extension(caller): Extension<Caller>, Path(id): Path<String>) -> Response {
    let serving = match admin.serving() {
        Ok(s) => s,
        Err(r) => return r,
    };
    let store = serving.store.as_ref();
    let found = match find(store, &id).await {
        Ok(f) => f.filter(|v| caller.covers(&v.queue)),
        Err(e) => return unavailable(e),
    };
    let queues: Vec<&str> = match found {
        Some(_) => Vec::new(),
        None => serving
            .runners
            .iter()
            .map(|r| r.spec.name.as_str())
            .filter(|q| caller.covers(q))
            .collect(),
    };
    let by_source = Matcher::attribute(crate::names::SOURCE_MESSAGE_ATTRIBUTE, &id);
    let mut produced = Vec::new();
    let mut budget = SCAN_BUDGET;
    'scan: for queue in &queues {
        for state in [Status::Ready, Status::Delayed, Status::Leased, Status::Dead] {
            if budget == 0 {
                break 'scan;
            }
            match search(store, queue, state, None, &by_source, MAX_PAGE, budget).await {
                Ok(page) => {
                    budget -= page.scanned;
                    produced.extend(page.messages);
                }
                Err(e) => return unavailable(e),
            }
        }
    }
    if found.is_none() && produced.is_empty() {
        return error(
            StatusCode::NOT_FOUND,
            format!(
                "no message {} on a queue or dead (a processed message is gone once acked)",
                crate::names::printable(&id)
            ),
        );
    }
    let source = found.as_ref().and_then(|v| {
        Some(serde_json::json!({
            "queue": v.attribute(crate::names::SOURCE_QUEUE_ATTRIBUTE)?,
            "id": v.attribute(crate::names::SOURCE_MESSAGE_ATTRIBUTE)?,
        }))
    });
    Json(serde_json::json!({
        "message": found,
        "produced_by": source,
        "produced": produced,
        "produced_complete": budget > 0,
    }))
    .into_response()
}

#[derive(serde::Deserialize)]
pub(super) struct ReasonsQuery {
    queue: String,
}

/// `GET /v1/dead/reasons?queue=Q`: a queue's dead letters grouped by
/// reason, most first (of the newest [`SCAN_BUDGET`] × 5).
pub(super) async fn reasons(
    State(admin): State<Arc<Admin>>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<ReasonsQuery>,
) -> Response {
    let serving = match admin.serving() {
        Ok(s) => s,
        Err(r) => return r,
    };
    if let Err(why) = caller.check(Action::Read, Some(&q.queue)) {
        return error(StatusCode::FORBIDDEN, why);
    }
    let mut groups: std::collections::HashMap<String, (u64, i64)> = Default::default();
    let mut after = None;
    let mut scanned = 0;
    let budget = SCAN_BUDGET * 5;
    let complete = loop {
        let rows = match serving.store.dead_letter_browse(&q.queue, after.as_ref(), CHUNK).await {
            Ok(r) => r,
            Err(e) => return unavailable(e),
        };
        let end = rows.len() < CHUNK;
        for d in rows {
            scanned += 1;
            let g = groups.entry(reason_group(&d.reason)).or_insert((0, d.failed_at));
            g.0 += 1;
            g.1 = g.1.max(d.failed_at);
            after = Some(BrowseKey { at: d.failed_at, id: d.id });
        }
        if end {
            break true;
        }
        if scanned >= budget {
            break false;
        }
    };
    let mut list: Vec<_> = groups
        .into_iter()
        .map(|(reason, (count, newest))| serde_json::json!({ "reason": reason, "count": count, "newest_at": newest }))
        .collect();
    list.sort_by(|a, b| {
        b["count"]
            .as_u64()
            .cmp(&a["count"].as_u64())
            .then(a["reason"].as_str().cmp(&b["reason"].as_str()))
    });
    Json(serde_json::json!({ "queue": q.queue, "reasons": list, "scanned": scanned, "complete": complete })).into_response()
}

/// `POST /v1/dead/bulk`: replay or discard a queue's dead letters: the
/// ones named, or every one matching a filter (up to [`MAX_BULK`]).
/// With `dry_run`, only counts them.
#[derive(serde::Deserialize)]
pub(super) struct Bulk {
    queue: String,
    action: String,
    #[serde(default)]
    ids: Vec<String>,
    #[serde(default)]
    filter: Filter,
    #[serde(default)]
    dry_run: bool,
}

pub(super) async fn bulk(State(admin): State<Arc<Admin>>, Extension(caller): Extension<Caller>, Json(b): Json<Bulk>) -> Response {
    let serving = match admin.serving() {
        Ok(s) => s,
        Err(r) => return r,
    };
    let store = serving.store.as_ref();
    let how = match b.action.as_str() {
        "replay" => Settle::Replay,
        "discard" => Settle::Discard,
        other => return error(StatusCode::BAD_REQUEST, format!("action {other:?}: replay or discard")),
    };
    if let Err(why) = caller.check(Action::Operate, Some(&b.queue)) {
        if b.dry_run {
            return error(StatusCode::FORBIDDEN, why);
        }
        return forbidden(store, &caller, &b.action, Some(&b.queue), "bulk", why).await;
    }
    let matcher = match b.filter.matcher() {
        Ok(m) => m,
        Err(why) => return error(StatusCode::BAD_REQUEST, why),
    };
    let ids: Vec<String> = if b.ids.is_empty() {
        let mut ids = Vec::new();
        let mut after = None;
        loop {
            let page = match search(store, &b.queue, Status::Dead, after, &matcher, MAX_BULK - ids.len(), SCAN_BUDGET).await {
                Ok(p) => p,
                Err(e) => return unavailable(e),
            };
            ids.extend(page.messages.into_iter().map(|v| v.id));
            match page.next {
                Some(next) if ids.len() < MAX_BULK => after = parse_cursor(&next).ok(),
                _ => break,
            }
        }
        ids
    } else {
        if b.ids.len() > MAX_BULK {
            return error(StatusCode::BAD_REQUEST, format!("at most {MAX_BULK} ids at once"));
        }
        let mut ids = Vec::new();
        for id in &b.ids {
            match store.dead_letter_get(id).await {
                Ok(Some(d)) => {
                    let v = View::dead(d);
                    if v.queue == b.queue && matcher.matches(&v) {
                        ids.push(id.clone());
                    }
                }
                Ok(None) => {}
                Err(e) => return unavailable(e),
            }
        }
        ids
    };
    if b.dry_run {
        return Json(serde_json::json!({ "queue": b.queue, "action": b.action, "matched": ids.len(), "dry_run": true })).into_response();
    }
    let mut settled = 0;
    for id in &ids {
        let entry = crate::store::AuditEntry::now(caller_name(&caller), &b.action, Some(&b.queue), id);
        match store.dead_letter_settle(id, how, Some(&entry)).await {
            Ok(Some(_)) => settled += 1,
            Ok(None) => {}
            Err(e) => {
                return error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("{settled} of {} settled, then: {e}", ids.len()),
                )
            }
        }
    }
    Json(serde_json::json!({ "queue": b.queue, "action": b.action, "matched": ids.len(), "settled": settled })).into_response()
}

fn caller_name(c: &Caller) -> &str {
    match c {
        Caller::Open => "anonymous",
        Caller::Token(t) => &t.name,
    }
}

async fn pause_or_resume(admin: Arc<Admin>, caller: Caller, queue: String, pause: bool) -> Response {
    let serving = match admin.serving() {
        Ok(s) => s,
        Err(r) => return r,
    };
    let action = if pause { "pause" } else { "resume" };
    if let Err(why) = caller.check(Action::Operate, Some(&queue)) {
        return forbidden(serving.store.as_ref(), &caller, action, Some(&queue), "", why).await;
    }
    if let Err(e) = crate::names::check_queue(&queue) {
        return error(StatusCode::BAD_REQUEST, format!("queue {}: {e}", crate::names::printable(&queue)));
    }
    let entry = crate::store::AuditEntry::now(caller_name(&caller), action, Some(&queue), "");
    match serving.store.queue_pause(&queue, pause, Some(&entry)).await {
        Ok(changed) => {
            // This host at once; the others within PAUSE_POLL.
            for r in serving.runners.iter().filter(|r| r.spec.name == queue) {
                r.set_paused(pause);
            }
            Json(serde_json::json!({ "queue": queue, "paused": pause, "changed": changed })).into_response()
        }
        Err(e) => unavailable(e),
    }
}

/// `POST /v1/queues/{queue}/pause`
pub(super) async fn pause(State(admin): State<Arc<Admin>>, Extension(caller): Extension<Caller>, Path(queue): Path<String>) -> Response {
    pause_or_resume(admin, caller, queue, true).await
}

/// `POST /v1/queues/{queue}/resume`
pub(super) async fn resume(State(admin): State<Arc<Admin>>, Extension(caller): Extension<Caller>, Path(queue): Path<String>) -> Response {
    pause_or_resume(admin, caller, queue, false).await
}

/// `GET /v1/overview`: every queue of the caller's with its counts, pause,
/// oldest ready message, active version and this host's rates and
/// latency; the outbox per connector with its health.
pub(super) async fn overview(State(admin): State<Arc<Admin>>, Extension(caller): Extension<Caller>) -> Response {
    let serving = match admin.serving() {
        Ok(s) => s,
        Err(r) => return r,
    };
    let store = serving.store.as_ref();
    let (stats, paused, hosts) = match tokio::try_join!(store.stats(), store.queue_paused(), store.hosts_seen(HOSTS_WITHIN)) {
        Ok(x) => x,
        Err(e) => return unavailable(e),
    };
    let (mut queues, mut connectors) = crate::outbox::inspect::split_stats(&stats);
    // Queues this host serves show even when empty.
    for r in &serving.runners {
        if crate::outbox::connector_of(&r.spec.name).is_none() && !queues.iter().any(|q| q.queue == r.spec.name) {
            queues.push(crate::store::QueueStats {
                queue: r.spec.name.clone(),
                ..Default::default()
            });
        }
    }
    queues.retain(|q| caller.covers(&q.queue));
    queues.sort_by(|a, b| a.queue.cmp(&b.queue));
    connectors.retain(|c| caller.covers(&crate::names::outbox_queue(&c.connector)));
    let active = serving.deployer.active();
    let now_us = crate::store::now_micros();
    let mut out = Vec::new();
    for q in queues {
        let oldest = match store.message_browse(&q.queue, LiveState::Ready, None, 1).await {
            Ok(rows) => rows.first().map(|m| ((now_us - m.visible_at) / 1000).max(0)),
            Err(e) => return unavailable(e),
        };
        let runner = serving.runners.iter().find(|r| r.spec.name == q.queue);
        let p = paused.iter().find(|p| p.queue == q.queue);
        out.push(serde_json::json!({
            "stats": q,
            "paused": p.is_some(),
            "paused_by": p.map(|p| p.by.clone()),
            "oldest_ready_ms": oldest,
            "active_version": active.get(&q.queue),
            "here": runner.map(|r| here(&admin, r)),
        }));
    }
    let mut outbox = Vec::new();
    for c in connectors {
        let queue = crate::names::outbox_queue(&c.connector);
        // The retry backlog's first intent carries the last delivery error.
        let last_error = match store.message_browse(&queue, LiveState::Delayed, None, 1).await {
            Ok(rows) => rows.into_iter().next().and_then(|m| m.last_error),
            Err(e) => return unavailable(e),
        };
        let retrying = stats.queues.iter().find(|s| s.queue == queue).map_or(0, |s| s.delayed);
        outbox.push(serde_json::json!({ "stats": c, "retrying": retrying, "last_error": last_error }));
    }
    // Hosts serving any of the caller's queues, with those queues only.
    let hosts: Vec<serde_json::Value> = hosts
        .into_iter()
        .filter_map(|mut h| {
            h.queues.retain(|q| caller.covers(q));
            if h.queues.is_empty() {
                return None;
            }
            let ago_ms = ((now_us - h.seen_at) / 1000).max(0);
            let gone = ago_ms as u128 > 3 * crate::host::HOST_BEAT.as_millis();
            Some(serde_json::json!({ "host": h, "seen_ago_ms": ago_ms, "gone": gone }))
        })
        .collect();
    Json(serde_json::json!({ "queues": out, "outbox": outbox, "hosts": hosts, "store": store.kind() })).into_response()
}

/// How far back `/v1/overview` lists hosts: one not seen for three
/// heartbeats is shown as gone, for an hour.
const HOSTS_WITHIN: std::time::Duration = std::time::Duration::from_secs(3600);

/// This host's figures for a queue it serves: rates over the last minute
/// of samples, latency, in flight, outcomes per handler version.
fn here(admin: &Admin, r: &crate::protocol::QueueRunner) -> serde_json::Value {
    use std::sync::atomic::Ordering::Relaxed;
    let samples = admin.history.of(&r.spec.name);
    let rate = |f: fn(&super::console::Sample) -> u64| {
        let last = samples.last()?;
        let first = samples.iter().find(|s| last.t.saturating_sub(s.t) <= 60)?;
        let dt = last.t.saturating_sub(first.t);
        (dt > 0).then(|| f(last).saturating_sub(f(first)) as f64 / dt as f64)
    };
    serde_json::json!({
        "processed_per_s": rate(|s| s.processed),
        "failed_per_s": rate(|s| s.failures),
        // None until the host finished a message of the queue.
        "p50_ms": (r.metrics.finished() > 0).then(|| r.metrics.latency_quantile(0.5) as f64 / 1000.0),
        "p99_ms": (r.metrics.finished() > 0).then(|| r.metrics.latency_quantile(0.99) as f64 / 1000.0),
        "in_flight": r.metrics.in_flight.load(Relaxed),
        "paused": r.is_paused(),
        "versions": r.metrics.versions(),
    })
}

#[derive(serde::Deserialize)]
pub(super) struct HistoryQuery {
    queue: String,
}

/// `GET /v1/history?queue=Q`: this host's samples of the queue's books
/// over the last hour, every ten seconds.
pub(super) async fn history(
    State(admin): State<Arc<Admin>>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<HistoryQuery>,
) -> Response {
    if let Err(why) = caller.check(Action::Read, Some(&q.queue)) {
        return error(StatusCode::FORBIDDEN, why);
    }
    Json(serde_json::json!({
        "queue": q.queue,
        "every_s": super::console::SAMPLE_EVERY.as_secs(),
        "samples": admin.history.of(&q.queue),
    }))
    .into_response()
}

#[derive(serde::Deserialize)]
pub(super) struct DeliveredQuery {
    connector: String,
    key: Option<String>,
    limit: Option<usize>,
}

/// `GET /v1/outbox/delivered?connector=C[&key=TEXT]`: intents delivered
/// within the retention window, newest first, their key containing TEXT.
pub(super) async fn delivered(
    State(admin): State<Arc<Admin>>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<DeliveredQuery>,
) -> Response {
    let serving = match admin.serving() {
        Ok(s) => s,
        Err(r) => return r,
    };
    if let Err(why) = caller.check(Action::Read, Some(&crate::names::outbox_queue(&q.connector))) {
        return error(StatusCode::FORBIDDEN, why);
    }
    let limit = q.limit.unwrap_or(50).clamp(1, MAX_PAGE);
    match crate::outbox::inspect::delivered(serving.store.as_ref(), Some(&q.connector), serving.outbox_retention, SCAN_BUDGET).await {
        Ok(list) => {
            let list: Vec<_> = list
                .into_iter()
                .filter(|d| nonempty(&q.key).is_none_or(|k| d.idempotency_key.contains(k)))
                .take(limit)
                .collect();
            Json(list).into_response()
        }
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, format!("{e:#}")),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn view(payload: &str, attrs: &[(&str, &str)], error: Option<&str>) -> View {
        View {
            id: "m1".into(),
            queue: "q".into(),
            state: Status::Ready,
            payload_text: payload.into(),
            payload_base64: None,
            attributes: attrs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            deliveries: 0,
            failures: 0,
            enqueued_at: 1_000,
            at: 1_000,
            error: error.map(str::to_string),
            handler_version: None,
            payload: payload.as_bytes().to_vec(),
        }
    }

    fn m(f: Filter) -> Matcher {
        f.matcher().unwrap()
    }

    #[test]
    fn filters_match_fields_text_attributes_errors_and_times() {
        let v = view(
            r#"{"customer":{"id":42,"name":"Ada"},"items":[{"sku":"A-1"}]}"#,
            &[("tenant", "eu")],
            Some("insufficient funds"),
        );
        let f = |field: &str, value: &str| Filter {
            field: Some(field.into()),
            value: Some(value.into()),
            ..Filter::default()
        };
        assert!(m(f("customer.id", "42")).matches(&v));
        assert!(m(f("$.customer.id", "42")).matches(&v));
        assert!(!m(f("customer.id", "43")).matches(&v));
        assert!(m(f("customer.name", "Ada")).matches(&v), "plain text compares with a string");
        assert!(m(f("customer.name", "\"Ada\"")).matches(&v));
        assert!(m(f("items.0.sku", "A-1")).matches(&v));
        assert!(!m(f("items.1.sku", "A-1")).matches(&v));
        let exists = Filter {
            field: Some("customer".into()),
            ..Filter::default()
        };
        assert!(m(exists).matches(&v));
        let attr = |a: &str| Filter {
            attr: Some(a.into()),
            ..Filter::default()
        };
        assert!(m(attr("tenant=eu")).matches(&v) && m(attr("tenant")).matches(&v));
        assert!(!m(attr("tenant=us")).matches(&v) && !m(attr("region")).matches(&v));
        let err = |e: &str| Filter {
            error: Some(e.into()),
            ..Filter::default()
        };
        assert!(m(err("funds")).matches(&v) && !m(err("timeout")).matches(&v));
        let window = Filter {
            since: Some("999".into()),
            until: Some("1001".into()),
            ..Filter::default()
        };
        assert!(m(window).matches(&v));
        let later = Filter {
            since: Some("2026-01-01T00:00:00Z".into()),
            ..Filter::default()
        };
        assert!(!m(later).matches(&v));
        assert!(
            !m(f("customer.id", "42")).matches(&view("not json", &[], None)),
            "a field of a non-JSON payload never matches"
        );
    }

    #[test]
    fn reasons_group_with_numbers_and_ids_folded() {
        assert_eq!(
            reason_group("order o-6: amount must be positive, got -6"),
            reason_group("order o-17: amount must be positive, got -170")
        );
        assert_eq!(reason_group("order o-6: got -6"), "order o-#: got -#");
        assert_eq!(reason_group("version 4d467eec38649c4a failed"), "version … failed");
        assert_ne!(reason_group("unknown account"), reason_group("amount must be positive"));
        let v = view("{}", &[], Some("order o-9: unknown account acct-9"));
        let f = Filter {
            reason: Some("order o-#: unknown account acct-#".into()),
            ..Filter::default()
        };
        assert!(m(f).matches(&v));
    }

    #[test]
    fn bad_filters_are_named() {
        let no_field = Filter {
            value: Some("1".into()),
            ..Filter::default()
        };
        assert!(no_field.matcher().unwrap_err().contains("field"));
        let bad_time = Filter {
            since: Some("yesterday".into()),
            ..Filter::default()
        };
        assert!(bad_time.matcher().unwrap_err().contains("since"));
        assert!(parse_cursor("nonsense").is_err());
        assert_eq!(
            parse_cursor(&cursor(&BrowseKey { at: 5, id: "a:b".into() })).unwrap(),
            BrowseKey { at: 5, id: "a:b".into() }
        );
    }
}
