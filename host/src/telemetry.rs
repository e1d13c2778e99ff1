//! OpenTelemetry traces of messages, exported over OTLP.
//!
//! A message's story crosses processes and time: `onceq send` creates it,
//! a host leases it (maybe several times, on several hosts), its handler
//! runs, a batch commits it with others, its follow-ups are processed on
//! other queues and its intents are delivered later by the outbox. Each
//! step is a span by the OpenTelemetry messaging conventions, and all of
//! them land in the trace the message was created in (its
//! `onceq.traceparent`, [`crate::trace`]):
//!
//! | span | kind | where |
//! |---|---|---|
//! | `send {queue}` | producer | `onceq send`, one per message; its span id is the message's creation context |
//! | `process {queue}` | consumer | each run of the handler (a re-run after an abort or an unknown outcome is another), a child of the creation context (or a new trace with a link to it: `telemetry.propagation = "link"`), always linked to it |
//! | `handle {queue}` | internal | the handler call; its `ctx.log` lines are its events |
//! | `get {table}` / `scan {table}` | client | a store read of the call |
//! | `settle {queue}` | client | the ack committed with the effects, or the failure recorded |
//! | `send {queue}` / `create {connector}` | producer | each follow-up and intent of the run that committed; the span id is the effect's derived context |
//! | `commit` | internal | one group commit: `messaging.batch.message_count`, a link per message's `settle` span |
//! | `renew {queue}` | client | one lease renewal of a worker's batch, a link per renewed message's creation context |
//! | `send {connector}` | client | an outbox delivery (under the outbox queue's `process` span); a webhook receives its context as `traceparent` |
//!
//! Failures, re-runs, retries, dead letters, "already committed" and a
//! lost lease are span status and events, with the reason.
//!
//! Off by default: a [`Telemetry::off`] handle is a `None`, every call on
//! it returns at once, and no span, attribute or clock read is made.
//!
//! Span ids: a span whose id is already written in a message (the
//! creation context of a sent message, a follow-up, an intent) is started
//! with that id ([`ChosenIds`]), so the `process` span of the message
//! names an exported parent.

use crate::trace::TraceParent;
use opentelemetry::trace::{
    Link, Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId, TraceState, Tracer as _,
    TracerProvider as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator, SdkTracer, SdkTracerProvider};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// `messaging.system` of every span.
pub const MESSAGING_SYSTEM: &str = "onceq";

/// How long [`Telemetry::shutdown`] waits for the last spans to be sent.
pub const SHUTDOWN_FLUSH: Duration = Duration::from_secs(5);

/// How a `process` span relates to its message's creation context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Propagation {
    /// A child of the creation context (and linked to it): one trace from
    /// `send` to the webhook.
    #[default]
    Child,
    /// The root of a trace of its own, linked to the creation context (a
    /// trace per delivery, for producers whose traces must stay small).
    Link,
}

/// The OTLP transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// `http/protobuf` (port 4318).
    HttpProtobuf,
    /// `grpc` (port 4317).
    Grpc,
}

impl Protocol {
    pub fn parse(text: &str) -> Option<Protocol> {
        match text.trim() {
            "http/protobuf" | "http" => Some(Protocol::HttpProtobuf),
            "grpc" => Some(Protocol::Grpc),
            _ => None,
        }
    }
}

/// `[telemetry]`, resolved; the `OTEL_*` variables fill what it leaves
/// out ([`TelemetryConfig::resolve`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TelemetryConfig {
    /// `telemetry.enabled`; unset: on when `OTEL_TRACES_EXPORTER=otlp`.
    pub enabled: Option<bool>,
    /// Collector base URL (`/v1/traces` is added for HTTP); unset: the
    /// `OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT` variables, else localhost.
    pub endpoint: Option<String>,
    /// Unset: `OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL`, else HTTP.
    pub protocol: Option<Protocol>,
    /// `service.name`; `OTEL_SERVICE_NAME` wins, else `onceq`.
    pub service_name: Option<String>,
    /// Extra headers on every export request (an API key).
    pub headers: BTreeMap<String, String>,
    /// Deadline of one export request.
    pub timeout: Option<Duration>,
    pub propagation: Propagation,
}

/// What [`TelemetryConfig::resolve`] decided.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    pub protocol: Protocol,
    /// `None`: the exporter reads the `OTEL_*` endpoint variables.
    pub endpoint: Option<String>,
}

