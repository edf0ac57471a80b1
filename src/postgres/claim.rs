//! Steps 1 and 2 of the protocol (see the [module docs](super)): replay a
//! completed record, or claim the key by inserting its row, within the
//! request's wait.

use std::time::Duration;

use tokio_postgres::{
    error::SqlState,
    types::{ToSql, Type},
    Row,
};

use super::{conn::Conn, decode, error::map_error, statements::Sql, PgStore, PgTx};
use crate::protocol::{errors::ends_only_the_statement, statements::BEGIN};
use crate::store::{Claim, ClaimRequest, StoreError, StoreErrorKind};

// Parameters carry explicit casts so their types are fixed by the SQL text:
// binding can then never fail on the client after an earlier pipelined
// statement was already sent.
const LOOKUP: &str = "SELECT request_fingerprint, state, response_status, response_headers, response_body, resource_id \
     FROM idempotency_requests \
     WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text AND expires_at > now()";

// The claim, claim first: no read before the insert decides the owner. One
// statement either inserts the key's row (we own it; RETURNING puts
// lock_timeout back to the session's default for the handler) or, without
// taking a row lock, returns the key's committed record as this
// statement's snapshot sees it, with whether it may be taken over (its
// retention ended, or an orphan: see CLAIM_KEY). ON CONFLICT DO NOTHING
// waits for a transaction that holds the key's row, within lock_timeout;
// a record committed during that wait is not in the snapshot: no row comes
// back, and the caller reads it with a fresh one. Columns: owned, token,
// xid, then the record as LOOKUP reads it (from 3), then "may take over".
const CLAIM: &str = "WITH claimed AS ( \
         INSERT INTO idempotency_requests AS r \
             (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at) \
         VALUES ($1::text, $2::text, $3::text, $4::bytea, 'in_progress', now() + make_interval(secs => $5::float8)) \
         ON CONFLICT ON CONSTRAINT idempotency_requests_pkey DO NOTHING \
         RETURNING attempt_token, pg_current_xact_id()::text AS xid, set_config('lock_timeout', NULL, true)) \
     SELECT true, attempt_token, xid, NULL::bytea, NULL::text, NULL::int2, NULL::bytea, NULL::bytea, NULL::text, false \
     FROM claimed \
     UNION ALL \
     SELECT false, NULL::int8, NULL::text, request_fingerprint, state, response_status, response_headers, \
         response_body, resource_id, \
         expires_at <= now() OR (state = 'in_progress' AND (lease_expires_at IS NULL OR lease_expires_at <= now())) \
     FROM idempotency_requests \
     WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text \
         AND NOT EXISTS (SELECT FROM claimed)";

// The takeover of an expired or orphaned record, in the claim's
// transaction. Its transaction was begun by `claim_begin`, which set the wait
// limit; RETURNING runs once we own the key and puts lock_timeout back to the
// session's default for the handler (`set_config` with NULL is `SET LOCAL …
// TO DEFAULT`: the value from the server, database, role or connection
// options).
//
// ON CONFLICT waits for the transaction holding the key's row, so the WHERE
// sees a committed row: an expired record, or an `in_progress` row whose
// transaction is over without completing it (an owner in this mode only ever
// commits `completed`, so such a row is an orphan: a crash of an older
// version, a manual edit); a long-running operation's row is committed
// in_progress too, and is only taken over once its lease expired. All are
// taken over as a new attempt, with the
// token the proposed row drew from the sequence (EXCLUDED): larger than every
// token handed out before, also for a key whose row was removed meanwhile.
const CLAIM_KEY: &str = "INSERT INTO idempotency_requests AS r \
         (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at) \
     VALUES ($1::text, $2::text, $3::text, $4::bytea, 'in_progress', now() + make_interval(secs => $5::float8)) \
     ON CONFLICT ON CONSTRAINT idempotency_requests_pkey DO UPDATE SET \
         request_fingerprint = EXCLUDED.request_fingerprint, state = 'in_progress', \
         attempt_token = EXCLUDED.attempt_token, response_status = NULL, response_headers = NULL, \
         response_body = NULL, resource_id = NULL, created_at = now(), completed_at = NULL, \
         expires_at = EXCLUDED.expires_at, lease_expires_at = NULL \
     WHERE r.expires_at <= now() \
         OR (r.state = 'in_progress' AND (r.lease_expires_at IS NULL OR r.lease_expires_at <= now())) \
     RETURNING attempt_token, pg_current_xact_id()::text, set_config('lock_timeout', NULL, true)";

