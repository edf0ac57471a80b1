//! [`PgTx`]: the open transaction a key's owner writes through.

use std::{fmt, future::Future, sync::Arc};

use tokio::sync::MappedMutexGuard;
use tokio_postgres::{
    types::{ToSql, Type},
    Row, Statement,
};

use super::{
    conn::{behind, Conn},
    prepared::{Prepared, Sql},
};
use crate::protocol::{
    identity::{tx_accessors, TxIdentity},
    owner::{Handle, Slot},
};

mod error;

pub use error::{TxError, TxErrorKind};

use error::refuse_transaction_control;

/// Runs the statement `run` makes on `conn` behind the transaction's
/// deferred `BEGIN`, if that is still unsent: both in one round trip.
async fn behind_begin<'c, T, F>(
    conn: &'c mut Conn,
    run: impl FnOnce(&'c Conn) -> F,
) -> Result<T, TxError>
where
    F: Future<Output = Result<T, tokio_postgres::Error>>,
{
    let begin = conn.take_begin();
    let conn = &*conn;
    Ok(behind(conn, begin, run(conn)).await?)
}

/// Runs `$attempt` (a block using the locked connection `$conn`) and, when
/// nothing but the transaction's `BEGIN` had gone out before it (the
/// one-commit mode's first statement) and the connection turned out dead,
/// once more on a fresh connection from the pool, as the claim-first mode's
/// claim does. The lost connection's transaction never committed: the
/// server rolled it back with the session.
macro_rules! again_on_a_fresh_connection {
    ($tx:expr, $conn:ident, $attempt:block) => {{
        let restart = $conn.restart();
        let first: Result<_, TxError> = async { $attempt }.await;
        let answered = match (first, restart) {
            (Err(lost), Some(begin)) if lost.lost_connection() => {
                $tx.replace_connection(&mut $conn, begin, lost).await?;
                async { $attempt }.await
            }
            (result, _) => result,
        };
        $conn.started();
        if let Err(e) = &answered {
            if $conn.unnamed() && e.names_a_missing_statement() {
                $conn.poison();
            }
        }
        answered
    }};
}

/// The handle's ways to run a statement with parameters: `$prepare`
/// prepares `sql` on the locked connection ([`prepare`] for the caller's,
/// [`prepare_own`] for the crate's own), then `$run` runs it.
macro_rules! run_prepared {
    ($($(#[$doc:meta])* $vis:vis fn $name:ident(sql: $sql:ty) -> $out:ty {
        prepare: $prepare:ident, run: $run:ident $(,)?
    })*) => {
        $(
            $(#[$doc])*
            $vis async fn $name(
                &self,
                sql: $sql,
                params: &[&(dyn ToSql + Sync)],
            ) -> Result<$out, TxError> {
                let mut conn = self.guarded(Text::text(&sql)).await?;
                again_on_a_fresh_connection!(self, conn, {
                    let statement = $prepare(&conn, sql).await?;
                    behind_begin(&mut conn, |conn| conn.$run(&statement, params)).await
                })
            }
        )*
    };
}

/// The text of a statement, whichever way it is given.
trait Text {
    fn text(&self) -> &str;
}

impl Text for &str {
    fn text(&self) -> &str {
        self
    }
}

impl Text for Sql<'_> {
    fn text(&self) -> &str {
        Sql::text(self)
    }
}

/// The caller's `sql`, prepared: cached per connection, or, behind a
/// transaction pooler, prepared for this one statement (the driver closes
/// it when it is dropped, still inside the transaction, so nothing is left
/// on the pooler's server connection).
async fn prepare(conn: &Conn, sql: &str) -> Result<Statement, tokio_postgres::Error> {
    if conn.unnamed() {
        conn.prepare(sql).await
    } else {
        conn.prepare_cached(sql).await
    }
}

