//! The behaviour every [`Store`] owes the layer, as runnable checks.
//!
//! One line in a test of your store runs them all and fails with a report
//! of every check (passed, failed with the broken guarantee and why,
//! skipped with why):
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! # let store = tower_idempotency::memory::MemoryStore::new();
//! tower_idempotency::testing::conformance::run_all(store).await.assert_passed();
//! # }
//! ```
//!
//! [`run_all`] returns a [`Report`]; [`Report::assert_passed`] panics with
//! it if a check failed. Checks use fresh keys, so one store instance can run
//! them all, also a store other tests use. Each check runs in a task of its
//! own under a time limit: a store that panics or never answers fails that
//! check and the run goes on. A claim that must answer within its wait is
//! given that wait and two seconds more.
//!
//! # The checks of the short-transaction mode
//!
//! Each check is named by its function here and checks one guarantee of the
//! [`Store`] docs (a [`Guarantee`]):
//!
//! | check | guarantee | the store must |
//! | --- | --- | --- |
//! | [`completed_record_replays_byte_for_byte`] | replay | answer a completed key with its status, headers (repeated ones in order) and body bytes |
//! | [`fingerprint_is_returned_for_comparison`] | replay | return the first request's fingerprint with the record |
//! | [`concurrent_claims_have_one_owner`] | one owner | let exactly one of 8 concurrent claims own a new key; the others get its record |
//! | [`stale_handle_cannot_complete`] | one owner | refuse `complete` through a handle whose transaction ended, after another claim owns the key |
//! | [`abort_frees_the_key`] | abort frees the key | let the next claim own a key whose owner aborted |
//! | [`dropped_handle_frees_the_key`] | drop frees the key | let the next claim own a key whose owner dropped every clone of its handle |
//! | [`wait_is_bounded`] | bounded wait | answer `InProgress` after the claim's wait while another request owns the key |
//! | [`scopes_are_isolated`] | tenant isolation | keep the same raw key of two tenants apart: neither replays the other's record |
//! | [`expired_record_is_a_new_operation`] | expiry takeover | let a claim own a completed key whose retention ended |
//!
//! What the handler writes through the transaction handle is
//! store-specific. Give the suite a way to write and to look ([`Writes`])
//! with [`run_all_with`], and four more checks run (skipped without it):
//!
//! | check | guarantee | the store must |
//! | --- | --- | --- |
//! | [`handler_writes_commit_with_the_response`] | atomic completion | show the handler's write only once `complete` returned, then together with the record |
//! | [`failed_write_fails_the_completion`] | atomic completion | refuse `complete` after a failed write (`TransactionAborted`), remember nothing, commit nothing, free the key |
//! | [`abort_discards_the_handler_writes`] | abort frees the key | discard the handler's write on abort |
//! | [`dropped_handle_discards_the_handler_writes`] | drop frees the key | discard the handler's write when the handle is dropped |
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use tower_idempotency::{memory::MemoryStore, testing::conformance};
//!
//! let store = MemoryStore::new();
//! // MemoryStore is its own `Writes`: rows staged through `MemoryTx`.
//! let report = conformance::run_all_with(store.clone(), store).await;
//! println!("{report}");
//! report.assert_passed();
//! # }
//! ```
//!
//! The individual checks are public too: each returns `Ok(())` or the
//! [`CheckFailure`] naming the guarantee it found broken.
//!
//! # The one-commit mode
//!
//! A store that also implements [`CommitStore`](crate::store::CommitStore)
//! runs [`run_at_commit`] (or [`run_at_commit_with`], with [`Writes`]): one
//! commit wins, the loser gets the winner's record and rolls back, another
//! request is told the first fingerprint, an abort leaves the key free,
//! tenants are isolated, an expired record is won again. Its docs list each
//! check.
//!
//! # Long-running operations
//!
//! A store that also implements [`LeaseStore`](crate::store::LeaseStore)
//! runs [`run_leases`] too. Its checks, each named by the guarantee a
//! failure names:
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
//! - **identity** ([`a_released_operation_keeps_its_identity`]): a release
//!   keeps the operation (its status `Running`, attempts counted, the old
//!   lease fenced); another request still finds it running; the same
//!   request resumes it at once as attempt 2 with its id; a recovery worker
//!   only after its backoff, as attempt 3;
//! - **failure** ([`a_failed_operation_replays_its_failure`]): a failed
//!   operation replays its failure as a completed record, shows `Failed`
//!   with its attempts, and fences the lease that failed it;
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
//! # let store = tower_idempotency::memory::MemoryStore::new();
//! tower_idempotency::testing::conformance::run_leases(store).await.assert_passed();
//! # }
//! ```

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

