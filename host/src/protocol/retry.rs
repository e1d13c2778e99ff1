//! The re-run and backoff rules, in one place, apart from the worker loop.
//!
//! Two kinds of "again" exist, and they must not be confused:
//!
//! - a **re-run** runs the same attempt's transaction again (same lease,
//!   same attempt number): after an abort or an unavailable store (nothing
//!   landed), or an unknown commit outcome (the ack decides). Re-runs are
//!   bounded by `max_reruns` and paused briefly ([`rerun_pause`]), except
//!   after an unknown outcome, which re-runs at once: the first commit may
//!   have landed, and the sooner the ack finds out, the sooner the lease
//!   is free.
//! - a **retry** is a new attempt, later: the attempt failed (the handler
//!   asked, trapped, returned a bad effect, or the store refused a write).
//!   The message becomes visible again after [`Policy::backoff`] (or the
//!   handler's own delay, capped by `max_delay`), until `max_attempts`,
//!   then it is dead-lettered. Failures a re-run cannot change (a reject,
//!   an invalid effect, a read of a table that is not granted or does not
//!   exist, a malformed key) are dead-lettered at once.

use super::{HandlerFailure, Policy};
use crate::store::StoreError;
use rand::RngExt;
use std::time::Duration;

/// What to do after one run of an attempt's transaction failed.
#[derive(Debug, Clone, PartialEq)]
pub enum Rerun {
    /// Run the transaction again at once (unknown outcome).
    Now,
    /// Run it again after this pause (aborted, unavailable).
    After(Duration),
    /// Stop re-running: the attempt ends with this error.
    Stop,
}

impl Policy {
    /// The decision for `error`, after `reruns` re-runs of this attempt.
    pub fn rerun(&self, error: &StoreError, reruns: u32) -> Rerun {
        if reruns >= self.max_reruns {
            return Rerun::Stop;
        }
        if error.is_unknown_outcome() {
            Rerun::Now
        } else if error.is_retryable() {
            Rerun::After(rerun_pause(reruns + 1))
        } else {
            Rerun::Stop
        }
    }

    /// The delay before attempt `attempt + 1`, after attempt `attempt`
    /// failed: `backoff_initial` doubled per attempt, capped at
    /// `backoff_max`, ±20 % jitter (so failing messages do not come back in
    /// lockstep).
    pub fn backoff(&self, attempt: u32) -> Duration {
        let exp = self.backoff_initial.saturating_mul(1u32 << attempt.saturating_sub(1).min(20));
        jittered(exp.min(self.backoff_max))
    }

    /// Retry later (with this delay) or dead-letter now, after `failure` on
    /// attempt `attempt`. A handler's own delay is capped at `max_delay`.
    pub fn after_failure(&self, failure: &HandlerFailure, attempt: u32, max_delay: Duration) -> Next {
        match failure {
            // Deterministic: the same message gives the same effects and
            // the same reads, so another attempt would fail the same way.
            HandlerFailure::Reject(_) | HandlerFailure::Effect(_) => Next::DeadLetter,
            HandlerFailure::Read(e) if e.is_deterministic() => Next::DeadLetter,
            _ if attempt >= self.max_attempts => Next::DeadLetter,
            HandlerFailure::Retry { delay: Some(d), .. } => Next::RetryAfter((*d).min(max_delay)),
            HandlerFailure::Retry { delay: None, .. } | HandlerFailure::Failed(_) | HandlerFailure::Read(_) | HandlerFailure::Store(_) => {
                Next::RetryAfter(self.backoff(attempt))
            }
        }
    }
}

/// Where a failed attempt goes.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    RetryAfter(Duration),
    DeadLetter,
}

/// The pause before re-run `n` (1, 2, ...) of a transaction that was
/// aborted or found the store unavailable: 2, 4, ... 64 ms, jittered.
pub fn rerun_pause(n: u32) -> Duration {
    jittered(Duration::from_millis(1 << n.min(6)))
}

