//! The create the pooler and TLS benches measure: the layer over a handler
//! that inserts one order through the claim's transaction (one typed
//! statement: the same in both statement modes, direct or behind a pooler).

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tokio_postgres::types::Type;
use tower::util::BoxCloneSyncService;
use tower_idempotency::{
    fingerprint::JsonFingerprinter,
    postgres::{PgStore, PgTx},
    scope::SingleTenant,
    IdempotencyLayer, RequestBody,
};

/// The order insert, also run bare.
pub(crate) const INSERT: &str = "INSERT INTO orders (tenant_id, total) VALUES ($1, $2)";

/// The layered service, boxed.
pub(crate) type Service = BoxCloneSyncService<
    Request<Full<Bytes>>,
    Response<tower_idempotency::ResponseBody<Full<Bytes>>>,
    Box<dyn std::error::Error + Send + Sync>,
>;

/// The layer (tenant `bench`, no replay cache) over the insert.
pub(crate) fn layered(store: PgStore) -> Service {
    let handler = tower::service_fn(|request: Request<RequestBody>| async move {
        let tx = request
            .extensions()
            .get::<PgTx>()
            .cloned()
            .ok_or("no transaction")?;
        tx.execute_typed(INSERT, &[(&"bench", Type::TEXT), (&2400_i64, Type::INT8)])
            .await?;
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(
            Response::builder()
                .status(StatusCode::CREATED)
                .body(Full::new(Bytes::from_static(b"{\"id\":1}")))
                .expect("response"),
        )
    });
    BoxCloneSyncService::new(tower::Layer::layer(&layer(store), handler))
}

/// The benches' layer: `POST /orders v1`, JSON fingerprints, tenant
/// `bench`, no replay cache.
pub(crate) fn layer(store: PgStore) -> IdempotencyLayer<PgStore, JsonFingerprinter, SingleTenant> {
    IdempotencyLayer::new(
        store,
        "POST /orders v1",
        JsonFingerprinter::new("orders.v1"),
    )
    .tenant_resolver(SingleTenant::new("bench"))
    .without_replay_cache()
}
