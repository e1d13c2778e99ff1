//! `onceq.toml`: the store, the schema, and the queues with their handlers.
//!
//! Every key is documented in `docs/src/configuration.md` (tests/docs.rs
//! checks both ways). Unknown
//! keys are errors (a typo must not silently fall back to a default).
//! Relative paths are relative to the config file's folder.

use crate::outbox::{ConnectorConfig, OutboxSettings};
use crate::protocol::{EffectLimits, Grants, Policy};
use crate::runtime::{HandlerLimits, RuntimeConfig};
use crate::store::StoreOptions;
use anyhow::{bail, Context};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(PathBuf),
    Many(Vec<PathBuf>),
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawSqlite {
    synchronous: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawSpanner {
    shards: Option<u32>,
    clients: Option<usize>,
    exclusive_clients: Option<bool>,
    call_timeout: Option<String>,
    expiry: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawCommit {
    max_batch: Option<usize>,
    max_wait: Option<String>,
    handoff: Option<bool>,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawRuntime {
    max_instances: Option<u32>,
    max_memory: Option<String>,
    cache: Option<bool>,
    cache_max_bytes: Option<String>,
    reset_dirty_pages: Option<bool>,
    count_instructions: Option<bool>,
    perf_map: Option<bool>,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawAdmin {
    listen: Option<String>,
    max_upload: Option<String>,
    token: Option<String>,
    token_env: Option<String>,
    max_connections: Option<usize>,
    header_timeout: Option<String>,
    #[serde(default)]
    tokens: Vec<RawToken>,
}

/// One `[[admin.tokens]]`: a name, a role, the queues it may touch, and
/// its secret from the environment, a file, or as a SHA-256.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawToken {
    name: String,
    role: String,
    queues: Option<Vec<String>>,
    secret_env: Option<String>,
    secret_file: Option<PathBuf>,
    sha256: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawAudit {
    retention: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawTelemetry {
    enabled: Option<bool>,
    endpoint: Option<String>,
    protocol: Option<String>,
    service_name: Option<String>,
    #[serde(default)]
    headers: std::collections::BTreeMap<String, String>,
    timeout: Option<String>,
    propagation: Option<String>,
}

impl RawTelemetry {
    fn resolve(&self) -> anyhow::Result<crate::telemetry::TelemetryConfig> {
        use crate::telemetry::{Propagation, Protocol};
        Ok(crate::telemetry::TelemetryConfig {
            enabled: self.enabled,
            endpoint: self.endpoint.clone(),
            protocol: match &self.protocol {
                Some(p) => Some(
                    Protocol::parse(p)
                        .ok_or_else(|| anyhow::anyhow!("telemetry.protocol: {p:?} is not one of \"http/protobuf\", \"grpc\""))?,
                ),
                None => None,
            },
            service_name: self.service_name.clone(),
            headers: self.headers.clone(),
            timeout: match &self.timeout {
                Some(t) => Some(at_most(
                    "telemetry.timeout",
                    parse_duration("telemetry.timeout", t)?,
                    Duration::from_secs(60),
                )?),
                None => None,
            },
            propagation: match self.propagation.as_deref() {
                None | Some("child") => Propagation::Child,
                Some("link") => Propagation::Link,
                Some(other) => anyhow::bail!("telemetry.propagation: {other:?} is not one of \"child\", \"link\""),
            },
        })
    }
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawDeploy {
    watch: Option<PathBuf>,
    poll: Option<String>,
    #[serde(default)]
    trusted_keys: Vec<String>,
    require_signature: Option<bool>,
}

/// Settings a queue can set, or inherit from `[defaults]`.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawSettings {
    lease: Option<String>,
    max_attempts: Option<u32>,
    max_deliveries: Option<u32>,
    max_reruns: Option<u32>,
    retry_crashes: Option<bool>,
    backoff_initial: Option<String>,
    backoff_max: Option<String>,
    workers: Option<usize>,
    batch: Option<usize>,
    deadline: Option<String>,
    memory: Option<String>,
    max_effects: Option<usize>,
    max_effect_bytes: Option<String>,
    max_delay: Option<String>,
    max_reads: Option<u64>,
    max_read_bytes: Option<String>,
    max_log_bytes: Option<String>,
    max_instructions: Option<u64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawQueue {
    name: String,
    handler: PathBuf,
    #[serde(default)]
    tables: Vec<String>,
    #[serde(default)]
    enqueue: Vec<String>,
    #[serde(default)]
    connectors: Vec<String>,
    lease: Option<String>,
    max_attempts: Option<u32>,
    max_deliveries: Option<u32>,
    max_reruns: Option<u32>,
    retry_crashes: Option<bool>,
    backoff_initial: Option<String>,
    backoff_max: Option<String>,
    workers: Option<usize>,
    batch: Option<usize>,
    deadline: Option<String>,
    memory: Option<String>,
    max_effects: Option<usize>,
    max_effect_bytes: Option<String>,
    max_delay: Option<String>,
    max_reads: Option<u64>,
    max_read_bytes: Option<String>,
    max_log_bytes: Option<String>,
    max_instructions: Option<u64>,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawOutbox {
    workers: Option<usize>,
    batch: Option<usize>,
    lease: Option<String>,
    max_attempts: Option<u32>,
    backoff_initial: Option<String>,
    backoff_max: Option<String>,
    retention: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConnector {
    name: String,
    kind: String,
    url: Option<String>,
    timeout: Option<String>,
    #[serde(default)]
    headers: std::collections::BTreeMap<String, String>,
    bearer_token_env: Option<String>,
    path: Option<PathBuf>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    store: String,
    schema: Option<OneOrMany>,
    dedup_window: Option<String>,
    shutdown_grace: Option<String>,
    state_dir: Option<PathBuf>,
    #[serde(default)]
    sqlite: RawSqlite,
    #[serde(default)]
    spanner: RawSpanner,
    #[serde(default)]
    runtime: RawRuntime,
    #[serde(default)]
    commit: RawCommit,
    #[serde(default)]
    defaults: RawSettings,
    #[serde(default, rename = "queue")]
    queues: Vec<RawQueue>,
    #[serde(default)]
    outbox: RawOutbox,
    #[serde(default)]
    admin: RawAdmin,
    #[serde(default)]
    deploy: RawDeploy,
    #[serde(default)]
    audit: RawAudit,
    #[serde(default)]
    telemetry: RawTelemetry,
    #[serde(default, rename = "connector")]
    connectors: Vec<RawConnector>,
}

/// One queue, resolved.
#[derive(Debug, Clone)]
pub struct QueueConfig {
    pub name: String,
    pub handler: PathBuf,
    pub grants: Grants,
    pub policy: Policy,
    pub limits: HandlerLimits,
    pub effect_limits: EffectLimits,
}

impl QueueConfig {
    /// The queue's runner on `store`: its grants checked against the
    /// store's schema, then its handler loaded by `load` (a compilation can
    /// take seconds, so a bad grant is refused first). The one place a
    /// runner is built from configuration (`onceq run` through the
    /// deployer, the demo).
    pub fn runner(
        &self,
        store: &std::sync::Arc<dyn crate::store::Store>,
        load: impl FnOnce(&QueueConfig) -> anyhow::Result<std::sync::Arc<dyn crate::protocol::Handler>>,
    ) -> anyhow::Result<std::sync::Arc<crate::protocol::QueueRunner>> {
        self.check_grants(&store.schema())?;
        let handler = load(self).with_context(|| format!("queue {}", self.name))?;
        tracing::info!(queue = %self.name, version = %handler.version(), handler = %self.handler.display(), "handler loaded");
        Ok(std::sync::Arc::new(crate::protocol::QueueRunner::new(
            crate::protocol::QueueSpec {
                name: self.name.clone(),
                handler,
                grants: self.grants.clone(),
                limits: self.effect_limits,
                policy: self.policy.clone(),
            },
            store.clone(),
        )))
    }

    /// Check the queue's table grants against the database schema (the one
    /// place grants are checked against what exists; effects are checked
    /// against the grants at run time).
    pub fn check_grants(&self, schema: &crate::schema::Schema) -> anyhow::Result<()> {
        for t in &self.grants.tables {
            if !schema.tables.contains_key(t) {
                bail!(
                    "queue {} is granted table {t}, which is not in the database (tables: {})",
                    self.name,
                    schema.tables.keys().cloned().collect::<Vec<_>>().join(", ")
                );
            }
        }
        Ok(())
    }
}

/// The whole file, resolved and checked.
#[derive(Debug, Clone)]
pub struct Config {
    /// `sqlite://PATH` (or a plain path).
    pub store: String,
    pub schema: Vec<PathBuf>,
    pub store_options: StoreOptions,
    pub runtime: RuntimeConfig,
    pub queues: Vec<QueueConfig>,
    /// How outbox queues are worked.
    pub outbox: OutboxSettings,
    /// Connectors by name, in file order.
    pub connectors: Vec<(String, ConnectorConfig)>,
    /// This host's own files: deployed components, deployment history,
    /// compiled-component cache, the admin API's address.
    pub state_dir: PathBuf,
    pub admin: AdminConfig,
    /// Folder watched for `<queue>.wasm` handler files, and how often.
    pub watch: Option<(PathBuf, Duration)>,
    /// The keys components must be signed by (`deploy.trusted_keys`,
    /// `deploy.require_signature`).
    pub trust: crate::signing::Trust,
    /// How long audit entries are kept (`audit.retention`).
    pub audit_retention: Duration,
    /// OpenTelemetry export (`[telemetry]`, and the `OTEL_*` variables).
    pub telemetry: crate::telemetry::TelemetryConfig,
    /// After SIGINT/SIGTERM, how long in-flight messages may take to finish
    /// before the host exits anyway (their leases then expire).
    pub shutdown_grace: Duration,
}

/// Default `audit.retention`.
pub const AUDIT_RETENTION: Duration = Duration::from_secs(365 * 24 * 3600);

/// Default `shutdown_grace`.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(15);

/// Longest lease a queue may set: renewal keeps longer work leased.
pub const MAX_LEASE: Duration = Duration::from_secs(3600);

/// Refuse a duration over `max`, naming the key.
fn at_most(key: &str, d: Duration, max: Duration) -> anyhow::Result<Duration> {
    if d > max {
        bail!(
            "{key}: {} is over the limit of {}",
            crate::names::duration(d),
            crate::names::duration(max)
        );
    }
    Ok(d)
}

/// The admin HTTP API (`[admin]`).
#[derive(Debug, Clone)]
pub struct AdminConfig {
    /// Where to listen (`None`: no admin API).
    pub listen: Option<String>,
    /// `admin.token` (or the variable `admin.token_env` names): an admin
    /// token named `admin`, and what the CLI sends.
    pub token: Option<String>,
    /// Every token the host accepts: `[[admin.tokens]]`, and `admin.token`
    /// as `admin`. None: reads are open, mutations refused.
    pub tokens: crate::access::Tokens,
    /// The variable the CLI's own token is read from first.
    pub token_env: String,
    /// Largest request body (a component upload) accepted, after the token
    /// was checked.
    pub max_upload: usize,
    /// Connections served at once, and the header-read timeout.
    pub limits: ServeLimits,
}

/// Bounds on the admin server's connections (`[admin]`).
#[derive(Debug, Clone, Copy)]
pub struct ServeLimits {
    /// Connections served at once (`admin.max_connections`); more wait in
    /// the listen backlog.
    pub max_connections: usize,
    /// A connection must send a request's headers within this, idle or
    /// not (`admin.header_timeout`), or it is closed.
    pub header_timeout: Duration,
}

impl Default for ServeLimits {
    fn default() -> Self {
        ServeLimits {
            max_connections: 128,
            header_timeout: Duration::from_secs(10),
        }
    }
}

/// Default admin API address: loopback only.
pub const ADMIN_LISTEN: &str = "127.0.0.1:7070";
/// Default `admin.max_upload`: the largest request body (a component) a
/// deploy accepts. JS and Python components are 12-20 MB.
pub const ADMIN_MAX_UPLOAD: usize = 64 << 20;
/// Environment variable read for the admin token by default.
pub const ADMIN_TOKEN_ENV: &str = "ONCEQ_ADMIN_TOKEN";

/// Default whole-request timeout of a `webhook` connector.
pub const WEBHOOK_TIMEOUT: Duration = Duration::from_secs(10);

fn parse_connector(c: &RawConnector, base: &Path) -> anyhow::Result<ConnectorConfig> {
    let name = &c.name;
    let refuse = |key: &str, set: bool| -> anyhow::Result<()> {
        if set {
            bail!("connector {name}: {key} is not a setting of kind {}", c.kind);
        }
        Ok(())
    };
    Ok(match c.kind.as_str() {
        "webhook" => {
            refuse("path", c.path.is_some())?;
            ConnectorConfig::Webhook {
                url: c
                    .url
                    .clone()
                    .with_context(|| format!("connector {name}: kind webhook needs a url"))?,
                timeout: match &c.timeout {
                    Some(t) => parse_duration(&format!("connector {name}: timeout"), t)?,
                    None => WEBHOOK_TIMEOUT,
                },
                headers: c.headers.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
                bearer_token_env: c.bearer_token_env.clone(),
            }
        }
        "file" => {
            refuse("url", c.url.is_some())?;
            refuse("timeout", c.timeout.is_some())?;
            refuse("headers", !c.headers.is_empty())?;
            refuse("bearer_token_env", c.bearer_token_env.is_some())?;
            ConnectorConfig::File {
                path: resolve(
                    base,
                    c.path
                        .as_deref()
                        .with_context(|| format!("connector {name}: kind file needs a path"))?,
                ),
            }
        }
        "log" => {
            refuse("url", c.url.is_some())?;
            refuse("timeout", c.timeout.is_some())?;
            refuse("headers", !c.headers.is_empty())?;
            refuse("bearer_token_env", c.bearer_token_env.is_some())?;
            refuse("path", c.path.is_some())?;
            ConnectorConfig::Log
        }
        other => bail!("connector {name}: unknown kind {other:?} (use \"webhook\", \"file\" or \"log\")"),
    })
}

/// Parse `"10s"`, `"250ms"`, `"5m"`.
pub fn parse_duration(key: &str, s: &str) -> anyhow::Result<Duration> {
    humantime::parse_duration(s).with_context(|| format!("{key}: {s:?} is not a duration (try \"10s\", \"250ms\", \"5m\")"))
}

/// Parse `"64MiB"`, `"512KiB"`, `"1GiB"` or a number of bytes.
pub fn parse_size(key: &str, s: &str) -> anyhow::Result<usize> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num.parse().with_context(|| format!("{key}: {s:?} is not a size (try \"64MiB\")"))?;
    let mult: usize = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        other => bail!("{key}: unknown size unit {other:?} in {s:?} (use B, KiB, MiB or GiB)"),
    };
    n.checked_mul(mult).with_context(|| format!("{key}: {s:?} is too large"))
}

fn resolve(base: &Path, p: &Path) -> PathBuf {
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        base.join(p)
    }
}

/// A queue's workers when neither it nor `[defaults]` sets them, on a
/// SQLite store: its committer commits what is queued in one transaction,
/// so more messages under way make fewer, larger commits, and the two
/// cores were busier. Through the CLI (20,000 payments messages, intents
/// to a file connector, alternated pairs), 32 workers took 0.89-0.95 of
/// 16's time (medians of 10, 8, 6 and 8 pairs; 24 and 48 did less well),
/// with 30% fewer `fdatasync`s; the JavaScript and Python examples ran
/// alike with either, Python's peak RSS 10% higher
/// (docs/src/benchmarks.md).
pub const SQLITE_WORKERS: usize = 32;

/// The built-in `workers` of a queue on the store `url`: [`SQLITE_WORKERS`]
/// on SQLite; on Spanner, [`Policy::default`]'s, the count measured on the
/// emulator (which runs one read-write transaction at a time).
pub fn default_workers(url: &str) -> usize {
    match crate::store::StoreUrl::parse(url) {
        Ok(crate::store::StoreUrl::Spanner(_)) => Policy::default().workers,
        // A URL no store takes is refused when the store opens.
        _ => SQLITE_WORKERS,
    }
}

/// `store = ...`: a `sqlite://` URL or a plain path (relative to the config
/// file's folder), or another store's URL as written.
fn store_url(store: &str, base: &Path) -> String {
    if let Some(p) = store.strip_prefix("sqlite://") {
        format!("sqlite://{}", resolve(base, Path::new(p)).display())
    } else if store.contains("://") {
        store.to_string()
    } else {
        format!("sqlite://{}", resolve(base, Path::new(store)).display())
    }
}

impl RawConfig {
    /// `dedup_window`, `[sqlite]`, `[spanner]` and `[commit]`.
    fn store_options(&self) -> anyhow::Result<StoreOptions> {
        let mut o = StoreOptions::default();
        if let Some(w) = &self.dedup_window {
            o.dedup_window = at_most("dedup_window", parse_duration("dedup_window", w)?, crate::store::MAX_SCHEDULE)?;
        }
        if let Some(s) = &self.sqlite.synchronous {
            if !matches!(s.as_str(), "full" | "normal" | "off") {
                bail!("sqlite.synchronous must be \"full\", \"normal\" or \"off\", got {s:?}");
            }
            o.sqlite_synchronous = s.clone();
        }
        let sp = &self.spanner;
        if let Some(n) = sp.shards {
            if n == 0 {
                bail!("spanner.shards must be at least 1");
            }
            o.spanner_shards = n;
        }
        if let Some(n) = sp.clients {
            o.spanner_clients = n.max(1);
        }
        o.spanner_exclusive_clients = sp.exclusive_clients;
        if let Some(t) = &sp.call_timeout {
            let t = at_most(
                "spanner.call_timeout",
                parse_duration("spanner.call_timeout", t)?,
                Duration::from_secs(600),
            )?;
            if t < Duration::from_millis(100) {
                bail!("spanner.call_timeout must be at least 100ms, got {t:?}");
            }
            o.spanner_call_timeout = t;
        }
        if let Some(e) = &sp.expiry {
            o.spanner_expiry = match e.as_str() {
                "ttl" => crate::store::SpannerExpiry::Ttl,
                "purge" => crate::store::SpannerExpiry::Purge,
                _ => bail!("spanner.expiry must be \"ttl\" or \"purge\", got {e:?}"),
            };
        }
        if let Some(n) = self.commit.max_batch {
            if n == 0 {
                bail!("commit.max_batch must be at least 1 (1 commits every message alone)");
            }
            o.commit.max_batch = n;
        }
        if let Some(w) = &self.commit.max_wait {
            o.commit.max_wait = at_most("commit.max_wait", parse_duration("commit.max_wait", w)?, Duration::from_secs(1))?;
        }
        if let Some(h) = self.commit.handoff {
            o.commit.handoff = h;
        }
        Ok(o)
    }
}

impl RawRuntime {
    /// `[runtime]`; the compiled-component cache lives in `state_dir`.
    fn resolve(&self, state_dir: &Path) -> anyhow::Result<RuntimeConfig> {
        let mut runtime = RuntimeConfig::default();
        if let Some(n) = self.max_instances {
            runtime.max_instances = n;
        }
        if let Some(m) = &self.max_memory {
            runtime.max_memory = parse_size("runtime.max_memory", m)?;
        }
        if let Some(b) = self.reset_dirty_pages {
            runtime.reset_dirty_pages = b;
        }
        if let Some(b) = self.count_instructions {
            runtime.count_instructions = b;
        }
        if let Some(b) = self.perf_map {
            runtime.perf_map = b;
        }
        if self.cache.unwrap_or(true) {
            runtime.cache_dir = Some(state_dir.join("cache"));
        }
        if let Some(m) = &self.cache_max_bytes {
            runtime.cache_max_bytes = parse_size("runtime.cache_max_bytes", m)? as u64;
        }
        Ok(runtime)
    }
}

impl RawQueue {
    /// One `[[queue]]`, its unset settings taken from `[defaults]` `d`,
    /// then the built-in defaults; `default_workers` is the store's
    /// ([`default_workers`]).
    fn resolve(&self, d: &RawSettings, runtime: &RuntimeConfig, base: &Path, default_workers: usize) -> anyhow::Result<QueueConfig> {
        let q = self;
        crate::names::check_queue(&q.name)?;
        for target in &q.enqueue {
            crate::names::check_queue(target).with_context(|| format!("queue {}: enqueue", q.name))?;
        }
        let key = |k: &str| format!("queue {}: {k}", q.name);
        let dur = |k: &str, qv: &Option<String>, dv: &Option<String>, def: Duration| -> anyhow::Result<Duration> {
            match qv.as_ref().or(dv.as_ref()) {
                Some(s) => parse_duration(&key(k), s),
                None => Ok(def),
            }
        };
        let size = |k: &str, qv: &Option<String>, dv: &Option<String>, def: usize| -> anyhow::Result<usize> {
            match qv.as_ref().or(dv.as_ref()) {
                Some(s) => parse_size(&key(k), s),
                None => Ok(def),
            }
        };
        let pd = Policy::default();
        let max_attempts = q.max_attempts.or(d.max_attempts).unwrap_or(pd.max_attempts).max(1);
        let policy = Policy {
            lease: dur("lease", &q.lease, &d.lease, pd.lease)?,
            max_attempts,
            // Unset, it leaves room for every failure and as many
            // deliveries without a verdict again.
            max_deliveries: q
                .max_deliveries
                .or(d.max_deliveries)
                .unwrap_or(pd.max_deliveries.max(max_attempts.saturating_mul(2))),
            max_reruns: q.max_reruns.or(d.max_reruns).unwrap_or(pd.max_reruns),
            retry_crashes: q.retry_crashes.or(d.retry_crashes).unwrap_or(pd.retry_crashes),
            backoff_initial: dur("backoff_initial", &q.backoff_initial, &d.backoff_initial, pd.backoff_initial)?,
            backoff_max: dur("backoff_max", &q.backoff_max, &d.backoff_max, pd.backoff_max)?,
            workers: q.workers.or(d.workers).unwrap_or(default_workers),
            batch: q.batch.or(d.batch).unwrap_or(pd.batch),
            ..pd
        };
        if policy.workers == 0 || policy.batch == 0 {
            bail!("queue {}: workers and batch must be at least 1", q.name);
        }
        if policy.max_deliveries < policy.max_attempts {
            bail!(
                "queue {}: max_deliveries ({}) must be at least max_attempts ({}): every failure takes a delivery",
                q.name,
                policy.max_deliveries,
                policy.max_attempts
            );
        }
        if policy.lease < Duration::from_millis(100) {
            bail!("queue {}: lease must be at least 100ms", q.name);
        }
        at_most(&key("lease"), policy.lease, MAX_LEASE)?;
        let hd = HandlerLimits::default();
        let limits = HandlerLimits {
            deadline: at_most(&key("deadline"), dur("deadline", &q.deadline, &d.deadline, hd.deadline)?, MAX_LEASE)?,
            memory: size("memory", &q.memory, &d.memory, hd.memory)?,
            max_log_bytes: size("max_log_bytes", &q.max_log_bytes, &d.max_log_bytes, hd.max_log_bytes)?,
            max_instructions: match q.max_instructions.or(d.max_instructions) {
                Some(0) => bail!("queue {}: max_instructions must be at least 1 (leave it out for no budget)", q.name),
                n => n,
            },
        };
        if limits.memory > runtime.max_memory {
            bail!(
                "queue {}: memory {} exceeds runtime.max_memory {}",
                q.name,
                limits.memory,
                runtime.max_memory
            );
        }
        let ed = EffectLimits::default();
        let effect_limits = EffectLimits {
            max_effects: q.max_effects.or(d.max_effects).unwrap_or(ed.max_effects),
            max_bytes: size("max_effect_bytes", &q.max_effect_bytes, &d.max_effect_bytes, ed.max_bytes)?,
            max_delay: at_most(
                &key("max_delay"),
                dur("max_delay", &q.max_delay, &d.max_delay, ed.max_delay)?,
                crate::store::MAX_SCHEDULE,
            )?,
            max_reads: q.max_reads.or(d.max_reads).unwrap_or(ed.max_reads),
            max_read_bytes: size("max_read_bytes", &q.max_read_bytes, &d.max_read_bytes, ed.max_read_bytes)?,
        };
        at_most(&key("backoff_max"), policy.backoff_max, effect_limits.max_delay)?;
        at_most(&key("backoff_initial"), policy.backoff_initial, policy.backoff_max)?;
        Ok(QueueConfig {
            name: q.name.clone(),
            handler: resolve(base, &q.handler),
            grants: Grants {
                tables: q.tables.iter().cloned().collect(),
                queues: q.enqueue.iter().cloned().collect(),
                connectors: q.connectors.iter().cloned().collect(),
            },
            policy,
            limits,
            effect_limits,
        })
    }
}

/// The `[[connector]]`s, in file order; every connector a queue is granted
/// must be among them.
fn parse_connectors(raw: &[RawConnector], queues: &[QueueConfig], base: &Path) -> anyhow::Result<Vec<(String, ConnectorConfig)>> {
    let mut connectors: Vec<(String, ConnectorConfig)> = Vec::new();
    for c in raw {
        crate::names::check_connector(&c.name)?;
        if connectors.iter().any(|(n, _)| *n == c.name) {
            bail!("connector {} is configured twice", c.name);
        }
        connectors.push((c.name.clone(), parse_connector(c, base)?));
    }
    for q in queues {
        for c in &q.grants.connectors {
            if !connectors.iter().any(|(n, _)| n == c) {
                bail!(
                    "queue {} is granted connector {c}, but no [[connector]] named {c} is configured (connectors: {})",
                    q.name,
                    if connectors.is_empty() {
                        "none".to_string()
                    } else {
                        connectors.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(", ")
                    }
                );
            }
        }
    }
    Ok(connectors)
}

impl RawOutbox {
    /// `[outbox]`: how outbox queues are worked.
    fn resolve(&self) -> anyhow::Result<OutboxSettings> {
        let o = self;
        let od = OutboxSettings::default();
        let odur = |k: &str, v: &Option<String>, def: Duration| -> anyhow::Result<Duration> {
            match v {
                Some(s) => parse_duration(&format!("outbox.{k}"), s),
                None => Ok(def),
            }
        };
        let outbox = OutboxSettings {
            workers: o.workers.or(od.workers),
            batch: o.batch.unwrap_or(od.batch),
            lease: odur("lease", &o.lease, od.lease)?,
            max_attempts: o.max_attempts.unwrap_or(od.max_attempts).max(1),
            backoff_initial: odur("backoff_initial", &o.backoff_initial, od.backoff_initial)?,
            backoff_max: odur("backoff_max", &o.backoff_max, od.backoff_max)?,
            retention: odur("retention", &o.retention, od.retention)?,
        };
        if outbox.workers == Some(0) || outbox.batch == 0 {
            bail!("outbox.workers and outbox.batch must be at least 1");
        }
        if outbox.lease < Duration::from_millis(100) {
            bail!("outbox.lease must be at least 100ms");
        }
        at_most("outbox.lease", outbox.lease, MAX_LEASE)?;
        at_most("outbox.backoff_max", outbox.backoff_max, crate::protocol::effects::MAX_DELAY)?;
        at_most("outbox.retention", outbox.retention, crate::store::MAX_SCHEDULE)?;
        Ok(outbox)
    }
}

impl RawAdmin {
    /// `[admin]`: the address (default loopback, `"off"` for none), the
    /// token (from the file or the environment) and the upload limit.
    fn resolve(&self, base: &Path) -> anyhow::Result<AdminConfig> {
        let max_upload = match &self.max_upload {
            Some(m) => parse_size("admin.max_upload", m)?,
            None => ADMIN_MAX_UPLOAD,
        };
        let listen = match self.listen.as_deref() {
            None => Some(ADMIN_LISTEN.to_string()),
            Some("off") => None,
            Some(a) => {
                a.parse::<std::net::SocketAddr>()
                    .with_context(|| format!("admin.listen: {a:?} is not an address (try \"127.0.0.1:7070\", or \"off\")"))?;
                Some(a.to_string())
            }
        };
        if self.token.is_some() && self.token_env.is_some() {
            bail!("admin: set token or token_env, not both");
        }
        let token = match (&self.token, &self.token_env) {
            (Some(t), _) if t.is_empty() => bail!("admin.token is empty"),
            (Some(t), _) => Some(t.clone()),
            (None, env) => std::env::var(env.as_deref().unwrap_or(ADMIN_TOKEN_ENV))
                .ok()
                .filter(|t| !t.is_empty()),
        };
        let d = ServeLimits::default();
        let limits = ServeLimits {
            max_connections: self.max_connections.unwrap_or(d.max_connections),
            header_timeout: match &self.header_timeout {
                Some(t) => parse_duration("admin.header_timeout", t)?,
                None => d.header_timeout,
            },
        };
        if limits.max_connections == 0 {
            bail!("admin.max_connections must be at least 1");
        }
        if limits.header_timeout.is_zero() {
            bail!("admin.header_timeout must be more than zero");
        }
        let mut tokens = Vec::new();
        if let Some(t) = &token {
            tokens.push(
                crate::access::Token::new("admin", crate::access::Role::Admin, vec!["*".into()], crate::access::digest(t))
                    .map_err(anyhow::Error::msg)?,
            );
        }
        for t in &self.tokens {
            tokens.push(t.resolve(base)?);
        }
        for (i, t) in tokens.iter().enumerate() {
            if tokens[..i].iter().any(|o| o.name == t.name) {
                bail!("admin.tokens: two tokens are named {} (admin.token is named admin)", t.name);
            }
        }
        Ok(AdminConfig {
            listen,
            token,
            tokens: crate::access::Tokens(tokens),
            token_env: self.token_env.clone().unwrap_or_else(|| ADMIN_TOKEN_ENV.to_string()),
            max_upload,
            limits,
        })
    }
}

impl AdminConfig {
    /// The token the CLI sends: from the environment (`admin.token_env`,
    /// default `ONCEQ_ADMIN_TOKEN`) when set, else `admin.token`.
    pub fn client_token(&self) -> Option<String> {
        std::env::var(&self.token_env)
            .ok()
            .filter(|t| !t.is_empty())
            .or_else(|| self.token.clone())
    }
}

impl RawToken {
    fn resolve(&self, base: &Path) -> anyhow::Result<crate::access::Token> {
        let name = &self.name;
        let role = crate::access::Role::parse(&self.role).with_context(|| {
            format!(
                "admin.tokens {name}: role {:?} is not admin, deployer, operator or viewer",
                self.role
            )
        })?;
        let digest = match (&self.secret_env, &self.secret_file, &self.sha256) {
            (Some(var), None, None) => match std::env::var(var) {
                Ok(s) if !s.is_empty() => crate::access::digest(&s),
                _ => bail!("admin.tokens {name}: the variable {var} (secret_env) is not set"),
            },
            (None, Some(file), None) => {
                let path = resolve(base, file);
                let s = std::fs::read_to_string(&path)
                    .with_context(|| format!("admin.tokens {name}: reading secret_file {}", path.display()))?;
                let s = s.trim_end_matches(['\n', '\r']);
                if s.is_empty() {
                    bail!("admin.tokens {name}: secret_file {} is empty", path.display());
                }
                crate::access::digest(s)
            }
            (None, None, Some(hex)) => {
                let bytes: Vec<u8> = (0..hex.len())
                    .step_by(2)
                    .filter_map(|i| hex.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
                    .collect();
                match <[u8; 32]>::try_from(bytes.as_slice()) {
                    Ok(d) if hex.len() == 64 => d,
                    _ => bail!("admin.tokens {name}: sha256 must be 64 hex digits (the SHA-256 of the secret, as `sha256sum` prints it)"),
                }
            }
            _ => bail!("admin.tokens {name}: give exactly one of secret_env, secret_file or sha256"),
        };
        crate::access::Token::new(name, role, self.queues.clone().unwrap_or_else(|| vec!["*".into()]), digest)
            .map_err(|e| anyhow::anyhow!("admin.tokens: {e}"))
    }
}

impl RawDeploy {
    /// `[deploy]`: the folder watched for handler files, and how often.
    fn resolve(&self, base: &Path) -> anyhow::Result<Option<(PathBuf, Duration)>> {
        let Some(dir) = &self.watch else { return Ok(None) };
        let poll = match &self.poll {
            Some(p) => parse_duration("deploy.poll", p)?,
            None => Duration::from_secs(1),
        };
        Ok(Some((resolve(base, dir), poll)))
    }
}

impl Config {
    /// Read and check a config file.
    pub fn load(path: &Path) -> anyhow::Result<Config> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading config {}", path.display()))?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Self::parse(&text, &base).with_context(|| format!("in config {}", path.display()))
    }

    /// Parse config text; relative paths are resolved against `base`.
    pub fn parse(text: &str, base: &Path) -> anyhow::Result<Config> {
        let raw: RawConfig = toml::from_str(text)?;
        let schema = match &raw.schema {
            None => vec![],
            Some(OneOrMany::One(p)) => vec![resolve(base, p)],
            Some(OneOrMany::Many(ps)) => ps.iter().map(|p| resolve(base, p)).collect(),
        };
        let state_dir = resolve(base, raw.state_dir.as_deref().unwrap_or(Path::new(".onceq")));
        let runtime = raw.runtime.resolve(&state_dir)?;
        if raw.runtime.count_instructions == Some(false)
            && (raw.defaults.max_instructions.is_some() || raw.queues.iter().any(|q| q.max_instructions.is_some()))
        {
            bail!("runtime.count_instructions = false, but a queue has max_instructions: a budget needs instructions counted");
        }
        let store = store_url(&raw.store, base);
        let default_workers = default_workers(&store);
        let mut queues: Vec<QueueConfig> = Vec::new();
        for q in &raw.queues {
            if queues.iter().any(|o| o.name == q.name) {
                bail!("queue {} is configured twice", q.name);
            }
            queues.push(q.resolve(&raw.defaults, &runtime, base, default_workers)?);
        }
        let connectors = parse_connectors(&raw.connectors, &queues, base)?;
        Ok(Config {
            store,
            schema,
            store_options: raw.store_options()?,
            runtime,
            queues,
            outbox: raw.outbox.resolve()?,
            connectors,
            state_dir,
            admin: raw.admin.resolve(base)?,
            telemetry: raw.telemetry.resolve()?,
            audit_retention: match &raw.audit.retention {
                Some(r) => parse_duration("audit.retention", r)?,
                None => AUDIT_RETENTION,
            },
            watch: raw.deploy.resolve(base)?,
            trust: crate::signing::Trust::parse(&raw.deploy.trusted_keys, raw.deploy.require_signature.unwrap_or(false), base)?,
            shutdown_grace: match &raw.shutdown_grace {
                Some(g) => at_most("shutdown_grace", parse_duration("shutdown_grace", g)?, MAX_LEASE)?,
                None => SHUTDOWN_GRACE,
            },
        })
    }

    pub fn queue(&self, name: &str) -> anyhow::Result<&QueueConfig> {
        self.queues
            .iter()
            .find(|q| q.name == name)
            .with_context(|| format!("no queue named {name} in the config (queues: {})", self.queue_list()))
    }

    /// A queue may enqueue on queues this config does not serve (another
    /// host may); said at start (`onceq run`, the demo), since a typo parks
    /// its messages for good.
    pub fn warn_unserved_targets(&self) {
        for q in &self.queues {
            for t in q.grants.queues.iter().filter(|t| self.queue(t).is_err()) {
                tracing::warn!(
                    queue = %q.name,
                    "queue {} may enqueue on {t}{}, which no [[queue]] of this config serves: its messages wait until a host serves it",
                    q.name,
                    crate::names::did_you_mean(t, self.queue_names())
                );
            }
        }
    }

    /// The configured queues' names, in file order.
    pub fn queue_names(&self) -> impl Iterator<Item = &str> {
        self.queues.iter().map(|q| q.name.as_str())
    }

    /// The configured queues' names, comma-separated, for messages.
    pub fn queue_list(&self) -> String {
        self.queue_names().collect::<Vec<_>>().join(", ")
    }

    /// The concatenated schema files.
    pub fn schema_ddl(&self) -> anyhow::Result<String> {
        let mut ddl = String::new();
        for p in &self.schema {
            ddl.push_str(&std::fs::read_to_string(p).with_context(|| format!("reading schema file {}", p.display()))?);
            ddl.push('\n');
        }
        Ok(ddl)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use super::*;

    #[test]
    fn sizes_and_durations_parse_or_name_the_key() {
        assert_eq!(parse_size("k", "64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_size("k", "512 KiB").unwrap(), 512 << 10);
        assert_eq!(parse_size("k", "100").unwrap(), 100);
        let e = parse_size("queue q: memory", "64 parsecs").unwrap_err().to_string();
        assert!(e.contains("queue q: memory") && e.contains("parsecs"), "{e}");
        assert_eq!(parse_duration("k", "250ms").unwrap(), Duration::from_millis(250));
        assert!(parse_duration("lease", "soon").unwrap_err().to_string().contains("lease: \"soon\""));
    }

    #[test]
    fn a_queue_s_workers_default_to_what_its_store_was_measured_with() {
        let queue = "[[queue]]\nname = \"q\"\nhandler = \"q.wasm\"\n";
        let workers = |store: &str, extra: &str| {
            let cfg = Config::parse(&format!("store = \"{store}\"\n{extra}{queue}"), Path::new("/b")).unwrap();
            (cfg.queue("q").unwrap().policy.workers, cfg.runtime.max_instances)
        };
        assert_eq!(workers("x.db", ""), (SQLITE_WORKERS, 256));
        assert_eq!(workers("sqlite://x.db", ""), (SQLITE_WORKERS, 256));
        assert_eq!(workers("spanner://projects/p/instances/i/databases/d", "").0, 16);
        // Set, it is what was set, on either store.
        assert_eq!(workers("x.db", "[defaults]\nworkers = 3\n").0, 3);
        assert_eq!(
            workers("spanner://projects/p/instances/i/databases/d", "[defaults]\nworkers = 40\n").0,
            40
        );
        // Eight SQLite queues at the default fit the default instances.
        assert!(SQLITE_WORKERS * 8 <= crate::runtime::RuntimeConfig::default().max_instances as usize);
    }

    #[test]
    fn spanner_expiry_is_ttl_or_purge() {
        let cfg = |expiry: &str| Config::parse(&format!("store = \"x.db\"\n[spanner]\nexpiry = \"{expiry}\"\n"), Path::new("/b"));
        assert_eq!(
            cfg("purge").unwrap().store_options.spanner_expiry,
            crate::store::SpannerExpiry::Purge
        );
        assert_eq!(cfg("ttl").unwrap().store_options.spanner_expiry, crate::store::SpannerExpiry::Ttl);
        let e = format!("{:#}", cfg("never").unwrap_err());
        assert!(e.contains("spanner.expiry") && e.contains("\"never\""), "{e}");
    }

    #[test]
    fn queues_inherit_defaults_and_paths_resolve_against_the_config() {
        let cfg = Config::parse(
            r#"
            store = "db/x.db"
            schema = "s.sql"
            [defaults]
            lease = "3s"
            workers = 2
            [[queue]]
            name = "a"
            handler = "a.wasm"
            tables = ["t"]
            [[queue]]
            name = "b"
            handler = "/abs/b.wasm"
            workers = 7
            deadline = "250ms"
            memory = "16MiB"
            "#,
            Path::new("/base"),
        )
        .unwrap();
        assert_eq!(cfg.store, "sqlite:///base/db/x.db");
        assert_eq!(cfg.schema, vec![PathBuf::from("/base/s.sql")]);
        let a = cfg.queue("a").unwrap();
        assert_eq!((a.policy.lease, a.policy.workers), (Duration::from_secs(3), 2));
        assert_eq!(a.handler, PathBuf::from("/base/a.wasm"));
        assert!(a.grants.tables.contains("t"));
        let b = cfg.queue("b").unwrap();
        assert_eq!(
            (b.policy.workers, b.limits.deadline, b.limits.memory),
            (7, Duration::from_millis(250), 16 << 20)
        );
        assert!(cfg.queue("c").unwrap_err().to_string().contains("queues: a, b"));
        assert!(cfg.runtime.reset_dirty_pages, "dirty pages scanned by default");
        let wholesale = Config::parse("store = \"x.db\"\n[runtime]\nreset_dirty_pages = false\n", Path::new("/base")).unwrap();
        assert!(!wholesale.runtime.reset_dirty_pages);
    }

    #[test]
    fn bad_configs_are_refused_with_a_reason() {
        let base = Path::new("/");
        let bad = |text: &str, needle: &str| {
            let e = format!("{:#}", Config::parse(text, base).unwrap_err());
            assert!(e.contains(needle), "expected {needle:?} in {e}");
        };
        bad("store = 1", "invalid type");
        bad("store = \"x\"\n[[queue]]\nname = \"a b\"\nhandler = \"h\"", "queue name \"a b\"");
        bad(
            "store = \"x\"\n[[queue]]\nname = \"a\"\nhandler = \"h\"\n[[queue]]\nname = \"a\"\nhandler = \"h\"",
            "configured twice",
        );
        bad("store = \"x\"\n[[queue]]\nname = \"a\"\nhandler = \"h\"\nworkers = 0", "at least 1");
        bad(
            "store = \"x\"\n[[queue]]\nname = \"a\"\nhandler = \"h\"\nmemory = \"1GiB\"",
            "exceeds runtime.max_memory",
        );
        bad("store = \"x\"\n[sqlite]\nsynchronous = \"sometimes\"", "sqlite.synchronous");
        bad("store = \"x\"\n[[queue]]\nname = \"onceq.x\"\nhandler = \"h\"", "reserved");
        bad(
            "store = \"x\"\n[[queue]]\nname = \"a\"\nhandler = \"h\"\nconnectors = [\"charge\"]",
            "no [[connector]] named charge is configured (connectors: none)",
        );
        bad(
            "store = \"x\"\n[[connector]]\nname = \"c\"\nkind = \"webhook\"",
            "kind webhook needs a url",
        );
        bad(
            "store = \"x\"\n[[connector]]\nname = \"c\"\nkind = \"file\"\npath = \"p\"\nurl = \"http://x\"",
            "url is not a setting of kind file",
        );
        bad(
            "store = \"x\"\n[[connector]]\nname = \"c\"\nkind = \"kafka\"",
            "unknown kind \"kafka\"",
        );
        bad("store = \"x\"\n[outbox]\nretention = \"forever\"", "outbox.retention");
        bad("store = \"x\"\n[outbox]\nworkers = 0", "outbox.workers");
        bad(
            "store = \"x\"\n[[queue]]\nname = \"a\"\nhandler = \"h\"\nlease = \"300000years\"",
            "queue a: lease: ",
        );
        bad(
            "store = \"x\"\n[[queue]]\nname = \"a\"\nhandler = \"h\"\nlease = \"2h\"",
            "is over the limit of 1h",
        );
        bad(
            "store = \"x\"\n[[queue]]\nname = \"ONCEQ.x\"\nhandler = \"h\"",
            "reserved for onceq",
        );
        bad(
            "store = \"x\"\n[[queue]]\nname = \"a\"\nhandler = \"h\"\nenqueue = [\"b c\"]",
            "queue a: enqueue",
        );
        bad(
            "store = \"x\"\nshutdown_grace = \"2h\"",
            "shutdown_grace: 2h is over the limit of 1h",
        );
        bad(
            "store = \"x\"\n[defaults]\nmax_delay = \"2000years\"\n[[queue]]\nname = \"a\"\nhandler = \"h\"",
            "queue a: max_delay",
        );
        bad("store = \"x\"\n[admin]\nmax_upload = \"lots\"", "admin.max_upload");
        bad(
            "store = \"x\"\n[runtime]\ncount_instructions = false\n[[queue]]\nname = \"a\"\nhandler = \"h\"\nmax_instructions = 1000",
            "a budget needs instructions counted",
        );
        bad(
            "store = \"x\"\n[[queue]]\nname = \"a\"\nhandler = \"h\"\nmax_instructions = 0",
            "queue a: max_instructions must be at least 1",
        );
    }

    #[test]
    fn limits_parse_with_their_defaults() {
        let cfg = Config::parse(
            "store = \"x.db\"\nshutdown_grace = \"3s\"\n[admin]\nmax_upload = \"8MiB\"\n[defaults]\nmax_delay = \"7d\"\nmax_reads = 50\n[[queue]]\nname = \"a\"\nhandler = \"h\"\nmax_read_bytes = \"1MiB\"\nmax_log_bytes = \"4KiB\"\n[[queue]]\nname = \"b\"\nhandler = \"h\"",
            Path::new("/"),
        )
        .unwrap();
        assert_eq!(cfg.shutdown_grace, Duration::from_secs(3));
        assert_eq!(cfg.admin.max_upload, 8 << 20);
        let a = cfg.queue("a").unwrap();
        assert_eq!(a.effect_limits.max_delay, Duration::from_secs(7 * 24 * 3600));
        assert_eq!((a.effect_limits.max_reads, a.effect_limits.max_read_bytes), (50, 1 << 20));
        assert_eq!(a.limits.max_log_bytes, 4 << 10);
        let b = cfg.queue("b").unwrap();
        assert_eq!(b.effect_limits.max_read_bytes, EffectLimits::default().max_read_bytes);
        assert_eq!(b.limits.max_log_bytes, HandlerLimits::default().max_log_bytes);
        assert_eq!((a.limits.max_instructions, b.limits.max_instructions), (None, None));
        assert!(cfg.runtime.count_instructions, "instructions are counted by default");
        let budget = Config::parse(
            "store = \"x\"\n[defaults]\nmax_instructions = 11000000\n[[queue]]\nname = \"a\"\nhandler = \"h\"\n[[queue]]\nname = \"b\"\nhandler = \"h\"\nmax_instructions = 500",
            Path::new("/"),
        )
        .unwrap();
        assert_eq!(budget.queue("a").unwrap().limits.max_instructions, Some(11_000_000));
        assert_eq!(budget.queue("b").unwrap().limits.max_instructions, Some(500));
        assert_eq!(
            Config::parse("store = \"x\"", Path::new("/")).unwrap().shutdown_grace,
            SHUTDOWN_GRACE
        );
    }

    #[test]
    fn connectors_and_outbox_settings_parse() {
        let cfg = Config::parse(
            r#"
            store = "x.db"
            [outbox]
            workers = 2
            retention = "1h"
            [[connector]]
            name = "charge"
            kind = "webhook"
            url = "https://payments.example/charges"
            timeout = "3s"
            headers = { "X-Team" = "payments" }
            [[connector]]
            name = "audit"
            kind = "file"
            path = "out/audit.jsonl"
            [[queue]]
            name = "payments"
            handler = "p.wasm"
            connectors = ["charge", "audit"]
            "#,
            Path::new("/base"),
        )
        .unwrap();
        assert_eq!((cfg.outbox.workers, cfg.outbox.retention), (Some(2), Duration::from_secs(3600)));
        assert_eq!(cfg.outbox.max_attempts, OutboxSettings::default().max_attempts);
        match &cfg.connectors[0] {
            (n, ConnectorConfig::Webhook { url, timeout, headers, .. }) => {
                assert_eq!(
                    (n.as_str(), url.as_str(), *timeout),
                    ("charge", "https://payments.example/charges", Duration::from_secs(3))
                );
                assert_eq!(headers, &vec![("X-Team".to_string(), "payments".to_string())]);
            }
            other => panic!("unexpected {other:?}"),
        }
        match &cfg.connectors[1] {
            (_, ConnectorConfig::File { path }) => assert_eq!(path, &PathBuf::from("/base/out/audit.jsonl")),
            other => panic!("unexpected {other:?}"),
        }
    }
}
