//! Pooled connections that are returned to the pool only in a known state.
//!
//! [`Conn`] holds every pooled connection the store uses: one that may be
//! inside a transaction (or whose state is unknown) is closed on drop instead
//! of being returned. [`PooledClient`] is the connection lent to the
//! application, rolled back and reset before anyone else gets it.
//! [`Conn::reset_session`] undoes a request's session changes.

use std::{
    fmt,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::Duration,
};

use deadpool_postgres::Object;

use crate::protocol::{
    claim::{begin_then_waits, BeginText},
    driver::Waits,
    errors::in_failed_transaction,
    session_reset::{session_reset_keeping, OUTSIDE_A_TRANSACTION},
    sql::{Param, Sql},
    transaction::{BEGIN, BEGIN_DEFAULT, ROLLBACK},
    waits::millis,
};
use crate::store::{StoreError, StoreErrorKind};

/// A pooled connection that may be inside a transaction.
///
/// Dropped while a transaction may be open (a cancelled future, a panic), it
/// closes the connection instead of returning it to the pool; PostgreSQL then
/// rolls the transaction back. Nothing else can put an open transaction back
/// into the pool.
pub(crate) struct Conn {
    object: Option<Object>,
    /// Known to be outside any transaction, with nothing running on it: only
    /// then does it go back to the pool.
    clean: bool,
    /// Reached through a transaction pooler: the crate's statements go out
    /// unnamed, and nothing is left on the session (see `prepared.rs`).
    unnamed: bool,
    /// A `BEGIN` not sent yet: it goes out with the next statement, in the
    /// same round trip (the one-commit mode's transaction).
    deferred_begin: Option<BeginText>,
    /// The store's TLS, for cancel requests.
    connector: super::tls::Connector,
    /// The pool it came from, for a replacement ([`Conn::replace`]).
    pool: deadpool_postgres::Pool,
    /// The one-commit mode's `BEGIN` while nothing but it has been sent:
    /// the transaction may still start over on another connection.
    restartable: Option<BeginText>,
    /// Closed instead of pooled again, however it ends (see [`Conn::poison`]).
    poisoned: bool,
    /// What its session holds between transactions.
    session: SessionDefaults,
    /// Whether the session reset may ride in the statement that decides the
    /// commit (`COMPLETE_AND_RESET`, `CLAIM_AT_COMMIT_AND_RESET`): reached
    /// directly, on a database known not to be Citus.
    reset_in_statement: bool,
}

/// What the store's sessions hold between transactions: the hold limit
/// given to every connection the store opens
/// ([`PgStoreBuilder::hold_limit`](super::PgStoreBuilder::hold_limit)),
/// if they carry one, and the session reset that keeps it.
#[derive(Debug, Clone)]
pub(super) struct SessionDefaults {
    hold_limit: Option<Duration>,
    /// The reset as a message of its own, and as one for sessions that
    /// have the hold limit from their start (nothing to set again).
    reset: Arc<str>,
    reset_at_startup: Arc<str>,
    /// Whether every connection the store opened so far has the hold limit
    /// from its start (asked for in the startup packet, and checked as it
    /// opened): the reset then leaves the setting to `RESET ALL`, which
    /// goes back to the session's start. False once one did not.
    hold_limit_at_startup: Arc<AtomicBool>,
    /// The reset function's arguments where the reset rides in the commit's
    /// statement: the hold limit as the setting takes it, and the role the
    /// store logs in as.
    reset_arguments: ResetArguments,
    /// No reset after an owner's transaction that committed
    /// ([`SessionReset::TrustedHandlers`](super::SessionReset::TrustedHandlers)).
    trusted_handlers: bool,
    /// Whether every connection the store opened so far starts its
    /// sessions at READ COMMITTED (checked as each opens, before its first
    /// use): transactions then begin with a plain `BEGIN`. False for a pool
    /// the store does not open itself, or behind a transaction pooler.
    read_committed: Arc<AtomicBool>,
}

/// The session reset function's arguments, for a statement that carries
/// the reset ([`Conn::reset_in_statement`]).
#[derive(Debug, Clone)]
pub(super) struct ResetArguments {
    hold_limit: Option<Arc<str>>,
    login: Option<Arc<str>>,
}

