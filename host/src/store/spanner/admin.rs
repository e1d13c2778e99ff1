//! Database administration: onceq's own tables (DDL), creating, opening,
//! upgrading and dropping a database, and reading its schema. Start-up
//! queries are retried while the failure is transient ([`retrying`]).

use super::*;

/// onceq's own tables, in GoogleSQL, their dedup keys expiring by a row
/// deletion policy (TTL) or not ([`SpannerExpiry`]).
///
/// No index of them leads with a time: an index on a monotonic column
/// alone sends every insert to the split at its tail (Spanner's schema
/// guidance). The queue's index leads with the queue and shard; the dedup
/// keys' expiry has no index at all (the row deletion policy needs none,
/// Partitioned DML neither), where it had one on `expires_at` alone.
pub fn system_ddl(expiry: SpannerExpiry) -> Vec<String> {
    let dedup = match expiry {
        SpannerExpiry::Ttl => DEDUP_TTL_DDL,
        SpannerExpiry::Purge => DEDUP_DDL,
    };
    [
        "CREATE TABLE onceq_messages (
            shard INT64 NOT NULL, id STRING(64) NOT NULL, queue STRING(256) NOT NULL,
            payload BYTES(MAX) NOT NULL, attributes STRING(MAX) NOT NULL, attempt INT64 NOT NULL,
            enqueued_at INT64 NOT NULL, visible_at INT64 NOT NULL, lease_token STRING(64), last_error STRING(MAX),
            failures INT64 NOT NULL DEFAULT (0)
         ) PRIMARY KEY (shard, id)",
        "CREATE INDEX onceq_messages_visible ON onceq_messages (queue, shard, visible_at)",
        "CREATE TABLE onceq_dead_letters (
            id STRING(64) NOT NULL, queue STRING(256) NOT NULL, payload BYTES(MAX) NOT NULL, attributes STRING(MAX) NOT NULL,
            attempts INT64 NOT NULL, enqueued_at INT64 NOT NULL, failed_at INT64 NOT NULL, reason STRING(MAX) NOT NULL,
            handler_version STRING(64), failures INT64 NOT NULL DEFAULT (0)
         ) PRIMARY KEY (id)",
        dedup,
        COUNTS_DDL,
        CHORES_DDL,
        SETTINGS_DDL,
        AUDIT_DDL,
        PAUSED_DDL,
        HOSTS_DDL,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The dedup keys, without a row deletion policy.
const DEDUP_DDL: &str = "CREATE TABLE onceq_dedup (
            queue STRING(256) NOT NULL, dedup_key STRING(MAX) NOT NULL, message_id STRING(64) NOT NULL, expires_at INT64 NOT NULL
         ) PRIMARY KEY (queue, dedup_key)";

/// The dedup keys, deleted by Spanner once expired (`expires`, a stored
/// generated column, is the policy's TIMESTAMP; onceq reads and writes
/// `expires_at`).
const DEDUP_TTL_DDL: &str = "CREATE TABLE onceq_dedup (
            queue STRING(256) NOT NULL, dedup_key STRING(MAX) NOT NULL, message_id STRING(64) NOT NULL, expires_at INT64 NOT NULL,
            expires TIMESTAMP AS (TIMESTAMP_MICROS(expires_at)) STORED
         ) PRIMARY KEY (queue, dedup_key), ROW DELETION POLICY (OLDER_THAN(expires, INTERVAL 0 DAY))";

/// What turns bring a database that has none a row deletion policy on
/// its dedup keys (the advice `open` logs).
pub(super) const DEDUP_TTL_ALTER: [&str; 2] = [
    "ALTER TABLE onceq_dedup ADD COLUMN expires TIMESTAMP AS (TIMESTAMP_MICROS(expires_at)) STORED",
    "ALTER TABLE onceq_dedup ADD ROW DELETION POLICY (OLDER_THAN(expires, INTERVAL 0 DAY))",
];

/// Chores one host at a time does (the dedup purge): whose turn it is
/// and when the next one is due.
pub(super) const CHORES_DDL: &str = "CREATE TABLE onceq_chores (
            chore STRING(64) NOT NULL, holder STRING(64) NOT NULL, next_at INT64 NOT NULL
         ) PRIMARY KEY (chore)";