use crate::{
    fingerprint::Fingerprint, key::IdempotencyKey, record::Record, record::ResourceId,
    record::StoredResponse, scope::Scope, scope::TenantId, store::Claim, store::ClaimRequest,
    store::Store, store::StoreError, store::StoreErrorKind,
};

/// Runs the check function `$check` on the runner `$run`, under
/// `Guarantee::$guarantee` and its own name. With `$writes` (an
/// `Option<Arc<_>>` of [`Writes`]), a check that writes through the handle:
/// without them it is reported skipped, saying `$skipped`.
macro_rules! check {
    ($run:ident, $check:ident, $guarantee:ident) => {
        $run.check(
            stringify!($check),
            Guarantee::$guarantee,
            |store| async move { $check(&store).await },
        )
        .await
    };
    ($run:ident, $check:ident, $guarantee:ident, $writes:ident, $skipped:expr) => {
        $run.with_writes(
            stringify!($check),
            Guarantee::$guarantee,
            $writes.clone(),
            $skipped,
            |store, writes| async move { $check(&store, &*writes).await },
        )
        .await
    };
}

mod at_commit;
mod checks;
mod leases;
mod report;
mod runner;
mod writes;

pub use at_commit::{
    a_losers_writes_are_rolled_back, a_remembered_key_is_never_won_again,
    an_aborted_transaction_leaves_the_key_free, an_expired_record_is_won_again,
    another_request_gets_the_first_fingerprint, concurrent_commits_have_one_winner, run_at_commit,
    run_at_commit_with, scopes_are_isolated_at_commit, the_loser_gets_the_winners_record,
    the_winners_writes_commit_with_its_record,
};
pub use checks::{
    abort_frees_the_key, completed_record_replays_byte_for_byte, concurrent_claims_have_one_owner,
    dropped_handle_frees_the_key, expired_record_is_a_new_operation,
    fingerprint_is_returned_for_comparison, scopes_are_isolated, stale_handle_cannot_complete,
    wait_is_bounded,
};
pub use leases::{
    a_failed_operation_replays_its_failure, a_released_operation_keeps_its_identity,
    concurrent_acquires_have_one_owner, duplicate_during_a_lease_is_running,
    expired_lease_is_recovered_once, expired_lease_is_taken_over_once,
    finished_operation_replays_and_has_a_status, heartbeats_keep_the_lease, run_leases,
    stale_owner_is_fenced, tokens_only_grow,
};
pub use report::{CheckFailure, CheckResult, Guarantee, Outcome, Report};
pub use writes::{
    abort_discards_the_handler_writes, dropped_handle_discards_the_handler_writes,
    failed_write_fails_the_completion, handler_writes_commit_with_the_response, BoxError, Writes,
};

use report::{ensure, fail, OrFail};
use runner::Runner;

const WAIT: Duration = Duration::from_secs(5);
/// The wait of a claim that must find the key free: long enough for any
/// store to see an abort, short enough that a key left taken fails fast.
const FREE_WAIT: Duration = Duration::from_secs(2);
/// The wait of a claim expected to meet a dropped owner: a SQL store may
/// only notice the closed connection after a while.
const DROP_WAIT: Duration = Duration::from_secs(10);
const DAY: Duration = Duration::from_secs(86_400);
/// How much longer than its wait a claim may take to answer.
const WAIT_SLACK: Duration = Duration::from_secs(2);

/// Runs every check of the [`Store`] guarantees (the short-transaction
/// mode) that needs nothing but the store; those that look at the handler's
/// writes are reported skipped (see [`run_all_with`]). [`run_leases`] runs
/// those of the long-running mode.
pub async fn run_all<St: Store>(store: St) -> Report {
    run_short(store, None::<writes::NoWrites>).await
}

/// [`run_all`], plus the checks that write through the transaction handle
/// with `writes` and look at what was committed.
pub async fn run_all_with<St: Store, W: Writes<St::Tx>>(store: St, writes: W) -> Report {
    run_short(store, Some(writes)).await
}

