//! The checks of [`LeaseStore`]'s guarantees; [`run_leases`] runs them all.
//!
//! Leases here are short (a few hundred milliseconds) where a check needs
//! one to run out: sleeping past a lease is the behaviour under test, not a
//! way to wait for the store.

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method};

use super::{request, response, scope, unique_key, DAY, WAIT};
use crate::{
    fingerprint::Fingerprint,
    key::IdempotencyKey,
    lease::OperationId,
    scope::{Scope, TenantId},
    store::{
        Acquired, ClaimRequest, LeaseRequest, LeaseStore, OperationState, Owned, StoreError,
        StoreErrorKind, StoredRequest,
    },
};

/// A lease no check outlives.
const LONG: Duration = Duration::from_secs(60);
/// A lease a check sleeps past.
const SHORT: Duration = Duration::from_millis(300);
/// Long enough past [`SHORT`] for any store's clock.
const PAST_SHORT: Duration = Duration::from_millis(500);
/// How many requests race in the concurrency checks.
const RACERS: usize = 20;

/// Runs every check of the long-running mode.
pub async fn run_leases<St: LeaseStore>(store: St) {
    concurrent_acquires_have_one_owner(&store).await;
    duplicate_during_a_lease_is_running(&store).await;
    expired_lease_is_taken_over_once(&store).await;
    stale_owner_is_fenced(&store).await;
    tokens_only_grow(&store).await;
    heartbeats_keep_the_lease(&store).await;
    finished_operation_replays_and_has_a_status(&store).await;
    expired_lease_is_recovered_once(&store).await;
}

fn stored_request() -> StoredRequest {
    StoredRequest::new(
        Method::POST,
        "/conformance/things?notify=true",
        vec![
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            ),
            (header::CONTENT_TYPE, HeaderValue::from_static("text/plain")),
        ],
        Bytes::from_static(b"{\"total\":42}\x00\xff"),
    )
}

fn lease_request(lease: Duration) -> LeaseRequest {
    LeaseRequest::new(lease, OperationId::random(), stored_request())
}

fn claim(scope: Scope, key: &IdempotencyKey, fingerprint: u8) -> ClaimRequest {
    request(scope, key, fingerprint, DAY, WAIT)
}

fn describe<L>(acquired: &Acquired<L>) -> &'static str {
    match acquired {
        Acquired::Owned(_) => "Owned",
        Acquired::Running { .. } => "Running",
        Acquired::Completed(_) => "Completed",
        Acquired::InProgress => "InProgress",
    }
}

async fn must_acquire<St: LeaseStore>(
    store: &St,
    claim: &ClaimRequest,
    request: &LeaseRequest,
    what: &str,
) -> Owned<St::Lease> {
    match store.acquire(claim, request).await {
        Ok(Acquired::Owned(owned)) => owned,
        Ok(other) => panic!(
            "{what}: expected to own the operation, got {}",
            describe(&other)
        ),
        Err(e) => panic!("{what}: acquire failed: {e}"),
    }
}

/// `Running` under `operation_id`, or a panic naming `what`.
async fn must_be_running<St: LeaseStore>(
    store: &St,
    claim: &ClaimRequest,
    operation_id: OperationId,
    what: &str,
) {
    match store.acquire(claim, &lease_request(LONG)).await {
        Ok(Acquired::Running {
            operation_id: running,
            ..
        }) => assert_eq!(
            running, operation_id,
            "{what}: Running must name the operation"
        ),
        Ok(other) => panic!("{what}: expected Running, got {}", describe(&other)),
        Err(e) => panic!("{what}: acquire failed: {e}"),
    }
}

fn must_be_fenced<T>(result: Result<T, StoreError>, what: &str) {
    match result {
        Err(e) if e.kind() == StoreErrorKind::Fenced => {}
        Err(e) => panic!("fencing: {what}: expected Fenced, got {e}"),
        Ok(_) => panic!("fencing: {what} succeeded with a stale lease"),
    }
}

