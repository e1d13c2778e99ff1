//! What the `onceq` commands do. The binary only parses arguments and
//! prints; everything testable lives here.

use crate::config::{Config, QueueConfig};
use crate::outbox;
use crate::protocol::{self, Handler, QueueRunner, QueueSpec};
use crate::runtime::{ComponentInfo, HandlerLimits, Runtime, RuntimeConfig};
use crate::store::{self, SendOutcome, SendParams, Store};
use crate::value::{random_id, Message};
use anyhow::{bail, Context};
use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use tokio::sync::watch;

/// `onceq init`: create the database with onceq's tables and the schema.
pub async fn init(cfg: &Config) -> anyhow::Result<Arc<dyn Store>> {
    let ddl = cfg.schema_ddl()?;
    store::init(&cfg.store, &ddl, &cfg.store_options).await
}

pub async fn open_store(cfg: &Config) -> anyhow::Result<Arc<dyn Store>> {
    store::open(&cfg.store, &cfg.store_options).await
}

/// Check a queue's grants against the database schema.
pub fn check_grants(q: &QueueConfig, store: &dyn Store) -> anyhow::Result<()> {
    let schema = store.schema();
    for t in &q.grants.tables {
        if !schema.tables.contains_key(t) {
            bail!(
                "queue {} is granted table {t}, which is not in the database (tables: {})",
                q.name,
                schema.tables.keys().cloned().collect::<Vec<_>>().join(", ")
            );
        }
    }
    Ok(())
}

/// Load every queue's handler and build its runner, then one outbox runner
/// per configured connector.
pub fn build_runners(cfg: &Config, store: &Arc<dyn Store>, runtime: &Runtime) -> anyhow::Result<Vec<Arc<QueueRunner>>> {
    if cfg.queues.is_empty() && cfg.connectors.is_empty() {
        bail!("no [[queue]] and no [[connector]] configured: nothing to run");
    }
    runtime.check_capacity(cfg.queues.iter().map(|q| q.policy.workers).sum())?;
    let mut out = Vec::new();
    for q in &cfg.queues {
        check_grants(q, store.as_ref())?;
        let handler = runtime
            .load_file(&q.handler, q.limits)
            .with_context(|| format!("queue {}", q.name))?;
        tracing::info!(queue = %q.name, version = %handler.version(), handler = %q.handler.display(), "handler loaded");
        out.push(Arc::new(QueueRunner::new(
            QueueSpec {
                name: q.name.clone(),
                handler: Arc::new(handler),
                grants: q.grants.clone(),
                limits: q.effect_limits,
                policy: q.policy.clone(),
                key_retention: None,
            },
            store.clone(),
        )));
    }
    out.extend(build_outbox_runners(cfg, store)?);
    Ok(out)
}

/// One runner per configured connector, working its outbox queue.
pub fn build_outbox_runners(cfg: &Config, store: &Arc<dyn Store>) -> anyhow::Result<Vec<Arc<QueueRunner>>> {
    let mut out = Vec::new();
    for (name, c) in &cfg.connectors {
        let connector = c.build(name)?;
        tracing::info!(connector = %name, kind = c.kind(), queue = %outbox::queue_of(name), "outbox dispatcher ready");
        out.push(Arc::new(outbox::runner(store.clone(), name, connector, &cfg.outbox)));
    }
    Ok(out)
}

/// How often `onceq run` forgets expired dedup keys (producer keys past the
/// window, delivered intents' keys past the retention).
pub const PURGE_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

async fn purge_loop(store: Arc<dyn Store>) {
    loop {
        match store.dedup_purge().await {
            Ok(0) => {}
            Ok(n) => tracing::debug!("forgot {n} expired dedup keys"),
            Err(e) => tracing::warn!("purging expired dedup keys failed (will retry): {e}"),
        }
        tokio::time::sleep(crate::protocol::jittered(PURGE_EVERY)).await;
    }
}

/// A future that resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

