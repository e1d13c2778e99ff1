//! Taking turns at the Spanner emulator.
//!
//! The emulator runs one read-write transaction per database at a time. A
//! transaction that asks while another runs is aborted at once, or, now and
//! then, the running one is aborted instead ("getting priority"). So
//! transactions that overlap abort each other, and the longest ones (a
//! commit of a whole batch) lose most often: three hosts on one emulator
//! database processed fewer messages between them than one host alone
//! (docs/src/benchmarks.md).
//!
//! On the emulator, a host's read-write transactions therefore take turns:
//! inside the process through a FIFO semaphore, and across the processes of
//! the machine through an exclusive lock (`flock`) on a file in the
//! temporary folder named after the database. Each turn opens the file
//! afresh, so two turns never share a lock, and closing it releases it; a
//! process that dies releases its lock with its files. A transaction it
//! left open in the emulator is ended by the emulator once another one gets
//! priority (within seconds), meanwhile the others abort and re-run as
//! before.
//!
//! Hosts that do not share the temporary folder (other machines or
//! containers) do not see each other's turns: they abort each other and
//! re-run, as before. Correctness never rests on the turns; only the
//! emulator's throughput does. Real Spanner locks rows, not the database,
//! and takes no turns.

use std::fs::{File, OpenOptions, TryLockError};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::sync::{Semaphore, SemaphorePermit};
use tokio::time::Instant;

/// The longest pause between two tries at another process's lock. The
/// releasing process waits as long before it takes the lock again, so the
/// processes of a machine get turns about evenly.
const POLL: Duration = Duration::from_millis(2);

/// The turns of one database on the emulator.
pub(crate) struct Turns {
    local: Semaphore,
    /// The machine-wide lock file. A turn that cannot open or lock it (a
    /// read-only temporary folder) is a local turn only, said once.
    path: PathBuf,
    /// This process released the machine lock and has not taken it since.
    just_released: AtomicBool,
    warned: AtomicBool,
}

/// One turn: held until dropped.
pub(crate) struct Turn<'a> {
    turns: &'a Turns,
    _permit: SemaphorePermit<'a>,
    file: Option<File>,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            self.turns.just_released.store(true, Ordering::Relaxed);
        }
    }
}

impl Turns {
    /// Turns for `database` (`projects/P/instances/I/databases/D`).
    pub(crate) fn new(database: &str) -> Turns {
        let name: String = database
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' })
            .collect();
        Turns::at(std::env::temp_dir().join(format!("onceq-emulator-{name}.lock")))
    }

    fn at(path: PathBuf) -> Turns {
        Turns {
            local: Semaphore::new(1),
            path,
            just_released: AtomicBool::new(false),
            warned: AtomicBool::new(false),
        }
    }

    /// Wait for this process's turn, then the machine's, for at most
    /// `within`. `Err` names what was waited for.
    pub(crate) async fn take(&self, within: Duration) -> Result<Turn<'_>, String> {
        let deadline = Instant::now() + within;
        let permit = match tokio::time::timeout_at(deadline, self.local.acquire()).await {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => return Err(format!("this host's turn: {e}")),
            Err(_) => return Err("this host's turn".into()),
        };
        let mut turn = Turn {
            turns: self,
            _permit: permit,
            file: None,
        };
        let path = &self.path;
        let file = match OpenOptions::new().create(true).truncate(false).write(true).open(path) {
            Ok(f) => f,
            Err(e) => {
                self.warn_once(path, &e.to_string());
                return Ok(turn);
            }
        };
        if self.just_released.swap(false, Ordering::Relaxed) {
            tokio::time::sleep(pause()).await;
        }
        loop {
            match file.try_lock() {
                Ok(()) => {
                    turn.file = Some(file);
                    return Ok(turn);
                }
                Err(TryLockError::WouldBlock) => {}
                Err(TryLockError::Error(e)) => {
                    self.warn_once(path, &e.to_string());
                    return Ok(turn);
                }
            }
            if Instant::now() >= deadline {
                return Err(format!("the other processes' turns on this machine ({})", path.display()));
            }
            tokio::time::sleep(pause().min(deadline.saturating_duration_since(Instant::now()))).await;
        }
    }

    fn warn_once(&self, path: &std::path::Path, e: &str) {
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "cannot lock {} ({e}): this host's emulator transactions take turns with each other but not with other processes'",
                path.display()
            );
        }
    }
}

fn pause() -> Duration {
    POLL.mul_f64(rand::random::<f64>())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use std::sync::Arc;

    /// Two `Turns` on one file stand for two processes: each turn opens the
    /// file afresh, so they exclude each other as processes do.
    fn two(dir: &tempfile::TempDir) -> (Arc<Turns>, Arc<Turns>) {
        let path = dir.path().join("db.lock");
        (Arc::new(Turns::at(path.clone())), Arc::new(Turns::at(path)))
    }

    #[tokio::test]
    async fn another_process_waits_for_the_turn_and_times_out_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = two(&dir);
        let held = a.take(Duration::from_secs(5)).await.unwrap();
        let err = b.take(Duration::from_millis(50)).await.err().expect("the lock is held");
        assert!(err.contains("other processes' turns"), "{err}");
        // Released: the other process gets its turn while waiting for it.
        let waiter = tokio::spawn({
            let b = b.clone();
            async move { b.take(Duration::from_secs(30)).await.map(|_| ()) }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "it waits while the turn is held");
        drop(held);
        waiter.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn turns_alternate_between_processes() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = two(&dir);
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let run = |t: Arc<Turns>, name: &'static str| {
            let order = order.clone();
            tokio::spawn(async move {
                for _ in 0..20 {
                    let _turn = t.take(Duration::from_secs(30)).await.unwrap();
                    order.lock().unwrap().push(name);
                    tokio::time::sleep(Duration::from_millis(3)).await;
                }
            })
        };
        let (x, y) = (run(a, "a"), run(b, "b"));
        x.await.unwrap();
        y.await.unwrap();
        let order = order.lock().unwrap();
        // Neither process keeps the lock for a long run of turns.
        let longest = order.chunk_by(|p, q| p == q).map(<[_]>::len).max().unwrap();
        assert!(longest <= 10, "longest run of one process: {longest} in {order:?}");
    }

    #[tokio::test]
    async fn without_a_lock_file_turns_are_local_only() {
        // A lock file that cannot be opened (its folder does not exist).
        let dir = tempfile::tempdir().unwrap();
        let t = Turns::at(dir.path().join("missing").join("db.lock"));
        let held = t.take(Duration::from_secs(1)).await.unwrap();
        assert!(held.file.is_none(), "no machine-wide lock");
        let err = t.take(Duration::from_millis(20)).await.err().expect("one turn at a time");
        assert!(err.contains("this host's turn"), "{err}");
        drop(held);
        t.take(Duration::from_millis(20)).await.unwrap();
    }
}
