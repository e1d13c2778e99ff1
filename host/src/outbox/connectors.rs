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
/// Concurrent deliveries share their writes and syncs (a group write):
/// lines queue while a write runs, and the next write appends every queued
/// line at once, then one fsync covers them all; before it takes a group,
/// the writer yields to deliveries already under way. With a blocking-pool call,
/// an open and a write per line and an fsync per group, the file connector
/// was a thread hand-off and four system calls per intent
/// (docs/src/benchmarks.md).
pub struct FileConnector {
    shared: Arc<FileShared>,
}

struct FileShared {
    path: PathBuf,
    queued: std::sync::Mutex<Queued>,
    /// Group writes run (one write and one fsync each).
    syncs: std::sync::atomic::AtomicU64,
}

/// The lines waiting for the next group write, and who waits for each.
#[derive(Default)]
struct Queued {
    lines: Vec<u8>,
    waiting: Vec<tokio::sync::oneshot::Sender<Result<(), String>>>,
    /// A writer task is running (it takes whatever is queued before it
    /// stops).
    writing: bool,
}

impl FileShared {
    fn queued(&self) -> std::sync::MutexGuard<'_, Queued> {
        // Nothing panics while holding it; a poisoned queue is still whole.
        self.queued.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Write what is queued, one group at a time, until nothing is. A task
    /// of its own: a delivery given up by its caller does not stop the
    /// writes the others wait for.
    fn write_queued(self: Arc<Self>) -> impl std::future::Future<Output = ()> + Send + 'static {
        // Dropped with the task however it ends early (the runtime shutting
        // down drops it mid-write, or before it first ran): the next
        // delivery then starts a writer, which takes what is still queued,
        // where `writing` left set would have made every later delivery
        // wait for good. A writer that runs out of work clears `writing`
        // itself, under the same lock that found the queue empty, so no
        // delivery queued in between is missed.
        struct Stopped {
            shared: Arc<FileShared>,
            finished: bool,
        }
        impl Drop for Stopped {
            fn drop(&mut self) {
                if !self.finished {
                    self.shared.queued().writing = false;
                }
            }
        }
        let stopped = Stopped {
            shared: self.clone(),
            finished: false,
        };
        async move {
            let mut stopped = stopped; // moved in whole: dropped with the task
            loop {
                // Deliveries arrive in bursts (a batch's intents handed to
                // the outbox workers at once): before taking a group, let
                // the ones already woken queue their lines, yielding while
                // the group still grows, so fewer fsyncs cover them (a
                // group of ~4 lines, an fsync each, was 9% of a CLI run's
                // CPU). No timer: a lone delivery is written at once.
                let mut queued = self.queued().waiting.len();
                for _ in 0..FILE_GROUP_YIELDS {
                    tokio::task::yield_now().await;
                    let now = self.queued().waiting.len();
                    if now == queued {
                        break;
                    }
                    queued = now;
                }
                let (lines, waiting) = {
                    let mut q = self.queued();
                    if q.waiting.is_empty() {
                        q.writing = false;
                        stopped.finished = true;
                        return;
                    }
                    (std::mem::take(&mut q.lines), std::mem::take(&mut q.waiting))
                };
                let path = self.path.clone();
                // One write: the group's lines land whole and together (the
                // file is opened to append, so writers of other hosts never
                // interleave within a line).
                let written = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
                    let open = || std::fs::OpenOptions::new().create(true).append(true).open(&path);
                    // Its folder made only when missing (a failed mkdir for
                    // every group, otherwise).
                    let mut f = match open() {
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                                std::fs::create_dir_all(dir)?;
                            }
                            open()?
                        }
                        other => other?,
                    };
                    f.write_all(&lines)?;
                    f.sync_data()
                })
                .await
                .map_err(std::io::Error::other)
                .and_then(|r| r)
                .map_err(|e| e.to_string());
                self.syncs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                for w in waiting {
                    let _ = w.send(written.clone()); // a caller that gave up is not waiting
                }
            }
        }
    }
}

impl FileConnector {
    pub fn new(path: PathBuf) -> FileConnector {
        FileConnector {
            shared: Arc::new(FileShared {
                path,
                queued: Default::default(),
                syncs: Default::default(),
            }),
        }
    }

    /// Append `line` and wait until it is on disk: written and synced by
    /// the group write that took it.
    async fn append_synced(&self, line: &[u8]) -> Result<(), String> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let start_writer = {
            let mut q = self.shared.queued();
            q.lines.extend_from_slice(line);
            q.waiting.push(tx);
            !std::mem::replace(&mut q.writing, true)
        };
        if start_writer {
            tokio::spawn(self.shared.clone().write_queued());
        }
        rx.await.map_err(|_| "the file's writer stopped".to_string())?
    }
}

