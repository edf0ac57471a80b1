//! [`PgStore`]: keys arbitrated by a PostgreSQL primary key, responses
//! committed in the handler's own transaction.
//!
//! The protocol, per request:
//!
//! 1. A plain indexed read finds a completed, unexpired record: replay it
//!    (no transaction, no write, no lock).
//! 2. Otherwise, in one round trip: `BEGIN`, `lock_timeout` for the wait,
//!    `INSERT … ON CONFLICT ON CONSTRAINT idempotency_requests_pkey DO UPDATE
//!    … WHERE expired RETURNING attempt_token`, and `lock_timeout` back to the
//!    session's default for the handler. A returned row means this
//!    request owns the key (new, or an expired record taken over). If another
//!    transaction holds the key, the insert waits on it; `55P03` after the wait
//!    means in progress. No row means a record committed meanwhile: read it in
//!    the same transaction and roll back.
//! 3. The handler writes through [`PgTx`].
//! 4. In one round trip: `UPDATE` the row with the response and `COMMIT`.
//!
//! No `SELECT` decides ownership: the unique index does.

use std::{fmt, str::FromStr, time::Duration};

use bytes::Bytes;
use deadpool_postgres::{
    Manager, ManagerConfig, Object, Pool, PoolError, RecyclingMethod, Runtime,
};
use http::StatusCode;
use tokio_postgres::{error::SqlState, NoTls, Row};

use super::{Claim, ClaimRequest, Store, StoreError, StoreErrorKind};
use crate::{
    fingerprint::Fingerprint,
    record::{Record, StoredResponse},
};

mod migrations;
mod tx;

pub use tx::{PgTx, TxError, TxErrorKind};

const LOOKUP: &str =
    "SELECT request_fingerprint, state, response_status, response_headers, response_body \
     FROM idempotency_requests \
     WHERE tenant_id = $1 AND endpoint = $2 AND idempotency_key = $3 AND expires_at > now()";

const CLAIM: &str = "INSERT INTO idempotency_requests AS r \
         (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at) \
     VALUES ($1, $2, $3, $4, 'in_progress', now() + make_interval(secs => $5)) \
     ON CONFLICT ON CONSTRAINT idempotency_requests_pkey DO UPDATE SET \
         request_fingerprint = EXCLUDED.request_fingerprint, state = 'in_progress', \
         attempt_token = r.attempt_token + 1, response_status = NULL, response_headers = NULL, \
         response_body = NULL, created_at = now(), completed_at = NULL, expires_at = EXCLUDED.expires_at \
     WHERE r.expires_at <= now() \
     RETURNING attempt_token";

// The COMMIT is pipelined behind this statement, so it must fail (aborting
// the transaction) rather than match no row: the handler's writes must never
// commit without the remembered response. Division by zero does that.
const COMPLETE: &str = "WITH done AS ( \
         UPDATE idempotency_requests SET state = 'completed', response_status = $5, \
             response_headers = $6, response_body = $7, completed_at = now() \
         WHERE tenant_id = $1 AND endpoint = $2 AND idempotency_key = $3 AND attempt_token = $4 \
             AND state = 'in_progress' \
         RETURNING 1) \
     SELECT 1 / (SELECT count(*)::int FROM done)";

/// The PostgreSQL [`Store`].
///
/// Cheap to clone (a pool handle). Create it with [`PgStore::connect`] or
/// [`PgStore::builder`], then run [`PgStore::migrate`] once at start-up (safe
/// from many processes at once).
///
/// ```no_run
/// # async fn run() -> Result<(), tower_idempotency::StoreError> {
/// use tower_idempotency::PgStore;
///
/// let store = PgStore::connect("postgres://app@localhost/app")?;
/// store.migrate().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PgStore {
    pool: Pool,
}

impl fmt::Debug for PgStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let status = self.pool.status();
        f.debug_struct("PgStore")
            .field("max_connections", &status.max_size)
            .field("connections", &status.size)
            .finish()
    }
}

