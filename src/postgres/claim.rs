//! Steps 1 and 2 of the protocol (see the [module docs](super)): replay a
//! completed record, or claim the key by inserting its row, within the
//! request's wait.

use std::time::Duration;

use super::{
    conn::Conn,
    error::map_error,
    prepared::dyn_params,
    transport::{rollback, timed_out},
    PgStore, PgTx,
};
use crate::protocol::{
    citus::IS_CITUS,
    claim::{
        begin_with_waits, claim_params, settle, split_claim_rows, Claimed, CLAIM, CLAIM_INSERT,
        CLAIM_READ, CURRENT_XID,
    },
    errors::{ends_only_the_statement, LOCK_NOT_AVAILABLE},
    record::key_params,
};
use crate::store::{Claim, ClaimRequest, StoreError, StoreErrorKind};

/// How much longer than its wait a claim may take before the store gives up
/// on the database: room for the server to report its own lock timeout.
const CLAIM_GRACE: Duration = Duration::from_millis(250);

/// The shortest wait a claim gets: a request that spent its wait elsewhere
/// (behind a duplicate in this process) still gets to read the record.
const MIN_WAIT: Duration = Duration::from_millis(100);

/// [`Store::claim`](crate::store::Store::claim) for [`PgStore`].
pub(super) async fn claim(
    store: &PgStore,
    request: &ClaimRequest,
) -> Result<Claim<PgTx>, StoreError> {
    claim_once(store, request, None).await
}

impl PgStore {
    /// Whether the database is a Citus coordinator: known, or asked on
    /// `conn` (once per store, by its first claim or one-commit
    /// transaction; `None` if the question failed). `conn` learns it too.
    pub(super) async fn learn_citus(&self, conn: &mut Conn) -> Option<bool> {
        let citus = match self.on_citus() {
            Some(citus) => citus,
            None => {
                let rows = conn.query_sql(IS_CITUS, &[]).await.ok()?;
                let citus = rows.first().is_some_and(|row| row.get::<_, bool>(0));
                self.found_citus(citus);
                citus
            }
        };
        conn.on_citus(citus);
        Some(citus)
    }
}

/// The claim, answered by `deadline` (plus [`CLAIM_GRACE`]) whatever the
/// database does. The first attempt sets the deadline once it has a
/// connection (taking one is bounded by the pool's acquire timeout); an
/// attempt on a replacement for a faulty pooled connection keeps it.
async fn claim_once(
    store: &PgStore,
    request: &ClaimRequest,
    deadline: Option<tokio::time::Instant>,
) -> Result<Claim<PgTx>, StoreError> {
    let mut conn = store.conn().await?;
    let retried = deadline.is_some();
    let deadline =
        deadline.unwrap_or_else(|| tokio::time::Instant::now() + request.wait.max(MIN_WAIT));
    let wait = deadline.saturating_duration_since(tokio::time::Instant::now());
    // Cut off mid-statement, `conn` stays marked dirty: it is closed, and
    // PostgreSQL rolls back once the statement ends.
    // Unanswered, the claim takes the one statement that is correct on
    // both (and the store asks again next time).
    // From here on a statement may be owed an answer: cut off (the layer's
    // deadline), the connection is closed rather than pooled.
    conn.mark_dirty();
    let split = store.learn_citus(&mut conn).await.unwrap_or(false);
    let claimed = tokio::time::timeout_at(
        deadline + CLAIM_GRACE,
        try_claim(&mut conn, request, wait, split),
    )
    .await;
    match claimed {
        Err(_) => Err(timed_out()),
        Ok(Ok(Claimed::Owned(token, xid))) => {
            Ok(Claim::Owned(PgTx::of_request(conn, request, token, xid)))
        }
        // The common replay: nothing to wait for. The transaction wrote
        // nothing; it ends behind the answer.
        Ok(Ok(Claimed::Completed(record))) => {
            tokio::spawn(rollback_quietly(conn));
            Ok(Claim::Completed(record))
        }
        Ok(Ok(Claimed::InProgress)) => {
            rollback(conn).await?;
            Ok(Claim::InProgress)
        }
        // A lock wait past the wait (a duplicate's row, or the whole table
        // locked by a migration): in progress. The connection is sound: it
        // rolls back and goes back to the pool.
        Ok(Err(e)) if e.sql_state() == Some(LOCK_NOT_AVAILABLE) => {
            // A failed rollback leaves `conn` marked dirty: it is closed.
            let _ = rollback(conn).await;
            Ok(Claim::InProgress)
        }
        // A pooled connection the server closed (a restart, a terminated
        // backend), or whose session is not what we left, is only found
        // out when used. Nothing was committed on it: drop it and start
        // over once on a fresh one, rather than answer 503 for a database
        // that is fine.
        Ok(Err(e)) if connection_fault(&e) && !retried => {
            drop(conn);
            Box::pin(claim_once(store, request, Some(deadline))).await
        }
        Ok(Err(e)) => {
            if !connection_fault(&e) {
                // A failed rollback leaves `conn` marked dirty: it is closed.
                let _ = rollback(conn).await;
            }
            Err(e)
        }
    }
}

