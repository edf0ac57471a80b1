//! [`PgStore`]: keys arbitrated by a PostgreSQL primary key, responses
//! committed in the handler's own transaction.
//!
//! The handler writes through [`PgTx`] (in the long-running mode,
//! [`PgLease`]). The statements a request sends, and how long each may wait:
//! [how a request flows](crate::guide::request_flow). What the handle refuses
//! and how every pooled connection goes back clean:
//! [the transaction handle](crate::guide::transaction). No `SELECT` decides
//! ownership: the unique index does.

// The driver's part only: every statement, row decoding and decision, and
// the owner's transaction itself, are the protocol's (`crate::protocol`).
// Here, one concern per file: the seam (`driver.rs`: what this driver
// sends, pipelined, for the protocol); how a statement is sent, cached or
// unnamed (`prepared.rs`); the connection guard and the application's
// connection (`conn.rs`); the pool (`pool.rs`), its connection string
// (`conninfo.rs`) and TLS (`tls.rs`); error mapping (`error.rs`); the
// handler's transaction (`tx/`); the long-running owner's lease (`lease/`);
// the operator API (`admin.rs`); user-defined types behind a pooler
// (`types.rs`); and `Session` (`session.rs`), the one way the rest of the
// crate (the outbox relay, retention) runs statements on the pool.

use std::{fmt, str::FromStr};

use deadpool_postgres::Pool;

use crate::store::StoreError;

mod admin;
pub(crate) mod conn;
mod conninfo;
mod driver;
mod error;
pub(crate) mod lease;
mod pool;
pub(crate) mod prepared;
mod session;
pub(crate) mod tls;
mod tx;
mod types;

pub use conn::PooledClient;
// Their home is `store`; the paths under `postgres` stay.
#[doc(no_inline)]
pub use crate::store::{KeyRecord, KeyState};
pub use lease::{FencedTx, PgLease};
pub use pool::{PgStoreBuilder, SessionReset};
pub use tx::{PgTx, TxError, TxErrorKind};
pub use types::load_types;

use error::map_error;

/// The PostgreSQL [`Store`](crate::store::Store).
///
/// Cheap to clone (a pool handle). Create it with [`PgStore::connect`] or
/// [`PgStore::builder`], then run [`PgStore::migrate`] once at start-up (safe
/// from many processes at once).
///
/// ```no_run
/// # async fn run() -> Result<(), tower_idempotency::store::StoreError> {
/// use tower_idempotency::postgres::PgStore;
///
/// let store = PgStore::connect("postgres://app@localhost/app")?;
/// store.migrate().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PgStore {
    pool: Pool,
    config: std::sync::Arc<tokio_postgres::Config>,
    connector: tls::Connector,
    transaction_pooling: bool,
    /// Whether the database is a Citus coordinator: unknown (0) until the
    /// first claim asks (or `migrate` finds out), then no (1) or yes (2).
    /// On Citus the claim is sent as separate router statements (see
    /// `protocol::owner`). Shared by every clone.
    citus: std::sync::Arc<std::sync::atomic::AtomicU8>,
    /// What the store's sessions hold between transactions.
    session: conn::SessionDefaults,
}

impl fmt::Debug for PgStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let status = self.pool.status();
        f.debug_struct("PgStore")
            .field("max_connections", &status.max_size)
            .field("connections", &status.size)
            .field("transaction_pooling", &self.transaction_pooling)
            .field("tls", &self.connector)
            .finish()
    }
}

impl PgStore {
    /// A builder from a parsed configuration.
    pub fn builder(config: tokio_postgres::Config) -> PgStoreBuilder {
        PgStoreBuilder::new(config)
    }

    /// A store for a connection string (`postgres://…` or `host=… user=…`)
    /// with default pool settings. libpq's TLS parameters (`sslmode`,
    /// `sslrootcert`, `sslcert`, `sslkey`) have libpq's meaning; see
    /// [`PgStoreBuilder::from_conninfo`].
    pub fn connect(conninfo: &str) -> Result<PgStore, StoreError> {
        PgStoreBuilder::from_str(conninfo)?.build()
    }

    /// Creates or upgrades the schema (`idempotency_requests`). Idempotent;
    /// concurrent callers serialise on an advisory lock.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let summary = crate::protocol::migrations::migrate(self).await?;
        self.found_citus(summary.citus);
        Ok(())
    }

    /// On a Citus coordinator, distributes the application's `tables` by
    /// `tenant_id`, co-located with the crate's own (which
    /// [`migrate`](Self::migrate) distributes there), so that a request's
    /// claim, its writes and its remembered response go to one worker and
    /// commit there without a two-phase commit. Returns `false`, having done
    /// nothing, when the database has no Citus; tables already distributed
    /// are left as they are. Call it after `migrate` and after creating the
    /// tables; every primary key and unique constraint of each must include
    /// `tenant_id`, and Citus refuses triggers on them. See the deploying
    /// guide (`docs/deploying.md`, Citus).
    pub async fn distribute_by_tenant(&self, tables: &[&str]) -> Result<bool, StoreError> {
        let citus = crate::protocol::citus::distribute_on(self, tables).await?;
        self.found_citus(citus);
        Ok(citus)
    }

    pub(crate) fn found_citus(&self, citus: bool) {
        let state = if citus { 2 } else { 1 };
        self.citus
            .store(state, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the database is a Citus coordinator, if known.
    pub(crate) fn on_citus(&self) -> Option<bool> {
        match self.citus.load(std::sync::atomic::Ordering::Relaxed) {
            0 => None,
            state => Some(state == 2),
        }
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
        conn.mark_dirty();
        Ok(PooledClient::new(conn))
    }

    /// Whether the store was built for a transaction pooler
    /// ([`PgStoreBuilder::transaction_pooling`]); the same as
    /// [`SqlxStore::uses_transaction_pooling`](crate::sqlx::SqlxStore::uses_transaction_pooling).
    pub fn uses_transaction_pooling(&self) -> bool {
        self.transaction_pooling
    }

    /// Opens a dedicated connection outside the pool (e.g. for `LISTEN`),
    /// with the pool's TLS; its messages drive it.
    pub(crate) async fn dedicated(
        &self,
    ) -> Result<(tokio_postgres::Client, tls::Messages), StoreError> {
        self.connector
            .connect(&self.config)
            .await
            .map_err(map_error)
    }
}

crate::protocol::forward_store!(PgStore, PgTx);

// Long-running operations; see [`lease`](crate::lease) and [`PgLease`].
crate::protocol::forward_lease_store!(PgStore, PgLease, PgTx);
