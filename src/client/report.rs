//! What the layer did for one call, as the caller reads it afterwards.

use crate::key::IdempotencyKey;

/// Why an attempt was retried (also the `reason` label of
/// [`CLIENT_RETRIES_TOTAL`](crate::metrics::CLIENT_RETRIES_TOTAL)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RetryReason {
    /// The wrapped service failed (connection refused or reset, a body that
    /// broke off): the request may or may not have arrived.
    Transport,
    /// The attempt did not answer within its time bound.
    Timeout,
    /// `503 Service Unavailable` (e.g. `store_unavailable`: nothing was remembered).
    Unavailable,
    /// `502 Bad Gateway` or `504 Gateway Timeout` from a proxy on the way.
    Gateway,
    /// `409` with code `idempotency_in_progress` (or what the layer's
    /// [`in_progress_when`](super::IdempotentClientLayer::in_progress_when)
    /// predicate matches): the first attempt still runs.
    InProgress,
}

impl RetryReason {
    /// The label value: `transport`, `timeout`, `unavailable`, `gateway`, `in_progress`.
    pub fn as_str(self) -> &'static str {
        match self {
            RetryReason::Transport => "transport",
            RetryReason::Timeout => "timeout",
            RetryReason::Unavailable => "unavailable",
            RetryReason::Gateway => "gateway",
            RetryReason::InProgress => "in_progress",
        }
    }
}

/// Why the layer stopped retrying an outcome it would otherwise have retried
/// (also the `reason` label of
/// [`CLIENT_GIVE_UPS_TOTAL`](crate::metrics::CLIENT_GIVE_UPS_TOTAL)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GiveUp {
    /// The last allowed attempt was spent.
    AttemptsExhausted,
    /// The wait before the next attempt (`Retry-After` or the backoff) would
    /// end past the call's total time bound, or the bound passed during an attempt.
    Deadline,
    /// The request body cannot be sent again.
    BodyNotReplayable,
    /// The client's [retry budget](super::RetryBudget) refused the retry:
    /// too many of its recent calls were retried already.
    RetryBudget,
}

impl GiveUp {
    /// The label value: `attempts_exhausted`, `deadline`,
    /// `body_not_replayable`, `retry_budget`.
    pub fn as_str(self) -> &'static str {
        match self {
            GiveUp::AttemptsExhausted => "attempts_exhausted",
            GiveUp::Deadline => "deadline",
            GiveUp::BodyNotReplayable => "body_not_replayable",
            GiveUp::RetryBudget => "retry_budget",
        }
    }
}

/// What the layer did for one call: in the extensions of every response of
/// an unsafe method that went through [`IdempotentClient`](super::IdempotentClient).
///
/// ```
/// # fn check(response: http::Response<()>) {
/// use tower_idempotency::client::CallReport;
///
/// if let Some(report) = response.extensions().get::<CallReport>() {
///     if report.replayed() {
///         // The server answered from memory: an earlier attempt (perhaps
///         // one whose answer was lost) had already done the work.
///     }
/// }
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallReport {
    pub(crate) key: IdempotencyKey,
    pub(crate) attempts: u32,
    pub(crate) retries: Vec<RetryReason>,
    pub(crate) replayed: bool,
    pub(crate) gave_up: Option<GiveUp>,
}

impl CallReport {
    /// The key every attempt of the call carried (`Debug` shows only its hash;
    /// [`IdempotencyKey::as_str`] gives the key itself).
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// How many attempts were sent, the first included.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Why each retry was made, in order (`attempts() - 1` entries).
    pub fn retries(&self) -> &[RetryReason] {
        &self.retries
    }

    /// Whether the answer carried `Idempotent-Replayed: true`: the server
    /// answered from its memory of an earlier attempt of this operation.
    pub fn replayed(&self) -> bool {
        self.replayed
    }

    /// Set when the answer is one the layer would have retried but stopped
    /// (e.g. a `503` after the last attempt), and why.
    pub fn gave_up(&self) -> Option<GiveUp> {
        self.gave_up
    }
}
