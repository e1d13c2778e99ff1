//! The `onceq` command line: argument parsing and printing only; the work is
//! in [`crate::app`]. The binary (`src/bin/onceq.rs`) calls [`main`].
//!
//! It lives in the library, not in the binary, for build time: an async
//! function's body is compiled again in every crate that awaits it (its
//! state machine counts as generic), so a binary that awaited the
//! library's commands compiled the store, the Spanner client and wasmtime's
//! async paths a second time (as long as the library itself, in a cold
//! release build). Called through one plain function, they are compiled
//! once, here.

use crate::app;
use crate::config::{parse_duration, Config};
use crate::names::printable;
use crate::store::SendParams;
use anyhow::Context;
use clap::{Parser, Subcommand};
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
    /// A queue's messages, oldest first: state, attempts, payload,
    /// attributes and the last failure.
    Peek {
        queue: String,
        #[arg(long, default_value_t = 20)]
        limit: usize,
        #[arg(long)]
        json: bool,
    },
    /// Pause a queue: no host leases from it until `onceq resume` (what
    /// hosts hold finishes). Recorded in the audit trail.
    Pause {
        queue: String,
        /// Through a running host's admin API, as its token (default: on
        /// the database directly, recorded as local:USER).
        #[arg(long)]
        admin: Option<String>,
    },
    /// Resume a paused queue.
    Resume {
        queue: String,
        /// Through a running host's admin API, as its token.
        #[arg(long)]
        admin: Option<String>,
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
    /// and exports. With an onceq.toml, what it compiles goes into the
    /// compiled cache (`try`, `test` and `run` then read it).
    Check { component: PathBuf },
    /// The compiled-component cache (`STATE_DIR/cache`).
    Cache {
        #[command(subcommand)]
        command: CacheCommand,
    },
    /// Run one message through a component against the database, print the
    /// effects, and commit nothing.
    Try {
        component: PathBuf,
        /// File holding the message payload ("-" for stdin).
        #[arg(long)]
        message: PathBuf,
        /// Queue whose grants and limits apply (default: the config's only
        /// queue; with several, every table granted and no enqueue or
        /// intent targets).
        #[arg(long)]
        queue: Option<String>,
        /// Message id (fixes the handler's random seed).
        #[arg(long)]
        id: Option<String>,
    },
    /// Run a handler's test cases (`*.test.toml`: fixture rows, a message,
    /// the expected outcome and effects) against its built component, with
    /// the verdicts of a real run; no database needed.
    Test {
        /// Test files (default: every `*.test.toml` next to the config and
        /// in its `tests/` folder).
        files: Vec<PathBuf>,
        /// Only the cases whose name contains this.
        #[arg(long)]
        filter: Option<String>,
        /// Print the results as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Type declarations for handlers, generated from the schema files: a
    /// wrong table, column or value type then fails the author's own type
    /// check (`npm run check`, `make check`, rustc).
    Types {
        /// Language: ts (TypeScript declarations `schema.d.ts`, also for
        /// JavaScript checked by tsc), py (a `schema_types.pyi` stub for
        /// mypy) or rust (a `schema.rs` module of typed tables).
        #[arg(long, default_value = "ts")]
        lang: String,
        /// Write here (default: print).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// The author's loop: watch the project, rebuild with its own build
    /// command on a change, load and test the component (`onceq test`),
    /// and hot-swap it into the running local host when the tests pass.
    Dev {
        /// The build command (default: cargo, npm run build or make, from
        /// the project's files).
        #[arg(long)]
        build: Option<String>,
        /// How often files are checked for changes.
        #[arg(long, default_value = "500ms")]
        poll: String,
        /// One round (build, test, deploy), then exit with its verdict.
        #[arg(long)]
        once: bool,
        /// Build and test only; never deploy.
        #[arg(long)]
        no_deploy: bool,
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
        /// Rust: depend on this guest SDK crate by path (default: a copy of
        /// the SDK in the project, so it builds wherever it goes).
        #[arg(long)]
        sdk: Option<PathBuf>,
    },
    /// The `make run` demo: fresh database, example handlers, 10,000
    /// messages, a summary with invariant checks.
    Demo(crate::demo::DemoArgs),
    /// Sign a component (minisign's format): writes COMPONENT.minisig,
    /// which `onceq deploy`, the watched folder and `onceq run` send or
    /// read beside it.
    Sign {
        component: PathBuf,
        /// The secret key file (`onceq keygen`, or `minisign -G`).
        #[arg(long)]
        key: PathBuf,
        /// The variable holding the key's password, if it has one.
        #[arg(long, default_value = "ONCEQ_SIGN_PASSWORD")]
        password_env: String,
    },
    /// Make a signing key pair: PREFIX.key (secret) and PREFIX.pub (for
    /// deploy.trusted_keys).
    Keygen {
        prefix: PathBuf,
        /// Protect the secret key with the password in this variable.
        #[arg(long)]
        password_env: Option<String>,
    },
    /// The audit trail, newest first: deploys, rollbacks, replays,
    /// discards, who did them and how they ended.
    Audit {
        #[arg(long)]
        queue: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: usize,
        #[arg(long)]
        json: bool,
        /// Through a running host's admin API, as its token (the entries
        /// of the token's queues); default: the database directly.
        #[arg(long)]
        admin: Option<String>,
    },
}

#[derive(Subcommand)]
enum CacheCommand {
    /// Remove the least recently used entries until the cache fits
    /// `runtime.cache_max_bytes` (or --max-bytes; 0 empties it).
    Prune {
        /// The bound, e.g. 256MiB (default: runtime.cache_max_bytes).
        #[arg(long)]
        max_bytes: Option<String>,
    },
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
    /// Intents delivered within the retention window (`outbox.retention`),
    /// newest first: connector, key and delivery time (only the key is kept
    /// after delivery).
    Delivered {
        /// Only this connector's intents.
        #[arg(long)]
        connector: Option<String>,
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
    /// Put a dead letter back on its queue (recorded in the audit trail).
    Replay {
        id: String,
        /// Through a running host's admin API, as its token (default: on
        /// the database directly, recorded as local:USER).
        #[arg(long)]
        admin: Option<String>,
    },
    /// Delete a dead letter for good (recorded in the audit trail).
    Discard {
        id: String,
        /// Through a running host's admin API, as its token.
        #[arg(long)]
        admin: Option<String>,
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

/// The `onceq` command: parse the arguments, run the command, and map its
/// error to a message and exit code 1.
/// Whether `args` (the program name first) is a command line `onceq`
/// accepts; the parser's message if not. The docs' tests check every
/// command the book shows with it.
pub fn check_args<I, T>(args: I) -> Result<(), String>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    match Cli::try_parse_from(args) {
        Ok(_) => Ok(()),
        Err(e)
            if matches!(
                e.kind(),
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion
            ) =>
        {
            Ok(())
        }
        Err(e) => Err(e.to_string()),
    }
}

/// A reader that went away (`onceq stats --json | head -c 10`) ends onceq
/// quietly, as it ends other Unix tools: status 141 (128 + SIGPIPE), where
/// printing to the closed pipe panicked (status 101 and a panic message).
/// Any other panic is reported as before.
fn quiet_on_closed_pipe() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or_default();
        if message.starts_with("failed printing to stdout") && message.contains("Broken pipe") {
            std::process::exit(141);
        }
        report(info);
    }));
}

