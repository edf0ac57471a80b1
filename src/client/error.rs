//! The client layer's error: no answer could be obtained.

use std::fmt;

use crate::key::IdempotencyKey;

pub(crate) use crate::error::BoxError;

/// Why a call through [`IdempotentClient`](super::IdempotentClient) ended
/// without an answer.
///
/// An answer, whatever its status, is always returned as a response (a `503`
/// the layer gave up on included: its body explains and its [`CallReport`](super::CallReport)
/// says why the layer stopped). This error means there is no answer to return.
/// Each kind has a stable [`code`](ClientErrorKind::code) to branch on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ClientErrorKind {
    /// The request's own `Idempotency-Key` header is not a valid key (1–255
    /// visible ASCII characters, once). Nothing was sent.
    KeyInvalid,
    /// The attempt failed without an answer (a connection error, a timeout)
    /// and the request body cannot be sent again (see
    /// [`ReplayBody`](super::ReplayBody)), so it was not retried.
    BodyNotReplayable,
    /// Every allowed attempt failed without an answer; the last failure is
    /// the [`source`](std::error::Error::source).
    AttemptsExhausted,
    /// The call's total time bound passed: an attempt still running at the
    /// deadline was abandoned, or no time was left to wait for another.
    DeadlineExceeded,
    /// The wrapped service failed outside the retry loop: its `poll_ready`,
    /// or the call of a safe method (`GET`, …), which passes through once.
    ServiceFailed,
    /// An attempt failed without an answer and the client's
    /// [retry budget](super::RetryBudget) refused its retry (too many
    /// recent calls were retried already); the failure is the
    /// [`source`](std::error::Error::source).
    RetryBudgetExhausted,
}

impl ClientErrorKind {
    /// The stable machine-readable code: `idempotency_key_invalid`,
    /// `body_not_replayable`, `attempts_exhausted`, `deadline_exceeded`,
    /// `service_failed` or `retry_budget_exhausted`.
    pub fn code(self) -> &'static str {
        match self {
            ClientErrorKind::KeyInvalid => "idempotency_key_invalid",
            ClientErrorKind::BodyNotReplayable => "body_not_replayable",
            ClientErrorKind::AttemptsExhausted => "attempts_exhausted",
            ClientErrorKind::DeadlineExceeded => "deadline_exceeded",
            ClientErrorKind::ServiceFailed => "service_failed",
            ClientErrorKind::RetryBudgetExhausted => "retry_budget_exhausted",
        }
    }
}

/// A call through [`IdempotentClient`](super::IdempotentClient) that got no
/// answer: what went wrong ([`kind`](Self::kind), [`code`](Self::code)), how
/// many attempts were sent, and the key they carried, so that the caller can
/// retry the same operation later with the same key.
///
/// Its `Debug` and `Display` show the key only as a short hash.
#[derive(Debug)]
pub struct ClientError {
    kind: ClientErrorKind,
    attempts: u32,
    key: Option<IdempotencyKey>,
    source: Option<BoxError>,
}

impl ClientError {
    pub(crate) fn new(
        kind: ClientErrorKind,
        attempts: u32,
        key: Option<IdempotencyKey>,
        source: Option<BoxError>,
    ) -> Self {
        ClientError {
            kind,
            attempts,
            key,
            source,
        }
    }

    /// What went wrong.
    pub fn kind(&self) -> ClientErrorKind {
        self.kind
    }

    /// The stable machine-readable code of [`kind`](Self::kind).
    pub fn code(&self) -> &'static str {
        self.kind.code()
    }

    /// How many attempts were sent (0 when none was).
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// The key every attempt carried (none if the request's own key was
    /// invalid). Retrying the operation later with this key is safe: the
    /// server replays it if one of the attempts got through. Send it as
    /// [`IdempotencyKey::header_value`](crate::key::IdempotencyKey::header_value).
    pub fn key(&self) -> Option<&IdempotencyKey> {
        self.key.as_ref()
    }
}

impl fmt::Display for ClientError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            ClientErrorKind::KeyInvalid => {
                "the request's idempotency key is invalid; nothing was sent"
            }
            ClientErrorKind::BodyNotReplayable => {
                "the attempt failed and the request body cannot be sent again"
            }
            ClientErrorKind::AttemptsExhausted => "every allowed attempt failed without an answer",
            ClientErrorKind::DeadlineExceeded => "no answer within the call's total time bound",
            ClientErrorKind::ServiceFailed => "the wrapped service failed outside the retry loop",
            ClientErrorKind::RetryBudgetExhausted => {
                "the attempt failed and the retry budget refused another"
            }
        };
        write!(f, "{what} ({}; {} attempt(s)", self.code(), self.attempts)?;
        if let Some(key) = &self.key {
            write!(f, ", key {key}")?;
        }
        f.write_str(")")?;
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ClientError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// Why one attempt failed without an answer.
#[derive(Debug)]
pub(crate) enum AttemptError {
    /// The attempt's own time bound passed.
    Timeout,
    /// The wrapped service failed the call, or the answer's body could not be read.
    Inner(BoxError),
    /// The wrapped service failed its `poll_ready` before a retry.
    NotReady(BoxError),
}

impl AttemptError {
    pub(crate) fn into_source(self) -> BoxError {
        match self {
            AttemptError::Timeout => Box::new(AttemptTimedOut),
            AttemptError::Inner(e) | AttemptError::NotReady(e) => e,
        }
    }
}

/// The source of an error whose last attempt hit its time bound.
#[derive(Debug)]
struct AttemptTimedOut;

impl fmt::Display for AttemptTimedOut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the attempt timed out")
    }
}

impl std::error::Error for AttemptTimedOut {}