impl ResetArguments {
    /// The reset's arguments (if it rides in the statement), to bind after
    /// the statement's own: the hold limit and the login, each `NULL` if
    /// there is none.
    pub(super) fn params(arguments: &Option<ResetArguments>) -> Option<[Param<'_>; 2]> {
        arguments.as_ref().map(|arguments| {
            [
                Param::OptText(arguments.hold_limit.as_deref()),
                Param::OptText(arguments.login.as_deref()),
            ]
        })
    }
}

impl SessionDefaults {
    /// Whether the sessions have the hold limit from their start.
    fn hold_limit_at_startup(&self) -> bool {
        self.hold_limit_at_startup.load(Ordering::Relaxed)
    }

    /// The sessions' `hold_limit`, if they carry one, and the role the
    /// store logs in as, if the configuration names it.
    pub(super) fn new(
        hold_limit: Option<Duration>,
        login: Option<&str>,
        reset: super::SessionReset,
        read_committed: Arc<AtomicBool>,
        hold_limit_at_startup: Arc<AtomicBool>,
    ) -> Self {
        SessionDefaults {
            hold_limit,
            reset: session_reset_keeping(hold_limit, login).into(),
            reset_at_startup: session_reset_keeping(None, login).into(),
            hold_limit_at_startup,
            reset_arguments: ResetArguments {
                hold_limit: hold_limit.map(|limit| format!("{}ms", millis(limit)).into()),
                login: login.map(Into::into),
            },
            trusted_handlers: reset == super::SessionReset::TrustedHandlers,
            read_committed,
        }
    }
}

impl Conn {
    pub(super) fn new(
        object: Object,
        transaction_pooling: bool,
        connector: super::tls::Connector,
        pool: deadpool_postgres::Pool,
        session: SessionDefaults,
        citus: Option<bool>,
    ) -> Self {
        Conn {
            object: Some(object),
            clean: true,
            unnamed: transaction_pooling,
            deferred_begin: None,
            connector,
            pool,
            restartable: None,
            poisoned: false,
            session,
            reset_in_statement: !transaction_pooling && citus == Some(false),
        }
    }

    /// Closes this connection when it is done, instead of pooling it again:
    /// behind a transaction pooler, its driver named a statement on another
    /// server connection (a type created since the connection opened was
    /// looked up; see `types.rs`), and will again until replaced.
    pub(super) fn poison(&mut self) {
        self.poisoned = true;
    }

    /// Marks the transaction begun with `begin` as one that may start over
    /// on another connection until its first statement is answered
    /// ([`Conn::replace`]): nothing of it can have committed before.
    pub(super) fn restartable(&mut self, begin: BeginText) {
        self.restartable = Some(begin);
    }

    /// The `BEGIN` to start over with, while the transaction may still.
    pub(super) fn restart(&self) -> Option<BeginText> {
        self.restartable.clone()
    }

    /// The first statement was answered: the transaction holds work now,
    /// and can no longer start over.
    pub(super) fn started(&mut self) {
        self.restartable = None;
    }

    /// Swaps this connection, lost before its transaction's first statement
    /// was answered, for a fresh one from the pool, with the transaction's
    /// `begin` deferred again (behind a transaction pooler, sent again at
    /// once). The lost one is closed, never pooled; whatever was sent on it
    /// died with its session, uncommitted.
    pub(super) async fn replace(&mut self, begin: BeginText) -> Result<(), StoreError> {
        let fresh = self.pool.get().await.map_err(|e| {
            StoreError::new(
                StoreErrorKind::Unavailable,
                "cannot open a database connection",
            )
            .with_source(e)
        })?;
        if let Some(lost) = self.object.replace(fresh) {
            drop(Object::take(lost));
        }
        if self.unnamed {
            self.clean = false;
            self.batch_pipelined(&begin)
                .await
                .map_err(super::error::map_error)?;
        } else {
            self.clean = true;
            self.deferred_begin = Some(begin);
        }
        Ok(())
    }

    /// What cancels a statement running on this connection, over its TLS.
    pub(super) fn canceller(&self) -> super::tls::Canceller {
        super::tls::Canceller::new(self.cancel_token(), self.connector.clone())
    }

    /// Defers `begin` (utility statements only: nothing to plan, nothing to
    /// fail) to the next statement, which it is pipelined with: the
    /// transaction costs no round trip of its own. Until then the connection
    /// is outside any transaction.
    pub(super) fn defer_begin(&mut self, begin: BeginText) {
        self.deferred_begin = Some(begin);
    }

