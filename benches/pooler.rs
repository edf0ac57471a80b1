//! What a transaction pooler and the statements it needs cost: the layer's
//! create (new key: claim, the handler's insert, completion) and replay
//! (a remembered key), and a bare transaction with the same insert, each
//! reached directly and through PgBouncer 1.18 in transaction pooling mode,
//! with the store's statements cached (the default) or unnamed
//! (`transaction_pooling(true)`), in one run. The tower service is called
//! in-process (no HTTP), so the numbers are the database side's. Variants
//! alternate and repeat; medians are reported, and ratios within the run.
//!
//!     cargo bench --bench pooler
//!
//! Environment: `POOLER_SECONDS` (per run, default 3), `POOLER_ROUNDS`
//! (default 3). Needs PgBouncer (`apt-get install pgbouncer`).

#[path = "support/create.rs"]
mod create;
#[path = "../tests/common/pgbouncer.rs"]
#[allow(dead_code)]
mod pgbouncer;

use std::{
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use create::{layered, Service, INSERT};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio_postgres::types::Type;
use tower::ServiceExt;
use tower_idempotency::{postgres::PgStore, testing::TempPostgres};

/// The application pool; PgBouncer's server pool is 4 per database (as in
/// the tests), so through it 16 clients share 4 server connections.
const POOL: usize = 16;
const CONCURRENCY: usize = 16;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Route {
    Direct,
    Pooler,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Work {
    Bare,
    Create,
    Replay,
}

#[derive(Clone, Copy)]
struct Variant {
    route: Route,
    unnamed: bool,
    work: Work,
}

impl Variant {
    fn name(self) -> String {
        let route = match self.route {
            Route::Direct => "direct",
            Route::Pooler => "PgBouncer",
        };
        let statements = if self.unnamed { "unnamed" } else { "cached" };
        let work = match self.work {
            Work::Bare => "bare transaction",
            Work::Create => "create",
            Work::Replay => "replay",
        };
        format!("{work}, {route}, {statements}")
    }
}

const VARIANTS: [Variant; 9] = [
    v(Route::Direct, false, Work::Bare),
    v(Route::Direct, false, Work::Create),
    v(Route::Direct, true, Work::Create),
    v(Route::Direct, false, Work::Replay),
    v(Route::Direct, true, Work::Replay),
    v(Route::Pooler, true, Work::Bare),
    v(Route::Pooler, true, Work::Create),
    v(Route::Pooler, true, Work::Replay),
    // The default store through the pooler, to count what fails.
    v(Route::Pooler, false, Work::Create),
];

const fn v(route: Route, unnamed: bool, work: Work) -> Variant {
    Variant {
        route,
        unnamed,
        work,
    }
}

fn main() {
    let seconds: u64 = env("POOLER_SECONDS", 3);
    let rounds: usize = env("POOLER_ROUNDS", 3) as usize;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(run(Duration::from_secs(seconds), rounds));
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

async fn run(duration: Duration, rounds: usize) {
    let pg = tokio::task::spawn_blocking(|| {
        TempPostgres::builder()
            .durable(true)
            .setting("max_connections", "200")
            .start()
    })
    .await
    .expect("start")
    .unwrap_or_else(|e| panic!("{e}"));
    let config = pg.config();
    let bouncer = pgbouncer::PgBouncer::start(&config);
    let dbname = config.get_dbname().unwrap_or("postgres").to_owned();
    let setup = PgStore::builder(config.clone()).build().expect("store");
    setup.migrate().await.expect("migrate");
    setup
        .client()
        .await
        .expect("client")
        .batch_execute(
            "CREATE TABLE orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, \
                                  tenant_id text NOT NULL, total bigint NOT NULL)",
        )
        .await
        .expect("schema");
    let store = |route: Route, unnamed: bool| {
        let config = match route {
            Route::Direct => config.clone(),
            Route::Pooler => bouncer.config(&dbname),
        };
        PgStore::builder(config)
            .max_connections(POOL)
            .transaction_pooling(unnamed)
            .build()
            .expect("store")
    };
    let mut targets = Vec::new();
    for variant in VARIANTS {
        let service = layered(store(variant.route, variant.unnamed));
        let mut clients = Vec::new();
        if variant.work == Work::Bare {
            let config = match variant.route {
                Route::Direct => config.clone(),
                Route::Pooler => bouncer.config(&dbname),
            };
            for _ in 0..CONCURRENCY {
                let (client, connection) = config
                    .connect(tokio_postgres::NoTls)
                    .await
                    .expect("connect");
                tokio::spawn(connection);
                clients.push(client);
            }
        }
        let target = Arc::new(Target {
            variant,
            service,
            clients,
            next: AtomicUsize::new(0),
        });
        // Warm the pool, and create the keys a replay run replays.
        target.clone().load(Duration::from_millis(500), true).await;
        targets.push(target);
    }

    let mut results: Vec<Vec<(f64, usize)>> = vec![Vec::new(); VARIANTS.len()];
    for round in 1..=rounds {
        for (i, target) in targets.iter().enumerate() {
            let (rate, failed) = target.clone().load(duration, false).await;
            println!(
                "round {round} {:<32} {rate:>8.0} req/s  failed {failed}",
                target.variant.name()
            );
            results[i].push((rate, failed));
        }
    }
    let medians: Vec<(f64, usize)> = results
        .iter()
        .map(|runs| {
            let mut rates: Vec<f64> = runs.iter().map(|r| r.0).collect();
            rates.sort_by(f64::total_cmp);
            (rates[rates.len() / 2], runs.iter().map(|r| r.1).sum())
        })
        .collect();
    println!();
    println!("| variant | req/s | failed answers |");
    println!("| --- | ---: | ---: |");
    for (variant, (rate, failed)) in VARIANTS.iter().zip(&medians) {
        println!("| {} | {rate:.0} | {failed} |", variant.name());
    }
    let rate = |route, unnamed, work| {
        let i = VARIANTS
            .iter()
            .position(|x| x.route == route && x.unnamed == unnamed && x.work == work)
            .expect("a variant");
        medians[i].0
    };
    println!();
    println!(
        "RATIOS direct: unnamed/cached create={:.2} replay={:.2}; create/bare cached={:.2} unnamed={:.2}; \
         PgBouncer: create/bare={:.2} replay/create={:.2}; PgBouncer/direct unnamed create={:.2} bare={:.2}",
        rate(Route::Direct, true, Work::Create) / rate(Route::Direct, false, Work::Create),
        rate(Route::Direct, true, Work::Replay) / rate(Route::Direct, false, Work::Replay),
        rate(Route::Direct, false, Work::Create) / rate(Route::Direct, false, Work::Bare),
        rate(Route::Direct, true, Work::Create) / rate(Route::Direct, false, Work::Bare),
        rate(Route::Pooler, true, Work::Create) / rate(Route::Pooler, true, Work::Bare),
        rate(Route::Pooler, true, Work::Replay) / rate(Route::Pooler, true, Work::Create),
        rate(Route::Pooler, true, Work::Create) / rate(Route::Direct, true, Work::Create),
        rate(Route::Pooler, true, Work::Bare) / rate(Route::Direct, false, Work::Bare),
    );
    drop(bouncer);
}

struct Target {
    variant: Variant,
    service: Service,
    /// One connection per worker, for the bare transactions.
    clients: Vec<tokio_postgres::Client>,
    next: AtomicUsize,
}

impl Target {
    /// Runs `CONCURRENCY` workers for `duration`; the rate of successful
    /// answers and the number of failed ones.
    async fn load(self: Arc<Self>, duration: Duration, warm: bool) -> (f64, usize) {
        let deadline = Instant::now() + duration;
        let workers: Vec<_> = (0..CONCURRENCY)
            .map(|worker| {
                let target = self.clone();
                let service = self.service.clone();
                tokio::spawn(async move {
                    let (mut ok, mut failed) = (0usize, 0usize);
                    while Instant::now() < deadline {
                        if target.one(&service, worker, warm).await {
                            ok += 1;
                        } else {
                            failed += 1;
                        }
                    }
                    (ok, failed)
                })
            })
            .collect();
        let (mut ok, mut failed) = (0, 0);
        for worker in workers {
            let (o, f) = worker.await.expect("worker");
            ok += o;
            failed += f;
        }
        (ok as f64 / duration.as_secs_f64(), failed)
    }

    async fn one(&self, service: &Service, worker: usize, warm: bool) -> bool {
        match self.variant.work {
            Work::Bare => self.bare(&self.clients[worker]).await,
            Work::Create => {
                self.post(service, self.next.fetch_add(1, Ordering::Relaxed))
                    .await
            }
            Work::Replay if warm => {
                self.post(service, self.next.fetch_add(1, Ordering::Relaxed))
                    .await
            }
            Work::Replay => {
                let created = self.next.load(Ordering::Relaxed).max(1);
                let n = fastrand(created);
                self.post(service, n).await
            }
        }
    }

    /// The same insert in a transaction of its own, without the layer: one
    /// typed statement between `BEGIN` and `COMMIT`, pipelined.
    async fn bare(&self, client: &tokio_postgres::Client) -> bool {
        let done = tokio::try_join!(
            client.batch_execute("BEGIN"),
            client.execute_typed(INSERT, &[(&"bench", Type::TEXT), (&2400_i64, Type::INT8)]),
            client.batch_execute("COMMIT"),
        );
        done.is_ok()
    }

    async fn post(&self, service: &Service, n: usize) -> bool {
        let v = self.variant;
        let key = format!("{:?}-{:?}-{:?}-{n}", v.route, v.unnamed, v.work);
        let request = Request::post("/orders")
            .header("content-type", "application/json")
            .header("idempotency-key", key)
            .body(Full::new(Bytes::from_static(b"{\"total\":2400}")))
            .expect("request");
        match service.clone().oneshot(request).await {
            Ok(response) => {
                let ok = response.status() == StatusCode::CREATED;
                let _ = response.into_body().collect().await;
                ok
            }
            Err(_) => false,
        }
    }
}

/// A number in [0, n) from the clock: enough to spread replays over keys.
fn fastrand(n: usize) -> usize {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0) as usize;
    nanos.wrapping_mul(2_654_435_761) % n
}
