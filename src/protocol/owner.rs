//! The owner's transaction, written once over the [driver seam](super::driver):
//! the claim (its waits, the Citus split, a key in progress, one more try
//! on a faulty pooled connection), the completion, the abort, the
//! one-commit mode's begin and commit (and a lost commit's look at the
//! winner), the long-running mode's fenced transaction, and what a failed
//! end means. A driver's handle (`PgTx`, `SqlxTx`) is a [`Slot`] of its
//! connection plus its own query methods.

use std::{
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex as SyncMutex, PoisonError},
};

use tokio::{
    sync::{MappedMutexGuard, Mutex, MutexGuard},
    time::Instant,
};

use super::{
    at_commit::{at_commit_params, CLAIM_AT_COMMIT, CLAIM_AT_COMMIT_AND_RESET, LOST_AT_COMMIT},
    claim::{
        claim_params, settle, split_claim_rows, Claimed, CLAIM, CLAIM_INSERT, CLAIM_READ,
        CURRENT_XID,
    },
    complete::{complete_params, fenced_check_params, COMPLETE, COMPLETE_AND_RESET, FENCED_CHECK},
    driver::{Cancel, Connection, Deciding, Driver, End, Failed, Statement, Waits},
    errors::{
        claim_given_to_commit_fenced, connection_fault, ends_only_the_statement,
        fenced_given_to_complete, LOCK_NOT_AVAILABLE,
    },
    identity::{Identity, LeaseIdentity, Tx, TxIdentity},
    lease::{fenced, token_params, HOLD},
    record::{key_params, record_at},
    waits::{
        commit_gave_up, CANCEL_DEADLINE, CANCEL_GRACE, COMMIT_PATIENCE, GRACE, MIN_WAIT,
        ROLLBACK_PATIENCE, ROW_WAIT,
    },
};
use crate::{
    metrics::FencedAt,
    record::{Record, StoredResponse, TraceText},
    store::{Claim, ClaimRequest, Committed, StoreError, StoreErrorKind},
};

/// What a driver's transaction handle holds, shared by its clones: the
/// connection (statements through clones run one at a time), what cancels
/// the statement running on it, and who owns the key.
pub(crate) struct Slot<C: Connection> {
    conn: Mutex<Option<C>>,
    // Outside the connection's mutex: a statement holding that mutex is
    // what it cancels. Replaced with the connection, should a driver swap
    // it ([`Slot::replace_canceller`]).
    cancel: SyncMutex<C::Cancel>,
    id: TxIdentity,
    // A long-running owner's fenced transaction, ended by `commit_fenced`;
    // otherwise a claim's, ended by `complete`.
    fenced: bool,
}

/// A driver's transaction handle: an [`Arc`] of a [`Slot`].
pub(crate) trait Handle: Sized {
    /// The driver's connection.
    type Conn: Connection;

    /// The handle of `slot`.
    fn of(slot: Arc<Slot<Self::Conn>>) -> Self;

    /// The slot this handle shares with its clones.
    fn slot(&self) -> &Slot<Self::Conn>;
}

/// What [`Slot::try_take`] found.
enum Take<C> {
    Taken(C),
    Finished,
    Busy,
}

impl<C: Connection> Slot<C> {
    fn new(conn: C, id: TxIdentity, fenced: bool) -> Arc<Self> {
        Arc::new(Slot {
            cancel: SyncMutex::new(conn.canceller()),
            conn: Mutex::new(Some(conn)),
            id,
            fenced,
        })
    }

    /// The handle of a transaction that owns (or, in the one-commit mode,
    /// will claim) `request`'s key.
    pub(crate) fn of_request<H: Handle<Conn = C>>(
        conn: C,
        request: &ClaimRequest,
        token: i64,
        xid: String,
    ) -> H {
        let id = Identity::new(
            request.scope.clone(),
            request.key.clone(),
            request.fingerprint,
            token,
            request.retention,
            Tx::new(xid),
        );
        H::of(Self::new(conn, id, false))
    }

    /// Who owns the key.
    pub(crate) fn identity(&self) -> &TxIdentity {
        &self.id
    }

    /// Whether this is a long-running owner's fenced transaction.
    pub(crate) fn is_fenced(&self) -> bool {
        self.fenced
    }

