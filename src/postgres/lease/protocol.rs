//! The long-running mode's statements: acquire (insert or take over),
//! heartbeat, the fenced transaction, finish, release, the status lookup
//! and recovery. Each decision is one statement on the key's row, guarded
//! by the attempt token; none reads and then writes.

use std::time::Duration;

use bytes::Bytes;
use http::Method;
use tokio_postgres::{
    error::SqlState,
    types::{ToSql, Type},
    Row,
};

use super::{fenced_error, PgLease};
use crate::{
    fingerprint::Fingerprint,
    key::IdempotencyKey,
    metrics::FencedAt,
    postgres::{conn::Conn, decode, error::map_error, statements::Sql, PgStore, PgTx},
    record::{ResourceId, StoredResponse},
    scope::{Scope, TenantId},
    store::OperationId,
    store::{
        Acquired, Backoff, ClaimRequest, LeaseRequest, Operation, OperationState, Owned, Recovered,
        StoreError, StoreErrorKind, StoredRequest,
    },
};

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
          now() + make_interval(secs => GREATEST($5::float8, $6::float8)), \
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

// The record's retention never ends before its lease: a live operation is
// never cleaned up.
pub(crate) const HEARTBEAT: &str = "UPDATE idempotency_requests SET \
         lease_expires_at = now() + make_interval(secs => $5::float8), \
         expires_at = GREATEST(expires_at, now() + make_interval(secs => $5::float8)) \
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
         expires_at = GREATEST(r.expires_at, now() + make_interval(secs => $2::float8)), \
         attempts = r.attempts + 1 \
     FROM due \
     WHERE r.tenant_id = due.tenant_id AND r.endpoint = due.endpoint \
         AND r.idempotency_key = due.idempotency_key \
     RETURNING r.tenant_id, r.idempotency_key, r.attempt_token, r.operation_id::text, \
         r.request_method, r.request_target, r.request_headers, r.request_body, r.attempts";

// The parameters of each, in order: the key's columns (tenant, endpoint,
// key) first, then the token and the rest as each statement names them.
const T: Type = Type::TEXT;
pub(crate) const LOOKUP_SQL: Sql<'static> = Sql::new(LOOKUP, &[T, T, T]);
pub(crate) const ACQUIRE_SQL: Sql<'static> = Sql::new(
    ACQUIRE,
    &[
        T,
        T,
        T,
        Type::BYTEA,
        Type::FLOAT8,
        Type::FLOAT8,
        T,
        T,
        T,
        Type::BYTEA,
        Type::BYTEA,
    ],
);
pub(crate) const HEARTBEAT_SQL: Sql<'static> =
    Sql::new(HEARTBEAT, &[T, T, T, Type::INT8, Type::FLOAT8]);
pub(crate) const HOLD_SQL: Sql<'static> = Sql::new(HOLD, &[T, T, T, Type::INT8]);
pub(crate) const FINISH_SQL: Sql<'static> = Sql::new(
    FINISH,
    &[
        T,
        T,
        T,
        Type::INT8,
        Type::INT2,
        Type::BYTEA,
        Type::BYTEA,
        Type::FLOAT8,
        T,
    ],
);
pub(crate) const RELEASE_SQL: Sql<'static> = Sql::new(RELEASE, &[T, T, T, Type::INT8]);
pub(crate) const FAIL_SQL: Sql<'static> = Sql::new(
    FAIL,
    &[
        T,
        T,
        T,
        Type::INT8,
        Type::INT2,
        Type::BYTEA,
        Type::BYTEA,
        Type::FLOAT8,
        Type::INT4,
    ],
);
pub(crate) const OPERATION_SQL: Sql<'static> = Sql::new(OPERATION, &[T, T]);
pub(crate) const RECOVER_SQL: Sql<'static> =
    Sql::new(RECOVER, &[T, Type::FLOAT8, Type::FLOAT8, Type::FLOAT8]);

