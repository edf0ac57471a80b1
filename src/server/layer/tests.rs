use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use tokio::sync::Notify;
use tower_service::Service;

use super::*;
use crate::{
    fingerprint::JsonFingerprinter,
    key::IdempotencyKey,
    memory::{MemoryStore, MemoryTx},
    record::StoredResponse,
    scope::{Scope, TenantId},
    server::body::RequestBody,
    store::{Claim, ClaimRequest, StoreError},
};

/// A store that counts what it is asked.
#[derive(Clone, Default)]
struct Counting {
    inner: MemoryStore,
    claims: Arc<AtomicUsize>,
    completions: Arc<AtomicUsize>,
}

impl Store for Counting {
    type Tx = MemoryTx;
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim<MemoryTx>, StoreError> {
        self.claims.fetch_add(1, Ordering::SeqCst);
        self.inner.claim(request).await
    }
    async fn complete(&self, tx: MemoryTx, response: &StoredResponse) -> Result<(), StoreError> {
        self.completions.fetch_add(1, Ordering::SeqCst);
        self.inner.complete(tx, response).await
    }
    async fn abort(&self, tx: MemoryTx) -> Result<(), StoreError> {
        self.inner.abort(tx).await
    }
}

fn post(body: &'static str) -> Request<http_body_util::Full<Bytes>> {
    let mut request = Request::post("/orders")
        .header("idempotency-key", "hot")
        .body(http_body_util::Full::new(Bytes::from_static(
            body.as_bytes(),
        )))
        .unwrap();
    request.extensions_mut().insert(TenantId::new("t"));
    request
}

/// A response's status, whether it was a replay, and its body.
async fn answer<B: http_body::Body>(response: Response<B>) -> (StatusCode, bool, Bytes)
where
    B::Error: std::fmt::Debug,
{
    let replayed = response.headers().contains_key("idempotent-replayed");
    let status = response.status();
    let body = http_body_util::BodyExt::collect(response.into_body())
        .await
        .unwrap()
        .to_bytes();
    (status, replayed, body)
}

