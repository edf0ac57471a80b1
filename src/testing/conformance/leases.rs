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
    join_all, request, response, scope, unique_key, CheckFailure, Guarantee, Report, Runner, DAY,
    WAIT,
};
use crate::{
    fingerprint::Fingerprint,
    key::IdempotencyKey,
    scope::{Scope, TenantId},
    store::OperationId,
    store::{
        Acquired, Backoff, ClaimRequest, LeaseRequest, LeaseStore, OperationState, Owned,
        StoreError, StoreErrorKind, StoredRequest,
    },
};

use super::report::{ensure, fail, OrFail};

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

fn claim(scope: Scope, key: &IdempotencyKey, fingerprint: u8) -> ClaimRequest {
    request(scope, key, fingerprint, DAY, WAIT)
}

/// [`claim`], for checks that keep a local named `claim`.
fn claim_in(scope: Scope, key: &IdempotencyKey, fingerprint: u8) -> ClaimRequest {
    claim(scope, key, fingerprint)
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

/// One owner: of many concurrent acquires of a new key, exactly one owns the
/// operation (under the id it proposed); every other one finds it running
/// under that id.
pub async fn concurrent_acquires_have_one_owner<St: LeaseStore>(
    store: &St,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::OneOwner;
    let key = unique_key();
    let claim = claim(scope("t1"), &key, 1);
    let mut racers = JoinSet::new();
    for _ in 0..RACERS {
        let store = store.clone();
        let claim = claim.clone();
        racers.spawn(async move {
            let request = lease_request(LONG);
            match store
                .acquire(&claim, &request)
                .await
                .or_fail(G, "acquire")?
            {
                Acquired::Owned(owned) => {
                    ensure!(
                        owned.operation_id == request.operation_id,
                        G,
                        "a new operation gets the id its request proposed"
                    );
                    ensure!(!owned.taken_over, G, "a new key is no takeover");
                    Ok((Some(owned), None))
                }
                Acquired::Running { operation_id, .. } => Ok((None, Some(operation_id))),
                other => fail!(G, "expected Owned or Running, got {}", describe(&other)),
            }
        });
    }
    let mut owners = Vec::new();
    let mut running = Vec::new();
    for (owned, seen) in join_all(racers, G).await? {
        owners.extend(owned);
        running.extend(seen);
    }
    ensure!(
        owners.len() == 1,
        G,
        "{} of {RACERS} concurrent acquires owned a new key (exactly one may)",
        owners.len()
    );
    let owner = owners.remove(0);
    ensure!(
        running.iter().all(|id| *id == owner.operation_id),
        G,
        "every other acquire must see the owner's operation running"
    );
    store
        .release(&owner.lease)
        .await
        .or_fail(G, "the owner's release")
}

/// One owner: while the lease is valid, a duplicate (the same request or
/// another one) finds the operation running, with the first request's
/// fingerprint so that the layer can tell a retry from a reused key.
pub async fn duplicate_during_a_lease_is_running<St: LeaseStore>(
    store: &St,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::OneOwner;
    let key = unique_key();
    let owner = must_acquire(
        store,
        &claim(scope("t1"), &key, 1),
        &lease_request(LONG),
        G,
        "owner",
    )
    .await?;
    for fingerprint in [1, 2] {
        match store
            .acquire(&claim(scope("t1"), &key, fingerprint), &lease_request(LONG))
            .await
        {
            Ok(Acquired::Running {
                operation_id,
                fingerprint: first,
            }) => {
                ensure!(
                    operation_id == owner.operation_id,
                    G,
                    "a duplicate must see the owner's operation"
                );
                ensure!(
                    first == Fingerprint::from_bytes([1; 32]),
                    G,
                    "Running must carry the first request's fingerprint"
                );
            }
            Ok(other) => fail!(
                G,
                "a duplicate during a valid lease must get Running, got {}",
                describe(&other)
            ),
            Err(e) => fail!(G, "acquire failed: {e}"),
        }
    }
    store
        .release(&owner.lease)
        .await
        .or_fail(G, "the owner's release")
}

/// Takeover: once the lease expired, another request is refused (`Running`),
/// and of many concurrent acquires by the same request exactly one takes the
/// operation over, keeping its id, under a larger token.
pub async fn expired_lease_is_taken_over_once<St: LeaseStore>(
    store: &St,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::LeaseTakeover;
    let key = unique_key();
    let claim = claim(scope("t1"), &key, 1);
    let first = must_acquire(store, &claim, &lease_request(SHORT), G, "first acquire").await?;
    tokio::time::sleep(PAST_SHORT).await;
    let other = request(scope("t1"), &key, 2, DAY, WAIT);
    must_be_running(
        store,
        &other,
        first.operation_id,
        G,
        "another request after the lease expired (a reused key)",
    )
    .await?;
    let mut racers = JoinSet::new();
    for _ in 0..RACERS {
        let store = store.clone();
        let claim = claim.clone();
        racers.spawn(async move {
            match store.acquire(&claim, &lease_request(LONG)).await {
                Ok(Acquired::Owned(owned)) => Ok((Some(owned), None)),
                Ok(Acquired::Running { operation_id, .. }) => Ok((None, Some(operation_id))),
                Ok(other) => fail!(G, "expected Owned or Running, got {}", describe(&other)),
                Err(e) => fail!(G, "acquire failed: {e}"),
            }
        });
    }
    let mut owners = Vec::new();
    let mut running = Vec::new();
    for (owned, seen) in join_all(racers, G).await? {
        owners.extend(owned);
        running.extend(seen);
    }
    ensure!(
        owners.len() == 1,
        G,
        "{} of {RACERS} concurrent acquires took an expired lease over (exactly one may)",
        owners.len()
    );
    let owner = owners.remove(0);
    ensure!(owner.taken_over, G, "the new owner is told it took over");
    ensure!(
        owner.token > first.token,
        G,
        "the new token ({}) must be larger than the old ({})",
        owner.token,
        first.token
    );
    ensure!(
        owner.operation_id == first.operation_id,
        G,
        "the operation keeps its id"
    );
    ensure!(
        running.iter().all(|id| *id == first.operation_id),
        G,
        "every other acquire must see the operation running"
    );
    store
        .release(&owner.lease)
        .await
        .or_fail(G, "the new owner's release")
}

/// Fencing: after a takeover the old lease can neither open a fenced
/// transaction, nor heartbeat, finish or release, and each attempt changes
/// nothing; the new owner can do all of them.
pub async fn stale_owner_is_fenced<St: LeaseStore>(store: &St) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::Fencing;
    let key = unique_key();
    let claim = claim(scope("t1"), &key, 1);
    let (old, new) = taken_over(store, &claim).await?;

    must_be_fenced(store.fenced(&old.lease).await, "a fenced transaction")?;
    must_be_fenced(store.heartbeat(&old.lease, LONG).await, "a heartbeat")?;
    must_be_fenced(
        store.finish(&old.lease, &response(b"stale")).await,
        "finishing",
    )?;
    must_be_running(
        store,
        &claim,
        new.operation_id,
        G,
        "after a stale finish the operation must still run under its new owner",
    )
    .await?;
    must_be_fenced(store.release(&old.lease).await, "releasing")?;
    must_be_running(
        store,
        &claim,
        new.operation_id,
        G,
        "after a stale release the key must stay held",
    )
    .await?;

    let tx = store
        .fenced(&new.lease)
        .await
        .or_fail(G, "the current owner's fenced transaction")?;
    store
        .commit_fenced(tx)
        .await
        .or_fail(G, "the current owner's fenced commit")?;
    store
        .heartbeat(&new.lease, LONG)
        .await
        .or_fail(G, "the current owner's heartbeat")?;
    let answer = response(b"new owner");
    store
        .finish(&new.lease, &answer)
        .await
        .or_fail(G, "the current owner's finish")?;
    match store.acquire(&claim, &lease_request(LONG)).await {
        Ok(Acquired::Completed(record)) => ensure!(
            record.response == answer,
            G,
            "the answer remembered must be the current owner's"
        ),
        Ok(other) => fail!(
            G,
            "after the owner finished, expected Completed, got {}",
            describe(&other)
        ),
        Err(e) => fail!(G, "acquire failed: {e}"),
    }
    Ok(())
}

