//! [`LeaseConfig`]: how long a lease lasts, how often it is renewed, and
//! how long a request waits for its work before answering `202`.

use std::{sync::Arc, time::Duration};

use crate::store::Backoff;

/// The long-running mode's settings.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::lease::LeaseConfig;
///
/// let config = LeaseConfig::new(Duration::from_secs(10))
///     .heartbeat(Duration::from_secs(3))
///     .respond_within(Duration::from_secs(1))
///     .max_attempts(3);
/// assert_eq!(config.lease_duration(), Duration::from_secs(10));
/// assert_eq!(config.attempts(), 3);
/// ```
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    pub(crate) lease: Duration,
    pub(crate) heartbeat: Duration,
    pub(crate) respond_within: Duration,
    pub(crate) status_path: Arc<str>,
    pub(crate) recovery_interval: Duration,
    pub(crate) max_attempts: u32,
    pub(crate) backoff: Backoff,
}

/// The shortest lease: heartbeats need room to run.
const MIN_LEASE: Duration = Duration::from_millis(100);

impl LeaseConfig {
    /// A lease of `lease` (at least 100 ms), renewed every third of it,
    /// answering `202` after 1 s, with the status resource at
    /// `/operations/{id}`.
    pub fn new(lease: Duration) -> Self {
        let lease = lease.clamp(MIN_LEASE, crate::store::MAX_WAIT);
        LeaseConfig {
            lease,
            heartbeat: lease / 3,
            respond_within: Duration::from_secs(1),
            status_path: Arc::from("/operations"),
            recovery_interval: Duration::from_secs(1),
            max_attempts: 5,
            backoff: Backoff::new(Duration::from_secs(1), Duration::from_secs(60)),
        }
    }

    /// How often the owner renews its lease (default a third of the lease;
    /// at most half of it, so that one late heartbeat does not lose it).
    pub fn heartbeat(self, every: Duration) -> Self {
        crate::setter::with(self, |s| {
            s.heartbeat = every.clamp(Duration::from_millis(10), s.lease / 2)
        })
    }

    /// How long the first request waits for its work before answering
    /// `202 Accepted` (default 1 s). Zero answers `202` at once.
    pub fn respond_within(self, within: Duration) -> Self {
        crate::setter::with(self, |s| s.respond_within = within)
    }

    /// The path the status resource is mounted at (default `/operations`):
    /// `202` answers carry `Location: {path}/{operation_id}`.
    pub fn status_path(mut self, path: impl Into<Arc<str>>) -> Self {
        let path: Arc<str> = path.into();
        self.status_path = Arc::from(path.trim_end_matches('/'));
        self
    }

    /// How often an idle [`Recovery`](crate::lease::Recovery) worker looks for
    /// operations whose lease expired (default 1 s).
    pub fn recovery_interval(self, every: Duration) -> Self {
        crate::setter::with(self, |s| {
            s.recovery_interval = every.max(Duration::from_millis(10))
        })
    }

    /// How many attempts an operation gets (default 5, at least 1): the
    /// first run, takeovers by a duplicate and recoveries all count. An
    /// attempt that ends without an answer to remember (a `5xx`, an error,
    /// a panic, the handler timeout, a crash) leaves the operation to the
    /// next one; after the last, the operation ends `failed` with a
    /// remembered `500 operation_failed`, so a request that crashes its
    /// process cannot crash-loop a fleet for the whole retention.
    pub fn max_attempts(self, attempts: u32) -> Self {
        crate::setter::with(self, |s| s.max_attempts = attempts.max(1))
    }

    /// How long the [`Recovery`](crate::lease::Recovery) worker waits before the
    /// next attempt of an operation whose attempt ended without an answer
    /// (counted from the end of its lease): `first` after the first
    /// attempt, doubling with each one, at most `max` (default 1 s, at most
    /// 60 s). A retry by the client is not held back: the same request
    /// resumes the operation at once.
    pub fn recovery_backoff(self, first: Duration, max: Duration) -> Self {
        crate::setter::with(self, |s| s.backoff = Backoff::new(first, max))
    }

    /// The lease.
    pub fn lease_duration(&self) -> Duration {
        self.lease
    }

    /// How many attempts an operation gets; see [`max_attempts`](Self::max_attempts).
    pub fn attempts(&self) -> u32 {
        self.max_attempts
    }

    /// `Retry-After` (whole seconds, at least 1) for answers that say an
    /// operation still runs: its status can change at each heartbeat.
    pub(crate) fn retry_after(&self) -> u64 {
        self.heartbeat.as_secs_f64().ceil().max(1.0) as u64
    }
}
