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
