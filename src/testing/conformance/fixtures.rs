//! What the checks share: the waits, the requests and responses they
//! build, and the assertions they make of a claim's answer.

use std::{
    future::Future,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use bytes::Bytes;
use http::{header, HeaderValue, StatusCode};
use tokio::{sync::Barrier, task::JoinSet};

use super::report::{ensure, fail, CheckFailure, Guarantee, OrFail};
use crate::{
    fingerprint::Fingerprint, key::IdempotencyKey, record::Record, record::ResourceId,
    record::StoredResponse, scope::Scope, scope::TenantId, store::Claim, store::ClaimRequest,
    store::Store, store::StoreError, store::StoreErrorKind,
};

pub(super) const WAIT: Duration = Duration::from_secs(5);
/// The wait of a claim that must find the key free: long enough for any
/// store to see an abort, short enough that a key left taken fails fast.
pub(super) const FREE_WAIT: Duration = Duration::from_secs(2);
/// The wait of a claim expected to meet a dropped owner: a SQL store may
/// only notice the closed connection after a while.
pub(super) const DROP_WAIT: Duration = Duration::from_secs(10);
pub(super) const DAY: Duration = Duration::from_secs(86_400);
/// How much longer than its wait a claim may take to answer.
const WAIT_SLACK: Duration = Duration::from_secs(2);

/// Spawns `racers` tasks, the future `racer(i)` for each `i` below
/// `racers`, that start together (behind one barrier, once all are
/// spawned): the set to [`join_all`].
pub(super) fn start_together<T, F, Fut>(racers: usize, racer: F) -> JoinSet<Result<T, CheckFailure>>
where
    T: Send + 'static,
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Result<T, CheckFailure>> + Send + 'static,
{
    let start = Arc::new(Barrier::new(racers));
    let mut tasks = JoinSet::new();
    for i in 0..racers {
        let (start, race) = (start.clone(), racer(i));
        tasks.spawn(async move {
            start.wait().await;
            race.await
        });
    }
    tasks
}

/// Waits for every task of `tasks`; a task that panicked fails the check
/// with `guarantee`. Dropping the set (a check at its limit) aborts them.
pub(super) async fn join_all<T: 'static>(
    mut tasks: JoinSet<Result<T, CheckFailure>>,
    guarantee: Guarantee,
) -> Result<Vec<T>, CheckFailure> {
    let mut done = Vec::with_capacity(tasks.len());
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(result) => done.push(result?),
            Err(e) => fail!(guarantee, "a concurrent task failed: {e}"),
        }
    }
    Ok(done)
}

