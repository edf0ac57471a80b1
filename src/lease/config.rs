//! [`LeaseConfig`]: how long a lease lasts, how often it is renewed, and
//! how long a request waits for its work before answering `202`.

use std::{sync::Arc, time::Duration};

/// The long-running mode's settings.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::lease::LeaseConfig;
///
/// let config = LeaseConfig::new(Duration::from_secs(10))
///     .heartbeat(Duration::from_secs(3))
///     .respond_within(Duration::from_secs(1));
/// assert_eq!(config.lease_duration(), Duration::from_secs(10));
/// ```
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    pub(crate) lease: Duration,
    pub(crate) heartbeat: Duration,
    pub(crate) respond_within: Duration,
    pub(crate) status_path: Arc<str>,
    pub(crate) recovery_interval: Duration,
}

/// The shortest lease: heartbeats need room to run.
const MIN_LEASE: Duration = Duration::from_millis(100);

impl LeaseConfig {
    /// A lease of `lease` (at least 100 ms), renewed every third of it,
    /// answering `202` after 1 s, with the status resource at
    /// `/operations/{id}`.
    pub fn new(lease: Duration) -> Self {
        let lease = lease.clamp(MIN_LEASE, crate::layer::MAX_WAIT);
        LeaseConfig {
            lease,
            heartbeat: lease / 3,
            respond_within: Duration::from_secs(1),
            status_path: Arc::from("/operations"),
            recovery_interval: Duration::from_secs(1),
        }
    }

    /// How often the owner renews its lease (default a third of the lease;
    /// at most half of it, so that one late heartbeat does not lose it).
    pub fn heartbeat(mut self, every: Duration) -> Self {
        self.heartbeat = every.clamp(Duration::from_millis(10), self.lease / 2);
        self
    }

    /// How long the first request waits for its work before answering
    /// `202 Accepted` (default 1 s). Zero answers `202` at once.
    pub fn respond_within(mut self, within: Duration) -> Self {
        self.respond_within = within;
        self
    }

    /// The path the status resource is mounted at (default `/operations`):
    /// `202` answers carry `Location: {path}/{operation_id}`.
    pub fn status_path(mut self, path: impl Into<Arc<str>>) -> Self {
        let path: Arc<str> = path.into();
        self.status_path = Arc::from(path.trim_end_matches('/'));
        self
    }

    /// How often an idle [`Recovery`](super::Recovery) worker looks for
    /// operations whose lease expired (default 1 s).
    pub fn recovery_interval(mut self, every: Duration) -> Self {
        self.recovery_interval = every.max(Duration::from_millis(10));
        self
    }

    /// The lease.
    pub fn lease_duration(&self) -> Duration {
        self.lease
    }
}
