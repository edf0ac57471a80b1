//! The long-running mode's protocol, shared by both drivers: every
//! statement (each decision one statement on the key's row, guarded by the
//! attempt token; none reads and then writes) and the reading of the
//! columns they return.

use bytes::Bytes;
use http::Method;

use std::time::Duration;

use crate::{
    fingerprint::Fingerprint,
    key::IdempotencyKey,
    protocol::identity::{Identity, Lease, LeaseIdentity},
    record::{ResourceId, StoredResponse},
    scope::{Scope, TenantId},
    store::{
        Acquired, ClaimRequest, LeaseRequest, OperationId, OperationState, Owned, Recovered,
        StoreError, StoreErrorKind, StoredRequest,
    },
};

/// Whether a record in `state` holds an answer to replay: a completion, or
/// a long-running operation's remembered failure. Both drivers' claims and
/// lookups read the `state` column through this one rule.
pub(crate) fn answered(state: &str) -> bool {
    matches!(state, "completed" | "failed")
}

/// An operation's state from its `state` column; `response` reads its
/// stored answer, once there is one.
pub(crate) fn operation_state(
    state: &str,
    response: impl FnOnce() -> Result<StoredResponse, StoreError>,
) -> Result<OperationState, StoreError> {
    Ok(match state {
        "completed" => OperationState::Completed(response()?),
        "failed" => OperationState::Failed(response()?),
        _ => OperationState::Running,
    })
}

/// Where a key stands, without a lock or a write.
pub(crate) const LOOKUP: &str = "SELECT request_fingerprint, state, response_status, response_headers, response_body, \
         resource_id, operation_id::text, lease_expires_at > now() \
     FROM idempotency_requests \
     WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text AND expires_at > now()";

// A new operation, or a takeover. ON CONFLICT waits for whoever holds the
// row (a fenced transaction, another acquire) and then sees the committed
// row. It is taken over when its retention ended (a new operation: new id),
// when it is a short-transaction orphan (committed in_progress without a
// lease), or when its lease expired and the request is the same (a
// takeover: the operation keeps its id, its age, and counts one more
// attempt). Of any number of concurrent takeovers, the first raises the
// token and renews the lease; the others find a live lease and take
// nothing. The token comes from the sequence (EXCLUDED), so it is larger
// than every token before it.
pub(crate) const ACQUIRE: &str = "INSERT INTO idempotency_requests AS r \
         (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at, \
          operation_id, lease_expires_at, request_method, request_target, request_headers, request_body, \
          attempts) \
     VALUES ($1::text, $2::text, $3::text, $4::bytea, 'in_progress', \
          now() + make_interval(secs => $6::float8 + $5::float8), \
          $7::text::uuid, now() + make_interval(secs => $6::float8), $8::text, $9::text, $10::bytea, $11::bytea, \
          1) \
     ON CONFLICT ON CONSTRAINT idempotency_requests_pkey DO UPDATE SET \
         attempt_token = EXCLUDED.attempt_token, lease_expires_at = EXCLUDED.lease_expires_at, \
         attempts = CASE WHEN r.expires_at > now() AND r.lease_expires_at IS NOT NULL \
             THEN r.attempts + 1 ELSE 1 END, \
         operation_id = CASE WHEN r.expires_at > now() AND r.lease_expires_at IS NOT NULL \
             THEN r.operation_id ELSE EXCLUDED.operation_id END, \
         created_at = CASE WHEN r.expires_at > now() AND r.lease_expires_at IS NOT NULL \
             THEN r.created_at ELSE now() END, \
         request_fingerprint = EXCLUDED.request_fingerprint, state = 'in_progress', \
         response_status = NULL, response_headers = NULL, response_body = NULL, resource_id = NULL, \
         completed_at = NULL, expires_at = GREATEST(r.expires_at, EXCLUDED.expires_at), \
         request_method = EXCLUDED.request_method, request_target = EXCLUDED.request_target, \
         request_headers = EXCLUDED.request_headers, request_body = EXCLUDED.request_body \
     WHERE r.expires_at <= now() \
         OR (r.state = 'in_progress' AND (r.lease_expires_at IS NULL \
             OR (r.lease_expires_at <= now() AND r.request_fingerprint = EXCLUDED.request_fingerprint))) \
     RETURNING attempt_token, operation_id::text, attempts";

// An operation's retention counts from its end: while it runs, its record
// lasts a retention ($6) past its lease, so one that outlives its retention
// is neither cleaned up nor taken for a new operation, and one whose owner
// died is still there for a recovery worker (ACQUIRE and RECOVER set it so
// too). FINISH and FAIL count the retention from the answer.
pub(crate) const HEARTBEAT: &str = "UPDATE idempotency_requests SET \
         lease_expires_at = now() + make_interval(secs => $5::float8), \
         expires_at = GREATEST(expires_at, now() + make_interval(secs => $5::float8 + $6::float8)) \
     WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text \
         AND attempt_token = $4::int8 AND state = 'in_progress'";