async fn run_short<St: Store, W: Writes<St::Tx>>(store: St, writes: Option<W>) -> Report {
    let mut run = Runner::new("Store", store);
    check!(run, completed_record_replays_byte_for_byte, Replay);
    check!(run, fingerprint_is_returned_for_comparison, Replay);
    check!(run, concurrent_claims_have_one_owner, OneOwner);
    check!(run, stale_handle_cannot_complete, OneOwner);
    check!(run, abort_frees_the_key, AbortFreesTheKey);
    check!(run, dropped_handle_frees_the_key, DropFreesTheKey);
    check!(run, wait_is_bounded, BoundedWait);
    check!(run, scopes_are_isolated, TenantIsolation);
    check!(run, expired_record_is_a_new_operation, ExpiryTakeover);

    let writes = writes.map(Arc::new);
    let skipped = "needs a way to write through the handle: run_all_with(store, writes)";
    check!(
        run,
        handler_writes_commit_with_the_response,
        AtomicCompletion,
        writes,
        skipped
    );
    check!(
        run,
        failed_write_fails_the_completion,
        AtomicCompletion,
        writes,
        skipped
    );
    check!(
        run,
        abort_discards_the_handler_writes,
        AbortFreesTheKey,
        writes,
        skipped
    );
    check!(
        run,
        dropped_handle_discards_the_handler_writes,
        DropFreesTheKey,
        writes,
        skipped
    );
    run.finish()
}

/// Spawns `racers` tasks, the future `racer(i)` for each `i` below
/// `racers`, that start together (behind one barrier, once all are
/// spawned): the set to [`join_all`].
fn start_together<T, F, Fut>(racers: usize, racer: F) -> JoinSet<Result<T, CheckFailure>>
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
async fn join_all<T: 'static>(
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

/// Requests of tenant `t1` under one key never used before, one per
/// fingerprint of `fingerprints` (the first request and retries or other
/// requests under its key): kept a day, waiting at most [`WAIT`].
fn under_one_key<const N: usize>(fingerprints: [u8; N]) -> [ClaimRequest; N] {
    under_one_key_in(scope("t1"), fingerprints)
}

/// [`under_one_key`], in `scope`.
fn under_one_key_in<const N: usize>(scope: Scope, fingerprints: [u8; N]) -> [ClaimRequest; N] {
    let key = unique_key();
    fingerprints.map(|fingerprint| request(scope.clone(), &key, fingerprint, DAY, WAIT))
}

/// A request of tenant `t1` under a key never used before: fingerprint 1,
/// kept a day, waiting at most `wait`.
fn new_request(wait: Duration) -> ClaimRequest {
    request(scope("t1"), &unique_key(), 1, DAY, wait)
}

fn response(body: &'static [u8]) -> StoredResponse {
    response_with(Bytes::from_static(body))
}

fn response_with(body: Bytes) -> StoredResponse {
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
    }
}

/// Claims `request`, bounded by its wait (plus slack); anything but
/// `Owned` fails the check with `guarantee`, naming `what`.
async fn must_own<St: Store>(
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
async fn must_be_free<St: Store>(
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
async fn claim_bounded<St: Store>(
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

/// Claims `request` (see [`claim_bounded`]); anything but `Completed` fails
/// the check with `guarantee`, naming `what`.
async fn must_replay<St: Store>(
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
async fn must_replay_body<St: Store>(
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
/// `guarantee`, naming `what` (what the record should be) and the body it
/// holds.
fn must_have_body(
    record: &Record,
    expected: &[u8],
    guarantee: Guarantee,
    what: &str,
) -> Result<(), CheckFailure> {
    ensure!(
        record.response.body == expected,
        guarantee,
        "{what}: the body is {:?}, not {:?}",
        String::from_utf8_lossy(&record.response.body),
        String::from_utf8_lossy(expected)
    );
    Ok(())
}

/// `record` must carry the fingerprint `fingerprint` (every byte of it),
/// `whose` it is: otherwise the check fails with `guarantee`.
fn must_carry_fingerprint(
    record: &Record,
    fingerprint: u8,
    guarantee: Guarantee,
    whose: &str,
) -> Result<(), CheckFailure> {
    ensure!(
        record.fingerprint == Fingerprint::from_bytes([fingerprint; 32]),
        guarantee,
        "the record must carry {whose} fingerprint, got {:?}",
        record.fingerprint
    );
    Ok(())
}

/// `result` (of a `complete` that must not succeed) must be the error
/// [`StoreErrorKind::TransactionAborted`]: success, or any other error,
/// fails the check with `guarantee`, naming `what` and `when` it was called.
fn must_be_aborted(
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

fn describe<T>(claim: &Claim<T>) -> String {
    match claim {
        Claim::Owned(_) => "Owned".to_owned(),
        Claim::Completed(record) => format!(
            "Completed (body {:?})",
            String::from_utf8_lossy(&record.response.body)
        ),
        Claim::InProgress => "InProgress".to_owned(),
    }
}
