//! axum extractors (feature `axum`) for what the layer leaves in the request,
//! and their rejection, [`MissingFromLayer`]. Each driver's handles (`PgTx`,
//! `PgLease`, `SqlxTx`, `SqlxLease`) are extractors by
//! `crate::macros::from_extensions!`, invoked beside their types.

use axum_core::{
    extract::FromRequestParts,
    response::{IntoResponse, Response},
};
use http::{request::Parts, StatusCode};

use crate::{fingerprint::Validated, problem::Problem};

/// The rejection when a handler asks for something the layer did not provide:
/// the route is not behind [`IdempotencyLayer`](crate::IdempotencyLayer) (or
/// not with the matching fingerprinter). A server configuration error: 500.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub struct MissingFromLayer(&'static str);

impl MissingFromLayer {
    /// The rejection for a request without `what` (a type's name).
    pub(crate) const fn new(what: &'static str) -> Self {
        MissingFromLayer(what)
    }
}

impl IntoResponse for MissingFromLayer {
    fn into_response(self) -> Response {
        tracing::error!(
            missing = self.0,
            "the route is not behind the idempotency layer it expects"
        );
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "idempotency_layer_missing",
            "The server is misconfigured",
        )
        .into_response()
    }
}

#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
impl<S: Send + Sync, T: Send + Sync + 'static> FromRequestParts<S> for Validated<T> {
    type Rejection = MissingFromLayer;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Validated<T>>()
            .cloned()
            .ok_or(MissingFromLayer::new("Validated<T>"))
    }
}
