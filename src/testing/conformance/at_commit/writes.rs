//! The one-commit checks that look at what the handler wrote through the
//! transaction handle ([`Writes`]).

use super::{begin_new, begin_twice, commit, expect_won, win_then_lose};
use crate::{
    store::CommitStore,
    testing::conformance::{
        new_request, response,
        writes::{expect_row, marker, write, Row},
        CheckFailure, Guarantee, Writes, WAIT,
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
