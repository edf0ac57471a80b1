//! The behaviour every [`Store`] owes the layer, as runnable checks.
//!
//! Call [`run_all`] from a test of your store; each check panics with a
//! message naming the broken guarantee. Checks use fresh keys, so one store
//! instance can run them all. What the handler writes through the transaction
//! handle is store-specific and is not covered here: test that your
//! `complete` commits those writes and `abort` discards them.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! tower_idempotency::testing::conformance::run_all(tower_idempotency::memory::MemoryStore::new()).await;
//! # }
//! ```
//!
//! # Long-running operations
//!
//! A store that also implements [`LeaseStore`](crate::store::LeaseStore)
//! runs [`run_leases`] too. Its checks, each named by the guarantee a
//! failure message starts with:
//!
//! - **one owner** ([`concurrent_acquires_have_one_owner`],
//!   [`duplicate_during_a_lease_is_running`]): of 20 concurrent acquires of a
//!   new key exactly one owns the operation, and every other one, like any
//!   duplicate while the lease is valid, gets `Running` with its id;
//! - **takeover** ([`expired_lease_is_taken_over_once`]): once the lease
//!   expired, of 20 concurrent acquires by the same request exactly one
//!   takes the operation over, keeping its id, under a larger token; another
//!   request gets `Running`;
//! - **fencing** ([`stale_owner_is_fenced`]): after a takeover, the old
//!   lease's fenced transaction, heartbeat, finish and release are `Fenced`
//!   and change nothing (the operation still runs under its new owner);
//!   the new owner's succeed;
//! - **monotonic token** ([`tokens_only_grow`]): after a release, and after
//!   the record's retention ended, the next owner's token is larger than
//!   every earlier one;
//! - **heartbeat** ([`heartbeats_keep_the_lease`]): a lease renewed past its
//!   first end is not taken over;
//! - **finish** and **status**
//!   ([`finished_operation_replays_and_has_a_status`]): a finished operation
//!   replays its answer byte for byte with the first request's fingerprint,
//!   and [`operation`](crate::store::LeaseStore::operation) shows it
//!   `Completed` to its tenant and to no other, and nothing for an unknown id;
//! - **recovery** ([`expired_lease_is_recovered_once`]): an expired
//!   operation is recovered by one of two concurrent workers, under a larger
//!   token, with its stored request intact; a live or just recovered one is not.
//!
//! The checks sleep past leases of a few hundred milliseconds (the
//! behaviour under test), about two seconds in all. What a fenced
//! transaction writes is store-specific: the suite only checks that the
//! current owner's commits and a stale owner's cannot be opened; test that
//! your `commit_fenced` commits the writes at the current token only.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! tower_idempotency::testing::conformance::run_leases(tower_idempotency::memory::MemoryStore::new()).await;
//! # }
//! ```

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use bytes::Bytes;
use http::{header, HeaderValue, StatusCode};

use crate::{
    fingerprint::Fingerprint, key::IdempotencyKey, record::ResourceId, record::StoredResponse,
    scope::Scope, scope::TenantId, store::Claim, store::ClaimRequest, store::Store,
};

mod leases;

pub use leases::{
    concurrent_acquires_have_one_owner, duplicate_during_a_lease_is_running,
    expired_lease_is_recovered_once, expired_lease_is_taken_over_once,
    finished_operation_replays_and_has_a_status, heartbeats_keep_the_lease, run_leases,
    stale_owner_is_fenced, tokens_only_grow,
};

const WAIT: Duration = Duration::from_secs(5);
const DAY: Duration = Duration::from_secs(86_400);

/// Runs every check of the [`Store`] guarantees (the short-transaction
/// mode); [`run_leases`] runs those of the long-running mode.
pub async fn run_all<St: Store>(store: St) {
    completed_record_replays_byte_for_byte(&store).await;
    fingerprint_is_returned_for_comparison(&store).await;
    abort_frees_the_key(&store).await;
    scopes_are_isolated(&store).await;
    concurrent_claims_have_one_owner(&store).await;
    wait_is_bounded(&store).await;
    dropped_handle_frees_the_key(&store).await;
    expired_record_is_a_new_operation(&store).await;
}

