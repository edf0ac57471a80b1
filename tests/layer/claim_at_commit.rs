//! The one-commit mode (`IdempotencyLayer::claim_at_commit`) against a real
//! PostgreSQL, on both stores: duplicates on two instances may both run the
//! handler, and exactly one commit wins; duplicates in one instance run it
//! once; every answer is the winner's.

use crate::common;

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc,
};

use bytes::Bytes;
use common::*;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use serde_json::json;
use tokio::sync::Barrier;
use tower::Layer;
use tower_idempotency::{store::CommitStore, ClaimAtCommit, IdempotencyLayer, RequestBody};

/// A backend whose store can be had twice: two instances of the service on
/// one database, each with its own pool and its own in-process coalescing.
trait TwoInstances: Backend<Store: CommitStore> {
    fn second_store(&self) -> impl std::future::Future<Output = Self::Store> + Send;
}

impl TwoInstances for Postgres {
    async fn second_store(&self) -> Self::Store {
        tower_idempotency::postgres::PgStore::builder(self.db.config())
            .max_connections(4)
            .build()
            .expect("a second store")
    }
}

impl TwoInstances for Sqlx {
    async fn second_store(&self) -> Self::Store {
        tower_idempotency::sqlx::SqlxStore::new(sqlx_pool(&self.db, 4).await)
    }
}

fn one_commit<St: CommitStore>(
    store: St,
) -> IdempotencyLayer<
    St,
    tower_idempotency::fingerprint::JsonFingerprinter,
    tower_idempotency::scope::TenantFromExtension,
    ClaimAtCommit,
> {
    layer(store).claim_at_commit()
}

/// A handler that writes an order under a fresh id, then waits at `meet`
/// (when given) so that two instances are both inside their transactions
/// before either commits, and answers 201 with the order; counts its runs.
fn meeting_handler<B: Backend>(calls: Arc<AtomicU64>, meet: Option<Arc<Barrier>>) -> Handler {
    tower::util::BoxCloneService::new(tower::service_fn(move |request: Request<RequestBody>| {
        let (calls, meet) = (calls.clone(), meet.clone());
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            let (id, _) = write_order::<B>(&request).await?;
            if let Some(meet) = meet {
                meet.wait().await;
            }
            let body = json!({"id": id}).to_string();
            Ok::<_, BoxError>(
                Response::builder()
                    .status(StatusCode::CREATED)
                    .header("content-type", "application/json")
                    .header("location", format!("/orders/{id}"))
                    .body(Full::new(Bytes::from(body)))
                    .unwrap(),
            )
        }
    }))
}

