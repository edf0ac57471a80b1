//! The layer's behaviour against `MemoryStore`, and against a real
//! PostgreSQL through `PgStore` and through `SqlxStore`: every scenario asserts on the committed rows and the remembered
//! records, not only on statuses.

use crate::common;

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc,
};

use bytes::Bytes;
use common::*;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tokio::sync::{Barrier, Notify};
use tower::Layer;
use tower_idempotency::{record::FinalResponse, scope::TenantId, RequestBody};

/// The default layer over [`order_handler`], and the count of the handler's calls.
fn counted_orders<B: Backend>(backend: &B) -> (TestService<B::Store>, Arc<AtomicU64>) {
    let calls = Arc::new(AtomicU64::new(0));
    let service = layer(backend.store()).layer(order_handler::<B>(calls.clone()));
    (service, calls)
}

// Each start waits at the barrier, then hands back the spawned request.
#[allow(clippy::async_yields_async)]
async fn fifty_concurrent_duplicates_commit_once<B: Backend>(backend: B) {
    let (service, calls) = counted_orders(&backend);
    let barrier = Arc::new(Barrier::new(50));
    let starts: Vec<_> = (0..50)
        .map(|i| {
            let service = service.clone();
            let barrier = barrier.clone();
            // Same request, different spellings: the fingerprint is canonical.
            let body = if i % 2 == 0 {
                BODY.to_owned()
            } else {
                r#"{ "amount": 1200.0, "checkout_id": "chk_1", "trace_id": "t" }"#.to_owned()
            };
            async move {
                barrier.wait().await;
                spawn_send(service, post(Some("tenant-a"), Some("key-50"), &body))
            }
        })
        .collect();
    // Line all 50 up, then let them go together.
    let tasks: Vec<_> = starts.into_iter().map(tokio::spawn).collect();
    let mut answers = Vec::new();
    for task in tasks {
        let task = task.await.unwrap();
        answers.push(task.await.unwrap());
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler ran once");
    assert_eq!(backend.orders().await.len(), 1, "one business row");
    assert_eq!(backend.remembered().await, 1, "one remembered result");
    let first = &answers
        .iter()
        .find(|a| !a.replayed())
        .expect("one original answer")
        .body;
    for answer in &answers {
        assert_eq!(answer.status, StatusCode::CREATED);
        assert_eq!(&answer.body, first, "every answer carries the first body");
    }
    assert_eq!(answers.iter().filter(|a| a.replayed()).count(), 49);
}

async fn replays_first_response_with_allow_listed_headers<B: Backend>(backend: B) {
    let (service, calls) = counted_orders(&backend);
    let first = send(service.clone(), tenant_a_post("k1")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    assert!(
        first.headers.get("set-cookie").is_some(),
        "the first answer is untouched"
    );
    let replay = send(service.clone(), tenant_a_post("\"k1\"")).await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.headers["location"], first.headers["location"]);
    let links: Vec<_> = replay.headers.get_all("link").iter().collect();
    assert_eq!(links, ["</a>; rel=a", "</b>; rel=b"]);
    assert!(
        replay.headers.get("set-cookie").is_none(),
        "Set-Cookie is never replayed"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(backend.orders().await.len(), 1);
}

/// A compression layer inside the idempotency layer: the stored bytes are
/// encoded, so the replay carries the headers that say how (without them a
/// client reads compressed bytes as the body).
async fn replays_how_its_stored_bytes_are_encoded<B: Backend>(backend: B) {
    let calls = Arc::new(AtomicU64::new(0));
    // An empty gzip member.
    let gzip: &[u8] = &[
        31, 139, 8, 0, 0, 0, 0, 0, 0, 3, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ];
    let service = layer(backend.store()).layer(writes_then::<B>(calls.clone(), move || {
        Ok(Response::builder()
            .status(StatusCode::CREATED)
            .header("content-type", "application/json")
            .header("content-encoding", "gzip")
            .header("vary", "accept-encoding")
            .body(Full::new(Bytes::from_static(gzip)))
            .unwrap())
    }));
    let first = send(service.clone(), tenant_a_post("k1")).await;
    let replay = send(service, tenant_a_post("k1")).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(&replay.body[..], gzip);
    assert_eq!(replay.headers["content-encoding"], "gzip");
    assert_eq!(replay.headers["vary"], "accept-encoding");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(backend.orders().await.len(), 1);
}

async fn refuses_reused_key_and_changes_nothing<B: Backend>(backend: B) {
    let (service, calls) = counted_orders(&backend);
    let first = send(service.clone(), tenant_a_post("k1")).await;
    let other = send(
        service.clone(),
        post(
            Some("tenant-a"),
            Some("k1"),
            r#"{"checkout_id":"chk_1","amount":1300}"#,
        ),
    )
    .await;
    assert_eq!(other.status, StatusCode::CONFLICT);
    assert_eq!(other.json()["code"], "idempotency_key_reused");
    assert_eq!(other.headers["content-type"], "application/problem+json");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(backend.orders().await.len(), 1);
    assert_eq!(backend.remembered().await, 1);
    let replay = send(service.clone(), tenant_a_post("k1")).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body, "the original still replays");
}

/// A handler that counts its call, writes its order, then answers what `answer` gives.
fn writes_then<B: Backend>(
    calls: Arc<AtomicU64>,
    answer: impl Fn() -> Result<Response<Full<Bytes>>, BoxError> + Clone + Send + Sync + 'static,
) -> Handler {
    tower::util::BoxCloneService::new(tower::service_fn(move |request: Request<RequestBody>| {
        let (calls, answer) = (calls.clone(), answer.clone());
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            let tx = tx_of::<B>(&request).unwrap();
            B::insert_order(&tx, &new_order_id(), "tenant-a").await?;
            answer()
        }
    }))
}

