//! The checks that look at what the handler wrote through the transaction
//! handle: [`Writes`] says how to write and how to look.

use std::{future::Future, time::Duration};

use super::{
    must_be_aborted, must_be_free, must_own, must_replay_body, new_request, response, unique_key,
    CheckFailure, Guarantee, DROP_WAIT, FREE_WAIT, WAIT,
};
use crate::store::{Claim, ClaimRequest, Store};

use super::report::{ensure, fail, OrFail};

/// The error a [`Writes`] method may return.
pub type BoxError = crate::error::BoxError;

/// How the suite writes through a store's transaction handle `Tx`, as a
/// handler would, and sees what was committed.
///
/// For a SQL store: [`write`](Self::write) inserts a row into a table of
/// the test's own, [`fail`](Self::fail) runs a statement that fails (a
/// unique violation, `SELECT 1/0`) so that the transaction can no longer
/// commit, and [`is_committed`](Self::is_committed) looks for the row from
/// another connection. [`MemoryStore`](crate::memory::MemoryStore)
/// implements it with [`MemoryTx`](crate::memory::MemoryTx)'s staged rows.
pub trait Writes<Tx>: Send + Sync + 'static {
    /// Writes a row identified by `marker` through the owner's handle.
    fn write(&self, tx: &Tx, marker: &str) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// Makes a statement through the handle fail, as a constraint violation
    /// does: the transaction can no longer commit. The error the statement
    /// got is not an error of this method.
    fn fail(&self, tx: &Tx) -> impl Future<Output = Result<(), BoxError>> + Send;

    /// Whether the row `marker` is committed, as another connection sees it.
    fn is_committed(&self, marker: &str) -> impl Future<Output = Result<bool, BoxError>> + Send;
}

/// [`run_all`](super::run_all)'s stand-in: never called.
pub(super) enum NoWrites {}

impl<Tx: Sync> Writes<Tx> for NoWrites {
    async fn write(&self, _: &Tx, _: &str) -> Result<(), BoxError> {
        match *self {}
    }
    async fn fail(&self, _: &Tx) -> Result<(), BoxError> {
        match *self {}
    }
    async fn is_committed(&self, _: &str) -> Result<bool, BoxError> {
        match *self {}
    }
}

pub(super) fn marker(what: &str) -> String {
    format!("{what}-{}", unique_key().as_str())
}

pub(super) async fn write<Tx, W: Writes<Tx>>(
    writes: &W,
    tx: &Tx,
    marker: &str,
    guarantee: Guarantee,
) -> Result<(), CheckFailure> {
    writes
        .write(tx, marker)
        .await
        .map_err(|e| CheckFailure::new(guarantee, format!("the handler's write failed: {e}")))
}

async fn committed<Tx, W: Writes<Tx>>(
    writes: &W,
    marker: &str,
    guarantee: Guarantee,
) -> Result<bool, CheckFailure> {
    writes.is_committed(marker).await.map_err(|e| {
        CheckFailure::new(
            guarantee,
            format!("looking for the handler's write failed: {e}"),
        )
    })
}

/// Claims a [`new_request`] waiting at most `wait`, which must own the key,
/// and writes a row through the handle as a handler would, its marker
/// named after `what`: the request, the handle and the row's marker.
async fn own_and_write<St: Store, W: Writes<St::Tx>>(
    store: &St,
    writes: &W,
    wait: Duration,
    what: &str,
    guarantee: Guarantee,
) -> Result<(ClaimRequest, St::Tx, String), CheckFailure> {
    let request = new_request(wait);
    let marker = marker(what);
    let tx = must_own(store, &request, guarantee, "first claim").await?;
    write(writes, &tx, &marker, guarantee).await?;
    Ok((request, tx, marker))
}

/// What a check expects of a row the handler wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Row {
    /// Committed.
    Committed,
    /// Not committed: rolled back, or not yet.
    Absent,
}

/// The row `marker` must be as `expected`: otherwise the check fails with
/// `guarantee`, saying `why`.
pub(super) async fn expect_row<Tx, W: Writes<Tx>>(
    writes: &W,
    marker: &str,
    expected: Row,
    guarantee: Guarantee,
    why: &str,
) -> Result<(), CheckFailure> {
    let found = match committed(writes, marker, guarantee).await? {
        true => Row::Committed,
        false => Row::Absent,
    };
    ensure!(found == expected, guarantee, "{why}");
    Ok(())
}

