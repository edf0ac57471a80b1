//! [`PgStore`]: keys arbitrated by a PostgreSQL primary key, responses
//! committed in the handler's own transaction.
//!
//! The protocol, per request:
//!
//! 1. A plain indexed read finds a completed, unexpired record: replay it
//!    (no transaction, no write, no lock).
//! 2. Otherwise, in one round trip: `BEGIN ISOLATION LEVEL READ COMMITTED`
//!    (the "not owned" read below needs a fresh snapshot) with `lock_timeout`
//!    set to the wait, and `INSERT … ON CONFLICT ON CONSTRAINT
//!    idempotency_requests_pkey DO UPDATE … WHERE expired RETURNING
//!    attempt_token, (the session's lock_timeout restored for the handler)`. A returned row means this
//!    request owns the key (new, or an expired record taken over). If another
//!    transaction holds the key, the insert waits on it; `55P03` after the wait
//!    means in progress. No row means a record committed meanwhile: read it in
//!    the same transaction and roll back.
//! 3. The handler writes through [`PgTx`].
//! 4. In one round trip: `UPDATE` the row with the response (its retention
//!    counts from now, the completion), `COMMIT`, and a session reset. The
//!    `UPDATE` matches only the row this transaction claimed (attempt token
//!    and transaction id), and fails otherwise, so the pipelined `COMMIT`
//!    rolls back; an `UPDATE` that cannot even be sent keeps the `COMMIT`
//!    from being sent.
//!
//! One deadline (the request's wait) bounds steps 1 and 2: lock waits by
//! `lock_timeout`, everything else (a slow server, a lost network) by the
//! client, which then closes the connection.
//!
//! Every pooled connection that may be inside a transaction is held in a
//! guard that closes it, rather than returning it to the pool, if it is
//! dropped before `COMMIT`/`ROLLBACK` was acknowledged (a cancelled future, a
//! panic): PostgreSQL then rolls back. A connection goes back to the pool
//! only in a known state: after the owner's `COMMIT`/`ROLLBACK` its session
//! is reset, and a connection lent to the application is rolled back and
//! reset when it is returned.
//!
//! No `SELECT` decides ownership: the unique index does.

use std::{fmt, str::FromStr, time::Duration};

use bytes::Bytes;
use deadpool_postgres::{
    Manager, ManagerConfig, Object, Pool, PoolError, RecyclingMethod, Runtime,
};
use http::StatusCode;
use tokio_postgres::{error::SqlState, types::ToSql, NoTls, Row};

use super::{Claim, ClaimRequest, Store, StoreError, StoreErrorKind};
use crate::{
    fingerprint::Fingerprint,
    record::{Record, StoredResponse},
};

mod admin;
mod migrations;
mod sql;
mod tx;

pub use admin::{KeyRecord, KeyState};
pub use tx::{PgTx, TxError, TxErrorKind};

// Parameters carry explicit casts so their types are fixed by the SQL text:
// binding can then never fail on the client after an earlier pipelined
// statement was already sent.
const LOOKUP: &str = "SELECT request_fingerprint, state, response_status, response_headers, response_body \
     FROM idempotency_requests \
     WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text AND expires_at > now()";

// The claim. Its transaction was begun by `claim_begin`, which set the wait
// limit; RETURNING runs once we own the key and puts lock_timeout back to the
// session's default for the handler (`set_config` with NULL is `SET LOCAL …
// TO DEFAULT`: the value from the server, database, role or connection
// options).
//
// ON CONFLICT waits for the transaction holding the key's row, so the WHERE
// sees a committed row: an expired record, or an `in_progress` row whose
// transaction is over without completing it (an owner in this mode only ever
// commits `completed`, so such a row is an orphan: a crash of an older
// version, a manual edit). Both are taken over as a new attempt.
const CLAIM: &str = "INSERT INTO idempotency_requests AS r \
         (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at) \
     VALUES ($1::text, $2::text, $3::text, $4::bytea, 'in_progress', now() + make_interval(secs => $5::float8)) \
     ON CONFLICT ON CONSTRAINT idempotency_requests_pkey DO UPDATE SET \
         request_fingerprint = EXCLUDED.request_fingerprint, state = 'in_progress', \
         attempt_token = r.attempt_token + 1, response_status = NULL, response_headers = NULL, \
         response_body = NULL, created_at = now(), completed_at = NULL, expires_at = EXCLUDED.expires_at \
     WHERE r.expires_at <= now() OR r.state = 'in_progress' \
     RETURNING attempt_token, pg_current_xact_id()::text, set_config('lock_timeout', NULL, true)";