/// How long a heartbeat, completion or release waits for the row, and how
/// long a fenced transaction waits to hold it (a takeover in flight).
const ROW_WAIT: Duration = Duration::from_secs(5);
/// Room beyond a wait for the server to report its own lock timeout.
const GRACE: Duration = Duration::from_millis(250);
/// The shortest wait an acquire gets.
const MIN_WAIT: Duration = Duration::from_millis(100);

/// [`LeaseStore::acquire`](crate::store::LeaseStore::acquire).
pub(in crate::postgres) async fn acquire(
    store: &PgStore,
    claim: &ClaimRequest,
    request: &LeaseRequest,
) -> Result<Acquired<PgLease>, StoreError> {
    let wait = claim.wait.max(MIN_WAIT);
    let deadline = tokio::time::Instant::now() + wait;
    if let Some(found) = lookup(store, claim, deadline).await? {
        return Ok(found);
    }
    let (tenant, endpoint, key) = key_columns(&claim.scope, &claim.key);
    let fingerprint = claim.fingerprint.as_bytes().as_slice();
    let retention = claim.retention.as_secs_f64();
    let lease = request.lease.as_secs_f64();
    let proposed = request.operation_id.to_string();
    let method = request.request.method.as_str();
    let target = request.request.target.as_str();
    let headers = request.request.encode_headers();
    let body: &[u8] = &request.request.body;
    let params: [&(dyn ToSql + Sync); 11] = [
        &tenant,
        &endpoint,
        &key,
        &fingerprint,
        &retention,
        &lease,
        &proposed,
        &method,
        &target,
        &headers,
        &body,
    ];
    let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
    let rows = match short_transaction(store, ACQUIRE_SQL, &params, remaining.max(MIN_WAIT)).await {
        Ok(rows) => rows,
        Err(e) if e.sql_state() == Some(SqlState::LOCK_NOT_AVAILABLE.code()) => {
            return Ok(Acquired::InProgress)
        }
        Err(e) => return Err(e),
    };
    if let Some(row) = rows.first() {
        let token: i64 = row.get(0);
        let id: String = row.get(1);
        let attempt = attempt_of(row.get(2));
        let operation_id = parse_id(&id)?;
        let handle = PgLease::new(
            store.clone(),
            claim.scope.clone(),
            claim.key.clone(),
            token,
            operation_id,
            claim.retention,
            request.lease,
        );
        return Ok(Acquired::Owned(Owned::new(
            handle,
            operation_id,
            token,
            attempt,
        )));
    }
    // Someone else's record: a live lease, a completion, another request.
    let deadline = tokio::time::Instant::now() + MIN_WAIT.max(GRACE);
    Ok(lookup(store, claim, deadline)
        .await?
        .unwrap_or(Acquired::InProgress))
}

/// Where the key stands, if that decides the acquire: completed, or
/// running under a live lease (or under an expired one, for another
/// request). `None`: the key is free or may be taken over.
async fn lookup(
    store: &PgStore,
    claim: &ClaimRequest,
    deadline: tokio::time::Instant,
) -> Result<Option<Acquired<PgLease>>, StoreError> {
    let (tenant, endpoint, key) = key_columns(&claim.scope, &claim.key);
    let row = read_one(store, deadline, LOOKUP_SQL, &[&tenant, &endpoint, &key]).await?;
    let Some(row) = row else { return Ok(None) };
    if let Some(record) = decode::record(&row)? {
        return Ok(Some(Acquired::Completed(record)));
    }
    let id: Option<String> = row.get(6);
    let live: Option<bool> = row.get(7);
    let fingerprint = Fingerprint::from_slice(row.get(0))
        .ok_or_else(|| corrupt("stored record has an invalid fingerprint"))?;
    let running = |id: &str| -> Result<_, StoreError> {
        Ok(Some(Acquired::Running {
            operation_id: parse_id(id)?,
            fingerprint,
        }))
    };
    match (id, live) {
        (Some(id), Some(true)) => running(&id),
        (Some(id), Some(false)) if fingerprint != claim.fingerprint => running(&id),
        _ => Ok(None),
    }
}

