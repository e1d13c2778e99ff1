//! An OTLP trace receiver in the test process: it decodes what onceq
//! exports with the official protobufs (`opentelemetry-proto`), over
//! HTTP/protobuf (`POST /v1/traces`, HTTP/1.1) and over gRPC
//! (`TraceService/Export`, HTTP/2, on a second port), and keeps every span
//! with its resource's `service.name`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use std::sync::{Arc, Mutex};

/// One received span, with the `service.name` of its resource.
#[derive(Debug, Clone)]
pub struct Got {
    pub service: String,
    pub span: Span,
}

impl Got {
    pub fn trace_id(&self) -> String {
        hex(&self.span.trace_id)
    }
    pub fn span_id(&self) -> String {
        hex(&self.span.span_id)
    }
    pub fn parent(&self) -> String {
        hex(&self.span.parent_span_id)
    }
    /// The string (or integer, as text) attribute `key`.
    pub fn attr(&self, key: &str) -> Option<String> {
        attr(&self.span.attributes, key)
    }
    /// The span ids this span links to.
    pub fn links(&self) -> Vec<String> {
        self.span.links.iter().map(|l| hex(&l.span_id)).collect()
    }
    pub fn events(&self) -> Vec<(String, Vec<KeyValue>)> {
        self.span.events.iter().map(|e| (e.name.clone(), e.attributes.clone())).collect()
    }
}

pub fn attr(attributes: &[KeyValue], key: &str) -> Option<String> {
    attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| match &v.value {
            Some(AnyValue::StringValue(s)) => Some(s.clone()),
            Some(AnyValue::IntValue(i)) => Some(i.to_string()),
            Some(AnyValue::BoolValue(b)) => Some(b.to_string()),
            _ => None,
        })
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

pub struct Otlp {
    /// HTTP/protobuf, for `endpoint` and `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub http: std::net::SocketAddr,
    /// gRPC.
    pub grpc: std::net::SocketAddr,
    spans: Arc<Mutex<Vec<Got>>>,
    /// Export requests received (of either kind).
    requests: Arc<std::sync::atomic::AtomicU64>,
}

impl Otlp {
    pub async fn start() -> Otlp {
        let spans: Arc<Mutex<Vec<Got>>> = Arc::default();
        let requests: Arc<std::sync::atomic::AtomicU64> = Arc::default();
        let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (http_addr, grpc_addr) = (http.local_addr().unwrap(), grpc.local_addr().unwrap());
        for (listener, h2) in [(http, false), (grpc, true)] {
            let (spans, requests) = (spans.clone(), requests.clone());
            tokio::spawn(async move {
                while let Ok((stream, _)) = listener.accept().await {
                    let (spans, requests) = (spans.clone(), requests.clone());
                    tokio::spawn(async move {
                        let io = hyper_util::rt::TokioIo::new(stream);
                        let svc = hyper::service::service_fn(move |req| handle(spans.clone(), requests.clone(), req, h2));
                        if h2 {
                            let _ = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                                .serve_connection(io, svc)
                                .await;
                        } else {
                            let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, svc).await;
                        }
                    });
                }
            });
        }
        Otlp {
            http: http_addr,
            grpc: grpc_addr,
            spans,
            requests,
        }
    }

    pub fn http_url(&self) -> String {
        format!("http://{}", self.http)
    }

    /// Telemetry on, exporting here over HTTP.
    pub fn config(&self) -> onceq::telemetry::TelemetryConfig {
        onceq::telemetry::TelemetryConfig {
            enabled: Some(true),
            endpoint: Some(self.http_url()),
            ..Default::default()
        }
    }

    pub fn grpc_url(&self) -> String {
        format!("http://{}", self.grpc)
    }

    pub fn spans(&self) -> Vec<Got> {
        self.spans.lock().unwrap().clone()
    }

    pub fn requests(&self) -> u64 {
        self.requests.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The spans named `name`.
    pub fn named(&self, name: &str) -> Vec<Got> {
        self.spans().into_iter().filter(|g| g.span.name == name).collect()
    }
}

type Body = http_body_util::combinators::BoxBody<Bytes, std::convert::Infallible>;

async fn handle(
    spans: Arc<Mutex<Vec<Got>>>,
    requests: Arc<std::sync::atomic::AtomicU64>,
    req: Request<hyper::body::Incoming>,
    grpc: bool,
) -> Result<Response<Body>, std::convert::Infallible> {
    let path = req.uri().path().to_string();
    let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let expected = if grpc {
        "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
    } else {
        "/v1/traces"
    };
    if path != expected {
        let r = Response::builder()
            .status(StatusCode::NOT_FOUND)
            .body(Full::new(Bytes::from(format!("no {path}"))).boxed())
            .unwrap();
        return Ok(r);
    }
    // gRPC: a 5-byte frame header (compressed flag, length) first.
    let message = if grpc { body.get(5..).unwrap_or_default() } else { &body[..] };
    let request = ExportTraceServiceRequest::decode(message).expect("an OTLP ExportTraceServiceRequest");
    requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    {
        let mut kept = spans.lock().unwrap();
        for rs in request.resource_spans {
            let service = rs
                .resource
                .as_ref()
                .and_then(|r| attr(&r.attributes, "service.name"))
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for span in ss.spans {
                    kept.push(Got {
                        service: service.clone(),
                        span,
                    });
                }
            }
        }
    }
    let answer = ExportTraceServiceResponse::default().encode_to_vec();
    if grpc {
        let mut framed = vec![0u8];
        framed.extend_from_slice(&(answer.len() as u32).to_be_bytes());
        framed.extend_from_slice(&answer);
        let mut trailers = hyper::HeaderMap::new();
        trailers.insert("grpc-status", hyper::header::HeaderValue::from_static("0"));
        let body = Full::new(Bytes::from(framed)).with_trailers(async move { Some(Ok(trailers)) });
        Ok(Response::builder()
            .header("content-type", "application/grpc")
            .body(body.boxed())
            .unwrap())
    } else {
        Ok(Response::builder()
            .header("content-type", "application/x-protobuf")
            .body(Full::new(Bytes::from(answer)).boxed())
            .unwrap())
    }
}