    /// The deferred `BEGIN`, taken to be sent now, before the statement
    /// about to go out: from here on the connection is inside a transaction.
    /// Take it only where it is sent in the same poll (see [`behind`]).
    pub(super) fn take_begin(&mut self) -> Option<BeginText> {
        let begin = self.deferred_begin.take();
        if begin.is_some() {
            self.clean = false;
        }
        begin
    }

    /// Behind a transaction pooler: statements go out unnamed, and the
    /// session is the pooler's, not this connection's (see `prepared.rs`).
    pub(crate) fn unnamed(&self) -> bool {
        self.unnamed
    }

    /// Undoes a request's session changes: one call of the reset function
    /// (which gives the session its hold limit again, where the store's
    /// sessions carry one), a message of its own, sent on the first poll so
    /// that it goes out right behind whatever was polled before it. Nothing
    /// behind a transaction pooler, where it would run on whichever server
    /// connection the pooler picks next, not on the one the transaction
    /// used.
    pub(super) async fn reset_session(&self) -> Result<(), tokio_postgres::Error> {
        if self.unnamed {
            return Ok(());
        }
        let reset = if self.session.hold_limit_at_startup() {
            &self.session.reset_at_startup
        } else {
            &self.session.reset
        };
        self.batch_execute(reset).await
    }

    /// The database is (or is not) a Citus coordinator, as the store found.
    pub(super) fn on_citus(&mut self, citus: bool) {
        self.reset_in_statement = !self.unnamed && !citus;
    }

    /// Whether an owner's transaction that committed skips the session
    /// reset ([`SessionReset::TrustedHandlers`](super::SessionReset::TrustedHandlers)).
    pub(super) fn trusts_handlers(&self) -> bool {
        self.session.trusted_handlers
    }

    /// The statement that decides the commit: `resetting` (`plain` with
    /// the session reset in it, see `COMPLETE_AND_RESET`) with the reset's
    /// arguments, where the reset may ride in it; else `plain`, and the
    /// reset goes as a message of its own ([`Conn::reset_session`]).
    pub(super) fn deciding(
        &self,
        plain: Sql<'static>,
        resetting: Sql<'static>,
    ) -> (Sql<'static>, Option<ResetArguments>) {
        if self.reset_in_statement {
            let mut arguments = self.session.reset_arguments.clone();
            if self.session.hold_limit_at_startup() {
                arguments.hold_limit = None;
            }
            (resetting, Some(arguments))
        } else {
            (plain, None)
        }
    }

    /// How an owner's transaction begins: `BEGIN` (plain where the
    /// session's default level was checked to be READ COMMITTED), its lock
    /// wait and the hold limit the session does not already carry, one
    /// utility statement each.
    pub(super) fn begin_text(&self, waits: Waits) -> BeginText {
        let begin = if !self.unnamed && self.session.read_committed.load(Ordering::Relaxed) {
            BEGIN_DEFAULT
        } else {
            BEGIN
        };
        begin_then_waits(begin, waits.lock, self.hold_limit_to_set(waits.idle))
    }

    /// The hold limit an owner's transaction must set for itself: `limit`,
    /// unless the session already carries it.
    pub(super) fn hold_limit_to_set(&self, limit: Option<Duration>) -> Option<Duration> {
        let carried = self.session.hold_limit.map(millis);
        limit.filter(|&limit| Some(millis(limit)) != carried)
    }

    /// Sends the `; `-separated utility statements of `batch` (our own
    /// `BEGIN …; SET LOCAL …` texts, no client data) each as its own
    /// message, all pipelined, on the first poll. PostgreSQL runs one
    /// message of several statements as an implicit transaction block at a
    /// cost of its own: measured with pgbench, `RESET ALL; CLOSE ALL` as one
    /// message took 0.046 ms, either alone 0.018 ms.
    pub(super) async fn batch_pipelined(&self, batch: &str) -> Result<(), tokio_postgres::Error> {
        let sent: Vec<_> = batch
            .split("; ")
            .map(|statement| self.batch_execute(statement))
            .collect();
        futures_util::future::try_join_all(sent).await.map(|_| ())
    }

