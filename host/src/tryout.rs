//! One message through a handler, outside the protocol: reads served by a
//! transaction, effects checked as the host checks them (grants, schema,
//! limits), nothing committed. `onceq try` runs it against the database
//! (and rolls back); the handler test kit (`onceq-testkit`) against fixture
//! rows in memory. Same code, same verdicts.

use crate::protocol::{self, EffectLimits, Grants, HandleOutput, Handler, HandlerFailure, ReadScope};
use crate::schema::Schema;
use crate::store::Transaction;
use crate::value::{Effect, Message};
use std::sync::Arc;

/// What one message did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TryReport {
    pub message: Message,
    pub version: String,
    /// "ok", "retry", "reject", "failed" or "invalid-effects".
    pub outcome: String,
    pub reason: Option<String>,
    /// The handler's effects ("ok"; also shown for "invalid-effects").
    pub effects: Vec<Effect>,
    /// Reads the handler made.
    pub reads: u64,
    /// For "retry": the delay the handler asked for.
    pub retry_after_ms: Option<u64>,
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
    // As in a real run: a store error during a read decides the attempt
    // (the protocol re-runs or fails it), then a refused read, then the
    // handler's own result.
    let violation = match &scope.store_error {
        Some(e) => Some(format!("store error: {e}")),
        None => scope.violation.clone(),
    };
    let mut tx = scope.into_transaction();
    let report = |outcome: &str, reason: Option<String>, effects: Vec<Effect>, retry_after_ms: Option<u64>| TryReport {
        message: message.clone(),
        version: handler.version().to_string(),
        outcome: outcome.to_string(),
        reason,
        effects,
        reads,
        retry_after_ms,
    };
    let out = match (violation, result) {
        (Some(v), _) => report("failed", Some(v), vec![], None),
        (None, Ok(effects)) => {
            match protocol::effects::check_and_buffer(&message, handler.version(), effects.clone(), grants, limits, &schema, &mut *tx) {
                Ok(_) => report("ok", None, effects, None),
                Err(e) => report("invalid-effects", Some(e.to_string()), effects, None),
            }
        }
        (None, Err(HandlerFailure::Retry { reason, delay })) => report("retry", Some(reason), vec![], delay.map(|d| d.as_millis() as u64)),
        (None, Err(HandlerFailure::Reject(r))) => report("reject", Some(r), vec![], None),
        (None, Err(HandlerFailure::Failed(r))) => report("failed", Some(r), vec![], None),
    };
    tx.rollback().await;
    out
}
