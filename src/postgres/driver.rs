//! The [driver seam](crate::protocol::driver) for tokio-postgres: how the
//! protocol's statements travel on [`PgStore`]'s pooled connections. This
//! file only sends; what the answers mean is decided in `crate::protocol`.
//!
//! tokio-postgres pipelines: a message is sent on the first poll of its
//! future, so futures joined in order (`biased`) go out in order, in one
//! round trip. So a transaction's `BEGIN` (with its `SET LOCAL`s) goes out
//! with its first statements, and its deciding statement with the `COMMIT`
//! and the session reset (or, on a direct connection to plain PostgreSQL,
//! with the reset inside the deciding statement). The one-commit mode's
//! `BEGIN` waits for the handler's first statement (`PgTx`), and a
//! transaction whose connection was lost before that starts over on a
//! fresh one. Every statement is prepared and cached per connection, or
//! unnamed behind a transaction pooler (`prepared.rs`).

use std::{
    future::Future,
    pin::{pin, Pin},
    task::Poll,
    time::Duration,
};

use futures_util::FutureExt as _;
use tokio::time::Instant;
use tokio_postgres::Row;

use super::{
    conn::{behind, Conn, ResetArguments},
    error::map_error,
    prepared::dyn_params,
    tls::Canceller,
    PgStore,
};
use crate::{
    protocol::{
        citus::IS_CITUS,
        claim::begin_with_waits,
        driver::{Cancel, Connection, Deciding, Driver, End, Failed, Statement, Step, Waits},
        errors::{connection_fault, connection_lost},
        sql::{Param, Sql},
        transaction::{COMMIT, ROLLBACK},
        waits::GRACE,
    },
    store::{StoreError, StoreErrorKind},
};

impl Driver for PgStore {
    type Row = Row;
    type Conn = Conn;

    async fn connect(&self) -> Result<Conn, StoreError> {
        self.conn().await
    }

    async fn learn_citus(&self, conn: &mut Conn) -> Option<bool> {
        let citus = match self.on_citus() {
            Some(citus) => citus,
            None => {
                // Cut off while asking, the connection is closed.
                conn.mark_dirty();
                let rows = conn.query_sql(IS_CITUS, &[]).await.ok()?;
                conn.mark_clean();
                let citus = rows.first().is_some_and(|row| row.get::<_, bool>(0));
                self.found_citus(citus);
                citus
            }
        };
        conn.on_citus(citus);
        Some(citus)
    }

