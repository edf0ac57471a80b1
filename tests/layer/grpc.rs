//! gRPC through the layer, on PgStore: trailers (gRPC ends every unary
//! answer with `grpc-status`) passed on with the first answer, remembered
//! with the response in the same transaction and replayed from the replay
//! cache and from the database, in both modes of a short transaction;
//! `grpc-status` deciding what is remembered, by default for an answer
//! whose content type is gRPC; the layer's own answers as
//! gRPC statuses; the key read from the message (AIP-155's `request_id`).

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc,
};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{Layer, ServiceExt};
use tower_idempotency::RequestBody;

use crate::common::*;

/// What a client reads of an answer: status, headers, body and trailers.
struct Read {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
    trailers: Option<HeaderMap>,
}

fn grpc_trailers() -> HeaderMap {
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    trailers.insert("grpc-message", HeaderValue::from_static("created"));
    trailers
}

type Body = http_body_util::combinators::BoxBody<Bytes, BoxError>;

/// A handler that writes an order through the layer's transaction and
/// answers 200 with a gRPC-framed message and gRPC's trailers; counts its
/// runs.
fn grpc_like(
    calls: Arc<AtomicU64>,
) -> tower::util::BoxCloneService<Request<RequestBody>, Response<Body>, BoxError> {
    tower::util::BoxCloneService::new(tower::service_fn(move |request: Request<RequestBody>| {
        let calls = calls.clone();
        async move {
            let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
            let tx = tx_of::<Postgres>(&request).expect("the layer's transaction");
            Postgres::insert_order(&tx, &format!("order-{n}"), "tenant-a").await?;
            let message = Bytes::from_static(b"\0\0\0\0\x07created");
            let trailers = grpc_trailers();
            let body = Full::new(message)
                .map_err(|never| match never {})
                .with_trailers(async move { Some(Ok(trailers)) })
                .boxed();
            let mut response = Response::new(body);
            response
                .headers_mut()
                .insert("content-type", HeaderValue::from_static("application/grpc"));
            Ok::<_, BoxError>(response)
        }
    }))
}

async fn read<S, B>(service: S, request: Request<Full<Bytes>>) -> Read
where
    S: tower::Service<Request<Full<Bytes>>, Response = Response<B>>,
    S::Error: std::fmt::Debug,
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let response = service.oneshot(request).await.expect("answers");
    let (parts, body) = response.into_parts();
    let collected = body.collect().await.expect("body");
    Read {
        status: parts.status,
        headers: parts.headers,
        trailers: collected.trailers().cloned(),
        body: collected.to_bytes(),
    }
}

