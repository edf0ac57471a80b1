//! The checks of the claim-first mode that need nothing but the store.

use std::time::Duration;

use bytes::Bytes;

use super::{
    claim_bounded, describe, join_all, lookup_bounded, must_be_aborted, must_be_free,
    must_carry_fingerprint, must_have_body, must_own, must_replay, must_replay_body, new_request,
    request, response, response_with, scope, start_together, under_one_key, unique_key,
    CheckFailure, Guarantee, DAY, DROP_WAIT, FREE_WAIT, WAIT,
};
use crate::{
    scope::{Scope, TenantId},
    store::{Claim, Store},
};

use super::report::{ensure, fail, OrFail};

/// How many claims race in [`concurrent_claims_have_one_owner`].
const RACERS: usize = 8;

/// **Replay**: a completed record comes back with the same status, headers
/// (repeated ones kept in order) and body bytes; [`Store::lookup`] finds
/// nothing before the claim and while the key is in progress, and the same
/// record (or nothing) once it completed.
pub async fn completed_record_replays_byte_for_byte<St: Store>(
    store: &St,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::Replay;
    let req = new_request(WAIT);
    let found = lookup_bounded(store, &req, G, "a key never claimed").await?;
    ensure!(
        found.is_none(),
        G,
        "lookup found {found:?} for a key never claimed"
    );
    let tx = must_own(store, &req, G, "first claim").await?;
    let found = lookup_bounded(store, &req, G, "a key in progress").await?;
    ensure!(
        found.is_none(),
        G,
        "lookup found {found:?} for a key still in progress"
    );
    let stored = response(b"\x00{\"id\":1}\xff");
    store.complete(tx, &stored).await.or_fail(G, "complete")?;
    let record = must_replay(store, &req, G, "second claim").await?;
    ensure!(
        record.response == stored,
        G,
        "the replayed response differs from the one completed: {:?} instead of {:?}",
        record.response,
        stored
    );
    // A store that reads ahead of a claim finds the same record (one that
    // does not finds nothing, and the claim answers).
    if let Some(found) = lookup_bounded(store, &req, G, "a completed key").await? {
        ensure!(
            found.response == stored,
            G,
            "lookup found {:?} instead of the response completed, {:?}",
            found.response,
            stored
        );
        must_carry_fingerprint(&found, 1, G, "the record lookup found")?;
    }
    Ok(())
}

/// **Replay**: the record carries the first request's fingerprint, so the
/// layer can tell a retry from a reused key.
pub async fn fingerprint_is_returned_for_comparison<St: Store>(
    store: &St,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::Replay;
    let [first, other] = under_one_key([7, 8]);
    let tx = must_own(store, &first, G, "first claim").await?;
    store
        .complete(tx, &response(b"a"))
        .await
        .or_fail(G, "complete")?;
    let record = must_replay(store, &other, G, "claim with another fingerprint").await?;
    must_carry_fingerprint(
        &record,
        7,
        G,
        "the record a claim with another fingerprint finds",
    )
}

/// **One owner**: of many concurrent claims of a new key exactly one owns
/// it; once it completes, every other one gets the owner's record (a
/// check-then-insert store lets several own it).
pub async fn concurrent_claims_have_one_owner<St: Store>(store: &St) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::OneOwner;
    enum Answer {
        // The racer, and whether its complete failed (and how).
        Owned(usize, Option<String>),
        Completed(Bytes),
    }
    let key = unique_key();
    let req = request(scope("t1"), &key, 1, DAY, Duration::from_secs(30));
    let racers = start_together(RACERS, |racer| {
        let (store, req) = (store.clone(), req.clone());
        async move {
            match claim_bounded(&store, &req, G, "a concurrent claim").await? {
                Claim::Owned(tx) => {
                    let body = Bytes::from(format!("racer {racer}"));
                    let completed = store.complete(tx, &response_with(body)).await;
                    Ok(Answer::Owned(racer, completed.err().map(|e| e.to_string())))
                }
                Claim::Completed(record) => Ok(Answer::Completed(record.response.body)),
                Claim::InProgress => fail!(
                    Guarantee::BoundedWait,
                    "a claim waiting 30 s answered InProgress although the owner completed at once"
                ),
            }
        }
    });
    let answers = join_all(racers, G).await?;
    let owners: Vec<(usize, &Option<String>)> = answers
        .iter()
        .filter_map(|a| match a {
            Answer::Owned(racer, error) => Some((*racer, error)),
            Answer::Completed(_) => None,
        })
        .collect();
    ensure!(
        owners.len() == 1,
        G,
        "{} of {RACERS} concurrent claims owned the same new key (exactly one may)",
        owners.len()
    );
    if let (racer, Some(error)) = owners[0] {
        fail!(
            G,
            "the only owner (racer {racer}) could not complete: {error}"
        );
    }
    let winner = Bytes::from(format!("racer {}", owners[0].0));
    for answer in &answers {
        if let Answer::Completed(body) = answer {
            ensure!(
                *body == winner,
                G,
                "a concurrent claim replayed {:?}, not the owner's record {:?}",
                String::from_utf8_lossy(body),
                String::from_utf8_lossy(&winner)
            );
        }
    }
    let what = "a claim after the race must replay the owner's record";
    must_replay_body(store, &req, &winner, G, what).await
}

