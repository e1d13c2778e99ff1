//! Leasing: candidates read by key range on the queue's index, taken with
//! mutations in a read-write transaction; lease renewal.

use super::*;

/// The columns a lease reads of each candidate's row, in
/// [`message_from_row`]'s order.
pub(super) const LEASED_COLUMNS: [&str; 9] = [
    "shard",
    "id",
    "payload",
    "attributes",
    "attempt",
    "enqueued_at",
    "visible_at",
    "queue",
    "failures",
];

/// A row of [`LEASED_COLUMNS`], leased with `token` until `until` as its
/// attempt `attempt` (the values the lease writes).
pub(super) fn message_from_row(
    queue: &str,
    token: &str,
    r: &google_cloud_spanner::result::Row,
    attempt: i64,
    until: i64,
) -> StoreResult<LeasedMessage> {
    let shard: i64 = r.get(0).map_err(classify)?;
    let id: String = r.get(1).map_err(classify)?;
    let attributes: String = r.get(3).map_err(classify)?;
    let failures: i64 = r.get(8).map_err(classify)?;
    Ok(LeasedMessage {
        message: Message {
            id: id.clone(),
            queue: queue.to_string(),
            payload: r.get(2).map_err(classify)?,
            attributes: attrs_from_json(&attributes),
            attempt: u32::try_from(attempt).unwrap_or(u32::MAX),
            enqueued_at: r.get(5).map_err(classify)?,
        },
        lease: Lease {
            queue: queue.to_string(),
            message_id: id.clone(),
            shard,
            token: token.to_string(),
        },
        lease_until: until,
        failures: u32::try_from(failures).unwrap_or(u32::MAX),
    })
}

impl SpannerStore {
    /// On the emulator, take the turn first and collect the requests then
    /// (as [`SpannerBatch::commit_collected`] does for commits).
    pub(super) async fn lease_collected(
        &self,
        queue: &str,
        lease: Duration,
        collect: &(dyn Fn() -> usize + Send + Sync),
    ) -> StoreResult<Vec<LeasedMessage>> {
        let params = |limit| LeaseParams {
            queue: queue.to_owned(),
            limit,
            lease,
        };
        self.pool.in_turn(|| self.lease(params(collect()))).await
    }