async fn remembered_block(pg: &Postgres, key: &str) -> Vec<u8> {
    pg.client
        .query_one(
            "SELECT response_headers FROM idempotency_requests WHERE idempotency_key = $1",
            &[&key],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trailers_are_passed_on_remembered_and_replayed_claim_first() {
    let pg = Postgres::new().await;
    let calls = Arc::new(AtomicU64::new(0));
    let first_process = layer(pg.store.clone()).layer(grpc_like(calls.clone()));

    let first = read(first_process.clone(), tenant_a_post("k1")).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(first.body, Bytes::from_static(b"\0\0\0\0\x07created"));
    assert_eq!(first.trailers, Some(grpc_trailers()), "the first answer");

    // Remembered in the same row as the response, after the headers.
    let block = remembered_block(&pg, "k1").await;
    assert!(
        block.ends_with(b"\r\n\r\ngrpc-status: 0\r\ngrpc-message: created\r\n"),
        "{:?}",
        String::from_utf8_lossy(&block)
    );

    // From this process's replay cache, and from the database.
    let cached = read(first_process, tenant_a_post("k1")).await;
    let other_process = layer(pg.store.clone())
        .without_replay_cache()
        .layer(grpc_like(calls.clone()));
    let stored = read(other_process, tenant_a_post("k1")).await;
    for replay in [&cached, &stored] {
        assert_eq!(replay.status, StatusCode::OK);
        assert_eq!(replay.headers["idempotent-replayed"], "true");
        assert_eq!(replay.headers["content-type"], "application/grpc");
        assert_eq!(replay.body, first.body);
        assert_eq!(replay.trailers, Some(grpc_trailers()));
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler ran once");
    assert_eq!(pg.orders().await.len(), 1, "one order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trailers_are_passed_on_remembered_and_replayed_one_commit() {
    let pg = Postgres::new().await;
    let calls = Arc::new(AtomicU64::new(0));
    let service = layer(pg.store.clone())
        .claim_at_commit()
        .without_replay_cache()
        .layer(grpc_like(calls.clone()));

    let first = read(service.clone(), tenant_a_post("k1")).await;
    assert_eq!(first.trailers, Some(grpc_trailers()), "the first answer");
    let block = remembered_block(&pg, "k1").await;
    assert!(block.ends_with(b"\r\n\r\ngrpc-status: 0\r\ngrpc-message: created\r\n"));

    let replay = read(service, tenant_a_post("k1")).await;
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.trailers, Some(grpc_trailers()));
    // The one-commit mode runs the handler again and loses at commit.
    assert_eq!(pg.orders().await.len(), 1, "one order");
}

/// A response without trailers is remembered as before: no empty line, no
/// trailers frame on the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_without_trailers_replays_without_them() {
    let pg = Postgres::new().await;
    let handler = order_handler::<Postgres>(Default::default());
    let service = layer(pg.store.clone())
        .without_replay_cache()
        .layer(handler);
    let first = read(service.clone(), tenant_a_post("k1")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.trailers, None);
    let block = remembered_block(&pg, "k1").await;
    assert!(!block.windows(4).any(|w| w == b"\r\n\r\n"));
    let replay = read(service, tenant_a_post("k1")).await;
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert_eq!(replay.trailers, None);
}

/// A handler answering as a gRPC service does: an order written, then an
/// `application/grpc` answer with the status `codes[n]` for its `n`th call,
/// in the trailers or (`in_head`) in the headers of a trailers-only answer;
/// `final_codes` marked `FinalResponse`.
fn grpc_service(
    calls: Arc<AtomicU64>,
    codes: &'static [&'static str],
    in_head: bool,
    final_codes: &'static [&'static str],
) -> tower::util::BoxCloneService<Request<RequestBody>, Response<Body>, BoxError> {
    answering::<Postgres>(calls, "application/grpc", codes, in_head, final_codes)
}

/// [`grpc_service`] on any backend, with the answer's `content_type`.
fn answering<B: Backend>(
    calls: Arc<AtomicU64>,
    content_type: &'static str,
    codes: &'static [&'static str],
    in_head: bool,
    final_codes: &'static [&'static str],
) -> tower::util::BoxCloneService<Request<RequestBody>, Response<Body>, BoxError> {
    tower::util::BoxCloneService::new(tower::service_fn(move |request: Request<RequestBody>| {
        let calls = calls.clone();
        async move {
            let n = calls.fetch_add(1, Ordering::SeqCst) as usize;
            let code = codes[n.min(codes.len() - 1)];
            let tx = tx_of::<B>(&request).expect("the layer's transaction");
            B::insert_order(&tx, &format!("order-{n}"), "tenant-a").await?;
            let mut trailers = HeaderMap::new();
            trailers.insert("grpc-status", HeaderValue::from_static(code));
            let mut response = if in_head {
                let mut response = Response::new(
                    Full::new(Bytes::new())
                        .map_err(|never| match never {})
                        .boxed(),
                );
                response.headers_mut().extend(trailers);
                response
            } else {
                Response::new(
                    Full::new(Bytes::from_static(b"\0\0\0\0\x00"))
                        .map_err(|never| match never {})
                        .with_trailers(async move { Some(Ok(trailers)) })
                        .boxed(),
                )
            };
            response
                .headers_mut()
                .insert("content-type", HeaderValue::from_static(content_type));
            if final_codes.contains(&code) {
                response
                    .extensions_mut()
                    .insert(tower_idempotency::record::FinalResponse);
            }
            Ok::<_, BoxError>(response)
        }
    }))
}

async fn key_rows(pg: &Postgres, key: &str) -> i64 {
    pg.client
        .query_one(
            "SELECT count(*) FROM idempotency_requests WHERE idempotency_key = $1",
            &[&key],
        )
        .await
        .unwrap()
        .get(0)
}

