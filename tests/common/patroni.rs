//! A Patroni cluster on this machine, the way production runs PostgreSQL
//! for high availability: one etcd, three Patroni nodes (PostgreSQL 15,
//! synchronous mode, loopback ports, run as the `postgres` OS user when the
//! tests run as root) and HAProxy in front, routing to the node whose REST
//! API says `/primary`. Everything is killed and removed on drop.

use std::{
    fs,
    io::{Read, Write},
    net::TcpStream,
    os::unix::{fs::PermissionsExt, process::CommandExt},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

const INSTALL: &str = "install Debian's patroni, etcd-server and haproxy packages \
     (apt-get install -y patroni etcd-server haproxy)";

/// The settings that bound an unplanned outage: the leader key's time to
/// live, how often each node's loop runs, and how long a node retries the
/// DCS and PostgreSQL before it demotes itself.
pub(crate) const TTL: u32 = 10;
pub(crate) const LOOP_WAIT: u32 = 1;
pub(crate) const RETRY_TIMEOUT: u32 = 3;

pub(crate) struct Node {
    pub(crate) name: String,
    pub(crate) pg_port: u16,
    api_port: u16,
    data_dir: PathBuf,
    child: Option<Child>,
}

pub(crate) struct Patroni {
    dir: PathBuf,
    etcd: Child,
    haproxy: Child,
    haproxy_port: u16,
    pub(crate) nodes: Vec<Node>,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
}

/// The `postgres` OS user's uid and gid, when running as root.
fn postgres_ids() -> Option<(u32, u32)> {
    if !running_as_root() {
        return None;
    }
    let id = |flag: &str| {
        let out = Command::new("id")
            .args([flag, "postgres"])
            .output()
            .expect("id runs");
        assert!(out.status.success(), "no postgres OS user: {INSTALL}");
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse::<u32>()
            .unwrap()
    };
    Some((id("-u"), id("-g")))
}

fn find(program: &str) -> PathBuf {
    for dir in ["/usr/bin", "/usr/sbin", "/usr/local/bin"] {
        let path = Path::new(dir).join(program);
        if path.is_file() {
            return path;
        }
    }
    panic!("{program} not found: {INSTALL}");
}

fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("PG_BIN_DIR") {
        return dir.into();
    }
    let mut found: Vec<_> = fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin"))
        .filter(|p| p.join("initdb").is_file())
        .collect();
    found.sort();
    found.pop().expect("PostgreSQL's server binaries")
}

