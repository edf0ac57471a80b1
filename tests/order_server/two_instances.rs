//! Two example order servers on one database, clients spread over both:
//! PostgreSQL arbitrates between the processes, and a hot key neither
//! exhausts a process's pool nor slows other keys down. Each process runs
//! with its own `application_name`, so `pg_stat_activity` tells their
//! connections apart.

use crate::common::example_binary;

use std::{
    process::Stdio,
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use example_binary::{both_modes, commits_lost, example_binary, Mode};
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
use tower_idempotency::testing::TestDatabase;

const TOKEN_A: &str = "demo-token-a";
const INSTANCES: [&str; 2] = ["order-a", "order-b"];

/// The two tests measure connections and latencies: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// One order server process.
struct Instance {
    _child: Child,
    _stdout: ChildStdout,
    base: String,
}

impl Instance {
    async fn start(db: &TestDatabase, name: &str, mode: Mode, env: &[(&str, &str)]) -> Instance {
        let mut child = Command::new(example_binary())
            .env(
                "DATABASE_URL",
                format!("{} application_name={name}", db.connection_string()),
            )
            .env("ORDER_SERVER_ADDR", "127.0.0.1:0")
            .env("RUST_LOG", "warn")
            .envs([mode.env()])
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("the example server starts");
        let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        stdout.read_line(&mut line).await.expect("reads stdout");
        let base = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("{name}: unexpected first line {line:?}"))
            .to_owned();
        Instance {
            _child: child,
            _stdout: stdout.into_inner(),
            base,
        }
    }
}

/// Both instances (started together: both apply the migrations at once),
/// with `POST /orders` in one mode, and the test's own connection.
struct Pair {
    db: TestDatabase,
    instances: [Instance; 2],
    sql: tokio_postgres::Client,
    http: Client<HttpConnector, Full<Bytes>>,
}

#[derive(Debug)]
struct Answer {
    status: StatusCode,
    replayed: bool,
    body: Bytes,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }
}

impl Pair {
    async fn start(mode: Mode, env: &[(&str, &str)]) -> Arc<Pair> {
        let db = TestDatabase::create().await;
        let (a, b) = tokio::join!(
            Instance::start(&db, INSTANCES[0], mode, env),
            Instance::start(&db, INSTANCES[1], mode, env)
        );
        let sql = connect(&db, "observer").await;
        let pair = Arc::new(Pair {
            db,
            instances: [a, b],
            sql,
            http: Client::builder(TokioExecutor::new()).build_http(),
        });
        for i in 0..2 {
            mode.assert_serves(&pair.metrics(i).await);
        }
        pair
    }

    /// The text of instance `i`'s `GET /metrics`.
    async fn metrics(&self, i: usize) -> String {
        let request = Request::get(format!("{}/metrics", self.instances[i].base))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let response = self.http.request(request).await.expect("server answers");
        let body = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        String::from_utf8(body.to_vec()).expect("UTF-8")
    }

    /// Lost commits of `POST /orders` over both instances (one-commit mode;
    /// 0 in the claim-first mode, which commits only what it claimed).
    async fn commits_lost(&self) -> u64 {
        let mut lost = 0;
        for i in 0..2 {
            lost += commits_lost(&self.metrics(i).await).unwrap_or(0);
        }
        lost
    }

    /// Tenant A posts `order(checkout)` under `key` to instance `i % 2`.
    async fn place_order(&self, i: usize, key: &str, checkout: &str) -> Answer {
        let request = Request::post(format!("{}/orders", self.instances[i % 2].base))
            .header("authorization", format!("Bearer {TOKEN_A}"))
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(Full::new(Bytes::from(order(checkout))))
            .unwrap();
        let response = self.http.request(request).await.expect("server answers");
        let (parts, body) = response.into_parts();
        Answer {
            status: parts.status,
            replayed: parts
                .headers
                .get("idempotent-replayed")
                .is_some_and(|v| v == "true"),
            body: body.collect().await.expect("body").to_bytes(),
        }
    }

    async fn count(&self, sql: &str) -> i64 {
        self.sql.query_one(sql, &[]).await.unwrap().get(0)
    }

