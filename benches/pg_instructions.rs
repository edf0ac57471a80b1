//! A create in instructions, counted by callgrind: a unit that holds still.
//! PostgreSQL's side counts the same to a fraction of a percent whatever
//! else the machine does, the process's within about 10 % (the runtime
//! polls a little more or less), where CPU time moves by 10 % between runs
//! of the same code.
//!
//! PostgreSQL's side: the cluster runs under `valgrind --tool=callgrind`;
//! each scenario's requests run one after another on one connection (one
//! backend), which callgrind counts on its own and writes out when it
//! exits. A backend that only connects and warms up (statements prepared,
//! functions compiled, caches filled) is counted the same way, and the
//! difference over the number of requests is what one request costs.
//!
//! The process's side: this bench runs itself again under callgrind for
//! one scenario at a time, against a cluster of its own run as usual, with
//! the requests and with a third of them; the difference over the
//! difference in requests. It holds the layer, `PgStore` and the driver,
//! not HTTP (the tower service is called in process).
//!
//! Scenarios: bare (the order and its outbox event in a transaction), the
//! hand-written claim at commit with a minimal key row and with the full
//! record (the layer's own one-commit insert, its text and parameters: the
//! anchor the one-commit mode is measured against), the one-commit mode and
//! the default mode (claim first), the last two through the layer and
//! `PgStore` as an application runs them. Every scenario is the same tower
//! service shape, called in process (a JSON request collected and parsed,
//! a pool of one connection, a JSON answer), and sends `outbox::enqueue`'s
//! own statement for the event.
//!
//! The process's allocations per request are counted too (a counting
//! global allocator, over the requests after the warm-up, in the run that
//! counts PostgreSQL's side). The last line is `RATIOS
//! pgi_onecommit_vs_experiment=… proci_onecommit_vs_experiment=…
//! allocs_onecommit=…` and more, against the full-record experiment.
//!
//!     cargo bench --features test-util --bench pg_instructions
//!
//! `PGI_REQUESTS` (default 300) requests per scenario; `PGI_ONLY`, the
//! scenarios whose names hold one of its comma-separated words; `PGI_SETUP`,
//! SQL run after the migrations (to count a variant: a function replaced,
//! an index added); `PGI_LOCALE`, a locale (`en_US.UTF-8`) to create the
//! scenarios' database in instead of the cluster's C. Needs valgrind (`apt-get install valgrind`); takes about
//! a minute and a half.

#![allow(unsafe_code)] // the counting allocator, and nothing else

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tower::{util::BoxCloneSyncService, Service as _, ServiceExt as _};
use tower_idempotency::{
    outbox,
    postgres::{PgStore, PgTx, SessionReset},
    testing::{Shutdown, TempPostgres},
    RequestBody,
};

#[path = "support/create.rs"]
#[allow(dead_code)]
mod create;

use create::Service;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Every scenario's service: the answer's body is dropped once answered
/// (the layer's is buffered already; the hand-written one's is built).
type Plain = BoxCloneSyncService<Request<Full<Bytes>>, Response<()>, BoxError>;

const ORDERS: &str = "CREATE TABLE orders (id uuid PRIMARY KEY DEFAULT gen_random_uuid(), \
     tenant_id text NOT NULL, checkout_id text NOT NULL, total bigint NOT NULL, \
     created_at timestamptz NOT NULL DEFAULT now(), UNIQUE (tenant_id, checkout_id)); \
     DROP TRIGGER outbox_events_notify_insert ON outbox_events;";
const INSERT_ORDER: &str =
    "INSERT INTO orders (tenant_id, checkout_id, total) VALUES ($1, $2, $3) RETURNING id::text";
/// `outbox::enqueue`'s own statement, for the hand-written scenarios too.
const ENQUEUE: &str = tower_idempotency::testing::statements::ENQUEUE;
/// The layer's one-commit insert, for the full-record experiment.
const CLAIM_AT_COMMIT: &str = tower_idempotency::testing::statements::CLAIM_AT_COMMIT;
/// The layer's default retention, in seconds, as the full record sends it.
const RETENTION_SECS: f64 = 24.0 * 3600.0;
const REMEMBER: &str = "INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, \
     request_fingerprint, state, response_status, response_headers, response_body, completed_at, \
     expires_at) VALUES ('bench', 'at-commit', $1, $2, 'completed', 201, '', $3, now(), \
     now() + interval '1 day')";
