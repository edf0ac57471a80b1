//! What one request costs, in units that hold still from run to run: round
//! trips, statements and bytes between the server and PostgreSQL, WAL
//! bytes, and CPU time of the bench process and of PostgreSQL.
//!
//! Every server of this part reaches PostgreSQL through a counting proxy
//! (loopback TCP to the cluster's Unix socket, no delay) that reads the
//! frontend's messages: `Q` (a simple query), `P` (parse), `E` (execute)
//! and `S` (sync), and counts a round trip at each change of direction of
//! a connection (the client sends after the server has answered). WAL is
//! `pg_current_wal_insert_lsn()` before and after a run; PostgreSQL's CPU
//! is the postmaster's and its children's `utime + stime` from `/proc`
//! (exited children through the postmaster's `cutime + cstime`); the bench
//! process's CPU is its own from `/proc/self/stat` less the proxy thread's,
//! and holds the load's HTTP client as well as the server (the client's
//! share is the same request for every scenario of the same body).
//!
//! Every scenario runs open loop at one fixed rate, half the slowest
//! scenario's closed-loop throughput in the warm-up (or `E2E_UNITS_RATE`):
//! saturated, the two cores are always busy and CPU per request is only
//! the inverse of throughput, as noisy as it. The scenarios compared
//! (default create and bare, one-commit and the hand-written experiment)
//! run next to each other in every round, and their CPU ratio is the median
//! of the rounds' ratios, so a drift of the machine's speed between rounds
//! falls out of it.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower_idempotency::postgres::PgStore;

use crate::{
    experiment,
    load::{median, Body, Kind, Load, Scenario, MAIN_KEYS},
    one_commit_server, servers, Settings,
};

/// What the proxy counted, in total.
#[derive(Default)]
struct Counters {
    round_trips: AtomicU64,
    queries: AtomicU64,
    parses: AtomicU64,
    executes: AtomicU64,
    syncs: AtomicU64,
    bytes_up: AtomicU64,
    bytes_down: AtomicU64,
    /// The proxy thread's id, to leave its CPU out of the process's.
    thread: AtomicU64,
}

/// Cost per request of one scenario's run.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Cost {
    pub(crate) round_trips: f64,
    /// Simple queries and executes: the statements PostgreSQL ran.
    pub(crate) statements: f64,
    pub(crate) parses: f64,
    pub(crate) bytes_up: f64,
    pub(crate) bytes_down: f64,
    pub(crate) wal: f64,
    /// Microseconds of the bench process (server and load client).
    pub(crate) cpu_process: f64,
    /// Microseconds of PostgreSQL (backends, WAL writer, checkpointer).
    pub(crate) cpu_postgres: f64,
}

impl Cost {
    /// Server and database together.
    pub(crate) fn cpu(&self) -> f64 {
        self.cpu_process + self.cpu_postgres
    }
}

/// Each scenario's cost in every round, at one rate.
pub(crate) struct Costs {
    /// Requests a second every scenario was sent.
    pub(crate) rate: f64,
    /// The scenarios' names and their costs, round by round.
    scenarios: Vec<(&'static str, Vec<Cost>)>,
}

impl Costs {
    /// `name`'s costs, round by round.
    fn rounds(&self, name: &str) -> Option<&[Cost]> {
        let (_, rounds) = self.scenarios.iter().find(|(n, _)| *n == name)?;
        Some(rounds)
    }

    /// The median of `name`'s rounds, part by part.
    pub(crate) fn median(&self, name: &str) -> Option<Cost> {
        self.rounds(name).map(median_cost)
    }