/// `onceq run`: serve until a signal (or until empty): the configured
/// queues on their active versions, the outbox dispatchers, the admin API
/// and the watched handler folder.
pub async fn run(cfg: &Config, until_empty: bool) -> anyhow::Result<Vec<Arc<QueueRunner>>> {
    let store = open_store(cfg).await?;
    let runtime = Arc::new(Runtime::new(cfg.runtime.clone())?);
    let (deployer, mut runners) = crate::deploy::Deployer::open(cfg, &store, runtime)?;
    runners.extend(build_outbox_runners(cfg, &store)?);
    if runners.is_empty() {
        bail!("no [[queue]] and no [[connector]] configured: nothing to run");
    }
    let mut background = tokio::task::JoinSet::new();
    let admin = Arc::new(crate::admin::Admin {
        store: store.clone(),
        runners: runners.clone(),
        deployer: deployer.clone(),
        token: cfg.admin.token.clone(),
        ready: std::sync::atomic::AtomicBool::new(false),
    });
    let addr_file = cfg.state_dir.join("admin.addr");
    if let Some(listen) = &cfg.admin.listen {
        let listener = tokio::net::TcpListener::bind(listen).await.with_context(|| {
            format!("admin API: cannot listen on {listen} (another host on this machine? set [admin] listen to another address, \"127.0.0.1:0\", or \"off\")")
        })?;
        let addr = listener.local_addr()?;
        std::fs::write(&addr_file, addr.to_string()).with_context(|| format!("writing {}", addr_file.display()))?;
        tracing::info!(%addr, token = cfg.admin.token.is_some(), "admin API listening");
        background.spawn(crate::admin::serve(admin.clone(), listener));
    }
    if let Some((dir, every)) = &cfg.watch {
        background.spawn(deployer.clone().watch(dir.clone(), *every));
    }
    background.spawn(purge_loop(store.clone()));
    let (tx, _rx) = watch::channel(false);
    let tx = Arc::new(tx);
    let signal_tx = tx.clone();
    background.spawn(async move {
        shutdown_signal().await;
        tracing::info!("shutdown requested: finishing in-flight messages, releasing the rest");
        let _ = signal_tx.send(true);
    });
    tracing::info!(queues = runners.len(), store = %cfg.store, "serving");
    admin.ready.store(true, std::sync::atomic::Ordering::Relaxed);
    protocol::run_queues(store, runners.clone(), tx, until_empty).await;
    background.abort_all();
    if cfg.admin.listen.is_some() {
        let _ = std::fs::remove_file(&addr_file);
    }
    Ok(runners)
}

/// A client of the running host's admin API, with the configured token.
pub fn admin_client(cfg: &Config, flag: Option<&str>) -> anyhow::Result<crate::admin::Client> {
    crate::admin::Client::new(&admin_url(cfg, flag)?, cfg.admin.token.clone())
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

/// `onceq check COMPONENT`.
pub fn check(path: &Path) -> anyhow::Result<(ComponentInfo, Result<(), String>)> {
    let runtime = Runtime::new(RuntimeConfig {
        max_instances: 4,
        ..Default::default()
    })?;
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let (_, info) = runtime.inspect(&bytes).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let verdict = runtime
        .load(&bytes, HandlerLimits::default())
        .map(|_| ())
        .map_err(|e| e.to_string());
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
    let runtime = Runtime::new(RuntimeConfig {
        max_instances: 4,
        ..cfg.runtime.clone()
    })?;
    let handler = runtime.load_file(component, limits)?;
    let message = Message {
        id: id.unwrap_or_else(random_id),
        queue: queue.to_string(),
        payload,
        attributes: vec![],
        attempt: 1,
        enqueued_at: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros() as i64)
            .unwrap_or(0),
    };
    let tx = store.transaction_begin().await?;
    Ok(crate::tryout::run(&handler, message, tx, store.schema(), &grants, &effect_limits).await)
}

/// An intent as `onceq outbox list|show` prints it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct OutboxEntry {
    /// "pending" (waiting for a delivery or a retry), "in-flight" (leased
    /// by a dispatcher) or "dead" (refused, or out of attempts).
    pub state: &'static str,
    #[serde(flatten)]
    pub intent: outbox::Intent,
    pub payload: String,
    /// Database time (µs) of the emission.
    pub created_at: i64,
    /// Pending: when the next delivery may start (µs); dead: when it died.
    pub at: i64,
    /// Why the last delivery failed (pending), or why it is dead.
    pub reason: Option<String>,
}