/// **One owner**: a handle whose transaction ended (here: aborted through a
/// clone) cannot complete the key once another claim owns it: `complete`
/// answers [`StoreErrorKind::TransactionAborted`] and changes nothing (a
/// store whose `complete` writes the record without checking that its
/// handle still owns the key, by its token or its open transaction,
/// overwrites the new owner's).
///
/// [`StoreErrorKind::TransactionAborted`]: crate::store::StoreErrorKind::TransactionAborted
pub async fn stale_handle_cannot_complete<St: Store>(store: &St) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::OneOwner;
    let key = unique_key();
    let req = request(scope("t1"), &key, 1, DAY, FREE_WAIT);
    let stale = must_own(store, &req, G, "first claim").await?;
    store
        .abort(stale.clone())
        .await
        .or_fail(Guarantee::AbortFreesTheKey, "abort")?;
    let current = must_own(
        store,
        &req,
        Guarantee::AbortFreesTheKey,
        "the claim after the abort",
    )
    .await?;
    let stale_complete = store.complete(stale, &response(b"stale")).await;
    must_be_aborted(
        stale_complete,
        G,
        "complete through an aborted handle",
        "while another claim owned the key",
    )?;
    let probe = request(scope("t1"), &key, 1, DAY, Duration::from_millis(200));
    match claim_bounded(store, &probe, G, "a claim while the new owner works").await? {
        Claim::InProgress => {}
        Claim::Completed(record) => fail!(
            G,
            "the aborted handle's complete was remembered (body {:?}) while another claim owned \
             the key: complete must check that its handle still owns the key",
            String::from_utf8_lossy(&record.response.body)
        ),
        Claim::Owned(_) => fail!(G, "a claim owned the key while the new owner held it"),
    }
    store
        .complete(current, &response(b"current"))
        .await
        .or_fail(G, "the current owner's complete")?;
    let what = "a claim after the current owner completed must replay its record";
    must_replay_body(store, &req, b"current", G, what).await
}

/// **Abort frees the key**: after an abort, the next claim owns the key
/// (within a short wait: nothing holds it any more).
pub async fn abort_frees_the_key<St: Store>(store: &St) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::AbortFreesTheKey;
    let req = new_request(FREE_WAIT);
    let tx = must_own(store, &req, G, "first claim").await?;
    store.abort(tx).await.or_fail(G, "abort")?;
    must_be_free(store, &req, G, "the claim after the abort").await
}

/// **Drop frees the key**: dropping every clone of an unfinished handle
/// (a handler that panicked, a cancelled request) rolls back and frees the
/// key.
pub async fn dropped_handle_frees_the_key<St: Store>(store: &St) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::DropFreesTheKey;
    let req = new_request(DROP_WAIT);
    let tx = must_own(store, &req, G, "first claim").await?;
    let clone = tx.clone();
    drop(tx);
    drop(clone);
    must_be_free(store, &req, G, "the claim after the handle was dropped").await
}