    /// The connection may be inside a transaction, or is in an unknown state
    /// (a statement still running on it): close it on drop instead of
    /// returning it. Call before sending `BEGIN`.
    pub(super) fn mark_dirty(&mut self) {
        self.clean = false;
    }

    /// `COMMIT` or `ROLLBACK` was acknowledged (and the session reset, where
    /// one is due): the connection may go back to the pool.
    pub(super) fn mark_clean(&mut self) {
        self.clean = true;
    }
}

/// Runs `statement` on `conn`, pipelined behind `begin` when there is one:
/// one round trip for both. The `BEGIN` is polled, and so sent, first;
/// both are sent by the time the first poll returns, and a failed `BEGIN`
/// fails the statement's answer too.
///
/// A combinator rather than an `async fn`, which would keep `statement`
/// twice in its state (the argument and the join awaiting it).
pub(super) fn behind<'c, T, F>(
    conn: &'c Conn,
    begin: Option<BeginText>,
    statement: F,
) -> impl std::future::Future<Output = Result<T, tokio_postgres::Error>> + 'c
where
    F: std::future::Future<Output = Result<T, tokio_postgres::Error>> + 'c,
{
    use futures_util::{future::Either, TryFutureExt as _};
    match begin {
        None => Either::Left(statement),
        Some(begin) => {
            let begin = async move { conn.batch_pipelined(&begin).await };
            // `try_join` polls its first future first, every time.
            Either::Right(
                futures_util::future::try_join(begin, statement).map_ok(|((), done)| done),
            )
        }
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
            if !self.clean || self.poisoned || object.is_closed() {
                drop(Object::take(object));
            }
        }
    }
}

/// A pooled connection from [`PgStore::client`](super::PgStore::client);
/// dereferences to a `tokio_postgres::Client`.
///
/// On drop it goes back to the pool only once it is clean again: a
/// transaction the application left open or failed is rolled back, and the
/// session is reset (settings, role, cursors, listeners, session advisory
/// locks, temporary tables), on a task of its own so that dropping never
/// blocks. Should that not work within a few seconds, the connection is
/// closed instead. Prepared statements are kept (the pool caches its own);
/// an application that deallocates them costs the next claim on that
/// connection a reconnect, nothing else.
///
/// Behind a transaction pooler the session belongs to the pooler: no reset
/// is sent (it would reach another server connection), and a statement
/// outside an explicit transaction must be one round trip (`query_typed`,
/// `execute_typed`, `simple_query`): `query(&str, …)` prepares a named
/// statement first, which the next round trip may not find.
pub struct PooledClient(Option<Conn>);

impl PooledClient {
    /// Lends `conn`, which the caller marked dirty: its state is unknown until
    /// the reset on drop proves otherwise.
    pub(super) fn new(conn: Conn) -> Self {
        PooledClient(Some(conn))
    }

    /// Prepares a statement, reusing this connection's cached one.
    ///
    /// Not behind a transaction pooler
    /// ([`PgStoreBuilder::transaction_pooling`](super::PgStoreBuilder::transaction_pooling)):
    /// the statement stays on the server connection it was prepared on,
    /// which the next transaction may not get. Use `query_typed` there.
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
        // dirty: possibly in a transaction).
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(reset_borrowed(conn));
        }
    }
}

/// Returns an application's connection to the pool clean, or closes it.
async fn reset_borrowed(mut conn: Conn) {
    const RESET_LIMIT: Duration = Duration::from_secs(5);
    let reset = async {
        let in_transaction = match conn
            .simple_query(OUTSIDE_A_TRANSACTION)
            .await
        {
            Ok(messages) => !messages.iter().any(|m| {
                matches!(m, tokio_postgres::SimpleQueryMessage::Row(row) if row.get(0) == Some("t"))
            }),
            Err(e) if e.code().is_some_and(|c| in_failed_transaction(c.code())) => true,
            Err(e) => return Err(e),
        };
        if in_transaction {
            conn.batch_execute(ROLLBACK).await?;
        }
        conn.reset_session().await
    };
    match tokio::time::timeout(RESET_LIMIT, reset).await {
        Ok(Ok(())) => conn.mark_clean(),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "could not reset an application connection; closing it")
        }
        Err(_) => tracing::warn!("resetting an application connection took too long; closing it"),
    }
}
