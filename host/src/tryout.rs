//! One message through a handler, outside the protocol: reads served by a
//! transaction, effects checked as the host checks them (grants, schema,
//! limits), then applied in a write transaction that is rolled back
//! ([`Transaction::rehearse`]), so the database's own constraints,
//! triggers and defaults judge them as a commit would. Nothing is kept.
//! `onceq try` runs it against the database; `onceq test` and the handler
//! test kit (`onceq-testkit`) against fixture rows, rehearsed on a scratch
//! database made from the same schema files. Same code, same verdicts.

use crate::protocol::{self, EffectLimits, Grants, HandleOutput, Handler, HandlerFailure, ReadScope};
use crate::schema::Schema;
use crate::store::Transaction;
use crate::value::{Effect, Message, RowWrite, Value};
use std::sync::Arc;

/// What one message did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TryReport {
    pub message: Message,
    pub version: String,
    /// "ok", "retry", "reject", "failed", "invalid-effects" or "deferred"
    /// (the host's trouble, not the message's: a real run tries again
    /// without counting a failure).
    pub outcome: String,
    pub reason: Option<String>,
    /// The handler's effects ("ok"; also shown for "invalid-effects").
    pub effects: Vec<Effect>,
    /// Reads the handler made.
    pub reads: u64,
    /// Instructions the call ran, instantiation included (wasmtime fuel;
    /// `None` when the runtime does not count them).
    pub instructions: Option<u64>,
    /// For "retry": the delay the handler asked for.
    pub retry_after_ms: Option<u64>,
    /// The effects in words, one line each, timestamps as RFC 3339 times.
    pub shown: Vec<String>,
    /// The effects were applied in a rolled-back transaction (false: the
    /// store applies writes only as it commits them, as Spanner does, or
    /// the handler gave none to apply).
    pub rehearsed: bool,
}

impl TryReport {
    pub fn is_ok(&self) -> bool {
        self.outcome == "ok"
    }
}

/// Run `message` through `handler`, reading through `tx` (then rolled
/// back), and check the effects against `grants`, `schema` and `limits`.
pub async fn run(
    handler: &dyn Handler,
    message: Message,
    tx: Box<dyn Transaction>,
    schema: Arc<Schema>,
    grants: &Grants,
    limits: &EffectLimits,
) -> TryReport {
    let scope = ReadScope::new(tx, schema.clone(), Arc::new(grants.tables.clone())).with_limits(limits);
    let HandleOutput { scope, result } = handler.handle(&message, scope).await;
    let reads = scope.reads;
    let instructions = scope.instructions;
    // As in a real run: a store error during a read decides the attempt
    // (the protocol re-runs or fails it), then a refused read, then a
    // refused emit, then the handler's own result; the reason is worded as
    // a real run words it.
    let violation = match &scope.store_error {
        Some(e) => Some(HandlerFailure::from_store(e.clone())),
        None => scope.refusal(),
    };
    let mut tx = scope.into_transaction();
    let report = |outcome: &str, reason: Option<String>, effects: Vec<Effect>, retry_after_ms: Option<u64>| TryReport {
        rehearsed: false,
        message: message.clone(),
        version: handler.version().to_string(),
        outcome: outcome.to_string(),
        reason,
        reads,
        instructions,
        retry_after_ms,
        shown: effects.iter().map(show_effect).collect(),
        effects,
    };
    let out = match (violation, result) {
        (Some(f), _) if !f.is_own() => report("deferred", Some(f.recorded_reason()), vec![], None),
        (Some(f), _) => report("failed", Some(f.to_string()), vec![], None),
        (None, Ok(effects)) => {
            match protocol::effects::check_and_buffer(
                &message,
                handler.version(),
                effects.clone(),
                grants,
                limits,
                &schema,
                &mut *tx,
                &mut |_| {},
            ) {
                // As the commit would: the database's verdict, worded and
                // classed as a real run records it.
                Ok(_) => {
                    return match tx.rehearse().await {
                        None => report("ok", None, effects, None),
                        Some(Ok(())) => TryReport {
                            rehearsed: true,
                            ..report("ok", None, effects, None)
                        },
                        Some(Err(e)) => {
                            let f = HandlerFailure::from_store(e);
                            let outcome = if f.is_own() { "failed" } else { "deferred" };
                            TryReport {
                                rehearsed: true,
                                ..report(outcome, Some(f.recorded_reason()), effects, None)
                            }
                        }
                    };
                }
                Err(e) => report("invalid-effects", Some(HandlerFailure::Effect(e).to_string()), effects, None),
            }
        }
        (None, Err(HandlerFailure::Retry { reason, delay })) => report("retry", Some(reason), vec![], delay.map(|d| d.as_millis() as u64)),
        (None, Err(HandlerFailure::Reject(r))) => report("reject", Some(r), vec![], None),
        (None, Err(f @ HandlerFailure::Effect(_))) => report("invalid-effects", Some(f.to_string()), vec![], None),
        (None, Err(f)) if !f.is_own() => report("deferred", Some(f.recorded_reason()), vec![], None),
        (None, Err(f)) => report("failed", Some(f.to_string()), vec![], None),
    };
    tx.rollback().await;
    out
}

