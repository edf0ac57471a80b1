//! Process crash soak: the example order server is SIGKILLed at random
//! moments while clients keep placing orders, and restarted each time; at the
//! end the database must hold exactly one order, one outbox event, one
//! remembered result and one payment charge per logical operation, and every
//! client's final answer must name the order the database holds.
//!
//!     cargo build --release --examples
//!     cargo run --release --example chaos -- --ops 2000 --crashes 6
//!
//! Flags: `--ops N` logical operations (default 500), `--crashes N` SIGKILLs
//! spread over the run (default 4), `--clients N` concurrent clients
//! (default 8), `--seed N` (default 1; the same seed gives the same keys,
//! order bodies and crash points), `--deadline SECONDS` (default 1800: operations
//! still without a final answer then count as mismatched). `--server PATH` runs another
//! `order_server` binary than the one next to this one. `--mode claim-first|one-commit`
//! sets the server's `IDEMPOTENCY_MODE` (default `claim-first`).
//!
//! It starts its own temporary PostgreSQL (as the order server does when
//! `DATABASE_URL` is unset), runs the `order_server` example built next to
//! it as a child process on a fixed local address, lets the server apply its
//! own migrations, and checks the outcome with SQL once the outbox relay has
//! drained. Each client performs one logical operation at a time: one
//! `Idempotency-Key` and one `checkout_id`, retried with the same key and
//! body on timeouts, connection errors, `5xx` and `409
//! idempotency_in_progress` until it gets its final answer. It prints a
//! Markdown summary and exits non-zero if any operation has a duplicate, a
//! lost order, a mismatched answer or not exactly one event, result or
//! charge, or if the server could not be crashed as often as asked.

use std::{
    collections::HashMap,
    path::PathBuf,
    process::{ExitCode, Stdio},
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::{
    client::legacy::{connect::HttpConnector, Client},
    rt::TokioExecutor,
};
use serde_json::{json, Value};
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::{Child, ChildStdout, Command},
};
use tower_idempotency::testing::TempPostgres;

const TOKEN: &str = "demo-token-a";
const TENANT: &str = "tenant-a";
const ENDPOINT: &str = "POST /orders v1";
/// One attempt longer than this counts as a timeout and is retried.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the outbox relay gets to deliver everything at the end: this,
/// plus [`DRAIN_PER_OPERATION`] per operation.
const DRAIN_DEADLINE: Duration = Duration::from_secs(60);
const DRAIN_PER_OPERATION: Duration = Duration::from_millis(20);

struct Args {
    ops: usize,
    crashes: usize,
    clients: usize,
    seed: u64,
    /// Operations without a final answer by then are given up (and
    /// reported as mismatched answers).
    deadline: Duration,
    server: Option<PathBuf>,
    /// The server's `IDEMPOTENCY_MODE`.
    mode: String,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        ops: 500,
        crashes: 4,
        clients: 8,
        seed: 1,
        deadline: Duration::from_secs(1800),
        server: None,
        mode: "claim-first".to_owned(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        let number = |v: String| {
            v.parse::<u64>()
                .map_err(|_| format!("{flag}: {v:?} is not a number"))
        };
        match flag.as_str() {
            "--ops" => args.ops = number(value()?)? as usize,
            "--crashes" => args.crashes = number(value()?)? as usize,
            "--clients" => args.clients = number(value()?)?.max(1) as usize,
            "--seed" => args.seed = number(value()?)?,
            "--deadline" => args.deadline = Duration::from_secs(number(value()?)?),
            "--server" => args.server = Some(PathBuf::from(value()?)),
            "--mode" => match value()?.as_str() {
                mode @ ("claim-first" | "one-commit") => args.mode = mode.to_owned(),
                other => {
                    return Err(format!(
                        "--mode: {other:?} is neither claim-first nor one-commit"
                    ))
                }
            },
            "--help" | "-h" => {
                return Err(
                    "usage: chaos [--ops N] [--crashes N] [--clients N] [--seed N] [--deadline SECONDS] [--server PATH] [--mode claim-first|one-commit]"
                        .into(),
                )
            }
            other => return Err(format!("unknown flag {other:?} (try --help)")),
        }
    }
    Ok(args)
}

