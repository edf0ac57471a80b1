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
//! hand-written claim at commit (the upper bound of the one-commit mode),
//! the one-commit mode and the default mode (claim first), the last two
//! through the layer and `PgStore` as an application runs them.
//!
//!     cargo bench --features test-util --bench pg_instructions
//!
//! `PGI_REQUESTS` (default 300) requests per scenario; `PGI_ONLY`, the
//! scenarios whose names hold one of its comma-separated words; `PGI_SETUP`,
//! SQL run after the migrations (to count a variant: a function replaced,
//! an index added); `PGI_LOCALE`, a locale (`en_US.UTF-8`) to create the
//! scenarios' database in instead of the cluster's C. Needs valgrind (`apt-get install valgrind`); takes about
//! a minute and a half.

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
    postgres::{PgStore, PgTx},
    testing::{Shutdown, TempPostgres},
    RequestBody,
};

#[path = "support/create.rs"]
#[allow(dead_code)]
mod create;

use create::Service;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const ORDERS: &str = "CREATE TABLE orders (id uuid PRIMARY KEY DEFAULT gen_random_uuid(), \
     tenant_id text NOT NULL, checkout_id text NOT NULL, total bigint NOT NULL, \
     created_at timestamptz NOT NULL DEFAULT now(), UNIQUE (tenant_id, checkout_id)); \
     DROP TRIGGER outbox_events_notify_insert ON outbox_events;";
const INSERT_ORDER: &str =
    "INSERT INTO orders (tenant_id, checkout_id, total) VALUES ($1, $2, $3) RETURNING id::text";
const ENQUEUE: &str = "INSERT INTO outbox_events (tenant_id, aggregate_id, event_type, payload) \
     VALUES ($1, $2, 'OrderCreated', $3)";
const REMEMBER: &str = "INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, \
     request_fingerprint, state, response_status, response_headers, response_body, completed_at, \
     expires_at) VALUES ('bench', 'at-commit', $1, $2, 'completed', 201, '', $3, now(), \
     now() + interval '1 day')";
const WARM_UP: usize = 20;

/// How one scenario sends its requests.
#[derive(Clone, Copy, PartialEq)]
enum Scenario {
    Bare,
    Experiment,
    OneCommit,
    Default,
}

impl Scenario {
    const ALL: [Scenario; 4] = [
        Scenario::Bare,
        Scenario::Experiment,
        Scenario::OneCommit,
        Scenario::Default,
    ];

    fn name(self) -> &'static str {
        match self {
            Scenario::Bare => "bare (no layer)",
            Scenario::Experiment => "claim at commit, hand-written",
            Scenario::OneCommit => "one-commit create",
            Scenario::Default => "default create (claim first)",
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
        runtime.block_on(backend(&config, scenario, requests));
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
    for &scenario in &scenarios {
        let count = |n| {
            runtime.block_on(async {
                let pid = backend(&config, scenario, n).await;
                counted(&out.join(format!("cg.{pid}"))).await
            })
        };
        let (base, full) = (count(0), count(requests));
        database.push((scenario, full.saturating_sub(base) as f64 / requests as f64));
    }
    drop(server);
    let mut process = Vec::new();
    for &scenario in &scenarios {
        process.push((scenario, process_side(scenario, requests, &out)));
    }

    println!("Instructions per request ({requests} requests a scenario, one after another):");
    println!();
    println!("| scenario | PostgreSQL | over bare | over the hand-written | the process (no HTTP) | over bare | over the hand-written |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
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
                ratio(n, of(counts, Scenario::Experiment))
            )
        });
        println!("| {} | {} | {} |", scenario.name(), cells[0], cells[1]);
    }
    let both = |s: Scenario| Some(of(&database, s)? + of(&process, s)?);
    println!();
    println!(
        "INSTRUCTIONS pg_onecommit_vs_experiment={} pg_default_vs_bare={} pg_experiment_vs_bare={} \
         process_onecommit_vs_experiment={} both_onecommit_vs_experiment={}",
        ratio(
            of(&database, Scenario::OneCommit),
            of(&database, Scenario::Experiment)
        ),
        ratio(of(&database, Scenario::Default), of(&database, Scenario::Bare)),
        ratio(
            of(&database, Scenario::Experiment),
            of(&database, Scenario::Bare)
        ),
        ratio(
            of(&process, Scenario::OneCommit),
            of(&process, Scenario::Experiment)
        ),
        ratio(both(Scenario::OneCommit), both(Scenario::Experiment)),
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
        .args(["-c", "listen_addresses=", "-c", "autovacuum=off"])
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
/// `scenario`, and exits; its process id.
async fn backend(config: &tokio_postgres::Config, scenario: Scenario, requests: usize) -> i32 {
    let run = run_tag();
    let pid = match scenario {
        Scenario::Bare | Scenario::Experiment => {
            let (client, connection) = config
                .connect(tokio_postgres::NoTls)
                .await
                .expect("connect");
            let task = tokio::spawn(connection);
            let pid: i32 = client
                .query_one("SELECT pg_backend_pid()", &[])
                .await
                .expect("pid")
                .get(0);
            let statements = Statements::prepare(&client).await;
            for i in 0..WARM_UP + requests {
                let checkout = format!("{run}-{i}");
                if scenario == Scenario::Bare {
                    bare(&client, &statements, &checkout).await;
                } else {
                    at_commit(&client, &statements, &checkout).await;
                }
            }
            drop(client);
            let _ = task.await;
            pid
        }
        Scenario::OneCommit | Scenario::Default => {
            let store = PgStore::builder(config.clone())
                .max_connections(1)
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
            let mut service = layered(store, scenario == Scenario::OneCommit);
            for i in 0..WARM_UP + requests {
                let checkout = format!("{run}-{i}");
                let request = Request::post("/orders")
                    .header("idempotency-key", &checkout)
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(format!(
                        r#"{{"checkout_id":"{checkout}","total":2400}}"#
                    ))))
                    .expect("request");
                let answer = service
                    .ready()
                    .await
                    .expect("ready")
                    .call(request)
                    .await
                    .expect("answer");
                assert_eq!(answer.status(), StatusCode::CREATED);
            }
            drop(service);
            pid
        }
    };
    pid
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

