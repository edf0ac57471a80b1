//! Types the driver does not know, behind a transaction pooler.
//!
//! tokio-postgres looks a type up (an enum, a domain, `citext`, …) the first
//! time a statement meets its OID, with a lookup statement it prepares under
//! a name and keeps for the client's life. Behind a pooler in transaction
//! mode that name exists only on the server connection the transaction had:
//! a later lookup on another one fails (`26000`), and the name left behind
//! can collide with another client's (`42P05`). So each new connection of a
//! store built for a pooler loads every user-defined type into its cache in
//! one transaction, and deallocates the lookup statements before that
//! transaction ends, on the same server connection. A type created after a
//! connection was opened is still looked up, and fails that request once:
//! the connection is then closed (`Conn::poison`) and its replacement loads
//! the new type.

use tokio_postgres::{Client, SimpleQueryMessage};

use crate::protocol::{
    transaction::{BEGIN, COMMIT, ROLLBACK},
    user_types::{describe_types, DEALLOCATE_ALL, USER_TYPES},
};

/// Types per loading statement.
const CHUNK: usize = 200;

/// Loads every user-defined type of the database (enums, domains, ranges,
/// extension types such as `citext`, standalone composites and their
/// arrays) into `client`'s type cache, in one transaction that leaves no
/// prepared statement on the server connection.
///
/// A store built with
/// [`transaction_pooling(true)`](super::PgStoreBuilder::transaction_pooling)
/// does this for each connection its pool opens. A pool you build yourself
/// ([`PgStoreBuilder::pool`](super::PgStoreBuilder::pool)) behind a
/// transaction pooler needs it too, in a `post_create` hook:
///
/// ```no_run
/// use deadpool_postgres::{Hook, HookError, Manager, Pool};
///
/// # fn build(manager: Manager) -> Result<(), Box<dyn std::error::Error>> {
/// let pool = Pool::builder(manager)
///     .post_create(Hook::async_fn(|client, _| {
///         Box::pin(async move {
///             tower_idempotency::postgres::load_types(client)
///                 .await
///                 .map_err(HookError::Backend)
///         })
///     }))
///     .build()?;
/// # Ok(()) }
/// ```
///
/// A type created after a connection opened is looked up as tokio-postgres
/// does it: behind the pooler that request fails once (`26000`), and a
/// store's connection is then closed and replaced.
pub async fn load_types(client: &Client) -> Result<(), tokio_postgres::Error> {
    client.batch_execute(BEGIN).await?;
    let loaded = load(client).await;
    let end = if loaded.is_ok() { COMMIT } else { ROLLBACK };
    let ended = client.batch_execute(end).await;
    loaded.and(ended)
}

async fn load(client: &Client) -> Result<(), tokio_postgres::Error> {
    let names: Vec<String> = client
        .simple_query(USER_TYPES)
        .await?
        .into_iter()
        .filter_map(|message| match message {
            SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
            _ => None,
        })
        .collect();
    for chunk in names.chunks(CHUNK) {
        // Preparing it describes its columns: the driver looks each type
        // up. The statement itself is closed when dropped, here, before the
        // DEALLOCATE below and inside the transaction.
        drop(client.prepare(&describe_types(chunk)).await?);
    }
    // The driver's own lookup statements, on this server connection only.
    client.batch_execute(DEALLOCATE_ALL).await
}