impl TelemetryConfig {
    /// Whether to export, and how, from this config and `env` (a lookup of
    /// the process environment; tests pass their own). `Ok(None)`: off.
    pub fn resolve(&self, env: impl Fn(&str) -> Option<String>) -> anyhow::Result<Option<Resolved>> {
        let var = |k: &str| env(k).filter(|v| !v.trim().is_empty());
        if var("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
            return Ok(None);
        }
        let exporter = var("OTEL_TRACES_EXPORTER");
        let on = match (self.enabled, exporter.as_deref().map(str::trim)) {
            (Some(false), _) | (None, None) => false,
            (_, Some("none")) => false,
            (Some(true), None | Some("otlp")) | (None, Some("otlp")) => true,
            (_, Some(other)) => anyhow::bail!("OTEL_TRACES_EXPORTER={other}: onceq exports traces over OTLP only (use otlp or none)"),
        };
        if !on {
            return Ok(None);
        }
        let protocol = match self.protocol {
            Some(p) => p,
            None => match var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL").or_else(|| var("OTEL_EXPORTER_OTLP_PROTOCOL")) {
                Some(p) => Protocol::parse(&p)
                    .ok_or_else(|| anyhow::anyhow!("OTEL_EXPORTER_OTLP_PROTOCOL={p}: onceq speaks http/protobuf or grpc"))?,
                None => Protocol::HttpProtobuf,
            },
        };
        let endpoint = self.endpoint.as_ref().map(|e| {
            let e = e.trim().trim_end_matches('/');
            match protocol {
                Protocol::HttpProtobuf if !e.ends_with("/v1/traces") => format!("{e}/v1/traces"),
                _ => e.to_string(),
            }
        });
        Ok(Some(Resolved { protocol, endpoint }))
    }
}

/// The exporting half: cheap to clone; [`Telemetry::off`] does nothing.
#[derive(Clone, Default)]
pub struct Telemetry {
    inner: Option<Arc<Inner>>,
}

struct Inner {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    propagation: Propagation,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.inner.is_some() { "Telemetry(on)" } else { "Telemetry(off)" })
    }
}

thread_local! {
    /// The ids the next span started on this thread gets ([`ChosenIds`]).
    static CHOSEN: Cell<(Option<TraceId>, Option<SpanId>)> = const { Cell::new((None, None)) };
}

/// Random ids, unless a span is being started with ids of its own
/// ([`Telemetry::start_span`] sets them for one call, on its thread).
#[derive(Debug, Default)]
struct ChosenIds(RandomIdGenerator);

impl IdGenerator for ChosenIds {
    fn new_trace_id(&self) -> TraceId {
        let (trace, span) = CHOSEN.get();
        CHOSEN.set((None, span));
        trace.unwrap_or_else(|| self.0.new_trace_id())
    }

    fn new_span_id(&self) -> SpanId {
        let (trace, span) = CHOSEN.get();
        CHOSEN.set((trace, None));
        span.unwrap_or_else(|| self.0.new_span_id())
    }
}

fn span_context(t: &TraceParent, state: Option<&str>, remote: bool) -> SpanContext {
    SpanContext::new(
        TraceId::from_bytes(t.trace_id),
        SpanId::from_bytes(t.span_id),
        TraceFlags::new(t.flags),
        remote,
        state.and_then(|s| s.parse::<TraceState>().ok()).unwrap_or_default(),
    )
}

/// The ids [`ChosenIds`] gives a span whose id is `t`'s.
fn chosen(t: &TraceParent) -> (Option<TraceId>, Option<SpanId>) {
    (Some(TraceId::from_bytes(t.trace_id)), Some(SpanId::from_bytes(t.span_id)))
}

/// The W3C context of a span.
pub fn traceparent_of(sc: &SpanContext) -> Option<TraceParent> {
    sc.is_valid().then(|| TraceParent {
        trace_id: sc.trace_id().to_bytes(),
        span_id: sc.span_id().to_bytes(),
        flags: sc.trace_flags().to_u8(),
    })
}

/// The common attributes of a span about `destination`.
fn messaging(operation: &'static str, destination: &str) -> Vec<KeyValue> {
    messaging_named(operation, operation, destination)
}