// The COMMIT is pipelined behind this statement, so it must fail (aborting
// the transaction) rather than match no row: the handler's writes must never
// commit without the remembered response. Division by zero does that. The
// transaction id check catches a handler that ended the claim's transaction.
// Retention counts from the completion (one timestamp for both columns).
const COMPLETE: &str = "WITH done AS ( \
         UPDATE idempotency_requests SET state = 'completed', response_status = $5::int2, \
             response_headers = $6::bytea, response_body = $7::bytea, completed_at = statement_timestamp(), \
             expires_at = statement_timestamp() + make_interval(secs => $8::float8) \
         WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text \
             AND attempt_token = $4::int8 AND state = 'in_progress' \
             AND pg_current_xact_id() = $9::text::xid8 \
         RETURNING 1) \
     SELECT 1 / (SELECT count(*)::int FROM done)";

// What a request may have left on its session that would outlive it on a
// pooled connection, undone before anyone else gets the connection: what
// `DISCARD ALL` does except dropping prepared statements (the pool's cached
// statements live on). Sent pipelined behind the COMMIT or ROLLBACK, in a
// message of its own so that its outcome never blurs the commit's.
// `PgTx` refuses the plain ways to change the session; this catches the
// hidden ones (a function calling `set_config(…, false)` or taking a session
// advisory lock).
const SESSION_RESET: &str = "SET SESSION AUTHORIZATION DEFAULT; RESET ALL; CLOSE ALL; UNLISTEN *; \
     SELECT pg_advisory_unlock_all(); DISCARD TEMP";

/// A pooled connection that may be inside a transaction.
///
/// Dropped while a transaction may be open (a cancelled future, a panic), it
/// closes the connection instead of returning it to the pool; PostgreSQL then
/// rolls the transaction back. Nothing else can put an open transaction back
/// into the pool.
pub(crate) struct Conn {
    object: Option<Object>,
    in_transaction: bool,
}

impl Conn {
    fn new(object: Object) -> Self {
        Conn {
            object: Some(object),
            in_transaction: false,
        }
    }

    /// Call before sending `BEGIN`.
    pub(crate) fn begin(&mut self) {
        self.in_transaction = true;
    }

    /// The connection is in an unknown state (a statement still running on
    /// it): close it on drop instead of returning it.
    pub(crate) fn discard(&mut self) {
        self.in_transaction = true;
    }

    /// Call once `COMMIT` or `ROLLBACK` was acknowledged.
    pub(crate) fn ended(&mut self) {
        self.in_transaction = false;
    }
}

