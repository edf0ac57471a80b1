//! The checks of the one-commit mode ([`CommitStore`]).

use std::{sync::Arc, time::Duration};

use bytes::Bytes;

use super::{
    join_all, must_carry_fingerprint, must_have_body, must_replay_body, new_request, request,
    response, response_with, scope, start_together, under_one_key, unique_key, writes::NoWrites,
    CheckFailure, Guarantee, Report, Runner, Writes, DAY, WAIT,
};
use crate::{
    record::{Record, StoredResponse},
    store::{ClaimRequest, CommitStore, Committed},
};

use super::report::{ensure, fail, OrFail};

mod writes;

pub use writes::{
    a_losers_writes_are_rolled_back, a_record_that_expires_during_the_work_is_won_at_commit,
    the_winners_writes_commit_with_its_record,
};

const SKIPPED: &str = "needs a way to write through the handle: run_at_commit_with(store, writes)";

/// How many commits race in [`concurrent_commits_have_one_winner`].
const RACERS: usize = 8;

/// Runs every check of the one-commit mode ([`CommitStore`]) that needs
/// nothing but the store; those that look at the handler's writes are
/// reported skipped (see [`run_at_commit_with`]).
///
/// | check | guarantee | the store must |
/// | --- | --- | --- |
/// | [`concurrent_commits_have_one_winner`] | one commit wins | let exactly one of 8 concurrent commits of a new key win; every other one gets the winner's record |
/// | [`a_remembered_key_is_never_won_again`] | one commit wins | answer a commit of a key with an unexpired record with that record, also after the same request's winner |
/// | [`the_loser_gets_the_winners_record`] | replay | give the loser the winner's status, headers, body and fingerprint, byte for byte; a later claim finds the same record |
/// | [`another_request_gets_the_first_fingerprint`] | replay | give a commit with another fingerprint the first request's record, so the layer refuses it |
/// | [`an_aborted_transaction_leaves_the_key_free`] | abort frees the key | let the next commit win after an abort |
/// | [`scopes_are_isolated_at_commit`] | tenant isolation | let the same raw key of two tenants win once each |
/// | [`an_expired_record_is_won_again`] | expiry takeover | let a commit win a key whose record's retention ended (at once, or after answering [`Committed::Freed`]) |
///
/// With [`run_at_commit_with`], three more:
///
/// | check | guarantee | the store must |
/// | --- | --- | --- |
/// | [`the_winners_writes_commit_with_its_record`] | atomic completion | show the winner's write only once its commit returned |
/// | [`a_losers_writes_are_rolled_back`] | a loser rolls back | commit nothing a loser wrote, the winner's write only |
/// | [`a_record_that_expires_during_the_work_is_won_at_commit`] | expiry takeover | judge expiry at the commit: a record whose retention ended while the handler worked is taken over by its commit, or freed by it ([`Committed::Freed`], the work rolled back) for a second run that wins |
pub async fn run_at_commit<St: CommitStore>(store: St) -> Report {
    run(store, None::<NoWrites>).await
}

/// [`run_at_commit`], plus the checks that write through the transaction
/// handle with `writes` and look at what was committed.
pub async fn run_at_commit_with<St: CommitStore, W: Writes<St::Tx>>(
    store: St,
    writes: W,
) -> Report {
    run(store, Some(writes)).await
}

async fn run<St: CommitStore, W: Writes<St::Tx>>(store: St, writes: Option<W>) -> Report {
    let mut run = Runner::new("CommitStore", store);
    check!(run, concurrent_commits_have_one_winner, OneCommit);
    check!(run, a_remembered_key_is_never_won_again, OneCommit);
    check!(run, the_loser_gets_the_winners_record, Replay);
    check!(run, another_request_gets_the_first_fingerprint, Replay);
    check!(
        run,
        an_aborted_transaction_leaves_the_key_free,
        AbortFreesTheKey
    );
    check!(run, scopes_are_isolated_at_commit, TenantIsolation);
    check!(run, an_expired_record_is_won_again, ExpiryTakeover);
    let writes = writes.map(Arc::new);
    check! { run, the_winners_writes_commit_with_its_record, AtomicCompletion, writes, SKIPPED }
    check! { run, a_losers_writes_are_rolled_back, LoserRollsBack, writes, SKIPPED }
    check! { run, a_record_that_expires_during_the_work_is_won_at_commit, ExpiryTakeover, writes, SKIPPED }
    run.finish()
}

