//! What the `onceq` commands do. The binary only parses arguments and
//! prints; everything testable lives here.

use crate::config::Config;
use crate::protocol::{self, QueueRunner};
use crate::runtime::{ComponentInfo, HandlerLimits, Runtime, RuntimeConfig};
use crate::store::{self, SendOutcome, SendParams, Store};
use crate::value::{random_id, Message};
use anyhow::{bail, Context};
use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;

/// `onceq init`: create the database with onceq's tables and the schema.
pub async fn init(cfg: &Config) -> anyhow::Result<Arc<dyn Store>> {
    let ddl = cfg.schema_ddl()?;
    store::init(&cfg.store, &ddl, &cfg.store_options).await
}

/// How the database's tables differ from the schema files (see
/// [`crate::schema::drift`]); nothing when the files are not SQLite DDL
/// (a Spanner schema is checked by Spanner itself).
pub fn schema_drift(cfg: &Config, store: &dyn Store) -> anyhow::Result<(Vec<String>, bool)> {
    let Ok(files) = store::sqlite::schema_from_ddl(&cfg.schema_ddl()?) else {
        return Ok((Vec::new(), false));
    };
    Ok(crate::schema::drift(&files, &store.schema()))
}

pub async fn open_store(cfg: &Config) -> anyhow::Result<Arc<dyn Store>> {
    store::open(&cfg.store, &cfg.store_options).await
}

/// How often `onceq run` forgets expired dedup keys (producer keys past the
/// window, delivered intents' keys past the retention).
pub const PURGE_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

/// How often `onceq run` removes audit entries older than
/// `audit.retention`.
pub const AUDIT_PRUNE_EVERY: std::time::Duration = std::time::Duration::from_secs(3600);

async fn purge_loop(store: Arc<dyn Store>, audit_retention: std::time::Duration, mut shutdown: crate::shutdown::Shutdown) {
    let mut audit_pruned: Option<std::time::Instant> = None;
    while !shutdown.is_requested() {
        match store.dedup_purge().await {
            Ok(0) => {}
            Ok(n) => tracing::debug!("forgot {n} expired dedup keys"),
            Err(e) => tracing::warn!("purging expired dedup keys failed (will retry): {e}"),
        }
        if audit_pruned.is_none_or(|at| at.elapsed() >= AUDIT_PRUNE_EVERY) {
            match store.audit_prune(audit_retention).await {
                Ok(n) => {
                    audit_pruned = Some(std::time::Instant::now());
                    if n > 0 {
                        tracing::info!(
                            "removed {n} audit entries older than audit.retention ({})",
                            crate::names::duration(audit_retention)
                        );
                    }
                }
                Err(e) => tracing::warn!("pruning old audit entries failed (will retry): {e}"),
            }
            // Hosts silent for a day are forgotten (`/v1/overview` shows
            // the last hour's); at the same pace as the audit.
            match store.hosts_prune(crate::store::HOSTS_FORGOTTEN_AFTER).await {
                Ok(0) => {}
                Ok(n) => tracing::debug!("forgot {n} hosts silent for a day"),
                Err(e) => tracing::debug!("forgetting silent hosts failed (will retry): {e}"),
            }
        }
        shutdown.sleep(crate::protocol::jittered(PURGE_EVERY)).await;
    }
}

