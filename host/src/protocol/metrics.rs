//! Counters and histograms of one queue: what `/metrics` exports and `make
//! run` summarizes. One set of books, read at each scrape.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// Counters for one queue (also what `make run` summarizes).
#[derive(Debug, Default)]
pub struct Metrics {
    /// Committed with their ack.
    pub processed: AtomicU64,
    /// Found already committed after an unknown outcome.
    pub already_committed: AtomicU64,
    /// Deliveries that ended in a retry later after a failure of the
    /// message's own (counted toward `max_attempts`).
    pub retried: AtomicU64,
    pub dead_lettered: AtomicU64,
    /// Leases taken (every delivery of a message, whatever its end).
    pub deliveries: AtomicU64,
    /// Failures of the messages' own (retried or dead-lettered for them).
    pub failures: AtomicU64,
    /// Deliveries deferred for the host's own trouble (not counted as
    /// failures): a failing or stalled store, contention, resources.
    pub deferred: AtomicU64,
    /// Transactions re-run after an abort.
    pub aborted_reruns: AtomicU64,
    /// Commits with an unknown outcome (each re-run).
    pub unknown_outcomes: AtomicU64,
    /// Lost leases (another worker holds the message now).
    pub lease_lost: AtomicU64,
    /// Released unprocessed at shutdown.
    pub released: AtomicU64,
    /// Messages handed to this queue's workers in memory by the commit
    /// that sent them, instead of leased from the table
    /// (`commit.handoff`).
    pub handed_off: AtomicU64,
    /// Leases extended while their message waited or was being handled.
    pub lease_renewals: AtomicU64,
    /// Work cancelled because its lease was lost (or could not be renewed).
    pub cancelled: AtomicU64,
    /// Messages being processed right now.
    pub in_flight: AtomicI64,
    /// Final outcomes per handler version.
    pub by_version: Mutex<BTreeMap<String, VersionCounts>>,
    pub writes: AtomicU64,
    pub intents: AtomicU64,
    pub enqueued: AtomicU64,
    /// Lease-to-outcome latency, microseconds.
    pub latency_us: Mutex<Option<hdrhistogram::Histogram<u64>>>,
    /// Time inside the handler call (instantiation, reads, the call),
    /// microseconds, per attempt.
    pub handler_us: Mutex<Option<hdrhistogram::Histogram<u64>>>,
    /// Instructions per handler call, by handler version (when the runtime
    /// counts them).
    pub instructions: Mutex<BTreeMap<String, hdrhistogram::Histogram<u64>>>,
    /// Failed store calls by error class ([`crate::store::StoreError::class`]).
    pub store_errors: Mutex<BTreeMap<&'static str, u64>>,
    /// When this queue last committed a message (Unix microseconds; 0:
    /// never since start).
    pub last_commit_us: AtomicI64,
    /// Deferring for the host's trouble since, last deferred at, and why;
    /// cleared by a commit.
    deferring: Mutex<Option<(std::time::Instant, std::time::Instant, String)>>,
}

type Hist = Mutex<Option<hdrhistogram::Histogram<u64>>>;

pub(super) fn hist_record(h: &Hist, d: Duration) {
    if let Ok(mut h) = h.lock() {
        if h.is_none() {
            *h = hdrhistogram::Histogram::new(3).ok();
        }
        if let Some(h) = h.as_mut() {
            let _ = h.record(d.as_micros().max(1) as u64);
        }
    }
}

/// (sum in seconds, count, per-bucket counts for `bounds` in seconds, then
/// the rest under `f64::MAX`), as Prometheus histograms want them.
fn hist_buckets(h: &Hist, bounds: &[f64]) -> (f64, u64, Vec<(f64, u64)>) {
    let guard = h.lock();
    let Some(h) = guard.as_ref().ok().and_then(|g| g.as_ref()) else {
        return (
            0.0,
            0,
            bounds.iter().map(|b| (*b, 0)).chain(std::iter::once((f64::MAX, 0))).collect(),
        );
    };
    let count = h.len();
    let sum = h.mean() * count as f64 / 1e6;
    let mut out = Vec::with_capacity(bounds.len() + 1);
    let mut below = 0;
    for b in bounds {
        let upto = h.count_between(0, (b * 1e6) as u64);
        out.push((*b, upto.saturating_sub(below)));
        below = upto.max(below);
    }
    out.push((f64::MAX, count.saturating_sub(below)));
    (sum, count, out)
}

/// Final outcomes of the messages one handler version processed.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct VersionCounts {
    /// Being processed now: an old version still above zero is draining.
    pub in_flight: u64,
    pub processed: u64,
    pub already_committed: u64,
    pub retried: u64,
    pub dead_lettered: u64,
}

