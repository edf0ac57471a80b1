//! What counts as success: whether a response is the operation's answer,
//! remembered and committed with the handler's writes, or a failure, rolled
//! back so that the key is free for a retry.
//!
//! The names follow tower-http's `classify`. [`ServerErrorsAsFailures`] is
//! HTTP's rule: a 2xx is remembered, and any other status below 500 that
//! the handler marked [`FinalResponse`]; the rest rolls back.
//! [`GrpcErrorsAsFailures`] is gRPC's, where every answer is HTTP 200 and
//! the outcome is in `grpc-status`: in the trailers, or in the headers of a
//! trailers-only answer (as tonic sends an `Err(Status)`). `0` (`OK`) is
//! remembered; any other code rolls back unless the handler marked the
//! answer [`FinalResponse`] (deterministic rejections: `INVALID_ARGUMENT`,
//! `FAILED_PRECONDITION`, `ALREADY_EXISTS`); an answer without a
//! `grpc-status` is a failure.
//!
//! The layer's default, [`ServerOrGrpcErrorsAsFailures`], picks one of the
//! two for each answer by the answer's own `content-type`: gRPC's rule for
//! `application/grpc` and `application/grpc+<codec>`, HTTP's for anything
//! else. So a gRPC service is safe without a word: its `UNAVAILABLE` rolls
//! back instead of being remembered as the success its HTTP 200 looks like.
//! gRPC-Web (`application/grpc-web…`) carries its trailers in the body,
//! which no classifier reads: only its trailers-only answers are judged by
//! their `grpc-status`, the rest by HTTP's rule; put the gRPC-Web
//! translation outside the layer and the layer sees plain gRPC.
//!
//! Set another with [`IdempotencyLayer::classify`](crate::IdempotencyLayer::classify);
//! a classifier chosen there judges every answer, gRPC or not:
//! `classify(ServerErrorsAsFailures)` remembers a gRPC error as the HTTP 200
//! it is, and `classify(GrpcErrorsAsFailures)` rolls back an HTTP 200 with
//! no `grpc-status`, whatever its content type.
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

/// HTTP's rule: 2xx, and a non-5xx marked [`FinalResponse`]. The default
/// for an answer that is not gRPC ([`ServerOrGrpcErrorsAsFailures`]).
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

/// gRPC's rule: `grpc-status` decides (see the [module](self) docs). The
/// default for an answer whose content type is gRPC
/// ([`ServerOrGrpcErrorsAsFailures`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct GrpcErrorsAsFailures;

/// The `grpc-status` of `headers`, if it has one that is a number.
pub(crate) fn grpc_status(headers: &HeaderMap) -> Option<u32> {
    headers.get("grpc-status")?.to_str().ok()?.parse().ok()
}

/// Which gRPC a `content-type` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GrpcContent {
    /// gRPC: the status in HTTP trailers, or in a trailers-only head.
    Grpc,
    /// gRPC-Web: the trailers in the body's last frame.
    Web,
}

