//! Checking a handler's effects before they touch the transaction: limits,
//! grants (which tables, queues and connectors the queue's handler may
//! use) and the schema. All effects are checked before any is buffered, so a
//! bad one leaves the transaction untouched.
//!
//! An intent becomes a message on its connector's outbox queue
//! ([`crate::outbox`]), enqueued in the same transaction as everything
//! else, its idempotency key as the dedup key.

use crate::schema::{Schema, ValidWrite};
use crate::store::{SendParams, Transaction};
use crate::value::{Effect, Message};
use std::collections::BTreeSet;
use std::time::Duration;

/// What a queue's handler may touch.
#[derive(Debug, Clone, Default)]
pub struct Grants {
    /// Business tables it may read and write.
    pub tables: BTreeSet<String>,
    /// Queues it may enqueue follow-ups on (its own queue is always allowed).
    pub queues: BTreeSet<String>,
    /// Outbox connectors it may emit intents for.
    pub connectors: BTreeSet<String>,
}

/// Bounds on what one handler call may return.
#[derive(Debug, Clone, Copy)]
pub struct EffectLimits {
    pub max_effects: usize,
    pub max_bytes: usize,
}

impl Default for EffectLimits {
    fn default() -> Self {
        EffectLimits {
            max_effects: 1000,
            max_bytes: 1 << 20,
        }
    }
}

/// Counts of what was buffered, for metrics.
#[derive(Debug, Clone, Copy, Default)]
pub struct EffectCounts {
    pub writes: u64,
    pub enqueued: u64,
    pub intents: u64,
}

enum Checked {
    Write(ValidWrite),
    Enqueue(SendParams),
    Intent(SendParams),
}

/// Check every effect, then buffer them all into `tx`. On error nothing is
/// buffered and the reason names the effect (by index) and the problem.
pub fn check_and_buffer(
    msg: &Message,
    version: &str,
    effects: Vec<Effect>,
    grants: &Grants,
    limits: &EffectLimits,
    schema: &Schema,
    tx: &mut dyn Transaction,
) -> Result<EffectCounts, String> {
    if effects.len() > limits.max_effects {
        return Err(format!(
            "{} effects returned, over the limit of {}",
            effects.len(),
            limits.max_effects
        ));
    }
    let bytes: usize = effects.iter().map(Effect::size).sum();
    if bytes > limits.max_bytes {
        return Err(format!("effects total {bytes} bytes, over the limit of {} bytes", limits.max_bytes));
    }
    let mut checked = Vec::with_capacity(effects.len());
    for (i, effect) in effects.into_iter().enumerate() {
        let c = match effect {
            Effect::Write(w) => {
                if !grants.tables.contains(&w.table) {
                    return Err(format!(
                        "effect {i}: write to table {} is not granted to queue {}",
                        w.table, msg.queue
                    ));
                }
                let table = schema.table(&w.table).map_err(|e| format!("effect {i}: {e}"))?;
                Checked::Write(table.check_write(&w).map_err(|e| format!("effect {i}: {e}"))?)
            }
            Effect::Enqueue(f) => {
                if f.queue != msg.queue && !grants.queues.contains(&f.queue) {
                    return Err(format!(
                        "effect {i}: enqueue on queue {} is not granted to queue {}",
                        f.queue, msg.queue
                    ));
                }
                if f.queue.is_empty() {
                    return Err(format!("effect {i}: enqueue needs a queue name"));
                }
                if f.queue.starts_with(crate::outbox::RESERVED_PREFIX) {
                    return Err(format!(
                        "effect {i}: queue {} is reserved for onceq (emit an intent to reach a connector)",
                        f.queue
                    ));
                }
                Checked::Enqueue(SendParams {
                    queue: f.queue,
                    payload: f.payload,
                    attributes: f.attributes,
                    delay: Duration::from_millis(f.delay_ms.unwrap_or(0)),
                    dedup_key: f.dedup_key,
                    dedup_window: None,
                })
            }
            Effect::Intent(it) => {
                if !grants.connectors.contains(&it.connector) {
                    return Err(format!(
                        "effect {i}: intent for connector {} is not granted to queue {}",
                        it.connector, msg.queue
                    ));
                }
                if it.idempotency_key.is_empty() {
                    return Err(format!(
                        "effect {i}: intent for connector {} has an empty idempotency key",
                        it.connector
                    ));
                }
                let mut m = crate::outbox::intent_message(msg, it);
                m.attributes
                    .insert(3, (crate::outbox::VERSION_ATTRIBUTE.to_string(), version.to_string()));
                Checked::Intent(m)
            }
        };
        checked.push(c);
    }
    let mut counts = EffectCounts::default();
    for c in checked {
        match c {
            Checked::Write(w) => {
                counts.writes += 1;
                tx.row_write(w)
            }
            Checked::Enqueue(p) => {
                counts.enqueued += 1;
                tx.message_enqueue(p)
            }
            Checked::Intent(p) => {
                counts.intents += 1;
                tx.message_enqueue(p)
            }
        }
    }
    Ok(counts)
}