// The parameters of each: tenant, endpoint, key (and the fingerprint and
// the retention in seconds).
pub(super) const LOOKUP_SQL: Sql<'static> = Sql::new(LOOKUP, &[Type::TEXT, Type::TEXT, Type::TEXT]);
const CLAIM_PARAMS: &[Type] = &[
    Type::TEXT,
    Type::TEXT,
    Type::TEXT,
    Type::BYTEA,
    Type::FLOAT8,
];
pub(super) const CLAIM_SQL: Sql<'static> = Sql::new(CLAIM, CLAIM_PARAMS);
pub(super) const CLAIM_KEY_SQL: Sql<'static> = Sql::new(CLAIM_KEY, CLAIM_PARAMS);

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
    let claimed =
        tokio::time::timeout_at(deadline + CLAIM_GRACE, try_claim(&mut conn, request, wait)).await;
    let found = match claimed {
        Err(_) => return Err(timed_out()),
        Ok(Ok(Claimed::Owned(token, xid))) => {
            return Ok(Claim::Owned(PgTx::of_request(conn, request, token, xid)))
        }
        Ok(Ok(Claimed::Found(found))) => found,
        // A lock wait past the wait (a duplicate's row, or the whole table
        // locked by a migration): in progress. The connection is sound: it
        // rolls back and goes back to the pool.
        Ok(Err(e)) if e.sql_state() == Some(SqlState::LOCK_NOT_AVAILABLE.code()) => {
            // A failed rollback leaves `conn` marked dirty: it is closed.
            let _ = rollback(conn).await;
            return Ok(Claim::InProgress);
        }
        // A pooled connection the server closed (a restart, a terminated
        // backend), or whose session is not what we left, is only found
        // out when used. Nothing was committed on it: drop it and start
        // over once on a fresh one, rather than answer 503 for a database
        // that is fine.
        Ok(Err(e)) if connection_fault(&e) && !retried => {
            drop(conn);
            return Box::pin(claim_once(store, request, Some(deadline))).await;
        }
        Ok(Err(e)) => {
            if !connection_fault(&e) {
                // A failed rollback leaves `conn` marked dirty: it is closed.
                let _ = rollback(conn).await;
            }
            return Err(e);
        }
    };
    let answer = match found {
        // The common replay: nothing to wait for. The transaction wrote
        // nothing; it ends behind the answer.
        Found::Existing(Some(record)) => {
            tokio::spawn(rollback_quietly(conn));
            return Ok(Claim::Completed(record));
        }
        Found::Existing(None) => Ok(Claim::InProgress),
        // Committed by another owner while we waited on its row (or a row
        // to take over, taken by someone else): read it with a fresh
        // snapshot, then let go.
        Found::Unseen => {
            let row = tokio::time::timeout_at(deadline + CLAIM_GRACE, lookup(&conn, request))
                .await
                .unwrap_or_else(|_| Err(timed_out()));
            match row {
                Ok(Some(row)) => {
                    decode::record(&row).map(|r| r.map_or(Claim::InProgress, Claim::Completed))
                }
                Ok(None) => Ok(Claim::InProgress),
                Err(e) => Err(e),
            }
        }
    };
    rollback(conn).await?;
    answer
}

/// What the claim's transaction found.
enum Claimed {
    /// Inserted (or took over): this request owns the key.
    Owned(i64, String),
    /// Someone else's record.
    Found(Found),
}

/// Someone else's record, as the claim found it.
enum Found {
    /// The key's committed record, as the claim's snapshot saw it:
    /// completed (`Some`), or in progress under a live lease.
    Existing(Option<crate::record::Record>),
    /// The key is taken, but by a row the claim's snapshot does not show
    /// (committed while the claim waited for it).
    Unseen,
}

/// Reads the record of `request`'s key, if any (READ COMMITTED: a fresh snapshot).
pub(super) async fn lookup(conn: &Conn, request: &ClaimRequest) -> Result<Option<Row>, StoreError> {
    let (tenant, endpoint, key) = key_columns(request);
    conn.query_opt_sql(LOOKUP_SQL, &[&tenant, &endpoint, &key])
        .await
        .map_err(map_error)
}

