//! A TCP proxy for fault injection on the wire: it forwards both ways and,
//! while faults are on, cuts the connection at random instead of forwarding
//! a chunk of the server's response. A request that reached the server (a
//! commit, say) then has an unknown outcome for the client, as when a
//! network drops a response.
//!
//! While `blackhole` is on, the server's bytes are swallowed instead, and a
//! connection that lost a byte stays silent for good, open but answering
//! nothing: a half-open connection, as when a NAT or a proxy forgets a flow.
//! Only connections made after `blackhole` turns off work again.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use rand::{RngExt, SeedableRng};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub struct Proxy {
    pub addr: std::net::SocketAddr,
    /// Cut probability per server response chunk, while `enabled`.
    pub enabled: Arc<AtomicBool>,
    /// Connections cut so far.
    pub cuts: Arc<AtomicU64>,
    /// Swallow the server's bytes (see the module docs).
    pub blackhole: Arc<AtomicBool>,
    /// Connections left half-open by `blackhole`.
    pub silenced: Arc<AtomicU64>,
    /// Connections accepted so far.
    pub accepted: Arc<AtomicU64>,
}

impl Proxy {
    pub async fn start(upstream: std::net::SocketAddr, cut_probability: f64, seed: u64) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let enabled = Arc::new(AtomicBool::new(false));
        let cuts = Arc::new(AtomicU64::new(0));
        let blackhole = Arc::new(AtomicBool::new(false));
        let silenced = Arc::new(AtomicU64::new(0));
        let accepted = Arc::new(AtomicU64::new(0));
        let rng = Arc::new(Mutex::new(rand::rngs::StdRng::seed_from_u64(seed)));
        let (en, cu, bh, si, ac) = (enabled.clone(), cuts.clone(), blackhole.clone(), silenced.clone(), accepted.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                ac.fetch_add(1, Ordering::Relaxed);
                let Ok(server) = TcpStream::connect(upstream).await else { continue };
                let (en, cu, rng, bh, si) = (en.clone(), cu.clone(), rng.clone(), bh.clone(), si.clone());
                tokio::spawn(async move {
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let up = tokio::spawn(async move {
                        let mut buf = vec![0u8; 64 << 10];
                        loop {
                            match cr.read(&mut buf).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => {
                                    if sw.write_all(&buf[..n]).await.is_err() {
                                        break;
                                    }
                                }
                            }
                        }
                    });
                    let mut buf = vec![0u8; 64 << 10];
                    let mut silent = false;
                    loop {
                        match sr.read(&mut buf).await {
                            // Half-open: the client never hears the server go.
                            Ok(0) | Err(_) if silent => std::future::pending::<()>().await,
                            Ok(0) | Err(_) => break,
                            Ok(_) if silent => {}
                            Ok(_) if bh.load(Ordering::Relaxed) => {
                                silent = true;
                                si.fetch_add(1, Ordering::Relaxed);
                            }
                            Ok(n) => {
                                let cut = en.load(Ordering::Relaxed)
                                    && rng.lock().map(|mut r| r.random::<f64>() < cut_probability).unwrap_or(false);
                                if cut {
                                    cu.fetch_add(1, Ordering::Relaxed);
                                    break; // drop both halves: the connection is cut
                                }
                                if cw.write_all(&buf[..n]).await.is_err() {
                                    break;
                                }
                            }
                        }
                    }
                    up.abort();
                });
            }
        });
        Proxy {
            addr,
            enabled,
            cuts,
            blackhole,
            silenced,
            accepted,
        }
    }
}