/// An owner whose lease has expired, and a new owner that took the
/// operation over from it.
async fn taken_over<St: LeaseStore>(
    store: &St,
    claim: &ClaimRequest,
) -> (Owned<St::Lease>, Owned<St::Lease>) {
    let first = must_acquire(store, claim, &lease_request(SHORT), "first acquire").await;
    tokio::time::sleep(PAST_SHORT).await;
    let second = must_acquire(
        store,
        claim,
        &lease_request(LONG),
        "acquire after the lease expired",
    )
    .await;
    assert!(
        second.taken_over,
        "takeover: an expired operation is taken over, not started anew"
    );
    (first, second)
}

/// One owner: of many concurrent acquires of a new key, exactly one owns the
/// operation (under the id it proposed); every other one finds it running
/// under that id.
pub async fn concurrent_acquires_have_one_owner<St: LeaseStore>(store: &St) {
    let key = unique_key();
    let claim = claim(scope("t1"), &key, 1);
    let racers = (0..RACERS).map(|_| {
        let store = store.clone();
        let claim = claim.clone();
        tokio::spawn(async move {
            let request = lease_request(LONG);
            let acquired = store
                .acquire(&claim, &request)
                .await
                .unwrap_or_else(|e| panic!("one owner: acquire failed: {e}"));
            match acquired {
                Acquired::Owned(owned) => {
                    assert_eq!(
                        owned.operation_id, request.operation_id,
                        "one owner: a new operation gets the id its request proposed"
                    );
                    assert!(!owned.taken_over, "one owner: a new key is no takeover");
                    (Some(owned), None)
                }
                Acquired::Running { operation_id, .. } => (None, Some(operation_id)),
                other => panic!(
                    "one owner: expected Owned or Running, got {}",
                    describe(&other)
                ),
            }
        })
    });
    let mut owners = Vec::new();
    let mut running = Vec::new();
    for racer in racers.collect::<Vec<_>>() {
        let (owned, seen) = racer.await.expect("an acquire task does not panic");
        owners.extend(owned);
        running.extend(seen);
    }
    assert_eq!(
        owners.len(),
        1,
        "one owner: exactly one of {RACERS} concurrent acquires may own a new key"
    );
    let owner = owners.remove(0);
    assert!(
        running.iter().all(|id| *id == owner.operation_id),
        "one owner: every other acquire must see the owner's operation running"
    );
    store
        .release(&owner.lease)
        .await
        .expect("the owner releases the operation");
}

/// One owner: while the lease is valid, a duplicate (the same request or
/// another one) finds the operation running, with the first request's
/// fingerprint so that the layer can tell a retry from a reused key.
pub async fn duplicate_during_a_lease_is_running<St: LeaseStore>(store: &St) {
    let key = unique_key();
    let owner = must_acquire(
        store,
        &claim(scope("t1"), &key, 1),
        &lease_request(LONG),
        "owner",
    )
    .await;
    for fingerprint in [1, 2] {
        match store
            .acquire(&claim(scope("t1"), &key, fingerprint), &lease_request(LONG))
            .await
        {
            Ok(Acquired::Running {
                operation_id,
                fingerprint: first,
            }) => {
                assert_eq!(
                    operation_id, owner.operation_id,
                    "one owner: a duplicate must see the owner's operation"
                );
                assert_eq!(
                    first,
                    Fingerprint::from_bytes([1; 32]),
                    "one owner: Running must carry the first request's fingerprint"
                );
            }
            Ok(other) => panic!(
                "one owner: a duplicate during a valid lease must get Running, got {}",
                describe(&other)
            ),
            Err(e) => panic!("one owner: acquire failed: {e}"),
        }
    }
    store
        .release(&owner.lease)
        .await
        .expect("the owner releases the operation");
}

