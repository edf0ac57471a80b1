//! The layer's mode, as a value: [`ShortTransaction`] (the default),
//! [`ClaimAtCommit`] (opt-in: the commit claims the key) or [`LongRunning`],
//! which carries its [`LeaseConfig`]. One `Service` impl serves all three;
//! the mode decides phases 2 to 5 of a request.

use std::{future::Future, time::Duration};

use super::{
    admit::Admitted,
    endpoint::Setup,
    lease_config::LeaseConfig,
    long,
    service::{Inner, InnerBody},
    settled::{Settled, Timings},
    short,
};
use crate::{
    fingerprint::Fingerprinter,
    scope::ResolveTenant,
    store::{CommitStore, LeaseStore, Store},
};

/// The mode of an [`IdempotencyLayer`](crate::IdempotencyLayer) over a
/// store `St`: [`ShortTransaction`] for any [`Store`], [`ClaimAtCommit`]
/// for a [`CommitStore`], [`LongRunning`] for a [`LeaseStore`]. Sealed: the
/// crate's three modes are the only ones.
pub trait Mode<St>: sealed::Sealed<St> + Clone + Send + Sync + 'static {}

mod sealed {
    use super::*;

    /// What a mode does with an admitted request: phases 2 to 5.
    pub trait Sealed<St>: Sized {
        fn run<S: Inner<B>, F: Fingerprinter, R: ResolveTenant, B: InnerBody>(
            setup: Setup<St, F, R, Self>,
            inner: S,
            admitted: Admitted,
        ) -> impl Future<Output = (Settled<B, S::Error>, Timings)> + Send + 'static;

        /// The shortest retention that covers the mode's work: a record
        /// must not expire while the work that will remember its answer
        /// may still commit, or a retry would run the work again.
        fn covers(&self, handler_timeout: Duration) -> Duration;
    }
}

impl<St, F, R, M: Mode<St>> Setup<St, F, R, M> {
    /// The retention records are kept for: the configured one, raised to
    /// what the mode's work needs (see [`IdempotencyLayer::retention`](crate::IdempotencyLayer::retention)).
    pub(crate) fn retention(&self) -> Duration {
        self.config.retention.max(sealed::Sealed::covers(
            &self.mode,
            self.config.handler_timeout,
        ))
    }
}

/// The default mode: one short transaction per request, from the claim to
/// the commit of the handler's writes with the remembered answer.
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct ShortTransaction;

/// The one-commit mode, set by
/// [`IdempotencyLayer::claim_at_commit`](crate::IdempotencyLayer::claim_at_commit):
/// the handler writes first, and the key's record goes in with the response
/// in the same transaction, pipelined with its `COMMIT`; the key's
/// uniqueness decides at commit. Sound only when every effect of the
/// handler is in that transaction: see [when to choose it](crate::guide::modes).
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct ClaimAtCommit;

/// The long-running mode, with its settings, set by
/// [`IdempotencyLayer::long_running`](crate::IdempotencyLayer::long_running):
/// a committed record with a lease and a fencing token (see
/// [`lease`](crate::lease)).
#[derive(Debug, Clone)]
pub struct LongRunning {
    pub(crate) config: LeaseConfig,
}

impl LongRunning {
    /// The mode with these settings.
    pub fn new(config: LeaseConfig) -> Self {
        LongRunning { config }
    }

    /// Its settings.
    pub fn config(&self) -> &LeaseConfig {
        &self.config
    }
}

/// Each mode runs its own flow, for the stores it works with.
macro_rules! mode {
    ($mode:ty, $store:ident, $flow:path, |$this:pat_param, $config:ident| $covers:expr) => {
        impl<St: $store> Mode<St> for $mode {}

        impl<St: $store> sealed::Sealed<St> for $mode {
            fn run<S: Inner<B>, F: Fingerprinter, R: ResolveTenant, B: InnerBody>(
                setup: Setup<St, F, R, Self>,
                inner: S,
                admitted: Admitted,
            ) -> impl Future<Output = (Settled<B, S::Error>, Timings)> + Send + 'static {
                $flow(setup, inner, admitted)
            }

            fn covers(&self, $config: Duration) -> Duration {
                let $this = self;
                $covers
            }
        }
    };
}

// The default mode's record counts its retention from the claim, and the
// work may run until the handler's deadline, then commit within the hold
// margin. The one-commit mode's counts from the commit itself. A released
// long-running operation waits up to the longest recovery backoff after its
// lease before recovery may take it, and must still be there then.
mode!(ShortTransaction, Store, short::run, |_, handler_timeout| {
    handler_timeout.saturating_add(short::HOLD_MARGIN)
});
mode!(ClaimAtCommit, CommitStore, short::run, |_, _config| {
    Duration::ZERO
});
mode!(LongRunning, LeaseStore, long::run, |mode, _config| mode
    .config
    .lease
    .saturating_add(mode.config.backoff.max)
    .saturating_add(short::HOLD_MARGIN));
