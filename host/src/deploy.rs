//! Hot swap: deploying a new version of a queue's handler while the host
//! runs, without dropping or double-processing a message.
//!
//! - **Validate first.** A new component is compiled and checked (imports,
//!   exports, world) *before* anything changes; a refused one leaves the
//!   running version serving and the error names the problem.
//! - **Atomic switch, in-flight drain.** The switch replaces the handler the
//!   queue's workers hand *new* leases to ([`QueueRunner::swap_handler`]); a
//!   message already in flight keeps the version it started with through
//!   all its re-runs, and the version is recorded with its outcome (metrics
//!   per version, the dead letter's `handler_version`, the log span).
//!   Exactly-once does not depend on versions at all: the ack is still the
//!   guard.
//! - **Versions** are content hashes (sha256, 16 hex digits) with an
//!   optional label. Each host keeps its deployment history and the
//!   components' bytes in its state folder (`state_dir`):
//!   `deployments.json` and `components/<version>.wasm`, so a restart keeps
//!   the deployed version and `rollback` can return to the previous one.
//! - **Sources**: the config file (`queue.handler`; a changed file wins at
//!   start), the admin API (`onceq deploy`), a watched folder
//!   (`deploy.watch`: `<dir>/<queue>.wasm` replaced on disk), a rollback.
//! - Compiled code is cached on disk by the runtime (`runtime.cache`), so a
//!   restart or a rollback does not recompile.

use crate::config::{Config, QueueConfig};
use crate::protocol::{Handler, QueueRunner};
use crate::runtime::{HandlerLimits, Runtime};
use crate::store::Store;
use anyhow::Context;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// One deployment of a version to a queue.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Deployment {
    pub version: String,
    pub label: Option<String>,
    /// "config", "api", "watch" or "rollback".
    pub source: String,
    /// When, in milliseconds since the Unix epoch (host clock).
    pub at_ms: u64,
    pub size: u64,
    /// Who signed the component, when the host checks signatures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signer: Option<crate::signing::Signer>,
    /// The admin token that deployed it (its name), or `local:USER`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
}

/// What a deploy is given besides the queue.
#[derive(Debug, Clone, Default)]
pub struct Upload {
    pub bytes: Vec<u8>,
    pub label: Option<String>,
    /// "api", "watch" or "rollback".
    pub source: String,
    /// The component's `.minisig` text, if it came with one.
    pub signature: Option<String>,
    /// Who asked (a token's name).
    pub by: Option<String>,
}

/// A row of `onceq versions`.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct VersionInfo {
    #[serde(flatten)]
    pub deployment: Deployment,
    pub active: bool,
}

#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
struct History {
    /// Per queue, oldest first; the last entry is the active version.
    queues: BTreeMap<String, Vec<Deployment>>,
}

/// Why a deploy or a rollback did not happen.
#[derive(Debug, thiserror::Error)]
pub enum DeployFailure {
    #[error("no queue named {0} on this host")]
    UnknownQueue(String),
    #[error("component refused, version {version} not deployed (the running version keeps serving): {reason}")]
    Refused { version: String, reason: String },
    #[error("queue {0} has no earlier version to roll back to")]
    NothingToRollBack(String),
    #[error("label {shown}: {problem}")]
    BadLabel { shown: String, problem: String },
    #[error("{0}")]
    Internal(String),
}

/// Longest deploy label, in bytes.
pub const MAX_LABEL_LEN: usize = 128;

/// Deployments kept per queue in the history: older ones are forgotten,
/// and their stored components removed when no kept entry names them.
pub const MAX_HISTORY: usize = 50;

/// A label is shown in terminals and logs: printable, one line, short.
fn check_label(label: &str) -> Result<(), DeployFailure> {
    let bad = |problem: String| {
        Err(DeployFailure::BadLabel {
            shown: crate::names::quoted(label, 40),
            problem,
        })
    };
    if label.len() > MAX_LABEL_LEN {
        return bad(format!("longer than {MAX_LABEL_LEN} bytes"));
    }
    if crate::names::printable(label) != label {
        return bad("has control, invisible or text-direction characters (a label is shown in terminals and logs)".into());
    }
    Ok(())
}

