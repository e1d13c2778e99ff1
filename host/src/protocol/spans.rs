//! What the protocol tells [`crate::telemetry`]: a `process` span per run
//! of a message's handler, its handler call, its settle, the follow-ups
//! and intents of the run that committed, and how the message ended, as
//! span status and events with the reason.

use super::{AttemptError, HandleOutput, Handler, Outcome, QueueRunner};
use crate::store::{LeasedMessage, StoreError};
use crate::telemetry::Active;
use crate::trace::TraceParent;
use crate::value::{Effect, Message};
use opentelemetry::KeyValue;

/// A follow-up or intent a run emitted, and its creation context.
#[derive(Debug, Clone)]
pub(crate) struct Produced {
    intent: bool,
    destination: String,
    created: TraceParent,
}

impl Produced {
    /// The follow-ups and intents of `effects` (a run of `message`), with
    /// the contexts the effect check gives them ([`crate::trace::inherit`]).
    pub(crate) fn of(message: &Message, effects: &[Effect]) -> Vec<Produced> {
        let Some(parent) = crate::trace::of(&message.attributes) else {
            return Vec::new();
        };
        effects
            .iter()
            .enumerate()
            .filter_map(|(index, e)| {
                let (intent, destination) = match e {
                    Effect::Enqueue(f) => (false, f.queue.clone()),
                    Effect::Intent(i) => (true, i.connector.clone()),
                    Effect::Write(_) => return None,
                };
                Some(Produced {
                    intent,
                    destination,
                    created: parent.derived(&message.id, index),
                })
            })
            .collect()
    }
}

impl QueueRunner {
    /// The `process` span of a new run of `lm`.
    pub(super) fn process_span(&self, lm: &LeasedMessage, handler: &dyn Handler) -> Active {
        if !self.telemetry().is_on() {
            return Active::default();
        }
        let m = &lm.message;
        let state = m
            .attributes
            .iter()
            .find(|(k, _)| k == crate::trace::TRACESTATE_ATTRIBUTE)
            .map(|(_, v)| v.as_str());
        let run = self.telemetry().process(
            &m.queue,
            &m.id,
            m.attempt,
            handler.version(),
            crate::trace::of(&m.attributes).map(|t| (t, state)),
        );
        if let Some(t) = run.traceparent() {
            tracing::Span::current().record("span_id", tracing::field::display(t.span_id_hex()));
        }
        run
    }
}

/// The protocol's events on its spans.
pub(super) trait RunSpan {
    fn produced_all(&self, produced: &[Produced]);
    fn run_failed(&self, err: &AttemptError);
    fn outcome(&self, outcome: &Outcome);
    fn handled(&self, out: &HandleOutput);
    fn settled(&self, committed: &Result<(), StoreError>);
}

impl RunSpan for Active {
    /// The producer spans of the run's follow-ups and intents.
    fn produced_all(&self, produced: &[Produced]) {
        for p in produced {
            self.produced(p.intent, &p.destination, &p.created);
        }
    }

    /// Why this run did not commit.
    fn run_failed(&self, err: &AttemptError) {
        if !self.is_recording() {
            return;
        }
        let (name, reason) = match err {
            AttemptError::Store(e) if e.is_unknown_outcome() => ("commit outcome unknown", e.to_string()),
            AttemptError::Store(StoreError::Aborted(e)) => ("aborted", e.to_string()),
            AttemptError::Store(e @ StoreError::LeaseLost { .. }) => ("ack refused", e.to_string()),
            AttemptError::Store(e) => ("store error", e.to_string()),
            AttemptError::Handler(f) => ("handler failed", f.to_string()),
        };
        self.event(name, vec![KeyValue::new("onceq.reason", reason)]);
    }

    /// How the message ended: the span's status, and an event naming it.
    fn outcome(&self, outcome: &Outcome) {
        if !self.is_recording() {
            return;
        }
        let (name, reason) = match outcome {
            Outcome::Acked => ("acked", None),
            Outcome::AlreadyCommitted => (
                "already committed",
                Some("the ack was refused after an unknown commit outcome: the earlier commit landed".to_string()),
            ),
            Outcome::RetryLater(r) => ("retry", Some(r.clone())),
            Outcome::Deferred(r) => ("deferred", Some(r.clone())),
            Outcome::DeadLettered(r) => ("dead-lettered", Some(r.clone())),
            Outcome::LeaseLost => ("lease lost", Some("the lease expired or was taken; rolled back".to_string())),
            Outcome::Released => ("released", None),
        };
        self.attribute(KeyValue::new("onceq.outcome", name));
        match (outcome, reason) {
            (Outcome::RetryLater(_) | Outcome::DeadLettered(_) | Outcome::LeaseLost | Outcome::Deferred(_), Some(r)) => {
                self.fail(&r);
                self.event(name, vec![KeyValue::new("onceq.reason", r)]);
            }
            (_, Some(r)) => self.event(name, vec![KeyValue::new("onceq.reason", r)]),
            (_, None) => {}
        }
    }

    /// The handler call's logs (its events) and its result.
    fn handled(&self, out: &HandleOutput) {
        if !self.is_recording() {
            return;
        }
        for (level, line) in out.scope.logs.iter().flatten() {
            self.event(
                "log",
                vec![KeyValue::new("log.severity", *level), KeyValue::new("log.message", line.clone())],
            );
        }
        self.attribute(KeyValue::new("onceq.reads", out.scope.reads as i64));
        if let Err(f) = &out.result {
            self.fail(&f.to_string());
        }
        self.end();
    }

    fn settled(&self, committed: &Result<(), StoreError>) {
        if let Err(e) = committed {
            self.fail(&e.to_string());
        }
        self.end();
    }
}