/// [`messaging`], with an operation name more precise than its type.
fn messaging_named(operation: &'static str, name: &'static str, destination: &str) -> Vec<KeyValue> {
    vec![
        KeyValue::new("messaging.system", MESSAGING_SYSTEM),
        KeyValue::new("messaging.operation.type", operation),
        KeyValue::new("messaging.operation.name", name),
        KeyValue::new("messaging.destination.name", destination.to_string()),
    ]
}

impl Telemetry {
    /// No export: every span call returns at once.
    pub const fn off() -> Telemetry {
        Telemetry { inner: None }
    }

    pub fn is_on(&self) -> bool {
        self.inner.is_some()
    }

    /// Start exporting as `config` (and the `OTEL_*` variables) say, or
    /// [`Telemetry::off`]. Needs a tokio runtime: the exporter's batches
    /// are sent from a task of it.
    pub fn start(config: &TelemetryConfig) -> anyhow::Result<Telemetry> {
        let Some(resolved) = config.resolve(|k| std::env::var(k).ok())? else {
            return Ok(Telemetry::off());
        };
        use opentelemetry_otlp::{WithExportConfig, WithHttpConfig, WithTonicConfig};
        let timeout = config.timeout;
        let exporter = match resolved.protocol {
            Protocol::HttpProtobuf => {
                let mut b = opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_protocol(opentelemetry_otlp::Protocol::HttpBinary);
                if let Some(e) = &resolved.endpoint {
                    b = b.with_endpoint(e.clone());
                }
                if let Some(t) = timeout {
                    b = b.with_timeout(t);
                }
                if !config.headers.is_empty() {
                    b = b.with_headers(config.headers.clone().into_iter().collect());
                }
                b.build()
            }
            Protocol::Grpc => {
                let mut b = opentelemetry_otlp::SpanExporter::builder().with_tonic();
                if let Some(e) = &resolved.endpoint {
                    b = b.with_endpoint(e.clone());
                }
                if let Some(t) = timeout {
                    b = b.with_timeout(t);
                }
                if !config.headers.is_empty() {
                    b = b.with_metadata(tonic_metadata(&config.headers)?);
                }
                b.build()
            }
        }
        .map_err(|e| anyhow::anyhow!("telemetry: could not build the OTLP exporter: {e}"))?;
        let mut batch = opentelemetry_sdk::trace::BatchConfigBuilder::default();
        // A busy host makes thousands of spans a second: a larger queue
        // and a shorter delay than the SDK's, unless the operator set them.
        if std::env::var_os("OTEL_BSP_MAX_QUEUE_SIZE").is_none() {
            batch = batch.with_max_queue_size(65_536);
        }
        if std::env::var_os("OTEL_BSP_SCHEDULE_DELAY").is_none() {
            batch = batch.with_scheduled_delay(Duration::from_secs(1));
        }
        let processor = opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
            exporter,
            opentelemetry_sdk::runtime::Tokio,
        )
        .with_batch_config(batch.build())
        .build();
        let mut resource = opentelemetry_sdk::Resource::builder();
        if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
            resource = resource.with_service_name(config.service_name.clone().unwrap_or_else(|| "onceq".into()));
        }
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_id_generator(ChosenIds::default())
            .with_resource(resource.build())
            .build();
        let scope = opentelemetry::InstrumentationScope::builder("onceq")
            .with_version(env!("CARGO_PKG_VERSION"))
            .build();
        let tracer = provider.tracer_with_scope(scope);
        tracing::info!(
            protocol = ?resolved.protocol,
            endpoint = resolved.endpoint.as_deref().unwrap_or("(from OTEL_EXPORTER_OTLP_ENDPOINT, else localhost)"),
            "telemetry: exporting traces over OTLP"
        );
        Ok(Telemetry {
            inner: Some(Arc::new(Inner {
                provider,
                tracer,
                propagation: config.propagation,
            })),
        })
    }

    /// Send what is buffered and stop, waiting at most [`SHUTDOWN_FLUSH`].
    pub async fn shutdown(&self) {
        let Some(inner) = &self.inner else { return };
        let provider = inner.provider.clone();
        let done = tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(SHUTDOWN_FLUSH));
        match tokio::time::timeout(SHUTDOWN_FLUSH + Duration::from_secs(1), done).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!("telemetry: the last spans may not have been sent: {e}"),
            Ok(Err(e)) => tracing::warn!("telemetry: flushing ended abnormally: {e}"),
            Err(_) => tracing::warn!(
                "telemetry: the collector did not take the last spans within {}",
                crate::names::duration(SHUTDOWN_FLUSH)
            ),
        }
    }

    /// Start a span with `ids` (trace, span) chosen instead of random ones:
    /// the trace id is used only when `parent` has no span.
    fn start_span(
        inner: &Inner,
        builder: opentelemetry::trace::SpanBuilder,
        parent: &Context,
        ids: (Option<TraceId>, Option<SpanId>),
    ) -> opentelemetry_sdk::trace::Span {
        CHOSEN.set(ids);
        let span = inner.tracer.build_with_context(builder, parent);
        CHOSEN.set((None, None));
        span
    }

    /// The producer span of one message `onceq send` wrote: its span id is
    /// the message's creation context `created`; its parent the caller's
    /// `TRACEPARENT`, if any.
    pub fn sent(&self, queue: &str, created: &TraceParent, parent: Option<&TraceParent>, state: Option<&str>, started: SystemTime) {
        let Some(inner) = &self.inner else { return };
        let cx = match parent {
            Some(p) => Context::new().with_remote_span_context(span_context(p, state, true)),
            None => Context::new(),
        };
        let mut attributes = messaging("send", queue);
        attributes.push(KeyValue::new("messaging.batch.message_count", 1i64));
        let b = inner
            .tracer
            .span_builder(format!("send {queue}"))
            .with_kind(SpanKind::Producer)
            .with_start_time(started)
            .with_attributes(attributes);
        let mut span = Self::start_span(inner, b, &cx, chosen(created));
        span.end();
    }

    /// The consumer span of one run of `message`'s handler.
    pub fn process(
        &self,
        queue: &str,
        message_id: &str,
        delivery: u32,
        version: &str,
        created: Option<(TraceParent, Option<&str>)>,
    ) -> Active {
        let Some(inner) = &self.inner else { return Active::default() };
        let creation = created.map(|(t, s)| span_context(&t, s, true));
        let mut attributes = messaging("process", queue);
        attributes.push(KeyValue::new("messaging.message.id", message_id.to_string()));
        attributes.push(KeyValue::new("messaging.message.delivery_count", i64::from(delivery)));
        attributes.push(KeyValue::new("onceq.handler.version", version.to_string()));
        let mut b = inner
            .tracer
            .span_builder(format!("process {queue}"))
            .with_kind(SpanKind::Consumer)
            .with_attributes(attributes);
        let parent = match (&creation, inner.propagation) {
            (Some(sc), Propagation::Child) => Context::new().with_remote_span_context(sc.clone()),
            _ => Context::new(),
        };
        if let Some(sc) = &creation {
            b = b.with_links(vec![Link::with_context(sc.clone())]);
        }
        let span = Self::start_span(inner, b, &parent, (None, None));
        Active {
            cx: Some((inner.clone(), Context::new().with_span(span))),
            creation,
        }
    }

    /// Export a span per group commit of `store` ([`Self::batch_committed`]).
    pub fn observe_commits(&self, store: &dyn crate::store::Store) {
        if !self.is_on() {
            return;
        }
        let me = self.clone();
        store.commit_observe(std::sync::Arc::new(move |b: crate::store::commit::BatchReport| {
            me.batch_committed(b.started, &b.members, b.count, b.failed)
        }));
    }

    /// One renewal round of a worker's batch on `queue`: a link to each
    /// renewed message's creation context, how many were held and lost, or
    /// the error that failed the round.
    pub fn renewed(&self, queue: &str, started: SystemTime, members: &[TraceParent], held: usize, lost: usize, error: Option<String>) {
        let Some(inner) = &self.inner else { return };
        let links = members.iter().map(|m| Link::with_context(span_context(m, None, true))).collect();
        let mut attributes = messaging("renew", queue);
        attributes.push(KeyValue::new("messaging.batch.message_count", (held + lost) as i64));
        attributes.push(KeyValue::new("onceq.renewed", held as i64));
        attributes.push(KeyValue::new("onceq.lost", lost as i64));
        let b = inner
            .tracer
            .span_builder(format!("renew {queue}"))
            .with_kind(SpanKind::Client)
            .with_start_time(started)
            .with_links(links)
            .with_attributes(attributes);
        let mut span = Self::start_span(inner, b, &Context::new(), (None, None));
        match error {
            Some(e) => span.set_status(Status::error(e)),
            None if lost > 0 => span.set_status(Status::error(format!("{lost} lease(s) lost: another holder has them"))),
            None => {}
        }
        span.end();
    }

    /// The one span of a group commit of `count` messages: a link to each
    /// message's `process` span.
    pub fn batch_committed(&self, started: SystemTime, members: &[TraceParent], count: usize, failed: usize) {
        let Some(inner) = &self.inner else { return };
        let links = members.iter().map(|m| Link::with_context(span_context(m, None, false))).collect();
        let b = inner
            .tracer
            .span_builder("commit")
            .with_kind(SpanKind::Internal)
            .with_start_time(started)
            .with_links(links)
            .with_attributes(vec![
                KeyValue::new("messaging.system", MESSAGING_SYSTEM),
                KeyValue::new("messaging.batch.message_count", count as i64),
                KeyValue::new("onceq.batch.failed", failed as i64),
            ]);
        let mut span = Self::start_span(inner, b, &Context::new(), (None, None));
        if failed > 0 {
            span.set_status(Status::error(format!("{failed} of {count} messages not committed")));
        }
        span.end();
    }
}

