//! The long-running mode's protocol, shared by both drivers: every
//! statement (each decision one statement on the key's row, guarded by the
//! attempt token; none reads and then writes) and the reading of the
//! columns they return.

use bytes::Bytes;
use http::Method;

use std::time::Duration;

use super::{
    driver::Driver,
    record::{fingerprint, key_params, record_at, response_at},
    sql::{Columns, Param, Sql},
    waits::{GRACE, MIN_WAIT, ROW_WAIT},
};
use crate::{
    fingerprint::Fingerprint,
    key::IdempotencyKey,
    protocol::identity::{Identity, Lease, LeaseIdentity},
    record::{StoredResponse, TraceText},
    scope::{Scope, TenantId},
    store::{
        Acquired, ClaimRequest, LeaseRequest, OperationId, OperationState, Owned, Recovered,
        StoreError, StoreErrorKind, StoredRequest,
    },
};

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
pub(crate) const LOOKUP: Sql<'static> = Sql::new("SELECT request_fingerprint, state, response_status, response_headers, response_body, \
         resource_id, trace_id, operation_id::text, lease_expires_at > now() \
     FROM idempotency_requests \
     WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text AND expires_at > now()");

// A new operation, or a takeover. ON CONFLICT waits for whoever holds the
// row (a fenced transaction, another acquire) and then sees the committed
// row. It is taken over when its retention ended (a new operation: new id),
// when it is a short-transaction orphan (committed in_progress without a
// lease), or when its lease expired and the request is the same (a
// takeover: the operation keeps its id, its age, and counts one more
// attempt). Of any number of concurrent takeovers, the first raises the
// token and renews the lease; the others find a live lease and take
// nothing. The token comes from the sequence (EXCLUDED), so it is larger
// than every token before it. "Now" is the proposed row's `created_at` (its
// default, the transaction's start): Citus refuses functions that are not
// immutable in `ON CONFLICT … DO UPDATE`.
pub(crate) const ACQUIRE: Sql<'static> = Sql::new("INSERT INTO idempotency_requests AS r \
         (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at, \
          operation_id, lease_expires_at, request_method, request_target, request_headers, request_body, \
          attempts) \
     VALUES ($1::text, $2::text, $3::text, $4::bytea, 'in_progress', \
          now() + make_interval(secs => $6::float8 + $5::float8), \
          $7::text::uuid, now() + make_interval(secs => $6::float8), $8::text, $9::text, $10::bytea, $11::bytea, \
          1) \
     ON CONFLICT ON CONSTRAINT idempotency_requests_pkey DO UPDATE SET \
         attempt_token = EXCLUDED.attempt_token, lease_expires_at = EXCLUDED.lease_expires_at, \
         attempts = CASE WHEN r.expires_at > EXCLUDED.created_at AND r.lease_expires_at IS NOT NULL \
             THEN r.attempts + 1 ELSE 1 END, \
         operation_id = CASE WHEN r.expires_at > EXCLUDED.created_at AND r.lease_expires_at IS NOT NULL \
             THEN r.operation_id ELSE EXCLUDED.operation_id END, \
         created_at = CASE WHEN r.expires_at > EXCLUDED.created_at AND r.lease_expires_at IS NOT NULL \
             THEN r.created_at ELSE EXCLUDED.created_at END, \
         request_fingerprint = EXCLUDED.request_fingerprint, state = 'in_progress', \
         response_status = NULL, response_headers = NULL, response_body = NULL, resource_id = NULL, \
         trace_id = NULL, completed_at = NULL, expires_at = GREATEST(r.expires_at, EXCLUDED.expires_at), \
         request_method = EXCLUDED.request_method, request_target = EXCLUDED.request_target, \
         request_headers = EXCLUDED.request_headers, request_body = EXCLUDED.request_body \
     WHERE r.expires_at <= EXCLUDED.created_at \
         OR (r.state = 'in_progress' AND (r.lease_expires_at IS NULL \
             OR (r.lease_expires_at <= EXCLUDED.created_at AND r.request_fingerprint = EXCLUDED.request_fingerprint))) \
     RETURNING attempt_token, operation_id::text, attempts");

