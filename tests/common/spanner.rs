//! A database on the Cloud Spanner emulator for each test. The emulator is
//! started by `tests/with-spanner-emulator.sh` (which `make test` uses), on
//! free ports, and stopped by pid afterwards.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use onceq::store::spanner::{SpannerOptions, SpannerStore};
use onceq::store::{Store, StoreOptions};
use std::sync::Arc;

pub const PROJECT: &str = "onceq";
pub const INSTANCE: &str = "onceq-test";

/// A name for a database that does not exist yet, on the test instance.
pub fn database_name() -> String {
    format!("projects/{PROJECT}/instances/{INSTANCE}/databases/t{:x}", rand::random::<u64>())
}

/// How a test's own store instance opens `database`: `shards`, two
/// clients, the default call deadline.
pub fn spanner_options(database: &str, shards: u32) -> SpannerOptions {
    SpannerOptions {
        database: database.to_string(),
        shards,
        clients: 2,
        exclusive: None,
        call_timeout: StoreOptions::default().spanner_call_timeout,
    }
}

/// A fresh database with `ddl` (GoogleSQL), on the running emulator.
pub async fn spanner_db(ddl: &str, options: StoreOptions) -> (Arc<dyn Store>, String) {
    assert!(
        std::env::var("SPANNER_EMULATOR_HOST").is_ok(),
        "SPANNER_EMULATOR_HOST is not set: run the Spanner tests through `make test` \
         (or tests/with-spanner-emulator.sh cargo test), which starts the emulator"
    );
    let database = database_name();
    let opts = SpannerOptions {
        clients: 4,
        call_timeout: options.spanner_call_timeout,
        ..spanner_options(&database, 4)
    };
    let store = SpannerStore::init(&opts, ddl, &options)
        .await
        .expect("create the emulator database");
    (Arc::new(store), database)
}

/// Reads a database with Google's client directly, not through onceq's
/// store code: the chaos audit's own eyes.
pub struct Audit {
    client: google_cloud_spanner::client::DatabaseClient,
}

impl Audit {
    pub async fn new(database: &str) -> Audit {
        let spanner = google_cloud_spanner::client::Spanner::builder().build().await.unwrap();
        let client = spanner.database_client(database.to_string()).build().await.unwrap();
        Audit { client }
    }

    /// The first column of each row the query returns, as text.
    pub async fn strings(&self, sql: &str) -> Vec<String> {
        use google_cloud_spanner::statement::Statement;
        let mut rs = self
            .client
            .single_use()
            .build()
            .execute_query(Statement::builder(sql.to_string()).build())
            .await
            .unwrap();
        let mut out = Vec::new();
        while let Some(r) = rs.next().await {
            out.push(r.unwrap().get::<String>(0).unwrap());
        }
        out
    }

    /// Write `rows` in one write-only transaction (test set-up behind the
    /// store's back).
    pub async fn write(&self, rows: Vec<google_cloud_spanner::mutation::Mutation>) {
        self.client.write_only_transaction().build().write(rows).await.unwrap();
    }

    /// The one INT64 the query returns (queried as its text).
    pub async fn int(&self, sql: &str) -> i64 {
        let got = self.strings(&format!("SELECT CAST(({sql}) AS STRING)")).await;
        got[0].parse().unwrap()
    }
}
