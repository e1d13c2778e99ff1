//! The on-disk compiled-component cache (`runtime.cache`).
//!
//! JavaScript and Python components are 12–19 MB of Wasm and take seconds
//! to compile; a restart or a redeploy of known bytes must not pay that
//! again. Each compiled component is stored as wasmtime's serialized form
//! in `<dir>/<sha256 of the bytes>-<engine>.cwasm`, where `<engine>` hashes
//! wasmtime's compatibility key (its version and every setting that
//! affects code). A hit is read and handed to `Component::deserialize`:
//! no decompression and no second hash of the bytes, so loading a cached
//! 19 MB component takes tens of milliseconds. (Read rather than
//! memory-mapped: a mapped file truncated by anyone would kill the host
//! with SIGBUS.)
//!
//! Trust: a `.cwasm` file is native code that wasmtime runs without
//! re-validating it, so the folder must be as trusted as the onceq binary
//! (it is inside `state_dir`, written only by onceq). wasmtime still checks
//! that a file was produced by a compatible engine and refuses any other;
//! a refused or unreadable entry is removed and the component recompiled.
//! Entries are written to a temporary file and renamed into place, so a
//! crash never leaves a partial entry under a real name. The folder keeps
//! the [`KEEP`] most recently written entries.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use wasmtime::component::Component;
use wasmtime::Engine;

/// Entries kept (the oldest beyond this are removed after a write).
pub const KEEP: usize = 32;

/// A folder of compiled components for one engine configuration.
pub struct CodeCache {
    dir: PathBuf,
    engine_key: String,
}

impl CodeCache {
    /// Open (create) the folder.
    pub fn open(dir: &Path, engine: &Engine) -> anyhow::Result<CodeCache> {
        std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("creating the compiled-component cache {}: {e}", dir.display()))?;
        let mut h = std::collections::hash_map::DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut h);
        Ok(CodeCache {
            dir: dir.to_path_buf(),
            engine_key: format!("{:016x}", h.finish()),
        })
    }

    fn entry(&self, digest: &[u8]) -> PathBuf {
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        self.dir.join(format!("{hex}-{}.cwasm", self.engine_key))
    }

    /// The compiled component for `bytes` (whose SHA-256 is `digest`): from
    /// the cache, or compiled and stored.
    pub fn component(&self, engine: &Engine, bytes: &[u8], digest: &[u8]) -> wasmtime::Result<Component> {
        let path = self.entry(digest);
        if let Ok(code) = std::fs::read(&path) {
            // Read, not memory-mapped: a file truncated under a mapping would
            // kill the process with SIGBUS.
            // SAFETY: the bytes are wasmtime's own serialized output, written
            // by this cache (temp file + rename) in onceq's state folder,
            // which is as trusted as the binary; wasmtime checks their header
            // against this engine's version and settings and refuses a
            // mismatch.
            #[allow(unsafe_code)]
            let cached = unsafe { Component::deserialize(engine, &code) };
            match cached {
                Ok(c) => return Ok(c),
                Err(e) => {
                    tracing::warn!(path = %path.display(), "compiled-component cache entry refused, recompiling: {e:#}");
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        let component = Component::new(engine, bytes)?;
        if let Err(e) = self.store(&component, &path) {
            tracing::warn!(path = %path.display(), "could not write the compiled-component cache: {e:#}");
        }
        Ok(component)
    }

    fn store(&self, component: &Component, path: &Path) -> anyhow::Result<()> {
        let code = component.serialize()?;
        let tmp = self.dir.join(format!(".tmp-{}-{:016x}", std::process::id(), rand::random::<u64>()));
        std::fs::write(&tmp, &code)?;
        if let Err(e) = std::fs::rename(&tmp, path) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e.into());
        }
        self.prune();
        Ok(())
    }

    /// Keep the [`KEEP`] newest entries; remove temporary files a crash
    /// left behind (older than an hour).
    fn prune(&self) {
        let Ok(rd) = std::fs::read_dir(&self.dir) else { return };
        let hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        let mut entries: Vec<(std::time::SystemTime, PathBuf)> = Vec::new();
        for e in rd.filter_map(Result::ok) {
            let (path, Some(modified)) = (e.path(), e.metadata().ok().and_then(|m| m.modified().ok())) else {
                continue;
            };
            if path.extension().is_some_and(|x| x == "cwasm") {
                entries.push((modified, path));
            } else if e.file_name().to_string_lossy().starts_with(".tmp-") && modified < hour_ago {
                let _ = std::fs::remove_file(&path);
            }
        }
        if entries.len() <= KEEP {
            return;
        }
        entries.sort();
        for (_, p) in &entries[..entries.len() - KEEP] {
            let _ = std::fs::remove_file(p);
        }
    }
}
