//! The checks of [`LeaseStore`]'s guarantees; [`run_leases`] runs them all.
//!
//! Leases here are short (a few hundred milliseconds) where a check needs
//! one to run out: sleeping past a lease is the behaviour under test, not a
//! way to wait for the store.

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method};
use tokio::task::JoinSet;

use super::{
    join_all, must_carry_fingerprint, new_request, request, response, under_one_key,
    under_one_key_in, unique_key, CheckFailure, Guarantee, Report, Runner, DAY, WAIT,
};
use crate::{
    fingerprint::Fingerprint,
    scope::{Scope, TenantId},
    store::OperationId,
    store::{
        Acquired, Backoff, ClaimRequest, LeaseRequest, LeaseStore, OperationState, Owned,
        StoreError, StoreErrorKind, StoredRequest,
    },
};

use super::report::{ensure, fail, OrFail};

mod lifecycle;
mod owners;

pub use lifecycle::{
    a_failed_operation_replays_its_failure, a_released_operation_keeps_its_identity,
    an_operation_outlives_its_retention_while_it_runs, expired_lease_is_recovered_once,
    finished_operation_replays_and_has_a_status, heartbeats_keep_the_lease,
};
pub use owners::{
    concurrent_acquires_have_one_owner, duplicate_during_a_lease_is_running,
    expired_lease_is_taken_over_once, stale_owner_is_fenced, tokens_only_grow,
};

/// A lease no check outlives.
const LONG: Duration = Duration::from_secs(60);
/// A lease a check sleeps past.
const SHORT: Duration = Duration::from_millis(300);
/// Long enough past [`SHORT`] for any store's clock.
const PAST_SHORT: Duration = Duration::from_millis(500);
/// How many requests race in the concurrency checks.
const RACERS: usize = 20;

/// Runs every check of the long-running mode (see the
/// [module docs](super#long-running-operations)).
pub async fn run_leases<St: LeaseStore>(store: St) -> Report {
    let mut run = Runner::new("LeaseStore", store);
    check!(run, concurrent_acquires_have_one_owner, OneOwner);
    check!(run, duplicate_during_a_lease_is_running, OneOwner);
    check!(run, expired_lease_is_taken_over_once, LeaseTakeover);
    check!(run, stale_owner_is_fenced, Fencing);
    check!(run, tokens_only_grow, MonotonicToken);
    check!(run, heartbeats_keep_the_lease, Heartbeat);
    check!(run, finished_operation_replays_and_has_a_status, Finish);
    check!(run, expired_lease_is_recovered_once, Recovery);
    check!(run, a_released_operation_keeps_its_identity, Identity);
    check!(
        run,
        an_operation_outlives_its_retention_while_it_runs,
        Identity
    );
    check!(run, a_failed_operation_replays_its_failure, Failure);
    run.finish()
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
    guarantee: Guarantee,
    what: &str,
) -> Result<Owned<St::Lease>, CheckFailure> {
    match store.acquire(claim, request).await {
        Ok(Acquired::Owned(owned)) => Ok(owned),
        Ok(other) => fail!(
            guarantee,
            "{what}: expected to own the operation, got {}",
            describe(&other)
        ),
        Err(e) => fail!(guarantee, "{what}: acquire failed: {e}"),
    }
}

/// `Running` under `operation_id`, or a failure of `guarantee` naming `what`.
/// What one racer of an acquire race saw: the operation owned, or running
/// under an id.
type Sighting<L> = (Option<Owned<L>>, Option<OperationId>);

/// Waits for `racers`, each of which either owned the operation or saw it
/// running under an id: the one owner and the ids the others saw. Any
/// number of owners but one fails the check with `guarantee`, saying what
/// the owners `did`.
async fn one_owner<L: 'static>(
    racers: JoinSet<Result<Sighting<L>, CheckFailure>>,
    guarantee: Guarantee,
    did: &str,
) -> Result<(Owned<L>, Vec<OperationId>), CheckFailure> {
    let mut owners = Vec::new();
    let mut running = Vec::new();
    for (owned, seen) in join_all(racers, guarantee).await? {
        owners.extend(owned);
        running.extend(seen);
    }
    ensure!(
        owners.len() == 1,
        guarantee,
        "{} of {RACERS} concurrent acquires {did} (exactly one may)",
        owners.len()
    );
    Ok((owners.remove(0), running))
}

/// An endpoint no other check uses (recovery takes any abandoned operation
/// of its endpoint), `what` in its name, and a scope of tenant `t1` in it.
fn endpoint_of_its_own(what: &str) -> (String, Scope) {
    let endpoint = format!("POST /conformance/{what}/{} v1", unique_key().as_str());
    let scope = Scope::new(TenantId::new("t1"), endpoint.as_str());
    (endpoint, scope)
}

/// A recovery worker's `recover` of `endpoint` (with `backoff` between
/// attempts), named `what`, that must find nothing to recover: otherwise
/// the check fails with `guarantee`, saying `why`.
async fn must_not_recover<St: LeaseStore>(
    store: &St,
    endpoint: &str,
    backoff: Backoff,
    guarantee: Guarantee,
    what: &str,
    why: &str,
) -> Result<(), CheckFailure> {
    let recovered = store.recover(endpoint, LONG, DAY, backoff).await;
    ensure!(
        recovered.or_fail(guarantee, what)?.is_none(),
        guarantee,
        "{why}"
    );
    Ok(())
}

/// Releases `owned`'s lease; an error fails the check with `guarantee`,
/// naming `what`.
async fn release<St: LeaseStore>(
    store: &St,
    owned: &Owned<St::Lease>,
    guarantee: Guarantee,
    what: &str,
) -> Result<(), CheckFailure> {
    store.release(&owned.lease).await.or_fail(guarantee, what)
}

async fn must_be_running<St: LeaseStore>(
    store: &St,
    claim: &ClaimRequest,
    operation_id: OperationId,
    guarantee: Guarantee,
    what: &str,
) -> Result<(), CheckFailure> {
    match store.acquire(claim, &lease_request(LONG)).await {
        Ok(Acquired::Running {
            operation_id: running,
            ..
        }) => {
            ensure!(
                running == operation_id,
                guarantee,
                "{what}: Running must name the operation"
            );
            Ok(())
        }
        Ok(other) => fail!(
            guarantee,
            "{what}: expected Running, got {}",
            describe(&other)
        ),
        Err(e) => fail!(guarantee, "{what}: acquire failed: {e}"),
    }
}

fn must_be_fenced<T>(result: Result<T, StoreError>, what: &str) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::Fencing;
    match result {
        Err(e) if e.kind() == StoreErrorKind::Fenced => Ok(()),
        Err(e) => fail!(G, "{what}: expected Fenced, got {e}"),
        Ok(_) => fail!(G, "{what} succeeded with a stale lease"),
    }
}

/// An owner whose lease has expired, and a new owner that took the
/// operation over from it.
async fn taken_over<St: LeaseStore>(
    store: &St,
    claim: &ClaimRequest,
) -> Result<(Owned<St::Lease>, Owned<St::Lease>), CheckFailure> {
    const G: Guarantee = Guarantee::LeaseTakeover;
    let first = must_acquire(store, claim, &lease_request(SHORT), G, "first acquire").await?;
    tokio::time::sleep(PAST_SHORT).await;
    let second = must_acquire(
        store,
        claim,
        &lease_request(LONG),
        G,
        "acquire after the lease expired",
    )
    .await?;
    ensure!(
        second.taken_over,
        G,
        "an expired operation is taken over, not started anew"
    );
    Ok((first, second))
}
