//! The throwaway cluster: [`TempPostgres`], a private PostgreSQL server in a temporary
//! directory, found on this machine, initialised (as the `postgres` user when running as
//! root), watched so that it stops when the process exits, and removed on drop, along with
//! clusters left behind by test processes that were killed (`host.rs`). Also
//! [`HarnessError`] (`error.rs`), shared with the per-test databases of the `database` module.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

const DIR_PREFIX: &str = "tower-idempotency-pg-";
// Names the socket file; the server listens on a private socket directory, and on TCP only
// when a test asks for it (`TempPostgresBuilder::tcp`).
const PORT: u16 = 5432;
const READY_TIMEOUT: Duration = Duration::from_secs(30);
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
const INSTALL: &str =
    "install PostgreSQL's server package (Debian/Ubuntu: apt-get install -y postgresql)";

static DIR_COUNTER: AtomicU64 = AtomicU64::new(0);

mod error;
mod host;

pub use error::HarnessError;
pub(super) use host::left_by_dead_process;

use error::io_err;
use host::{
    effective_uid, find_bin_dir, passwd_ids, quiet, signal_int, spawn_watchdog, sweep_stale_dirs,
};

/// Options for a [`TempPostgres`]; obtained from [`TempPostgres::builder`].
#[derive(Debug, Clone, Default)]
pub struct TempPostgresBuilder {
    durable: bool,
    settings: Vec<(String, String)>,
    tcp_port: Option<u16>,
    hba: Option<String>,
    files: Vec<(String, Vec<u8>)>,
}

impl TempPostgresBuilder {
    /// Keep `fsync`, `synchronous_commit` and `full_page_writes` at their safe defaults, for
    /// benchmarks that must pay real commit costs. Off by default.
    pub fn durable(self, durable: bool) -> Self {
        crate::setter::with(self, |s| s.durable = durable)
    }

    /// Pass `-c name=value` to the server; later settings override earlier ones.
    pub fn setting(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.settings.push((name.into(), value.into()));
        self
    }

    /// Also listen on TCP, on `127.0.0.1:port` (the socket file then carries
    /// that port's number too). Pick a free port, e.g. by binding port 0.
    pub fn tcp(self, port: u16) -> Self {
        crate::setter::with(self, |s| s.tcp_port = Some(port))
    }

    /// Replace `pg_hba.conf` with `contents` before the server starts. Keep
    /// a `local` line that lets `postgres` in: the cluster checks that it is
    /// ready, and makes test databases, over its Unix socket.
    pub fn hba(self, contents: impl Into<String>) -> Self {
        crate::setter::with(self, |s| s.hba = Some(contents.into()))
    }

    /// Write a file into the data directory before the server starts (mode
    /// 0600, owned by the server's user): certificates and keys for
    /// `ssl_cert_file`, `ssl_key_file` and `ssl_ca_file`, which take paths
    /// relative to it.
    pub fn file(mut self, name: impl Into<String>, contents: impl Into<Vec<u8>>) -> Self {
        self.files.push((name.into(), contents.into()));
        self
    }

    /// Create, start and wait for the cluster; blocks for about a second.
    pub fn start(self) -> Result<TempPostgres, HarnessError> {
        let bin = find_bin_dir()?;
        sweep_stale_dirs();
        let owner = match effective_uid() {
            Some(0) => Some(passwd_ids("postgres").ok_or(HarnessError::PostgresUserMissing)?),
            _ => None,
        };
        let n = DIR_COUNTER.fetch_add(1, Relaxed);
        let name = format!("{DIR_PREFIX}{}-{n}", std::process::id());
        let dir = std::env::temp_dir().join(name);
        // A leftover from an earlier process with our pid is never swept as stale.
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
        // From here on, Drop cleans up whatever fails.
        let data_dir = dir.join("data");
        let mut pg = TempPostgres {
            dir,
            data_dir,
            bin_dir: bin.clone(),
            port: self.tcp_port.unwrap_or(PORT),
            owner,
            server_args: Vec::new(),
            child: None,
            watchdog: None,
        };
        pg.init(&bin, owner, &self)?;
        Ok(pg)
    }
}

/// A private, temporary PostgreSQL cluster; stopped and removed on drop.
#[derive(Debug)]
pub struct TempPostgres {
    dir: PathBuf,
    data_dir: PathBuf,
    bin_dir: PathBuf,
    /// The socket's port number, and the TCP port when it listens on TCP.
    port: u16,
    /// The `postgres` OS user's ids, when running as root.
    owner: Option<(u32, u32)>,
    /// The server's command line after the binary, kept for restarts.
    server_args: Vec<String>,
    child: Option<Child>,
    watchdog: Option<Child>,
}