/// A handler that writes its order and then fails with `status`.
fn failing_after_write<B: Backend>(status: StatusCode, calls: Arc<AtomicU64>) -> Handler {
    writes_then::<B>(calls, move || {
        if status == StatusCode::IM_A_TEAPOT {
            return Err("service error".into());
        }
        Ok(response(status, "{\"error\":true}"))
    })
}

async fn rolls_back_on_5xx_and_frees_the_key<B: Backend>(backend: B) {
    let calls = Arc::new(AtomicU64::new(0));
    let failing = layer(backend.store()).layer(failing_after_write::<B>(
        StatusCode::INTERNAL_SERVER_ERROR,
        calls.clone(),
    ));
    let answer = send(failing.clone(), tenant_a_post("k1")).await;
    assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(
        backend.orders().await.is_empty(),
        "the write was rolled back"
    );
    assert_eq!(backend.remembered().await, 0);
    let working = layer(backend.store()).layer(order_handler::<B>(calls.clone()));
    let retry = send(working.clone(), tenant_a_post("k1")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed(), "the retry ran afresh");
    assert_eq!(backend.orders().await.len(), 1);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

async fn rolls_back_on_service_error<B: Backend>(backend: B) {
    let calls = Arc::new(AtomicU64::new(0));
    let failing = layer(backend.store()).layer(failing_after_write::<B>(
        StatusCode::IM_A_TEAPOT,
        calls.clone(),
    ));
    let error = tower::ServiceExt::oneshot(failing, tenant_a_post("k1")).await;
    assert!(error.is_err(), "the service error is passed on");
    assert!(backend.orders().await.is_empty());
    assert_eq!(backend.remembered().await, 0);
}

async fn unmarked_4xx_is_rolled_back_but_final_4xx_is_remembered<B: Backend>(backend: B) {
    let calls = Arc::new(AtomicU64::new(0));
    let unmarked = layer(backend.store()).layer(failing_after_write::<B>(
        StatusCode::UNPROCESSABLE_ENTITY,
        calls.clone(),
    ));
    let answer = send(unmarked.clone(), tenant_a_post("k1")).await;
    assert_eq!(answer.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(backend.orders().await.is_empty());
    assert_eq!(backend.remembered().await, 0);

    let marked = layer(backend.store()).layer(writes_then::<B>(calls.clone(), || {
        let mut response = response(
            StatusCode::UNPROCESSABLE_ENTITY,
            "{\"code\":\"coupon_expired\"}",
        );
        response.extensions_mut().insert(FinalResponse);
        Ok(response)
    }));
    let first = send(marked.clone(), tenant_a_post("k2")).await;
    let replay = send(marked.clone(), tenant_a_post("k2")).await;
    assert_eq!(first.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(replay.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(
        backend.orders().await.len(),
        1,
        "a final answer commits its writes"
    );
    assert_eq!(backend.remembered().await, 1);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

async fn same_key_on_another_target_is_a_reused_key<B: Backend>(backend: B) {
    let (service, calls) = counted_orders(&backend);
    let mut first = tenant_a_post("k1");
    *first.uri_mut() = "/orders/1/cancel".parse().unwrap();
    let mut second = tenant_a_post("k1");
    *second.uri_mut() = "/orders/2/cancel".parse().unwrap();
    assert_eq!(
        send(service.clone(), first).await.status,
        StatusCode::CREATED
    );
    let other = send(service.clone(), second).await;
    assert_eq!(other.status, StatusCode::CONFLICT);
    assert_eq!(other.json()["code"], "idempotency_key_reused");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(backend.orders().await.len(), 1);
}

async fn tenants_with_the_same_raw_key_stay_apart<B: Backend>(backend: B) {
    let (service, _) = counted_orders(&backend);
    let a = send(service.clone(), tenant_a_post("shared")).await;
    let b = send(
        service.clone(),
        post(Some("tenant-b"), Some("shared"), BODY),
    )
    .await;
    assert!(!a.replayed() && !b.replayed());
    assert_ne!(a.body, b.body);
    assert_eq!(a.json()["tenant"], "tenant-a");
    assert_eq!(b.json()["tenant"], "tenant-b");
    let mut tenants: Vec<_> = backend.orders().await.into_iter().map(|(_, t)| t).collect();
    tenants.sort();
    assert_eq!(tenants, ["tenant-a", "tenant-b"]);
    let replay_b = send(
        service.clone(),
        post(Some("tenant-b"), Some("shared"), BODY),
    )
    .await;
    assert_eq!(replay_b.body, b.body);
}

async fn expired_key_is_a_new_operation<B: Backend>(backend: B) {
    let calls = Arc::new(AtomicU64::new(0));
    // The shortest retention a layer keeps: its handler's deadline plus the
    // 5 s within which the work commits or is ended (see `retention`).
    let deadline = std::time::Duration::from_millis(100);
    let service = layer(backend.store())
        .handler_timeout(deadline)
        .retention(std::time::Duration::ZERO)
        .layer(order_handler::<B>(calls.clone()));
    let first = send(service.clone(), tenant_a_post("k1")).await;
    assert!(
        send(service.clone(), tenant_a_post("k1")).await.replayed(),
        "a retention below the work's is raised to cover it"
    );
    // The behaviour under test is time passing: the raised retention ends.
    tokio::time::sleep(deadline + std::time::Duration::from_millis(5300)).await;
    let second = send(service.clone(), tenant_a_post("k1")).await;
    assert!(!second.replayed(), "past retention the key is new again");
    assert_ne!(first.body, second.body);
    assert_eq!(backend.orders().await.len(), 2);
    assert_eq!(
        backend.remembered().await,
        1,
        "the expired record was taken over"
    );
}

async fn duplicate_waits_then_answers_in_progress<B: Backend>(backend: B) {
    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let service = layer(backend.store())
        .wait(WAIT_SHORT)
        .layer(gated::<B>(started.clone(), release.clone()));
    let first = spawn_send(service.clone(), tenant_a_post("k1"));
    started.notified().await;
    let duplicate = send(service.clone(), tenant_a_post("k1")).await;
    assert_eq!(duplicate.status, StatusCode::CONFLICT);
    assert_eq!(duplicate.json()["code"], "idempotency_in_progress");
    assert_eq!(duplicate.headers["retry-after"], "1");
    assert!(
        backend.orders().await.is_empty(),
        "nothing is visible before the first commits"
    );
    release.notify_one();
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let later = send(service.clone(), tenant_a_post("k1")).await;
    assert!(later.replayed());
    assert_eq!(later.body, first.body);
    assert_eq!(backend.orders().await.len(), 1);
}

async fn client_gone_after_claim_still_commits_and_retry_replays<B: Backend>(backend: B) {
    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let service = layer(backend.store()).layer(gated::<B>(started.clone(), release.clone()));
    let client = spawn_send(service.clone(), tenant_a_post("k1"));
    started.notified().await;
    // The client disconnects: its response future is dropped mid-request.
    client.abort();
    assert!(client.await.unwrap_err().is_cancelled());
    // The retry arrives while the orphaned work still holds the key; it waits
    // for the commit (the wait is the synchronisation) and replays it.
    let retry = spawn_send(service.clone(), tenant_a_post("k1"));
    release.notify_one();
    let retry = retry.await.unwrap();
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed(), "the retry gets the committed result");
    let orders = backend.orders().await;
    assert_eq!(orders.len(), 1);
    assert_eq!(retry.json()["id"], orders[0].0);
}

async fn bad_input_is_refused_and_writes_nothing<B: Backend>(backend: B) {
    let calls = Arc::new(AtomicU64::new(0));
    let service = layer(backend.store())
        .request_body_limit(64)
        .max_key_length(40)
        .layer(order_handler::<B>(calls.clone()));
    let too_long = "k".repeat(256);
    let over_endpoint_limit = "k".repeat(41);
    let cases: Vec<(Request<Full<Bytes>>, StatusCode, &str)> = vec![
        (
            post(Some("tenant-a"), None, BODY),
            StatusCode::BAD_REQUEST,
            "idempotency_key_missing",
        ),
        (
            post(Some("tenant-a"), Some("has space"), BODY),
            StatusCode::BAD_REQUEST,
            "idempotency_key_invalid",
        ),
        (
            post(Some("tenant-a"), Some(&over_endpoint_limit), BODY),
            StatusCode::BAD_REQUEST,
            "idempotency_key_invalid",
        ),
        (
            post(Some("tenant-a"), Some(&too_long), BODY),
            StatusCode::BAD_REQUEST,
            "idempotency_key_invalid",
        ),
        (
            post(Some("tenant-a"), Some("\"quoted space\""), BODY),
            StatusCode::BAD_REQUEST,
            "idempotency_key_invalid",
        ),
        (
            post(None, Some("k1"), BODY),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        ),
        (
            post(Some("tenant-a"), Some("k1"), &"x".repeat(65)),
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
        ),
        (
            post(Some("tenant-a"), Some("k1"), "{not json"),
            StatusCode::UNPROCESSABLE_ENTITY,
            "validation_failed",
        ),
    ];
    let mut repeated = post(Some("tenant-a"), Some("k1"), BODY);
    repeated
        .headers_mut()
        .append("idempotency-key", "k2".parse().unwrap());
    for (request, status, code) in
        cases
            .into_iter()
            .chain([(repeated, StatusCode::BAD_REQUEST, "idempotency_key_invalid")])
    {
        let answer = send(service.clone(), request).await;
        assert_eq!(answer.status, status, "{code}");
        assert_eq!(answer.json()["code"], code);
        assert_eq!(answer.json()["status"], status.as_u16());
        assert_eq!(answer.headers["content-type"], "application/problem+json");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0, "the handler never ran");
    assert!(backend.orders().await.is_empty());
    assert_eq!(backend.remembered().await, 0);
    // A corrected body may reuse the key the invalid one was sent with.
    let corrected = send(service.clone(), tenant_a_post("k1")).await;
    assert_eq!(corrected.status, StatusCode::CREATED);
}

async fn builder_options_change_the_contract<B: Backend>(backend: B) {
    let calls = Arc::new(AtomicU64::new(0));
    let service = layer(backend.store())
        .header_name(http::HeaderName::from_static("x-request-key"))
        .require_key(false)
        .key_reuse_status(tower_idempotency::KeyReuseStatus::UnprocessableContent)
        .replay_headers([http::header::LOCATION])
        .layer(order_handler::<B>(calls.clone()));
    // Without a key the request passes through: no transaction, nothing remembered.
    let passthrough = layer(backend.store())
        .require_key(false)
        .layer(tower::service_fn(
            |request: Request<RequestBody>| async move {
                let had_tx = tx_of::<B>(&request).is_some();
                Ok::<_, BoxError>(Response::new(Full::new(Bytes::from(format!("{had_tx}")))))
            },
        ));
    let keyless = send(passthrough, post(Some("tenant-a"), None, BODY)).await;
    assert_eq!(
        (keyless.status, &keyless.body[..]),
        (StatusCode::OK, &b"false"[..])
    );
    assert_eq!(backend.remembered().await, 0);
    let with_key = |key: &str, body: &str| {
        let mut request = post(Some("tenant-a"), None, body);
        request
            .headers_mut()
            .insert("x-request-key", key.parse().unwrap());
        request
    };
    let first = send(service.clone(), with_key("k1", BODY)).await;
    let replay = send(service.clone(), with_key("k1", BODY)).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert!(replay.headers.get("location").is_some());
    assert!(
        replay.headers.get("content-type").is_none(),
        "only the allow-listed headers replay"
    );
    let reused = send(service, with_key("k1", r#"{"other":true}"#)).await;
    assert_eq!(
        reused.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "the IETF draft's status"
    );
    assert_eq!(reused.json()["code"], "idempotency_key_reused");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(backend.orders().await.len(), 1);
    assert_eq!(backend.remembered().await, 1);
}

async fn safe_methods_pass_through<B: Backend>(backend: B) {
    let service = layer(backend.store()).layer(tower::service_fn(
        |request: Request<RequestBody>| async move {
            assert!(request.extensions().get::<TenantId>().is_none());
            Ok::<_, BoxError>(Response::new(Full::new(Bytes::from_static(b"listing"))))
        },
    ));
    let request = Request::get("/orders")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let answer = send(service.clone(), request).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert_eq!(&answer.body[..], b"listing");
    assert_eq!(backend.remembered().await, 0);
}

macro_rules! for_every_store {
    ($($scenario:ident),* $(,)?) => {
        mod memory {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    super::$scenario(Memory::new().await).await;
                }
            )*
        }
        mod postgres {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    super::$scenario(Postgres::new().await).await;
                }
            )*
        }
        mod sqlx {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    super::$scenario(Sqlx::new().await).await;
                }
            )*
        }
    };
}

for_every_store!(
    fifty_concurrent_duplicates_commit_once,
    replays_first_response_with_allow_listed_headers,
    replays_how_its_stored_bytes_are_encoded,
    refuses_reused_key_and_changes_nothing,
    rolls_back_on_5xx_and_frees_the_key,
    rolls_back_on_service_error,
    unmarked_4xx_is_rolled_back_but_final_4xx_is_remembered,
    tenants_with_the_same_raw_key_stay_apart,
    same_key_on_another_target_is_a_reused_key,
    expired_key_is_a_new_operation,
    duplicate_waits_then_answers_in_progress,
    client_gone_after_claim_still_commits_and_retry_replays,
    bad_input_is_refused_and_writes_nothing,
    safe_methods_pass_through,
    builder_options_change_the_contract,
);
