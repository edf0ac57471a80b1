//! The checks of ownership: one owner, takeover, fencing, growing tokens.

use super::*;

/// One owner: of many concurrent acquires of a new key, exactly one owns the
/// operation (under the id it proposed); every other one finds it running
/// under that id.
pub async fn concurrent_acquires_have_one_owner<St: LeaseStore>(
    store: &St,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::OneOwner;
    let claim = new_request(WAIT);
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
    let (owner, running) = one_owner(racers, G, "owned a new key").await?;
    ensure!(
        running.iter().all(|id| *id == owner.operation_id),
        G,
        "every other acquire must see the owner's operation running"
    );
    release(store, &owner, G, "the owner's release").await
}

/// One owner: while the lease is valid, a duplicate (the same request or
/// another one) finds the operation running, with the first request's
/// fingerprint so that the layer can tell a retry from a reused key.
pub async fn duplicate_during_a_lease_is_running<St: LeaseStore>(
    store: &St,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::OneOwner;
    // The owner's request; then each request under its key, the same one
    // and another, is a duplicate.
    let requests = under_one_key([1, 2]);
    let owner = must_acquire(store, &requests[0], &lease_request(LONG), G, "owner").await?;
    for duplicate in &requests {
        match store.acquire(duplicate, &lease_request(LONG)).await {
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
    release(store, &owner, G, "the owner's release").await
}

/// Takeover: once the lease expired, another request is refused (`Running`),
/// and of many concurrent acquires by the same request exactly one takes the
/// operation over, keeping its id, under a larger token.
pub async fn expired_lease_is_taken_over_once<St: LeaseStore>(
    store: &St,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::LeaseTakeover;
    let [claim, other] = under_one_key([1, 2]);
    let first = must_acquire(store, &claim, &lease_request(SHORT), G, "first acquire").await?;
    tokio::time::sleep(PAST_SHORT).await;
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
    let (owner, running) = one_owner(racers, G, "took an expired lease over").await?;
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
    release(store, &owner, G, "the new owner's release").await
}

/// Fencing: after a takeover the old lease can neither open a fenced
/// transaction, nor heartbeat, finish or release, and each attempt changes
/// nothing; the new owner can do all of them.
pub async fn stale_owner_is_fenced<St: LeaseStore>(store: &St) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::Fencing;
    let claim = new_request(WAIT);
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
    let claim = new_request(WAIT);
    let first = must_acquire(store, &claim, &lease_request(LONG), G, "first owner").await?;
    release(store, &first, G, "the first owner's release").await?;
    // The released operation resumes; its answer is then remembered for no
    // time at all, so the acquire after it starts anew.
    let forgotten = claim.clone().with_retention(Duration::ZERO);
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
    release(store, &third, G, "the last owner's release").await
}
