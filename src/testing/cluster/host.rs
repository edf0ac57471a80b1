//! What a cluster needs from the machine: the server binaries, the ids of
//! the `postgres` user (as root), and the processes that clean up after a
//! test process that was killed.

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use super::{HarnessError, DIR_PREFIX};

pub(super) fn find_bin_dir() -> Result<PathBuf, HarnessError> {
    let usable = |dir: &Path| dir.join("initdb").is_file() && dir.join("postgres").is_file();
    let mut searched = Vec::new();
    if let Some(dir) = std::env::var_os("PG_BIN_DIR").map(PathBuf::from) {
        if usable(&dir) {
            return Ok(dir);
        }
        searched.push(format!("PG_BIN_DIR={}", dir.display()));
    }
    // Debian ships pg_config in libpq-dev, so it may name a bindir without the server.
    if let Ok(out) = quiet(Command::new("pg_config").arg("--bindir")).output() {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if out.status.success() && usable(&dir) {
            return Ok(dir);
        }
        searched.push(format!("pg_config --bindir ({})", dir.display()));
    }
    let version = |name: &str| {
        name.split('.')
            .map(str::parse)
            .collect::<Result<Vec<u32>, _>>()
    };
    let mut versions: Vec<(Vec<u32>, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((version(e.file_name().to_str()?).ok()?, e.path().join("bin"))))
        .collect();
    versions.sort();
    if let Some((_, dir)) = versions.into_iter().rev().find(|(_, dir)| usable(dir)) {
        return Ok(dir);
    }
    searched.push("/usr/lib/postgresql/*/bin".into());
    // Resolve symlinks so postgres and pg_isready are looked up next to the real initdb.
    for dir in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
        let real = fs::canonicalize(dir.join("initdb")).ok();
        if let Some(dir) = real.as_deref().and_then(Path::parent).filter(|d| usable(d)) {
            return Ok(dir.to_path_buf());
        }
    }
    searched.push("initdb on PATH".into());
    Err(HarnessError::BinariesNotFound {
        searched: searched.join(", "),
    })
}

// Statics are never dropped, so the shared cluster relies on this to stop once we exit.
// Its own process group keeps a terminal Ctrl-C from killing it before it cleans up.
pub(super) fn spawn_watchdog(pg_pid: u32, dir: &Path) -> Option<Child> {
    let me = std::process::id();
    let dir = dir.to_string_lossy().replace('\'', r"'\''");
    let script = format!(
        "while kill -0 {me} 2>/dev/null; do sleep 1; done; kill -INT {pg_pid} 2>/dev/null; \
         i=0; while kill -0 {pg_pid} 2>/dev/null && [ $i -lt 100 ]; do sleep 0.1; \
         i=$((i+1)); done; rm -rf '{dir}'"
    );
    let mut cmd = Command::new("sh");
    let spawned = quiet(cmd.arg("-c").arg(script).process_group(0)).spawn();
    spawned
        .map_err(|e| tracing::warn!(error = %e, "could not start the watchdog"))
        .ok()
}

// Clusters of test processes that died without running Drop (killed, or whose watchdog was).
pub(super) fn sweep_stale_dirs() {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for path in entries.flatten().map(|entry| entry.path()) {
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if !left_by_dead_process(&name, DIR_PREFIX, '-') {
            continue;
        }
        let postmaster = fs::read_to_string(path.join("data/postmaster.pid")).unwrap_or_default();
        if let Some(Ok(pg_pid)) = postmaster.lines().next().map(|l| l.trim().parse()) {
            signal_int(pg_pid);
        }
        let _ = fs::remove_dir_all(&path);
    }
}

// Names are `<prefix><pid><sep>...`; true when that pid is neither ours nor running.
pub(in crate::testing) fn left_by_dead_process(name: &str, prefix: &str, sep: char) -> bool {
    let pid = name
        .strip_prefix(prefix)
        .and_then(|rest| rest.split(sep).next());
    let pid = pid.and_then(|pid| pid.parse::<u32>().ok());
    pid.is_some_and(|pid| pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists())
}

// Through the `kill` command because std can only send SIGKILL.
pub(super) fn signal_int(pid: u32) {
    let _ = quiet(Command::new("kill").arg("-INT").arg(pid.to_string())).status();
}

pub(super) fn quiet(cmd: &mut Command) -> &mut Command {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
}

pub(super) fn effective_uid() -> Option<u32> {
    let status = fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok() // "Uid: real effective saved fs"
}

pub(super) fn passwd_ids(user: &str) -> Option<(u32, u32)> {
    let passwd = fs::read_to_string("/etc/passwd").ok()?;
    passwd
        .lines()
        .find_map(|line| match line.split(':').collect::<Vec<_>>()[..] {
            [name, _, uid, gid, ..] if name == user => Some((uid.parse().ok()?, gid.parse().ok()?)),
            _ => None,
        })
}
