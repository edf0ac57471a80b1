//! The example order server: `POST /orders` with every guarantee of
//! tower-idempotency, and `POST /orders/{id}/fulfilment`, a long-running
//! operation (leases, fencing tokens, takeover and recovery), run as a real
//! server. Its HTTP contract is in the README ("The example order server").
//!
//!     cargo run --release --example order_server
//!
//! With `DATABASE_URL` unset it starts a private, temporary PostgreSQL from
//! the local installation and removes it on exit. `DATABASE_URL` may name
//! PostgreSQL or a pooler in transaction pooling mode (PgBouncer), with
//! libpq's TLS parameters (`sslmode=verify-full&sslrootcert=ca.pem`): the
//! store is built for the pooler whenever the URL is given unless
//! `DATABASE_POOL_MODE=direct` (see the `deploying` guide), and the
//! server's own statements outside a transaction are typed, one round trip
//! each. `IDEMPOTENCY_MODE=one-commit` runs `POST /orders` in the
//! one-commit mode (the key's record inserted with the `COMMIT`) instead of
//! the default `claim-first`; the answers are the same.

mod auth;
mod config;
mod downstream;
mod fulfilment;
mod orders;
mod schema;
mod warehouse;

use std::{future::Future, pin::Pin, sync::Arc, time::Duration};

use axum::{
    extract::State,
    middleware,
    response::{IntoResponse, Response},
    routing::{get, post},
    Router,
};
use http::StatusCode;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::sync::watch;
use tower_idempotency::{
    lease::LeaseConfig,
    metrics::OUTBOX_RELAY_RESTARTS_TOTAL,
    outbox::Relay,
    postgres::{PgStore, PgStoreBuilder},
    problem::Problem,
    retention::Cleanup,
    testing::TempPostgres,
    IdempotencyLayer,
};
use tracing_subscriber::EnvFilter;

/// The buckets of every `…_seconds` histogram, in seconds: 1 ms to 30 s,
/// about three per decade (a claim takes milliseconds; a duplicate waits
/// up to `IDEMPOTENCY_WAIT`, 10 s by default; a key is held for the
/// handler's time, up to its 30 s timeout).
const LATENCY_BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// A problem answer as an axum response.
pub(crate) fn problem(problem: Problem) -> Response {
    problem
        .to_response()
        .map(axum::body::Body::from)
        .into_response()
}

