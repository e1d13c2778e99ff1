//! The re-run and backoff rules, in one place, apart from the worker loop.
//!
//! Three kinds of "again" exist, and they must not be confused:
//!
//! - a **re-run** runs the same attempt's transaction again (same lease,
//!   same delivery): after an abort or an unavailable store (nothing
//!   landed), or an unknown commit outcome (the ack decides). Re-runs are
//!   bounded by `max_reruns` and paused briefly ([`rerun_pause`]), except
//!   after an unknown outcome, which re-runs at once: the first commit may
//!   have landed, and the sooner the ack finds out, the sooner the lease
//!   is free.
//! - a **retry** is a new delivery, later, after a *failure* of the
//!   message's own: the handler asked, crashed, ran out of time or memory,
//!   returned a bad effect, or the store refused its writes. Each counts
//!   toward `max_attempts`; the message is visible again after
//!   [`Policy::backoff`] (or the handler's own delay, capped by
//!   `max_delay`), and dead-lettered at the last. Failures a re-run cannot
//!   change (a reject, an invalid effect, a read of a table that is not
//!   granted or does not exist, a malformed key, an instruction budget
//!   spent) are dead-lettered at once.
//! - a **deferral** is a new delivery, later, after the host's own trouble
//!   ([`HostTrouble`](super::handler::HostTrouble): the store failed or
//!   stalled, contention outlasted the re-runs, resources ran out). It is
//!   not counted as a failure; `max_deliveries` bounds deliveries of every
//!   kind, so a message that takes its host down every time is still
//!   parked in the end.

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

    /// The delay before the next delivery after failure number `failures`
    /// (1, 2, ...): `backoff_initial` doubled per failure, capped at
    /// `backoff_max`, ±20 % jitter (so failing messages do not come back in
    /// lockstep).
    pub fn backoff(&self, failures: u32) -> Duration {
        let exp = self.backoff_initial.saturating_mul(1u32 << failures.saturating_sub(1).min(20));
        jittered(exp.min(self.backoff_max))
    }

    /// After `failure` on a delivery of a message that had failed
    /// `failures` times before and has been delivered `deliveries` times
    /// (this one included): retry later (a failure counted), defer (not
    /// counted), or dead-letter now. A handler's own delay is capped at
    /// `max_delay`.
    pub fn after_failure(&self, failure: &HandlerFailure, failures: u32, deliveries: u32, max_delay: Duration) -> Next {
        if !failure.is_own() {
            // Deliveries that ended without a failure of the message's own
            // set the pause: a store that stays down is asked less often.
            return Next::Defer(self.backoff(deliveries.saturating_sub(failures).max(1)));
        }
        let failed = failures.saturating_add(1);
        match failure {
            // Deterministic: the same message gives the same effects and
            // the same reads, so another attempt would fail the same way.
            HandlerFailure::Reject(_) | HandlerFailure::Effect(_) | HandlerFailure::Instructions(_) => Next::DeadLetter,
            HandlerFailure::Undelivered { retry: false, .. } => Next::DeadLetter,
            HandlerFailure::Read(e) if e.is_deterministic() => Next::DeadLetter,
            f if f.is_crash() && !self.retry_crashes => Next::DeadLetter,
            _ if failed >= self.max_attempts => Next::DeadLetter,
            HandlerFailure::Retry { delay: Some(d), .. } | HandlerFailure::Undelivered { after: Some(d), .. } => {
                Next::RetryAfter((*d).min(max_delay))
            }
            _ => Next::RetryAfter(self.backoff(failed)),
        }
    }
}

