//! The long-running mode against a real PostgreSQL: a committed in-progress
//! record with a lease, heartbeats, takeover by compare-and-swap, fencing,
//! the status resource and the recovery worker. Each test asserts on the
//! rows.

use crate::common;

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use bytes::Bytes;
use common::*;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tokio::sync::Notify;
use tower::{Layer, ServiceExt};
use tower_idempotency::{
    fingerprint::{Fingerprint, JsonFingerprinter},
    key::IdempotencyKey,
    lease::{LeaseConfig, LongRunning, OperationId},
    postgres::{PgLease, PgStore, TxErrorKind},
    scope::{Scope, TenantFromExtension, TenantId},
    store::{Acquired, ClaimRequest, LeaseRequest, LeaseStore, StoreErrorKind, StoredRequest},
    Idempotency, IdempotencyLayer, RequestBody,
};

const ENDPOINT: &str = "POST /orders v1";
const LEASE: Duration = Duration::from_millis(600);

type LongLayer = IdempotencyLayer<PgStore, JsonFingerprinter, TenantFromExtension, LongRunning>;
type LongService =
    Idempotency<Handler, PgStore, JsonFingerprinter, TenantFromExtension, LongRunning>;

fn long_layer(store: PgStore, respond_within: Duration) -> LongLayer {
    IdempotencyLayer::new(store, ENDPOINT, JsonFingerprinter::new("orders.v1"))
        .wait(Duration::from_millis(500))
        .long_running(
            LeaseConfig::new(LEASE)
                .heartbeat(Duration::from_millis(100))
                .respond_within(respond_within)
                .recovery_backoff(Duration::ZERO, Duration::ZERO),
        )
}

/// A handler that writes one order through a fenced transaction, counting
/// its calls; when `gate` is given it waits for it first (slow work).
fn fenced_orders(calls: Arc<AtomicU64>, gate: Option<Arc<Notify>>) -> Handler {
    tower::util::BoxCloneService::new(tower::service_fn(move |request: Request<RequestBody>| {
        let (calls, gate) = (calls.clone(), gate.clone());
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            let lease = request
                .extensions()
                .get::<PgLease>()
                .cloned()
                .ok_or("no lease")?;
            if let Some(gate) = gate {
                gate.notified().await;
            }
            let id = new_order_id();
            let tx = lease.transaction().await?;
            tx.execute(
                "INSERT INTO orders (id, tenant_id) VALUES ($1, $2)",
                &[&id, &lease.tenant()],
            )
            .await?;
            tx.commit().await?;
            let body = format!(r#"{{"id":"{id}","token":{}}}"#, lease.attempt_token());
            Ok::<_, BoxError>(
                Response::builder()
                    .status(StatusCode::CREATED)
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(body)))
                    .unwrap(),
            )
        }
    }))
}

fn service(layer: &LongLayer, handler: Handler) -> LongService {
    layer.layer(handler)
}

/// The key's row: (state, attempt_token, lease set, operation id).
async fn row(pg: &Postgres, key: &str) -> Option<(String, i64, bool, Option<String>)> {
    pg.client
        .query_opt(
            "SELECT state, attempt_token, lease_expires_at IS NOT NULL, operation_id::text \
             FROM idempotency_requests WHERE idempotency_key = $1",
            &[&key],
        )
        .await
        .unwrap()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
}

