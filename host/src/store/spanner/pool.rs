//! The clients of one database ([`Pool`]), the deadline every call runs
//! under, read-write transactions with their abort re-runs, and the
//! emulator's turns.

use super::*;

/// The clients of one database, and the connection they share.
///
/// Every call runs under a deadline (`spanner.call_timeout`, [`Pool::within`]).
/// Google's client sets no transport keepalive, so a connection whose peer
/// vanished (a NAT or proxy dropped the flow, a front end restarted) can
/// leave calls waiting forever; a call that misses its deadline therefore
/// replaces the connection: a new generation of clients on new channels,
/// while calls still holding an old client finish or miss their own
/// deadline.
pub(super) struct Pool {
    pub(super) exclusive: bool,
    pub(super) database: String,
    pub(super) max: usize,
    pub(super) call_timeout: Duration,
    pub(super) state: Mutex<Conn>,
    pub(super) ready: tokio::sync::Notify,
    /// On the emulator, which runs one read-write transaction at a time and
    /// aborts any other at once, read-write transactions take turns, in
    /// this process and with the other processes of the machine, instead of
    /// aborting each other ([`super::turns`]: without them even one host
    /// is slowed to a crawl by its own aborts).
    pub(super) turns: Option<super::turns::Turns>,
    /// The newest commit timestamp of this process's read-write
    /// transactions on the database, and when its answer came: handlers'
    /// point reads are at least that new ([`super::reads`]), and a commit
    /// soon after takes its clock from it ([`Pool::clock`]).
    committed: Mutex<Option<(wkt::Timestamp, std::time::Instant)>>,
}

/// One generation of the connection.
pub(super) struct Conn {
    pub(super) generation: u64,
    /// The channels; `None` after a replacement, until the next call.
    pub(super) spanner: Option<Spanner>,
    /// Clients not lent out (exclusive mode), or the one shared client.
    pub(super) free: Vec<DatabaseClient>,
    /// Clients of this generation created (or being created).
    pub(super) made: usize,
    pub(super) replaced_at: Option<tokio::time::Instant>,
}

/// A client checked out of the pool; returned on drop (clients are cheap
/// `Arc` clones).
pub(super) struct Lent {
    pub(super) pool: Arc<Pool>,
    pub(super) client: DatabaseClient,
    pub(super) generation: u64,
}

impl std::ops::Deref for Lent {
    type Target = DatabaseClient;
    fn deref(&self) -> &DatabaseClient {
        &self.client
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        if !self.pool.exclusive {
            return;
        }
        if let Ok(mut c) = self.pool.state.lock() {
            // A client of a replaced generation is dropped with its channels.
            if c.generation == self.generation {
                c.free.push(self.client.clone());
            }
        }
        self.pool.ready.notify_one();
    }
}

impl Pool {
    pub(super) fn new(spanner: Spanner, opts: &SpannerOptions, exclusive: bool, emulator: bool) -> Pool {
        Pool {
            turns: emulator.then(|| super::turns::Turns::new(&opts.database)),
            exclusive,
            database: opts.database.clone(),
            max: if exclusive { opts.clients.max(1) } else { 1 },
            call_timeout: opts.call_timeout,
            state: Mutex::new(Conn {
                generation: 0,
                spanner: Some(spanner),
                free: Vec::new(),
                made: 0,
                replaced_at: None,
            }),
            ready: tokio::sync::Notify::new(),
            committed: Mutex::new(None),
        }
    }

    /// The newest commit timestamp this process saw on the database, if
    /// its answer came within [`RECENT_COMMIT`].
    pub(super) fn committed(&self) -> Option<wkt::Timestamp> {
        self.recent_commit().map(|(at, _)| at)
    }

    /// The database's clock in microseconds, without asking it: the newest
    /// commit timestamp this process saw (within [`RECENT_COMMIT`]),
    /// advanced by the host's monotonic clock since its answer came. Behind
    /// the database's clock by that answer's latency, never ahead of it.
    pub(super) fn clock(&self) -> Option<i64> {
        let (at, seen) = self.recent_commit()?;
        micros_of(&at).checked_add(i64::try_from(seen.elapsed().as_micros()).ok()?)
    }

    fn recent_commit(&self) -> Option<(wkt::Timestamp, std::time::Instant)> {
        let c = self.committed.lock().ok()?;
        c.filter(|(_, seen)| seen.elapsed() < RECENT_COMMIT)
    }

    fn saw_commit(&self, at: Option<wkt::Timestamp>) {
        let Some(at) = at else { return };
        if let Ok(mut c) = self.committed.lock() {
            if c.is_none_or(|(seen, _)| seen < at) {
                *c = Some((at, std::time::Instant::now()));
            }
        }
    }

