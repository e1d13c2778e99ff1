//! The [`Store`] implementation: sends, failure records, dead letters,
//! listings and counts (the lease is in `lease.rs`, the batch commit in
//! `batch.rs`).

use super::*;

impl SpannerStore {
    /// Run a `DELETE` as Partitioned DML, in the emulator's turn, within
    /// [`PURGE_DEADLINE`]; how many rows it removed.
    async fn partitioned_delete(&self, what: &'static str, stmt: Statement) -> StoreResult<u64> {
        let pool = self.pool.clone();
        let deleted = self
            .pool
            .in_turn(move || async move {
                let c = pool.get().await?;
                tokio::time::timeout(PURGE_DEADLINE, c.partitioned_dml_transaction().build().execute_update(stmt))
                    .await
                    .map_err(|_| StoreError::Unavailable(format!("{what}: no answer within {}", crate::names::duration(PURGE_DEADLINE))))?
                    .map_err(classify)
            })
            .await?;
        Ok(deleted.max(0) as u64)
    }

    /// `UPDATE onceq_messages SET <set> WHERE <lease>`: exactly one row, or
    /// `LeaseLost`.
    pub(super) async fn guarded_update(&self, what: &str, lease: &Lease, set: &str, n: i64, text: Option<String>) -> StoreResult<()> {
        let (shard, id) = (lease.shard, lease.message_id.clone());
        let sql = format!("UPDATE onceq_messages SET {set} WHERE shard = @s AND id = @id AND lease_token = @t");
        let token = lease.token.clone();
        let id2 = id.clone();
        let count = self
            .rw(what, move |tx| {
                let mut b = Statement::builder(sql.clone())
                    .add_param("s", shard)
                    .add_param("id", id2.clone())
                    .add_param("t", token.clone())
                    .add_param("n", n);
                if let Some(t) = &text {
                    b = b.add_param("x", t.clone());
                }
                let stmt = b.build();
                async move { tx.execute_update(stmt).await }
            })
            .await?;
        if count == 1 {
            Ok(())
        } else {
            Err(StoreError::LeaseLost { message_id: id })
        }
    }

    /// Whether this host does `chore` now: true at most once per `every`
    /// across every host of the database (the first to ask once it is due
    /// takes the turn and sets the next one), so a chore that reads a whole
    /// table runs once per period, not once per host.
    pub(super) async fn chore_turn(&self, chore: &'static str, every: Duration) -> StoreResult<bool> {
        let every = micros(every);
        let query = Statement::builder(format!("SELECT {NOW}, (SELECT next_at FROM onceq_chores WHERE chore = @c)"))
            .add_param("c", chore.to_string())
            .build();
        let turn = Mutation::new_insert_or_update_builder("onceq_chores")
            .set("chore")
            .to(chore.to_string())
            .set("holder")
            .to(&self.instance);
        self.rw("a chore's turn", move |tx| {
            let (query, turn) = (query.clone(), turn.clone());
            async move {
                let mut rs = tx.execute_query(query).await?;
                let mut due = None;
                while let Some(r) = rs.next().await {
                    let r = r?;
                    let (now, next_at) = (r.get::<i64>(0)?, r.get::<Option<i64>>(1)?);
                    if next_at.is_none_or(|at| at <= now) {
                        due = Some(now);
                    }
                }
                let Some(now) = due else { return Ok(false) };
                tx.buffer(vec![turn.set("next_at").to(now.saturating_add(every)).build()])?;
                Ok(true)
            }
        })
        .await
    }

    pub(super) async fn query_rows(&self, stmt: Statement, table: &TableSchema) -> StoreResult<Vec<Row>> {
        self.pool
            .within(&format!("a query of {}", table.name), false, async {
                let c = self.pool.get().await?;
                let rs = c.single_use().build().execute_query(stmt).await.map_err(classify)?;
                collect(table, rs).await
            })
            .await
    }

