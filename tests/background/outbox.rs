//! The outbox against a real PostgreSQL: events commit with the order or not
//! at all, relays deliver each at least once and never concurrently, and a
//! downstream keyed by the derived key charges once whatever the deliveries.

use crate::common;

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
    time::Duration,
};

use common::*;
use http::StatusCode;
use serde_json::json;
use tokio::sync::Notify;
use tower::Layer;
use tower_idempotency::{
    outbox::{self, inbox, DeliveryError, OutboxEvent, Relay, Sink},
    postgres::PgTx,
};

/// A downstream payment API that is idempotent on the derived key: one
/// `charges` row per key, however often it is called.
#[derive(Clone)]
struct Payments {
    store: tower_idempotency::postgres::PgStore,
    calls: Arc<Mutex<Vec<(String, String)>>>,
    in_flight: Arc<Mutex<HashSet<String>>>,
    overlaps: Arc<Mutex<usize>>,
    /// Per event id: how many calls fail before one succeeds (u32::MAX: all).
    failures: Arc<Mutex<HashMap<String, u32>>>,
    fail_first: u32,
    /// Signalled after a charge; with `hang`, the delivery then never returns.
    charged: Arc<Notify>,
    hang: bool,
}

impl Payments {
    fn new(store: tower_idempotency::postgres::PgStore) -> Self {
        Payments {
            store,
            calls: Default::default(),
            in_flight: Default::default(),
            overlaps: Default::default(),
            failures: Default::default(),
            fail_first: 0,
            charged: Default::default(),
            hang: false,
        }
    }
}

impl Sink for Payments {
    async fn deliver(&self, event: &OutboxEvent) -> Result<(), DeliveryError> {
        if !self.in_flight.lock().unwrap().insert(event.id.clone()) {
            *self.overlaps.lock().unwrap() += 1;
        }
        let key = event.derived_key("payment.charge");
        self.calls
            .lock()
            .unwrap()
            .push((event.id.clone(), key.clone()));
        let result = async {
            {
                let mut failures = self.failures.lock().unwrap();
                let failed = failures.entry(event.id.clone()).or_insert(0);
                if *failed < self.fail_first {
                    *failed += 1;
                    return Err(DeliveryError::retryable(format!("provider said 503 (failure {failed})")));
                }
            }
            let client = self.store.client().await.map_err(|e| DeliveryError::retryable(e.to_string()))?;
            client
                .execute(
                    "INSERT INTO charges (idempotency_key, order_id) VALUES ($1, $2) ON CONFLICT (idempotency_key) DO NOTHING",
                    &[&key, &event.aggregate_id],
                )
                .await
                .map_err(|e| DeliveryError::retryable(e.to_string()))?;
            Ok(())
        }
        .await;
        self.in_flight.lock().unwrap().remove(&event.id);
        if result.is_ok() {
            self.charged.notify_one();
            if self.hang {
                std::future::pending::<()>().await;
            }
        }
        result
    }
}

async fn setup() -> Postgres {
    let pg = Postgres::new().await;
    pg.exec("CREATE TABLE charges (idempotency_key text PRIMARY KEY, order_id text NOT NULL)")
        .await;
    pg
}

/// The order handler of these tests: an order row and its event, through the layer.
fn ordering(status: StatusCode) -> Handler {
    handler(move |tx: PgTx| async move {
        let id = new_order_id();
        tx.execute(
            "INSERT INTO orders (id, tenant_id) VALUES ($1, $2)",
            &[&id, &tx.tenant()],
        )
        .await?;
        outbox::enqueue(&tx, &id, "OrderCreated", &json!({"order_id": id})).await?;
        Ok(response(status, id))
    })
}

async fn place_orders(pg: &Postgres, n: usize) {
    let service = layer(pg.store.clone()).layer(ordering(StatusCode::CREATED));
    for i in 0..n {
        let answer = send(service.clone(), tenant_a_post(&format!("k{i}"))).await;
        assert_eq!(answer.status, StatusCode::CREATED);
    }
}