    /// The connection, locked for one statement; `None` once the
    /// transaction ended.
    pub(crate) async fn lock(&self) -> Option<MappedMutexGuard<'_, C>> {
        MutexGuard::try_map(self.conn.lock().await, Option::as_mut).ok()
    }

    /// What now cancels the statement running on the connection: a driver
    /// that swapped the connection (lost before its first statement was
    /// answered) says so here.
    pub(crate) fn replace_canceller(&self, cancel: C::Cancel) {
        *self.cancel.lock().unwrap_or_else(PoisonError::into_inner) = cancel;
    }

    fn try_take(&self) -> Take<C> {
        match self.conn.try_lock() {
            Ok(mut conn) => conn.take().map_or(Take::Finished, Take::Taken),
            Err(_) => Take::Busy,
        }
    }

    /// Takes the connection out to commit; `None` if the transaction
    /// already ended. A statement a task of the handler still runs through
    /// a clone commits with the response, so the commit waits for it, up to
    /// [`COMMIT_PATIENCE`]; then the statement is cancelled, the
    /// transaction rolled back, and the commit refused (retryable).
    async fn take_to_commit(&self) -> Result<Option<C>, StoreError> {
        match self.try_take() {
            Take::Taken(conn) => return Ok(Some(conn)),
            Take::Finished => return Ok(None),
            Take::Busy => {}
        }
        if let Ok(mut held) = tokio::time::timeout(COMMIT_PATIENCE, self.conn.lock()).await {
            return Ok(held.take());
        }
        self.cancel_running().await;
        if let Ok(mut held) = tokio::time::timeout(CANCEL_GRACE, self.conn.lock()).await {
            if let Some(conn) = held.take() {
                let _ = Box::pin(conn.end(None, End::Rollback)).await;
            }
        }
        // Not taken within the grace: the last handle to go closes the
        // connection, and the server rolls back.
        Err(commit_gave_up())
    }

    /// Takes the connection out to roll back; `None` if the transaction
    /// already ended. A statement a task of the handler runs through a
    /// clone would hold the transaction until it ends: it is cancelled, and
    /// given [`CANCEL_GRACE`] to end.
    async fn take_to_abort(&self) -> Result<Option<C>, StoreError> {
        match self.try_take() {
            Take::Taken(conn) => return Ok(Some(conn)),
            Take::Finished => return Ok(None),
            Take::Busy => {}
        }
        self.cancel_running().await;
        match tokio::time::timeout(CANCEL_GRACE, self.conn.lock()).await {
            Ok(mut held) => Ok(held.take()),
            Err(_) => Err(StoreError::new(
                StoreErrorKind::Unavailable,
                "a statement left running on the connection did not end",
            )),
        }
    }

    /// Cancels whatever statement runs on the connection (a handler cut
    /// off at its deadline, a task it spawned), so that its locks and its
    /// connection come back now rather than when the statement ends.
    /// Whether the cancel request was delivered: one that could not be (the
    /// server unreachable within [`CANCEL_DEADLINE`]) says the database is
    /// not answering, and nothing is gained by waiting for the statement.
    async fn cancel_running(&self) -> bool {
        let cancel = self
            .cancel
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        match tokio::time::timeout(CANCEL_DEADLINE, cancel.cancel()).await {
            Ok(Ok(())) => true,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "could not cancel the statement still running for an abandoned owner");
                false
            }
            Err(_) => {
                tracing::warn!(
                    "cancelling the statement still running for an abandoned owner took too long; its connection is closed instead"
                );
                false
            }
        }
    }
}

impl<C: Connection> Drop for Slot<C> {
    fn drop(&mut self) {
        if self.conn.get_mut().is_some() {
            // The transaction never reached commit or rollback; the
            // connection is closed instead of being returned, and
            // PostgreSQL rolls back.
            self.id.warn_dropped_unfinished();
        }
    }
}

/// The answer once the transaction ended.
pub(crate) fn finished() -> StoreError {
    StoreError::new(
        StoreErrorKind::TransactionAborted,
        "the transaction has already finished",
    )
}

/// The database did not answer in time.
pub(crate) fn timed_out() -> StoreError {
    StoreError::new(
        StoreErrorKind::Unavailable,
        "the database did not answer within the wait",
    )
}