    /// The median over rounds of `f(a) / f(b)`, each round's `a` against
    /// the same round's `b`.
    pub(crate) fn paired(&self, a: &str, b: &str, f: fn(&Cost) -> f64) -> Option<f64> {
        let mut ratios: Vec<f64> = self
            .rounds(a)?
            .iter()
            .zip(self.rounds(b)?)
            .map(|(a, b)| f(a) / f(b))
            .collect();
        (!ratios.is_empty()).then(|| median(&mut ratios))
    }
}

pub(crate) const BARE: &str = "bare (no layer)";
pub(crate) const DEFAULT: &str = "default create (claim first)";
pub(crate) const ONE_COMMIT: &str = "one-commit create";
pub(crate) const EXPERIMENT: &str = "claim at commit, hand-written";
pub(crate) const FULL_RECORD: &str = "claim at commit, full record, hand-written";
pub(crate) const REPLAY: &str = "replay from the table (no cache)";
pub(crate) const REPLAY_HINTED: &str = "replay from the table, retry said (no cache)";
pub(crate) const BARE_FIVE: &str = "bare, five statements";
pub(crate) const LAYERED_FIVE: &str = "layered, five statements";

pub(crate) async fn run(
    load: &Arc<Load>,
    socket: PathBuf,
    data_dir: &Path,
    direct: &tokio_postgres::Config,
    s: &Settings,
) -> Costs {
    let counters = Arc::new(Counters::default());
    let addr = start_proxy(socket, counters.clone());
    let mut via = tokio_postgres::Config::new();
    via.host("127.0.0.1")
        .port(addr.port())
        .user("postgres")
        .dbname("postgres");
    let wal_reader = PgStore::builder(direct.clone())
        .max_connections(1)
        .build()
        .expect("store");
    let bare = servers::bare_server(servers::bare_pool(&via)).await;
    let layered = servers::layered_server(servers::store(&via)).await;
    let one_commit = one_commit_server(servers::store(&via)).await;
    let at_commit = experiment::at_commit_server(servers::bare_pool(&via)).await;
    let full_record = experiment::full_record_server(servers::bare_pool(&via)).await;
    let uncached = servers::uncached_server(servers::store(&via)).await;
    let bare_five = servers::bare_five_server(servers::bare_pool(&via)).await;
    let layered_five = servers::layered_five_server(servers::store(&via)).await;
    let mut scenarios = vec![
        Scenario::new(BARE, bare, Kind::Plain),
        Scenario::new(DEFAULT, layered, Kind::Create),
    ];
    scenarios.extend(one_commit.map(|addr| Scenario::new(ONE_COMMIT, addr, Kind::Create)));
    scenarios.extend([
        Scenario::new(EXPERIMENT, at_commit, Kind::Create),
        Scenario::new(FULL_RECORD, full_record, Kind::Create),
        Scenario::new(REPLAY, uncached, Kind::Replay).list(MAIN_KEYS),
        Scenario::new(REPLAY_HINTED, uncached, Kind::Replay)
            .list(MAIN_KEYS)
            .hinted(),
        Scenario::new(BARE_FIVE, bare_five, Kind::Plain).body(Body::Full),
        Scenario::new(LAYERED_FIVE, layered_five, Kind::Create).body(Body::Full),
    ]);
    // `E2E_UNITS=one-commit,bare`: only the scenarios whose names hold one
    // of these (to profile one at a time).
    if let Ok(only) = std::env::var("E2E_UNITS") {
        let only: Vec<String> = only.split(',').map(|s| s.trim().to_owned()).collect();
        scenarios.retain(|s| only.iter().any(|o| s.name.contains(o.as_str())));
    }
    // Every pool connected and every statement prepared before counting;
    // the slowest scenario's throughput sets the rate.
    let mut slowest = f64::INFINITY;
    for scenario in &scenarios {
        let run = load.run(*scenario, Duration::from_secs(1)).await;
        slowest = slowest.min(run.throughput());
    }
    let rate = s.units_rate.unwrap_or(slowest * 0.5).max(1.0);
    println!("units: every scenario at {rate:.0} requests a second, open loop");
    let ticks = clock_ticks();
    let postmaster = postmaster_pid(data_dir);
    let mut rounds: Vec<Vec<Cost>> = vec![Vec::new(); scenarios.len()];
    // No autovacuum inside a window: it is off while the part runs, and a
    // VACUUM between rounds does its work where no scenario is counted.
    admin(
        &wal_reader,
        &[
            "ALTER SYSTEM SET autovacuum = off",
            "SELECT pg_reload_conf()",
        ],
    )
    .await;
    for round in 1..=s.rounds {
        admin(&wal_reader, &["VACUUM"]).await;
        // ABBA: every other round runs the scenarios in reverse, so that
        // none is always the one after the same neighbour.
        let order: Vec<usize> = if round % 2 == 1 {
            (0..scenarios.len()).collect()
        } else {
            (0..scenarios.len()).rev().collect()
        };
        for i in order {
            let scenario = &scenarios[i];
            let before = Snapshot::take(&counters, &wal_reader, postmaster, ticks).await;
            let run = load.fixed_rate(*scenario, rate, s.duration).await;
            let after = Snapshot::take(&counters, &wal_reader, postmaster, ticks).await;
            let cost = after.minus(&before, run.requests.max(1) as f64);
            println!(
                "round {round} {:<34} {:>6} requests ({} unexpected): {:.2} round trips, {:.2} statements, {:.0} WAL bytes, {:.0} + {:.0} CPU us",
                scenario.name,
                run.requests,
                run.unexpected,
                cost.round_trips,
                cost.statements,
                cost.wal,
                cost.cpu_process,
                cost.cpu_postgres
            );
            rounds[i].push(cost);
        }
    }
    admin(
        &wal_reader,
        &["ALTER SYSTEM RESET autovacuum", "SELECT pg_reload_conf()"],
    )
    .await;
    Costs {
        rate,
        scenarios: scenarios.iter().map(|s| s.name).zip(rounds).collect(),
    }
}

/// Runs each statement on its own (`ALTER SYSTEM` and `VACUUM` refuse a
/// transaction block, even a multi-statement query's).
async fn admin(store: &PgStore, statements: &[&str]) {
    let client = store.client().await.expect("client");
    for statement in statements {
        client
            .batch_execute(statement)
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
}

fn median_cost(costs: &[Cost]) -> Cost {
    let median = |f: fn(&Cost) -> f64| {
        let mut v: Vec<f64> = costs.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Cost {
        round_trips: median(|c| c.round_trips),
        statements: median(|c| c.statements),
        parses: median(|c| c.parses),
        bytes_up: median(|c| c.bytes_up),
        bytes_down: median(|c| c.bytes_down),
        wal: median(|c| c.wal),
        cpu_process: median(|c| c.cpu_process),
        cpu_postgres: median(|c| c.cpu_postgres),
    }
}

/// The table of costs per request.
pub(crate) fn print(costs: &Costs) {
    println!();
    println!("At a fixed {:.0} req/s, open loop:", costs.rate);
    println!();
    println!("| per request (median of rounds) | round trips | statements | parses | bytes to PostgreSQL | bytes back | WAL bytes | CPU us, bench process | CPU us, PostgreSQL |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (name, rounds) in &costs.scenarios {
        let c = median_cost(rounds);
        println!(
            "| {name} | {:.2} | {:.2} | {:.2} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} |",
            c.round_trips,
            c.statements,
            c.parses,
            c.bytes_up,
            c.bytes_down,
            c.wal,
            c.cpu_process,
            c.cpu_postgres
        );
    }
}

struct Snapshot {
    counts: [u64; 7],
    wal: i64,
    cpu_process_us: f64,
    cpu_postgres_us: f64,
}

impl Snapshot {
    async fn take(counters: &Counters, wal: &PgStore, postmaster: u32, ticks: f64) -> Snapshot {
        let client = wal.client().await.expect("client");
        let wal: i64 = client
            .query_one(
                "SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::int8",
                &[],
            )
            .await
            .expect("wal")
            .get(0);
        drop(client);
        let c = |a: &AtomicU64| a.load(Ordering::SeqCst);
        let proxy_thread = c(&counters.thread);
        let process = cpu_ticks("/proc/self/stat", false)
            - cpu_ticks(&format!("/proc/self/task/{proxy_thread}/stat"), false);
        Snapshot {
            counts: [
                c(&counters.round_trips),
                c(&counters.queries),
                c(&counters.parses),
                c(&counters.executes),
                c(&counters.syncs),
                c(&counters.bytes_up),
                c(&counters.bytes_down),
            ],
            wal,
            cpu_process_us: process * 1e6 / ticks,
            cpu_postgres_us: postgres_ticks(postmaster) * 1e6 / ticks,
        }
    }

    fn minus(&self, before: &Snapshot, requests: f64) -> Cost {
        let d = |i: usize| (self.counts[i] - before.counts[i]) as f64 / requests;
        Cost {
            round_trips: d(0),
            statements: d(1) + d(3),
            parses: d(2),
            bytes_up: d(5),
            bytes_down: d(6),
            wal: (self.wal - before.wal) as f64 / requests,
            cpu_process: (self.cpu_process_us - before.cpu_process_us) / requests,
            cpu_postgres: (self.cpu_postgres_us - before.cpu_postgres_us) / requests,
        }
    }
}

/// `utime + stime` of a `/proc/…/stat` file in clock ticks (with
/// `cutime + cstime` when `children`); 0 when it cannot be read.
fn cpu_ticks(path: &str, children: bool) -> f64 {
    let Ok(stat) = std::fs::read_to_string(path) else {
        return 0.0;
    };
    // The command name is in parentheses and may hold spaces.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // After the name: state (0), ppid (1), …, utime (11), stime (12),
    // cutime (13), cstime (14).
    field(11) + field(12) + if children { field(13) + field(14) } else { 0.0 }
}

fn parent_of(pid: &str) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// The postmaster's CPU with its exited children's, and its live children's.
fn postgres_ticks(postmaster: u32) -> f64 {
    let mut total = cpu_ticks(&format!("/proc/{postmaster}/stat"), true);
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        if parent_of(pid) == Some(postmaster) {
            total += cpu_ticks(&format!("/proc/{pid}/stat"), false);
        }
    }
    total
}

fn postmaster_pid(data_dir: &Path) -> u32 {
    std::fs::read_to_string(data_dir.join("postmaster.pid"))
        .ok()
        .and_then(|s| s.lines().next()?.trim().parse().ok())
        .expect("postmaster.pid names the postmaster")
}

fn clock_ticks() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok()?.trim().parse().ok())
        .unwrap_or(100.0)
}