/// The crate's own `sql`, prepared as the store prepares its statements
/// ([`Conn::prepare_sql`]).
async fn prepare_own<'a>(conn: &Conn, sql: Sql<'a>) -> Result<Prepared<'a>, tokio_postgres::Error> {
    conn.prepare_sql(sql).await
}

/// The open PostgreSQL transaction of the request that owns its key.
///
/// The layer puts it into the request extensions before calling the handler
/// (with the `axum` feature it is also an extractor). Everything written
/// through it commits in the same transaction as the remembered response,
/// before the response is sent, or not at all.
///
/// `PgTx` is `Clone + Send + Sync + 'static`; clones share one connection, and
/// statements run one at a time. It cannot leak a half-open transaction: when
/// the layer finishes, the transaction is committed or rolled back and every
/// later call answers [`TxErrorKind::Finished`]; if the layer never gets to
/// finish it (a panic, a dropped task), the last handle to go closes the
/// connection instead of returning it to the pool, and PostgreSQL rolls back.
///
/// Never issue `BEGIN`, `COMMIT` or `ROLLBACK` yourself: the layer owns the
/// transaction's end, and such statements are refused with
/// [`TxErrorKind::TransactionControl`]. Savepoints are fine. The guard reads
/// SQL as PostgreSQL's scanner does (quotes, comments, `--` ending at `\n` or
/// `\r`) and fails closed: text it cannot follow with certainty (an
/// unterminated quote or comment, a control character outside a string) is
/// refused the same way.
///
/// What would outlive the request on the pooled connection is refused with
/// [`TxErrorKind::SessionState`]: session-level `SET`/`RESET`, `PREPARE`,
/// `EXECUTE`, `DEALLOCATE`, `LISTEN`/`UNLISTEN`, `DISCARD`, `LOAD`, temporary
/// objects, `WITH HOLD` cursors, `set_config(…, false)`, writes to
/// `pg_settings`, a `pg_temp` search path, and session advisory locks. Use
/// `SET LOCAL` and `pg_advisory_xact_lock`. What no guard can see (a function
/// that changes the session) is undone by a session reset the store sends
/// behind every `COMMIT` and `ROLLBACK`. (As a backstop, should a `COMMIT`
/// slip through anyway, the completion detects that it runs in another
/// transaction and refuses to remember the response.)
///
/// Statements are prepared once per connection and cached: pass values as
/// `$n` parameters and keep the SQL text static. Behind a transaction pooler
/// ([`PgStoreBuilder::transaction_pooling`](super::PgStoreBuilder::transaction_pooling))
/// each statement is prepared for its one use instead, which costs a round
/// trip; [`query_typed`](Self::query_typed) saves it.
///
/// ```no_run
/// # async fn handler(tx: tower_idempotency::postgres::PgTx) -> Result<(), tower_idempotency::postgres::TxError> {
/// let row = tx
///     .query_one(
///         "INSERT INTO orders (tenant_id, total) VALUES ($1, $2) RETURNING id",
///         &[&tx.tenant(), &2400_i64],
///     )
///     .await?;
/// let id: i64 = row.get(0);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PgTx {
    inner: Arc<Slot<Conn>>,
}

impl Handle for PgTx {
    type Conn = Conn;

    fn of(slot: Arc<Slot<Conn>>) -> Self {
        PgTx { inner: slot }
    }

    fn slot(&self) -> &Slot<Conn> {
        &self.inner
    }
}

impl PgTx {
    tx_accessors!();

    /// Who owns the key.
    fn identity(&self) -> &TxIdentity {
        self.inner.identity()
    }

    run_prepared! {
        /// Runs one statement and returns the number of rows it affected.
        pub fn execute(sql: &str) -> u64 { prepare: prepare, run: execute }
        /// Runs one query and returns its rows.
        pub fn query(sql: &str) -> Vec<Row> { prepare: prepare, run: query }
        /// Runs a query that returns exactly one row.
        pub fn query_one(sql: &str) -> Row { prepare: prepare, run: query_one }
        /// Runs a query that returns at most one row.
        pub fn query_opt(sql: &str) -> Option<Row> { prepare: prepare, run: query_opt }
    }