/// The bare scenarios' statements, prepared once per connection (as the
/// e2e bench's pool caches them).
struct Statements {
    insert: tokio_postgres::Statement,
    enqueue: tokio_postgres::Statement,
    remember: tokio_postgres::Statement,
}

impl Statements {
    async fn prepare(client: &tokio_postgres::Client) -> Statements {
        Statements {
            insert: client.prepare(INSERT_ORDER).await.expect("prepare"),
            enqueue: client.prepare(ENQUEUE).await.expect("prepare"),
            remember: client.prepare(REMEMBER).await.expect("prepare"),
        }
    }
}

/// Begins and writes the order and its event (`BEGIN` pipelined with the
/// first insert); the order's id.
async fn order_and_event(
    client: &tokio_postgres::Client,
    s: &Statements,
    checkout: &str,
) -> String {
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] = [&"bench", &checkout, &2400_i64];
    let (_, row) = tokio::try_join!(
        biased;
        client.batch_execute("BEGIN"),
        client.query_one(&s.insert, &params)
    )
    .expect("insert");
    let id: String = row.get(0);
    let payload = serde_json::json!({"id": id, "total": 2400});
    client
        .execute(&s.enqueue, &[&"bench", &id, &payload])
        .await
        .expect("enqueue");
    id
}

/// The order and its event, in a transaction (as `benches/e2e`'s bare server).
async fn bare(client: &tokio_postgres::Client, s: &Statements, checkout: &str) {
    order_and_event(client, s, checkout).await;
    client.batch_execute("COMMIT").await.expect("commit");
}

/// The hand-written claim at commit (as `benches/e2e/experiment.rs`): the
/// key row last, completed, pipelined with `COMMIT`.
async fn at_commit(client: &tokio_postgres::Client, s: &Statements, checkout: &str) {
    use sha2::Digest as _;
    let body = format!(r#"{{"checkout_id":"{checkout}","total":2400}}"#);
    let fingerprint = sha2::Sha256::digest(body.as_bytes()).to_vec();
    let id = order_and_event(client, s, checkout).await;
    let response =
        serde_json::to_vec(&serde_json::json!({"id": id, "checkout_id": checkout, "total": 2400}))
            .expect("json");
    let row: [&(dyn tokio_postgres::types::ToSql + Sync); 3] = [&checkout, &fingerprint, &response];
    let (remembered, committed) = tokio::join!(
        biased;
        client.execute(&s.remember, &row),
        client.batch_execute("COMMIT")
    );
    remembered.expect("remember");
    committed.expect("commit");
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
