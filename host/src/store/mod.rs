//! The queue backend: one trait, one implementation per database.
//!
//! Shaped like River's driver: operations are named noun-first
//! (`message_lease`, `message_dead_letter`), take one params struct, use the
//! database's clock (never the host's), and every state change of a leased
//! message is guarded by its lease token: if the token no longer matches (the
//! lease expired and another worker took the message, or the message was
//! already acknowledged) the change fails with [`StoreError::LeaseLost`].
//!
//! A message transaction ([`Transaction`]) serves the handler's reads, buffers
//! its effects, and on [`Transaction::commit`] applies the effects *and*
//! deletes the message (the ack, the equivalent of Spanner's
//! `DELETE ... ASSERT_ROWS_MODIFIED 1`) atomically. If the ack finds no row,
//! the whole transaction is rolled back and `LeaseLost` returned: a store
//! never commits effects without their ack.
//!
//! Errors are classified once, here ([`StoreError`]), so the protocol can
//! decide between re-running, resolving an unknown outcome, or giving up.

use crate::schema::{Schema, TableSchema, ValidWrite};
use crate::value::{Message, Row, Value};
use async_trait::async_trait;
use std::sync::Arc;
use std::time::Duration;

pub mod commit;
pub mod faulty;
pub mod memory;
#[cfg(feature = "spanner")]
pub mod spanner;
pub mod sqlite;

/// What went wrong in a store operation, classified for the protocol.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The transaction was aborted (conflict); re-running it may succeed.
    #[error("transaction aborted: {0}")]
    Aborted(String),
    /// A transient failure before anything was written (busy, unavailable).
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The commit may or may not have landed (deadline, cut connection).
    #[error("commit outcome unknown: {0}")]
    UnknownOutcome(String),
    /// The lease token no longer matches: the lease expired and the message
    /// was leased again, or it was already acknowledged.
    #[error("lease lost on message {message_id} (expired and re-leased, or already acknowledged)")]
    LeaseLost { message_id: String },
    /// A guarded statement (`ASSERT_ROWS_MODIFIED 1`) found no row to change
    /// (Spanner's `OUT_OF_RANGE`). The store maps it to [`Self::LeaseLost`]
    /// where the statement was a lease guard; the transaction is rolled
    /// back, never committed without it.
    #[error("assertion failed: {0}")]
    AssertionFailed(String),
    /// The database refused a write the handler asked for (a constraint:
    /// duplicate key on insert, missing row on update, ...).
    #[error("write refused by the database: {0}")]
    WriteRefused(String),
    /// One of onceq's own invariants did not hold (a bug, or a database
    /// changed behind onceq's back): the host's trouble, never a message's.
    #[error("onceq invariant broken: {0}")]
    Invariant(String),
    /// Anything else: a corrupt database, a bad configuration.
    #[error("{0}")]
    Permanent(String),
}

impl StoreError {
    /// Safe to re-run the whole transaction (nothing landed).
    pub fn is_retryable(&self) -> bool {
        matches!(self, StoreError::Aborted(_) | StoreError::Unavailable(_))
    }
    /// The commit may have landed.
    pub fn is_unknown_outcome(&self) -> bool {
        matches!(self, StoreError::UnknownOutcome(_))
    }
    /// The error's class, as logs and metrics name it.
    pub fn class(&self) -> &'static str {
        match self {
            StoreError::Aborted(_) => "aborted",
            StoreError::Unavailable(_) => "unavailable",
            StoreError::UnknownOutcome(_) => "unknown_outcome",
            StoreError::LeaseLost { .. } => "lease_lost",
            StoreError::AssertionFailed(_) => "assertion_failed",
            StoreError::WriteRefused(_) => "write_refused",
            StoreError::Invariant(_) => "invariant",
            StoreError::Permanent(_) => "permanent",
        }
    }
}

pub type StoreResult<T> = Result<T, StoreError>;

/// Cap on the rows one scan may return to a handler (both stores enforce it).
pub const MAX_SCAN_ROWS: usize = 1000;

/// The furthest ahead a store schedules anything (a delay, a lease, a dedup
/// window); longer durations are cut to it. Times are `INT64` microseconds:
/// without the cut, `now + u64::MAX ms` would overflow (SQLite turns it into
/// a REAL that no reader expects). The settings (`max_delay`, lease limits)
/// refuse far less than this first; this is the store's own guard.
pub const MAX_SCHEDULE: Duration = Duration::from_secs(1000 * 365 * 24 * 3600);