    /// The messages' counts per queue: one query of `onceq_messages`
    /// (`Store::backlog`, and the first of `stats`).
    async fn backlog_now(&self, c: &DatabaseClient) -> StoreResult<std::collections::BTreeMap<String, QueueStats>> {
        let mut by_queue: std::collections::BTreeMap<String, QueueStats> = Default::default();
        let mut rs = c
            .single_use()
            .build()
            .execute_query(
                Statement::builder(format!(
                    "SELECT queue, COUNTIF(visible_at <= {NOW}), COUNTIF(visible_at > {NOW} AND lease_token IS NOT NULL),
                        COUNTIF(visible_at > {NOW} AND lease_token IS NULL),
                        MIN(IF(visible_at > {NOW} AND lease_token IS NULL, DIV(visible_at - {NOW}, 1000), NULL)),
                        COUNTIF(visible_at <= {NOW} AND lease_token IS NOT NULL)
                 FROM onceq_messages GROUP BY queue"
                ))
                .build(),
            )
            .await
            .map_err(classify)?;
        while let Some(r) = rs.next().await {
            let r = r.map_err(classify)?;
            let q: String = r.get(0).map_err(classify)?;
            let e = queue_entry(&mut by_queue, q);
            e.ready = r.get::<i64>(1).map_err(classify)? as u64;
            e.leased = r.get::<i64>(2).map_err(classify)? as u64;
            e.delayed = r.get::<i64>(3).map_err(classify)? as u64;
            e.next_due_ms = r.get::<Option<i64>>(4).map_err(classify)?.map(|ms| ms.max(0) as u64);
            e.expired_leases = r.get::<i64>(5).map_err(classify)? as u64;
        }
        Ok(by_queue)
    }

    /// The queue counts ([`Store::stats`]), without the deadline.
    pub(super) async fn stats_now(&self) -> StoreResult<Stats> {
        // The four reads at once, each on a client of its own (with
        // exclusive clients, the emulator's, a client serves one at a time).
        let (mut by_queue, processed, dead, dedup) = tokio::try_join!(
            async { self.backlog_now(&*self.pool.get().await?).await },
            async {
                let mut processed = Vec::new();
                if !self.counts {
                    return Ok(processed);
                }
                let c = self.pool.get().await?;
                let mut rs = c
                    .single_use()
                    .build()
                    .execute_query(
                        Statement::builder("SELECT queue, SUM(processed), MAX(last_at) FROM onceq_counts GROUP BY queue").build(),
                    )
                    .await
                    .map_err(classify)?;
                while let Some(r) = rs.next().await {
                    let r = r.map_err(classify)?;
                    let (q, n, at) = (
                        r.get::<String>(0).map_err(classify)?,
                        r.get::<i64>(1).map_err(classify)?.max(0) as u64,
                        r.get::<Option<i64>>(2).map_err(classify)?,
                    );
                    processed.push((q, n, at));
                }
                StoreResult::Ok(processed)
            },
            async {
                counts_by_queue(
                    &*self.pool.get().await?,
                    "SELECT queue, COUNT(*) FROM onceq_dead_letters GROUP BY queue".to_string(),
                )
                .await
            },
            async {
                counts_by_queue(
                    &*self.pool.get().await?,
                    format!("SELECT queue, COUNT(*) FROM onceq_dedup WHERE expires_at > {NOW} GROUP BY queue"),
                )
                .await
            },
        )?;
        for (q, n, at) in processed {
            let e = queue_entry(&mut by_queue, q);
            (e.processed, e.last_processed_at) = (n, at);
        }
        for (q, n) in dead {
            queue_entry(&mut by_queue, q).dead = n;
        }
        for (q, n) in dedup {
            queue_entry(&mut by_queue, q).dedup_keys = n;
        }
        Ok(Stats {
            queues: by_queue.into_values().collect(),
        })
    }

    /// A pseudo-schema for onceq's own tables, to reuse the typed reader.
    pub(super) fn system_table(name: &str, cols: &[(&str, ColumnType)]) -> TableSchema {
        TableSchema {
            name: name.into(),
            columns: cols
                .iter()
                .map(|(n, t)| ColumnSchema {
                    name: n.to_string(),
                    ty: *t,
                    nullable: true,
                    has_default: false,
                })
                .collect(),
            primary_key: vec![0],
        }
    }
}

pub(super) fn dead_letter_table() -> TableSchema {
    use ColumnType::*;
    SpannerStore::system_table(
        "onceq_dead_letters",
        &[
            ("id", String),
            ("queue", String),
            ("payload", Bytes),
            ("attributes", String),
            ("attempts", Int64),
            ("enqueued_at", Int64),
            ("failed_at", Int64),
            ("reason", String),
            ("handler_version", String),
            ("failures", Int64),
        ],
    )
}

/// The deadline of one dedup purge (Partitioned DML runs as long as the
/// table is large, beyond the deadline of one call).
const PURGE_DEADLINE: Duration = Duration::from_secs(600);

pub(super) const DEAD_COLUMNS: &str = "id, queue, payload, attributes, attempts, enqueued_at, failed_at, reason, handler_version, failures";

