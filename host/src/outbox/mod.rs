//! The transactional outbox: intents reach the outside world after commit,
//! at least once, always with their idempotency key.
//!
//! # How an intent travels
//!
//! 1. A handler returns an `intent` effect (connector, idempotency key,
//!    payload, metadata). The protocol turns it into a message on the
//!    connector's outbox queue, `onceq.outbox.<connector>`
//!    ([`intent_message`]), enqueued **in the message's transaction**: if
//!    that transaction rolls back, the intent never existed.
//! 2. The key is the message's dedup key, held until the intent is
//!    delivered ([`HOLD_UNTIL_DELIVERED`]): a second emission of the same
//!    key for the same connector (another message, a replay) is dropped.
//! 3. The outbox queue is worked by the same [`QueueRunner`] as any queue
//!    (leases, background renewal, backoff with jitter, dead letters,
//!    replay), with a [`Dispatcher`] as its handler: it hands the intent to
//!    its [`Connector`] and maps the answer to delivered (ack), retry (with
//!    the connector's delay, e.g. `Retry-After`) or refused (dead letter,
//!    with the reason).
//! 4. The dispatcher's ack moves the key's expiry to now + the retention
//!    window ([`crate::store::Transaction::dedup_hold`]), in the ack's
//!    transaction. A duplicate emission within the window is dropped; after
//!    it the key is purged.
//!
//! A delivery whose ack fails (crash, lost lease, unknown commit outcome) is
//! delivered again, with the same key: the receiver deduplicates. That is
//! the contract: at least once, one key per intent, the key chosen by the
//! handler (never random).

pub mod connectors;
pub mod inspect;

use crate::protocol::{EffectLimits, Grants, HandleOutput, Handler, HandlerFailure, Policy, QueueRunner, QueueSpec, ReadScope};
use crate::store::Store;
use crate::value::{Effect, Message};
use async_trait::async_trait;
use std::sync::Arc;
use std::time::Duration;

pub use connectors::{ConnectorConfig, Delivery};
pub use inspect::{ConnectorStats, Entry};

pub use crate::names::{outbox_connector as connector_of, outbox_queue as queue_of};
pub use crate::names::{
    KEY_ATTRIBUTE, OUTBOX_QUEUE_PREFIX as QUEUE_PREFIX, RESERVED_PREFIX, SOURCE_MESSAGE_ATTRIBUTE, SOURCE_QUEUE_ATTRIBUTE,
    VERSION_ATTRIBUTE,
};
pub use crate::protocol::effects::{intent_message, HOLD_UNTIL_DELIVERED};

/// Why an outbox message is not an intent (onceq wrote it: this is a bug
/// or a database changed behind onceq's back).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IntentError {
    #[error("queue {0} is not an outbox queue")]
    NotAnOutboxQueue(String),
    #[error("outbox message {id} has no {KEY_ATTRIBUTE} attribute")]
    NoKey { id: String },
}

/// An intent as a connector sees it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Intent {
    pub connector: String,
    pub idempotency_key: String,
    #[serde(skip)]
    pub payload: Vec<u8>,
    /// The handler's metadata (onceq's own attributes removed).
    pub metadata: Vec<(String, String)>,
    pub source_queue: String,
    pub source_message_id: String,
    /// The handler version that emitted it.
    pub source_version: Option<String>,
    /// The W3C trace context it carries (see [`crate::trace`]).
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
    /// The outbox message's id.
    pub id: String,
    /// Delivery attempt, 1 on the first.
    pub attempt: u32,
}

impl Intent {
    /// Read an outbox message back as an intent.
    pub fn from_message(msg: &Message) -> Result<Intent, IntentError> {
        let connector = connector_of(&msg.queue)
            .ok_or_else(|| IntentError::NotAnOutboxQueue(msg.queue.clone()))?
            .to_string();
        Self::from_parts(connector, &msg.id, msg.attempt, &msg.attributes, &msg.payload)
    }