/// What gRPC, if any, the `content-type` in `headers` names:
/// `application/grpc`, `application/grpc+proto`, `application/grpc-web`,
/// `application/grpc-web-text+proto`, …
pub(crate) fn grpc_content(headers: &HeaderMap) -> Option<GrpcContent> {
    let value = headers.get(http::header::CONTENT_TYPE)?.to_str().ok()?;
    // Parameters and case do not change a media type.
    let essence = value.split(';').next().unwrap_or_default().trim();
    let base = essence
        .split_once('+')
        .map_or(essence, |(base, _codec)| base);
    if base.eq_ignore_ascii_case("application/grpc") {
        Some(GrpcContent::Grpc)
    } else if base.eq_ignore_ascii_case("application/grpc-web")
        || base.eq_ignore_ascii_case("application/grpc-web-text")
    {
        Some(GrpcContent::Web)
    } else {
        None
    }
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

/// The default: gRPC's rule for an answer whose content type says gRPC,
/// HTTP's for any other (see the [module](self) docs).
///
/// An answer is gRPC when its `content-type` is `application/grpc`, or
/// `application/grpc+<codec>` (`+proto`, `+json`, …), parameters and case
/// aside: [`GrpcErrorsAsFailures`] judges it. gRPC-Web
/// (`application/grpc-web…`) carries its trailers in the body, where no
/// classifier looks: its trailers-only answers, whose `grpc-status` is in
/// the headers, are judged by that status, and the rest by
/// [`ServerErrorsAsFailures`], as every other answer is.
///
/// Choosing it with [`classify`](crate::IdempotencyLayer::classify) is the
/// same as choosing none.
#[derive(Debug, Clone, Copy, Default)]
pub struct ServerOrGrpcErrorsAsFailures;

impl Classifier for ServerOrGrpcErrorsAsFailures {
    fn classify_head(&self, head: &Parts) -> Verdict {
        match grpc_content(&head.headers) {
            Some(GrpcContent::Grpc) => GrpcErrorsAsFailures.classify_head(head),
            // Only a trailers-only answer shows gRPC-Web's status to us;
            // waiting for HTTP trailers it never sends would roll back
            // every success.
            Some(GrpcContent::Web) if grpc_status(&head.headers).is_some() => {
                GrpcErrorsAsFailures.classify_head(head)
            }
            _ => ServerErrorsAsFailures.classify_head(head),
        }
    }

    fn classify_end(&self, head: &Parts, trailers: Option<&HeaderMap>) -> bool {
        match grpc_content(&head.headers) {
            Some(GrpcContent::Grpc) => GrpcErrorsAsFailures.classify_end(head, trailers),
            _ => ServerErrorsAsFailures.classify_end(head, trailers),
        }
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

    fn with_content_type(mut head: Parts, content_type: &'static str) -> Parts {
        head.headers
            .insert(http::header::CONTENT_TYPE, content_type.parse().unwrap());
        head
    }

    #[test]
    fn the_content_type_names_grpc_and_grpc_web() {
        let named = |content_type: &'static str| {
            grpc_content(
                &with_content_type(head(StatusCode::OK, None, false), content_type).headers,
            )
        };
        for grpc in [
            "application/grpc",
            "application/grpc+proto",
            "application/grpc+json",
            "Application/GRPC",
            "application/grpc; charset=utf-8",
            "application/grpc+proto ; x=y",
        ] {
            assert_eq!(named(grpc), Some(GrpcContent::Grpc), "{grpc}");
        }
        for web in [
            "application/grpc-web",
            "application/grpc-web+proto",
            "application/grpc-web-text",
            "application/grpc-web-text+proto",
        ] {
            assert_eq!(named(web), Some(GrpcContent::Web), "{web}");
        }
        for other in [
            "application/json",
            "application/grpcx",
            "application/grpc-other",
            "text/application/grpc",
        ] {
            assert_eq!(named(other), None, "{other}");
        }
        assert_eq!(grpc_content(&HeaderMap::new()), None, "no content type");
    }

    #[test]
    fn the_default_judges_grpc_answers_by_grpc_status_and_the_rest_by_http() {
        let c = ServerOrGrpcErrorsAsFailures;
        let grpc = |code, final_answer| {
            with_content_type(
                head(StatusCode::OK, code, final_answer),
                "application/grpc+proto",
            )
        };

        // Status in the trailers.
        let ok = grpc(None, false);
        assert_eq!(c.classify_head(&ok), Verdict::AtEnd);
        assert!(c.classify_end(&ok, Some(&trailers("0"))));
        assert!(!c.classify_end(&ok, Some(&trailers("14"))), "UNAVAILABLE");
        assert!(!c.classify_end(&ok, None), "no grpc-status");
        assert!(
            c.classify_end(&grpc(None, true), Some(&trailers("3"))),
            "marked final"
        );
        // Trailers-only.
        assert_eq!(c.classify_head(&grpc(Some("0"), false)), Verdict::Remember);
        assert_eq!(c.classify_head(&grpc(Some("14"), false)), Verdict::RollBack);
        // A gRPC content type on an HTTP error (a proxy's): HTTP's rule.
        let bad_gateway = with_content_type(
            head(StatusCode::BAD_GATEWAY, None, false),
            "application/grpc",
        );
        assert_eq!(c.classify_head(&bad_gateway), Verdict::RollBack);

        // Not gRPC: HTTP's rule, whatever grpc-status it carries.
        let json = |status, code| with_content_type(head(status, code, false), "application/json");
        assert_eq!(
            c.classify_head(&json(StatusCode::OK, Some("14"))),
            Verdict::Remember
        );
        assert_eq!(
            c.classify_head(&json(StatusCode::CREATED, None)),
            Verdict::Remember
        );
        assert_eq!(
            c.classify_head(&json(StatusCode::SERVICE_UNAVAILABLE, None)),
            Verdict::RollBack
        );
        assert_eq!(
            c.classify_head(&head(StatusCode::OK, None, false)),
            Verdict::Remember,
            "no content type"
        );

        // gRPC-Web: its trailers-only status decides; a status in the body's
        // trailer frame is out of sight, so HTTP's rule.
        let web = |code| {
            with_content_type(
                head(StatusCode::OK, code, false),
                "application/grpc-web+proto",
            )
        };
        assert_eq!(c.classify_head(&web(Some("14"))), Verdict::RollBack);
        assert_eq!(c.classify_head(&web(Some("0"))), Verdict::Remember);
        assert_eq!(c.classify_head(&web(None)), Verdict::Remember);
    }
}
