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

/// Bounds on what one handler call may make the host hold or store: its
/// effects, its reads, and how far ahead it may schedule. Each is a queue
/// setting (README, "Security model"); each refusal names the limit and
/// its setting.
#[derive(Debug, Clone, Copy)]
pub struct EffectLimits {
    /// Effects per call (`max_effects`).
    pub max_effects: usize,
    /// Bytes of all effects together, counted as stored: every name, value,
    /// attribute and metadata pair, with a fixed overhead per item so that
    /// empty items are not free (`max_effect_bytes`).
    pub max_bytes: usize,
    /// Longest delay of a follow-up or a handler's retry (`max_delay`).
    pub max_delay: Duration,
    /// Reads (gets and scans) per call (`max_reads`).
    pub max_reads: u64,
    /// Bytes of rows read per call, recorded for the commit-time check
    /// (`max_read_bytes`).
    pub max_read_bytes: usize,
}

/// Default `max_delay`: a year.
pub const MAX_DELAY: Duration = Duration::from_secs(365 * 24 * 3600);

impl Default for EffectLimits {
    fn default() -> Self {
        EffectLimits {
            max_effects: 1000,
            max_bytes: 1 << 20,
            max_delay: MAX_DELAY,
            max_reads: 10_000,
            max_read_bytes: 16 << 20,
        }
    }
}

/// Header names a handler's intent metadata may not set: onceq's own, the
/// operator's credentials, and those that frame or route the request. A
/// webhook receiver can trust these to come from the host.
pub const PROTECTED_HEADERS: &[&str] = &[
    "authorization",
    "proxy-authorization",
    "cookie",
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "upgrade",
    "expect",
    "forwarded",
    "via",
    "user-agent",
    "idempotency-key",
    // The trace context comes from the message's, set by the host.
    "traceparent",
    "tracestate",
    // CGI/WSGI receivers see every header as HTTP_<NAME> and take
    // HTTP_PROXY for the proxy to use ("httpoxy").
    "proxy",
];

/// A header name as receivers compare it: case-insensitively, and with
/// `_` and `-` alike (CGI, WSGI and many gateways turn both into `_`, so
/// `Idempotency_Key` reaches them as the `Idempotency-Key` header).
pub fn header_identity(name: &str) -> String {
    name.chars().map(|c| if c == '_' { '-' } else { c.to_ascii_lowercase() }).collect()
}

/// Is `name` a header only the host may set (see [`PROTECTED_HEADERS`];
/// also every `x-forwarded-*`, `onceq-*` and `proxy-*`), compared as
/// receivers compare names ([`header_identity`])?
pub fn is_protected_header(name: &str) -> bool {
    let id = header_identity(name);
    PROTECTED_HEADERS.contains(&id.as_str()) || id.starts_with("x-forwarded-") || id.starts_with("onceq-") || id.starts_with("proxy-")
}

/// Why the effects of a call were refused. Nothing was buffered.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EffectError {
    #[error("{count} effects returned, over the limit of {limit} (setting max_effects)")]
    TooMany { count: usize, limit: usize },
    #[error("effects total {bytes} bytes, over the limit of {limit} bytes (setting max_effect_bytes)")]
    TooLarge { bytes: usize, limit: usize },
    #[error("effect {index}: {problem}")]
    Bad { index: usize, problem: EffectProblem },
    /// Effects emitted as JSON text (the WIT's `encoded.emit`) that did
    /// not decode: `call` counts the call's emits from 1.
    #[error("encoded effects (emit {call} of the call): {problem}")]
    Encoded { call: usize, problem: String },
}

