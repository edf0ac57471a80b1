//! A network partition between the example server and PostgreSQL: a relay
//! that stops moving bytes without closing anything (what a cloud
//! partition, a security-group change or a dead NAT entry does), held long
//! enough that only the process's own deadlines can answer. The contract:
//! every request, in flight when the path stopped or sent during it, is
//! answered within `IDEMPOTENCY_HANDLER_TIMEOUT` + 10 s (`503
//! store_unavailable`, never a wait for the network), `/healthz` answers
//! `503` within 5 s, the server serves again within 10 s of the path coming
//! back, and nothing is lost or doubled: every key retried afterwards ends
//! with exactly one order, one event and one remembered answer.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use http::{Method, StatusCode};
use tower_idempotency::testing::TestDatabase;

use crate::common::{
    example_binary::{both_modes, Mode},
    partition::PartitionProxy,
    pgbouncer::PgBouncer,
};
use crate::server_contract::{order, Server};

/// The handler timeout the server runs with, and the bound on every answer.
const HANDLER_TIMEOUT: Duration = Duration::from_secs(2);
const BOUND: Duration = Duration::from_secs(2 + 10);
/// Longer than the bound: an answer that waited for the network to heal
/// comes after it. `PARTITION_SECS` sets another length (45 for the
/// figures in the deploying guide).
fn partition_length() -> Duration {
    let secs = std::env::var("PARTITION_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(14);
    Duration::from_secs(secs)
}
/// Clients sending orders one after another, through the partition.
const CLIENTS: usize = 4;

/// One request as a client saw it.
#[derive(Debug, Clone)]
struct Sent {
    key: String,
    checkout: String,
    status: StatusCode,
    code: Option<String>,
    took: Duration,
}

async fn across_a_partition(mode: Mode, through_pgbouncer: bool) {
    let db = TestDatabase::create().await;
    let bouncer = through_pgbouncer.then(|| PgBouncer::start(&db.config()));
    let target: tokio_postgres::Config = match &bouncer {
        Some(bouncer) => bouncer.url(db.name()).parse().unwrap(),
        None => db.config(),
    };
    let proxy = PartitionProxy::start(target).await;
    let through = proxy.config();
    let mut url = format!(
        "host=127.0.0.1 port={} user={} dbname={}",
        proxy.port(),
        through.get_user().unwrap(),
        through.get_dbname().unwrap()
    );
    if let Some(password) = through.get_password() {
        url.push_str(&format!(" password={}", String::from_utf8_lossy(password)));
    }
    let timeout = format!("{}s", HANDLER_TIMEOUT.as_secs());
    let server = Arc::new(
        Server::start_with(
            &url,
            mode,
            &[
                ("IDEMPOTENCY_HANDLER_TIMEOUT", timeout.as_str()),
                ("IDEMPOTENCY_WAIT", "1s"),
                ("IDEMPOTENCY_RETENTION", "1h"),
            ],
        )
        .await,
    );
    // The pool warm: a few orders before anything goes wrong.
    for n in 0..4 {
        let key = format!("warm-{n}");
        let answer = server
            .call(Method::POST, "/orders", Some(&key), &order(&key))
            .await;
        assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
    }

    // Clients send orders one after another, each under a key of its own,
    // from before the partition until after it healed.
    let sent: Arc<Mutex<Vec<Sent>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let started = Arc::new(tokio::sync::Barrier::new(CLIENTS + 1));
    let mut clients = Vec::new();
    for client in 0..CLIENTS {
        let (server, sent, stop, started) =
            (server.clone(), sent.clone(), stop.clone(), started.clone());
        clients.push(tokio::spawn(async move {
            let mut n = 0;
            let mut first = true;
            while !stop.load(Ordering::SeqCst) {
                let key = format!("p-{client}-{n}");
                let checkout = format!("chk-{client}-{n}");
                if first {
                    started.wait().await;
                    first = false;
                }
                let at = Instant::now();
                let answer = tokio::time::timeout(
                    BOUND + partition_length(),
                    server.call(Method::POST, "/orders", Some(&key), &order(&checkout)),
                )
                .await
                .expect("answered at all");
                let code = (answer.status != StatusCode::CREATED)
                    .then(|| answer.json()["code"].as_str().map(str::to_owned))
                    .flatten();
                sent.lock().unwrap().push(Sent {
                    key,
                    checkout,
                    status: answer.status,
                    code,
                    took: at.elapsed(),
                });
                n += 1;
            }
        }));
    }
    started.wait().await;
    // The requests now in flight are cut off mid-way.
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxy.partition();
    let partitioned_at = Instant::now();

    // Health answers within 5 s, and says the database is gone.
    let health_at = Instant::now();
    let health = server.call(Method::GET, "/healthz", None, "").await;
    let health_took = health_at.elapsed();
    assert_eq!(health.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(health_took <= Duration::from_secs(5), "{health_took:?}");

    tokio::time::sleep(partition_length().saturating_sub(partitioned_at.elapsed())).await;
    proxy.heal();
    let healed_at = Instant::now();
    // Serving again within 10 s of the path coming back.
    let serving = async {
        let mut n = 0;
        loop {
            let key = format!("after-{n}");
            let answer = server
                .call(Method::POST, "/orders", Some(&key), &order(&key))
                .await;
            if answer.status == StatusCode::CREATED {
                break healed_at.elapsed();
            }
            n += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let back_after = tokio::time::timeout(Duration::from_secs(10), serving)
        .await
        .expect("serving again within 10 s of the path coming back");
    stop.store(true, Ordering::SeqCst);
    for client in clients {
        client.await.unwrap();
    }

    let sent = sent.lock().unwrap().clone();
    let longest = sent.iter().map(|s| s.took).max().unwrap_or_default();
    let during: Vec<&Sent> = sent
        .iter()
        .filter(|s| s.status != StatusCode::CREATED)
        .collect();
    eprintln!(
        "partition of {:?} ({}, {}): {} requests, {} answered other than 201, longest answer {longest:?}, /healthz {health_took:?}, serving again {back_after:?} after the path came back",
        partition_length(),
        mode.name(),
        if through_pgbouncer { "through PgBouncer" } else { "direct" },
        sent.len(),
        during.len(),
    );
    assert!(
        !during.is_empty(),
        "some requests met the partition: {sent:?}"
    );
    for s in &sent {
        assert!(
            s.took <= BOUND,
            "{} took {:?}, past the bound {BOUND:?}",
            s.key,
            s.took
        );
        if s.status != StatusCode::CREATED {
            assert_eq!(
                (s.status, s.code.as_deref()),
                (StatusCode::SERVICE_UNAVAILABLE, Some("store_unavailable")),
                "{s:?}"
            );
        }
    }

    // Nothing lost, nothing doubled: every key retried now ends with one
    // order (created now, or replayed from a commit whose answer was lost).
    for s in &sent {
        let answer = server
            .call(Method::POST, "/orders", Some(&s.key), &order(&s.checkout))
            .await;
        assert_eq!(
            answer.status,
            StatusCode::CREATED,
            "{}: {:?}",
            s.key,
            answer.body
        );
        if s.status == StatusCode::CREATED {
            assert!(answer.replayed(), "{} was created before", s.key);
        }
    }
    let sql = db.client().await;
    let count = |query: &'static str| {
        let sql = &sql;
        async move { sql.query_one(query, &[]).await.unwrap().get::<_, i64>(0) }
    };
    let keys = count(
        "SELECT count(*) FROM idempotency_requests WHERE endpoint = 'POST /orders v1' AND idempotency_key LIKE 'p-%' AND state = 'completed' AND response_status = 201",
    )
    .await;
    let orders = count("SELECT count(*) FROM orders WHERE checkout_id LIKE 'chk-%'").await;
    let checkouts =
        count("SELECT count(DISTINCT checkout_id) FROM orders WHERE checkout_id LIKE 'chk-%'")
            .await;
    let events = count(
        "SELECT count(*) FROM outbox_events e JOIN orders o ON o.id::text = e.aggregate_id WHERE o.checkout_id LIKE 'chk-%'",
    )
    .await;
    let expected = sent.len() as i64;
    assert_eq!(
        (keys, orders, checkouts, events),
        (expected, expected, expected, expected),
        "one remembered answer, one order and one event per key"
    );
    drop(bouncer);
}

async fn requests_are_answered_within_the_bound_across_a_partition(mode: Mode) {
    across_a_partition(mode, false).await;
}

async fn requests_are_answered_within_the_bound_across_a_partition_through_pgbouncer(mode: Mode) {
    across_a_partition(mode, true).await;
}

both_modes!(
    requests_are_answered_within_the_bound_across_a_partition,
    requests_are_answered_within_the_bound_across_a_partition_through_pgbouncer,
);