    pub(super) fn conn(&self) -> StoreResult<std::sync::MutexGuard<'_, Conn>> {
        self.state
            .lock()
            .map_err(|_| StoreError::Permanent("the Spanner client pool is poisoned".into()))
    }

    /// A client: a free one, a new one while fewer than `max` exist, or the
    /// next one returned (waiting at most the call deadline).
    pub(super) async fn get(self: &Arc<Self>) -> StoreResult<Lent> {
        let waited = tokio::time::Instant::now();
        loop {
            let notified = self.ready.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let build = {
                let mut c = self.conn()?;
                let generation = c.generation;
                let free = if self.exclusive { c.free.pop() } else { c.free.first().cloned() };
                if let Some(client) = free {
                    return Ok(Lent {
                        pool: self.clone(),
                        client,
                        generation,
                    });
                }
                if c.made < self.max {
                    c.made += 1;
                    Some((generation, c.spanner.clone()))
                } else {
                    None
                }
            };
            let Some((generation, spanner)) = build else {
                let left = self.call_timeout.saturating_sub(waited.elapsed());
                if tokio::time::timeout(left, notified).await.is_err() {
                    return Err(StoreError::Unavailable(format!(
                        "no Spanner client came free within {} (spanner.call_timeout; spanner.clients = {})",
                        crate::names::duration(self.call_timeout),
                        self.max
                    )));
                }
                continue;
            };
            let created = self.create(spanner).await;
            let mut c = self.conn()?;
            let current = c.generation == generation;
            return match created {
                Ok((spanner, client)) => {
                    if current {
                        c.spanner.get_or_insert(spanner);
                        if !self.exclusive {
                            c.free.push(client.clone());
                        }
                    }
                    drop(c);
                    self.ready.notify_waiters();
                    Ok(Lent {
                        pool: self.clone(),
                        client,
                        generation,
                    })
                }
                Err(e) => {
                    if current {
                        c.made = c.made.saturating_sub(1);
                    }
                    drop(c);
                    self.ready.notify_one();
                    Err(e)
                }
            };
        }
    }

    /// A new client (and new channels when the connection was replaced),
    /// within the call deadline.
    pub(super) async fn create(&self, spanner: Option<Spanner>) -> StoreResult<(Spanner, DatabaseClient)> {
        let make = async {
            let spanner = match spanner {
                Some(s) => s,
                None => Spanner::builder()
                    .build()
                    .await
                    .map_err(|e| StoreError::Unavailable(format!("connecting to Spanner: {e}")))?,
            };
            let client = spanner.database_client(self.database.clone()).build().await.map_err(classify)?;
            Ok((spanner, client))
        };
        match tokio::time::timeout(self.call_timeout, make).await {
            Ok(r) => r,
            Err(_) => {
                self.replace("creating a client");
                Err(StoreError::Unavailable(self.late("creating a client")))
            }
        }
    }

    pub(super) fn late(&self, what: &str) -> String {
        format!(
            "Spanner did not answer {what} within {} (spanner.call_timeout); the connection is replaced",
            crate::names::duration(self.call_timeout)
        )
    }

    /// Drop this generation of clients and channels: the next call connects
    /// afresh. Once per deadline, however many calls missed it together.
    pub(super) fn replace(&self, what: &str) {
        let Ok(mut c) = self.state.lock() else { return };
        let now = tokio::time::Instant::now();
        if c.replaced_at.is_some_and(|t| now.duration_since(t) < self.call_timeout) {
            return;
        }
        c.generation += 1;
        c.spanner = None;
        c.free.clear();
        c.made = 0;
        c.replaced_at = Some(now);
        drop(c);
        tracing::warn!(
            "Spanner did not answer {what} within {}: replacing the connection (calls still on the old one end at their deadline)",
            crate::names::duration(self.call_timeout)
        );
        self.ready.notify_waiters();
    }

    /// Run `call` under the call deadline. A call that misses it replaces
    /// the connection and fails: with an unknown outcome if it `writes`
    /// (it may have committed), else as unavailable (safe to retry).
    pub(super) async fn within<T>(
        &self,
        what: &str,
        writes: bool,
        call: impl std::future::Future<Output = StoreResult<T>>,
    ) -> StoreResult<T> {
        match tokio::time::timeout(self.call_timeout, call).await {
            Ok(r) => r,
            Err(_) => {
                self.replace(what);
                let text = self.late(what);
                Err(if writes {
                    StoreError::UnknownOutcome(text)
                } else {
                    StoreError::Unavailable(text)
                })
            }
        }
    }
}

impl Pool {
    /// Start `work` once this host's turn at the emulator came, and run it
    /// holding the turn (its read-write transactions take none of their
    /// own), so what `work` collects when it starts includes what arrived
    /// during the wait. Without turns (real Spanner) it starts at once; if
    /// no turn came within the call deadline, it starts anyway and its
    /// transactions ask for their own (and report the wait if they time
    /// out too).
    pub(super) async fn in_turn<T, Fut: std::future::Future<Output = T>>(&self, work: impl FnOnce() -> Fut) -> T {
        let Some(turns) = &self.turns else { return work().await };
        match turns.take(self.call_timeout).await {
            Ok(turn) => {
                let out = TURN_HELD.scope((), work()).await;
                drop(turn);
                out
            }
            Err(_) => work().await,
        }
    }

