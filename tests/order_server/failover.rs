//! Primary failover under the example order server: a primary and a
//! streaming standby built with `pg_basebackup -R`, the server's
//! `DATABASE_URL` naming both hosts with `target_session_attrs=read-write`,
//! the primary crashed (`-m immediate`) and the standby promoted while the
//! same server process keeps running.
//!
//! - Synchronous replication, crash under a load of creates retried with
//!   the same key: every `201` survives, no checkout has two orders, every
//!   order has one `OrderCreated` event and one remembered `201`, at most
//!   one charge per order; clients saw `503 store_unavailable` (with
//!   `Retry-After`) during the outage, then the pool found the new primary.
//! - Asynchronous replication with the standby cut off: the commits it
//!   never received vanish, each one's key row, order and event together;
//!   a retry with the same key then makes exactly one order. The charges of
//!   the orders that survived, made on the old primary alone, vanish too, and
//!   the relay makes them again under the same derived keys (which a replay
//!   cache in the providers' layers used to answer from memory instead).
//!
//! - Asynchronous, with the payment provider outside the database
//!   (`PAYMENT_PROVIDER_URL`): orders charged and then lost with the old
//!   primary are made again by the retries under the same ids, so the
//!   provider sees the same derived keys and charges each checkout once.
//!
//! Each runs in both modes of `POST /orders` (`IDEMPOTENCY_MODE`), a
//! cluster pair of its own per mode. The outage figures are printed (run
//! with `--nocapture` to see them).

use crate::common::example_binary;
use crate::common::standby;