// An operation's retention counts from its end: while it runs, its record
// lasts a retention ($6) past its lease, so one that outlives its retention
// is neither cleaned up nor taken for a new operation, and one whose owner
// died is still there for a recovery worker (ACQUIRE and RECOVER set it so
// too). FINISH and FAIL count the retention from the answer.
pub(crate) const HEARTBEAT: Sql<'static> = Sql::new(
    "UPDATE idempotency_requests SET \
         lease_expires_at = now() + make_interval(secs => $5::float8), \
         expires_at = GREATEST(expires_at, now() + make_interval(secs => $5::float8 + $6::float8)) \
     WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text \
         AND attempt_token = $4::int8 AND state = 'in_progress' RETURNING 1",
);

// FOR SHARE: concurrent fenced transactions of the owner do not wait for
// each other, but a takeover (an UPDATE of the row) waits until they end,
// and then finds the lease renewed or not, never half of a write. Also
// returns the transaction id, which the commit checks.
pub(crate) const HOLD: Sql<'static> = Sql::new(
    "SELECT pg_current_xact_id()::text \
     FROM idempotency_requests \
     WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text \
         AND attempt_token = $4::int8 AND state = 'in_progress' \
     FOR SHARE",
);

// The completion: a compare-and-swap on the token. The request is no
// longer needed once the answer is stored.
pub(crate) const FINISH: Sql<'static> = Sql::new(
    "UPDATE idempotency_requests SET state = 'completed', response_status = $5::int2, \
         response_headers = $6::bytea, response_body = $7::bytea, resource_id = $9::text, \
         trace_id = $10::text, completed_at = statement_timestamp(), \
         expires_at = statement_timestamp() + make_interval(secs => $8::float8), \
         lease_expires_at = NULL, request_headers = NULL, request_body = NULL \
     WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text \
         AND attempt_token = $4::int8 AND state = 'in_progress' RETURNING 1",
);

// The record stays (the operation keeps its identity); its lease ends now,
// so the next acquire of the same request resumes it at once, and the token
// moves on, so nothing more of this attempt gets through. A recovery worker
// waits out its backoff first. The new token is drawn in a subquery: Citus
// refuses a volatile function in an UPDATE, and evaluates the subquery
// first, on the coordinator.
pub(crate) const RELEASE: Sql<'static> = Sql::new(
    "UPDATE idempotency_requests SET \
         attempt_token = (SELECT nextval('idempotency_attempt_token_seq')), \
         lease_expires_at = statement_timestamp() \
     WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text \
         AND attempt_token = $4::int8 AND state = 'in_progress' RETURNING 1",
);

// The failure is remembered as a completion is: replayed to every retry
// until the retention ends.
pub(crate) const FAIL: Sql<'static> = Sql::new(
    "UPDATE idempotency_requests SET state = 'failed', response_status = $5::int2, \
         response_headers = $6::bytea, response_body = $7::bytea, resource_id = NULL, \
         completed_at = statement_timestamp(), \
         expires_at = statement_timestamp() + make_interval(secs => $8::float8), \
         attempts = $9::int4, \
         lease_expires_at = NULL, request_headers = NULL, request_body = NULL \
     WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text \
         AND attempt_token = $4::int8 AND state = 'in_progress' RETURNING 1",
);

pub(crate) const OPERATION: Sql<'static> = Sql::new(
    "SELECT state, response_status, response_headers, response_body, resource_id, attempts \
     FROM idempotency_requests \
     WHERE operation_id = $1::text::uuid AND tenant_id = $2::text AND expires_at > now()",
);

/// Whether a long-running operation of endpoint `$endpoint` is due for
/// recovery: in progress, its lease ended and its backoff passed
/// (`$first` seconds after the first attempt, doubling with each further
/// one, at most `$max`), its record not expired.
macro_rules! due_operation {
    ($endpoint:literal, $first:literal, $max:literal) => {
        concat!(
            "endpoint = ",
            $endpoint,
            "::text AND state = 'in_progress' \
             AND lease_expires_at <= now() AND expires_at > now() \
             AND lease_expires_at + make_interval(secs => LEAST(",
            $first,
            "::float8 * power(2::float8, LEAST(GREATEST(attempts - 1, 0), 30)), ",
            $max,
            "::float8)) <= now()"
        )
    };
}

