//! The one-commit checks that look at what the handler wrote through the
//! transaction handle ([`Writes`]).

use std::time::Duration;

use super::{
    begin, begin_new, begin_twice, commit, expect_won, must_lose, must_win, win_then_lose,
};
use crate::{
    store::{CommitStore, Committed},
    testing::conformance::{
        new_request, request, response, scope, unique_key,
        writes::{expect_row, marker, write, Row},
        CheckFailure, Guarantee, Writes, DAY, WAIT,
    },
};

/// **Atomic completion**: the winner's write is invisible until its commit
/// returned, then committed with its record.
pub async fn the_winners_writes_commit_with_its_record<St: CommitStore, W: Writes<St::Tx>>(
    store: &St,
    writes: &W,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::AtomicCompletion;
    let (req, tx) = begin_new(store, G).await?;
    let mark = marker("winner");
    write(writes, &tx, &mark, G).await?;
    let why = "the handler's write was visible before the commit";
    expect_row(writes, &mark, Row::Absent, G, why).await?;
    let only = commit(store, tx, &req, &response(b"w"), G, "commit").await?;
    expect_won(only, Guarantee::OneCommit, "the only commit of a new key")?;
    let why = "the winner's write is not committed after its commit won";
    expect_row(writes, &mark, Row::Committed, G, why).await
}

/// **A loser rolls back**: of two transactions that both wrote, the winner's
/// write is committed and the loser's is not, also when the loser commits
/// after the winner's record exists.
pub async fn a_losers_writes_are_rolled_back<St: CommitStore, W: Writes<St::Tx>>(
    store: &St,
    writes: &W,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::LoserRollsBack;
    let req = new_request(WAIT);
    let (winner, loser) = begin_twice(store, &req, G).await?;
    let (won, lost) = (marker("winner"), marker("loser"));
    write(writes, &winner, &won, G).await?;
    write(writes, &loser, &lost, G).await?;
    const ONE: Guarantee = Guarantee::OneCommit;
    win_then_lose(store, (winner, loser), &req, &response(b"w"), ONE).await?;
    let why = "the winner's write is not committed";
    expect_row(writes, &won, Row::Committed, G, why).await?;
    let why = "the loser's write was committed although its commit lost";
    expect_row(writes, &lost, Row::Absent, G, why).await
}

/// **Expiry takeover**: a record whose retention ends while a handler's
/// transaction runs (begun, and written through, before the end) is taken
/// over by that transaction's commit, or freed by it
/// ([`Committed::Freed`]: its writes rolled back, and a second run of the
/// work, as the layer makes, wins): expiry is judged when the commit
/// happens, not when the transaction began. The new record then answers.
pub async fn a_record_that_expires_during_the_work_is_won_at_commit<
    St: CommitStore,
    W: Writes<St::Tx>,
>(
    store: &St,
    writes: &W,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::ExpiryTakeover;
    let key = unique_key();
    let retention = Duration::from_millis(300);
    let short = request(scope("t1"), &key, 1, retention, WAIT);
    must_win(store, &short, &response(b"old"), G, "the first commit").await?;
    let req = request(scope("t1"), &key, 2, DAY, WAIT);
    let tx = begin(store, &req, G).await?;
    let mark = marker("late");
    write(writes, &tx, &mark, G).await?;
    // The behaviour under test is time passing: the first record's
    // retention runs out while this transaction is open.
    tokio::time::sleep(retention * 2).await;
    let committed = commit(store, tx, &req, &response(b"new"), G, "commit").await?;
    let what = "the commit of a transaction begun before the record expired, committed after";
    let mark = if let Committed::Freed = committed {
        // Freed: the work is rolled back, and runs again on the free key.
        let why = "a write of a commit that answered Freed is committed";
        expect_row(writes, &mark, Row::Absent, G, why).await?;
        let tx = begin(store, &req, G).await?;
        let again = marker("again");
        write(writes, &tx, &again, G).await?;
        let committed = commit(store, tx, &req, &response(b"new"), G, "the second run").await?;
        expect_won(committed, G, &format!("{what}, run again after Freed"))?;
        again
    } else {
        expect_won(committed, G, what)?;
        mark
    };
    let why = "the winner's write is not committed";
    expect_row(writes, &mark, Row::Committed, G, why).await?;
    let what = "a retry of the new record (which must replace the expired one)";
    must_lose(store, &req, &response(b"again"), b"new", G, what).await
}