/// [`LeaseStore::heartbeat`](crate::store::LeaseStore::heartbeat).
pub(in crate::postgres) async fn heartbeat(
    lease: &PgLease,
    extend: Duration,
) -> Result<(), StoreError> {
    let (tenant, endpoint, key) = key_columns(lease.scope(), lease.key());
    let token = lease.attempt_token();
    let extend = extend.as_secs_f64();
    let params: [&(dyn ToSql + Sync); 5] = [&tenant, &endpoint, &key, &token, &extend];
    let rows = short_execute(lease.store(), HEARTBEAT_SQL, &params).await?;
    if rows == 0 {
        lease.mark_fenced(None);
        return Err(fenced_error());
    }
    Ok(())
}

/// Opens a fenced transaction for `lease`: `BEGIN`, the waits, and the
/// row held at the token, in one round trip.
pub(in crate::postgres) async fn open_fenced(lease: &PgLease) -> Result<PgTx, StoreError> {
    let store = lease.store();
    let mut conn = store.conn().await?;
    let hold = bounded(tokio::time::Instant::now() + ROW_WAIT, async {
        conn.prepare_sql(HOLD_SQL).await.map_err(map_error)
    })
    .await;
    let hold = match hold {
        Ok(hold) => hold,
        Err(e) => {
            conn.mark_dirty();
            return Err(e);
        }
    };
    let (tenant, endpoint, key) = key_columns(lease.scope(), lease.key());
    let token = lease.attempt_token();
    let params: [&(dyn ToSql + Sync); 4] = [&tenant, &endpoint, &key, &token];
    // While the row is held, the owner's own heartbeats wait too. So no
    // lock wait in the transaction may outlast half a lease (the rest of
    // the lease is the margin for the next heartbeat), and should the
    // owner's process stall with the row held, PostgreSQL ends the
    // transaction once it idles for a lease: takeovers are not blocked for
    // longer than the lease they wait for anyway.
    let begin = format!(
        "BEGIN ISOLATION LEVEL READ COMMITTED; \
         SET LOCAL lock_timeout = '{}ms'; \
         SET LOCAL idle_in_transaction_session_timeout = '{}ms'",
        millis(ROW_WAIT.min(lease.lease() / 2)),
        millis(lease.lease()),
    );
    conn.mark_dirty();
    let held = tokio::time::timeout(ROW_WAIT + GRACE, async {
        tokio::try_join!(
            biased;
            conn.batch_execute(&begin),
            conn.query_opt_prepared(&hold, &params),
        )
    })
    .await;
    let row = match held {
        Err(_) => return Err(timed_out()),
        Ok(Err(e)) => {
            let e = map_error(e);
            let _ = rollback(conn).await;
            return Err(e);
        }
        Ok(Ok((_, row))) => row,
    };
    let Some(row) = row else {
        let _ = rollback(conn).await;
        lease.mark_fenced(Some(FencedAt::Write));
        return Err(fenced_error());
    };
    let xid: String = row.get(0);
    Ok(PgTx::new(
        conn,
        lease.scope().clone(),
        lease.key().clone(),
        token,
        xid,
        lease.retention(),
    ))
}

/// [`LeaseStore::finish`](crate::store::LeaseStore::finish).
pub(in crate::postgres) async fn finish(
    lease: &PgLease,
    response: &StoredResponse,
) -> Result<(), StoreError> {
    let (tenant, endpoint, key) = key_columns(lease.scope(), lease.key());
    let token = lease.attempt_token();
    let status = response.status.as_u16() as i16;
    let headers = response.encode_headers();
    let body: &[u8] = &response.body;
    let retention = lease.retention().as_secs_f64();
    let resource = response.resource_id.as_ref().map(|id| id.as_str());
    let params: [&(dyn ToSql + Sync); 9] = [
        &tenant, &endpoint, &key, &token, &status, &headers, &body, &retention, &resource,
    ];
    let rows = short_execute(lease.store(), FINISH_SQL, &params).await?;
    if rows == 0 {
        lease.mark_fenced(None);
        return Err(fenced_error());
    }
    Ok(())
}

