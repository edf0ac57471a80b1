//! The claim (steps 1 and 2 of the claim-first mode): the statements that
//! insert the key's row or find the record that holds it, the rule that
//! decides whether a found record may be taken over, and the decision a
//! claim reaches from their rows. Both drivers send these; each only begins
//! the transaction its own way ([`begin_with_waits`] in one round trip
//! with the claim, or [`SET_WAITS`] as a statement of its own).

use std::time::Duration;

use super::{
    driver::Connection,
    record::{key_params, may_take_over, record_at},
    sql::{Columns, Param, Sql},
    transaction::BEGIN,
    waits::millis,
};
use crate::{
    record::Record,
    store::{ClaimRequest, StoreError},
};

/// The record columns the claim's statements return, in this order, as
/// [`record_at`] reads them.
macro_rules! record_columns {
    () => {
        "request_fingerprint, state, response_status, response_headers, response_body, resource_id, \
         trace_id"
    };
}

/// Reads the record of a key, if its retention has not ended (READ
/// COMMITTED: a fresh snapshot). Parameters: tenant, endpoint, key.
pub(crate) const LOOKUP: Sql<'static> = Sql::new(concat!(
    "SELECT ",
    record_columns!(),
    " FROM idempotency_requests \
         WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text \
             AND expires_at > now()"
));

// The claim, claim first: no read before the insert decides the owner. One
// statement either inserts the key's row (we own it; the statement also
// puts lock_timeout back to the session's default for the handler) or,
// without taking a row lock, returns the key's committed record as this
// statement's snapshot sees it, with whether it may be taken over. ON
// CONFLICT DO NOTHING waits for a transaction that holds the key's row,
// within lock_timeout; a record committed during that wait is not in the
// snapshot: no row comes back, and the caller reads it with a fresh one.
// Columns: owned, token, xid, then the record as LOOKUP reads it (3 to 9),
// then "may take over", then the reset setting (unread). The transaction id
// and the reset are in the outer SELECT, not in RETURNING: Citus evaluates
// them on the coordinator, where the transaction is, and refuses anything
// but immutable functions in a RETURNING.
/// Inserts the key's row, or returns the record that holds the key.
pub(crate) const CLAIM: Sql<'static> = Sql::new(concat!(
    "WITH claimed AS ( \
             INSERT INTO idempotency_requests AS r \
                 (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at) \
             VALUES ($1::text, $2::text, $3::text, $4::bytea, 'in_progress', \
                 now() + make_interval(secs => $5::float8)) \
             ON CONFLICT ON CONSTRAINT idempotency_requests_pkey DO NOTHING \
             RETURNING attempt_token) \
         SELECT true, attempt_token, pg_current_xact_id()::text, NULL::bytea, NULL::text, \
             NULL::int2, NULL::bytea, NULL::bytea, NULL::text, NULL::text, false, \
             set_config('lock_timeout', NULL, true) \
         FROM claimed \
         UNION ALL \
         SELECT false, NULL::int8, NULL::text, ",
    record_columns!(),
    ", ",
    may_take_over!("", "now()"),
    ", NULL::text FROM idempotency_requests \
         WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text \
             AND NOT EXISTS (SELECT FROM claimed)"
));

// The claim as separate statements, for Citus, which plans an INSERT inside
// a WITH in steps (see CLAIM): the insert, and then, pipelined behind it in
// the same round trip, the key's row as a fresh snapshot shows it (with the
// lock-wait reset, which runs on the worker with the read) and the
// transaction id. The insert and the read are each one router query; the
// transaction id is read on its own because Citus evaluates it on the
// coordinator there, as it does in the completion's check, while in a
// router query it would be the worker's. When the insert returned a token,
// the read shows this transaction's own row and is not used; otherwise it
// is the record that holds the key (committed before or while the insert
// waited), read as CLAIM's second part reads it.
/// [`CLAIM`]'s insert alone: the token, if the key was free.
pub(crate) const CLAIM_INSERT: Sql<'static> = Sql::new(
    "INSERT INTO idempotency_requests AS r \
         (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at) \
     VALUES ($1::text, $2::text, $3::text, $4::bytea, 'in_progress', \
         now() + make_interval(secs => $5::float8)) \
     ON CONFLICT ON CONSTRAINT idempotency_requests_pkey DO NOTHING \
     RETURNING attempt_token",
);