const WARM_UP: usize = 20;

/// The header block the layer stores for the layered handler's answer
/// (`content-type: application/json`).
static HEADER_BLOCK: std::sync::LazyLock<Vec<u8>> = std::sync::LazyLock::new(|| {
    let mut headers = http::HeaderMap::new();
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    tower_idempotency::record::StoredResponse::new(
        StatusCode::CREATED,
        &headers,
        &[http::header::CONTENT_TYPE],
        Bytes::new(),
    )
    .encode_headers()
});

/// Counts allocations (it only forwards to the system allocator).
struct Counting;

static ALLOCATIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

// SAFETY: every call forwards to `System` with the caller's arguments.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        unsafe { std::alloc::System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Allocations so far (a `realloc` counts as one).
fn allocated() -> u64 {
    ALLOCATIONS.load(std::sync::atomic::Ordering::Relaxed)
}

/// How one scenario sends its requests.
#[derive(Clone, Copy, PartialEq)]
enum Scenario {
    Bare,
    Experiment,
    FullRecord,
    OneCommit,
    Trusted,
    Default,
    Observed,
}

impl Scenario {
    const ALL: [Scenario; 7] = [
        Scenario::Bare,
        Scenario::Experiment,
        Scenario::FullRecord,
        Scenario::OneCommit,
        Scenario::Trusted,
        Scenario::Default,
        Scenario::Observed,
    ];

    fn name(self) -> &'static str {
        match self {
            Scenario::Bare => "bare (no layer)",
            Scenario::Experiment => "claim at commit, hand-written",
            Scenario::FullRecord => "claim at commit, full record, hand-written",
            Scenario::OneCommit => "one-commit create",
            Scenario::Trusted => "one-commit create, trusted handlers",
            Scenario::Default => "default create (claim first)",
            Scenario::Observed => "one-commit create, observed",
        }
    }
}

/// Set in the bench's own runs under callgrind (the process's side): the
/// scenario to run, against a cluster run as usual.
const CHILD: &str = "PGI_CHILD";

