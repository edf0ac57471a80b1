//! The owner's work, polled where its request is answered and moved onto a
//! task of its own only if the request is dropped first.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use tokio::runtime::Handle;

/// Runs `work` inline, in the task that polls it (the request's own).
/// Dropped before `work` finished (the client went away, and the server
/// dropped the request's future), it spawns the rest of `work` on the
/// runtime it was made on, so that work that owns its key runs on to its
/// commit or rollback and a retry finds a finished result.
///
/// Against spawning the work for every request, this spares each one a
/// task of its own and the wake-up of the request's task when the work
/// ends (a hand-over that may cross worker threads). A panic in `work`
/// unwinds through the request's task, as a spawned task's panic was
/// resumed there; the work is then dropped, not spawned, and its guards
/// roll back what it held.
pub(crate) struct OwnedWork<F: Future<Output: Send> + Send + 'static> {
    work: Option<Pin<Box<F>>>,
    runtime: Option<Handle>,
}

impl<F: Future<Output: Send> + Send + 'static> OwnedWork<F> {
    /// `work`, to be run where it is polled; made inside a tokio runtime
    /// (outside one, dropping it unfinished drops the work).
    pub(crate) fn new(work: F) -> Self {
        OwnedWork {
            work: Some(Box::pin(work)),
            runtime: Handle::try_current().ok(),
        }
    }
}

impl<F: Future<Output: Send> + Send + 'static> Future for OwnedWork<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        let work = this
            .work
            .as_mut()
            .expect("OwnedWork polled after it finished");
        let done = work.as_mut().poll(cx);
        if done.is_ready() {
            this.work = None;
        }
        done
    }
}

impl<F: Future<Output: Send> + Send + 'static> Drop for OwnedWork<F> {
    fn drop(&mut self) {
        let (Some(work), Some(runtime)) = (self.work.take(), self.runtime.take()) else {
            return;
        };
        if std::thread::panicking() {
            return;
        }
        // Detached: what the work settles on is observed inside it.
        drop(runtime.spawn(async move {
            work.await;
        }));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    };

    use std::future::Future as _;

    use tokio::sync::oneshot;

    use super::OwnedWork;

    /// Work dropped while it waits runs on to its end on a task of its own.
    #[tokio::test]
    async fn dropped_unfinished_work_runs_on() {
        let (go, wait) = oneshot::channel::<()>();
        let (done, finished) = oneshot::channel();
        let ran = Arc::new(AtomicBool::new(false));
        let flag = ran.clone();
        let mut work = Box::pin(OwnedWork::new(async move {
            wait.await.unwrap();
            flag.store(true, Ordering::SeqCst);
            done.send(()).unwrap();
        }));
        // Polled once: it waits for `go`.
        let pending =
            std::future::poll_fn(|cx| std::task::Poll::Ready(work.as_mut().poll(cx).is_pending()))
                .await;
        assert!(pending);
        drop(work);
        assert!(!ran.load(Ordering::SeqCst));
        go.send(()).unwrap();
        finished.await.expect("the work finished on its own task");
        assert!(ran.load(Ordering::SeqCst));
    }

    /// Work that finishes where it is polled gives its output there.
    #[tokio::test]
    async fn finished_work_answers_inline() {
        assert_eq!(OwnedWork::new(async { 7 }).await, 7);
    }
}
