//! [`Runner`]: runs the checks one by one and writes the [`Report`].

use std::{
    any::Any,
    future::Future,
    sync::Arc,
    time::{Duration, Instant},
};

use super::{CheckFailure, Guarantee, Outcome, Report};

/// How long one check may run before it fails as not finished (a store call
/// that never returns).
const CHECK_LIMIT: Duration = Duration::from_secs(60);

/// Runs checks one by one, each in a task of its own under [`CHECK_LIMIT`],
/// and writes down what became of each.
pub(super) struct Runner<St> {
    store: St,
    report: Report,
}

impl<St: Clone + Send + Sync + 'static> Runner<St> {
    pub(super) fn new(title: &'static str, store: St) -> Self {
        Runner {
            store,
            report: Report::new(title),
        }
    }

    pub(super) async fn check<F, Fut>(&mut self, name: &'static str, guarantee: Guarantee, check: F)
    where
        F: FnOnce(St) -> Fut,
        Fut: Future<Output = Result<(), CheckFailure>> + Send + 'static,
    {
        let started = Instant::now();
        // A task of its own: a panic in the store fails this check only, and
        // aborting it at the limit drops every task the check spawned.
        let mut task = tokio::spawn(check(self.store.clone()));
        let outcome = match tokio::time::timeout(CHECK_LIMIT, &mut task).await {
            Ok(Ok(Ok(()))) => Outcome::Passed,
            Ok(Ok(Err(failure))) => Outcome::Failed(failure),
            Ok(Err(e)) => Outcome::Failed(CheckFailure::new(
                guarantee,
                match e.try_into_panic() {
                    Ok(panic) => format!("the check panicked: {}", panic_message(&*panic)),
                    Err(e) => format!("the check's task ended: {e}"),
                },
            )),
            Err(_) => {
                task.abort();
                Outcome::Failed(CheckFailure::new(
                    guarantee,
                    format!(
                        "did not finish within {} s: a store call never returned",
                        CHECK_LIMIT.as_secs()
                    ),
                ))
            }
        };
        self.report
            .push(name, guarantee, outcome, started.elapsed());
    }

    /// Runs a check that writes through the handle with `writes`, or
    /// reports it skipped without them.
    pub(super) async fn with_writes<W, F, Fut>(
        &mut self,
        name: &'static str,
        guarantee: Guarantee,
        writes: Option<Arc<W>>,
        runner: &'static str,
        check: F,
    ) where
        W: Send + Sync + 'static,
        F: FnOnce(St, Arc<W>) -> Fut,
        Fut: Future<Output = Result<(), CheckFailure>> + Send + 'static,
    {
        match writes {
            Some(writes) => {
                self.check(name, guarantee, |store| check(store, writes))
                    .await
            }
            None => self
                .report
                .push(name, guarantee, Outcome::Skipped(runner), Duration::ZERO),
        }
    }

    pub(super) fn finish(self) -> Report {
        self.report
    }
}

fn panic_message(panic: &(dyn Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "(a panic without a message)".to_owned()
    }
}