fn unique_key() -> IdempotencyKey {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let key = format!(
        "conformance-{nanos}-{}",
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    IdempotencyKey::parse(key.as_bytes()).expect("generated keys are valid")
}

fn scope(tenant: &str) -> Scope {
    Scope::new(TenantId::new(tenant), "POST /conformance v1")
}

fn request(
    scope: Scope,
    key: &IdempotencyKey,
    fingerprint: u8,
    retention: Duration,
    wait: Duration,
) -> ClaimRequest {
    ClaimRequest::new(
        scope,
        key.clone(),
        Fingerprint::from_bytes([fingerprint; 32]),
    )
    .with_retention(retention)
    .with_wait(wait)
}

fn response(body: &'static [u8]) -> StoredResponse {
    StoredResponse {
        status: StatusCode::CREATED,
        headers: vec![
            (header::LOCATION, HeaderValue::from_static("/things/1")),
            (header::LINK, HeaderValue::from_static("<a>")),
            (header::LINK, HeaderValue::from_static("<b>")),
        ],
        body: Bytes::from_static(body),
        // Remembered with the response and given back with it.
        resource_id: Some(ResourceId::new("thing_1")),
    }
}

async fn must_own<St: Store>(store: &St, request: &ClaimRequest, what: &str) -> St::Tx {
    match store.claim(request).await {
        Ok(Claim::Owned(tx)) => tx,
        Ok(other) => panic!("{what}: expected to own the key, got {}", describe(&other)),
        Err(e) => panic!("{what}: claim failed: {e}"),
    }
}

fn describe<T>(claim: &Claim<T>) -> &'static str {
    match claim {
        Claim::Owned(_) => "Owned",
        Claim::Completed(_) => "Completed",
        Claim::InProgress => "InProgress",
    }
}

/// A completed record comes back with the same status, headers (multi-valued
/// kept in order) and body bytes.
pub async fn completed_record_replays_byte_for_byte<St: Store>(store: &St) {
    let key = unique_key();
    let req = request(scope("t1"), &key, 1, DAY, WAIT);
    let tx = must_own(store, &req, "first claim").await;
    let stored = response(b"\x00{\"id\":1}\xff");
    store
        .complete(tx, &stored)
        .await
        .expect("complete succeeds");
    match store.claim(&req).await.expect("second claim succeeds") {
        Claim::Completed(record) => {
            assert_eq!(record.response, stored, "replay must be byte for byte")
        }
        other => panic!("second claim: expected Completed, got {}", describe(&other)),
    }
}

/// The record carries the first request's fingerprint, so the layer can tell
/// a retry from a reused key.
pub async fn fingerprint_is_returned_for_comparison<St: Store>(store: &St) {
    let key = unique_key();
    let tx = must_own(
        store,
        &request(scope("t1"), &key, 7, DAY, WAIT),
        "first claim",
    )
    .await;
    store
        .complete(tx, &response(b"a"))
        .await
        .expect("complete succeeds");
    match store
        .claim(&request(scope("t1"), &key, 8, DAY, WAIT))
        .await
        .expect("claim succeeds")
    {
        Claim::Completed(record) => {
            assert_eq!(record.fingerprint, Fingerprint::from_bytes([7; 32]))
        }
        other => panic!(
            "claim with another fingerprint: expected Completed, got {}",
            describe(&other)
        ),
    }
}

/// After an abort, the next claim owns the key.
pub async fn abort_frees_the_key<St: Store>(store: &St) {
    let key = unique_key();
    let req = request(scope("t1"), &key, 1, DAY, WAIT);
    let tx = must_own(store, &req, "first claim").await;
    store.abort(tx).await.expect("abort succeeds");
    let tx = must_own(store, &req, "claim after abort").await;
    store.abort(tx).await.expect("abort succeeds");
}