/// xorshift64*: reproducible choices from `--seed`, no dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        // Never zero, and distinct streams for nearby seeds.
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `0..n` (n > 0).
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// The order server child process, restarted after every crash.
struct Server {
    binary: PathBuf,
    /// Its `IDEMPOTENCY_MODE`.
    mode: String,
    database_url: String,
    addr: String,
    log: PathBuf,
    child: Option<(Child, ChildStdout)>,
}

impl Server {
    async fn start(&mut self) -> Result<(), String> {
        // A restart right after a SIGKILL may rarely find the port still
        // held by the old process's last moments: try again a few times.
        let mut last = String::new();
        for _ in 0..20 {
            match self.try_start().await {
                Ok(()) => return Ok(()),
                Err(e) => last = e,
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(last)
    }

    async fn try_start(&mut self) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| format!("cannot open {}: {e}", self.log.display()))?;
        let mut child = Command::new(&self.binary)
            .env("DATABASE_URL", &self.database_url)
            .env("IDEMPOTENCY_MODE", &self.mode)
            .env("ORDER_SERVER_ADDR", &self.addr)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.binary.display()))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        let read = tokio::time::timeout(Duration::from_secs(60), reader.read_line(&mut line)).await;
        if !matches!(read, Ok(Ok(n)) if n > 0) || !line.starts_with("listening on ") {
            let _ = child.kill().await;
            return Err(format!(
                "the order server did not start (first line {line:?}; see {})",
                self.log.display()
            ));
        }
        // Kept open so that the server never writes to a closed pipe.
        self.child = Some((child, reader.into_inner()));
        Ok(())
    }

    /// SIGKILL: no graceful shutdown, no chance to finish anything.
    async fn crash(&mut self) -> Result<(), String> {
        let (mut child, _stdout) = self.child.take().ok_or("the server is not running")?;
        child
            .kill()
            .await
            .map_err(|e| format!("SIGKILL failed: {e}"))
    }

    /// SIGTERM, and wait for a graceful exit.
    async fn stop(&mut self) -> Result<(), String> {
        let Some((mut child, _stdout)) = self.child.take() else {
            return Ok(());
        };
        let pid = child.id().ok_or("the server already exited")?.to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status().await;
        match tokio::time::timeout(Duration::from_secs(60), child.wait()).await {
            Ok(Ok(status)) if status.success() => Ok(()),
            Ok(Ok(status)) => Err(format!("the order server exited with {status}")),
            _ => {
                let _ = child.kill().await;
                Err("the order server did not stop after SIGTERM".into())
            }
        }
    }
}

/// What one retry was for.
#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    connection_errors: AtomicU64,
    timeouts: AtomicU64,
    server_errors: AtomicU64,
    in_progress: AtomicU64,
}

/// A client's final answer to one logical operation.
#[derive(Debug, Clone)]
enum Final {
    /// `201`, with the order id its body names; `replayed` when it was the
    /// remembered answer (`Idempotent-Replayed: true`).
    Created {
        order_id: Option<String>,
        replayed: bool,
    },
    /// Anything else final (a bug for this workload), or no answer in time.
    Other(String),
}

fn order_body(seed: u64, op: usize) -> String {
    json!({
        "checkout_id": checkout_of(seed, op),
        "currency": "JPY",
        "items": [{"sku": format!("SKU-{}", op % 7), "quantity": 1 + op % 3, "unit_price": 100 + op}],
        "shipping_address_id": "addr_chaos"
    })
    .to_string()
}

fn key_of(seed: u64, op: usize) -> String {
    format!("chaos-{seed}-{op}")
}

fn checkout_of(seed: u64, op: usize) -> String {
    format!("chk-chaos-{seed}-{op}")
}

