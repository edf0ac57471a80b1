//! The example order server on Citus (a coordinator and two workers, on
//! this machine): two instances through the coordinator keep the whole
//! contract with every table distributed by tenant and co-located; a
//! restart on the distributed schema starts cleanly and replays.

use tower_idempotency::testing::TestDatabase;

use crate::common::{
    citus,
    example_binary::{both_modes, Mode},
};
use crate::server_contract::{keeps_its_contract, Server};

/// The tables the server distributes (the crate's and its own), each with
/// the co-location group of `idempotency_requests`.
const TABLES: [&str; 8] = [
    "idempotency_requests",
    "outbox_events",
    "inbox_events",
    "orders",
    "payment_charges",
    "inventory_reservations",
    "warehouse_shipments",
    "warehouse_tokens",
];

async fn distributed(db: &TestDatabase) -> Vec<(String, String)> {
    let client = db.client().await;
    client
        .query(
            "SELECT logicalrelid::text, partkey IS NOT NULL AND \
                 colocationid = (SELECT colocationid FROM pg_dist_partition \
                                 WHERE logicalrelid = 'idempotency_requests'::regclass) \
             FROM pg_dist_partition ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| {
            let colocated: bool = row.get(1);
            (
                row.get(0),
                if colocated { "co-located" } else { "apart" }.to_owned(),
            )
        })
        .collect()
}

async fn the_order_server_keeps_its_contract_on_citus_with_two_instances(mode: Mode) {
    let db = citus::cluster()
        .await
        .database()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // Over loopback TCP: the coordinator offers TLS with Citus's own
    // certificate, which the default sslmode (prefer) takes.
    let url = db.connection_string();
    keeps_its_contract(&db, &[url.clone(), url.clone()], mode).await;

    let mut expected: Vec<_> = TABLES
        .iter()
        .map(|t| (t.to_string(), "co-located".to_owned()))
        .collect();
    expected.sort();
    assert_eq!(distributed(&db).await, expected);

    // A restart on the distributed schema: migrations and distribution find
    // everything done, and the first order is replayed.
    let server = Server::start(&url, mode).await;
    let replay = server
        .call(
            http::Method::POST,
            "/orders",
            Some("key-1"),
            &crate::server_contract::order("chk_1"),
        )
        .await;
    assert_eq!(replay.status, http::StatusCode::CREATED, "{replay:?}");
    assert!(replay.replayed());
    let (exit, log) = server.stop().await;
    assert!(exit.success(), "graceful shutdown exits 0:\n{log}");
    assert_eq!(distributed(&db).await, expected);
}

both_modes!(the_order_server_keeps_its_contract_on_citus_with_two_instances);