/// A future that resolves on SIGINT, SIGTERM or SIGHUP; a second of any
/// of them during the shutdown ends the process at once (status 130).
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut signals: Vec<(&'static str, tokio::signal::unix::Signal)> = [
            ("SIGINT", SignalKind::interrupt()),
            ("SIGTERM", SignalKind::terminate()),
            // A closed terminal or a supervisor's reload: shut down
            // gracefully rather than die with leases held.
            ("SIGHUP", SignalKind::hangup()),
        ]
        .into_iter()
        .filter_map(|(name, kind)| Some((name, signal(kind).ok()?)))
        .collect();
        if signals.is_empty() {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
        let first = any_signal(&mut signals).await;
        tracing::warn!("{first}: shutting down; messages in flight finish within shutdown_grace (a second signal exits at once)");
        tokio::spawn(async move {
            let second = any_signal(&mut signals).await;
            tracing::error!(
                "{second} during shutdown: exiting now; the messages still leased are processed again once their leases expire"
            );
            std::process::exit(130);
        });
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// The name of the first of `signals` to arrive.
#[cfg(unix)]
async fn any_signal(signals: &mut [(&'static str, tokio::signal::unix::Signal)]) -> &'static str {
    std::future::poll_fn(|cx| {
        for (name, s) in signals.iter_mut() {
            if s.poll_recv(cx).is_ready() {
                return std::task::Poll::Ready(*name);
            }
        }
        std::task::Poll::Pending
    })
    .await
}

/// `onceq run`: serve the configured queues on their active versions, the
/// outbox dispatchers, the admin API and the watched handler folder until
/// `shutdown` resolves (the CLI passes [`shutdown_signal`]; tests and
/// embedders their own) or, with `until_empty`, until no work is left.
///
/// The admin API starts first: while the store cannot be reached (a
/// network fault at start-up), the host keeps trying with backoff, says
/// why at WARN and in `/readyz`, and can be stopped; only an error that
/// trying again cannot mend (no such database, a bad schema) ends it.
///
/// On shutdown, in-flight messages finish (leased, unstarted ones are
/// released), then the admin server, the watcher and the purge loop stop
/// and are awaited; all within `shutdown_grace`, past which the host
/// returns anyway (leases of what it still held expire). The store's
/// committer commits what it holds last.
pub async fn run(
    cfg: &Config,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    until_empty: bool,
) -> anyhow::Result<Vec<Arc<QueueRunner>>> {
    let mut background = tokio::task::JoinSet::new();
    // Background tasks (admin API, watcher, purge) stop on this one.
    let (stop_background, background_shutdown) = crate::shutdown::channel();
    let admin = Arc::new(crate::admin::Admin::new(cfg.admin.tokens.clone(), cfg.admin.max_upload));
    let addr_file = cfg.state_dir.join("admin.addr");
    if let Some(listen) = &cfg.admin.listen {
        let listener = tokio::net::TcpListener::bind(listen).await.with_context(|| {
            format!("admin API: cannot listen on {listen} (another host on this machine? set [admin] listen to another address, \"127.0.0.1:0\", or \"off\")")
        })?;
        let addr = listener.local_addr()?;
        std::fs::create_dir_all(&cfg.state_dir).with_context(|| format!("creating {}", cfg.state_dir.display()))?;
        std::fs::write(&addr_file, addr.to_string()).with_context(|| format!("writing {}", addr_file.display()))?;
        tracing::info!(%addr, tokens = cfg.admin.tokens.0.len(), "admin API listening; console at http://{addr}/console/");
        background.spawn(crate::admin::serve(
            admin.clone(),
            listener,
            cfg.admin.limits,
            background_shutdown.clone(),
        ));
    }
    // The queues stop on this one: a signal, or no work left.
    let (stop, queues_shutdown) = crate::shutdown::channel();
    let signalled = stop.clone();
    // Not in `background`: it must not hold the host open once it is done.
    let requested = tokio::spawn(async move {
        shutdown.await;
        tracing::info!("shutdown requested: finishing in-flight messages, releasing the rest");
        signalled.request();
    });
    let served = match open_store_patiently(cfg, &admin, queues_shutdown).await {
        Ok(Some(store)) => {
            let served = serve(cfg, store.clone(), &admin, &mut background, &background_shutdown, stop, until_empty).await;
            // What the committer holds is committed before the host goes.
            if tokio::time::timeout(cfg.shutdown_grace, store.close()).await.is_err() {
                tracing::warn!("the store's committer did not finish within the shutdown grace");
            }
            served
        }
        Ok(None) => Ok(Vec::new()),
        Err(e) => Err(e),
    };
    requested.abort();
    // Drain the background tasks: the admin server finishes its requests,
    // the watcher and the purge loop their round.
    stop_background.request();
    let drained = tokio::time::timeout(cfg.shutdown_grace, async { while background.join_next().await.is_some() {} }).await;
    if drained.is_err() {
        tracing::warn!("background tasks did not stop within the shutdown grace; aborting them");
        background.abort_all();
    }
    if cfg.admin.listen.is_some() {
        let _ = std::fs::remove_file(&addr_file);
    }
    served
}

/// Open the configured store, trying again with backoff (up to 30 s
/// apart) while the error is transient, until `shutdown` is requested
/// (`None`).
async fn open_store_patiently(
    cfg: &Config,
    admin: &crate::admin::Admin,
    mut shutdown: crate::shutdown::Shutdown,
) -> anyhow::Result<Option<Arc<dyn Store>>> {
    let mut pause = std::time::Duration::from_millis(500);
    admin.starting(format!("opening the store {}", cfg.store));
    loop {
        match open_store(cfg).await {
            Ok(store) => return Ok(Some(store)),
            Err(e) if is_transient(&e) => {
                let why = format!("{e:#}");
                tracing::warn!(
                    "cannot open the store {} (trying again in {}): {why}",
                    cfg.store,
                    crate::names::duration(pause)
                );
                admin.starting(format!("waiting for the store {}: {why}", cfg.store));
                if shutdown.sleep(crate::protocol::jittered(pause)).await {
                    return Ok(None);
                }
                pause = (pause * 2).min(std::time::Duration::from_secs(30));
            }
            Err(e) => return Err(e),
        }
    }
}

/// An error that trying again may mend: the store unavailable, a call that
/// missed its deadline.
fn is_transient(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<store::StoreError>()
            .is_some_and(|s| s.is_retryable() || s.is_unknown_outcome())
    })
}

/// The host on an open store, until shutdown (see [`run`]).
async fn serve(
    cfg: &Config,
    store: Arc<dyn Store>,
    admin: &Arc<crate::admin::Admin>,
    background: &mut tokio::task::JoinSet<()>,
    background_shutdown: &crate::shutdown::Shutdown,
    stop: crate::shutdown::Stop,
    until_empty: bool,
) -> anyhow::Result<Vec<Arc<QueueRunner>>> {
    admin.starting("loading the handlers");
    let runtime = Arc::new(Runtime::new(cfg.runtime.clone())?);
    let host = crate::host::Host::assemble(cfg, store.clone(), runtime)?;
    let deployer = host
        .deployer
        .clone()
        .ok_or_else(|| anyhow::anyhow!("an assembled host has a deployer"))?;
    let telemetry = crate::telemetry::Telemetry::start(&cfg.telemetry)?;
    for r in &host.runners {
        r.set_telemetry(telemetry.clone());
    }
    telemetry.observe_commits(store.as_ref());
    admin.serve_with(crate::admin::Serving {
        store: store.clone(),
        runners: host.runners.clone(),
        deployer: deployer.clone(),
        outbox_retention: cfg.outbox.retention,
        telemetry: telemetry.clone(),
    });
    if let Some((dir, every)) = &cfg.watch {
        background.spawn(deployer.watch(dir.clone(), *every, background_shutdown.clone()));
    }
    background.spawn(crate::host::heartbeat(
        store.clone(),
        host.runners.clone(),
        background_shutdown.clone(),
    ));
    background.spawn(purge_loop(store, cfg.audit_retention, background_shutdown.clone()));
    tracing::info!(queues = host.runners.len(), store = %cfg.store, "serving");
    admin.set_ready();
    host.run(stop, until_empty, cfg.shutdown_grace).await;
    telemetry.shutdown().await;
    Ok(host.runners)
}

/// A client of the running host's admin API, with the configured token.
pub fn admin_client(cfg: &Config, flag: Option<&str>) -> anyhow::Result<crate::admin::Client> {
    crate::admin::Client::new(&admin_url(cfg, flag)?, cfg.admin.client_token())
}

/// Where a running host's admin API is: `--admin`, else `ONCEQ_ADMIN_URL`,
/// else the address the host wrote to its state folder, else the
/// configured `admin.listen`.
pub fn admin_url(cfg: &Config, flag: Option<&str>) -> anyhow::Result<String> {
    if let Some(u) = flag {
        return Ok(u.to_string());
    }
    if let Ok(u) = std::env::var("ONCEQ_ADMIN_URL") {
        return Ok(u);
    }
    if let Ok(a) = std::fs::read_to_string(cfg.state_dir.join("admin.addr")) {
        return Ok(a.trim().to_string());
    }
    cfg.admin
        .listen
        .clone()
        .context("the admin API is off (admin.listen = \"off\"): give --admin URL")
}

/// Parse `--attribute k=v`.
pub fn parse_attribute(s: &str) -> anyhow::Result<(String, String)> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => bail!("attribute {s:?}: expected NAME=VALUE"),
    }
}

