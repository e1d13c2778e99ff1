//! `POST /v1/queues/{queue}/messages`: send one message through a running
//! host, in the caller's trace. The body is the payload (bytes, as
//! `onceq send --file`); `?dedup_key=K&delay=30s` as `onceq send`'s
//! flags. A `traceparent` header (W3C; `tracestate` beside it) makes the
//! message a span of the caller's trace, as `TRACEPARENT` does for
//! `onceq send`; without one the message starts a trace of its own. A
//! malformed one is refused (400), never replaced. Needs role operator or
//! admin on the queue, which this host must serve; recorded in the audit
//! trail.

use super::{error, Admin, Caller};
use crate::trace::{TraceParent, TRACEPARENT_ATTRIBUTE, TRACESTATE_ATTRIBUTE};
use axum::body::Bytes;
use axum::extract::{Extension, Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::sync::Arc;

#[derive(Debug, serde::Deserialize)]
pub(super) struct SendQuery {
    dedup_key: Option<String>,
    delay: Option<String>,
}

pub(super) async fn send(
    State(admin): State<Arc<Admin>>,
    Extension(caller): Extension<Caller>,
    Path(queue): Path<String>,
    Query(q): Query<SendQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let serving = match admin.serving() {
        Ok(s) => s,
        Err(r) => return r,
    };
    // Role and queue were checked by `authenticate`, before the body.
    let Some(runner) = serving
        .runners
        .iter()
        .find(|r| r.spec.name == queue && crate::outbox::connector_of(&queue).is_none())
    else {
        let served: Vec<&str> = serving
            .runners
            .iter()
            .map(|r| r.spec.name.as_str())
            .filter(|n| crate::outbox::connector_of(n).is_none())
            .collect();
        return error(
            StatusCode::NOT_FOUND,
            format!(
                "queue {} is not served by this host (its queues: {})",
                crate::names::printable(&queue),
                served.join(", ")
            ),
        );
    };
    let parent =
        match headers.get("traceparent").map(|v| v.to_str().ok().and_then(TraceParent::parse)) {
            None => None,
            Some(Some(t)) => Some(t),
            Some(None) => return error(
                StatusCode::BAD_REQUEST,
                "traceparent header: not a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>); leave it out to start a trace for the message",
            ),
        };
    let state = headers
        .get("tracestate")
        .and_then(|v| v.to_str().ok())
        .filter(|s| parent.is_some() && !s.trim().is_empty())
        .map(str::to_string);
    let delay = match q.delay.as_deref().map(|d| crate::config::parse_duration("delay", d)) {
        None => None,
        Some(Ok(d)) if d > runner.spec.limits.max_delay => {
            return error(
                StatusCode::BAD_REQUEST,
                format!(
                    "delay {} is over the queue's max_delay of {}",
                    crate::names::duration(d),
                    crate::names::duration(runner.spec.limits.max_delay)
                ),
            )
        }
        Some(Ok(d)) => Some(d),
        Some(Err(e)) => return error(StatusCode::BAD_REQUEST, format!("{e:#}")),
    };
    if let Some(k) = &q.dedup_key {
        if let Err(e) = crate::names::check_key("dedup_key", k) {
            return error(StatusCode::BAD_REQUEST, e.to_string());
        }
    }
    let started = std::time::SystemTime::now();
    let context = parent.map_or_else(TraceParent::root, |p| p.child());
    let mut attributes = vec![(TRACEPARENT_ATTRIBUTE.to_string(), context.to_string())];
    if let Some(s) = &state {
        attributes.push((TRACESTATE_ATTRIBUTE.to_string(), s.clone()));
    }
    let bytes = body.len();
    let sent = serving
        .store
        .message_send(vec![crate::store::SendParams {
            queue: queue.clone(),
            payload: body.to_vec(),
            attributes,
            delay: delay.unwrap_or_default(),
            dedup_key: q.dedup_key.clone(),
            dedup_window: None,
            handoff: None,
        }])
        .await;
    let (id, duplicate) = match sent.map(|mut o| o.pop()) {
        Ok(Some(crate::store::SendOutcome::Sent { id })) => (id, false),
        Ok(Some(crate::store::SendOutcome::Duplicate { existing_id })) => (existing_id, true),
        Ok(None) => return error(StatusCode::SERVICE_UNAVAILABLE, "the store sent nothing back"),
        Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    };
    if !duplicate {
        serving.telemetry.sent(&queue, &context, parent.as_ref(), state.as_deref(), started);
    }
    let subject = format!("{id} ({bytes} bytes{})", if duplicate { ", a duplicate: dropped" } else { "" });
    let entry = crate::store::AuditEntry::now(caller.name(), "send", Some(&queue), &subject);
    if let Err(e) = serving.store.audit_append(&entry).await {
        tracing::warn!(queue = %queue, "a message sent through the admin API is not in the audit trail: {e}");
    }
    Json(serde_json::json!({
        "queue": queue,
        "id": id,
        "duplicate": duplicate,
        "traceparent": context.to_string(),
    }))
    .into_response()
}