/// The counting proxy, on a thread and runtime of its own.
fn start_proxy(target: PathBuf, counters: Arc<Counters>) -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let addr = listener.local_addr().expect("addr");
    std::thread::Builder::new()
        .name("e2e-counting-proxy".into())
        .spawn(move || {
            let tid = std::fs::read_link("/proc/thread-self")
                .ok()
                .and_then(|p| p.file_name()?.to_str()?.parse().ok())
                .unwrap_or(0);
            counters.thread.store(tid, Ordering::SeqCst);
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("proxy runtime");
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                while let Ok((client, _)) = listener.accept().await {
                    let _ = client.set_nodelay(true);
                    let Ok(server) = tokio::net::UnixStream::connect(&target).await else {
                        continue;
                    };
                    let counters = counters.clone();
                    tokio::spawn(connection(client, server, counters));
                }
            });
        })
        .expect("proxy thread");
    addr
}

async fn connection(
    client: tokio::net::TcpStream,
    server: tokio::net::UnixStream,
    counters: Arc<Counters>,
) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    // Whether the server spoke last: the client's next bytes start a round trip.
    let answered = AtomicBool::new(true);
    let up = async {
        let mut buf = vec![0u8; 64 * 1024];
        let mut parser = Frontend::default();
        while let Ok(n @ 1..) = client_read.read(&mut buf).await {
            if answered.swap(false, Ordering::SeqCst) {
                counters.round_trips.fetch_add(1, Ordering::Relaxed);
            }
            counters.bytes_up.fetch_add(n as u64, Ordering::Relaxed);
            parser.feed(&buf[..n], &counters);
            if server_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = server_write.shutdown().await;
    };
    let down = async {
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n @ 1..) = server_read.read(&mut buf).await {
            answered.store(true, Ordering::SeqCst);
            counters.bytes_down.fetch_add(n as u64, Ordering::Relaxed);
            if client_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = client_write.shutdown().await;
    };
    tokio::join!(up, down);
}