/// Parse a JSON-lines stream into payloads; a bad line is an error naming
/// its line number (and nothing is sent).
pub fn parse_jsonl(text: &str) -> anyhow::Result<Vec<Vec<u8>>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        serde_json::from_str::<serde_json::Value>(line).with_context(|| format!("line {}: not valid JSON", i + 1))?;
        out.push(line.as_bytes().to_vec());
    }
    Ok(out)
}

/// Send messages in chunks of `chunk`, one transaction each.
pub async fn send_many(store: &dyn Store, msgs: Vec<SendParams>, chunk: usize) -> anyhow::Result<(u64, u64)> {
    let (mut sent, mut dup) = (0, 0);
    let mut it = msgs.into_iter().peekable();
    while it.peek().is_some() {
        let part: Vec<SendParams> = it.by_ref().take(chunk.max(1)).collect();
        for o in store.message_send(part).await? {
            match o {
                SendOutcome::Sent { .. } => sent += 1,
                SendOutcome::Duplicate { .. } => dup += 1,
            }
        }
    }
    Ok((sent, dup))
}

/// `onceq check COMPONENT`; with a configuration, through its compiled
/// cache (what check compiles, `try`, `test` and `run` then read).
pub fn check(
    path: &Path,
    cfg: Option<&Config>,
    progress: &dyn Fn(&str),
) -> anyhow::Result<(ComponentInfo, Result<(), crate::runtime::DeployError>)> {
    let runtime = Runtime::new(RuntimeConfig {
        max_instances: 4,
        cache_dir: cfg.and_then(|c| c.runtime.cache_dir.clone()),
        cache_max_bytes: cfg.map_or(crate::runtime::cache::DEFAULT_MAX_BYTES, |c| c.runtime.cache_max_bytes),
        ..Default::default()
    })?;
    let bytes = crate::runtime::read_component(path).with_context(|| format!("reading {}", path.display()))?;
    let digest = crate::runtime::component_digest(&bytes);
    if !runtime.is_cached(&digest) {
        crate::runtime::announce_large(path, progress);
    }
    let (component, info) = runtime
        .inspect_digested(&bytes, &digest)
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let verdict = runtime.prepare(component, info.clone(), HandlerLimits::default()).map(|_| ());
    Ok((info, verdict))
}