/// The content hash that names a version.
pub fn version_of(bytes: &[u8]) -> String {
    crate::runtime::version_of_digest(&crate::runtime::component_digest(bytes))
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Store a version's component (or its signature) at `path`, unless the
/// file there holds these bytes already: a host restarting on the same
/// handler rewrote its whole component on every start (a fifth of a
/// JavaScript host's start, docs/src/benchmarks.md). Reading it back to
/// compare costs less than writing it, and a damaged copy is replaced.
fn store_version_file(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let same = std::fs::metadata(path).is_ok_and(|m| m.len() == bytes.len() as u64) && std::fs::read(path).is_ok_and(|b| b == bytes);
    if same {
        return Ok(());
    }
    write_atomic(path, bytes)
}

/// Write `bytes` to `path` atomically (temporary file, then rename).
fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

struct Slot {
    runner: Arc<QueueRunner>,
    limits: HandlerLimits,
}

/// Deploys, rolls back and lists the versions of this host's queues.
pub struct Deployer {
    runtime: Arc<Runtime>,
    trust: crate::signing::Trust,
    dir: PathBuf,
    slots: BTreeMap<String, Slot>,
    history: tokio::sync::Mutex<History>,
}

impl Deployer {
    fn history_path(dir: &Path) -> PathBuf {
        dir.join("deployments.json")
    }

    fn component_path(&self, version: &str) -> PathBuf {
        self.dir.join("components").join(format!("{version}.wasm"))
    }

    /// A stored component's signature, kept beside it.
    fn stored_signature(path: &Path) -> Option<String> {
        crate::signing::read_beside(path).ok().flatten()
    }

    fn load_history(dir: &Path) -> anyhow::Result<History> {
        let p = Self::history_path(dir);
        match std::fs::read(&p) {
            Ok(b) => serde_json::from_slice(&b).with_context(|| format!("{} is not a deployment history", p.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(History::default()),
            Err(e) => Err(e).with_context(|| format!("reading {}", p.display())),
        }
    }

    fn save_history(dir: &Path, h: &History) -> Result<(), DeployFailure> {
        let bytes = serde_json::to_vec_pretty(h).map_err(|e| DeployFailure::Internal(e.to_string()))?;
        write_atomic(&Self::history_path(dir), &bytes)
            .map_err(|e| DeployFailure::Internal(format!("saving the deployment history in {}: {e}", dir.display())))
    }

    /// Build the runners of the configured queues, each on its active
    /// version: the last deployed one, unless the config's handler file
    /// changed since it was last deployed from the config (then that file).
    pub fn open(cfg: &Config, store: &Arc<dyn Store>, runtime: Arc<Runtime>) -> anyhow::Result<(Arc<Deployer>, Vec<Arc<QueueRunner>>)> {
        let dir = cfg.state_dir.clone();
        std::fs::create_dir_all(dir.join("components")).with_context(|| format!("creating the state folder {}", dir.display()))?;
        let mut history = Self::load_history(&dir)?;
        runtime.check_capacity(cfg.queues.iter().map(|q| q.policy.workers).sum())?;
        cfg.warn_unserved_targets();
        let mut slots = BTreeMap::new();
        let mut runners = Vec::new();
        for q in &cfg.queues {
            let mut deployment = None;
            let runner = q.runner(store, |q| {
                let (handler, d) = Self::initial(&dir, &runtime, &cfg.trust, q, history.queues.get(&q.name))?;
                deployment = d;
                Ok(handler)
            })?;
            if let Some(d) = deployment {
                history.queues.entry(q.name.clone()).or_default().push(d);
            }
            slots.insert(
                q.name.clone(),
                Slot {
                    runner: runner.clone(),
                    limits: q.limits,
                },
            );
            runners.push(runner);
        }
        Self::save_history(&dir, &history)?;
        let deployer = Arc::new(Deployer {
            runtime,
            trust: cfg.trust.clone(),
            dir,
            slots,
            history: tokio::sync::Mutex::new(history),
        });
        Ok((deployer, runners))
    }

    /// The handler a queue starts on, and the deployment to record if the
    /// config's file is (newly) the active version.
    fn initial(
        dir: &Path,
        runtime: &Runtime,
        trust: &crate::signing::Trust,
        q: &QueueConfig,
        past: Option<&Vec<Deployment>>,
    ) -> anyhow::Result<(Arc<dyn Handler>, Option<Deployment>)> {
        let bytes = crate::runtime::read_component(&q.handler)
            .with_context(|| format!("queue {}: reading handler {}", q.name, q.handler.display()))?;
        let digest = crate::runtime::component_digest(&bytes);
        let version = crate::runtime::version_of_digest(&digest);
        let last_from_config = past.and_then(|h| h.iter().rev().find(|d| d.source == "config"));
        let active = past.and_then(|h| h.last());
        if let (Some(active), Some(cfgd)) = (active, last_from_config) {
            if cfgd.version == version && active.version != version {
                // Deployed since the config file was last read: keep it.
                let path = dir.join("components").join(format!("{}.wasm", active.version));
                match std::fs::read(&path) {
                    Ok(b) => {
                        // Checked again: the trusted keys may have changed.
                        trust
                            .check(&b, Self::stored_signature(&path).as_deref())
                            .map_err(|e| anyhow::anyhow!("queue {}: deployed version {} refused: {e}", q.name, active.version))?;
                        let h = runtime
                            .load(&b, q.limits)
                            .map_err(|e| anyhow::anyhow!("queue {}: deployed version {} refused: {e}", q.name, active.version))?;
                        return Ok((Arc::new(h), None));
                    }
                    Err(e) => tracing::warn!(
                        queue = %q.name,
                        "deployed version {} is missing ({}: {e}); starting on the config's handler",
                        active.version,
                        path.display()
                    ),
                }
            }
        }
        let signature = crate::signing::read_beside(&q.handler)
            .with_context(|| format!("queue {}: reading the signature of {}", q.name, q.handler.display()))?;
        let signer = trust
            .check(&bytes, signature.as_deref())
            .map_err(|e| anyhow::anyhow!("queue {}: handler {} refused: {e}", q.name, q.handler.display()))?;
        let h = runtime
            .load_digested(&bytes, &digest, q.limits)
            .map_err(|e| anyhow::anyhow!("queue {}: handler {} refused: {e}", q.name, q.handler.display()))?;
        let stored = dir.join("components").join(format!("{version}.wasm"));
        store_version_file(&stored, &bytes).with_context(|| format!("storing version {version} in {}", dir.display()))?;
        if let Some(s) = &signature {
            store_version_file(&crate::signing::signature_path(&stored), s.as_bytes())
                .with_context(|| format!("storing version {version}'s signature in {}", dir.display()))?;
        }
        let record = if active.map(|a| a.version.as_str()) == Some(version.as_str()) {
            None
        } else {
            Some(Deployment {
                version,
                label: None,
                source: "config".into(),
                at_ms: now_ms(),
                size: bytes.len() as u64,
                signer,
                by: None,
            })
        };
        Ok((Arc::new(h), record))
    }

    /// The queues this host can deploy to.
    pub fn queues(&self) -> Vec<String> {
        self.slots.keys().cloned().collect()
    }

    /// Validate and compile `bytes`, then switch `queue` to it. Deploying the
    /// active version again changes nothing (its label may be updated).
    pub fn deploy<'a>(
        &'a self,
        queue: &'a str,
        bytes: Vec<u8>,
        label: Option<String>,
        source: &'a str,
    ) -> crate::BoxFuture<'a, Result<Deployment, DeployFailure>> {
        self.upload(
            queue,
            Upload {
                bytes,
                label,
                source: source.to_string(),
                ..Default::default()
            },
        )
    }

    /// [`Self::deploy`] with a signature and who asked.
    pub fn upload<'a>(&'a self, queue: &'a str, upload: Upload) -> crate::BoxFuture<'a, Result<Deployment, DeployFailure>> {
        Box::pin(async move {
            let Upload {
                bytes,
                label,
                source,
                signature,
                by,
            } = upload;
            let source = source.as_str();
            let slot = self
                .slots
                .get(queue)
                .ok_or_else(|| DeployFailure::UnknownQueue(queue.to_string()))?;
            if let Some(l) = &label {
                check_label(l)?;
            }
            let digest = crate::runtime::component_digest(&bytes);
            let version = crate::runtime::version_of_digest(&digest);
            let signer = self.trust.check(&bytes, signature.as_deref()).map_err(|e| {
                tracing::warn!(queue, version = %version, source, "deploy refused, the running version keeps serving: {e}");
                DeployFailure::Refused {
                    version: version.clone(),
                    reason: e.to_string(),
                }
            })?;
            let (runtime, limits) = (self.runtime.clone(), slot.limits);
            let compiled = {
                let bytes = bytes.clone();
                tokio::task::spawn_blocking(move || runtime.load_digested(&bytes, &digest, limits))
                    .await
                    .map_err(|e| DeployFailure::Internal(format!("compiling: {e}")))?
            };
            let handler = compiled.map_err(|e| {
                // The host's own log says so too, not only the caller's answer.
                tracing::warn!(queue, version = %version, source, "deploy refused, the running version keeps serving: {e}");
                DeployFailure::Refused {
                    version: version.clone(),
                    reason: e.to_string(),
                }
            })?;
            let mut history = self.history.lock().await;
            let entries = history.queues.entry(queue.to_string()).or_default();
            if let Some(active) = entries.last_mut() {
                if active.version == version {
                    if label.is_some() && active.label != label {
                        active.label = label;
                        let d = active.clone();
                        Self::save_history(&self.dir, &history)?;
                        return Ok(d);
                    }
                    return Ok(active.clone());
                }
            }
            store_version_file(&self.component_path(&version), &bytes)
                .map_err(|e| DeployFailure::Internal(format!("storing version {version}: {e}")))?;
            let sig_path = crate::signing::signature_path(&self.component_path(&version));
            match &signature {
                Some(s) => store_version_file(&sig_path, s.as_bytes())
                    .map_err(|e| DeployFailure::Internal(format!("storing version {version}'s signature: {e}")))?,
                None => {
                    let _ = std::fs::remove_file(&sig_path);
                }
            }
            let d = Deployment {
                version,
                label,
                source: source.to_string(),
                at_ms: now_ms(),
                size: bytes.len() as u64,
                signer,
                by,
            };
            let old = slot.runner.swap_handler(Arc::new(handler));
            let entries = history.queues.entry(queue.to_string()).or_default();
            entries.push(d.clone());
            let forgotten: Vec<Deployment> = entries.drain(..entries.len().saturating_sub(MAX_HISTORY)).collect();
            Self::save_history(&self.dir, &history)?;
            // Stored components no kept entry names any more (after the
            // history is saved: a crash in between leaves a file, not a
            // history entry without its component).
            for f in forgotten {
                if !history.queues.values().flatten().any(|e| e.version == f.version) {
                    let _ = std::fs::remove_file(self.component_path(&f.version));
                    let _ = std::fs::remove_file(crate::signing::signature_path(&self.component_path(&f.version)));
                }
            }
            tracing::info!(
                queue,
                from = %old.version(),
                to = %d.version,
                label = d.label.as_deref().unwrap_or(""),
                source,
                "deployed: new leases use the new version; messages in flight finish on the old one"
            );
            Ok(d)
        })
    }

    /// Switch `queue` back to the version active before the current one.
    pub fn rollback<'a>(&'a self, queue: &'a str) -> crate::BoxFuture<'a, Result<Deployment, DeployFailure>> {
        self.rollback_by(queue, None)
    }

    /// [`Self::rollback`], saying who asked.
    pub fn rollback_by<'a>(&'a self, queue: &'a str, by: Option<String>) -> crate::BoxFuture<'a, Result<Deployment, DeployFailure>> {
        Box::pin(async move {
            if !self.slots.contains_key(queue) {
                return Err(DeployFailure::UnknownQueue(queue.to_string()));
            }
            let previous = {
                let history = self.history.lock().await;
                let entries = history.queues.get(queue).cloned().unwrap_or_default();
                let active = entries.last().map(|d| d.version.clone());
                entries
                    .iter()
                    .rev()
                    .find(|d| Some(&d.version) != active.as_ref())
                    .cloned()
                    .ok_or_else(|| DeployFailure::NothingToRollBack(queue.to_string()))?
            };
            let path = self.component_path(&previous.version);
            let bytes = std::fs::read(&path)
                .map_err(|e| DeployFailure::Internal(format!("version {} is no longer stored on this host: {e}", previous.version)))?;
            // Its signature is checked again: a key removed from the
            // trusted ones since cannot come back through a rollback.
            self.upload(
                queue,
                Upload {
                    bytes,
                    label: previous.label,
                    source: "rollback".into(),
                    signature: Self::stored_signature(&path),
                    by,
                },
            )
            .await
        })
    }

    /// A queue's deployments, newest first, the active one marked.
    pub fn versions<'a>(&'a self, queue: &'a str) -> crate::BoxFuture<'a, Result<Vec<VersionInfo>, DeployFailure>> {
        Box::pin(async move {
            if !self.slots.contains_key(queue) {
                return Err(DeployFailure::UnknownQueue(queue.to_string()));
            }
            let history = self.history.lock().await;
            let entries = history.queues.get(queue).cloned().unwrap_or_default();
            let n = entries.len();
            Ok(entries
                .into_iter()
                .enumerate()
                .rev()
                .map(|(i, deployment)| VersionInfo {
                    deployment,
                    active: i + 1 == n,
                })
                .collect())
        })
    }

    /// The version each queue's new leases use.
    pub fn active(&self) -> BTreeMap<String, String> {
        self.slots
            .iter()
            .map(|(q, s)| (q.clone(), s.runner.handler().version().to_string()))
            .collect()
    }

    /// Watch `dir` for `<queue>.wasm` files and deploy each new content
    /// (source "watch"). A refused file is logged once per content.
    pub async fn watch(self: Arc<Self>, dir: PathBuf, every: Duration, mut stop: crate::shutdown::Shutdown) {
        type Stamp = (u64, Option<std::time::SystemTime>);
        let stamp_of = |m: &std::fs::Metadata| -> Stamp { (m.len(), m.modified().ok()) };
        let mut seen: BTreeMap<String, (Stamp, Option<Stamp>)> = BTreeMap::new();
        let mut refused: BTreeMap<String, String> = BTreeMap::new();
        tracing::info!(dir = %dir.display(), "watching for handler files (<queue>.wasm)");
        while !stop.is_requested() {
            for queue in self.queues() {
                let path = dir.join(format!("{queue}.wasm"));
                let Ok(meta) = std::fs::metadata(&path) else { continue };
                // The signature beside it counts too: a .minisig that lands
                // after its component is seen.
                let sig_path = crate::signing::signature_path(&path);
                let stamp = (stamp_of(&meta), std::fs::metadata(&sig_path).ok().map(|m| stamp_of(&m)));
                if seen.get(&queue) == Some(&stamp) {
                    continue;
                }
                let bytes = match crate::runtime::read_component(&path) {
                    Ok(b) => b,
                    Err(e) => {
                        // Said once per change of the file (a FIFO, a
                        // device, a huge file); the host goes on.
                        tracing::error!(queue = %queue, file = %path.display(), "watched handler not read: {e}");
                        seen.insert(queue, stamp);
                        continue;
                    }
                };
                let signature = match crate::signing::read_beside(&path) {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::error!(queue = %queue, file = %sig_path.display(), "watched handler's signature not read: {e}");
                        seen.insert(queue, stamp);
                        continue;
                    }
                };
                let version = format!(
                    "{}{}",
                    version_of(&bytes),
                    signature.as_deref().map(|s| version_of(s.as_bytes())).unwrap_or_default()
                );
                if refused.get(&queue) == Some(&version) {
                    seen.insert(queue, stamp);
                    continue;
                }
                let upload = Upload {
                    bytes,
                    source: "watch".into(),
                    signature,
                    ..Default::default()
                };
                match self.upload(&queue, upload).await {
                    Ok(_) => {
                        seen.insert(queue.clone(), stamp);
                        refused.remove(&queue);
                    }
                    Err(DeployFailure::Refused { version: v, reason }) => {
                        tracing::error!(queue = %queue, file = %path.display(), "watched handler refused, version {v}: {reason}");
                        seen.insert(queue.clone(), stamp);
                        refused.insert(queue, version);
                    }
                    Err(e) => tracing::warn!(queue = %queue, file = %path.display(), "deploying the watched handler failed: {e}"),
                }
            }
            stop.sleep(every).await;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::os::unix::fs::MetadataExt;

    /// A version's file is written when missing or different, and left
    /// alone (the same file, not rewritten) when it holds the bytes
    /// already: a restart on the same handler writes nothing.
    #[test]
    fn a_stored_version_is_rewritten_only_when_it_differs() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("components").join("0123456789abcdef.wasm");
        let bytes = b"\0asm\x0d\x00\x01\x00 a component".to_vec();
        store_version_file(&path, &bytes).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
        let inode = std::fs::metadata(&path).unwrap().ino();

        store_version_file(&path, &bytes).unwrap();
        assert_eq!(
            std::fs::metadata(&path).unwrap().ino(),
            inode,
            "the same bytes are not written again"
        );

        // Damaged in place (same length): replaced by a new file.
        let mut damaged = bytes.clone();
        damaged[10] ^= 0xff;
        std::fs::write(&path, &damaged).unwrap();
        store_version_file(&path, &bytes).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), bytes, "a damaged copy is replaced");
        assert_ne!(std::fs::metadata(&path).unwrap().ino(), inode);

        // Cut short: replaced too.
        std::fs::write(&path, &bytes[..8]).unwrap();
        store_version_file(&path, &bytes).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
        let leftovers: Vec<_> = std::fs::read_dir(path.parent().unwrap()).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temporary file left behind");
    }
}