// FOR SHARE: concurrent fenced transactions of the owner do not wait for
// each other, but a takeover (an UPDATE of the row) waits until they end,
// and then finds the lease renewed or not, never half of a write. Also
// returns the transaction id, which the commit checks.
pub(crate) const HOLD: &str = "SELECT pg_current_xact_id()::text \
     FROM idempotency_requests \
     WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text \
         AND attempt_token = $4::int8 AND state = 'in_progress' \
     FOR SHARE";

// The completion: a compare-and-swap on the token. The request is no
// longer needed once the answer is stored.
pub(crate) const FINISH: &str =
    "UPDATE idempotency_requests SET state = 'completed', response_status = $5::int2, \
         response_headers = $6::bytea, response_body = $7::bytea, resource_id = $9::text, \
         completed_at = statement_timestamp(), \
         expires_at = statement_timestamp() + make_interval(secs => $8::float8), \
         lease_expires_at = NULL, request_headers = NULL, request_body = NULL \
     WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text \
         AND attempt_token = $4::int8 AND state = 'in_progress'";

// The record stays (the operation keeps its identity); its lease ends now,
// so the next acquire of the same request resumes it at once, and the token
// moves on, so nothing more of this attempt gets through. A recovery worker
// waits out its backoff first.
pub(crate) const RELEASE: &str = "UPDATE idempotency_requests SET \
         attempt_token = nextval('idempotency_attempt_token_seq'), \
         lease_expires_at = statement_timestamp() \
     WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text \
         AND attempt_token = $4::int8 AND state = 'in_progress'";

// The failure is remembered as a completion is: replayed to every retry
// until the retention ends.
pub(crate) const FAIL: &str =
    "UPDATE idempotency_requests SET state = 'failed', response_status = $5::int2, \
         response_headers = $6::bytea, response_body = $7::bytea, resource_id = NULL, \
         completed_at = statement_timestamp(), \
         expires_at = statement_timestamp() + make_interval(secs => $8::float8), \
         attempts = $9::int4, \
         lease_expires_at = NULL, request_headers = NULL, request_body = NULL \
     WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text \
         AND attempt_token = $4::int8 AND state = 'in_progress'";

pub(crate) const OPERATION: &str =
    "SELECT state, response_status, response_headers, response_body, resource_id, attempts \
     FROM idempotency_requests \
     WHERE operation_id = $1::text::uuid AND tenant_id = $2::text AND expires_at > now()";

// SKIP LOCKED: workers of several instances never wait on, nor take, the
// same operation; the row is locked from the scan to the commit. An
// operation is due once its lease ended and its backoff passed: $3 seconds
// after the first attempt, doubling with each further one, at most $4.
pub(crate) const RECOVER: &str = "WITH due AS ( \
         SELECT tenant_id, endpoint, idempotency_key FROM idempotency_requests \
         WHERE endpoint = $1::text AND state = 'in_progress' AND lease_expires_at <= now() \
             AND expires_at > now() \
             AND lease_expires_at + make_interval(secs => LEAST( \
                 $3::float8 * power(2::float8, LEAST(GREATEST(attempts - 1, 0), 30)), $4::float8)) <= now() \
         ORDER BY lease_expires_at LIMIT 1 \
         FOR UPDATE SKIP LOCKED) \
     UPDATE idempotency_requests AS r SET \
         attempt_token = nextval('idempotency_attempt_token_seq'), \
         lease_expires_at = now() + make_interval(secs => $2::float8), \
         expires_at = GREATEST(r.expires_at, now() + make_interval(secs => $2::float8 + $5::float8)), \
         attempts = r.attempts + 1 \
     FROM due \
     WHERE r.tenant_id = due.tenant_id AND r.endpoint = due.endpoint \
         AND r.idempotency_key = due.idempotency_key \
     RETURNING r.tenant_id, r.idempotency_key, r.attempt_token, r.operation_id::text, \
         r.request_method, r.request_target, r.request_headers, r.request_body, r.attempts";

/// The owner an acquire made, from the row [`ACQUIRE`] returns (attempt
/// token, operation id, attempts); `handle` makes the driver's lease of
/// its identity.
pub(crate) fn acquired<L>(
    claim: &ClaimRequest,
    request: &LeaseRequest,
    (token, id, attempts): (i64, &str, i32),
    handle: impl FnOnce(LeaseIdentity) -> L,
) -> Result<Owned<L>, StoreError> {
    let operation_id = parse_id(id)?;
    let lease = Lease::new(operation_id, request.lease);
    let identity = Identity::new(
        claim.scope.clone(),
        claim.key.clone(),
        token,
        claim.retention,
        lease,
    );
    let attempt = attempt_of(attempts);
    Ok(Owned::new(handle(identity), operation_id, token, attempt))
}