/// [`Store::claim`](crate::store::Store::claim): replay a completed record,
/// or claim the key by inserting its row, within the request's wait.
///
/// Answered by the wait (plus [`GRACE`]) whatever the database does; the
/// wait starts once a connection was had (taking one is bounded by the
/// pool's acquire timeout). A pooled connection the server closed (a
/// restart, a terminated backend), or whose session is not what the store
/// left, is only found out when used; nothing was committed on it, so the
/// claim starts over once on a fresh one, within the same wait, rather
/// than answer `503` for a database that is fine.
pub(crate) async fn claim<D: Driver, H: Handle<Conn = D::Conn>>(
    driver: &D,
    request: &ClaimRequest,
) -> Result<Claim<H>, StoreError> {
    let mut deadline = None;
    loop {
        let mut conn = driver.connect().await?;
        let retried = deadline.is_some();
        let until = *deadline.get_or_insert_with(|| Instant::now() + request.wait.max(MIN_WAIT));
        let wait = until.saturating_duration_since(Instant::now());
        // Unanswered, the claim takes the one statement that is correct on
        // both (and the store asks again next time).
        let split = driver.learn_citus(&mut conn).await.unwrap_or(false);
        let claimed =
            tokio::time::timeout_at(until + GRACE, try_claim(&mut conn, request, wait, split))
                .await;
        // Cut off mid-statement, `conn` is dropped: it is closed, and the
        // server rolls back once the statement ends.
        return match claimed {
            Err(_) => Err(timed_out()),
            Ok(Ok(Claimed::Owned(token, xid))) => {
                Ok(Claim::Owned(Slot::of_request(conn, request, token, xid)))
            }
            // The common replay: nothing to wait for. The transaction wrote
            // nothing; it ends behind the answer.
            Ok(Ok(Claimed::Completed(record))) => {
                tokio::spawn(release(conn));
                Ok(Claim::Completed(record))
            }
            Ok(Ok(Claimed::InProgress)) => {
                unused(conn).await.map_err(|f| f.error)?;
                Ok(Claim::InProgress)
            }
            // A lock wait past the wait (a duplicate's row, or the whole
            // table locked by a migration): in progress. The connection is
            // sound: it rolls back and goes back to the pool.
            Ok(Err(e)) if e.sql_state() == Some(LOCK_NOT_AVAILABLE) => {
                // A failed rollback closes the connection.
                let _ = unused(conn).await;
                Ok(Claim::InProgress)
            }
            Ok(Err(e)) if connection_fault(&e) && !retried => {
                drop(conn);
                continue;
            }
            Ok(Err(e)) => {
                if !connection_fault(&e) {
                    // A failed rollback closes the connection.
                    let _ = unused(conn).await;
                }
                Err(e)
            }
        };
    }
}

/// Begins and claims, in one round trip where the driver pipelines, and
/// takes over a record that may be taken over in a second statement of the
/// same transaction. Should the owner's process freeze between two
/// statements, the server ends the session (and frees the key) after the
/// hold limit.
///
/// On Citus (`split`) the claim is [`CLAIM_INSERT`], [`CLAIM_READ`] and
/// [`CURRENT_XID`], each one router query.
async fn try_claim<C: Connection>(
    conn: &mut C,
    request: &ClaimRequest,
    wait: std::time::Duration,
    split: bool,
) -> Result<Claimed, StoreError> {
    let waits = Waits {
        lock: Some(wait),
        idle: request.hold_limit,
    };
    let params = claim_params(request);
    if !split {
        let mut rows = conn
            .begin(
                waits,
                &[Statement {
                    sql: CLAIM,
                    params: &params,
                }],
            )
            .await?;
        let rows = rows.pop().unwrap_or_default();
        return settle(conn, request, rows).await;
    }
    let key = key_params(request);
    let mut rows = conn
        .begin(
            waits,
            &[
                Statement {
                    sql: CLAIM_INSERT,
                    params: &params,
                },
                Statement {
                    sql: CLAIM_READ,
                    params: &key,
                },
                Statement {
                    sql: CURRENT_XID,
                    params: &[],
                },
            ],
        )
        .await?
        .into_iter();
    let mut next = || rows.next().unwrap_or_default();
    let (inserted, read, xid) = (next(), next(), next());
    match split_claim_rows(&inserted, read, &xid)? {
        Ok(owned) => Ok(owned),
        Err(read) => settle(conn, request, read).await,
    }
}