pub(crate) fn unavailable() -> Response {
    problem(
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "store_unavailable",
            "The database is unavailable; nothing was changed",
        )
        .with_retry_after(1),
    )
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colours only on a terminal: not under a supervisor, nor in a file.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if let Err(e) = run().await {
        tracing::error!("{e}");
        eprintln!("order_server: {e}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), String> {
    let settings = config::Settings::from_env()?;
    // Histograms, not the exporter's default summaries: buckets add up
    // across a fleet (`histogram_quantile` over `sum by (le)`), a summary's
    // quantiles do not (the dashboard's p99 would be the worst pod's).
    let metrics = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &LATENCY_BUCKETS)
        .map_err(|e| format!("cannot set the histogram buckets: {e}"))?
        .install_recorder()
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
    // `# HELP` lines and units for every metric, including those of the
    // relay and cleanup, which build no layer (the layers describe them too).
    tower_idempotency::metrics::describe();

    // Kept alive until the server stops; dropping it stops and removes the cluster.
    let mut _private_cluster = None;
    let store = match &settings.database_url {
        // libpq's TLS parameters in the URL (sslmode, sslrootcert, sslcert,
        // sslkey) have libpq's meaning; a certificate that does not verify
        // stops the start-up below, at the first connection.
        Some(url) => PgStoreBuilder::from_conninfo(url)
            .map_err(|e| format!("DATABASE_URL is not valid: {e}"))?,
        None => {
            tracing::info!("DATABASE_URL is unset: starting a private temporary PostgreSQL cluster");
            let cluster = tokio::task::spawn_blocking(TempPostgres::start)
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())?;
            tracing::info!(data_dir = %cluster.data_dir().display(), "private PostgreSQL is ready; it is removed on exit");
            let config = cluster.config();
            _private_cluster = Some(cluster);
            PgStore::builder(config)
        }
    }
    // A pooler in transaction pooling mode (PgBouncer) is invisible in the
    // URL, so with DATABASE_URL the store sends nothing that needs the
    // session to outlive a transaction unless DATABASE_POOL_MODE=direct
    // says PostgreSQL is reached directly (statements cached per
    // connection: measured 1.6 times the create throughput and 2.5 times
    // the replay).
    .transaction_pooling(settings.transaction_pooling)
    .max_connections(32)
    .build()
    .map_err(|e| format!("DATABASE_URL is not usable: {e}"))?;
    schema::migrate(&store).await?;

    let tokens: auth::Tokens = Arc::new(settings.tokens.clone());
    let idempotency =
        IdempotencyLayer::new(store.clone(), "POST /orders v1", orders::fingerprinter())
            .retention(settings.retention)
            .handler_timeout(settings.handler_timeout)
            .wait(settings.wait)
            // The contract lets operators (and tests) change
            // idempotency_requests rows directly; a replay cache would keep
            // answering from memory for up to its TTL.
            .without_replay_cache();
    // IDEMPOTENCY_MODE: the same answers either way. In the one-commit mode
    // the key's record goes in with the COMMIT (no claim round trip); sound
    // here because every effect of orders::create is a row of its
    // transaction (the order and its outbox event). Without a replay cache,
    // a retry runs the handler again there, loses at commit, rolls back and
    // answers the record (idempotency_commits_lost_total counts it). The
    // fulfilment below stays long-running: it calls a slow warehouse.
    let (create_order, orders_drained): (_, Pin<Box<dyn Future<Output = ()> + Send>>) =
        match settings.mode {
            config::Mode::ClaimFirst => (
                post(orders::create).layer(idempotency.clone()),
                Box::pin(idempotency.drained()),
            ),
            config::Mode::OneCommit => {
                let idempotency = idempotency.claim_at_commit();
                (
                    post(orders::create).layer(idempotency.clone()),
                    Box::pin(idempotency.drained()),
                )
            }
        };
    let warehouse = warehouse::WarehouseClient::new(store.clone(), settings.fulfilment_delay);
    let fulfilment = IdempotencyLayer::new(
        store.clone(),
        fulfilment::ENDPOINT,
        fulfilment::fingerprinter(),
    )
    .retention(settings.retention)
    .wait(settings.wait)
    // The whole work includes the warehouse's delay: a slow warehouse must
    // not turn every fulfilment into a handler timeout.
    .handler_timeout(
        settings
            .fulfilment_delay
            .saturating_add(Duration::from_secs(30)),
    )
    .long_running(
        LeaseConfig::new(settings.lease)
            .respond_within(Duration::from_secs(1))
            .max_attempts(settings.max_attempts),
    );
    // Everything but /healthz and /metrics needs a token, unknown routes included.
    let protected = Router::new()
        .route("/orders", create_order)
        .route("/orders/{id}", get(orders::get))
        .route(
            "/orders/{id}/fulfilment",
            fulfilment::routes(warehouse.clone()).layer(fulfilment.clone()),
        )
        .route_service("/operations/{id}", fulfilment.status_service())
        .fallback(|| async {
            problem(Problem::new(
                StatusCode::NOT_FOUND,
                "not_found",
                "No such route",
            ))
        })
        .layer(middleware::from_fn_with_state(tokens, auth::authenticate));
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(render_metrics).with_state(metrics))
        .merge(protected)
        .with_state(store.clone());

    let listener = tokio::net::TcpListener::bind(settings.addr)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", settings.addr))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;

    // One signal stops both the HTTP server and the outbox relay.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        let _ = stop.send(true);
    });
    // Behind a transaction pooler the relay cannot LISTEN for new events;
    // it polls, then, four times a second.
    let poll = if store.uses_transaction_pooling() {
        Duration::from_millis(250)
    } else {
        Duration::from_secs(1)
    };
    let relay = Arc::new(
        Relay::new(
            store.clone(),
            downstream::Providers::new(store.clone(), settings.payment_provider.clone()),
        )
        .poll_interval(poll),
    );
    let relay = tokio::spawn(supervise_relay(relay, stopped.clone()));

    // Fulfilments whose owner died or stalled with nobody retrying are
    // re-driven here. The handler runs without the idempotency layer (the
    // worker owns the lease) but under the same path, so it extracts the
    // same order id as for a client.
    let recovery = fulfilment
        .recovery(Router::new().route("/orders/{id}/fulfilment", fulfilment::routes(warehouse)));
    let recovery = tokio::spawn(recovery.run(until_stopped(stopped.clone())));

    // Expired keys go in small batches; the gauges an operator watches
    // (cleanup backlog, oldest in-progress age) refresh on the same beat.
    let cleanup = Cleanup::new(store.clone()).interval(Duration::from_secs(15));
    let cleanup = tokio::spawn({
        let stopped = stopped.clone();
        async move { cleanup.run(until_stopped(stopped)).await }
    });

    println!("listening on http://{addr}");
    tracing::info!(%addr, mode = settings.mode.name(), retention = ?settings.retention, handler_timeout = ?settings.handler_timeout, wait = ?settings.wait, lease = ?settings.lease, fulfilment_delay = ?settings.fulfilment_delay, "order server started; outbox relay and fulfilment recovery running");
    axum::serve(listener, app)
        .with_graceful_shutdown(until_stopped(stopped))
        .await
        .map_err(|e| format!("server error: {e}"))?;
    if recovery.await.is_err() {
        tracing::error!("fulfilment recovery worker failed");
    }
    // Requests whose clients left, and fulfilments (whose work always runs
    // on a task of its own), run on; let them commit before the database goes.
    let drained = async {
        tokio::join!(orders_drained, fulfilment.drained());
    };
    if tokio::time::timeout(
        settings
            .fulfilment_delay
            .saturating_add(Duration::from_secs(30)),
        drained,
    )
    .await
    .is_err()
    {
        tracing::warn!("requests still running past the shutdown grace period; exiting anyway");
    }
    if let Err(e) = cleanup.await {
        tracing::error!(error = %e, "cleanup task failed");
    }
    if relay.await.is_err() {
        tracing::error!("outbox relay supervisor failed");
    }
    tracing::info!("shut down; in-flight requests, fulfilments and the relay's batch finished");
    Ok(())
}