/// Takeover: once the lease expired, another request is refused (`Running`),
/// and of many concurrent acquires by the same request exactly one takes the
/// operation over, keeping its id, under a larger token.
pub async fn expired_lease_is_taken_over_once<St: LeaseStore>(store: &St) {
    let key = unique_key();
    let claim = claim(scope("t1"), &key, 1);
    let first = must_acquire(store, &claim, &lease_request(SHORT), "first acquire").await;
    tokio::time::sleep(PAST_SHORT).await;
    let other = request(scope("t1"), &key, 2, DAY, WAIT);
    must_be_running(
        store,
        &other,
        first.operation_id,
        "takeover: another request after the lease expired (a reused key)",
    )
    .await;
    let racers = (0..RACERS).map(|_| {
        let store = store.clone();
        let claim = claim.clone();
        tokio::spawn(async move {
            match store.acquire(&claim, &lease_request(LONG)).await {
                Ok(Acquired::Owned(owned)) => (Some(owned), None),
                Ok(Acquired::Running { operation_id, .. }) => (None, Some(operation_id)),
                Ok(other) => panic!(
                    "takeover: expected Owned or Running, got {}",
                    describe(&other)
                ),
                Err(e) => panic!("takeover: acquire failed: {e}"),
            }
        })
    });
    let mut owners = Vec::new();
    let mut running = Vec::new();
    for racer in racers.collect::<Vec<_>>() {
        let (owned, seen) = racer.await.expect("an acquire task does not panic");
        owners.extend(owned);
        running.extend(seen);
    }
    assert_eq!(
        owners.len(),
        1,
        "takeover: exactly one of {RACERS} concurrent acquires may take an expired lease over"
    );
    let owner = owners.remove(0);
    assert!(
        owner.taken_over,
        "takeover: the new owner is told it took over"
    );
    assert!(
        owner.token > first.token,
        "takeover: the new token ({}) must be larger than the old ({})",
        owner.token,
        first.token
    );
    assert_eq!(
        owner.operation_id, first.operation_id,
        "takeover: the operation keeps its id"
    );
    assert!(
        running.iter().all(|id| *id == first.operation_id),
        "takeover: every other acquire must see the operation running"
    );
    store
        .release(&owner.lease)
        .await
        .expect("the new owner releases the operation");
}

/// Fencing: after a takeover the old lease can neither open a fenced
/// transaction, nor heartbeat, finish or release, and each attempt changes
/// nothing; the new owner can do all of them.
pub async fn stale_owner_is_fenced<St: LeaseStore>(store: &St) {
    let key = unique_key();
    let claim = claim(scope("t1"), &key, 1);
    let (old, new) = taken_over(store, &claim).await;

    must_be_fenced(store.fenced(&old.lease).await, "a fenced transaction");
    must_be_fenced(store.heartbeat(&old.lease, LONG).await, "a heartbeat");
    must_be_fenced(
        store.finish(&old.lease, &response(b"stale")).await,
        "finishing",
    );
    must_be_running(
        store,
        &claim,
        new.operation_id,
        "fencing: after a stale finish the operation must still run under its new owner",
    )
    .await;
    must_be_fenced(store.release(&old.lease).await, "releasing");
    must_be_running(
        store,
        &claim,
        new.operation_id,
        "fencing: after a stale release the key must stay held",
    )
    .await;

    let tx = store
        .fenced(&new.lease)
        .await
        .unwrap_or_else(|e| panic!("fencing: the current owner's fenced transaction failed: {e}"));
    store
        .commit_fenced(tx)
        .await
        .unwrap_or_else(|e| panic!("fencing: the current owner's fenced commit failed: {e}"));
    store
        .heartbeat(&new.lease, LONG)
        .await
        .unwrap_or_else(|e| panic!("fencing: the current owner's heartbeat failed: {e}"));
    let answer = response(b"new owner");
    store
        .finish(&new.lease, &answer)
        .await
        .unwrap_or_else(|e| panic!("fencing: the current owner's finish failed: {e}"));
    match store.acquire(&claim, &lease_request(LONG)).await {
        Ok(Acquired::Completed(record)) => assert_eq!(
            record.response, answer,
            "fencing: the answer remembered must be the current owner's"
        ),
        Ok(other) => panic!(
            "fencing: after the owner finished, expected Completed, got {}",
            describe(&other)
        ),
        Err(e) => panic!("fencing: acquire failed: {e}"),
    }
}

