//! Types sqlx does not know, behind a transaction pooler: [`load_types`].

use std::{future::Future, pin::Pin};

use ::sqlx::{postgres::PgConnection, Connection as _, Executor as _, SqlSafeStr as _};

use crate::protocol::user_types::{describe_types, DEALLOCATE_ALL, USER_TYPES};

/// Types per loading statement.
const CHUNK: usize = 200;

/// Loads every user-defined type of the database (enums, domains, ranges,
/// extension types such as `citext`, standalone composites and their
/// arrays) into `conn`'s type cache, and leaves no prepared statement
/// behind, neither on the server connection nor in sqlx's statement cache.
///
/// sqlx looks an unknown type up the first time a statement meets it, with
/// a statement it prepares under a name and caches. Behind a pooler in
/// transaction mode (PgBouncer before 1.21 without `max_prepared_statements`)
/// that name exists only on the server connection of that transaction: the
/// next lookup on another one fails with `26000`, and the name left behind
/// collides with another client's (`42P05`). Call this for each new
/// connection of a pool that reaches the database through such a pooler:
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = sqlx::postgres::PgPoolOptions::new()
///     .after_connect(|conn, _| Box::pin(tower_idempotency::sqlx::load_types(conn)))
///     .connect("postgres://app@pgbouncer:6432/app")
///     .await?;
/// # Ok(()) }
/// ```
///
/// A type created after a connection was opened is still looked up as
/// sqlx does it; close the pool's connections (or restart) after creating
/// types that handlers use. Runs in one transaction of its own.
pub fn load_types(
    conn: &mut PgConnection,
) -> Pin<Box<dyn Future<Output = Result<(), ::sqlx::Error>> + Send + '_>> {
    Box::pin(async move {
        let mut tx = conn.begin().await?;
        let connection: &mut PgConnection = &mut tx;
        let names: Vec<String> = ::sqlx::query_scalar(USER_TYPES)
            .persistent(false)
            .fetch_all(&mut *connection)
            .await?;
        for chunk in names.chunks(CHUNK) {
            let select = describe_types(chunk);
            // Describing it makes sqlx look each column's type up.
            connection
                .describe(::sqlx::AssertSqlSafe(select).into_sql_str())
                .await?;
        }
        // sqlx's lookup statements, on this server connection only, and
        // then out of its cache, before the transaction ends.
        ::sqlx::query(DEALLOCATE_ALL)
            .persistent(false)
            .execute(&mut *connection)
            .await?;
        connection.clear_cached_statements().await?;
        tx.commit().await
    })
}