/// Begins a transaction for `request`; an error fails the check.
async fn begin<St: CommitStore>(
    store: &St,
    request: &ClaimRequest,
    guarantee: Guarantee,
) -> Result<St::Tx, CheckFailure> {
    store.begin(request).await.or_fail(guarantee, "begin")
}

/// A [`new_request`] and a transaction begun for it (see [`begin`]).
async fn begin_new<St: CommitStore>(
    store: &St,
    guarantee: Guarantee,
) -> Result<(ClaimRequest, St::Tx), CheckFailure> {
    let request = new_request(WAIT);
    let tx = begin(store, &request, guarantee).await?;
    Ok((request, tx))
}

/// Two transactions begun for `request`, open together: the winner and the
/// loser to be (see [`win_then_lose`]).
async fn begin_twice<St: CommitStore>(
    store: &St,
    request: &ClaimRequest,
    guarantee: Guarantee,
) -> Result<(St::Tx, St::Tx), CheckFailure> {
    let winner = begin(store, request, guarantee).await?;
    Ok((winner, begin(store, request, guarantee).await?))
}

/// Commits `tx`, begun for `request`, with `response`; an error fails the
/// check with `guarantee`, naming `what`.
async fn commit<St: CommitStore>(
    store: &St,
    tx: St::Tx,
    request: &ClaimRequest,
    response: &StoredResponse,
    guarantee: Guarantee,
    what: &str,
) -> Result<Committed, CheckFailure> {
    store
        .commit(tx, request, response)
        .await
        .or_fail(guarantee, what)
}

/// Begins and commits `response` at once; an error fails the check.
async fn commit_new<St: CommitStore>(
    store: &St,
    request: &ClaimRequest,
    response: &StoredResponse,
    guarantee: Guarantee,
) -> Result<Committed, CheckFailure> {
    let tx = begin(store, request, guarantee).await?;
    commit(store, tx, request, response, guarantee, "commit").await
}

/// Commits `winner`, then `loser`, both begun for `request`: the first (with
/// `won`) must win and the second lose, or the check fails with
/// [`Guarantee::OneCommit`] (a store error with `guarantee`). The record the
/// loser was told.
async fn win_then_lose<St: CommitStore>(
    store: &St,
    (winner, loser): (St::Tx, St::Tx),
    request: &ClaimRequest,
    won: &StoredResponse,
    guarantee: Guarantee,
) -> Result<Record, CheckFailure> {
    const ONE: Guarantee = Guarantee::OneCommit;
    let first = commit(store, winner, request, won, guarantee, "the first commit").await?;
    expect_won(first, ONE, "the first commit of a new key")?;
    let lost = response(b"the loser's");
    let second = commit(store, loser, request, &lost, guarantee, "the second commit").await?;
    expect_lost(second, ONE, "the second commit")
}

fn describe_commit(committed: &Committed) -> String {
    match committed {
        Committed::Won => "Won".to_owned(),
        Committed::Lost(record) => format!(
            "Lost (body {:?})",
            String::from_utf8_lossy(&record.response.body)
        ),
        Committed::Held => "Held".to_owned(),
        Committed::Freed => "Freed".to_owned(),
    }
}

/// `committed` must be `Won`: anything else fails with `guarantee`,
/// naming `what`.
fn expect_won(committed: Committed, guarantee: Guarantee, what: &str) -> Result<(), CheckFailure> {
    match committed {
        Committed::Won => Ok(()),
        other => fail!(
            guarantee,
            "{what}: expected Won, got {}",
            describe_commit(&other)
        ),
    }
}