/// The same raw key in two tenants names two operations.
pub async fn scopes_are_isolated<St: Store>(store: &St) {
    let key = unique_key();
    let a = must_own(
        store,
        &request(scope("tenant-a"), &key, 1, DAY, WAIT),
        "tenant a",
    )
    .await;
    let b = must_own(
        store,
        &request(scope("tenant-b"), &key, 1, DAY, WAIT),
        "tenant b",
    )
    .await;
    store
        .complete(a, &response(b"a"))
        .await
        .expect("complete a");
    store
        .complete(b, &response(b"b"))
        .await
        .expect("complete b");
    for (tenant, body) in [("tenant-a", &b"a"[..]), ("tenant-b", &b"b"[..])] {
        match store
            .claim(&request(scope(tenant), &key, 1, DAY, WAIT))
            .await
            .expect("claim")
        {
            Claim::Completed(record) => {
                assert_eq!(record.response.body, body, "{tenant} sees its own record")
            }
            other => panic!("{tenant}: expected Completed, got {}", describe(&other)),
        }
    }
}

/// Of many concurrent claims, one owns; once it completes, every other one
/// gets the completed record.
pub async fn concurrent_claims_have_one_owner<St: Store>(store: &St) {
    let key = unique_key();
    let req = request(scope("t1"), &key, 1, DAY, Duration::from_secs(30));
    let claims = (0..8).map(|_| {
        let store = store.clone();
        let req = req.clone();
        tokio::spawn(async move {
            match store.claim(&req).await.expect("claim succeeds") {
                Claim::Owned(tx) => {
                    store
                        .complete(tx, &response(b"one"))
                        .await
                        .expect("complete succeeds");
                    true
                }
                Claim::Completed(record) => {
                    assert_eq!(record.response.body, &b"one"[..]);
                    false
                }
                other => panic!("expected Owned or Completed, got {}", describe(&other)),
            }
        })
    });
    let mut owners = 0;
    for claim in claims.collect::<Vec<_>>() {
        owners += usize::from(claim.await.expect("task does not panic"));
    }
    assert_eq!(owners, 1, "exactly one concurrent claim may own the key");
}

/// A claim that meets an unfinished owner answers InProgress after its wait.
pub async fn wait_is_bounded<St: Store>(store: &St) {
    let key = unique_key();
    let tx = must_own(store, &request(scope("t1"), &key, 1, DAY, WAIT), "owner").await;
    let waiter = request(scope("t1"), &key, 1, DAY, Duration::from_millis(100));
    match store.claim(&waiter).await.expect("claim succeeds") {
        Claim::InProgress => {}
        other => panic!(
            "claim during ownership: expected InProgress, got {}",
            describe(&other)
        ),
    }
    store.abort(tx).await.expect("abort succeeds");
}

/// Dropping every clone of an unfinished handle rolls back and frees the key.
pub async fn dropped_handle_frees_the_key<St: Store>(store: &St) {
    let key = unique_key();
    let req = request(scope("t1"), &key, 1, DAY, Duration::from_secs(10));
    let tx = must_own(store, &req, "owner").await;
    drop(tx);
    let tx = must_own(store, &req, "claim after the handle was dropped").await;
    store.abort(tx).await.expect("abort succeeds");
}

/// A record past its retention is taken over as a new operation.
pub async fn expired_record_is_a_new_operation<St: Store>(store: &St) {
    let key = unique_key();
    let req = request(scope("t1"), &key, 1, Duration::ZERO, WAIT);
    let tx = must_own(store, &req, "first claim").await;
    store
        .complete(tx, &response(b"first"))
        .await
        .expect("complete succeeds");
    let tx = must_own(
        store,
        &request(scope("t1"), &key, 2, DAY, WAIT),
        "claim after expiry",
    )
    .await;
    store
        .complete(tx, &response(b"second"))
        .await
        .expect("complete succeeds");
    match store.claim(&req).await.expect("claim succeeds") {
        Claim::Completed(record) => assert_eq!(record.response.body, &b"second"[..]),
        other => panic!(
            "expected the new operation's record, got {}",
            describe(&other)
        ),
    }
}