/// Begins and claims in one round trip, and takes over a record that may
/// be taken over in a second statement of the same transaction.
///
/// The claim statement is prepared on first use on this connection; its
/// `Parse` then goes out behind the `BEGIN` batch, so that a lock on the
/// whole table met while planning it is bounded by the wait too.
///
/// On Citus (`split`) the claim is [`CLAIM_INSERT`] and [`CLAIM_READ`],
/// both pipelined behind the begin batch: still one round trip, each
/// statement one router query.
async fn try_claim(
    conn: &mut Conn,
    request: &ClaimRequest,
    wait: Duration,
    split: bool,
) -> Result<Claimed, StoreError> {
    let params = claim_params(request);
    let params_dyn = dyn_params(&params);
    let begin = begin_with_waits(Some(wait), conn.hold_limit_to_set(request.hold_limit));
    conn.mark_dirty();
    if split {
        let key = key_params(request);
        let key_dyn = dyn_params(&key);
        let (_, inserted, read, xid) = tokio::try_join!(
            biased;
            conn.batch_pipelined(&begin),
            conn.query_sql(CLAIM_INSERT, &params_dyn),
            conn.query_sql(CLAIM_READ, &key_dyn),
            conn.query_sql(CURRENT_XID, &[]),
        )
        .map_err(map_error)?;
        return match split_claim_rows(&inserted, read, &xid)? {
            Ok(owned) => Ok(owned),
            Err(read) => settle(conn, request, read).await,
        };
    }
    let (_, rows) = tokio::try_join!(
        biased;
        conn.batch_pipelined(&begin),
        // Cached after the first use (or unnamed): no round trip, and the
        // claim is pipelined with the begin batch.
        conn.query_sql(CLAIM, &params_dyn),
    )
    .map_err(map_error)?;
    settle(conn, request, rows).await
}

/// A replay's transaction wrote nothing: end it off the request's path.
async fn rollback_quietly(conn: Conn) {
    if let Err(e) = rollback(conn).await {
        tracing::debug!(error = %e, "ending a replay's transaction failed; the connection was closed");
    }
}

/// Whether `e` says the connection itself is at fault (closed by the
/// server, or its session not what we left), not only the statement.
pub(super) fn connection_fault(e: &StoreError) -> bool {
    (e.kind() == StoreErrorKind::Unavailable && !e.sql_state().is_some_and(ends_only_the_statement))
        || is_session_fault(e)
}

/// Errors that say this connection's session is not what the store left
/// (its prepared statements deallocated, its `search_path` or role changed,
/// a transaction left open on it, a table changed under a cached plan):
/// another connection is fine.
fn is_session_fault(error: &StoreError) -> bool {
    const CODES: [&str; 8] = [
        "26000", // invalid_sql_statement_name: a cached statement is gone
        "42P05", // duplicate_prepared_statement: a name the driver uses is taken
        "25P02", // in_failed_sql_transaction
        "25001", // active_sql_transaction
        "42P01", // undefined_table: search_path changed
        "3F000", // invalid_schema_name
        "42501", // insufficient_privilege: role changed
        "0A000", // feature_not_supported: cached plan must not change result type
    ];
    error.sql_state().is_some_and(|code| CODES.contains(&code))
}