/// **Bounded wait**: a claim that meets an unfinished owner answers
/// `InProgress` once its wait (200 ms here) is over, not much later.
pub async fn wait_is_bounded<St: Store>(store: &St) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::BoundedWait;
    let key = unique_key();
    let tx = must_own(store, &request(scope("t1"), &key, 1, DAY, WAIT), G, "owner").await?;
    let waiter = request(scope("t1"), &key, 1, DAY, Duration::from_millis(200));
    let answer = claim_bounded(store, &waiter, G, "a claim while the key is owned").await;
    store.abort(tx).await.or_fail(G, "abort")?;
    match answer? {
        Claim::InProgress => Ok(()),
        Claim::Owned(_) => fail!(
            Guarantee::OneOwner,
            "a second claim owned the key while its first owner held it"
        ),
        other => fail!(
            G,
            "a claim while the key is owned: expected InProgress, got {}",
            describe(&other)
        ),
    }
}

/// **Tenant isolation**: the same raw key in two tenants (and in two
/// endpoints of one tenant) names separate operations: a claim in one never
/// finds the other's record, completed or in progress.
pub async fn scopes_are_isolated<St: Store>(store: &St) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::TenantIsolation;
    let key = unique_key();
    let a = scope("tenant-a");
    let b = scope("tenant-b");
    let other_endpoint = Scope::new(TenantId::new("tenant-a"), "POST /conformance/other v1");
    let tx = must_own(
        store,
        &request(a.clone(), &key, 1, DAY, WAIT),
        G,
        "tenant a",
    )
    .await?;
    store
        .complete(tx, &response(b"a"))
        .await
        .or_fail(G, "complete tenant a")?;
    let mut owners = Vec::new();
    for (scope, body, who) in [
        (b.clone(), &b"b"[..], "tenant b"),
        (
            other_endpoint.clone(),
            &b"other"[..],
            "tenant a's other endpoint",
        ),
    ] {
        let req = request(scope, &key, 1, DAY, FREE_WAIT);
        match claim_bounded(store, &req, G, who).await? {
            Claim::Owned(tx) => owners.push((tx, body)),
            Claim::Completed(record) => fail!(
                G,
                "{who} got the record of the same raw key in tenant a (body {:?}): keys must be \
                 scoped by tenant and endpoint",
                String::from_utf8_lossy(&record.response.body)
            ),
            Claim::InProgress => fail!(
                G,
                "{who} found the same raw key of tenant a in progress: keys must be scoped by \
                 tenant and endpoint"
            ),
        }
    }
    for (tx, body) in owners {
        store
            .complete(tx, &response_with(Bytes::from_static(body)))
            .await
            .or_fail(G, "complete")?;
    }
    for (scope, body) in [
        (a, &b"a"[..]),
        (b, &b"b"[..]),
        (other_endpoint, &b"other"[..]),
    ] {
        let who = format!("{}/{}", scope.tenant().as_str(), scope.endpoint());
        let what = format!("{who} must replay its own record");
        must_replay_body(store, &request(scope, &key, 1, DAY, WAIT), body, G, &what).await?;
    }
    Ok(())
}

/// **Expiry takeover**: a record past its retention is taken over by the
/// next claim as a new operation, whose record then replaces it;
/// [`Store::lookup`] does not find it once its retention ended.
pub async fn expired_record_is_a_new_operation<St: Store>(store: &St) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::ExpiryTakeover;
    let key = unique_key();
    let req = request(scope("t1"), &key, 1, Duration::ZERO, WAIT);
    let tx = must_own(store, &req, G, "first claim").await?;
    store
        .complete(tx, &response(b"first"))
        .await
        .or_fail(G, "complete")?;
    let found = lookup_bounded(store, &req, G, "a record whose retention ended").await?;
    ensure!(
        found.is_none(),
        G,
        "lookup found {found:?}, whose retention ended"
    );
    let tx = must_own(
        store,
        &request(scope("t1"), &key, 2, DAY, FREE_WAIT),
        G,
        "a claim after the record's retention ended",
    )
    .await?;
    // The new operation names no resource: nothing of the first may remain.
    store
        .complete(tx, &response(b"second").with_resource_id(None))
        .await
        .or_fail(G, "complete the new operation")?;
    let what = "a claim after the new operation must replay its record";
    let record = must_replay(store, &req, G, what).await?;
    must_have_body(&record, b"second", G, what)?;
    ensure!(
        record.response.resource_id.is_none(),
        G,
        "the new operation's record kept the first one's resource id {:?}",
        record.response.resource_id
    );
    Ok(())
}
