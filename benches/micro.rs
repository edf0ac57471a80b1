//! Micro-benchmarks of the layer's CPU work: key parsing, fingerprinting a
//! 1 KB and a 64 KB order body (typed and JSON), building a replay, and a
//! whole replay through the layer (`MemoryStore`), stored bytes against one
//! rebuilt from the resource id.
//!
//!     cargo bench --bench micro

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use http::{header, HeaderValue, StatusCode};
use serde::{Deserialize, Serialize};
use tower_idempotency::{
    fingerprint::{Fingerprinter, JsonFingerprinter, TypedFingerprinter},
    key::IdempotencyKey,
    record::StoredResponse,
};

#[derive(Serialize, Deserialize)]
struct Order {
    checkout_id: String,
    currency: String,
    items: Vec<Item>,
    shipping_address_id: String,
    #[serde(default)]
    coupon: Option<String>,
}

#[derive(Serialize, Deserialize)]
struct Item {
    sku: String,
    #[serde(default = "one")]
    quantity: i64,
    unit_price: i64,
}

fn one() -> i64 {
    1
}

/// An order body of about `bytes` bytes.
fn order_body(bytes: usize) -> Bytes {
    let mut items = Vec::new();
    let mut body = String::new();
    while body.len() < bytes {
        items.push(serde_json::json!({"sku": format!("SKU-{:06}", items.len()), "quantity": 2, "unit_price": 1200}));
        body = serde_json::json!({
            "checkout_id": "chk_123", "currency": "JPY", "items": items,
            "shipping_address_id": "addr_1", "trace_id": "t-1"
        })
        .to_string();
    }
    Bytes::from(body)
}

fn keys(c: &mut Criterion) {
    let mut group = c.benchmark_group("key_parse");
    group.bench_function("bare", |b| {
        b.iter(|| IdempotencyKey::parse(b"8e03978e-40d5-43e8-bc93-6894a57f9324"))
    });
    group.bench_function("quoted", |b| {
        b.iter(|| IdempotencyKey::parse(b"\"8e03978e-40d5-43e8-bc93-6894a57f9324\""))
    });
    group.finish();
}

fn fingerprints(c: &mut Criterion) {
    let typed = TypedFingerprinter::<Order>::new("orders.v1");
    let json = JsonFingerprinter::new("orders.v1").ignore_field("trace_id");
    let mut group = c.benchmark_group("fingerprint");
    for size in [1024, 64 * 1024] {
        let body = order_body(size);
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(BenchmarkId::new("typed", size), &body, |b, body| {
            b.iter(|| {
                let (mut parts, ()) = http::Request::new(()).into_parts();
                typed.fingerprint(&mut parts, body).unwrap()
            })
        });
        group.bench_with_input(BenchmarkId::new("json", size), &body, |b, body| {
            b.iter(|| {
                let (mut parts, ()) = http::Request::new(()).into_parts();
                json.fingerprint(&mut parts, body).unwrap()
            })
        });
    }
    group.finish();
}

fn replay(c: &mut Criterion) {
    let stored = StoredResponse {
        status: StatusCode::CREATED,
        headers: vec![
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            ),
            (
                header::LOCATION,
                HeaderValue::from_static("/orders/8e03978e-40d5-43e8-bc93-6894a57f9324"),
            ),
        ],
        body: order_body(1024),
        resource_id: None,
        trailers: Vec::new(),
        trace_id: None,
        span_id: None,
    };
    let block = stored.encode_headers();
    let mut group = c.benchmark_group("replay");
    group.bench_function("build_response", |b| b.iter(|| stored.to_replay()));
    group.bench_function("decode_headers_and_build", |b| {
        b.iter(|| {
            let headers = StoredResponse::decode_headers(&block).unwrap();
            StoredResponse {
                status: stored.status,
                headers,
                body: stored.body.clone(),
                resource_id: None,
                trailers: Vec::new(),
                trace_id: None,
                span_id: None,
            }
            .to_replay()
        })
    });
    group.finish();
}

/// A replay through the layer over `MemoryStore`: the stored bytes, or the
/// response rebuilt by a function that formats a fresh body (no I/O: the
/// layer's own cost of the rebuild path).
fn layer_replay(c: &mut Criterion) {
    use tower::{Layer, ServiceExt};
    use tower_idempotency::{
        memory::MemoryStore,
        record::ResourceId,
        replay::{RebuildRequest, Rebuilt},
        scope::{SingleTenant, TenantId},
        IdempotencyLayer, RequestBody,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let handler = tower::service_fn(|_: http::Request<RequestBody>| async {
        let mut response = http::Response::new(http_body_util::Full::new(Bytes::from_static(
            br#"{"id":"ord_1","download_url":"/files/ord_1?sig=first"}"#,
        )));
        *response.status_mut() = StatusCode::CREATED;
        response.extensions_mut().insert(ResourceId::new("ord_1"));
        Ok::<_, std::convert::Infallible>(response)
    });
    let rebuild = tower::service_fn(|request: RebuildRequest| async move {
        let body = format!(
            r#"{{"id":"{}","download_url":"/files/{}?sig=fresh"}}"#,
            request.resource_id, request.resource_id
        );
        Ok::<_, std::convert::Infallible>(Rebuilt::Current(http::Response::new(Bytes::from(body))))
    });
    let base = || {
        IdempotencyLayer::new(
            MemoryStore::new(),
            "POST /exports v1",
            JsonFingerprinter::new("exports.v1"),
        )
        .tenant_resolver(SingleTenant::new(TenantId::new("bench")))
    };
    let request = || {
        http::Request::post("/exports")
            .header("idempotency-key", "k-1")
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(Bytes::from_static(
                br#"{"file":"a"}"#,
            )))
            .unwrap()
    };
    let stored = base().layer(handler);
    let rebuilt = base().rebuild_replays(rebuild).layer(handler);
    runtime.block_on(async {
        stored.clone().oneshot(request()).await.unwrap();
        rebuilt.clone().oneshot(request()).await.unwrap();
    });
    let mut group = c.benchmark_group("layer_replay");
    group.bench_function("stored", |b| {
        b.to_async(&runtime)
            .iter(|| async { stored.clone().oneshot(request()).await.unwrap() })
    });
    group.bench_function("rebuilt", |b| {
        b.to_async(&runtime)
            .iter(|| async { rebuilt.clone().oneshot(request()).await.unwrap() })
    });
    group.finish();
}

criterion_group!(benches, keys, fingerprints, replay, layer_replay);
criterion_main!(benches);