/// Column `i` of a row read with a system table's schema, as text ("" when
/// NULL).
fn text_at(row: &Row, i: usize) -> std::string::String {
    match row.get(i) {
        Some((_, Value::String(s))) => s.clone(),
        _ => std::string::String::new(),
    }
}

/// Column `i` as an integer (0 when NULL).
fn int_at(row: &Row, i: usize) -> i64 {
    match row.get(i) {
        Some((_, Value::Int64(n))) => *n,
        _ => 0,
    }
}

pub(super) fn dead_letter_from(row: Row) -> DeadLetter {
    let get = |i: usize| row.get(i).map(|(_, v)| v.clone()).unwrap_or(Value::Null);
    let s = |i: usize| text_at(&row, i);
    let n = |i: usize| int_at(&row, i);
    let payload = match get(2) {
        Value::Bytes(b) => b,
        _ => vec![],
    };
    DeadLetter {
        id: s(0),
        queue: s(1),
        payload_text: std::string::String::from_utf8_lossy(&payload).into_owned(),
        payload,
        attributes: attrs_from_json(&s(3)),
        deliveries: u32::try_from(n(4)).unwrap_or(0),
        failures: u32::try_from(n(9)).unwrap_or(0),
        enqueued_at: n(5),
        failed_at: n(6),
        reason: s(7),
        handler_version: match get(8) {
            Value::String(v) => Some(v),
            _ => None,
        },
    }
}