fn tonic_metadata(headers: &BTreeMap<String, String>) -> anyhow::Result<tonic::metadata::MetadataMap> {
    let mut m = tonic::metadata::MetadataMap::new();
    for (k, v) in headers {
        let key = tonic::metadata::MetadataKey::from_bytes(k.to_ascii_lowercase().as_bytes())
            .map_err(|_| anyhow::anyhow!("telemetry.headers: {k:?} is not a valid header name"))?;
        let value = v
            .parse()
            .map_err(|_| anyhow::anyhow!("telemetry.headers: the value of {k:?} is not a valid header value"))?;
        m.insert(key, value);
    }
    Ok(m)
}

/// A span being recorded (or nothing, when telemetry is off).
#[derive(Default, Clone)]
pub struct Active {
    cx: Option<(Arc<Inner>, Context)>,
    /// The message's creation context (what a `link`-mode span links to).
    creation: Option<SpanContext>,
}

impl std::fmt::Debug for Active {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.traceparent() {
            Some(t) => write!(f, "Active({t})"),
            None => f.write_str("Active(none)"),
        }
    }
}

impl Active {
    pub fn is_recording(&self) -> bool {
        self.cx.is_some()
    }

    /// This span's W3C context (what a child, or a webhook, is given).
    pub fn traceparent(&self) -> Option<TraceParent> {
        self.cx.as_ref().and_then(|(_, cx)| traceparent_of(cx.span().span_context()))
    }