/// Tokens only grow: each new owner of a key (after a release, after the
/// record's retention ended) gets a token larger than every earlier one, and
/// a new operation gets a new id.
pub async fn tokens_only_grow<St: LeaseStore>(store: &St) {
    let key = unique_key();
    let claim = claim(scope("t1"), &key, 1);
    let first = must_acquire(store, &claim, &lease_request(LONG), "first owner").await;
    store
        .release(&first.lease)
        .await
        .expect("the first owner releases the operation");
    // Its answer is remembered for no time at all: the next acquire starts anew.
    let forgotten = request(scope("t1"), &key, 1, Duration::ZERO, WAIT);
    let second = must_acquire(
        store,
        &forgotten,
        &lease_request(LONG),
        "acquire after a release",
    )
    .await;
    assert!(
        !second.taken_over,
        "monotonic token: after a release the key holds a new operation"
    );
    assert!(
        second.token > first.token,
        "monotonic token: after a release the token ({}) must be larger than before ({})",
        second.token,
        first.token
    );
    store
        .finish(&second.lease, &response(b"second"))
        .await
        .expect("the second owner finishes the operation");
    let proposed = lease_request(LONG);
    let third = must_acquire(
        store,
        &claim,
        &proposed,
        "acquire after the record's retention ended",
    )
    .await;
    assert!(
        !third.taken_over && third.operation_id == proposed.operation_id,
        "monotonic token: after the retention ended the key holds a new operation with a new id"
    );
    assert!(
        third.token > second.token,
        "monotonic token: after the retention ended the token ({}) must be larger than every \
         earlier one ({} and {})",
        third.token,
        first.token,
        second.token
    );
    store
        .release(&third.lease)
        .await
        .expect("the last owner releases the operation");
}

/// Heartbeats keep the lease: an owner that heartbeats past its lease's
/// original end still owns it, and a duplicate still finds it running.
pub async fn heartbeats_keep_the_lease<St: LeaseStore>(store: &St) {
    let key = unique_key();
    let claim = claim(scope("t1"), &key, 1);
    let owner = must_acquire(store, &claim, &lease_request(SHORT), "owner").await;
    // Twice the lease in all, a heartbeat every half lease.
    for _ in 0..4 {
        tokio::time::sleep(SHORT / 2).await;
        store
            .heartbeat(&owner.lease, SHORT)
            .await
            .unwrap_or_else(|e| panic!("heartbeat: the owner's heartbeat failed: {e}"));
    }
    must_be_running(
        store,
        &claim,
        owner.operation_id,
        "heartbeat: a heartbeated lease must not be taken over",
    )
    .await;
    store
        .release(&owner.lease)
        .await
        .expect("the owner releases the operation");
}

/// A finished operation replays its answer byte for byte, with the first
/// request's fingerprint, and its status is `Completed` for its own tenant
/// only.
pub async fn finished_operation_replays_and_has_a_status<St: LeaseStore>(store: &St) {
    let key = unique_key();
    let tenant = TenantId::new("t1");
    let claim = claim(scope("t1"), &key, 1);
    let owner = must_acquire(store, &claim, &lease_request(LONG), "owner").await;
    let status = |tenant: TenantId, id: OperationId| {
        let store = store.clone();
        async move {
            store
                .operation(&tenant, id)
                .await
                .unwrap_or_else(|e| panic!("status: operation lookup failed: {e}"))
        }
    };
    match status(tenant.clone(), owner.operation_id).await {
        Some(operation) => assert_eq!(
            operation.state,
            OperationState::Running,
            "status: an owned operation is Running"
        ),
        None => panic!("status: an owned operation must be found"),
    }
    let answer = response(b"\x00{\"id\":1}\xff");
    store
        .finish(&owner.lease, &answer)
        .await
        .unwrap_or_else(|e| panic!("finish: the owner's finish failed: {e}"));
    for (fingerprint, what) in [(1, "the same request"), (2, "another request")] {
        match store
            .acquire(
                &request(scope("t1"), &key, fingerprint, DAY, WAIT),
                &lease_request(LONG),
            )
            .await
        {
            Ok(Acquired::Completed(record)) => {
                assert_eq!(
                    record.response, answer,
                    "finish: {what} must get the answer byte for byte"
                );
                assert_eq!(
                    record.fingerprint,
                    Fingerprint::from_bytes([1; 32]),
                    "finish: the record carries the first request's fingerprint"
                );
            }
            Ok(other) => panic!(
                "finish: {what} after the finish: expected Completed, got {}",
                describe(&other)
            ),
            Err(e) => panic!("finish: acquire failed: {e}"),
        }
    }
    match status(tenant, owner.operation_id).await {
        Some(operation) => {
            assert_eq!(operation.id, owner.operation_id);
            assert_eq!(
                operation.state,
                OperationState::Completed(answer),
                "status: a finished operation is Completed with its answer"
            );
        }
        None => panic!("status: a finished operation must be found"),
    }
    assert_eq!(
        status(TenantId::new("t2"), owner.operation_id).await,
        None,
        "status: another tenant must not see the operation"
    );
    assert_eq!(
        status(TenantId::new("t1"), OperationId::random()).await,
        None,
        "status: an unknown id must not be found"
    );
}