#[async_trait]
impl Store for SpannerStore {
    fn kind(&self) -> &'static str {
        "spanner"
    }

    fn commit_observe(&self, observer: commit::BatchObserver) {
        self.group.observe(observer)
    }

    /// Not on Spanner: a follow-up is inserted ready and leased from the
    /// table, by whichever host gets it first.
    fn handoff(&self) -> bool {
        false
    }

    fn commit_stats(&self) -> Option<commit::CommitStats> {
        let mut stats = self.group.stats();
        stats.split_batches = self.splits.load(std::sync::atomic::Ordering::Relaxed);
        stats.point_reads = self.reads.keys.load(std::sync::atomic::Ordering::Relaxed);
        stats.point_read_calls = self.reads.calls.load(std::sync::atomic::Ordering::Relaxed);
        Some(stats)
    }

    fn schema(&self) -> Arc<Schema> {
        self.schema.clone()
    }

    async fn message_send(&self, params: Vec<SendParams>) -> StoreResult<Vec<SendOutcome>> {
        let (shards, window, schema) = (self.shards, self.options.dedup_window, self.schema.clone());
        let params = Arc::new(params);
        self.rw("a send", move |tx| {
            let (params, schema) = (params.clone(), schema.clone());
            async move {
                let seen = read_ahead(&tx, &[], &params, false, None, None).await?;
                let mut ex = SpannerExec::new(&schema, seen, false);
                let mut out = Vec::with_capacity(params.len());
                for p in params.iter() {
                    // Claims and inserts are kept, never run here: no error.
                    out.push(commit::send(&mut ex, p, window).await.map_err(carried)?);
                }
                ex.write_all(&tx, shards, None).await?;
                Ok(out)
            }
        })
        .await
    }

    /// On the emulator, take the turn first and collect the requests then
    /// (as [`SpannerBatch::commit_collected`] does for commits).
    async fn message_lease_collected(
        &self,
        queue: &str,
        lease: Duration,
        collect: &(dyn Fn() -> usize + Send + Sync),
    ) -> StoreResult<Vec<LeasedMessage>> {
        self.lease_collected(queue, lease, collect).await
    }

    async fn message_lease(&self, p: LeaseParams) -> StoreResult<Vec<LeasedMessage>> {
        self.lease(p).await
    }

    async fn message_lease_renew(&self, leases: &[Lease], duration: Duration) -> StoreResult<Vec<bool>> {
        self.lease_renew(leases, duration).await
    }

    async fn message_release(&self, lease: &Lease) -> StoreResult<()> {
        self.guarded_update(
            "a release",
            lease,
            &format!("visible_at = {NOW} + @n, lease_token = NULL, attempt = GREATEST(attempt - 1, 0)"),
            0,
            None,
        )
        .await
    }

    async fn message_retry_later(&self, lease: &Lease, p: RetryParams) -> StoreResult<()> {
        let failures = if p.failed { "failures = failures + 1, " } else { "" };
        self.guarded_update(
            "a retry later",
            lease,
            &format!("{failures}visible_at = {NOW} + @n, lease_token = NULL, last_error = @x"),
            micros(p.delay),
            Some(p.reason),
        )
        .await
    }

    async fn message_dead_letter(&self, lease: &Lease, p: DeadLetterParams) -> StoreResult<()> {
        let (shard, id) = (lease.shard, lease.message_id.clone());
        let clear = Statement::builder("DELETE FROM onceq_dead_letters WHERE id = @id")
            .add_param("id", id.clone())
            .build();
        let copy = Statement::builder(format!(
            "INSERT INTO onceq_dead_letters (id, queue, payload, attributes, attempts, enqueued_at, failed_at, reason, handler_version, failures)
             SELECT id, queue, payload, attributes, attempt, enqueued_at, {NOW}, @r, @v, failures + @f FROM onceq_messages
             WHERE shard = @s AND id = @id AND lease_token = @t"
        ))
        .add_param("f", i64::from(p.failed))
        .add_param("s", shard)
        .add_param("id", id.clone())
        .add_param("t", lease.token.clone())
        .add_typed_param("r", p.reason.clone(), google_cloud_spanner::types::string())
        .add_typed_param("v", p.handler_version.clone(), google_cloud_spanner::types::string())
        .build();
        let delete =
            Statement::builder("DELETE FROM onceq_messages WHERE shard = @s AND id = @id AND lease_token = @t ASSERT_ROWS_MODIFIED 1")
                .add_param("s", shard)
                .add_param("id", id)
                .add_param("t", lease.token.clone())
                .build();
        self.rw("a dead letter", move |tx| {
            let (clear, copy, delete) = (clear.clone(), copy.clone(), delete.clone());
            async move {
                tx.execute_update(clear).await?;
                tx.execute_update(copy).await?;
                tx.execute_update(delete).await
            }
        })
        .await
        .map(|_| ())
        .map_err(|e| lease_error(e, lease))
    }

    async fn commit_hold(&self) -> StoreResult<Option<commit::Hold>> {
        self.group.hold().await.map(Some)
    }

    async fn close(&self) {
        self.group.stop().await
    }

    async fn transaction_begin(&self) -> StoreResult<Box<dyn Transaction>> {
        let snapshot = SpannerSnapshot {
            pool: self.pool.clone(),
            reads: self.reads.clone(),
            ro: None,
        };
        Ok(Box::new(commit::Buffered::new(snapshot, self.group.clone())))
    }

    async fn stats(&self) -> StoreResult<Stats> {
        self.pool.within("the stats queries", false, self.stats_now()).await
    }

    async fn backlog(&self) -> StoreResult<Stats> {
        self.pool
            .within("the backlog query", false, async {
                let c = self.pool.get().await?;
                Ok(Stats {
                    queues: self.backlog_now(&c).await?.into_values().collect(),
                })
            })
            .await
    }

    async fn dead_letter_list(&self, queues: Queues<'_>, limit: usize) -> StoreResult<Vec<DeadLetter>> {
        let t = dead_letter_table();
        let (cond, q) = queue_condition(queues);
        let stmt = Statement::builder(format!(
            "SELECT {DEAD_COLUMNS} FROM onceq_dead_letters
             WHERE {cond} ORDER BY failed_at DESC, id LIMIT @n"
        ))
        .add_param("q", q)
        .add_param("n", limit.min(i64::MAX as usize) as i64)
        .build();
        Ok(self.query_rows(stmt, &t).await?.into_iter().map(dead_letter_from).collect())
    }

    async fn dead_letter_get(&self, id: &str) -> StoreResult<Option<DeadLetter>> {
        let t = dead_letter_table();
        let stmt = Statement::builder(format!("SELECT {DEAD_COLUMNS} FROM onceq_dead_letters WHERE id = @id"))
            .add_param("id", id.to_string())
            .build();
        Ok(self.query_rows(stmt, &t).await?.into_iter().next().map(dead_letter_from))
    }

    async fn dead_letter_settle(&self, id: &str, how: Settle, audit: Option<&AuditEntry>) -> StoreResult<Option<String>> {
        let shard = shard_of(id, self.shards);
        let copy = Statement::builder(format!(
            "INSERT INTO onceq_messages (shard, id, queue, payload, attributes, attempt, enqueued_at, visible_at, failures)
             SELECT @s, id, queue, payload, attributes, 0, enqueued_at, {NOW}, 0 FROM onceq_dead_letters WHERE id = @id"
        ))
        .add_param("s", shard)
        .add_param("id", id.to_string())
        .build();
        let delete = Statement::builder("DELETE FROM onceq_dead_letters WHERE id = @id")
            .add_param("id", id.to_string())
            .build();
        let record = audit.map(audit_insert);
        let id = id.to_string();
        self.rw("a replay", move |tx| {
            let (copy, delete, id, record) = (copy.clone(), delete.clone(), id.clone(), record.clone());
            async move {
                if how == Settle::Replay && tx.execute_update(copy).await? == 0 {
                    return Ok(None);
                }
                if tx.execute_update(delete).await? == 0 {
                    return Ok(None);
                }
                if let Some(r) = record {
                    tx.execute_update(r).await?;
                }
                Ok(Some(id))
            }
        })
        .await
    }

    async fn message_browse(
        &self,
        queue: &str,
        state: LiveState,
        after: Option<&BrowseKey>,
        limit: usize,
    ) -> StoreResult<Vec<QueuedMessage>> {
        let cond = match state {
            LiveState::Ready => format!("visible_at <= {NOW}"),
            LiveState::Delayed => format!("visible_at > {NOW} AND lease_token IS NULL"),
            LiveState::Leased => format!("visible_at > {NOW} AND lease_token IS NOT NULL"),
        };
        let (at, id) = after.map_or((i64::MIN, String::new()), |k| (k.at, k.id.clone()));
        let stmt = Statement::builder(format!(
            "SELECT {QUEUED_COLUMNS} FROM onceq_messages
             WHERE queue = @q AND {cond} AND visible_at >= @at AND (visible_at > @at OR id > @id)
             ORDER BY visible_at, id LIMIT @n"
        ))
        .add_param("q", queue.to_string())
        .add_param("at", at)
        .add_param("id", id)
        .add_param("n", limit.min(i64::MAX as usize) as i64)
        .build();
        Ok(self.query_rows(stmt, &queued_table()).await?.into_iter().map(queued_from).collect())
    }

    async fn dead_letter_browse(&self, queue: &str, after: Option<&BrowseKey>, limit: usize) -> StoreResult<Vec<DeadLetter>> {
        let (at, id) = after.map_or((i64::MAX, String::new()), |k| (k.at, k.id.clone()));
        let stmt = Statement::builder(format!(
            "SELECT {DEAD_COLUMNS} FROM onceq_dead_letters
             WHERE queue = @q AND failed_at <= @at AND (failed_at < @at OR id > @id)
             ORDER BY failed_at DESC, id LIMIT @n"
        ))
        .add_param("q", queue.to_string())
        .add_param("at", at)
        .add_param("id", id)
        .add_param("n", limit.min(i64::MAX as usize) as i64)
        .build();
        Ok(self
            .query_rows(stmt, &dead_letter_table())
            .await?
            .into_iter()
            .map(dead_letter_from)
            .collect())
    }

    async fn queue_pause(&self, queue: &str, pause: bool, audit: Option<&AuditEntry>) -> StoreResult<bool> {
        let by = audit.map_or_else(local_actor, |e| e.actor.clone());
        // Paused already: the row stays as it is (who paused it first, when).
        let present = Statement::builder("UPDATE onceq_paused SET actor = actor WHERE queue = @q")
            .add_param("q", queue.to_string())
            .build();
        let change = if pause {
            Statement::builder(format!(
                "INSERT INTO onceq_paused (queue, paused_at, actor) VALUES (@q, {NOW}, @by)"
            ))
            .add_param("q", queue.to_string())
            .add_param("by", by)
            .build()
        } else {
            Statement::builder("DELETE FROM onceq_paused WHERE queue = @q")
                .add_param("q", queue.to_string())
                .build()
        };
        let record = audit.map(audit_insert);
        self.rw("a pause", move |tx| {
            let (present, change, record) = (present.clone(), change.clone(), record.clone());
            async move {
                let n = if pause && tx.execute_update(present).await? > 0 {
                    0
                } else {
                    tx.execute_update(change).await?
                };
                if let Some(r) = record {
                    tx.execute_update(r).await?;
                }
                Ok(n > 0)
            }
        })
        .await
    }

    async fn queue_paused(&self) -> StoreResult<Vec<PausedQueue>> {
        use ColumnType::*;
        let t = Self::system_table("onceq_paused", &[("queue", String), ("paused_at", Int64), ("actor", String)]);
        let stmt = Statement::builder("SELECT queue, paused_at, actor FROM onceq_paused ORDER BY queue").build();
        Ok(self
            .query_rows(stmt, &t)
            .await?
            .into_iter()
            .map(|row| PausedQueue {
                queue: text_at(&row, 0),
                paused_at: int_at(&row, 1),
                by: text_at(&row, 2),
            })
            .collect())
    }

    async fn host_beat(&self, beat: &HostBeat) -> StoreResult<()> {
        let queues = serde_json::to_string(&beat.queues).unwrap_or_else(|_| "[]".into());
        let update = Statement::builder(format!(
            "UPDATE onceq_hosts SET seen_at = {NOW}, queues = @queues, in_flight = @in_flight, finished = @finished WHERE id = @id"
        ))
        .add_param("id", beat.id.clone())
        .add_param("queues", queues.clone())
        .add_param("in_flight", beat.in_flight)
        .add_param("finished", beat.finished)
        .build();
        let insert = Statement::builder(format!(
            "INSERT INTO onceq_hosts (id, name, pid, version, started_at, seen_at, queues, in_flight, finished)
             VALUES (@id, @name, @pid, @version, @started_at, {NOW}, @queues, @in_flight, @finished)"
        ))
        .add_param("id", beat.id.clone())
        .add_param("name", beat.name.clone())
        .add_param("pid", beat.pid)
        .add_param("version", beat.version.clone())
        .add_param("started_at", beat.started_at)
        .add_param("queues", queues)
        .add_param("in_flight", beat.in_flight)
        .add_param("finished", beat.finished)
        .build();
        self.rw("a heartbeat", move |tx| {
            let (update, insert) = (update.clone(), insert.clone());
            async move {
                if tx.execute_update(update).await? == 0 {
                    tx.execute_update(insert).await?;
                }
                Ok(())
            }
        })
        .await
    }

    async fn hosts_prune(&self, age: Duration) -> StoreResult<u64> {
        let stmt = Statement::builder(format!("DELETE FROM onceq_hosts WHERE seen_at < {NOW} - @age"))
            .add_param("age", micros(age))
            .build();
        self.partitioned_delete("the hosts prune", stmt).await
    }

    async fn hosts_seen(&self, within: Duration) -> StoreResult<Vec<HostBeat>> {
        use ColumnType::*;
        let t = Self::system_table(
            "onceq_hosts",
            &[
                ("id", String),
                ("name", String),
                ("pid", Int64),
                ("version", String),
                ("started_at", Int64),
                ("seen_at", Int64),
                ("queues", String),
                ("in_flight", Int64),
                ("finished", Int64),
            ],
        );
        let stmt = Statement::builder(format!(
            "SELECT id, name, pid, version, started_at, seen_at, queues, in_flight, finished FROM onceq_hosts
             WHERE seen_at >= {NOW} - @within ORDER BY seen_at DESC, id"
        ))
        .add_param("within", micros(within))
        .build();
        Ok(self
            .query_rows(stmt, &t)
            .await?
            .into_iter()
            .map(|row| HostBeat {
                id: text_at(&row, 0),
                name: text_at(&row, 1),
                pid: int_at(&row, 2),
                version: text_at(&row, 3),
                started_at: int_at(&row, 4),
                seen_at: int_at(&row, 5),
                queues: serde_json::from_str(&text_at(&row, 6)).unwrap_or_default(),
                in_flight: int_at(&row, 7),
                finished: int_at(&row, 8),
            })
            .collect())
    }

    async fn audit_append(&self, entry: &AuditEntry) -> StoreResult<()> {
        let stmt = audit_insert(entry);
        self.rw("an audit entry", move |tx| {
            let stmt = stmt.clone();
            async move { tx.execute_update(stmt).await.map(|_| ()) }
        })
        .await
    }

    async fn audit_list(&self, queues: Queues<'_>, limit: usize) -> StoreResult<Vec<AuditEntry>> {
        use ColumnType::*;
        let t = Self::system_table(
            "onceq_audit",
            &[
                ("at_us", Int64),
                ("actor", String),
                ("action", String),
                ("queue", String),
                ("subject", String),
                ("signer", String),
                ("result", String),
            ],
        );
        let (cond, q) = queue_condition(queues);
        let stmt = Statement::builder(format!(
            "SELECT at_us, actor, action, queue, subject, signer, result FROM onceq_audit WHERE {cond} ORDER BY at_us DESC, id LIMIT @n"
        ))
        .add_param("q", q)
        .add_param("n", limit.min(i64::MAX as usize) as i64)
        .build();
        Ok(self
            .query_rows(stmt, &t)
            .await?
            .into_iter()
            .map(|row| {
                let get = |i: usize| row.get(i).map(|(_, v)| v.clone()).unwrap_or(Value::Null);
                let opt = |i: usize| match get(i) {
                    Value::String(s) => Some(s),
                    _ => None,
                };
                AuditEntry {
                    at: match get(0) {
                        Value::Int64(n) => n,
                        _ => 0,
                    },
                    actor: opt(1).unwrap_or_default(),
                    action: opt(2).unwrap_or_default(),
                    queue: opt(3),
                    subject: opt(4).unwrap_or_default(),
                    signer: opt(5),
                    result: opt(6).unwrap_or_default(),
                }
            })
            .collect())
    }

    /// Partitioned DML, like the dedup purge: no commit limit to reach
    /// however many entries are old.
    async fn audit_prune(&self, age: Duration) -> StoreResult<u64> {
        let stmt = Statement::builder(format!("DELETE FROM onceq_audit WHERE at_us < {NOW} - @age"))
            .add_param("age", micros(age))
            .build();
        self.partitioned_delete("the audit prune", stmt).await
    }

    async fn message_list(&self, queues: Queues<'_>, limit: usize) -> StoreResult<Vec<QueuedMessage>> {
        let (cond, q) = queue_condition(queues);
        let stmt = Statement::builder(format!(
            "SELECT {QUEUED_COLUMNS} FROM onceq_messages WHERE {cond} ORDER BY enqueued_at, id LIMIT @n"
        ))
        .add_param("q", q)
        .add_param("n", limit.min(i64::MAX as usize) as i64)
        .build();
        let rows = self.query_rows(stmt, &queued_table()).await?;
        Ok(rows.into_iter().map(queued_from).collect())
    }

    async fn message_get(&self, id: &str) -> StoreResult<Option<QueuedMessage>> {
        let stmt = Statement::builder(format!("SELECT {QUEUED_COLUMNS} FROM onceq_messages WHERE shard = @s AND id = @id"))
            .add_param("s", shard_of(id, self.shards))
            .add_param("id", id.to_string())
            .build();
        let rows = self.query_rows(stmt, &queued_table()).await?;
        Ok(rows.into_iter().next().map(queued_from))
    }

    async fn table_rows(&self, table: &str) -> StoreResult<Vec<Row>> {
        let t = self.schema.table(table).map_err(|e| StoreError::Permanent(e.to_string()))?.clone();
        self.query_rows(select_stmt(&t, &[], Some(usize::MAX >> 2)), &t).await
    }

    /// Nothing where the database deletes expired keys itself (a row
    /// deletion policy, what `onceq init` makes). Otherwise the host whose
    /// turn it is ([`SpannerStore::chore_turn`], one a
    /// `spanner_purge_every`) deletes every expired key with Partitioned
    /// DML, which Spanner runs partition by partition in transactions of
    /// its own: no commit limit to reach however many keys expired. (One
    /// `DELETE` of every expired key, the first design, exceeded Spanner's
    /// 80,000 mutations a commit at steady state on a busy host; the
    /// chunked deletes that replaced it needed an index on `expires_at`,
    /// whose tail takes every insert.) Reads never count on the purge: an
    /// expired key is no key.
    async fn dedup_purge(&self) -> StoreResult<u64> {
        if self.ttl || !self.chore_turn("dedup_purge", self.options.spanner_purge_every).await? {
            return Ok(0);
        }
        let stmt = Statement::builder(format!("DELETE FROM onceq_dedup WHERE expires_at <= {NOW}")).build();
        self.partitioned_delete("the dedup purge", stmt).await
    }

    async fn dedup_list(&self, queues: Queues<'_>, within: Duration, limit: usize) -> StoreResult<Vec<DedupKey>> {
        use ColumnType::*;
        let t = Self::system_table(
            "onceq_dedup",
            &[
                ("queue", String),
                ("dedup_key", String),
                ("message_id", String),
                ("expires_at", Int64),
            ],
        );
        let (cond, q) = queue_condition(queues);
        let stmt = Statement::builder(format!(
            "SELECT queue, dedup_key, message_id, expires_at FROM onceq_dedup
             WHERE {cond} AND expires_at > {NOW} AND expires_at <= {NOW} + @w
             ORDER BY expires_at DESC, queue, dedup_key LIMIT @n"
        ))
        .add_param("q", q)
        .add_param("w", micros(within))
        .add_param("n", limit.min(i64::MAX as usize) as i64)
        .build();
        Ok(self
            .query_rows(stmt, &t)
            .await?
            .into_iter()
            .map(|row| {
                let get = |i: usize| row.get(i).map(|(_, v)| v.clone()).unwrap_or(Value::Null);
                let text = |i: usize| match get(i) {
                    Value::String(s) => s,
                    _ => std::string::String::new(),
                };
                DedupKey {
                    queue: text(0),
                    key: text(1),
                    message_id: text(2),
                    expires_at: match get(3) {
                        Value::Int64(n) => n,
                        _ => 0,
                    },
                }
            })
            .collect())
    }
}