    /// A child span of this one, started now.
    pub fn child(&self, name: String, kind: SpanKind, attributes: Vec<KeyValue>) -> Active {
        let Some((inner, cx)) = &self.cx else { return Active::default() };
        let b = inner.tracer.span_builder(name).with_kind(kind).with_attributes(attributes);
        let span = Telemetry::start_span(inner, b, cx, (None, None));
        Active {
            cx: Some((inner.clone(), cx.with_span(span))),
            creation: self.creation.clone(),
        }
    }

    /// `handle {queue}`: the handler call.
    pub fn handle(&self, queue: &str) -> Active {
        if self.cx.is_none() {
            return Active::default();
        }
        self.child(format!("handle {queue}"), SpanKind::Internal, messaging("process", queue))
    }

    /// `settle {queue}`: the ack (with the effects) or the failure record.
    pub fn settle(&self, queue: &str, how: &'static str) -> Active {
        if self.cx.is_none() {
            return Active::default();
        }
        self.child(format!("settle {queue}"), SpanKind::Client, messaging_named("settle", how, queue))
    }

    /// `{op} {table}`: one store read of a handler call (`get`, `scan`).
    pub fn read(&self, op: &'static str, table: &str) -> Active {
        if self.cx.is_none() {
            return Active::default();
        }
        let attributes = vec![
            KeyValue::new("db.operation.name", op),
            KeyValue::new("db.collection.name", table.to_string()),
        ];
        self.child(format!("{op} {table}"), SpanKind::Client, attributes)
    }

    /// End a read span: the rows it returned, or its error.
    pub fn read_done(&self, rows: Result<usize, String>) {
        if self.cx.is_none() {
            return;
        }
        match rows {
            Ok(n) => self.attribute(KeyValue::new("db.response.returned_rows", n as i64)),
            Err(e) => self.fail(&e),
        }
        self.end();
    }

