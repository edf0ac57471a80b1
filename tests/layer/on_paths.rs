//! One layer on a server that routes by path (`IdempotencyLayer::on_paths`),
//! on PgStore: each guarded path is its own endpoint, named by the path
//! without its `/`; every other path reaches the service untouched, its
//! body unread, nothing claimed.

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc,
};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{Layer, ServiceExt};
use tower_idempotency::{
    fingerprint::JsonFingerprinter, scope::TenantId, IdempotencyLayer, RequestBody,
};

use crate::common::*;

const CREATE: &str = "/orders.v1.Orders/CreateOrder";
const CANCEL: &str = "/orders.v1.Orders/CancelOrder";
const GET: &str = "/orders.v1.Orders/GetOrder";

/// Writes an order through the layer's transaction when there is one and
/// answers `201 <path>`; without one, answers `200 passed <body>`, the
/// body as it came.
fn by_path(
    runs: Arc<AtomicU64>,
) -> impl tower::Service<
    Request<RequestBody>,
    Response = Response<Full<Bytes>>,
    Error = BoxError,
    Future: Send,
> + Clone
       + Send
       + 'static {
    tower::service_fn(move |request: Request<RequestBody>| {
        let runs = runs.clone();
        async move {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            let path = request.uri().path().to_owned();
            if let Some(tx) = tx_of::<Postgres>(&request) {
                Postgres::insert_order(&tx, &format!("order-{n}"), "tenant-a").await?;
                return Ok(Response::builder()
                    .status(StatusCode::CREATED)
                    .body(Full::new(Bytes::from(path)))
                    .unwrap());
            }
            let body = request.into_body().collect().await?.to_bytes();
            let mut answer = b"passed ".to_vec();
            answer.extend_from_slice(&body);
            Ok::<_, BoxError>(Response::new(Full::new(Bytes::from(answer))))
        }
    })
}

fn call(path: &str, key: Option<&str>, body: &'static str) -> Request<Full<Bytes>> {
    let mut builder = Request::post(path).header("content-type", "application/json");
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    let mut request = builder
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap();
    request.extensions_mut().insert(TenantId::new("tenant-a"));
    request
}

async fn answer<S, B>(service: &S, request: Request<Full<Bytes>>) -> (StatusCode, bool, Bytes)
where
    S: tower::Service<Request<Full<Bytes>>, Response = Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let response = service.clone().oneshot(request).await.expect("answers");
    let replayed = response.headers().contains_key("idempotent-replayed");
    let status = response.status();
    (
        status,
        replayed,
        response.into_body().collect().await.unwrap().to_bytes(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_guarded_path_is_an_endpoint_and_every_other_path_passes_through_untouched() {
    let pg = Postgres::new().await;
    let runs = Arc::new(AtomicU64::new(0));
    let layer = layer(pg.store.clone()).on_paths([CREATE, CANCEL, CREATE, ""]);
    assert_eq!(
        layer.endpoints().collect::<Vec<_>>(),
        [
            "orders.v1.Orders/CreateOrder",
            "orders.v1.Orders/CancelOrder"
        ],
        "repeated and empty paths are dropped"
    );
    let service = layer.layer(by_path(runs.clone()));

    // The same key on two guarded methods: two operations.
    let created = answer(&service, call(CREATE, Some("k1"), BODY)).await;
    assert_eq!((created.0, created.1), (StatusCode::CREATED, false));
    assert_eq!(created.2, CREATE.as_bytes());
    let cancelled = answer(&service, call(CANCEL, Some("k1"), BODY)).await;
    assert_eq!((cancelled.0, cancelled.1), (StatusCode::CREATED, false));
    assert_eq!(cancelled.2, CANCEL.as_bytes());
    // A retry of each replays its own answer.
    assert_eq!(
        answer(&service, call(CREATE, Some("k1"), BODY)).await,
        (StatusCode::CREATED, true, created.2.clone())
    );
    assert_eq!(
        answer(&service, call(CANCEL, Some("k1"), BODY)).await,
        (StatusCode::CREATED, true, cancelled.2.clone())
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    let records: Vec<String> = pg
        .column(
            "SELECT endpoint || ' ' || state FROM idempotency_requests \
             WHERE idempotency_key = 'k1' ORDER BY endpoint",
        )
        .await;
    assert_eq!(
        records,
        [
            "orders.v1.Orders/CancelOrder completed",
            "orders.v1.Orders/CreateOrder completed"
        ]
    );
    assert_eq!(pg.count("SELECT count(*) FROM orders").await, 2);

    // Any other path: the service gets the request as it came (its body
    // unread, no transaction), with a key or without, twice; nothing is
    // claimed or remembered. A path that only starts like a guarded one is
    // another path.
    for path in [
        GET,
        "/orders.v1.Orders/CreateOrderLater",
        "/orders.v1.Orders/CreateOrder/",
    ] {
        for key in [Some("k1"), Some("k2"), None] {
            assert_eq!(
                answer(&service, call(path, key, "{\"id\":\"order-1\"}")).await,
                (
                    StatusCode::OK,
                    false,
                    Bytes::from_static(b"passed {\"id\":\"order-1\"}")
                ),
                "{path} {key:?}"
            );
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2 + 9);
    assert_eq!(
        pg.count("SELECT count(*) FROM idempotency_requests").await,
        2
    );
    assert_eq!(pg.count("SELECT count(*) FROM orders").await, 2);

    // A guarded path still refuses a request without a key, and another
    // body under a used key.
    assert_eq!(
        answer(&service, call(CREATE, None, BODY)).await.0,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        answer(&service, call(CREATE, Some("k1"), "{\"sku\":\"other\"}"))
            .await
            .0,
        StatusCode::CONFLICT
    );
    assert_eq!(runs.load(Ordering::SeqCst), 11);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_commit_layer_on_paths_commits_its_record_under_the_paths_endpoint() {
    let pg = Postgres::new().await;
    let runs = Arc::new(AtomicU64::new(0));
    let service = IdempotencyLayer::new(
        pg.store.clone(),
        "ignored",
        JsonFingerprinter::new("orders.v1"),
    )
    .claim_at_commit()
    .on_paths([CREATE])
    .layer(by_path(runs.clone()));
    for _ in 0..2 {
        assert_eq!(
            answer(&service, call(CREATE, Some("k1"), BODY)).await.0,
            StatusCode::CREATED
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let endpoints: Vec<String> = pg.column("SELECT endpoint FROM idempotency_requests").await;
    assert_eq!(endpoints, ["orders.v1.Orders/CreateOrder"]);
    assert_eq!(pg.count("SELECT count(*) FROM orders").await, 1);
}