impl Metrics {
    /// Count a failed store call by its class.
    pub(super) fn store_error(&self, e: &crate::store::StoreError) {
        if let Ok(mut m) = self.store_errors.lock() {
            *m.entry(e.class()).or_default() += 1;
        }
    }

    /// Failed store calls so far, by class.
    pub fn store_errors(&self) -> BTreeMap<&'static str, u64> {
        self.store_errors.lock().map(|m| m.clone()).unwrap_or_default()
    }

    /// A message was deferred for the host's trouble.
    pub(super) fn deferred_now(&self, why: &str) {
        if let Ok(mut d) = self.deferring.lock() {
            let now = std::time::Instant::now();
            match d.as_mut() {
                Some((_, last, reason)) => {
                    *last = now;
                    why.clone_into(reason);
                }
                None => *d = Some((now, now, why.to_string())),
            }
        }
    }

    /// `Some((seconds, why))` when this queue has been deferring messages
    /// for the host's trouble for at least `after`, the last time within
    /// `after`, with no commit since: it makes no progress.
    pub fn held_back(&self, after: Duration) -> Option<(f64, String)> {
        let d = self.deferring.lock().ok()?;
        let (since, last, why) = d.as_ref()?;
        (since.elapsed() >= after && last.elapsed() < after).then(|| (since.elapsed().as_secs_f64(), why.clone()))
    }

    pub(super) fn committed_now(&self) {
        if let Ok(mut d) = self.deferring.lock() {
            *d = None;
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX));
        self.last_commit_us.store(now, Ordering::Relaxed);
    }

    /// Seconds since this queue last committed a message, `None` if it has
    /// not since start.
    pub fn seconds_since_commit(&self) -> Option<f64> {
        let at = self.last_commit_us.load(Ordering::Relaxed);
        if at == 0 {
            return None;
        }
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).ok()?;
        Some((now.as_micros() as f64 - at as f64).max(0.0) / 1e6)
    }

    pub(super) fn record_version(&self, version: &str, f: impl FnOnce(&mut VersionCounts)) {
        if let Ok(mut m) = self.by_version.lock() {
            match m.get_mut(version) {
                Some(c) => f(c),
                None => f(m.entry(version.to_string()).or_default()),
            }
        }
    }

    /// Outcomes per version so far.
    pub fn versions(&self) -> BTreeMap<String, VersionCounts> {
        self.by_version.lock().map(|m| m.clone()).unwrap_or_default()
    }

    /// One call of `version` ran `n` instructions.
    pub(super) fn record_instructions(&self, version: &str, n: u64) {
        if let Ok(mut m) = self.instructions.lock() {
            if !m.contains_key(version) {
                match hdrhistogram::Histogram::new(2) {
                    Ok(h) => m.insert(version.to_string(), h),
                    Err(_) => return,
                };
            }
            if let Some(h) = m.get_mut(version) {
                // `record` grows the auto-resizing histogram to fit;
                // `saturating_record` alone would clamp to its current top.
                if h.record(n.max(1)).is_err() {
                    h.saturating_record(n.max(1));
                }
            }
        }
    }

    /// Per version: calls counted, and the instructions at quantiles 0.5
    /// and 0.99.
    pub fn instruction_quantiles(&self) -> BTreeMap<String, (u64, u64, u64)> {
        self.instructions
            .lock()
            .map(|m| {
                m.iter()
                    .map(|(v, h)| (v.clone(), (h.len(), h.value_at_quantile(0.5), h.value_at_quantile(0.99))))
                    .collect()
            })
            .unwrap_or_default()
    }

    pub(super) fn record_latency(&self, d: Duration) {
        hist_record(&self.latency_us, d)
    }

    /// Lease-to-outcome latency as histogram buckets (see [`hist_buckets`]).
    pub fn latency_buckets(&self, bounds: &[f64]) -> (f64, u64, Vec<(f64, u64)>) {
        hist_buckets(&self.latency_us, bounds)
    }

    /// Handler-call time as histogram buckets.
    pub fn handler_buckets(&self, bounds: &[f64]) -> (f64, u64, Vec<(f64, u64)>) {
        hist_buckets(&self.handler_us, bounds)
    }

    /// Latency quantile in microseconds (0 when nothing was recorded).
    pub fn latency_quantile(&self, q: f64) -> u64 {
        self.latency_us
            .lock()
            .ok()
            .and_then(|h| h.as_ref().map(|h| h.value_at_quantile(q)))
            .unwrap_or(0)
    }

    /// Messages acked exactly once (by this worker's commit, or by an
    /// earlier commit found after an unknown outcome).
    pub fn acked(&self) -> u64 {
        self.processed.load(Ordering::Relaxed) + self.already_committed.load(Ordering::Relaxed)
    }

    /// Messages that reached a final outcome (acked once or dead-lettered).
    pub fn finished(&self) -> u64 {
        self.acked() + self.dead_lettered.load(Ordering::Relaxed)
    }
}