// The tenants with operations due for recovery, those due longest first,
// among the `$4` due longest: a read without locks, across tenants (on
// Citus, across shards). RECOVER then takes one per tenant.
pub(crate) const RECOVERY_TENANTS: Sql<'static> = Sql::new(concat!(
    "SELECT tenant_id FROM (SELECT tenant_id, lease_expires_at FROM idempotency_requests WHERE ",
    due_operation!("$1", "$2", "$3"),
    " ORDER BY lease_expires_at LIMIT $4::int8) AS due \
     GROUP BY tenant_id ORDER BY min(lease_expires_at)"
));

// One due operation of tenant `$6`, taken for recovery. SKIP LOCKED:
// workers of several instances never wait on, nor take, the same
// operation; the row is locked from the scan to the commit. Per tenant, so
// that on Citus the lock is taken on one shard (Citus refuses FOR UPDATE
// across shards). The new token is drawn in a subquery (see RELEASE).
pub(crate) const RECOVER: Sql<'static> = Sql::new(concat!(
    "WITH due AS ( \
         SELECT tenant_id, endpoint, idempotency_key FROM idempotency_requests \
         WHERE tenant_id = $6::text AND ",
    due_operation!("$1", "$3", "$4"),
    " ORDER BY lease_expires_at LIMIT 1 \
         FOR UPDATE SKIP LOCKED) \
     UPDATE idempotency_requests AS r SET \
         attempt_token = (SELECT nextval('idempotency_attempt_token_seq')), \
         lease_expires_at = now() + make_interval(secs => $2::float8), \
         expires_at = GREATEST(r.expires_at, now() + make_interval(secs => $2::float8 + $5::float8)), \
         attempts = r.attempts + 1 \
     FROM due \
     WHERE r.tenant_id = $6::text AND r.tenant_id = due.tenant_id AND r.endpoint = due.endpoint \
         AND r.idempotency_key = due.idempotency_key \
     RETURNING r.tenant_id, r.idempotency_key, r.attempt_token, r.operation_id::text, \
         r.request_method, r.request_target, r.request_headers, r.request_body, r.attempts, \
         r.request_fingerprint"
));

/// How many of the operations due longest [`RECOVERY_TENANTS`] looks at.
const RECOVERY_SCAN: i64 = 64;

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
        claim.fingerprint,
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
    pub(crate) fingerprint: &'r [u8],
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
    let fingerprint = Fingerprint::from_slice(row.fingerprint)
        .ok_or_else(|| corrupt("stored record has a fingerprint that is not 32 bytes"))?;
    let lease = Lease::new(operation_id, lease);
    let identity = Identity::new(scope.clone(), key, fingerprint, row.token, retention, lease);
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

/// [`LeaseStore::acquire`](crate::store::LeaseStore::acquire) on
/// `transport`: where the key stands, then (if it may be owned) [`ACQUIRE`]
/// in a transaction of its own, within the claim's wait. `handle` makes the
/// driver's lease of the owner's identity.
pub(crate) async fn acquire<T: Driver, L>(
    transport: &T,
    claim: &ClaimRequest,
    request: &LeaseRequest,
    handle: impl FnOnce(LeaseIdentity) -> L,
) -> Result<Acquired<L>, StoreError> {
    let deadline = tokio::time::Instant::now() + claim.wait.max(MIN_WAIT);
    if let Some(found) = lookup(transport, claim, deadline).await? {
        return Ok(found);
    }
    let [tenant, endpoint, key] = key_params(claim);
    let headers = request.request.encode_headers();
    let proposed = request.operation_id.to_string();
    let params = [
        tenant,
        endpoint,
        key,
        Param::Bytea(claim.fingerprint.as_bytes().as_slice()),
        Param::from(claim.retention),
        Param::from(request.lease),
        Param::Text(&proposed),
        Param::Text(request.request.method.as_str()),
        Param::Text(request.request.target.as_str()),
        Param::Bytea(&headers),
        Param::Bytea(&request.request.body),
    ];
    let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
    let rows = match transport
        .transaction(ACQUIRE, &params, remaining.max(MIN_WAIT))
        .await
    {
        Ok(rows) => rows,
        Err(e) if e.sql_state() == Some(super::errors::LOCK_NOT_AVAILABLE) => {
            return Ok(Acquired::InProgress)
        }
        Err(e) => return Err(e),
    };
    if let Some(row) = rows.first() {
        let columns = (row.int8(0)?, row.text(1)?, row.int4(2)?);
        return Ok(Acquired::Owned(acquired(claim, request, columns, handle)?));
    }
    // Someone else's record: a live lease, a completion, another request.
    let deadline = tokio::time::Instant::now() + MIN_WAIT.max(GRACE);
    Ok(lookup(transport, claim, deadline)
        .await?
        .unwrap_or(Acquired::InProgress))
}