impl std::ops::Deref for Conn {
    type Target = Object;
    fn deref(&self) -> &Object {
        // Only `Drop` takes the object out.
        self.object
            .as_ref()
            .expect("a Conn holds its object until dropped")
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let Some(object) = self.object.take() {
            if self.in_transaction || object.is_closed() {
                drop(Object::take(object));
            }
        }
    }
}

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
    config: std::sync::Arc<tokio_postgres::Config>,
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
    keepalive_idle: Duration,
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

    /// How long a pooled connection may be silent before TCP keepalive
    /// probes check that the server is still there (default 15 s; probes
    /// every 5 s, 3 of them). A database host that vanished without closing
    /// its sockets is then noticed in about 30 s instead of hours, and a
    /// request waiting on it gets an error instead of hanging. Replaces the
    /// connection configuration's keepalive settings; no effect on Unix
    /// sockets.
    pub fn keepalive_idle(mut self, idle: Duration) -> Self {
        self.keepalive_idle = idle;
        self
    }

    /// Creates the store; connections are opened lazily.
    pub fn build(mut self) -> Result<PgStore, StoreError> {
        self.config
            .connect_timeout(self.connect_timeout)
            .keepalives(true)
            .keepalives_idle(self.keepalive_idle)
            .keepalives_interval(Duration::from_secs(5))
            .keepalives_retries(3);
        let config = std::sync::Arc::new(self.config.clone());
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
        Ok(PgStore { pool, config })
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
            keepalive_idle: Duration::from_secs(15),
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
        let mut conn = self.conn().await?;
        conn.begin();
        migrations::run(&conn).await?;
        conn.ended();
        Ok(())
    }

    /// A pooled connection for the application's own queries outside the
    /// layer (reads, health checks, its own migrations).
    ///
    /// Whatever the application leaves on it (a transaction it never ended,
    /// one that failed, a session setting) is undone before the connection
    /// serves anyone else; see [`PooledClient`].
    pub async fn client(&self) -> Result<PooledClient, StoreError> {
        let mut conn = self.conn().await?;
        // Unknown until the reset on drop proves otherwise.
        conn.discard();
        Ok(PooledClient(Some(conn)))
    }

    /// Opens a dedicated connection outside the pool (e.g. for `LISTEN`).
    pub(crate) async fn dedicated(
        &self,
    ) -> Result<
        (
            tokio_postgres::Client,
            tokio_postgres::Connection<tokio_postgres::Socket, tokio_postgres::tls::NoTlsStream>,
        ),
        StoreError,
    > {
        self.config.connect(NoTls).await.map_err(map_error)
    }

    pub(crate) async fn conn(&self) -> Result<Conn, StoreError> {
        self.pool.get().await.map(Conn::new).map_err(|e| {
            let message = match &e {
                PoolError::Timeout(_) => "timed out waiting for a pooled connection",
                PoolError::Closed => "the connection pool is closed",
                _ => "cannot open a database connection",
            };
            StoreError::new(StoreErrorKind::Unavailable, message).with_source(e)
        })
    }

    /// Reads the record of `request`'s key, if any (READ COMMITTED: a fresh snapshot).
    async fn lookup(conn: &Conn, request: &ClaimRequest) -> Result<Option<Row>, StoreError> {
        let statement = conn.prepare_cached(LOOKUP).await.map_err(map_error)?;
        let (tenant, endpoint, key) = key_columns(request);
        conn.query_opt(&statement, &[&tenant, &endpoint, &key])
            .await
            .map_err(map_error)
    }

    /// Begins and claims in one round trip: `Some((token, xid))` if we own the key.
    async fn try_claim(
        conn: &mut Conn,
        claim: &tokio_postgres::Statement,
        request: &ClaimRequest,
        wait: Duration,
    ) -> Result<Option<(i64, String)>, StoreError> {
        let retention = request.retention.as_secs_f64();
        let fingerprint = request.fingerprint.as_bytes().as_slice();
        let (tenant, endpoint, key) = key_columns(request);
        let params: [&(dyn ToSql + Sync); 5] = [&tenant, &endpoint, &key, &fingerprint, &retention];
        let begin = claim_begin(wait, request.hold_limit);
        conn.begin();
        // One round trip: the begin batch and the claim are pipelined, in this order.
        let (_, claimed) = tokio::try_join!(
            biased;
            conn.batch_execute(&begin),
            conn.query_opt(claim, &params),
        )
        .map_err(map_error)?;
        Ok(claimed.map(|row| (row.get(0), row.get(1))))
    }

    /// Rolls back; the connection goes back to the pool only if that worked.
    async fn rollback(mut conn: Conn) -> Result<(), StoreError> {
        conn.batch_execute("ROLLBACK").await.map_err(map_error)?;
        conn.ended();
        Ok(())
    }
}

