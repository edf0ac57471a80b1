//! The layer's mode, as a value: [`ShortTransaction`] (the default),
//! [`ClaimAtCommit`] (opt-in: the commit claims the key) or [`LongRunning`],
//! which carries its [`LeaseConfig`]. One `Service` impl serves all three;
//! the mode decides phases 2 to 5 of a request.

use std::future::Future;

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
    ($mode:ty, $store:ident, $flow:path) => {
        impl<St: $store> Mode<St> for $mode {}

        impl<St: $store> sealed::Sealed<St> for $mode {
            fn run<S: Inner<B>, F: Fingerprinter, R: ResolveTenant, B: InnerBody>(
                setup: Setup<St, F, R, Self>,
                inner: S,
                admitted: Admitted,
            ) -> impl Future<Output = (Settled<B, S::Error>, Timings)> + Send + 'static {
                $flow(setup, inner, admitted)
            }
        }
    };
}

mode!(ShortTransaction, Store, short::run);
mode!(ClaimAtCommit, CommitStore, short::run);
mode!(LongRunning, LeaseStore, long::run);