async fn until_stopped(mut stopped: watch::Receiver<bool>) {
    let _ = stopped.wait_for(|stop| *stop).await;
}

/// Keeps the outbox relay running until shutdown. Undelivered events pile up
/// silently behind a dead relay, so a relay task that ends early (an error, a
/// panic) is logged, counted and started again after a capped exponential
/// backoff.
async fn supervise_relay(relay: Arc<Relay<downstream::Providers>>, stopped: watch::Receiver<bool>) {
    const FIRST_DELAY: Duration = Duration::from_millis(100);
    const MAX_DELAY: Duration = Duration::from_secs(30);
    // At zero from the start, so an alert on its increase works before the first restart.
    metrics::counter!(OUTBOX_RELAY_RESTARTS_TOTAL).increment(0);
    let mut delay = FIRST_DELAY;
    loop {
        let started = tokio::time::Instant::now();
        let task = tokio::spawn({
            let (relay, stopped) = (relay.clone(), stopped.clone());
            async move { relay.run(until_stopped(stopped)).await }
        });
        match task.await {
            Ok(Ok(())) if *stopped.borrow() => return,
            Ok(Ok(())) => tracing::error!("outbox relay stopped before shutdown"),
            Ok(Err(e)) => tracing::error!(error = %e, "outbox relay stopped with an error"),
            // A panic's message may quote an event's payload: not logged.
            Err(e) if e.is_panic() => tracing::error!("outbox relay task panicked"),
            Err(e) => tracing::error!(error = %e, "outbox relay task failed"),
        }
        if *stopped.borrow() {
            return;
        }
        // A relay that ran for a good while hit a new fault, not the same
        // one in a loop: start again from the short delay.
        if started.elapsed() >= MAX_DELAY {
            delay = FIRST_DELAY;
        }
        tracing::warn!(
            restart_in_ms = delay.as_millis() as u64,
            "restarting the outbox relay"
        );
        tokio::select! {
            _ = until_stopped(stopped.clone()) => return,
            _ = tokio::time::sleep(delay) => {}
        }
        metrics::counter!(OUTBOX_RELAY_RESTARTS_TOTAL).increment(1);
        delay = (delay * 2).min(MAX_DELAY);
    }
}

async fn healthz(State(store): State<PgStore>) -> StatusCode {
    let check = async {
        let client = store.client().await.ok()?;
        client.simple_query("SELECT 1").await.ok()
    };
    match tokio::time::timeout(Duration::from_secs(2), check).await {
        Ok(Some(_)) => StatusCode::OK,
        _ => StatusCode::SERVICE_UNAVAILABLE,
    }
}

async fn render_metrics(State(handle): State<PrometheusHandle>) -> impl IntoResponse {
    (
        [(http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        handle.render(),
    )
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (mut interrupt, mut terminate) = match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(i), Ok(t)) => (i, t),
        _ => return std::future::pending().await,
    };
    tokio::select! {
        _ = interrupt.recv() => tracing::info!("SIGINT: shutting down gracefully"),
        _ = terminate.recv() => tracing::info!("SIGTERM: shutting down gracefully"),
    }
}