/// Ends a transaction that wrote nothing. Boxed: a driver's end future
/// is sized for its commit, the largest step of a request, and off the
/// owner's path it would only make the claim's future that much larger.
fn unused<C: Connection>(conn: C) -> Pin<Box<impl Future<Output = Result<(), Failed>>>> {
    Box::pin(conn.end(None, End::Unused))
}

/// Ends a transaction that wrote nothing, off the request's path.
async fn release<C: Connection>(conn: C) {
    if let Err(failed) = unused(conn).await {
        tracing::debug!(error = %failed.error, "ending a replay's transaction failed; the connection was closed");
    }
}

/// [`Store::complete`](crate::store::Store::complete): the response,
/// checked against the claim's token and transaction, then `COMMIT` and
/// the session reset.
pub(crate) async fn complete<H: Handle>(
    tx: H,
    response: &StoredResponse,
) -> Result<(), StoreError> {
    let slot = tx.slot();
    if slot.is_fenced() {
        let rolled_back = match slot.take_to_abort().await {
            Ok(Some(conn)) => Box::pin(conn.end(None, End::Rollback))
                .await
                .map_err(|f| f.error),
            Ok(None) => Ok(()),
            Err(e) => Err(e),
        };
        return Err(fenced_given_to_complete(rolled_back));
    }
    let headers = response.encode_headers();
    let trace = TraceText::of(response);
    let params = complete_params(slot.identity(), response, &headers, trace.as_ref());
    commit_behind(
        slot,
        Deciding {
            sql: COMPLETE,
            resetting: Some(COMPLETE_AND_RESET),
            params: &params,
        },
    )
    .await
}

/// [`LeaseStore::commit_fenced`](crate::store::LeaseStore::commit_fenced):
/// the check that the transaction is intact and still holds the record at
/// its token (it cannot have lost it while holding the row `FOR SHARE`,
/// unless the handler ended the transaction), then `COMMIT` and the session
/// reset.
pub(crate) async fn commit_fenced<H: Handle>(tx: H) -> Result<(), StoreError> {
    let slot = tx.slot();
    if !slot.is_fenced() {
        return Err(claim_given_to_commit_fenced());
    }
    let params = fenced_check_params(slot.identity());
    commit_behind(
        slot,
        Deciding {
            sql: FENCED_CHECK,
            resetting: None,
            params: &params,
        },
    )
    .await
}

/// Ends the transaction of `slot` with `COMMIT` behind `deciding`.
async fn commit_behind<C: Connection>(
    slot: &Slot<C>,
    deciding: Deciding<'_>,
) -> Result<(), StoreError> {
    let conn = slot.take_to_commit().await?.ok_or_else(finished)?;
    conn.end(Some(deciding), End::Commit)
        .await
        .map_err(commit_failed)
}

/// [`Store::abort`](crate::store::Store::abort): rolls back and resets the
/// session; a no-op once the transaction ended.
///
/// A statement the handler started may still be running on the connection
/// (its future was dropped at the deadline): the `ROLLBACK` waits behind
/// it. It is cancelled if it does not end within [`ROLLBACK_PATIENCE`].
pub(crate) async fn abort<H: Handle>(tx: H) -> Result<(), StoreError> {
    let slot = tx.slot();
    let Some(conn) = slot.take_to_abort().await? else {
        return Ok(());
    };
    let mut rollback = Box::pin(conn.end(None, End::Rollback));
    let ended = match tokio::time::timeout(ROLLBACK_PATIENCE, &mut rollback).await {
        Ok(ended) => Some(ended),
        Err(_) if slot.cancel_running().await => {
            tokio::time::timeout(CANCEL_GRACE, rollback).await.ok()
        }
        // The cancel went unanswered: so would the rollback.
        Err(_) => None,
    };
    match ended {
        Some(Ok(())) => Ok(()),
        // The server rolls back when a connection whose ROLLBACK failed is
        // closed.
        Some(Err(failed)) => Err(failed.error),
        None => Err(StoreError::new(
            StoreErrorKind::Unavailable,
            "the rollback did not finish; the connection was closed",
        )),
    }
}