    fn from_parts(
        connector: String,
        id: &str,
        attempt: u32,
        attributes: &[(String, String)],
        payload: &[u8],
    ) -> Result<Intent, IntentError> {
        let get = |name: &str| attributes.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
        let idempotency_key = get(KEY_ATTRIBUTE).ok_or_else(|| IntentError::NoKey { id: id.to_string() })?;
        Ok(Intent {
            connector,
            idempotency_key,
            payload: payload.to_vec(),
            metadata: attributes
                .iter()
                .filter(|(k, _)| !k.starts_with(RESERVED_PREFIX))
                .cloned()
                .collect(),
            source_queue: get(SOURCE_QUEUE_ATTRIBUTE).unwrap_or_default(),
            source_message_id: get(SOURCE_MESSAGE_ATTRIBUTE).unwrap_or_default(),
            source_version: get(VERSION_ATTRIBUTE),
            traceparent: get(crate::trace::TRACEPARENT_ATTRIBUTE),
            tracestate: get(crate::trace::TRACESTATE_ATTRIBUTE),
            id: id.to_string(),
            attempt,
        })
    }

    /// An intent waiting in the outbox, from a listing.
    pub fn from_queued(m: &crate::store::QueuedMessage) -> Option<Intent> {
        let connector = connector_of(&m.queue)?.to_string();
        Self::from_parts(connector, &m.id, m.deliveries, &m.attributes, &m.payload).ok()
    }

    /// A dead-lettered intent.
    pub fn from_dead_letter(d: &crate::store::DeadLetter) -> Option<Intent> {
        let connector = connector_of(&d.queue)?.to_string();
        Self::from_parts(connector, &d.id, d.deliveries, &d.attributes, &d.payload).ok()
    }

    /// The payload as text (lossy), for logs and listings.
    pub fn payload_text(&self) -> String {
        String::from_utf8_lossy(&self.payload).into_owned()
    }
}

/// Somewhere intents go: an HTTP endpoint, a file, the log.
#[async_trait]
pub trait Connector: Send + Sync {
    /// "webhook", "file", "log".
    fn kind(&self) -> &'static str;

    /// Deliver one intent. Called again, with the same key, after a retry
    /// or when an earlier delivery's ack was lost: the far side must
    /// deduplicate by the key.
    async fn deliver(&self, intent: &Intent) -> Delivery;

    /// Concurrent deliveries when `outbox.workers` is not set.
    fn default_workers(&self) -> usize {
        DEFAULT_WORKERS
    }

    /// Whether a worker may deliver the intents of its leased batch at
    /// once (up to four) rather than one after another. No by default:
    /// `outbox.workers` is then exactly how many deliveries a receiver is
    /// asked to take at once. Yes for a connector whose concurrent
    /// deliveries cost nothing more (the `file` connector's share one
    /// write and one `fdatasync`).
    fn delivers_together(&self) -> bool {
        false
    }
}

/// Concurrent deliveries per connector by default: what a receiver over
/// the network is asked to take at once.
pub const DEFAULT_WORKERS: usize = 16;

/// The handler of an outbox queue: delivers each intent through its
/// connector. It reads nothing and returns no effects; on a delivery it
/// holds the intent's key for the retention window in the transaction it
/// is given, and the protocol acks the intent in that same transaction.
pub struct Dispatcher {
    connector: Arc<dyn Connector>,
    version: String,
    /// How long a delivered intent's key is kept (`outbox.retention`).
    retention: Duration,
}

impl Dispatcher {
    pub fn new(name: &str, connector: Arc<dyn Connector>, retention: Duration) -> Dispatcher {
        let version = format!("connector:{}:{name}", connector.kind());
        Dispatcher {
            connector,
            version,
            retention,
        }
    }
}

#[async_trait]
impl Handler for Dispatcher {
    fn version(&self) -> &str {
        &self.version
    }