/// Begins the claim's transaction: READ COMMITTED (the "not owned" read needs
/// a fresh snapshot), the wait limit for every lock the claim may wait on
/// (including the table lock the INSERT takes first), an `application_name`
/// tag that `Cleanup` finds in `pg_stat_activity`, and, with a hold limit,
/// `idle_in_transaction_session_timeout`: should the owner's process freeze
/// or lose its network between two statements, the server ends the session
/// and frees the key by itself. The values are numbers we format, never
/// client data; `0` would mean "no limit", and PostgreSQL takes at most
/// `i32::MAX` milliseconds.
fn claim_begin(wait: Duration, hold_limit: Option<Duration>) -> String {
    let ms = |d: Duration| d.as_millis().clamp(1, i32::MAX as u128);
    let wait_ms = ms(wait);
    let hold = hold_limit.map_or(String::new(), |limit| {
        format!(
            "; SET LOCAL idle_in_transaction_session_timeout = '{}ms'",
            ms(limit)
        )
    });
    // Utility statements only: no planning, one message.
    format!(
        "BEGIN ISOLATION LEVEL READ COMMITTED; \
         SET LOCAL lock_timeout = '{wait_ms}ms'; \
         SET LOCAL application_name = 'tower-idempotency'{hold}"
    )
}

/// How much longer than its wait a claim may take before the store gives up
/// on the database: room for the server to report its own lock timeout.
const CLAIM_GRACE: Duration = Duration::from_millis(250);

/// The shortest wait a claim gets: a request that spent its wait elsewhere
/// (behind a duplicate in this process) still gets to read the record.
const MIN_WAIT: Duration = Duration::from_millis(100);

/// How long a `ROLLBACK` may queue behind a statement still running on the
/// connection (a handler cut off at its deadline) before that statement is
/// cancelled, and how long the cancelled statement then has to end.
const ROLLBACK_PATIENCE: Duration = Duration::from_millis(500);
const CANCEL_GRACE: Duration = Duration::from_secs(5);

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

