//! What counts as success: whether a response is the operation's answer,
//! remembered and committed with the handler's writes, or a failure, rolled
//! back so that the key is free for a retry.
//!
//! The names follow tower-http's `classify`. [`ServerErrorsAsFailures`] is
//! HTTP's rule and the layer's default: a 2xx is remembered, and any other
//! status below 500 that the handler marked [`FinalResponse`]; the rest
//! rolls back. [`GrpcErrorsAsFailures`] is gRPC's, where every answer is
//! HTTP 200 and the outcome is in `grpc-status`: in the trailers, or in the
//! headers of a trailers-only answer (as tonic sends an `Err(Status)`).
//! `0` (`OK`) is remembered; any other code rolls back unless the handler
//! marked the answer [`FinalResponse`] (deterministic rejections:
//! `INVALID_ARGUMENT`, `FAILED_PRECONDITION`, `ALREADY_EXISTS`); an answer
//! without a `grpc-status` is a failure. Set one with
//! [`IdempotencyLayer::classify`](crate::IdempotencyLayer::classify).
//!
//! A classifier that needs the trailers gets them once the body has been
//! buffered, which the layer does anyway for an answer it may remember: it
//! says [`Verdict::AtEnd`] on the head and decides in
//! [`Classifier::classify_end`].

use std::fmt;

use http::{response::Parts, HeaderMap};

use crate::record::FinalResponse;

/// What a classifier makes of a response's head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// The operation's answer: remember it with the handler's writes.
    Remember,
    /// A failure: roll the handler's writes back and free the key; the
    /// response is passed on as it is.
    RollBack,
    /// Decided by the trailers: the body is buffered, then
    /// [`Classifier::classify_end`] decides.
    AtEnd,
}

/// Decides whether a response is remembered or rolled back.
pub trait Classifier: fmt::Debug + Send + Sync + 'static {
    /// The verdict on the status, headers and extensions.
    fn classify_head(&self, head: &Parts) -> Verdict;

    /// After [`Verdict::AtEnd`], with the body buffered: whether to
    /// remember the response, given its trailers (`None` without any).
    fn classify_end(&self, head: &Parts, trailers: Option<&HeaderMap>) -> bool {
        let _ = trailers;
        self.classify_head(head) == Verdict::Remember
    }
}

/// HTTP's rule, the default: 2xx, and a non-5xx marked [`FinalResponse`].
#[derive(Debug, Clone, Copy, Default)]
pub struct ServerErrorsAsFailures;

impl Classifier for ServerErrorsAsFailures {
    fn classify_head(&self, head: &Parts) -> Verdict {
        let status = head.status;
        let final_answer = head.extensions.get::<FinalResponse>().is_some();
        if status.is_success() || (!status.is_server_error() && final_answer) {
            Verdict::Remember
        } else {
            Verdict::RollBack
        }
    }
}

/// gRPC's rule: `grpc-status` decides (see the [module](self) docs).
#[derive(Debug, Clone, Copy, Default)]
pub struct GrpcErrorsAsFailures;

/// The `grpc-status` of `headers`, if it has one that is a number.
pub(crate) fn grpc_status(headers: &HeaderMap) -> Option<u32> {
    headers.get("grpc-status")?.to_str().ok()?.parse().ok()
}

impl GrpcErrorsAsFailures {
    fn by_code(head: &Parts, code: Option<u32>) -> bool {
        match code {
            Some(0) => true,
            Some(_) => head.extensions.get::<FinalResponse>().is_some(),
            None => false,
        }
    }
}

impl Classifier for GrpcErrorsAsFailures {
    fn classify_head(&self, head: &Parts) -> Verdict {
        if head.status != http::StatusCode::OK {
            // Not a gRPC answer (a proxy's, or the transport's): HTTP's rule.
            return ServerErrorsAsFailures.classify_head(head);
        }
        match grpc_status(&head.headers) {
            // Trailers-only: the status is in the headers.
            Some(code) if Self::by_code(head, Some(code)) => Verdict::Remember,
            Some(_) => Verdict::RollBack,
            None => Verdict::AtEnd,
        }
    }

    fn classify_end(&self, head: &Parts, trailers: Option<&HeaderMap>) -> bool {
        Self::by_code(head, trailers.and_then(grpc_status))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{Response, StatusCode};

    fn head(status: StatusCode, grpc: Option<&'static str>, final_answer: bool) -> Parts {
        let mut response = Response::new(());
        *response.status_mut() = status;
        if let Some(code) = grpc {
            response
                .headers_mut()
                .insert("grpc-status", code.parse().unwrap());
        }
        if final_answer {
            response.extensions_mut().insert(FinalResponse);
        }
        response.into_parts().0
    }

    fn trailers(code: &'static str) -> HeaderMap {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", code.parse().unwrap());
        trailers
    }

    #[test]
    fn http_remembers_2xx_and_marked_non_5xx() {
        let c = ServerErrorsAsFailures;
        assert_eq!(
            c.classify_head(&head(StatusCode::CREATED, None, false)),
            Verdict::Remember
        );
        assert_eq!(
            c.classify_head(&head(StatusCode::CONFLICT, None, false)),
            Verdict::RollBack
        );
        assert_eq!(
            c.classify_head(&head(StatusCode::CONFLICT, None, true)),
            Verdict::Remember
        );
        assert_eq!(
            c.classify_head(&head(StatusCode::SERVICE_UNAVAILABLE, None, true)),
            Verdict::RollBack
        );
    }

    #[test]
    fn grpc_decides_by_grpc_status_in_the_trailers_or_a_trailers_only_head() {
        let c = GrpcErrorsAsFailures;
        let ok = head(StatusCode::OK, None, false);
        assert_eq!(c.classify_head(&ok), Verdict::AtEnd);
        assert!(c.classify_end(&ok, Some(&trailers("0"))));
        assert!(!c.classify_end(&ok, Some(&trailers("14"))), "UNAVAILABLE");
        assert!(!c.classify_end(&ok, None), "no grpc-status");
        assert!(!c.classify_end(&ok, Some(&trailers("x"))), "not a number");
        let marked = head(StatusCode::OK, None, true);
        assert!(
            c.classify_end(&marked, Some(&trailers("3"))),
            "INVALID_ARGUMENT, final"
        );

        // Trailers-only answers, as tonic sends an Err(Status).
        assert_eq!(
            c.classify_head(&head(StatusCode::OK, Some("0"), false)),
            Verdict::Remember
        );
        assert_eq!(
            c.classify_head(&head(StatusCode::OK, Some("14"), false)),
            Verdict::RollBack
        );
        assert_eq!(
            c.classify_head(&head(StatusCode::OK, Some("6"), true)),
            Verdict::Remember,
            "ALREADY_EXISTS, final"
        );
        // Not gRPC at all: HTTP's rule.
        assert_eq!(
            c.classify_head(&head(StatusCode::BAD_GATEWAY, None, false)),
            Verdict::RollBack
        );
    }
}