/// Builds a [`PgStore`] with pool settings.
#[derive(Debug, Clone)]
pub struct PgStoreBuilder {
    config: tokio_postgres::Config,
    max_connections: usize,
    acquire_timeout: Duration,
    connect_timeout: Duration,
}

impl PgStoreBuilder {
    /// The most connections the store's pool opens (default 16). Requests
    /// beyond it wait up to the acquire timeout.
    pub fn max_connections(mut self, n: usize) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// How long a request waits for a pooled connection before the layer
    /// answers `503 store_unavailable` (default 5 s).
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// How long opening a new connection may take (default 5 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Creates the store; connections are opened lazily.
    pub fn build(mut self) -> Result<PgStore, StoreError> {
        self.config.connect_timeout(self.connect_timeout);
        let manager = Manager::from_config(
            self.config,
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(self.max_connections)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(self.acquire_timeout))
            .create_timeout(Some(self.connect_timeout))
            .recycle_timeout(Some(self.connect_timeout))
            .build()
            .map_err(|e| {
                StoreError::new(StoreErrorKind::Backend, "cannot build the connection pool")
                    .with_source(e)
            })?;
        Ok(PgStore { pool })
    }
}

impl PgStore {
    /// A builder from a parsed configuration.
    pub fn builder(config: tokio_postgres::Config) -> PgStoreBuilder {
        PgStoreBuilder {
            config,
            max_connections: 16,
            acquire_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
        }
    }

    /// A store for a connection string (`postgres://…` or `host=… user=…`)
    /// with default pool settings.
    pub fn connect(conninfo: &str) -> Result<PgStore, StoreError> {
        let config = tokio_postgres::Config::from_str(conninfo).map_err(|e| {
            StoreError::new(StoreErrorKind::Backend, "invalid connection string").with_source(e)
        })?;
        Self::builder(config).build()
    }

    /// Creates or upgrades the schema (`idempotency_requests`). Idempotent;
    /// concurrent callers serialise on an advisory lock.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let conn = self.conn().await?;
        let result = migrations::run(&conn).await;
        if result.is_err() {
            drop(Object::take(conn));
        }
        result
    }

    /// A pooled connection for the application's own queries outside the
    /// layer (reads, health checks, its own migrations).
    pub async fn client(&self) -> Result<PooledClient, StoreError> {
        Ok(PooledClient(self.conn().await?))
    }

    async fn conn(&self) -> Result<Object, StoreError> {
        self.pool.get().await.map_err(|e| {
            let message = match &e {
                PoolError::Timeout(_) => "timed out waiting for a pooled connection",
                PoolError::Closed => "the connection pool is closed",
                _ => "cannot open a database connection",
            };
            StoreError::new(StoreErrorKind::Unavailable, message).with_source(e)
        })
    }

    async fn lookup(conn: &Object, request: &ClaimRequest) -> Result<Option<Row>, StoreError> {
        let statement = conn.prepare_cached(LOOKUP).await.map_err(map_error)?;
        conn.query_opt(
            &statement,
            &[
                &request.scope.tenant().as_str(),
                &request.scope.endpoint(),
                &request.key.as_str(),
            ],
        )
        .await
        .map_err(map_error)
    }

    async fn try_claim(conn: &Object, request: &ClaimRequest) -> Result<Option<i64>, StoreError> {
        let (set_wait, claim) = tokio::try_join!(
            conn.prepare_cached("SELECT set_config('lock_timeout', $1, true)"),
            conn.prepare_cached(CLAIM),
        )
        .map_err(map_error)?;
        // lock_timeout = 0 would mean "wait forever".
        let wait = format!("{}ms", request.wait.as_millis().max(1));
        let retention = request.retention.as_secs_f64();
        let fingerprint = request.fingerprint.as_bytes().as_slice();
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] = [
            &request.scope.tenant().as_str(),
            &request.scope.endpoint(),
            &request.key.as_str(),
            &fingerprint,
            &retention,
        ];
        // One round trip: the requests are pipelined. The wait limit is for
        // the claim alone; the handler's statements run under the session's
        // own lock_timeout again.
        let wait_param: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&wait];
        let (_, _, claimed, _) = tokio::try_join!(
            conn.batch_execute("BEGIN"),
            conn.query_one(&set_wait, &wait_param),
            conn.query_opt(&claim, &params),
            conn.batch_execute("SET LOCAL lock_timeout TO DEFAULT"),
        )
        .map_err(map_error)?;
        Ok(claimed.map(|row| row.get(0)))
    }
}