/// With gRPC's rule, a non-OK `grpc-status` (in the trailers, or in the
/// headers of a trailers-only answer) rolls the handler's writes back and
/// frees the key; the client still gets the answer with its status; the
/// retry runs again and its OK is remembered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_error_rolls_back_and_the_retry_runs_again() {
    for in_head in [false, true] {
        let pg = Postgres::new().await;
        let calls = Arc::new(AtomicU64::new(0));
        let service = layer(pg.store.clone())
            .classify(tower_idempotency::classify::GrpcErrorsAsFailures)
            .layer(grpc_service(calls.clone(), &["14", "0"], in_head, &[]));

        let failed = read(service.clone(), tenant_a_post("k1")).await;
        assert_eq!(failed.status, StatusCode::OK);
        let status = match &failed.trailers {
            Some(trailers) => trailers["grpc-status"].clone(),
            None => failed.headers["grpc-status"].clone(),
        };
        assert_eq!(
            status, "14",
            "UNAVAILABLE reaches the client (in_head {in_head})"
        );
        assert_eq!(
            pg.orders().await.len(),
            0,
            "rolled back (in_head {in_head})"
        );
        assert_eq!(key_rows(&pg, "k1").await, 0, "the key is free");

        let retried = read(service.clone(), tenant_a_post("k1")).await;
        assert!(!retried.headers.contains_key("idempotent-replayed"));
        assert_eq!(pg.orders().await.len(), 1, "the retry's order");
        assert_eq!(key_rows(&pg, "k1").await, 1);
        let replay = read(service, tenant_a_post("k1")).await;
        assert_eq!(replay.headers["idempotent-replayed"], "true");
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }
}

/// A deterministic rejection marked `FinalResponse` is remembered: its
/// writes commit and every retry gets it back; without the mark, the same
/// code rolls back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_rejection_marked_final_is_remembered() {
    let pg = Postgres::new().await;
    let calls = Arc::new(AtomicU64::new(0));
    let service = layer(pg.store.clone())
        .classify(tower_idempotency::classify::GrpcErrorsAsFailures)
        .without_replay_cache()
        .layer(grpc_service(calls.clone(), &["3"], true, &["3"]));
    let first = read(service.clone(), tenant_a_post("k1")).await;
    assert_eq!(first.headers["grpc-status"], "3");
    let replay = read(service, tenant_a_post("k1")).await;
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert_eq!(
        replay.headers["grpc-status"], "3",
        "remembered from the head"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(key_rows(&pg, "k1").await, 1);
}

/// The `grpc-status` a client reads: in the trailers, or in the headers of
/// a trailers-only answer.
fn grpc_status_of(read: &Read) -> HeaderValue {
    match &read.trailers {
        Some(trailers) => trailers["grpc-status"].clone(),
        None => read.headers["grpc-status"].clone(),
    }
}

/// With no classifier chosen, an answer whose content type says gRPC is
/// judged by its `grpc-status`: an `UNAVAILABLE` in the trailers, or in the
/// headers of a trailers-only answer, commits none of the handler's writes
/// and remembers nothing, and the retry runs the handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_a_grpc_error_commits_nothing_and_the_retry_runs_again() {
    let cases = [
        ("application/grpc", false),
        ("application/grpc", true),
        ("application/grpc+proto", false),
    ];
    for (content_type, in_head) in cases {
        let case = format!("{content_type}, in_head {in_head}");
        let pg = Postgres::new().await;
        let calls = Arc::new(AtomicU64::new(0));
        let service = layer(pg.store.clone()).layer(answering::<Postgres>(
            calls.clone(),
            content_type,
            &["14", "0"],
            in_head,
            &[],
        ));

        let failed = read(service.clone(), tenant_a_post("k1")).await;
        assert_eq!(failed.status, StatusCode::OK);
        assert_eq!(
            grpc_status_of(&failed),
            "14",
            "UNAVAILABLE reaches the client ({case})"
        );
        assert_eq!(pg.orders().await.len(), 0, "nothing committed ({case})");
        assert_eq!(key_rows(&pg, "k1").await, 0, "nothing remembered ({case})");

        let retried = read(service.clone(), tenant_a_post("k1")).await;
        assert!(
            !retried.headers.contains_key("idempotent-replayed"),
            "{case}"
        );
        assert_eq!(grpc_status_of(&retried), "0", "{case}");
        assert_eq!(
            calls.load(Ordering::SeqCst),
            2,
            "the retry ran the handler ({case})"
        );
        assert_eq!(pg.orders().await.len(), 1, "the retry's order ({case})");
        assert_eq!(key_rows(&pg, "k1").await, 1, "{case}");
    }
}