/// What is wrong with one effect.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EffectProblem {
    #[error("write to table {table} is not granted to queue {queue} (add it to the queue's `tables` in onceq.toml)")]
    TableNotGranted { table: String, queue: String },
    /// Unknown table or column, wrong type, missing key, NaN... (the
    /// schema's own words, naming table and column).
    #[error("{0}")]
    Schema(crate::schema::SchemaError),
    #[error("enqueue on queue {target} is not granted to queue {queue} (add it to the queue's `enqueue` in onceq.toml)")]
    QueueNotGranted { target: String, queue: String },
    #[error("{0} (emit an intent to reach a connector)")]
    QueueName(crate::names::NameError),
    #[error("{what} {} is reserved for onceq (provenance attributes are set by the host)", crate::names::quoted(.name, 40))]
    Reserved { what: &'static str, name: String },
    #[error("follow-up delay of {} is over the limit of {} (setting max_delay)", crate::names::duration(*.delay), crate::names::duration(*.limit))]
    Delay { delay: Duration, limit: Duration },
    /// A follow-up's dedup key breaks the one key rule of every key.
    #[error("{0}")]
    DedupKey(crate::names::KeyError),
    #[error("intent for connector {connector} is not granted to queue {queue} (add it to the queue's `connectors` in onceq.toml)")]
    ConnectorNotGranted { connector: String, queue: String },
    #[error("intent for connector {connector}: {reason}")]
    Key { connector: String, reason: crate::names::KeyError },
    #[error("metadata {} {reason}", crate::names::quoted(.name, 40))]
    Metadata { name: String, reason: &'static str },
}

/// A follow-up's or an intent's attributes: onceq's provenance attributes
/// (`onceq.*`) are the host's to set.
fn check_attributes(what: &'static str, pairs: &[(String, String)]) -> Result<(), EffectProblem> {
    match pairs.iter().find(|(k, _)| crate::names::is_reserved(k)) {
        Some((k, _)) => Err(EffectProblem::Reserved { what, name: k.clone() }),
        None => Ok(()),
    }
}

/// Intent metadata become HTTP headers on a webhook: names are tokens, not
/// reserved ones, values have no control characters.
fn check_metadata(pairs: &[(String, String)]) -> Result<(), EffectProblem> {
    check_attributes("metadata", pairs)?;
    for (k, v) in pairs {
        let bad = |reason| Err(EffectProblem::Metadata { name: k.clone(), reason });
        if k.is_empty() || !k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.') {
            return bad("must be letters, digits, '-', '_' or '.' (it may become an HTTP header)");
        }
        if is_protected_header(k) {
            return bad("names a header only the host sets (Authorization, Host, Content-Length, Idempotency-Key, ...)");
        }
        if v.chars().any(char::is_control) {
            return bad("has a control character in its value (it may become an HTTP header)");
        }
    }
    Ok(())
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
/// buffered; the error names the effect (by index) and the problem. Each
/// checked send (follow-up or intent) passes through `send` first (the
/// protocol marks those it hands over in memory there).
#[allow(clippy::too_many_arguments)]
pub fn check_and_buffer(
    msg: &Message,
    version: &str,
    effects: Vec<Effect>,
    grants: &Grants,
    limits: &EffectLimits,
    schema: &Schema,
    tx: &mut dyn Transaction,
    send: &mut dyn FnMut(&mut SendParams),
) -> Result<EffectCounts, EffectError> {
    if effects.len() > limits.max_effects {
        return Err(EffectError::TooMany {
            count: effects.len(),
            limit: limits.max_effects,
        });
    }
    let bytes: usize = effects.iter().map(Effect::size).sum();
    if bytes > limits.max_bytes {
        return Err(EffectError::TooLarge {
            bytes,
            limit: limits.max_bytes,
        });
    }
    let cx = Context {
        msg,
        version,
        grants,
        limits,
        schema,
    };
    let checked = effects
        .into_iter()
        .enumerate()
        .map(|(index, effect)| cx.check(effect, index).map_err(|problem| EffectError::Bad { index, problem }))
        .collect::<Result<Vec<_>, _>>()?;
    let mut counts = EffectCounts::default();
    for c in checked {
        match c {
            Checked::Write(w) => {
                counts.writes += 1;
                tx.row_write(w)
            }
            Checked::Enqueue(mut p) => {
                counts.enqueued += 1;
                send(&mut p);
                tx.message_enqueue(p)
            }
            Checked::Intent(mut p) => {
                counts.intents += 1;
                send(&mut p);
                tx.message_enqueue(p)
            }
        }
    }
    Ok(counts)
}

/// What one effect is checked against.
struct Context<'a> {
    msg: &'a Message,
    version: &'a str,
    grants: &'a Grants,
    limits: &'a EffectLimits,
    schema: &'a Schema,
}