/// Waits (polling the row, bounded) until the key's lease has expired.
async fn until_lease_expired(pg: &Postgres, key: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let expired: bool = pg
            .client
            .query_one(
                "SELECT COALESCE(bool_and(lease_expires_at <= now()), false) FROM idempotency_requests WHERE idempotency_key = $1",
                &[&key],
            )
            .await
            .unwrap()
            .get(0);
        if expired {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the lease never expired"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits (polling, bounded) until the key's record is completed.
async fn until_completed(pg: &Postgres, key: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while row(pg, key).await.map(|r| r.0) != Some("completed".into()) {
        assert!(tokio::time::Instant::now() < deadline, "never completed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn claim(key: &str, fingerprint: Fingerprint) -> ClaimRequest {
    ClaimRequest::new(
        Scope::new(TenantId::new("tenant-a"), ENDPOINT),
        IdempotencyKey::parse(key.as_bytes()).unwrap(),
        fingerprint,
    )
    .with_wait(Duration::from_millis(500))
}

/// The fingerprint the layer computes for [`tenant_a_post`].
async fn layer_fingerprint(pg: &Postgres, key: &str) -> Fingerprint {
    let bytes: Vec<u8> = pg
        .client
        .query_one(
            "SELECT request_fingerprint FROM idempotency_requests WHERE idempotency_key = $1",
            &[&key],
        )
        .await
        .unwrap()
        .get(0);
    Fingerprint::from_slice(&bytes).unwrap()
}

/// An owner that acquires `key` and then dies: it never heartbeats,
/// finishes or releases. Uses the fingerprint the layer stored for an
/// earlier, completed-then-removed probe of the same request.
async fn crashed_owner(pg: &Postgres, key: &str) -> (PgLease, OperationId, i64) {
    let fingerprint = probe_fingerprint(pg).await;
    let request = LeaseRequest::new(
        LEASE,
        OperationId::random(),
        StoredRequest::new(
            http::Method::POST,
            "/orders",
            vec![(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            )],
            Bytes::from_static(BODY.as_bytes()),
        ),
    );
    match pg.store.acquire(&claim(key, fingerprint), &request).await {
        Ok(Acquired::Owned(owned)) => (owned.lease, owned.operation_id, owned.token),
        other => panic!("the first owner must own the key: {other:?}"),
    }
}

/// The layer's fingerprint of [`tenant_a_post`], learnt once per database
/// by sending it under a throwaway key.
async fn probe_fingerprint(pg: &Postgres) -> Fingerprint {
    let layer = long_layer(pg.store.clone(), Duration::from_secs(5));
    let answer = send(
        service(&layer, fenced_orders(Default::default(), None)),
        tenant_a_post("probe"),
    )
    .await;
    assert_eq!(answer.status, StatusCode::CREATED);
    let fingerprint = layer_fingerprint(pg, "probe").await;
    pg.exec("DELETE FROM idempotency_requests WHERE idempotency_key = 'probe'; DELETE FROM orders")
        .await;
    fingerprint
}

#[tokio::test]
async fn work_done_within_respond_within_is_answered_directly_and_replayed() {
    let pg = Postgres::new().await;
    let calls = Arc::new(AtomicU64::new(0));
    let layer = long_layer(pg.store.clone(), Duration::from_secs(5));
    let first = send(
        service(&layer, fenced_orders(calls.clone(), None)),
        tenant_a_post("k1"),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    let again = send(
        service(&layer, fenced_orders(calls.clone(), None)),
        tenant_a_post("k1"),
    )
    .await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(again.replayed());
    assert_eq!(again.body, first.body, "byte-for-byte replay");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(pg.count("SELECT count(*) FROM orders").await, 1);
    let (state, token, lease, id) = row(&pg, "k1").await.unwrap();
    assert_eq!(state, "completed");
    assert!(!lease, "a completed operation holds no lease");
    assert!(id.is_some());
    assert_eq!(first.json()["token"], token);
    assert_eq!(
        pg.count("SELECT count(*) FROM idempotency_requests WHERE request_body IS NOT NULL")
            .await,
        0,
        "the stored request is dropped once the answer is stored"
    );
}

#[tokio::test]
async fn slow_work_answers_202_and_a_duplicate_gets_the_same_202_without_a_second_execution() {
    let pg = Postgres::new().await;
    let (calls, gate) = (Arc::new(AtomicU64::new(0)), Arc::new(Notify::new()));
    let layer = long_layer(pg.store.clone(), Duration::from_millis(100));
    let handler = fenced_orders(calls.clone(), Some(gate.clone()));
    let first = send(service(&layer, handler.clone()), tenant_a_post("k1")).await;
    assert_eq!(first.status, StatusCode::ACCEPTED);
    assert!(!first.replayed());
    let id = first.json()["operation_id"].as_str().unwrap().to_owned();
    assert_eq!(first.json()["state"], "running");
    assert_eq!(first.headers["location"], format!("/operations/{id}"));
    assert_eq!(
        first.headers["retry-after"], "1",
        "the heartbeat (100 ms) in whole seconds, at least 1"
    );
    let (state, _, lease, stored_id) = row(&pg, "k1").await.unwrap();
    assert_eq!(
        (state.as_str(), lease),
        ("in_progress", true),
        "committed in progress"
    );
    assert_eq!(stored_id.as_deref(), Some(id.as_str()));
    assert_eq!(
        pg.idle_in_transaction().await,
        0,
        "no transaction is held open"
    );

    let duplicate = send(service(&layer, handler.clone()), tenant_a_post("k1")).await;
    assert_eq!(duplicate.status, StatusCode::ACCEPTED);
    assert!(duplicate.replayed());
    assert_eq!(duplicate.body, first.body);
    assert_eq!(duplicate.headers["location"], first.headers["location"]);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "never a second execution");

    gate.notify_one();
    until_completed(&pg, "k1").await;
    let done = send(service(&layer, handler), tenant_a_post("k1")).await;
    assert_eq!(done.status, StatusCode::CREATED);
    assert!(done.replayed());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(pg.count("SELECT count(*) FROM orders").await, 1);
    layer.drained().await;
}

#[tokio::test]
async fn a_different_request_under_the_key_is_refused_while_running_and_after() {
    let pg = Postgres::new().await;
    let (calls, gate) = (Arc::new(AtomicU64::new(0)), Arc::new(Notify::new()));
    let layer = long_layer(pg.store.clone(), Duration::from_millis(50));
    let handler = fenced_orders(calls.clone(), Some(gate.clone()));
    let first = send(service(&layer, handler.clone()), tenant_a_post("k1")).await;
    assert_eq!(first.status, StatusCode::ACCEPTED);
    let other = || {
        post(
            Some("tenant-a"),
            Some("k1"),
            r#"{"checkout_id":"chk_2","amount":1}"#,
        )
    };
    let refused = send(service(&layer, handler.clone()), other()).await;
    assert_eq!(refused.status, StatusCode::CONFLICT);
    assert_eq!(refused.json()["code"], "idempotency_key_reused");
    gate.notify_one();
    until_completed(&pg, "k1").await;
    let refused = send(service(&layer, handler), other()).await;
    assert_eq!(refused.json()["code"], "idempotency_key_reused");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_request_refused_before_its_claim_is_never_remembered() {
    let pg = Postgres::new().await;
    let layer = long_layer(pg.store.clone(), Duration::from_secs(1)).request_body_limit(64);
    let handler = fenced_orders(Default::default(), None);
    let bad = send(
        service(&layer, handler.clone()),
        post(Some("tenant-a"), Some("k1"), "{not json"),
    )
    .await;
    assert_eq!(bad.status.as_u16() / 100, 4);
    let big = "x".repeat(100);
    let too_large = send(
        service(&layer, handler),
        post(Some("tenant-a"), Some("k2"), &format!(r#"{{"a":"{big}"}}"#)),
    )
    .await;
    assert_eq!(too_large.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(
        pg.count("SELECT count(*) FROM idempotency_requests").await,
        0
    );
}

/// How the first attempt of [`charge_once_then`] ends after its fenced write.
#[derive(Clone, Copy, Debug)]
enum FirstAttempt {
    /// A `502`: the downstream's answer was lost.
    BadGateway,
    /// Past the layer's handler timeout.
    TimesOut,
    /// The service fails with an error.
    Errors,
}

/// A handler that commits a charge keyed by the operation id (as a
/// downstream call would be) in every attempt, and whose first attempt
/// then ends without an answer (`first`); later attempts answer `201`.
/// Counts its calls.
fn charge_once_then(first: FirstAttempt, calls: Arc<AtomicU64>) -> Handler {
    tower::util::BoxCloneService::new(tower::service_fn(move |request: Request<RequestBody>| {
        let calls = calls.clone();
        async move {
            let call = calls.fetch_add(1, Ordering::SeqCst);
            let lease = request
                .extensions()
                .get::<PgLease>()
                .cloned()
                .ok_or("no lease")?;
            let operation = lease.operation_id().to_string();
            let key = tower_idempotency::outbox::derive_key(&operation, "charge");
            let tx = lease.transaction().await?;
            tx.execute(
                "INSERT INTO charges (key, operation_id, token) VALUES ($1, $2, $3) \
                 ON CONFLICT (key) DO NOTHING",
                &[&key, &operation, &lease.attempt_token()],
            )
            .await?;
            tx.commit().await?;
            if call == 0 {
                match first {
                    FirstAttempt::BadGateway => {
                        return Ok(response(StatusCode::BAD_GATEWAY, "answer lost"))
                    }
                    FirstAttempt::TimesOut => {
                        tokio::time::sleep(Duration::from_secs(30)).await;
                    }
                    FirstAttempt::Errors => return Err::<_, BoxError>("downstream failed".into()),
                }
            }
            let body = format!(r#"{{"operation_id":"{operation}"}}"#);
            Ok(created(body))
        }
    }))
}

/// The operation's status document, as its tenant reads it.
async fn operation_status(layer: &LongLayer, id: &str) -> (StatusCode, serde_json::Value) {
    let mut request = Request::get(format!("/operations/{id}"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    request.extensions_mut().insert(TenantId::new("tenant-a"));
    let response = layer.status_service().oneshot(request).await.unwrap();
    let status = response.status();
    let body = http_body_util::BodyExt::collect(response.into_body())
        .await
        .unwrap()
        .to_bytes();
    (status, serde_json::from_slice(&body).unwrap())
}

/// The key's `attempts` column.
async fn attempts(pg: &Postgres, key: &str) -> i32 {
    pg.client
        .query_one(
            "SELECT attempts FROM idempotency_requests WHERE idempotency_key = $1",
            &[&key],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn a_failed_attempt_keeps_the_operation_and_the_retry_resumes_it_at_once() {
    for first in [
        FirstAttempt::BadGateway,
        FirstAttempt::TimesOut,
        FirstAttempt::Errors,
    ] {
        let pg = Postgres::new().await;
        pg.exec("CREATE TABLE charges (key text PRIMARY KEY, operation_id text NOT NULL, token bigint NOT NULL)")
            .await;
        let calls = Arc::new(AtomicU64::new(0));
        let handler = charge_once_then(first, calls.clone());
        let layer = long_layer(pg.store.clone(), Duration::from_secs(5))
            .handler_timeout(Duration::from_millis(300));
        let answer =
            tower::ServiceExt::oneshot(service(&layer, handler.clone()), tenant_a_post("k1")).await;
        match (first, &answer) {
            (FirstAttempt::BadGateway, Ok(r)) => assert_eq!(r.status(), StatusCode::BAD_GATEWAY),
            (FirstAttempt::TimesOut, Ok(r)) => {
                assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE)
            }
            (FirstAttempt::Errors, Err(_)) => {}
            (first, other) => panic!(
                "{first:?}: unexpected first answer {:?}",
                other.as_ref().map(|r| r.status())
            ),
        }
        // The operation is still there, its lease given up, its work kept.
        let (state, first_token, _, id) = row(&pg, "k1").await.expect("the record stays");
        let id = id.expect("an operation id");
        assert_eq!(state, "in_progress", "{first:?}");
        assert_eq!(attempts(&pg, "k1").await, 1, "{first:?}");
        assert_eq!(
            pg.count("SELECT count(*) FROM charges").await,
            1,
            "{first:?}"
        );
        let (code, status) = operation_status(&layer, &id).await;
        assert_eq!(
            code,
            StatusCode::OK,
            "{first:?}: the status resource still answers"
        );
        assert_eq!(status["state"], "running", "{first:?}");
        assert_eq!(status["attempts"], 1, "{first:?}");

        // A different request under the key is refused; nothing changes.
        let other = send(
            service(&layer, handler.clone()),
            post(
                Some("tenant-a"),
                Some("k1"),
                r#"{"checkout_id":"chk_2","amount":5}"#,
            ),
        )
        .await;
        assert_eq!(other.status, StatusCode::CONFLICT, "{first:?}");
        assert_eq!(other.json()["code"], "idempotency_key_reused", "{first:?}");

        // The retry resumes the same operation at once (no wait for a lease).
        let retry = send(service(&layer, handler.clone()), tenant_a_post("k1")).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{first:?}");
        assert_eq!(
            retry.json()["operation_id"],
            id.as_str(),
            "{first:?}: the same operation"
        );
        assert_eq!(calls.load(Ordering::SeqCst), 2, "{first:?}");
        assert_eq!(
            pg.count("SELECT count(*) FROM charges").await,
            1,
            "{first:?}: the work keyed by the operation exists once"
        );
        let (state, token, _, same_id) = row(&pg, "k1").await.unwrap();
        assert_eq!(
            (state.as_str(), same_id.as_deref()),
            ("completed", Some(id.as_str()))
        );
        assert!(token > first_token, "{first:?}: a larger token");
        assert_eq!(attempts(&pg, "k1").await, 2, "{first:?}");
        let (_, status) = operation_status(&layer, &id).await;
        assert_eq!(status["state"], "completed", "{first:?}");
        assert_eq!(status["attempts"], 2, "{first:?}");
    }
}

#[tokio::test]
async fn a_handler_that_always_panics_ends_failed_after_max_attempts() {
    let pg = Postgres::new().await;
    let calls = Arc::new(AtomicU64::new(0));
    let panics = {
        let calls = calls.clone();
        tower::util::BoxCloneService::new(tower::service_fn(move |_: Request<RequestBody>| {
            let calls = calls.clone();
            async move {
                // Always true; written so that the answer type is inferred.
                if calls.fetch_add(1, Ordering::SeqCst) < u64::MAX {
                    panic!("a poison request");
                }
                Ok::<_, BoxError>(created("never"))
            }
        }))
    };
    let layer = IdempotencyLayer::new(
        pg.store.clone(),
        ENDPOINT,
        JsonFingerprinter::new("orders.v1"),
    )
    .wait(Duration::from_millis(500))
    .long_running(
        LeaseConfig::new(LEASE)
            .heartbeat(Duration::from_millis(100))
            .respond_within(Duration::from_secs(5))
            .max_attempts(3)
            .recovery_interval(Duration::from_millis(20))
            .recovery_backoff(Duration::from_millis(50), Duration::from_millis(200)),
    );
    let first = send(service(&layer, panics.clone()), tenant_a_post("k1")).await;
    assert_eq!(
        first.status,
        StatusCode::ACCEPTED,
        "the operation stays for its next attempt"
    );
    let id = first.json()["operation_id"].as_str().unwrap().to_owned();

    // Nobody retries; the recovery worker re-drives it (each pass takes
    // over what is due and waits for its attempts) until it runs out.
    let recovery = layer.recovery(panics.clone());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut passes_with_work = 0;
    while row(&pg, "k1").await.map(|r| r.0) != Some("failed".into()) {
        assert!(tokio::time::Instant::now() < deadline, "never ended failed");
        passes_with_work += recovery.run_once().await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Attempts 2 and 3 ran the handler; a 4th acquisition never happens:
    // attempt 3 was the last and recorded the failure itself.
    assert_eq!(passes_with_work, 2, "recovery re-drove the operation twice");
    assert_eq!(
        recovery.run_once().await.unwrap(),
        0,
        "a failed operation is not due"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 3, "at most max_attempts runs");
    assert_eq!(attempts(&pg, "k1").await, 3);
    let (code, status) = operation_status(&layer, &id).await;
    assert_eq!(code, StatusCode::OK);
    assert_eq!(status["state"], "failed");
    assert_eq!(status["attempts"], 3);
    assert_eq!(status["error"]["code"], "operation_failed");

    // A retry of the POST replays the remembered failure; nothing runs.
    let retry = send(service(&layer, panics.clone()), tenant_a_post("k1")).await;
    assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(retry.replayed());
    assert_eq!(retry.headers["content-type"], "application/problem+json");
    assert_eq!(retry.json()["code"], "operation_failed");
    assert_eq!(retry.json()["attempts"], 3);
    let again = send(service(&layer, panics.clone()), tenant_a_post("k1")).await;
    assert_eq!(again.body, retry.body, "byte for byte");
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn an_operation_whose_last_attempt_crashed_ends_failed_without_running_again() {
    let pg = Postgres::new().await;
    // Attempt 1 of 1 took its process down (it never ends its lease).
    let (_dead, operation_id, _) = crashed_owner(&pg, "k1").await;
    let calls = Arc::new(AtomicU64::new(0));
    let layer = IdempotencyLayer::new(
        pg.store.clone(),
        ENDPOINT,
        JsonFingerprinter::new("orders.v1"),
    )
    .long_running(LeaseConfig::new(LEASE).max_attempts(1));
    until_lease_expired(&pg, "k1").await;
    let retry = send(
        service(&layer, fenced_orders(calls.clone(), None)),
        tenant_a_post("k1"),
    )
    .await;
    assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(retry.json()["code"], "operation_failed");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "no attempt beyond the last"
    );
    let (state, _, _, id) = row(&pg, "k1").await.unwrap();
    assert_eq!(state, "failed");
    assert_eq!(id, Some(operation_id.to_string()));
    assert_eq!(attempts(&pg, "k1").await, 1);
    assert_eq!(pg.count("SELECT count(*) FROM orders").await, 0);
}

#[tokio::test]
async fn a_crashed_owner_is_taken_over_after_its_lease_with_a_larger_token() {
    let pg = Postgres::new().await;
    let (_dead, operation_id, dead_token) = crashed_owner(&pg, "k1").await;
    let calls = Arc::new(AtomicU64::new(0));
    let layer = long_layer(pg.store.clone(), Duration::from_secs(5));
    // While its lease holds, the dead owner's operation is "running".
    let early = send(
        service(&layer, fenced_orders(calls.clone(), None)),
        tenant_a_post("k1"),
    )
    .await;
    assert_eq!(early.status, StatusCode::ACCEPTED);
    assert!(early.replayed());
    assert_eq!(calls.load(Ordering::SeqCst), 0);

    until_lease_expired(&pg, "k1").await;
    let taken = send(
        service(&layer, fenced_orders(calls.clone(), None)),
        tenant_a_post("k1"),
    )
    .await;
    assert_eq!(taken.status, StatusCode::CREATED);
    let (state, token, _, id) = row(&pg, "k1").await.unwrap();
    assert_eq!(state, "completed");
    assert!(
        token > dead_token,
        "takeover raises the token: {token} > {dead_token}"
    );
    assert_eq!(
        id,
        Some(operation_id.to_string()),
        "the operation keeps its id"
    );
    assert_eq!(taken.json()["token"], token);
    assert_eq!(pg.count("SELECT count(*) FROM orders").await, 1);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_stale_owner_resuming_after_a_takeover_changes_nothing() {
    let pg = Postgres::new().await;
    let (stale, _, stale_token) = crashed_owner(&pg, "k1").await;
    until_lease_expired(&pg, "k1").await;
    let layer = long_layer(pg.store.clone(), Duration::from_secs(5));
    let taken = send(
        service(&layer, fenced_orders(Default::default(), None)),
        tenant_a_post("k1"),
    )
    .await;
    assert_eq!(taken.status, StatusCode::CREATED);
    let final_body: Vec<u8> = pg
        .value("SELECT response_body FROM idempotency_requests WHERE idempotency_key = 'k1'")
        .await;

    // The stale owner wakes up: every write, heartbeat and completion is refused.
    let refused = stale.transaction().await.expect_err("a fenced write");
    assert_eq!(refused.kind(), TxErrorKind::Fenced);
    assert!(stale.is_fenced());
    let heartbeat = pg
        .store
        .heartbeat(&stale, LEASE)
        .await
        .expect_err("fenced heartbeat");
    assert_eq!(heartbeat.kind(), StoreErrorKind::Fenced);
    let finish = pg
        .store
        .finish(&stale, &stored(b"stale"))
        .await
        .expect_err("fenced completion");
    assert_eq!(finish.kind(), StoreErrorKind::Fenced);
    let release = pg.store.release(&stale).await.expect_err("fenced release");
    assert_eq!(release.kind(), StoreErrorKind::Fenced);

    let (state, token, _, _) = row(&pg, "k1").await.unwrap();
    assert_eq!(state, "completed");
    assert!(token > stale_token);
    let body: Vec<u8> = pg
        .value("SELECT response_body FROM idempotency_requests WHERE idempotency_key = 'k1'")
        .await;
    assert_eq!(body, final_body, "the new owner's answer stands");
    assert_eq!(pg.count("SELECT count(*) FROM orders").await, 1);
}

/// A heartbeat that finds another token stops the owner's work: the
/// handler is dropped before it writes anything.
#[tokio::test]
async fn a_heartbeat_that_finds_a_newer_token_stops_the_work() {
    struct Dropped(Arc<Notify>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.notify_one();
        }
    }
    let pg = Postgres::new().await;
    let (started, dropped) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let never = Arc::new(Notify::new());
    let handler = {
        let (started, dropped, never) = (started.clone(), dropped.clone(), never.clone());
        tower::util::BoxCloneService::new(tower::service_fn(
            move |request: Request<RequestBody>| {
                let (started, dropped, never) = (started.clone(), dropped.clone(), never.clone());
                async move {
                    let _guard = Dropped(dropped);
                    let lease = request
                        .extensions()
                        .get::<PgLease>()
                        .cloned()
                        .ok_or("no lease")?;
                    started.notify_one();
                    never.notified().await;
                    let tx = lease.transaction().await?;
                    tx.execute(
                        "INSERT INTO orders (id, tenant_id) VALUES ('late', 'tenant-a')",
                        &[],
                    )
                    .await?;
                    tx.commit().await?;
                    Ok::<_, BoxError>(created("{}"))
                }
            },
        ))
    };
    let layer = long_layer(pg.store.clone(), Duration::from_millis(50));
    let first = send(service(&layer, handler), tenant_a_post("k1")).await;
    assert_eq!(first.status, StatusCode::ACCEPTED);
    started.notified().await;
    // What a takeover by another process does to the row.
    pg.exec(
        "UPDATE idempotency_requests SET attempt_token = nextval('idempotency_attempt_token_seq')",
    )
    .await;
    let newer: i64 = pg
        .value("SELECT attempt_token FROM idempotency_requests")
        .await;
    tokio::time::timeout(Duration::from_secs(5), dropped.notified())
        .await
        .expect("the fenced owner's work is stopped");
    layer.drained().await;
    assert_eq!(pg.count("SELECT count(*) FROM orders").await, 0);
    let (state, token, _, _) = row(&pg, "k1").await.unwrap();
    assert_eq!(
        (state.as_str(), token),
        ("in_progress", newer),
        "the new owner's row is untouched"
    );
}

/// The check and the commit of a fenced transaction cannot be split by a
/// takeover: the takeover waits for the row the transaction holds.
#[tokio::test]
async fn a_takeover_waits_for_an_open_fenced_transaction_and_then_wins() {
    let pg = Postgres::new().await;
    let (owner, _, owner_token) = crashed_owner(&pg, "k1").await;
    let tx = owner
        .transaction()
        .await
        .expect("the owner still holds the newest token");
    // Poll through the transaction itself: PostgreSQL ends a fenced
    // transaction left idle for a whole lease (a stalled owner).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let expired: bool = tx
            .query_one(
                "SELECT lease_expires_at <= clock_timestamp() FROM idempotency_requests WHERE idempotency_key = 'k1'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if expired {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the lease never expired"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let fingerprint = layer_fingerprint(&pg, "k1").await;
    let takeover = LeaseRequest::new(
        LEASE,
        OperationId::random(),
        StoredRequest::new(http::Method::POST, "/orders", vec![], Bytes::new()),
    );
    let short = claim("k1", fingerprint).with_wait(Duration::from_millis(200));
    let blocked = pg.store.acquire(&short, &takeover).await.unwrap();
    assert!(matches!(blocked, Acquired::InProgress), "held: {blocked:?}");
    tx.execute(
        "INSERT INTO orders (id, tenant_id) VALUES ('o1', 'tenant-a')",
        &[],
    )
    .await
    .unwrap();
    tx.commit()
        .await
        .expect("the write commits: no newer owner exists");
    match pg.store.acquire(&short, &takeover).await.unwrap() {
        Acquired::Owned(owned) => assert!(owned.taken_over && owned.token > owner_token),
        other => panic!("the takeover wins once the row is free: {other:?}"),
    }
    assert_eq!(pg.count("SELECT count(*) FROM orders").await, 1);
    let late = owner.transaction().await.expect_err("now fenced");
    assert_eq!(late.kind(), TxErrorKind::Fenced);
}

/// An owner that stalls inside a fenced transaction (its process frozen)
/// blocks takeovers for at most about a lease: PostgreSQL ends the idle
/// transaction, and its writes are gone.
#[tokio::test]
async fn a_fenced_transaction_left_idle_does_not_block_takeovers_for_good() {
    let pg = Postgres::new().await;
    let (owner, _, owner_token) = crashed_owner(&pg, "k1").await;
    let tx = owner.transaction().await.unwrap();
    tx.execute(
        "INSERT INTO orders (id, tenant_id) VALUES ('o1', 'tenant-a')",
        &[],
    )
    .await
    .unwrap();
    until_lease_expired(&pg, "k1").await;
    let layer = long_layer(pg.store.clone(), Duration::from_secs(5)).wait(Duration::from_secs(3));
    let taken = send(
        service(&layer, fenced_orders(Default::default(), None)),
        tenant_a_post("k1"),
    )
    .await;
    assert_eq!(taken.status, StatusCode::CREATED, "{:?}", taken.body);
    assert!(row(&pg, "k1").await.unwrap().1 > owner_token);
    assert!(
        tx.commit().await.is_err(),
        "the stalled transaction was ended"
    );
    let orders = pg.column::<String>("SELECT id FROM orders").await;
    assert_eq!(orders.len(), 1);
    assert_ne!(orders[0], "o1", "the stalled owner's write is gone");
}

#[tokio::test]
async fn twenty_concurrent_takeovers_have_one_winner() {
    let pg = Postgres::with_pool(24).await;
    let (_dead, _, dead_token) = crashed_owner(&pg, "k1").await;
    until_lease_expired(&pg, "k1").await;
    let (calls, gate) = (Arc::new(AtomicU64::new(0)), Arc::new(Notify::new()));
    let layer =
        long_layer(pg.store.clone(), Duration::from_millis(50)).wait(Duration::from_secs(3));
    // Twenty layers: twenty processes, no in-process coalescing between them.
    let requests: Vec<_> = (0..20)
        .map(|_| {
            let layer = long_layer(pg.store.clone(), Duration::from_millis(50));
            spawn_send(
                service(&layer, fenced_orders(calls.clone(), Some(gate.clone()))),
                tenant_a_post("k1"),
            )
        })
        .collect();
    let mut accepted = 0;
    let mut replayed = 0;
    for request in requests {
        let answer = request.await.unwrap();
        assert_eq!(answer.status, StatusCode::ACCEPTED, "{:?}", answer.body);
        if answer.replayed() {
            replayed += 1;
        } else {
            accepted += 1;
        }
    }
    assert_eq!((accepted, replayed), (1, 19), "one winner");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let (_, token, _, _) = row(&pg, "k1").await.unwrap();
    assert!(token > dead_token);
    gate.notify_one();
    until_completed(&pg, "k1").await;
    assert_eq!(pg.count("SELECT count(*) FROM orders").await, 1);
    drop(layer);
}

#[tokio::test]
async fn heartbeats_keep_a_slow_but_alive_owner_from_being_taken_over() {
    let pg = Postgres::new().await;
    let (calls, gate) = (Arc::new(AtomicU64::new(0)), Arc::new(Notify::new()));
    let layer = long_layer(pg.store.clone(), Duration::from_millis(50));
    let handler = fenced_orders(calls.clone(), Some(gate.clone()));
    let first = send(service(&layer, handler.clone()), tenant_a_post("k1")).await;
    assert_eq!(first.status, StatusCode::ACCEPTED);
    let (_, token, _, _) = row(&pg, "k1").await.unwrap();
    // Three leases pass: the work is slow, not dead.
    tokio::time::sleep(LEASE * 3).await;
    let live: bool = pg
        .value("SELECT lease_expires_at > now() FROM idempotency_requests WHERE idempotency_key = 'k1'")
        .await;
    assert!(live, "heartbeats renewed the lease");
    let duplicate = send(service(&layer, handler), tenant_a_post("k1")).await;
    assert_eq!(duplicate.status, StatusCode::ACCEPTED);
    assert!(duplicate.replayed());
    assert_eq!(row(&pg, "k1").await.unwrap().1, token, "nobody took over");
    gate.notify_one();
    until_completed(&pg, "k1").await;
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(pg.count("SELECT count(*) FROM orders").await, 1);
}

#[tokio::test]
async fn the_token_keeps_growing_after_remove_key() {
    let pg = Postgres::new().await;
    let layer = long_layer(pg.store.clone(), Duration::from_secs(5));
    send(
        service(&layer, fenced_orders(Default::default(), None)),
        tenant_a_post("k1"),
    )
    .await;
    let (_, first, _, _) = row(&pg, "k1").await.unwrap();
    let scope = Scope::new(TenantId::new("tenant-a"), ENDPOINT);
    let key = IdempotencyKey::parse(b"k1").unwrap();
    assert!(pg.store.remove_key(&scope, &key, "test").await.unwrap());
    send(
        service(&layer, fenced_orders(Default::default(), None)),
        tenant_a_post("k1"),
    )
    .await;
    let (_, second, _, _) = row(&pg, "k1").await.unwrap();
    assert!(second > first, "{second} > {first}");
}

#[tokio::test]
async fn the_status_resource_answers_its_tenant_only() {
    let pg = Postgres::new().await;
    let gate = Arc::new(Notify::new());
    let layer = long_layer(pg.store.clone(), Duration::from_millis(50));
    let first = send(
        service(
            &layer,
            fenced_orders(Default::default(), Some(gate.clone())),
        ),
        tenant_a_post("k1"),
    )
    .await;
    let id = first.json()["operation_id"].as_str().unwrap().to_owned();
    let status = |tenant: Option<&str>, path: String| {
        let mut request = Request::get(path).body(Full::new(Bytes::new())).unwrap();
        if let Some(tenant) = tenant {
            request.extensions_mut().insert(TenantId::new(tenant));
        }
        let service = layer.status_service();
        async move {
            let response = service.oneshot(request).await.unwrap();
            let status = response.status();
            let body = http_body_util::BodyExt::collect(response.into_body())
                .await
                .unwrap()
                .to_bytes();
            (
                status,
                serde_json::from_slice::<serde_json::Value>(&body).unwrap(),
            )
        }
    };
    let (code, body) = status(Some("tenant-a"), format!("/operations/{id}")).await;
    assert_eq!(code, StatusCode::OK);
    assert_eq!(
        body,
        serde_json::json!({"operation_id": id, "state": "running", "attempts": 1})
    );
    for (tenant, path) in [
        (Some("tenant-b"), format!("/operations/{id}")),
        (
            Some("tenant-a"),
            format!("/operations/{}", OperationId::random()),
        ),
        (Some("tenant-a"), "/operations/not-an-id".to_owned()),
        (
            Some("tenant-a"),
            format!("/operations/{}", id.to_uppercase().replace('-', "")),
        ),
    ] {
        let (code, body) = status(tenant, path.clone()).await;
        assert_eq!(code, StatusCode::NOT_FOUND, "{tenant:?} {path}");
        assert_eq!(body["code"], "not_found");
    }
    let (code, _) = status(None, format!("/operations/{id}")).await;
    assert_eq!(code, StatusCode::UNAUTHORIZED);
    gate.notify_one();
    until_completed(&pg, "k1").await;
    let (code, body) = status(Some("tenant-a"), format!("/operations/{id}")).await;
    assert_eq!(code, StatusCode::OK);
    assert_eq!(body["state"], "completed");
    assert_eq!(body["result"]["status"], 201);
    let final_answer = send(
        service(&layer, fenced_orders(Default::default(), None)),
        tenant_a_post("k1"),
    )
    .await;
    assert_eq!(body["result"]["body"], final_answer.json());
}

#[tokio::test]
async fn the_recovery_worker_completes_an_abandoned_operation_with_nobody_retrying() {
    let pg = Postgres::new().await;
    let (_dead, operation_id, dead_token) = crashed_owner(&pg, "k1").await;
    let calls = Arc::new(AtomicU64::new(0));
    let layer = long_layer(pg.store.clone(), Duration::from_secs(5));
    let recovery = layer.recovery(fenced_orders(calls.clone(), None));
    assert_eq!(
        recovery.run_once().await.unwrap(),
        0,
        "the lease still holds"
    );
    until_lease_expired(&pg, "k1").await;
    assert_eq!(recovery.run_once().await.unwrap(), 1);
    assert_eq!(recovery.run_once().await.unwrap(), 0, "once only");
    let (state, token, _, id) = row(&pg, "k1").await.unwrap();
    assert_eq!(state, "completed");
    assert!(token > dead_token);
    assert_eq!(id, Some(operation_id.to_string()));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let tenants = pg.column::<String>("SELECT tenant_id FROM orders").await;
    assert_eq!(
        tenants,
        ["tenant-a"],
        "re-driven for the operation's tenant"
    );
    // The client's retry gets the recovered answer.
    let retry = send(
        service(&layer, fenced_orders(calls.clone(), None)),
        tenant_a_post("k1"),
    )
    .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn recovery_workers_of_two_instances_never_drive_one_operation_twice() {
    let pg = Postgres::new().await;
    for key in ["k1", "k2", "k3"] {
        crashed_owner(&pg, key).await;
    }
    for key in ["k1", "k2", "k3"] {
        until_lease_expired(&pg, key).await;
    }
    let calls = Arc::new(AtomicU64::new(0));
    let (a, b) = (
        long_layer(pg.store.clone(), Duration::from_secs(5)),
        long_layer(pg.store.clone(), Duration::from_secs(5)),
    );
    let (ra, rb) = (
        a.recovery(fenced_orders(calls.clone(), None)),
        b.recovery(fenced_orders(calls.clone(), None)),
    );
    let (na, nb) = tokio::join!(ra.run_once(), rb.run_once());
    assert_eq!(na.unwrap() + nb.unwrap(), 3);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_eq!(pg.count("SELECT count(*) FROM orders").await, 3);
    assert_eq!(
        pg.count("SELECT count(*) FROM idempotency_requests WHERE state = 'completed'")
            .await,
        3
    );
}

#[tokio::test]
async fn the_lease_store_passes_the_conformance_suite() {
    let pg = Postgres::new().await;
    tower_idempotency::testing::conformance::run_leases(pg.store.clone())
        .await
        .assert_passed();
}

/// `PgStore`, except that a takeover by the recovery worker, once
/// committed, asks for shutdown and takes two more polls to return.
#[derive(Clone, Default)]
struct SlowTakeover {
    inner: Option<PgStore>,
    /// A committed takeover has not returned yet.
    in_flight: Arc<AtomicBool>,
    /// The shutdown future was polled while `in_flight`.
    raced: Arc<AtomicBool>,
    /// Shutdown was asked for.
    requested: Arc<AtomicBool>,
    waker: Arc<Mutex<Option<std::task::Waker>>>,
    /// `fail` waits for it, then notes that it has failed the operation.
    fail_gate: Arc<Notify>,
    failed: Arc<AtomicBool>,
}

impl SlowTakeover {
    fn store(&self) -> &PgStore {
        self.inner.as_ref().unwrap()
    }

    /// The worker's shutdown signal: resolves once asked for, and notes
    /// whether it was polled while a takeover was in flight.
    fn shutdown(&self) -> impl std::future::Future<Output = ()> + Send {
        let this = self.clone();
        std::future::poll_fn(move |cx| {
            if this.in_flight.load(Ordering::SeqCst) {
                this.raced.store(true, Ordering::SeqCst);
            }
            if this.requested.load(Ordering::SeqCst) {
                return std::task::Poll::Ready(());
            }
            *this.waker.lock().unwrap() = Some(cx.waker().clone());
            std::task::Poll::Pending
        })
    }
}

impl tower_idempotency::store::Store for SlowTakeover {
    type Tx = tower_idempotency::postgres::PgTx;
    async fn claim(
        &self,
        request: &ClaimRequest,
    ) -> Result<tower_idempotency::store::Claim<Self::Tx>, tower_idempotency::store::StoreError>
    {
        self.store().claim(request).await
    }
    async fn complete(
        &self,
        tx: Self::Tx,
        response: &tower_idempotency::record::StoredResponse,
    ) -> Result<(), tower_idempotency::store::StoreError> {
        self.store().complete(tx, response).await
    }
    async fn abort(&self, tx: Self::Tx) -> Result<(), tower_idempotency::store::StoreError> {
        self.store().abort(tx).await
    }
}

impl LeaseStore for SlowTakeover {
    type Lease = PgLease;
    async fn acquire(
        &self,
        claim: &ClaimRequest,
        lease: &LeaseRequest,
    ) -> Result<Acquired<PgLease>, tower_idempotency::store::StoreError> {
        self.store().acquire(claim, lease).await
    }
    async fn heartbeat(
        &self,
        lease: &PgLease,
        extend: Duration,
    ) -> Result<(), tower_idempotency::store::StoreError> {
        self.store().heartbeat(lease, extend).await
    }
    async fn fenced(
        &self,
        lease: &PgLease,
    ) -> Result<Self::Tx, tower_idempotency::store::StoreError> {
        self.store().fenced(lease).await
    }
    async fn commit_fenced(
        &self,
        tx: Self::Tx,
    ) -> Result<(), tower_idempotency::store::StoreError> {
        self.store().commit_fenced(tx).await
    }
    async fn finish(
        &self,
        lease: &PgLease,
        response: &tower_idempotency::record::StoredResponse,
    ) -> Result<(), tower_idempotency::store::StoreError> {
        self.store().finish(lease, response).await
    }
    async fn release(&self, lease: &PgLease) -> Result<(), tower_idempotency::store::StoreError> {
        self.store().release(lease).await
    }
    async fn fail(
        &self,
        lease: &PgLease,
        response: &tower_idempotency::record::StoredResponse,
        attempts: u32,
    ) -> Result<(), tower_idempotency::store::StoreError> {
        self.fail_gate.notified().await;
        let failed = self.store().fail(lease, response, attempts).await;
        self.failed.store(true, Ordering::SeqCst);
        failed
    }
    async fn operation(
        &self,
        tenant: &TenantId,
        id: OperationId,
    ) -> Result<Option<tower_idempotency::store::Operation>, tower_idempotency::store::StoreError>
    {
        self.store().operation(tenant, id).await
    }
    async fn recover(
        &self,
        endpoint: &str,
        lease: Duration,
        retention: Duration,
        backoff: tower_idempotency::store::Backoff,
    ) -> Result<
        Option<tower_idempotency::store::Recovered<PgLease>>,
        tower_idempotency::store::StoreError,
    > {
        let recovered = self
            .store()
            .recover(endpoint, lease, retention, backoff)
            .await?;
        if recovered.is_some() {
            self.in_flight.store(true, Ordering::SeqCst);
            self.requested.store(true, Ordering::SeqCst);
            if let Some(waker) = self.waker.lock().unwrap().take() {
                waker.wake();
            }
            // Pending twice: whoever polls the worker meanwhile polls its
            // shutdown signal too, if it races the takeover against it.
            tokio::task::yield_now().await;
            tokio::task::yield_now().await;
            self.in_flight.store(false, Ordering::SeqCst);
        }
        Ok(recovered)
    }
}

/// Shutdown does not cut a takeover short: one that had committed would
/// leave its operation under a lease nobody runs, with an attempt used up.
/// The worker finishes the takeover, hands the operation to its work
/// (which [`IdempotencyLayer::drained`] waits for), then stops.
#[tokio::test]
async fn the_recovery_worker_stops_after_a_takeover_in_flight_is_handed_to_its_work() {
    let pg = Postgres::new().await;
    let (_dead, _, dead_token) = crashed_owner(&pg, "k1").await;
    until_lease_expired(&pg, "k1").await;
    let store = SlowTakeover {
        inner: Some(pg.store.clone()),
        ..SlowTakeover::default()
    };
    let layer = IdempotencyLayer::new(store.clone(), ENDPOINT, JsonFingerprinter::new("orders.v1"))
        .long_running(
            LeaseConfig::new(LEASE)
                .heartbeat(Duration::from_millis(100))
                .recovery_backoff(Duration::ZERO, Duration::ZERO),
        );
    let calls = Arc::new(AtomicU64::new(0));
    layer
        .recovery(fenced_orders(calls.clone(), None))
        .run(store.shutdown())
        .await;
    layer.drained().await;
    assert!(
        !store.raced.load(Ordering::SeqCst),
        "shutdown was raced against a committed takeover"
    );
    let (state, token, _, _) = row(&pg, "k1").await.unwrap();
    assert_eq!(state, "completed", "the taken-over operation was driven");
    assert!(token > dead_token);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A recovered operation whose stored request no longer validates ends
/// failed on a task of its own; [`IdempotencyLayer::drained`] waits for it.
#[tokio::test]
async fn drained_waits_for_an_operation_the_recovery_worker_fails() {
    #[derive(serde::Deserialize, serde::Serialize)]
    #[serde(deny_unknown_fields)]
    struct NoFields {}
    let pg = Postgres::new().await;
    let (_dead, _, _) = crashed_owner(&pg, "k1").await;
    until_lease_expired(&pg, "k1").await;
    let store = SlowTakeover {
        inner: Some(pg.store.clone()),
        ..SlowTakeover::default()
    };
    let layer = IdempotencyLayer::new(
        store.clone(),
        ENDPOINT,
        tower_idempotency::fingerprint::TypedFingerprinter::<NoFields>::new("orders.v1"),
    )
    .long_running(LeaseConfig::new(LEASE).recovery_backoff(Duration::ZERO, Duration::ZERO));
    let calls = Arc::new(AtomicU64::new(0));
    layer
        .recovery(fenced_orders(calls.clone(), None))
        .run(store.shutdown())
        .await;
    let open_the_gate = async {
        tokio::task::yield_now().await;
        store.fail_gate.notify_one();
    };
    tokio::join!(layer.drained(), open_the_gate);
    assert!(
        store.failed.load(Ordering::SeqCst),
        "drained returned before the operation was failed"
    );
    let (state, _, _, _) = row(&pg, "k1").await.unwrap();
    assert_eq!(state, "failed");
    assert_eq!(calls.load(Ordering::SeqCst), 0, "it could not run");
}

/// A key that is itself a quoted string (sent as `"\"q1\""`: the key `"q1"`,
/// quotes included) is accepted, and the recovery worker, reading it back
/// from the store, drives the operation under that same key; a retry gets
/// its answer.
#[tokio::test]
async fn a_key_that_is_a_quoted_string_keeps_its_operation_through_recovery() {
    let pg = Postgres::new().await;
    let sent = r#""\"q1\"""#;
    let stored = r#""q1""#;
    let (_dead, operation_id, dead_token) = crashed_owner(&pg, sent).await;
    until_lease_expired(&pg, stored).await;
    let calls = Arc::new(AtomicU64::new(0));
    let layer = long_layer(pg.store.clone(), Duration::from_secs(5));
    let recovery = layer.recovery(fenced_orders(calls.clone(), None));
    assert_eq!(recovery.run_once().await.unwrap(), 1);
    let (state, token, _, id) = row(&pg, stored).await.unwrap();
    assert_eq!(state, "completed");
    assert!(token > dead_token);
    assert_eq!(id, Some(operation_id.to_string()));
    assert_eq!(row(&pg, "q1").await, None, "no other key was touched");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    let retry = send(
        service(&layer, fenced_orders(calls.clone(), None)),
        tenant_a_post(sent),
    )
    .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(retry.replayed());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A retention shorter than the lease plus the recovery backoff: a released
/// operation must still be there when it may be resumed, or its operation
/// id, and the work keyed by it, would be forgotten and run again under a
/// new one. The retention is raised to cover them.
#[tokio::test]
async fn a_retention_shorter_than_the_recovery_backoff_keeps_a_released_operation() {
    let pg = Postgres::new().await;
    pg.exec("CREATE TABLE charges (key text PRIMARY KEY, operation_id text NOT NULL, token bigint NOT NULL)")
        .await;
    let calls = Arc::new(AtomicU64::new(0));
    let handler = charge_once_then(FirstAttempt::BadGateway, calls.clone());
    let retention = Duration::from_millis(300);
    let layer = IdempotencyLayer::new(
        pg.store.clone(),
        ENDPOINT,
        JsonFingerprinter::new("orders.v1"),
    )
    .wait(Duration::from_millis(500))
    .retention(retention)
    .long_running(
        LeaseConfig::new(LEASE)
            .heartbeat(Duration::from_millis(100))
            .respond_within(Duration::from_secs(5))
            .recovery_backoff(Duration::from_secs(2), Duration::from_secs(2)),
    );
    let first = send(service(&layer, handler.clone()), tenant_a_post("k1")).await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY);
    let (_, _, _, id) = row(&pg, "k1").await.expect("the record stays");
    let id = id.expect("an operation id");
    // The behaviour under test is time passing: past the configured
    // retention, within the lease plus the backoff.
    tokio::time::sleep(retention * 3).await;
    let retry = send(service(&layer, handler), tenant_a_post("k1")).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert_eq!(
        retry.json()["operation_id"],
        id.as_str(),
        "the same operation"
    );
    assert_eq!(
        pg.count("SELECT count(*) FROM charges").await,
        1,
        "charged once"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}
