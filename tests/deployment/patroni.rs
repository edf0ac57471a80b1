//! The example order server on a Patroni cluster (three nodes, synchronous
//! mode, etcd, HAProxy with Patroni's health checks), under load, through a
//! planned switchover and the leader's sudden death: two server processes,
//! one through a multi-host URL (`target_session_attrs=read-write`), one
//! through HAProxy. Clients retry a `503` with the same key. Checked: every
//! order answered `201` is on the last primary (nothing acknowledged lost),
//! each key made one order, each order was charged once, and both
//! processes served on through both events. The unavailability windows are
//! printed.

use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use http::{Method, StatusCode};

use crate::common::{
    example_binary::Mode,
    patroni::{wait_for, Patroni, LOOP_WAIT, RETRY_TIMEOUT, TTL},
};
use crate::server_contract::{order, Server};

/// Clients per server process.
const CLIENTS: usize = 3;

/// Every attempt of every client as it happens: (when, which server, the
/// answer's status).
type Attempts = Arc<Mutex<Vec<(Instant, usize, StatusCode)>>>;

/// Creates orders one after another on server `at` until `stop`, each
/// retried with its key after 50 ms until it is answered `201`; returns
/// (key, order id) of each.
async fn client(
    server: Arc<Server>,
    at: usize,
    id: usize,
    stop: Arc<AtomicBool>,
    attempts: Attempts,
) -> Vec<(String, String)> {
    let mut orders = Vec::new();
    for n in 0.. {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let key = format!("s{at}-c{id}-{n}");
        let body = order(&format!("chk-{key}"));
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let answer = server
                .call(Method::POST, "/orders", Some(&key), &body)
                .await;
            attempts
                .lock()
                .unwrap()
                .push((Instant::now(), at, answer.status));
            if answer.status == StatusCode::CREATED {
                let id = answer.json()["id"].as_str().unwrap().to_owned();
                orders.push((key, id));
                break;
            }
            assert!(
                answer.status == StatusCode::SERVICE_UNAVAILABLE,
                "only 503 while the primary moves: {answer:?}"
            );
            assert!(Instant::now() < deadline, "{key} never succeeded");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    orders
}

/// The `503`s each server answered from `from` until `to`: (count, span
/// from the first to the last).
fn window(
    attempts: &[(Instant, usize, StatusCode)],
    server: usize,
    from: Instant,
    to: Instant,
) -> (usize, Duration) {
    let failed: Vec<_> = attempts
        .iter()
        .filter(|(t, s, status)| {
            *s == server && *t >= from && *t < to && *status == StatusCode::SERVICE_UNAVAILABLE
        })
        .map(|(t, ..)| *t)
        .collect();
    match (failed.first(), failed.last()) {
        (Some(first), Some(last)) => (failed.len(), *last - *first),
        _ => (0, Duration::ZERO),
    }
}

/// Waits until both servers have answered `201` after `since`.
async fn serving_again(seen: &Mutex<Vec<(Instant, usize, StatusCode)>>, since: Instant) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ok = |server| {
            seen.lock()
                .unwrap()
                .iter()
                .any(|(t, s, status)| *t > since && *s == server && *status == StatusCode::CREATED)
        };
        if ok(0) && ok(1) {
            return;
        }
        assert!(Instant::now() < deadline, "the servers never served again");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_order_server_rides_out_a_patroni_switchover_and_the_leaders_death() {
    let mut cluster = tokio::task::spawn_blocking(Patroni::start).await.unwrap();
    let urls = [cluster.multi_host_url(), cluster.haproxy_url()];
    let mut servers = Vec::new();
    for url in &urls {
        servers.push(Arc::new(Server::start(url, Mode::ClaimFirst).await));
    }

    let live: Attempts = Default::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for (at, server) in servers.iter().enumerate() {
        for id in 0..CLIENTS {
            let (server, stop, live) = (server.clone(), stop.clone(), live.clone());
            clients.push(tokio::spawn(client(server, at, id, stop, live)));
        }
    }

    tokio::time::sleep(Duration::from_secs(2)).await;
    let switched = Instant::now();
    let (from, to) = tokio::task::block_in_place(|| cluster.switchover());
    tokio::task::block_in_place(|| {
        wait_for("the switchover", Duration::from_secs(60), || {
            cluster.leader().as_deref() == Some(to.as_str())
        })
    });
    serving_again(&live, Instant::now()).await;
    // In synchronous mode only the synchronous standby may be promoted: the
    // old leader must be back as one before the new leader dies.
    tokio::task::block_in_place(|| {
        wait_for(
            "a synchronous standby again",
            Duration::from_secs(60),
            || cluster.sync_standby().is_some(),
        )
    });
    tokio::time::sleep(Duration::from_secs(2)).await;

    let killed_at = Instant::now();
    let killed = tokio::task::block_in_place(|| cluster.kill_leader());
    tokio::task::block_in_place(|| {
        wait_for("a new leader", Duration::from_secs(60), || {
            cluster.leader().is_some_and(|l| l != killed)
        })
    });
    let promoted_after = killed_at.elapsed();
    serving_again(&live, Instant::now()).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ended = Instant::now();
    stop.store(true, Ordering::Relaxed);
    let mut orders = Vec::new();
    for client in clients {
        orders.extend(client.await.unwrap());
    }
    let attempts = live.lock().unwrap().clone();
    for (at, url) in ["multi-host URL", "HAProxy"].iter().enumerate() {
        let (n, span) = window(&attempts, at, switched, killed_at);
        let (m, span2) = window(&attempts, at, killed_at, ended);
        eprintln!(
            "patroni (ttl {TTL}, loop_wait {LOOP_WAIT}, retry_timeout {RETRY_TIMEOUT}, synchronous), \
             through the {url}: switchover {from} -> {to}: {n} x 503 over {span:.1?}; \
             leader {killed} killed: {m} x 503 over {span2:.1?} (a new leader after {promoted_after:.1?})"
        );
    }
    assert!(
        orders.len() > 20,
        "the load went on: {} orders",
        orders.len()
    );

    // Both processes served on: the same processes, answering.
    for server in &servers {
        let health = server.call(Method::GET, "/healthz", None, "").await;
        assert_eq!(health.status, StatusCode::OK, "{health:?}");
    }

    // On the last primary: every order answered 201, one per key.
    let config = tokio::task::block_in_place(|| cluster.leader_config());
    let (db, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    let rows = db
        .query("SELECT checkout_id, id::text FROM orders", &[])
        .await
        .unwrap();
    let stored: BTreeMap<String, Vec<String>> =
        rows.iter().fold(BTreeMap::new(), |mut map, row| {
            map.entry(row.get(0)).or_default().push(row.get(1));
            map
        });
    for (key, id) in &orders {
        assert_eq!(
            stored.get(&format!("chk-{key}")),
            Some(&vec![id.clone()]),
            "{key}: answered 201 with order {id}, which is on the last primary, alone"
        );
    }
    assert!(
        stored.values().all(|ids| ids.len() == 1),
        "no checkout has two orders"
    );

    // The relay charged every order once.
    let count = |sql: &'static str| {
        let db = &db;
        async move { db.query_one(sql, &[]).await.unwrap().get::<_, i64>(0) }
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while count("SELECT count(*) FROM outbox_events WHERE published_at IS NULL").await > 0 {
        assert!(Instant::now() < deadline, "the outbox never drained");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let orders_stored = count("SELECT count(*) FROM orders").await;
    assert_eq!(
        count("SELECT count(DISTINCT order_id) FROM payment_charges").await,
        orders_stored,
        "every order charged"
    );
    assert_eq!(
        count("SELECT count(*) FROM payment_charges").await,
        orders_stored,
        "one charge per order"
    );

    for server in servers {
        let server = Arc::into_inner(server).expect("no request in flight");
        let (exit, log) = server.stop().await;
        assert!(exit.success(), "graceful shutdown exits 0:\n{log}");
    }
    drop(cluster);
}
