//! One way to assemble and run a host. `onceq run`, the demo and the tests
//! all go through [`Host`]: [`Host::assemble`] is the one place the
//! configured queues get their handlers (their active versions), the
//! capacity is checked, unserved follow-up targets are warned of and an
//! empty config is refused; [`Host::run`] works the queues until a
//! shutdown or, with `until_empty`, until no work is left, bounded by a
//! grace. The store outlives a run (a test drains it, then looks):
//! whoever opened it closes it ([`Store::close`]).

use crate::config::Config;
use crate::deploy::Deployer;
use crate::outbox;
use crate::protocol::{self, QueueRunner};
use crate::runtime::Runtime;
use crate::shutdown::Stop;
use crate::store::Store;
use anyhow::bail;
use std::sync::Arc;
use std::time::Duration;

/// A store, the runners working its queues, and what deploys to them.
pub struct Host {
    pub store: Arc<dyn Store>,
    pub runners: Vec<Arc<QueueRunner>>,
    /// Deploys, rollbacks and versions (none for a host of runners made
    /// by hand: tests, the bench).
    pub deployer: Option<Arc<Deployer>>,
}

/// How a [`Host::run`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ran {
    /// Work was still in flight when the grace ran out (its leases expire
    /// and another host processes it).
    pub cut_short: bool,
}

impl Host {
    /// The configured queues on their active versions (the last deployed
    /// one, unless the config's handler changed since), and one outbox
    /// dispatcher per connector.
    pub fn assemble(cfg: &Config, store: Arc<dyn Store>, runtime: Arc<Runtime>) -> anyhow::Result<Host> {
        if cfg.queues.is_empty() && cfg.connectors.is_empty() {
            bail!("no [[queue]] and no [[connector]] configured: nothing to run");
        }
        let (deployer, mut runners) = Deployer::open(cfg, &store, runtime)?;
        for (name, c) in &cfg.connectors {
            let connector = c.build(name)?;
            tracing::info!(connector = %name, kind = c.kind(), queue = %outbox::queue_of(name), "outbox dispatcher ready");
            runners.push(Arc::new(outbox::runner(store.clone(), name, connector, &cfg.outbox)));
        }
        Ok(Host {
            store,
            runners,
            deployer: Some(deployer),
        })
    }

    /// A host of runners made by hand (tests, the bench).
    pub fn of(store: Arc<dyn Store>, runners: Vec<Arc<QueueRunner>>) -> Host {
        Host {
            store,
            runners,
            deployer: None,
        }
    }

    /// Work every queue until `stop` is requested or, with `until_empty`,
    /// until no work is left. After the request, messages in flight finish
    /// (leased, unstarted ones are released) within `grace`; past it the
    /// host goes anyway and the leases of what it held expire.
    pub fn run(&self, stop: Stop, until_empty: bool, grace: Duration) -> crate::BoxFuture<'static, Ran> {
        let (store, runners) = (self.store.clone(), self.runners.clone());
        Box::pin(async move {
            let serving = protocol::run_queues(store, runners.clone(), stop.clone(), until_empty);
            let mut requested = stop.subscribe();
            let overdue = async move {
                requested.requested().await;
                tokio::time::sleep(grace).await;
            };
            let cut_short = tokio::select! {
                () = serving => false,
                () = overdue => {
                    let in_flight: i64 = runners.iter().map(|r| r.metrics.in_flight.load(std::sync::atomic::Ordering::Relaxed)).sum();
                    tracing::warn!(
                        in_flight,
                        "shutdown grace of {} over (setting shutdown_grace): exiting with work in flight; its leases will expire and another host will process it",
                        crate::names::duration(grace)
                    );
                    true
                }
            };
            Ran { cut_short }
        })
    }
}

/// How often a serving host (`onceq run`) says it is alive, for the
/// console's "hosts seen" and `/v1/overview`.
pub const HOST_BEAT: Duration = Duration::from_secs(10);

/// Say this host is alive every [`HOST_BEAT`] until shutdown: what it
/// serves, what it is working on, what it finished. A failed beat is
/// logged at debug and tried at the next: it is information, not work.
pub async fn heartbeat(store: Arc<dyn Store>, runners: Vec<Arc<QueueRunner>>, mut shutdown: crate::shutdown::Shutdown) {
    let mut beat = crate::store::HostBeat {
        id: crate::value::random_id()[..16].to_string(),
        name: machine_name(),
        pid: i64::from(std::process::id()),
        version: env!("CARGO_PKG_VERSION").to_string(),
        started_at: crate::store::now_micros(),
        seen_at: 0,
        queues: runners.iter().map(|r| r.spec.name.clone()).collect(),
        in_flight: 0,
        finished: 0,
    };
    while !shutdown.is_requested() {
        beat.in_flight = runners
            .iter()
            .map(|r| r.metrics.in_flight.load(std::sync::atomic::Ordering::Relaxed))
            .sum();
        beat.finished = runners.iter().map(|r| r.metrics.finished()).sum::<u64>() as i64;
        match tokio::time::timeout(HOST_BEAT, store.host_beat(&beat)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::debug!("the heartbeat failed (next in {HOST_BEAT:?}): {e}"),
            Err(_) => tracing::debug!("the heartbeat took over {HOST_BEAT:?}"),
        }
        shutdown.sleep(HOST_BEAT).await;
    }
}

/// This machine's name: `/proc/sys/kernel/hostname` (Linux), else
/// `$HOSTNAME`, else "unknown".
fn machine_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into())
}
