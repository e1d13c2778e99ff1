//! A message transaction's reads on Spanner: point reads coalesced with
//! other messages' ([`super::reads`]); scans in a read-only transaction (a
//! strong snapshot) on a pooled client, opened on the first scan; all
//! under the call deadline. The transaction itself is
//! [`commit::Buffered`].

use super::*;

/// The snapshot serving one message transaction's reads.
pub(super) struct SpannerSnapshot {
    pub(super) pool: Arc<Pool>,
    pub(super) reads: Arc<super::reads::PointReads>,
    /// The read-only transaction, with the client it holds until dropped.
    pub(super) ro: Option<(Lent, google_cloud_spanner::transaction::MultiUseReadOnlyTransaction)>,
}

impl SpannerSnapshot {
    async fn open(&mut self) -> StoreResult<&google_cloud_spanner::transaction::MultiUseReadOnlyTransaction> {
        if self.ro.is_none() {
            let c = self.pool.get().await?;
            let ro = c.read_only_transaction().build().await.map_err(classify)?;
            self.ro = Some((c, ro));
        }
        match &self.ro {
            Some((_, ro)) => Ok(ro),
            None => Err(StoreError::Invariant("snapshot missing".into())),
        }
    }

    /// A handler's scan in the snapshot, under the call deadline.
    async fn scan_rows(&mut self, table: &TableSchema, prefix: &[Value], limit: usize) -> StoreResult<Vec<Row>> {
        let pool = self.pool.clone();
        let what = format!("a scan of {}", table.name);
        pool.within(&what, false, async {
            let snapshot = self.open().await?;
            let rs = snapshot
                .execute_query(select_stmt(table, prefix, Some(limit)))
                .await
                .map_err(classify)?;
            collect(table, rs).await
        })
        .await
    }
}

#[async_trait]
impl commit::Snapshot for SpannerSnapshot {
    async fn get(&mut self, table: &TableSchema, key: &[Value]) -> StoreResult<Option<Row>> {
        self.reads.get(&self.pool, table, key).await
    }

    async fn scan(&mut self, table: &TableSchema, prefix: &[Value], limit: usize) -> StoreResult<Vec<Row>> {
        self.scan_rows(table, prefix, limit).await
    }
}
