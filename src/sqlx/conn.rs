//! [`GuardedConnection`]: the owner's pooled connection, inside the
//! transaction the store began, behind the guard the handler's statements
//! pass; it goes back to the pool only once the transaction ended and the
//! session was reset.
//!
//! The store sends `BEGIN`, `COMMIT` and `ROLLBACK` itself rather than
//! through a `sqlx::Transaction`: a `Transaction` returns its connection to
//! the pool the moment it ends, before the session reset could be sent.

use std::{
    fmt,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use ::sqlx::{
    error::BoxDynError,
    pool::PoolConnection,
    postgres::{PgArguments, PgQueryResult, PgRow, PgStatement, PgTypeInfo},
    Describe, Either, Execute, Executor, PgConnection, PgPool, Postgres, SqlStr,
};

use crate::protocol::{
    lexer::{self, Refusal},
    session_reset::SESSION_RESET,
};

/// What a [`SqlxConn`](super::SqlxConn) dereferences to: the claim's
/// connection behind the statement guard. `&mut GuardedConnection` is a
/// `sqlx` executor (`.execute(&mut *conn)`, `.fetch_one(&mut *conn)`).
///
/// The layer owns the transaction's end: `BEGIN`, `COMMIT`, `END`,
/// `ROLLBACK` (but not `ROLLBACK TO SAVEPOINT`) are refused before they
/// reach the server, with [`sqlx::Error::InvalidArgument`](::sqlx::Error::InvalidArgument);
/// savepoints are fine. So is what would outlive the request on the pooled
/// connection: session-level `SET`/`RESET`, `PREPARE`, `EXECUTE`,
/// `DEALLOCATE`, `LISTEN`/`UNLISTEN`, `DISCARD`, `LOAD`, temporary objects,
/// `WITH HOLD` cursors, `set_config(…, false)`, writes to `pg_settings`, a
/// `pg_temp` search path, and session advisory locks (use
/// `SET LOCAL` and `pg_advisory_xact_lock`). The guard reads SQL as
/// [`PgTx`](crate::postgres::PgTx)'s does, and fails closed on text it
/// cannot follow. What no guard can see (a function that changes the
/// session) is undone by a session reset behind the `COMMIT` or
/// `ROLLBACK`, before anyone else gets the connection: settings, role,
/// cursors, listeners, session advisory locks and temporary tables.
///
/// Settings your pool's connections should keep belong in their connect
/// options (`PgConnectOptions::options`) or in role or database defaults,
/// which the reset keeps; a `SET` in an `after_connect` hook is reset
/// after the connection served a request through this store.
pub struct GuardedConnection {
    conn: PoolConnection<Postgres>,
    /// Known to be outside any transaction, its session reset where one was
    /// due: only then does it go back to the pool.
    clean: bool,
    /// Behind a transaction pooler: the session is the pooler's, so no
    /// reset is sent (it would reach another server connection), and
    /// statements go out unnamed.
    transaction_pooling: bool,
    /// The pool, for a cancel request from another of its connections.
    pool: PgPool,
    /// The session's process id, read when the transaction began: what a
    /// cancel request names.
    pid: Option<i32>,
}

impl GuardedConnection {
    /// A pooled connection (waiting at most the pool's acquire timeout),
    /// outside any transaction.
    pub(super) async fn acquire(
        pool: &PgPool,
        transaction_pooling: bool,
    ) -> Result<Self, ::sqlx::Error> {
        Ok(GuardedConnection {
            conn: pool.acquire().await?,
            clean: true,
            transaction_pooling,
            pool: pool.clone(),
            pid: None,
        })
    }

    /// The connection without the guard, for the store's own statements.
    pub(super) fn raw(&mut self) -> &mut PgConnection {
        &mut self.conn
    }

    /// Whether statements go out unnamed (behind a transaction pooler).
    pub(super) fn transaction_pooling(&self) -> bool {
        self.transaction_pooling
    }

    /// From here on, dropped before [`finish`](Self::finish) means closed.
    pub(super) fn mark_dirty(&mut self) {
        self.clean = false;
    }

    /// Outside any transaction again, every statement answered: pooled
    /// again when dropped.
    pub(super) fn mark_settled(&mut self) {
        self.clean = true;
    }

    /// The session's process id, read inside the transaction.
    pub(super) fn set_pid(&mut self, pid: i32) {
        self.pid = Some(pid);
    }

    /// The pool and the session's process id, for a cancel request.
    pub(super) fn cancel_target(&self) -> (PgPool, Option<i32>) {
        (self.pool.clone(), self.pid)
    }

    /// Ends the transaction with `end` (`COMMIT` or `ROLLBACK`) and, if
    /// `reset`, then undoes what the handler may have left on the session,
    /// in a message of its own so that its outcome never blurs the end's.
    /// The connection goes back to the pool only if all of it worked;
    /// otherwise it is closed (and PostgreSQL rolls back, if it had not).
    pub(super) async fn finish(
        mut self,
        end: &'static str,
        reset: bool,
    ) -> Result<(), ::sqlx::Error> {
        self.raw().execute(end).await?;
        if reset && !self.transaction_pooling {
            if let Err(e) = self.raw().execute(SESSION_RESET).await {
                tracing::warn!(error = %e, "could not reset a connection's session; closing it");
                return Ok(());
            }
        }
        self.clean = true;
        Ok(())
    }
}

impl Drop for GuardedConnection {
    fn drop(&mut self) {
        if !self.clean {
            // Possibly inside a transaction, or with the handler's session
            // state on it: never lent again. The server rolls back.
            self.conn.close_on_drop();
        }
    }
}

impl fmt::Debug for GuardedConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuardedConnection").finish_non_exhaustive()
    }
}

