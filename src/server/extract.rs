//! axum extractors (feature `axum`) for what the layer leaves in the request.

use axum_core::{
    extract::FromRequestParts,
    response::{IntoResponse, Response},
};
use http::{request::Parts, StatusCode};

#[cfg(feature = "postgres")]
use crate::postgres::{PgLease, PgTx};
#[cfg(feature = "sqlx")]
use crate::sqlx::{SqlxLease, SqlxTx};
use crate::{fingerprint::Validated, problem::Problem};

/// The rejection when a handler asks for something the layer did not provide:
/// the route is not behind [`IdempotencyLayer`](crate::IdempotencyLayer) (or
/// not with the matching fingerprinter). A server configuration error: 500.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub struct MissingFromLayer(&'static str);

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

/// Extracts each handle `$handle` from the request extensions, where the
/// layer puts it; `Option<$handle>` is `None` where the layer put none (a
/// request without a key on a route with `require_key(false)`, passed
/// through without idempotency).
macro_rules! from_extensions {
    ($($(#[$cfg:meta])* $handle:ident,)*) => {$(
        $(#[$cfg])*
        #[doc = concat!(
            "`Option<", stringify!($handle), ">`: `None` when the layer put no handle in the ",
            "request (a request without a key where the layer has `require_key(false)`), ",
            "for handlers that serve both."
        )]
        impl<S: Send + Sync> axum_core::extract::OptionalFromRequestParts<S> for $handle {
            // No handle is an answer, not a failure: the request runs
            // without idempotency, as the layer let it through.
            type Rejection = std::convert::Infallible;

            async fn from_request_parts(
                parts: &mut Parts,
                _state: &S,
            ) -> Result<Option<Self>, Self::Rejection> {
                Ok(parts.extensions.get::<$handle>().cloned())
            }
        }

        $(#[$cfg])*
        #[doc = concat!(
            "The layer's `", stringify!($handle), "`; `500 idempotency_layer_missing` ",
            "([`MissingFromLayer`]) when the route is not behind it."
        )]
        impl<S: Send + Sync> FromRequestParts<S> for $handle {
            type Rejection = MissingFromLayer;

            async fn from_request_parts(
                parts: &mut Parts,
                _state: &S,
            ) -> Result<Self, Self::Rejection> {
                parts
                    .extensions
                    .get::<$handle>()
                    .cloned()
                    .ok_or(MissingFromLayer(stringify!($handle)))
            }
        }
    )*};
}

from_extensions! {
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(all(feature = "axum", feature = "postgres"))))]
    PgTx,
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(all(feature = "axum", feature = "postgres"))))]
    PgLease,
    #[cfg(feature = "sqlx")]
    #[cfg_attr(docsrs, doc(cfg(all(feature = "axum", feature = "sqlx"))))]
    SqlxTx,
    #[cfg(feature = "sqlx")]
    #[cfg_attr(docsrs, doc(cfg(all(feature = "axum", feature = "sqlx"))))]
    SqlxLease,
}

#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
impl<S: Send + Sync, T: Send + Sync + 'static> FromRequestParts<S> for Validated<T> {
    type Rejection = MissingFromLayer;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<Validated<T>>()
            .cloned()
            .ok_or(MissingFromLayer("Validated<T>"))
    }
}