/// **Atomic completion**: the handler's write is not visible while the
/// operation runs, and is committed once `complete` returned, together with
/// the record (a store that commits the handler's writes by themselves
/// shows them early).
pub async fn handler_writes_commit_with_the_response<St: Store, W: Writes<St::Tx>>(
    store: &St,
    writes: &W,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::AtomicCompletion;
    let (req, tx, marker) = own_and_write(store, writes, WAIT, "committed", G).await?;
    let early = committed::<St::Tx, W>(writes, &marker, G).await;
    if matches!(early, Ok(true)) {
        // Finish the operation before failing, so that nothing stays held.
        let _ = store.abort(tx).await;
        fail!(
            G,
            "the handler's write was visible before complete: it must commit with the response"
        );
    }
    early?;
    store
        .complete(tx, &response(b"with writes"))
        .await
        .or_fail(G, "complete")?;
    let why = "complete returned Ok but the handler's write was not committed";
    expect_row(writes, &marker, Row::Committed, G, why).await?;
    let what = "a claim after complete must replay the completed response";
    must_replay_body(store, &req, b"with writes", G, what).await
}

/// **Atomic completion**: after a write of the handler failed (the
/// transaction cannot commit), `complete` answers
/// [`StoreErrorKind::TransactionAborted`], commits none of the handler's
/// writes, remembers no response and frees the key (a store that stores the
/// response apart from the handler's writes remembers an answer whose
/// writes never happened).
///
/// [`StoreErrorKind::TransactionAborted`]: crate::store::StoreErrorKind::TransactionAborted
pub async fn failed_write_fails_the_completion<St: Store, W: Writes<St::Tx>>(
    store: &St,
    writes: &W,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::AtomicCompletion;
    let (req, tx, marker) = own_and_write(store, writes, FREE_WAIT, "failed", G).await?;
    writes
        .fail(&tx)
        .await
        .map_err(|e| CheckFailure::new(G, format!("failing a statement failed: {e}")))?;
    let completed = store.complete(tx, &response(b"never")).await;
    let when = "after a statement of the transaction failed";
    must_be_aborted(completed, G, "complete", when)?;
    let why = "complete failed, yet the handler's write was committed";
    expect_row(writes, &marker, Row::Absent, G, why).await?;
    match super::claim_bounded(store, &req, G, "a claim after the failed complete").await? {
        Claim::Owned(tx) => store.abort(tx).await.or_fail(G, "abort")?,
        Claim::Completed(record) => fail!(
            G,
            "complete failed, yet its response was remembered (body {:?}): the response must \
             commit in the handler's transaction",
            String::from_utf8_lossy(&record.response.body)
        ),
        Claim::InProgress => fail!(
            Guarantee::AbortFreesTheKey,
            "a failed complete left the key taken"
        ),
    }
    Ok(())
}

/// **Abort frees the key**: an abort discards the handler's write.
pub async fn abort_discards_the_handler_writes<St: Store, W: Writes<St::Tx>>(
    store: &St,
    writes: &W,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::AbortFreesTheKey;
    let (req, tx, marker) = own_and_write(store, writes, FREE_WAIT, "aborted", G).await?;
    store.abort(tx).await.or_fail(G, "abort")?;
    let why = "the handler's write was committed although the owner aborted";
    expect_row(writes, &marker, Row::Absent, G, why).await?;
    must_be_free(store, &req, G, "the claim after the abort").await
}

/// **Drop frees the key**: dropping every clone of the handle discards the
/// handler's write.
pub async fn dropped_handle_discards_the_handler_writes<St: Store, W: Writes<St::Tx>>(
    store: &St,
    writes: &W,
) -> Result<(), CheckFailure> {
    const G: Guarantee = Guarantee::DropFreesTheKey;
    let (req, tx, marker) = own_and_write(store, writes, DROP_WAIT, "dropped", G).await?;
    drop(tx);
    // Owning the key again means the dropped transaction has ended.
    must_be_free(store, &req, G, "the claim after the handle was dropped").await?;
    let why = "the handler's write was committed although its handle was dropped unfinished";
    expect_row(writes, &marker, Row::Absent, G, why).await
}

/// Rows staged through [`MemoryTx::insert`](crate::memory::MemoryTx::insert)
/// into a table `conformance_writes`; [`MemoryTx::fail`](crate::memory::MemoryTx::fail)
/// fails the transaction.
impl Writes<crate::memory::MemoryTx> for crate::memory::MemoryStore {
    async fn write(&self, tx: &crate::memory::MemoryTx, marker: &str) -> Result<(), BoxError> {
        tx.insert(MEMORY_TABLE, serde_json::json!({ "marker": marker }))?;
        Ok(())
    }

    async fn fail(&self, tx: &crate::memory::MemoryTx) -> Result<(), BoxError> {
        tx.fail();
        Ok(())
    }

    async fn is_committed(&self, marker: &str) -> Result<bool, BoxError> {
        Ok(self
            .rows(MEMORY_TABLE)
            .iter()
            .any(|row| row["marker"] == marker))
    }
}

const MEMORY_TABLE: &str = "conformance_writes";