fn entry_from_queued(m: &store::QueuedMessage) -> Option<OutboxEntry> {
    let intent = outbox::Intent::from_queued(m)?;
    Some(OutboxEntry {
        state: if m.leased { "in-flight" } else { "pending" },
        payload: intent.payload_text(),
        intent,
        created_at: m.enqueued_at,
        at: m.visible_at,
        reason: m.last_error.clone(),
    })
}

fn entry_from_dead(d: &store::DeadLetter) -> Option<OutboxEntry> {
    let intent = outbox::Intent::from_dead_letter(d)?;
    Some(OutboxEntry {
        state: "dead",
        payload: intent.payload_text(),
        intent,
        created_at: d.enqueued_at,
        at: d.failed_at,
        reason: Some(d.reason.clone()),
    })
}

/// `onceq outbox list`: undelivered intents (pending and in flight, oldest
/// first), then dead ones (newest first); of one connector, or all.
pub async fn outbox_list(store: &dyn Store, connector: Option<&str>, dead_only: bool, limit: usize) -> anyhow::Result<Vec<OutboxEntry>> {
    let queue = connector.map(outbox::queue_of);
    let sel = match &queue {
        Some(q) => store::Queues::Named(q),
        None => store::Queues::Prefix(outbox::QUEUE_PREFIX),
    };
    let mut out = Vec::new();
    if !dead_only {
        out.extend(store.message_list(sel, limit).await?.iter().filter_map(entry_from_queued));
    }
    let room = limit.saturating_sub(out.len());
    if room > 0 {
        out.extend(store.dead_letter_list(sel, room).await?.iter().filter_map(entry_from_dead));
    }
    Ok(out)
}

/// `onceq outbox show ID`.
pub async fn outbox_get(store: &dyn Store, id: &str) -> anyhow::Result<OutboxEntry> {
    if let Some(e) = store.message_get(id).await?.as_ref().and_then(entry_from_queued) {
        return Ok(e);
    }
    if let Some(e) = store.dead_letter_get(id).await?.as_ref().and_then(entry_from_dead) {
        return Ok(e);
    }
    bail!("no undelivered intent with id {id} (delivered intents leave the outbox; their keys are kept for the retention window)")
}

/// `onceq outbox replay ID`: put a dead intent back in its outbox (same key,
/// attempts reset). Returns the entry as it was.
pub async fn outbox_replay(store: &dyn Store, id: &str) -> anyhow::Result<OutboxEntry> {
    let entry = outbox_get(store, id).await?;
    if entry.state != "dead" {
        bail!("intent {id} is {}: only dead intents can be replayed", entry.state);
    }
    store
        .dead_letter_replay(id)
        .await?
        .with_context(|| format!("intent {id} was replayed or removed meanwhile"))?;
    Ok(entry)
}

/// Outbox figures per connector, for `onceq stats`.
#[derive(Debug, Clone, Default, serde::Serialize, PartialEq, Eq)]
pub struct OutboxStats {
    pub connector: String,
    /// Waiting for a first delivery or a retry.
    pub pending: u64,
    /// Being delivered now.
    pub in_flight: u64,
    /// Refused or out of attempts.
    pub dead: u64,
    /// Delivered, key still kept for the retention window.
    pub delivered_retained: u64,
}

/// Split store stats into message queues and outbox connectors.
pub fn outbox_stats(stats: &store::Stats) -> (Vec<store::QueueStats>, Vec<OutboxStats>) {
    let mut queues = Vec::new();
    let mut connectors = Vec::new();
    for q in &stats.queues {
        match outbox::connector_of(&q.queue) {
            None => queues.push(q.clone()),
            Some(c) => {
                let undelivered = q.ready + q.delayed + q.leased + q.dead;
                connectors.push(OutboxStats {
                    connector: c.to_string(),
                    pending: q.ready + q.delayed,
                    in_flight: q.leased,
                    dead: q.dead,
                    delivered_retained: q.dedup_keys.saturating_sub(undelivered),
                });
            }
        }
    }
    (queues, connectors)
}
