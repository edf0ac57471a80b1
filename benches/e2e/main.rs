//! End-to-end cost of the layer: the same order + outbox inserts served over
//! loopback HTTP, bare and behind `IdempotencyLayer`, against a throwaway
//! PostgreSQL with production durability (fsync on), load from a client in
//! the same run. Scenarios alternate and repeat; medians are reported.
//!
//!     cargo bench --bench e2e
//!
//! Environment (BENCHMARKS.md describes each part):
//!
//! - `E2E_SECONDS` (per scenario run, default 5), `E2E_ROUNDS` (default 3);
//! - `E2E_ONLY=main,units,open,proxy,pgbench,trials,memory,growth,cleanup,citus,grpc`
//!   (default: all);
//! - `E2E_KEYS` (key-table sizes, default `0,1000000,10000000`),
//!   `E2E_EXPIRED` (expired keys for cleanup, default 1000000);
//! - `E2E_PROXY_DELAY_MS` (each way, default 0.5), `E2E_RATE` (open loop);
//! - `E2E_UNITS` (the `units` part's scenarios whose names hold one of these
//!   comma-separated words, to profile one at a time), `E2E_UNITS_RATE`
//!   (the `units` part's fixed rate; default half the slowest scenario's);
//! - `E2E_TRIALS` (the `trials` part's trials by number, comma-separated;
//!   default: all).
//!
//! The last line is `RATIOS create_vs_bare=<x.xx> replay_vs_create=<x.xx>
//! p99_create_vs_bare=<x.xx> mixed_vs_bare=<x.xx> atcommit_vs_bare=<x.xx>
//! create_10m_vs_0=<x.xx> roundtrips_default_minus_bare=<x.xx>
//! roundtrips_onecommit_minus_bare=<x.xx> wal_create_vs_bare=<x.xx>
//! wal_onecommit_vs_bare=<x.xx> cpu_default_vs_bare=<x.xx>
//! cpu_onecommit_vs_experiment=<x.xx>` (`n/a` for what did not run).
#![allow(unsafe_code)] // the counting allocator in memory.rs, and nothing else

mod citus;
mod experiment;
mod growth;
mod grpc;
mod load;
mod memory;
mod observed;
mod pgbench;
mod proxy;
mod report;
mod servers;
mod trials;
mod units;

mod one_commit;

// The gRPC example's messages and server, measured as they are.
#[allow(dead_code)]
#[path = "../../examples/grpc_orders/service.rs"]
mod grpc_service;
#[allow(dead_code)]
#[path = "../../examples/grpc_orders/proto.rs"]
mod proto;

use std::{net::SocketAddr, sync::Arc, time::Duration};

use tower_idempotency::{postgres::PgStore, testing::TempPostgres};

use crate::{
    load::{print_open_round, print_round, Body, Kind, Load, Scenario, Stats, MAIN_KEYS},
    report::{Proxied, Report},
    servers::echo_server,
};

/// A server in the one-commit mode on `store` (`None` would run the
/// hand-written experiment in its place in the open-loop and proxy tables,
/// and leave out row 7).
async fn one_commit_server(store: PgStore) -> Option<SocketAddr> {
    Some(one_commit::server(store).await)
}

const SECTIONS: [&str; 11] = [
    "main", "units", "open", "proxy", "pgbench", "trials", "memory", "growth", "cleanup", "citus",
    "grpc",
];

struct Settings {
    duration: Duration,
    rounds: usize,
    sections: Vec<String>,
    keys: Vec<u64>,
    expired: u64,
    proxy_delay: Duration,
    rate: Option<f64>,
    units_rate: Option<f64>,
}