/// Settings every host of the database must share, fixed by the first
/// (`spanner.shards`: a message's shard is chosen when it is sent, so a
/// host leasing from fewer shards than producers send to would never see
/// some messages).
pub(super) const SETTINGS_DDL: &str = "CREATE TABLE onceq_settings (
            name STRING(64) NOT NULL, value STRING(MAX) NOT NULL
         ) PRIMARY KEY (name)";

/// The audit trail (`onceq audit`): a random id spreads the inserts; no
/// index (entries are few, listed newest first by a scan).
pub(super) const AUDIT_DDL: &str = "CREATE TABLE onceq_audit (
            id STRING(64) NOT NULL, at_us INT64 NOT NULL, actor STRING(MAX) NOT NULL, action STRING(64) NOT NULL,
            queue STRING(256), subject STRING(MAX) NOT NULL, signer STRING(MAX), result STRING(MAX) NOT NULL
         ) PRIMARY KEY (id)";

/// Paused queues (`onceq pause`).
pub(super) const PAUSED_DDL: &str = "CREATE TABLE onceq_paused (
            queue STRING(256) NOT NULL, paused_at INT64 NOT NULL, actor STRING(MAX) NOT NULL
         ) PRIMARY KEY (queue)";

/// The hosts serving (heartbeats; the console's overview).
pub(super) const HOSTS_DDL: &str = "CREATE TABLE onceq_hosts (
            id STRING(64) NOT NULL, name STRING(MAX) NOT NULL, pid INT64 NOT NULL, version STRING(64) NOT NULL,
            started_at INT64 NOT NULL, seen_at INT64 NOT NULL, queues STRING(MAX) NOT NULL,
            in_flight INT64 NOT NULL, finished INT64 NOT NULL
         ) PRIMARY KEY (id)";

/// The processed counts (`onceq stats`): `spanner_count_rows` rows per queue,
/// each batch commit adding to one at random, so hosts seldom contend for
/// a row and restarts add none; stats add them.
pub(super) const COUNTS_DDL: &str = "CREATE TABLE onceq_counts (
            queue STRING(256) NOT NULL, shard INT64 NOT NULL, processed INT64 NOT NULL, last_at INT64 NOT NULL
         ) PRIMARY KEY (queue, shard)";

