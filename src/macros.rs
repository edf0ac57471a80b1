//! Macros the middlewares share.

/// The `get_ref`, `get_mut` and `into_inner` of a middleware whose wrapped
/// service is the field `inner` of type `S` (as tower-http writes them).
macro_rules! define_inner_service_accessors {
    () => {
        /// Gets a reference to the wrapped service.
        pub fn get_ref(&self) -> &S {
            &self.inner
        }

        /// Gets a mutable reference to the wrapped service.
        pub fn get_mut(&mut self) -> &mut S {
            &mut self.inner
        }

        /// Consumes the middleware, returning the wrapped service.
        pub fn into_inner(self) -> S {
            self.inner
        }
    };
}

pub(crate) use define_inner_service_accessors;

/// axum extractors (feature `axum`) for each handle `$handle` that the layer
/// puts in the request extensions: `$handle` itself, rejected with
/// `MissingFromLayer` (`500 idempotency_layer_missing`) when the route is
/// not behind the layer, and `Option<$handle>`, `None` where the layer put
/// none (a request without a key on a route with `require_key(false)`,
/// passed through without idempotency). Invoked by each driver beside its
/// handle types; the attributes before a handle go on both impls.
#[cfg(all(feature = "axum", any(feature = "postgres", feature = "sqlx")))]
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
                parts: &mut http::request::Parts,
                _state: &S,
            ) -> Result<Option<Self>, Self::Rejection> {
                Ok(parts.extensions.get::<$handle>().cloned())
            }
        }

        $(#[$cfg])*
        #[doc = concat!(
            "The layer's `", stringify!($handle), "`; `500 idempotency_layer_missing` ",
            "([`MissingFromLayer`](crate::MissingFromLayer)) when the route is not behind it."
        )]
        impl<S: Send + Sync> axum_core::extract::FromRequestParts<S> for $handle {
            type Rejection = crate::MissingFromLayer;

            async fn from_request_parts(
                parts: &mut http::request::Parts,
                _state: &S,
            ) -> Result<Self, Self::Rejection> {
                parts
                    .extensions
                    .get::<$handle>()
                    .cloned()
                    .ok_or(crate::MissingFromLayer::new(stringify!($handle)))
            }
        }
    )*};
}

#[cfg(all(feature = "axum", any(feature = "postgres", feature = "sqlx")))]
pub(crate) use from_extensions;