/// What a failed commit means for the operation.
///
/// - The connection lost once the `COMMIT` was sent (or the server going
///   away): the commit may or may not have happened
///   ([`StoreErrorKind::OutcomeUnknown`]). Lost before it was sent, the
///   transaction is rolled back ([`StoreErrorKind::Unavailable`]).
/// - A statement cancelled or a lock wait run out in the server: rolled
///   back, and a retry may succeed ([`StoreErrorKind::Unavailable`]); so
///   for a serialization failure ([`StoreErrorKind::Conflict`]) and the
///   server's own trouble, such as a full disk ([`StoreErrorKind::Backend`]).
/// - Otherwise the deciding statement failed in the server (the
///   transaction was already aborted, the handler swallowed a failed
///   statement, or it is no longer the claim's), or could not even be
///   sent, or the `COMMIT` failed (a deferred constraint): rolled back, and
///   a retry fails the same way ([`StoreErrorKind::TransactionAborted`]).
pub(crate) fn commit_failed(failed: Failed) -> StoreError {
    let Failed {
        step,
        error,
        commit_sent,
        connection_lost,
    } = failed;
    let answered = error.sql_state().is_some();
    let server_going = error.kind() == StoreErrorKind::Unavailable
        && !error.sql_state().is_some_and(ends_only_the_statement);
    if commit_sent && (connection_lost || server_going) {
        return StoreError::new(
            StoreErrorKind::OutcomeUnknown,
            "the connection was lost while committing; whether the commit happened is unknown",
        )
        .with_sql_state(error.sql_state().map(str::to_owned))
        .with_source(error);
    }
    match error.kind() {
        StoreErrorKind::Unavailable | StoreErrorKind::Conflict => error,
        StoreErrorKind::Backend if answered => error,
        _ if connection_lost => error,
        _ => {
            let what = match step {
                super::driver::Step::Deciding => {
                    "remembering the response failed; the transaction was rolled back"
                }
                super::driver::Step::End => "the commit failed; the transaction was rolled back",
            };
            StoreError::new(StoreErrorKind::TransactionAborted, what)
                .with_sql_state(error.sql_state().map(str::to_owned))
                .with_source(error)
        }
    }
}

/// [`CommitStore::begin`](crate::store::CommitStore::begin): the handler's
/// transaction, without a claim. No lock wait of its own (the handler's
/// statements keep the session's); should this process freeze, the server
/// ends the transaction by itself after the hold limit.
pub(crate) async fn begin_at_commit<D: Driver, H: Handle<Conn = D::Conn>>(
    driver: &D,
    request: &ClaimRequest,
) -> Result<H, StoreError> {
    let mut conn = driver.connect().await?;
    // Whether the session reset may ride in the claim (asked once per
    // store); unanswered, it goes as a message of its own.
    driver.learn_citus(&mut conn).await;
    conn.begin_later(Waits {
        lock: None,
        idle: request.hold_limit,
    })
    .await?;
    Ok(Slot::of_request(conn, request, 0, String::new()))
}

/// [`CommitStore::commit`](crate::store::CommitStore::commit): the key's
/// record with the response, just before the `COMMIT` (pipelined with it
/// where the driver can). Lost, the record the commit lost to.
pub(crate) async fn commit_at_commit<D: Driver, H: Handle<Conn = D::Conn>>(
    driver: &D,
    tx: H,
    request: &ClaimRequest,
    response: &StoredResponse,
) -> Result<Committed, StoreError> {
    // A statement of the handler still running through a clone: the
    // commit queues behind it, as in the claim-first mode, for a while.
    let conn = tx.slot().take_to_commit().await?.ok_or_else(finished)?;
    let headers = response.encode_headers();
    let trace = TraceText::of(response);
    let params = at_commit_params(request, response, &headers, trace.as_ref());
    let deciding = Deciding {
        sql: CLAIM_AT_COMMIT,
        resetting: Some(CLAIM_AT_COMMIT_AND_RESET),
        params: &params,
    };
    match conn.end(Some(deciding), End::Commit).await {
        Ok(()) => Ok(Committed::Won),
        // Lost: the COMMIT rolled everything back.
        Err(failed)
            if failed.step == super::driver::Step::Deciding
                && failed.error.sql_state() == Some(LOST_AT_COMMIT) =>
        {
            winner(driver, request).await
        }
        Err(failed) => Err(commit_failed(failed)),
    }
}

