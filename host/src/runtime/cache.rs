//! The on-disk compiled-component cache (`runtime.cache`).
//!
//! JavaScript and Python components are 12–19 MB of Wasm and take seconds
//! to compile; a restart or a redeploy of known bytes must not pay that
//! again. Each compiled component is stored as wasmtime's serialized form
//! in `<dir>/<sha256 of the bytes>-<engine>.cwasm`, where `<engine>` hashes
//! wasmtime's compatibility key (its version and every setting that
//! affects code). A hit is read, its checksum checked, and handed to
//! `Component::deserialize`: no decompression and no hash of the
//! component's own bytes, so loading a cached 19 MB component takes tens
//! of milliseconds. (Read rather than
//! memory-mapped: a mapped file truncated by anyone would kill the host
//! with SIGBUS.)
//!
//! Trust: a `.cwasm` file is native code that wasmtime runs without
//! re-validating it, so the folder must be as trusted as the onceq binary
//! (it is inside `state_dir`, written only by onceq). Against damage (a
//! disk error, a stray write, a partial copy) each entry ends with the
//! CRC-32 of its code, checked before wasmtime sees it: damaged code
//! would otherwise run and kill the host (SIGILL, SIGSEGV). wasmtime then
//! checks that the code was produced by a compatible engine. A damaged,
//! refused or unreadable entry is removed and the component recompiled.
//! The checksum is not a signature: whoever can write the folder can write
//! a matching one, so a cryptographic hash would buy nothing here. It
//! was SHA-256 until a start of the JavaScript example spent a fifth of
//! its CPU hashing the 43 MB entry (docs/src/benchmarks.md); CRC-32 reads
//! it about eight times as fast (4 against 35 ms for a 37 MB entry) and
//! still finds every burst of damage up to 32 bits and all but one in 4
//! billion of the others.
//! Entries are written to a temporary file and renamed into place, so a
//! crash never leaves a partial entry under a real name.
//!
//! Bounded (`runtime.cache_max_bytes`): a hit marks its entry used (its
//! modification time), and after each write the least recently used
//! entries are removed until the folder fits; `onceq cache prune` does the
//! same on demand.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use wasmtime::component::Component;
use wasmtime::Engine;

/// The default bound of the folder (`runtime.cache_max_bytes`): a dozen
/// JavaScript or Python components, hundreds of Rust ones.
pub const DEFAULT_MAX_BYTES: u64 = 512 << 20;

/// A folder of compiled components for one engine configuration.
pub struct CodeCache {
    dir: PathBuf,
    engine_key: String,
    max_bytes: u64,
}

/// What a prune did.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Pruned {
    pub removed: usize,
    pub freed_bytes: u64,
    pub kept: usize,
    pub kept_bytes: u64,
}

/// Remove the least recently used entries of the cache folder `dir` until
/// they total at most `max_bytes`, sparing `keep` (an entry just written);
/// and temporary files a crash left behind (older than an hour). Entries
/// of every engine are counted (a wasmtime upgrade leaves the old ones to
/// age out).
pub fn prune(dir: &Path, max_bytes: u64, keep: Option<&Path>) -> std::io::Result<Pruned> {
    let hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    let mut entries: Vec<(std::time::SystemTime, u64, PathBuf)> = Vec::new();
    for e in std::fs::read_dir(dir)?.filter_map(Result::ok) {
        let path = e.path();
        let Some(meta) = e.metadata().ok() else { continue };
        let modified = meta.modified().unwrap_or(std::time::UNIX_EPOCH);
        if path.extension().is_some_and(|x| x == "cwasm") {
            entries.push((modified, meta.len(), path));
        } else if e.file_name().to_string_lossy().starts_with(".tmp-") && modified < hour_ago {
            let _ = std::fs::remove_file(&path);
        }
    }
    entries.sort();
    let mut total: u64 = entries.iter().map(|(_, len, _)| len).sum();
    let mut out = Pruned::default();
    for (_, len, path) in &entries {
        if total <= max_bytes {
            break;
        }
        if keep.is_some_and(|k| k == path) {
            continue;
        }
        if std::fs::remove_file(path).is_ok() {
            total = total.saturating_sub(*len);
            out.removed += 1;
            out.freed_bytes += len;
        }
    }
    out.kept = entries.len() - out.removed;
    out.kept_bytes = total;
    Ok(out)
}