/// The same default on the in-memory store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_a_grpc_error_commits_nothing_in_memory_either() {
    for in_head in [false, true] {
        let memory = Memory::new().await;
        let calls = Arc::new(AtomicU64::new(0));
        let service = layer(memory.store()).layer(answering::<Memory>(
            calls.clone(),
            "application/grpc",
            &["14", "0"],
            in_head,
            &[],
        ));

        let failed = read(service.clone(), tenant_a_post("k1")).await;
        assert_eq!(grpc_status_of(&failed), "14", "in_head {in_head}");
        assert_eq!(
            memory.orders().await.len(),
            0,
            "nothing committed (in_head {in_head})"
        );
        assert_eq!(
            memory.remembered().await,
            0,
            "nothing remembered (in_head {in_head})"
        );

        let retried = read(service, tenant_a_post("k1")).await;
        assert!(!retried.headers.contains_key("idempotent-replayed"));
        assert_eq!(
            calls.load(Ordering::SeqCst),
            2,
            "the retry ran the handler (in_head {in_head})"
        );
        assert_eq!(memory.orders().await.len(), 1);
        assert_eq!(memory.remembered().await, 1);
    }
}

/// With no classifier chosen, a gRPC `OK` (in the trailers or in a
/// trailers-only head) commits with its writes and is replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_a_grpc_ok_commits_and_is_replayed() {
    for in_head in [false, true] {
        let pg = Postgres::new().await;
        let calls = Arc::new(AtomicU64::new(0));
        let service = layer(pg.store.clone())
            .without_replay_cache()
            .layer(grpc_service(calls.clone(), &["0"], in_head, &[]));

        let first = read(service.clone(), tenant_a_post("k1")).await;
        assert_eq!(grpc_status_of(&first), "0");
        assert_eq!(pg.orders().await.len(), 1, "committed (in_head {in_head})");
        assert_eq!(
            key_rows(&pg, "k1").await,
            1,
            "remembered (in_head {in_head})"
        );

        let replay = read(service, tenant_a_post("k1")).await;
        assert_eq!(replay.headers["idempotent-replayed"], "true");
        assert_eq!(grpc_status_of(&replay), "0");
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "replayed (in_head {in_head})"
        );
        assert_eq!(pg.orders().await.len(), 1);
    }
}

/// With no classifier chosen, an answer that is not gRPC is judged by
/// HTTP's rule: a 200 is remembered, whatever `grpc-status` it carries (the
/// content type decides, not the header).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_a_non_grpc_200_is_remembered() {
    for in_head in [false, true] {
        let pg = Postgres::new().await;
        let calls = Arc::new(AtomicU64::new(0));
        let service = layer(pg.store.clone())
            .without_replay_cache()
            .layer(answering::<Postgres>(
                calls.clone(),
                "application/json",
                &["14"],
                in_head,
                &[],
            ));

        let first = read(service.clone(), tenant_a_post("k1")).await;
        assert_eq!(first.status, StatusCode::OK);
        assert_eq!(pg.orders().await.len(), 1, "committed (in_head {in_head})");
        assert_eq!(
            key_rows(&pg, "k1").await,
            1,
            "remembered (in_head {in_head})"
        );
        let replay = read(service, tenant_a_post("k1")).await;
        assert_eq!(replay.headers["idempotent-replayed"], "true");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }
}

