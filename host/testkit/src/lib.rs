//! `onceq-testkit`: test a handler component the way the host runs it, with
//! no database and no host process.
//!
//! Load the built component, describe the rows its reads should see (a
//! [`Fixture`], from the same schema file `onceq init` applies), feed it a
//! message, and look at what it did: its effects, checked against the
//! schema and the grants exactly as the host checks them, or its error.
//! `onceq try` runs the same code against a real database.
//!
//! ```ignore
//! use onceq_testkit::{Fixture, TestKit, Value};
//!
//! let kit = TestKit::new()?.connectors(&["charge"]);
//! let payments = kit.load("guest-examples/target/wasm32-wasip2/release/payments.wasm")?;
//! let mut db = Fixture::from_ddl(include_str!("../schema.sql"))?;
//! db.insert("accounts", [("id", Value::String("acct-1".into())), ("balance", Value::Int64(100))])?;
//! let report = kit.run(&payments, &db, &kit.message("payments", r#"{"order_id":"o-1","account":"acct-1","amount":60}"#));
//! assert!(report.is_ok());
//! assert!(report.intents().any(|i| i.idempotency_key == "charge-o-1"));
//! ```
//!
//! The handler sees the same deterministic world as in production: its
//! clock reads the message's time and its randomness is seeded from the
//! message id, so the same message gives the same effects every run.

pub use onceq::protocol::{EffectLimits, Grants};
pub use onceq::runtime::HandlerLimits;
pub use onceq::store::memory::Fixture;
pub use onceq::tryout::TryReport;
pub use onceq::value::{Effect, FollowUp, Intent, Message, RowWrite, Value, WriteOp};

use anyhow::Context;
use std::path::Path;

/// The engine (shared by the components it loads) and the grants messages
/// run with.
pub struct TestKit {
    runtime: onceq::runtime::Runtime,
    rt: tokio::runtime::Runtime,
    queues: Vec<String>,
    connectors: Vec<String>,
    limits: HandlerLimits,
    effect_limits: EffectLimits,
}

/// A loaded, validated handler component.
pub struct Component {
    handler: onceq::runtime::WasmHandler,
}

impl Component {
    /// Its version: the content hash the host reports.
    pub fn version(&self) -> &str {
        use onceq::protocol::Handler;
        self.handler.version()
    }
}

/// Logical time of test messages: 2026-01-01T00:00:00Z, in microseconds.
pub const TEST_TIME: i64 = 1_767_225_600_000_000;

impl TestKit {
    pub fn new() -> anyhow::Result<TestKit> {
        TestKit::build(None)
    }

    /// Like [`TestKit::new`], with compiled components cached on disk in
    /// `dir` (the host's `runtime.cache`): the JavaScript and Python
    /// components take seconds to compile, then milliseconds to load from
    /// the cache in every later test run.
    pub fn with_cache(dir: impl AsRef<Path>) -> anyhow::Result<TestKit> {
        TestKit::build(Some(dir.as_ref().to_path_buf()))
    }

    fn build(cache_dir: Option<std::path::PathBuf>) -> anyhow::Result<TestKit> {
        Ok(TestKit {
            runtime: onceq::runtime::Runtime::new(onceq::runtime::RuntimeConfig {
                max_instances: 4,
                cache_dir,
                ..Default::default()
            })?,
            rt: tokio::runtime::Builder::new_current_thread().enable_all().build()?,
            queues: Vec::new(),
            connectors: Vec::new(),
            limits: HandlerLimits::default(),
            effect_limits: EffectLimits::default(),
        })
    }

    /// Queues the handler may enqueue follow-ups on (its own always): the
    /// queue's `enqueue` in `onceq.toml`.
    pub fn enqueue(mut self, queues: &[&str]) -> Self {
        self.queues = queues.iter().map(|s| s.to_string()).collect();
        self
    }

    #[deprecated(note = "use `enqueue`, the name onceq.toml uses")]
    pub fn queues(self, queues: &[&str]) -> Self {
        self.enqueue(queues)
    }

    /// Connectors the handler may emit intents for: the queue's
    /// `connectors` in `onceq.toml`.
    pub fn connectors(mut self, connectors: &[&str]) -> Self {
        self.connectors = connectors.iter().map(|s| s.to_string()).collect();
        self
    }

    /// Deadline and memory of one call (defaults: the host's).
    pub fn limits(mut self, limits: HandlerLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Load and validate a component, as `onceq deploy` would.
    pub fn load(&self, path: impl AsRef<Path>) -> anyhow::Result<Component> {
        let path = path.as_ref();
        let handler = self
            .runtime
            .load_file(path, self.limits)
            .with_context(|| format!("loading {}", path.display()))?;
        Ok(Component { handler })
    }

    /// Load and validate a component from its bytes.
    pub fn load_bytes(&self, bytes: &[u8]) -> anyhow::Result<Component> {
        let handler = self.runtime.load(bytes, self.limits).map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(Component { handler })
    }

    /// A first delivery of `payload` on `queue`, id `m-1`, at [`TEST_TIME`].
    pub fn message(&self, queue: &str, payload: impl Into<Vec<u8>>) -> Message {
        Message {
            id: "m-1".into(),
            queue: queue.into(),
            payload: payload.into(),
            attributes: vec![],
            attempt: 1,
            enqueued_at: TEST_TIME,
        }
    }

    /// Run one message: reads served from `fixture` (every table granted),
    /// effects checked, nothing applied.
    pub fn run(&self, component: &Component, fixture: &Fixture, message: &Message) -> TryReport {
        let schema = fixture.schema();
        let grants = Grants {
            tables: schema.tables.keys().cloned().collect(),
            queues: self.queues.iter().cloned().collect(),
            connectors: self.connectors.iter().cloned().collect(),
        };
        self.rt.block_on(onceq::tryout::run(
            &component.handler,
            message.clone(),
            fixture.transaction(),
            schema,
            &grants,
            &self.effect_limits,
        ))
    }
}

/// Views of a report's effects by kind.
pub trait Effects {
    fn writes(&self) -> impl Iterator<Item = &RowWrite>;
    fn enqueued(&self) -> impl Iterator<Item = &FollowUp>;
    fn intents(&self) -> impl Iterator<Item = &Intent>;
}

impl Effects for TryReport {
    fn writes(&self) -> impl Iterator<Item = &RowWrite> {
        self.effects.iter().filter_map(|e| match e {
            Effect::Write(w) => Some(w),
            _ => None,
        })
    }
    fn enqueued(&self) -> impl Iterator<Item = &FollowUp> {
        self.effects.iter().filter_map(|e| match e {
            Effect::Enqueue(f) => Some(f),
            _ => None,
        })
    }
    fn intents(&self) -> impl Iterator<Item = &Intent> {
        self.effects.iter().filter_map(|e| match e {
            Effect::Intent(i) => Some(i),
            _ => None,
        })
    }
}

/// A column of a row write, if present.
pub fn column<'a>(w: &'a RowWrite, name: &str) -> Option<&'a Value> {
    w.columns.iter().find(|(k, _)| k == name).map(|(_, v)| v)
}
