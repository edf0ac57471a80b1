//! Proof under faults: a connection cut at every boundary of a create
//! (including with `COMMIT` in flight), a crash at every named point of the
//! request flow, and PostgreSQL restarted (fast and immediate) under load.
//! Each asserts on the rows: one order, one outbox event and one remembered
//! result when the commit happened, none and a free key when it did not,
//! never a second order.

mod common;

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use bytes::Bytes;
use common::{
    fault_proxy::{Cut, FaultProxy},
    *,
};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};
use tower::{Layer, ServiceExt};
use tower_idempotency::{
    failpoints::{FaultPoint, InjectFault},
    outbox,
    postgres::{PgStore, PgTx},
    scope::TenantId,
    testing::{Shutdown, TempPostgres},
    RequestBody,
};

/// Writes an order (with the body's checkout id) and its `OrderCreated`
/// event through the layer's transaction; a failed write answers 503, so the
/// layer rolls back.
fn order_and_event() -> Handler {
    tower::util::BoxCloneService::new(tower::service_fn(
        |request: Request<RequestBody>| async move {
            let tx = request
                .extensions()
                .get::<PgTx>()
                .cloned()
                .ok_or("no transaction handle")?;
            let tenant = request
                .extensions()
                .get::<TenantId>()
                .cloned()
                .ok_or("no tenant")?;
            let body = request.into_body().collect().await?.to_bytes();
            let order: Value = serde_json::from_slice(&body)?;
            let checkout = order["checkout_id"].as_str().unwrap_or_default().to_owned();
            let written = async {
                let id = new_order_id();
                tx.execute(
                    "INSERT INTO orders (id, tenant_id, checkout_id) VALUES ($1, $2, $3)",
                    &[&id, &tenant.as_str(), &checkout],
                )
                .await?;
                outbox::enqueue(&tx, &id, "OrderCreated", &json!({ "id": id })).await?;
                Ok::<_, tower_idempotency::postgres::TxError>(id)
            }
            .await;
            Ok::<_, BoxError>(match written {
                Ok(id) => created(json!({ "id": id, "checkout_id": checkout }).to_string()),
                Err(e) => response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    json!({ "code": "order_not_written", "detail": e.to_string() }).to_string(),
                ),
            })
        },
    ))
}

/// A fresh database whose `orders` table has a checkout column and no
/// unique constraint on it: a second order for one operation would show.
async fn database() -> Postgres {
    let pg = Postgres::new().await;
    pg.exec("ALTER TABLE orders ADD COLUMN checkout_id text")
        .await;
    pg
}

/// What the database holds for the one operation of a test.
#[derive(Debug, PartialEq, Eq)]
struct Rows {
    orders: Vec<String>,
    events_per_order: Vec<i64>,
    completed: i64,
    in_progress: i64,
}

async fn rows(pg: &Postgres) -> Rows {
    let orders: Vec<String> = pg.column("SELECT id FROM orders ORDER BY id").await;
    let mut events_per_order = Vec::new();
    for id in &orders {
        let row = pg
            .client
            .query_one(
                "SELECT count(*) FROM outbox_events WHERE aggregate_id = $1",
                &[id],
            )
            .await
            .unwrap();
        events_per_order.push(row.get(0));
    }
    Rows {
        orders,
        events_per_order,
        completed: pg
            .count("SELECT count(*) FROM idempotency_requests WHERE state = 'completed'")
            .await,
        in_progress: pg
            .count("SELECT count(*) FROM idempotency_requests WHERE state = 'in_progress'")
            .await,
    }
}

/// The statements of a create, in the order the store sends them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Boundary {
    /// The claim: `INSERT … ON CONFLICT DO NOTHING` into the key table.
    Claim,
    /// The handler's first write.
    OrderInsert,
    /// The handler's second write.
    OutboxInsert,
    /// The completion `UPDATE` that stores the response.
    Completion,
    /// `COMMIT`.
    Commit,
}

impl Boundary {
    fn matches(self, sql: &str) -> bool {
        let sql = sql.trim_start();
        match self {
            Boundary::Claim => {
                sql.starts_with("WITH claimed AS")
                    && sql.contains("INSERT INTO idempotency_requests")
            }
            Boundary::OrderInsert => sql.starts_with("INSERT INTO orders"),
            Boundary::OutboxInsert => sql.starts_with("INSERT INTO outbox_events"),
            Boundary::Completion => {
                sql.contains("UPDATE idempotency_requests SET state = 'completed'")
            }
            Boundary::Commit => sql.eq_ignore_ascii_case("COMMIT"),
        }
    }
}