/// [`LeaseStore::release`](crate::store::LeaseStore::release).
pub(in crate::postgres) async fn release(lease: &PgLease) -> Result<(), StoreError> {
    let (tenant, endpoint, key) = key_columns(lease.scope(), lease.key());
    let token = lease.attempt_token();
    let params: [&(dyn ToSql + Sync); 4] = [&tenant, &endpoint, &key, &token];
    let rows = short_execute(lease.store(), RELEASE_SQL, &params).await?;
    if rows == 0 {
        lease.mark_fenced(None);
        return Err(fenced_error());
    }
    Ok(())
}

/// [`LeaseStore::fail`](crate::store::LeaseStore::fail).
pub(in crate::postgres) async fn fail(
    lease: &PgLease,
    response: &StoredResponse,
    attempts: u32,
) -> Result<(), StoreError> {
    let (tenant, endpoint, key) = key_columns(lease.scope(), lease.key());
    let token = lease.attempt_token();
    let status = response.status.as_u16() as i16;
    let headers = response.encode_headers();
    let body: &[u8] = &response.body;
    let retention = lease.retention().as_secs_f64();
    let attempts = i32::try_from(attempts).unwrap_or(i32::MAX);
    let params: [&(dyn ToSql + Sync); 9] = [
        &tenant, &endpoint, &key, &token, &status, &headers, &body, &retention, &attempts,
    ];
    let rows = short_execute(lease.store(), FAIL_SQL, &params).await?;
    if rows == 0 {
        lease.mark_fenced(None);
        return Err(fenced_error());
    }
    Ok(())
}

/// [`LeaseStore::operation`](crate::store::LeaseStore::operation).
pub(in crate::postgres) async fn operation(
    store: &PgStore,
    tenant: &TenantId,
    id: OperationId,
) -> Result<Option<Operation>, StoreError> {
    let text = id.to_string();
    let deadline = tokio::time::Instant::now() + ROW_WAIT;
    let row = read_one(store, deadline, OPERATION_SQL, &[&text, &tenant.as_str()]).await?;
    let Some(row) = row else { return Ok(None) };
    let state: &str = row.get(0);
    let attempts = attempt_of(row.get(5));
    let state = match state {
        "completed" => OperationState::Completed(stored_response(
            row.get(1),
            row.get(2),
            row.get(3),
            row.get(4),
        )?),
        "failed" => OperationState::Failed(stored_response(
            row.get(1),
            row.get(2),
            row.get(3),
            row.get(4),
        )?),
        _ => OperationState::Running,
    };
    Ok(Some(Operation::new(id, state, attempts)))
}

/// [`LeaseStore::recover`](crate::store::LeaseStore::recover).
pub(in crate::postgres) async fn recover(
    store: &PgStore,
    endpoint: &str,
    lease: Duration,
    retention: Duration,
    backoff: Backoff,
) -> Result<Option<Recovered<PgLease>>, StoreError> {
    let seconds = lease.as_secs_f64();
    let first = backoff.first.as_secs_f64();
    let max = backoff.max.as_secs_f64();
    let params: [&(dyn ToSql + Sync); 4] = [&endpoint, &seconds, &first, &max];
    let rows = short_transaction(store, RECOVER_SQL, &params, ROW_WAIT).await?;
    let Some(row) = rows.first() else {
        return Ok(None);
    };
    let tenant: String = row.get(0);
    let key: String = row.get(1);
    let token: i64 = row.get(2);
    let id: String = row.get(3);
    let method: Option<String> = row.get(4);
    let target: Option<String> = row.get(5);
    let headers: Option<&[u8]> = row.get(6);
    let body: Option<&[u8]> = row.get(7);
    let attempt = attempt_of(row.get(8));
    let scope = Scope::new(TenantId::new(tenant), endpoint.to_owned());
    let key = IdempotencyKey::parse(key.as_bytes())
        .map_err(|_| corrupt("stored record has an invalid key"))?;
    let operation_id = parse_id(&id)?;
    let request = stored_request(method, target, headers, body)?;
    let handle = PgLease::new(
        store.clone(),
        scope.clone(),
        key,
        token,
        operation_id,
        retention,
        lease,
    );
    Ok(Some(Recovered::new(
        Owned::new(handle, operation_id, token, attempt),
        scope,
        request,
    )))
}

