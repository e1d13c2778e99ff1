//! The connectors an intent can be delivered through: `webhook` (HTTP POST
//! with an `Idempotency-Key` header), `file` (JSON lines, for demos and
//! local development) and `log`.

use super::{Connector, Intent};
use anyhow::{bail, Context};
use async_trait::async_trait;
use base64::Engine;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// The longest `Retry-After` honoured; a larger one is capped.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// Bytes of a refusing response's body kept in the dead letter's reason.
const BODY_EXCERPT: usize = 512;

/// What became of one delivery.
#[derive(Debug, Clone, PartialEq)]
pub enum Delivery {
    /// The far side has it (or already had it).
    Delivered(String),
    /// Try again later: after `after` if the far side said so, else after
    /// the outbox's backoff.
    Retry { reason: String, after: Option<Duration> },
    /// The far side refused it for good: dead-letter the intent.
    Refused(String),
}

/// A connector as configured (`[[connector]]` in `onceq.toml`).
#[derive(Debug, Clone)]
pub enum ConnectorConfig {
    Webhook {
        url: String,
        /// Whole-request timeout.
        timeout: Duration,
        /// Extra headers sent with every request.
        headers: Vec<(String, String)>,
        /// Environment variable holding a bearer token for `Authorization`.
        bearer_token_env: Option<String>,
    },
    File {
        path: PathBuf,
    },
    Log,
}

impl ConnectorConfig {
    pub fn kind(&self) -> &'static str {
        match self {
            ConnectorConfig::Webhook { .. } => "webhook",
            ConnectorConfig::File { .. } => "file",
            ConnectorConfig::Log => "log",
        }
    }

    /// Build the connector (an HTTP client, an output path).
    pub fn build(&self, name: &str) -> anyhow::Result<Arc<dyn Connector>> {
        Ok(match self {
            ConnectorConfig::Webhook {
                url,
                timeout,
                headers,
                bearer_token_env,
            } => Arc::new(Webhook::new(name, url, *timeout, headers, bearer_token_env.as_deref())?),
            ConnectorConfig::File { path } => Arc::new(FileConnector::new(path.clone())),
            ConnectorConfig::Log => Arc::new(LogConnector),
        })
    }
}

/// HTTP POST of the payload, with `Idempotency-Key` and the intent's
/// metadata as headers. Headers the operator configured (`headers`,
/// `bearer_token_env`) and the host's own (`Idempotency-Key`,
/// `Content-Length`, `Host`, `User-Agent`, ...) always win over metadata.
///
/// - 2xx and 409 (the far side already has this key): delivered;
/// - 408, 429 and 5xx: retried, after `Retry-After` if given;
/// - timeouts and connection errors: retried;
/// - any other status (4xx, a redirect): refused, with the status and the
///   start of the body.
pub struct Webhook {
    client: reqwest::Client,
    url: reqwest::Url,
    headers: reqwest::header::HeaderMap,
    timeout: Duration,
}

impl Webhook {
    pub fn new(
        name: &str,
        url: &str,
        timeout: Duration,
        headers: &[(String, String)],
        bearer_token_env: Option<&str>,
    ) -> anyhow::Result<Webhook> {
        let url = reqwest::Url::parse(url).with_context(|| format!("connector {name}: url {url:?} is not a URL"))?;
        if !matches!(url.scheme(), "http" | "https") {
            bail!("connector {name}: url {url} must be http:// or https://");
        }
        let mut map = reqwest::header::HeaderMap::new();
        for (k, v) in headers {
            let name_ = reqwest::header::HeaderName::from_bytes(k.as_bytes())
                .with_context(|| format!("connector {name}: {k:?} is not a valid HTTP header name"))?;
            let value =
                reqwest::header::HeaderValue::from_str(v).with_context(|| format!("connector {name}: header {k} has an invalid value"))?;
            map.insert(name_, value);
        }
        if let Some(var) = bearer_token_env {
            let token = std::env::var(var).with_context(|| format!("connector {name}: bearer_token_env names {var}, which is not set"))?;
            let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {token}"))
                .with_context(|| format!("connector {name}: the token in {var} is not a valid header value"))?;
            value.set_sensitive(true);
            map.insert(reqwest::header::AUTHORIZATION, value);
        }
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout.min(Duration::from_secs(5)))
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("onceq/", env!("CARGO_PKG_VERSION")))
            .build()
            .with_context(|| format!("connector {name}: building the HTTP client"))?;
        Ok(Webhook {
            client,
            url,
            headers: map,
            timeout,
        })
    }
}