impl Settings {
    fn from_env() -> Settings {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let number = |name: &str| {
            var(name).map(|v| {
                v.trim()
                    .parse::<f64>()
                    .unwrap_or_else(|_| panic!("{name}={v}: not a number"))
            })
        };
        let sections: Vec<String> = var("E2E_ONLY").map_or_else(
            || SECTIONS.iter().map(|s| s.to_string()).collect(),
            |v| v.split(',').map(|s| s.trim().to_owned()).collect(),
        );
        if let Some(unknown) = sections.iter().find(|s| !SECTIONS.contains(&s.as_str())) {
            panic!("E2E_ONLY: unknown part {unknown:?}; the parts are {SECTIONS:?}");
        }
        let mut keys: Vec<u64> = var("E2E_KEYS")
            .unwrap_or_else(|| "0,1000000,10000000".into())
            .split(',')
            .map(|k| {
                k.trim()
                    .replace('_', "")
                    .parse()
                    .expect("E2E_KEYS: numbers")
            })
            .collect();
        keys.sort_unstable();
        keys.dedup();
        Settings {
            duration: Duration::from_secs_f64(number("E2E_SECONDS").unwrap_or(5.0)),
            rounds: number("E2E_ROUNDS").map_or(3, |r| r as usize).max(1),
            sections,
            keys,
            expired: number("E2E_EXPIRED").map_or(1_000_000, |e| e as u64),
            proxy_delay: Duration::from_secs_f64(
                number("E2E_PROXY_DELAY_MS").unwrap_or(0.5) / 1000.0,
            ),
            rate: number("E2E_RATE"),
            units_rate: number("E2E_UNITS_RATE"),
        }
    }

    fn runs(&self, section: &str) -> bool {
        self.sections.iter().any(|s| s == section)
    }
}

fn main() {
    let settings = Settings::from_env();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(run(settings));
}

/// Closed loop, `rounds` rounds of every scenario in turn.
async fn rounds(load: &Arc<Load>, scenarios: &[Scenario], s: &Settings) -> report::Rows {
    let mut results: Vec<_> = scenarios.iter().map(|s| (s.name, Vec::new())).collect();
    for round in 1..=s.rounds {
        for (i, scenario) in scenarios.iter().enumerate() {
            let run = load.run(*scenario, s.duration).await;
            print_round(round, scenario.name, &run);
            results[i].1.push(run);
        }
    }
    results
}

/// Open loop at `rate`, `rounds` rounds of every scenario in turn.
async fn open_rounds(
    load: &Arc<Load>,
    scenarios: &[Scenario],
    rate: f64,
    s: &Settings,
) -> report::Rows {
    let mut results: Vec<_> = scenarios.iter().map(|s| (s.name, Vec::new())).collect();
    for round in 1..=s.rounds {
        for (i, scenario) in scenarios.iter().enumerate() {
            let run = load.fixed_rate(*scenario, rate, s.duration).await;
            print_open_round(round, scenario.name, rate, &run);
            results[i].1.push(run);
        }
    }
    results
}