impl Context<'_> {
    /// Check the `index`th effect; a message it sends gets the host's
    /// attributes (provenance, the trace) here, and only here.
    fn check(&self, effect: Effect, index: usize) -> Result<Checked, EffectProblem> {
        let traced = |mut p: SendParams| {
            crate::trace::inherit(&self.msg.attributes, &self.msg.id, index, &mut p.attributes);
            p
        };
        match effect {
            Effect::Write(w) => self.write(&w).map(Checked::Write),
            Effect::Enqueue(f) => self.enqueue(f).map(traced).map(Checked::Enqueue),
            Effect::Intent(i) => self.intent(i).map(traced).map(Checked::Intent),
        }
    }

    fn write(&self, w: &crate::value::RowWrite) -> Result<ValidWrite, EffectProblem> {
        if !self.grants.tables.contains(&w.table) {
            if !self.schema.tables.contains_key(&w.table) {
                return Err(EffectProblem::Schema(crate::schema::SchemaError::UnknownTable {
                    table: w.table.clone(),
                    hint: crate::names::did_you_mean(&w.table, self.grants.tables.iter().map(String::as_str)),
                }));
            }
            return Err(EffectProblem::TableNotGranted {
                table: w.table.clone(),
                queue: self.msg.queue.clone(),
            });
        }
        let table = self.schema.table(&w.table).map_err(EffectProblem::Schema)?;
        table.check_write(w).map_err(EffectProblem::Schema)
    }

    fn enqueue(&self, f: crate::value::FollowUp) -> Result<SendParams, EffectProblem> {
        if f.queue != self.msg.queue && !self.grants.queues.contains(&f.queue) {
            return Err(EffectProblem::QueueNotGranted {
                target: f.queue,
                queue: self.msg.queue.clone(),
            });
        }
        crate::names::check_queue(&f.queue).map_err(EffectProblem::QueueName)?;
        check_attributes("attribute", &f.attributes)?;
        let delay = Duration::from_millis(f.delay_ms.unwrap_or(0));
        if delay > self.limits.max_delay {
            return Err(EffectProblem::Delay {
                delay,
                limit: self.limits.max_delay,
            });
        }
        if let Some(key) = &f.dedup_key {
            crate::names::check_key("dedup key", key).map_err(EffectProblem::DedupKey)?;
        }
        // Provenance after the handler's own attributes (which cannot be
        // onceq.*: checked above), so a follow-up's producer can be found
        // from either end (the console's "produced" and "produced by").
        let mut attributes = f.attributes;
        attributes.push((crate::names::SOURCE_QUEUE_ATTRIBUTE.to_string(), self.msg.queue.clone()));
        attributes.push((crate::names::SOURCE_MESSAGE_ATTRIBUTE.to_string(), self.msg.id.clone()));
        Ok(SendParams {
            queue: f.queue,
            payload: f.payload,
            attributes,
            delay,
            dedup_key: f.dedup_key,
            dedup_window: None,
            handoff: None,
        })
    }

    fn intent(&self, it: crate::value::Intent) -> Result<SendParams, EffectProblem> {
        if !self.grants.connectors.contains(&it.connector) {
            return Err(EffectProblem::ConnectorNotGranted {
                connector: it.connector,
                queue: self.msg.queue.clone(),
            });
        }
        crate::names::check_key("idempotency key", &it.idempotency_key).map_err(|reason| EffectProblem::Key {
            connector: it.connector.clone(),
            reason,
        })?;
        check_metadata(&it.metadata)?;
        let mut m = intent_message(self.msg, it);
        m.attributes
            .insert(3, (crate::names::VERSION_ATTRIBUTE.to_string(), self.version.to_string()));
        Ok(m)
    }
}

/// How long an undelivered intent's key is held: until it is delivered
/// (then the retention window applies), for all practical purposes.
pub const HOLD_UNTIL_DELIVERED: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The outbox message for an intent emitted while handling `msg`: on the
/// connector's outbox queue, its key as the dedup key (held until
/// delivered), the provenance as `onceq.*` attributes.
pub fn intent_message(msg: &Message, intent: crate::value::Intent) -> SendParams {
    let mut attributes = Vec::with_capacity(intent.metadata.len() + 3);
    attributes.push((crate::names::KEY_ATTRIBUTE.to_string(), intent.idempotency_key.clone()));
    attributes.push((crate::names::SOURCE_QUEUE_ATTRIBUTE.to_string(), msg.queue.clone()));
    attributes.push((crate::names::SOURCE_MESSAGE_ATTRIBUTE.to_string(), msg.id.clone()));
    attributes.extend(intent.metadata);
    SendParams {
        queue: crate::names::outbox_queue(&intent.connector),
        payload: intent.payload,
        attributes,
        delay: Duration::ZERO,
        dedup_key: Some(intent.idempotency_key),
        dedup_window: Some(HOLD_UNTIL_DELIVERED),
        handoff: None,
    }
}
