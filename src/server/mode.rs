//! The layer's mode, as a value: [`ClaimFirst`] (the default),
//! [`ClaimAtCommit`] (opt-in: the commit claims the key) or [`LongRunning`],
//! which carries its [`LeaseConfig`], and the retention each one's work
//! needs. Which flow each runs is `flow`.

use std::time::Duration;

use super::lease_config::LeaseConfig;
use crate::store::limits::HOLD_MARGIN;

/// The claim-first mode, the default: one short transaction per request, from the claim to
/// the commit of the handler's writes with the remembered answer.
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct ClaimFirst;

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

pub(crate) use covers::Covers;

mod covers {
    use std::time::Duration;

    /// The shortest retention that covers a mode's work: a record must not
    /// expire while the work that will remember its answer may still
    /// commit, or a retry would run the work again. (Public in a private
    /// module: a bound of the sealed `Mode`, named by no one outside.)
    pub trait Covers {
        fn covers(&self, handler_timeout: Duration) -> Duration;

        /// Creates the mode's own per-endpoint series at zero.
        fn register(&self, endpoint: &str) {
            let _ = endpoint;
        }
    }
}

// The claim-first mode's record counts its retention from the claim, and the
// work may run until the handler's deadline, then commit within the hold
// margin. The one-commit mode's counts from the commit itself. A released
// long-running operation waits up to the longest recovery backoff after its
// lease before recovery may take it, and must still be there then.
impl Covers for ClaimFirst {
    fn covers(&self, handler_timeout: Duration) -> Duration {
        handler_timeout.saturating_add(HOLD_MARGIN)
    }
}

impl Covers for ClaimAtCommit {
    fn covers(&self, _: Duration) -> Duration {
        Duration::ZERO
    }

    fn register(&self, endpoint: &str) {
        crate::metrics::register_at_commit(endpoint);
    }
}

impl Covers for LongRunning {
    fn covers(&self, _: Duration) -> Duration {
        self.config
            .lease
            .saturating_add(self.config.backoff.max)
            .saturating_add(HOLD_MARGIN)
    }

    fn register(&self, endpoint: &str) {
        crate::metrics::register_long_running(endpoint);
    }
}