    pub(super) async fn lease(&self, p: LeaseParams) -> StoreResult<Vec<LeasedMessage>> {
        let token = random_id();
        // Start at a random shard (hosts spread over key ranges) and fill the
        // batch from the following shards, oldest first within each.
        let first = i64::from(rand::random::<u32>() % self.shards);
        // Candidates come from a strong read-only transaction: an empty
        // queue costs no read-write transaction (idle workers of many hosts
        // poll it). Its read timestamp is the database's clock; the queue's
        // index is read by key range up to it, shard by shard from `first`,
        // at most `limit` rows: what is visible now, oldest first within a
        // shard, and never more rows than asked for. (The same candidates
        // as one query ordered by shard and visibility is a scan on the
        // emulator and reads every visible entry of the queue's index on
        // Spanner.)
        let (candidates, now) = self
            .pool
            .within("a lease query", false, async {
                use google_cloud_spanner::transaction::BeginTransactionOption;
                let c = self.pool.get().await?;
                let ro = c
                    .read_only_transaction()
                    .set_begin_transaction_option(BeginTransactionOption::ExplicitBegin)
                    .build()
                    .await
                    .map_err(classify)?;
                let now = ro
                    .read_timestamp()
                    .map(|t| micros_of(&t))
                    .ok_or_else(|| StoreError::Permanent("a read-only transaction began without a read timestamp".into()))?;
                let shards = i64::from(self.shards);
                let (mut keys, mut n) = (KeySetBuilder::new(), 0usize);
                for range in [first..shards, 0..first] {
                    if n >= p.limit || range.is_empty() {
                        continue;
                    }
                    let mut visible = KeySetBuilder::new();
                    for shard in range {
                        let q = || SValue::from(p.queue.clone());
                        visible = visible.add_range(KeyRange::closed_closed(
                            Key::new(vec![q(), SValue::from(shard)]),
                            Key::new(vec![q(), SValue::from(shard), SValue::from(now)]),
                        ));
                    }
                    let read = google_cloud_spanner::read::ReadRequest::builder("onceq_messages", ["shard", "id"])
                        .with_index("onceq_messages_visible", visible.build())
                        .set_limit((p.limit - n) as i64)
                        .build();
                    let mut rs = ro.execute_read(read).await.map_err(classify)?;
                    while let Some(r) = rs.next().await {
                        let r = r.map_err(classify)?;
                        let (shard, id) = (r.get::<i64>(0).map_err(classify)?, r.get::<String>(1).map_err(classify)?);
                        keys = keys.add_key(Key::new(vec![SValue::from(shard), SValue::from(id)]));
                        n += 1;
                    }
                }
                Ok((if n == 0 { None } else { Some(keys.build()) }, now))
            })
            .await?;
        let Some(candidates) = candidates else {
            return Ok(Vec::new());
        };
        // The candidates' rows are read by key in the read-write
        // transaction (locked until it commits) and those still visible at
        // the query's time taken by mutations: no statement to plan or
        // scan (measured on the emulator: the same lease as one `UPDATE
        // ... THEN RETURN` of its ids cost 25-200 ms, a scan of the queue).
        // A row visible then is visible now. The lease runs from the
        // candidates' read timestamp plus the time since (this host's
        // monotonic clock), so an attempt that waited (aborted and re-run)
        // does not get a shorter lease.
        let read_at = std::time::Instant::now();
        let lease = micros(p.lease);
        let read = google_cloud_spanner::read::ReadRequest::builder("onceq_messages", LEASED_COLUMNS)
            .with_keys(candidates)
            .build();
        let (queue, lease_token) = (p.queue.clone(), token.clone());
        let leased = self
            .rw("a lease", move |tx| {
                let (read, queue, token) = (read.clone(), queue.clone(), lease_token.clone());
                async move {
                    let since = i64::try_from(read_at.elapsed().as_micros()).unwrap_or(i64::MAX);
                    let until = now.saturating_add(since).saturating_add(lease);
                    let mut rs = tx.execute_read(read).await?;
                    let mut rows = Vec::new();
                    let mut writes = Vec::new();
                    while let Some(r) = rs.next().await {
                        let r = r?;
                        if r.get::<String>(7)? != queue || r.get::<i64>(6)? > now {
                            continue; // leased (or re-queued) since the query
                        }
                        let attempt = r.get::<i64>(4)?.saturating_add(1);
                        writes.push(
                            Mutation::new_update_builder("onceq_messages")
                                .set("shard")
                                .to(r.get::<i64>(0)?)
                                .set("id")
                                .to(&r.get::<String>(1)?)
                                .set("lease_token")
                                .to(&token)
                                .set("visible_at")
                                .to(until)
                                .set("attempt")
                                .to(attempt)
                                .build(),
                        );
                        rows.push((r, attempt));
                    }
                    if !writes.is_empty() {
                        tx.buffer(writes)?;
                    }
                    Ok((rows, until))
                }
            })
            .await?;
        let (leased, until) = leased;
        let mut out = leased
            .iter()
            .map(|(r, attempt)| message_from_row(&p.queue, &token, r, *attempt, until))
            .collect::<StoreResult<Vec<_>>>()?;
        out.sort_by_key(|m| m.message.enqueued_at);
        Ok(out)
    }

    pub(super) async fn lease_renew(&self, leases: &[Lease], duration: Duration) -> StoreResult<Vec<bool>> {
        let sql = format!("UPDATE onceq_messages SET visible_at = {NOW} + @n WHERE shard = @s AND id = @id AND lease_token = @t");
        let stmts: Arc<Vec<Statement>> = Arc::new(
            leases
                .iter()
                .map(|l| {
                    Statement::builder(sql.clone())
                        .add_param("s", l.shard)
                        .add_param("id", l.message_id.clone())
                        .add_param("t", l.token.clone())
                        .add_param("n", micros(duration))
                        .build()
                })
                .collect(),
        );
        self.rw("a lease renewal", move |tx| {
            let stmts = stmts.clone();
            async move {
                let mut held = Vec::with_capacity(stmts.len());
                for stmt in stmts.iter() {
                    held.push(tx.execute_update(stmt.clone()).await? == 1);
                }
                Ok(held)
            }
        })
        .await
    }
}
