//! The one-commit checks that look at what the handler wrote through the
//! transaction handle ([`Writes`]).

use super::{begin, expect_lost, expect_won};
use crate::{
    store::CommitStore,
    testing::conformance::{
        new_request,
        report::{ensure, OrFail},
        response,
        writes::{committed, marker, write},
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
    let req = new_request(WAIT);
    let tx = begin(store, &req, G).await?;
    let mark = marker("winner");
    write(writes, &tx, &mark, G).await?;
    ensure!(
        !committed(writes, &mark, G).await?,
        G,
        "the handler's write was visible before the commit"
    );
    let only = store.commit(tx, &req, &response(b"w")).await;
    let only = only.or_fail(G, "commit")?;
    expect_won(only, Guarantee::OneCommit, "the only commit of a new key")?;
    ensure!(
        committed(writes, &mark, G).await?,
        G,
        "the winner's write is not committed after its commit won"
    );
    Ok(())
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
    let (winner, loser) = (begin(store, &req, G).await?, begin(store, &req, G).await?);
    let (won, lost) = (marker("winner"), marker("loser"));
    write(writes, &winner, &won, G).await?;
    write(writes, &loser, &lost, G).await?;
    const ONE: Guarantee = Guarantee::OneCommit;
    let first = store.commit(winner, &req, &response(b"w")).await;
    expect_won(
        first.or_fail(ONE, "the first commit")?,
        ONE,
        "the first commit of a new key",
    )?;
    let second = store.commit(loser, &req, &response(b"l")).await;
    expect_lost(
        second.or_fail(ONE, "the second commit")?,
        ONE,
        "the second commit",
    )?;
    ensure!(
        committed(writes, &won, G).await?,
        G,
        "the winner's write is not committed"
    );
    ensure!(
        !committed(writes, &lost, G).await?,
        G,
        "the loser's write was committed although its commit lost"
    );
    Ok(())
}