/// The one-commit mode's transaction begins with the handler's first
/// statement (its `BEGIN` pipelined with it). A pooled connection that dies
/// there, before or after the statement reached the server, has committed
/// nothing: it is replaced once with a fresh one and the statement sent
/// again, as the claim-first mode's claim is, so the request is served instead
/// of answered 503. One order, one event, one remembered answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_commit_mode_replaces_a_connection_lost_at_the_first_statement() {
    // Direct, the BEGIN goes out with the first statement; behind a
    // transaction pooler, before it.
    for (cut, pooling) in [
        (Cut::Before, false),
        (Cut::After, false),
        (Cut::Before, true),
        (Cut::After, true),
    ] {
        let pg = database().await;
        let proxy = FaultProxy::start(pg.db.config()).await;
        let store = PgStore::builder(proxy.config())
            .max_connections(4)
            .transaction_pooling(pooling)
            .build()
            .unwrap();
        let service = layer(store).claim_at_commit().layer(order_and_event());
        proxy.cut_at(cut, |sql| Boundary::OrderInsert.matches(sql));
        let first = send(service.clone(), tenant_a_post("k-first")).await;
        assert!(
            proxy.fired().is_some(),
            "{cut:?}/{pooling}: the cut never fired"
        );
        proxy.cut_finished().await;
        assert_eq!(
            first.status,
            StatusCode::CREATED,
            "{cut:?}/{pooling}: {:?}",
            first.body
        );
        let end = rows(&pg).await;
        assert_eq!(end.orders.len(), 1, "{cut:?}/{pooling}: exactly one order");
        assert_eq!(end.events_per_order, vec![1], "{cut:?}/{pooling}");
        assert_eq!(
            (end.completed, end.in_progress),
            (1, 0),
            "{cut:?}/{pooling}"
        );
        assert_eq!(
            end.orders[0],
            first.json()["id"].as_str().unwrap_or_default(),
            "{cut:?}/{pooling}: the answer names the order"
        );
        let retry = send(service, tenant_a_post("k-first")).await;
        assert!(retry.replayed(), "{cut:?}/{pooling}");
        assert_eq!(rows(&pg).await.orders.len(), 1, "{cut:?}/{pooling}");
    }
}

/// Cuts the store's connection at `boundary`, then retries the same
/// request, and checks that the operation converged to exactly one order.
async fn cut_then_retry(boundary: Boundary, cut: Cut) {
    let pg = database().await;
    let proxy = FaultProxy::start(pg.db.config()).await;
    let store = PgStore::builder(proxy.config())
        .max_connections(4)
        .build()
        .unwrap();
    let service = layer(store).layer(order_and_event());
    proxy.cut_at(cut, move |sql| boundary.matches(sql));

    let first = send(service.clone(), tenant_a_post("k-cut")).await;
    let fired = proxy.fired();
    assert!(
        fired.is_some(),
        "the request never ran the statement at {boundary:?}"
    );
    proxy.cut_finished().await;
    // A claim that loses its connection is tried once more on a fresh one
    // (its transaction died with the old): the request may succeed as is.
    let committed = match (boundary, cut) {
        (Boundary::Claim, _) => first.status == StatusCode::CREATED,
        (Boundary::Commit, Cut::After) => true,
        _ => false,
    };
    if !committed {
        assert_eq!(
            first.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{boundary:?}/{cut:?}: {:?}",
            first.body
        );
    }
    if matches!(
        boundary,
        Boundary::Claim | Boundary::Completion | Boundary::Commit
    ) && !committed
        || matches!((boundary, cut), (Boundary::Commit, Cut::After))
    {
        // The layer's own answer (a failed write of the handler gets the
        // handler's own 503, `order_not_written`).
        assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(first.json()["code"], "store_unavailable");
        assert!(first.headers.contains_key("retry-after"));
    }
    let after_fault = rows(&pg).await;
    if committed {
        if boundary == Boundary::Commit {
            let detail = first.json()["detail"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            assert!(
                detail.contains("unknown"),
                "a COMMIT whose answer was lost is reported as of unknown outcome: {detail}"
            );
        }
        assert_eq!(after_fault.orders.len(), 1, "the COMMIT reached the server");
        assert_eq!(after_fault.events_per_order, vec![1]);
        assert_eq!((after_fault.completed, after_fault.in_progress), (1, 0));
    } else {
        assert_eq!(
            after_fault,
            Rows {
                orders: vec![],
                events_per_order: vec![],
                completed: 0,
                in_progress: 0
            },
            "{boundary:?}/{cut:?}: nothing of the cut transaction exists"
        );
    }

    let retry = send(service, tenant_a_post("k-cut")).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert_eq!(
        retry.replayed(),
        committed,
        "replayed if and only if the first attempt committed"
    );
    let end = rows(&pg).await;
    assert_eq!(end.orders.len(), 1, "exactly one order");
    assert_eq!(end.events_per_order, vec![1], "exactly one outbox event");
    assert_eq!((end.completed, end.in_progress), (1, 0));
    assert_eq!(
        retry.json()["id"],
        end.orders[0],
        "the answer names the order the database holds"
    );
    if committed {
        assert_eq!(end.orders, after_fault.orders, "the retry created nothing");
    }
}

macro_rules! cut_tests {
    ($($name:ident: $boundary:ident, $cut:ident;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            cut_then_retry(Boundary::$boundary, Cut::$cut).await;
        }
    )*};
}