/// The key's row after [`CLAIM_INSERT`], in [`CLAIM`]'s columns.
pub(crate) const CLAIM_READ: Sql<'static> = Sql::new(concat!(
    "SELECT false, NULL::int8, NULL::text, ",
    record_columns!(),
    ", ",
    may_take_over!("", "now()"),
    ", set_config('lock_timeout', NULL, true) FROM idempotency_requests \
     WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text"
));

/// The transaction's id (on Citus, the coordinator's).
pub(crate) const CURRENT_XID: Sql<'static> = Sql::new("SELECT pg_current_xact_id()::text");

/// What [`CLAIM_INSERT`], [`CLAIM_READ`] and [`CURRENT_XID`] returned:
/// owned (the token and the transaction id), or the read, as [`CLAIM`]'s
/// rows.
pub(crate) fn split_claim_rows<R: Columns>(
    inserted: &[R],
    read: Vec<R>,
    xid: &[R],
) -> Result<Result<Claimed, Vec<R>>, StoreError> {
    match inserted.first() {
        Some(row) => {
            let xid = xid.first().ok_or_else(|| {
                StoreError::new(
                    crate::store::StoreErrorKind::Backend,
                    "the transaction id was not read",
                )
            })?;
            Ok(Ok(Claimed::Owned(row.int8(0)?, xid.text(0)?.to_owned())))
        }
        None => Ok(Err(read)),
    }
}

// The takeover of a record that may be taken over, in the claim's
// transaction. The outer SELECT runs once we own the key and puts
// lock_timeout back to the session's default for the handler (`set_config`
// with NULL is `SET LOCAL … TO DEFAULT`: the value from the server,
// database, role or connection options). "Now" is the proposed row's
// `created_at` (its default, the transaction's start): Citus refuses
// functions that are not immutable in `ON CONFLICT … DO UPDATE`.
//
// ON CONFLICT waits for the transaction holding the key's row, so the WHERE
// is evaluated on the newest version of the row once its lock is ours: of
// many claims racing for one expired record, one takes it over; the others
// find it taken. It is taken over as a new attempt, with the token the
// proposed row drew from the sequence (EXCLUDED): larger than every token
// handed out before, also for a key whose row was removed meanwhile.
/// Takes a record over that may be taken over.
pub(crate) const TAKE_OVER: Sql<'static> = Sql::new(concat!(
    "WITH taken AS ( \
         INSERT INTO idempotency_requests AS r \
             (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at) \
         VALUES ($1::text, $2::text, $3::text, $4::bytea, 'in_progress', \
             now() + make_interval(secs => $5::float8)) \
         ON CONFLICT ON CONSTRAINT idempotency_requests_pkey DO UPDATE SET \
             request_fingerprint = EXCLUDED.request_fingerprint, state = 'in_progress', \
             attempt_token = EXCLUDED.attempt_token, response_status = NULL, \
             response_headers = NULL, response_body = NULL, resource_id = NULL, trace_id = NULL, \
             created_at = EXCLUDED.created_at, completed_at = NULL, \
             expires_at = EXCLUDED.expires_at, lease_expires_at = NULL \
         WHERE ",
    may_take_over!("r.", "EXCLUDED.created_at"),
    " RETURNING attempt_token) \
     SELECT attempt_token, pg_current_xact_id()::text, set_config('lock_timeout', NULL, true) \
     FROM taken"
));

/// `SET LOCAL` of the lock wait and the idle limit that are given, each
/// statement after a `; `. `SET LOCAL`, not `set_config`: on Citus (with
/// `citus.propagate_set_commands = 'local'`, which `migrate` sets there) a
/// `SET LOCAL` also reaches the workers, where the claim's row lock is
/// waited for. The values are numbers formatted here, never client data.
fn set_waits(lock_wait: Option<Duration>, idle: Option<Duration>) -> String {
    let mut batch = String::new();
    if let Some(wait) = lock_wait {
        batch.push_str(&format!("; SET LOCAL lock_timeout = '{}ms'", millis(wait)));
    }
    if let Some(limit) = idle {
        batch.push_str(&format!(
            "; SET LOCAL idle_in_transaction_session_timeout = '{}ms'",
            millis(limit)
        ));
    }
    batch
}

/// `BEGIN ISOLATION LEVEL READ COMMITTED`, then [`set_waits`]: utility
/// statements only, nothing to plan, for a driver that sends them
/// pipelined, one message each, ahead of the claim.
pub(crate) fn begin_with_waits(lock_wait: Option<Duration>, idle: Option<Duration>) -> BeginText {
    begin_then_waits(BEGIN, lock_wait, idle)
}