/// Attributes as stored: a JSON array of `[name, value]` pairs.
pub(crate) fn attrs_to_json(a: &[(String, String)]) -> String {
    serde_json::to_string(a).unwrap_or_else(|_| "[]".to_string())
}

/// Attributes as stored, read back (malformed: none).
pub(crate) fn attrs_from_json(s: &str) -> Vec<(String, String)> {
    serde_json::from_str(s).unwrap_or_default()
}

/// A duration as the stores' microseconds, cut to [`MAX_SCHEDULE`].
pub fn micros(d: Duration) -> i64 {
    i64::try_from(d.min(MAX_SCHEDULE).as_micros()).unwrap_or(i64::MAX)
}

/// This machine's time as the stores' microseconds since the epoch (0
/// before it).
pub fn now_micros() -> i64 {
    micros(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default(),
    )
}

/// A read a handler made, recorded so the commit can run it again and abort
/// if the answer changed (optimistic concurrency, used by both stores).
#[derive(Debug, Clone)]
pub struct ReadRecord {
    pub table: TableSchema,
    /// The primary key (point read) or a key prefix (scan).
    pub key: Vec<Value>,
    /// `None`: a point read; `Some(n)`: a scan of at most `n` rows.
    pub limit: Option<usize>,
    /// What the handler saw (at most one row for a point read).
    pub result: Vec<Row>,
}

impl ReadRecord {
    /// Does `now`, the same read run again at commit, match what the handler saw?
    pub fn unchanged(&self, now: &[Row]) -> bool {
        now.len() == self.result.len() && now.iter().zip(&self.result).all(|(a, b)| crate::value::rows_same(a, b))
    }
}

/// A lease on one message: the right to ack, nack or dead-letter it while
/// the token matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub queue: String,
    /// The message's id, as handlers see it, on every store.
    pub message_id: String,
    /// Where the store keeps the message: Spanner's hash shard (the first
    /// primary-key column); 0 on SQLite.
    pub shard: i64,
    pub token: String,
}

/// A message with its lease.
#[derive(Debug, Clone)]
pub struct LeasedMessage {
    /// `message.attempt` is the delivery count, this lease included.
    pub message: Message,
    pub lease: Lease,
    /// Lease deadline, database time (µs since the epoch).
    pub lease_until: i64,
    /// Failed verdicts of the message's own so far (the handler failed or
    /// asked to retry, or its effects were refused): what
    /// `queue.max_attempts` bounds. Leases that ended without a verdict
    /// (a crash, an expiry, the host's own trouble) are not counted here.
    pub failures: u32,
}

/// Put a lease's messages oldest first (by `enqueued_at`, then id). Not a
/// stable sort: that one allocates scratch space for a 64-message batch,
/// which was 2% of the workers' samples through the CLI.
pub(crate) fn oldest_first(leased: &mut [LeasedMessage]) {
    leased.sort_unstable_by(|a, b| (a.message.enqueued_at, &a.message.id).cmp(&(b.message.enqueued_at, &b.message.id)));
}

/// Parameters of a send (a producer's message, or a handler's follow-up).
#[derive(Debug, Clone, Default)]
pub struct SendParams {
    pub queue: String,
    pub payload: Vec<u8>,
    pub attributes: Vec<(String, String)>,
    /// Not visible before now + delay.
    pub delay: Duration,
    /// A second send with the same key on the same queue within the dedup
    /// window is dropped.
    pub dedup_key: Option<String>,
    /// How long the dedup key is remembered (default: the store's
    /// `dedup_window`). Outbox intents hold theirs until delivered.
    pub dedup_window: Option<Duration>,
    /// Insert the message already leased to this host, for a worker of
    /// the same host to take from memory after the commit
    /// ([`crate::protocol`], "Handoff"). A store that cannot
    /// ([`Store::handoff`] false) inserts it ready, as without.
    pub handoff: Option<Arc<Handoff>>,
}

/// A send inserted already leased (its lease's token and length), and
/// what the insert gave back for the worker that takes it over: set by
/// the store when the insert ran, cleared when the same pending is applied
/// again (a batch re-committed one message at a time).
#[derive(Debug)]
pub struct Handoff {
    pub token: String,
    pub lease: Duration,
    landed: std::sync::Mutex<Option<HandedOff>>,
}

/// What the leased insert of a [`Handoff`] wrote: the message's id,
/// enqueue time and lease deadline (database time, µs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandedOff {
    pub id: String,
    pub enqueued_at: i64,
    pub lease_until: i64,
}