    /// Per instance right now: its connections holding a transaction that
    /// wrote, or waiting on a lock (what a request on a key holds), and all
    /// its non-idle connections (those plus its background tasks' short
    /// read-only statements: relay polls, gauges, cleanup).
    async fn busy(&self) -> ([i64; 2], [i64; 2]) {
        let row = self
            .sql
            .query_one(
                "SELECT count(*) FILTER (WHERE application_name = $1 AND held), \
                        count(*) FILTER (WHERE application_name = $2 AND held), \
                        count(*) FILTER (WHERE application_name = $1), \
                        count(*) FILTER (WHERE application_name = $2) \
                 FROM (SELECT application_name, \
                              backend_xid IS NOT NULL OR wait_event_type = 'Lock' AS held \
                       FROM pg_stat_activity \
                       WHERE datname = current_database() AND state IS DISTINCT FROM 'idle') AS busy",
                &[&INSTANCES[0], &INSTANCES[1]],
            )
            .await
            .unwrap();
        ([row.get(0), row.get(1)], [row.get(2), row.get(3)])
    }

    /// Waits (bounded) until the relays delivered every event, so that
    /// their batches do not blur a measurement.
    async fn wait_drained(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self
            .count("SELECT count(*) FROM outbox_events WHERE published_at IS NULL")
            .await
            > 0
        {
            assert!(Instant::now() < deadline, "the relays did not drain");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Creates `n` orders under fresh keys, `concurrency` at a time spread
    /// over both instances; each must be `201`. Returns their latencies.
    async fn create_others(
        self: &Arc<Self>,
        tag: &str,
        n: usize,
        concurrency: usize,
    ) -> Vec<Duration> {
        let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let workers: Vec<_> = (0..concurrency)
            .map(|w| {
                let (pair, next, tag) = (self.clone(), next.clone(), tag.to_owned());
                tokio::spawn(async move {
                    let mut latencies = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        if i >= n {
                            return latencies;
                        }
                        let started = Instant::now();
                        let answer = pair
                            .place_order(w, &format!("{tag}-{i}"), &format!("chk_{tag}_{i}"))
                            .await;
                        latencies.push(started.elapsed());
                        assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
                    }
                })
            })
            .collect();
        let mut latencies = Vec::new();
        for worker in workers {
            latencies.extend(worker.await.unwrap());
        }
        latencies
    }
}

async fn connect(db: &TestDatabase, application_name: &str) -> tokio_postgres::Client {
    let (client, connection) = db
        .config()
        .application_name(application_name)
        .connect(tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
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

fn p99(mut latencies: Vec<Duration>) -> Duration {
    latencies.sort_unstable();
    let rank = (latencies.len() * 99).div_ceil(100).max(1);
    latencies[rank - 1]
}

async fn fifty_duplicates_over_two_instances_make_one_order_with_one_answer(mode: Mode) {
    let _serial = SERIAL.lock().await;
    let pair = Pair::start(mode, &[]).await;
    let body_checkout = "chk_split";
    let tasks: Vec<_> = (0..50)
        .map(|i| {
            let pair = pair.clone();
            tokio::spawn(async move { pair.place_order(i, "split-key", body_checkout).await })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap());
    }
    assert!(
        answers.iter().all(|a| a.status == StatusCode::CREATED),
        "{:?}",
        answers.iter().map(|a| a.status).collect::<Vec<_>>()
    );
    assert!(
        answers.iter().all(|a| a.body == answers[0].body),
        "every client gets the same body, byte for byte"
    );
    // Claim-first: one execution, every other answer its replay. One-commit:
    // each instance may run the handler (docs/modes.md, "one commit wins"),
    // but one commit wins and every loser rolls back and answers the
    // winner's response, marked replayed: the same one original answer.
    assert_eq!(
        answers.iter().filter(|a| !a.replayed).count(),
        1,
        "one commit; every other answer is its replay"
    );
    assert_eq!(pair.count("SELECT count(*) FROM orders").await, 1);
    let order_id: String = pair
        .sql
        .query_one(
            "SELECT id::text FROM orders WHERE checkout_id = 'chk_split'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(answers[0].json()["id"], order_id.as_str());
    let events: Vec<String> = pair
        .sql
        .query(
            "SELECT aggregate_id FROM outbox_events WHERE event_type = 'OrderCreated'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(events, [order_id]);
    let records = pair
        .sql
        .query(
            "SELECT idempotency_key, state, response_status FROM idempotency_requests WHERE endpoint = 'POST /orders v1'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].get::<_, &str>(0), "split-key");
    assert_eq!(records[0].get::<_, &str>(1), "completed");
    assert_eq!(records[0].get::<_, i16>(2), 201);
    println!(
        "{}: {} handler runs lost at commit and rolled back",
        mode.name(),
        pair.commits_lost().await
    );
}

async fn hot_key_storm_holds_a_couple_of_connections_per_instance_and_spares_other_keys(
    mode: Mode,
) {
    const STORM: usize = 500;
    const OTHERS: usize = 200;
    const CONCURRENCY: usize = 8;
    let _serial = SERIAL.lock().await;
    // Duplicates wait for the storm's first request rather than give up.
    let pair = Pair::start(mode, &[("IDEMPOTENCY_WAIT", "60s")]).await;

    // Warm up (pools filled, statements prepared), then other keys without the storm.
    pair.create_others("warm", 4 * CONCURRENCY, CONCURRENCY)
        .await;
    let without = p99(pair.create_others("calm", OTHERS, CONCURRENCY).await);
    pair.wait_drained().await;

    // Keep the storm's first request running: the test holds an uncommitted
    // order for the storm's checkout, so that request's insert waits on it
    // (inside its claim) until the test lets go. Other checkouts are free.
    let holder = connect(&pair.db, "holder").await;
    holder
        .batch_execute(
            "BEGIN; INSERT INTO orders (tenant_id, checkout_id, currency, items, total, shipping_address_id) \
             VALUES ('tenant-a', 'chk_storm', 'JPY', '[]', 0, 'addr_1')",
        )
        .await
        .unwrap();
    let storm: Vec<_> = (0..STORM)
        .map(|i| {
            let pair = pair.clone();
            tokio::spawn(async move { pair.place_order(i, "storm-key", "chk_storm").await })
        })
        .collect();
    // Both instances have reached the database for the storm: claim-first,
    // one request's insert waits on the test's order, the other instance's
    // claim on that request's key; one-commit, each instance's request runs
    // the handler (nothing is claimed first), and both inserts wait on the
    // test's order.
    let deadline = Instant::now() + Duration::from_secs(30);
    let waiting = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                   AND application_name IN ('order-a', 'order-b') AND wait_event_type = 'Lock'";
    while pair.count(waiting).await < 2 {
        assert!(
            Instant::now() < deadline,
            "the storm never reached both instances' database sessions"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    // The storm alone: what each instance holds for it.
    let (mut peak, mut peak_busy) = ([0, 0], [0, 0]);
    for _ in 0..200 {
        let (held, busy) = pair.busy().await;
        peak = [peak[0].max(held[0]), peak[1].max(held[1])];
        peak_busy = [peak_busy[0].max(busy[0]), peak_busy[1].max(busy[1])];
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    println!(
        "storm of {STORM} duplicates, peak per instance: {peak:?} connections held, {peak_busy:?} not idle"
    );
    assert!(
        peak.iter().all(|&n| n <= 2),
        "each instance holds at most a couple of connections for the storm, held {peak:?}"
    );

    // Other keys during the storm.
    let with = p99(pair.create_others("storm", OTHERS, CONCURRENCY).await);
    assert!(
        storm.iter().all(|task| !task.is_finished()),
        "the storm was still waiting while the other keys were measured"
    );
    println!("other keys' create p99: {without:?} without the storm, {with:?} with it");
    assert!(
        with <= without * 5 + Duration::from_millis(100),
        "p99 with the storm {with:?} against {without:?} without it"
    );

    // Let the storm's first request through: one order, every duplicate its answer.
    holder.batch_execute("ROLLBACK").await.unwrap();
    let mut answers = Vec::new();
    for task in storm {
        answers.push(task.await.unwrap());
    }
    assert!(
        answers.iter().all(|a| a.status == StatusCode::CREATED),
        "{:?}",
        answers.iter().map(|a| a.status).collect::<Vec<_>>()
    );
    assert!(answers.iter().all(|a| a.body == answers[0].body));
    assert_eq!(answers.iter().filter(|a| !a.replayed).count(), 1);
    let storm_orders: Vec<String> = pair
        .sql
        .query(
            "SELECT id::text FROM orders WHERE checkout_id = 'chk_storm'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(storm_orders.len(), 1, "one order for the storm's key");
    assert_eq!(answers[0].json()["id"], storm_orders[0].as_str());
    let per_checkout = pair
        .sql
        .query_one(
            "SELECT count(*), count(DISTINCT checkout_id), count(*) FILTER (WHERE checkout_id LIKE 'chk\\_calm\\_%' OR checkout_id LIKE 'chk\\_storm\\_%') FROM orders",
            &[],
        )
        .await
        .unwrap();
    let expected = (1 + 2 * OTHERS + 4 * CONCURRENCY) as i64;
    assert_eq!(per_checkout.get::<_, i64>(0), expected, "one order per key");
    assert_eq!(per_checkout.get::<_, i64>(1), expected);
    assert_eq!(per_checkout.get::<_, i64>(2), 2 * OTHERS as i64);
    assert_eq!(
        pair.count("SELECT count(*) FROM idempotency_requests WHERE endpoint = 'POST /orders v1' AND state = 'completed' AND response_status = 201")
            .await,
        expected,
        "one remembered result per key"
    );
    assert_eq!(
        pair.count("SELECT count(*) FROM outbox_events WHERE event_type = 'OrderCreated'")
            .await,
        expected
    );
    println!(
        "{}: {} handler runs lost at commit and rolled back",
        mode.name(),
        pair.commits_lost().await
    );
}

/// The same key for two different orders, one on each instance, the first
/// still running when the second arrives: one of them is created, the other
/// is told `409 idempotency_key_reused`, and nothing of the refused one
/// remains. Which one wins is each mode's rule: the first to claim the key
/// (claim-first), the first to commit it (one-commit, docs/modes.md: the
/// loser's handler ran and its order was rolled back).
async fn one_key_for_two_orders_on_two_instances_creates_one_and_refuses_the_other(mode: Mode) {
    let _serial = SERIAL.lock().await;
    let pair = Pair::start(mode, &[("IDEMPOTENCY_WAIT", "60s")]).await;
    // The first request's insert waits on an uncommitted order of the test's.
    let holder = connect(&pair.db, "holder").await;
    holder
        .batch_execute(
            "BEGIN; INSERT INTO orders (tenant_id, checkout_id, currency, items, total, shipping_address_id) \
             VALUES ('tenant-a', 'chk_reuse_first', 'JPY', '[]', 0, 'addr_1')",
        )
        .await
        .unwrap();
    let waiting = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                   AND application_name IN ('order-a', 'order-b') AND wait_event_type = 'Lock'";
    let first = tokio::spawn({
        let pair = pair.clone();
        async move { pair.place_order(0, "reused-key", "chk_reuse_first").await }
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while pair.count(waiting).await < 1 {
        assert!(
            Instant::now() < deadline,
            "the first request never reached its insert"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let second = tokio::spawn({
        let pair = pair.clone();
        async move { pair.place_order(1, "reused-key", "chk_reuse_second").await }
    });
    // Claim-first: the second waits on the first's claim. One-commit: it
    // runs and commits on its own.
    while !second.is_finished() && pair.count(waiting).await < 2 {
        assert!(
            Instant::now() < deadline,
            "the second request neither waited nor ended"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    holder.batch_execute("ROLLBACK").await.unwrap();
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    let (won, lost, won_checkout, lost_checkout) = match mode {
        Mode::ClaimFirst => (first, second, "chk_reuse_first", "chk_reuse_second"),
        Mode::OneCommit => (second, first, "chk_reuse_second", "chk_reuse_first"),
    };
    assert_eq!(won.status, StatusCode::CREATED, "{:?}", won.json());
    assert!(!won.replayed);
    assert_eq!(won.json()["checkout_id"], won_checkout);
    assert_eq!(lost.status, StatusCode::CONFLICT, "{:?}", lost.json());
    assert_eq!(lost.json()["code"], "idempotency_key_reused");
    let orders: Vec<String> = pair
        .sql
        .query("SELECT checkout_id FROM orders", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        orders,
        [won_checkout],
        "no order of {lost_checkout} remains"
    );
    assert_eq!(
        pair.count("SELECT count(*) FROM outbox_events").await,
        1,
        "one OrderCreated event"
    );
    let record = pair
        .sql
        .query_one(
            "SELECT state, response_status, resource_id FROM idempotency_requests \
             WHERE endpoint = 'POST /orders v1' AND idempotency_key = 'reused-key'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(record.get::<_, &str>(0), "completed");
    assert_eq!(record.get::<_, i16>(1), 201);
    assert_eq!(record.get::<_, Option<&str>>(2), won.json()["id"].as_str());
    // Both instances replay the winner's answer to its own request, and
    // refuse the other's.
    for i in 0..2 {
        let replay = pair.place_order(i, "reused-key", won_checkout).await;
        assert!(replay.replayed);
        assert_eq!(replay.body, won.body);
        let refused = pair.place_order(i, "reused-key", lost_checkout).await;
        assert_eq!(refused.status, StatusCode::CONFLICT);
        assert_eq!(refused.json()["code"], "idempotency_key_reused");
    }
    assert_eq!(pair.count("SELECT count(*) FROM orders").await, 1);
}

both_modes!(
    fifty_duplicates_over_two_instances_make_one_order_with_one_answer,
    hot_key_storm_holds_a_couple_of_connections_per_instance_and_spares_other_keys,
    one_key_for_two_orders_on_two_instances_creates_one_and_refuses_the_other,
);
