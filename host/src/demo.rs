//! `onceq demo` (what `make run` runs): a fresh database, the `payments` and
//! `inventory` example handlers, 10,000 messages (a few of them bad on
//! purpose), unknown commit outcomes injected at random, a progress bar,
//! and a summary that checks the invariants a user would check.

use crate::app;
use crate::config::Config;
use crate::outbox;
use crate::protocol::{self, QueueRunner};
use crate::runtime::Runtime;
use crate::schema::Schema;
use crate::store::faulty::{FaultPlan, FaultyStore};
use crate::store::{Queues, SendParams, Store};
use crate::value::{Row, Value, WriteOp};
use anyhow::Context;
use rand::{RngExt, SeedableRng};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

const PAYMENTS_SCHEMA: &str = include_str!("../../guest-examples/payments/schema.sql");
const INVENTORY_SCHEMA: &str = include_str!("../../guest-examples/inventory/schema.sql");
const PAYMENTS_SCHEMA_SPANNER: &str = include_str!("../../guest-examples/payments/schema.spanner.sql");
const INVENTORY_SCHEMA_SPANNER: &str = include_str!("../../guest-examples/inventory/schema.spanner.sql");

const ACCOUNTS: usize = 1000;
const OPENING_BALANCE: i64 = 10_000;
const ITEMS: usize = 100;
const OPENING_STOCK: i64 = 100;

#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// Folder for the demo's database and config (wiped first).
    #[arg(long, default_value = ".onceq/demo")]
    pub dir: PathBuf,
    /// Folder holding the built example components.
    #[arg(long, default_value = "guest-examples/target/wasm32-wasip2/release")]
    pub guests: PathBuf,
    /// How many messages to send.
    #[arg(long, default_value_t = 10_000)]
    pub messages: usize,
    /// Probability per commit of an injected unknown outcome (half of them
    /// land, half are lost).
    #[arg(long, default_value_t = 0.01)]
    pub faults: f64,
    /// Workers per queue.
    #[arg(long, default_value_t = 16)]
    pub workers: usize,
    /// SQLite durability: "full" fsyncs every commit, "normal" at checkpoints
    /// (WAL; safe against crashes of the process, not of the machine).
    #[arg(long, default_value = "full")]
    pub synchronous: String,
    /// Where to run: "sqlite" (a fresh file in --dir) or a new Spanner
    /// database, `spanner://projects/P/instances/I/databases/D`.
    #[arg(long, default_value = "sqlite")]
    pub store: String,
    /// Random seed for the generated orders.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Serve the console (read-only: no token) on this address while the
    /// demo runs; "off" for none.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub console: String,
    /// Watch it in the console: processing starts after `--start-after`
    /// seconds, and the console stays open after the summary until Ctrl-C.
    #[arg(long)]
    pub stay: bool,
    /// Seconds to wait between sending and processing, to open the console
    /// first (default 10 with --stay, else 0).
    #[arg(long)]
    pub start_after: Option<u64>,
}

struct Expected {
    payments_ok: usize,
    inventory_ok: usize,
    bad: usize,
}

fn config_text(args: &DemoArgs, guests: &std::path::Path) -> String {
    format!(
        r#"# Written by `onceq demo`; inspect with `onceq -c {dir}/onceq.toml stats`.
store = "{store}"
schema = ["payments.sql", "inventory.sql"]

[sqlite]
synchronous = "{sync}"

[defaults]
lease = "10s"
max_attempts = 3
backoff_initial = "50ms"
backoff_max = "1s"
workers = {workers}
batch = 16

[[queue]]
name = "payments"
handler = "{guests}/payments.wasm"
tables = ["accounts", "orders"]
connectors = ["charge"]

[[queue]]
name = "inventory"
handler = "{guests}/inventory.wasm"
tables = ["items", "reservations"]

# Charge intents are delivered after commit, at least once, with their key.
[[connector]]
name = "charge"
kind = "file"
path = "charges.jsonl"

[outbox]
backoff_initial = "50ms"
backoff_max = "1s"
"#,
        dir = args.dir.display(),
        store = if args.store == "sqlite" {
            "sqlite://demo.db"
        } else {
            args.store.as_str()
        },
        sync = args.synchronous,
        workers = args.workers,
        guests = guests.display(),
    )
}

