//! `IdempotentClientLayer`: the client side's configuration.

use std::{sync::Arc, time::Duration};

use http::{response::Parts, HeaderName};
use tower_layer::Layer;

use super::{in_progress::InProgressWhen, IdempotentClient, RetryBudget};

/// No duration in the configuration goes past this: deadlines stay far from
/// the clock's limits, whatever a caller passes.
const LONGEST: Duration = Duration::from_secs(365 * 24 * 60 * 60);
/// Attempts allowed at most, whatever a caller passes.
const MOST_ATTEMPTS: u32 = 100;

#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) name: String,
    pub(crate) header: HeaderName,
    pub(crate) max_attempts: u32,
    pub(crate) attempt_timeout: Duration,
    pub(crate) total_timeout: Duration,
    pub(crate) backoff_base: Duration,
    pub(crate) backoff_max: Duration,
    pub(crate) budget: RetryBudget,
    pub(crate) quote_keys: bool,
    pub(crate) in_progress: InProgressWhen,
}

/// Makes outgoing unsafe requests (`POST`, `PUT`, `PATCH`, `DELETE`, …)
/// retry-safe under the Idempotency-Key contract the server layer answers:
/// one key per call, the same on every retry, retries only where the
/// contract says a retry helps. See the [module docs](super) for the retry
/// table.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::client::IdempotentClientLayer;
///
/// use tower_idempotency::client::RetryBudget;
///
/// let layer = IdempotentClientLayer::new()
///     .name("payments")
///     .max_attempts(4)
///     .attempt_timeout(Duration::from_secs(5))
///     .total_timeout(Duration::from_secs(20))
///     .retry_budget(RetryBudget::ratio(0.1))
///     .quote_keys(true);
/// # let _ = layer;
/// ```
#[derive(Debug, Clone)]
pub struct IdempotentClientLayer {
    config: Arc<Config>,
}

impl Default for IdempotentClientLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl IdempotentClientLayer {
    /// The defaults: header `Idempotency-Key` with bare keys, 5 attempts,
    /// 15 s per attempt, 60 s in total, backoff from 250 ms doubling to at
    /// most 10 s (with jitter), a retry budget of 20 % extra load with a
    /// floor of 10 retries a second ([`RetryBudget::default`]), this crate's
    /// in-progress answer (`409 idempotency_in_progress`), metrics label
    /// `client="default"`.
    pub fn new() -> Self {
        IdempotentClientLayer {
            config: Arc::new(Config {
                name: "default".to_owned(),
                header: HeaderName::from_static("idempotency-key"),
                max_attempts: 5,
                attempt_timeout: Duration::from_secs(15),
                total_timeout: Duration::from_secs(60),
                backoff_base: Duration::from_millis(250),
                backoff_max: Duration::from_secs(10),
                budget: RetryBudget::default(),
                quote_keys: false,
                in_progress: InProgressWhen::default(),
            }),
        }
    }

    /// The layer with `set` applied to its (copied-on-write) settings.
    fn configure(mut self, set: impl FnOnce(&mut Config)) -> Self {
        set(Arc::make_mut(&mut self.config));
        self
    }

    /// The `client` label of this layer's metrics (e.g. the API it calls).
    pub fn name(self, name: impl Into<String>) -> Self {
        self.configure(|c| c.name = name.into())
    }

    /// The key header (default `Idempotency-Key`).
    pub fn header_name(self, header: HeaderName) -> Self {
        self.configure(|c| c.header = header)
    }

    /// Attempts per call, the first included (default 5; at least 1, at most 100).
    pub fn max_attempts(self, attempts: u32) -> Self {
        self.configure(|c| c.max_attempts = attempts.clamp(1, MOST_ATTEMPTS))
    }

    /// How long one attempt may take before it counts as timed out and is
    /// retried with the same key (default 15 s). Keep it above the server's
    /// wait for a concurrent duplicate (5 s by default), or its
    /// `idempotency_in_progress` answer never arrives.
    pub fn attempt_timeout(self, timeout: Duration) -> Self {
        self.configure(|c| c.attempt_timeout = timeout.min(LONGEST))
    }

    /// The whole call's time bound, attempts and waits included (default
    /// 60 s): no wait is started that would end past it, and an attempt still
    /// running at it is abandoned ([`ClientErrorKind::DeadlineExceeded`](super::ClientErrorKind::DeadlineExceeded)).
    pub fn total_timeout(self, timeout: Duration) -> Self {
        self.configure(|c| c.total_timeout = timeout.min(LONGEST))
    }

    /// The wait before a retry when the answer carries no `Retry-After`:
    /// `base` doubling per retry up to `max`, of which a random half is
    /// waited ("equal jitter", so that many clients do not retry in
    /// lockstep). Defaults: 250 ms, 10 s.
    pub fn backoff(self, base: Duration, max: Duration) -> Self {
        let base = base.min(LONGEST);
        self.configure(|c| {
            c.backoff_base = base;
            c.backoff_max = max.min(LONGEST).max(base);
        })
    }

    /// Bounds retries to a share of the calls made (default
    /// [`RetryBudget::default`]: 20 % extra load, at least 10 retries a
    /// second), so that when the upstream is down a fleet of clients adds a
    /// fifth to its load rather than multiplying it by `max_attempts`. A
    /// retry the budget refuses is not sent: the last outcome is returned,
    /// with [`GiveUp::RetryBudget`](super::GiveUp::RetryBudget) in its
    /// report (or the [`retry_budget_exhausted`](super::ClientErrorKind::RetryBudgetExhausted)
    /// error without an answer). Each service this layer makes has its own
    /// budget, shared by its clones.
    pub fn retry_budget(self, budget: RetryBudget) -> Self {
        self.configure(|c| c.budget = budget)
    }

    /// Sends the key as an RFC 8941 string, `Idempotency-Key: "abc"`, the
    /// form the IETF draft writes, for servers that accept only it (default
    /// `false`: the bare key, `Idempotency-Key: abc`; this crate's server
    /// reads both). When set, a key the request already carries bare is
    /// sent quoted too; the key itself is the same.
    pub fn quote_keys(self, quote: bool) -> Self {
        self.configure(|c| c.quote_keys = quote)
    }

    /// Which answers mean "the first attempt with this key still runs;
    /// retry after `Retry-After`" ([`RetryReason::InProgress`](super::RetryReason::InProgress)),
    /// for servers other than this crate's (default: `409` whose problem
    /// `code` is `idempotency_in_progress`). The predicate sees the
    /// answer's head; for a `409` the layer has read the body's
    /// [`ConflictProblem`](super::ConflictProblem) fields into its
    /// extensions. `503`, `502`, `504`, timeouts and transport failures
    /// are retried whatever it says.
    ///
    /// ```
    /// use http::StatusCode;
    /// use tower_idempotency::client::IdempotentClientLayer;
    ///
    /// // A server following the IETF draft: every 409 is a concurrent
    /// // request (a reused key is its 422).
    /// let layer = IdempotentClientLayer::new()
    ///     .in_progress_when(|answer| answer.status == StatusCode::CONFLICT);
    /// # let _ = layer;
    /// ```
    pub fn in_progress_when<F>(self, predicate: F) -> Self
    where
        F: Fn(&Parts) -> bool + Send + Sync + 'static,
    {
        self.configure(|c| c.in_progress = InProgressWhen::new(predicate))
    }
}

impl<S> Layer<S> for IdempotentClientLayer {
    type Service = IdempotentClient<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotentClient::new(inner, self.config.clone())
    }
}