/// The text that begins a transaction: static where no `SET LOCAL` follows
/// the `BEGIN` (nothing to allocate, nothing to copy when kept for a
/// restart).
pub(crate) type BeginText = std::borrow::Cow<'static, str>;

/// `begin` ([`BEGIN`], or [`BEGIN_DEFAULT`] on a session whose default
/// level was checked), then [`set_waits`].
///
/// [`BEGIN_DEFAULT`]: super::transaction::BEGIN_DEFAULT
pub(crate) fn begin_then_waits(
    begin: &'static str,
    lock_wait: Option<Duration>,
    idle: Option<Duration>,
) -> BeginText {
    if lock_wait.is_none() && idle.is_none() {
        return BeginText::Borrowed(begin);
    }
    BeginText::Owned(format!("{begin}{}", set_waits(lock_wait, idle)))
}

/// [`begin_with_waits`], then the session's process id, which a cancel
/// request names: one simple-query message, for a driver that sends one
/// statement at a time (sqlx). In one message of several statements
/// PostgreSQL runs them in turn, and the `BEGIN` leaves the transaction
/// open behind the last.
pub(crate) fn begin_then_pid(lock_wait: Option<Duration>, idle: Option<Duration>) -> String {
    format!(
        "{}; SELECT pg_backend_pid()",
        begin_with_waits(lock_wait, idle)
    )
}

/// [`CLAIM`]'s and [`TAKE_OVER`]'s parameters.
pub(crate) fn claim_params(request: &ClaimRequest) -> [Param<'_>; 5] {
    let [tenant, endpoint, key] = key_params(request);
    [
        tenant,
        endpoint,
        key,
        Param::Bytea(request.fingerprint.as_bytes().as_slice()),
        Param::from(request.retention),
    ]
}

/// What a claim found.
#[derive(Debug)]
pub(crate) enum Claimed {
    /// This request owns the key: its attempt token and its transaction's id.
    Owned(i64, String),
    /// A completed record, to replay.
    Completed(Record),
    /// Held by an operation still in progress.
    InProgress,
}

/// Settles a claim from the rows [`CLAIM`] returned on `link`, in the
/// claim's transaction: owned; someone else's record; a record that may be
/// taken over, taken over with [`TAKE_OVER`]; or a record committed while
/// the claim waited (no row), read with a fresh snapshot ([`LOOKUP`]).
pub(crate) async fn settle<C: Connection>(
    link: &mut C,
    request: &ClaimRequest,
    rows: Vec<C::Row>,
) -> Result<Claimed, StoreError> {
    let Some(row) = rows.first() else {
        return unseen(link, request).await;
    };
    if row.bool(0)? {
        return Ok(Claimed::Owned(row.int8(1)?, row.text(2)?.to_owned()));
    }
    if !row.bool(10)? {
        return Ok(found(record_at(row, 3)?));
    }
    // Expired, or an orphan: take it over, as a second step of the same
    // transaction (rare: once per key per retention period).
    let taken = link.query(TAKE_OVER, &claim_params(request)).await?;
    match taken.first() {
        Some(row) => Ok(Claimed::Owned(row.int8(0)?, row.text(1)?.to_owned())),
        None => unseen(link, request).await,
    }
}

/// The key is taken by a row the claim's snapshot does not show (committed
/// while it waited, or taken over by someone else first): read it anew.
async fn unseen<C: Connection>(
    link: &mut C,
    request: &ClaimRequest,
) -> Result<Claimed, StoreError> {
    let rows = link.query(LOOKUP, &key_params(request)).await?;
    match rows.first() {
        Some(row) => Ok(found(record_at(row, 0)?)),
        None => Ok(Claimed::InProgress),
    }
}

// The row that failed a one-commit claim, deleted if it may be taken over
// (its retention ended, or an orphan: the rule of the claim-first mode's
// takeover), so that the request's work can run again on a free key. An
// operation under a live lease stays, and so does a record committed since
// (unexpired). The token a new row draws comes from the sequence: larger
// than every token handed out before, the deleted row's included.
pub(crate) const FREE: Sql<'static> = Sql::new(concat!(
    "DELETE FROM idempotency_requests AS r \
     WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text \
         AND (",
    may_take_over!("r.", "now()"),
    ") RETURNING 1"
));

fn found(record: Option<Record>) -> Claimed {
    record.map_or(Claimed::InProgress, Claimed::Completed)
}