/// `Retry-After`: delay-seconds or an HTTP date.
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let v = value.trim();
    let d = match v.parse::<u64>() {
        Ok(secs) => Duration::from_secs(secs),
        Err(_) => httpdate::parse_http_date(v).ok()?.duration_since(now).unwrap_or(Duration::ZERO),
    };
    Some(d.min(MAX_RETRY_AFTER))
}

#[async_trait]
impl Connector for Webhook {
    fn kind(&self) -> &'static str {
        "webhook"
    }

    async fn deliver(&self, intent: &Intent) -> Delivery {
        let mut headers = self.headers.clone();
        for (k, v) in &intent.metadata {
            let (Ok(name), Ok(value)) = (
                reqwest::header::HeaderName::from_bytes(k.as_bytes()),
                reqwest::header::HeaderValue::from_str(v),
            ) else {
                return Delivery::Refused(format!("metadata {} cannot be sent as an HTTP header", crate::names::quoted(k, 40)));
            };
            // The operator's headers and the host's own always win: a
            // handler cannot forge credentials, routing or framing. (The
            // effect check refuses such names; this guards older intents.)
            let id = crate::protocol::effects::header_identity(k);
            let operators = self
                .headers
                .keys()
                .any(|h| crate::protocol::effects::header_identity(h.as_str()) == id);
            if operators || crate::protocol::effects::is_protected_header(k) {
                tracing::warn!(
                    intent = %intent.idempotency_key,
                    "intent metadata {} not sent: the header is set by the operator or the host",
                    crate::names::quoted(k, 40)
                );
                continue;
            }
            headers.insert(name, value);
        }
        let key = match reqwest::header::HeaderValue::from_str(&intent.idempotency_key) {
            Ok(k) => k,
            Err(_) => {
                return Delivery::Refused(format!(
                    "idempotency key {:?} cannot be sent as an HTTP header",
                    intent.idempotency_key
                ))
            }
        };
        headers.insert("idempotency-key", key);
        // The intent's trace reaches the receiver, unless the operator's
        // headers say otherwise.
        for (name, value) in [("traceparent", &intent.traceparent), ("tracestate", &intent.tracestate)] {
            if let Some(v) = value.as_deref().and_then(|v| reqwest::header::HeaderValue::from_str(v).ok()) {
                if !self.headers.contains_key(name) {
                    headers.insert(name, v);
                }
            }
        }
        if !headers.contains_key(reqwest::header::CONTENT_TYPE) {
            let ct = if serde_json::from_slice::<serde::de::IgnoredAny>(&intent.payload).is_ok() {
                "application/json"
            } else {
                "application/octet-stream"
            };
            headers.insert(reqwest::header::CONTENT_TYPE, reqwest::header::HeaderValue::from_static(ct));
        }
        let sent = self
            .client
            .post(self.url.clone())
            .headers(headers)
            .body(intent.payload.clone())
            .send()
            .await;
        let resp = match sent {
            Ok(r) => r,
            Err(e) if e.is_timeout() => {
                return Delivery::Retry {
                    reason: format!("POST {} timed out after {:?}", self.url, self.timeout),
                    after: None,
                }
            }
            Err(e) => {
                return Delivery::Retry {
                    reason: format!("POST {} failed: {}", self.url, error_chain(&e)),
                    after: None,
                }
            }
        };
        let status = resp.status();
        if status.is_success() || status == reqwest::StatusCode::CONFLICT {
            return Delivery::Delivered(format!("HTTP {status}"));
        }
        let retry_after = resp
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, SystemTime::now()));
        let body = excerpt(resp).await;
        let what = format!(
            "POST {} answered HTTP {status}{}{}",
            self.url,
            if body.is_empty() { "" } else { ": " },
            body.trim()
        );
        if status.is_server_error() || status == reqwest::StatusCode::TOO_MANY_REQUESTS || status == reqwest::StatusCode::REQUEST_TIMEOUT {
            Delivery::Retry {
                reason: what,
                after: retry_after,
            }
        } else {
            Delivery::Refused(what)
        }
    }
}