cut_tests! {
    connection_cut_before_the_claim: Claim, Before;
    connection_cut_after_the_claim: Claim, After;
    connection_cut_before_the_order_insert: OrderInsert, Before;
    connection_cut_after_the_order_insert: OrderInsert, After;
    connection_cut_before_the_outbox_insert: OutboxInsert, Before;
    connection_cut_after_the_outbox_insert: OutboxInsert, After;
    connection_cut_before_the_completion: Completion, Before;
    connection_cut_after_the_completion: Completion, After;
    connection_cut_before_the_commit: Commit, Before;
    connection_cut_with_the_commit_in_flight: Commit, After;
}

/// The request's work dies at `point` (an injected panic on its task), then
/// the same request is retried.
async fn crash_then_retry(point: FaultPoint) {
    let pg = database().await;
    let service = layer(pg.store.clone()).layer(order_and_event());
    let mut request = tenant_a_post("k-crash");
    request
        .extensions_mut()
        .insert(InjectFault::panic_at(point));
    let crashed = tokio::spawn(service.clone().oneshot(request)).await;
    assert!(
        crashed.as_ref().is_err_and(|e| e.is_panic()),
        "{point}: the request's work died at the fault point"
    );
    let after_fault = rows(&pg).await;
    if point.committed() {
        assert_eq!(after_fault.orders.len(), 1);
        assert_eq!(after_fault.events_per_order, vec![1]);
        assert_eq!(after_fault.completed, 1);
    } else {
        assert!(after_fault.orders.is_empty(), "{point}: {after_fault:?}");
        assert_eq!(after_fault.completed, 0, "{point}");
    }

    let retry = send(service, tenant_a_post("k-crash")).await;
    assert_eq!(
        retry.status,
        StatusCode::CREATED,
        "{point}: {:?}",
        retry.body
    );
    assert_eq!(retry.replayed(), point.committed(), "{point}");
    let end = rows(&pg).await;
    assert_eq!(end.orders.len(), 1, "{point}: exactly one order");
    assert_eq!(end.events_per_order, vec![1], "{point}");
    assert_eq!((end.completed, end.in_progress), (1, 0), "{point}");
    assert_eq!(retry.json()["id"], end.orders[0], "{point}");
}

macro_rules! crash_tests {
    ($($name:ident: $point:ident;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            crash_then_retry(FaultPoint::$point).await;
        }
    )*};
}

crash_tests! {
    crash_before_the_claim: BeforeClaim;
    crash_after_the_claim: AfterClaim;
    crash_after_the_handler: AfterHandler;
    crash_before_the_commit: BeforeCommit;
    crash_after_the_commit_before_the_response: AfterCommit;
}

// ---------------------------------------------------------------- restarts

const CLIENTS: usize = 8;
const OPS_PER_CLIENT: usize = 25;

/// A logical operation's request: one key, one checkout, retried as is.
fn operation(client: usize, op: usize) -> Request<Full<Bytes>> {
    let body = json!({ "checkout_id": format!("chk-{client}-{op}"), "amount": 100 }).to_string();
    post(Some("tenant-a"), Some(&format!("op-{client}-{op}")), &body)
}

#[derive(Default)]
struct Tally {
    statuses: Mutex<HashMap<(u16, String), usize>>,
    done: AtomicUsize,
    /// checkout id → the order id its final answer named.
    answers: Mutex<HashMap<String, String>>,
}

