//! Retention against a real PostgreSQL: what expires, what cleanup removes
//! (and never removes), the gauges, and the operator API.

use crate::common;

use std::time::Duration;

use common::*;
use http::StatusCode;
use tower::Layer;
use tower_idempotency::{
    fingerprint::Fingerprint,
    key::IdempotencyKey,
    postgres::{KeyState, PgTx},
    retention::Cleanup,
    scope::{Scope, TenantId},
    store::{Claim, ClaimRequest, Store},
};

/// A claim by tenant `t` on `key` of endpoint `e`, kept for `retention`.
fn claim_request(key: &str, retention: Duration) -> ClaimRequest {
    ClaimRequest::new(
        Scope::new(TenantId::new("t"), "e"),
        IdempotencyKey::parse(key.as_bytes()).unwrap(),
        Fingerprint::from_bytes([9; 32]),
    )
    .with_retention(retention)
    .with_wait(Duration::from_secs(5))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_removes_expired_rows_nobody_holds_concurrently_in_batches() {
    let pg = Postgres::new().await;
    pg.exec(
        "INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at)
         SELECT 't', 'e', 'expired-' || i, '\\x00', 'completed', now() - interval '1 hour' FROM generate_series(1, 250) i;
         INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at)
         SELECT 't', 'e', 'live-' || i, '\\x00', 'completed', now() + interval '1 hour' FROM generate_series(1, 50) i;
         INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at)
         SELECT 't', 'e', 'stuck-' || i, '\\x00', 'in_progress', now() - interval '1 hour' FROM generate_series(1, 5) i;
         INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at)
         VALUES ('t', 'e', 'taken-over', '\\x00', 'completed', now() - interval '1 hour');",
    )
    .await;
    // A claim is taking the expired 'taken-over' key over right now (it holds the row).
    let takeover = pg
        .own(
            &claim_request("taken-over", Duration::from_secs(3600)),
            "an expired key is claimable",
        )
        .await;
    let cleaners: Vec<_> = (0..2)
        .map(|_| {
            let cleanup = Cleanup::new(pg.store.clone()).batch_size(20);
            tokio::spawn(async move { cleanup.run_once().await })
        })
        .collect();
    let mut removed = 0;
    for cleaner in cleaners {
        removed += cleaner
            .await
            .unwrap()
            .expect("concurrent cleaners neither fail nor deadlock");
    }
    // 250 expired completed rows, and 5 expired `in_progress` rows whose
    // transaction is over (orphans); not the row a claim holds.
    assert_eq!(removed, 255);
    pg.store.complete(takeover, &stored(b"new")).await.unwrap();
    assert_eq!(
        pg.count(
            "SELECT count(*) FROM idempotency_requests WHERE idempotency_key LIKE 'expired-%'"
        )
        .await,
        0
    );
    assert_eq!(
        pg.count("SELECT count(*) FROM idempotency_requests WHERE idempotency_key LIKE 'live-%'")
            .await,
        50
    );
    assert_eq!(
        pg.count("SELECT count(*) FROM idempotency_requests WHERE idempotency_key LIKE 'stuck-%'")
            .await,
        0,
        "expired orphans are removed"
    );
    // The 306 rows inserted above drew tokens 1 to 306; the takeover a later one.
    assert_eq!(
        pg.count("SELECT count(*) FROM idempotency_requests WHERE idempotency_key = 'taken-over' AND attempt_token > 306 AND expires_at > now()").await,
        1,
        "the row being taken over was skipped, and lives on as the new operation"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gauges_report_backlog_and_the_oldest_operation_holding_a_key() {
    let pg = Postgres::new().await;
    let cleanup = Cleanup::new(pg.store.clone());
    let idle = cleanup.refresh_gauges().await.unwrap();
    assert_eq!(
        (idle.cleanup_backlog, idle.oldest_in_progress),
        (0, Duration::ZERO)
    );
    // An open claim transaction, as a slow handler would hold it.
    let open = pg
        .own(&claim_request("slow", Duration::from_secs(60)), "owner")
        .await;
    let busy = cleanup.refresh_gauges().await.unwrap();
    assert!(
        busy.oldest_in_progress > Duration::ZERO,
        "the open claim is seen: {busy:?}"
    );
    assert!(busy.oldest_in_progress < Duration::from_secs(60));
    pg.store.abort(open).await.unwrap();
    // A long-running operation two hours in holds its key; a short-mode row
    // committed in progress three hours ago (an orphan: its transaction
    // ended without completing it) holds nothing, the next claim takes it
    // over.
    pg.exec(
        "INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, request_fingerprint, state, created_at, expires_at, lease_expires_at)
         VALUES ('t', 'e', 'stuck', '\\x00', 'in_progress', now() - interval '2 hours', now() + interval '1 hour', now() - interval '1 minute'),
                ('t', 'e', 'orphan', '\\x00', 'in_progress', now() - interval '3 hours', now() + interval '1 hour', NULL),
                ('t', 'e', 'old', '\\x00', 'completed', now() - interval '2 days', now() - interval '1 day', NULL);",
    )
    .await;
    let stuck = cleanup.refresh_gauges().await.unwrap();
    assert_eq!(stuck.cleanup_backlog, 1);
    assert!(
        stuck.oldest_in_progress >= Duration::from_secs(7200)
            && stuck.oldest_in_progress < Duration::from_secs(3 * 3600),
        "{stuck:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_inspects_and_removes_a_key() {
    let pg = Postgres::new().await;
    // With a replay cache, the removal reaches this process after the
    // cache's TTL (tests/stores/postgres.rs shows it); here it takes effect at once.
    let service = layer(pg.store.clone())
        .without_replay_cache()
        .layer(order_handler::<Postgres>(Default::default()));
    let first = send(service.clone(), tenant_a_post("k1")).await;
    let scope = Scope::new(TenantId::new("tenant-a"), "POST /orders v1");
    let key = IdempotencyKey::parse(b"k1").unwrap();
    let record = pg
        .store
        .inspect_key(&scope, &key)
        .await
        .unwrap()
        .expect("the key is remembered");
    assert_eq!(record.state, KeyState::Completed);
    assert_eq!(record.response_status, Some(StatusCode::CREATED));
    assert_eq!(record.attempt_token, 1);
    assert!(record.expires_at > record.created_at);
    let other_tenant = Scope::new(TenantId::new("tenant-b"), "POST /orders v1");
    assert!(pg
        .store
        .inspect_key(&other_tenant, &key)
        .await
        .unwrap()
        .is_none());
    assert!(pg
        .store
        .remove_key(&scope, &key, "customer support ticket 42")
        .await
        .unwrap());
    assert!(!pg.store.remove_key(&scope, &key, "again").await.unwrap());
    let again = send(service, tenant_a_post("k1")).await;
    assert!(!again.replayed(), "a removed key is a new operation");
    assert_ne!(again.body, first.body);
    assert_eq!(pg.orders().await.len(), 2);
}

/// A key's attempt token only ever grows, also once its row is gone (removed
/// by cleanup or an operator): a worker holding an old token can never be
/// mistaken for the newest attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempt_token_keeps_growing_after_the_row_is_removed() {
    let pg = Postgres::new().await;
    let scope = Scope::new(TenantId::new("t"), "e");
    let key = IdempotencyKey::parse(b"k").unwrap();
    let mut tokens = Vec::new();
    for round in 0..3 {
        let Claim::Owned(tx) = pg
            .store
            .claim(&claim_request("k", Duration::ZERO))
            .await
            .unwrap()
        else {
            panic!("round {round}: the key is free")
        };
        tokens.push(tx.attempt_token());
        pg.store.complete(tx, &stored(b"done")).await.unwrap();
        match round {
            // Expired, then removed by cleanup.
            0 => assert_eq!(Cleanup::new(pg.store.clone()).run_once().await.unwrap(), 1),
            // Removed by an operator.
            _ => assert!(pg.store.remove_key(&scope, &key, "test").await.unwrap()),
        }
        assert_eq!(
            pg.count("SELECT count(*) FROM idempotency_requests").await,
            0
        );
    }
    assert!(
        tokens.windows(2).all(|pair| pair[1] > pair[0]),
        "tokens {tokens:?}"
    );
}

/// A retention shorter than the work: the key's record must still hold the
/// key when the work commits, so that a retry right after it replays
/// instead of running the work again. The retention is raised to cover the
/// handler's deadline (and the commit after it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retention_shorter_than_the_work_still_covers_its_commit() {
    let pg = Postgres::new().await;
    let retention = Duration::from_millis(300);
    let slow = handler(move |tx: PgTx| async move {
        // The work outlasts the retention.
        tokio::time::sleep(retention * 3).await;
        tx.execute(
            "INSERT INTO orders (id, tenant_id) VALUES ($1, 'tenant-a')",
            &[&new_order_id()],
        )
        .await?;
        Ok(created("{}"))
    });
    let service = layer(pg.store.clone())
        .retention(retention)
        .handler_timeout(Duration::from_secs(5))
        .layer(slow);
    let first = send(service.clone(), tenant_a_post("slow")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
    let covered: bool = pg
        .client
        .query_one(
            "SELECT expires_at > completed_at FROM idempotency_requests",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(covered, "the record expired before its work committed");
    let retry = send(service, tenant_a_post("slow")).await;
    assert!(retry.replayed(), "{:?}", retry.body);
    assert_eq!(pg.orders().await.len(), 1);
}