/// `committed` must be `Lost`: its record, or a failure with `guarantee`
/// naming `what`.
fn expect_lost(
    committed: Committed,
    guarantee: Guarantee,
    what: &str,
) -> Result<Record, CheckFailure> {
    match committed {
        Committed::Lost(record) => Ok(record),
        other => fail!(
            guarantee,
            "{what}: expected Lost, got {}",
            describe_commit(&other)
        ),
    }
}

/// A commit that must win: anything else fails the check.
async fn must_win<St: CommitStore>(
    store: &St,
    request: &ClaimRequest,
    response: &StoredResponse,
    guarantee: Guarantee,
    what: &str,
) -> Result<(), CheckFailure> {
    expect_won(
        commit_new(store, request, response, guarantee).await?,
        guarantee,
        what,
    )
}

/// A commit of a key whose record expired, which must win it: at once
/// ([`Committed::Won`]), or after freeing it ([`Committed::Freed`]) by a
/// second commit of the same request, as the layer runs the work again.
/// Anything else fails the check.
async fn must_win_expired<St: CommitStore>(
    store: &St,
    request: &ClaimRequest,
    response: &StoredResponse,
    guarantee: Guarantee,
    what: &str,
) -> Result<(), CheckFailure> {
    match commit_new(store, request, response, guarantee).await? {
        Committed::Freed => {
            let again = format!("{what}, run again after Freed");
            must_win(store, request, response, guarantee, &again).await
        }
        committed => expect_won(committed, guarantee, what),
    }
}

/// A commit of `response` that must lose, told the remembered record with
/// the body `expected`: anything else fails the check with `guarantee`,
/// naming `what`.
async fn must_lose<St: CommitStore>(
    store: &St,
    request: &ClaimRequest,
    response: &StoredResponse,
    expected: &[u8],
    guarantee: Guarantee,
    what: &str,
) -> Result<(), CheckFailure> {
    let record = expect_lost(
        commit_new(store, request, response, guarantee).await?,
        guarantee,
        what,
    )?;
    must_have_body(&record, expected, guarantee, what)
}

/// **One commit wins**: of 8 transactions of a new key, started together
/// and committed at once, exactly one wins; every other one is told the
/// winner's record. (They start together rather than wait for each other
/// once begun: a store behind a pooler with fewer server connections than
/// racers could not hold all of them open at once.)
pub async fn concurrent_commits_have_one_winner<St: CommitStore>(
    store: &St,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::OneCommit;
    let req = new_request(WAIT);
    let racers = start_together(RACERS, |racer| {
        let (store, req) = (store.clone(), req.clone());
        async move {
            let tx = begin(&store, &req, G).await?;
            let body = Bytes::from(format!("racer {racer}"));
            let committed = store.commit(tx, &req, &response_with(body.clone())).await;
            Ok((body, committed.or_fail(G, "a concurrent commit")?))
        }
    });
    let answers = join_all(racers, G).await?;
    let winners: Vec<&Bytes> = answers
        .iter()
        .filter(|(_, c)| matches!(c, Committed::Won))
        .map(|(body, _)| body)
        .collect();
    ensure!(
        winners.len() == 1,
        G,
        "{} of {RACERS} concurrent commits of one key won; exactly one must",
        winners.len()
    );
    for (_, committed) in &answers {
        match committed {
            Committed::Won => {}
            Committed::Lost(record) => ensure!(
                record.response.body == *winners[0],
                G,
                "a loser was told the record {:?}, not the winner's {:?}",
                record.response.body,
                winners[0]
            ),
            Committed::Held => fail!(G, "a loser was told Held, not the winner's record"),
            Committed::Freed => fail!(G, "a loser was told Freed, not the winner's record"),
        }
    }
    Ok(())
}

