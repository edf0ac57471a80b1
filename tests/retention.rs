//! Retention against a real PostgreSQL: what expires, what cleanup removes
//! (and never removes), the gauges, and the operator API.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::StatusCode;
use tower::Layer;
use tower_idempotency::{
    retention::Cleanup, Claim, ClaimRequest, Fingerprint, IdempotencyKey, KeyState, Scope, Store,
    StoredResponse, TenantId,
};

const BODY: &str = r#"{"checkout_id":"chk_1","amount":1200}"#;

fn claim_request(key: &str, retention: Duration) -> ClaimRequest {
    ClaimRequest::new(
        Scope::new(TenantId::new("t"), "e"),
        IdempotencyKey::parse(key.as_bytes()).unwrap(),
        Fingerprint::from_bytes([9; 32]),
        retention,
        Duration::from_secs(5),
    )
}

async fn count(pg: &Postgres, sql: &str) -> i64 {
    pg.client.query_one(sql, &[]).await.unwrap().get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_removes_expired_rows_nobody_holds_concurrently_in_batches() {
    let pg = Postgres::new().await;
    pg.client
        .batch_execute(
            "INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at)
             SELECT 't', 'e', 'expired-' || i, '\\x00', 'completed', now() - interval '1 hour' FROM generate_series(1, 250) i;
             INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at)
             SELECT 't', 'e', 'live-' || i, '\\x00', 'completed', now() + interval '1 hour' FROM generate_series(1, 50) i;
             INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at)
             SELECT 't', 'e', 'stuck-' || i, '\\x00', 'in_progress', now() - interval '1 hour' FROM generate_series(1, 5) i;
             INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at)
             VALUES ('t', 'e', 'taken-over', '\\x00', 'completed', now() - interval '1 hour');",
        )
        .await
        .unwrap();
    // A claim is taking the expired 'taken-over' key over right now (it holds the row).
    let Claim::Owned(takeover) = pg
        .store
        .claim(&claim_request("taken-over", Duration::from_secs(3600)))
        .await
        .unwrap()
    else {
        panic!("an expired key is claimable")
    };
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
    let response = StoredResponse {
        status: StatusCode::OK,
        headers: vec![],
        body: Bytes::from_static(b"new"),
    };
    pg.store.complete(takeover, &response).await.unwrap();
    assert_eq!(
        count(
            &pg,
            "SELECT count(*) FROM idempotency_requests WHERE idempotency_key LIKE 'expired-%'"
        )
        .await,
        0
    );
    assert_eq!(
        count(
            &pg,
            "SELECT count(*) FROM idempotency_requests WHERE idempotency_key LIKE 'live-%'"
        )
        .await,
        50
    );
    assert_eq!(
        count(
            &pg,
            "SELECT count(*) FROM idempotency_requests WHERE idempotency_key LIKE 'stuck-%'"
        )
        .await,
        0,
        "expired orphans are removed"
    );
    assert_eq!(
        count(&pg, "SELECT count(*) FROM idempotency_requests WHERE idempotency_key = 'taken-over' AND attempt_token = 2 AND expires_at > now()").await,
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
    let Claim::Owned(open) = pg
        .store
        .claim(&claim_request("slow", Duration::from_secs(60)))
        .await
        .unwrap()
    else {
        panic!("owner")
    };
    let busy = cleanup.refresh_gauges().await.unwrap();
    assert!(
        busy.oldest_in_progress > Duration::ZERO,
        "the open claim is seen: {busy:?}"
    );
    assert!(busy.oldest_in_progress < Duration::from_secs(60));
    pg.store.abort(open).await.unwrap();
    pg.client
        .batch_execute(
            "INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, request_fingerprint, state, created_at, expires_at)
             VALUES ('t', 'e', 'stuck', '\\x00', 'in_progress', now() - interval '2 hours', now() + interval '1 hour'),
                    ('t', 'e', 'old', '\\x00', 'completed', now() - interval '2 days', now() - interval '1 day');",
        )
        .await
        .unwrap();
    let stuck = cleanup.refresh_gauges().await.unwrap();
    assert_eq!(stuck.cleanup_backlog, 1);
    assert!(
        stuck.oldest_in_progress >= Duration::from_secs(7200),
        "{stuck:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_inspects_and_removes_a_key() {
    let pg = Postgres::new().await;
    let service = layer(pg.store.clone()).layer(order_handler::<Postgres>(Default::default()));
    let first = send(service.clone(), post(Some("tenant-a"), Some("k1"), BODY)).await;
    let tenant = TenantId::new("tenant-a");
    let record = pg
        .store
        .inspect_key(&tenant, "POST /orders v1", "k1")
        .await
        .unwrap()
        .expect("the key is remembered");
    assert_eq!(record.state, KeyState::Completed);
    assert_eq!(record.response_status, Some(StatusCode::CREATED));
    assert_eq!(record.attempt_token, 1);
    assert!(record.expires_at > record.created_at);
    assert!(pg
        .store
        .inspect_key(&TenantId::new("tenant-b"), "POST /orders v1", "k1")
        .await
        .unwrap()
        .is_none());
    assert!(pg
        .store
        .remove_key(
            &tenant,
            "POST /orders v1",
            "k1",
            "customer support ticket 42"
        )
        .await
        .unwrap());
    assert!(!pg
        .store
        .remove_key(&tenant, "POST /orders v1", "k1", "again")
        .await
        .unwrap());
    let again = send(service, post(Some("tenant-a"), Some("k1"), BODY)).await;
    assert!(!again.replayed(), "a removed key is a new operation");
    assert_ne!(again.body, first.body);
    assert_eq!(pg.orders().await.len(), 2);
}
