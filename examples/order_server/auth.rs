//! Bearer tokens decide the tenant; nothing a client sends otherwise can.

use std::{collections::HashMap, sync::Arc};

use axum::{
    extract::{Request, State},
    middleware::Next,
    response::{IntoResponse, Response},
};
use http::{header, StatusCode};
use tower_idempotency::{problem::Problem, scope::TenantId};

pub(crate) type Tokens = Arc<HashMap<String, TenantId>>;

pub(crate) async fn authenticate(
    State(tokens): State<Tokens>,
    mut request: Request,
    next: Next,
) -> Response {
    let tenant = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token)
        .and_then(|token| tokens.get(token.trim()))
        .cloned();
    // A client must never pick its tenant by header; drop any attempt.
    request.extensions_mut().remove::<TenantId>();
    match tenant {
        Some(tenant) => {
            request.extensions_mut().insert(tenant);
            next.run(request).await
        }
        None => {
            let mut response = crate::problem(Problem::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "A valid bearer token is required",
            ));
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                http::HeaderValue::from_static("Bearer"),
            );
            response.into_response()
        }
    }
}