/// Tokens only grow: each new owner of a key (resuming after a release,
/// after the record's retention ended) gets a token larger than every
/// earlier one, and a new operation gets a new id.
pub async fn tokens_only_grow<St: LeaseStore>(store: &St) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::MonotonicToken;
    let key = unique_key();
    let claim = claim(scope("t1"), &key, 1);
    let first = must_acquire(store, &claim, &lease_request(LONG), G, "first owner").await?;
    store
        .release(&first.lease)
        .await
        .or_fail(G, "the first owner's release")?;
    // The released operation resumes; its answer is then remembered for no
    // time at all, so the acquire after it starts anew.
    let forgotten = request(scope("t1"), &key, 1, Duration::ZERO, WAIT);
    let second = must_acquire(
        store,
        &forgotten,
        &lease_request(LONG),
        G,
        "acquire after a release",
    )
    .await?;
    ensure!(
        second.token > first.token,
        G,
        "after a release the token ({}) must be larger than before ({})",
        second.token,
        first.token
    );
    store
        .finish(&second.lease, &response(b"second"))
        .await
        .or_fail(G, "the second owner's finish")?;
    let proposed = lease_request(LONG);
    let third = must_acquire(
        store,
        &claim,
        &proposed,
        G,
        "acquire after the record's retention ended",
    )
    .await?;
    ensure!(
        !third.taken_over && third.operation_id == proposed.operation_id,
        G,
        "after the retention ended the key holds a new operation with a new id"
    );
    ensure!(
        third.token > second.token,
        G,
        "after the retention ended the token ({}) must be larger than every earlier one ({} and \
         {})",
        third.token,
        first.token,
        second.token
    );
    store
        .release(&third.lease)
        .await
        .or_fail(G, "the last owner's release")
}