async fn seed(store: &dyn Store) -> anyhow::Result<()> {
    let schema = store.schema();
    let mut tx = store.transaction_begin().await?;
    let write = |schema: &Schema, table: &str, cols: Vec<(&str, Value)>| -> anyhow::Result<_> {
        let w = crate::value::RowWrite {
            table: table.into(),
            op: WriteOp::Insert,
            columns: cols.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        };
        schema
            .table(table)
            .map_err(anyhow::Error::msg)?
            .check_write(&w)
            .map_err(anyhow::Error::msg)
    };
    for i in 0..ACCOUNTS {
        tx.row_write(write(
            &schema,
            "accounts",
            vec![
                ("id", Value::String(format!("acct-{i}"))),
                ("balance", Value::Int64(OPENING_BALANCE)),
            ],
        )?);
    }
    for i in 0..ITEMS {
        tx.row_write(write(
            &schema,
            "items",
            vec![("sku", Value::String(format!("sku-{i}"))), ("stock", Value::Int64(OPENING_STOCK))],
        )?);
    }
    tx.commit().await?;
    Ok(())
}

fn generate(n: usize, seed: u64) -> (Vec<SendParams>, Expected) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut msgs = Vec::with_capacity(n);
    let mut e = Expected {
        payments_ok: 0,
        inventory_ok: 0,
        bad: 0,
    };
    for i in 0..n {
        let roll: f64 = rng.random();
        let (queue, payload) = if roll < 0.005 {
            e.bad += 1;
            ("payments", b"{\"order_id\": \"o-broken\", \"amount\": ".to_vec())
        } else if roll < 0.8 {
            let unknown = rng.random::<f64>() < 0.01;
            let account = if unknown {
                format!("acct-missing-{i}")
            } else {
                format!("acct-{}", rng.random_range(0..ACCOUNTS))
            };
            if unknown {
                e.bad += 1;
            } else {
                e.payments_ok += 1;
            }
            let amount: i64 = rng.random_range(1..=1500);
            (
                "payments",
                serde_json::json!({ "order_id": format!("o-{i}"), "account": account, "amount": amount })
                    .to_string()
                    .into_bytes(),
            )
        } else {
            let unknown = rng.random::<f64>() < 0.01;
            let sku = if unknown {
                format!("sku-missing-{i}")
            } else {
                format!("sku-{}", rng.random_range(0..ITEMS))
            };
            if unknown {
                e.bad += 1;
            } else {
                e.inventory_ok += 1;
            }
            let qty: i64 = rng.random_range(1..=5);
            (
                "inventory",
                serde_json::json!({ "order_id": format!("o-{i}"), "sku": sku, "qty": qty })
                    .to_string()
                    .into_bytes(),
            )
        };
        msgs.push(SendParams {
            queue: queue.into(),
            payload,
            ..Default::default()
        });
    }
    (msgs, e)
}

fn col<'a>(row: &'a Row, name: &str) -> Option<&'a Value> {
    row.iter().find(|(k, _)| k == name).map(|(_, v)| v)
}

fn int(row: &Row, name: &str) -> i64 {
    match col(row, name) {
        Some(Value::Int64(i)) => *i,
        _ => 0,
    }
}

fn text<'a>(row: &'a Row, name: &str) -> &'a str {
    match col(row, name) {
        Some(Value::String(s)) => s,
        _ => "",
    }
}