/// The start of a refusing response's body, at most [`BODY_EXCERPT`]
/// bytes, read chunk by chunk: the rest is never read (the connection is
/// dropped with the response), so a receiver answering with an endless
/// body costs the host no more than this.
async fn excerpt(mut resp: reqwest::Response) -> String {
    let mut kept: Vec<u8> = Vec::new();
    while kept.len() < BODY_EXCERPT {
        match resp.chunk().await {
            Ok(Some(chunk)) => kept.extend_from_slice(&chunk[..chunk.len().min(BODY_EXCERPT - kept.len())]),
            Ok(None) | Err(_) => break,
        }
    }
    String::from_utf8_lossy(&kept).into_owned()
}

/// An error with its causes ("error sending request: connection closed").
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// One JSON object per line, appended and synced to disk before the
/// intent counts as delivered. A crash between the append and the ack
/// leaves the line and delivers it again: readers deduplicate by key.
///
/// Concurrent deliveries share their syncs (a group fsync): a delivery
/// whose line an fsync begun after its write covered is done without one
/// of its own: with an fsync per line, the deliveries were what every
/// message waited for.
pub struct FileConnector {
    path: PathBuf,
    /// Lines written (a line's ticket is the count after its write).
    written: std::sync::atomic::AtomicU64,
    /// Lines known synced; the lock is held by the one fsync running.
    synced: tokio::sync::Mutex<u64>,
    /// Fsyncs run.
    syncs: std::sync::atomic::AtomicU64,
}

impl FileConnector {
    pub fn new(path: PathBuf) -> FileConnector {
        FileConnector {
            path,
            written: Default::default(),
            synced: tokio::sync::Mutex::new(0),
            syncs: Default::default(),
        }
    }

    /// Append `line` (one write: concurrent writers, of this host or
    /// others, never interleave within a line).
    async fn append(&self, line: String) -> std::io::Result<()> {
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            if let Some(dir) = path.parent() {
                if !dir.as_os_str().is_empty() {
                    std::fs::create_dir_all(dir)?;
                }
            }
            let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&path)?;
            f.write_all(line.as_bytes())
        })
        .await
        .map_err(std::io::Error::other)?
    }

    /// Wait until line `ticket` is on disk: synced by an fsync begun after
    /// it was written, this one's or another delivery's.
    async fn sync(&self, ticket: u64) -> std::io::Result<()> {
        let mut synced = self.synced.lock().await;
        if *synced >= ticket {
            return Ok(());
        }
        // Every line counted now was written before this fsync begins.
        let upto = self.written.load(std::sync::atomic::Ordering::Acquire);
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || std::fs::OpenOptions::new().append(true).open(&path)?.sync_data())
            .await
            .map_err(std::io::Error::other)??;
        self.syncs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        *synced = upto;
        Ok(())
    }
}

/// A line of the `file` connector's output.
pub fn file_line(intent: &Intent) -> serde_json::Value {
    let mut line = serde_json::json!({
        "connector": intent.connector,
        "idempotency_key": intent.idempotency_key,
        "metadata": intent.metadata.iter().map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone()))).collect::<serde_json::Map<String, serde_json::Value>>(),
        "source_queue": intent.source_queue,
        "source_message_id": intent.source_message_id,
        "source_version": intent.source_version,
        "attempt": intent.attempt,
    });
    if let Some(t) = &intent.traceparent {
        line["traceparent"] = serde_json::Value::String(t.clone());
    }
    let payload = match serde_json::from_slice::<serde_json::Value>(&intent.payload) {
        Ok(v) => ("payload", v),
        Err(_) => match std::str::from_utf8(&intent.payload) {
            Ok(t) => ("payload", serde_json::Value::String(t.to_string())),
            Err(_) => (
                "payload_base64",
                serde_json::Value::String(base64::engine::general_purpose::STANDARD.encode(&intent.payload)),
            ),
        },
    };
    if let Some(o) = line.as_object_mut() {
        o.insert(payload.0.to_string(), payload.1);
    }
    line
}