fn main() {
    let requests: usize = std::env::var("PGI_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    if Command::new("valgrind").arg("--version").output().is_err() {
        panic!("valgrind is needed (apt-get install valgrind)");
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut pg = TempPostgres::start().expect("a temporary PostgreSQL");
    let config = runtime.block_on(database(pg.config()));
    runtime.block_on(prepare(&config));
    if let Ok(name) = std::env::var(CHILD) {
        let scenario = Scenario::ALL
            .into_iter()
            .find(|s| s.name() == name)
            .expect("a scenario's name");
        let _ = runtime.block_on(backend(&config, scenario, requests));
        return;
    }
    // The process's side subtracts a run of a third of the requests.
    let requests = requests.max(3);
    let scenarios = selected();
    pg.stop(Shutdown::Fast).expect("stop");

    let data = pg.data_dir().to_path_buf();
    let out = data.parent().expect("cluster dir").join("callgrind");
    std::fs::create_dir_all(&out).expect("callgrind dir");
    chown_like(&out, &data);
    let server = under_callgrind(&pg, &out);
    runtime.block_on(wait_until_ready(&config));
    let mut database = Vec::new();
    let mut allocations = Vec::new();
    for &scenario in &scenarios {
        let count = |n| {
            runtime.block_on(async {
                let (pid, allocations) = backend(&config, scenario, n).await;
                (counted(&out.join(format!("cg.{pid}"))).await, allocations)
            })
        };
        let ((base, _), (full, allocated)) = (count(0), count(requests));
        database.push((scenario, full.saturating_sub(base) as f64 / requests as f64));
        allocations.push((scenario, allocated as f64 / requests as f64));
    }
    drop(server);
    let mut process = Vec::new();
    for &scenario in &scenarios {
        process.push((scenario, process_side(scenario, requests, &out)));
    }

    println!("Instructions per request ({requests} requests a scenario, one after another), and the process's allocations:");
    println!();
    println!("| scenario | PostgreSQL | over bare | over the full record | the process (no HTTP) | over bare | over the full record | allocations |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    let of = |counts: &[(Scenario, f64)], s: Scenario| {
        counts.iter().find(|(c, _)| *c == s).map(|(_, n)| *n)
    };
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => format!("{:.3}", a / b),
        _ => "n/a".to_owned(),
    };
    for &scenario in &scenarios {
        let cells = [&database, &process].map(|counts| {
            let n = of(counts, scenario);
            format!(
                "{:.0} | {} | {}",
                n.unwrap_or(0.0),
                ratio(n, of(counts, Scenario::Bare)),
                ratio(n, of(counts, Scenario::FullRecord))
            )
        });
        println!(
            "| {} | {} | {} | {:.1} |",
            scenario.name(),
            cells[0],
            cells[1],
            of(&allocations, scenario).unwrap_or(0.0)
        );
    }
    let both = |s: Scenario| Some(of(&database, s)? + of(&process, s)?);
    let count = |v: Option<f64>| v.map_or("n/a".to_owned(), |v| format!("{v:.1}"));
    println!();
    println!(
        "RATIOS pgi_onecommit_vs_experiment={} proci_onecommit_vs_experiment={} allocs_onecommit={} \
         pgi_onecommit_trusted_vs_experiment={} proci_onecommit_trusted_vs_experiment={} \
         allocs_experiment={} allocs_default={} pgi_onecommit_vs_minimal_experiment={} \
         proci_onecommit_vs_minimal_experiment={} pgi_default_vs_bare={} both_onecommit_vs_experiment={} \
         proci_observed_vs_onecommit={}",
        ratio(
            of(&database, Scenario::OneCommit),
            of(&database, Scenario::FullRecord)
        ),
        ratio(
            of(&process, Scenario::OneCommit),
            of(&process, Scenario::FullRecord)
        ),
        count(of(&allocations, Scenario::OneCommit)),
        ratio(
            of(&database, Scenario::Trusted),
            of(&database, Scenario::FullRecord)
        ),
        ratio(
            of(&process, Scenario::Trusted),
            of(&process, Scenario::FullRecord)
        ),
        count(of(&allocations, Scenario::FullRecord)),
        count(of(&allocations, Scenario::Default)),
        ratio(
            of(&database, Scenario::OneCommit),
            of(&database, Scenario::Experiment)
        ),
        ratio(
            of(&process, Scenario::OneCommit),
            of(&process, Scenario::Experiment)
        ),
        ratio(of(&database, Scenario::Default), of(&database, Scenario::Bare)),
        ratio(both(Scenario::OneCommit), both(Scenario::FullRecord)),
        ratio(
            of(&process, Scenario::Observed),
            of(&process, Scenario::OneCommit)
        ),
    );
}

