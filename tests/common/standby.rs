//! A streaming standby of a [`TempPostgres`] primary, for the failover
//! tests: `pg_basebackup -R` from the primary's socket, started on a socket
//! directory of its own, run as the OS user that owns the primary's data
//! directory (the `postgres` user when the tests run as root, which
//! `postgres` refuses). Stopped and removed on drop.

use std::{
    fs,
    io::Write,
    os::unix::{
        fs::{MetadataExt, PermissionsExt},
        process::CommandExt,
    },
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use tower_idempotency::testing::TempPostgres;

/// The port number every test cluster uses; it only names the socket file.
pub(crate) const PORT: u16 = 5432;
const READY_TIMEOUT: Duration = Duration::from_secs(30);
const INSTALL: &str =
    "install PostgreSQL's server package (Debian/Ubuntu: apt-get install -y postgresql), \
     which ships pg_basebackup, or set PG_BIN_DIR";

pub(crate) struct Standby {
    dir: PathBuf,
    child: Option<Child>,
}

impl Standby {
    /// Takes a base backup of `primary` (with `-R`: `standby.signal` and
    /// `primary_conninfo`) and starts it as a hot standby; returns once it
    /// accepts connections. Blocking.
    pub(crate) fn start(primary: &TempPostgres) -> Standby {
        let bin = primary.bin_dir().to_path_buf();
        for tool in ["pg_basebackup", "postgres", "pg_isready"] {
            assert!(
                bin.join(tool).is_file(),
                "{} is missing: {INSTALL}",
                bin.join(tool).display()
            );
        }
        let primary_socket = socket_dir(primary);
        let owner = fs::metadata(primary.data_dir()).expect("the primary's data directory");
        let ids = (owner.uid(), owner.gid());
        let as_owner = |cmd: &mut Command| {
            if running_as_root() {
                cmd.uid(ids.0).gid(ids.1);
            }
        };
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // The harness's prefix and layout (`<dir>/data/postmaster.pid`), so
        // that its sweep stops and removes a standby whose test process was
        // killed before this drop ran.
        let dir = std::env::temp_dir().join(format!(
            "tower-idempotency-pg-{}-standby-{n}",
            std::process::id()
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir(&dir).expect("the standby's directory");
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
        if running_as_root() {
            std::os::unix::fs::chown(&dir, Some(ids.0), Some(ids.1)).unwrap();
        }
        let standby = Standby { dir, child: None };
        let data = standby.data_dir();

        let mut backup = Command::new(bin.join("pg_basebackup"));
        backup
            .arg("-D")
            .arg(&data)
            .arg("-h")
            .arg(&primary_socket)
            .args([
                "-p",
                &PORT.to_string(),
                "-U",
                "postgres",
                "-R",
                "-X",
                "stream",
            ])
            .args(["-c", "fast", "--no-sync"])
            .current_dir(&standby.dir)
            .stdin(Stdio::null());
        as_owner(&mut backup);
        let out = backup
            .output()
            .unwrap_or_else(|e| panic!("running pg_basebackup: {e}; {INSTALL}"));
        assert!(
            out.status.success(),
            "pg_basebackup failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );

        let log = fs::File::create(standby.dir.join("server.log")).unwrap();
        if running_as_root() {
            std::os::unix::fs::chown(standby.dir.join("server.log"), Some(ids.0), Some(ids.1))
                .unwrap();
        }
        let mut server = Command::new(bin.join("postgres"));
        server.arg("-D").arg(&data).arg("-k").arg(&standby.dir);
        server.args(["-p", &PORT.to_string()]);
        // max_connections as the harness sets it on the primary: a standby may not have fewer.
        for setting in [
            "listen_addresses=",
            "max_connections=300",
            "fsync=off",
            "hot_standby=on",
        ] {
            server.args(["-c", setting]);
        }
        server
            .current_dir(&standby.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        as_owner(&mut server);
        let mut standby = standby;
        standby.child = Some(server.spawn().expect("starting the standby's postgres"));

        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(status) = standby.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("the standby exited ({status}); log:\n{}", standby.log());
            }
            let ready = Command::new(bin.join("pg_isready"))
                .arg("-h")
                .arg(&standby.dir)
                .args(["-p", &PORT.to_string(), "-U", "postgres"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .expect("running pg_isready");
            if ready.success() {
                return standby;
            }
            assert!(
                Instant::now() < deadline,
                "the standby did not accept connections in time; log:\n{}",
                standby.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub(crate) fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    pub(crate) fn socket_dir(&self) -> &Path {
        &self.dir
    }

    /// Connection settings for database `dbname` on the standby.
    pub(crate) fn config(&self, dbname: &str) -> tokio_postgres::Config {
        let mut config = tokio_postgres::Config::new();
        config
            .host_path(&self.dir)
            .port(PORT)
            .user("postgres")
            .dbname(dbname);
        config
    }

    /// Stops the WAL receiver for good: an empty `primary_conninfo`
    /// (appended to `postgresql.auto.conf`, where the last line wins; the
    /// caller reloads with `pg_reload_conf()`). The standby stays in
    /// recovery with what it has received so far.
    pub(crate) fn cut_off(&self) {
        let mut auto = fs::OpenOptions::new()
            .append(true)
            .open(self.data_dir().join("postgresql.auto.conf"))
            .expect("the standby's postgresql.auto.conf");
        writeln!(auto, "primary_conninfo = ''").unwrap();
    }

    /// The end of the server log.
    pub(crate) fn log(&self) -> String {
        let log = fs::read(self.dir.join("server.log")).unwrap_or_default();
        String::from_utf8_lossy(&log[log.len().saturating_sub(4000)..]).into_owned()
    }
}

impl Drop for Standby {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SIGINT: a fast, clean shutdown.
            let _ = Command::new("kill")
                .args(["-INT", &child.id().to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            let deadline = Instant::now() + Duration::from_secs(10);
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// The directory of `primary`'s Unix socket.
pub(crate) fn socket_dir(primary: &TempPostgres) -> PathBuf {
    primary
        .data_dir()
        .parent()
        .expect("the cluster's directory")
        .to_path_buf()
}

fn running_as_root() -> bool {
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .and_then(|l| l.split_whitespace().nth(2))
        .is_some_and(|uid| uid == "0")
}