/// An explicit choice wins over the default: `classify(ServerErrorsAsFailures)`
/// judges a gRPC answer by HTTP's rule too, so its `UNAVAILABLE` (HTTP 200)
/// is remembered with its writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_explicit_http_rule_applies_to_grpc_answers_too() {
    let pg = Postgres::new().await;
    let calls = Arc::new(AtomicU64::new(0));
    let service = layer(pg.store.clone())
        .classify(tower_idempotency::classify::ServerErrorsAsFailures)
        .without_replay_cache()
        .layer(grpc_service(calls.clone(), &["14"], false, &[]));

    let first = read(service.clone(), tenant_a_post("k1")).await;
    assert_eq!(grpc_status_of(&first), "14");
    assert_eq!(pg.orders().await.len(), 1, "committed");
    assert_eq!(key_rows(&pg, "k1").await, 1, "remembered");
    let replay = read(service, tenant_a_post("k1")).await;
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert_eq!(grpc_status_of(&replay), "14");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A request as a gRPC client sends it (the message here is JSON for the
/// test's fingerprinter; the layer reads only the content type).
fn grpc_post(key: Option<&str>, body: &str) -> Request<Full<Bytes>> {
    let mut request = post(Some("tenant-a"), key, body);
    request.headers_mut().insert(
        "content-type",
        HeaderValue::from_static("application/grpc+proto"),
    );
    request
}

/// The layer's own answers to a gRPC request are gRPC statuses in a
/// trailers-only answer, never a problem+json body: a missing key
/// `INVALID_ARGUMENT`, a reused key `FAILED_PRECONDITION`, a key still in
/// progress `ABORTED` with the retry pushback where HTTP says
/// `Retry-After`. Nothing is written for any of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layers_own_answers_to_a_grpc_request_are_grpc_statuses() {
    let pg = Postgres::new().await;
    let calls = Arc::new(AtomicU64::new(0));
    let service = layer(pg.store.clone())
        .classify(tower_idempotency::classify::GrpcErrorsAsFailures)
        .layer(grpc_service(calls.clone(), &["0"], false, &[]));

    let grpc_status = |read: &Read| {
        assert_eq!(read.status, StatusCode::OK);
        assert_eq!(read.headers["content-type"], "application/grpc");
        assert!(read.body.is_empty(), "trailers-only");
        read.headers["grpc-status"].to_str().unwrap().to_owned()
    };
    let missing = read(service.clone(), grpc_post(None, BODY)).await;
    assert_eq!(grpc_status(&missing), "3", "INVALID_ARGUMENT");
    assert!(missing.headers["grpc-message"]
        .to_str()
        .unwrap()
        .contains("dempotency"));

    let created = read(service.clone(), grpc_post(Some("k1"), BODY)).await;
    assert_eq!(created.trailers.unwrap()["grpc-status"], "0");
    let reused = read(
        service.clone(),
        grpc_post(Some("k1"), r#"{"checkout_id":"other","amount":1}"#),
    )
    .await;
    assert_eq!(grpc_status(&reused), "9", "FAILED_PRECONDITION");

    // A key still in progress: a second process with a short wait.
    let (started, release) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let holder = layer(pg.store.clone()).layer(gated::<Postgres>(started.clone(), release.clone()));
    let held = tokio::spawn(read(holder, grpc_post(Some("k2"), BODY)));
    started.notified().await;
    let impatient = layer(pg.store.clone())
        .wait(std::time::Duration::from_millis(200))
        .layer(grpc_service(calls.clone(), &["0"], false, &[]));
    let busy = read(impatient, grpc_post(Some("k2"), BODY)).await;
    assert_eq!(grpc_status(&busy), "10", "ABORTED");
    assert_eq!(busy.headers["grpc-retry-pushback-ms"], "1000");
    release.notify_one();
    held.await.unwrap();

    // An HTTP request to the same layer still gets problem+json.
    let http_missing = read(service, post(Some("tenant-a"), None, BODY)).await;
    assert_eq!(
        http_missing.headers["content-type"],
        "application/problem+json"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1, "only the created one ran");
}

/// A gRPC-framed message: the flag byte, the length, the message (JSON
/// here, standing in for protobuf).
fn framed(message: &str) -> String {
    let mut body = vec![0u8];
    body.extend_from_slice(&(message.len() as u32).to_be_bytes());
    body.extend_from_slice(message.as_bytes());
    String::from_utf8(body).unwrap()
}

/// AIP-155: the key is the message's `request_id`; the fingerprint is the
/// message without it (a retry carries the same id and the same message).
fn request_id(_: &http::request::Parts, body: &Bytes) -> Result<Option<String>, String> {
    let message = tower_idempotency::key::grpc_message(body).ok_or("not one gRPC frame")?;
    let value: serde_json::Value = serde_json::from_slice(message).map_err(|e| e.to_string())?;
    Ok(value["request_id"].as_str().map(str::to_owned))
}

fn message_fingerprint(
    _: &mut http::request::Parts,
    body: &Bytes,
) -> Result<tower_idempotency::fingerprint::Fingerprint, tower_idempotency::problem::Problem> {
    let message = tower_idempotency::key::grpc_message(body).unwrap_or(body);
    Ok(tower_idempotency::fingerprint::Fingerprint::digest(
        "orders.v1",
        message,
    ))
}

/// The key read from the message's `request_id` when no metadata carries
/// one: the retry with the same id replays; the same id with another
/// message is a reused key; a message without an id is refused as a
/// missing key; the header wins over the message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_is_read_from_the_message_when_the_metadata_has_none() {
    let pg = Postgres::new().await;
    let calls = Arc::new(AtomicU64::new(0));
    let service = tower_idempotency::IdempotencyLayer::new(
        pg.store.clone(),
        "orders.v1.Orders/CreateOrder",
        message_fingerprint,
    )
    .classify(tower_idempotency::classify::GrpcErrorsAsFailures)
    .key_from_body(request_id)
    .layer(grpc_service(calls.clone(), &["0"], false, &[]));

    let message = framed(r#"{"request_id":"rid-1","checkout_id":"chk_1"}"#);
    let first = read(service.clone(), grpc_post(None, &message)).await;
    assert_eq!(first.trailers.unwrap()["grpc-status"], "0");
    let retry = read(service.clone(), grpc_post(None, &message)).await;
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(key_rows(&pg, "rid-1").await, 1, "the request id is the key");

    let other = framed(r#"{"request_id":"rid-1","checkout_id":"chk_2"}"#);
    let reused = read(service.clone(), grpc_post(None, &other)).await;
    assert_eq!(reused.headers["grpc-status"], "9", "FAILED_PRECONDITION");

    let without = framed(r#"{"checkout_id":"chk_3"}"#);
    let missing = read(service.clone(), grpc_post(None, &without)).await;
    assert_eq!(missing.headers["grpc-status"], "3", "INVALID_ARGUMENT");
    let unframed = read(service.clone(), grpc_post(None, "{}")).await;
    assert_eq!(unframed.headers["grpc-status"], "3");
    assert!(unframed.headers["grpc-message"]
        .to_str()
        .unwrap()
        .contains("not one gRPC frame"));

    // Metadata wins over the message.
    let by_header = read(service, grpc_post(Some("meta-1"), &message)).await;
    assert!(!by_header.headers.contains_key("idempotent-replayed"));
    assert_eq!(key_rows(&pg, "meta-1").await, 1);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(pg.orders().await.len(), 2);
}

/// A gRPC request whose body is `body` as it is (a frame, compressed or
/// not), with `grpc-encoding: encoding` if given.
fn grpc_post_bytes(
    key: Option<&str>,
    body: Vec<u8>,
    encoding: Option<&str>,
) -> Request<Full<Bytes>> {
    let mut request = grpc_post(key, "");
    *request.body_mut() = Full::new(Bytes::from(body));
    if let Some(encoding) = encoding {
        request
            .headers_mut()
            .insert("grpc-encoding", HeaderValue::from_str(encoding).unwrap());
    }
    request
}

/// `message` in one frame whose flag byte is `flag`.
fn frame(flag: u8, message: &[u8]) -> Vec<u8> {
    let mut body = vec![flag];
    body.extend_from_slice(&(message.len() as u32).to_be_bytes());
    body.extend_from_slice(message);
    body
}

fn gzip(message: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(message).unwrap();
    encoder.finish().unwrap()
}

/// gRPC's `deflate`: the zlib format (RFC 1950), as tonic and gRPC core send it.
fn deflate(message: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut encoder = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::best());
    encoder.write_all(message).unwrap();
    encoder.finish().unwrap()
}

/// A gRPC handler that keeps the body it was handed, writes an order and
/// answers `OK`.
fn recording(
    bodies: Arc<std::sync::Mutex<Vec<Bytes>>>,
) -> tower::util::BoxCloneService<Request<RequestBody>, Response<Body>, BoxError> {
    tower::util::BoxCloneService::new(tower::service_fn(move |request: Request<RequestBody>| {
        let bodies = bodies.clone();
        async move {
            let tx = tx_of::<Postgres>(&request).expect("the layer's transaction");
            let n = bodies.lock().unwrap().len();
            Postgres::insert_order(&tx, &format!("order-{n}"), "tenant-a").await?;
            let body = request.into_body().collect().await?.to_bytes();
            bodies.lock().unwrap().push(body);
            let mut response = Response::new(
                Full::new(Bytes::from_static(b"\0\0\0\0\x00"))
                    .map_err(|never| match never {})
                    .with_trailers(async { Some(Ok(grpc_trailers())) })
                    .boxed(),
            );
            response
                .headers_mut()
                .insert("content-type", HeaderValue::from_static("application/grpc"));
            Ok::<_, BoxError>(response)
        }
    }))
}

/// The fingerprinter of [`aip155_layer`], as a nameable type.
type MessageFingerprint =
    fn(
        &mut http::request::Parts,
        &Bytes,
    )
        -> Result<tower_idempotency::fingerprint::Fingerprint, tower_idempotency::problem::Problem>;

/// A gRPC method's layer: the key from the message's `request_id`, the
/// fingerprint of the message's bytes.
fn aip155_layer(
    pg: &Postgres,
) -> tower_idempotency::IdempotencyLayer<tower_idempotency::postgres::PgStore, MessageFingerprint> {
    tower_idempotency::IdempotencyLayer::new(
        pg.store.clone(),
        "orders.v1.Orders/CreateOrder",
        message_fingerprint as MessageFingerprint,
    )
    .key_from_body(request_id)
}

/// The same message, uncompressed, gzip-compressed, deflate-compressed, or
/// uncompressed under a `grpc-encoding` header, is the same operation: the
/// key read from its `request_id` and the fingerprint of its bytes are the
/// same, so every retry replays the first answer. The handler is handed
/// the body as the client sent it, compressed or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compressed_message_is_the_same_operation_as_the_uncompressed_one() {
    let pg = Postgres::new().await;
    let bodies = Arc::new(std::sync::Mutex::new(Vec::new()));
    let service = aip155_layer(&pg).layer(recording(bodies.clone()));

    let message = br#"{"request_id":"rid-1","checkout_id":"chk_1"}"#;
    let first = read(
        service.clone(),
        grpc_post_bytes(None, frame(0, message), None),
    )
    .await;
    assert_eq!(first.trailers.unwrap()["grpc-status"], "0");
    assert!(!first.headers.contains_key("idempotent-replayed"));
    let retries = [
        ("gzip", frame(1, &gzip(message)), Some("gzip")),
        ("deflate", frame(1, &deflate(message)), Some("deflate")),
        (
            "GZIP, the name's case aside",
            frame(1, &gzip(message)),
            Some("GZIP"),
        ),
        (
            "uncompressed under grpc-encoding",
            frame(0, message),
            Some("gzip"),
        ),
        (
            "an unknown encoding, uncompressed",
            frame(0, message),
            Some("snappy"),
        ),
    ];
    for (case, body, encoding) in retries {
        let retry = read(service.clone(), grpc_post_bytes(None, body, encoding)).await;
        assert_eq!(retry.status, StatusCode::OK, "{case}");
        assert_eq!(retry.headers["idempotent-replayed"], "true", "{case}");
        assert_eq!(retry.trailers.unwrap()["grpc-status"], "0", "{case}");
    }
    assert_eq!(bodies.lock().unwrap().len(), 1, "the handler ran once");
    assert_eq!(pg.orders().await.len(), 1, "one order");
    assert_eq!(key_rows(&pg, "rid-1").await, 1);

    // Another message compressed: its own key and fingerprint (a new
    // operation, not a reuse of rid-1), and the handler reads the body the
    // client sent, compressed.
    let other = br#"{"request_id":"rid-2","checkout_id":"chk_2"}"#;
    let compressed = frame(1, &deflate(other));
    let created = read(
        service.clone(),
        grpc_post_bytes(None, compressed.clone(), Some("deflate")),
    )
    .await;
    assert_eq!(created.trailers.unwrap()["grpc-status"], "0");
    assert!(!created.headers.contains_key("idempotent-replayed"));
    assert_eq!(bodies.lock().unwrap()[1], Bytes::from(compressed));
    // The same request_id with another message, compressed: a reused key.
    let reused = framed_reuse(&service).await;
    assert_eq!(reused.headers["grpc-status"], "9", "FAILED_PRECONDITION");
    assert_eq!(pg.orders().await.len(), 2);
    assert_eq!(key_rows(&pg, "rid-2").await, 1);
    assert_eq!(
        pg.count("SELECT count(*) FROM idempotency_requests").await,
        2
    );
}

async fn framed_reuse<S, B>(service: &S) -> Read
where
    S: tower::Service<Request<Full<Bytes>>, Response = Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let message = br#"{"request_id":"rid-2","checkout_id":"chk_other"}"#;
    read(
        service.clone(),
        grpc_post_bytes(None, frame(1, &gzip(message)), Some("gzip")),
    )
    .await
}