/// `onceq try`: run one message through a component against the database,
/// check the effects as the protocol would, and roll back. Nothing is
/// committed.
pub async fn try_message(
    cfg: &Config,
    component: &Path,
    queue: &str,
    payload: Vec<u8>,
    id: Option<String>,
    progress: &dyn Fn(&str),
) -> anyhow::Result<crate::tryout::TryReport> {
    let store = open_store(cfg).await?;
    let (grants, limits, effect_limits) = match cfg.queue(queue) {
        Ok(q) => (q.grants.clone(), q.limits, q.effect_limits),
        Err(_) => {
            // Not a configured queue: grant every table, like a sandbox.
            let tables: BTreeSet<String> = store.schema().tables.keys().cloned().collect();
            (
                protocol::Grants {
                    tables,
                    ..Default::default()
                },
                HandlerLimits::default(),
                Default::default(),
            )
        }
    };
    // Instructions are always counted here: the report gives them.
    let runtime = Runtime::new(RuntimeConfig {
        max_instances: 4,
        count_instructions: true,
        ..cfg.runtime.clone()
    })?;
    let handler = runtime.load_file_reporting(component, limits, progress)?;
    let message = Message {
        id: id.unwrap_or_else(random_id),
        queue: queue.to_string(),
        payload,
        attributes: vec![],
        attempt: 1,
        enqueued_at: crate::store::now_micros(),
    };
    let tx = store.transaction_begin().await?;
    Ok(crate::tryout::run(&handler, message, tx, store.schema(), &grants, &effect_limits).await)
}