    async fn read(
        &self,
        sql: Sql<'static>,
        params: &[Param<'_>],
        deadline: Instant,
    ) -> Result<Vec<Row>, StoreError> {
        bounded(deadline, async {
            let mut conn = self.conn().await?;
            // Until the answer is in, a cut-off statement would leave the
            // connection busy: it is closed rather than returned.
            conn.mark_dirty();
            let rows = conn
                .query_sql(sql, &dyn_params(params))
                .await
                .map_err(map_error)?;
            conn.mark_clean();
            Ok(rows)
        })
        .await
    }

    /// `BEGIN` with the lock wait, the statement and `COMMIT`, pipelined:
    /// one round trip.
    fn target(&self) -> crate::protocol::telemetry::Target {
        let config = &self.config;
        let one_host = match config.get_hosts() {
            [tokio_postgres::config::Host::Tcp(host)] => Some(host.clone()),
            _ => None,
        };
        let port = match (config.get_ports(), &one_host) {
            ([], Some(_)) => Some(5432),
            ([port], Some(_)) => Some(*port),
            _ => None,
        };
        crate::protocol::telemetry::Target {
            database: config.get_dbname().map(str::to_owned),
            host: one_host,
            port,
        }
    }

    async fn transaction(
        &self,
        sql: Sql<'static>,
        params: &[Param<'_>],
        wait: Duration,
    ) -> Result<Vec<Row>, StoreError> {
        let mut conn = self.conn().await?;
        let deadline = Instant::now() + wait + GRACE;
        // Prepared before the pipeline: a statement prepared inside it would
        // let the COMMIT overtake its Bind.
        conn.mark_dirty();
        let statement = bounded(deadline, async {
            conn.prepare_sql(sql).await.map_err(map_error)
        })
        .await?;
        let begin = begin_with_waits(Some(wait), None);
        let params = dyn_params(params);
        let ran = tokio::time::timeout_at(deadline, async {
            tokio::try_join!(
                biased;
                conn.batch_pipelined(&begin),
                conn.query_prepared(&statement, &params),
                conn.batch_execute(COMMIT),
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
            // A failed statement aborted the transaction, and the COMMIT
            // rolled back; unless the connection itself failed, make sure
            // it is idle before it goes back to the pool.
            Ok(Err(e)) => {
                let e = map_error(e);
                if !connection_lost(&e) {
                    let _ = rollback(conn).await;
                }
                Err(e)
            }
        }
    }
}

impl Connection for Conn {
    type Row = Row;
    type Cancel = Canceller;

    /// The begin batch, then the statements, all pipelined: one round trip.
    /// A statement not yet prepared on this connection sends its `Parse`
    /// behind the begin batch, so that a lock on the whole table met while
    /// planning it is bounded by the transaction's lock wait too.
    async fn begin(
        &mut self,
        waits: Waits,
        first: &[Statement<'_>],
    ) -> Result<Vec<Vec<Row>>, StoreError> {
        let begin = self.begin_text(waits);
        self.mark_dirty();
        let params: Vec<_> = first.iter().map(|s| dyn_params(s.params)).collect();
        let conn = &*self;
        let statements = first
            .iter()
            .zip(&params)
            .map(|(statement, params)| conn.query_sql(statement.sql, params));
        let (_, rows) = tokio::try_join!(
            biased;
            conn.batch_pipelined(&begin),
            futures_util::future::try_join_all(statements),
        )
        .map_err(map_error)?;
        Ok(rows)
    }

    async fn begin_later(&mut self, waits: Waits) -> Result<(), StoreError> {
        let begin = self.begin_text(waits);
        // Until the handler's first statement is answered, a lost
        // connection costs nothing: the transaction starts over on another.
        self.restartable(begin.clone());
        if !self.unnamed() {
            // Sent with the handler's first statement (or with the claim,
            // if the handler sends none): no round trip of its own.
            self.defer_begin(begin);
            return Ok(());
        }
        // Behind a transaction pooler, a statement prepared before the
        // BEGIN may reach another server connection than the transaction:
        // begin now.
        self.mark_dirty();
        if let Err(e) = self.batch_pipelined(&begin).await {
            let error = map_error(e);
            if !connection_fault(&error) {
                return Err(error);
            }
            self.replace(begin).await?;
        }
        Ok(())
    }

    async fn query(
        &mut self,
        sql: Sql<'static>,
        params: &[Param<'_>],
    ) -> Result<Vec<Row>, StoreError> {
        self.query_sql(sql, &dyn_params(params))
            .await
            .map_err(map_error)
    }

    async fn batch(&mut self, sql: &str) -> Result<(), StoreError> {
        self.mark_dirty();
        self.batch_execute(sql).await.map_err(map_error)
    }

    fn settled(&mut self) {
        self.mark_clean();
    }

    async fn end(self, deciding: Option<Deciding<'_>>, end: End) -> Result<(), Failed> {
        match (deciding, end) {
            (Some(deciding), End::Commit) => commit_behind(self, deciding).await,
            (Some(_), _) => unreachable_end(),
            (None, End::Commit) => end_alone(self, COMMIT, true).await,
            (None, End::Rollback) => end_alone(self, ROLLBACK, true).await,
            (None, End::Unused) => end_alone(self, ROLLBACK, false).await,
        }
    }

    fn canceller(&self) -> Canceller {
        Conn::canceller(self)
    }
}

impl Cancel for Canceller {
    async fn cancel(&self) -> Result<(), StoreError> {
        Canceller::cancel(self).await.map_err(map_error)
    }
}

/// A deciding statement is only ever followed by a `COMMIT`.
fn unreachable_end() -> Result<(), Failed> {
    Err(Failed {
        step: Step::Deciding,
        error: StoreError::new(
            StoreErrorKind::Backend,
            "a deciding statement ends with COMMIT",
        ),
        commit_sent: false,
        connection_lost: false,
    })
}

/// `end` (`COMMIT` or `ROLLBACK`) and, if `reset`, the session reset behind
/// it: one round trip. A `BEGIN` still deferred goes first (a one-commit
/// transaction whose handler sent nothing: its `ROLLBACK` then finds no
/// transaction, which the server only warns about).
async fn end_alone(mut conn: Conn, end: &'static str, reset: bool) -> Result<(), Failed> {
    let begin = conn.take_begin();
    let ended = behind(&conn, begin, conn.batch_execute(end));
    let reset_session = async {
        if reset {
            conn.reset_session().await
        } else {
            Ok(())
        }
    };
    let (ended, reset) = tokio::join!(biased; ended, reset_session);
    if ended.is_ok() && reset.is_ok() {
        conn.mark_clean();
    }
    ended.map_err(|e| failed(Step::End, e, end == COMMIT))
}

/// The deciding statement, the `COMMIT` behind it without waiting, and the
/// session reset behind that, unless the statement carries it (see
/// [`Deciding::resetting`]): one round trip, behind a `BEGIN` still
/// deferred. The statement is prepared first (a statement prepared inside
/// the pipeline would let the `COMMIT` overtake its Bind); should it not
/// even prepare, the transaction rolls back.
async fn commit_behind(mut conn: Conn, deciding: Deciding<'_>) -> Result<(), Failed> {
    // Trusted handlers: no reset once the transaction committed, and one
    // of its own after a rollback (what `pipelined` does for a statement
    // that carries the reset and failed).
    let trusted = conn.trusts_handlers();
    let (sql, arguments) = match deciding.resetting {
        Some(_) if trusted => (deciding.sql, None),
        Some(resetting) => conn.deciding(deciding.sql, resetting),
        None => (deciding.sql, None),
    };
    let statement = match conn.prepare_sql(sql).await {
        Ok(statement) => statement,
        Err(e) => {
            // The transaction is still open (or aborted): roll it back.
            let _ = end_alone(conn, ROLLBACK, true).await;
            return Err(failed(Step::Deciding, e, false));
        }
    };
    let reset = ResetArguments::params(&arguments);
    let params = dyn_params(deciding.params).and(reset.as_ref().map_or(&[], |r| &r[..]));
    // A handler that sent no statement left the BEGIN to go out here.
    let begin = conn.take_begin();
    let (ended, clean) = {
        let decided = pin!(behind(
            &conn,
            begin,
            conn.query_one_prepared(&statement, &params)
        ));
        pipelined(&conn, decided, arguments.is_some() || trusted).await
    };
    if clean {
        conn.mark_clean();
    }
    ended
}

/// Sends `decided`, the `COMMIT` behind it without waiting, and the session
/// reset behind that (unless the statement carries it or the handlers are
/// trusted, `reset_inside`; then only if the transaction did not commit). The `COMMIT` goes out only
/// once the statement was sent (its first poll pending): one that could
/// not even be sent must not let the handler's writes commit without it.
/// Also says whether the connection is clean (its transaction over, its
/// session reset).
async fn pipelined<F>(
    conn: &Conn,
    mut decided: Pin<&mut F>,
    reset_inside: bool,
) -> (Result<(), Failed>, bool)
where
    F: Future<Output = Result<Row, tokio_postgres::Error>>,
{
    let first = std::future::poll_fn(|cx| match decided.as_mut().poll(cx) {
        Poll::Ready(done) => Poll::Ready(Some(done)),
        Poll::Pending => Poll::Ready(None),
    })
    .await;
    let commit = !matches!(first, Some(Err(_)));
    let end = if commit { COMMIT } else { ROLLBACK };
    let statement = async {
        match first {
            Some(done) => done,
            None => decided.await,
        }
    };
    let reset = async {
        if reset_inside {
            return Ok(());
        }
        conn.reset_session().await
    };
    let (statement, ended, reset) = tokio::join!(biased; statement, conn.batch_execute(end), reset);
    let mut clean = ended.is_ok() && reset.is_ok();
    if clean && reset_inside && statement.is_err() {
        // Rolled back before the statement's reset ran: the session
        // advisory locks a handler's function took are still held.
        clean = conn.reset_session().await.is_ok();
    }
    let result = match (statement, ended) {
        (Err(e), _) => Err(failed(Step::Deciding, e, commit)),
        (Ok(_), Err(e)) => Err(failed(Step::End, e, commit)),
        (Ok(_), Ok(())) => Ok(()),
    };
    (result, clean)
}

/// The facts of a failed step.
fn failed(step: Step, e: tokio_postgres::Error, commit_sent: bool) -> Failed {
    let error = map_error(e);
    Failed {
        step,
        connection_lost: connection_lost(&error),
        error,
        commit_sent,
    }
}

/// Ends a transaction whose outcome does not matter; the connection goes
/// back to the pool only if that worked.
async fn rollback(mut conn: Conn) -> Result<(), StoreError> {
    conn.batch_execute(ROLLBACK).await.map_err(map_error)?;
    conn.mark_clean();
    Ok(())
}

/// `work`, answered by `deadline` whatever the database does.
pub(super) fn bounded<T>(
    deadline: Instant,
    work: impl Future<Output = Result<T, StoreError>>,
) -> impl Future<Output = Result<T, StoreError>> {
    tokio::time::timeout_at(deadline, work).map(|done| done.unwrap_or_else(|_| Err(timed_out())))
}

/// The database did not answer in time.
pub(super) fn timed_out() -> StoreError {
    crate::protocol::owner::timed_out()
}
