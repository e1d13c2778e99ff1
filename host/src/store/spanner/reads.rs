//! Handlers' point reads, coalesced: the reads by key of concurrent
//! messages on one table go to Spanner as one read.
//!
//! A message transaction's reads used to be served by a read-only
//! transaction of its own (a strong snapshot): on the emulator that is a
//! transaction begun and a read per message, about a millisecond of its
//! CPU each, and the emulator's CPU is what bounds onceq there. Now a point
//! read joins the table's waiting reads; one read per table is in flight at
//! a time, and the reader whose turn it is reads every key waiting then
//! (up to [`KEYS_PER_READ`]) in one single-use read and hands each
//! requester its row. A lone read waits for nothing.
//!
//! What a message sees stays what commits: its reads are no longer from
//! one snapshot, but every one of them is recorded and read again in the
//! commit's read-write transaction, under its locks, and a changed answer
//! aborts the message and re-runs it ([`commit::apply`]). So a message
//! commits only if everything it read is still so at its commit: the same
//! guarantee a snapshot gave (which could be stale by then too). Scans
//! stay in the message's own read-only snapshot.
//!
//! For the same reason a point read need not be strong, only new enough
//! not to be re-run for nothing: it reads at or after the newest commit
//! this process made (`min_read_timestamp`), which Spanner serves without
//! waiting for transactions in flight; strongly when this process made
//! none in the last second ([`super::pool::RECENT_COMMIT`]), so what other
//! hosts committed is seen within about that (and caught by the re-read
//! anyway).
//! On the emulator a strong single-use read took 1.8 ms against 0.5 ms,
//! and these reads were a quarter of its time at 16 workers.

use super::*;
use crate::gather::Gather;

type Answer = StoreResult<Option<Row>>;

/// The waiting point reads of one table.
#[derive(Default)]
struct TableReads {
    waiting: Gather<Vec<Value>, Answer>,
    /// Held while this table's read is in flight.
    turn: tokio::sync::Mutex<()>,
}

/// Point reads of a store's tables, served together ([module docs](self)).
#[derive(Default)]
pub(super) struct PointReads {
    tables: std::sync::Mutex<BTreeMap<String, Arc<TableReads>>>,
    /// Keys read, and read calls made (the ratio is the coalescing).
    pub(super) keys: std::sync::atomic::AtomicU64,
    pub(super) calls: std::sync::atomic::AtomicU64,
}

impl PointReads {
    fn table(&self, name: &str) -> Arc<TableReads> {
        let mut tables = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        tables.entry(name.to_string()).or_default().clone()
    }

    /// The row of `table` with primary key `key`, read with the other
    /// reads of the table waiting when the read starts.
    pub(super) async fn get(&self, pool: &Arc<Pool>, table: &TableSchema, key: &[Value]) -> Answer {
        // A table keyed by a float (where 0.0 and -0.0, or NaNs, are one
        // key to Spanner) cannot match rows to keys exactly: read alone.
        if table.key_columns().any(|c| c.ty == ColumnType::Float64) {
            return self.read(pool, table, &[key.to_vec()]).await.map(|rows| rows.into_iter().next());
        }
        let reads = self.table(&table.name);
        // A reader whose message was cancelled mid-read (its lease lost)
        // drops the reads it took unanswered: those ask again.
        use tokio::sync::oneshot::error::TryRecvError;
        'ask: loop {
            let mut rx = reads.waiting.push(key.to_vec());
            loop {
                let turn = tokio::select! {
                    biased;
                    answer = &mut rx => match answer {
                        Ok(answer) => return answer,
                        Err(_) => continue 'ask,
                    },
                    turn = reads.turn.lock() => turn,
                };
                // A reader answers every read it took before it gives up
                // the turn: none here means this one still waits.
                match rx.try_recv() {
                    Ok(answer) => return answer,
                    Err(TryRecvError::Closed) => continue 'ask,
                    Err(TryRecvError::Empty) => {}
                }
                let collector = reads.waiting.collector(KEYS_PER_READ);
                let keys = collector.take();
                match self.read(pool, table, &keys).await {
                    Ok(rows) => collector.answer(keys.iter().map(|key| Ok(row_of(table, &rows, key))), || Ok(None)),
                    Err(e) => collector.answer(std::iter::empty(), || Err(e.clone())),
                }
                drop(turn);
                match rx.try_recv() {
                    Ok(answer) => return answer,
                    Err(TryRecvError::Closed) => continue 'ask,
                    // More than one read's worth waited before it: again.
                    Err(TryRecvError::Empty) => {}
                }
            }
        }
    }

    /// One single-use read of `keys` (distinct or not), at least as new as
    /// this process's last commit, under the call deadline.
    async fn read(&self, pool: &Arc<Pool>, table: &TableSchema, keys: &[Vec<Value>]) -> StoreResult<Vec<Row>> {
        use std::sync::atomic::Ordering::Relaxed;
        self.calls.fetch_add(1, Relaxed);
        self.keys.fetch_add(keys.len() as u64, Relaxed);
        let what = format!("a read of {}", table.name);
        pool.within(&what, false, async {
            let c = pool.get().await?;
            let mut single = c.single_use();
            if let Some(at) = pool.committed() {
                single = single.set_timestamp_bound(google_cloud_spanner::transaction::TimestampBound::min_read_timestamp(at));
            }
            let rs = single
                .build()
                .execute_read(point_read(table, keys.iter().map(Vec::as_slice)))
                .await
                .map_err(classify)?;
            collect(table, rs).await
        })
        .await
    }
}

/// The row of `rows` whose primary key is `key`.
fn row_of(table: &TableSchema, rows: &[Row], key: &[Value]) -> Option<Row> {
    rows.iter()
        .find(|row| {
            table
                .primary_key
                .iter()
                .zip(key)
                .all(|(&c, v)| row.get(c).is_some_and(|(_, got)| got.same(v)))
        })
        .cloned()
}