    /// A worker's intents are delivered together where the connector
    /// allows it ([`Connector::delivers_together`]): each then waits for
    /// its connector, not for the one before it.
    fn runs_together(&self) -> bool {
        self.connector.delivers_together()
    }

    async fn handle(&self, msg: &Message, mut scope: ReadScope) -> HandleOutput {
        let mut intent = match Intent::from_message(msg) {
            Ok(i) => i,
            Err(e) => {
                return HandleOutput {
                    scope,
                    result: Err(HandlerFailure::Reject(e.to_string())),
                }
            }
        };
        // The delivery's client span (telemetry on), under this run's
        // handler call: its context is what the receiver gets.
        let span = crate::telemetry::current().delivery(&intent.connector, self.connector.kind());
        if let Some(t) = span.traceparent() {
            intent.traceparent = Some(t.to_string());
        }
        let delivery = self.connector.deliver(&intent).await;
        match &delivery {
            Delivery::Delivered(detail) => span.event("delivered", vec![opentelemetry::KeyValue::new("onceq.detail", detail.clone())]),
            Delivery::Retry { reason, .. } | Delivery::Refused(reason) => span.fail(reason),
        }
        span.end();
        let result = match delivery {
            Delivery::Delivered(detail) => {
                tracing::debug!(connector = %intent.connector, key = %intent.idempotency_key, "delivered: {detail}");
                // Keep the key for the retention window, in the ack's
                // transaction: a duplicate emission within it is dropped.
                scope.transaction().dedup_hold(&msg.queue, &intent.idempotency_key, self.retention);
                Ok(Vec::<Effect>::new())
            }
            Delivery::Retry { reason, after } => Err(HandlerFailure::Undelivered {
                reason,
                retry: true,
                after,
            }),
            Delivery::Refused(reason) => Err(HandlerFailure::Undelivered {
                reason,
                retry: false,
                after: None,
            }),
        };
        HandleOutput { scope, result }
    }
}

/// How the outbox queues are worked (`[outbox]` in `onceq.toml`).
#[derive(Debug, Clone)]
pub struct OutboxSettings {
    /// Concurrent deliveries per connector; `None`: the connector's own
    /// default ([`Connector::default_workers`]).
    pub workers: Option<usize>,
    /// Intents leased per round trip.
    pub batch: usize,
    /// Lease per intent (renewed in the background while a delivery runs).
    pub lease: Duration,
    /// Delivery attempts before an intent is dead-lettered.
    pub max_attempts: u32,
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    /// How long a delivered intent's key is kept to drop duplicates.
    pub retention: Duration,
}

impl Default for OutboxSettings {
    fn default() -> Self {
        OutboxSettings {
            workers: None,
            batch: 4,
            lease: Duration::from_secs(30),
            max_attempts: 20,
            backoff_initial: Duration::from_millis(500),
            backoff_max: Duration::from_secs(300),
            retention: Duration::from_secs(7 * 24 * 3600),
        }
    }
}

/// The runner of one connector's outbox queue.
pub fn runner(store: Arc<dyn Store>, name: &str, connector: Arc<dyn Connector>, s: &OutboxSettings) -> QueueRunner {
    let workers = s.workers.unwrap_or_else(|| connector.default_workers());
    QueueRunner::new(
        QueueSpec {
            name: queue_of(name),
            handler: Arc::new(Dispatcher::new(name, connector, s.retention)),
            grants: Grants::default(),
            limits: EffectLimits::default(),
            policy: Policy {
                lease: s.lease,
                max_attempts: s.max_attempts,
                max_deliveries: Policy::default().max_deliveries.max(s.max_attempts.saturating_mul(2)),
                backoff_initial: s.backoff_initial,
                backoff_max: s.backoff_max,
                workers,
                batch: s.batch,
                ..Policy::default()
            },
        },
        store,
    )
}