async fn run(s: Settings) {
    let pg = tokio::task::spawn_blocking(|| {
        TempPostgres::builder()
            .durable(true)
            .setting("max_connections", "400")
            .start()
    })
    .await
    .expect("start")
    .unwrap_or_else(|e| panic!("{e}"));
    let config = pg.config();
    observed::install();
    let setup = PgStore::builder(config.clone()).build().expect("store");
    setup.migrate().await.expect("migrate");
    let client = setup.client().await.expect("client");
    client
        .batch_execute(&servers::schema())
        .await
        .expect("schema");
    drop(client);

    let bare = servers::bare_server(servers::bare_pool(&config)).await;
    let layered_store = servers::store(&config);
    let layered = servers::layered_server(layered_store.clone()).await;
    let uncached = servers::uncached_server(layered_store).await;
    let at_commit = experiment::at_commit_server(servers::bare_pool(&config)).await;
    let one_commit = one_commit_server(servers::store(&config)).await;
    let typed = servers::typed_server(&config).await;
    let bare_five = servers::bare_five_server(servers::bare_pool(&config)).await;
    let layered_five = servers::layered_five_server(servers::store(&config)).await;
    let full_record = experiment::full_record_server(servers::bare_pool(&config)).await;
    let echo = echo_server().await;
    let trusted_one_commit = one_commit_server(
        PgStore::builder(config.clone())
            .max_connections(servers::POOL)
            .session_reset(tower_idempotency::postgres::SessionReset::TrustedHandlers)
            .build()
            .expect("store"),
    )
    .await;
    let observed_one_commit = {
        // Built observed, in case the layer takes its metric handles once.
        let _on = observed::On::new();
        one_commit_server(servers::store(&config)).await
    };

    let bare_s = Scenario::new(report::BARE, bare, Kind::Plain);
    let create_s = Scenario::new(report::CREATE, layered, Kind::Create).list(MAIN_KEYS);
    let experiment_s = Scenario::new(report::EXPERIMENT, at_commit, Kind::Create);
    let one_commit_s = one_commit.map(|addr| Scenario::new(report::ONE_COMMIT, addr, Kind::Create));
    let mut main = vec![
        bare_s,
        create_s,
        Scenario::new(report::REPLAY, layered, Kind::Replay).fresh_hits(),
        Scenario::new(report::MIXED, layered, Kind::Mixed).list(MAIN_KEYS),
        Scenario::new(report::HOT, layered, Kind::HotKey),
        experiment_s,
    ];
    main.extend(one_commit_s);
    main.extend([
        Scenario::new(report::TYPED, typed, Kind::Create),
        Scenario::new(report::BARE_FIVE, bare_five, Kind::Plain).body(Body::Full),
        Scenario::new(report::LAYERED_FIVE, layered_five, Kind::Create).body(Body::Full),
        Scenario::new(report::FULL_RECORD, full_record, Kind::Create),
        Scenario::new(report::REPLAY_MISS, uncached, Kind::Replay).list(MAIN_KEYS),
        Scenario::new(report::ECHO, echo, Kind::Plain),
        Scenario::new(report::FULL_RECORD_4K, full_record, Kind::Create).body(Body::Large),
    ]);
    main.extend(
        one_commit
            .map(|addr| Scenario::new(report::ONE_COMMIT_4K, addr, Kind::Create).body(Body::Large)),
    );
    main.extend(trusted_one_commit.map(|addr| Scenario::new(report::TRUSTED, addr, Kind::Create)));
    main.extend(
        observed_one_commit
            .map(|addr| Scenario::new(report::OBSERVED, addr, Kind::Create).observed()),
    );
    let mut report = Report {
        one_commit: one_commit.is_some(),
        ..Report::default()
    };

    let load = Load::new();
    println!("warming up (and creating keys to replay)…");
    load.run(bare_s, Duration::from_secs(1)).await;
    load.run(create_s, Duration::from_secs(2)).await;
    if s.runs("main") {
        for scenario in &main[5..] {
            load.run(*scenario, Duration::from_millis(500)).await;
        }
        report.main = rounds(&load, &main, &s).await;
    }

    if s.runs("units") {
        let socket = unix_socket(&config);
        let costs = units::run(&load, socket, pg.data_dir(), &config, &s).await;
        report.key_row_wal = Some(units::key_row_wal(&setup).await);
        report.units = Some(costs);
    }

    if s.runs("open") {
        // Latency at equal load: all at half the layered create throughput.
        let rate = match (
            s.rate,
            report.main.iter().find(|(n, _)| *n == report::CREATE),
        ) {
            (Some(rate), _) => rate,
            (None, Some((_, runs))) => Stats::of(runs).tput * 0.5,
            (None, None) => load.run(create_s, s.duration).await.throughput() * 0.5,
        }
        .max(1.0);
        let mut open = vec![bare_s, create_s, experiment_s];
        open.extend(one_commit_s);
        report.open = Some((rate, open_rounds(&load, &open, rate, &s).await));
    }

    if s.runs("proxy") {
        report.proxy = Some(proxied(&load, &config, one_commit.is_some(), &s).await);
    }

    if s.runs("pgbench") {
        let seconds = s.duration.as_secs().max(5);
        report.pgbench = Some(pgbench::run(&pg, seconds));
    }
    if s.runs("trials") {
        let seconds = s.duration.as_secs().max(5);
        report.trials = Some(trials::run(&pg, seconds, s.rounds));
    }
    if s.runs("memory") {
        report.memory = Some(memory::memory_per_in_flight_request().await);
    }

    let targets = growth::Targets {
        bare,
        layered,
        uncached,
    };
    if s.runs("growth") {
        let steps = growth::run(
            &load,
            &setup,
            pg.data_dir(),
            targets,
            &s.keys,
            s.duration,
            s.rounds,
        )
        .await;
        report.growth = Some(steps);
    }
    if s.runs("cleanup") {
        let cleaner = PgStore::builder(config.clone())
            .max_connections(2)
            .build()
            .expect("store");
        let cleanup = growth::cleanup(
            &load, &setup, cleaner, targets, s.expired, s.duration, s.rounds,
        )
        .await;
        report.cleanup = Some(cleanup);
    }
    report.print();
    if s.runs("grpc") {
        println!("\ngRPC (the tonic example's CreateOrder, with and without the layer):");
        let r = grpc::run(&config, &s).await;
        println!(
            "GRPC create_vs_bare={:.2} replay_vs_create={:.2} p99_create_vs_bare={:.2}",
            r.create_vs_bare, r.replay_vs_create, r.p99_create_vs_bare
        );
    }
    if s.runs("citus") {
        println!("\nCitus (a coordinator and two workers on these cores) against PostgreSQL:");
        citus::run(&load, &s).await;
    }
}