pub fn main() -> ExitCode {
    quiet_on_closed_pipe();
    let cli = Cli::parse();
    // The demo prints its own summary; per-message logs would drown it
    // (its poison messages and injected faults are counted there).
    let default_filter = if matches!(cli.command, Command::Demo(_)) {
        "warn,onceq::protocol=error"
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
        Command::Demo(args) => crate::demo::run(args).await,
        Command::Sign {
            component,
            key,
            password_env,
        } => {
            let password = std::env::var(&password_env).ok().filter(|p| !p.is_empty());
            let (path, signer) = crate::signing::sign(&component, &key, password)?;
            println!("signed {} by {signer}: {}", component.display(), path.display());
            Ok(ExitCode::SUCCESS)
        }
        Command::Keygen { prefix, password_env } => {
            let password = match &password_env {
                Some(var) => Some(
                    std::env::var(var)
                        .ok()
                        .filter(|p| !p.is_empty())
                        .with_context(|| format!("--password-env: the variable {var} is not set"))?,
                ),
                None => None,
            };
            let (public, id) = crate::signing::keygen(&prefix, password)?;
            println!(
                "wrote {} (secret: keep it out of the repository) and {}\nkey id {id}; trust it with:\n  [deploy]\n  trusted_keys = [\"{public}\"]",
                prefix.with_extension("key").display(),
                prefix.with_extension("pub").display()
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Audit { queue, limit, json, admin } => audit(&cfg()?, queue, limit, json, admin).await,
        Command::New { name, lang, dir, sdk } => new_project(&name, &lang, &dir, sdk.as_deref()),
        Command::Check { component } => check(&component, &path),
        Command::Cache {
            command: CacheCommand::Prune { max_bytes },
        } => cache_prune(&cfg()?, max_bytes.as_deref()),
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
        Command::Pause { queue, admin } => pause(&cfg()?, &queue, true, admin).await,
        Command::Resume { queue, admin } => pause(&cfg()?, &queue, false, admin).await,
        Command::Peek { queue, limit, json } => peek(&cfg()?, &queue, limit, json).await,
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
        Command::Test { files, filter, json } => test(&cfg()?, &path, files, filter, json).await,
        Command::Types { lang, out } => types(&cfg()?, &lang, out),
        Command::Dev {
            build,
            poll,
            once,
            no_deploy,
        } => {
            let opts = crate::dev::DevOptions {
                build,
                poll: parse_duration("--poll", &poll)?,
                once,
                deploy: !no_deploy,
            };
            dev(&cfg()?, &path, opts).await
        }
    }
}

/// `onceq types`.
fn types(cfg: &Config, lang: &str, out: Option<PathBuf>) -> anyhow::Result<ExitCode> {
    if cfg.schema.is_empty() {
        anyhow::bail!("the config names no schema files (`schema = \"schema.sql\"`): no tables to declare");
    }
    let schema = crate::store::sqlite::schema_from_ddl(&cfg.schema_ddl()?).context("reading the schema files as SQLite DDL")?;
    let names: Vec<String> = cfg
        .schema
        .iter()
        .map(|p| p.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default())
        .collect();
    let Some(text) = crate::typegen::generate(lang, &schema, &names.join(", ")) else {
        anyhow::bail!("--lang {lang}: onceq generates types for {}", crate::typegen::LANGUAGES.join(", "));
    };
    match out {
        None => print!("{text}"),
        Some(path) => {
            std::fs::write(&path, &text).with_context(|| format!("writing {}", path.display()))?;
            eprintln!("wrote {} ({} tables)", path.display(), schema.tables.len());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The folder of the config file: the project.
fn project_of(config: &std::path::Path) -> &std::path::Path {
    config
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."))
}

/// `onceq dev`.
async fn dev(cfg: &Config, config: &std::path::Path, opts: crate::dev::DevOptions) -> anyhow::Result<ExitCode> {
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let r = crate::dev::run(cfg, project_of(config), opts, shutdown).await?;
    Ok(if r.ok() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// `onceq test`.
async fn test(cfg: &Config, config: &std::path::Path, files: Vec<PathBuf>, filter: Option<String>, json: bool) -> anyhow::Result<ExitCode> {
    let files = if files.is_empty() {
        let found = crate::testcases::discover(project_of(config));
        if found.is_empty() {
            anyhow::bail!(
                "no test files: write NAME.test.toml next to {} or in tests/ (see docs/src/handlers/testing.md)",
                config.display()
            );
        }
        found
    } else {
        files
    };
    if let Ok(schema) = crate::testcases::schema(cfg) {
        for stale in crate::typegen::stale(project_of(config), &schema) {
            eprintln!("warning: {stale}");
        }
    }
    let results = crate::testcases::run(cfg, &files, filter.as_deref(), &|m| eprintln!("{m}")).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    } else {
        print!("{}", crate::testcases::render(&results));
    }
    let failed: usize = results.iter().map(|f| f.failed()).sum();
    Ok(if failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// `onceq new`.
fn new_project(name: &str, lang: &str, dir: &std::path::Path, sdk: Option<&std::path::Path>) -> anyhow::Result<ExitCode> {
    let p = crate::scaffold::new_project(dir, name, lang, sdk)?;
    println!("created {} ({} handler); next:", p.dir.display(), p.lang);
    println!("  cd {}", p.dir.display());
    for step in p.build {
        println!("  {step}");
    }
    println!("  onceq check {}", p.component);
    println!("  onceq init && onceq try {} --message message.json --queue {name}", p.component);
    Ok(ExitCode::SUCCESS)
}

/// `onceq cache prune`.
fn cache_prune(cfg: &Config, max_bytes: Option<&str>) -> anyhow::Result<ExitCode> {
    let Some(dir) = cfg.runtime.cache_dir.as_ref() else {
        println!("the compiled cache is off (runtime.cache = false): nothing to prune");
        return Ok(ExitCode::SUCCESS);
    };
    let max = match max_bytes {
        Some(m) => crate::config::parse_size("--max-bytes", m)? as u64,
        None => cfg.runtime.cache_max_bytes,
    };
    if !dir.exists() {
        println!("{}: no compiled cache yet", dir.display());
        return Ok(ExitCode::SUCCESS);
    }
    let p = crate::runtime::cache::prune(dir, max, None).with_context(|| format!("pruning {}", dir.display()))?;
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "{}: removed {} entr{} ({:.1} MiB); kept {} ({:.1} MiB, bound {:.1} MiB)",
        dir.display(),
        p.removed,
        if p.removed == 1 { "y" } else { "ies" },
        mib(p.freed_bytes),
        p.kept,
        mib(p.kept_bytes),
        mib(max)
    );
    Ok(ExitCode::SUCCESS)
}

/// `onceq check`: through the compiled cache of the configuration when
/// there is one.
fn check(component: &std::path::Path, config: &std::path::Path) -> anyhow::Result<ExitCode> {
    let cfg = if config.exists() {
        match Config::load(config) {
            Ok(cfg) => Some(cfg),
            Err(e) => {
                eprintln!("note: {} not used (the compiled cache is not written): {e:#}", config.display());
                None
            }
        }
    } else {
        None
    };
    if let Some(schema) = cfg.as_ref().and_then(|c| crate::testcases::schema(c).ok()) {
        for stale in crate::typegen::stale(project_of(config), &schema) {
            eprintln!("warning: {stale}");
        }
    }
    let (info, verdict) = app::check(component, cfg.as_ref(), &|m| eprintln!("{m}"))?;
    println!("component: {}", component.display());
    println!("version:   {}", info.version);
    println!("size:      {} bytes", info.size);
    println!("imports:");
    let forbidden = crate::runtime::wasi::check_imports(info.imports.iter().map(String::as_str));
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
            if !info.imports.iter().any(|i| i.starts_with("wasi:")) {
                println!(
                    "note: it imports no WASI at all, so it was built with stubbed capabilities (componentize-py \
                     --stub-wasi does this): a call to open(), a socket or urllib traps at run time"
                );
            }
            println!(
                "note: the sandbox offers no network and no files (the SDKs make JavaScript's fetch() and Python's open() \
                 throw, naming the line; a socket or urllib traps): read rows with ctx.get/scan, and reach other systems with intents"
            );
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
    // `CREATE TABLE IF NOT EXISTS` keeps an existing table as it is: say
    // where the database and the schema files part ways.
    let (drift, refuse) = app::schema_drift(cfg, store.as_ref())?;
    if refuse {
        anyhow::bail!(
            "the database's tables differ from the schema files (onceq init creates missing tables but never alters one):\n  {}",
            drift.join("\n  ")
        );
    }
    for line in &drift {
        eprintln!("note: {line}");
    }
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
    crate::names::check_queue(&queue).map_err(|e| anyhow::anyhow!("{e} (intents come from handlers, through the outbox)"))?;
    let max_delay = cfg
        .queue(&queue)
        .map(|q| q.effect_limits.max_delay)
        .unwrap_or(crate::protocol::effects::MAX_DELAY);
    let delay = match delay {
        Some(d) => parse_duration("--delay", &d)?,
        None => Default::default(),
    };
    if delay > max_delay {
        anyhow::bail!(
            "--delay {} is over the limit of {} (the queue's max_delay setting)",
            crate::names::duration(delay),
            crate::names::duration(max_delay)
        );
    }
    let attributes = attributes
        .iter()
        .map(|a| app::parse_attribute(a))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if let Some((k, _)) = attributes.iter().find(|(k, _)| crate::names::is_reserved(k)) {
        anyhow::bail!("--attribute {k}: names starting with \"onceq.\" are set by onceq itself");
    }
    if let Some(k) = &dedup_key {
        // One key rule for every kind of key (intents, follow-ups, sends).
        crate::names::check_key("--dedup-key", k)?;
    }
    if cfg.queue(&queue).is_err() {
        eprintln!(
            "warning: no [[queue]] named {queue}{} in {}: nothing here will process these messages (queues: {})",
            crate::names::did_you_mean(&queue, cfg.queue_names()),
            config_path.display(),
            cfg.queue_list()
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
    // Each message's creation context (W3C trace context): a child of
    // TRACEPARENT when the caller is inside a trace, else a trace of its own.
    let parent = match std::env::var("TRACEPARENT") {
        Ok(v) if !v.trim().is_empty() => Some(crate::trace::TraceParent::parse(&v).ok_or_else(|| {
            anyhow::anyhow!(
                "TRACEPARENT={}: not a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>); unset it to start a trace per message",
                printable(&v)
            )
        })?),
        _ => None,
    };
    let tracestate = std::env::var("TRACESTATE")
        .ok()
        .filter(|s| parent.is_some() && !s.trim().is_empty());
    let telemetry = crate::telemetry::Telemetry::start(&cfg.telemetry)?;
    let started = std::time::SystemTime::now();
    let mut contexts = Vec::new();
    let msgs: Vec<SendParams> = payloads
        .into_iter()
        .map(|payload| SendParams {
            queue: queue.clone(),
            payload,
            attributes: {
                let mut a = attributes.clone();
                let context = parent.map_or_else(crate::trace::TraceParent::root, |p| p.child());
                if telemetry.is_on() {
                    contexts.push(context);
                }
                a.push((crate::trace::TRACEPARENT_ATTRIBUTE.to_string(), context.to_string()));
                if let Some(s) = &tracestate {
                    a.push((crate::trace::TRACESTATE_ATTRIBUTE.to_string(), s.clone()));
                }
                a
            },
            delay,
            dedup_key: dedup_key.clone(),
            dedup_window: None,
            handoff: None,
        })
        .collect();
    let (sent, dup) = app::send_many(store.as_ref(), msgs, 1000).await?;
    // The producer span of each message: its id is the message's context.
    for c in &contexts {
        telemetry.sent(&queue, c, parent.as_ref(), tracestate.as_deref(), started);
    }
    telemetry.shutdown().await;
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
    let (queues, outbox) = crate::outbox::inspect::split_stats(&stats);
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({ "queues": queues, "outbox": outbox }))?
        );
    } else {
        println!(
            "{:<24} {:>8} {:>8} {:>8} {:>8} {:>10}  LAST PROCESSED",
            "QUEUE", "READY", "LEASED", "DELAYED", "DEAD", "PROCESSED"
        );
        for q in &queues {
            println!(
                "{:<24} {:>8} {:>8} {:>8} {:>8} {:>10}  {}",
                printable(&q.queue),
                q.ready,
                q.leased,
                q.delayed,
                q.dead,
                q.processed,
                q.last_processed_at.map(crate::names::time).unwrap_or_else(|| "-".into())
            );
        }
        if queues.is_empty() {
            println!("(no messages, and none processed)");
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
            "{:<24} {:>8} {:>9} {:>8} {:>10} {:>10}  LAST DELIVERED",
            "OUTBOX", "PENDING", "IN-FLIGHT", "DEAD", "DELIVERED", "KEYS KEPT"
        );
        for c in &outbox {
            println!(
                "{:<24} {:>8} {:>9} {:>8} {:>10} {:>10}  {}",
                c.connector,
                c.pending,
                c.in_flight,
                c.dead,
                c.delivered,
                c.delivered_retained,
                c.last_delivered_at.map(crate::names::time).unwrap_or_else(|| "-".into())
            );
        }
        if outbox.is_empty() {
            println!("(no intents)");
        } else {
            println!("(KEYS KEPT: keys of delivered intents kept for the retention window, to drop duplicate emissions; `onceq outbox delivered` lists them)");
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
                Some(q) => crate::store::Queues::Named(q),
                None => crate::store::Queues::All,
            };
            let list = store.dead_letter_list(sel, limit).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                for d in &list {
                    // Queue and reason may come from a handler or a
                    // producer: escaped, so they cannot drive the terminal.
                    println!(
                        "{}  {:<16} {}  failures={} deliveries={}  {}",
                        d.id,
                        printable(&d.queue),
                        crate::names::time(d.failed_at),
                        d.failures,
                        d.deliveries,
                        printable(&d.reason)
                    );
                }
                if list.is_empty() {
                    println!("no dead letters");
                }
            }
        }
        DlqCommand::Show { id } => match store.dead_letter_get(&id).await? {
            Some(d) => {
                // Times for people next to the stored microseconds.
                let mut v = serde_json::to_value(&d)?;
                v["enqueued"] = crate::names::time(d.enqueued_at).into();
                v["failed"] = crate::names::time(d.failed_at).into();
                println!("{}", serde_json::to_string_pretty(&v)?);
            }
            None => anyhow::bail!("no dead letter with id {id}"),
        },
        DlqCommand::Replay { id, admin } => settle_dead(cfg, &*store, &id, crate::store::Settle::Replay, admin).await?,
        DlqCommand::Discard { id, admin } => settle_dead(cfg, &*store, &id, crate::store::Settle::Discard, admin).await?,
    }
    Ok(ExitCode::SUCCESS)
}

/// `onceq dlq replay|discard`: through the admin API with `--admin`, else
/// on the database, recorded as `local:USER` in the same transaction.
async fn settle_dead(
    cfg: &Config,
    store: &dyn crate::store::Store,
    id: &str,
    how: crate::store::Settle,
    admin: Option<String>,
) -> anyhow::Result<()> {
    let (action, done) = match how {
        crate::store::Settle::Replay => ("replay", "replayed"),
        crate::store::Settle::Discard => ("discard", "discarded"),
    };
    let shown = printable(id);
    if admin.is_some() {
        let client = app::admin_client(cfg, admin.as_deref())?;
        let r = client.settle(id, action).await?;
        println!("{done} {shown} (queue {})", printable(r["queue"].as_str().unwrap_or("")));
        return Ok(());
    }
    let Some(dead) = store.dead_letter_get(id).await? else {
        anyhow::bail!("no dead letter with id {shown}");
    };
    let entry = crate::store::AuditEntry::now(&crate::store::local_actor(), action, Some(&dead.queue), id);
    match store.dead_letter_settle(id, how, Some(&entry)).await? {
        Some(_) if how == crate::store::Settle::Replay => println!("replayed {shown}: back on queue {}", printable(&dead.queue)),
        Some(_) => println!("discarded {shown} (queue {})", printable(&dead.queue)),
        None => anyhow::bail!("dead letter {shown} was replayed or discarded meanwhile"),
    }
    Ok(())
}

/// `onceq pause|resume`: through the admin API with `--admin`, else on the
/// database, recorded as `local:USER` in the same transaction. Hosts see
/// it within [`crate::protocol::PAUSE_POLL`].
async fn pause(cfg: &Config, queue: &str, pause: bool, admin: Option<String>) -> anyhow::Result<ExitCode> {
    let (action, done) = if pause { ("pause", "paused") } else { ("resume", "resumed") };
    crate::names::check_queue(queue).map_err(|e| anyhow::anyhow!("queue {}: {e}", printable(queue)))?;
    let changed = if admin.is_some() {
        let r = app::admin_client(cfg, admin.as_deref())?.pause(queue, pause).await?;
        r["changed"].as_bool().unwrap_or(true)
    } else {
        let store = app::open_store(cfg).await?;
        let entry = crate::store::AuditEntry::now(&crate::store::local_actor(), action, Some(queue), "");
        store.queue_pause(queue, pause, Some(&entry)).await?
    };
    match (changed, pause) {
        (true, true) => println!(
            "{done} {}: hosts lease nothing from it within {}s (`onceq resume` to go on)",
            printable(queue),
            crate::protocol::PAUSE_POLL.as_secs()
        ),
        (true, false) => println!("{done} {}", printable(queue)),
        (false, _) => println!("{} was {done} already", printable(queue)),
    }
    Ok(ExitCode::SUCCESS)
}

/// `onceq audit`.
async fn audit(cfg: &Config, queue: Option<String>, limit: usize, json: bool, admin: Option<String>) -> anyhow::Result<ExitCode> {
    let list = match admin {
        Some(_) => app::admin_client(cfg, admin.as_deref())?.audit(queue.as_deref(), limit).await?,
        None => {
            let store = app::open_store(cfg).await?;
            let sel = match &queue {
                Some(q) => crate::store::Queues::Named(q),
                None => crate::store::Queues::All,
            };
            store.audit_list(sel, limit).await?
        }
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&list)?);
        return Ok(ExitCode::SUCCESS);
    }
    if list.is_empty() {
        println!("no audit entries");
        return Ok(ExitCode::SUCCESS);
    }
    for e in &list {
        // Names, subjects and results may come from tokens, handlers'
        // labels and errors: escaped.
        println!(
            "{}  {:<9} {:<16} {}  {}{}  {}",
            crate::names::time(e.at),
            printable(&e.action),
            crate::names::truncated(&printable(&e.actor), 24),
            e.queue.as_deref().map(printable).unwrap_or_else(|| "-".into()),
            crate::names::truncated(&printable(&e.subject), 64),
            e.signer
                .as_deref()
                .map(|s| format!(" signed by {}", printable(s)))
                .unwrap_or_default(),
            crate::names::truncated(&printable(&e.result), 200)
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Most bytes of one payload or attribute value the text views print
/// (`--json` has them whole).
const MAX_SHOWN: usize = 300;

/// `onceq peek`.
async fn peek(cfg: &Config, queue: &str, limit: usize, json: bool) -> anyhow::Result<ExitCode> {
    let store = app::open_store(cfg).await?;
    let list = store.message_list(crate::store::Queues::Named(queue), limit).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&list)?);
        return Ok(ExitCode::SUCCESS);
    }
    if list.is_empty() {
        let hint = if cfg.queue(queue).is_err() {
            format!(
                " (no [[queue]] named {queue}{} in the config)",
                crate::names::did_you_mean(queue, cfg.queue_names())
            )
        } else {
            String::new()
        };
        println!("no messages on {}{hint}", printable(queue));
        return Ok(ExitCode::SUCCESS);
    }
    let now = crate::store::now_micros();
    for m in &list {
        let state = if m.leased {
            "leased".to_string()
        } else if m.visible_at > now {
            format!("delayed until {}", crate::names::time(m.visible_at))
        } else {
            "ready".to_string()
        };
        // Payloads, attributes and reasons come from producers and
        // handlers: escaped, so they cannot drive the terminal.
        println!(
            "{}  {state}  failures={} deliveries={}  sent {}",
            m.id,
            m.failures,
            m.deliveries,
            crate::names::time(m.enqueued_at)
        );
        println!("    payload: {}", crate::names::truncated(&printable(&m.payload_text), MAX_SHOWN));
        if !m.attributes.is_empty() {
            let attrs: Vec<String> = m
                .attributes
                .iter()
                .map(|(k, v)| format!("{}={}", printable(k), crate::names::truncated(&printable(v), MAX_SHOWN)))
                .collect();
            println!("    attributes: {}", attrs.join(" "));
        }
        if let Some(e) = &m.last_error {
            println!("    last failure: {}", printable(e));
        }
    }
    if list.len() == limit {
        println!("(first {limit}; --limit N for more)");
    }
    Ok(ExitCode::SUCCESS)
}

/// `onceq deploy`.
async fn deploy(cfg: &Config, queue: String, component: PathBuf, label: Option<String>, admin: Option<String>) -> anyhow::Result<ExitCode> {
    let bytes = crate::runtime::read_component(&component).with_context(|| format!("reading {}", component.display()))?;
    let client = app::admin_client(cfg, admin.as_deref())?;
    if bytes.len() as u64 > crate::runtime::LARGE_COMPONENT {
        eprintln!(
            "sending {} ({:.1} MB): the host validates and compiles it before switching, which can take a while",
            component.display(),
            bytes.len() as f64 / (1 << 20) as f64
        );
    }
    // The signature beside the component, if there is one.
    let signature = crate::signing::read_beside(&component)
        .with_context(|| format!("reading {}", crate::signing::signature_path(&component).display()))?;
    let d = client.deploy_signed(&queue, bytes, label.as_deref(), signature.as_deref()).await?;
    println!(
        "deployed {} to {queue}{}{}: new leases use it; messages in flight finish on the previous version",
        d.version,
        d.label.map(|l| format!(" ({})", crate::names::printable(&l))).unwrap_or_default(),
        d.signer.map(|s| format!(", signed by {s}")).unwrap_or_default()
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
                d.label
                    .as_deref()
                    .map_or_else(|| "-".to_string(), |l| crate::names::truncated(&crate::names::printable(l), 40)),
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
        d.label.map(|l| format!(" ({})", crate::names::printable(&l))).unwrap_or_default()
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
            let list = crate::outbox::inspect::list(store.as_ref(), connector.as_deref(), dead, limit).await?;
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
        OutboxCommand::Delivered { connector, limit, json } => {
            let list = crate::outbox::inspect::delivered(store.as_ref(), connector.as_deref(), cfg.outbox.retention, limit).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                println!(
                    "{:<32}  {:<12} {:<32}  {:<27}  KEY KEPT UNTIL",
                    "ID", "CONNECTOR", "KEY", "DELIVERED"
                );
                for d in &list {
                    println!(
                        "{:<32}  {:<12} {:<32}  {:<27}  {}",
                        d.id,
                        d.connector,
                        printable(&d.idempotency_key),
                        crate::names::time(d.delivered_at),
                        crate::names::time(d.key_kept_until)
                    );
                }
                if list.is_empty() {
                    println!(
                        "no delivered intents within the retention window ({})",
                        crate::names::duration(cfg.outbox.retention)
                    );
                }
            }
        }
        OutboxCommand::Show { id } => {
            let e = crate::outbox::inspect::get(store.as_ref(), &id).await?;
            println!("{}", serde_json::to_string_pretty(&e)?);
        }
        OutboxCommand::Replay { id } => {
            let e = crate::outbox::inspect::replay(store.as_ref(), &id).await?;
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
async fn try_message(
    cfg: &Config,
    component: PathBuf,
    message: PathBuf,
    queue: Option<String>,
    id: Option<String>,
) -> anyhow::Result<ExitCode> {
    let payload = if message.as_os_str() == "-" {
        let mut buf = Vec::new();
        std::io::stdin().read_to_end(&mut buf).context("reading the message from stdin")?;
        buf
    } else {
        std::fs::read(&message).with_context(|| format!("reading {}", message.display()))?
    };
    let queue = match (queue, cfg.queues.as_slice()) {
        (Some(q), _) => q,
        (None, [only]) => only.name.clone(),
        (None, _) => "try".to_string(),
    };
    let report = app::try_message(cfg, &component, &queue, payload, id, &|m| eprintln!("{m}")).await?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    if report.outcome != "ok" {
        return Ok(ExitCode::from(2));
    }
    Ok(ExitCode::SUCCESS)
}