impl Handoff {
    pub fn new(lease: Duration) -> Handoff {
        Handoff {
            token: crate::value::random_id(),
            lease,
            landed: std::sync::Mutex::new(None),
        }
    }

    /// The insert ran (`Some`), or this send's pending is being applied
    /// again or the send was a duplicate (`None`).
    pub fn set_landed(&self, landed: Option<HandedOff>) {
        *self.landed.lock().unwrap_or_else(|p| p.into_inner()) = landed;
    }

    /// What the last application of the send inserted, if it inserted.
    pub fn landed(&self) -> Option<HandedOff> {
        self.landed.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// The result of a send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SendOutcome {
    Sent {
        id: String,
    },
    /// The dedup key was seen within the window; nothing was enqueued.
    Duplicate {
        existing_id: String,
    },
}

#[derive(Debug, Clone)]
pub struct LeaseParams {
    pub queue: String,
    pub limit: usize,
    pub lease: Duration,
}

#[derive(Debug, Clone)]
pub struct DeadLetterParams {
    pub reason: String,
    pub handler_version: Option<String>,
    /// The message's own verdict was a failure: the dead letter records
    /// one more failure than the message had. False when the message is
    /// parked without one (too many deliveries without a verdict).
    pub failed: bool,
}

/// Parameters of [`Store::message_retry_later`].
#[derive(Debug, Clone)]
pub struct RetryParams {
    /// Visible again after this long.
    pub delay: Duration,
    /// Why, kept as the message's last error.
    pub reason: String,
    /// The message's own verdict was a failure (counted toward
    /// `max_attempts`); false when the host defers it for its own trouble
    /// (the store failed or stalled, resources ran out, contention).
    pub failed: bool,
}

/// What [`Store::dead_letter_settle`] does with a dead letter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    /// Back onto its queue, deliveries and failures reset.
    Replay,
    /// Deleted, for good.
    Discard,
}

/// One entry of the audit trail: who did what to which queue, and how it
/// ended. Written by the admin API and the CLI's mutating verbs; no API
/// deletes it (`audit.retention` prunes old entries).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AuditEntry {
    /// When, in microseconds since the Unix epoch (the acting host's clock).
    pub at: i64,
    /// The admin token's name, or `local:USER` for a CLI verb run against
    /// the database directly.
    pub actor: String,
    /// `deploy`, `rollback`, `replay`, `discard`, `intent-replay`...
    pub action: String,
    pub queue: Option<String>,
    /// What it acted on: a component's version, a message id.
    pub subject: String,
    /// Who signed the deployed component.
    pub signer: Option<String>,
    /// `ok`, or why it did not happen.
    pub result: String,
}

impl AuditEntry {
    /// An entry stamped now.
    pub fn now(actor: &str, action: &str, queue: Option<&str>, subject: &str) -> AuditEntry {
        AuditEntry {
            at: now_micros(),
            actor: actor.to_string(),
            action: action.to_string(),
            queue: queue.map(str::to_string),
            subject: subject.to_string(),
            signer: None,
            result: "ok".into(),
        }
    }

    pub fn with_result(mut self, result: impl Into<String>) -> AuditEntry {
        self.result = crate::names::truncated(&result.into(), 1024);
        self
    }

    pub fn with_signer(mut self, signer: Option<String>) -> AuditEntry {
        self.signer = signer;
        self
    }
}

/// Who runs a CLI verb against the database directly: `local:USER`.
pub fn local_actor() -> String {
    format!(
        "local:{}",
        std::env::var("USER")
            .or_else(|_| std::env::var("LOGNAME"))
            .unwrap_or_else(|_| "unknown".into())
    )
}

/// Which queues a listing covers.
#[derive(Debug, Clone, Copy)]
pub enum Queues<'a> {
    All,
    /// One queue.
    Named(&'a str),
    /// Every queue whose name starts with this (`onceq.outbox.` say).
    Prefix(&'a str),
}

impl Queues<'_> {
    pub fn matches(&self, queue: &str) -> bool {
        match self {
            Queues::All => true,
            Queues::Named(n) => queue == *n,
            Queues::Prefix(p) => queue.starts_with(p),
        }
    }
}

fn is_utf8(bytes: &[u8]) -> bool {
    std::str::from_utf8(bytes).is_ok()
}

fn base64_bytes<S: serde::Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
    use base64::Engine;
    s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(bytes))
}

