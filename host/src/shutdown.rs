//! Shutdown, as every task of a host sees it (after mini-redis's
//! `Shutdown`): a [`Stop`] requests it once, for everyone; each task holds
//! a [`Shutdown`] and asks whether it was requested, waits for it, or
//! sleeps unless it comes. A leaf: it imports nothing of onceq's.

use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Requests the shutdown (a signal handler, `--until-empty`, a test).
#[derive(Debug, Clone)]
pub struct Stop {
    tx: Arc<watch::Sender<bool>>,
}

/// A task's view of the shutdown.
#[derive(Debug, Clone)]
pub struct Shutdown {
    rx: watch::Receiver<bool>,
    /// Held by [`Shutdown::never`] so that its sender outlives the view.
    _keep: Option<Arc<watch::Sender<bool>>>,
}

/// A new shutdown, not requested yet.
pub fn channel() -> (Stop, Shutdown) {
    let (tx, rx) = watch::channel(false);
    (Stop { tx: Arc::new(tx) }, Shutdown { rx, _keep: None })
}

impl Stop {
    /// Request the shutdown (again is harmless).
    pub fn request(&self) {
        self.tx.send_replace(true);
    }

    /// Another view of this shutdown, for a new task.
    pub fn subscribe(&self) -> Shutdown {
        Shutdown {
            rx: self.tx.subscribe(),
            _keep: None,
        }
    }

    pub fn is_requested(&self) -> bool {
        *self.tx.borrow()
    }
}

impl Shutdown {
    /// A shutdown nobody will request (a test's runner, a one-off run).
    pub fn never() -> Shutdown {
        let (stop, mut shutdown) = channel();
        shutdown._keep = Some(stop.tx);
        shutdown
    }

    pub fn is_requested(&self) -> bool {
        *self.rx.borrow()
    }

    /// Wait until it is requested (at once if it was). Also returns if
    /// every [`Stop`] is gone: nobody is left to request it, and a task
    /// waiting only for the shutdown should end rather than hang.
    pub async fn requested(&mut self) {
        let _ = self.rx.wait_for(|stop| *stop).await;
    }

    /// Sleep `d`, or less if the shutdown is requested meanwhile; true if
    /// it was. A shutdown whose every [`Stop`] is gone sleeps the whole `d`.
    pub async fn sleep(&mut self, d: Duration) -> bool {
        let wake = tokio::time::sleep(d);
        tokio::pin!(wake);
        tokio::select! {
            () = &mut wake => return self.is_requested(),
            () = self.requested() => {}
        }
        if self.is_requested() {
            return true;
        }
        wake.await;
        self.is_requested()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn every_view_sees_the_request_and_sleeps_end_at_it() {
        let (stop, mut a) = channel();
        let mut b = stop.subscribe();
        assert!(!a.is_requested() && !b.is_requested());
        let sleeper = tokio::spawn(async move { b.sleep(Duration::from_secs(3600)).await });
        tokio::time::sleep(Duration::from_secs(1)).await;
        stop.request();
        assert!(sleeper.await.unwrap_or(false), "the sleep ended at the request");
        a.requested().await;
        assert!(a.is_requested() && stop.is_requested());
        assert!(stop.subscribe().is_requested(), "a view made after the request sees it");
        let mut never = Shutdown::never();
        let before = tokio::time::Instant::now();
        assert!(!never.sleep(Duration::from_millis(10)).await);
        assert!(
            before.elapsed() >= Duration::from_millis(10),
            "a never-shutdown sleeps the whole time"
        );
        let (gone, mut orphan) = channel();
        drop(gone);
        let before = tokio::time::Instant::now();
        assert!(!orphan.sleep(Duration::from_millis(10)).await, "nobody requested it");
        assert!(
            before.elapsed() >= Duration::from_millis(10),
            "an orphaned view sleeps the whole time"
        );
    }
}