/// Where the key stands, if that decides the acquire: completed, or
/// running under a live lease (or under an expired one, for another
/// request). `None`: the key is free or may be taken over.
async fn lookup<T: Driver, L>(
    transport: &T,
    claim: &ClaimRequest,
    deadline: tokio::time::Instant,
) -> Result<Option<Acquired<L>>, StoreError> {
    let rows = transport.read(LOOKUP, &key_params(claim), deadline).await?;
    let Some(row) = rows.first() else {
        return Ok(None);
    };
    if let Some(record) = record_at(row, 0)? {
        return Ok(Some(Acquired::Completed(record)));
    }
    running(
        claim,
        fingerprint(row.bytea(0)?)?,
        row.opt_text(7)?,
        row.opt_bool(8)?,
    )
}

/// [`LeaseStore::heartbeat`](crate::store::LeaseStore::heartbeat).
pub(crate) async fn heartbeat<T: Driver>(
    transport: &T,
    lease: &LeaseIdentity,
    extend: Duration,
) -> Result<(), StoreError> {
    let [tenant, endpoint, key, token] = token_params(lease);
    let params = [
        tenant,
        endpoint,
        key,
        token,
        Param::from(extend.min(crate::store::MAX_WAIT)),
        Param::from(lease.retention()),
    ];
    guarded(transport, lease, HEARTBEAT, &params).await
}

/// [`LeaseStore::finish`](crate::store::LeaseStore::finish).
pub(crate) async fn finish<T: Driver>(
    transport: &T,
    lease: &LeaseIdentity,
    response: &StoredResponse,
) -> Result<(), StoreError> {
    let resource = response.resource_id.as_ref().map(|id| id.as_str());
    let trace = TraceText::of(response);
    let trace = Param::OptText(trace.as_ref().map(TraceText::as_str));
    end_with(
        transport,
        lease,
        FINISH,
        response,
        &[Param::OptText(resource), trace],
    )
    .await
}

/// [`LeaseStore::fail`](crate::store::LeaseStore::fail).
pub(crate) async fn fail<T: Driver>(
    transport: &T,
    lease: &LeaseIdentity,
    response: &StoredResponse,
    attempts: u32,
) -> Result<(), StoreError> {
    let attempts = i32::try_from(attempts).unwrap_or(i32::MAX);
    end_with(transport, lease, FAIL, response, &[Param::Int4(attempts)]).await
}

/// [`LeaseStore::release`](crate::store::LeaseStore::release).
pub(crate) async fn release<T: Driver>(
    transport: &T,
    lease: &LeaseIdentity,
) -> Result<(), StoreError> {
    guarded(transport, lease, RELEASE, &token_params(lease)).await
}

/// The parameters every token-guarded statement starts with: tenant,
/// endpoint, key, token.
pub(crate) fn token_params(lease: &LeaseIdentity) -> [Param<'_>; 4] {
    let (tenant, endpoint, key, token) = lease.columns();
    [
        Param::Text(tenant),
        Param::Text(endpoint),
        Param::Text(key),
        Param::Int8(token),
    ]
}