impl Store for PgStore {
    type Tx = PgTx;

    async fn claim(&self, request: &ClaimRequest) -> Result<Claim<PgTx>, StoreError> {
        let conn = self.conn().await?;
        if let Some(row) = Self::lookup(&conn, request).await? {
            if let Some(record) = decode_record(&row)? {
                return Ok(Claim::Completed(record));
            }
        }
        match Self::try_claim(&conn, request).await {
            Ok(Some(token)) => Ok(Claim::Owned(PgTx::new(
                conn,
                request.scope.clone(),
                request.key.clone(),
                token,
            ))),
            Ok(None) => {
                // Committed by another owner while we waited: read it with a
                // fresh snapshot (READ COMMITTED), then let go.
                let statement = conn.prepare_cached(LOOKUP).await;
                let read = match &statement {
                    Ok(statement) => {
                        let (tenant, endpoint, key) = (
                            request.scope.tenant().as_str(),
                            request.scope.endpoint(),
                            request.key.as_str(),
                        );
                        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
                            [&tenant, &endpoint, &key];
                        let (row, rollback) = tokio::join!(
                            conn.query_opt(statement, &params),
                            conn.batch_execute("ROLLBACK"),
                        );
                        rollback.map_err(map_error).and(row.map_err(map_error))
                    }
                    Err(_) => Err(rollback_and_discard(conn).await),
                };
                let record = match read? {
                    Some(row) => decode_record(&row)?,
                    None => None,
                };
                Ok(record.map_or(Claim::InProgress, Claim::Completed))
            }
            Err(e) if e.kind() == StoreErrorKind::Unavailable => {
                drop(Object::take(conn));
                Err(e)
            }
            Err(e) => {
                let lock_timeout = e.sql_state() == Some(SqlState::LOCK_NOT_AVAILABLE.code());
                if conn.batch_execute("ROLLBACK").await.is_err() {
                    drop(Object::take(conn));
                }
                if lock_timeout {
                    Ok(Claim::InProgress)
                } else {
                    Err(e)
                }
            }
        }
    }

    async fn complete(&self, tx: PgTx, response: &StoredResponse) -> Result<(), StoreError> {
        let Some(conn) = tx.take().await else {
            return Err(StoreError::new(
                StoreErrorKind::TransactionAborted,
                "the transaction has already finished",
            ));
        };
        let statement = match conn.prepare_cached(COMPLETE).await {
            Ok(statement) => statement,
            Err(e) => {
                let _ = conn.batch_execute("ROLLBACK").await;
                return Err(map_error(e));
            }
        };
        let status = response.status.as_u16() as i16;
        let headers = response.encode_headers();
        let body: &[u8] = &response.body;
        let scope = tx.scope();
        let token = tx.attempt_token();
        let (tenant, endpoint, key) =
            (scope.tenant().as_str(), scope.endpoint(), tx.key().as_str());
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 7] =
            [&tenant, &endpoint, &key, &token, &status, &headers, &body];
        let (updated, committed) = tokio::join!(
            conn.query_one(&statement, &params),
            conn.batch_execute("COMMIT"),
        );
        match (updated, committed) {
            (Ok(_), Ok(())) => Ok(()),
            // The update failed, so the pipelined COMMIT rolled back.
            (Err(e), _) => {
                let error = map_error(e);
                let error = if error.kind() == StoreErrorKind::Unavailable {
                    error
                } else {
                    StoreError::new(
                        StoreErrorKind::TransactionAborted,
                        "the transaction was rolled back",
                    )
                    .with_source(error)
                };
                if conn.is_closed() {
                    drop(Object::take(conn));
                }
                Err(error)
            }
            (Ok(_), Err(e)) => {
                drop(Object::take(conn));
                Err(map_error(e))
            }
        }
    }

    async fn abort(&self, tx: PgTx) -> Result<(), StoreError> {
        let Some(conn) = tx.take().await else {
            return Ok(());
        };
        match conn.batch_execute("ROLLBACK").await {
            Ok(()) => Ok(()),
            Err(e) => {
                // The server rolls back when the connection closes.
                drop(Object::take(conn));
                Err(map_error(e))
            }
        }
    }
}

