//! The console on a big queue, and what it costs when nobody looks.
//!
//! 1. A SQLite file with `ONCEQ_BENCH_CONSOLE_MESSAGES` (default
//!    1,000,000) ready `payments` messages and 10,000 dead letters under a
//!    `onceq run` whose queue is paused (so the queue stays that size);
//!    each console page is loaded as the browser loads it (the same
//!    requests, one after the other, on one kept-alive connection) and
//!    timed from the first byte sent to the last byte read.
//! 2. `onceq run --until-empty` on 20,000 messages with the admin server
//!    (and so the console and its sampler) on and off, interleaved.

use super::{env_usize, fresh_db, order_payload, payments_config, until_empty};
use onceq::store::{AuditEntry, SendParams};
use std::path::Path;
use std::time::{Duration, Instant};

/// One console page: what it is, and the API paths it loads.
struct Page {
    name: String,
    paths: Vec<String>,
}

pub fn console(dir: &Path, component: &Path) {
    let rt = tokio::runtime::Handle::current();
    let work = dir.join("console");
    std::fs::create_dir_all(&work).unwrap();
    let n = env_usize("ONCEQ_BENCH_CONSOLE_MESSAGES", 1_000_000);
    let dead = 10_000;

    // The queue: n ready messages, then dead letters with a few reasons.
    let started = Instant::now();
    let (store, db) = fresh_db(&work, "big.db");
    rt.block_on(async {
        let per_send = 10_000;
        for start in (0..n).step_by(per_send) {
            let batch: Vec<SendParams> = (start..(start + per_send).min(n))
                .map(|i| SendParams {
                    queue: "payments".into(),
                    payload: order_payload(i),
                    attributes: vec![("tenant".into(), format!("t-{}", i % 7))],
                    ..Default::default()
                })
                .collect();
            store.message_send(batch).await.unwrap();
        }
        store
            .queue_pause(
                "payments",
                true,
                Some(&AuditEntry::now("bench", "pause", Some("payments"), "payments")),
            )
            .await
            .unwrap();
    });
    {
        let mut conn = rusqlite::Connection::open(&db).unwrap();
        let tx = conn.transaction().unwrap();
        for i in 0..dead {
            let reason = match i % 3 {
                0 => format!("rejected by handler: amount {} over the limit", i % 500),
                1 => format!("rejected by handler: unknown account acct-{i}"),
                _ => "handler trapped: wasm unreachable".to_string(),
            };
            tx.execute(
                "INSERT INTO onceq_dead_letters (id, queue, payload, attributes, attempts, enqueued_at, failed_at, reason, failures)
                 VALUES (?1, 'payments', ?2, '[]', 3, ?3, ?3, ?4, 3)",
                rusqlite::params![
                    format!("dead{i:028}"),
                    order_payload(n + i),
                    1_700_000_000_000_000i64 + i as i64,
                    reason
                ],
            )
            .unwrap();
        }
        tx.commit().unwrap();
    }
    drop(store);
    let fill = started.elapsed();
    let size_mb = std::fs::metadata(&db).map(|m| m.len()).unwrap_or(0) as f64 / 1e6;

    // A message in the middle of the queue, for a deep page and a detail.
    let (mid_at, mid_id): (i64, String) = rusqlite::Connection::open(&db)
        .unwrap()
        .query_row(
            "SELECT visible_at, id FROM onceq_messages WHERE queue = 'payments' ORDER BY visible_at, id LIMIT 1 OFFSET ?1",
            [n as i64 / 2],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();

    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let charges = work.join("charges.jsonl");
    let config = with_admin(
        payments_config(&db.display().to_string(), "", component, &charges.display().to_string()),
        &format!("127.0.0.1:{port}"),
    );
    std::fs::write(work.join("onceq.toml"), config).unwrap();
    let mut host = std::process::Command::new(env!("CARGO_BIN_EXE_onceq"))
        .current_dir(&work)
        .arg("run")
        .env("RUST_LOG", "error")
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    let q = "/v1/queues/payments/messages?limit=50";
    let pages = [
        Page {
            name: "console shell (/console/, app.js, app.css)".into(),
            paths: vec!["/console/".into(), "/console/app.js".into(), "/console/app.css".into()],
        },
        Page {
            name: "overview (/v1/overview, /v1/history)".into(),
            paths: vec!["/v1/overview".into(), "/v1/history?queue=payments".into()],
        },
        Page {
            name: "queue, first page of ready messages".into(),
            paths: vec![format!("{q}&state=ready"), "/v1/history?queue=payments".into()],
        },
        Page {
            name: format!("queue, the page after message {} (keyset)", n / 2),
            paths: vec![format!("{q}&state=ready&after={mid_at}:{mid_id}")],
        },
        Page {
            name: "search: payload field order_id = one order (first match, then 20,000 rows read)".into(),
            paths: vec![format!("{q}&state=ready&field=order_id&value=o-7")],
        },
        Page {
            name: "search: attribute tenant=t-3 (a page of matches)".into(),
            paths: vec![format!("{q}&state=ready&attr=tenant%3Dt-3")],
        },
        Page {
            name: "search: a value in no message (the 20,000-row budget, then `next`)".into(),
            paths: vec![format!("{q}&state=ready&contains=no-such-text")],
        },
        Page {
            name: "message detail (message, produced, produced by)".into(),
            paths: vec![format!("/v1/messages/{mid_id}")],
        },
        Page {
            name: format!("dead letters ({dead}) with reasons grouped"),
            paths: vec![format!("{q}&state=dead"), "/v1/dead/reasons?queue=payments".into()],
        },
    ];
    let rounds = env_usize("ONCEQ_BENCH_CONSOLE_LOADS", 15).max(3);
    let results = rt.block_on(async {
        // Ready when the admin server answers with the store's counts.
        let deadline = Instant::now() + Duration::from_secs(120);
        while !http
            .get(format!("{base}/v1/overview"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            assert!(Instant::now() < deadline, "the host's admin server did not answer within 120 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut results = Vec::new();
        for page in &pages {
            let mut times = Vec::new();
            for _ in 0..rounds + 1 {
                let started = Instant::now();
                for path in &page.paths {
                    let r = http.get(format!("{base}{path}")).send().await.unwrap();
                    assert!(r.status().is_success(), "{path}: {}", r.status());
                    r.bytes().await.unwrap();
                }
                times.push(started.elapsed());
            }
            times.remove(0); // the first load warms the page cache
            times.sort();
            results.push((times[times.len() / 2], times[times.len() * 95 / 100]));
        }
        // The middle message really is found by its detail.
        let detail: serde_json::Value = http
            .get(format!("{base}/v1/messages/{mid_id}"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(detail["message"]["id"], mid_id.as_str(), "{detail}");
        results
    });
    let _ = host.kill();
    let _ = host.wait();

    println!(
        "\n| console on a SQLite queue of {n} ready messages and {dead} dead letters ({size_mb:.0} MB, filled in {:.0} s), `onceq run` with the queue paused; each page's requests one after another, median and p95 of {rounds} loads | median | p95 |",
        fill.as_secs_f64()
    );
    println!("|---|---|---|");
    let mut worst = Duration::ZERO;
    for (page, (median, p95)) in pages.iter().zip(&results) {
        worst = worst.max(*median);
        println!("| {} | {:.1} ms | {:.1} ms |", page.name, ms(*median), ms(*p95));
    }
    println!("| slowest page, median (target < 200 ms) | {:.1} ms | |", ms(worst));
    super::history::record("console_slowest_page_ms", ms(worst));

    // What the console costs when nobody has it open: the same run with
    // the admin server on (console served, history sampled) and off.
    let messages = env_usize("ONCEQ_BENCH_CLI_MESSAGES", 20_000);
    let run = |name: &str, admin: &str| -> f64 {
        let (store, db) = fresh_db(&work, &format!("{name}.db"));
        rt.block_on(super::queue_orders(store.as_ref(), messages, 1000));
        drop(store);
        let charges = work.join(format!("{name}.jsonl"));
        std::fs::write(
            work.join("onceq.toml"),
            with_admin(
                payments_config(&db.display().to_string(), "", component, &charges.display().to_string()),
                admin,
            ),
        )
        .unwrap();
        let started = Instant::now();
        assert!(until_empty(&work).status().unwrap().success(), "onceq run failed");
        messages as f64 / started.elapsed().as_secs_f64()
    };
    let rounds = env_usize("ONCEQ_BENCH_ROUNDS", 2).max(1);
    let (mut off, mut on) = (0f64, 0f64);
    for r in 0..rounds {
        off = off.max(run(&format!("off-{r}"), "off"));
        on = on.max(run(&format!("on-{r}"), "127.0.0.1:0"));
    }
    println!(
        "\n| `onceq run --until-empty`, {messages} payments messages, best of {rounds} interleaved | messages/s |\n|---|---|\n| admin server and console off | {off:.0} |\n| admin server and console on, nobody looking | {on:.0} |\n| on / off | {:.2} |",
        on / off
    );
    super::history::record("console_on_over_off", on / off);
}

/// `config` (from [`payments_config`], admin on any port) with the admin
/// server on `listen`, or "off".
fn with_admin(config: String, listen: &str) -> String {
    let on_any_port = "listen = \"127.0.0.1:0\"";
    assert!(config.contains(on_any_port));
    config.replace(on_any_port, &format!("listen = \"{listen}\""))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