/// Finish or fail: the record ends with `response` (and `last`, the
/// statement's own parameters), if the token is still the record's.
async fn end_with<T: Driver>(
    transport: &T,
    lease: &LeaseIdentity,
    sql: Sql<'static>,
    response: &StoredResponse,
    last: &[Param<'_>],
) -> Result<(), StoreError> {
    let [tenant, endpoint, key, token] = token_params(lease);
    let headers = response.encode_headers();
    let mut params = vec![
        tenant,
        endpoint,
        key,
        token,
        Param::Int2(response.status.as_u16() as i16),
        Param::Bytea(&headers),
        Param::Bytea(&response.body),
        Param::from(lease.retention()),
    ];
    params.extend_from_slice(last);
    guarded(transport, lease, sql, &params).await
}

/// Runs a statement guarded by the lease's token (it returns a row for the
/// row it changed); none changed: the owner is fenced.
async fn guarded<T: Driver>(
    transport: &T,
    lease: &LeaseIdentity,
    sql: Sql<'static>,
    params: &[Param<'_>],
) -> Result<(), StoreError> {
    if transport
        .transaction(sql, params, ROW_WAIT)
        .await?
        .is_empty()
    {
        lease.mark_fenced();
        return Err(fenced());
    }
    Ok(())
}

/// [`LeaseStore::operation`](crate::store::LeaseStore::operation).
pub(crate) async fn operation<T: Driver>(
    transport: &T,
    tenant: &TenantId,
    id: OperationId,
) -> Result<Option<crate::store::Operation>, StoreError> {
    let text = id.to_string();
    let deadline = tokio::time::Instant::now() + ROW_WAIT;
    let params = [Param::Text(&text), Param::Text(tenant.as_str())];
    let rows = transport.read(OPERATION, &params, deadline).await?;
    let Some(row) = rows.first() else {
        return Ok(None);
    };
    let attempts = attempt_of(row.int4(5)?);
    let state = operation_state(row.text(0)?, || response_at(row, 1))?;
    Ok(Some(crate::store::Operation::new(id, state, attempts)))
}

/// [`LeaseStore::recover`](crate::store::LeaseStore::recover).
pub(crate) async fn recover<T: Driver, L>(
    transport: &T,
    endpoint: &str,
    lease: Duration,
    retention: Duration,
    backoff: crate::store::Backoff,
    handle: impl FnOnce(LeaseIdentity) -> L,
) -> Result<Option<Recovered<L>>, StoreError> {
    let (lease, retention) = crate::store::bounded(lease, retention);
    let params = [
        Param::Text(endpoint),
        Param::from(lease),
        Param::from(backoff.first),
        Param::from(backoff.max),
        Param::from(retention),
    ];
    let scan = [
        Param::Text(endpoint),
        Param::from(backoff.first),
        Param::from(backoff.max),
        Param::Int8(RECOVERY_SCAN),
    ];
    let tenants = transport
        .transaction(RECOVERY_TENANTS, &scan, ROW_WAIT)
        .await?;
    let mut found = None;
    for tenant in &tenants {
        let tenant = tenant.text(0)?;
        let mut params = params.to_vec();
        params.push(Param::Text(tenant));
        let rows = transport.transaction(RECOVER, &params, ROW_WAIT).await?;
        if let Some(row) = rows.into_iter().next() {
            found = Some(row);
            break;
        }
    }
    let Some(row) = found.as_ref() else {
        return Ok(None);
    };
    let row = RecoverRow {
        tenant: row.text(0)?.to_owned(),
        key: row.text(1)?,
        token: row.int8(2)?,
        operation_id: row.text(3)?,
        method: row.opt_text(4)?.map(str::to_owned),
        target: row.opt_text(5)?.map(str::to_owned),
        headers: row.opt_bytea(6)?,
        body: row.opt_bytea(7)?,
        attempts: row.int4(8)?,
        fingerprint: row.bytea(9)?,
    };
    recovered(row, endpoint, lease, retention, handle).map(Some)
}
