//! A real HTTP server for webhook tests (hyper, bound to 127.0.0.1:0): it
//! applies each `Idempotency-Key` once, answers repeats with 200, and on
//! demand misbehaves the ways real endpoints do: 500s, 429 with
//! `Retry-After`, responses slower than the client's timeout (after
//! applying: the response is lost), and connections closed without a
//! response (before or after applying).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use rand::{RngExt, SeedableRng};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Fault probabilities per request, while `Receiver::faults_on` is set.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    pub error_500: f64,
    pub too_many_429: f64,
    /// Apply, then answer after `slow` (longer than the client's timeout).
    pub slow_after_apply: f64,
    pub slow: Duration,
    /// Close the connection without a response, before applying.
    pub close_before_apply: f64,
    /// Apply, then close the connection without a response.
    pub close_after_apply: f64,
}

/// What one key received.
#[derive(Debug, Clone, Default)]
pub struct Seen {
    /// Requests carrying the key (deliveries, including repeats).
    pub requests: u64,
    /// Times applied: 1 for every key, if the server deduplicates.
    pub applied: u64,
    pub payload: String,
    pub headers: Vec<(String, String)>,
}

#[derive(Default)]
pub struct ReceiverState {
    pub faults: Mutex<Faults>,
    pub faults_on: AtomicBool,
    /// Keys answered with 422 (a permanent refusal).
    pub refuse: Mutex<BTreeSet<String>>,
    /// Keys answered only after this delay (and applied first).
    pub slow_keys: Mutex<BTreeMap<String, Duration>>,
    pub keys: Mutex<BTreeMap<String, Seen>>,
    pub requests: AtomicU64,
    pub faults_injected: AtomicU64,
    pub without_key: AtomicU64,
    rng: Mutex<Option<rand::rngs::StdRng>>,
}

pub struct Receiver {
    pub addr: std::net::SocketAddr,
    pub state: Arc<ReceiverState>,
}

impl Receiver {
    pub async fn start(seed: u64) -> Receiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(ReceiverState::default());
        *state.rng.lock().unwrap() = Some(rand::rngs::StdRng::seed_from_u64(seed));
        let st = state.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let st = st.clone();
                tokio::spawn(async move {
                    let io = hyper_util::rt::TokioIo::new(stream);
                    let svc = hyper::service::service_fn(move |req| handle(st.clone(), req));
                    let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, svc).await;
                });
            }
        });
        Receiver { addr, state }
    }

    pub fn url(&self) -> String {
        format!("http://{}/intents", self.addr)
    }

    pub fn set_faults(&self, f: Faults) {
        *self.state.faults.lock().unwrap() = f;
        self.state.faults_on.store(true, Ordering::Relaxed);
    }

    pub fn faults_off(&self) {
        self.state.faults_on.store(false, Ordering::Relaxed);
    }

    pub fn seen(&self) -> BTreeMap<String, Seen> {
        self.state.keys.lock().unwrap().clone()
    }
}

enum Act {
    Ok,
    E500,
    E429,
    Slow(Duration),
    CloseBefore,
    CloseAfter,
}

fn draw(st: &ReceiverState) -> Act {
    if !st.faults_on.load(Ordering::Relaxed) {
        return Act::Ok;
    }
    let f = st.faults.lock().unwrap().clone();
    let x: f64 = st.rng.lock().unwrap().as_mut().unwrap().random();
    let mut acc = 0.0;
    for (p, act) in [
        (f.error_500, Act::E500),
        (f.too_many_429, Act::E429),
        (f.slow_after_apply, Act::Slow(f.slow)),
        (f.close_before_apply, Act::CloseBefore),
        (f.close_after_apply, Act::CloseAfter),
    ] {
        acc += p;
        if x < acc {
            st.faults_injected.fetch_add(1, Ordering::Relaxed);
            return act;
        }
    }
    Act::Ok
}

fn reply(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
    *r.status_mut() = status;
    r
}

async fn handle(st: Arc<ReceiverState>, req: Request<hyper::body::Incoming>) -> Result<Response<Full<Bytes>>, std::io::Error> {
    st.requests.fetch_add(1, Ordering::Relaxed);
    let headers: Vec<(String, String)> = req
        .headers()
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").to_string()))
        .collect();
    let key = req
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = req.into_body().collect().await.map_err(std::io::Error::other)?.to_bytes();
    let Some(key) = key else {
        st.without_key.fetch_add(1, Ordering::Relaxed);
        return Ok(reply(StatusCode::BAD_REQUEST, "missing Idempotency-Key"));
    };
    if st.refuse.lock().unwrap().contains(&key) {
        return Ok(reply(StatusCode::UNPROCESSABLE_ENTITY, &format!("refused: {key}")));
    }
    let act = draw(&st);
    match act {
        Act::E500 => return Ok(reply(StatusCode::INTERNAL_SERVER_ERROR, "injected 500")),
        Act::E429 => {
            let mut r = reply(StatusCode::TOO_MANY_REQUESTS, "slow down");
            r.headers_mut().insert("retry-after", hyper::header::HeaderValue::from_static("0"));
            return Ok(r);
        }
        Act::CloseBefore => return Err(std::io::Error::other("injected: connection closed before applying")),
        _ => {}
    }
    {
        let mut keys = st.keys.lock().unwrap();
        let seen = keys.entry(key.clone()).or_default();
        seen.requests += 1;
        if seen.applied == 0 {
            seen.applied = 1;
            seen.payload = String::from_utf8_lossy(&body).into_owned();
            seen.headers = headers;
        }
    }
    let slow = st.slow_keys.lock().unwrap().get(&key).copied();
    if let Some(d) = slow {
        tokio::time::sleep(d).await;
    }
    match act {
        Act::Slow(d) => {
            tokio::time::sleep(d).await;
            Ok(reply(StatusCode::OK, "late"))
        }
        Act::CloseAfter => Err(std::io::Error::other("injected: connection closed after applying")),
        _ => Ok(reply(StatusCode::OK, "ok")),
    }
}