impl PgStore {
    /// The claim, answered by `deadline` (plus [`CLAIM_GRACE`]) whatever the
    /// database does. The first attempt sets the deadline once it has a
    /// connection (taking one is bounded by the pool's acquire timeout); an
    /// attempt on a replacement for a faulty pooled connection keeps it.
    async fn claim_once(
        &self,
        request: &ClaimRequest,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<Claim<PgTx>, StoreError> {
        let mut conn = self.conn().await?;
        let retried = deadline.is_some();
        let deadline =
            deadline.unwrap_or_else(|| tokio::time::Instant::now() + request.wait.max(MIN_WAIT));
        // Outside the claim's transaction no lock_timeout applies, so the
        // deadline bounds the lookup and the first PREPARE of the claim
        // statement on this connection. A statement cut off that way leaves
        // its connection busy, so the connection is closed rather than
        // returned.
        let mut looked_up = false;
        let prepared = tokio::time::timeout_at(deadline, async {
            let record = match Self::lookup(&conn, request).await? {
                Some(row) => decode_record(&row)?,
                None => None,
            };
            looked_up = true;
            let claim = conn.prepare_cached(CLAIM).await.map_err(map_error)?;
            Ok::<_, StoreError>((record, claim))
        })
        .await;
        let claim = match prepared {
            Ok(Ok((Some(record), _))) => return Ok(Claim::Completed(record)),
            Ok(Ok((None, claim))) => claim,
            // A pooled connection the server closed (a restart, a terminated
            // backend), or whose session is not what we left, is only found
            // out when used. Nothing has happened on it yet: drop it and start
            // over once on a fresh one, rather than answer 503 for a database
            // that is fine.
            Ok(Err(e))
                if (e.kind() == StoreErrorKind::Unavailable || is_session_fault(&e))
                    && !retried =>
            {
                conn.discard();
                drop(conn);
                return Box::pin(self.claim_once(request, Some(deadline))).await;
            }
            Ok(Err(e)) => {
                if is_session_fault(&e) {
                    conn.discard();
                }
                return Err(e);
            }
            // The server answered the lookup, but preparing the INSERT waits
            // for a lock on the key table (a migration, a `LOCK TABLE`): the
            // same wait as the claim's own lock timeout, answered the same way.
            Err(_) if looked_up => {
                conn.discard();
                return Ok(Claim::InProgress);
            }
            Err(_) => {
                conn.discard();
                return Err(timed_out());
            }
        };
        let wait = deadline.saturating_duration_since(tokio::time::Instant::now());
        let claimed = tokio::time::timeout_at(
            deadline + CLAIM_GRACE,
            Self::try_claim(&mut conn, &claim, request, wait),
        )
        .await;
        match claimed {
            // Cut off mid-statement: `conn` is marked in a transaction, so it
            // is closed, and PostgreSQL rolls back once the statement ends.
            Err(_) => Err(timed_out()),
            Ok(Ok(Some((token, xid)))) => Ok(Claim::Owned(PgTx::new(conn, request, token, xid))),
            Ok(Ok(None)) => {
                // Committed by another owner while we waited: read it with a
                // fresh snapshot, then let go.
                let row =
                    tokio::time::timeout_at(deadline + CLAIM_GRACE, Self::lookup(&conn, request))
                        .await
                        .unwrap_or_else(|_| Err(timed_out()));
                Self::rollback(conn).await?;
                let record = match row? {
                    Some(row) => decode_record(&row)?,
                    None => None,
                };
                Ok(record.map_or(Claim::InProgress, Claim::Completed))
            }
            Ok(Err(e)) => {
                let lock_timeout = e.sql_state() == Some(SqlState::LOCK_NOT_AVAILABLE.code());
                if e.kind() != StoreErrorKind::Unavailable && !is_session_fault(&e) {
                    // A failed rollback leaves `conn` marked in a transaction: it is closed.
                    let _ = Self::rollback(conn).await;
                }
                if lock_timeout {
                    Ok(Claim::InProgress)
                } else {
                    Err(e)
                }
            }
        }
    }

    /// Ends the owner's transaction with `end` (`COMMIT` or `ROLLBACK`),
    /// pipelined behind `update` when there is one, with the session reset
    /// behind it: one round trip. The connection goes back to the pool only
    /// if all of it is known to have worked.
    async fn finish(
        mut conn: Conn,
        update: Option<(&tokio_postgres::Statement, &[&(dyn ToSql + Sync)])>,
        end: &'static str,
    ) -> Result<(), Finished> {
        let ended = async {
            // `try_join!` and `biased`: the UPDATE goes out first, and should
            // it fail before it was sent (an encoding error), the COMMIT
            // never goes out at all. Once both were sent, a failed UPDATE has
            // aborted the transaction and the COMMIT rolls back.
            match update {
                Some((statement, params)) => tokio::try_join!(
                    biased;
                    async { conn.query_one(statement, params).await.map_err(Finished::Update) },
                    async { conn.batch_execute(end).await.map_err(Finished::End) },
                )
                .map(|_| ()),
                None => conn.batch_execute(end).await.map_err(Finished::End),
            }
        };
        let (ended, reset) = tokio::join!(biased; ended, conn.batch_execute(SESSION_RESET));
        if ended.is_ok() && reset.is_ok() {
            conn.ended();
        }
        ended
    }

    /// Cancels whatever statement runs on the connection of `tx` (a handler
    /// cut off at its deadline, a task it spawned), so that its locks and
    /// its connection come back now rather than when the statement ends.
    async fn cancel_running(tx: &PgTx) {
        if let Err(e) = tx.cancel_token().cancel_query(NoTls).await {
            tracing::warn!(error = %e, "could not cancel the statement still running for an abandoned owner");
        }
    }
}

/// Which part of ending a transaction failed.
enum Finished {
    /// The statement before the end (the completion's UPDATE).
    Update(tokio_postgres::Error),
    /// The `COMMIT` or `ROLLBACK` itself.
    End(tokio_postgres::Error),
}

impl Store for PgStore {
    type Tx = PgTx;

