//! [`PgBouncer`]: the real connection pooler (Debian's `pgbouncer`, 1.18) in
//! transaction pooling mode, started in front of the test's PostgreSQL, so
//! that the store is tested as production runs it behind one.
//!
//! Settings as a production deployment would have them where they matter:
//! `pool_mode = transaction` (a server connection belongs to a client for one
//! transaction only: no named prepared statement, session setting, session
//! advisory lock or `LISTEN` survives), and a server pool per database
//! smaller than the application's pool, so that clients really do share
//! server connections. Every database name is forwarded (`*`), so the usual
//! database per test works through it.

use std::{
    fs,
    os::unix::{fs::PermissionsExt, process::CommandExt},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

use tokio_postgres::config::Host;

const INSTALL: &str = "PgBouncer is needed for the pooler tests and was not found \
     (looked for /usr/sbin/pgbouncer and `pgbouncer` on PATH): apt-get install pgbouncer";

/// The server connections PgBouncer keeps per database: fewer than any
/// application pool the tests build (10 and more).
pub(crate) const SERVER_POOL: usize = 4;

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A running PgBouncer in transaction pooling mode; stopped on drop.
pub(crate) struct PgBouncer {
    child: Option<Child>,
    watchdog: Option<Child>,
    dir: PathBuf,
    port: u16,
}

impl PgBouncer {
    /// Starts PgBouncer in front of the server `backend` names (its host,
    /// port, user and password; the database name is the client's).
    ///
    /// # Panics
    ///
    /// When `pgbouncer` is not installed (the message says what to install)
    /// or does not start; never skips.
    pub(crate) fn start(backend: &tokio_postgres::Config) -> PgBouncer {
        Self::start_with(backend, Pooling::Transaction)
    }

    /// [`start`](Self::start) in session pooling mode (a server connection
    /// belongs to one client for as long as it is connected), refusing the
    /// `options` startup parameter (`Pooling::SessionRefusingOptions`) or
    /// dropping it unread (`Pooling::SessionIgnoringOptions`).
    pub(crate) fn start_with(backend: &tokio_postgres::Config, pooling: Pooling) -> PgBouncer {
        let binary = find_binary().unwrap_or_else(|| panic!("{INSTALL}"));
        // A port race with another process is possible between this probe
        // and PgBouncer's bind: retry on another port.
        let mut last_error = String::new();
        for _ in 0..5 {
            match Self::try_start(&binary, backend, pooling) {
                Ok(bouncer) => return bouncer,
                Err(e) => last_error = e,
            }
        }
        panic!("PgBouncer did not start: {last_error}");
    }

    fn try_start(
        binary: &Path,
        backend: &tokio_postgres::Config,
        pooling: Pooling,
    ) -> Result<PgBouncer, String> {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "tower-idempotency-pgbouncer-{}-{n}",
            std::process::id()
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        // PgBouncer refuses to run as root: as root, run it as the `postgres`
        // user (as the cluster's initdb is), which must own its directory.
        let owner = if effective_uid() == Some(0) {
            Some(passwd_ids("postgres").ok_or(
                "running as root, which PgBouncer refuses, and there is no `postgres` user \
                 to run it as (apt-get install postgresql creates it)",
            )?)
        } else {
            None
        };
        let port = free_port()?;
        let ini = dir.join("pgbouncer.ini");
        fs::write(&ini, ini_text(backend, &dir, port, pooling)?)
            .map_err(|e| format!("writing {}: {e}", ini.display()))?;
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("{}: {e}", dir.display()))?;
        if let Some((uid, gid)) = owner {
            for path in [&dir, &ini] {
                std::os::unix::fs::chown(path, Some(uid), Some(gid))
                    .map_err(|e| format!("chown {}: {e}", path.display()))?;
            }
        }
        let mut command = Command::new(binary);
        command
            .arg(&ini)
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some((uid, gid)) = owner {
            command.uid(uid).gid(gid);
        }
        let child = command
            .spawn()
            .map_err(|e| format!("starting {}: {e}", binary.display()))?;
        let watchdog = spawn_watchdog(child.id());
        let mut bouncer = PgBouncer {
            child: Some(child),
            watchdog,
            dir,
            port,
        };
        bouncer.wait_ready()?;
        Ok(bouncer)
    }

    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok()?) {
                self.child = None;
                return Err(format!("pgbouncer exited ({status}); log:\n{}", self.log()));
            }
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "pgbouncer did not listen within 10 s; log:\n{}",
                    self.log()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The port PgBouncer listens on (127.0.0.1).
    pub(crate) fn port(&self) -> u16 {
        self.port
    }

    /// Connection settings for database `dbname` through PgBouncer.
    pub(crate) fn config(&self, dbname: &str) -> tokio_postgres::Config {
        let mut config = tokio_postgres::Config::new();
        config
            .host("127.0.0.1")
            .port(self.port)
            .user("postgres")
            .dbname(dbname);
        config
    }

    /// [`config`](Self::config) as a `DATABASE_URL` for a child process.
    pub(crate) fn url(&self, dbname: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{dbname}", self.port)
    }

    /// PgBouncer's log so far (for assertion messages).
    pub(crate) fn log(&self) -> String {
        fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        if let Some(mut watchdog) = self.watchdog.take() {
            let _ = watchdog.kill();
            let _ = watchdog.wait();
        }
        if let Some(mut child) = self.child.take() {
            // SIGKILL: nothing of a test's pooler needs a clean shutdown.
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// How a [`PgBouncer`] pools, and what it does with `options`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(dead_code)] // each test binary uses some
pub(crate) enum Pooling {
    /// Transaction pooling; `options` dropped unread.
    Transaction,
    /// Session pooling; a client that sends `options` is refused.
    SessionRefusingOptions,
    /// Session pooling; `options` dropped unread.
    SessionIgnoringOptions,
}

/// The configuration: transaction pooling (or as `pooling` says), a server
/// pool smaller than the application's, every database forwarded to
/// `backend`.
fn ini_text(
    backend: &tokio_postgres::Config,
    dir: &Path,
    port: u16,
    pooling: Pooling,
) -> Result<String, String> {
    let (mode, ignored) = match pooling {
        Pooling::Transaction => ("transaction", "extra_float_digits,options,application_name"),
        Pooling::SessionRefusingOptions => ("session", "extra_float_digits,application_name"),
        Pooling::SessionIgnoringOptions => {
            ("session", "extra_float_digits,options,application_name")
        }
    };
    let host = match backend.get_hosts().first() {
        Some(Host::Tcp(name)) => name.clone(),
        Some(Host::Unix(path)) => path.display().to_string(),
        None => return Err("the backend configuration names no host".into()),
    };
    let backend_port = backend.get_ports().first().copied().unwrap_or(5432);
    let user = backend.get_user().unwrap_or("postgres");
    let mut target = format!("host={host} port={backend_port} user={user}");
    if let Some(password) = backend.get_password() {
        target.push_str(&format!(" password={}", String::from_utf8_lossy(password)));
    }
    let dir = dir.display();
    Ok(format!(
        "[databases]\n\
         * = {target}\n\
         \n\
         [pgbouncer]\n\
         listen_addr = 127.0.0.1\n\
         listen_port = {port}\n\
         unix_socket_dir =\n\
         logfile = {dir}/pgbouncer.log\n\
         pidfile = {dir}/pgbouncer.pid\n\
         ; every client logs in as the user of the [databases] line\n\
         auth_type = any\n\
         pool_mode = {mode}\n\
         default_pool_size = {SERVER_POOL}\n\
         min_pool_size = 0\n\
         reserve_pool_size = 0\n\
         max_client_conn = 2000\n\
         ; what drivers send at startup that PgBouncer would otherwise refuse\n\
         ignore_startup_parameters = {ignored}\n\
         server_reset_query =\n\
         ; a client waits for a server connection at most this long\n\
         query_wait_timeout = 30\n\
         log_connections = 0\n\
         log_disconnections = 0\n"
    ))
}

fn find_binary() -> Option<PathBuf> {
    let sbin = PathBuf::from("/usr/sbin/pgbouncer");
    if sbin.is_file() {
        return Some(sbin);
    }
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|dir| dir.join("pgbouncer"))
        .find(|path| path.is_file())
}

fn free_port() -> Result<u16, String> {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0))
        .map_err(|e| format!("finding a free port: {e}"))?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|e| format!("finding a free port: {e}"))
}

/// Stops PgBouncer should this test process die without running `Drop`.
fn spawn_watchdog(pid: u32) -> Option<Child> {
    let me = std::process::id();
    let script =
        format!("while kill -0 {me} 2>/dev/null; do sleep 1; done; kill -KILL {pid} 2>/dev/null");
    Command::new("sh")
        .arg("-c")
        .arg(script)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .ok()
}

fn effective_uid() -> Option<u32> {
    let status = fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok()
}

fn passwd_ids(user: &str) -> Option<(u32, u32)> {
    let passwd = fs::read_to_string("/etc/passwd").ok()?;
    passwd
        .lines()
        .find_map(|line| match line.split(':').collect::<Vec<_>>()[..] {
            [name, _, uid, gid, ..] if name == user => Some((uid.parse().ok()?, gid.parse().ok()?)),
            _ => None,
        })
}