pub(super) fn unique_key() -> IdempotencyKey {
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

pub(super) fn scope(tenant: &str) -> Scope {
    Scope::new(TenantId::new(tenant), "POST /conformance v1")
}

pub(super) fn request(
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

/// Requests of tenant `t1` under one key never used before, one per
/// fingerprint of `fingerprints` (the first request and retries or other
/// requests under its key): kept a day, waiting at most [`WAIT`].
pub(super) fn under_one_key<const N: usize>(fingerprints: [u8; N]) -> [ClaimRequest; N] {
    under_one_key_in(scope("t1"), fingerprints)
}

/// [`under_one_key`], in `scope`.
pub(super) fn under_one_key_in<const N: usize>(
    scope: Scope,
    fingerprints: [u8; N],
) -> [ClaimRequest; N] {
    let key = unique_key();
    fingerprints.map(|fingerprint| request(scope.clone(), &key, fingerprint, DAY, WAIT))
}

/// A request of tenant `t1` under a key never used before: fingerprint 1,
/// kept a day, waiting at most `wait`.
pub(super) fn new_request(wait: Duration) -> ClaimRequest {
    request(scope("t1"), &unique_key(), 1, DAY, wait)
}

pub(super) fn response(body: &'static [u8]) -> StoredResponse {
    response_with(Bytes::from_static(body))
}

pub(super) fn response_with(body: Bytes) -> StoredResponse {
    StoredResponse {
        status: StatusCode::CREATED,
        headers: vec![
            (header::LOCATION, HeaderValue::from_static("/things/1")),
            (header::LINK, HeaderValue::from_static("<a>")),
            (header::LINK, HeaderValue::from_static("<b>")),
        ],
        body,
        // Remembered with the response and given back with it.
        resource_id: Some(ResourceId::new("thing_1")),
        // As gRPC ends a unary answer: remembered and given back in order.
        trailers: vec![
            (
                http::HeaderName::from_static("grpc-status"),
                HeaderValue::from_static("0"),
            ),
            (
                http::HeaderName::from_static("grpc-message"),
                HeaderValue::from_static("created"),
            ),
        ],
        // What a store may keep, or not (the replay then names no trace).
        trace_id: None,
        span_id: None,
    }
}

/// Claims `request`, bounded by its wait (plus slack); anything but
/// `Owned` fails the check with `guarantee`, naming `what`.
pub(super) async fn must_own<St: Store>(
    store: &St,
    request: &ClaimRequest,
    guarantee: Guarantee,
    what: &str,
) -> Result<St::Tx, CheckFailure> {
    match claim_bounded(store, request, guarantee, what).await? {
        Claim::Owned(tx) => Ok(tx),
        other => fail!(
            guarantee,
            "{what}: expected to own the key, got {}",
            describe(&other)
        ),
    }
}

/// Claims `request`, which must own the key (nothing holds it any more),
/// and aborts at once: the key is left free. Anything else fails the check
/// with `guarantee`, naming `what`.
pub(super) async fn must_be_free<St: Store>(
    store: &St,
    request: &ClaimRequest,
    guarantee: Guarantee,
    what: &str,
) -> Result<(), CheckFailure> {
    let tx = must_own(store, request, guarantee, what).await?;
    store.abort(tx).await.or_fail(guarantee, "abort")
}

/// Claims `request`; a store error fails the check with `guarantee`, and a
/// claim that does not answer within its wait plus [`WAIT_SLACK`] fails it
/// as a broken bounded wait.
pub(super) async fn claim_bounded<St: Store>(
    store: &St,
    request: &ClaimRequest,
    guarantee: Guarantee,
    what: &str,
) -> Result<Claim<St::Tx>, CheckFailure> {
    let limit = request.wait + WAIT_SLACK;
    match tokio::time::timeout(limit, store.claim(request)).await {
        Ok(result) => result.or_fail(guarantee, &format!("{what}: claim failed")),
        Err(_) => fail!(
            Guarantee::BoundedWait,
            "{what}: a claim with a wait of {} ms had not answered after {} ms",
            request.wait.as_millis(),
            limit.as_millis()
        ),
    }
}

/// [`Store::lookup`] of `request`, which waits for nothing: answered
/// within [`WAIT_SLACK`], else the check fails with `guarantee`.
pub(super) async fn lookup_bounded<St: Store>(
    store: &St,
    request: &ClaimRequest,
    guarantee: Guarantee,
    what: &str,
) -> Result<Option<Record>, CheckFailure> {
    match tokio::time::timeout(WAIT_SLACK, store.lookup(request)).await {
        Ok(result) => result.or_fail(guarantee, &format!("{what}: lookup failed")),
        Err(_) => fail!(
            guarantee,
            "{what}: a lookup had not answered after {} ms",
            WAIT_SLACK.as_millis()
        ),
    }
}

/// Claims `request` (see [`claim_bounded`]); anything but `Completed` fails
/// the check with `guarantee`, naming `what`.
pub(super) async fn must_replay<St: Store>(
    store: &St,
    request: &ClaimRequest,
    guarantee: Guarantee,
    what: &str,
) -> Result<Record, CheckFailure> {
    match claim_bounded(store, request, guarantee, what).await? {
        Claim::Completed(record) => Ok(record),
        other => fail!(
            guarantee,
            "{what}: expected Completed, got {}",
            describe(&other)
        ),
    }
}

/// Claims `request` (see [`must_replay`]): the record it replays must hold
/// the body `expected`, or the check fails with `guarantee`, naming `what`.
pub(super) async fn must_replay_body<St: Store>(
    store: &St,
    request: &ClaimRequest,
    expected: &[u8],
    guarantee: Guarantee,
    what: &str,
) -> Result<(), CheckFailure> {
    let record = must_replay(store, request, guarantee, what).await?;
    must_have_body(&record, expected, guarantee, what)
}

/// `record` must hold the body `expected`: otherwise the check fails with
/// `guarantee`, naming `what` (what the record should be), the body
/// expected and the one it holds.
pub(super) fn must_have_body(
    record: &Record,
    expected: &[u8],
    guarantee: Guarantee,
    what: &str,
) -> Result<(), CheckFailure> {
    ensure!(
        record.response.body == expected,
        guarantee,
        "{what}: expected body {:?}, got {:?}",
        String::from_utf8_lossy(expected),
        String::from_utf8_lossy(&record.response.body)
    );
    Ok(())
}

/// `record` must carry the fingerprint `fingerprint` (every byte of it):
/// otherwise the check fails with `guarantee`, naming `what` (the record),
/// the fingerprint expected and the one it carries.
pub(super) fn must_carry_fingerprint(
    record: &Record,
    fingerprint: u8,
    guarantee: Guarantee,
    what: &str,
) -> Result<(), CheckFailure> {
    let expected = Fingerprint::from_bytes([fingerprint; 32]);
    ensure!(
        record.fingerprint == expected,
        guarantee,
        "{what}: expected fingerprint {expected:?}, got {:?}",
        record.fingerprint
    );
    Ok(())
}

/// `result` (of a `complete` that must not succeed) must be the error
/// [`StoreErrorKind::TransactionAborted`]: success, or any other error,
/// fails the check with `guarantee`, naming `what` and `when` it was called.
pub(super) fn must_be_aborted(
    result: Result<(), StoreError>,
    guarantee: Guarantee,
    what: &str,
    when: &str,
) -> Result<(), CheckFailure> {
    match result {
        Err(e) if e.kind() == StoreErrorKind::TransactionAborted => Ok(()),
        Err(e) => fail!(
            guarantee,
            "{what} {when} must answer transaction_aborted, got {e}"
        ),
        Ok(()) => fail!(guarantee, "{what} succeeded {when}"),
    }
}

pub(super) fn describe<T>(claim: &Claim<T>) -> String {
    match claim {
        Claim::Owned(_) => "Owned".to_owned(),
        Claim::Completed(record) => format!(
            "Completed (body {:?})",
            String::from_utf8_lossy(&record.response.body)
        ),
        Claim::InProgress => "InProgress".to_owned(),
    }
}