/// A message waiting on its queue (or leased), as listed by tools.
#[derive(Debug, Clone, serde::Serialize)]
pub struct QueuedMessage {
    pub id: String,
    pub queue: String,
    /// The exact bytes, as `payload_base64` in JSON when they are not
    /// UTF-8 (`payload_text` is then lossy: U+FFFD for each bad byte).
    #[serde(rename = "payload_base64", serialize_with = "base64_bytes", skip_serializing_if = "is_utf8")]
    pub payload: Vec<u8>,
    pub payload_text: String,
    pub attributes: Vec<(String, String)>,
    /// Leases taken so far (a release at shutdown gives one back).
    pub deliveries: u32,
    /// Failed verdicts of its own so far (what `max_attempts` bounds).
    pub failures: u32,
    pub enqueued_at: i64,
    /// When it is (or was) visible to a lease, database time (µs).
    pub visible_at: i64,
    /// Leased by a worker right now.
    pub leased: bool,
    /// Why the last attempt failed, if one did.
    pub last_error: Option<String>,
}

/// A dead-lettered message.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeadLetter {
    pub id: String,
    pub queue: String,
    /// The exact bytes, as `payload_base64` in JSON when they are not
    /// UTF-8 (`payload_text` is then lossy: U+FFFD for each bad byte).
    #[serde(rename = "payload_base64", serialize_with = "base64_bytes", skip_serializing_if = "is_utf8")]
    pub payload: Vec<u8>,
    pub payload_text: String,
    pub attributes: Vec<(String, String)>,
    /// Leases it was given.
    pub deliveries: u32,
    /// Failed verdicts of its own (a message parked after too many
    /// deliveries without a verdict may have none).
    pub failures: u32,
    pub enqueued_at: i64,
    pub failed_at: i64,
    pub reason: String,
    pub handler_version: Option<String>,
}

/// Per-queue counts (database time decides ready/leased/delayed).
#[derive(Debug, Clone, Default, serde::Serialize, PartialEq, Eq)]
pub struct QueueStats {
    pub queue: String,
    /// Visible now.
    pub ready: u64,
    /// Leased by a worker.
    pub leased: u64,
    /// Waiting for a delay or a retry backoff.
    pub delayed: u64,
    /// Of `ready`: messages whose lease expired without an outcome (the
    /// holder crashed, stalled, or lost the store): another worker takes
    /// them again. Many of these means hosts are dying mid-message.
    pub expired_leases: u64,
    /// In the dead-letter table.
    pub dead: u64,
    /// When the next delayed message becomes visible, in milliseconds from
    /// now (`None` when nothing is delayed).
    pub next_due_ms: Option<u64>,
    /// Dedup keys remembered (producer keys within the window; on an outbox
    /// queue, intent keys: held until delivery, then for the retention).
    pub dedup_keys: u64,
    /// Messages committed with their ack since the database was created
    /// (counted in the commit's own transaction, so exact; on an outbox
    /// queue, intents delivered).
    pub processed: u64,
    /// When the last of them committed (database time, µs).
    pub last_processed_at: Option<i64>,
}

/// The entry of `queue` in a stats map, created empty if missing.
pub(crate) fn queue_entry(map: &mut std::collections::BTreeMap<String, QueueStats>, queue: String) -> &mut QueueStats {
    map.entry(queue.clone()).or_insert_with(|| QueueStats {
        queue,
        ..Default::default()
    })
}

#[derive(Debug, Clone, Default, serde::Serialize, PartialEq, Eq)]
pub struct Stats {
    /// Every queue with messages, dead letters, dedup keys or processed
    /// messages, by name.
    pub queues: Vec<QueueStats>,
}