/// The socket file of the bench's cluster.
fn unix_socket(config: &tokio_postgres::Config) -> std::path::PathBuf {
    match (config.get_hosts().first(), config.get_ports().first()) {
        (Some(tokio_postgres::config::Host::Unix(dir)), Some(port)) => {
            dir.join(format!(".s.PGSQL.{port}"))
        }
        _ => panic!("the bench's cluster listens on a Unix socket"),
    }
}

/// Bare, the layered create and the one-commit mode (the experiment until
/// it is merged) with the database behind the delaying proxy: closed loop,
/// then open loop at half the proxied layered create's throughput.
async fn proxied(
    load: &Arc<Load>,
    config: &tokio_postgres::Config,
    mode: bool,
    s: &Settings,
) -> Proxied {
    let proxy = proxy::Proxy::start(unix_socket(config), s.proxy_delay);
    let mut via = tokio_postgres::Config::new();
    via.host("127.0.0.1")
        .port(proxy.addr.port())
        .user("postgres")
        .dbname("postgres");
    let bare = servers::bare_server(servers::bare_pool(&via)).await;
    let layered = servers::layered_server(servers::store(&via)).await;
    let at_commit = match one_commit_server(servers::store(&via)).await {
        Some(addr) => Scenario::new("create, one-commit mode, via proxy", addr, Kind::Create),
        None => Scenario::new(
            "create, claim at commit (experiment), via proxy",
            experiment::at_commit_server(servers::bare_pool(&via)).await,
            Kind::Create,
        ),
    };
    debug_assert_eq!(mode, at_commit.name.contains("mode"));
    let scenarios = [
        Scenario::new("bare (no layer), via proxy", bare, Kind::Plain),
        Scenario::new("layered create, via proxy", layered, Kind::Create),
        at_commit,
    ];
    for scenario in scenarios {
        load.run(scenario, Duration::from_secs(1)).await;
    }
    let closed = rounds(load, &scenarios, s).await;
    let rate = s
        .rate
        .unwrap_or_else(|| (Stats::of(&closed[1].1).tput * 0.5).max(1.0));
    let open = open_rounds(load, &scenarios, rate, s).await;
    Proxied {
        delay_ms: s.proxy_delay.as_secs_f64() * 1000.0,
        measured: proxy.take_delays(),
        rate,
        rows: closed
            .into_iter()
            .zip(open)
            .map(|((name, closed), (_, open))| (name, closed, open))
            .collect(),
    }
}