    async fn claim(&self, request: &ClaimRequest) -> Result<Claim<PgTx>, StoreError> {
        self.claim_once(request, None).await
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
                // The transaction is still open (or aborted): roll it back.
                let _ = Self::finish(conn, None, "ROLLBACK").await;
                return Err(map_error(e));
            }
        };
        let status = response.status.as_u16() as i16;
        let headers = response.encode_headers();
        let body: &[u8] = &response.body;
        let retention = tx.retention().as_secs_f64();
        let (tenant, endpoint) = (tx.scope().tenant().as_str(), tx.scope().endpoint());
        let (key, token, xid) = (tx.key().as_str(), tx.attempt_token(), tx.xid());
        let params: [&(dyn ToSql + Sync); 9] = [
            &tenant, &endpoint, &key, &token, &status, &headers, &body, &retention, &xid,
        ];
        Self::finish(conn, Some((&statement, &params)), "COMMIT")
            .await
            .map_err(completion_error)
    }

    async fn abort(&self, tx: PgTx) -> Result<(), StoreError> {
        // Busy: a statement still runs through a clone of the handle (a task
        // the handler spawned); it would hold the transaction until it ends.
        let conn = match tx.try_take() {
            Some(taken) => taken,
            None => {
                Self::cancel_running(&tx).await;
                tx.take().await
            }
        };
        let Some(conn) = conn else { return Ok(()) };
        // A statement the handler started may still be running on the
        // connection (its future was dropped at the deadline): the ROLLBACK
        // waits behind it. Cancel it if it does not end soon.
        let mut rollback = std::pin::pin!(Self::finish(conn, None, "ROLLBACK"));
        let ended = match tokio::time::timeout(ROLLBACK_PATIENCE, &mut rollback).await {
            Ok(ended) => Some(ended),
            Err(_) => {
                Self::cancel_running(&tx).await;
                tokio::time::timeout(CANCEL_GRACE, rollback).await.ok()
            }
        };
        match ended {
            Some(Ok(())) => Ok(()),
            // The server rolls back when a connection whose ROLLBACK failed is closed.
            Some(Err(Finished::Update(e) | Finished::End(e))) => Err(map_error(e)),
            None => Err(StoreError::new(
                StoreErrorKind::Unavailable,
                "the rollback did not finish; the connection was closed",
            )),
        }
    }
}