/// Heartbeats keep the lease: an owner that heartbeats past its lease's
/// original end still owns it, and a duplicate still finds it running.
pub async fn heartbeats_keep_the_lease<St: LeaseStore>(store: &St) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::Heartbeat;
    let key = unique_key();
    let claim = claim(scope("t1"), &key, 1);
    let owner = must_acquire(store, &claim, &lease_request(SHORT), G, "owner").await?;
    // Twice the lease in all, a heartbeat every half lease.
    for _ in 0..4 {
        tokio::time::sleep(SHORT / 2).await;
        store
            .heartbeat(&owner.lease, SHORT)
            .await
            .or_fail(G, "the owner's heartbeat")?;
    }
    must_be_running(
        store,
        &claim,
        owner.operation_id,
        G,
        "a heartbeated lease must not be taken over",
    )
    .await?;
    store
        .release(&owner.lease)
        .await
        .or_fail(G, "the owner's release")
}

/// A finished operation replays its answer byte for byte, with the first
/// request's fingerprint, and its status is `Completed` for its own tenant
/// only.
pub async fn finished_operation_replays_and_has_a_status<St: LeaseStore>(
    store: &St,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::Finish;
    const S: Guarantee = Guarantee::Status;
    let key = unique_key();
    let tenant = TenantId::new("t1");
    let claim = claim(scope("t1"), &key, 1);
    let owner = must_acquire(store, &claim, &lease_request(LONG), G, "owner").await?;
    let status = |tenant: TenantId, id: OperationId| {
        let store = store.clone();
        async move {
            store
                .operation(&tenant, id)
                .await
                .or_fail(S, "operation lookup")
        }
    };
    match status(tenant.clone(), owner.operation_id).await? {
        Some(operation) => ensure!(
            operation.state == OperationState::Running,
            S,
            "an owned operation is Running"
        ),
        None => fail!(S, "an owned operation must be found"),
    }
    let answer = response(b"\x00{\"id\":1}\xff");
    store
        .finish(&owner.lease, &answer)
        .await
        .or_fail(G, "the owner's finish")?;
    for (fingerprint, what) in [(1, "the same request"), (2, "another request")] {
        match store
            .acquire(
                &request(scope("t1"), &key, fingerprint, DAY, WAIT),
                &lease_request(LONG),
            )
            .await
        {
            Ok(Acquired::Completed(record)) => {
                ensure!(
                    record.response == answer,
                    G,
                    "{what} must get the answer byte for byte"
                );
                ensure!(
                    record.fingerprint == Fingerprint::from_bytes([1; 32]),
                    G,
                    "the record carries the first request's fingerprint"
                );
            }
            Ok(other) => fail!(
                G,
                "{what} after the finish: expected Completed, got {}",
                describe(&other)
            ),
            Err(e) => fail!(G, "acquire failed: {e}"),
        }
    }
    match status(tenant, owner.operation_id).await? {
        Some(operation) => {
            ensure!(
                operation.id == owner.operation_id,
                S,
                "the status names another operation"
            );
            ensure!(
                operation.state == OperationState::Completed(answer),
                S,
                "a finished operation is Completed with its answer"
            );
        }
        None => fail!(S, "a finished operation must be found"),
    }
    ensure!(
        status(TenantId::new("t2"), owner.operation_id)
            .await?
            .is_none(),
        S,
        "another tenant must not see the operation"
    );
    ensure!(
        status(TenantId::new("t1"), OperationId::random())
            .await?
            .is_none(),
        S,
        "an unknown id must not be found"
    );
    Ok(())
}