/// Performs one logical operation: the same key and body until a final answer.
async fn operation(
    http: &Client<HttpConnector, Full<Bytes>>,
    base: &str,
    seed: u64,
    op: usize,
    rng: &mut Rng,
    counters: &Counters,
    deadline: Instant,
) -> Final {
    let (key, body) = (key_of(seed, op), Bytes::from(order_body(seed, op)));
    let mut attempt: u32 = 0;
    loop {
        if Instant::now() > deadline {
            return Final::Other(format!("no final answer after {attempt} attempts"));
        }
        if attempt > 0 {
            // A short, growing, jittered pause: keep the pressure on.
            let pause = 10 * u64::from(attempt.min(20)) + rng.below(20);
            tokio::time::sleep(Duration::from_millis(pause)).await;
        }
        attempt += 1;
        counters.requests.fetch_add(1, SeqCst);
        let request = Request::post(format!("{base}/orders"))
            .header("authorization", format!("Bearer {TOKEN}"))
            .header("content-type", "application/json")
            .header("idempotency-key", &key)
            .body(Full::new(body.clone()))
            .expect("a valid request");
        let exchange = async {
            let response = http.request(request).await.map_err(|e| e.to_string())?;
            let (parts, body) = response.into_parts();
            let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
            let replayed = parts
                .headers
                .get("idempotent-replayed")
                .is_some_and(|v| v == "true");
            Ok::<_, String>((parts.status, replayed, body))
        };
        let timeout = REQUEST_TIMEOUT.min(deadline.saturating_duration_since(Instant::now()));
        let (status, replayed, body) = match tokio::time::timeout(timeout, exchange).await {
            Err(_) => {
                counters.timeouts.fetch_add(1, SeqCst);
                continue;
            }
            Ok(Err(_)) => {
                counters.connection_errors.fetch_add(1, SeqCst);
                continue;
            }
            Ok(Ok(answer)) => answer,
        };
        let json: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        if status.is_server_error() {
            counters.server_errors.fetch_add(1, SeqCst);
            continue;
        }
        if status == StatusCode::CONFLICT && json["code"] == "idempotency_in_progress" {
            counters.in_progress.fetch_add(1, SeqCst);
            continue;
        }
        return if status == StatusCode::CREATED {
            Final::Created {
                order_id: json["id"].as_str().map(str::to_owned),
                replayed,
            }
        } else {
            Final::Other(format!("{} {}", status.as_u16(), json["code"]))
        };
    }
}

/// The mode the server runs `POST /orders` in, as its `/metrics` shows it:
/// only the one-commit mode exports `idempotency_commits_lost_total`.
async fn served_mode(base: &str) -> Result<&'static str, String> {
    let http: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    let uri = format!("{base}/metrics")
        .parse()
        .map_err(|e| format!("{base}/metrics: {e}"))?;
    let response = http
        .get(uri)
        .await
        .map_err(|e| format!("GET /metrics: {e}"))?;
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("GET /metrics: {e}"))?
        .to_bytes();
    let lost = "idempotency_commits_lost_total{endpoint=\"POST /orders v1\"}";
    Ok(if String::from_utf8_lossy(&body).contains(lost) {
        "one-commit"
    } else {
        "claim-first"
    })
}

/// What the database holds per logical operation.
#[derive(Default)]
struct Stored {
    orders: Vec<String>,
    events: i64,
    remembered: i64,
    charges: i64,
}

async fn connect(url: &str) -> Result<tokio_postgres::Client, String> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .map_err(|e| format!("cannot connect to the database: {e}"))?;
    tokio::spawn(connection);
    Ok(client)
}

