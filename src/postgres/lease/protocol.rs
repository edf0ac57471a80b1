//! The long-running mode's statements: acquire (insert or take over),
//! heartbeat, the fenced transaction, finish, release, the status lookup
//! and recovery. Each decision is one statement on the key's row, guarded
//! by the attempt token; none reads and then writes.

use std::time::Duration;

use tokio_postgres::{error::SqlState, types::ToSql, Row};

use super::statements::{
    ACQUIRE_SQL, FAIL_SQL, FINISH_SQL, HEARTBEAT_SQL, HOLD_SQL, LOOKUP_SQL, OPERATION_SQL,
    RECOVER_SQL, RELEASE_SQL,
};
use super::PgLease;
use crate::protocol::lease::{
    acquired, attempt_of, fenced, operation_state, recovered, running, stored_response, RecoverRow,
};
use crate::protocol::{errors::ends_only_the_statement, statements::BEGIN};
use crate::{
    fingerprint::Fingerprint,
    key::IdempotencyKey,
    metrics::FencedAt,
    postgres::{conn::Conn, decode, error::map_error, statements::Sql, PgStore, PgTx},
    protocol::waits::{GRACE, MIN_WAIT, ROW_WAIT},
    record::StoredResponse,
    scope::{Scope, TenantId},
    store::OperationId,
    store::{
        Acquired, Backoff, ClaimRequest, LeaseRequest, Operation, Recovered, StoreError,
        StoreErrorKind,
    },
};

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
        let columns = (row.get(0), row.get(1), row.get(2));
        let owned = acquired(claim, request, columns, |id| {
            PgLease::new(store.clone(), id)
        })?;
        return Ok(Acquired::Owned(owned));
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
    let fingerprint = Fingerprint::from_slice(row.get(0))
        .ok_or_else(|| corrupt("stored record has an invalid fingerprint"))?;
    running(claim, fingerprint, row.get(6), row.get(7))
}

/// [`LeaseStore::heartbeat`](crate::store::LeaseStore::heartbeat).
pub(in crate::postgres) async fn heartbeat(
    lease: &PgLease,
    extend: Duration,
) -> Result<(), StoreError> {
    let (tenant, endpoint, key, token) = lease.identity().columns();
    let extend = extend.as_secs_f64();
    let retention = lease.identity().retention().as_secs_f64();
    let params: [&(dyn ToSql + Sync); 6] = [&tenant, &endpoint, &key, &token, &extend, &retention];
    guarded(lease, HEARTBEAT_SQL, &params).await
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
    let (tenant, endpoint, key, token) = lease.identity().columns();
    let params: [&(dyn ToSql + Sync); 4] = [&tenant, &endpoint, &key, &token];
    // While the row is held, the owner's own heartbeats wait too. So no
    // lock wait in the transaction may outlast half a lease (the rest of
    // the lease is the margin for the next heartbeat), and should the
    // owner's process stall with the row held, PostgreSQL ends the
    // transaction once it idles for a lease: takeovers are not blocked for
    // longer than the lease they wait for anyway.
    let begin = format!(
        "{BEGIN}; \
         SET LOCAL lock_timeout = '{}ms'; \
         SET LOCAL idle_in_transaction_session_timeout = '{}ms'",
        millis(ROW_WAIT.min(lease.identity().lease() / 2)),
        millis(lease.identity().lease()),
    );
    conn.mark_dirty();
    let held = tokio::time::timeout(ROW_WAIT + GRACE, async {
        tokio::try_join!(
            biased;
            conn.batch_pipelined(&begin),
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
        return Err(fenced());
    };
    let xid: String = row.get(0);
    let id = lease.identity();
    Ok(PgTx::fenced(
        conn,
        id.scope().clone(),
        id.key().clone(),
        token,
        xid,
        id.retention(),
    ))
}

/// [`LeaseStore::finish`](crate::store::LeaseStore::finish).
pub(in crate::postgres) async fn finish(
    lease: &PgLease,
    response: &StoredResponse,
) -> Result<(), StoreError> {
    let resource = response.resource_id.as_ref().map(|id| id.as_str());
    end_with(lease, FINISH_SQL, response, &resource).await
}

/// [`LeaseStore::release`](crate::store::LeaseStore::release).
pub(in crate::postgres) async fn release(lease: &PgLease) -> Result<(), StoreError> {
    let (tenant, endpoint, key, token) = lease.identity().columns();
    let params: [&(dyn ToSql + Sync); 4] = [&tenant, &endpoint, &key, &token];
    guarded(lease, RELEASE_SQL, &params).await
}

/// [`LeaseStore::fail`](crate::store::LeaseStore::fail).
pub(in crate::postgres) async fn fail(
    lease: &PgLease,
    response: &StoredResponse,
    attempts: u32,
) -> Result<(), StoreError> {
    let attempts = i32::try_from(attempts).unwrap_or(i32::MAX);
    end_with(lease, FAIL_SQL, response, &attempts).await
}

/// Finish or fail: the record ends with `response` (and `last`, the
/// statement's own parameter), if the token is still the record's.
async fn end_with(
    lease: &PgLease,
    sql: Sql<'static>,
    response: &StoredResponse,
    last: &(dyn ToSql + Sync),
) -> Result<(), StoreError> {
    let (tenant, endpoint, key, token) = lease.identity().columns();
    let status = response.status.as_u16() as i16;
    let headers = response.encode_headers();
    let body: &[u8] = &response.body;
    let retention = lease.identity().retention().as_secs_f64();
    let params: [&(dyn ToSql + Sync); 9] = [
        &tenant, &endpoint, &key, &token, &status, &headers, &body, &retention, last,
    ];
    guarded(lease, sql, &params).await
}

/// Runs a statement guarded by the lease's token; no row changed: fenced.
async fn guarded(
    lease: &PgLease,
    sql: Sql<'static>,
    params: &[&(dyn ToSql + Sync)],
) -> Result<(), StoreError> {
    if short_execute(lease.store(), sql, params).await? == 0 {
        lease.mark_fenced(None);
        return Err(fenced());
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
    let state = operation_state(state, || {
        stored_response(row.get(1), row.get(2), row.get(3), row.get(4))
    })?;
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
    let kept = retention.as_secs_f64();
    let params: [&(dyn ToSql + Sync); 5] = [&endpoint, &seconds, &first, &max, &kept];
    let rows = short_transaction(store, RECOVER_SQL, &params, ROW_WAIT).await?;
    let Some(row) = rows.first() else {
        return Ok(None);
    };
    let row = RecoverRow {
        tenant: row.get(0),
        key: row.get(1),
        token: row.get(2),
        operation_id: row.get(3),
        method: row.get(4),
        target: row.get(5),
        headers: row.get(6),
        body: row.get(7),
        attempts: row.get(8),
    };
    let recovered = recovered(row, endpoint, lease, retention, |id| {
        PgLease::new(store.clone(), id)
    })?;
    Ok(Some(recovered))
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
    let begin = format!("{BEGIN}; SET LOCAL lock_timeout = '{}ms'", millis(wait));
    conn.mark_dirty();
    let ran = tokio::time::timeout_at(deadline, async {
        tokio::try_join!(
            biased;
            conn.batch_pipelined(&begin),
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
            if e.kind() != StoreErrorKind::Unavailable
                || e.sql_state().is_some_and(ends_only_the_statement)
            {
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
