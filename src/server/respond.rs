//! axum answers (feature `axum`): [`Problem`], and [`StoreError`], which a
//! handler's statements fail with, as `IntoResponse`, so a handler returns
//! `Result<_, StoreError>` (with `SqlxTx`) and uses `?`. `PgTx`'s `TxError`
//! answers the same way; its impl is beside it (`postgres/tx/error.rs`).

use axum_core::{
    body::Body,
    response::{IntoResponse, Response},
};

use crate::{problem::Problem, store::StoreError};

/// The problem's status, `application/problem+json` and its `Retry-After`,
/// as [`Problem::to_response`] renders them.
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        self.to_response().map(Body::from)
    }
}

/// [`StoreError::to_problem`]: what a [`SqlxTx`](crate::sqlx::SqlxTx)
/// handler answers when its connection or a query fails (`sqlx::Error`
/// converts with `?`), or a fenced commit does. Logged at debug by kind and
/// SQLSTATE only.
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
impl IntoResponse for StoreError {
    fn into_response(self) -> Response {
        tracing::debug!(
            kind = self.kind().code(),
            sqlstate = self.sql_state(),
            "the handler answered a failed statement"
        );
        self.to_problem().into_response()
    }
}

#[cfg(test)]
mod tests {
    use http::{header, StatusCode};

    use super::*;
    use crate::problem::{codes, PROBLEM_JSON};

    /// The same head as `Problem::to_response`: status, content type and
    /// `Retry-After`.
    #[test]
    fn a_problem_answers_its_status_content_type_and_retry_after() {
        let response = Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            codes::STORE_UNAVAILABLE,
            "down",
        )
        .with_retry_after(1)
        .into_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
        assert_eq!(response.headers()[header::RETRY_AFTER], "1");
    }

    /// Store errors by kind: worth a retry (503 with `Retry-After`) or not
    /// (500), and the message stays out of the body.
    #[test]
    fn store_errors_answer_by_kind() {
        use crate::store::StoreErrorKind as Kind;
        for (kind, status, code) in [
            (Kind::Unavailable, 503, codes::STORE_UNAVAILABLE),
            (Kind::Conflict, 503, codes::STORE_UNAVAILABLE),
            (Kind::OutcomeUnknown, 503, codes::STORE_UNAVAILABLE),
            (Kind::Fenced, 503, codes::OPERATION_TAKEN_OVER),
            (Kind::TransactionAborted, 500, codes::STATEMENT_FAILED),
            (Kind::Schema, 500, codes::STATEMENT_FAILED),
            (Kind::Backend, 500, codes::STATEMENT_FAILED),
        ] {
            let error = StoreError::new(kind, "duplicate key value (secret)");
            let problem = error.to_problem();
            assert_eq!((problem.status().as_u16(), problem.code()), (status, code));
            assert!(!problem.to_json().to_string().contains("secret"));
            let response = error.into_response();
            assert_eq!(
                response.headers().contains_key(header::RETRY_AFTER),
                status == 503,
                "{kind:?}"
            );
        }
    }
}