/// One trace as an SVG waterfall: a row per span in tree order (children
/// under their parent, by start time), a bar from its start to its end on
/// a shared time axis, named `name (kind)` and coloured by kind; links are
/// listed after the name. What `make trace-picture` puts in the docs.
pub fn render_svg(spans: &[Got]) -> String {
    let mut spans: Vec<&Got> = spans.iter().collect();
    spans.sort_by_key(|g| g.span.start_time_unix_nano);
    let ids: std::collections::BTreeSet<String> = spans.iter().map(|g| g.span_id()).collect();
    // Tree order: roots (no parent among these spans) first, depth-first.
    let mut rows: Vec<(&Got, usize)> = Vec::new();
    fn walk<'a>(g: &'a Got, depth: usize, all: &[&'a Got], rows: &mut Vec<(&'a Got, usize)>) {
        rows.push((g, depth));
        for c in all.iter().filter(|c| c.parent() == g.span_id()) {
            walk(c, depth + 1, all, rows);
        }
    }
    for g in spans.iter().filter(|g| !ids.contains(&g.parent())) {
        walk(g, 0, &spans, &mut rows);
    }
    let start = spans.iter().map(|g| g.span.start_time_unix_nano).min().unwrap_or(0);
    let end = spans
        .iter()
        .map(|g| g.span.end_time_unix_nano)
        .max()
        .unwrap_or(start + 1)
        .max(start + 1);
    // Idle stretches (no span open) longer than a tenth of the whole, such
    // as the producer's exit and the host's start, are cut to a sliver.
    let mut intervals: Vec<(u64, u64)> = spans
        .iter()
        .map(|g| (g.span.start_time_unix_nano, g.span.end_time_unix_nano))
        .collect();
    intervals.sort();
    let mut gaps: Vec<(u64, u64)> = Vec::new();
    let mut covered = start;
    for (s, e) in intervals {
        if s > covered && s - covered > (end - start) / 10 {
            gaps.push((covered, s));
        }
        covered = covered.max(e);
    }
    let cut: u64 = gaps.iter().map(|(a, b)| b - a).sum();
    let shown = (end - start - cut).max(1) as f64;
    let (label_w, bar_w, row_h, sliver) = (430.0, 520.0, 24.0, 12.0);
    let scale = (bar_w - sliver * gaps.len() as f64) / shown;
    let x = |t: u64| {
        let mut px = label_w;
        let mut at = start;
        for (a, b) in &gaps {
            if t <= *a {
                break;
            }
            px += (a - at) as f64 * scale + sliver;
            at = *b;
            if t < *b {
                return px;
            }
        }
        px + t.saturating_sub(at) as f64 * scale
    };
    let height = 40.0 + row_h * rows.len() as f64 + 30.0;
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{height}\" font-family=\"monospace\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"8\" y=\"20\" font-weight=\"bold\">one message's trace ({n} spans, {ms:.1} ms): onceq send, a re-run after an unknown commit, a follow-up and a webhook delivery</text>\n",
        w = label_w + bar_w + 20.0,
        n = rows.len(),
        ms = (end - start) as f64 / 1e6,
    );
    for (a, _) in &gaps {
        let gx = x(*a) + sliver / 2.0;
        svg.push_str(&format!(
            "<line x1=\"{gx:.1}\" y1=\"30\" x2=\"{gx:.1}\" y2=\"{y2}\" stroke=\"#bbb\" stroke-dasharray=\"3,3\"/>\n",
            y2 = 40.0 + row_h * rows.len() as f64
        ));
    }
    for (i, (g, depth)) in rows.iter().enumerate() {
        let y = 40.0 + row_h * i as f64;
        let (kind, colour) = match g.span.kind {
            2 => ("server", "#8e6bbf"),
            3 => ("client", "#d9822b"),
            4 => ("producer", "#2b8a3e"),
            5 => ("consumer", "#1c7ed6"),
            _ => ("internal", "#868e96"),
        };
        let links = if g.span.links.is_empty() {
            String::new()
        } else {
            format!(" ↔{}", g.span.links.len())
        };
        let name = format!("{}{} ({kind}){links}", "  ".repeat(*depth), g.span.name)
            .replace('&', "&amp;")
            .replace('<', "&lt;");
        let (x0, x1) = (x(g.span.start_time_unix_nano), x(g.span.end_time_unix_nano));
        svg.push_str(&format!(
            "<text x=\"8\" y=\"{ty}\" xml:space=\"preserve\">{name}</text>\n<rect x=\"{x0:.1}\" y=\"{ry}\" width=\"{bw:.1}\" height=\"14\" rx=\"2\" fill=\"{colour}\"/>\n",
            ty = y + 12.0,
            ry = y + 1.0,
            bw = (x1 - x0).max(2.0),
        ));
    }
    svg.push_str(&format!(
        "<text x=\"8\" y=\"{y}\" fill=\"#555\">green producer · blue consumer · orange client · grey internal · ↔ links (a commit links to each message it committed) · dashed: idle time cut</text>\n</svg>\n",
        y = height - 10.0
    ));
    svg
}