/// Run the demo; the exit code is non-zero if an invariant fails.
pub async fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    let guests = std::fs::canonicalize(&args.guests)
        .with_context(|| format!("example components not found in {} (run `make guests`)", args.guests.display()))?;
    if args.dir.exists() {
        std::fs::remove_dir_all(&args.dir).with_context(|| format!("clearing {}", args.dir.display()))?;
    }
    std::fs::create_dir_all(&args.dir)?;
    let spanner = args.store.starts_with("spanner://");
    let (payments, inventory) = if spanner {
        (PAYMENTS_SCHEMA_SPANNER, INVENTORY_SCHEMA_SPANNER)
    } else {
        (PAYMENTS_SCHEMA, INVENTORY_SCHEMA)
    };
    std::fs::write(args.dir.join("payments.sql"), payments)?;
    std::fs::write(args.dir.join("inventory.sql"), inventory)?;
    let cfg_path = args.dir.join("onceq.toml");
    std::fs::write(&cfg_path, config_text(&args, &guests))?;
    let cfg = Config::load(&cfg_path)?;

    let backend = if spanner {
        format!("Spanner ({})", args.store)
    } else {
        format!("SQLite (synchronous={})", args.synchronous)
    };
    println!("onceq demo: {} messages, payments + inventory handlers, {backend}", args.messages);
    let base = app::init(&cfg).await?;
    seed(base.as_ref()).await?;
    let (mut msgs, expected) = generate(args.messages, args.seed);
    // Traced (OTEL_TRACES_EXPORTER=otlp): each message starts its trace
    // at its send, as `onceq send` starts it.
    let telemetry = crate::telemetry::Telemetry::start(&cfg.telemetry)?;
    let sent_at = std::time::SystemTime::now();
    let mut contexts = Vec::new();
    if telemetry.is_on() {
        for m in &mut msgs {
            let context = crate::trace::TraceParent::root();
            m.attributes
                .push((crate::trace::TRACEPARENT_ATTRIBUTE.to_string(), context.to_string()));
            contexts.push((m.queue.clone(), context));
        }
    }
    app::send_many(base.as_ref(), msgs, 1000).await?;
    for (queue, context) in &contexts {
        telemetry.sent(queue, context, None, None, sent_at);
    }
    println!(
        "  seeded {ACCOUNTS} accounts and {ITEMS} items; sent {} messages ({} of them bad on purpose)",
        args.messages, expected.bad
    );

    let (faulty, fault_counts) = FaultyStore::new(
        base.clone(),
        FaultPlan {
            after_commit: args.faults / 2.0,
            before_commit: args.faults / 2.0,
            limit: None,
            seed: args.seed,
            ..FaultPlan::default()
        },
    );
    let store: Arc<dyn Store> = Arc::new(faulty);
    let runtime = Arc::new(Runtime::new(cfg.runtime.clone())?);
    let host = crate::host::Host::assemble(&cfg, store.clone(), runtime)?;
    let runners = host.runners.clone();
    for r in &runners {
        r.set_telemetry(telemetry.clone());
    }
    telemetry.observe_commits(store.as_ref());
    let (console_stop, console_shutdown) = crate::shutdown::channel();
    tokio::spawn(crate::host::heartbeat(base.clone(), runners.clone(), console_shutdown.clone()));
    let console = match host.deployer.clone() {
        Some(deployer) if args.console != "off" => {
            let admin = Arc::new(crate::admin::Admin::new(crate::access::Tokens(Vec::new()), cfg.admin.max_upload));
            admin.serve_with(crate::admin::Serving {
                store: base.clone(),
                runners: runners.clone(),
                deployer,
                outbox_retention: cfg.outbox.retention,
                telemetry: crate::telemetry::Telemetry::off(),
            });
            admin.set_ready();
            let listener = tokio::net::TcpListener::bind(&args.console)
                .await
                .with_context(|| format!("console: cannot listen on {} (--console ADDR, or off)", args.console))?;
            let addr = listener.local_addr()?;
            tokio::spawn(crate::admin::serve(admin, listener, cfg.admin.limits, console_shutdown));
            println!(
                "  console: http://{addr}/console/  (live, read-only{})",
                if args.stay {
                    "; stays open after the summary"
                } else {
                    "; `make run STAY=1` keeps it open after the summary"
                }
            );
            Some(addr)
        }
        _ => None,
    };
    let wait = args.start_after.unwrap_or(if args.stay { 10 } else { 0 });
    if wait > 0 {
        println!("  processing starts in {wait} s: open the console to watch it live");
        tokio::time::sleep(Duration::from_secs(wait)).await;
    }

    let (queues, dispatchers): (Vec<_>, Vec<_>) = runners.iter().cloned().partition(|r| outbox::connector_of(&r.spec.name).is_none());
    let bar = indicatif::ProgressBar::new(args.messages as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("  {bar:40} {pos}/{len} messages  {per_sec}  eta {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let (stop, _) = crate::shutdown::channel();
    let started = Instant::now();
    let run = tokio::spawn(host.run(stop.clone(), true, cfg.shutdown_grace));
    let signals = tokio::spawn(async move {
        app::shutdown_signal().await;
        stop.request();
    });
    while !run.is_finished() {
        bar.set_position(queues.iter().map(|r| r.metrics.finished()).sum());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    run.await?;
    signals.abort();
    // What the committer holds is committed before the summary reads.
    store.close().await;
    telemetry.shutdown().await;
    let elapsed = started.elapsed();
    bar.set_position(queues.iter().map(|r| r.metrics.finished()).sum());
    bar.finish();

    let charges = read_charges(&args.dir.join("charges.jsonl"))?;
    let outcome = Outcome {
        queues: &queues,
        dispatchers: &dispatchers,
        elapsed,
        faults: fault_counts.total(),
        sent: args.messages,
        charges,
    };
    let code = summarize(&outcome, base.as_ref(), &expected).await;
    if let (Some(addr), true) = (console, args.stay) {
        println!();
        println!("console still open at http://{addr}/console/ — Ctrl-C to end");
        app::shutdown_signal().await;
    }
    console_stop.request();
    code
}

/// The idempotency keys in the `charge` connector's file, one per line
/// (a key appears more than once when a delivery was repeated).
fn read_charges(path: &std::path::Path) -> anyhow::Result<Vec<String>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).with_context(|| format!("{}: a line is not JSON", path.display()))?;
            Ok(v["idempotency_key"].as_str().unwrap_or_default().to_string())
        })
        .collect()
}