/// Whether a key without an answer to replay is taken, from the columns
/// [`LOOKUP`] returns: a live lease, or an expired one that another request
/// started (the layer refuses a reused key; only the same request takes an
/// operation over). `None`: an acquire may own it (an orphan, an expired
/// lease of the same request).
pub(crate) fn running<L>(
    claim: &ClaimRequest,
    fingerprint: Fingerprint,
    operation_id: Option<&str>,
    live: Option<bool>,
) -> Result<Option<Acquired<L>>, StoreError> {
    let taken = match live {
        Some(true) => true,
        Some(false) => fingerprint != claim.fingerprint,
        None => false,
    };
    match operation_id {
        Some(id) if taken => Ok(Some(Acquired::Running {
            operation_id: parse_id(id)?,
            fingerprint,
        })),
        _ => Ok(None),
    }
}

/// The columns of the row [`RECOVER`] returns, as a driver reads them.
pub(crate) struct RecoverRow<'r> {
    pub(crate) tenant: String,
    pub(crate) key: &'r str,
    pub(crate) token: i64,
    pub(crate) operation_id: &'r str,
    pub(crate) method: Option<String>,
    pub(crate) target: Option<String>,
    pub(crate) headers: Option<&'r [u8]>,
    pub(crate) body: Option<&'r [u8]>,
    pub(crate) attempts: i32,
}

/// The owner a recovery on `endpoint` took over, with the request to
/// re-drive; `handle` makes the driver's lease of its identity.
pub(crate) fn recovered<L>(
    row: RecoverRow<'_>,
    endpoint: &str,
    lease: Duration,
    retention: Duration,
    handle: impl FnOnce(LeaseIdentity) -> L,
) -> Result<Recovered<L>, StoreError> {
    let scope = Scope::new(TenantId::new(row.tenant), endpoint.to_owned());
    let key = IdempotencyKey::from_text(row.key)
        .map_err(|_| corrupt("stored record has an invalid key"))?;
    let operation_id = parse_id(row.operation_id)?;
    let request = stored_request(row.method, row.target, row.headers, row.body)?;
    let lease = Lease::new(operation_id, lease);
    let identity = Identity::new(scope.clone(), key, row.token, retention, lease);
    let attempt = attempt_of(row.attempts);
    let owned = Owned::new(handle(identity), operation_id, row.token, attempt);
    Ok(Recovered::new(owned, scope, request))
}

/// The request a recovery worker re-drives, from its stored columns
/// (shared with the sqlx store, which reads the same table).
pub(crate) fn stored_request(
    method: Option<String>,
    target: Option<String>,
    headers: Option<&[u8]>,
    body: Option<&[u8]>,
) -> Result<StoredRequest, StoreError> {
    Ok(StoredRequest::new(
        method
            .and_then(|m| Method::from_bytes(m.as_bytes()).ok())
            .ok_or_else(|| corrupt("stored request has an invalid method"))?,
        target.ok_or_else(|| corrupt("stored request has no target"))?,
        StoredRequest::decode_headers(headers.unwrap_or_default())
            .ok_or_else(|| corrupt("stored request has an invalid header block"))?,
        Bytes::copy_from_slice(body.unwrap_or_default()),
    ))
}

/// A completed operation's answer, from its stored columns (shared with the
/// sqlx store).
pub(crate) fn stored_response(
    status: i16,
    headers: &[u8],
    body: &[u8],
    resource_id: Option<String>,
) -> Result<StoredResponse, StoreError> {
    Ok(StoredResponse {
        status: u16::try_from(status)
            .ok()
            .and_then(|s| http::StatusCode::from_u16(s).ok())
            .ok_or_else(|| corrupt("stored record has an invalid status"))?,
        headers: StoredResponse::decode_headers(headers)
            .ok_or_else(|| corrupt("stored record has an invalid header block"))?,
        body: Bytes::copy_from_slice(body),
        resource_id: resource_id.map(ResourceId::new),
    })
}

/// The `attempts` column (never negative; 0 for records older than the count).
pub(crate) fn attempt_of(attempts: i32) -> u32 {
    u32::try_from(attempts).unwrap_or(0)
}

/// `Fenced`, for an owner whose attempt token is no longer the record's.
pub(crate) fn fenced() -> StoreError {
    StoreError::new(
        StoreErrorKind::Fenced,
        "another owner took the operation over with a larger attempt token",
    )
}

pub(crate) fn parse_id(id: &str) -> Result<OperationId, StoreError> {
    id.parse()
        .map_err(|_| corrupt("stored record has an invalid operation id"))
}

fn corrupt(message: &str) -> StoreError {
    StoreError::new(StoreErrorKind::Corrupt, message)
}
