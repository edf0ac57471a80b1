//! Counting the operations that own a key, so a server can wait for them at
//! shutdown: their work runs on tasks of its own, which a server's graceful
//! shutdown does not see once their clients have gone.

use std::sync::{
    atomic::{AtomicUsize, Ordering},
    Arc,
};

use tokio::sync::Notify;

#[derive(Debug, Default)]
pub(crate) struct Operations {
    running: AtomicUsize,
    idle: Notify,
}

/// One running operation; dropping it (finished, failed or panicked) counts it out.
pub(crate) struct Running(Arc<Operations>);

impl Operations {
    pub(crate) fn start(self: &Arc<Self>) -> Running {
        self.running.fetch_add(1, Ordering::SeqCst);
        Running(self.clone())
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

impl Drop for Running {
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
        let operations = Arc::new(Operations::default());
        operations.idle().await;
        let (a, b) = (operations.start(), operations.start());
        let waiter = tokio::spawn({
            let operations = operations.clone();
            async move { operations.idle().await }
        });
        drop(a);
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "one operation still runs");
        drop(b);
        waiter.await.unwrap();
    }
}
