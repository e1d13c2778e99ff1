//! What tracing costs: `onceq run --until-empty` on the same payments
//! messages (each sent with a W3C context, as `onceq send` sends them)
//! with telemetry off, and on, exporting every span over OTLP/HTTP to a
//! sink in this process that reads each request and answers 200;
//! interleaved, best of `ONCEQ_BENCH_ROUNDS` (2). With
//! `ONCEQ_BENCH_BASELINE_BIN` (an `onceq` built from an earlier commit),
//! that binary runs too, telemetry off: what the off path costs.

use super::{env_usize, fresh_db, order_payload, payments_config, until_empty};
use onceq::store::SendParams;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

pub fn telemetry(dir: &Path, component: &Path) {
    let rt = tokio::runtime::Handle::current();
    let work = dir.join("telemetry");
    std::fs::create_dir_all(&work).unwrap();
    let messages = env_usize("ONCEQ_BENCH_CLI_MESSAGES", 20_000);
    // The collector: counts requests and bytes, answers 200.
    let (bytes, requests) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let sink = listener.local_addr().unwrap();
    {
        let (bytes, requests) = (bytes.clone(), requests.clone());
        rt.spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (bytes, requests) = (bytes.clone(), requests.clone());
                tokio::spawn(async move {
                    let io = hyper_util::rt::TokioIo::new(stream);
                    let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                        let (bytes, requests) = (bytes.clone(), requests.clone());
                        async move {
                            use http_body_util::BodyExt;
                            let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
                            bytes.fetch_add(body.len() as u64, Ordering::Relaxed);
                            requests.fetch_add(1, Ordering::Relaxed);
                            Ok::<_, std::convert::Infallible>(hyper::Response::new(http_body_util::Full::new(hyper::body::Bytes::new())))
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, svc).await;
                });
            }
        });
    }
    let run = |name: &str, telemetry: &str, bin: Option<&Path>| -> f64 {
        let (store, db) = fresh_db(&work, &format!("{name}.db"));
        rt.block_on(async {
            let msgs: Vec<SendParams> = (0..messages)
                .map(|i| SendParams {
                    queue: "payments".into(),
                    payload: order_payload(i),
                    attributes: vec![(
                        onceq::trace::TRACEPARENT_ATTRIBUTE.into(),
                        onceq::trace::TraceParent::root().to_string(),
                    )],
                    ..Default::default()
                })
                .collect();
            for c in msgs.chunks(1000) {
                store.message_send(c.to_vec()).await.unwrap();
            }
        });
        drop(store);
        let charges = work.join(format!("{name}.jsonl"));
        let config = payments_config(&db.display().to_string(), telemetry, component, &charges.display().to_string());
        std::fs::write(work.join("onceq.toml"), config).unwrap();
        let mut cmd = until_empty(&work);
        if let Some(bin) = bin {
            let args: Vec<_> = cmd.get_args().map(|a| a.to_owned()).collect();
            let mut other = std::process::Command::new(bin);
            other
                .current_dir(&work)
                .args(args)
                .env("RUST_LOG", "error")
                .stdout(std::process::Stdio::null());
            cmd = other;
        }
        let started = Instant::now();
        assert!(cmd.status().unwrap().success(), "onceq run failed");
        messages as f64 / started.elapsed().as_secs_f64()
    };
    let on_config = format!("[telemetry]\nenabled = true\nendpoint = \"http://{sink}\"\n");
    let rounds = env_usize("ONCEQ_BENCH_ROUNDS", 2).max(1);
    let baseline = std::env::var_os("ONCEQ_BENCH_BASELINE_BIN").map(std::path::PathBuf::from);
    let (mut off, mut on, mut base) = (0f64, 0f64, 0f64);
    for r in 0..rounds {
        if let Some(b) = &baseline {
            base = base.max(run(&format!("base-{r}"), "", Some(b)));
        }
        off = off.max(run(&format!("off-{r}"), "", None));
        on = on.max(run(&format!("on-{r}"), &on_config, None));
    }
    if let Some(b) = &baseline {
        println!(
            "\n| {} (telemetry off) against the baseline `{}` | {off:.0} / {base:.0} msg/s = {:.2} |\n|---|---|",
            messages,
            b.display(),
            off / base
        );
        super::history::record("telemetry_off_over_baseline", off / base);
    }
    let (b, n) = (bytes.load(Ordering::Relaxed), requests.load(Ordering::Relaxed));
    println!(
        "\n| `onceq run --until-empty`, {messages} payments messages with a trace context, best of {rounds} interleaved | messages/s |\n|---|---|\n| telemetry off | {off:.0} |\n| telemetry on, every span exported over OTLP/HTTP ({n} requests, {:.1} MB in all rounds) | {on:.0} |\n| on / off | {:.2} |",
        b as f64 / 1e6,
        on / off
    );
    super::history::record("telemetry_on_over_off", on / off);
}