/// `(queue, count)` rows of a `SELECT queue, COUNT(*) ... GROUP BY queue`.
pub(super) async fn counts_by_queue(c: &DatabaseClient, sql: String) -> StoreResult<Vec<(String, u64)>> {
    let mut rs = c
        .single_use()
        .build()
        .execute_query(Statement::builder(sql).build())
        .await
        .map_err(classify)?;
    let mut out = Vec::new();
    while let Some(r) = rs.next().await {
        let r = r.map_err(classify)?;
        out.push((
            r.get::<String>(0).map_err(classify)?,
            r.get::<i64>(1).map_err(classify)?.max(0) as u64,
        ));
    }
    Ok(out)
}

/// A `WHERE` condition on `queue` for a selection, with `@q` bound to the
/// returned text.
/// The statement adding `e` to the audit trail (a random id: entries
/// spread over the key space).
fn audit_insert(e: &AuditEntry) -> Statement {
    Statement::builder(
        "INSERT INTO onceq_audit (id, at_us, actor, action, queue, subject, signer, result) VALUES (@id, @at, @actor, @action, @queue, @subject, @signer, @result)",
    )
    .add_param("id", crate::value::random_id())
    .add_param("at", e.at)
    .add_param("actor", e.actor.clone())
    .add_param("action", e.action.clone())
    .add_param("queue", e.queue.clone())
    .add_param("subject", e.subject.clone())
    .add_param("signer", e.signer.clone())
    .add_param("result", e.result.clone())
    .build()
}