impl CodeCache {
    /// Open (create) the folder.
    pub fn open(dir: &Path, engine: &Engine, max_bytes: u64) -> anyhow::Result<CodeCache> {
        std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("creating the compiled-component cache {}: {e}", dir.display()))?;
        let mut h = std::collections::hash_map::DefaultHasher::new();
        engine.precompile_compatibility_hash().hash(&mut h);
        Ok(CodeCache {
            dir: dir.to_path_buf(),
            engine_key: format!("{:016x}", h.finish()),
            max_bytes,
        })
    }

    /// Whether the compiled component for bytes of SHA-256 `digest` is here.
    pub fn has(&self, digest: &[u8]) -> bool {
        self.entry(digest).is_file()
    }

    fn entry(&self, digest: &[u8]) -> PathBuf {
        let hex = crate::names::hex(digest);
        // `-c`: entries ending with their CRC-32 (older ones, `-s` with a
        // SHA-256, age out).
        self.dir.join(format!("{hex}-{}-c.cwasm", self.engine_key))
    }

    /// The compiled component for `bytes` (whose SHA-256 is `digest`): from
    /// the cache, or compiled and stored.
    pub fn component(&self, engine: &Engine, bytes: &[u8], digest: &[u8]) -> wasmtime::Result<Component> {
        let path = self.entry(digest);
        if let Ok(entry) = std::fs::read(&path) {
            // Read, not memory-mapped: a file truncated under a mapping would
            // kill the process with SIGBUS.
            let Some(code) = checked(&entry) else {
                tracing::warn!(path = %path.display(), "compiled-component cache entry damaged (checksum mismatch), recompiling");
                let _ = std::fs::remove_file(&path);
                return self.compile_and_store(engine, bytes, &path);
            };
            // SAFETY: the bytes are wasmtime's own serialized output, written
            // by this cache (temp file + rename) in onceq's state folder,
            // which is as trusted as the binary; wasmtime checks their header
            // against this engine's version and settings and refuses a
            // mismatch.
            #[allow(unsafe_code)]
            let cached = unsafe { Component::deserialize(engine, code) };
            match cached {
                Ok(c) => {
                    // Used now: the last entry a prune removes.
                    if let Ok(f) = std::fs::File::options().write(true).open(&path) {
                        let _ = f.set_modified(std::time::SystemTime::now());
                    }
                    return Ok(c);
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), "compiled-component cache entry refused, recompiling: {e:#}");
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        self.compile_and_store(engine, bytes, &path)
    }

    fn compile_and_store(&self, engine: &Engine, bytes: &[u8], path: &Path) -> wasmtime::Result<Component> {
        let component = Component::new(engine, bytes)?;
        if let Err(e) = self.store(&component, path) {
            tracing::warn!(path = %path.display(), "could not write the compiled-component cache: {e:#}");
        }
        Ok(component)
    }

    fn store(&self, component: &Component, path: &Path) -> anyhow::Result<()> {
        let mut code = component.serialize()?;
        let sum = crc32fast::hash(&code);
        code.extend_from_slice(&sum.to_le_bytes());
        let tmp = self.dir.join(format!(".tmp-{}-{:016x}", std::process::id(), rand::random::<u64>()));
        std::fs::write(&tmp, &code)?;
        if let Err(e) = std::fs::rename(&tmp, path) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e.into());
        }
        self.prune(path);
        Ok(())
    }

    /// Fit the folder in its bound, sparing the entry at `written`.
    fn prune(&self, written: &Path) {
        if let Err(e) = prune(&self.dir, self.max_bytes, Some(written)) {
            tracing::warn!(dir = %self.dir.display(), "could not prune the compiled-component cache: {e}");
        }
    }
}

/// The code of a cache entry whose trailing CRC-32 (little-endian)
/// matches it.
fn checked(entry: &[u8]) -> Option<&[u8]> {
    let split = entry.len().checked_sub(4)?;
    let (code, sum) = entry.split_at(split);
    (crc32fast::hash(code).to_le_bytes() == sum).then_some(code)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn prune_removes_the_least_recently_used_until_the_folder_fits() {
        let dir = tempfile::tempdir().unwrap();
        let put = |name: &str, len: usize, age_s: u64| {
            let p = dir.path().join(name);
            std::fs::write(&p, vec![0u8; len]).unwrap();
            let f = std::fs::File::options().write(true).open(&p).unwrap();
            f.set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(age_s))
                .unwrap();
            p
        };
        let oldest = put("a.cwasm", 100, 300);
        let used = put("b.cwasm", 100, 200);
        let newest = put("c.cwasm", 100, 100);
        let just_written = put("d.cwasm", 100, 400); // oldest time, but spared
        std::fs::write(dir.path().join("other.txt"), b"not an entry").unwrap();
        let pruned = prune(dir.path(), 250, Some(&just_written)).unwrap();
        assert_eq!(
            pruned,
            Pruned {
                removed: 2,
                freed_bytes: 200,
                kept: 2,
                kept_bytes: 200
            }
        );
        assert!(!oldest.exists() && !used.exists());
        assert!(newest.exists() && just_written.exists());
        assert!(dir.path().join("other.txt").exists(), "only entries are removed");
        let all = prune(dir.path(), 0, None).unwrap();
        assert_eq!((all.removed, all.kept, all.kept_bytes), (2, 0, 0));
    }
}