    /// `send {connector}`: one outbox delivery, a client span.
    pub fn delivery(&self, connector: &str, kind: &'static str) -> Active {
        if self.cx.is_none() {
            return Active::default();
        }
        let mut attributes = messaging("send", connector);
        attributes.push(KeyValue::new("onceq.connector.kind", kind));
        self.child(format!("send {connector}"), SpanKind::Client, attributes)
    }

    /// The producer span of an effect this run emitted, ended now: a
    /// follow-up (`send {queue}`) or an intent (`create {connector}`),
    /// with the effect's derived context `created` as its id.
    pub fn produced(&self, intent: bool, destination: &str, created: &TraceParent) {
        let Some((inner, cx)) = &self.cx else { return };
        let (operation, name) = if intent {
            ("create", format!("create {destination}"))
        } else {
            ("send", format!("send {destination}"))
        };
        let b = inner
            .tracer
            .span_builder(name)
            .with_kind(SpanKind::Producer)
            .with_attributes(messaging(operation, destination));
        // The effect's context is in the message's trace: in link mode,
        // this span hangs under the message's creation, not this run's
        // trace.
        let parent = match (&self.creation, inner.propagation) {
            (Some(sc), Propagation::Link) => Context::new().with_remote_span_context(sc.clone()),
            _ => cx.clone(),
        };
        let mut span = Telemetry::start_span(inner, b, &parent, chosen(created));
        span.end();
    }

    pub fn event(&self, name: &'static str, attributes: Vec<KeyValue>) {
        if let Some((_, cx)) = &self.cx {
            cx.span().add_event(name, attributes);
        }
    }

    pub fn attribute(&self, kv: KeyValue) {
        if let Some((_, cx)) = &self.cx {
            cx.span().set_attribute(kv);
        }
    }

    /// An error status with `reason`.
    pub fn fail(&self, reason: &str) {
        if let Some((_, cx)) = &self.cx {
            cx.span().set_status(Status::error(reason.to_string()));
        }
    }

    pub fn end(&self) {
        if let Some((_, cx)) = &self.cx {
            cx.span().end();
        }
    }
}

tokio::task_local! {
    /// The span of the handler call running on this task: an outbox
    /// connector starts its client span under it.
    pub static CURRENT: Active;
}

/// The span of the handler call running on this task, if any.
pub fn current() -> Active {
    CURRENT.try_with(Clone::clone).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn env(vars: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn off_unless_the_config_or_otel_traces_exporter_says_otlp() {
        let c = TelemetryConfig::default();
        assert_eq!(c.resolve(env(&[])).unwrap(), None);
        assert_eq!(c.resolve(env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://x:4318")])).unwrap(), None);
        let on = c.resolve(env(&[("OTEL_TRACES_EXPORTER", "otlp")])).unwrap().unwrap();
        assert_eq!(on.protocol, Protocol::HttpProtobuf);
        let enabled = TelemetryConfig {
            enabled: Some(true),
            endpoint: Some("http://collector:4318/".into()),
            ..TelemetryConfig::default()
        };
        assert_eq!(
            enabled.resolve(env(&[])).unwrap().unwrap().endpoint.as_deref(),
            Some("http://collector:4318/v1/traces")
        );
        // The kill switches win over the file.
        assert_eq!(enabled.resolve(env(&[("OTEL_SDK_DISABLED", "true")])).unwrap(), None);
        assert_eq!(enabled.resolve(env(&[("OTEL_TRACES_EXPORTER", "none")])).unwrap(), None);
        let e = enabled.resolve(env(&[("OTEL_TRACES_EXPORTER", "zipkin")])).unwrap_err();
        assert!(e.to_string().contains("OTEL_TRACES_EXPORTER=zipkin"), "{e}");
        let grpc = enabled.resolve(env(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")])).unwrap().unwrap();
        assert_eq!(
            (grpc.protocol, grpc.endpoint.as_deref()),
            (Protocol::Grpc, Some("http://collector:4318"))
        );
        let e = enabled.resolve(env(&[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")])).unwrap_err();
        assert!(e.to_string().contains("http/json"), "{e}");
    }

    #[test]
    fn an_off_handle_records_nothing() {
        let t = Telemetry::off();
        let p = t.process("q", "m", 1, "v", None);
        assert!(!p.is_recording());
        assert_eq!(p.handle("q").traceparent(), None);
    }
}