/// Reads the frontend's message stream across chunk boundaries: the
/// untyped start-up messages (an SSL or GSS request, then the start-up
/// message), then `type, int32 length, payload` messages.
#[derive(Default)]
struct Frontend {
    started: bool,
    /// The header being read: 4 bytes before start-up, 5 after.
    header: Vec<u8>,
    /// Payload bytes still to skip.
    skip: usize,
}

impl Frontend {
    fn feed(&mut self, mut bytes: &[u8], counters: &Counters) {
        while !bytes.is_empty() {
            if self.skip > 0 {
                let n = self.skip.min(bytes.len());
                self.skip -= n;
                bytes = &bytes[n..];
                continue;
            }
            let header_len = if self.started { 5 } else { 4 };
            let n = (header_len - self.header.len()).min(bytes.len());
            self.header.extend_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
            if self.header.len() < header_len {
                return;
            }
            let len_at = header_len - 4;
            let len =
                u32::from_be_bytes(self.header[len_at..].try_into().expect("4 bytes")) as usize;
            if self.started {
                let counter = match self.header[0] {
                    b'Q' => Some(&counters.queries),
                    b'P' => Some(&counters.parses),
                    b'E' => Some(&counters.executes),
                    b'S' => Some(&counters.syncs),
                    _ => None,
                };
                if let Some(counter) = counter {
                    counter.fetch_add(1, Ordering::Relaxed);
                }
                self.skip = len.saturating_sub(4);
            } else {
                // The payload's first 4 bytes say which: an SSL request
                // (80877103) or a GSS one (80877104) comes before the
                // start-up message; the server's one-byte answer to it is
                // not a message the client parses here.
                self.skip = len.saturating_sub(4);
                let mut code = [0u8; 4];
                let take = self.skip.min(bytes.len()).min(4);
                code[..take].copy_from_slice(&bytes[..take]);
                let request =
                    take == 4 && matches!(u32::from_be_bytes(code), 80_877_103 | 80_877_104);
                self.started = !request;
            }
            self.header.clear();
        }
    }
}