/// The record of `key` as (state, status, body).
async fn record<B: Backend>(
    client: &tokio_postgres::Client,
    key: &str,
) -> Vec<(String, i16, Vec<u8>)> {
    client
        .query(
            "SELECT state, response_status, response_body FROM idempotency_requests \
             WHERE tenant_id = 'tenant-a' AND endpoint = 'POST /orders v1' AND idempotency_key = $1",
            &[&key],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

async fn duplicates_on_two_instances_commit_once<B: TwoInstances>(
    backend: &B,
    client: &tokio_postgres::Client,
) {
    let calls = Arc::new(AtomicU64::new(0));
    let meet = Arc::new(Barrier::new(2));
    let first =
        one_commit(backend.store()).layer(meeting_handler::<B>(calls.clone(), Some(meet.clone())));
    let second = one_commit(backend.second_store().await)
        .layer(meeting_handler::<B>(calls.clone(), Some(meet)));
    let (a, b) = tokio::join!(
        spawn_send(first, tenant_a_post("two-instances")),
        spawn_send(second, tenant_a_post("two-instances")),
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "both instances ran the handler"
    );
    assert_eq!(
        (a.status, b.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert_eq!(a.body, b.body, "the loser answers the winner's body");
    assert_eq!(a.headers.get("location"), b.headers.get("location"));
    assert_eq!(
        [a.replayed(), b.replayed()].iter().filter(|r| **r).count(),
        1,
        "exactly one answer is the winner's own, the other its replay"
    );
    let orders = backend.orders().await;
    assert_eq!(orders.len(), 1, "one commit, one order: {orders:?}");
    assert_eq!(
        a.json()["id"],
        orders[0].0.as_str(),
        "the answer names the committed order"
    );
    let rows = record::<B>(client, "two-instances").await;
    assert_eq!(rows.len(), 1);
    assert_eq!((rows[0].0.as_str(), rows[0].1), ("completed", 201));
    assert_eq!(
        rows[0].2,
        a.body.to_vec(),
        "the record holds the answer both got"
    );
}

async fn duplicates_in_one_instance_run_the_handler_once<B: TwoInstances>(backend: &B) {
    let calls = Arc::new(AtomicU64::new(0));
    let service = one_commit(backend.store()).layer(meeting_handler::<B>(calls.clone(), None));
    let answers: Vec<_> = (0..10)
        .map(|_| spawn_send(service.clone(), tenant_a_post("one-instance")))
        .collect();
    let mut bodies = Vec::new();
    for answer in answers {
        let answer = answer.await.unwrap();
        assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
        bodies.push(answer.body);
    }
    assert!(
        bodies.windows(2).all(|w| w[0] == w[1]),
        "every duplicate got the same answer"
    );
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "one handler run in one instance"
    );
    assert_eq!(backend.orders().await.len(), 1);
}

async fn a_retry_on_another_instance_rolls_back_and_replays<B: TwoInstances>(
    backend: &B,
    client: &tokio_postgres::Client,
) {
    let calls = Arc::new(AtomicU64::new(0));
    let first = one_commit(backend.store()).layer(meeting_handler::<B>(calls.clone(), None));
    let second =
        one_commit(backend.second_store().await).layer(meeting_handler::<B>(calls.clone(), None));
    let created = send(first, tenant_a_post("retry")).await;
    assert_eq!(created.status, StatusCode::CREATED);
    assert!(!created.replayed());
    let retried = send(second.clone(), tenant_a_post("retry")).await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "the other instance ran the handler, then lost"
    );
    assert_eq!(retried.status, StatusCode::CREATED);
    assert!(retried.replayed());
    assert_eq!(retried.body, created.body, "byte for byte");
    assert_eq!(
        backend.orders().await.len(),
        1,
        "the loser's order was rolled back"
    );

    let reused = send(
        second,
        post(
            Some("tenant-a"),
            Some("retry"),
            r#"{"checkout_id":"other","amount":1}"#,
        ),
    )
    .await;
    assert_eq!(reused.status, StatusCode::CONFLICT);
    assert_eq!(reused.json()["code"], "idempotency_key_reused");
    assert_eq!(
        backend.orders().await.len(),
        1,
        "the refused request's order was rolled back"
    );
    assert_eq!(record::<B>(client, "retry").await.len(), 1);
}

async fn a_failed_handler_commits_nothing<B: TwoInstances>(
    backend: &B,
    client: &tokio_postgres::Client,
) {
    let failing = tower::util::BoxCloneService::new(tower::service_fn(
        move |request: Request<RequestBody>| async move {
            let tx = tx_of::<B>(&request).ok_or("no transaction handle")?;
            B::insert_order(&tx, &new_order_id(), "tenant-a").await?;
            Ok::<_, BoxError>(response(StatusCode::BAD_GATEWAY, "upstream down"))
        },
    ));
    let answer = send(
        one_commit(backend.store()).layer(failing),
        tenant_a_post("fails"),
    )
    .await;
    assert_eq!(answer.status, StatusCode::BAD_GATEWAY);
    assert!(
        backend.orders().await.is_empty(),
        "a 5xx rolls the order back"
    );
    assert!(
        record::<B>(client, "fails").await.is_empty(),
        "and remembers nothing"
    );
    let calls = Arc::new(AtomicU64::new(0));
    let answer = send(
        one_commit(backend.store()).layer(meeting_handler::<B>(calls, None)),
        tenant_a_post("fails"),
    )
    .await;
    assert_eq!(
        answer.status,
        StatusCode::CREATED,
        "the key is free for the retry"
    );
    assert_eq!(backend.orders().await.len(), 1);
}

/// A key whose record expired but is still in the table (cleanup has not
/// run) is a new operation. The commit's insert meets the old row; the
/// store removes it (`Committed::Freed`) and the layer runs the work
/// again on the free key: the handler runs twice for that request, the
/// first run's order is rolled back, and the key's one row holds the new
/// answer, under a larger token, remembered anew. Sent to a second
/// instance, whose replay cache does not hold the first answer.
async fn an_expired_record_is_taken_over_by_a_second_run<B: TwoInstances>(
    backend: &B,
    client: &tokio_postgres::Client,
) {
    let calls = Arc::new(AtomicU64::new(0));
    let first = send(
        one_commit(backend.store()).layer(meeting_handler::<B>(calls.clone(), None)),
        tenant_a_post("expired"),
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let old_token: i64 = client
        .query_one(
            "UPDATE idempotency_requests SET expires_at = now() - interval '1 second' \
             WHERE idempotency_key = 'expired' RETURNING attempt_token",
            &[],
        )
        .await
        .unwrap()
        .get(0);

    let second = send(
        one_commit(backend.second_store().await).layer(meeting_handler::<B>(calls.clone(), None)),
        tenant_a_post("expired"),
    )
    .await;
    assert_eq!(second.status, StatusCode::CREATED);
    assert!(!second.replayed(), "a new operation, not a replay");
    assert_ne!(second.json()["id"], first.json()["id"]);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        3,
        "the first request once, the second twice (its first run met the expired row)"
    );
    let mut orders: Vec<String> = backend
        .orders()
        .await
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    orders.sort();
    let mut answered = vec![
        first.json()["id"].as_str().unwrap().to_owned(),
        second.json()["id"].as_str().unwrap().to_owned(),
    ];
    answered.sort();
    assert_eq!(
        orders, answered,
        "one order per operation; the freed run's rolled back"
    );
    assert_eq!(
        record::<B>(client, "expired").await,
        [("completed".to_owned(), 201, second.body.to_vec())]
    );
    let row = client
        .query_one(
            "SELECT attempt_token, expires_at > now() + interval '1 hour' \
             FROM idempotency_requests WHERE idempotency_key = 'expired'",
            &[],
        )
        .await
        .unwrap();
    let (token, remembered): (i64, bool) = (row.get(0), row.get(1));
    assert!(token > old_token, "token {token} after {old_token}");
    assert!(remembered, "remembered for the retention from this commit");
}

/// The state and token of `key`'s rows.
async fn state_and_token(client: &tokio_postgres::Client, key: &str) -> Vec<(String, i64)> {
    client
        .query(
            "SELECT state, attempt_token FROM idempotency_requests WHERE idempotency_key = $1",
            &[&key],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// A key whose row is an operation of the long-running mode: under a live
/// lease it is held (the one-commit request's work is rolled back, it is
/// answered `409 idempotency_in_progress`, and the row stays as it was);
/// once the lease has expired the row may be taken over, and the request
/// runs its work again on the freed key and commits.
async fn a_leased_key_is_held_and_an_expired_lease_is_taken_over<B: TwoInstances>(
    backend: &B,
    client: &tokio_postgres::Client,
) {
    client
        .batch_execute(
            "INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, \
                 request_fingerprint, state, expires_at, lease_expires_at) \
             VALUES ('tenant-a', 'POST /orders v1', 'leased', '\\x00', 'in_progress', \
                 now() + interval '1 day', now() + interval '1 hour')",
        )
        .await
        .unwrap();
    let leased = state_and_token(client, "leased").await;
    let calls = Arc::new(AtomicU64::new(0));
    let held = send(
        one_commit(backend.store()).layer(meeting_handler::<B>(calls.clone(), None)),
        tenant_a_post("leased"),
    )
    .await;
    assert_eq!(held.status, StatusCode::CONFLICT);
    assert_eq!(held.json()["code"], "idempotency_in_progress");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "run once, not again");
    assert!(backend.orders().await.is_empty(), "its order rolled back");
    assert_eq!(
        state_and_token(client, "leased").await,
        leased,
        "the operation untouched"
    );

    client
        .batch_execute(
            "UPDATE idempotency_requests SET lease_expires_at = now() - interval '1 second' \
             WHERE idempotency_key = 'leased'",
        )
        .await
        .unwrap();
    let taken = send(
        one_commit(backend.second_store().await).layer(meeting_handler::<B>(calls.clone(), None)),
        tenant_a_post("leased"),
    )
    .await;
    assert_eq!(taken.status, StatusCode::CREATED);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        3,
        "its first run met the row, its second won"
    );
    let orders = backend.orders().await;
    assert_eq!(orders.len(), 1);
    assert_eq!(taken.json()["id"], orders[0].0.as_str());
    let now = state_and_token(client, "leased").await;
    assert_eq!(now.len(), 1);
    assert_eq!(now[0].0, "completed");
    assert!(
        now[0].1 > leased[0].1,
        "a larger token: {now:?} after {leased:?}"
    );
}

/// A handler whose order is unique in the domain (one per checkout: its id
/// is the checkout's). Its insert fails once the first order is committed;
/// it answers that failure with a `503`, or, if `ignores_errors`, answers
/// `201` all the same (so that its commit fails).
fn one_order_per_checkout<B: Backend>(ignores_errors: bool) -> Handler {
    tower::util::BoxCloneService::new(tower::service_fn(
        move |request: Request<RequestBody>| async move {
            let tx = tx_of::<B>(&request).ok_or("no transaction handle")?;
            let inserted = B::insert_order(&tx, "order-of-chk-1", "tenant-a").await;
            Ok::<_, BoxError>(match inserted {
                Err(_) if !ignores_errors => response(StatusCode::SERVICE_UNAVAILABLE, "try again"),
                _ => created(r#"{"id":"order-of-chk-1"}"#),
            })
        },
    ))
}

/// A retry that reaches an instance without the key in its replay cache
/// runs the handler, whose insert now meets the domain's unique key: the
/// retry still gets the first answer (the mode reads the key once the work
/// is rolled back), and another request under the key is refused.
async fn a_retry_that_meets_a_unique_key_of_the_domain_replays<B: TwoInstances>(
    backend: &B,
    client: &tokio_postgres::Client,
) {
    let created = send(
        one_commit(backend.store()).layer(one_order_per_checkout::<B>(false)),
        tenant_a_post("domain"),
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED);
    for ignores_errors in [false, true] {
        let other = one_commit(backend.second_store().await)
            .layer(one_order_per_checkout::<B>(ignores_errors));
        let retried = send(other.clone(), tenant_a_post("domain")).await;
        assert_eq!(
            (retried.status, retried.replayed()),
            (StatusCode::CREATED, true),
            "ignores errors: {ignores_errors}: {:?}",
            retried.body
        );
        assert_eq!(retried.body, created.body, "byte for byte");
        let reused = send(
            other,
            post(
                Some("tenant-a"),
                Some("domain"),
                r#"{"checkout_id":"other","amount":1}"#,
            ),
        )
        .await;
        assert_eq!(reused.json()["code"], "idempotency_key_reused");
    }
    assert_eq!(
        backend.orders().await,
        [("order-of-chk-1".to_owned(), "tenant-a".to_owned())]
    );
    let rows = record::<B>(client, "domain").await;
    assert_eq!(rows.len(), 1);
    assert_eq!((rows[0].0.as_str(), rows[0].1), ("completed", 201));
    assert_eq!(rows[0].2, created.body.to_vec());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_store_a_retry_that_meets_a_unique_key_of_the_domain_replays() {
    let pg = Postgres::new().await;
    a_retry_that_meets_a_unique_key_of_the_domain_replays(&pg, &pg.client).await;
    assert_eq!(pg.idle_in_transaction().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_store_a_retry_that_meets_a_unique_key_of_the_domain_replays() {
    let sqlx = Sqlx::new().await;
    a_retry_that_meets_a_unique_key_of_the_domain_replays(&sqlx, &sqlx.client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_store_duplicates_on_two_instances_commit_once_and_answer_alike() {
    let pg = Postgres::new().await;
    duplicates_on_two_instances_commit_once(&pg, &pg.client).await;
    assert_eq!(pg.idle_in_transaction().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_store_duplicates_in_one_instance_run_the_handler_once() {
    let pg = Postgres::new().await;
    duplicates_in_one_instance_run_the_handler_once(&pg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_store_a_retry_on_another_instance_rolls_back_and_replays() {
    let pg = Postgres::new().await;
    a_retry_on_another_instance_rolls_back_and_replays(&pg, &pg.client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_store_a_failed_handler_commits_nothing() {
    let pg = Postgres::new().await;
    a_failed_handler_commits_nothing(&pg, &pg.client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_store_duplicates_on_two_instances_commit_once_and_answer_alike() {
    let sqlx = Sqlx::new().await;
    duplicates_on_two_instances_commit_once(&sqlx, &sqlx.client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_store_duplicates_in_one_instance_run_the_handler_once() {
    let sqlx = Sqlx::new().await;
    duplicates_in_one_instance_run_the_handler_once(&sqlx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_store_a_retry_on_another_instance_rolls_back_and_replays() {
    let sqlx = Sqlx::new().await;
    a_retry_on_another_instance_rolls_back_and_replays(&sqlx, &sqlx.client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_store_a_failed_handler_commits_nothing() {
    let sqlx = Sqlx::new().await;
    a_failed_handler_commits_nothing(&sqlx, &sqlx.client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_store_an_expired_record_is_taken_over_by_a_second_run() {
    let pg = Postgres::new().await;
    an_expired_record_is_taken_over_by_a_second_run(&pg, &pg.client).await;
    assert_eq!(pg.idle_in_transaction().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_store_an_expired_record_is_taken_over_by_a_second_run() {
    let sqlx = Sqlx::new().await;
    an_expired_record_is_taken_over_by_a_second_run(&sqlx, &sqlx.client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_store_a_leased_key_is_held_and_an_expired_lease_is_taken_over() {
    let pg = Postgres::new().await;
    a_leased_key_is_held_and_an_expired_lease_is_taken_over(&pg, &pg.client).await;
    assert_eq!(pg.idle_in_transaction().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_store_a_leased_key_is_held_and_an_expired_lease_is_taken_over() {
    let sqlx = Sqlx::new().await;
    a_leased_key_is_held_and_an_expired_lease_is_taken_over(&sqlx, &sqlx.client).await;
}