/// Split a GoogleSQL DDL file into statements (on `;`, dropping `--`
/// comments and blank statements).
pub fn split_ddl(ddl: &str) -> Vec<String> {
    let text: String = ddl
        .lines()
        .map(|l| l.split("--").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    text.split(';')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

/// `projects/P/instances/I/databases/D` -> (P, I, D).
pub fn parse_database(path: &str) -> anyhow::Result<(String, String, String)> {
    let parts: Vec<&str> = path.split('/').collect();
    match parts.as_slice() {
        ["projects", p, "instances", i, "databases", d] if !p.is_empty() && !i.is_empty() && !d.is_empty() => {
            Ok((p.to_string(), i.to_string(), d.to_string()))
        }
        _ => anyhow::bail!("Spanner database {path:?}: expected projects/PROJECT/instances/INSTANCE/databases/DATABASE"),
    }
}

/// The REST admin endpoint: `ONCEQ_SPANNER_ADMIN_ENDPOINT` (the emulator's
/// gateway_main), else the client's default.
pub(super) fn admin_endpoint() -> Option<String> {
    std::env::var("ONCEQ_SPANNER_ADMIN_ENDPOINT").ok().filter(|s| !s.is_empty())
}

/// The database admin client, at [`admin_endpoint`] if set.
pub(super) async fn database_admin(spanner: &Spanner) -> anyhow::Result<google_cloud_spanner::client::DatabaseAdmin> {
    let mut b = spanner.database_admin_builder();
    if let Some(ep) = admin_endpoint() {
        b = b.with_endpoint(ep);
    }
    b.build().await.map_err(|e| anyhow::anyhow!("database admin: {e}"))
}

/// A start-up query, retried while the failure is transient (no answer
/// within the call deadline, unavailable): each failure logged at WARN with
/// its pause, up to about a minute and a half in all, before the host gives
/// up with the last error.
pub(super) async fn retrying<T, Fut: std::future::Future<Output = StoreResult<T>>>(
    what: &str,
    mut call: impl FnMut() -> Fut,
) -> StoreResult<T> {
    const TRIES: u32 = 8;
    let mut pause = Duration::from_millis(200);
    for attempt in 1..=TRIES {
        match call().await {
            Err(e) if (e.is_retryable() || e.is_unknown_outcome()) && attempt < TRIES => {
                tracing::warn!(
                    "{what} failed (try {attempt} of {TRIES}, again in {}): {e}",
                    crate::names::duration(pause)
                );
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(30));
            }
            other => return other,
        }
    }
    Err(StoreError::Unavailable(format!("{what}: no try left")))
}

/// Apply `statements` to `database` and wait for them, within five minutes.
pub(super) async fn update_ddl(database: &str, statements: Vec<String>) -> anyhow::Result<()> {
    use google_cloud_lro::Poller;
    let spanner = Spanner::builder()
        .build()
        .await
        .map_err(|e| anyhow::anyhow!("connecting to Spanner: {e}"))?;
    let admin = database_admin(&spanner).await?;
    let update = admin
        .update_database_ddl()
        .set_database(database)
        .set_statements(statements.clone())
        .poller()
        .until_done();
    tokio::time::timeout(Duration::from_secs(300), update)
        .await
        .map_err(|_| anyhow::anyhow!("updating the schema of {database}: no answer within 5m"))?
        .map_err(|e| anyhow::anyhow!("updating the schema of {database} ({}): {e}", statements.join("; ")))?;
    Ok(())
}

impl SpannerStore {
    /// `onceq init` on Spanner: on the emulator also create the instance;
    /// create the database with onceq's tables and the business DDL.
    pub fn init<'a>(
        opts: &'a SpannerOptions,
        business_ddl: &'a str,
        options: &'a StoreOptions,
    ) -> crate::BoxFuture<'a, anyhow::Result<SpannerStore>> {
        Box::pin(async move {
            // Creating a database on real Spanner takes up to a minute or two.
            const INIT_DEADLINE: Duration = Duration::from_secs(300);
            tokio::time::timeout(INIT_DEADLINE, Self::create(opts, business_ddl, options.spanner_expiry))
                .await
                .map_err(|_| anyhow::anyhow!("creating database {}: no answer from Spanner within 5m", opts.database))??;
            Self::open(opts, options).await
        })
    }

    /// The emulator's instance (on the emulator) and the database.
    pub(super) async fn create(opts: &SpannerOptions, business_ddl: &str, expiry: SpannerExpiry) -> anyhow::Result<()> {
        use google_cloud_lro::Poller;
        let (project, instance, database) = parse_database(&opts.database)?;
        let spanner = Spanner::builder()
            .build()
            .await
            .map_err(|e| anyhow::anyhow!("connecting to Spanner: {e}"))?;
        let emulator = std::env::var("SPANNER_EMULATOR_HOST").is_ok_and(|s| !s.is_empty());
        if emulator {
            let mut b = spanner.instance_admin_builder();
            if let Some(ep) = admin_endpoint() {
                b = b.with_endpoint(ep);
            }
            let admin = b.build().await.map_err(|e| anyhow::anyhow!("instance admin: {e}"))?;
            let created = admin
                .create_instance()
                .set_parent(format!("projects/{project}"))
                .set_instance_id(instance.clone())
                .set_instance(
                    google_cloud_spanner_admin_instance_v1::model::Instance::new()
                        .set_config(format!("projects/{project}/instanceConfigs/emulator-config"))
                        .set_display_name(instance.clone())
                        .set_node_count(1),
                )
                .poller()
                .until_done()
                .await;
            if let Err(e) = created {
                if !e.to_string().contains("lready exists") {
                    anyhow::bail!("creating emulator instance {instance}: {e}");
                }
            }
        }
        let admin = database_admin(&spanner).await?;
        let mut ddl = system_ddl(expiry);
        ddl.extend(split_ddl(business_ddl));
        admin
            .create_database()
            .set_parent(format!("projects/{project}/instances/{instance}"))
            .set_create_statement(format!("CREATE DATABASE `{database}`"))
            .set_extra_statements(ddl)
            .poller()
            .until_done()
            .await
            .map_err(|e| anyhow::anyhow!("creating database {}: {e}", opts.database))?;
        Ok(())
    }

    /// Drop `database` (`projects/P/instances/I/databases/D`), within a
    /// minute: what the bench does after each run on the emulator, so its
    /// databases do not pile up there.
    pub async fn drop_database(database: &str) -> anyhow::Result<()> {
        let spanner = Spanner::builder()
            .build()
            .await
            .map_err(|e| anyhow::anyhow!("connecting to Spanner: {e}"))?;
        let admin = database_admin(&spanner).await?;
        tokio::time::timeout(Duration::from_secs(60), admin.drop_database().set_database(database).send())
            .await
            .map_err(|_| anyhow::anyhow!("dropping database {database}: no answer within 1m"))?
            .map_err(|e| anyhow::anyhow!("dropping database {database}: {e}"))
    }

    /// Connect to an existing database.
    pub async fn open(opts: &SpannerOptions, options: &StoreOptions) -> anyhow::Result<SpannerStore> {
        let spanner = Spanner::builder()
            .build()
            .await
            .map_err(|e| anyhow::anyhow!("connecting to Spanner: {e}"))?;
        let emulator = std::env::var("SPANNER_EMULATOR_HOST").is_ok_and(|s| !s.is_empty());
        let pool = Arc::new(Pool::new(spanner, opts, opts.exclusive.unwrap_or(emulator), emulator));
        // The three INFORMATION_SCHEMA reads at once: one after another
        // they took about 55 ms of every start on the emulator.
        let (schema, tables, ttl) = tokio::try_join!(
            async {
                retrying("the schema query", || {
                    pool.within("the schema query", false, Self::load_schema(&pool))
                })
                .await
                .map_err(|e| anyhow::Error::new(e).context(format!("reading the schema of {}", opts.database)))
            },
            async {
                retrying("the system tables query", || {
                    pool.within("the system tables query", false, Self::system_columns(&pool))
                })
                .await
                .map_err(|e| anyhow::Error::new(e).context(format!("reading onceq's tables in {}", opts.database)))
            },
            async {
                retrying("the row deletion policy query", || {
                    pool.within("the row deletion policy query", false, Self::dedup_ttl(&pool))
                })
                .await
                .map_err(|e| anyhow::Error::new(e).context(format!("reading onceq's tables in {}", opts.database)))
            },
        )?;
        Self::migrate(&pool, &opts.database, &tables).await?;
        if !ttl && options.spanner_expiry == SpannerExpiry::Ttl {
            tracing::info!(
                "{}: onceq_dedup has no row deletion policy (made by an older onceq or with spanner.expiry = \"purge\"): one host a minute deletes expired dedup keys with Partitioned DML; to let Spanner delete them instead: {}; DROP INDEX onceq_dedup_expiry (if present)",
                opts.database,
                DEDUP_TTL_ALTER.join("; ")
            );
        }
        let counts = match tables.contains(&("onceq_counts".to_string(), "processed".to_string())) {
            true => true,
            false => {
                tracing::warn!(
                    "{} has no onceq_counts table (made by an older onceq): `onceq stats` will not count processed messages; add it with: {}",
                    opts.database,
                    COUNTS_DDL.split_whitespace().collect::<Vec<_>>().join(" ")
                );
                false
            }
        };
        let schema = Arc::new(schema);
        let shards = retrying("the shard count", || Self::settled_shards(&pool, opts.shards.max(1)))
            .await
            .map_err(|e| anyhow::Error::new(e).context(format!("reading the shard count of {}", opts.database)))?;
        if shards != opts.shards.max(1) {
            tracing::warn!(
                "{}: its queues are sharded {shards} ways (fixed by the first host that opened it); spanner.shards = {} here is not used: every host and producer must use the same count, or messages sit on shards some hosts never read",
                opts.database,
                opts.shards
            );
        }
        let splits = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let batch = SpannerBatch {
            pool: pool.clone(),
            schema: schema.clone(),
            shards,
            window: options.dedup_window,
            counts,
            count_rows: options.spanner_count_rows,
            suspects: Mutex::new(Default::default()),
            splits: splits.clone(),
            #[cfg(feature = "fault-injection")]
            refuse: options.commit.faults.filter(|f| f.refused > 0.0).map(|f| {
                use rand::SeedableRng;
                (f.refused, Mutex::new(rand::rngs::StdRng::seed_from_u64(f.seed)))
            }),
        };
        Ok(SpannerStore {
            reads: Default::default(),
            pool,
            schema,
            group: Arc::new(commit::Group::new(options.commit, Arc::new(batch))),
            options: options.clone(),
            shards,
            counts,
            ttl,
            instance: random_id(),
            splits,
        })
    }

    /// The database's shard count: the one stored in `onceq_settings`, or
    /// `wanted`, stored, if none is yet (the first host to open it).
    async fn settled_shards(pool: &Arc<Pool>, wanted: u32) -> StoreResult<u32> {
        let read = google_cloud_spanner::read::ReadRequest::builder("onceq_settings", ["value"])
            .with_keys(
                KeySetBuilder::new()
                    .add_key(Key::new(vec![SValue::from("spanner.shards".to_string())]))
                    .build(),
            )
            .build();
        // Read first: only the first host of a database writes (every
        // command opens the store; a read-write transaction each time
        // would take the emulator's turn for nothing).
        let first_read = read.clone();
        let stored = pool
            .within("the shard count", false, async {
                let c = pool.get().await?;
                let mut rs = c.single_use().build().execute_read(first_read).await.map_err(classify)?;
                let mut stored = None;
                while let Some(r) = rs.next().await {
                    stored = Some(r.map_err(classify)?.get::<String>(0).map_err(classify)?);
                }
                Ok(stored)
            })
            .await?;
        let stored = match stored {
            Some(v) => Some(v),
            None => {
                pool.rw("the shard count", move |tx| {
                    let read = read.clone();
                    async move {
                        let mut rs = tx.execute_read(read).await?;
                        let mut stored = None;
                        while let Some(r) = rs.next().await {
                            stored = Some(r?.get::<String>(0)?);
                        }
                        if stored.is_none() {
                            tx.buffer(vec![Mutation::new_insert_builder("onceq_settings")
                                .set("name")
                                .to("spanner.shards".to_string())
                                .set("value")
                                .to(wanted.to_string())
                                .build()])?;
                        }
                        Ok(stored)
                    }
                })
                .await?
            }
        };
        match stored {
            None => Ok(wanted),
            Some(v) => v
                .parse::<u32>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| StoreError::Permanent(format!("onceq_settings has spanner.shards = {v:?}, not a shard count"))),
        }
    }

    /// The rows of a query of the database's INFORMATION_SCHEMA.
    async fn schema_rows(pool: &Arc<Pool>, sql: &'static str) -> StoreResult<Vec<google_cloud_spanner::result::Row>> {
        let c = pool.get().await?;
        let mut rs = c
            .single_use()
            .build()
            .execute_query(Statement::builder(sql).build())
            .await
            .map_err(classify)?;
        let mut rows = Vec::new();
        while let Some(r) = rs.next().await {
            rows.push(r.map_err(classify)?);
        }
        Ok(rows)
    }

    /// Whether `onceq_dedup` has a row deletion policy.
    pub(super) async fn dedup_ttl(pool: &Arc<Pool>) -> StoreResult<bool> {
        let rows = Self::schema_rows(
            pool,
            "SELECT ROW_DELETION_POLICY_EXPRESSION FROM INFORMATION_SCHEMA.TABLES
             WHERE TABLE_SCHEMA = '' AND TABLE_NAME = 'onceq_dedup'",
        )
        .await?;
        let mut ttl = false;
        for r in rows {
            ttl |= r.get::<Option<String>>(0).map_err(classify)?.is_some();
        }
        Ok(ttl)
    }

    /// onceq's own tables and their columns, as (table, column).
    pub(super) async fn system_columns(pool: &Arc<Pool>) -> StoreResult<BTreeSet<(String, String)>> {
        let rows = Self::schema_rows(
            pool,
            "SELECT TABLE_NAME, COLUMN_NAME FROM INFORMATION_SCHEMA.COLUMNS
             WHERE TABLE_SCHEMA = '' AND STARTS_WITH(TABLE_NAME, 'onceq_')",
        )
        .await?;
        let mut out = BTreeSet::new();
        for r in rows {
            out.insert((r.get::<String>(0).map_err(classify)?, r.get::<String>(1).map_err(classify)?));
        }
        Ok(out)
    }

    /// Bring a database made by an older onceq up to date: the `failures`
    /// columns (failures counted apart from deliveries; a queued message
    /// starts with none, a dead letter keeps its old count as its
    /// failures) and the chores table.
    pub(super) async fn migrate(pool: &Arc<Pool>, database: &str, tables: &BTreeSet<(String, String)>) -> anyhow::Result<()> {
        let has = |t: &str, c: &str| tables.contains(&(t.to_string(), c.to_string()));
        let mut ddl = Vec::new();
        for table in ["onceq_messages", "onceq_dead_letters"] {
            if has(table, "id") && !has(table, "failures") {
                ddl.push(format!("ALTER TABLE {table} ADD COLUMN failures INT64 NOT NULL DEFAULT (0)"));
            }
        }
        if has("onceq_messages", "id") && !has("onceq_chores", "chore") {
            ddl.push(CHORES_DDL.split_whitespace().collect::<Vec<_>>().join(" "));
        }
        if has("onceq_messages", "id") && !has("onceq_settings", "name") {
            ddl.push(SETTINGS_DDL.split_whitespace().collect::<Vec<_>>().join(" "));
        }
        if has("onceq_messages", "id") && !has("onceq_audit", "id") {
            ddl.push(AUDIT_DDL.split_whitespace().collect::<Vec<_>>().join(" "));
        }
        if has("onceq_messages", "id") && !has("onceq_paused", "queue") {
            ddl.push(PAUSED_DDL.split_whitespace().collect::<Vec<_>>().join(" "));
        }
        if has("onceq_messages", "id") && !has("onceq_hosts", "id") {
            ddl.push(HOSTS_DDL.split_whitespace().collect::<Vec<_>>().join(" "));
        }
        if ddl.is_empty() {
            return Ok(());
        }
        tracing::info!(%database, "bringing onceq's tables up to date: {}", ddl.join("; "));
        update_ddl(database, ddl).await?;
        if has("onceq_dead_letters", "id") && !has("onceq_dead_letters", "failures") {
            let stmt = Statement::builder("UPDATE onceq_dead_letters SET failures = attempts WHERE failures = 0").build();
            pool.rw("the dead letters' failure counts", move |tx| {
                let stmt = stmt.clone();
                async move { tx.execute_update(stmt).await }
            })
            .await
            .map_err(|e| anyhow::Error::new(e).context(format!("setting the failure counts of old dead letters in {database}")))?;
        }
        Ok(())
    }

    pub(super) async fn load_schema(pool: &Arc<Pool>) -> StoreResult<Schema> {
        // The columns and the primary keys, read at once.
        let (columns, keys) = tokio::try_join!(
            Self::schema_rows(
                pool,
                "SELECT TABLE_NAME, COLUMN_NAME, SPANNER_TYPE, IS_NULLABLE, COLUMN_DEFAULT IS NOT NULL OR IS_GENERATED = 'ALWAYS' FROM INFORMATION_SCHEMA.COLUMNS
                 WHERE TABLE_SCHEMA = '' AND NOT STARTS_WITH(TABLE_NAME, 'onceq_') ORDER BY TABLE_NAME, ORDINAL_POSITION",
            ),
            Self::schema_rows(
                pool,
                "SELECT TABLE_NAME, COLUMN_NAME FROM INFORMATION_SCHEMA.INDEX_COLUMNS
                 WHERE TABLE_SCHEMA = '' AND INDEX_TYPE = 'PRIMARY_KEY' AND NOT STARTS_WITH(TABLE_NAME, 'onceq_')
                 ORDER BY TABLE_NAME, ORDINAL_POSITION",
            ),
        )?;
        let mut schema = Schema::default();
        for r in columns {
            let (t, c, ty, nullable, has_default): (String, String, String, String, bool) = (
                r.get(0).map_err(classify)?,
                r.get(1).map_err(classify)?,
                r.get(2).map_err(classify)?,
                r.get(3).map_err(classify)?,
                r.get(4).map_err(classify)?,
            );
            let ty = column_type_from_decl(&ty)
                .ok_or_else(|| StoreError::Permanent(format!("table {t}: column {c} has type {ty}, which onceq cannot map")))?;
            schema
                .tables
                .entry(t.clone())
                .or_insert_with(|| TableSchema {
                    name: t.clone(),
                    columns: vec![],
                    primary_key: vec![],
                })
                .columns
                .push(ColumnSchema {
                    name: c,
                    ty,
                    nullable: nullable == "YES",
                    has_default,
                });
        }
        for r in keys {
            let (t, c): (String, String) = (r.get(0).map_err(classify)?, r.get(1).map_err(classify)?);
            if let Some(table) = schema.tables.get_mut(&t) {
                if let Some(i) = table.columns.iter().position(|col| col.name == c) {
                    table.primary_key.push(i);
                    if let Some(col) = table.columns.get_mut(i) {
                        col.nullable = false;
                    }
                }
            }
        }
        Ok(schema)
    }
}