/// WAL bytes of one key row with its index entries, as a one-commit create
/// writes it: transactions that each insert a copy of a completed row of
/// the layered create (under a new key) against transactions that each insert into an
/// unlogged table (whose commit record is all they write), per transaction.
pub(crate) async fn key_row_wal(store: &PgStore) -> f64 {
    const N: i64 = 500;
    let client = store.client().await.expect("client");
    client
        .batch_execute("CREATE UNLOGGED TABLE IF NOT EXISTS e2e_wal_probe (n int)")
        .await
        .expect("probe table");
    let lsn = || async {
        client
            .query_one(
                "SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::int8",
                &[],
            )
            .await
            .expect("wal")
            .get::<_, i64>(0)
    };
    let start = lsn().await;
    for i in 0..N {
        client
            .batch_execute(&format!(
                "BEGIN; INSERT INTO idempotency_requests \
                 SELECT (jsonb_populate_record(r, jsonb_build_object('idempotency_key', 'wal-probe-{i}'))).* \
                 FROM idempotency_requests r \
                 WHERE endpoint = 'POST /orders v1' AND state = 'completed' LIMIT 1; COMMIT"
            ))
            .await
            .expect("a key row");
    }
    let rows = lsn().await - start;
    let start = lsn().await;
    for _ in 0..N {
        client
            .batch_execute("BEGIN; INSERT INTO e2e_wal_probe VALUES (1); COMMIT")
            .await
            .expect("a commit");
    }
    let commits = lsn().await - start;
    client
        .batch_execute(
            "DELETE FROM idempotency_requests WHERE idempotency_key LIKE 'wal-probe-%'; \
             DROP TABLE e2e_wal_probe",
        )
        .await
        .expect("clean up");
    (rows - commits) as f64 / N as f64
}