use std::{
    collections::{BTreeMap, HashMap},
    process::Stdio,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use serde_json::json;
use tokio::{
    io::{AsyncBufReadExt, BufReader},
    process::{Child, Command},
    time::Instant,
};
use tower_idempotency::testing::{Shutdown, TempPostgres};

use example_binary::{both_modes, example_binary, Answer, Mode};
use standby::{socket_dir, Standby, PORT};

const TOKEN_A: &str = "demo-token-a";
const DB: &str = "shop";
/// Bound on every wait of these tests.
const DEADLINE: Duration = Duration::from_secs(30);

/// A primary ready to be copied: `full_page_writes` on (a base backup
/// needs it), `synchronous_commit` on (a synchronous standby is waited for
/// only then), the rest as the harness's fast defaults.
fn primary() -> TempPostgres {
    TempPostgres::builder()
        .setting("wal_level", "replica")
        .setting("max_wal_senders", "5")
        .setting("full_page_writes", "on")
        .setting("synchronous_commit", "on")
        .start()
        .unwrap_or_else(|e| panic!("{e}"))
}

async fn connect(config: &tokio_postgres::Config) -> tokio_postgres::Client {
    let (client, connection) = config
        .connect(tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("connecting to {config:?}: {e}"));
    tokio::spawn(connection);
    client
}

fn db_config(primary: &TempPostgres, dbname: &str) -> tokio_postgres::Config {
    let mut config = primary.config();
    config.dbname(dbname);
    config
}

/// Polls `probe` until it holds, failing the test after [`DEADLINE`].
async fn eventually<Fut: std::future::Future<Output = bool>>(
    what: &str,
    mut probe: impl FnMut() -> Fut,
) {
    let deadline = Instant::now() + DEADLINE;
    while !probe().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The primary, a standby streaming from it, the database the server uses,
/// and the server's `DATABASE_URL` naming both.
struct Pair {
    primary: TempPostgres,
    standby: Standby,
    url: String,
}

impl Pair {
    async fn start(synchronous: bool) -> Pair {
        let primary = tokio::task::spawn_blocking(primary).await.unwrap();
        let admin = connect(&primary.config()).await;
        admin
            .batch_execute(&format!("CREATE DATABASE {DB}"))
            .await
            .unwrap();
        let standby = {
            // pg_basebackup and the standby's start block for a second or two.
            let primary_ref = &primary;
            tokio::task::block_in_place(|| Standby::start(primary_ref))
        };
        eventually("the standby to stream", || async {
            admin
                .query_one(
                    "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'",
                    &[],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
                == 1
        })
        .await;
        if synchronous {
            admin
                .batch_execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
                .await
                .unwrap();
            admin
                .batch_execute("SELECT pg_reload_conf()")
                .await
                .unwrap();
            eventually("the standby to be synchronous", || async {
                admin
                    .query_one(
                        "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'",
                        &[],
                    )
                    .await
                    .unwrap()
                    .get::<_, i64>(0)
                    == 1
            })
            .await;
        }
        let url = format!(
            "host={},{} port={PORT} user=postgres dbname={DB} target_session_attrs=read-write",
            socket_dir(&primary).display(),
            standby.socket_dir().display()
        );
        Pair {
            primary,
            standby,
            url,
        }
    }

    /// Crashes the primary as `pg_ctl stop -m immediate` does (SIGQUIT:
    /// every backend exits at once, nothing is flushed or handed over).
    async fn crash_primary(&mut self) {
        let primary = &mut self.primary;
        tokio::task::block_in_place(|| primary.stop(Shutdown::Immediate)).unwrap();
    }

    /// Waits until the standby has replayed everything the primary
    /// committed, then cuts it off (its WAL receiver stops: an empty
    /// `primary_conninfo`) and waits until the primary sees it gone; the
    /// primary goes on acknowledging commits. A connection to the standby.
    async fn cut_off_once_replayed(
        &mut self,
        primary_sql: &tokio_postgres::Client,
    ) -> tokio_postgres::Client {
        eventually(
            "the standby to replay what the primary committed",
            || async {
                count(
                primary_sql,
                "SELECT count(*) FROM pg_stat_replication WHERE replay_lsn >= pg_current_wal_lsn()",
            )
            .await
                == 1
            },
        )
        .await;
        self.standby.cut_off();
        let standby_sql = connect(&self.standby.config(DB)).await;
        standby_sql
            .batch_execute("SELECT pg_reload_conf()")
            .await
            .unwrap();
        eventually("the standby to stop streaming", || async {
            count(primary_sql, "SELECT count(*) FROM pg_stat_replication").await == 0
        })
        .await;
        standby_sql
    }

    /// `SELECT pg_promote(false)` on the standby, then polls
    /// `pg_is_in_recovery()` until it has left recovery (`pg_promote(true)`
    /// would only check every 100 ms).
    async fn promote(&self) -> tokio_postgres::Client {
        let standby = connect(&self.standby.config(DB)).await;
        let signalled: bool = standby
            .query_one("SELECT pg_promote(false)", &[])
            .await
            .unwrap_or_else(|e| panic!("pg_promote: {e}; log:\n{}", self.standby.log()))
            .get(0);
        assert!(signalled, "pg_promote signalled the standby");
        let deadline = Instant::now() + DEADLINE;
        while standby
            .query_one("SELECT pg_is_in_recovery()", &[])
            .await
            .unwrap()
            .get::<_, bool>(0)
        {
            assert!(
                Instant::now() < deadline,
                "the standby was not promoted in time; log:\n{}",
                self.standby.log()
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        standby
    }
}

/// The server process.
struct Server {
    child: Child,
    pid: u32,
    http: Http,
}

/// The server's HTTP side, shared by the clients.
#[derive(Clone)]
struct Http {
    base: String,
    client: Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
}

impl Server {
    async fn start(database_url: &str, mode: Mode) -> Server {
        Server::start_with(database_url, mode, &[]).await
    }

    /// [`start`](Self::start) with `env` on top.
    async fn start_with(database_url: &str, mode: Mode, env: &[(&str, &str)]) -> Server {
        let mut child = Command::new(example_binary())
            .env("DATABASE_URL", database_url)
            .envs([mode.env()])
            .envs(env.iter().copied())
            .env("ORDER_SERVER_ADDR", "127.0.0.1:0")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("the example server starts");
        let pid = child.id().expect("running");
        let log = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().expect("stderr");
        tokio::spawn({
            let log = log.clone();
            async move {
                let mut lines = BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    // Only the first lines: the outage logs one error per failed request.
                    let mut log = log.lock().unwrap();
                    if log.len() < 20_000 {
                        eprintln!("{line}");
                        log.push_str(&line);
                        log.push('\n');
                    }
                }
            }
        });
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .await
            .expect("reads stdout");
        let base = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| {
                panic!(
                    "unexpected first line: {line:?}; log:\n{}",
                    log.lock().unwrap()
                )
            })
            .to_owned();
        let mut http = Client::builder(TokioExecutor::new());
        http.pool_idle_timeout(Duration::from_secs(5));
        let server = Server {
            child,
            pid,
            http: Http {
                base,
                client: http.build_http(),
            },
        };
        mode.assert_serves(&server.http.metrics().await);
        server
    }

    /// Asserts that the process started by the test is still the one running.
    fn assert_still_running(&mut self) {
        assert!(
            self.child.try_wait().unwrap().is_none(),
            "the server process kept running through the failover"
        );
        assert_eq!(self.child.id(), Some(self.pid), "the same server process");
    }

    async fn stop(mut self) -> std::process::ExitStatus {
        let killed = Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .status()
            .await
            .unwrap();
        assert!(killed.success());
        tokio::time::timeout(Duration::from_secs(20), self.child.wait())
            .await
            .expect("the server exits after SIGTERM")
            .unwrap()
    }
}

impl Http {
    /// The text of `GET /metrics`.
    async fn metrics(&self) -> String {
        let (_, body) = self.fetch("/metrics").await;
        String::from_utf8(body.to_vec()).expect("UTF-8")
    }

    /// `GET path` as tenant A: its status and body as JSON.
    async fn get(&self, path: &str) -> (StatusCode, serde_json::Value) {
        let (status, body) = self.fetch(path).await;
        (status, serde_json::from_slice(&body).unwrap_or_default())
    }

    /// `GET path` as tenant A (`/metrics` needs no token and ignores it).
    async fn fetch(&self, path: &str) -> (StatusCode, Bytes) {
        let request = Request::get(format!("{}{path}", self.base))
            .header("authorization", format!("Bearer {TOKEN_A}"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let response = self.client.request(request).await.expect("server answers");
        let status = response.status();
        let body = response.into_body().collect().await.expect("body");
        (status, body.to_bytes())
    }

    /// POST /orders; `Err` when the transport failed.
    async fn post_order(&self, key: &str, body: &str) -> Result<Answer, String> {
        let request = Request::builder()
            .method(Method::POST)
            .uri(format!("{}/orders", self.base))
            .header("authorization", format!("Bearer {TOKEN_A}"))
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(Full::new(Bytes::copy_from_slice(body.as_bytes())))
            .unwrap();
        let response = tokio::time::timeout(DEADLINE, self.client.request(request))
            .await
            .map_err(|_| "no answer within the deadline".to_owned())?
            .map_err(|e| e.to_string())?;
        let (parts, body) = response.into_parts();
        let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok(Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }
}

fn order(checkout: &str) -> String {
    json!({
        "checkout_id": checkout,
        "currency": "JPY",
        "items": [{"sku": "SKU-1", "quantity": 2, "unit_price": 1200}],
        "shipping_address_id": "addr_1"
    })
    .to_string()
}

/// What the clients saw during a failover.
#[derive(Default)]
struct Log {
    /// key -> the order id its `201` named.
    created: BTreeMap<String, String>,
    /// Answers `503 store_unavailable` (each carried `Retry-After`).
    unavailable: usize,
    /// Requests that got no HTTP answer.
    transport_errors: usize,
    /// `201`s that were replays (a retry whose first attempt had committed).
    replays: usize,
    /// When the first request sent after the crash was answered `201`.
    first_created_after_crash: Option<Instant>,
}

/// Sends `key` until it is answered `201`, retrying the same key and body
/// after a `503` or a transport error; any other answer fails the test.
async fn create_with_retries(
    server: &Http,
    key: &str,
    checkout: &str,
    crashed_at: &Mutex<Option<Instant>>,
    log: &Mutex<Log>,
) -> String {
    let body = order(checkout);
    let deadline = Instant::now() + DEADLINE;
    loop {
        assert!(
            Instant::now() < deadline,
            "{key} was not created within {DEADLINE:?}"
        );
        let sent = Instant::now();
        match server.post_order(key, &body).await {
            Ok(answer) if answer.status == StatusCode::CREATED => {
                let id = answer.json()["id"].as_str().unwrap().to_owned();
                let mut log = log.lock().unwrap();
                if answer.replayed() {
                    log.replays += 1;
                }
                let after_crash = crashed_at.lock().unwrap().is_some_and(|at| sent >= at);
                if after_crash && log.first_created_after_crash.is_none() {
                    log.first_created_after_crash = Some(Instant::now());
                }
                log.created.insert(key.to_owned(), id.clone());
                return id;
            }
            Ok(answer) if answer.status == StatusCode::SERVICE_UNAVAILABLE => {
                assert_eq!(
                    answer.json()["code"],
                    "store_unavailable",
                    "{key}: {answer:?}"
                );
                assert!(
                    answer.headers.contains_key("retry-after"),
                    "a 503 carries Retry-After: {answer:?}"
                );
                log.lock().unwrap().unavailable += 1;
            }
            Ok(answer) => panic!(
                "{key}: only 201 or 503 store_unavailable are expected through a failover: {} {}",
                answer.status,
                String::from_utf8_lossy(&answer.body)
            ),
            Err(_) => log.lock().unwrap().transport_errors += 1,
        }
        // Retry-After asks for whole seconds; these clients retry after 50 ms
        // to time the outage.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// How many of the orders `ids` have a charge.
async fn charged(sql: &tokio_postgres::Client, ids: &[String]) -> i64 {
    sql.query_one(
        "SELECT count(*) FROM payment_charges WHERE order_id = ANY($1)",
        &[&ids],
    )
    .await
    .unwrap()
    .get(0)
}

async fn count(sql: &tokio_postgres::Client, query: &str) -> i64 {
    sql.query_one(query, &[])
        .await
        .unwrap_or_else(|e| panic!("{query}: {e}"))
        .get(0)
}

const CLIENTS: usize = 4;
const ORDERS_PER_CLIENT: usize = 40;
/// Creates answered before the primary is crashed.
const CRASH_AFTER: usize = 30;

async fn synchronous_failover_under_load_loses_and_doubles_nothing(mode: Mode) {
    let mut pair = Pair::start(true).await;
    let mut server = Server::start(&pair.url, mode).await;
    let log = Arc::new(Mutex::new(Log::default()));
    let crashed_at = Arc::new(Mutex::new(None::<Instant>));
    let answered = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (http, log, crashed_at, answered) = (
                server.http.clone(),
                log.clone(),
                crashed_at.clone(),
                answered.clone(),
            );
            tokio::spawn(async move {
                for n in 0..ORDERS_PER_CLIENT {
                    let key = format!("sync-{c}-{n}");
                    create_with_retries(&http, &key, &format!("chk-{key}"), &crashed_at, &log)
                        .await;
                    answered.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();

    eventually("the first creates", || async {
        answered.load(Ordering::SeqCst) >= CRASH_AFTER
    })
    .await;
    let in_flight_at_crash = answered.load(Ordering::SeqCst);
    pair.crash_primary().await;
    let crash = Instant::now();
    *crashed_at.lock().unwrap() = Some(crash);
    let sql = pair.promote().await;
    let promoted_after = crash.elapsed();
    for client in clients {
        client.await.expect("a client finished");
    }
    let load_took = started.elapsed();

    let log = std::mem::take(&mut *log.lock().unwrap());
    let first_after = log
        .first_created_after_crash
        .expect("a request sent after the crash was created");
    let outage = first_after - crash;
    eprintln!(
        "synchronous failover, {}: {} creates ({} answered before the crash), {} answers 503 \
         store_unavailable, {} transport errors, {} replayed 201s; promotion done {:?} after \
         the crash; outage (crash to the first 201 of a request sent after it) {:?}; whole load {:?}",
        mode.name(),
        log.created.len(),
        in_flight_at_crash,
        log.unavailable,
        log.transport_errors,
        log.replays,
        promoted_after,
        outage,
        load_took
    );
    assert_eq!(log.created.len(), CLIENTS * ORDERS_PER_CLIENT);
    assert!(
        log.unavailable > 0,
        "the outage was seen as 503 store_unavailable"
    );
    server.assert_still_running();

    // Every answered order exists on the promoted server, once.
    let ids: Vec<String> = log.created.values().cloned().collect();
    let present: i64 = sql
        .query_one(
            "SELECT count(*) FROM orders WHERE id::text = ANY($1)",
            &[&ids],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        present,
        ids.len() as i64,
        "every order answered 201 survived the failover"
    );
    let orders = count(&sql, "SELECT count(*) FROM orders").await;
    assert_eq!(
        orders,
        ids.len() as i64,
        "no order beyond the answered ones"
    );
    assert_eq!(
        count(
            &sql,
            "SELECT count(*) FROM (SELECT 1 FROM orders GROUP BY tenant_id, checkout_id HAVING count(*) > 1) d"
        )
        .await,
        0,
        "no checkout has two orders"
    );
    assert_eq!(
        count(
            &sql,
            "SELECT count(*) FROM orders o WHERE (SELECT count(*) FROM outbox_events e \
             WHERE e.aggregate_id = o.id::text AND e.event_type = 'OrderCreated') <> 1"
        )
        .await,
        0,
        "every order has exactly one OrderCreated event"
    );
    assert_eq!(
        count(&sql, "SELECT count(*) FROM outbox_events").await,
        orders
    );
    assert_eq!(
        count(
            &sql,
            "SELECT count(*) FROM idempotency_requests \
             WHERE endpoint = 'POST /orders v1' AND response_status = 201"
        )
        .await,
        orders,
        "one remembered 201 per order"
    );
    let mut keys = HashMap::new();
    for row in sql
        .query(
            "SELECT idempotency_key, convert_from(response_body, 'UTF8')::jsonb ->> 'id' \
             FROM idempotency_requests WHERE endpoint = 'POST /orders v1'",
            &[],
        )
        .await
        .unwrap()
    {
        keys.insert(row.get::<_, String>(0), row.get::<_, Option<String>>(1));
    }
    for (key, id) in &log.created {
        assert_eq!(
            keys.get(key),
            Some(&Some(id.clone())),
            "{key} remembers the order it was answered with"
        );
    }

    // The relay, restarted on the new primary, charges every order once.
    eventually("a charge for every order", || async {
        count(&sql, "SELECT count(DISTINCT order_id) FROM payment_charges").await == orders
    })
    .await;
    assert_eq!(
        count(
            &sql,
            "SELECT count(*) FROM (SELECT 1 FROM payment_charges GROUP BY order_id HAVING count(*) > 1) d"
        )
        .await,
        0,
        "at most one charge per order"
    );

    server.assert_still_running();
    let exit = server.stop().await;
    assert!(
        exit.success(),
        "graceful shutdown after the failover exits 0"
    );
}

async fn asynchronous_failover_loses_whole_requests_and_a_retry_makes_one_order(mode: Mode) {
    let mut pair = Pair::start(false).await;
    let mut server = Server::start(&pair.url, mode).await;
    let primary_sql = connect(&db_config(&pair.primary, DB)).await;
    let no_crash = Mutex::new(None);
    let log = Mutex::new(Log::default());

    // Orders the standby receives.
    let mut kept = Vec::new();
    for n in 0..5 {
        let key = format!("kept-{n}");
        let id =
            create_with_retries(&server.http, &key, &format!("chk-{key}"), &no_crash, &log).await;
        kept.push((key, id));
    }
    let kept_ids: Vec<String> = kept.iter().map(|(_, id)| id.clone()).collect();
    // The standby is cut off as soon as it has the orders ; the primary
    // goes on acknowledging commits.
    let standby_sql = pair.cut_off_once_replayed(&primary_sql).await;
    // The relay charges the kept orders on the primary alone: their orders
    // and events are on the standby, their charges will not be.
    eventually("the kept orders' charges on the primary", || async {
        charged(&primary_sql, &kept_ids).await == kept.len() as i64
    })
    .await;
    let mut lost = Vec::new();
    for n in 0..5 {
        let key = format!("lost-{n}");
        let id =
            create_with_retries(&server.http, &key, &format!("chk-{key}"), &no_crash, &log).await;
        lost.push((key, id));
    }
    // What the relay had delivered for them on the old primary (the fake
    // providers keep their charges in the same database).
    let lost_ids: Vec<String> = lost.iter().map(|(_, id)| id.clone()).collect();
    // The standby is readable: what it holds of the kept orders' charges.
    let kept_charged_on_standby = charged(&standby_sql, &kept_ids).await;
    let lost_charged_before = primary_sql
        .query_one(
            "SELECT count(*) FROM payment_charges WHERE order_id = ANY($1)",
            &[&lost_ids],
        )
        .await
        .unwrap()
        .get::<_, i64>(0);
    drop(primary_sql);

    pair.crash_primary().await;
    let crash = Instant::now();
    let sql = pair.promote().await;
    drop(standby_sql);

    // Each answered request is there whole or gone whole: key row, order
    // and event together.
    let whole = |key: String, id: String| {
        let sql = &sql;
        async move {
            let row = sql
                .query_one(
                    "SELECT (SELECT count(*) FROM idempotency_requests \
                             WHERE endpoint = 'POST /orders v1' AND idempotency_key = $1), \
                            (SELECT count(*) FROM orders WHERE id::text = $2), \
                            (SELECT count(*) FROM outbox_events WHERE aggregate_id = $2)",
                    &[&key, &id],
                )
                .await
                .unwrap();
            (
                row.get::<_, i64>(0),
                row.get::<_, i64>(1),
                row.get::<_, i64>(2),
            )
        }
    };
    for (key, id) in &kept {
        assert_eq!(
            whole(key.clone(), id.clone()).await,
            (1, 1, 1),
            "{key}: replicated before the cut, kept whole"
        );
    }
    let mut vanished = 0;
    for (key, id) in &lost {
        let found = whole(key.clone(), id.clone()).await;
        assert!(
            found == (0, 0, 0) || found == (1, 1, 1),
            "{key}: key row, order and event are all present or all absent, never a part: {found:?}"
        );
        if found == (0, 0, 0) {
            vanished += 1;
        }
    }
    assert_eq!(
        vanished,
        lost.len(),
        "the commits the cut-off standby never received are gone"
    );
    // Before any retry makes them again under the same ids (and the relay
    // charges them anew).
    assert_eq!(
        sql.query_one(
            "SELECT count(*) FROM payment_charges WHERE order_id = ANY($1)",
            &[&lost_ids],
        )
        .await
        .unwrap()
        .get::<_, i64>(0),
        0,
        "the charges of the vanished orders vanished with them (same database)"
    );

    // A retry with the same key makes exactly one order, the lost one again
    // under its id (the id follows from tenant, endpoint and key), and is
    // then replayed.
    let crashed_at = Mutex::new(Some(crash));
    let retry_log = Mutex::new(Log::default());
    for (key, old_id) in &lost {
        let checkout = format!("chk-{key}");
        let id = create_with_retries(&server.http, key, &checkout, &crashed_at, &retry_log).await;
        assert_eq!(
            &id, old_id,
            "{key}: the lost order is made again, under its id"
        );
        let again = server
            .http
            .post_order(key, &order(&checkout))
            .await
            .unwrap();
        assert_eq!(again.status, StatusCode::CREATED);
        assert!(again.replayed(), "{key}: then replayed");
        assert_eq!(again.json()["id"], id.as_str());
        let row = sql
            .query_one(
                "SELECT count(*) FROM orders WHERE checkout_id = $1",
                &[&checkout],
            )
            .await
            .unwrap();
        assert_eq!(row.get::<_, i64>(0), 1, "{key}: exactly one order");
    }
    let retry_log = std::mem::take(&mut *retry_log.lock().unwrap());
    let outage = retry_log.first_created_after_crash.unwrap() - crash;
    assert_eq!(
        retry_log.replays, 0,
        "no retry of a lost request found it remembered"
    );
    let orders = count(&sql, "SELECT count(*) FROM orders").await;
    let checkouts: Vec<String> = sql
        .query("SELECT checkout_id FROM orders ORDER BY 1", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(orders, (kept.len() + lost.len()) as i64, "{checkouts:?}");
    assert_eq!(
        count(
            &sql,
            "SELECT count(*) FROM idempotency_requests \
             WHERE endpoint = 'POST /orders v1' AND response_status = 201"
        )
        .await,
        orders
    );
    assert_eq!(
        count(
            &sql,
            "SELECT count(*) FROM orders o WHERE (SELECT count(*) FROM outbox_events e \
             WHERE e.aggregate_id = o.id::text AND e.event_type = 'OrderCreated') <> 1"
        )
        .await,
        0,
        "every order has exactly one OrderCreated event"
    );
    // The relay on the promoted primary charges every order there once,
    // those whose charge was lost with the old primary included.
    let deadline = Instant::now() + DEADLINE;
    while count(&sql, "SELECT count(DISTINCT order_id) FROM payment_charges").await != orders {
        if Instant::now() > deadline {
            let uncharged: Vec<String> = sql
                .query(
                    "SELECT aggregate_id || ' published_at ' || coalesce(published_at::text, '-') \
                     FROM outbox_events e WHERE NOT EXISTS \
                     (SELECT 1 FROM payment_charges c WHERE c.order_id = e.aggregate_id)",
                    &[],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| r.get(0))
                .collect();
            panic!("orders without a charge on the promoted primary: {uncharged:#?}");
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(
        count(&sql, "SELECT count(*) FROM payment_charges").await,
        orders,
        "one charge per order"
    );
    for row in sql
        .query("SELECT order_id, idempotency_key FROM payment_charges", &[])
        .await
        .unwrap()
    {
        let (order_id, key): (String, String) = (row.get(0), row.get(1));
        assert_eq!(
            key,
            tower_idempotency::outbox::derive_tenant_key("tenant-a", &order_id, "payment.charge"),
            "each charge under the key derived from its order"
        );
    }
    eprintln!(
        "asynchronous failover, {}: {} of {} acknowledged creates vanished (key row, order and event \
         together; {} of them had been charged on the old primary, and the charges vanished too), \
         {} kept ({} of their charges, made on the old primary, had reached the standby; the relay \
         made the others again, under the same derived keys, on the promoted primary); the retries (same keys) made {} new orders; {} answers 503 and {} \
         transport errors before the first retry was created, {:?} after the crash",
        mode.name(),
        vanished,
        kept.len() + lost.len(),
        lost_charged_before,
        kept.len(),
        kept_charged_on_standby,
        lost.len(),
        retry_log.unavailable,
        retry_log.transport_errors,
        outage
    );
    server.assert_still_running();
    let exit = server.stop().await;
    assert!(
        exit.success(),
        "graceful shutdown after the failover exits 0"
    );
}

/// A payment provider outside the order server's database, as real ones
/// are: it does not fail over with it. It charges once per idempotency key
/// (a repeat is answered with the first charge) and remembers every
/// request.
#[derive(Clone, Default)]
struct OutsideProvider {
    /// key -> order id charged under it.
    charges: Arc<Mutex<BTreeMap<String, String>>>,
    /// key -> requests received with it.
    requests: Arc<Mutex<HashMap<String, usize>>>,
}

impl OutsideProvider {
    /// Serves `POST /charges` on a loopback port; its base URL.
    async fn start(&self) -> String {
        use axum::{extract::State, routing::post, Json, Router};
        async fn charge(
            State(provider): State<OutsideProvider>,
            headers: http::HeaderMap,
            Json(body): Json<serde_json::Value>,
        ) -> (StatusCode, Json<serde_json::Value>) {
            let Some(key) = headers.get("idempotency-key").and_then(|k| k.to_str().ok()) else {
                return (
                    StatusCode::BAD_REQUEST,
                    Json(json!({"code": "key_missing"})),
                );
            };
            *provider
                .requests
                .lock()
                .unwrap()
                .entry(key.to_owned())
                .or_default() += 1;
            let order_id = body["order_id"].as_str().unwrap_or_default().to_owned();
            let charged = provider
                .charges
                .lock()
                .unwrap()
                .entry(key.to_owned())
                .or_insert(order_id)
                .clone();
            (
                StatusCode::CREATED,
                Json(json!({"order_id": charged, "key": key})),
            )
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let app = Router::new()
            .route("/charges", post(charge))
            .with_state(self.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        url
    }

    /// The order ids charged, one per charge.
    fn charged_orders(&self) -> Vec<String> {
        self.charges.lock().unwrap().values().cloned().collect()
    }
}

/// Orders lost in an asynchronous failover after their charge reached a
/// provider outside the database: the client's retries create them again
/// under the same ids, so the relay's deliveries carry the same derived
/// keys and the provider charges each checkout once. (With ids drawn at
/// insert, each lost checkout was charged twice: once for the lost order,
/// once for its new one.)
async fn an_order_lost_in_a_failover_is_made_again_under_its_id_and_charged_once_outside(
    mode: Mode,
) {
    let provider = OutsideProvider::default();
    let provider_url = provider.start().await;
    let mut pair = Pair::start(false).await;
    let mut server = Server::start_with(
        &pair.url,
        mode,
        &[("PAYMENT_PROVIDER_URL", provider_url.as_str())],
    )
    .await;
    let primary_sql = connect(&db_config(&pair.primary, DB)).await;
    let no_crash = Mutex::new(None);
    let log = Mutex::new(Log::default());
    let mut checkout_of: HashMap<String, String> = HashMap::new();

    let mut kept = Vec::new();
    for n in 0..3 {
        let key = format!("kept-{n}");
        let checkout = format!("chk-{key}");
        let id = create_with_retries(&server.http, &key, &checkout, &no_crash, &log).await;
        checkout_of.insert(id.clone(), checkout);
        kept.push(id);
    }
    let standby_sql = pair.cut_off_once_replayed(&primary_sql).await;
    drop(standby_sql);

    // Acknowledged on the primary alone, and charged outside.
    let mut lost = Vec::new();
    for n in 0..5 {
        let key = format!("lost-{n}");
        let checkout = format!("chk-{key}");
        let id = create_with_retries(&server.http, &key, &checkout, &no_crash, &log).await;
        checkout_of.insert(id.clone(), checkout);
        lost.push((key, id));
    }
    eventually("the provider to charge every order", || async {
        let charged = provider.charged_orders();
        kept.iter()
            .chain(lost.iter().map(|(_, id)| id))
            .all(|id| charged.contains(id))
    })
    .await;
    drop(primary_sql);

    pair.crash_primary().await;
    let sql = pair.promote().await;
    for (key, id) in &lost {
        assert_eq!(
            count(
                &sql,
                &format!("SELECT count(*) FROM orders WHERE id::text = '{id}'")
            )
            .await,
            0,
            "{key}: the order vanished with the old primary"
        );
    }

    // The client retries with its keys: the same orders again, under the
    // ids the client already holds.
    let crashed = Mutex::new(Some(Instant::now()));
    let retry_log = Mutex::new(Log::default());
    for (key, old_id) in &lost {
        let id = create_with_retries(
            &server.http,
            key,
            &format!("chk-{key}"),
            &crashed,
            &retry_log,
        )
        .await;
        assert_eq!(&id, old_id, "{key}: made again under its id");
        let (status, order) = server.http.get(&format!("/orders/{old_id}")).await;
        assert_eq!(
            status,
            StatusCode::OK,
            "{key}: the link the client holds works"
        );
        assert_eq!(order["checkout_id"], format!("chk-{key}"));
    }

    // The relay on the promoted primary delivers every event there.
    let total = (kept.len() + lost.len()) as i64;
    eventually(
        "the relay to deliver every event on the promoted primary",
        || async {
            count(
                &sql,
                "SELECT count(*) FROM outbox_events WHERE published_at IS NOT NULL",
            )
            .await
                == total
        },
    )
    .await;
    let charges = provider.charges.lock().unwrap().clone();
    let requests = provider.requests.lock().unwrap().clone();
    let mut per_checkout: BTreeMap<String, usize> = BTreeMap::new();
    for order_id in charges.values() {
        let checkout = checkout_of
            .get(order_id)
            .unwrap_or_else(|| panic!("a charge for an order no client was told of: {order_id}"));
        *per_checkout.entry(checkout.clone()).or_default() += 1;
    }
    let doubled: Vec<_> = per_checkout.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        doubled.is_empty(),
        "charges per checkout at the outside provider: {per_checkout:?}"
    );
    assert_eq!(per_checkout.len() as i64, total, "every checkout charged");
    // The lost orders' events were delivered twice (before the crash, and
    // again after the retries made them anew): the provider saw each key
    // again and charged nothing more.
    for (key, id) in &lost {
        let derived =
            tower_idempotency::outbox::derive_tenant_key("tenant-a", id, "payment.charge");
        assert!(
            requests.get(&derived).copied().unwrap_or(0) >= 2,
            "{key}: delivered before the crash and again after it: {requests:?}"
        );
    }
    eprintln!(
        "asynchronous failover, outside provider, {}: {} orders lost with the old primary after \
         their charge, made again by the retries under the same ids; the provider got {} requests \
         for {} charges: {} checkouts, {} charge each",
        mode.name(),
        lost.len(),
        requests.values().sum::<usize>(),
        charges.len(),
        per_checkout.len(),
        per_checkout.values().max().copied().unwrap_or(0),
    );
    server.assert_still_running();
    assert!(server.stop().await.success(), "graceful shutdown exits 0");
}

both_modes!(
    synchronous_failover_under_load_loses_and_doubles_nothing,
    asynchronous_failover_loses_whole_requests_and_a_retry_makes_one_order,
    an_order_lost_in_a_failover_is_made_again_under_its_id_and_charged_once_outside,
);