/// What a failed completion means for the operation.
///
/// - Lost before or with the `COMMIT` (a connection closed or terminated):
///   the commit may or may not have happened ([`StoreErrorKind::OutcomeUnknown`]).
/// - The UPDATE failed in the server: the transaction was already aborted
///   (the handler swallowed a failed statement) or is no longer the claim's;
///   the `COMMIT` rolled back, and a retry fails the same way
///   ([`StoreErrorKind::TransactionAborted`]). Likewise an UPDATE that could
///   not even be sent: the `COMMIT` never was.
/// - The `COMMIT` failed in the server: a deferred constraint
///   ([`StoreErrorKind::TransactionAborted`]) or a serialization failure
///   ([`StoreErrorKind::Conflict`]); rolled back either way.
fn completion_error(failed: Finished) -> StoreError {
    let (e, what) = match failed {
        Finished::Update(e) => (
            e,
            "remembering the response failed; the transaction was rolled back",
        ),
        Finished::End(e) => (e, "the commit failed; the transaction was rolled back"),
    };
    let error = map_error(e);
    match error.kind() {
        StoreErrorKind::Unavailable => StoreError::new(
            StoreErrorKind::OutcomeUnknown,
            "the connection was lost while committing; whether the commit happened is unknown",
        )
        .with_sql_state(error.sql_state().map(str::to_owned))
        .with_source(error),
        StoreErrorKind::Conflict => error,
        _ => StoreError::new(StoreErrorKind::TransactionAborted, what)
            .with_sql_state(error.sql_state().map(str::to_owned))
            .with_source(error),
    }
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
pub(crate) fn map_error(e: tokio_postgres::Error) -> StoreError {
    let kind = match e.code() {
        // Not a server error: the connection failed, or a value could not be
        // encoded (nothing was sent, and sending it again fails the same way).
        None if is_encoding_error(&e) => StoreErrorKind::Backend,
        None => StoreErrorKind::Unavailable,
        Some(code) if *code == SqlState::UNDEFINED_TABLE || *code == SqlState::UNDEFINED_COLUMN => {
            StoreErrorKind::Schema
        }
        Some(code)
            if *code == SqlState::T_R_SERIALIZATION_FAILURE
                || *code == SqlState::T_R_DEADLOCK_DETECTED =>
        {
            StoreErrorKind::Conflict
        }
        Some(code)
            if *code == SqlState::IN_FAILED_SQL_TRANSACTION
                || *code == SqlState::DIVISION_BY_ZERO
                || code.code().starts_with("23") =>
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

/// The driver fails to serialize a parameter before anything is sent.
fn is_encoding_error(e: &tokio_postgres::Error) -> bool {
    use std::error::Error as _;
    // tokio-postgres has no public kind for it; its message is stable.
    !e.is_closed() && e.source().is_some() && e.to_string().starts_with("error serializing")
}

/// A pooled connection from [`PgStore::client`]; dereferences to a
/// `tokio_postgres::Client`.
///
/// On drop it goes back to the pool only once it is clean again: a
/// transaction the application left open or failed is rolled back, and the
/// session is reset (settings, role, cursors, listeners, session advisory
/// locks, temporary tables), on a task of its own so that dropping never
/// blocks. Should that not work within a few seconds, the connection is
/// closed instead. Prepared statements are kept (the pool caches its own);
/// an application that deallocates them costs the next claim on that
/// connection a reconnect, nothing else.
pub struct PooledClient(Option<Conn>);

impl PooledClient {
    /// Prepares a statement, reusing this connection's cached one.
    pub async fn prepare_cached(
        &self,
        sql: &str,
    ) -> Result<tokio_postgres::Statement, tokio_postgres::Error> {
        self.conn().prepare_cached(sql).await
    }

    fn conn(&self) -> &Conn {
        // Only `Drop` takes the connection out.
        self.0
            .as_ref()
            .expect("a PooledClient holds its connection until dropped")
    }
}

impl std::ops::Deref for PooledClient {
    type Target = tokio_postgres::Client;
    fn deref(&self) -> &tokio_postgres::Client {
        self.conn()
    }
}

impl fmt::Debug for PooledClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PooledClient").finish_non_exhaustive()
    }
}

impl Drop for PooledClient {
    fn drop(&mut self) {
        let Some(conn) = self.0.take() else { return };
        // Without a runtime the connection is simply closed (it is marked
        // as possibly in a transaction).
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(reset_borrowed(conn));
        }
    }
}

/// Returns an application's connection to the pool clean, or closes it.
async fn reset_borrowed(mut conn: Conn) {
    const RESET_LIMIT: Duration = Duration::from_secs(5);
    let reset = async {
        // Outside a transaction block a statement is its own transaction, so
        // now() and statement_timestamp() are one instant; inside a block the
        // transaction began with an earlier message. A failed block answers
        // 25P02. (A bare ROLLBACK would do too, but warns on every clean
        // connection.)
        let in_transaction = match conn
            .simple_query("SELECT now() = statement_timestamp()")
            .await
        {
            Ok(messages) => !messages.iter().any(|m| {
                matches!(m, tokio_postgres::SimpleQueryMessage::Row(row) if row.get(0) == Some("t"))
            }),
            Err(e) if e.code() == Some(&SqlState::IN_FAILED_SQL_TRANSACTION) => true,
            Err(e) => return Err(e),
        };
        if in_transaction {
            conn.batch_execute("ROLLBACK").await?;
        }
        conn.batch_execute(SESSION_RESET).await
    };
    match tokio::time::timeout(RESET_LIMIT, reset).await {
        Ok(Ok(())) => conn.ended(),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "could not reset an application connection; closing it")
        }
        Err(_) => tracing::warn!("resetting an application connection took too long; closing it"),
    }
}
