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
        }
    }

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
    /// A pooled connection, waiting up to the acquire timeout.
    pub(super) async fn conn(&self) -> Result<Conn, StoreError> {
        self.pool.get().await.map(Conn::new).map_err(|e| {
            let message = match &e {
                PoolError::Timeout(_) => "timed out waiting for a pooled connection",
                PoolError::Closed => "the connection pool is closed",
                _ => "cannot open a database connection",
            };
            StoreError::new(StoreErrorKind::Unavailable, message).with_source(e)
        })
    }
}
