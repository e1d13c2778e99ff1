//! The `onceq` command line: argument parsing and printing only; the work is
//! in `onceq::app`.

use anyhow::Context;
use clap::{Parser, Subcommand};
use onceq::app;
use onceq::config::{parse_duration, Config};
use onceq::names::printable;
use onceq::store::SendParams;
use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "onceq", version, about = "Exactly-once message handlers as WebAssembly components")]
struct Cli {
    /// Configuration file.
    #[arg(long, short, global = true, env = "ONCEQ_CONFIG", default_value = "onceq.toml")]
    config: PathBuf,
    /// Log format.
    #[arg(long, global = true, value_enum, default_value = "text")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Create the database: onceq's tables plus the schema file(s).
    Init,
    /// Enqueue messages.
    Send {
        queue: String,
        /// The payload, as JSON text.
        #[arg(long, conflicts_with_all = ["file", "jsonl"])]
        payload: Option<String>,
        /// Read the payload (raw bytes) from a file.
        #[arg(long, conflicts_with = "jsonl")]
        file: Option<PathBuf>,
        /// Send one message per line of a JSON-lines file ("-" for stdin).
        #[arg(long)]
        jsonl: Option<String>,
        /// Producer deduplication key (single message only).
        #[arg(long, conflicts_with = "jsonl")]
        dedup_key: Option<String>,
        /// Deliver no earlier than this from now ("30s", "5m").
        #[arg(long)]
        delay: Option<String>,
        /// NAME=VALUE attribute (repeatable).
        #[arg(long = "attribute", short = 'a')]
        attributes: Vec<String>,
    },
    /// Serve the configured queues until SIGINT/SIGTERM.
    Run {
        /// Exit once every configured queue is drained.
        #[arg(long)]
        until_empty: bool,
    },
    /// Per-queue counts (ready, leased, delayed, dead) and per-connector
    /// outbox counts (pending, in flight, dead, delivered).
    Stats {
        #[arg(long)]
        json: bool,
    },
    /// Inspect and replay dead letters.
    Dlq {
        #[command(subcommand)]
        command: DlqCommand,
    },
    /// Deploy a new version of a queue's handler to a running host (through
    /// its admin API): validated first, then switched to atomically.
    Deploy {
        queue: String,
        component: PathBuf,
        /// A label for the version ("v2", a git sha...).
        #[arg(long)]
        label: Option<String>,
        /// The host's admin API (default: from its state folder or the config).
        #[arg(long)]
        admin: Option<String>,
    },
    /// A queue's deployed versions on a running host, newest first.
    Versions {
        queue: String,
        #[arg(long)]
        admin: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Return a queue to the version deployed before the current one.
    Rollback {
        queue: String,
        #[arg(long)]
        admin: Option<String>,
    },
    /// Inspect undelivered intents and replay dead ones.
    Outbox {
        #[command(subcommand)]
        command: OutboxCommand,
    },
    /// Validate a component against the handler world; print its imports
    /// and exports.
    Check { component: PathBuf },
    /// Run one message through a component against the database, print the
    /// effects, and commit nothing.
    Try {
        component: PathBuf,
        /// File holding the message payload.
        #[arg(long)]
        message: PathBuf,
        /// Queue whose grants apply (default: all tables granted).
        #[arg(long, default_value = "try")]
        queue: String,
        /// Message id (fixes the handler's random seed).
        #[arg(long)]
        id: Option<String>,
    },
    /// Write a new handler project, ready to build, check and run.
    New {
        name: String,
        /// Language of the handler: rust, js or python.
        #[arg(long, default_value = "rust")]
        lang: String,
        /// Where to create it.
        #[arg(long, default_value = ".")]
        dir: PathBuf,
        /// The Rust guest SDK's folder (default: the one next to this onceq).
        #[arg(long)]
        sdk: Option<PathBuf>,
    },
    /// The `make run` demo: fresh database, example handlers, 10,000
    /// messages, a summary with invariant checks.
    Demo(onceq::demo::DemoArgs),
}

#[derive(Subcommand)]
enum OutboxCommand {
    /// Undelivered intents: pending and in flight (oldest first), then dead.
    List {
        /// Only this connector's intents.
        #[arg(long)]
        connector: Option<String>,
        /// Only dead intents (refused, or out of attempts).
        #[arg(long)]
        dead: bool,
        #[arg(long, default_value_t = 50)]
        limit: usize,
        #[arg(long)]
        json: bool,
    },
    /// One undelivered intent, with its payload and last error.
    Show { id: String },
    /// Put a dead intent back in the outbox (same key, attempts reset).
    Replay { id: String },
}

#[derive(Subcommand)]
enum DlqCommand {
    List {
        #[arg(long)]
        queue: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: usize,
        #[arg(long)]
        json: bool,
    },
    Show {
        id: String,
    },
    /// Put a dead letter back on its queue.
    Replay {
        id: String,
    },
}

fn init_tracing(format: LogFormat, default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    // Colours only on a terminal: a log file or a pipe gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    match format {
        LogFormat::Text => b.init(),
        LogFormat::Json => b.json().init(),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The demo prints its own summary; per-message logs would drown it.
    let default_filter = if matches!(cli.command, Command::Demo(_)) {
        "warn"
    } else {
        "onceq=info,warn"
    };
    init_tracing(cli.log_format, default_filter);
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(dispatch(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn dispatch(cli: Cli) -> anyhow::Result<ExitCode> {
    let path = cli.config;
    let cfg = || Config::load(&path);
    match cli.command {
        Command::Demo(args) => onceq::demo::run(args).await,
        Command::New { name, lang, dir, sdk } => new_project(&name, &lang, &dir, sdk.as_deref()),
        Command::Check { component } => check(&component),
        Command::Init => init(&cfg()?).await,
        Command::Send {
            queue,
            payload,
            file,
            jsonl,
            dedup_key,
            delay,
            attributes,
        } => send(&cfg()?, &path, queue, payload, file, jsonl, dedup_key, delay, attributes).await,
        Command::Run { until_empty } => run(&cfg()?, until_empty).await,
        Command::Stats { json } => stats(&cfg()?, json).await,
        Command::Dlq { command } => dlq(&cfg()?, command).await,
        Command::Deploy {
            queue,
            component,
            label,
            admin,
        } => deploy(&cfg()?, queue, component, label, admin).await,
        Command::Versions { queue, admin, json } => versions(&cfg()?, queue, admin, json).await,
        Command::Rollback { queue, admin } => rollback(&cfg()?, queue, admin).await,
        Command::Outbox { command } => outbox(&cfg()?, command).await,
        Command::Try {
            component,
            message,
            queue,
            id,
        } => try_message(&cfg()?, component, message, queue, id).await,
    }
}

/// `onceq new`.
fn new_project(name: &str, lang: &str, dir: &std::path::Path, sdk: Option<&std::path::Path>) -> anyhow::Result<ExitCode> {
    let p = onceq::scaffold::new_project(dir, name, lang, sdk)?;
    println!("created {} ({} handler); next:", p.dir.display(), p.lang);
    println!("  cd {}", p.dir.display());
    for step in p.build {
        println!("  {step}");
    }
    println!("  onceq check {}", p.component);
    println!("  onceq init && onceq try {} --message message.json --queue {name}", p.component);
    Ok(ExitCode::SUCCESS)
}

/// `onceq check`.
fn check(component: &std::path::Path) -> anyhow::Result<ExitCode> {
    let (info, verdict) = app::check(component)?;
    println!("component: {}", component.display());
    println!("version:   {}", info.version);
    println!("size:      {} bytes", info.size);
    println!("imports:");
    let forbidden = onceq::runtime::wasi::check_imports(info.imports.iter().map(String::as_str));
    for i in &info.imports {
        let bad = forbidden.iter().any(|f| f.starts_with(i.as_str()));
        println!("  {} {i}", if bad { "✗" } else { "✓" });
    }
    println!("exports:");
    for e in &info.exports {
        println!("  {e}");
    }
    Ok(match verdict {
        Ok(()) => {
            println!("ok: fits the onceq:handler world");
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("refused: {e}");
            ExitCode::FAILURE
        }
    })
}

/// `onceq init`.
async fn init(cfg: &Config) -> anyhow::Result<ExitCode> {
    let store = app::init(cfg).await?;
    let tables: Vec<String> = store.schema().tables.keys().cloned().collect();
    println!(
        "initialized {} (business tables: {})",
        cfg.store,
        if tables.is_empty() { "none".into() } else { tables.join(", ") }
    );
    Ok(ExitCode::SUCCESS)
}

/// `onceq send`.
#[allow(clippy::too_many_arguments)]
async fn send(
    cfg: &Config,
    config_path: &std::path::Path,
    queue: String,
    payload: Option<String>,
    file: Option<PathBuf>,
    jsonl: Option<String>,
    dedup_key: Option<String>,
    delay: Option<String>,
    attributes: Vec<String>,
) -> anyhow::Result<ExitCode> {
    onceq::names::check_queue(&queue).map_err(|e| anyhow::anyhow!("{e} (intents come from handlers, through the outbox)"))?;
    let max_delay = cfg
        .queue(&queue)
        .map(|q| q.effect_limits.max_delay)
        .unwrap_or(onceq::protocol::effects::MAX_DELAY);
    let delay = match delay {
        Some(d) => parse_duration("--delay", &d)?,
        None => Default::default(),
    };
    if delay > max_delay {
        anyhow::bail!(
            "--delay {} is over the limit of {} (the queue's max_delay setting)",
            onceq::names::duration(delay),
            onceq::names::duration(max_delay)
        );
    }
    let attributes = attributes
        .iter()
        .map(|a| app::parse_attribute(a))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if let Some((k, _)) = attributes.iter().find(|(k, _)| onceq::names::is_reserved(k)) {
        anyhow::bail!("--attribute {k}: names starting with \"onceq.\" are set by onceq itself");
    }
    if let Some(k) = &dedup_key {
        if k.len() > onceq::names::MAX_KEY_LEN {
            anyhow::bail!(
                "--dedup-key is {} bytes long, over the limit of {}",
                k.len(),
                onceq::names::MAX_KEY_LEN
            );
        }
    }
    if cfg.queue(&queue).is_err() {
        eprintln!(
            "warning: no [[queue]] named {queue} in {}: nothing here will process these messages (queues: {})",
            config_path.display(),
            cfg.queues.iter().map(|q| q.name.as_str()).collect::<Vec<_>>().join(", ")
        );
    }
    let store = app::open_store(cfg).await?;
    let payloads: Vec<Vec<u8>> = if let Some(src) = jsonl {
        let mut text = String::new();
        if src == "-" {
            std::io::stdin().read_to_string(&mut text).context("reading stdin")?;
        } else {
            text = std::fs::read_to_string(&src).with_context(|| format!("reading {src}"))?;
        }
        app::parse_jsonl(&text).with_context(|| format!("in {src}"))?
    } else if let Some(f) = file {
        vec![std::fs::read(&f).with_context(|| format!("reading {}", f.display()))?]
    } else if let Some(p) = payload {
        serde_json::from_str::<serde_json::Value>(&p).context("--payload is not valid JSON")?;
        vec![p.into_bytes()]
    } else {
        anyhow::bail!("give the message with --payload JSON, --file F or --jsonl F")
    };
    let msgs: Vec<SendParams> = payloads
        .into_iter()
        .map(|payload| SendParams {
            queue: queue.clone(),
            payload,
            attributes: attributes.clone(),
            delay,
            dedup_key: dedup_key.clone(),
            dedup_window: None,
        })
        .collect();
    let (sent, dup) = app::send_many(store.as_ref(), msgs, 1000).await?;
    println!(
        "sent {sent} message(s) to {queue}{}",
        if dup > 0 {
            format!(", {dup} dropped as duplicates")
        } else {
            String::new()
        }
    );
    Ok(ExitCode::SUCCESS)
}

/// `onceq run`.
async fn run(cfg: &Config, until_empty: bool) -> anyhow::Result<ExitCode> {
    let runners = app::run(cfg, app::shutdown_signal(), until_empty).await?;
    for r in runners {
        let m = &r.metrics;
        use std::sync::atomic::Ordering::Relaxed;
        println!(
            "{}: processed {}, already committed {}, retried {}, dead-lettered {}, released {}",
            r.spec.name,
            m.processed.load(Relaxed),
            m.already_committed.load(Relaxed),
            m.retried.load(Relaxed),
            m.dead_lettered.load(Relaxed),
            m.released.load(Relaxed)
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `onceq stats`.
async fn stats(cfg: &Config, json: bool) -> anyhow::Result<ExitCode> {
    let store = app::open_store(cfg).await?;
    let stats = store.stats().await?;
    let (queues, outbox) = onceq::outbox::inspect::split_stats(&stats);
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "queues": queues, "outbox": outbox }))?
        );
    } else {
        println!("{:<24} {:>8} {:>8} {:>8} {:>8}", "QUEUE", "READY", "LEASED", "DELAYED", "DEAD");
        for q in &queues {
            println!(
                "{:<24} {:>8} {:>8} {:>8} {:>8}",
                printable(&q.queue),
                q.ready,
                q.leased,
                q.delayed,
                q.dead
            );
        }
        if queues.is_empty() {
            println!("(no messages)");
        }
        for q in queues.iter().filter(|q| q.expired_leases > 0) {
            println!(
                "{}: {} of the ready messages were leased by a worker that is gone (crashed, stalled or cut off from the store); another worker takes them again",
                printable(&q.queue),
                q.expired_leases
            );
        }
        println!();
        println!(
            "{:<24} {:>8} {:>9} {:>8} {:>10}",
            "OUTBOX", "PENDING", "IN-FLIGHT", "DEAD", "DELIVERED"
        );
        for c in &outbox {
            println!(
                "{:<24} {:>8} {:>9} {:>8} {:>10}",
                c.connector, c.pending, c.in_flight, c.dead, c.delivered_retained
            );
        }
        if outbox.is_empty() {
            println!("(no intents)");
        } else {
            println!("(DELIVERED: keys kept for the retention window, to drop duplicate emissions)");
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `onceq dlq`.
async fn dlq(cfg: &Config, command: DlqCommand) -> anyhow::Result<ExitCode> {
    let store = app::open_store(cfg).await?;
    match command {
        DlqCommand::List { queue, limit, json } => {
            let sel = match &queue {
                Some(q) => onceq::store::Queues::Named(q),
                None => onceq::store::Queues::All,
            };
            let list = store.dead_letter_list(sel, limit).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                for d in &list {
                    // Queue and reason may come from a handler or a
                    // producer: escaped, so they cannot drive the terminal.
                    println!(
                        "{}  {:<16} attempts={}  {}",
                        d.id,
                        printable(&d.queue),
                        d.attempts,
                        printable(&d.reason)
                    );
                }
                if list.is_empty() {
                    println!("no dead letters");
                }
            }
        }
        DlqCommand::Show { id } => match store.dead_letter_get(&id).await? {
            Some(d) => println!("{}", serde_json::to_string_pretty(&d)?),
            None => anyhow::bail!("no dead letter with id {id}"),
        },
        DlqCommand::Replay { id } => match store.dead_letter_replay(&id).await? {
            Some(new_id) => println!("replayed {id}: back on its queue as {new_id}"),
            None => anyhow::bail!("no dead letter with id {id}"),
        },
    }
    Ok(ExitCode::SUCCESS)
}

/// `onceq deploy`.
async fn deploy(cfg: &Config, queue: String, component: PathBuf, label: Option<String>, admin: Option<String>) -> anyhow::Result<ExitCode> {
    let bytes = std::fs::read(&component).with_context(|| format!("reading {}", component.display()))?;
    let client = app::admin_client(cfg, admin.as_deref())?;
    let d = client.deploy(&queue, bytes, label.as_deref()).await?;
    println!(
        "deployed {} to {queue}{}: new leases use it; messages in flight finish on the previous version",
        d.version,
        d.label.map(|l| format!(" ({l})")).unwrap_or_default()
    );
    Ok(ExitCode::SUCCESS)
}

/// `onceq versions`.
async fn versions(cfg: &Config, queue: String, admin: Option<String>, json: bool) -> anyhow::Result<ExitCode> {
    let client = app::admin_client(cfg, admin.as_deref())?;
    let list = client.versions(&queue).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&list)?);
    } else {
        println!(
            "{:<2} {:<16}  {:<12} {:<9} {:>9}  DEPLOYED",
            "", "VERSION", "LABEL", "SOURCE", "BYTES"
        );
        for v in &list {
            let d = &v.deployment;
            let when = humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + std::time::Duration::from_millis(d.at_ms));
            println!(
                "{:<2} {:<16}  {:<12} {:<9} {:>9}  {when}",
                if v.active { "*" } else { "" },
                d.version,
                d.label.as_deref().unwrap_or("-"),
                d.source,
                d.size
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `onceq rollback`.
async fn rollback(cfg: &Config, queue: String, admin: Option<String>) -> anyhow::Result<ExitCode> {
    let client = app::admin_client(cfg, admin.as_deref())?;
    let d = client.rollback(&queue).await?;
    println!(
        "rolled {queue} back to {}{}",
        d.version,
        d.label.map(|l| format!(" ({l})")).unwrap_or_default()
    );
    Ok(ExitCode::SUCCESS)
}

/// `onceq outbox`.
async fn outbox(cfg: &Config, command: OutboxCommand) -> anyhow::Result<ExitCode> {
    let store = app::open_store(cfg).await?;
    match command {
        OutboxCommand::List {
            connector,
            dead,
            limit,
            json,
        } => {
            let list = onceq::outbox::inspect::list(store.as_ref(), connector.as_deref(), dead, limit).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                println!(
                    "{:<32}  {:<10} {:<12} {:<9} {:>8}  REASON",
                    "ID", "STATE", "CONNECTOR", "KEY", "ATTEMPTS"
                );
                for e in &list {
                    println!(
                        "{:<32}  {:<10} {:<12} {:<9} {:>8}  {}",
                        e.intent.id,
                        e.state,
                        e.intent.connector,
                        printable(&e.intent.idempotency_key),
                        e.intent.attempt,
                        printable(e.reason.as_deref().unwrap_or(""))
                    );
                }
                if list.is_empty() {
                    println!("no undelivered intents");
                }
            }
        }
        OutboxCommand::Show { id } => {
            let e = onceq::outbox::inspect::get(store.as_ref(), &id).await?;
            println!("{}", serde_json::to_string_pretty(&e)?);
        }
        OutboxCommand::Replay { id } => {
            let e = onceq::outbox::inspect::replay(store.as_ref(), &id).await?;
            println!(
                "replayed intent {id} (connector {}, key {}): back in the outbox",
                e.intent.connector,
                printable(&e.intent.idempotency_key)
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `onceq try`.
async fn try_message(cfg: &Config, component: PathBuf, message: PathBuf, queue: String, id: Option<String>) -> anyhow::Result<ExitCode> {
    let payload = std::fs::read(&message).with_context(|| format!("reading {}", message.display()))?;
    let report = app::try_message(cfg, &component, &queue, payload, id).await?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    if report.outcome != "ok" {
        return Ok(ExitCode::from(2));
    }
    Ok(ExitCode::SUCCESS)
}