/// How [`TempPostgres::stop`] shuts the server down, as `pg_ctl stop -m`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Shutdown {
    /// `-m fast` (`SIGINT`): sessions are ended, open transactions rolled
    /// back, and the server shuts down cleanly.
    Fast,
    /// `-m immediate` (`SIGQUIT`): every process exits at once, as in a
    /// crash; the next start replays the WAL.
    Immediate,
}

impl TempPostgres {
    /// Start a cluster with the default (fast, non-durable) settings; blocking.
    pub fn start() -> Result<TempPostgres, HarnessError> {
        Self::builder().start()
    }

    /// Configure a cluster before starting it.
    pub fn builder() -> TempPostgresBuilder {
        TempPostgresBuilder::default()
    }

    /// Connection settings for the `postgres` database as the `postgres` superuser.
    pub fn config(&self) -> tokio_postgres::Config {
        let mut config = tokio_postgres::Config::new();
        config.host_path(&self.dir).port(self.port);
        config.user("postgres").dbname("postgres");
        config
    }

    /// The same settings as [`config`](Self::config), in libpq key=value form.
    pub fn connection_string(&self) -> String {
        let host = conninfo_quote(&self.dir.to_string_lossy());
        format!(
            "host={host} port={} user=postgres dbname=postgres",
            self.port
        )
    }

    /// The directory of the server binaries it was started from (`pgbench`,
    /// `psql` and friends are there too).
    pub fn bin_dir(&self) -> &Path {
        &self.bin_dir
    }