/// Polls (bounded) the sessions listening for the outbox until `done` holds of
/// their number, and returns the last number seen.
async fn wait_for_listeners(pg: &Postgres, done: impl Fn(i64) -> bool) -> i64 {
    let listening =
        "SELECT count(*) FROM pg_stat_activity WHERE query = 'LISTEN tower_idempotency_outbox'";
    let mut seen = 0;
    for _ in 0..500 {
        seen = pg.count(listening).await;
        if done(seen) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_committed_event_is_delivered_once_and_charges_once() {
    let pg = setup().await;
    place_orders(&pg, 3).await;
    let payments = Payments::new(pg.store.clone());
    let relay = Relay::new(pg.store.clone(), payments.clone());
    let report = relay.run_once().await.unwrap();
    assert_eq!((report.claimed, report.delivered), (3, 3));
    assert_eq!(
        relay.run_once().await.unwrap().claimed,
        0,
        "nothing left to deliver"
    );
    assert_eq!(
        pg.count(
            "SELECT count(*) FROM outbox_events WHERE published_at IS NOT NULL AND attempts = 1"
        )
        .await,
        3
    );
    assert_eq!(pg.count("SELECT count(*) FROM charges").await, 3);
    let charged: i64 = pg
        .count("SELECT count(*) FROM charges c JOIN orders o ON o.id = c.order_id")
        .await;
    assert_eq!(charged, 3, "one charge per order");
    let status = relay.refresh_backlog().await.unwrap();
    assert_eq!((status.backlog, status.lag), (0, Duration::ZERO));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolled_back_order_leaves_no_event() {
    let pg = setup().await;
    let service = layer(pg.store.clone()).layer(ordering(StatusCode::INTERNAL_SERVER_ERROR));
    let answer = send(service, tenant_a_post("k1")).await;
    assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(pg.count("SELECT count(*) FROM outbox_events").await, 0);
    assert_eq!(pg.count("SELECT count(*) FROM orders").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_redelivery_carries_the_same_key_and_charges_once() {
    let pg = setup().await;
    place_orders(&pg, 2).await;
    let payments = Payments::new(pg.store.clone());
    let relay = Relay::new(pg.store.clone(), payments.clone());
    relay.run_once().await.unwrap();
    pg.exec("UPDATE outbox_events SET published_at = NULL")
        .await;
    assert_eq!(
        relay.run_once().await.unwrap().delivered,
        2,
        "delivered again"
    );
    let calls = payments.calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 4);
    for (event, key) in &calls {
        let same: Vec<_> = calls
            .iter()
            .filter(|(e, _)| e == event)
            .map(|(_, k)| k)
            .collect();
        assert_eq!(
            same,
            [key, key],
            "every delivery of one event carries one key"
        );
    }
    assert_eq!(
        pg.count("SELECT count(*) FROM charges").await,
        2,
        "still one charge per order"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_that_dies_after_delivering_redelivers_without_double_charging() {
    let pg = setup().await;
    place_orders(&pg, 1).await;
    let mut hanging = Payments::new(pg.store.clone());
    hanging.hang = true;
    let crashed = Relay::new(pg.store.clone(), hanging.clone());
    let batch = tokio::spawn(async move { crashed.run_once().await });
    hanging.charged.notified().await;
    // The relay process dies between the delivery and marking it published.
    batch.abort();
    assert!(batch.await.unwrap_err().is_cancelled());
    let relay = Relay::new(pg.store.clone(), Payments::new(pg.store.clone()));
    // Its transaction rolls back when its connection closes: the event is due again.
    let mut redelivered = 0;
    for _ in 0..100 {
        redelivered = relay.run_once().await.unwrap().delivered;
        if redelivered > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(redelivered, 1);
    assert_eq!(
        pg.count("SELECT count(*) FROM outbox_events WHERE published_at IS NOT NULL")
            .await,
        1
    );
    assert_eq!(pg.count("SELECT count(*) FROM charges").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_relays_never_deliver_one_event_at_the_same_moment() {
    let pg = setup().await;
    place_orders(&pg, 40).await;
    let payments = Payments::new(pg.store.clone());
    let relays: Vec<_> = (0..3)
        .map(|_| {
            let relay = Relay::new(pg.store.clone(), payments.clone()).batch_size(5);
            tokio::spawn(async move {
                let mut delivered = 0;
                loop {
                    let report = relay.run_once().await.unwrap();
                    delivered += report.delivered;
                    if report.claimed == 0 {
                        return delivered;
                    }
                }
            })
        })
        .collect();
    let mut total = 0;
    for relay in relays {
        total += relay.await.unwrap();
    }
    assert_eq!(total, 40);
    assert_eq!(
        *payments.overlaps.lock().unwrap(),
        0,
        "no event was delivered by two relays at once"
    );
    let calls = payments.calls.lock().unwrap().clone();
    let distinct: HashSet<_> = calls.iter().map(|(e, _)| e).collect();
    assert_eq!(
        (calls.len(), distinct.len()),
        (40, 40),
        "each event delivered once"
    );
    assert_eq!(pg.count("SELECT count(*) FROM charges").await, 40);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_sink_is_retried_with_backoff_and_attempts_are_recorded() {
    let pg = setup().await;
    place_orders(&pg, 1).await;
    let mut flaky = Payments::new(pg.store.clone());
    flaky.fail_first = 2;
    let relay = Relay::new(pg.store.clone(), flaky.clone());
    let first = relay.run_once().await.unwrap();
    assert_eq!((first.claimed, first.retried), (1, 1));
    let row = pg.row("SELECT attempts, last_error, next_attempt_at > now(), published_at IS NULL FROM outbox_events").await;
    assert_eq!(row.get::<_, i32>(0), 1);
    assert_eq!(row.get::<_, &str>(1), "provider said 503 (failure 1)");
    assert!(row.get::<_, bool>(2), "the retry waits for its backoff");
    assert!(row.get::<_, bool>(3));
    assert_eq!(relay.run_once().await.unwrap().claimed, 0, "not due yet");
    // Without waiting for the backoff: a relay with no delay retries at once.
    let eager = Relay::new(pg.store.clone(), flaky.clone()).backoff(Duration::ZERO, Duration::ZERO);
    pg.exec("UPDATE outbox_events SET next_attempt_at = now()")
        .await;
    assert_eq!(eager.run_once().await.unwrap().retried, 1);
    assert_eq!(eager.run_once().await.unwrap().delivered, 1);
    let row = pg
        .row("SELECT attempts, last_error IS NULL, published_at IS NOT NULL FROM outbox_events")
        .await;
    assert_eq!(
        (
            row.get::<_, i32>(0),
            row.get::<_, bool>(1),
            row.get::<_, bool>(2)
        ),
        (3, true, true)
    );
    assert_eq!(pg.count("SELECT count(*) FROM charges").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn always_failing_sink_parks_the_event_and_leaves_the_order() {
    let pg = setup().await;
    place_orders(&pg, 1).await;
    let mut broken = Payments::new(pg.store.clone());
    broken.fail_first = u32::MAX;
    let relay = Relay::new(pg.store.clone(), broken)
        .max_attempts(3)
        .backoff(Duration::ZERO, Duration::ZERO);
    let reports = [
        relay.run_once().await.unwrap(),
        relay.run_once().await.unwrap(),
        relay.run_once().await.unwrap(),
    ];
    assert_eq!(
        reports.map(|r| (r.retried, r.parked)),
        [(1, 0), (1, 0), (0, 1)]
    );
    assert_eq!(
        relay.run_once().await.unwrap().claimed,
        0,
        "a parked event is not retried"
    );
    let row = pg.row("SELECT attempts, parked_at IS NOT NULL, published_at IS NULL, last_error FROM outbox_events").await;
    assert_eq!(
        (
            row.get::<_, i32>(0),
            row.get::<_, bool>(1),
            row.get::<_, bool>(2)
        ),
        (3, true, true)
    );
    assert_eq!(row.get::<_, &str>(3), "provider said 503 (failure 3)");
    assert_eq!(
        pg.count("SELECT count(*) FROM orders").await,
        1,
        "the order is untouched"
    );
    // An operator re-drives it once the provider is fixed.
    pg.exec("UPDATE outbox_events SET parked_at = NULL").await;
    let fixed = Relay::new(pg.store.clone(), Payments::new(pg.store.clone()));
    assert_eq!(fixed.run_once().await.unwrap().delivered, 1);
    assert_eq!(pg.count("SELECT count(*) FROM charges").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_wakes_on_notify_without_polling() {
    let pg = setup().await;
    let payments = Payments::new(pg.store.clone());
    // A poll interval of an hour: only the NOTIFY at commit can wake it.
    let relay =
        Relay::new(pg.store.clone(), payments.clone()).poll_interval(Duration::from_secs(3600));
    let stop = Arc::new(Notify::new());
    let running = tokio::spawn({
        let stop = stop.clone();
        async move { relay.run(async move { stop.notified().await }).await }
    });
    // Wait until the listener is subscribed, so the first NOTIFY is not missed.
    wait_for_listeners(&pg, |n| n > 0).await;
    place_orders(&pg, 1).await;
    tokio::time::timeout(Duration::from_secs(10), payments.charged.notified())
        .await
        .expect("the relay delivered after the commit's NOTIFY");
    stop.notify_one();
    running.await.unwrap().unwrap();
    assert_eq!(pg.count("SELECT count(*) FROM charges").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_processes_each_event_once_and_only_with_its_effect() {
    let pg = setup().await;
    let mut client = pg.db.client().await;
    let tx = client.transaction().await.unwrap();
    assert!(
        inbox::first_delivery(&tx, "tenant-a", "inventory", "event-1")
            .await
            .unwrap()
    );
    tx.rollback().await.unwrap();
    let tx = client.transaction().await.unwrap();
    assert!(
        inbox::first_delivery(&tx, "tenant-a", "inventory", "event-1")
            .await
            .unwrap(),
        "a rolled-back record does not count"
    );
    assert!(
        !inbox::first_delivery(&tx, "tenant-a", "inventory", "event-1")
            .await
            .unwrap()
    );
    assert!(
        inbox::first_delivery(&tx, "tenant-a", "billing", "event-1")
            .await
            .unwrap(),
        "consumers are independent"
    );
    tx.commit().await.unwrap();
    let tx = client.transaction().await.unwrap();
    assert!(
        !inbox::first_delivery(&tx, "tenant-a", "inventory", "event-1")
            .await
            .unwrap()
    );
    assert!(
        inbox::first_delivery(&tx, "tenant-b", "inventory", "event-1")
            .await
            .unwrap(),
        "tenants are independent"
    );
    tx.commit().await.unwrap();
    assert_eq!(pg.count("SELECT count(*) FROM inbox_events").await, 3);
}

/// A sink whose error message holds a NUL byte (a downstream can say
/// anything) still gets its attempt recorded, and the batch's delivered
/// events are marked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_error_message_is_recorded_without_poisoning_the_batch() {
    struct Picky;
    impl Sink for Picky {
        async fn deliver(&self, event: &OutboxEvent) -> Result<(), DeliveryError> {
            if event.aggregate_id == "bad" {
                Err(DeliveryError::retryable("upstream said \u{0} and more"))
            } else {
                Ok(())
            }
        }
    }
    let pg = setup().await;
    pg.exec(
        "INSERT INTO outbox_events (tenant_id, aggregate_id, event_type) VALUES ('t', 'good', 'E'), ('t', 'bad', 'E')",
    )
    .await;
    let report = Relay::new(pg.store.clone(), Picky)
        .run_once()
        .await
        .unwrap();
    assert_eq!((report.delivered, report.retried), (1, 1));
    let row = pg
        .row("SELECT attempts, last_error FROM outbox_events WHERE aggregate_id = 'bad'")
        .await;
    assert_eq!(row.get::<_, i32>(0), 1);
    assert_eq!(row.get::<_, &str>(1), "upstream said \u{fffd} and more");
    assert_eq!(
        pg.count("SELECT count(*) FROM outbox_events WHERE published_at IS NOT NULL")
            .await,
        1
    );
}

/// However `run` ends, its listener connection goes with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_relay_closes_its_listener() {
    let pg = setup().await;
    let relay = Relay::new(pg.store.clone(), Payments::new(pg.store.clone()));
    let running = tokio::spawn(async move { relay.run(std::future::pending()).await });
    let seen = wait_for_listeners(&pg, |n| n > 0).await;
    assert_eq!(seen, 1, "the relay listens");
    running.abort();
    let _ = running.await;
    let seen = wait_for_listeners(&pg, |n| n == 0).await;
    assert_eq!(seen, 0, "the listener's connection closed with the relay");
}

/// A sink that hangs costs one delivery timeout, not one per event: the
/// batch's transaction stays short and the rest wait for the next batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_sink_keeps_the_batch_short() {
    struct Hangs;
    impl Sink for Hangs {
        async fn deliver(&self, event: &OutboxEvent) -> Result<(), DeliveryError> {
            if event.aggregate_id == "slow" {
                std::future::pending::<()>().await;
            }
            Ok(())
        }
    }
    let pg = setup().await;
    pg.exec(
        "INSERT INTO outbox_events (tenant_id, aggregate_id, event_type, next_attempt_at)
         VALUES ('t', 'slow', 'E', now() - interval '1 minute');
         INSERT INTO outbox_events (tenant_id, aggregate_id, event_type)
         SELECT 't', 'fast-' || i, 'E' FROM generate_series(1, 5) i;",
    )
    .await;
    let relay = Relay::new(pg.store.clone(), Hangs).delivery_timeout(Duration::from_millis(200));
    let first = relay.run_once().await.unwrap();
    assert_eq!(
        (
            first.claimed,
            first.retried,
            first.deferred,
            first.delivered
        ),
        (6, 1, 5, 0)
    );
    assert_eq!(
        pg.count(
            "SELECT count(*) FROM outbox_events WHERE aggregate_id LIKE 'fast-%' AND attempts = 0"
        )
        .await,
        5,
        "deferred events were not touched"
    );
    let second = relay.run_once().await.unwrap();
    assert_eq!(second.delivered, 5, "the next batch delivers them");
    let row = pg
        .row("SELECT attempts, last_error FROM outbox_events WHERE aggregate_id = 'slow'")
        .await;
    assert_eq!(
        (row.get::<_, i32>(0), row.get::<_, &str>(1)),
        (1, "delivery timed out")
    );
}

/// A sink that panics on one event costs that event one failed attempt, like
/// any other failure: the rest of the batch is delivered and recorded once,
/// and the panicking event is retried with backoff, then parked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_sink_counts_as_a_failed_attempt() {
    #[derive(Clone, Default)]
    struct Panics {
        deliveries: Arc<Mutex<HashMap<String, u32>>>,
    }
    impl Sink for Panics {
        async fn deliver(&self, event: &OutboxEvent) -> Result<(), DeliveryError> {
            *self
                .deliveries
                .lock()
                .unwrap()
                .entry(event.aggregate_id.clone())
                .or_default() += 1;
            if event.aggregate_id == "boom" {
                panic!("cannot charge {}", event.payload);
            }
            Ok(())
        }
    }
    let pg = setup().await;
    // Distinct due times fix the claim order: two events before the panic, two after.
    pg.exec(
        "INSERT INTO outbox_events (tenant_id, aggregate_id, event_type, payload, next_attempt_at) VALUES
         ('t', 'before-1', 'E', '{}', now() - interval '5 minutes'),
         ('t', 'before-2', 'E', '{}', now() - interval '4 minutes'),
         ('t', 'boom', 'E', '{\"card\": \"4242-SECRET\"}', now() - interval '3 minutes'),
         ('t', 'after-1', 'E', '{}', now() - interval '2 minutes'),
         ('t', 'after-2', 'E', '{}', now() - interval '1 minute')",
    )
    .await;
    let sink = Panics::default();
    let relay = Relay::new(pg.store.clone(), sink.clone()).max_attempts(3);
    let report = relay.run_once().await.unwrap();
    assert_eq!(
        (
            report.claimed,
            report.delivered,
            report.retried,
            report.parked
        ),
        (5, 4, 1, 0)
    );
    assert_eq!(
        pg.count(
            "SELECT count(*) FROM outbox_events WHERE aggregate_id <> 'boom' \
             AND published_at IS NOT NULL AND attempts = 1 AND last_error IS NULL"
        )
        .await,
        4,
        "the events on either side of the panic are marked delivered"
    );
    let boom = "SELECT attempts, last_error, next_attempt_at > now(), published_at IS NULL, parked_at IS NULL \
                FROM outbox_events WHERE aggregate_id = 'boom'";
    let row = pg.row(boom).await;
    assert_eq!(row.get::<_, i32>(0), 1);
    assert_eq!(
        row.get::<_, &str>(1),
        "the sink panicked",
        "a fixed message: the panic's text may hold the payload"
    );
    assert!(row.get::<_, bool>(2), "the retry waits for its backoff");
    assert!(row.get::<_, bool>(3) && row.get::<_, bool>(4));
    assert_eq!(relay.run_once().await.unwrap().claimed, 0, "not due yet");

    let eager = Relay::new(pg.store.clone(), sink.clone())
        .max_attempts(3)
        .backoff(Duration::ZERO, Duration::ZERO);
    pg.exec("UPDATE outbox_events SET next_attempt_at = now()")
        .await;
    let reports = [
        eager.run_once().await.unwrap(),
        eager.run_once().await.unwrap(),
        eager.run_once().await.unwrap(),
    ];
    assert_eq!(
        reports.map(|r| (r.claimed, r.retried, r.parked)),
        [(1, 1, 0), (1, 0, 1), (0, 0, 0)],
        "parked after its third attempt, then left alone"
    );
    let row = pg
        .row(
            "SELECT attempts, last_error, parked_at IS NOT NULL, published_at IS NULL \
             FROM outbox_events WHERE aggregate_id = 'boom'",
        )
        .await;
    assert_eq!(
        (
            row.get::<_, i32>(0),
            row.get::<_, &str>(1),
            row.get::<_, bool>(2),
            row.get::<_, bool>(3)
        ),
        (3, "the sink panicked", true, true)
    );
    let deliveries = sink.deliveries.lock().unwrap().clone();
    assert_eq!(
        deliveries,
        HashMap::from(
            [
                ("before-1", 1),
                ("before-2", 1),
                ("boom", 3),
                ("after-1", 1),
                ("after-2", 1)
            ]
            .map(|(id, n)| (id.to_owned(), n))
        ),
        "each delivered event went out once; the panicking one once per attempt"
    );
}

/// Entity ids unique only within a tenant (order number 1001 in two
/// tenants) get two downstream keys: each tenant's charge is made, neither
/// is taken for a retry of the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_entity_id_in_two_tenants_gets_two_downstream_keys() {
    let pg = setup().await;
    let numbered = layer(pg.store.clone()).layer(handler(|tx: PgTx| async move {
        outbox::enqueue(&tx, "1001", "OrderCreated", &json!({"order": 1001})).await?;
        Ok(response(StatusCode::CREATED, "1001"))
    }));
    for tenant in ["tenant-a", "tenant-b"] {
        let answer = send(numbered.clone(), post(Some(tenant), Some("k1"), BODY)).await;
        assert_eq!(answer.status, StatusCode::CREATED, "{tenant}");
    }
    let payments = Payments::new(pg.store.clone());
    let report = Relay::new(pg.store.clone(), payments.clone())
        .run_once()
        .await
        .unwrap();
    assert_eq!((report.claimed, report.delivered), (2, 2));
    assert_eq!(
        pg.count("SELECT count(*) FROM charges WHERE order_id = '1001'")
            .await,
        2,
        "one charge for each tenant's order 1001"
    );
}

/// A re-driven parked event gets the relay's attempts again, its backoff
/// starting over: one more transient failure is retried, not parked at
/// once because the attempts before the re-drive are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_re_driven_event_gets_its_attempts_again() {
    let pg = setup().await;
    place_orders(&pg, 1).await;
    let mut broken = Payments::new(pg.store.clone());
    broken.fail_first = u32::MAX;
    let relay = |sink: Payments| {
        Relay::new(pg.store.clone(), sink)
            .max_attempts(2)
            .backoff(Duration::ZERO, Duration::ZERO)
    };
    let broken = relay(broken);
    assert_eq!(broken.run_once().await.unwrap().retried, 1);
    assert_eq!(broken.run_once().await.unwrap().parked, 1);
    pg.exec("UPDATE outbox_events SET parked_at = NULL").await;
    // The provider is back, but one call still fails.
    let mut recovering = Payments::new(pg.store.clone());
    recovering.fail_first = 1;
    let recovering = relay(recovering);
    let report = recovering.run_once().await.unwrap();
    assert_eq!(
        (report.retried, report.parked),
        (1, 0),
        "retried, not parked"
    );
    assert_eq!(recovering.run_once().await.unwrap().delivered, 1);
    let row = pg
        .row("SELECT attempts, parked_at IS NULL, published_at IS NOT NULL FROM outbox_events")
        .await;
    assert_eq!(
        (
            row.get::<_, i32>(0),
            row.get::<_, bool>(1),
            row.get::<_, bool>(2)
        ),
        (4, true, true)
    );
    assert_eq!(pg.count("SELECT count(*) FROM charges").await, 1);
}

/// Settings at the ends of their range neither panic nor stall the relay:
/// the longest durations are held to a year, a zero delivery timeout still
/// attempts an event per batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extreme_relay_settings_neither_panic_nor_stall() {
    let pg = setup().await;
    place_orders(&pg, 2).await;
    let mut broken = Payments::new(pg.store.clone());
    broken.fail_first = u32::MAX;
    let patient = Relay::new(pg.store.clone(), broken)
        .delivery_timeout(Duration::MAX)
        .backoff(Duration::MAX, Duration::MAX);
    let report = patient
        .run_once()
        .await
        .expect("a batch with a long backoff");
    assert_eq!(report.retried, 2);
    assert_eq!(
        pg.count("SELECT count(*) FROM outbox_events WHERE next_attempt_at > now() + interval '150 days'")
            .await,
        2,
        "the retries wait, at most a year"
    );
    pg.exec("UPDATE outbox_events SET next_attempt_at = now()")
        .await;
    let hasty = Relay::new(pg.store.clone(), Payments::new(pg.store.clone()))
        .delivery_timeout(Duration::ZERO)
        .backoff(Duration::ZERO, Duration::ZERO);
    let report = hasty.run_once().await.unwrap();
    assert_eq!(report.claimed, 2);
    assert!(
        report.delivered + report.retried >= 1,
        "a batch attempts at least one event: {report:?}"
    );
    let payments = Payments::new(pg.store.clone());
    let idle = Relay::new(pg.store.clone(), payments.clone()).poll_interval(Duration::MAX);
    pg.exec("UPDATE outbox_events SET next_attempt_at = now()")
        .await;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        idle.run(async {
            let _ = stopped.await;
        })
        .await
    });
    payments.charged.notified().await;
    stop.send(()).unwrap();
    running
        .await
        .expect("the relay ran on")
        .expect("and stopped cleanly");
}