/// PostgreSQL stopped fast and then immediately (a crash) while 8 clients
/// create orders with retries: the service answers 503 while it is down,
/// recovers by itself, and every operation ends with exactly one order, one
/// event and one remembered result, named by its client's final answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarted_under_load_loses_and_doubles_nothing() {
    let pg = tokio::task::spawn_blocking(|| TempPostgres::builder().durable(true).start())
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}"));
    let config = pg.config();
    let pg = Arc::new(Mutex::new(pg));
    let store = PgStore::builder(config.clone())
        .max_connections(8)
        .build()
        .unwrap();
    store.migrate().await.unwrap();
    let sql = {
        let (client, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(connection);
        client
    };
    sql.batch_execute(
        "CREATE TABLE orders (id text PRIMARY KEY, tenant_id text NOT NULL, checkout_id text)",
    )
    .await
    .unwrap();
    let service = layer(store).layer(order_and_event());
    let tally = Arc::new(Tally::default());

    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (service, tally) = (service.clone(), tally.clone());
            tokio::spawn(async move {
                for op in 0..OPS_PER_CLIENT {
                    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
                    loop {
                        let answer = spawn_send(service.clone(), operation(c, op))
                            .await
                            .expect("request task");
                        let code = match answer.status {
                            StatusCode::CREATED => String::new(),
                            _ => serde_json::from_slice::<Value>(&answer.body)
                                .ok()
                                .and_then(|v| v["code"].as_str().map(str::to_owned))
                                .unwrap_or_default(),
                        };
                        *tally
                            .statuses
                            .lock()
                            .unwrap()
                            .entry((answer.status.as_u16(), code))
                            .or_default() += 1;
                        if answer.status == StatusCode::CREATED {
                            let id = answer.json()["id"].as_str().unwrap().to_owned();
                            tally
                                .answers
                                .lock()
                                .unwrap()
                                .insert(format!("chk-{c}-{op}"), id);
                            tally.done.fetch_add(1, Ordering::SeqCst);
                            break;
                        }
                        assert!(
                            tokio::time::Instant::now() < deadline,
                            "operation {c}/{op} never succeeded"
                        );
                        // The client's own backoff before it retries.
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            })
        })
        .collect();

    let total = CLIENTS * OPS_PER_CLIENT;
    let mut done_before = Vec::new();
    for (after, mode) in [
        (total / 4, Shutdown::Fast),
        (total / 2, Shutdown::Immediate),
    ] {
        wait_until(|| tally.done.load(Ordering::SeqCst) >= after).await;
        let down = pg.clone();
        tokio::task::spawn_blocking(move || down.lock().unwrap().stop(mode))
            .await
            .unwrap()
            .unwrap();
        done_before.push(tally.done.load(Ordering::SeqCst));
        let probe = send(
            service.clone(),
            post(
                Some("tenant-a"),
                Some(&format!("probe-{mode:?}")),
                r#"{"checkout_id":"probe","amount":1}"#,
            ),
        )
        .await;
        assert_eq!(probe.status, StatusCode::SERVICE_UNAVAILABLE, "{mode:?}");
        assert_eq!(probe.json()["code"], "store_unavailable");
        let up = pg.clone();
        tokio::task::spawn_blocking(move || up.lock().unwrap().start_again())
            .await
            .unwrap()
            .unwrap();
    }
    for client in clients {
        client.await.expect("client");
    }
    assert!(
        tally.done.load(Ordering::SeqCst) > done_before[1],
        "the service recovered by itself after the crash"
    );

    // The first connection died with the server.
    let sql = {
        let (client, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(connection);
        client
    };
    let statuses = tally.statuses.lock().unwrap().clone();
    for ((status, code), n) in &statuses {
        assert!(
            *status == 201
                || (*status == 503 && code == "store_unavailable")
                // The handler's own answer when its write met the outage.
                || (*status == 503 && code == "order_not_written")
                || (*status == 409 && code == "idempotency_in_progress"),
            "unexpected answer {status} {code} ({n} times): {statuses:?}"
        );
    }
    let orders = sql
        .query(
            "SELECT o.checkout_id, o.id, \
                    (SELECT count(*) FROM outbox_events e WHERE e.aggregate_id = o.id) \
             FROM orders o WHERE o.checkout_id <> 'probe'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        orders.len(),
        total,
        "one order per operation, no more: {statuses:?}"
    );
    let answers = tally.answers.lock().unwrap().clone();
    for row in &orders {
        let (checkout, id, events): (String, String, i64) = (row.get(0), row.get(1), row.get(2));
        assert_eq!(events, 1, "{checkout}: one outbox event");
        assert_eq!(
            answers.get(&checkout),
            Some(&id),
            "{checkout}: the answer names the order"
        );
    }
    let remembered: i64 = sql
        .query_one(
            "SELECT count(*) FROM idempotency_requests WHERE state = 'completed' AND idempotency_key LIKE 'op-%'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        remembered as usize, total,
        "one remembered result per operation"
    );
    eprintln!("answers seen across the restarts: {statuses:?}");
}

/// Polls `done` until it holds (the test's load makes progress on its own).
async fn wait_until(done: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "no progress");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