/// 50 duplicates in one process cost one claim and one completion: the
/// 49 that waited behind the first take its record from memory, and a
/// different request under the key is still refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_in_one_process_answer_from_the_leaders_record() {
    let store = Counting::default();
    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let calls = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (started, release, calls) = (started.clone(), release.clone(), calls.clone());
        tower::service_fn(move |request: Request<RequestBody>| {
            let (started, release, calls) = (started.clone(), release.clone(), calls.clone());
            async move {
                calls.fetch_add(1, Ordering::SeqCst);
                let tx = request.extensions().get::<MemoryTx>().cloned().unwrap();
                tx.insert("orders", serde_json::json!({"id": 1})).unwrap();
                started.notify_one();
                release.notified().await;
                let mut response =
                    Response::new(http_body_util::Full::new(Bytes::from_static(b"{\"id\":1}")));
                *response.status_mut() = StatusCode::CREATED;
                Ok::<_, std::convert::Infallible>(response)
            }
        })
    };
    let layer = IdempotencyLayer::new(
        store.clone(),
        "POST /orders v1",
        JsonFingerprinter::new("v1"),
    )
    .wait(Duration::from_secs(30));
    let service = layer.layer(handler);
    let send = |body: &'static str| {
        let mut service = service.clone();
        tokio::spawn(async move { answer(service.call(post(body)).await.unwrap()).await })
    };
    let leader = send(r#"{"a":1}"#);
    started.notified().await;
    let duplicates: Vec<_> = (0..49).map(|_| send(r#"{ "a": 1 }"#)).collect();
    let other = send(r#"{"a":2}"#);
    let (scope, key) = (
        Scope::new(TenantId::new("t"), "POST /orders v1"),
        IdempotencyKey::parse(b"hot").unwrap(),
    );
    // Wait (bounded) until all 50 wait behind the leader in this process.
    let in_flight = layer.setup.shared.in_flight.clone();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while in_flight.waiting(&scope, &key) < 50 {
        assert!(
            std::time::Instant::now() < deadline,
            "the duplicates never lined up"
        );
        tokio::task::yield_now().await;
    }
    release.notify_one();
    let (status, replayed, first) = leader.await.unwrap();
    assert_eq!((status, replayed), (StatusCode::CREATED, false));
    for duplicate in duplicates {
        let (status, replayed, body) = duplicate.await.unwrap();
        assert_eq!((status, replayed), (StatusCode::CREATED, true));
        assert_eq!(body, first, "the leader's bytes");
    }
    let (status, _, _) = other.await.unwrap();
    assert_eq!(
        status,
        StatusCode::CONFLICT,
        "a different request is refused from memory too"
    );
    assert_eq!(store.claims.load(Ordering::SeqCst), 1, "one claim");
    assert_eq!(store.completions.load(Ordering::SeqCst), 1);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(store.inner.rows("orders").len(), 1);
}

/// A TTL beyond what the cache crate takes (it panics above 1000
/// years) is clamped like the other durations; the cache still answers
/// the retry.
#[tokio::test]
async fn replay_cache_with_the_longest_ttl_serves_replays() {
    let store = Counting::default();
    let layer = IdempotencyLayer::new(
        store.clone(),
        "POST /orders v1",
        JsonFingerprinter::new("v1"),
    )
    .replay_cache(ReplayCache::default().ttl(Duration::MAX));
    let mut service = layer.layer(tower::service_fn(
        |request: Request<RequestBody>| async move {
            let tx = request.extensions().get::<MemoryTx>().cloned().unwrap();
            tx.insert("orders", serde_json::json!({"id": 1})).unwrap();
            let mut response =
                Response::new(http_body_util::Full::new(Bytes::from_static(b"{\"id\":1}")));
            *response.status_mut() = StatusCode::CREATED;
            Ok::<_, std::convert::Infallible>(response)
        },
    ));
    let mut answers = Vec::new();
    for _ in 0..2 {
        answers.push(answer(service.call(post(r#"{"a":1}"#)).await.unwrap()).await);
    }
    assert_eq!((answers[0].0, answers[0].1), (StatusCode::CREATED, false));
    assert_eq!((answers[1].0, answers[1].1), (StatusCode::CREATED, true));
    assert_eq!(answers[1].2, answers[0].2, "the first answer's bytes");
    assert_eq!(
        store.claims.load(Ordering::SeqCst),
        1,
        "the retry came from the cache"
    );
    assert_eq!(store.inner.rows("orders").len(), 1);
}

/// A fingerprinter that counts its calls and says whether it reads the
/// body alone.
#[derive(Clone)]
struct CountingFingerprints {
    inner: JsonFingerprinter,
    calls: Arc<AtomicUsize>,
    body_only: bool,
}

impl crate::fingerprint::Fingerprinter for CountingFingerprints {
    fn fingerprint(
        &self,
        parts: &mut http::request::Parts,
        body: &Bytes,
    ) -> Result<crate::fingerprint::Fingerprint, crate::problem::Problem> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.fingerprint(parts, body)
    }
    fn depends_on_body_only(&self) -> bool {
        self.body_only
    }
}

/// With a fingerprinter that reads the body alone, a retry repeating the
/// first request byte for byte is answered from the cache without being
/// fingerprinted; a retry with the members in another order is
/// fingerprinted and replayed; another body, or the same body to another
/// target, is fingerprinted and refused. A fingerprinter that does not say
/// so is asked every time.
#[tokio::test]
async fn a_byte_identical_retry_is_answered_from_the_cache_without_a_fingerprint() {
    for body_only in [true, false] {
        let store = Counting::default();
        let calls = Arc::new(AtomicUsize::new(0));
        let fingerprints = CountingFingerprints {
            inner: JsonFingerprinter::new("v1"),
            calls: calls.clone(),
            body_only,
        };
        let layer = IdempotencyLayer::new(store.clone(), "POST /orders v1", fingerprints);
        let mut service = layer.layer(tower::service_fn(
            |request: Request<RequestBody>| async move {
                let tx = request.extensions().get::<MemoryTx>().cloned().unwrap();
                tx.insert("orders", serde_json::json!({"id": 1})).unwrap();
                let mut response =
                    Response::new(http_body_util::Full::new(Bytes::from_static(b"{\"id\":1}")));
                *response.status_mut() = StatusCode::CREATED;
                Ok::<_, std::convert::Infallible>(response)
            },
        ));
        let first = answer(service.call(post(r#"{"a":1,"b":2}"#)).await.unwrap()).await;
        assert_eq!((first.0, first.1), (StatusCode::CREATED, false));
        assert_eq!(calls.load(Ordering::SeqCst), 1);

        let repeated = answer(service.call(post(r#"{"a":1,"b":2}"#)).await.unwrap()).await;
        assert_eq!((repeated.0, repeated.1), (StatusCode::CREATED, true));
        assert_eq!(repeated.2, first.2, "the first answer's bytes");
        let expected = if body_only { 1 } else { 2 };
        assert_eq!(
            calls.load(Ordering::SeqCst),
            expected,
            "body only: {body_only}"
        );

        let reordered = answer(service.call(post(r#"{"b":2, "a":1}"#)).await.unwrap()).await;
        assert_eq!((reordered.0, reordered.1), (StatusCode::CREATED, true));
        assert_eq!(calls.load(Ordering::SeqCst), expected + 1, "fingerprinted");

        let other = answer(service.call(post(r#"{"a":1,"b":3}"#)).await.unwrap()).await;
        assert_eq!(other.0, StatusCode::CONFLICT);
        let mut elsewhere = post(r#"{"a":1,"b":2}"#);
        *elsewhere.uri_mut() = "/orders?copy=1".parse().unwrap();
        let elsewhere = answer(service.call(elsewhere).await.unwrap()).await;
        assert_eq!(elsewhere.0, StatusCode::CONFLICT, "another target");
        assert_eq!(calls.load(Ordering::SeqCst), expected + 3);

        assert_eq!(
            store.claims.load(Ordering::SeqCst),
            1,
            "one claim: the rest from the cache"
        );
        assert_eq!(store.inner.rows("orders").len(), 1);
    }
}

/// With a problem type base, the layer's own error answers name their
/// `type` under it and link it (`rel="describedby"`); a key reused with
/// another body, a missing key and a fingerprinter's refusal alike. No
/// claim is made for the refused ones.
#[tokio::test]
async fn a_problem_type_base_names_and_links_the_layers_own_problems() {
    let store = Counting::default();
    let layer = IdempotencyLayer::new(
        store.clone(),
        "POST /orders v1",
        JsonFingerprinter::new("v1"),
    )
    .problem_type_base("https://docs.example.com/errors/");
    let mut service = layer.layer(tower::service_fn(|_: Request<RequestBody>| async move {
        Ok::<_, std::convert::Infallible>(Response::new(http_body_util::Full::new(
            Bytes::from_static(b"{}"),
        )))
    }));
    let mut missing = post(r#"{"a":1}"#);
    missing.headers_mut().remove("idempotency-key");
    let cases = [
        (missing, StatusCode::BAD_REQUEST, "idempotency_key_missing"),
        (
            post("{nope"),
            StatusCode::UNPROCESSABLE_ENTITY,
            "validation_failed",
        ),
    ];
    for (request, status, code) in cases {
        let response = service.call(request).await.unwrap();
        let link = response.headers()[http::header::LINK].clone();
        let (got, _, body) = answer(response).await;
        assert_eq!(got, status);
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let uri = format!("https://docs.example.com/errors/{code}");
        assert_eq!(body["type"], uri.as_str());
        assert_eq!(link, format!("<{uri}>; rel=\"describedby\"").as_str());
    }
    assert_eq!(store.claims.load(Ordering::SeqCst), 0);
    let first = service.call(post(r#"{"a":1}"#)).await.unwrap();
    assert!(
        !first.headers().contains_key(http::header::LINK),
        "not an error"
    );
    let reused = service.call(post(r#"{"a":2}"#)).await.unwrap();
    assert!(reused.headers()[http::header::LINK]
        .to_str()
        .unwrap()
        .contains("/errors/idempotency_key_reused>"));
}

#[test]
fn limits_are_clamped_to_what_the_database_takes() {
    let layer = IdempotencyLayer::new(MemoryStore::new(), "e", JsonFingerprinter::new("v1"))
        .request_body_limit(usize::MAX)
        .response_body_limit(usize::MAX)
        .handler_timeout(Duration::MAX)
        .wait(Duration::MAX);
    assert_eq!(layer.setup.config.request_body_limit, MAX_BODY);
    assert_eq!(layer.setup.config.response_body_limit, MAX_BODY);
    assert_eq!(layer.setup.config.handler_timeout, MAX_WAIT);
    assert_eq!(layer.setup.config.wait, MAX_WAIT);
}

/// A retention shorter than the claim-first mode's work is raised to cover
/// it, and said once, with both values, when the layer makes its first
/// service (not again for the next ones, nor for a clone's); the one-commit
/// mode keeps it as configured and says nothing.
#[test]
fn a_raised_retention_is_said_once_and_exposed() {
    use std::time::Duration;
    let layer = IdempotencyLayer::new(
        MemoryStore::new(),
        "POST /orders v1",
        JsonFingerprinter::new("orders.v1"),
    )
    .handler_timeout(Duration::from_secs(2))
    .retention(Duration::from_secs(3));
    assert_eq!(layer.effective_retention(), Duration::from_secs(7));
    let log = crate::test_log::logged(async {
        let inner = tower::service_fn(|_: Request<RequestBody>| async {
            Ok::<_, std::convert::Infallible>(Response::new(
                http_body_util::Full::new(Bytes::new()),
            ))
        });
        let _first = layer.layer(inner);
        let _second = layer.clone().layer(inner);
        // A clone configured to another floor says its own, once.
        let longer = layer.clone().handler_timeout(Duration::from_secs(4));
        let _third = longer.layer(inner);
        let _fourth = longer.layer(inner);
    });
    assert_eq!(log.matches("WARN").count(), 2, "{log}");
    assert!(log.contains("effective_retention=9s"), "{log}");
    assert!(
        log.contains("configured_retention=3s") && log.contains("effective_retention=7s"),
        "{log}"
    );
    let at_commit = IdempotencyLayer::new(
        MemoryStore::new(),
        "POST /orders v1",
        JsonFingerprinter::new("orders.v1"),
    )
    .handler_timeout(Duration::from_secs(2))
    .retention(Duration::from_secs(3))
    .claim_at_commit();
    assert_eq!(at_commit.effective_retention(), Duration::from_secs(3));
    let log = crate::test_log::logged(async {
        let inner = tower::service_fn(|_: Request<RequestBody>| async {
            Ok::<_, std::convert::Infallible>(Response::new(
                http_body_util::Full::new(Bytes::new()),
            ))
        });
        let _service = at_commit.layer(inner);
    });
    assert!(!log.contains("WARN"), "{log}");
}

/// A store that counts claims and remembers responses without their
/// bodies, so that what a test measures of the process is the layer's
/// memory, not a copy the store keeps. A replay it answered would come back
/// empty.
#[derive(Clone, Default)]
struct Bodiless {
    inner: MemoryStore,
    claims: Arc<AtomicUsize>,
}

impl Store for Bodiless {
    type Tx = MemoryTx;
    async fn claim(&self, request: &ClaimRequest) -> Result<Claim<MemoryTx>, StoreError> {
        self.claims.fetch_add(1, Ordering::SeqCst);
        self.inner.claim(request).await
    }
    async fn complete(&self, tx: MemoryTx, response: &StoredResponse) -> Result<(), StoreError> {
        let mut bodiless = response.clone();
        bodiless.body = Bytes::new();
        self.inner.complete(tx, &bodiless).await
    }
    async fn abort(&self, tx: MemoryTx) -> Result<(), StoreError> {
        self.inner.abort(tx).await
    }
}

/// The process's resident memory, in bytes (Linux; 0 elsewhere).
fn resident_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|statm| statm.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

const MIB: u64 = 1024 * 1024;

/// 1,000 creates whose answers are 512 KiB each, every one its own buffer
/// (as a serialised document is), through a layer with the default cache:
/// the cache holds at most its byte budget, the process grows by about
/// that and not by the 500 MiB answered, and a recent key still replays
/// from memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_replay_cache_holds_at_most_its_byte_budget() {
    const ANSWER: usize = 512 * 1024;
    const BUDGET: u64 = ReplayCache::DEFAULT_MAX_BYTES;
    let store = Bodiless::default();
    let layer = IdempotencyLayer::new(
        store.clone(),
        "POST /orders v1",
        JsonFingerprinter::new("v1"),
    );
    let mut service = layer.layer(tower::service_fn(|_: Request<RequestBody>| async {
        // Not zeroed: a zeroed buffer's pages are not resident until written.
        let body = Bytes::from(vec![b'x'; ANSWER]);
        let mut response = Response::new(http_body_util::Full::new(body));
        *response.status_mut() = StatusCode::CREATED;
        Ok::<_, std::convert::Infallible>(response)
    }));
    let create = |key: String| {
        let mut request = Request::post("/orders")
            .header("idempotency-key", key)
            .body(http_body_util::Full::new(Bytes::from_static(b"{\"a\":1}")))
            .unwrap();
        request.extensions_mut().insert(TenantId::new("t"));
        request
    };
    let before = resident_bytes();
    for i in 0..1000 {
        let (status, replayed, body) =
            answer(service.call(create(format!("k{i}"))).await.unwrap()).await;
        assert_eq!(
            (status, replayed, body.len()),
            (StatusCode::CREATED, false, ANSWER)
        );
    }
    let grown = resident_bytes().saturating_sub(before);
    let cache = layer.setup.shared.cache.as_ref().expect("on by default");
    let (held, weight) = (cache.held_bytes(), cache.weight());
    eprintln!(
        "replay cache: {} entries, {} MiB of bodies, {} MiB weighed; process grew {} MiB",
        cache.len(),
        held / MIB,
        weight / MIB,
        grown / MIB
    );
    assert!(held <= weight, "the weight counts every body byte");
    assert!(
        weight <= BUDGET,
        "the cache holds {weight} bytes, over its budget of {BUDGET}"
    );
    assert!(
        grown <= BUDGET + 64 * MIB,
        "the process grew by {} MiB",
        grown / MIB
    );

    let claims = store.claims.load(Ordering::SeqCst);
    let (status, replayed, body) = answer(service.call(create("k999".into())).await.unwrap()).await;
    assert_eq!(
        (status, replayed, body.len()),
        (StatusCode::CREATED, true, ANSWER)
    );
    assert_eq!(
        store.claims.load(Ordering::SeqCst),
        claims,
        "a replay of a recent key comes from memory"
    );
}
