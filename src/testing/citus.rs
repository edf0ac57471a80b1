//! A throwaway Citus cluster: [`TempCitus`], a coordinator and its workers,
//! each a [`TempPostgres`] with the `citus` library loaded, listening on
//! loopback TCP (the coordinator reaches its workers there), and a fresh
//! database per test on all of them with the extension created and the
//! workers added ([`TempCitus::database`]).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::cluster::{HarnessError, TempPostgres};
use super::database::{connect, TestDatabase};

static DB_COUNTER: AtomicU64 = AtomicU64::new(0);

/// How many shards a table distributed in a test database gets (Citus's
/// default is 32: a test distributes a handful of tables, and each shard
/// is a table on a worker).
pub const TEST_SHARD_COUNT: u32 = 4;

/// A Citus coordinator and its workers, private and temporary; stopped and
/// removed on drop.
#[derive(Debug)]
pub struct TempCitus {
    coordinator: Node,
    workers: Vec<Node>,
    /// Databases are set up one at a time: Citus's node activation fails
    /// ("failure on connection marked as essential") when two databases'
    /// run at once.
    setup: tokio::sync::Mutex<()>,
}

#[derive(Debug)]
struct Node {
    server: TempPostgres,
    port: u16,
}

impl TempCitus {
    /// Start a coordinator and `workers` workers; blocks for a few seconds.
    ///
    /// Fails with [`HarnessError::CitusNotInstalled`] when the server
    /// binaries found have no Citus beside them.
    pub fn start(workers: usize) -> Result<TempCitus, HarnessError> {
        let node = || -> Result<Node, HarnessError> {
            let port = free_port()?;
            let server = TempPostgres::builder()
                .tcp(port)
                .setting("shared_preload_libraries", "citus")
                .setting("max_connections", "300")
                .setting("citus.shard_count", TEST_SHARD_COUNT.to_string())
                // Between the nodes, on loopback: plain (the servers run with
                // the test's HOME, where libpq would look for a client
                // certificate). Clients still get TLS: Citus turns it on with
                // a certificate of its own.
                .setting("citus.node_conninfo", "sslmode=disable")
                .start()?;
            Ok(Node { server, port })
        };
        let first = node()?;
        citus_installed(first.server.bin_dir())?;
        let workers = (0..workers).map(|_| node()).collect::<Result<_, _>>()?;
        Ok(TempCitus {
            coordinator: first,
            workers,
            setup: tokio::sync::Mutex::new(()),
        })
    }

    /// The coordinator's server.
    pub fn coordinator(&self) -> &TempPostgres {
        &self.coordinator.server
    }

    /// The workers' servers.
    pub fn workers(&self) -> impl Iterator<Item = &TempPostgres> {
        self.workers.iter().map(|node| &node.server)
    }

    /// A fresh database of the same name on every node, with the `citus`
    /// extension in each and the workers added to the coordinator's. Its
    /// connection settings name the coordinator over loopback TCP, where it
    /// offers TLS with the self-signed certificate Citus makes.
    pub async fn database(&self) -> Result<TestDatabase, HarnessError> {
        let _one_at_a_time = self.setup.lock().await;
        let n = DB_COUNTER.fetch_add(1, Relaxed);
        let name = format!("tidem_citus_{}_{n}", std::process::id());
        for node in self.workers.iter().chain([&self.coordinator]) {
            let admin = connect(&node.server.config()).await?;
            admin
                .batch_execute(&format!("CREATE DATABASE \"{name}\""))
                .await
                .map_err(HarnessError::Database)?;
            let mut config = node.server.config();
            config.dbname(&name);
            connect(&config)
                .await?
                .batch_execute("CREATE EXTENSION citus")
                .await
                .map_err(HarnessError::Database)?;
        }
        let mut config = self.coordinator.server.config();
        config.dbname(&name);
        let coordinator = connect(&config).await?;
        let mut setup = format!(
            "SELECT citus_set_coordinator_host('127.0.0.1', {});",
            self.coordinator.port
        );
        for worker in &self.workers {
            setup.push_str(&format!(
                "SELECT citus_add_node('127.0.0.1', {});",
                worker.port
            ));
        }
        coordinator
            .batch_execute(&setup)
            .await
            .map_err(HarnessError::Database)?;
        let mut tcp = tokio_postgres::Config::new();
        tcp.host("127.0.0.1")
            .port(self.coordinator.port)
            .user("postgres")
            .dbname(&name);
        Ok(TestDatabase::from_parts(name, tcp))
    }
}

/// Whether Citus is installed beside the server binaries in `bin`.
fn citus_installed(bin: &Path) -> Result<(), HarnessError> {
    let libdir = Command::new(bin.join("pg_config"))
        .arg("--pkglibdir")
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
        .unwrap_or_else(|| bin.with_file_name("lib"));
    if libdir.join("citus.so").is_file() {
        Ok(())
    } else {
        Err(HarnessError::CitusNotInstalled {
            libdir: libdir.display().to_string(),
        })
    }
}

fn free_port() -> Result<u16, HarnessError> {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .map_err(|source| HarnessError::Io {
            context: "finding a free port".into(),
            source,
        })
}