/// How many times a file connector's writer yields for its group to grow
/// (it stops as soon as a yield added nothing).
const FILE_GROUP_YIELDS: usize = 8;

/// Concurrent deliveries of a `file` connector by default.
pub const FILE_WORKERS: usize = 64;

/// A line of the `file` connector's output: a JSON object, its keys in
/// alphabetical order, then a newline. The payload is kept as JSON when it
/// is JSON (its keys sorted too), as text when it is other UTF-8, and as
/// base64 under `payload_base64` otherwise; `source_version` is `null`
/// when unknown, `traceparent` only there when the intent carries one.
///
/// Written straight from the intent's fields: building a
/// `serde_json::Value` of the whole line and formatting it was about 6% of
/// the workers' time in a CLI run of 20,000 payments messages.
pub fn file_line(intent: &Intent) -> Vec<u8> {
    #[derive(serde::Serialize)]
    #[serde(untagged)]
    enum Payload<'a> {
        Json(serde_json::Value),
        Text(&'a str),
    }
    // Fields in alphabetical order, as a `serde_json::Map` writes its keys.
    #[derive(serde::Serialize)]
    struct Line<'a> {
        attempt: u32,
        connector: &'a str,
        idempotency_key: &'a str,
        /// Sorted, the last of a repeated name kept.
        metadata: std::collections::BTreeMap<&'a str, &'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        payload: Option<Payload<'a>>,
        #[serde(skip_serializing_if = "Option::is_none")]
        payload_base64: Option<String>,
        source_message_id: &'a str,
        source_queue: &'a str,
        source_version: Option<&'a str>,
        #[serde(skip_serializing_if = "Option::is_none")]
        traceparent: Option<&'a str>,
    }
    let (payload, payload_base64) = match serde_json::from_slice::<serde_json::Value>(&intent.payload) {
        Ok(v) => (Some(Payload::Json(v)), None),
        Err(_) => match std::str::from_utf8(&intent.payload) {
            Ok(t) => (Some(Payload::Text(t)), None),
            Err(_) => (None, Some(base64::engine::general_purpose::STANDARD.encode(&intent.payload))),
        },
    };
    let line = Line {
        attempt: intent.attempt,
        connector: &intent.connector,
        idempotency_key: &intent.idempotency_key,
        metadata: intent.metadata.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect(),
        payload,
        payload_base64,
        source_message_id: &intent.source_message_id,
        source_queue: &intent.source_queue,
        source_version: intent.source_version.as_deref(),
        traceparent: intent.traceparent.as_deref(),
    };
    let mut out = Vec::with_capacity(256 + intent.payload.len());
    // Cannot fail: writing to a Vec does not, every key is a string and
    // every value serializes.
    let _ = serde_json::to_writer(&mut out, &line);
    out.push(b'\n');
    out
}