/// Begins and claims in one round trip, and takes over a record that may
/// be taken over in a second statement of the same transaction.
///
/// The claim statement is prepared on first use on this connection; its
/// `Parse` then goes out behind the `BEGIN` batch, so that a lock on the
/// whole table met while planning it is bounded by the wait too.
async fn try_claim(
    conn: &mut Conn,
    request: &ClaimRequest,
    wait: Duration,
) -> Result<Claimed, StoreError> {
    let retention = request.retention.as_secs_f64();
    let fingerprint = request.fingerprint.as_bytes().as_slice();
    let (tenant, endpoint, key) = key_columns(request);
    let params: [&(dyn ToSql + Sync); 5] = [&tenant, &endpoint, &key, &fingerprint, &retention];
    let begin = claim_begin(wait, request.hold_limit);
    conn.mark_dirty();
    let (_, rows) = tokio::try_join!(
        biased;
        conn.batch_pipelined(&begin),
        // Cached after the first use (or unnamed): no round trip, and the
        // claim is pipelined with the begin batch.
        conn.query_sql(CLAIM_SQL, &params),
    )
    .map_err(map_error)?;
    let Some(row) = rows.first() else {
        return Ok(Claimed::Found(Found::Unseen));
    };
    if row.get::<_, bool>(0) {
        return Ok(Claimed::Owned(row.get(1), row.get(2)));
    }
    if !row.get::<_, bool>(9) {
        return Ok(Claimed::Found(Found::Existing(decode::record_at(row, 3)?)));
    }
    // Expired, or an orphan: take it over, as a second step of the same
    // transaction (rare: once per key per retention period).
    let taken = conn
        .query_opt_sql(CLAIM_KEY_SQL, &params)
        .await
        .map_err(map_error)?;
    Ok(match taken {
        Some(row) => Claimed::Owned(row.get(0), row.get(1)),
        None => Claimed::Found(Found::Unseen),
    })
}

/// A replay's transaction wrote nothing: end it off the request's path.
async fn rollback_quietly(conn: Conn) {
    if let Err(e) = rollback(conn).await {
        tracing::debug!(error = %e, "ending a replay's transaction failed; the connection was closed");
    }
}

/// Rolls back; the connection goes back to the pool only if that worked.
async fn rollback(mut conn: Conn) -> Result<(), StoreError> {
    conn.batch_execute("ROLLBACK").await.map_err(map_error)?;
    conn.mark_clean();
    Ok(())
}

/// Begins the claim's transaction: READ COMMITTED (the "not owned" read needs
/// a fresh snapshot), the wait limit for every lock the claim may wait on
/// (including the table lock the INSERT takes first), and, with a hold limit,
/// `idle_in_transaction_session_timeout`: should the owner's process freeze
/// or lose its network between two statements, the server ends the session
/// and frees the key by itself.
fn claim_begin(wait: Duration, hold_limit: Option<Duration>) -> String {
    begin_batch(Some(wait), hold_limit)
}

/// `BEGIN ISOLATION LEVEL READ COMMITTED`, then `SET LOCAL` of the lock wait
/// and the idle limit that are given: utility statements only, nothing to
/// plan, sent by `Conn::batch_pipelined` one message each. The values are
/// numbers we format, never client data; `0` would mean "no limit", and
/// PostgreSQL takes at most `i32::MAX` milliseconds.
pub(super) fn begin_batch(lock_wait: Option<Duration>, hold_limit: Option<Duration>) -> String {
    let ms = |d: Duration| d.as_millis().clamp(1, i32::MAX as u128);
    let mut batch = BEGIN.to_owned();
    if let Some(wait) = lock_wait {
        batch.push_str(&format!("; SET LOCAL lock_timeout = '{}ms'", ms(wait)));
    }
    if let Some(limit) = hold_limit {
        batch.push_str(&format!(
            "; SET LOCAL idle_in_transaction_session_timeout = '{}ms'",
            ms(limit)
        ));
    }
    batch
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

fn timed_out() -> StoreError {
    StoreError::new(
        StoreErrorKind::Unavailable,
        "the database did not answer within the wait",
    )
}

fn key_columns(request: &ClaimRequest) -> (&str, &str, &str) {
    (
        request.scope.tenant().as_str(),
        request.scope.endpoint(),
        request.key.as_str(),
    )
}