/// Runs one statement in a transaction of its own, with `lock_timeout` set
/// to `wait`: `BEGIN`, the statement and `COMMIT` in one round trip. A
/// failed statement aborts the transaction, and the `COMMIT` rolls back.
async fn short_transaction(
    store: &PgStore,
    sql: Sql<'_>,
    params: &[&(dyn ToSql + Sync)],
    wait: Duration,
) -> Result<Vec<Row>, StoreError> {
    let mut conn = store.conn().await?;
    let deadline = tokio::time::Instant::now() + wait + GRACE;
    let statement = match bounded(deadline, async {
        conn.prepare_sql(sql).await.map_err(map_error)
    })
    .await
    {
        Ok(statement) => statement,
        Err(e) => {
            conn.mark_dirty();
            return Err(e);
        }
    };
    let begin = format!(
        "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL lock_timeout = '{}ms'",
        millis(wait)
    );
    conn.mark_dirty();
    let ran = tokio::time::timeout_at(deadline, async {
        tokio::try_join!(
            biased;
            conn.batch_execute(&begin),
            conn.query_prepared(&statement, params),
            conn.batch_execute("COMMIT"),
        )
    })
    .await;
    match ran {
        // Cut off mid-statement: `conn` stays dirty and is closed;
        // PostgreSQL rolls back.
        Err(_) => Err(timed_out()),
        Ok(Ok((_, rows, _))) => {
            conn.mark_clean();
            Ok(rows)
        }
        Ok(Err(e)) => {
            let e = map_error(e);
            if e.kind() != StoreErrorKind::Unavailable {
                let _ = rollback(conn).await;
            }
            Err(e)
        }
    }
}

/// [`short_transaction`] for a statement that returns no rows: how many it changed.
async fn short_execute(
    store: &PgStore,
    sql: Sql<'_>,
    params: &[&(dyn ToSql + Sync)],
) -> Result<u64, StoreError> {
    // `RETURNING 1` makes the changed rows countable through `query`.
    let text = format!("{} RETURNING 1", sql.text());
    let rows = short_transaction(store, sql.with_text(&text), params, ROW_WAIT).await?;
    Ok(rows.len() as u64)
}

/// Reads at most one row, without a transaction, by `deadline`.
async fn read_one(
    store: &PgStore,
    deadline: tokio::time::Instant,
    sql: Sql<'_>,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Option<Row>, StoreError> {
    bounded(deadline, async {
        let mut conn = store.conn().await?;
        // Until the answer is in, a cut-off statement would leave the
        // connection busy: it is closed rather than returned.
        conn.mark_dirty();
        let row = conn.query_opt_sql(sql, params).await.map_err(map_error)?;
        conn.mark_clean();
        Ok(row)
    })
    .await
}

/// Ends a transaction whose outcome does not matter; the connection goes
/// back to the pool only if that worked.
async fn rollback(mut conn: Conn) -> Result<(), StoreError> {
    conn.batch_execute("ROLLBACK").await.map_err(map_error)?;
    conn.mark_clean();
    Ok(())
}

async fn bounded<T>(
    deadline: tokio::time::Instant,
    work: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout_at(deadline, work)
        .await
        .unwrap_or_else(|_| Err(timed_out()))
}

fn key_columns<'a>(scope: &'a Scope, key: &'a IdempotencyKey) -> (&'a str, &'a str, &'a str) {
    (scope.tenant().as_str(), scope.endpoint(), key.as_str())
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

pub(crate) fn parse_id(id: &str) -> Result<OperationId, StoreError> {
    id.parse()
        .map_err(|_| corrupt("stored record has an invalid operation id"))
}

/// PostgreSQL takes at most `i32::MAX` milliseconds; `0` would mean "no limit".
fn millis(d: Duration) -> u128 {
    d.as_millis().clamp(1, i32::MAX as u128)
}

fn timed_out() -> StoreError {
    StoreError::new(
        StoreErrorKind::Unavailable,
        "the database did not answer in time",
    )
}

fn corrupt(message: &str) -> StoreError {
    StoreError::new(StoreErrorKind::Corrupt, message)
}
