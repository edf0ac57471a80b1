//! Micro-benchmarks of the layer's CPU work: key parsing, fingerprinting a
//! 1 KB and a 64 KB order body (typed and JSON), building a replay.
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
            }
            .to_replay()
        })
    });
    group.finish();
}

criterion_group!(benches, keys, fingerprints, replay);
criterion_main!(benches);