    /// The cluster's data directory.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    fn init(
        &mut self,
        bin: &Path,
        owner: Option<(u32, u32)>,
        opts: &TempPostgresBuilder,
    ) -> Result<(), HarnessError> {
        let (dir, data_dir) = (&self.dir, &self.data_dir);
        let as_owner = |cmd: &mut Command| {
            // initdb refuses root, and the server must own the socket directory it writes to.
            if let Some((uid, gid)) = owner {
                cmd.uid(uid).gid(gid);
            }
            cmd.current_dir(dir);
        };
        fs::create_dir(data_dir).map_err(io_err("creating the data directory"))?;
        for (path, mode) in [(dir, 0o755), (data_dir, 0o700)] {
            let context = format!("setting up {}", path.display());
            fs::set_permissions(path, fs::Permissions::from_mode(mode))
                .and_then(|()| match owner {
                    Some((uid, gid)) => std::os::unix::fs::chown(path, Some(uid), Some(gid)),
                    None => Ok(()),
                })
                .map_err(io_err(context))?;
        }

        let mut initdb = Command::new(bin.join("initdb"));
        initdb.arg("-D").arg(data_dir).stdin(Stdio::null());
        initdb.args("--locale=C -E UTF8 -U postgres --auth=trust -N".split(' '));
        as_owner(&mut initdb);
        let out = initdb.output().map_err(io_err("running initdb"))?;
        if !out.status.success() {
            let mut stderr = String::from_utf8_lossy(&out.stdout).into_owned();
            stderr.push_str(&String::from_utf8_lossy(&out.stderr));
            return Err(HarnessError::Initdb { stderr });
        }

        let data_file = |name: &str, contents: &[u8]| {
            let path = data_dir.join(name);
            fs::write(&path, contents)
                .and_then(|()| fs::set_permissions(&path, fs::Permissions::from_mode(0o600)))
                .and_then(|()| match owner {
                    Some((uid, gid)) => std::os::unix::fs::chown(&path, Some(uid), Some(gid)),
                    None => Ok(()),
                })
                .map_err(io_err(format!("writing {}", path.display())))
        };
        if let Some(hba) = &opts.hba {
            data_file("pg_hba.conf", hba.as_bytes())?;
        }
        for (name, contents) in &opts.files {
            data_file(name, contents)?;
        }
        let listen = match opts.tcp_port {
            Some(_) => "127.0.0.1",
            None => "",
        };
        let mut fixed =
            format!("listen_addresses={listen} max_connections=300 shared_buffers=128MB");
        if !opts.durable {
            fixed.push_str(" fsync=off synchronous_commit=off full_page_writes=off");
        }
        let custom = opts.settings.iter().map(|(k, v)| format!("{k}={v}"));
        let mut args = vec!["-D".to_owned(), data_dir.to_string_lossy().into_owned()];
        args.extend(["-k".to_owned(), dir.to_string_lossy().into_owned()]);
        args.extend(["-p".to_owned(), self.port.to_string()]);
        for setting in fixed.split(' ').map(String::from).chain(custom) {
            args.extend(["-c".to_owned(), setting]);
        }
        self.server_args = args;
        self.launch()
    }

    /// Starts the server with the command line `init` chose, and waits until
    /// it accepts connections.
    fn launch(&mut self) -> Result<(), HarnessError> {
        let log_path = self.dir.join("server.log");
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(io_err("opening server.log"))?;
        let log_copy = log
            .try_clone()
            .map_err(io_err("duplicating a file handle"))?;
        let mut server = Command::new(self.bin_dir.join("postgres"));
        server.args(&self.server_args).current_dir(&self.dir);
        if let Some((uid, gid)) = self.owner {
            server.uid(uid).gid(gid);
        }
        server.stdin(Stdio::null()).stdout(log_copy).stderr(log);
        let child = server.spawn().map_err(io_err("starting postgres"))?;
        let pg_pid = child.id();
        self.child = Some(child);
        self.watchdog = spawn_watchdog(pg_pid, &self.dir);

        let isready = Some(self.bin_dir.join("pg_isready")).filter(|p| p.is_file());
        let mut isready = Command::new(isready.unwrap_or_else(|| "pg_isready".into()));
        isready.arg("-h").arg(&self.dir);
        quiet(isready.args(["-p", &self.port.to_string(), "-U", "postgres"]));
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok()?) {
                self.child = None;
                self.stop_watchdog();
                let (status, log_tail) = (status.to_string(), log_tail(&log_path));
                return Err(HarnessError::ServerExited { status, log_tail });
            }
            let ready = isready.status().map_err(io_err("running pg_isready"))?;
            if ready.success() {
                tracing::debug!(dir = %self.dir.display(), pid = pg_pid, "temporary postgres ready");
                return Ok(());
            }
            if Instant::now() >= deadline {
                let log_tail = log_tail(&log_path);
                return Err(HarnessError::StartTimeout { log_tail });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the server as `pg_ctl stop -m fast` or `-m immediate` would
    /// (the signals those send), and waits until it has exited; blocking.
    /// Connections fail from then on, until [`start_again`](Self::start_again).
    pub fn stop(&mut self, mode: Shutdown) -> Result<(), HarnessError> {
        self.stop_watchdog();
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let signal = match mode {
            Shutdown::Fast => "-INT",
            Shutdown::Immediate => "-QUIT",
        };
        let _ = quiet(Command::new("kill").arg(signal).arg(child.id().to_string())).status();
        let deadline = Instant::now() + STOP_TIMEOUT;
        while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        if !matches!(child.try_wait(), Ok(Some(_))) {
            let _ = child.kill();
        }
        child
            .wait()
            .map_err(io_err("waiting for postgres to stop"))?;
        Ok(())
    }

    /// Starts a stopped server again on the same data directory and socket
    /// (after [`Shutdown::Immediate`] it first recovers from its WAL), and
    /// waits until it accepts connections; blocking.
    pub fn start_again(&mut self) -> Result<(), HarnessError> {
        if let Some(child) = self.child.as_mut() {
            if matches!(child.try_wait(), Ok(None)) {
                return Ok(());
            }
            // It died on its own (or never became ready): start it anew.
            self.child = None;
            self.stop_watchdog();
        }
        self.launch()
    }

    /// [`stop`](Self::stop) then [`start_again`](Self::start_again): what
    /// `pg_ctl restart -m …` does; blocking.
    pub fn restart(&mut self, mode: Shutdown) -> Result<(), HarnessError> {
        self.stop(mode)?;
        self.start_again()
    }

    fn stop_watchdog(&mut self) {
        // Once the server is gone its pid may be reused by an unrelated
        // process, which the watchdog would otherwise signal when we exit.
        if let Some(mut watchdog) = self.watchdog.take() {
            let _ = watchdog.kill();
            let _ = watchdog.wait();
        }
    }
}

impl Drop for TempPostgres {
    fn drop(&mut self) {
        self.stop_watchdog();
        if let Some(mut child) = self.child.take() {
            // SIGINT is a fast but clean shutdown; Child::kill would be SIGKILL.
            signal_int(child.id());
            let deadline = Instant::now() + STOP_TIMEOUT;
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if !matches!(child.try_wait(), Ok(Some(_))) {
                tracing::warn!(
                    pid = child.id(),
                    "temporary postgres did not stop; killing it"
                );
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

fn log_tail(path: &Path) -> String {
    let bytes = fs::read(path).unwrap_or_default();
    String::from_utf8_lossy(&bytes[bytes.len().saturating_sub(4000)..]).into_owned()
}

fn conninfo_quote(s: &str) -> String {
    if !s.is_empty() && !s.contains(|c: char| c.is_whitespace() || c == '\'' || c == '\\') {
        return s.to_owned();
    }
    format!("'{}'", s.replace('\\', r"\\").replace('\'', r"\'"))
}

#[cfg(test)]
mod tests;