/// `d` ± 20 %.
pub fn jittered(d: Duration) -> Duration {
    let f: f64 = rand::rng().random_range(0.8..1.2);
    d.mul_f64(f)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]
    use super::*;

    fn policy() -> Policy {
        Policy {
            backoff_initial: Duration::from_secs(1),
            backoff_max: Duration::from_secs(300),
            max_attempts: 5,
            max_reruns: 3,
            ..Policy::default()
        }
    }

    #[test]
    fn each_store_error_class_gets_its_rerun_decision() {
        let p = policy();
        assert_eq!(p.rerun(&StoreError::UnknownOutcome("cut".into()), 0), Rerun::Now);
        for e in [StoreError::Aborted("x".into()), StoreError::Unavailable("x".into())] {
            match p.rerun(&e, 0) {
                Rerun::After(d) => assert!(d >= Duration::from_micros(1600) && d <= Duration::from_micros(2400), "{d:?}"),
                other => panic!("{e}: {other:?}"),
            }
        }
        for e in [
            StoreError::LeaseLost { message_id: "m".into() },
            StoreError::WriteRefused("dup".into()),
            StoreError::Permanent("bug".into()),
        ] {
            assert_eq!(p.rerun(&e, 0), Rerun::Stop, "{e}");
        }
        // Bounded: the fourth re-run is refused whatever the class.
        assert_eq!(p.rerun(&StoreError::UnknownOutcome("cut".into()), 3), Rerun::Stop);
        assert_eq!(p.rerun(&StoreError::Aborted("x".into()), 3), Rerun::Stop);
    }

    #[test]
    fn backoff_doubles_per_attempt_with_jitter_and_is_capped() {
        let p = policy();
        for attempt in 1..=12u32 {
            let base = Duration::from_secs(1u64 << (attempt - 1)).min(Duration::from_secs(300));
            for _ in 0..200 {
                let d = p.backoff(attempt);
                assert!(
                    d >= base.mul_f64(0.8) && d <= base.mul_f64(1.2),
                    "attempt {attempt}: {d:?} vs {base:?}"
                );
            }
        }
        // Huge attempt numbers neither overflow nor pass the cap.
        assert!(p.backoff(u32::MAX) <= Duration::from_secs(360));
        // Jitter spreads: 200 draws are not all the same.
        let draws: std::collections::BTreeSet<u128> = (0..200).map(|_| p.backoff(3).as_micros()).collect();
        assert!(draws.len() > 50, "{} distinct", draws.len());
    }

    #[test]
    fn failures_retry_until_max_attempts_and_rejects_dead_letter_at_once() {
        let p = policy();
        let year = Duration::from_secs(365 * 24 * 3600);
        let failed = HandlerFailure::Failed("trap".into());
        assert!(matches!(p.after_failure(&failed, 1, year), Next::RetryAfter(_)));
        assert_eq!(p.after_failure(&failed, 5, year), Next::DeadLetter);
        assert_eq!(p.after_failure(&HandlerFailure::Reject("no".into()), 1, year), Next::DeadLetter);
        // Deterministic failures: dead-lettered at once; a read over the
        // limit depends on the data, so it is retried.
        let bad = crate::protocol::effects::EffectError::TooMany { count: 9, limit: 1 };
        assert_eq!(p.after_failure(&HandlerFailure::Effect(bad), 1, year), Next::DeadLetter);
        let typo = crate::protocol::ReadError::UnknownTable {
            table: "user".into(),
            message: "unknown table user".into(),
        };
        assert_eq!(p.after_failure(&HandlerFailure::Read(typo), 1, year), Next::DeadLetter);
        let many = crate::protocol::ReadError::TooManyReads { limit: 10 };
        assert!(matches!(p.after_failure(&HandlerFailure::Read(many), 1, year), Next::RetryAfter(_)));
        let asked = HandlerFailure::Retry {
            reason: "later".into(),
            delay: Some(Duration::from_secs(42)),
        };
        assert_eq!(p.after_failure(&asked, 1, year), Next::RetryAfter(Duration::from_secs(42)));
        let forever = HandlerFailure::Retry {
            reason: "never".into(),
            delay: Some(Duration::MAX),
        };
        assert_eq!(p.after_failure(&forever, 1, year), Next::RetryAfter(year), "capped at max_delay");
        assert_eq!(p.after_failure(&forever, 5, year), Next::DeadLetter, "max_attempts still applies");
    }
}