/// The database the scenarios run in: the cluster's own (locale C), or one
/// created in the locale `PGI_LOCALE` names (what a database created by a
/// managed service or a distribution's cluster tools has: text compared by
/// the locale's rules wherever the key's columns say nothing else).
async fn database(mut config: tokio_postgres::Config) -> tokio_postgres::Config {
    let Ok(locale) = std::env::var("PGI_LOCALE") else {
        return config;
    };
    let (client, connection) = config
        .connect(tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(connection);
    let literal = locale.replace('\'', "''");
    client
        .batch_execute(&format!(
            "CREATE DATABASE pgi TEMPLATE template0 ENCODING 'UTF8' LOCALE '{literal}'"
        ))
        .await
        .unwrap_or_else(|e| {
            panic!("a database in locale {locale:?} (is it installed? locale -a): {e}")
        });
    config.dbname("pgi");
    config
}

/// The schema: the crate's migrations, the orders table, `PGI_SETUP`.
async fn prepare(config: &tokio_postgres::Config) {
    let store = PgStore::builder(config.clone()).build().expect("store");
    store.migrate().await.expect("migrations");
    let (client, connection) = config
        .connect(tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(connection);
    client.batch_execute(ORDERS).await.expect("schema");
    if let Ok(setup) = std::env::var("PGI_SETUP") {
        client.batch_execute(&setup).await.expect("PGI_SETUP");
    }
}

/// The scenarios `PGI_ONLY` names (all without it).
fn selected() -> Vec<Scenario> {
    let only: Option<Vec<String>> = std::env::var("PGI_ONLY")
        .ok()
        .map(|only| only.split(',').map(|w| w.trim().to_owned()).collect());
    Scenario::ALL
        .into_iter()
        .filter(|s| match &only {
            Some(only) => only.iter().any(|w| s.name().contains(w.as_str())),
            None => true,
        })
        .collect()
}

/// The process's instructions per request of `scenario`: this bench run
/// again under callgrind for that scenario alone, once with `requests` and
/// once with a third of them, against a cluster of its own run as usual;
/// the difference over the difference in requests.
fn process_side(scenario: Scenario, requests: usize, out: &Path) -> f64 {
    let few = requests / 3;
    let total = |n: usize| {
        let file = out.join(format!("process.{n}.{}", run_tag()));
        let ran = Command::new("valgrind")
            .arg("--tool=callgrind")
            .arg("--trace-children=no")
            .arg(format!("--callgrind-out-file={}", file.display()))
            .arg(std::env::current_exe().expect("this bench"))
            .env(CHILD, scenario.name())
            .env("PGI_REQUESTS", n.to_string())
            .output()
            .expect("valgrind");
        assert!(
            ran.status.success(),
            "{} under callgrind: {}",
            scenario.name(),
            String::from_utf8_lossy(&ran.stderr)
        );
        totals(&std::fs::read_to_string(&file).expect("callgrind's file")).expect("a total")
    };
    let (few_total, full_total) = (total(few), total(requests));
    full_total.saturating_sub(few_total) as f64 / (requests - few) as f64
}

/// The total of a callgrind file.
fn totals(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| {
            l.strip_prefix("totals: ")
                .or_else(|| l.strip_prefix("summary: "))
        })
        .and_then(|total| total.trim().parse().ok())
}

/// The cluster under callgrind, shut down (fast) when dropped, a panic
/// included.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg("-INT")
            .arg(self.0.id().to_string())
            .status();
        let _ = self.0.wait();
    }
}

/// Gives `path` the owner of `like` (the cluster runs as `postgres` when
/// the bench runs as root).
fn chown_like(path: &Path, like: &Path) {
    use std::os::unix::fs::MetadataExt as _;
    let meta = std::fs::metadata(like).expect("data dir");
    std::os::unix::fs::chown(path, Some(meta.uid()), Some(meta.gid())).expect("chown");
}

/// The stopped cluster started again under callgrind, as its owner, on its
/// socket and port; every backend writes `out/cg.<pid>` when it exits.
fn under_callgrind(pg: &TempPostgres, out: &Path) -> Server {
    use std::os::unix::{fs::MetadataExt as _, process::CommandExt as _};
    let config = pg.config();
    let socket = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Unix(path)) => path.clone(),
        _ => panic!("the temporary cluster listens on a Unix socket"),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let meta = std::fs::metadata(pg.data_dir()).expect("data dir");
    let mut command = Command::new("valgrind");
    command
        .arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}/cg.%p", out.display()))
        .arg(pg.bin_dir().join("postgres"))
        .arg("-D")
        .arg(pg.data_dir())
        .arg("-k")
        .arg(&socket)
        .arg("-p")
        .arg(port.to_string())
        // No autovacuum, and no checkpoint during the run: after one, the
        // first change to each page writes the whole page to the WAL, which
        // would land in whichever scenario runs then.
        .args(["-c", "listen_addresses=", "-c", "autovacuum=off"])
        .args(["-c", "checkpoint_timeout=1d", "-c", "max_wal_size=100GB"])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if running_as_root() {
        command.uid(meta.uid()).gid(meta.gid());
    }
    Server(command.spawn().expect("valgrind"))
}