async fn rollback_and_discard(conn: Object) -> StoreError {
    let _ = conn.batch_execute("ROLLBACK").await;
    drop(Object::take(conn));
    StoreError::new(
        StoreErrorKind::Unavailable,
        "cannot prepare the lookup statement",
    )
}

/// `None` for a row that is not completed (a committed in-progress row).
fn decode_record(row: &Row) -> Result<Option<Record>, StoreError> {
    let corrupt = |what: &str| {
        StoreError::new(
            StoreErrorKind::Corrupt,
            format!("stored record has an invalid {what}"),
        )
    };
    let state: &str = row.try_get(1).map_err(|_| corrupt("state"))?;
    if state != "completed" {
        return Ok(None);
    }
    let fingerprint: &[u8] = row.try_get(0).map_err(|_| corrupt("fingerprint"))?;
    let status: i16 = row.try_get(2).map_err(|_| corrupt("status"))?;
    let headers: &[u8] = row.try_get(3).map_err(|_| corrupt("header block"))?;
    let body: &[u8] = row.try_get(4).map_err(|_| corrupt("body"))?;
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
        },
    }))
}

/// Sorts driver errors into the store's stable kinds.
fn map_error(e: tokio_postgres::Error) -> StoreError {
    let kind = match e.code() {
        None => StoreErrorKind::Unavailable,
        Some(code) if *code == SqlState::UNDEFINED_TABLE || *code == SqlState::UNDEFINED_COLUMN => {
            StoreErrorKind::Schema
        }
        Some(code)
            if *code == SqlState::IN_FAILED_SQL_TRANSACTION
                || *code == SqlState::T_R_SERIALIZATION_FAILURE
                || *code == SqlState::T_R_DEADLOCK_DETECTED
                || *code == SqlState::DIVISION_BY_ZERO =>
        {
            StoreErrorKind::TransactionAborted
        }
        Some(code)
            if code.code().starts_with("08")
                || code.code().starts_with("57P")
                || *code == SqlState::TOO_MANY_CONNECTIONS
                || *code == SqlState::QUERY_CANCELED =>
        {
            StoreErrorKind::Unavailable
        }
        Some(_) => StoreErrorKind::Backend,
    };
    let code = e.code().map(|c| c.code().to_owned());
    // The server's message names the failure without row values (those are
    // in the detail, which stays out of logs).
    let message = match e.as_db_error() {
        Some(db) => format!("database error {}: {}", db.code().code(), db.message()),
        None if e.is_closed() => "the database connection is closed".to_owned(),
        None => "cannot talk to the database".to_owned(),
    };
    StoreError::new(kind, message)
        .with_sql_state(code)
        .with_source(e)
}

/// A pooled connection from [`PgStore::client`]; dereferences to a
/// `tokio_postgres::Client` and returns to the pool on drop.
pub struct PooledClient(Object);

impl PooledClient {
    /// Prepares a statement, reusing this connection's cached one.
    pub async fn prepare_cached(
        &self,
        sql: &str,
    ) -> Result<tokio_postgres::Statement, tokio_postgres::Error> {
        self.0.prepare_cached(sql).await
    }
}

impl std::ops::Deref for PooledClient {
    type Target = tokio_postgres::Client;
    fn deref(&self) -> &tokio_postgres::Client {
        &self.0
    }
}

impl fmt::Debug for PooledClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PooledClient").finish_non_exhaustive()
    }
}
