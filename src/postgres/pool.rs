//! The connection pool: [`PgStoreBuilder`] (its size, timeouts and TCP
//! keepalives), building the deadpool pool, and taking a [`Conn`] from it.

use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, PoolError, RecyclingMethod, Runtime};
use tokio_postgres::NoTls;

use super::{conn::Conn, PgStore};
use crate::store::{StoreError, StoreErrorKind};

/// Builds a [`PgStore`] with pool settings.
#[derive(Debug, Clone)]
pub struct PgStoreBuilder {
    config: tokio_postgres::Config,
    max_connections: usize,
    acquire_timeout: Duration,
    connect_timeout: Duration,
    keepalive_idle: Duration,
    transaction_pooling: bool,
}

impl PgStoreBuilder {
    /// The defaults documented on each setting.
    pub(super) fn new(config: tokio_postgres::Config) -> Self {
        PgStoreBuilder {
            config,
            max_connections: 16,
            acquire_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            keepalive_idle: Duration::from_secs(15),
            transaction_pooling: false,
        }
    }

    /// The most connections the store's pool opens (default 16). Requests
    /// beyond it wait up to the acquire timeout.
    pub fn max_connections(self, n: usize) -> Self {
        crate::with(self, |b| b.max_connections = n.max(1))
    }

    /// How long a request waits for a pooled connection before the layer
    /// answers `503 store_unavailable` (default 5 s).
    pub fn acquire_timeout(self, timeout: Duration) -> Self {
        crate::with(self, |b| b.acquire_timeout = timeout)
    }

    /// How long opening a new connection may take (default 5 s).
    pub fn connect_timeout(self, timeout: Duration) -> Self {
        crate::with(self, |b| b.connect_timeout = timeout)
    }

    /// How long a pooled connection may be silent before TCP keepalive
    /// probes check that the server is still there (default 15 s; probes
    /// every 5 s, 3 of them). A database host that vanished without closing
    /// its sockets is then noticed in about 30 s instead of hours, and a
    /// request waiting on it gets an error instead of hanging. Replaces the
    /// connection configuration's keepalive settings; no effect on Unix
    /// sockets.
    pub fn keepalive_idle(self, idle: Duration) -> Self {
        crate::with(self, |b| b.keepalive_idle = idle)
    }

    /// The connection string names a pooler in transaction pooling mode
    /// (PgBouncer's `pool_mode = transaction`; RDS Proxy, Supavisor and PgCat
    /// behave alike): the server connection behind a pooled connection may
    /// change after every transaction, and after every statement outside
    /// one. Default `false` (PostgreSQL reached directly, or through a pooler
    /// in session mode).
    ///
    /// With `true`, nothing the store does relies on the server connection
    /// outliving a transaction:
    ///
    /// - the store's own statements go out unnamed, with their parameter
    ///   types given, in one round trip each (Parse, Bind, Execute and Sync
    ///   in one message: tokio-postgres `query_typed`), instead of prepared
    ///   once per connection and cached; the server plans them each time;
    /// - [`PgTx`](super::PgTx)'s statements are prepared for their one use
    ///   and closed inside the transaction, which costs a round trip each
    ///   ([`PgTx::query_typed`](super::PgTx::query_typed) saves it);
    /// - no session reset is sent after a transaction: it would run on
    ///   whichever server connection the pooler picks next (settings a
    ///   handler's function changed with `set_config(…, false)` are the
    ///   pooler's to reset: PgBouncer's `server_reset_query_always`);
    /// - the outbox [`Relay`](crate::outbox::Relay) does not `LISTEN`: it
    ///   polls.
    ///
    /// Application statements on [`PgStore::client`] must follow the same
    /// rule: inside an explicit transaction anything goes; outside one, use
    /// `query_typed`/`execute_typed` or `simple_query`, never a prepared or
    /// cached statement. Migrations work through the pooler (they hold a
    /// transaction-scoped advisory lock). See the
    /// [deploying guide](crate::guide::deploying) for the pooler's settings.
    pub fn transaction_pooling(self, on: bool) -> Self {
        crate::with(self, |b| b.transaction_pooling = on)
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
        Ok(PgStore {
            pool,
            config,
            transaction_pooling: self.transaction_pooling,
        })
    }
}

impl PgStore {
    /// A pooled connection, waiting up to the acquire timeout.
    pub(super) async fn conn(&self) -> Result<Conn, StoreError> {
        let pooling = self.transaction_pooling;
        self.pool
            .get()
            .await
            .map(|o| Conn::new(o, pooling))
            .map_err(|e| {
                let message = match &e {
                    PoolError::Timeout(_) => "timed out waiting for a pooled connection",
                    PoolError::Closed => "the connection pool is closed",
                    _ => "cannot open a database connection",
                };
                StoreError::new(StoreErrorKind::Unavailable, message).with_source(e)
            })
    }
}