/// A compressed message in an encoding the layer does not read is refused
/// as gRPC says, `UNIMPLEMENTED` with the encodings it reads in
/// `grpc-accept-encoding`, before a key is claimed; a compressed flag
/// without an encoding, or bytes that do not decompress, are an unreadable
/// message. The handler never runs and nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_encoding_is_unimplemented_and_nothing_is_written() {
    let pg = Postgres::new().await;
    let bodies = Arc::new(std::sync::Mutex::new(Vec::new()));
    let service = aip155_layer(&pg).layer(recording(bodies.clone()));
    let message = br#"{"request_id":"rid-1","checkout_id":"chk_1"}"#;

    let unknown = read(
        service.clone(),
        grpc_post_bytes(None, frame(1, &gzip(message)), Some("snappy")),
    )
    .await;
    assert_eq!(unknown.status, StatusCode::OK);
    assert_eq!(unknown.headers["content-type"], "application/grpc");
    assert_eq!(unknown.headers["grpc-status"], "12", "UNIMPLEMENTED");
    assert_eq!(
        unknown.headers["grpc-accept-encoding"],
        "identity,gzip,deflate"
    );
    assert!(
        unknown.headers["grpc-message"]
            .to_str()
            .unwrap()
            .contains("snappy"),
        "{:?}",
        unknown.headers["grpc-message"]
    );
    assert!(unknown.body.is_empty(), "trailers-only");

    for (case, body, encoding) in [
        ("no grpc-encoding", frame(1, &gzip(message)), None),
        ("identity", frame(1, &gzip(message)), Some("identity")),
        ("not gzip", frame(1, message), Some("gzip")),
        (
            "deflate sent as gzip",
            frame(1, &deflate(message)),
            Some("gzip"),
        ),
    ] {
        let refused = read(service.clone(), grpc_post_bytes(None, body, encoding)).await;
        assert_eq!(
            refused.headers["grpc-status"], "3",
            "INVALID_ARGUMENT: {case}"
        );
    }

    assert!(bodies.lock().unwrap().is_empty(), "the handler never ran");
    assert_eq!(pg.orders().await.len(), 0);
    assert_eq!(
        pg.count("SELECT count(*) FROM idempotency_requests").await,
        0,
        "no key claimed"
    );
}