#[async_trait]
impl Connector for FileConnector {
    fn kind(&self) -> &'static str {
        "file"
    }

    /// More than a webhook's: concurrent deliveries share one write and
    /// one fsync ([`FileConnector`]), so more at once cost the disk nothing
    /// more, and each holds its worker for about two fsyncs (its group's
    /// and the one before). With 16, delivery was what a CLI run of
    /// 20,000 payments messages waited for: 2.3 s, against 1.6 s with 64
    /// (docs/src/benchmarks.md).
    fn default_workers(&self) -> usize {
        FILE_WORKERS
    }

    /// A worker's intents join one group write together, where each used
    /// to wait for the group of the one before it: through the CLI
    /// (20,000 payments messages) the run took 4-15% less time (medians
    /// of alternated pairs, docs/src/benchmarks.md).
    fn delivers_together(&self) -> bool {
        true
    }

    async fn deliver(&self, intent: &Intent) -> Delivery {
        match self.append_synced(&file_line(intent)).await {
            Ok(()) => Delivery::Delivered(format!("appended to {}", self.shared.path.display())),
            Err(e) => Delivery::Retry {
                reason: format!("writing {}: {e}", self.shared.path.display()),
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
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// An intent of connector `c` with key `key` and `payload`.
    fn intent(key: &str, payload: &[u8]) -> Intent {
        Intent {
            connector: "c".into(),
            idempotency_key: key.into(),
            payload: payload.to_vec(),
            metadata: vec![],
            source_queue: "q".into(),
            source_message_id: "id".into(),
            source_version: None,
            traceparent: None,
            tracestate: None,
            id: "x".into(),
            attempt: 1,
        }
    }

    /// The idempotency keys of a file connector's lines, in order.
    fn keys_in(path: &std::path::Path) -> Vec<String> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["idempotency_key"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect()
    }

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
    fn file_lines_keep_json_payloads_as_json_with_every_key_sorted() {
        let mut i = intent("k", br#"{"b": [1, 2.5], "a": {"y": null, "x": "\u00e9"}}"#);
        i.metadata = vec![("z".into(), "1".into()), ("m".into(), "v".into()), ("z".into(), "2".into())];
        let line = |i: &Intent| String::from_utf8(file_line(i)).unwrap();
        assert_eq!(
            line(&i),
            concat!(
                r#"{"attempt":1,"connector":"c","idempotency_key":"k","metadata":{"m":"v","z":"2"},"#,
                r#""payload":{"a":{"x":"é","y":null},"b":[1,2.5]},"source_message_id":"id","source_queue":"q","#,
                r#""source_version":null}"#,
                "\n"
            )
        );
        i.payload = b"not json \"quoted\"".to_vec();
        i.source_version = Some("v1".into());
        i.traceparent = Some("00-abc-def-01".into());
        i.metadata.clear();
        assert_eq!(
            line(&i),
            concat!(
                r#"{"attempt":1,"connector":"c","idempotency_key":"k","metadata":{},"payload":"not json \"quoted\"","#,
                r#""source_message_id":"id","source_queue":"q","source_version":"v1","traceparent":"00-abc-def-01"}"#,
                "\n"
            )
        );
        i.payload = vec![0xff, 0x00];
        let v: serde_json::Value = serde_json::from_slice(&file_line(&i)).unwrap();
        assert_eq!(v["payload_base64"], "/wA=");
        assert!(v.get("payload").is_none());
    }

    #[tokio::test]
    async fn a_file_connector_makes_its_missing_folders_and_appends_whole_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("not").join("yet").join("out.jsonl");
        let c = FileConnector::new(path.clone());
        let mut i = intent("k1", br#"{"n":1}"#);
        assert!(matches!(c.deliver(&i).await, Delivery::Delivered(_)));
        i.idempotency_key = "k2".into();
        assert!(matches!(c.deliver(&i).await, Delivery::Delivered(_)));
        assert_eq!(keys_in(&path), ["k1", "k2"]);
    }

    #[tokio::test]
    async fn a_file_connector_works_more_deliveries_at_once_unless_outbox_workers_is_set() {
        let (dir, store) = crate::protocol::testing::store();
        let file: Arc<dyn Connector> = Arc::new(FileConnector::new(dir.path().join("out.jsonl")));
        let log: Arc<dyn Connector> = Arc::new(LogConnector);
        let by_default = crate::outbox::OutboxSettings::default();
        let workers = |c: &Arc<dyn Connector>, s: &crate::outbox::OutboxSettings| {
            crate::outbox::runner(store.clone(), "c", c.clone(), s).spec.policy.workers
        };
        assert_eq!(workers(&file, &by_default), FILE_WORKERS);
        assert_eq!(workers(&log, &by_default), crate::outbox::DEFAULT_WORKERS);
        let set = crate::outbox::OutboxSettings {
            workers: Some(3),
            ..by_default
        };
        assert_eq!((workers(&file, &set), workers(&log, &set)), (3, 3));
    }

    #[test]
    fn a_file_writer_dropped_before_it_ran_does_not_leave_later_deliveries_waiting() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("charges.jsonl");
        let c = FileConnector::new(path.clone());
        {
            // A delivery queues its line and spawns the writer; the runtime
            // then shuts down before the writer ever runs.
            let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
            rt.block_on(async {
                use std::future::Future;
                let mut first = Box::pin(c.append_synced(b"first\n"));
                std::future::poll_fn(|cx| {
                    assert!(first.as_mut().poll(cx).is_pending());
                    std::task::Poll::Ready(())
                })
                .await;
            });
        }
        assert!(!c.shared.queued().writing, "a dropped writer clears `writing`");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            tokio::time::timeout(std::time::Duration::from_secs(60), c.append_synced(b"second\n"))
                .await
                .expect("a later delivery starts a writer of its own")
                .unwrap();
        });
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "first\nsecond\n",
            "what was still queued is written too"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_file_deliveries_share_their_fsyncs_and_every_line_lands_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out/charges.jsonl");
        let c = Arc::new(FileConnector::new(path.clone()));
        let mut tasks = tokio::task::JoinSet::new();
        for n in 0..64 {
            let c = c.clone();
            tasks.spawn(async move { c.deliver(&intent(&format!("k{n}"), format!(r#"{{"n":{n}}}"#).as_bytes())).await });
        }
        while let Some(d) = tasks.join_next().await {
            assert!(matches!(d.unwrap(), Delivery::Delivered(_)));
        }
        let mut keys = keys_in(&path);
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), 64, "every line, whole, once");
        let syncs = c.shared.syncs.load(std::sync::atomic::Ordering::Relaxed);
        assert!((1..64).contains(&syncs), "64 concurrent deliveries shared fsyncs: {syncs}");
    }
}