    /// [`SpannerStore::rw`]: a read-write transaction on a lent client,
    /// each attempt under the call deadline.
    ///
    /// Aborted attempts are re-run here rather than in the client (whose
    /// backoff grows to a second): after a short jittered pause, for up to
    /// the call deadline. On the emulator, which aborts every transaction
    /// but one at once, transactions also take turns ([`Pool::turns`]);
    /// hosts on other machines still abort each other, and a short pause
    /// keeps the emulator busy instead of idle while the losers sleep.
    pub(super) async fn rw<T, F, Fut>(self: &Arc<Self>, what: &str, work: F) -> StoreResult<T>
    where
        F: FnMut(RwTx) -> Fut + Send + Clone,
        Fut: std::future::Future<Output = google_cloud_spanner::Result<T>> + Send,
        T: Send,
    {
        let asked = tokio::time::Instant::now();
        let held = TURN_HELD.try_with(|_| ()).is_ok();
        let _turn = match &self.turns {
            _ if held => None,
            None => None,
            Some(turns) => match turns.take(self.call_timeout).await {
                Ok(turn) => Some(turn),
                Err(waited_for) => {
                    return Err(StoreError::Unavailable(format!(
                        "{what}: waited {} for {waited_for} at the emulator (spanner.call_timeout)",
                        crate::names::duration(self.call_timeout)
                    )))
                }
            },
        };
        let started = tokio::time::Instant::now();
        let mut aborts = 0u32;
        loop {
            let attempt = self
                .within(what, true, async {
                    let c = self.get().await?;
                    run_rw(&c, self.call_timeout, work.clone()).await
                })
                .await
                .map(|(result, at)| {
                    self.saw_commit(at);
                    result
                });
            match attempt {
                Err(StoreError::Aborted(_)) if started.elapsed() < self.call_timeout => {
                    aborts += 1;
                    tokio::time::sleep(abort_pause(aborts)).await;
                }
                other => {
                    tracing::trace!(
                        what,
                        turn_us = (started - asked).as_micros() as u64,
                        took_us = started.elapsed().as_micros() as u64,
                        aborts,
                        ok = other.is_ok(),
                        "read-write transaction"
                    );
                    return other;
                }
            }
        }
    }
}

/// How long a commit's timestamp stands in for the database's clock
/// ([`Pool::clock`]) and bounds handlers' point reads ([`super::reads`]):
/// under load commits come every few milliseconds; an idle host asks.
pub(super) const RECENT_COMMIT: Duration = Duration::from_secs(1);

/// Attempts of one read-write transaction the client's runner makes
/// across aborts, keeping the first attempt's lock priority.
const ABORT_ATTEMPTS: u32 = 8;

/// The pause before re-running an aborted transaction: 2 ms growing by
/// half per abort up to 50 ms, jittered (full jitter).
pub(super) fn abort_pause(aborts: u32) -> Duration {
    let cap = (2.0 * 1.5f64.powi(aborts.min(20) as i32)).min(50.0);
    Duration::from_micros((rand::random::<f64>() * cap * 1000.0) as u64)
}

/// Run a read-write transaction with an ordinary closure returning an owned
/// future (which is an `AsyncFnMut` through the standard library's blanket
/// impl, without the lifetime trouble of borrowing async closures): its
/// result, and the commit's timestamp.
///
/// The client's own transaction timeout ends it a little before the call
/// deadline: re-runs after aborts stop, and what was begun is rolled back
/// (on the emulator an abandoned transaction would hold its locks until it
/// expires).
pub(super) async fn run_rw<T, F, Fut>(client: &DatabaseClient, deadline: Duration, mut work: F) -> StoreResult<(T, Option<wkt::Timestamp>)>
where
    F: FnMut(RwTx) -> Fut + Send,
    Fut: std::future::Future<Output = google_cloud_spanner::Result<T>> + Send,
    T: Send,
{
    client
        .read_write_transaction()
        .with_transaction_timeout(deadline.mul_f64(0.8))
        // Serializable, said rather than left to the database's default
        // (which an administrator can set to repeatable read): the ack's
        // re-read of what the handler read relies on it.
        .set_isolation_level(google_cloud_spanner::model::transaction_options::IsolationLevel::Serializable)
        // The client's runner re-runs an aborted attempt itself, passing
        // the aborted transaction's id (`multiplexed_session_previous_
        // transaction_id`), so the retry keeps its wound-wait priority: a
        // 64-message batch, the largest lock set, is not made young by
        // every abort and starved. After ABORT_ATTEMPTS, `Pool::rw` starts
        // over with a new transaction (until its deadline).
        .with_retry_policy(google_cloud_spanner::transaction::BasicTransactionRetryPolicy::new().with_max_attempts(ABORT_ATTEMPTS))
        .build()
        .run(move |tx: RwTx| work(tx))
        .await
        .map(|r| {
            let at = r.commit_timestamp();
            (r.into_inner(), at)
        })
        .map_err(classify)
}

tokio::task_local! {
    /// Set while work holds this host's turn at the emulator
    /// ([`Pool::in_turn`]): [`Pool::rw`] takes none of its own.
    static TURN_HELD: ();
}