/// A queue backend.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// "sqlite", "spanner", ...
    fn kind(&self) -> &'static str;

    /// What the store's group commit did so far, when it has one.
    ///
    /// No method of this trait has a default: a decorator (the fault
    /// injector) must forward each one, or the compiler says so.
    fn commit_stats(&self) -> Option<commit::CommitStats>;

    /// Tell `observer` of every group commit (telemetry's `commit` span);
    /// a store without group commit has none to tell.
    fn commit_observe(&self, _observer: commit::BatchObserver) {}

    /// Whether sends with a [`SendParams::handoff`] are inserted leased
    /// (SQLite, unless `commit.handoff = false`). Where false, the protocol
    /// never hands a message over in memory.
    fn handoff(&self) -> bool;

    /// The business tables, as read from the database when it was opened.
    fn schema(&self) -> Arc<Schema>;

    /// Enqueue messages, in one transaction (all or none).
    async fn message_send(&self, params: Vec<SendParams>) -> StoreResult<Vec<SendOutcome>>;

    /// Lease up to `limit` visible messages of a queue: give each a new
    /// token, make it invisible until now + lease, count the delivery.
    async fn message_lease(&self, params: LeaseParams) -> StoreResult<Vec<LeasedMessage>>;

    /// [`Store::message_lease`] for as many messages as `collect` returns,
    /// calling it once the lease can run at once: a store whose transactions
    /// wait their turn (the Spanner emulator) waits first, so requests made
    /// meanwhile join this lease (`protocol::lease`). A store without
    /// turns collects at once.
    async fn message_lease_collected(
        &self,
        queue: &str,
        lease: Duration,
        collect: &(dyn Fn() -> usize + Send + Sync),
    ) -> StoreResult<Vec<LeasedMessage>>;

    /// Extend leases to now + `duration`, each guarded by its token, in one
    /// transaction (a worker renews its whole batch at once). Per lease:
    /// `true` if renewed, `false` if lost (expired and re-leased, or acked).
    async fn message_lease_renew(&self, leases: &[Lease], duration: Duration) -> StoreResult<Vec<bool>>;

    /// Give the message back without counting the delivery (shutdown).
    async fn message_release(&self, lease: &Lease) -> StoreResult<()>;

    /// Make the message visible again after `p.delay`, recording
    /// `p.reason`, and count a failure if `p.failed`.
    async fn message_retry_later(&self, lease: &Lease, p: RetryParams) -> StoreResult<()>;

    /// Move the message to the dead-letter table, in one transaction.
    async fn message_dead_letter(&self, lease: &Lease, params: DeadLetterParams) -> StoreResult<()>;

    /// Start a message transaction.
    async fn transaction_begin(&self) -> StoreResult<Box<dyn Transaction>>;

    /// Stop the store's committer between two batches for one message
    /// ([`commit::Group::hold`]), before its transaction begins; commit it
    /// with [`Transaction::commit_held`]. `None` for a store without a
    /// committer.
    async fn commit_hold(&self) -> StoreResult<Option<commit::Hold>>;

    /// Counts per queue (outbox queues included), with dedup keys held.
    async fn stats(&self) -> StoreResult<Stats>;

    /// Of [`Store::stats`], the queued messages' counts alone (`ready`,
    /// `leased`, `delayed`, `expired_leases`, `next_due_ms`; the other
    /// fields may be zero): what `onceq run --until-empty` asks before it
    /// stops. A store whose whole stats cost more reads less (Spanner: one
    /// query of the messages table instead of four).
    async fn backlog(&self) -> StoreResult<Stats> {
        self.stats().await
    }

    /// Whether the store can take a write within [`WRITE_CHECK_WITHIN`]:
    /// `/readyz` asks, so a host whose database file another process holds
    /// locked says so instead of answering ready while every commit waits.
    /// Spanner has no lock one client can hold over the whole database: it
    /// has nothing to check beyond the read `/readyz` makes.
    async fn write_check(&self) -> StoreResult<()> {
        Ok(())
    }

    /// Stop taking commits: what is queued is committed, then the
    /// committer ends. Commits asked for after this are refused
    /// (unavailable, nothing written).
    async fn close(&self);

    /// Dead letters, newest first.
    async fn dead_letter_list(&self, queues: Queues<'_>, limit: usize) -> StoreResult<Vec<DeadLetter>>;

    async fn dead_letter_get(&self, id: &str) -> StoreResult<Option<DeadLetter>>;

    /// Move a dead letter back onto its queue (deliveries and failures
    /// reset), in one
    /// transaction. Returns the new message id, or `None` if there was no
    /// such dead letter.
    async fn dead_letter_replay(&self, id: &str) -> StoreResult<Option<String>> {
        self.dead_letter_settle(id, Settle::Replay, None).await
    }

    /// Replay or discard a dead letter, recording `audit` in the same
    /// transaction when it happened. `None` if there was no such dead
    /// letter (nothing is recorded then).
    async fn dead_letter_settle(&self, id: &str, how: Settle, audit: Option<&AuditEntry>) -> StoreResult<Option<String>>;

    /// Add an entry to the audit trail (its own transaction).
    async fn audit_append(&self, entry: &AuditEntry) -> StoreResult<()>;

    /// The audit trail, newest first; `queues` keeps entries about those
    /// queues (entries about no queue only with [`Queues::All`]).
    async fn audit_list(&self, queues: Queues<'_>, limit: usize) -> StoreResult<Vec<AuditEntry>>;

    /// Remove audit entries older than `age` (`audit.retention`); returns
    /// how many. No API calls it: only the host's retention chore.
    async fn audit_prune(&self, age: Duration) -> StoreResult<u64>;

    /// Messages on their queues (ready, delayed or leased), oldest first.
    async fn message_list(&self, queues: Queues<'_>, limit: usize) -> StoreResult<Vec<QueuedMessage>>;

    /// One message on its queue, by id.
    async fn message_get(&self, id: &str) -> StoreResult<Option<QueuedMessage>>;

    /// A page of `queue`'s messages in `state`, by the time they become
    /// (or became) visible then id, strictly after `after`: a range of the
    /// `(queue, visible_at)` index, never a scan of the queue (the
    /// console's paging on a queue of a million messages).
    async fn message_browse(
        &self,
        queue: &str,
        state: LiveState,
        after: Option<&BrowseKey>,
        limit: usize,
    ) -> StoreResult<Vec<QueuedMessage>>;

    /// A page of `queue`'s dead letters, newest first (then by id),
    /// strictly after `after`: a range of the `(queue, failed_at)` index.
    async fn dead_letter_browse(&self, queue: &str, after: Option<&BrowseKey>, limit: usize) -> StoreResult<Vec<DeadLetter>>;

    /// Pause `queue` (hosts lease nothing from it; what they hold
    /// finishes) or resume it; with `audit`, recorded in the same
    /// transaction. Returns whether anything changed.
    async fn queue_pause(&self, queue: &str, pause: bool, audit: Option<&AuditEntry>) -> StoreResult<bool>;

    /// The paused queues, by name.
    async fn queue_paused(&self) -> StoreResult<Vec<PausedQueue>>;

    /// Say that the host `beat` describes is alive (its `seen_at` is the
    /// database's time of this write).
    async fn host_beat(&self, beat: &HostBeat) -> StoreResult<()>;

    /// Forget the hosts not seen for `age` ([`HOSTS_FORGOTTEN_AFTER`], by
    /// the host's purge chore); returns how many.
    async fn hosts_prune(&self, age: std::time::Duration) -> StoreResult<u64>;

    /// The hosts seen in the last `within`, most recently seen first.
    async fn hosts_seen(&self, within: std::time::Duration) -> StoreResult<Vec<HostBeat>>;

    /// Every row of a business table, in key order: for checks and tools
    /// (`onceq demo`'s invariants, tests), never for handlers.
    async fn table_rows(&self, table: &str) -> StoreResult<Vec<Row>>;

    /// Forget dedup keys whose time is up (producer keys after the window,
    /// delivered intent keys after the retention); returns how many.
    async fn dedup_purge(&self) -> StoreResult<u64>;

    /// Live dedup keys that expire within `within` from now, the latest to
    /// expire first. On an outbox queue with `within` = the retention:
    /// the keys of delivered intents, newest delivery first (a key held
    /// until delivery expires a century out).
    async fn dedup_list(&self, queues: Queues<'_>, within: Duration, limit: usize) -> StoreResult<Vec<DedupKey>>;
}

/// Which messages of a queue a browse lists (dead letters have their own
/// listing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LiveState {
    /// Visible now (a lease that expired without an outcome included).
    Ready,
    /// Waiting for a delay or a retry's backoff.
    Delayed,
    /// Held by a worker's lease.
    Leased,
}

/// Where a browse stopped: the last row's time (`visible_at`, or a dead
/// letter's `failed_at`) and id. The next page starts after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrowseKey {
    pub at: i64,
    pub id: String,
}

/// A paused queue.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PausedQueue {
    pub queue: String,
    /// When (µs since the epoch).
    pub paused_at: i64,
    /// Who paused it (a token's name, or `local:USER`).
    pub by: String,
}