    /// Runs one query with the types of its parameters given, as one
    /// unnamed statement in one round trip: nothing is prepared or cached,
    /// which is what a transaction pooler keeps. Behind one it saves the
    /// round trip [`query`](Self::query) spends preparing.
    ///
    /// ```no_run
    /// # async fn handler(tx: tower_idempotency::postgres::PgTx) -> Result<(), tower_idempotency::postgres::TxError> {
    /// use tokio_postgres::types::Type;
    ///
    /// let rows = tx
    ///     .query_typed(
    ///         "INSERT INTO orders (tenant_id, total) VALUES ($1, $2) RETURNING id",
    ///         &[(&tx.tenant(), Type::TEXT), (&2400_i64, Type::INT8)],
    ///     )
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn query_typed(
        &self,
        sql: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<Vec<Row>, TxError> {
        let mut conn = self.guarded(sql).await?;
        again_on_a_fresh_connection!(self, conn, {
            behind_begin(&mut conn, |conn| conn.query_typed(sql, params)).await
        })
    }

    /// [`query_typed`](Self::query_typed) for a statement whose rows are not
    /// needed: returns the number of rows it affected.
    pub async fn execute_typed(
        &self,
        sql: &str,
        params: &[(&(dyn ToSql + Sync), Type)],
    ) -> Result<u64, TxError> {
        let mut conn = self.guarded(sql).await?;
        again_on_a_fresh_connection!(self, conn, {
            behind_begin(&mut conn, |conn| conn.execute_typed(sql, params)).await
        })
    }

    run_prepared! {
        /// One of the crate's own statements, sent as the store sends its own
        /// (cached, or unnamed behind a transaction pooler).
        pub(crate) fn query_one_sql(sql: Sql<'_>) -> Row {
            prepare: prepare_own,
            run: query_one_prepared,
        }
        /// [`query_one_sql`](Self::query_one_sql) for a statement whose rows
        /// are not needed: returns the number of rows it affected.
        pub(crate) fn execute_sql(sql: Sql<'_>) -> u64 {
            prepare: prepare_own,
            run: execute_prepared,
        }
    }

    /// Runs statements without parameters (e.g. `SAVEPOINT s1`).
    pub async fn batch_execute(&self, sql: &str) -> Result<(), TxError> {
        let mut conn = self.guarded(sql).await?;
        again_on_a_fresh_connection!(self, conn, {
            behind_begin(&mut conn, |conn| conn.batch_execute(sql)).await
        })
    }

    /// The path every statement takes: refused if it would end the
    /// transaction or change the session, then the connection, locked so
    /// that statements run one at a time, unless the layer already ended the
    /// transaction ([`TxErrorKind::Finished`]).
    async fn guarded(&self, sql: &str) -> Result<MappedMutexGuard<'_, Conn>, TxError> {
        refuse_transaction_control(sql)?;
        self.inner.lock().await.ok_or_else(TxError::finished)
    }

    /// Swaps `conn`, lost before its transaction's first statement was
    /// answered, for a fresh one with `begin` deferred again; the cancel
    /// requests follow it. A pool that has none to give leaves `lost` as
    /// the answer.
    async fn replace_connection(
        &self,
        conn: &mut Conn,
        begin: crate::protocol::claim::BeginText,
        lost: TxError,
    ) -> Result<(), TxError> {
        tracing::debug!(error = %lost, "the transaction's connection was lost before its first statement; on a fresh one");
        if conn.replace(begin).await.is_err() {
            return Err(lost);
        }
        self.inner.replace_canceller(conn.canceller());
        Ok(())
    }
}

impl fmt::Debug for PgTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.identity().fmt_debug("PgTx", f)
    }
}

#[cfg(feature = "axum")]
crate::macros::from_extensions! {
    #[cfg_attr(docsrs, doc(cfg(all(feature = "axum", feature = "postgres"))))]
    PgTx,
}
