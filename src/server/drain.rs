//! The shutdown drain: counting the operations that own a key, so a server can wait for them at
//! shutdown: their work runs on tasks of its own, which a server's graceful
//! shutdown does not see once their clients have gone.

use std::sync::{
    atomic::{AtomicUsize, Ordering},
    Arc,
};

use tokio::sync::Notify;

#[derive(Debug, Default)]
pub(crate) struct Drain {
    running: AtomicUsize,
    idle: Notify,
}

/// One running operation; dropping it (finished, failed or panicked) counts it out.
pub(crate) struct Counted(Arc<Drain>);

impl Drain {
    pub(crate) fn start(self: &Arc<Self>) -> Counted {
        self.running.fetch_add(1, Ordering::SeqCst);
        Counted(self.clone())
    }

    pub(crate) async fn idle(&self) {
        loop {
            let notified = self.idle.notified();
            let mut notified = std::pin::pin!(notified);
            // Registered before the check, so a wake-up in between is not lost.
            notified.as_mut().enable();
            if self.running.load(Ordering::SeqCst) == 0 {
                return;
            }
            notified.await;
        }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        if self.0.running.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn idle_waits_for_every_running_operation() {
        let drain = Arc::new(Drain::default());
        drain.idle().await;
        let (a, b) = (drain.start(), drain.start());
        let waiter = tokio::spawn({
            let drain = drain.clone();
            async move { drain.idle().await }
        });
        drop(a);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "one operation still runs");
        drop(b);
        waiter.await.unwrap();
    }
}