/// [`Store::lookup`](crate::store::Store::lookup): the key's completed,
/// unexpired record ([`LOOKUP`](super::claim::LOOKUP)), read alone with a
/// fresh snapshot: one round trip, no transaction of the store's, nothing
/// written.
pub(crate) async fn lookup<D: Driver>(
    driver: &D,
    request: &ClaimRequest,
) -> Result<Option<Record>, StoreError> {
    let rows = driver
        .read(
            super::claim::LOOKUP,
            &key_params(request),
            Instant::now() + ROW_WAIT + GRACE,
        )
        .await?;
    Ok(rows
        .first()
        .map(|row| record_at(row, 0))
        .transpose()?
        .flatten())
}

/// What a commit of the one-commit mode that lost lost to, read with a
/// fresh snapshot: the key's record; else, if the row that failed the
/// commit may be taken over (or is gone), the key freed ([`FREE`]) for the
/// work to run again; else (an operation of the long-running mode under its
/// lease) held. Each statement on its own.
///
/// [`FREE`]: super::claim::FREE
async fn winner<D: Driver>(driver: &D, request: &ClaimRequest) -> Result<Committed, StoreError> {
    let key = key_params(request);
    let rows = driver
        .read(
            super::claim::LOOKUP,
            &key,
            Instant::now() + ROW_WAIT + GRACE,
        )
        .await?;
    let found = rows.first().map(|row| record_at(row, 0)).transpose()?;
    if let Some(Some(record)) = found {
        return Ok(Committed::Lost(record));
    }
    // Should the COMMIT fail, only the removal of the expired row is in
    // doubt (the handler's writes were rolled back before): an error of the
    // removal, not an unknown outcome.
    let freed = driver
        .transaction(super::claim::FREE, &key, ROW_WAIT)
        .await?;
    Ok(if found.is_none() || !freed.is_empty() {
        // Expired, an orphan, or removed since (by cleanup or an
        // operator): the key is free, though this transaction is over.
        Committed::Freed
    } else {
        Committed::Held
    })
}

/// [`LeaseStore::fenced`](crate::store::LeaseStore::fenced): `BEGIN`, the
/// waits, and the record held at the lease's token, in one round trip
/// where the driver pipelines. A record no longer at the token fences the
/// owner.
pub(crate) async fn open_fenced<D: Driver, H: Handle<Conn = D::Conn>>(
    driver: &D,
    owner: &LeaseIdentity,
) -> Result<H, StoreError> {
    let mut conn = driver.connect().await?;
    let params = token_params(owner);
    // While the row is held, the owner's own heartbeats wait too. So no
    // lock wait in the transaction may outlast half a lease (the rest of
    // the lease is the margin for the next heartbeat), and should the
    // owner's process stall with the row held, PostgreSQL ends the
    // transaction once it idles for a lease: takeovers are not blocked for
    // longer than the lease they wait for anyway.
    let waits = Waits {
        lock: Some(ROW_WAIT.min(owner.lease() / 2)),
        idle: Some(owner.lease()),
    };
    let held = tokio::time::timeout(
        ROW_WAIT + GRACE,
        conn.begin(
            waits,
            &[Statement {
                sql: HOLD,
                params: &params,
            }],
        ),
    )
    .await;
    let rows = match held {
        // Cut off: `conn` is dropped and closed; the server rolls back.
        Err(_) => return Err(timed_out()),
        Ok(Err(e)) => {
            let _ = conn.end(None, End::Unused).await;
            return Err(e);
        }
        Ok(Ok(mut rows)) => rows.pop().unwrap_or_default(),
    };
    let Some(row) = rows.first() else {
        let _ = conn.end(None, End::Unused).await;
        owner.mark_fenced();
        crate::metrics::fenced(owner.endpoint(), FencedAt::Write);
        return Err(fenced());
    };
    let xid = super::sql::Columns::text(row, 0)?.to_owned();
    let id = Identity::new(
        owner.scope().clone(),
        owner.key().clone(),
        *owner.fingerprint(),
        owner.attempt_token(),
        owner.retention(),
        Tx::new(xid),
    );
    Ok(H::of(Slot::new(conn, id, true)))
}