/// Recovery: an operation whose lease expired is taken over by exactly one
/// of two concurrent recoveries, under a larger token and its id, with the
/// stored request intact; a live lease is not recovered.
pub async fn expired_lease_is_recovered_once<St: LeaseStore>(
    store: &St,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::Recovery;
    // An endpoint of its own: recovery takes any abandoned operation of it.
    let endpoint = format!("POST /conformance/recover/{} v1", unique_key().as_str());
    let scope = Scope::new(TenantId::new("t1"), endpoint.as_str());
    let key = unique_key();
    let claim = claim(scope.clone(), &key, 1);
    let first = must_acquire(store, &claim, &lease_request(SHORT), G, "owner").await?;
    ensure!(
        store
            .recover(&endpoint, LONG, DAY, Backoff::NONE)
            .await
            .or_fail(G, "recover")?
            .is_none(),
        G,
        "a live lease must not be recovered"
    );
    tokio::time::sleep(PAST_SHORT).await;
    let mut workers = JoinSet::new();
    for _ in 0..2 {
        let store = store.clone();
        let endpoint = endpoint.clone();
        workers.spawn(async move {
            store
                .recover(&endpoint, LONG, DAY, Backoff::NONE)
                .await
                .or_fail(G, "recover")
        });
    }
    let mut recovered: Vec<_> = join_all(workers, G).await?.into_iter().flatten().collect();
    ensure!(
        recovered.len() == 1,
        G,
        "{} of two concurrent recoveries took the operation over (exactly one may)",
        recovered.len()
    );
    let recovered = recovered.remove(0);
    ensure!(
        recovered.owned.token > first.token,
        G,
        "the new token ({}) must be larger than the old ({})",
        recovered.owned.token,
        first.token
    );
    ensure!(
        recovered.owned.operation_id == first.operation_id,
        G,
        "the operation keeps its id"
    );
    ensure!(recovered.owned.taken_over, G, "a recovery is a takeover");
    ensure!(recovered.scope == scope, G, "the operation's scope changed");
    ensure!(
        recovered.request == stored_request(),
        G,
        "the stored request (method, target, headers, body) must be intact"
    );
    must_be_fenced(
        store.heartbeat(&first.lease, LONG).await,
        "a heartbeat after recovery",
    )?;
    ensure!(
        store
            .recover(&endpoint, LONG, DAY, Backoff::NONE)
            .await
            .or_fail(G, "recover")?
            .is_none(),
        G,
        "a recovered operation is not recovered again"
    );
    store
        .finish(&recovered.owned.lease, &response(b"recovered"))
        .await
        .or_fail(G, "the recovered operation's finish")
}

