//! A gRPC-aware proxy between the Spanner client and the emulator, for
//! the unknown commit outcome on the wire: it serves HTTP/2 (cleartext,
//! as the emulator does) and forwards each call upstream on a connection of
//! its own; a `Commit` whose request names a chosen table (so: a message
//! commit, not a lease) is forwarded, its whole answer received (the commit
//! landed), and then no answer is given at all. The client's deadline
//! passes with the outcome unknown, exactly as when a network loses the
//! response of a commit that reached the server.
//!
//! A TCP-level cut is not enough for this: Google's client resends a
//! Commit itself after a transport error, and the emulator answers a
//! repeated Commit with the stored result, so onceq's own re-run is
//! reached only when the answer never comes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use http_body_util::{BodyExt, Full};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub struct GrpcProxy {
    pub addr: std::net::SocketAddr,
    /// Commits still to swallow (counted down).
    pub to_swallow: Arc<AtomicU64>,
    /// Commits that landed and whose answer was swallowed.
    pub swallowed: Arc<AtomicU64>,
    /// Calls forwarded.
    pub calls: Arc<AtomicU64>,
}

impl GrpcProxy {
    /// Proxy to `upstream`; swallow the answers of commits whose request
    /// bytes contain `marker` (a table name the message commits write).
    pub async fn start(upstream: std::net::SocketAddr, marker: &'static [u8]) -> GrpcProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let to_swallow = Arc::new(AtomicU64::new(0));
        let swallowed = Arc::new(AtomicU64::new(0));
        let calls = Arc::new(AtomicU64::new(0));
        let (ts, sw, ca) = (to_swallow.clone(), swallowed.clone(), calls.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(upstream).await else {
                    continue;
                };
                let Ok((sender, conn)) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(server)).await else {
                    continue;
                };
                tokio::spawn(conn);
                let (ts, sw, ca) = (ts.clone(), sw.clone(), ca.clone());
                let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                    let (mut sender, ts, sw, ca) = (sender.clone(), ts.clone(), sw.clone(), ca.clone());
                    async move {
                        ca.fetch_add(1, Ordering::Relaxed);
                        let (parts, body) = req.into_parts();
                        let bytes = body.collect().await?.to_bytes();
                        let commit = parts.uri.path().ends_with("/Commit");
                        let swallow = commit
                            && bytes.windows(marker.len()).any(|w| w == marker)
                            && ts.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok();
                        let resp = sender.send_request(Request::from_parts(parts, Full::new(bytes))).await?;
                        if swallow {
                            // The whole answer, trailers included: the commit
                            // is done. Then nothing, ever.
                            let _ = resp.into_body().collect().await;
                            sw.fetch_add(1, Ordering::Relaxed);
                            return std::future::pending().await;
                        }
                        Ok::<Response<hyper::body::Incoming>, hyper::Error>(resp)
                    }
                });
                tokio::spawn(async move {
                    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(client), service)
                        .await;
                });
            }
        });
        GrpcProxy {
            addr,
            to_swallow,
            swallowed,
            calls,
        }
    }
}