struct Outcome<'a> {
    queues: &'a [Arc<QueueRunner>],
    dispatchers: &'a [Arc<QueueRunner>],
    elapsed: Duration,
    faults: u64,
    sent: usize,
    /// Keys delivered to the charge file, with repeats.
    charges: Vec<String>,
}

fn sum(runners: &[Arc<QueueRunner>], f: impl Fn(&protocol::Metrics) -> u64) -> u64 {
    runners.iter().map(|r| f(&r.metrics)).sum()
}

/// Print what the run did, then check the invariants against the database
/// and the charge file: success only if every one holds.
async fn summarize(o: &Outcome<'_>, store: &dyn Store, expected: &Expected) -> anyhow::Result<ExitCode> {
    print_counts(o);
    if let Some(c) = store.commit_stats() {
        println!(
            "  group commit               {} batches, {:.1} messages each (leases, renewals and failure records between them)",
            c.batches,
            c.messages as f64 / c.batches.max(1) as f64
        );
    }
    let checks = invariants(o, store, expected).await?;
    println!();
    println!("invariants");
    let mut ok = true;
    for (what, pass) in &checks {
        ok &= pass;
        println!("  {} {what}", if *pass { "ok  " } else { "FAIL" });
    }
    if let Some(d) = store.dead_letter_list(Queues::All, 1).await?.first() {
        println!();
        println!("  e.g. dead letter {}: {}", d.id, d.reason);
    }
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// The run's counts, from the runners' metrics.
fn print_counts(o: &Outcome<'_>) {
    let (runners, elapsed, faults) = (o.queues, o.elapsed, o.faults);
    let processed = sum(runners, |m| m.processed.load(Relaxed));
    let already = sum(runners, |m| m.already_committed.load(Relaxed));
    let dead = sum(runners, |m| m.dead_lettered.load(Relaxed));
    let p50 = runners.iter().map(|r| r.metrics.latency_quantile(0.5)).max().unwrap_or(0);
    let p99 = runners.iter().map(|r| r.metrics.latency_quantile(0.99)).max().unwrap_or(0);
    println!();
    println!("summary");
    println!("  processed (acked)          {processed}");
    println!("  already committed          {already}   (unknown outcome, first commit had landed)");
    println!("  retried attempts           {}", sum(runners, |m| m.retried.load(Relaxed)));
    println!("  dead-lettered              {dead}");
    let delivered = sum(o.dispatchers, protocol::Metrics::acked);
    println!(
        "  intents delivered          {delivered}   (to charges.jsonl after commit; {} repeats after an unknown outcome, same key)",
        o.charges
            .len()
            .saturating_sub(o.charges.iter().collect::<std::collections::BTreeSet<_>>().len())
    );
    println!(
        "  unknown outcomes injected  {faults}   (re-runs: {} of messages, {} of deliveries)",
        sum(runners, |m| m.unknown_outcomes.load(Relaxed)),
        sum(o.dispatchers, |m| m.unknown_outcomes.load(Relaxed))
    );
    println!(
        "  aborted + re-run           {}",
        sum(runners, |m| m.aborted_reruns.load(Relaxed)) + sum(o.dispatchers, |m| m.aborted_reruns.load(Relaxed))
    );
    println!(
        "  throughput                 {:.0} messages/s + {:.0} deliveries/s  ({:.2}s; message latency p50 {:.2} ms, p99 {:.2} ms)",
        (processed + already + dead) as f64 / elapsed.as_secs_f64(),
        delivered as f64 / elapsed.as_secs_f64(),
        elapsed.as_secs_f64(),
        p50 as f64 / 1000.0,
        p99 as f64 / 1000.0
    );
}

/// Each invariant of the demo, worded, and whether it holds.
async fn invariants(o: &Outcome<'_>, store: &dyn Store, expected: &Expected) -> anyhow::Result<Vec<(String, bool)>> {
    let runners = o.queues;
    let processed = sum(runners, |m| m.processed.load(Relaxed));
    let already = sum(runners, |m| m.already_committed.load(Relaxed));
    let sent = o.sent;
    let accounts = store.table_rows("accounts").await?;
    let orders = store.table_rows("orders").await?;
    let items = store.table_rows("items").await?;
    let reservations = store.table_rows("reservations").await?;
    let stats = store.stats().await?;
    let balances: i64 = accounts.iter().map(|r| int(r, "balance")).sum();
    let charged: Vec<&Row> = orders.iter().filter(|r| text(r, "status") == "charged").collect();
    let charged_sum: i64 = charged.iter().map(|r| int(r, "amount")).sum();
    let stock: i64 = items.iter().map(|r| int(r, "stock")).sum();
    let reserved: i64 = reservations
        .iter()
        .filter(|r| text(r, "status") == "reserved")
        .map(|r| int(r, "qty"))
        .sum();
    let charge_keys: std::collections::BTreeSet<&str> = o.charges.iter().map(String::as_str).collect();
    let every_charge_delivered = charged
        .iter()
        .all(|r| charge_keys.contains(format!("charge-{}", text(r, "id")).as_str()));
    let left: u64 = stats.queues.iter().map(|q| q.ready + q.leased + q.delayed).sum();
    let (queues, connectors) = crate::outbox::inspect::split_stats(&stats);
    let dead_in_table: u64 = queues.iter().map(|q| q.dead).sum();
    let dead_intents: u64 = connectors.iter().map(|c| c.dead).sum();

    let checks = [
        (
            format!(
                "money conserved: balances {balances} + charged {charged_sum} = {}",
                ACCOUNTS as i64 * OPENING_BALANCE
            ),
            balances + charged_sum == ACCOUNTS as i64 * OPENING_BALANCE,
        ),
        (
            format!(
                "each payment order processed once: {} orders for {} valid messages",
                orders.len(),
                expected.payments_ok
            ),
            orders.len() == expected.payments_ok,
        ),
        (
            format!(
                "one charge delivered per charged order: {} keys in charges.jsonl, {} charged, {dead_intents} undeliverable",
                charge_keys.len(),
                charged.len()
            ),
            charge_keys.len() == charged.len() && every_charge_delivered && dead_intents == 0,
        ),
        (
            format!(
                "stock conserved: stock {stock} + reserved {reserved} = {}",
                ITEMS as i64 * OPENING_STOCK
            ),
            stock + reserved == ITEMS as i64 * OPENING_STOCK,
        ),
        (
            format!(
                "each reservation processed once: {} rows for {} valid messages",
                reservations.len(),
                expected.inventory_ok
            ),
            reservations.len() == expected.inventory_ok,
        ),
        (
            format!("bad messages dead-lettered: {dead_in_table} of {}", expected.bad),
            dead_in_table == expected.bad as u64,
        ),
        (
            format!(
                "every message accounted for: {} acked + {dead_in_table} dead = {sent} sent, {left} left",
                processed + already
            ),
            processed + already + dead_in_table == sent as u64 && left == 0,
        ),
    ];
    Ok(checks.into())
}