/// Recovery: an operation whose lease expired is taken over by exactly one
/// of two concurrent recoveries, under a larger token and its id, with the
/// stored request intact; a live lease is not recovered.
pub async fn expired_lease_is_recovered_once<St: LeaseStore>(store: &St) {
    // An endpoint of its own: recovery takes any abandoned operation of it.
    let endpoint = format!("POST /conformance/recover/{} v1", unique_key().as_str());
    let scope = Scope::new(TenantId::new("t1"), endpoint.as_str());
    let key = unique_key();
    let claim = claim(scope.clone(), &key, 1);
    let first = must_acquire(store, &claim, &lease_request(SHORT), "owner").await;
    match store.recover(&endpoint, LONG, DAY).await {
        Ok(None) => {}
        Ok(Some(_)) => panic!("recovery: a live lease must not be recovered"),
        Err(e) => panic!("recovery: recover failed: {e}"),
    }
    tokio::time::sleep(PAST_SHORT).await;
    let workers = (0..2).map(|_| {
        let store = store.clone();
        let endpoint = endpoint.clone();
        tokio::spawn(async move {
            store
                .recover(&endpoint, LONG, DAY)
                .await
                .unwrap_or_else(|e| panic!("recovery: recover failed: {e}"))
        })
    });
    let mut recovered = Vec::new();
    for worker in workers.collect::<Vec<_>>() {
        recovered.extend(worker.await.expect("a recovery task does not panic"));
    }
    assert_eq!(
        recovered.len(),
        1,
        "recovery: exactly one of two concurrent recoveries may take an operation over"
    );
    let recovered = recovered.remove(0);
    assert!(
        recovered.owned.token > first.token,
        "recovery: the new token ({}) must be larger than the old ({})",
        recovered.owned.token,
        first.token
    );
    assert_eq!(
        recovered.owned.operation_id, first.operation_id,
        "recovery: the operation keeps its id"
    );
    assert!(recovered.owned.taken_over, "recovery: it is a takeover");
    assert_eq!(recovered.scope, scope, "recovery: the operation's scope");
    assert_eq!(
        recovered.request,
        stored_request(),
        "recovery: the stored request (method, target, headers, body) must be intact"
    );
    must_be_fenced(
        store.heartbeat(&first.lease, LONG).await,
        "a heartbeat after recovery",
    );
    match store.recover(&endpoint, LONG, DAY).await {
        Ok(None) => {}
        Ok(Some(_)) => panic!("recovery: a recovered operation is not recovered again"),
        Err(e) => panic!("recovery: recover failed: {e}"),
    }
    store
        .finish(&recovered.owned.lease, &response(b"recovered"))
        .await
        .unwrap_or_else(|e| panic!("recovery: the recovered operation's finish failed: {e}"));
}
