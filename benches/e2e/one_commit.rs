//! The one-commit mode (`IdempotencyLayer::claim_at_commit()`, the store
//! trait `tower_idempotency::store::CommitStore`): the handler writes first,
//! and the key row goes in with the response, pipelined with `COMMIT`.

use std::net::SocketAddr;

use axum::{routing::post, Router};
use tower_idempotency::{
    fingerprint::TypedFingerprinter, postgres::PgStore, scope::SingleTenant, IdempotencyLayer,
};

use crate::servers::{layered, serve, NewOrder};

/// The layered server in the one-commit mode: the same handler and `PgTx`
/// as the claim-first mode, the same endpoint, fingerprint and tenant.
pub(crate) async fn server(store: PgStore) -> SocketAddr {
    let layer = IdempotencyLayer::new(
        store,
        "POST /orders v1",
        TypedFingerprinter::<NewOrder>::new("orders.v1"),
    )
    .claim_at_commit()
    .tenant_resolver(SingleTenant::new("bench"));
    serve(Router::new().route("/orders", post(layered).layer(layer))).await
}
