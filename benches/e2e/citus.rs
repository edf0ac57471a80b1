//! Citus against plain PostgreSQL on this machine: the same bare and
//! layered create servers on a PostgreSQL and on a Citus coordinator with
//! two workers (every node on the same cores), the same settings
//! (`fsync` off on both), rounds alternating. What it shows is the
//! coordinator's cost per request here; on separate machines the workers
//! would add capacity instead of sharing it.

use std::sync::Arc;

use tower_idempotency::{
    postgres::PgStore,
    testing::{TempCitus, TempPostgres},
};

use crate::{
    load::{Kind, Load, Scenario, Stats},
    servers, Settings,
};

/// The benchmark's `orders`, keyed by tenant so that Citus can distribute
/// it (the main schema's primary key is the id alone).
const ORDERS: &str = "CREATE TABLE orders (tenant_id text NOT NULL, \
     id uuid NOT NULL DEFAULT gen_random_uuid(), checkout_id text NOT NULL, total bigint NOT NULL, \
     created_at timestamptz NOT NULL DEFAULT now(), customer_id bigint, \
     PRIMARY KEY (tenant_id, id), UNIQUE (tenant_id, checkout_id))";

async fn prepare(config: &tokio_postgres::Config) {
    let setup = PgStore::builder(config.clone()).build().expect("store");
    setup.migrate().await.expect("migrate");
    let client = setup.client().await.expect("client");
    client.batch_execute(ORDERS).await.expect("orders");
    drop(client);
    setup
        .distribute_by_tenant(&["orders"])
        .await
        .expect("distribute");
}

pub(crate) async fn run(load: &Arc<Load>, s: &Settings) {
    let (plain, citus) = tokio::task::spawn_blocking(|| {
        let plain = TempPostgres::builder()
            .setting("max_connections", "250")
            .start()
            .unwrap_or_else(|e| panic!("{e}"));
        let citus = TempCitus::start(2).unwrap_or_else(|e| panic!("{e}"));
        (plain, citus)
    })
    .await
    .expect("start");
    let on_citus = citus.database().await.unwrap_or_else(|e| panic!("{e}"));
    let configs = [plain.config(), on_citus.config()];
    for config in &configs {
        prepare(config).await;
    }
    let mut scenarios = Vec::new();
    for (config, [bare, create]) in configs.iter().zip([
        ["postgres bare", "postgres create"],
        ["citus bare", "citus create"],
    ]) {
        let bare_addr = servers::bare_server(servers::bare_pool(config)).await;
        let layered = servers::layered_server(servers::store(config)).await;
        scenarios.push(Scenario::new(bare, bare_addr, Kind::Plain));
        scenarios.push(Scenario::new(create, layered, Kind::Create));
    }
    for scenario in &scenarios {
        load.run(*scenario, std::time::Duration::from_secs(1)).await;
    }
    let results = crate::rounds(load, &scenarios, s).await;
    let stats: Vec<_> = results.iter().map(|(_, runs)| Stats::of(runs)).collect();
    println!(
        "\n| scenario (median of {} rounds) | req/s | p50 ms | p99 ms |",
        s.rounds
    );
    println!("| --- | ---: | ---: | ---: |");
    for ((name, _), stat) in results.iter().zip(&stats) {
        println!(
            "| {name} | {:.0} | {:.2} | {:.2} |",
            stat.tput, stat.p50, stat.p99
        );
    }
    println!(
        "CITUS create_vs_postgres_create={:.2} bare_vs_postgres_bare={:.2} \
         create_vs_bare_postgres={:.2} create_vs_bare_citus={:.2}",
        stats[3].tput / stats[1].tput,
        stats[2].tput / stats[0].tput,
        stats[1].tput / stats[0].tput,
        stats[3].tput / stats[2].tput,
    );
}