#[async_trait]
impl Connector for FileConnector {
    fn kind(&self) -> &'static str {
        "file"
    }

    async fn deliver(&self, intent: &Intent) -> Delivery {
        let mut line = file_line(intent).to_string();
        line.push('\n');
        let written = async {
            self.append(line).await?;
            let ticket = self.written.fetch_add(1, std::sync::atomic::Ordering::AcqRel) + 1;
            self.sync(ticket).await
        };
        match written.await {
            Ok(()) => Delivery::Delivered(format!("appended to {}", self.path.display())),
            Err(e) => Delivery::Retry {
                reason: format!("writing {}: {e}", self.path.display()),
                after: None,
            },
        }
    }
}

/// Logs the intent (target `onceq::outbox`) and counts it delivered.
pub struct LogConnector;

#[async_trait]
impl Connector for LogConnector {
    fn kind(&self) -> &'static str {
        "log"
    }

    async fn deliver(&self, intent: &Intent) -> Delivery {
        tracing::info!(
            target: "onceq::outbox",
            connector = %intent.connector,
            idempotency_key = %intent.idempotency_key,
            source_queue = %intent.source_queue,
            source_message_id = %intent.source_message_id,
            payload = %intent.payload_text(),
            "intent"
        );
        Delivery::Delivered("logged".into())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn retry_after_seconds_and_dates() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(parse_retry_after("7", now), Some(Duration::from_secs(7)));
        let later = httpdate::fmt_http_date(now + Duration::from_secs(90));
        assert_eq!(parse_retry_after(&later, now), Some(Duration::from_secs(90)));
        let earlier = httpdate::fmt_http_date(now - Duration::from_secs(90));
        assert_eq!(parse_retry_after(&earlier, now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("999999", now), Some(MAX_RETRY_AFTER));
        assert_eq!(parse_retry_after("soon", now), None);
    }

    #[test]
    fn file_lines_keep_json_payloads_as_json() {
        let mut i = Intent {
            connector: "c".into(),
            idempotency_key: "k".into(),
            payload: br#"{"a":1}"#.to_vec(),
            metadata: vec![("m".into(), "v".into())],
            source_queue: "q".into(),
            source_message_id: "id".into(),
            source_version: None,
            traceparent: None,
            tracestate: None,
            id: "x".into(),
            attempt: 1,
        };
        let line = file_line(&i);
        assert_eq!(line["payload"]["a"], 1);
        assert_eq!(line["metadata"]["m"], "v");
        i.payload = vec![0xff, 0x00];
        assert_eq!(file_line(&i)["payload_base64"], "/wA=");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_file_deliveries_share_their_fsyncs_and_every_line_lands_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out/charges.jsonl");
        let c = Arc::new(FileConnector::new(path.clone()));
        let mut tasks = tokio::task::JoinSet::new();
        for n in 0..64 {
            let c = c.clone();
            tasks.spawn(async move {
                let i = Intent {
                    connector: "c".into(),
                    idempotency_key: format!("k{n}"),
                    payload: format!(r#"{{"n":{n}}}"#).into_bytes(),
                    metadata: vec![],
                    source_queue: "q".into(),
                    source_message_id: format!("m{n}"),
                    source_version: None,
                    traceparent: None,
                    tracestate: None,
                    id: format!("x{n}"),
                    attempt: 1,
                };
                c.deliver(&i).await
            });
        }
        while let Some(d) = tasks.join_next().await {
            assert!(matches!(d.unwrap(), Delivery::Delivered(_)));
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let mut keys: Vec<String> = text
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["idempotency_key"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), 64, "every line, whole, once");
        let syncs = c.syncs.load(std::sync::atomic::Ordering::Relaxed);
        assert!((1..64).contains(&syncs), "64 concurrent deliveries shared fsyncs: {syncs}");
    }
}
