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

/// A lease round reads this many times the candidates it needs and picks
/// among them at random (see [`SpannerStore::lease`]).
pub(super) const WINDOW: usize = 4;
/// ... but never more than this many beyond what it needs.
pub(super) const MAX_EXTRA: usize = 192;
/// Lease rounds at most per lease: a round that lost candidates to another
/// leaser is followed by another.
pub(super) const ROUNDS: usize = 3;

/// Keep `want` of `found` at random (all of them when there are no more).
fn pick<T>(found: &mut Vec<T>, want: usize, rng: &mut impl rand::Rng) {
    use rand::seq::SliceRandom;
    if found.len() > want {
        found.shuffle(rng);
        found.truncate(want);
    }
}

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

    /// Up to `p.limit` ready messages of `p.queue`, leased with one token.
    ///
    /// Several leasers (the hosts) read the same shards, so a candidate can
    /// be taken by another between this host's read and its lease. Two
    /// things keep that from costing throughput: each round picks its
    /// candidates at random among the oldest [`WINDOW`] times as many as it
    /// needs (two leasers reading the same shard at once mostly pick
    /// different rows, so fewer lease transactions conflict), and a round
    /// that lost candidates is followed by another (up to [`ROUNDS`]):
    /// a lost candidate is not an idle queue. Before, a leaser that lost
    /// every candidate answered "nothing ready" and its workers backed off
    /// from a full queue (tests/spanner.rs,
    /// `spanner_leasers_on_one_shard_never_see_a_full_queue_as_empty`).
    pub(super) async fn lease(&self, p: LeaseParams) -> StoreResult<Vec<LeasedMessage>> {
        let token = random_id();
        let mut out = Vec::new();
        for _ in 0..ROUNDS {
            let want = p.limit.saturating_sub(out.len());
            if want == 0 {
                break;
            }
            let Some((candidates, now)) = self.lease_candidates(&p.queue, want).await? else {
                break; // nothing ready
            };
            let asked = candidates.len();
            let leased = self.lease_these(&p, &token, candidates, now).await?;
            let lost = asked - leased.len();
            out.extend(leased);
            if lost == 0 {
                break;
            }
            tracing::trace!(queue = %p.queue, lost, asked, "lease candidates taken by another leaser; reading again");
        }
        crate::store::oldest_first(&mut out);
        Ok(out)
    }

    /// Up to `want` keys of ready messages of `queue`, picked at random
    /// among the oldest `want * WINDOW`, and the database's time of the
    /// read; `None` when nothing is ready.
    async fn lease_candidates(&self, queue: &str, want: usize) -> StoreResult<Option<(Vec<(i64, String)>, i64)>> {
        // Start at a random shard (hosts spread over key ranges) and fill the
        // window from the following shards, oldest first within each.
        let first = i64::from(rand::random::<u32>() % self.shards);
        let window = want.saturating_mul(WINDOW).min(want.saturating_add(MAX_EXTRA));
        // Candidates come from a strong read-only transaction: an empty
        // queue costs no read-write transaction (idle workers of many hosts
        // poll it). Its read timestamp is the database's clock; the queue's
        // index is read by key range up to it, shard by shard from `first`,
        // at most `window` rows: what is visible now, oldest first within a
        // shard, and never more rows than asked for. (The same candidates
        // as one query ordered by shard and visibility is a scan on the
        // emulator and reads every visible entry of the queue's index on
        // Spanner.)
        let (mut found, now) = self
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
                let mut found = Vec::new();
                for range in [first..shards, 0..first] {
                    if found.len() >= window || range.is_empty() {
                        continue;
                    }
                    let mut visible = KeySetBuilder::new();
                    for shard in range {
                        let q = || SValue::from(queue.to_owned());
                        visible = visible.add_range(KeyRange::closed_closed(
                            Key::new(vec![q(), SValue::from(shard)]),
                            Key::new(vec![q(), SValue::from(shard), SValue::from(now)]),
                        ));
                    }
                    let read = google_cloud_spanner::read::ReadRequest::builder("onceq_messages", ["shard", "id"])
                        .with_index("onceq_messages_visible", visible.build())
                        .set_limit((window - found.len()) as i64)
                        .build();
                    let mut rs = ro.execute_read(read).await.map_err(classify)?;
                    while let Some(r) = rs.next().await {
                        let r = r.map_err(classify)?;
                        found.push((r.get::<i64>(0).map_err(classify)?, r.get::<String>(1).map_err(classify)?));
                    }
                }
                Ok((found, now))
            })
            .await?;
        if found.is_empty() {
            return Ok(None);
        }
        pick(&mut found, want, &mut rand::rng());
        Ok(Some((found, now)))
    }

    /// Lease those of `candidates` still ready at `now` (the candidates'
    /// read time) with `token`.
    async fn lease_these(&self, p: &LeaseParams, token: &str, candidates: Vec<(i64, String)>, now: i64) -> StoreResult<Vec<LeasedMessage>> {
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
        let keys = candidates
            .into_iter()
            .fold(KeySetBuilder::new(), |keys, (shard, id)| {
                keys.add_key(Key::new(vec![SValue::from(shard), SValue::from(id)]))
            })
            .build();
        let read = google_cloud_spanner::read::ReadRequest::builder("onceq_messages", LEASED_COLUMNS)
            .with_keys(keys)
            .build();
        let (queue, lease_token) = (p.queue.clone(), token.to_owned());
        let (leased, until) = self
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
        leased
            .iter()
            .map(|(r, attempt)| message_from_row(&p.queue, token, r, *attempt, until))
            .collect()
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::pick;
    use rand::SeedableRng;
    use std::collections::BTreeSet;

    /// Two leasers picking 16 of the same 64 candidates share about four
    /// (16 x 16 / 64); taking the oldest 16, both would take the same 16.
    #[test]
    fn two_leasers_mostly_pick_different_candidates() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut shared = 0;
        for _ in 0..100 {
            let (mut a, mut b): (Vec<u32>, Vec<u32>) = ((0..64).collect(), (0..64).collect());
            pick(&mut a, 16, &mut rng);
            pick(&mut b, 16, &mut rng);
            assert_eq!((a.len(), b.len()), (16, 16));
            assert_eq!(a.iter().collect::<BTreeSet<_>>().len(), 16, "picked one twice");
            shared += a.iter().filter(|x| b.contains(x)).count();
        }
        assert!((200..=600).contains(&shared), "{shared} shared in 100 pairs of picks");
    }

    #[test]
    fn fewer_candidates_than_wanted_are_all_kept() {
        let mut found = vec![1, 2, 3];
        pick(&mut found, 8, &mut rand::rng());
        assert_eq!(found, [1, 2, 3]);
    }
}