/// **One commit wins**: once a key is remembered, no commit wins it again
/// while the record lives, also one by the same request, and a claim of the
/// claim-first mode finds the record.
pub async fn a_remembered_key_is_never_won_again<St: CommitStore>(
    store: &St,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::OneCommit;
    let req = new_request(WAIT);
    must_win(store, &req, &response(b"first"), G, "the first commit").await?;
    for attempt in ["a retry", "another retry"] {
        let what = format!("{attempt} of a remembered key");
        must_lose(store, &req, &response(b"again"), b"first", G, &what).await?;
    }
    must_replay_body(store, &req, b"first", G, "a claim after the commit").await
}

/// **Replay**: the loser of two commits gets the winner's status, headers
/// (repeated ones in order), body and resource id byte for byte, with the
/// winner's fingerprint.
pub async fn the_loser_gets_the_winners_record<St: CommitStore>(
    store: &St,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::Replay;
    let req = request(scope("t1"), &unique_key(), 3, DAY, WAIT);
    let begun = begin_twice(store, &req, G).await?;
    let stored = response(b"\x00{\"id\":1}\xff");
    let record = win_then_lose(store, begun, &req, &stored, G).await?;
    ensure!(
        record.response == stored,
        G,
        "the loser was told {:?} instead of the winner's {:?}",
        record.response,
        stored
    );
    must_carry_fingerprint(&record, 3, G, "the record the loser is told")
}

/// **Replay**: a commit of another request under a remembered key is told
/// the first request's record, fingerprint included, so that the layer
/// refuses it as a reused key.
pub async fn another_request_gets_the_first_fingerprint<St: CommitStore>(
    store: &St,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::Replay;
    let [first, other] = under_one_key([7, 8]);
    must_win(store, &first, &response(b"a"), G, "the first commit").await?;
    let committed = commit_new(store, &other, &response(b"b"), G).await?;
    let what = "another request under a remembered key";
    let record = expect_lost(committed, Guarantee::OneCommit, what)?;
    must_carry_fingerprint(&record, 7, G, "the record another request is told")
}

/// **Abort frees the key**: an aborted transaction remembers nothing; the
/// next commit of its key wins.
pub async fn an_aborted_transaction_leaves_the_key_free<St: CommitStore>(
    store: &St,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::AbortFreesTheKey;
    let (req, tx) = begin_new(store, G).await?;
    store.abort(tx).await.or_fail(G, "abort")?;
    must_win(store, &req, &response(b"b"), G, "the commit after an abort").await
}

/// **Tenant isolation**: the same raw key of two tenants names two
/// operations; each wins once and keeps its own record.
pub async fn scopes_are_isolated_at_commit<St: CommitStore>(
    store: &St,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::TenantIsolation;
    let key = unique_key();
    let a = request(scope("tenant-a"), &key, 1, DAY, WAIT);
    let b = request(scope("tenant-b"), &key, 1, DAY, WAIT);
    for (req, body, what) in [
        (&a, b"a", "tenant a's commit"),
        (&b, b"b", "tenant b's commit (same raw key)"),
    ] {
        must_win(store, req, &response(body), G, what).await?;
    }
    let what = "tenant a's retry (told its own record)";
    must_lose(store, &a, &response(b"again"), b"a", G, what).await
}

/// **Expiry takeover**: a record past its retention is a free key; the next
/// commit wins it and its record replaces the old one.
pub async fn an_expired_record_is_won_again<St: CommitStore>(
    store: &St,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::ExpiryTakeover;
    let key = unique_key();
    let short = request(scope("t1"), &key, 1, Duration::from_millis(200), WAIT);
    must_win(store, &short, &response(b"old"), G, "the first commit").await?;
    // The behaviour under test is time passing: the retention runs out.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let req = request(scope("t1"), &key, 2, DAY, WAIT);
    must_win_expired(
        store,
        &req,
        &response(b"new"),
        G,
        "a commit after the retention",
    )
    .await?;
    let what = "a retry of the new record (which must replace the expired one)";
    must_lose(store, &req, &response(b"again"), b"new", G, what).await
}
