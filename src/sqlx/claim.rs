//! The claim: insert the key's row in a new transaction, or read the
//! record that holds the key, or take over an expired one, within the
//! request's wait.

use std::time::Duration;

use ::sqlx::{PgConnection, Postgres, Row};
use bytes::Bytes;
use http::StatusCode;

use super::{
    conn::GuardedConnection,
    error::{map_error, sql_state, LOCK_NOT_AVAILABLE},
    query, SqlxStore, SqlxTx,
};
use crate::{
    fingerprint::Fingerprint,
    protocol::lease::answered,
    record::{Record, ResourceId, StoredResponse},
    store::{Claim, ClaimRequest, StoreError, StoreErrorKind},
};

// Claim first: the unique index decides the owner, never a read before
// the insert. ON CONFLICT DO NOTHING waits (within lock_timeout) for a
// transaction that holds the key's row; no row back means the key is
// taken by a committed record. RETURNING puts lock_timeout back to the
// session's default for the handler's statements.
const INSERT: &str = "INSERT INTO idempotency_requests \
         (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at) \
     VALUES ($1::text, $2::text, $3::text, $4::bytea, 'in_progress', \
         now() + make_interval(secs => $5::float8)) \
     ON CONFLICT ON CONSTRAINT idempotency_requests_pkey DO NOTHING \
     RETURNING attempt_token, pg_current_xact_id()::text, set_config('lock_timeout', NULL, true)";

// The committed record that holds the key (READ COMMITTED: a fresh
// snapshot per statement), and whether it may be taken over: its retention
// ended, or it is an in-progress row no transaction holds whose lease (if
// any) expired. Short-mode owners never commit `in_progress`, so such a row
// is an orphan or an abandoned long-running operation.
pub(super) const LOOKUP: &str = "SELECT request_fingerprint, state, response_status, response_headers, \
         response_body, resource_id, \
         expires_at <= now() \
             OR (state = 'in_progress' AND (lease_expires_at IS NULL OR lease_expires_at <= now())) \
     FROM idempotency_requests \
     WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text";

// The takeover, as a new attempt under a new token (drawn from the
// sequence by the proposed row). The WHERE is evaluated on the newest
// version of the row once its lock is ours: of many claims racing for one
// expired record, one takes it over; the others find it taken.
const TAKE_OVER: &str = "INSERT INTO idempotency_requests AS r \
         (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at) \
     VALUES ($1::text, $2::text, $3::text, $4::bytea, 'in_progress', \
         now() + make_interval(secs => $5::float8)) \
     ON CONFLICT ON CONSTRAINT idempotency_requests_pkey DO UPDATE SET \
         request_fingerprint = EXCLUDED.request_fingerprint, state = 'in_progress', \
         attempt_token = EXCLUDED.attempt_token, response_status = NULL, \
         response_headers = NULL, response_body = NULL, resource_id = NULL, created_at = now(), \
         completed_at = NULL, expires_at = EXCLUDED.expires_at, lease_expires_at = NULL \
     WHERE r.expires_at <= now() \
         OR (r.state = 'in_progress' AND (r.lease_expires_at IS NULL OR r.lease_expires_at <= now())) \
     RETURNING attempt_token, pg_current_xact_id()::text, set_config('lock_timeout', NULL, true)";

/// The shortest wait a claim gets: enough to read the record.
const MIN_WAIT: Duration = Duration::from_millis(100);

/// How much longer than its wait the claim gives the database before it
/// stops waiting itself: room for the server to report its lock timeout.
const GRACE: Duration = Duration::from_millis(250);

/// What one pass of the claim found.
enum Found {
    /// We own the key: (token, transaction id, the session's process id).
    Owned(i64, String, i32),
    /// A completed, unexpired record.
    Completed(Record),
    /// A long-running operation under a live lease.
    Running,
}

/// [`Store::claim`](crate::store::Store::claim) for [`SqlxStore`].
pub(super) async fn claim(
    store: &SqlxStore,
    request: &ClaimRequest,
) -> Result<Claim<SqlxTx>, StoreError> {
    // Taking a connection is bounded by the pool's acquire timeout.
    let pooling = store.transaction_pooling;
    let mut tx = GuardedConnection::begin(&store.pool, pooling)
        .await
        .map_err(map_error)?;
    let wait = request.wait.max(MIN_WAIT);
    let found =
        tokio::time::timeout(wait + GRACE, arbitrate(tx.raw(), request, wait, pooling)).await;
    // Cut off mid-statement, `tx` is dropped: its connection is closed, and
    // the server rolls back.
    let found = match found {
        Err(_) => {
            return Err(StoreError::new(
                StoreErrorKind::Unavailable,
                "the database did not answer within the wait",
            ))
        }
        Ok(Err(e)) if sql_state(&e).as_deref() == Some(LOCK_NOT_AVAILABLE) => {
            tx.rollback_quietly().await;
            return Ok(Claim::InProgress);
        }
        Ok(Err(e)) => {
            let error = map_error(e);
            tx.rollback_quietly().await;
            return Err(error);
        }
        Ok(Ok(found)) => found,
    };
    match found {
        Found::Owned(token, xid, pid) => Ok(Claim::Owned(SqlxTx::of_request(
            tx, store, pid, request, token, xid,
        ))),
        Found::Completed(record) => {
            tx.rollback_quietly().await;
            Ok(Claim::Completed(record))
        }
        Found::Running => {
            tx.rollback_quietly().await;
            Ok(Claim::InProgress)
        }
    }
}