/// One HTTP/1.0 request to `127.0.0.1:port`: the status and the body.
pub(crate) fn http(port: u16, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let request = format!(
        "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    let status = answer.split(' ').nth(1)?.parse().ok()?;
    let body = answer.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((status, body))
}

impl Patroni {
    /// Starts etcd, three Patroni nodes and HAProxy; returns once a leader
    /// and a synchronous standby are up. Blocking.
    pub(crate) fn start() -> Patroni {
        let (etcd_bin, patroni_bin, haproxy_bin) = (find("etcd"), find("patroni"), find("haproxy"));
        sweep_left_by_dead_processes();
        let ids = postgres_ids();
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "tower-idempotency-patroni-{}-{n}",
            std::process::id()
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
        if let Some((uid, gid)) = ids {
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).unwrap();
        }
        let as_postgres = |cmd: &mut Command| {
            if let Some((uid, gid)) = ids {
                cmd.uid(uid).gid(gid);
            }
            cmd.env("HOME", &dir).current_dir(&dir);
        };
        let log = |name: &str| fs::File::create(dir.join(name)).unwrap();

        let (client, peer) = (free_port(), free_port());
        let mut etcd = Command::new(etcd_bin);
        etcd.args(["--name", "e1", "--data-dir"])
            .arg(dir.join("etcd"))
            .arg(format!("--listen-client-urls=http://127.0.0.1:{client}"))
            .arg(format!("--advertise-client-urls=http://127.0.0.1:{client}"))
            .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer}"))
            .arg(format!(
                "--initial-advertise-peer-urls=http://127.0.0.1:{peer}"
            ))
            .arg(format!("--initial-cluster=e1=http://127.0.0.1:{peer}"))
            .stdout(Stdio::null())
            .stderr(log("etcd.log"));
        as_postgres(&mut etcd);
        let etcd = etcd.spawn().expect("etcd starts");

        let bin = bin_dir();
        let mut nodes = Vec::new();
        for i in 1..=3 {
            let (pg_port, api_port) = (free_port(), free_port());
            let name = format!("n{i}");
            let data_dir = dir.join(&name);
            let config = format!(
                "scope: tidem\nname: {name}\n\
                 restapi:\n  listen: 127.0.0.1:{api_port}\n  connect_address: 127.0.0.1:{api_port}\n\
                 etcd3:\n  hosts: 127.0.0.1:{client}\n\
                 bootstrap:\n  dcs:\n    ttl: {TTL}\n    loop_wait: {LOOP_WAIT}\n    retry_timeout: {RETRY_TIMEOUT}\n\
                 \x20   synchronous_mode: true\n    postgresql:\n      use_pg_rewind: true\n\
                 \x20     parameters:\n        wal_log_hints: 'on'\n        max_connections: 200\n\
                 \x20 initdb:\n  - encoding: UTF8\n  - locale: C\n\
                 \x20 pg_hba:\n  - local all all trust\n  - host all all 127.0.0.1/32 trust\n\
                 \x20 - host replication all 127.0.0.1/32 trust\n\
                 postgresql:\n  listen: 127.0.0.1:{pg_port}\n  connect_address: 127.0.0.1:{pg_port}\n\
                 \x20 data_dir: {data}\n  bin_dir: {bin}\n  pgpass: {pgpass}\n\
                 \x20 authentication:\n    superuser:\n      username: postgres\n\
                 \x20   replication:\n      username: postgres\n\
                 \x20 parameters:\n    unix_socket_directories: {dir}\n",
                data = data_dir.display(),
                bin = bin.display(),
                pgpass = dir.join(format!("pgpass-{name}")).display(),
                dir = dir.display(),
            );
            let path = dir.join(format!("{name}.yml"));
            fs::write(&path, config).unwrap();
            let mut patroni = Command::new(&patroni_bin);
            patroni
                .arg(&path)
                .stdout(log(&format!("{name}.log")))
                .stderr(log(&format!("{name}.err")));
            as_postgres(&mut patroni);
            nodes.push(Node {
                name,
                pg_port,
                api_port,
                data_dir,
                child: Some(patroni.spawn().expect("patroni starts")),
            });
            // The first node bootstraps the cluster; the others clone it.
            if i == 1 {
                wait_for("the first node to lead", Duration::from_secs(60), || {
                    http(api_port, "GET", "/primary", "").is_some_and(|(s, _)| s == 200)
                });
            }
        }

        let haproxy_port = free_port();
        let mut config = format!(
            "global\n  maxconn 500\n\
             defaults\n  mode tcp\n  timeout connect 2s\n  timeout client 30m\n  timeout server 30m\n\
             \x20 timeout check 1s\n\
             listen primary\n  bind 127.0.0.1:{haproxy_port}\n  option httpchk OPTIONS /primary\n\
             \x20 http-check expect status 200\n\
             \x20 default-server inter 500ms fall 2 rise 1 on-marked-down shutdown-sessions\n"
        );
        for node in &nodes {
            config.push_str(&format!(
                "  server {} 127.0.0.1:{} check port {}\n",
                node.name, node.pg_port, node.api_port
            ));
        }
        let path = dir.join("haproxy.cfg");
        fs::write(&path, config).unwrap();
        let haproxy = Command::new(haproxy_bin)
            .args(["-db", "-f"])
            .arg(&path)
            .stdout(Stdio::null())
            .stderr(log("haproxy.log"))
            .spawn()
            .expect("haproxy starts");
        let cluster = Patroni {
            dir,
            etcd,
            haproxy,
            haproxy_port,
            nodes,
        };
        wait_for(
            "a leader and a synchronous standby",
            Duration::from_secs(90),
            || cluster.leader().is_some() && cluster.sync_standby().is_some(),
        );
        cluster
    }

    /// The members as Patroni's REST API lists them: (name, role, state).
    pub(crate) fn members(&self) -> Vec<(String, String, String)> {
        for node in &self.nodes {
            if let Some((200, body)) = http(node.api_port, "GET", "/cluster", "") {
                let cluster: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                let members = cluster["members"].as_array().cloned().unwrap_or_default();
                return members
                    .iter()
                    .map(|m| {
                        let s = |k: &str| m[k].as_str().unwrap_or_default().to_owned();
                        (s("name"), s("role"), s("state"))
                    })
                    .collect();
            }
        }
        Vec::new()
    }

    fn member_with(&self, role: &str) -> Option<String> {
        self.members()
            .into_iter()
            .find(|(_, r, state)| r == role && (state == "running" || state == "streaming"))
            .map(|(name, ..)| name)
    }

    pub(crate) fn leader(&self) -> Option<String> {
        self.member_with("leader")
    }

    pub(crate) fn sync_standby(&self) -> Option<String> {
        self.member_with("sync_standby")
    }

    fn node(&self, name: &str) -> &Node {
        self.nodes.iter().find(|n| n.name == name).unwrap()
    }

    /// A planned switchover from the leader to the synchronous standby,
    /// through the leader's REST API; returns (old leader, new leader).
    pub(crate) fn switchover(&self) -> (String, String) {
        let leader = self.leader().expect("a leader");
        let candidate = self.sync_standby().expect("a synchronous standby");
        let body = format!(r#"{{"leader":"{leader}","candidate":"{candidate}"}}"#);
        let answer = http(self.node(&leader).api_port, "POST", "/switchover", &body);
        assert!(
            answer.as_ref().is_some_and(|(s, _)| *s == 200),
            "switchover refused: {answer:?}"
        );
        (leader, candidate)
    }

    /// The leader's sudden death: its Patroni and its PostgreSQL (the
    /// postmaster and every child) killed with SIGKILL. Returns its name.
    pub(crate) fn kill_leader(&mut self) -> String {
        let leader = self.leader().expect("a leader");
        let node = self.nodes.iter_mut().find(|n| n.name == leader).unwrap();
        if let Some(mut child) = node.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        kill_postgres(&node.data_dir);
        leader
    }

    /// Every node by its port, the driver picking the writable one.
    pub(crate) fn multi_host_url(&self) -> String {
        let ports: Vec<_> = self.nodes.iter().map(|n| n.pg_port.to_string()).collect();
        let hosts = vec!["127.0.0.1"; self.nodes.len()].join(",");
        format!(
            "host={hosts} port={} user=postgres dbname=postgres target_session_attrs=read-write \
             connect_timeout=2",
            ports.join(",")
        )
    }

    /// HAProxy, which routes to the node whose REST API answers `/primary`.
    pub(crate) fn haproxy_url(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres connect_timeout=2",
            self.haproxy_port
        )
    }

    /// Connection settings of the current leader.
    pub(crate) fn leader_config(&self) -> tokio_postgres::Config {
        let leader = self.leader().expect("a leader");
        let mut config = tokio_postgres::Config::new();
        config
            .host("127.0.0.1")
            .port(self.node(&leader).pg_port)
            .user("postgres")
            .dbname("postgres");
        config
    }
}