/// Where a failed attempt goes.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// A failure of the message's own: counted, visible again after this.
    RetryAfter(Duration),
    /// A failure of the message's own, its last (or one no attempt can
    /// change): dead-lettered.
    DeadLetter,
    /// The host's trouble: not counted, visible again after this.
    Defer(Duration),
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
        let failed = HandlerFailure::Deadline(Duration::from_secs(1));
        assert!(matches!(p.after_failure(&failed, 0, 1, year), Next::RetryAfter(_)));
        assert!(matches!(p.after_failure(&failed, 3, 9, year), Next::RetryAfter(_)));
        assert_eq!(p.after_failure(&failed, 4, 5, year), Next::DeadLetter, "the fifth failure");
        assert_eq!(p.after_failure(&HandlerFailure::Reject("no".into()), 0, 1, year), Next::DeadLetter);
        // Deterministic failures: dead-lettered at once; a read over the
        // limit depends on the data, so it is retried.
        let bad = crate::protocol::effects::EffectError::TooMany { count: 9, limit: 1 };
        assert_eq!(p.after_failure(&HandlerFailure::Effect(bad), 0, 1, year), Next::DeadLetter);
        let typo = crate::protocol::ReadError::UnknownTable {
            table: "user".into(),
            message: "unknown table user".into(),
        };
        assert_eq!(p.after_failure(&HandlerFailure::Read(typo), 0, 1, year), Next::DeadLetter);
        let many = crate::protocol::ReadError::TooManyReads { limit: 10 };
        assert!(matches!(
            p.after_failure(&HandlerFailure::Read(many), 0, 1, year),
            Next::RetryAfter(_)
        ));
        let asked = HandlerFailure::Retry {
            reason: "later".into(),
            delay: Some(Duration::from_secs(42)),
        };
        assert_eq!(p.after_failure(&asked, 0, 1, year), Next::RetryAfter(Duration::from_secs(42)));
        let forever = HandlerFailure::Retry {
            reason: "never".into(),
            delay: Some(Duration::MAX),
        };
        assert_eq!(p.after_failure(&forever, 0, 1, year), Next::RetryAfter(year), "capped at max_delay");
        assert_eq!(
            p.after_failure(&forever, 4, 5, year),
            Next::DeadLetter,
            "max_attempts still applies"
        );
    }

    /// Deliveries without a verdict do not count: a message leased and lost
    /// six times, then failing once, is retried, not dead-lettered.
    #[test]
    fn only_failures_count_toward_max_attempts() {
        let p = policy();
        let year = Duration::from_secs(365 * 24 * 3600);
        let failed = HandlerFailure::Refused("CHECK constraint failed".into());
        assert!(matches!(p.after_failure(&failed, 0, 7, year), Next::RetryAfter(_)));
        assert!(matches!(p.after_failure(&failed, 0, 50, year), Next::RetryAfter(_)));
    }

    #[test]
    fn a_crash_is_dead_lettered_at_once_unless_the_queue_retries_crashes() {
        let year = Duration::from_secs(365 * 24 * 3600);
        let crashes = [
            HandlerFailure::Crash("trap: unreachable".into()),
            HandlerFailure::Exit(3),
            HandlerFailure::Memory(1 << 20),
            HandlerFailure::from_retry("uncaught TypeError: x is null".into(), None),
        ];
        for crash in &crashes {
            assert!(crash.is_crash(), "{crash:?}");
            assert_eq!(policy().after_failure(crash, 0, 1, year), Next::DeadLetter, "{crash:?}");
            let retrying = Policy {
                retry_crashes: true,
                ..policy()
            };
            assert!(
                matches!(retrying.after_failure(crash, 0, 1, year), Next::RetryAfter(_)),
                "{crash:?}"
            );
            assert_eq!(
                retrying.after_failure(crash, 4, 5, year),
                Next::DeadLetter,
                "max_attempts still applies"
            );
        }
        // What the handler asked for stays a retry, also with that wording
        // when it gives a delay; a deadline is retried.
        let asked = HandlerFailure::from_retry("uncaught? no: later".into(), None);
        assert!(matches!(asked, HandlerFailure::Retry { .. }), "{asked:?}");
        let delayed = HandlerFailure::from_retry("uncaught x".into(), Some(Duration::from_secs(1)));
        assert!(matches!(delayed, HandlerFailure::Retry { .. }), "{delayed:?}");
        let deadline = HandlerFailure::Deadline(Duration::from_secs(1));
        assert!(!deadline.is_crash());
        assert!(matches!(policy().after_failure(&deadline, 0, 1, year), Next::RetryAfter(_)));
    }

    /// The host's trouble is deferred, never counted, whatever the counts;
    /// a refused write is the message's own.
    #[test]
    fn host_trouble_is_deferred_and_a_refused_write_is_a_failure() {
        let p = policy();
        let year = Duration::from_secs(365 * 24 * 3600);
        use crate::protocol::handler::HostTrouble;
        for trouble in [
            HandlerFailure::from_store(StoreError::Unavailable("down".into())),
            HandlerFailure::from_store(StoreError::Aborted("contention".into())),
            HandlerFailure::from_store(StoreError::Permanent("no such savepoint".into())),
            HandlerFailure::Host(HostTrouble::ReadStalled(Duration::from_secs(1))),
            HandlerFailure::Host(HostTrouble::Resources("cannot create a memfd".into())),
        ] {
            assert!(!trouble.is_own(), "{trouble}");
            for (failures, deliveries) in [(0, 1), (4, 5), (4, 40)] {
                match p.after_failure(&trouble, failures, deliveries, year) {
                    Next::Defer(d) => assert!(d <= Duration::from_secs(360), "{d:?}"),
                    other => panic!("{trouble}: {other:?}"),
                }
            }
        }
        let refused = HandlerFailure::from_store(StoreError::WriteRefused("UNIQUE constraint failed".into()));
        assert!(refused.is_own());
        assert!(matches!(p.after_failure(&refused, 0, 1, year), Next::RetryAfter(_)));
        assert_eq!(p.after_failure(&refused, 4, 5, year), Next::DeadLetter);
    }
}