/// Waits (bounded) until the relay has delivered every event. An event the
/// relay parked (a delivery failed for good) will not be delivered without
/// an operator: reported at once rather than waited for.
async fn drain(sql: &tokio_postgres::Client, ops: usize) -> Result<Duration, String> {
    let limit = DRAIN_DEADLINE + DRAIN_PER_OPERATION * ops as u32;
    let started = Instant::now();
    loop {
        let row = sql
            .query_one(
                "SELECT count(*) FILTER (WHERE parked_at IS NULL), \
                        count(*) FILTER (WHERE parked_at IS NOT NULL) \
                 FROM outbox_events WHERE published_at IS NULL",
                &[],
            )
            .await
            .map_err(|e| e.to_string())?;
        let (pending, parked): (i64, i64) = (row.get(0), row.get(1));
        if pending == 0 && parked > 0 {
            return Err(format!(
                "{parked} outbox events parked (see the server log)"
            ));
        }
        if pending == 0 {
            return Ok(started.elapsed());
        }
        if started.elapsed() > limit {
            return Err(format!(
                "{pending} outbox events still undelivered after {limit:?} ({parked} parked)"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn stored(
    sql: &tokio_postgres::Client,
    seed: u64,
    ops: usize,
) -> Result<HashMap<String, Stored>, String> {
    let mut by_checkout: HashMap<String, Stored> = (0..ops)
        .map(|op| (checkout_of(seed, op), Stored::default()))
        .collect();
    let prefix = format!("chk-chaos-{seed}-%");
    let err = |e: tokio_postgres::Error| e.to_string();
    // Per order: its outbox events and the charges the provider made for it
    // (joined, not correlated: payment_charges has no index on order_id).
    let rows = sql
        .query(
            "WITH o AS (SELECT checkout_id, id::text AS id FROM orders \
                        WHERE tenant_id = $1 AND checkout_id LIKE $2), \
                  e AS (SELECT aggregate_id, count(*) AS n FROM outbox_events \
                        WHERE tenant_id = $1 AND event_type = 'OrderCreated' GROUP BY 1), \
                  c AS (SELECT order_id, count(*) AS n FROM payment_charges GROUP BY 1) \
             SELECT o.checkout_id, o.id, coalesce(e.n, 0), coalesce(c.n, 0) \
             FROM o LEFT JOIN e ON e.aggregate_id = o.id LEFT JOIN c ON c.order_id = o.id",
            &[&TENANT, &prefix],
        )
        .await
        .map_err(err)?;
    for row in rows {
        let entry = by_checkout.entry(row.get(0)).or_default();
        entry.orders.push(row.get(1));
        entry.events += row.get::<_, i64>(2);
        entry.charges += row.get::<_, i64>(3);
    }
    let keys = format!("chaos-{seed}-%");
    let rows = sql
        .query(
            "SELECT idempotency_key, count(*) FROM idempotency_requests \
             WHERE tenant_id = $1 AND endpoint = $2 AND idempotency_key LIKE $3 \
               AND state = 'completed' AND response_status = 201 \
             GROUP BY idempotency_key",
            &[&TENANT, &ENDPOINT, &keys],
        )
        .await
        .map_err(err)?;
    for row in rows {
        let key: String = row.get(0);
        let Some(op) = key.rsplit('-').next().and_then(|n| n.parse().ok()) else {
            continue;
        };
        by_checkout
            .entry(checkout_of(seed, op))
            .or_default()
            .remembered += row.get::<_, i64>(1);
    }
    Ok(by_checkout)
}

/// "1", or the range and how many operations are off.
fn per_operation(values: impl Iterator<Item = i64>) -> (String, usize) {
    let values: Vec<i64> = values.collect();
    let off = values.iter().filter(|v| **v != 1).count();
    let (min, max) = (
        values.iter().min().copied().unwrap_or(0),
        values.iter().max().copied().unwrap_or(0),
    );
    let text = if off == 0 {
        "1".to_owned()
    } else {
        format!("{min}–{max} ({off} operations not 1)")
    };
    (text, off)
}

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("chaos: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run() -> Result<bool, String> {
    let args = parse_args()?;
    let binary = match &args.server {
        Some(path) => path.clone(),
        None => std::env::current_exe()
            .map_err(|e| e.to_string())?
            .with_file_name("order_server"),
    };
    if !binary.is_file() {
        return Err(format!(
            "{} is missing: build the examples first (`cargo build --release --examples`)",
            binary.display()
        ));
    }
    let cluster = tokio::task::spawn_blocking(TempPostgres::start)
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("cannot start a temporary PostgreSQL: {e}"))?;
    let database_url = format!(
        "{} application_name=order_server",
        cluster.connection_string()
    );
    // A fixed address for the whole run: a free port now, reused by every restart.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free port: {e}"))?
        .to_string();
    let log = std::env::temp_dir().join(format!("chaos-order-server-{}.log", std::process::id()));
    let mut server = Server {
        binary,
        mode: args.mode.clone(),
        database_url,
        addr: addr.clone(),
        log: log.clone(),
        child: None,
    };
    // The first start applies the migrations.
    server.start().await?;
    let base = format!("http://{addr}");
    let mode = served_mode(&base).await?;
    if mode != args.mode {
        return Err(format!(
            "the server runs POST /orders in the {mode} mode, not {}",
            args.mode
        ));
    }
    eprintln!(
        "chaos: {} operations, {} clients, {} crashes, seed {}, mode {}; server log: {}",
        args.ops,
        args.clients,
        args.crashes,
        args.seed,
        args.mode,
        log.display()
    );

    let started = Instant::now();
    let deadline = started + args.deadline;
    let counters = Arc::new(Counters::default());
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let finals: Arc<Mutex<Vec<Option<Final>>>> = Arc::new(Mutex::new(vec![None; args.ops]));
    let clients: Vec<_> = (0..args.clients)
        .map(|c| {
            let (counters, next, done, finals) =
                (counters.clone(), next.clone(), done.clone(), finals.clone());
            let (base, seed, ops) = (base.clone(), args.seed, args.ops);
            tokio::spawn(async move {
                let http = Client::builder(TokioExecutor::new()).build_http();
                let mut rng = Rng::new(seed ^ ((c as u64 + 1) << 32));
                loop {
                    let op = next.fetch_add(1, SeqCst);
                    if op >= ops {
                        return;
                    }
                    let answer =
                        operation(&http, &base, seed, op, &mut rng, &counters, deadline).await;
                    finals.lock().unwrap_or_else(|p| p.into_inner())[op] = Some(answer);
                    done.fetch_add(1, SeqCst);
                }
            })
        })
        .collect();

    // Crash points: random moments spread over the run, by progress.
    let mut rng = Rng::new(args.seed);
    let span = (args.ops * 8 / 10).max(1) as u64;
    let mut points: Vec<usize> = (0..args.crashes)
        .map(|_| args.ops / 10 + rng.below(span) as usize)
        .collect();
    points.sort_unstable();
    let mut crashes = 0;
    let mut downtime = Duration::ZERO;
    for point in points {
        while done.load(SeqCst) < point && done.load(SeqCst) < args.ops {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        if done.load(SeqCst) >= args.ops {
            break;
        }
        // Somewhere inside whatever the server is doing right now.
        tokio::time::sleep(Duration::from_millis(rng.below(25))).await;
        server.crash().await?;
        crashes += 1;
        let down = Instant::now();
        server.start().await?;
        downtime += down.elapsed();
    }
    for client in clients {
        client.await.map_err(|e| format!("a client failed: {e}"))?;
    }
    let load_time = started.elapsed();

    let sql = connect(&cluster.connection_string()).await?;
    let drained = drain(&sql, args.ops).await;
    let stored = stored(&sql, args.seed, args.ops).await?;
    let stopped = server.stop().await;

    let finals = std::mem::take(&mut *finals.lock().unwrap_or_else(|p| p.into_inner()));
    let mut duplicates = 0;
    let mut lost = 0;
    let mut mismatched = 0;
    let mut examples = Vec::new();
    for (op, answer) in finals.iter().enumerate() {
        let held = &stored[&checkout_of(args.seed, op)];
        duplicates += held.orders.len().saturating_sub(1);
        if held.orders.is_empty() {
            lost += 1;
        }
        let matches = match answer {
            Some(Final::Created {
                order_id: Some(id), ..
            }) => held.orders.contains(id),
            _ => false,
        };
        if !matches || held.orders.len() != 1 {
            mismatched += usize::from(!matches);
            if examples.len() < 5 {
                let answer = match answer {
                    Some(Final::Created { order_id, .. }) => format!("201 naming {order_id:?}"),
                    Some(Final::Other(what)) => what.clone(),
                    None => "none".to_owned(),
                };
                examples.push(format!(
                    "operation {op}: answer {answer}, orders {:?}",
                    held.orders
                ));
            }
        }
    }
    // Operations whose first answer was lost with a crashed server after
    // the order committed: the retry was answered from the memory.
    let replayed = finals
        .iter()
        .filter(|f| matches!(f, Some(Final::Created { replayed: true, .. })))
        .count();
    let orders: usize = stored.values().map(|s| s.orders.len()).sum();
    let ops_held = || (0..args.ops).map(|op| &stored[&checkout_of(args.seed, op)]);
    let (events, events_off) = per_operation(ops_held().map(|s| s.events));
    let (remembered, remembered_off) = per_operation(ops_held().map(|s| s.remembered));
    let (charges, charges_off) = per_operation(ops_held().map(|s| s.charges));
    let c = |n: &AtomicU64| n.load(SeqCst);
    let requests = c(&counters.requests);
    let retries = requests.saturating_sub(args.ops as u64);

    println!("| measure | value |");
    println!("| --- | --- |");
    println!("| mode | {mode} |");
    println!("| operations | {} |", args.ops);
    println!("| clients | {} |", args.clients);
    println!("| requests | {requests} |");
    println!("| retries | {retries} |");
    println!(
        "| retries after a connection error | {} |",
        c(&counters.connection_errors)
    );
    println!("| retries after a timeout | {} |", c(&counters.timeouts));
    println!("| retries after a 5xx | {} |", c(&counters.server_errors));
    println!(
        "| retries after 409 in progress | {} |",
        c(&counters.in_progress)
    );
    println!("| crashes | {crashes} |");
    println!("| final answers that were replays | {replayed} |");
    println!("| orders | {orders} |");
    println!("| duplicates | {duplicates} |");
    println!("| lost | {lost} |");
    println!("| mismatched answers | {mismatched} |");
    println!("| outbox events per order | {events} |");
    println!("| remembered results per operation | {remembered} |");
    println!("| charges per order | {charges} |");
    println!("| load time | {:.1} s |", load_time.as_secs_f64());
    println!(
        "| server down (restarts) | {:.1} s |",
        downtime.as_secs_f64()
    );
    match &drained {
        Ok(took) => println!(
            "| relay drain after the load | {:.1} s |",
            took.as_secs_f64()
        ),
        Err(_) => println!("| relay drain after the load | not drained |"),
    }

    let mut ok = true;
    for line in &examples {
        eprintln!("chaos: {line}");
    }
    let mut fail = |what: String| {
        eprintln!("chaos: FAILED: {what}");
        ok = false;
    };
    if duplicates + lost + mismatched > 0 {
        fail(format!(
            "{duplicates} duplicates, {lost} lost, {mismatched} mismatched answers"
        ));
    }
    if events_off + remembered_off + charges_off > 0 {
        fail(format!("{events_off} operations without exactly one outbox event, {remembered_off} without exactly one remembered result, {charges_off} without exactly one charge"));
    }
    if crashes < args.crashes {
        fail(format!(
            "the run ended after {crashes} of {} crashes",
            args.crashes
        ));
    }
    if let Err(e) = drained {
        fail(e);
    }
    if let Err(e) = stopped {
        fail(e);
    }
    if ok {
        let _ = std::fs::remove_file(&log);
    } else {
        eprintln!("chaos: server log kept at {}", log.display());
    }
    drop(cluster);
    Ok(ok)
}
