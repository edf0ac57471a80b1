//! Which flow each mode runs: the [`Mode`] trait. The claim-first and the
//! one-commit modes run `one_transaction`, the long-running mode
//! `long_running`: phases 2 to 5 of a request.

use std::future::Future;

use super::{
    admit::Admitted,
    endpoint::Setup,
    inner::{Inner, InnerBody},
    long_running,
    mode::{ClaimAtCommit, ClaimFirst, Covers, LongRunning},
    one_transaction,
    settled::{Settled, Timings},
};
use crate::{
    fingerprint::Fingerprinter,
    scope::ResolveTenant,
    store::{CommitStore, LeaseStore, Store},
};

/// The mode of an [`IdempotencyLayer`](crate::IdempotencyLayer) over a
/// store `St`: [`ClaimFirst`] for any [`Store`], [`ClaimAtCommit`]
/// for a [`CommitStore`], [`LongRunning`] for a [`LeaseStore`]. Sealed: the
/// crate's three modes are the only ones.
pub trait Mode<St>: sealed::Sealed<St> + Covers + Clone + Send + Sync + 'static {}

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

mode!(ClaimFirst, Store, one_transaction::run);
mode!(ClaimAtCommit, CommitStore, one_transaction::run);
mode!(LongRunning, LeaseStore, long_running::run);