/// Clusters of test processes that died before their drop ran (killed, or
/// aborted): every process started in such a directory is killed, and the
/// directory removed.
fn sweep_left_by_dead_processes() {
    let prefix = "tower-idempotency-patroni-";
    for entry in fs::read_dir(std::env::temp_dir())
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(prefix)
            .and_then(|rest| rest.split('-').next())
        else {
            continue;
        };
        if Path::new("/proc").join(pid).exists() {
            continue;
        }
        let dir = entry.path();
        let _ = Command::new("pkill")
            .args(["-KILL", "-f"])
            .arg(dir.as_os_str())
            .status();
        let _ = fs::remove_dir_all(&dir);
    }
}

/// SIGKILL to the postmaster of `data_dir` and to its children.
fn kill_postgres(data_dir: &Path) {
    let Ok(pid_file) = fs::read_to_string(data_dir.join("postmaster.pid")) else {
        return;
    };
    let Some(pid) = pid_file.lines().next().map(str::trim) else {
        return;
    };
    for (program, args) in [("pkill", ["-KILL", "-P"]), ("kill", ["-KILL", "--"])] {
        let _ = Command::new(program)
            .args(args)
            .arg(pid)
            .stderr(Stdio::null())
            .status();
    }
}

pub(crate) fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() {
        if Instant::now() >= deadline {
            let dir = std::env::temp_dir();
            let logs = Command::new("sh")
                .arg("-c")
                .arg(format!(
                    "tail -n 15 {}/tower-idempotency-patroni-{}-*/n*.log",
                    dir.display(),
                    std::process::id()
                ))
                .output()
                .map(|out| String::from_utf8_lossy(&out.stdout).into_owned())
                .unwrap_or_default();
            panic!("timed out waiting for {what}; the nodes' logs end:\n{logs}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

impl Drop for Patroni {
    fn drop(&mut self) {
        let _ = self.haproxy.kill();
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
            kill_postgres(&node.data_dir);
        }
        let _ = self.etcd.kill();
        let _ = self.etcd.wait();
        let _ = self.haproxy.wait();
        let _ = fs::remove_dir_all(&self.dir);
    }
}