fn running_as_root() -> bool {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

async fn wait_until_ready(config: &tokio_postgres::Config) {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        match config.connect(tokio_postgres::NoTls).await {
            Ok(_) => return,
            Err(e) if Instant::now() > deadline => panic!("PostgreSQL under callgrind: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// One backend's life: it connects, warms up, sends `requests` creates of
/// `scenario`, and exits; its process id, and the process's allocations
/// over the `requests` (after the warm-up).
///
/// Every scenario is the same tower service shape called in process: a
/// request with a JSON body, the body collected and parsed, the writes
/// through a deadpool-postgres pool of one connection (the layered
/// scenarios': the store's), a JSON answer.
async fn backend(
    config: &tokio_postgres::Config,
    scenario: Scenario,
    requests: usize,
) -> (i32, u64) {
    let run = run_tag();
    // Observed as production runs: a subscriber at INFO formatting to a
    // sink, and the Prometheus recorder, for this scenario alone (this
    // thread's defaults: the runtime is current-thread).
    let _observed = (scenario == Scenario::Observed).then(|| {
        use tracing_subscriber::layer::SubscriberExt as _;
        let subscriber = tracing_subscriber::registry()
            .with(tracing_subscriber::filter::LevelFilter::INFO)
            .with(
                tracing_subscriber::fmt::layer()
                    .with_writer(std::io::sink)
                    .with_ansi(false),
            );
        let recorder = Box::leak(Box::new(
            metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder(),
        ));
        (
            tracing::subscriber::set_default(subscriber),
            metrics::set_default_local_recorder(&*recorder),
        )
    });
    let (mut service, pid) = match scenario {
        Scenario::Bare | Scenario::Experiment | Scenario::FullRecord => {
            let manager = deadpool_postgres::Manager::from_config(
                config.clone(),
                tokio_postgres::NoTls,
                deadpool_postgres::ManagerConfig {
                    recycling_method: deadpool_postgres::RecyclingMethod::Fast,
                },
            );
            let pool = deadpool_postgres::Pool::builder(manager)
                .max_size(1)
                .build()
                .expect("pool");
            let pid: i32 = pool
                .get()
                .await
                .expect("client")
                .query_one("SELECT pg_backend_pid()", &[])
                .await
                .expect("pid")
                .get(0);
            (hand_written(pool, scenario), pid)
        }
        Scenario::OneCommit | Scenario::Trusted | Scenario::Default | Scenario::Observed => {
            let reset = if scenario == Scenario::Trusted {
                SessionReset::TrustedHandlers
            } else {
                SessionReset::Always
            };
            let store = PgStore::builder(config.clone())
                .max_connections(1)
                .session_reset(reset)
                .build()
                .expect("store");
            let pid: i32 = store
                .client()
                .await
                .expect("client")
                .query_one("SELECT pg_backend_pid()", &[])
                .await
                .expect("pid")
                .get(0);
            let service = layered(store, scenario != Scenario::Default);
            (Plain::new(service.map_response(|r| r.map(drop))), pid)
        }
    };
    let mut allocations = 0;
    for i in 0..WARM_UP + requests {
        let checkout = format!("{run}-{i}");
        let request = Request::post("/orders")
            .header("idempotency-key", &checkout)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(format!(
                r#"{{"checkout_id":"{checkout}","total":2400}}"#
            ))))
            .expect("request");
        let before = allocated();
        let answer = service
            .ready()
            .await
            .expect("ready")
            .call(request)
            .await
            .expect("answer");
        assert_eq!(answer.status(), StatusCode::CREATED);
        drop(answer);
        if i >= WARM_UP {
            allocations += allocated() - before;
        }
    }
    drop(service);
    (pid, allocations)
}

/// The total a backend's callgrind file holds, once it has exited.
async fn counted(file: &PathBuf) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(total) = std::fs::read_to_string(file)
            .ok()
            .as_deref()
            .and_then(totals)
        {
            return total;
        }
        assert!(
            Instant::now() < deadline,
            "{} was not written: did the backend exit?",
            file.display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A tag that keeps each backend's checkout ids (and keys) new.
fn run_tag() -> String {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
        .to_string()
}

/// Bare and the hand-written experiments as a tower service of the same
/// shape as the layered ones: the body collected and parsed, the order and
/// its event (`BEGIN` pipelined with the first insert), then `COMMIT`
/// (bare) or the key row pipelined with `COMMIT` (the experiments: the
/// minimal row, or the layer's own one-commit insert with its parameters).
fn hand_written(pool: deadpool_postgres::Pool, scenario: Scenario) -> Plain {
    let handler = tower::service_fn(move |request: Request<Full<Bytes>>| {
        let pool = pool.clone();
        async move {
            use sha2::Digest as _;
            let (parts, body) = request.into_parts();
            let key = parts
                .headers
                .get("idempotency-key")
                .and_then(|k| k.to_str().ok())
                .unwrap_or_default()
                .to_owned();
            let body = http_body_util::BodyExt::collect(body).await?.to_bytes();
            let order: serde_json::Value = serde_json::from_slice(&body)?;
            let checkout = order["checkout_id"].as_str().unwrap_or_default().to_owned();
            let total = order["total"].as_i64().unwrap_or_default();
            let client = pool.get().await?;
            let insert = client.prepare_cached(INSERT_ORDER).await?;
            let enqueue = client.prepare_cached(ENQUEUE).await?;
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
                [&"bench", &checkout, &total];
            let (_, row) = tokio::try_join!(
                biased;
                client.batch_execute("BEGIN"),
                client.query_one(&insert, &params)
            )?;
            let id: String = row.get(0);
            let payload = serde_json::json!({"id": id, "total": total});
            let _event: String = client
                .query_one(&enqueue, &[&"bench", &id, &"OrderCreated", &payload])
                .await?
                .get(0);
            let answer =
                serde_json::json!({"id": id, "checkout_id": checkout, "total": total}).to_string();
            // Bare stores no key row, and hashes nothing.
            let fingerprint = || sha2::Sha256::digest(&body).to_vec();
            let resource: Option<&str> = None;
            match scenario {
                Scenario::Bare => client.batch_execute("COMMIT").await?,
                Scenario::Experiment => {
                    let fingerprint = fingerprint();
                    let row: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
                        [&key, &fingerprint, &answer.as_bytes()];
                    remember_with_commit(&client, REMEMBER, &row).await?;
                }
                _ => {
                    let fingerprint = fingerprint();
                    // No trace: the request carries none.
                    let trace: Option<&str> = None;
                    let row: [&(dyn tokio_postgres::types::ToSql + Sync); 10] = [
                        &"bench",
                        &"at-commit-full",
                        &key,
                        &fingerprint,
                        &201_i16,
                        &*HEADER_BLOCK,
                        &answer.as_bytes(),
                        &resource,
                        &RETENTION_SECS,
                        &trace,
                    ];
                    remember_with_commit(&client, CLAIM_AT_COMMIT, &row).await?;
                }
            }
            Ok::<_, BoxError>(
                Response::builder()
                    .status(StatusCode::CREATED)
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(answer)))
                    .expect("response")
                    .map(drop),
            )
        }
    });
    Plain::new(handler)
}

/// The key row `sql` (prepared and cached) with `row`, and `COMMIT`
/// pipelined behind it without waiting.
async fn remember_with_commit(
    client: &deadpool_postgres::Client,
    sql: &str,
    row: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<(), BoxError> {
    let remember = client.prepare_cached(sql).await?;
    let (remembered, committed) = tokio::join!(
        biased;
        client.execute(&remember, row),
        client.batch_execute("COMMIT")
    );
    remembered?;
    committed?;
    Ok(())
}

/// The layer in the one-commit or the default mode over the same writes,
/// through the owner's transaction.
fn layered(store: PgStore, one_commit: bool) -> Service {
    let handler = tower::service_fn(|request: Request<RequestBody>| async move {
        let tx = request
            .extensions()
            .get::<PgTx>()
            .cloned()
            .ok_or("no transaction")?;
        let (parts, body) = request.into_parts();
        drop(parts);
        let body = http_body_util::BodyExt::collect(body).await?.to_bytes();
        let order: serde_json::Value = serde_json::from_slice(&body)?;
        let checkout = order["checkout_id"].as_str().unwrap_or_default().to_owned();
        let total = order["total"].as_i64().unwrap_or_default();
        let row = tx
            .query_one(INSERT_ORDER, &[&tx.tenant(), &checkout, &total])
            .await?;
        let id: String = row.get(0);
        let payload = serde_json::json!({"id": id, "total": total});
        outbox::enqueue(&tx, &id, "OrderCreated", &payload).await?;
        let answer = serde_json::json!({"id": id, "checkout_id": checkout, "total": total});
        Ok::<_, BoxError>(
            Response::builder()
                .status(StatusCode::CREATED)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(answer.to_string())))
                .expect("response"),
        )
    });
    let layer = create::layer(store);
    if one_commit {
        BoxCloneSyncService::new(tower::Layer::layer(&layer.claim_at_commit(), handler))
    } else {
        BoxCloneSyncService::new(tower::Layer::layer(&layer, handler))
    }
}