/// A host serving queues, as it last said (`onceq run` writes one every
/// [`crate::host::HOST_BEAT`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct HostBeat {
    /// Random per process.
    pub id: String,
    /// The machine's name.
    pub name: String,
    pub pid: i64,
    /// onceq's version.
    pub version: String,
    /// µs since the epoch.
    pub started_at: i64,
    /// When it last said so (database time, µs; set by the store).
    pub seen_at: i64,
    /// The queues (and outboxes) it serves.
    pub queues: Vec<String>,
    /// Messages it was working on.
    pub in_flight: i64,
    /// Messages it finished since it started.
    pub finished: i64,
}

/// A host not seen for this long is forgotten.
pub const HOSTS_FORGOTTEN_AFTER: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

/// A remembered dedup key.
#[derive(Debug, Clone, serde::Serialize, PartialEq, Eq)]
pub struct DedupKey {
    pub queue: String,
    pub key: String,
    /// The message that claimed the key.
    pub message_id: String,
    /// Database time (µs) the key is forgotten at.
    pub expires_at: i64,
}

/// One message transaction. Reads are served now; effects are buffered and
/// applied, together with the ack, by `commit`.
#[async_trait]
pub trait Transaction: Send {
    /// Read one row by primary key.
    async fn row_get(&mut self, table: &TableSchema, key: &[Value]) -> StoreResult<Option<Row>>;

