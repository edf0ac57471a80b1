//! Which answers say "the first attempt with this key still runs": the
//! in-progress predicate, and the problem fields of a `409` it can read.

use std::{fmt, sync::Arc};

use http::{response::Parts, StatusCode};

use crate::problem::codes;

/// The problem-details fields of a `409` answer, read by the layer (a JSON
/// object body of at most 64 KiB) and put in the answer's extensions, for
/// an [in-progress predicate](super::IdempotentClientLayer::in_progress_when)
/// to look at and for the caller, who gets the same extensions.
///
/// ```
/// use http::StatusCode;
/// use tower_idempotency::client::{ConflictProblem, IdempotentClientLayer};
///
/// // A server whose in-progress answer is a 409 with its own problem `type`.
/// let layer = IdempotentClientLayer::new().in_progress_when(|answer| {
///     answer.status == StatusCode::CONFLICT
///         && answer.extensions.get::<ConflictProblem>().and_then(ConflictProblem::type_uri)
///             == Some("https://api.example.com/problems/request-in-flight")
/// });
/// # let _ = layer;
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConflictProblem {
    code: Option<String>,
    type_uri: Option<String>,
}

impl ConflictProblem {
    /// The fields of a `409` body, if it is a JSON object.
    pub(crate) fn read(body: &[u8]) -> Option<Self> {
        let value = serde_json::from_slice::<serde_json::Value>(body).ok()?;
        let object = value.as_object()?;
        let text = |name: &str| object.get(name)?.as_str().map(str::to_owned);
        Some(ConflictProblem {
            code: text("code"),
            type_uri: text("type"),
        })
    }

    /// The top-level `code` member, when it is a string (this crate's
    /// server: `idempotency_in_progress`, `idempotency_key_reused`, …).
    pub fn code(&self) -> Option<&str> {
        self.code.as_deref()
    }

    /// The top-level `type` member (RFC 9457), when it is a string.
    pub fn type_uri(&self) -> Option<&str> {
        self.type_uri.as_deref()
    }
}

/// The in-progress predicate, shared by the layer's clones.
#[derive(Clone)]
pub(crate) struct InProgressWhen(Arc<dyn Fn(&Parts) -> bool + Send + Sync>);

impl InProgressWhen {
    pub(crate) fn new(predicate: impl Fn(&Parts) -> bool + Send + Sync + 'static) -> Self {
        InProgressWhen(Arc::new(predicate))
    }

    pub(crate) fn matches(&self, answer: &Parts) -> bool {
        (self.0)(answer)
    }
}

impl Default for InProgressWhen {
    fn default() -> Self {
        InProgressWhen::new(ours)
    }
}

impl fmt::Debug for InProgressWhen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("InProgressWhen")
    }
}

/// The server layer's rule: `409` with the problem code
/// `idempotency_in_progress`.
fn ours(answer: &Parts) -> bool {
    answer.status == StatusCode::CONFLICT
        && answer
            .extensions
            .get::<ConflictProblem>()
            .and_then(ConflictProblem::code)
            == Some(codes::IN_PROGRESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(status: u16, body: &[u8]) -> Parts {
        let (mut parts, ()) = http::Response::builder()
            .status(status)
            .body(())
            .unwrap()
            .into_parts();
        if let Some(problem) = ConflictProblem::read(body) {
            parts.extensions.insert(problem);
        }
        parts
    }

    #[test]
    fn the_default_rule_is_a_409_with_our_code() {
        let rule = InProgressWhen::default();
        assert!(rule.matches(&parts(409, br#"{"code":"idempotency_in_progress"}"#)));
        assert!(!rule.matches(&parts(409, br#"{"code":"idempotency_key_reused"}"#)));
        assert!(!rule.matches(&parts(409, b"busy")));
        assert!(!rule.matches(&parts(409, br#"["idempotency_in_progress"]"#)));
        assert!(!rule.matches(&parts(503, br#"{"code":"idempotency_in_progress"}"#)));
    }

    #[test]
    fn problem_fields_are_read_when_they_are_strings() {
        let problem = ConflictProblem::read(br#"{"type":"https://x/p","code":7}"#).unwrap();
        assert_eq!(problem.type_uri(), Some("https://x/p"));
        assert_eq!(problem.code(), None);
        assert_eq!(ConflictProblem::read(b"not json"), None);
    }
}