/// A compression bomb: 10 MiB of zeros is about 10 KiB gzipped, well under
/// the body limit, and 10 times over it decompressed. The layer stops
/// reading at the limit and answers `RESOURCE_EXHAUSTED`, as for a body
/// over the limit; a message of exactly the limit is read. Nothing is
/// written for the refused ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compression_bomb_is_refused_at_the_body_limit_and_nothing_is_written() {
    let pg = Postgres::new().await;
    let bodies = Arc::new(std::sync::Mutex::new(Vec::new()));
    let limit = 64 * 1024;
    let service = tower_idempotency::IdempotencyLayer::new(
        pg.store.clone(),
        "orders.v1.Orders/CreateOrder",
        message_fingerprint,
    )
    .request_body_limit(limit)
    .layer(recording(bodies.clone()));

    let bomb = frame(1, &gzip(&vec![0u8; 10 * 1024 * 1024]));
    assert!(bomb.len() < limit, "the compressed bomb is under the limit");
    let refused = read(
        service.clone(),
        grpc_post_bytes(Some("bomb"), bomb, Some("gzip")),
    )
    .await;
    assert_eq!(refused.headers["grpc-status"], "8", "RESOURCE_EXHAUSTED");
    assert!(refused.headers["grpc-message"]
        .to_str()
        .unwrap()
        .contains(&limit.to_string()));
    let one_over = frame(1, &deflate(&vec![b'x'; limit + 1]));
    let refused = read(
        service.clone(),
        grpc_post_bytes(Some("one-over"), one_over, Some("deflate")),
    )
    .await;
    assert_eq!(
        refused.headers["grpc-status"], "8",
        "one byte over the limit"
    );
    assert!(bodies.lock().unwrap().is_empty(), "the handler never ran");
    assert_eq!(pg.orders().await.len(), 0);
    assert_eq!(
        pg.count("SELECT count(*) FROM idempotency_requests").await,
        0
    );

    let at_limit = frame(1, &gzip(&vec![b'x'; limit]));
    let created = read(
        service.clone(),
        grpc_post_bytes(Some("at-limit"), at_limit, Some("gzip")),
    )
    .await;
    assert_eq!(
        created.trailers.unwrap()["grpc-status"],
        "0",
        "at the limit"
    );
    assert_eq!(pg.orders().await.len(), 1);
    assert_eq!(key_rows(&pg, "at-limit").await, 1);
}