/// Identity: an attempt that gives its lease up leaves the operation in
/// place: its status stays `Running` with the attempts counted, another
/// request under the key still finds it running, the same request resumes
/// it at once (same id, attempt 2, a larger token, the old lease fenced),
/// and a recovery worker resumes it only once its backoff has passed.
pub async fn a_released_operation_keeps_its_identity<St: LeaseStore>(
    store: &St,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::Identity;
    let endpoint = format!("POST /conformance/identity/{} v1", unique_key().as_str());
    let scope = Scope::new(TenantId::new("t1"), endpoint.as_str());
    let key = unique_key();
    let claim = claim_in(scope.clone(), &key, 1);
    let first = must_acquire(store, &claim, &lease_request(LONG), G, "first attempt").await?;
    ensure!(
        first.attempt == 1 && !first.taken_over,
        G,
        "a new operation's first attempt is attempt 1 (got {})",
        first.attempt
    );
    store
        .release(&first.lease)
        .await
        .or_fail(G, "the first attempt's release")?;
    match store
        .operation(&TenantId::new("t1"), first.operation_id)
        .await
    {
        Ok(Some(op)) if op.state == OperationState::Running && op.attempts == 1 => {}
        other => fail!(
            G,
            "after a release the operation must still exist, running after 1 attempt: {other:?}"
        ),
    }
    if must_be_fenced(store.heartbeat(&first.lease, LONG).await, "heartbeat").is_err() {
        fail!(
            G,
            "a released lease must be fenced: its heartbeat was not refused"
        );
    }
    let other = claim_in(scope.clone(), &key, 2);
    match store.acquire(&other, &lease_request(LONG)).await {
        Ok(Acquired::Running { operation_id, .. }) if operation_id == first.operation_id => {}
        Ok(other) => fail!(
            G,
            "another request under a released operation's key must find it running, got {}",
            describe(&other)
        ),
        Err(e) => fail!(G, "acquire by another request failed: {e}"),
    }
    let second = must_acquire(store, &claim, &lease_request(LONG), G, "the retry").await?;
    ensure!(
        second.operation_id == first.operation_id
            && second.attempt == 2
            && second.taken_over
            && second.token > first.token,
        G,
        "the retry must resume the same operation as attempt 2 under a larger token (id kept: \
         {}, attempt {}, token {} after {})",
        second.operation_id == first.operation_id,
        second.attempt,
        second.token,
        first.token
    );
    store
        .release(&second.lease)
        .await
        .or_fail(G, "the second attempt's release")?;
    let hour = Duration::from_secs(3600);
    let held_back = store
        .recover(&endpoint, LONG, DAY, Backoff::new(hour, hour))
        .await
        .or_fail(G, "recover during the backoff")?;
    ensure!(
        held_back.is_none(),
        G,
        "a recovery worker must wait out the backoff before the next attempt"
    );
    let Some(third) = store
        .recover(&endpoint, LONG, DAY, Backoff::NONE)
        .await
        .or_fail(G, "recover after the backoff")?
    else {
        fail!(
            G,
            "a released operation must be recoverable once its backoff passed"
        );
    };
    ensure!(
        third.owned.operation_id == first.operation_id && third.owned.attempt == 3,
        G,
        "recovery must resume the same operation as attempt 3 (got attempt {})",
        third.owned.attempt
    );
    store
        .finish(&third.owned.lease, &response(b"third"))
        .await
        .or_fail(G, "the third attempt's finish")?;
    match store
        .operation(&TenantId::new("t1"), first.operation_id)
        .await
    {
        Ok(Some(op)) if matches!(op.state, OperationState::Completed(_)) && op.attempts == 3 => {
            Ok(())
        }
        other => fail!(
            G,
            "the operation must end completed after 3 attempts: {other:?}"
        ),
    }
}

/// Failure: `fail` ends the operation with a remembered answer: the same
/// request gets it as a completed record, the status shows it failed after
/// the attempts given, and the lease that failed it is fenced.
pub async fn a_failed_operation_replays_its_failure<St: LeaseStore>(
    store: &St,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::Failure;
    let key = unique_key();
    let claim = claim(scope("t1"), &key, 1);
    let owner = must_acquire(store, &claim, &lease_request(LONG), G, "owner").await?;
    // A failure names no resource.
    let failure = response(br#"{"code":"operation_failed"}"#).with_resource_id(None);
    store
        .fail(&owner.lease, &failure, 3)
        .await
        .or_fail(G, "fail")?;
    match store.acquire(&claim, &lease_request(LONG)).await {
        Ok(Acquired::Completed(record)) if record.response == failure => {}
        Ok(Acquired::Completed(record)) => fail!(
            G,
            "a failed operation must replay its failure byte for byte: stored {:?}, replayed {:?}",
            failure,
            record.response
        ),
        Ok(other) => fail!(
            G,
            "a failed operation must replay its failure to the same request, got {}",
            describe(&other)
        ),
        Err(e) => fail!(G, "acquire after the failure failed: {e}"),
    }
    match store
        .operation(&TenantId::new("t1"), owner.operation_id)
        .await
    {
        Ok(Some(op)) if op.state == OperationState::Failed(failure.clone()) && op.attempts == 3 => {
        }
        other => fail!(
            G,
            "the status of a failed operation must say failed after 3 attempts: {other:?}"
        ),
    }
    must_be_fenced(store.fail(&owner.lease, &failure, 3).await, "failing again")?;
    must_be_fenced(store.heartbeat(&owner.lease, LONG).await, "heartbeat")?;
    Ok(())
}
