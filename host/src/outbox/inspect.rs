//! Outbox inspection: what `onceq outbox list|show|replay|delivered` and the outbox
//! part of `onceq stats` (and `/v1/stats`) show, read from the store.

use super::{connector_of, queue_of, Intent, QUEUE_PREFIX};
use crate::store::{self, Store};
use anyhow::{bail, Context};

/// An intent as `onceq outbox list|show` prints it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Entry {
    /// "pending" (waiting for a delivery or a retry), "in-flight" (leased
    /// by a dispatcher) or "dead" (refused, or out of attempts).
    pub state: &'static str,
    #[serde(flatten)]
    pub intent: Intent,
    pub payload: String,
    /// Database time (µs) of the emission.
    pub created_at: i64,
    /// Pending: when the next delivery may start (µs); dead: when it died.
    pub at: i64,
    /// Why the last delivery failed (pending), or why it is dead.
    pub reason: Option<String>,
}

fn entry_from_queued(m: &store::QueuedMessage) -> Option<Entry> {
    let intent = Intent::from_queued(m)?;
    Some(Entry {
        state: if m.leased { "in-flight" } else { "pending" },
        payload: intent.payload_text(),
        intent,
        created_at: m.enqueued_at,
        at: m.visible_at,
        reason: m.last_error.clone(),
    })
}

fn entry_from_dead(d: &store::DeadLetter) -> Option<Entry> {
    let intent = Intent::from_dead_letter(d)?;
    Some(Entry {
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
pub async fn list(store: &dyn Store, connector: Option<&str>, dead_only: bool, limit: usize) -> anyhow::Result<Vec<Entry>> {
    let queue = connector.map(queue_of);
    let sel = match &queue {
        Some(q) => store::Queues::Named(q),
        None => store::Queues::Prefix(QUEUE_PREFIX),
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
pub async fn get(store: &dyn Store, id: &str) -> anyhow::Result<Entry> {
    if let Some(e) = store.message_get(id).await?.as_ref().and_then(entry_from_queued) {
        return Ok(e);
    }
    if let Some(e) = store.dead_letter_get(id).await?.as_ref().and_then(entry_from_dead) {
        return Ok(e);
    }
    bail!("no undelivered intent with id {id} (delivered intents leave the outbox; their keys are kept for the retention window: `onceq outbox delivered`)")
}

/// `onceq outbox replay ID`: put a dead intent back in its outbox (same key,
/// attempts reset). Returns the entry as it was.
pub async fn replay(store: &dyn Store, id: &str) -> anyhow::Result<Entry> {
    let entry = get(store, id).await?;
    if entry.state != "dead" {
        bail!("intent {id} is {}: only dead intents can be replayed", entry.state);
    }
    let audit = crate::store::AuditEntry::now(
        &crate::store::local_actor(),
        "replay",
        Some(&crate::names::outbox_queue(&entry.intent.connector)),
        id,
    );
    store
        .dead_letter_settle(id, crate::store::Settle::Replay, Some(&audit))
        .await?
        .with_context(|| format!("intent {id} was replayed or removed meanwhile"))?;
    Ok(entry)
}

/// A delivered intent, as `onceq outbox delivered` prints it: only its key
/// is kept after delivery (to drop a duplicate emission), for the
/// retention window.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Delivered {
    pub connector: String,
    pub idempotency_key: String,
    /// The outbox message that carried it.
    pub id: String,
    /// Database time (µs) of the delivery's commit (the key's expiry less
    /// the configured `outbox.retention`).
    pub delivered_at: i64,
    /// When its key is forgotten (µs): an emission with the same key is
    /// dropped until then.
    pub key_kept_until: i64,
}

/// `onceq outbox delivered`: the intents delivered within the retention
/// window, newest first; of one connector, or all.
pub async fn delivered(
    store: &dyn Store,
    connector: Option<&str>,
    retention: std::time::Duration,
    limit: usize,
) -> anyhow::Result<Vec<Delivered>> {
    let queue = connector.map(queue_of);
    let sel = match &queue {
        Some(q) => store::Queues::Named(q),
        None => store::Queues::Prefix(QUEUE_PREFIX),
    };
    Ok(store
        .dedup_list(sel, retention, limit)
        .await?
        .into_iter()
        .filter_map(|k| {
            Some(Delivered {
                connector: connector_of(&k.queue)?.to_string(),
                idempotency_key: k.key,
                id: k.message_id,
                delivered_at: k.expires_at.saturating_sub(store::micros(retention)),
                key_kept_until: k.expires_at,
            })
        })
        .collect())
}

/// Outbox figures per connector, for `onceq stats`.
#[derive(Debug, Clone, Default, serde::Serialize, PartialEq, Eq)]
pub struct ConnectorStats {
    pub connector: String,
    /// Waiting for a first delivery or a retry.
    pub pending: u64,
    /// Being delivered now.
    pub in_flight: u64,
    /// Refused or out of attempts.
    pub dead: u64,
    /// Delivered, key still kept for the retention window.
    pub delivered_retained: u64,
    /// Delivered since the database was created.
    pub delivered: u64,
    /// When the last delivery committed (µs).
    pub last_delivered_at: Option<i64>,
}

/// Split store stats into message queues and outbox connectors.
pub fn split_stats(stats: &store::Stats) -> (Vec<store::QueueStats>, Vec<ConnectorStats>) {
    let mut queues = Vec::new();
    let mut connectors = Vec::new();
    for q in &stats.queues {
        match connector_of(&q.queue) {
            None => queues.push(q.clone()),
            Some(c) => {
                let undelivered = q.ready + q.delayed + q.leased + q.dead;
                connectors.push(ConnectorStats {
                    connector: c.to_string(),
                    pending: q.ready + q.delayed,
                    in_flight: q.leased,
                    dead: q.dead,
                    delivered_retained: q.dedup_keys.saturating_sub(undelivered),
                    delivered: q.processed,
                    last_delivered_at: q.last_processed_at,
                });
            }
        }
    }
    (queues, connectors)
}