    /// Read up to `limit` rows whose key starts with `prefix`, in key order.
    async fn row_scan(&mut self, table: &TableSchema, prefix: &[Value], limit: usize) -> StoreResult<Vec<Row>>;

    /// Buffer a validated write.
    fn row_write(&mut self, write: ValidWrite);

    /// Buffer a follow-up message.
    fn message_enqueue(&mut self, params: SendParams);

    /// Buffer a change of a dedup key's expiry to now + `window` (an outbox
    /// dispatcher's ack: the delivered intent's key is kept for the
    /// retention window, then forgotten).
    fn dedup_hold(&mut self, queue: &str, key: &str, window: Duration);

    /// Buffer the ack: delete the message, asserting exactly one row.
    fn message_ack(&mut self, lease: &Lease);

    /// The span this message's commit belongs to, for the span of the
    /// batch that commits it (telemetry). Ignored by stores without group
    /// commit.
    fn trace(&mut self, _span: crate::trace::TraceParent) {}

    /// Apply everything atomically, or nothing.
    async fn commit(self: Box<Self>) -> StoreResult<()>;

    /// [`Transaction::commit`], first in the batch the hold stopped the
    /// committer for ([`Store::commit_hold`]).
    async fn commit_held(self: Box<Self>, hold: commit::Hold) -> StoreResult<()>;

    /// Discard everything.
    async fn rollback(self: Box<Self>);

    /// Apply what was buffered in a write transaction of the database, then
    /// roll it back: the verdict a commit would give on the same data
    /// (constraints, triggers, defaults, types), nothing kept. `onceq try`
    /// and `onceq test` give it. `None`: this store applies writes only as
    /// it commits them (Spanner's mutations), so nothing can be rehearsed.
    async fn rehearse(self: Box<Self>) -> Option<StoreResult<()>>;
}

/// Which backend a store URL names.
pub enum StoreUrl {
    Sqlite(std::path::PathBuf),
    /// `projects/P/instances/I/databases/D`
    Spanner(String),
}

impl StoreUrl {
    pub fn parse(url: &str) -> anyhow::Result<StoreUrl> {
        if let Some(path) = url.strip_prefix("sqlite://") {
            Ok(StoreUrl::Sqlite(path.into()))
        } else if let Some(db) = url.strip_prefix("spanner://") {
            #[cfg(feature = "spanner")]
            spanner::parse_database(db)?;
            Ok(StoreUrl::Spanner(db.to_string()))
        } else if url.contains("://") {
            anyhow::bail!("unsupported store URL {url:?}: expected sqlite://PATH or spanner://projects/P/instances/I/databases/D")
        } else {
            Ok(StoreUrl::Sqlite(url.into()))
        }
    }
}

/// Open an existing store from its URL.
pub fn open<'a>(url: &'a str, options: &'a StoreOptions) -> crate::BoxFuture<'a, anyhow::Result<Arc<dyn Store>>> {
    Box::pin(async move {
        Ok(match StoreUrl::parse(url)? {
            StoreUrl::Sqlite(path) => Arc::new(sqlite::SqliteStore::open(&path, options)?),
            StoreUrl::Spanner(db) => spanner_open(&db, None, options).await?,
        })
    })
}

#[cfg(feature = "spanner")]
async fn spanner_open(db: &str, init_ddl: Option<&str>, options: &StoreOptions) -> anyhow::Result<Arc<dyn Store>> {
    Ok(match init_ddl {
        None => Arc::new(spanner::SpannerStore::open(&options.spanner(db), options).await?),
        Some(ddl) => Arc::new(spanner::SpannerStore::init(&options.spanner(db), ddl, options).await?),
    })
}

