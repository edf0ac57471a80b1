//! `MemoryStore` specifics beyond the conformance suite.
use bytes::Bytes;
use http::{Method, StatusCode};
use serde_json::json;

use super::*;

const LONG: Duration = Duration::from_secs(60);
const SHORT: Duration = Duration::from_millis(50);
// Sleeping past a lease is the behaviour under test here.
const PAST_SHORT: Duration = Duration::from_millis(100);

fn claim(key: &str, fingerprint: u8) -> ClaimRequest {
    ClaimRequest::new(
        Scope::new(TenantId::new("t1"), "POST /things v1"),
        IdempotencyKey::parse(key.as_bytes()).unwrap(),
        Fingerprint::from_bytes([fingerprint; 32]),
    )
    .with_wait(Duration::from_millis(100))
}

fn lease_request(lease: Duration) -> LeaseRequest {
    let request = StoredRequest::new(Method::POST, "/things", vec![], Bytes::new());
    LeaseRequest::new(lease, OperationId::random(), request)
}

fn response(body: &'static str) -> StoredResponse {
    StoredResponse {
        status: StatusCode::CREATED,
        headers: vec![],
        body: Bytes::from_static(body.as_bytes()),
        resource_id: None,
        trailers: Vec::new(),
        trace_id: None,
        span_id: None,
    }
}

async fn own(store: &MemoryStore, claim: &ClaimRequest, lease: Duration) -> Owned<MemoryLease> {
    match store.acquire(claim, &lease_request(lease)).await.unwrap() {
        Acquired::Owned(owned) => owned,
        other => panic!("expected to own the operation, got {other:?}"),
    }
}

/// A fenced transaction of `lease` that has written the order `id`.
fn fenced_order(lease: &MemoryLease, id: u32) -> MemoryTx {
    let tx = lease.transaction().unwrap();
    tx.insert("orders", json!({ "id": id })).unwrap();
    tx
}

/// A new store, its lease on `k` for `lease`, and a fenced transaction of
/// that lease that has written the order 1.
async fn fenced_order_of_a_new_store(
    lease: Duration,
) -> (MemoryStore, Owned<MemoryLease>, MemoryTx) {
    let store = MemoryStore::new();
    let owned = own(&store, &claim("k", 1), lease).await;
    let tx = fenced_order(&owned.lease, 1);
    (store, owned, tx)
}

fn is_fenced<T>(result: Result<T, StoreError>) -> bool {
    matches!(result, Err(e) if e.kind() == StoreErrorKind::Fenced)
}

#[tokio::test]
async fn fenced_tx_commits_all_rows_at_once() {
    let (store, _owned, tx) = fenced_order_of_a_new_store(LONG).await;
    tx.insert("outbox", json!({"order": 1})).unwrap();
    assert!(
        store.rows("orders").is_empty(),
        "staged rows are not visible"
    );
    store.commit_fenced(tx.clone()).await.unwrap();
    assert_eq!(store.rows("orders"), vec![json!({"id": 1})]);
    assert_eq!(store.rows("outbox"), vec![json!({"order": 1})]);
    assert!(
        tx.insert("orders", json!({"id": 2})).is_err(),
        "a committed transaction takes no more rows"
    );
    assert!(
        store.commit_fenced(tx).await.is_err(),
        "committed only once"
    );
    assert_eq!(store.rows("orders").len(), 1);
}

#[tokio::test]
async fn fenced_tx_applies_nothing_once_its_token_is_not_the_records() {
    let (store, owned, released) = fenced_order_of_a_new_store(LONG).await;
    store.release(&owned.lease).await.unwrap();
    assert!(is_fenced(store.commit_fenced(released).await));

    let owned = own(&store, &claim("k", 1), LONG).await;
    let finished = fenced_order(&owned.lease, 2);
    store.finish(&owned.lease, &response("done")).await.unwrap();
    assert!(is_fenced(store.commit_fenced(finished).await));
    assert!(store.rows("orders").is_empty(), "no row of a fenced commit");
}