/// The guard's answer to `sql`: `None` to let it through.
fn refused(sql: &str) -> Option<::sqlx::Error> {
    let why = match lexer::refusal(sql)? {
        Refusal::TransactionControl => {
            "refused by the idempotency layer: transaction control statements (and SQL text the \
             guard cannot read with certainty) are reserved for it; savepoints are allowed"
        }
        Refusal::SessionState => {
            "refused by the idempotency layer: the statement would change the pooled session \
             beyond this request; use SET LOCAL, pg_advisory_xact_lock or transaction-scoped objects"
        }
    };
    Some(::sqlx::Error::InvalidArgument(why.to_owned()))
}

type BoxFuture<'e, T> = Pin<Box<dyn Future<Output = T> + Send + 'e>>;
type BoxStream<'e, T> = Pin<Box<dyn futures_core::Stream<Item = T> + Send + 'e>>;

/// The stream of a refused statement: its one error.
struct Refused(Option<::sqlx::Error>);

impl futures_core::Stream for Refused {
    type Item = Result<Either<PgQueryResult, PgRow>, ::sqlx::Error>;

    fn poll_next(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Poll::Ready(self.get_mut().0.take().map(Err))
    }
}

/// A statement taken apart so that its text can be read before it runs
/// (`Execute::sql` consumes the statement): the same statement, put back
/// together for the connection underneath.
struct Checked {
    sql: SqlStr,
    statement: Option<PgStatement>,
    arguments: Option<Result<Option<PgArguments>, BoxDynError>>,
    persistent: bool,
}

impl Checked {
    fn new<'q, E: Execute<'q, Postgres>>(mut query: E) -> Self {
        let statement = query.statement().cloned();
        let arguments = Some(query.take_arguments());
        let persistent = query.persistent();
        Checked {
            sql: query.sql(),
            statement,
            arguments,
            persistent,
        }
    }
}

impl Execute<'_, Postgres> for Checked {
    fn sql(self) -> SqlStr {
        self.sql
    }

    fn statement(&self) -> Option<&PgStatement> {
        self.statement.as_ref()
    }

    fn take_arguments(&mut self) -> Result<Option<PgArguments>, BoxDynError> {
        self.arguments.take().unwrap_or(Ok(None))
    }

    fn persistent(&self) -> bool {
        self.persistent
    }
}

impl<'c> Executor<'c> for &'c mut GuardedConnection {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxStream<'e, Result<Either<PgQueryResult, PgRow>, ::sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        let query = Checked::new(query);
        match refused(query.sql.as_str()) {
            Some(error) => Box::pin(Refused(Some(error))),
            None => self.raw().fetch_many(query),
        }
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, Result<Option<PgRow>, ::sqlx::Error>>
    where
        'c: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        let query = Checked::new(query);
        match refused(query.sql.as_str()) {
            Some(error) => Box::pin(std::future::ready(Err(error))),
            None => self.raw().fetch_optional(query),
        }
    }

    // A prepared statement runs through `fetch_*` with its text, where it
    // is checked again; refusing it here already says so sooner.
    fn prepare_with<'e>(
        self,
        sql: SqlStr,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement, ::sqlx::Error>>
    where
        'c: 'e,
    {
        match refused(sql.as_str()) {
            Some(error) => Box::pin(std::future::ready(Err(error))),
            None => self.raw().prepare_with(sql, parameters),
        }
    }

    // Describing runs nothing. (sqlx declares it only with its `offline`
    // feature, which the `sqlx` feature turns on through `sqlx-postgres`,
    // so that this impl compiles whether or not an application's `sqlx`
    // turns on `macros`.)
    fn describe<'e>(self, sql: SqlStr) -> BoxFuture<'e, Result<Describe<Postgres>, ::sqlx::Error>>
    where
        'c: 'e,
    {
        self.raw().describe(sql)
    }
}