/// Built without the `spanner` feature (the handler test kit's light
/// build): only SQLite.
#[cfg(not(feature = "spanner"))]
async fn spanner_open(db: &str, _init_ddl: Option<&str>, _options: &StoreOptions) -> anyhow::Result<Arc<dyn Store>> {
    anyhow::bail!("spanner://{db}: this onceq was built without the `spanner` feature")
}

/// Create a store (`onceq init`): onceq's tables plus the business DDL.
pub fn init<'a>(url: &'a str, business_ddl: &'a str, options: &'a StoreOptions) -> crate::BoxFuture<'a, anyhow::Result<Arc<dyn Store>>> {
    Box::pin(async move {
        refuse_reserved_tables(business_ddl)?;
        Ok(match StoreUrl::parse(url)? {
            StoreUrl::Sqlite(path) => Arc::new(sqlite::SqliteStore::init(&path, business_ddl, options)?),
            StoreUrl::Spanner(db) => spanner_open(&db, Some(business_ddl), options).await?,
        })
    })
}

/// A schema may not create a table in onceq's own namespace (`onceq_`, in
/// any case): it would be read as one of onceq's tables and silently left
/// out of the schema, the types and the grants.
pub fn refuse_reserved_tables(ddl: &str) -> anyhow::Result<()> {
    match crate::names::reserved_table_in_ddl(ddl) {
        Some(t) => anyhow::bail!(
            "table {}: names starting with \"onceq_\" (in any case) are reserved for onceq's own tables; rename it (nothing was changed)",
            crate::names::quoted(&t, 60)
        ),
        None => Ok(()),
    }
}

/// How long [`Store::write_check`] tries to take the write lock.
pub const WRITE_CHECK_WITHIN: Duration = Duration::from_secs(2);

/// Store settings that are not part of the URL.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// How long producer dedup keys are remembered.
    pub dedup_window: Duration,
    /// SQLite `synchronous`: "full" (fsync every commit) or "normal".
    pub sqlite_synchronous: String,
    /// Spanner: shards per queue key range.
    pub spanner_shards: u32,
    /// Spanner: clients in the pool (concurrent operations).
    pub spanner_clients: usize,
    /// Spanner: one client per operation (`None`: only on the emulator).
    pub spanner_exclusive_clients: Option<bool>,
    /// Spanner: the deadline of every call (a read, a transaction with its
    /// commit, a client's creation); one that passes replaces the
    /// connection.
    pub spanner_call_timeout: Duration,
    /// Spanner: rows of `onceq_counts` per queue; each batch commit adds
    /// to one at random. Not a setting (`make sim`: 64 rows cost 100 hosts
    /// 40% of their throughput in aborts, 1,024 next to nothing).
    pub spanner_count_rows: u32,
    /// Spanner: how a database onceq creates forgets expired dedup keys
    /// (`spanner.expiry`).
    pub spanner_expiry: SpannerExpiry,
    /// Spanner, without a row deletion policy: how often one host purges
    /// expired dedup keys (the others skip their turn). Not a setting.
    pub spanner_purge_every: Duration,
    /// Group commit (`[commit]`).
    pub commit: commit::CommitOptions,
}

/// How a Spanner database that onceq creates forgets expired dedup keys
/// (`spanner.expiry`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpannerExpiry {
    /// A row deletion policy (TTL) on `onceq_dedup`: Spanner deletes
    /// expired keys in the background (within days; reads ignore them
    /// from the moment they expire), no purge transaction at all.
    #[default]
    Ttl,
    /// No policy: one host a minute deletes them with Partitioned DML.
    Purge,
}

impl StoreOptions {
    #[cfg(feature = "spanner")]
    fn spanner(&self, database: &str) -> spanner::SpannerOptions {
        spanner::SpannerOptions {
            database: database.to_string(),
            shards: self.spanner_shards,
            clients: self.spanner_clients,
            exclusive: self.spanner_exclusive_clients,
            call_timeout: self.spanner_call_timeout,
        }
    }
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            dedup_window: Duration::from_secs(24 * 3600),
            sqlite_synchronous: "full".to_string(),
            spanner_shards: 8,
            spanner_clients: 16,
            spanner_exclusive_clients: None,
            spanner_call_timeout: Duration::from_secs(10),
            spanner_count_rows: 1_024,
            spanner_expiry: SpannerExpiry::Ttl,
            spanner_purge_every: Duration::from_secs(50),
            commit: commit::CommitOptions::default(),
        }
    }
}