#[tokio::test]
async fn stale_lease_opens_no_fenced_tx() {
    let store = MemoryStore::new();
    let first = own(&store, &claim("k", 1), SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    let second = own(&store, &claim("k", 1), LONG).await;
    assert!(second.taken_over && second.token > first.token);
    assert!(is_fenced(first.lease.transaction()));
    assert!(is_fenced(store.fenced(&first.lease).await));
    let tx = store.fenced(&second.lease).await.unwrap();
    tx.insert("orders", json!({"id": 1})).unwrap();
    store.commit_fenced(tx).await.unwrap();
    assert_eq!(store.rows("orders").len(), 1);
}

#[tokio::test]
async fn dropping_a_fenced_tx_unfinished_keeps_the_lease() {
    let (store, owned, tx) = fenced_order_of_a_new_store(LONG).await;
    let clone = tx.clone();
    drop(tx);
    drop(clone);
    let aborted = fenced_order(&owned.lease, 2);
    store.abort(aborted).await.unwrap();
    assert!(
        store.rows("orders").is_empty(),
        "discarded rows stay unseen"
    );
    assert!(
        matches!(
            store.acquire(&claim("k", 1), &lease_request(LONG)).await.unwrap(),
            Acquired::Running { operation_id, .. } if operation_id == owned.operation_id
        ),
        "the lease is still its owner's"
    );
    store.heartbeat(&owned.lease, LONG).await.unwrap();
    store.finish(&owned.lease, &response("done")).await.unwrap();
}

#[tokio::test]
async fn ended_fenced_txs_do_not_hold_the_record() {
    let store = MemoryStore::new();
    let owned = own(&store, &claim("k", 1), SHORT).await;
    drop(owned.lease.transaction().unwrap());
    store
        .abort(owned.lease.transaction().unwrap())
        .await
        .unwrap();
    store
        .commit_fenced(owned.lease.transaction().unwrap())
        .await
        .unwrap();
    tokio::time::sleep(PAST_SHORT).await;
    let next = own(&store, &claim("k", 1), LONG).await;
    assert!(
        next.taken_over,
        "an expired lease without open writes is taken over"
    );
}

#[tokio::test]
async fn an_open_fenced_tx_holds_off_takeovers() {
    let (store, owned, tx) = fenced_order_of_a_new_store(SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    assert!(matches!(
        store
            .acquire(&claim("k", 1), &lease_request(LONG))
            .await
            .unwrap(),
        Acquired::InProgress
    ));
    assert!(store
        .recover("POST /things v1", LONG, LONG, crate::store::Backoff::NONE)
        .await
        .unwrap()
        .is_none());

    // A takeover waiting on the hold goes ahead once the write commits.
    let waiting = tokio::spawn({
        let store = store.clone();
        async move {
            let claim = claim("k", 1).with_wait(Duration::from_secs(10));
            store.acquire(&claim, &lease_request(LONG)).await.unwrap()
        }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    store.commit_fenced(tx).await.unwrap();
    match waiting.await.unwrap() {
        Acquired::Owned(next) => {
            assert!(next.taken_over && next.token > owned.token);
            assert_eq!(next.operation_id, owned.operation_id);
        }
        other => panic!("expected the takeover after the commit, got {other:?}"),
    }
    assert_eq!(
        store.rows("orders").len(),
        1,
        "the write before the takeover stands"
    );
}

#[tokio::test]
async fn a_short_claim_waits_for_a_live_lease() {
    let store = MemoryStore::new();
    let owned = own(&store, &claim("k", 1), LONG).await;
    assert!(matches!(
        store.claim(&claim("k", 1)).await.unwrap(),
        Claim::InProgress
    ));

    // A claim waiting on the operation replays it once it finishes.
    let waiting = tokio::spawn({
        let store = store.clone();
        async move {
            let claim = claim("k", 1).with_wait(Duration::from_secs(10));
            store.claim(&claim).await.unwrap()
        }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    store.finish(&owned.lease, &response("done")).await.unwrap();
    match waiting.await.unwrap() {
        Claim::Completed(record) => assert_eq!(record.response, response("done")),
        other => panic!("expected the finished operation, got {other:?}"),
    }
}

#[tokio::test]
async fn a_short_claim_takes_an_expired_lease_over() {
    let store = MemoryStore::new();
    let owned = own(&store, &claim("k", 1), SHORT).await;
    // Waiting from before the lease runs out.
    let claim = claim("k", 1).with_wait(Duration::from_secs(10));
    let Claim::Owned(tx) = store.claim(&claim).await.unwrap() else {
        panic!("an abandoned operation is taken over once its lease expired");
    };
    assert!(is_fenced(store.heartbeat(&owned.lease, LONG).await));
    assert!(is_fenced(owned.lease.transaction()));
    assert!(tx.inner.token > owned.token);
    store.complete(tx, &response("short")).await.unwrap();
    assert!(is_fenced(
        store.finish(&owned.lease, &response("long")).await
    ));
}

#[tokio::test]
async fn a_short_claim_waits_for_a_fenced_write() {
    let store = MemoryStore::new();
    let owned = own(&store, &claim("k", 1), SHORT).await;
    let held = owned.lease.transaction().unwrap();
    tokio::time::sleep(PAST_SHORT).await;
    assert!(matches!(
        store.claim(&claim("k", 1)).await.unwrap(),
        Claim::InProgress
    ));
    store.commit_fenced(held).await.unwrap();
    assert!(matches!(
        store.claim(&claim("k", 1)).await.unwrap(),
        Claim::Owned(_)
    ));
}

#[tokio::test]
async fn a_leased_record_past_its_retention_is_a_new_operation() {
    let store = MemoryStore::new();
    let short_lived = claim("k", 1).with_retention(Duration::ZERO);
    let first = own(&store, &short_lived, SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    assert!(
        store
            .operation(first.lease.tenant(), first.operation_id)
            .await
            .unwrap()
            .is_none(),
        "an expired record has no status"
    );
    assert!(matches!(
        store.claim(&claim("k", 2)).await.unwrap(),
        Claim::Owned(_)
    ));

    let other = claim("other", 1).with_retention(Duration::ZERO);
    let first = own(&store, &other, SHORT).await;
    tokio::time::sleep(PAST_SHORT).await;
    let second = own(&store, &claim("other", 2), LONG).await;
    assert!(!second.taken_over);
    assert_ne!(second.operation_id, first.operation_id);
    assert!(second.token > first.token);
}

/// Retention counts from the claim, not from the completion (as in
/// PgStore, whose completion leaves the claim's expiry alone so that it is
/// a HOT update).
#[tokio::test(start_paused = true)]
async fn a_record_is_remembered_for_its_retention_from_its_claim() {
    let store = MemoryStore::new();
    let request = claim("k", 1).with_retention(Duration::from_secs(10));
    let Claim::Owned(tx) = store.claim(&request).await.unwrap() else {
        panic!("a new key is owned")
    };
    // The owner's work.
    tokio::time::advance(Duration::from_secs(8)).await;
    store.complete(tx, &response("done")).await.unwrap();
    tokio::time::advance(Duration::from_secs(1)).await;
    assert!(
        matches!(store.claim(&request).await.unwrap(), Claim::Completed(_)),
        "9 s after the claim the record replays"
    );
    tokio::time::advance(Duration::from_secs(1)).await;
    assert!(
        matches!(store.claim(&request).await.unwrap(), Claim::Owned(_)),
        "10 s after the claim (2 s after the completion) the key is a new operation"
    );
}

#[tokio::test]
async fn transaction_kinds_commit_their_own_way() {
    let store = MemoryStore::new();
    let owned = own(&store, &claim("leased", 1), LONG).await;
    let fenced = owned.lease.transaction().unwrap();
    assert!(store
        .complete(fenced.clone(), &response("x"))
        .await
        .is_err());
    store.commit_fenced(fenced).await.unwrap();

    let Claim::Owned(tx) = store.claim(&claim("short", 1)).await.unwrap() else {
        panic!("a new key is owned");
    };
    assert!(store.commit_fenced(tx.clone()).await.is_err());
    store.complete(tx, &response("y")).await.unwrap();
}

#[tokio::test]
async fn leases_of_another_store_are_refused() {
    let store = MemoryStore::new();
    let other = MemoryStore::new();
    let owned = own(&store, &claim("k", 1), LONG).await;
    own(&other, &claim("k", 1), LONG).await;
    assert!(other.heartbeat(&owned.lease, LONG).await.is_err());
    assert!(other.finish(&owned.lease, &response("x")).await.is_err());
    assert!(other.release(&owned.lease).await.is_err());
    assert!(other.fenced(&owned.lease).await.is_err());
}

#[test]
fn lease_debug_does_not_show_the_key() {
    let store = MemoryStore::new();
    let leased = Leased {
        token: 7,
        operation_id: OperationId::random(),
        fingerprint: Fingerprint::from_bytes([0; 32]),
        request: StoredRequest::new(Method::POST, "/", vec![], Bytes::new()),
        lease_expires_at: Instant::now(),
        expires_at: Instant::now(),
        retention: LONG,
        holds: 0,
        attempts: 1,
    };
    let key = (
        Scope::new(TenantId::new("t1"), "POST /things v1"),
        IdempotencyKey::parse(b"secret-key").unwrap(),
    );
    let owned = store.owned(key, &leased);
    let debug = format!("{:?}", owned.lease);
    assert!(!debug.contains("secret-key"), "{debug}");
    assert!(debug.contains("attempt_token: 7"), "{debug}");
}