/// The operation of a write, as a test file names it.
pub fn op_name(w: &RowWrite) -> &'static str {
    match w.op {
        crate::value::WriteOp::Insert => "insert",
        crate::value::WriteOp::Update => "update",
        crate::value::WriteOp::Upsert => "upsert",
        crate::value::WriteOp::Delete => "delete",
    }
}

fn show_value(v: &Value) -> String {
    match v {
        Value::Timestamp(us) => crate::names::time(*us),
        Value::Json(j) => j.clone(),
        other => other.to_string(),
    }
}

fn show_payload(p: &[u8]) -> String {
    match std::str::from_utf8(p) {
        Ok(t) => crate::names::truncated(&crate::names::printable(t), 200),
        Err(_) => format!("<{} binary bytes>", p.len()),
    }
}

/// One line per effect, for a failed case.
pub fn show_effect(e: &Effect) -> String {
    match e {
        Effect::Write(w) => format!(
            "{} {} {{{}}}",
            op_name(w),
            w.table,
            w.columns
                .iter()
                .map(|(k, v)| format!("{k}: {}", show_value(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Effect::Enqueue(f) => {
            let delay = f.delay_ms.map(|d| format!(" after {d} ms")).unwrap_or_default();
            format!("follow-up on {}{delay}: {}", f.queue, show_payload(&f.payload))
        }
        Effect::Intent(i) => format!(
            "intent for {} keyed {:?}: {}",
            i.connector,
            i.idempotency_key,
            show_payload(&i.payload)
        ),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use crate::protocol::testing;
    use crate::protocol::{NativeHandler, Outcome};
    use crate::store::faulty::{FaultPlan, FaultyStore};
    use crate::store::{Store, StoreError};
    use crate::value::Value;
    use std::time::Duration;

    /// Reads the row keyed by the message id and swallows any error, as a
    /// careless handler would: the store error still decides the attempt.
    fn careless_reader() -> Arc<dyn Handler> {
        Arc::new(NativeHandler::new("careless-reader", |m, mut scope| async move {
            let _ = scope.get("t", &[Value::String(m.id.clone())]).await;
            HandleOutput { scope, result: Ok(vec![]) }
        }))
    }

    /// `onceq try` and the test kit give the verdict a real run gives, with
    /// the same reason, when the store fails a read: permanently (failed at
    /// once) and transiently (a real run re-runs, then fails the same way).
    #[tokio::test(start_paused = true)]
    async fn try_gives_the_verdict_of_a_real_run_when_a_read_fails() {
        for error in [
            StoreError::Permanent("disk on fire".into()),
            StoreError::Unavailable("no answer".into()),
        ] {
            let (_dir, base) = testing::store();
            let plan = FaultPlan {
                read_error: Some(error.clone()),
                ..FaultPlan::default()
            };
            let (faulty, _) = FaultyStore::new(base.clone(), plan);
            let store: Arc<dyn Store> = Arc::new(faulty);
            let lease = Duration::from_secs(30);
            let handler = careless_reader();
            let r = testing::runner(&store, handler.clone(), lease);
            let batch = testing::leased(&store, 1, lease).await;

            // The store's trouble, not the message's: deferred, uncounted.
            let real = match r.process(&batch[0]).await {
                Outcome::Deferred(reason) => reason,
                other => panic!("{error}: a real run defers it, got {other:?}"),
            };
            let tx = store.transaction_begin().await.unwrap();
            let tried = run(
                &*handler,
                batch[0].message.clone(),
                tx,
                store.schema(),
                &r.spec.grants,
                &r.spec.limits,
            )
            .await;
            assert_eq!(tried.outcome, "deferred", "{error}");
            assert_eq!(tried.reason.as_deref(), Some(real.as_str()), "{error}: same reason as the real run");
            assert!(real.contains(&error.to_string()), "{real}");
        }
    }
}
