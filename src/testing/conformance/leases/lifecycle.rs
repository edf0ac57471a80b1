//! The checks of an operation's life: heartbeats, finish and status,
//! recovery, identity through a release, and failure.

use super::*;

/// Heartbeats keep the lease: an owner that heartbeats past its lease's
/// original end still owns it, and a duplicate still finds it running.
pub async fn heartbeats_keep_the_lease<St: LeaseStore>(store: &St) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::Heartbeat;
    let claim = new_request(WAIT);
    let owner = must_acquire(store, &claim, &lease_request(SHORT), G, "owner").await?;
    heartbeat_through_twice_the_lease(store, &owner, G).await?;
    must_be_running(
        store,
        &claim,
        owner.operation_id,
        G,
        "a heartbeated lease must not be taken over",
    )
    .await?;
    release(store, &owner, G, "the owner's release").await
}

/// A finished operation replays its answer byte for byte, with the first
/// request's fingerprint, and its status is `Completed` for its own tenant
/// only.
pub async fn finished_operation_replays_and_has_a_status<St: LeaseStore>(
    store: &St,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::Finish;
    const S: Guarantee = Guarantee::Status;
    let tenant = TenantId::new("t1");
    let [claim, other] = under_one_key([1, 2]);
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
    for (request, what) in [(&claim, "the same request"), (&other, "another request")] {
        match store.acquire(request, &lease_request(LONG)).await {
            Ok(Acquired::Completed(record)) => {
                ensure!(
                    record.response == answer,
                    G,
                    "{what} must get the answer byte for byte"
                );
                must_carry_fingerprint(&record, 1, G, &format!("the record {what} gets"))?;
            }
            Ok(acquired) => fail!(
                G,
                "{what} after the finish: expected Completed, got {}",
                describe(&acquired)
            ),
            Err(e) => fail!(G, "acquire failed: {e}"),
        }
    }
    match status(tenant.clone(), owner.operation_id).await? {
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
    let elsewhere = status(TenantId::new("t2"), owner.operation_id).await?;
    ensure!(
        elsewhere.is_none(),
        S,
        "another tenant must not see the operation"
    );
    let unknown = status(tenant, OperationId::random()).await?;
    ensure!(unknown.is_none(), S, "an unknown id must not be found");
    Ok(())
}

/// Recovery: an operation whose lease expired is taken over by exactly one
/// of two concurrent recoveries, under a larger token and its id, with the
/// stored request intact; a live lease is not recovered.
pub async fn expired_lease_is_recovered_once<St: LeaseStore>(
    store: &St,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::Recovery;
    let (endpoint, scope) = endpoint_of_its_own("recover");
    let claim = request(scope.clone(), &unique_key(), 1, DAY, WAIT);
    let first = must_acquire(store, &claim, &lease_request(SHORT), G, "owner").await?;
    let why = "a live lease must not be recovered";
    must_not_recover(store, &endpoint, Backoff::NONE, G, "recover", why).await?;
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
    let why = "a recovered operation is not recovered again";
    must_not_recover(store, &endpoint, Backoff::NONE, G, "recover", why).await?;
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
    let (endpoint, scope) = endpoint_of_its_own("identity");
    let [claim, other] = under_one_key_in(scope, [1, 2]);
    let first = must_acquire(store, &claim, &lease_request(LONG), G, "first attempt").await?;
    ensure!(
        first.attempt == 1 && !first.taken_over,
        G,
        "a new operation's first attempt is attempt 1 (got {})",
        first.attempt
    );
    release(store, &first, G, "the first attempt's release").await?;
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
    release(store, &second, G, "the second attempt's release").await?;
    let hour = Duration::from_secs(3600);
    let why = "a recovery worker must wait out the backoff before the next attempt";
    let backoff = Backoff::new(hour, hour);
    let what = "recover during the backoff";
    must_not_recover(store, &endpoint, backoff, G, what, why).await?;
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
    let claim = new_request(WAIT);
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

/// An operation that runs longer than its retention keeps its identity:
/// the retention counts from its end (for one abandoned, from the end of
/// its last lease), so after its owner stops heart-beating its status is
/// still `Running`, and a recovery worker resumes it once its backoff has
/// passed, under the same id.
pub async fn an_operation_outlives_its_retention_while_it_runs<St: LeaseStore>(
    store: &St,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::Identity;
    let (endpoint, scope) = endpoint_of_its_own("outlives");
    let retention = SHORT * 2;
    let claim = request(scope.clone(), &unique_key(), 1, retention, WAIT);
    let owner = must_acquire(store, &claim, &lease_request(SHORT), G, "owner").await?;
    // The work outlasts the retention, heart-beating; then its owner dies.
    heartbeat_through_twice_the_lease(store, &owner, G).await?;
    tokio::time::sleep(PAST_SHORT).await;
    match store.operation(scope.tenant(), owner.operation_id).await {
        Ok(Some(op)) if op.state == OperationState::Running => {}
        other => fail!(
            G,
            "an abandoned operation older than its retention must still be running: {other:?}"
        ),
    }
    let backoff = Backoff::new(SHORT / 3, SHORT / 3);
    let recovered = store
        .recover(&endpoint, LONG, retention, backoff)
        .await
        .or_fail(G, "recover")?;
    let Some(recovered) = recovered else {
        fail!(
            G,
            "an abandoned operation older than its retention must be recovered once its backoff passed"
        )
    };
    ensure!(
        recovered.owned.operation_id == owner.operation_id,
        G,
        "the recovered operation keeps its id"
    );
    store
        .finish(&recovered.owned.lease, &response(b"late"))
        .await
        .or_fail(G, "the recovered operation's finish")
}

/// Heartbeats `owner`'s lease of [`SHORT`] every half lease, four times:
/// twice the lease in all.
async fn heartbeat_through_twice_the_lease<St: LeaseStore>(
    store: &St,
    owner: &Owned<St::Lease>,
    guarantee: Guarantee,
) -> Result<(), CheckFailure> {
    for _ in 0..4 {
        tokio::time::sleep(SHORT / 2).await;
        store
            .heartbeat(&owner.lease, SHORT)
            .await
            .or_fail(guarantee, "the owner's heartbeat")?;
    }
    Ok(())
}