/// Sets the wait, then inserts, reads or takes over until one of them
/// decides (a record removed or changed between two statements: again).
async fn arbitrate(
    conn: &mut PgConnection,
    request: &ClaimRequest,
    wait: Duration,
    pooling: bool,
) -> Result<Found, ::sqlx::Error> {
    // Should the owner's process freeze between two statements, the
    // server ends the session (and frees the key) after the hold limit.
    let pid = set_waits(&mut *conn, wait, request.hold_limit, pooling).await?;
    loop {
        if let Some(row) = bind(query(INSERT, pooling), request)
            .fetch_optional(&mut *conn)
            .await?
        {
            return Ok(Found::Owned(row.try_get(0)?, row.try_get(1)?, pid));
        }
        let Some(row) = query(LOOKUP, pooling)
            .bind(request.scope.tenant().as_str())
            .bind(request.scope.endpoint())
            .bind(request.key.as_str())
            .fetch_optional(&mut *conn)
            .await?
        else {
            // Removed since the insert met it: insert again.
            continue;
        };
        let may_take_over: bool = row.try_get(6)?;
        if !may_take_over {
            return Ok(match decode(&row)? {
                Some(record) => Found::Completed(record),
                None => Found::Running,
            });
        }
        if let Some(row) = bind(query(TAKE_OVER, pooling), request)
            .fetch_optional(&mut *conn)
            .await?
        {
            return Ok(Found::Owned(row.try_get(0)?, row.try_get(1)?, pid));
        }
        // Another claim took it over first and has finished with it: look again.
    }
}

/// Sets, for the rest of the transaction, how long a lock wait may last
/// and (if given) how long the session may sit idle in it before the server
/// ends it (parameters, never formatted SQL); returns the session's process
/// id, which a cancel request names.
pub(super) async fn set_waits(
    conn: &mut PgConnection,
    wait: Duration,
    idle: Option<Duration>,
    pooling: bool,
) -> Result<i32, ::sqlx::Error> {
    // `0` would mean no limit, and PostgreSQL takes at most i32::MAX ms.
    let ms = |d: Duration| format!("{}ms", d.as_millis().clamp(1, i32::MAX as u128));
    let row = query(
        "SELECT pg_backend_pid(), set_config('lock_timeout', $1, true), \
             CASE WHEN $2::text IS NOT NULL \
                 THEN set_config('idle_in_transaction_session_timeout', $2, true) END",
        pooling,
    )
    .bind(ms(wait))
    .bind(idle.map(ms))
    .fetch_one(conn)
    .await?;
    row.try_get(0)
}

fn bind<'q>(
    query: ::sqlx::query::Query<'q, Postgres, ::sqlx::postgres::PgArguments>,
    request: &'q ClaimRequest,
) -> ::sqlx::query::Query<'q, Postgres, ::sqlx::postgres::PgArguments> {
    query
        .bind(request.scope.tenant().as_str())
        .bind(request.scope.endpoint())
        .bind(request.key.as_str())
        .bind(request.fingerprint.as_bytes().as_slice())
        .bind(request.retention.as_secs_f64())
}

/// The record of a LOOKUP row; `None` if it is still in progress. A
/// long-running operation's remembered failure replays as a completion does.
pub(super) fn decode(row: &::sqlx::postgres::PgRow) -> Result<Option<Record>, ::sqlx::Error> {
    let state: &str = row.try_get(1)?;
    if !answered(state) {
        return Ok(None);
    }
    let corrupt =
        |what: &str| ::sqlx::Error::Decode(format!("stored record has an invalid {what}").into());
    let fingerprint: &[u8] = row.try_get(0)?;
    let status: i16 = row.try_get(2)?;
    let headers: &[u8] = row.try_get(3)?;
    let body: &[u8] = row.try_get(4)?;
    let resource_id: Option<String> = row.try_get(5)?;
    Ok(Some(Record {
        fingerprint: Fingerprint::from_slice(fingerprint).ok_or_else(|| corrupt("fingerprint"))?,
        response: StoredResponse {
            status: u16::try_from(status)
                .ok()
                .and_then(|s| StatusCode::from_u16(s).ok())
                .ok_or_else(|| corrupt("status"))?,
            headers: StoredResponse::decode_headers(headers)
                .ok_or_else(|| corrupt("header block"))?,
            body: Bytes::copy_from_slice(body),
            resource_id: resource_id.map(ResourceId::new),
        },
    }))
}
