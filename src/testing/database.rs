//! The per-test database: [`TestDatabase`], a fresh database per test, on the server named
//! by `DATABASE_URL` when it is set, otherwise on one [`TempPostgres`] cluster shared by the
//! whole test process; on a `DATABASE_URL` server, databases left by killed test processes
//! are dropped first.

use std::path::Path;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use super::cluster::{left_by_dead_process, HarnessError, TempPostgres};

const DB_PREFIX: &str = "tidem_";

static DB_COUNTER: AtomicU64 = AtomicU64::new(0);
static CLUSTER: OnceLock<Result<TempPostgres, String>> = OnceLock::new();
static STALE_DATABASES_SWEPT: AtomicBool = AtomicBool::new(false);

/// One fresh database per test, on `DATABASE_URL` when set, otherwise on a cluster shared by
/// the whole test process.
#[derive(Debug)]
pub struct TestDatabase {
    name: String,
    config: tokio_postgres::Config,
}

impl TestDatabase {
    /// Create a uniquely named, empty database.
    ///
    /// # Panics
    ///
    /// When no server can be used; the message says what to install or configure.
    pub async fn create() -> TestDatabase {
        Self::try_create().await.unwrap_or_else(|e| panic!("{e}"))
    }

    /// A database made elsewhere (a [`TempCitus`](super::TempCitus)'s).
    pub(super) fn from_parts(name: String, config: tokio_postgres::Config) -> TestDatabase {
        TestDatabase { name, config }
    }

    /// Connection settings pointing at the new database.
    pub fn config(&self) -> tokio_postgres::Config {
        self.config.clone()
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Connection settings in key=value form, for a child process's `DATABASE_URL`.
    pub fn connection_string(&self) -> String {
        let quote = |v: &str| format!("'{}'", v.replace('\\', "\\\\").replace('\'', "\\'"));
        let mut parts = Vec::new();
        if let Some(host) = self.config.get_hosts().first() {
            let host = match host {
                tokio_postgres::config::Host::Tcp(name) => name.clone(),
                tokio_postgres::config::Host::Unix(path) => path.display().to_string(),
            };
            parts.push(format!("host={}", quote(&host)));
        }
        if let Some(port) = self.config.get_ports().first() {
            parts.push(format!("port={port}"));
        }
        if let Some(user) = self.config.get_user() {
            parts.push(format!("user={}", quote(user)));
        }
        if let Some(password) = self.config.get_password() {
            parts.push(format!(
                "password={}",
                quote(&String::from_utf8_lossy(password))
            ));
        }
        parts.push(format!("dbname={}", quote(&self.name)));
        parts.join(" ")
    }

    /// Connect without TLS, driving the connection on a spawned task.
    ///
    /// # Panics
    ///
    /// When the connection fails.
    pub async fn client(&self) -> tokio_postgres::Client {
        let client = connect(&self.config).await;
        client.unwrap_or_else(|e| panic!("connecting to test database {}: {e}", self.name))
    }

    async fn try_create() -> Result<TestDatabase, HarnessError> {
        let url = std::env::var("DATABASE_URL")
            .ok()
            .filter(|u| !u.trim().is_empty());
        let mut config = match &url {
            Some(url) => {
                tokio_postgres::Config::from_str(url).map_err(HarnessError::InvalidDatabaseUrl)?
            }
            // OnceLock makes concurrent tests wait for one start; spawn_blocking keeps that wait
            // off the async workers (block_in_place panics on current_thread runtimes).
            None => tokio::task::spawn_blocking(shared_cluster_config)
                .await
                .map_err(|e| HarnessError::SharedCluster(e.to_string()))??,
        };
        let admin = connect(&config).await?;
        if url.is_some() && !STALE_DATABASES_SWEPT.swap(true, Relaxed) {
            drop_stale_databases(&admin).await;
        }
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let n = DB_COUNTER.fetch_add(1, Relaxed);
        let name = format!("{DB_PREFIX}{}_{n}_{nanos}", std::process::id());
        let create = format!("CREATE DATABASE \"{name}\"");
        admin
            .batch_execute(&create)
            .await
            .map_err(HarnessError::Database)?;
        config.dbname(&name);
        Ok(TestDatabase { name, config })
    }
}

fn shared_cluster_config() -> Result<tokio_postgres::Config, HarnessError> {
    match CLUSTER.get_or_init(|| TempPostgres::start().map_err(|e| e.to_string())) {
        Ok(cluster) => Ok(cluster.config()),
        Err(message) => Err(HarnessError::SharedCluster(message.clone())),
    }
}

pub(super) async fn connect(
    config: &tokio_postgres::Config,
) -> Result<tokio_postgres::Client, HarnessError> {
    let connected = config.connect(tokio_postgres::NoTls).await;
    let (client, connection) = connected.map_err(HarnessError::Database)?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "test database connection ended with an error");
        }
    });
    Ok(client)
}

// Databases left on a long-lived DATABASE_URL server by test processes that were killed.
async fn drop_stale_databases(client: &tokio_postgres::Client) {
    if !Path::new("/proc/self").exists() {
        return; // without /proc every pid would look dead
    }
    let Ok(rows) = client.query("SELECT datname FROM pg_database", &[]).await else {
        return;
    };
    for name in rows.iter().map(|row| row.get::<_, String>(0)) {
        if left_by_dead_process(&name, DB_PREFIX, '_') {
            let drop = format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)");
            let _ = client.batch_execute(&drop).await;
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// The first column of the one row `sql` returns.
    pub(in crate::testing) async fn query_one<T>(client: &tokio_postgres::Client, sql: &str) -> T
    where
        T: for<'a> tokio_postgres::types::FromSql<'a>,
    {
        client.query_one(sql, &[]).await.unwrap().get(0)
    }

    #[tokio::test]
    async fn test_databases_are_distinct() {
        let (a, b) = (TestDatabase::create().await, TestDatabase::create().await);
        assert_ne!(a.name(), b.name());
        for db in [&a, &b] {
            let current: String = query_one(&db.client().await, "SELECT current_database()").await;
            assert_eq!(current, db.name());
        }
    }
}