pub(super) fn queue_condition(q: Queues<'_>) -> (&'static str, String) {
    match q {
        Queues::All => ("@q = ''", String::new()),
        Queues::Named(name) => ("queue = @q", name.to_string()),
        Queues::Prefix(p) => ("STARTS_WITH(queue, @q)", p.to_string()),
    }
}

pub(super) const QUEUED_COLUMNS: &str = "id, queue, payload, attributes, attempt, enqueued_at, visible_at,
    lease_token IS NOT NULL AND visible_at > UNIX_MICROS(CURRENT_TIMESTAMP()), last_error, failures";

pub(super) fn queued_table() -> TableSchema {
    use ColumnType::*;
    SpannerStore::system_table(
        "onceq_messages",
        &[
            ("id", String),
            ("queue", String),
            ("payload", Bytes),
            ("attributes", String),
            ("attempt", Int64),
            ("enqueued_at", Int64),
            ("visible_at", Int64),
            ("leased", Bool),
            ("last_error", String),
            ("failures", Int64),
        ],
    )
}

pub(super) fn queued_from(row: Row) -> QueuedMessage {
    let mut it = row.into_iter().map(|(_, v)| v);
    let mut next = || it.next().unwrap_or(Value::Null);
    let text = |v: Value| match v {
        Value::String(s) => s,
        _ => std::string::String::new(),
    };
    let int = |v: Value| match v {
        Value::Int64(n) => n,
        _ => 0,
    };
    let id = text(next());
    let queue = text(next());
    let payload = match next() {
        Value::Bytes(b) => b,
        _ => Vec::new(),
    };
    let attributes = attrs_from_json(&text(next()));
    let deliveries = u32::try_from(int(next())).unwrap_or(u32::MAX);
    let enqueued_at = int(next());
    let visible_at = int(next());
    let leased = matches!(next(), Value::Bool(true));
    let last_error = match next() {
        Value::String(s) => Some(s),
        _ => None,
    };
    let failures = u32::try_from(int(next())).unwrap_or(u32::MAX);
    QueuedMessage {
        id,
        queue,
        payload_text: std::string::String::from_utf8_lossy(&payload).into_owned(),
        payload,
        attributes,
        deliveries,
        failures,
        enqueued_at,
        visible_at,
        leased,
        last_error,
    }
}
