//! Metrics and logs, read through a test recorder and a capturing
//! subscriber installed for this test binary.

mod common;

use std::{
    collections::HashMap,
    io::Write,
    sync::{Arc, Mutex, OnceLock},
    time::Duration,
};

use bytes::Bytes;
use common::*;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tokio::sync::Notify;
use tower::Layer;
use tower_idempotency::{
    fingerprint::JsonFingerprinter,
    key::IdempotencyKey,
    memory::{MemoryStore, MemoryTx},
    outbox::{DeliveryError, OutboxEvent, Relay, Sink},
    retention::Cleanup,
    store::Store,
    IdempotencyLayer, RequestBody,
};

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

struct Installed {
    snapshotter: Snapshotter,
    logs: Captured,
    spans: Spans,
}

fn installed() -> &'static Installed {
    static INSTALLED: OnceLock<Installed> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        use tracing_subscriber::{
            filter::LevelFilter, layer::SubscriberExt, util::SubscriberInitExt,
        };
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder
            .install()
            .expect("the only recorder of this binary");
        let logs = Captured::default();
        let writer = logs.clone();
        let spans = Spans::default();
        tracing_subscriber::registry()
            .with(LevelFilter::TRACE)
            .with(
                tracing_subscriber::fmt::layer()
                    .with_ansi(false)
                    .with_writer(move || writer.clone()),
            )
            .with(spans.clone())
            .init();
        Installed {
            snapshotter,
            logs,
            spans,
        }
    })
}

/// Held by a test while the process-wide gauges it refreshes must keep
/// its values until it has read them: `Cleanup::refresh_gauges` of any
/// test sets the same unlabelled gauges.
fn gauges_lock() -> &'static tokio::sync::Mutex<()> {
    static GAUGES: OnceLock<tokio::sync::Mutex<()>> = OnceLock::new();
    GAUGES.get_or_init(Default::default)
}

/// The gauges `Cleanup` refreshes, from `store`'s database, in turn with
/// the other tests that refresh them.
async fn refresh_gauges(
    store: &tower_idempotency::postgres::PgStore,
) -> tower_idempotency::retention::RetentionStatus {
    let _gauges = gauges_lock().lock().await;
    Cleanup::new(store.clone()).refresh_gauges().await.unwrap()
}

/// A span as a subscriber saw it: its name, every field recorded on it
/// (at creation or later), and its parent's fields.
#[derive(Clone, Debug, Default)]
struct SpanSeen {
    name: &'static str,
    fields: HashMap<String, String>,
    parent: Option<HashMap<String, String>>,
}

/// A layer of the subscriber that keeps every closed span, as an
/// OpenTelemetry exporter receives them.
#[derive(Clone, Default)]
struct Spans(Arc<Mutex<Vec<SpanSeen>>>);

struct FieldsOf<'a>(&'a mut HashMap<String, String>);

impl tracing::field::Visit for FieldsOf<'_> {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
}

impl<S> tracing_subscriber::Layer<S> for Spans
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let span = ctx.span(id).expect("a new span");
        let mut seen = SpanSeen {
            name: attrs.metadata().name(),
            ..SpanSeen::default()
        };
        attrs.record(&mut FieldsOf(&mut seen.fields));
        seen.parent = span.parent().and_then(|parent| {
            parent
                .extensions()
                .get::<SpanSeen>()
                .map(|p| p.fields.clone())
        });
        span.extensions_mut().insert(seen);
    }

    fn on_record(
        &self,
        id: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let span = ctx.span(id).expect("a recorded span");
        let mut extensions = span.extensions_mut();
        if let Some(seen) = extensions.get_mut::<SpanSeen>() {
            values.record(&mut FieldsOf(&mut seen.fields));
        }
    }

    fn on_close(&self, id: tracing::span::Id, ctx: tracing_subscriber::layer::Context<'_, S>) {
        let span = ctx.span(&id).expect("a closed span");
        let seen = span.extensions_mut().remove::<SpanSeen>();
        if let Some(seen) = seen {
            self.0.lock().unwrap().push(seen);
        }
    }
}

impl Spans {
    /// The closed spans named `name` whose field `field` is `value`.
    fn named(&self, name: &str, field: &str, value: &str) -> Vec<SpanSeen> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.name == name && s.fields.get(field).map(String::as_str) == Some(value))
            .cloned()
            .collect()
    }
}

type Values = HashMap<(String, Vec<(String, String)>), DebugValue>;

/// Everything recorded so far, by (name, sorted labels). Reading the
/// recorder drains it (counters restart at 0, samples are taken), and the
/// tests of this binary run in parallel: every reading is folded into one
/// running total that each test then reads from.
fn snapshot(snapshotter: &Snapshotter) -> Values {
    static TOTAL: OnceLock<Mutex<Values>> = OnceLock::new();
    let mut total = TOTAL.get_or_init(Default::default).lock().unwrap();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        let mut labels: Vec<_> = key
            .labels()
            .map(|l| (l.key().to_owned(), l.value().to_owned()))
            .collect();
        labels.sort();
        let entry = (key.name().to_owned(), labels);
        match (total.get_mut(&entry), value) {
            (Some(DebugValue::Counter(n)), DebugValue::Counter(more)) => *n += more,
            (Some(DebugValue::Histogram(samples)), DebugValue::Histogram(more)) => {
                samples.extend(more)
            }
            // A gauge reads 0 once drained: keep the last value it was set to.
            (Some(_), DebugValue::Gauge(g)) if g.into_inner() == 0.0 => {}
            (_, value) => {
                total.insert(entry, value);
            }
        }
    }
    total
        .iter()
        .map(|(key, value)| {
            let value = match value {
                DebugValue::Counter(n) => DebugValue::Counter(*n),
                DebugValue::Gauge(g) => DebugValue::Gauge(*g),
                DebugValue::Histogram(samples) => DebugValue::Histogram(samples.clone()),
            };
            (key.clone(), value)
        })
        .collect()
}

fn labels(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut labels: Vec<_> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    labels.sort();
    labels
}

/// What `values` hold for the metric `name` with the labels `pairs`.
fn metric<'a>(values: &'a Values, name: &str, pairs: &[(&str, &str)]) -> Option<&'a DebugValue> {
    values.get(&(name.to_owned(), labels(pairs)))
}

/// What `values` hold for the one-commit mode's lost commits of `endpoint`.
fn commits_lost<'a>(values: &'a Values, endpoint: &str) -> Option<&'a DebugValue> {
    metric(
        values,
        "idempotency_commits_lost_total",
        &[("endpoint", endpoint)],
    )
}

/// What `values` hold for the requests of `endpoint` that ended as `outcome`.
fn outcome<'a>(values: &'a Values, endpoint: &str, outcome: &str) -> Option<&'a DebugValue> {
    let pairs = [("endpoint", endpoint), ("outcome", outcome)];
    metric(values, "idempotency_requests_total", &pairs)
}

/// A handler that answers `status` with `{}`.
fn status_handler(status: StatusCode) -> Handler {
    tower::util::BoxCloneService::new(tower::service_fn(
        move |_: Request<RequestBody>| async move { Ok::<_, BoxError>(response(status, "{}")) },
    ))
}

/// The layer of these tests for `endpoint` over `store`.
fn v1_layer<St: Store>(store: St, endpoint: &str) -> IdempotencyLayer<St, JsonFingerprinter> {
    IdempotencyLayer::new(store, endpoint, JsonFingerprinter::new("v1"))
}

/// A handler that holds its transaction, tells the test it started, and waits for `release`.
fn held(started: Arc<Notify>, release: Arc<Notify>) -> Handler {
    tower::util::BoxCloneService::new(tower::service_fn(move |request: Request<RequestBody>| {
        let (started, release) = (started.clone(), release.clone());
        async move {
            let _tx = request.extensions().get::<MemoryTx>().cloned();
            started.notify_one();
            release.notified().await;
            Ok::<_, BoxError>(Response::new(Full::new(Bytes::new())))
        }
    }))
}

struct Recording;
impl Sink for Recording {
    async fn deliver(&self, _: &OutboxEvent) -> Result<(), DeliveryError> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_every_outcome() {
    let installed = installed();
    const ENDPOINT: &str = "POST /metrics-test v1";
    let store = MemoryStore::new();
    let make = |status| v1_layer(store.clone(), ENDPOINT).layer(status_handler(status));
    let ok = make(StatusCode::CREATED);
    send(ok.clone(), post(Some("t"), Some("k-new"), "{}")).await;
    send(ok.clone(), post(Some("t"), Some("k-new"), "{}")).await;
    send(ok.clone(), post(Some("t"), Some("k-new"), "{\"other\":1}")).await;
    send(ok.clone(), post(Some("t"), None, "{}")).await;
    send(
        make(StatusCode::BAD_GATEWAY),
        post(Some("t"), Some("k-fail"), "{}"),
    )
    .await;
    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let gated = v1_layer(store.clone(), ENDPOINT)
        .wait(Duration::from_millis(100))
        .layer(held(started.clone(), release.clone()));
    let first = spawn_send(gated.clone(), post(Some("t"), Some("k-slow"), "{}"));
    started.notified().await;
    let waited = send(gated, post(Some("t"), Some("k-slow"), "{}")).await;
    assert_eq!(waited.status, StatusCode::CONFLICT);
    release.notify_one();
    first.await.unwrap();
    let down = v1_layer(unreachable_store(Duration::from_millis(100)), ENDPOINT)
        .layer(status_handler(StatusCode::CREATED));
    send(down, post(Some("t"), Some("k-down"), "{}")).await;

    // Retention and outbox gauges, from a real database.
    let pg = Postgres::new().await;
    pg.exec(
        "INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at) \
         SELECT 't', 'e', 'expired-' || i, '\\x00', 'completed', now() - interval '1 hour' FROM generate_series(1, 7) i;
         INSERT INTO outbox_events (tenant_id, aggregate_id, event_type) VALUES ('t', 'a1', 'MetricsTest');",
    )
    .await;
    // The gauges keep this test's values until the snapshot below.
    let gauges = gauges_lock().lock().await;
    let cleanup = Cleanup::new(pg.store.clone()).batch_size(3);
    assert_eq!(cleanup.refresh_gauges().await.unwrap().cleanup_backlog, 7);
    assert_eq!(cleanup.run_once().await.unwrap(), 7);
    assert_eq!(
        Relay::new(pg.store.clone(), Recording)
            .run_once()
            .await
            .unwrap()
            .delivered,
        1
    );

    let values = snapshot(&installed.snapshotter);
    drop(gauges);
    let counter = |name: &str, pairs: &[(&str, &str)]| match metric(&values, name, pairs) {
        Some(DebugValue::Counter(n)) => *n,
        other => panic!("{name} {pairs:?}: {other:?}"),
    };
    let samples = |name: &str, pairs: &[(&str, &str)]| match metric(&values, name, pairs) {
        Some(DebugValue::Histogram(samples)) => samples.iter().map(|s| s.0).collect::<Vec<f64>>(),
        other => panic!("{name} {pairs:?}: {other:?}"),
    };
    for (outcome, expected) in [
        ("new", 2),
        ("replayed", 1),
        ("key_reused", 1),
        ("rejected", 1),
        ("rolled_back", 1),
        ("in_progress", 1),
        ("store_unavailable", 1),
    ] {
        let got = counter(
            "idempotency_requests_total",
            &[("endpoint", ENDPOINT), ("outcome", outcome)],
        );
        assert_eq!(got, expected, "outcome {outcome}");
    }
    let waits = samples(
        "idempotency_duplicate_wait_seconds",
        &[("endpoint", ENDPOINT)],
    );
    assert_eq!(waits.len(), 1);
    assert!(
        waits[0] >= 0.1,
        "the duplicate waited its 100 ms: {waits:?}"
    );
    assert_eq!(
        samples("idempotency_key_held_seconds", &[("endpoint", ENDPOINT)]).len(),
        3
    );
    assert!(!samples(
        "idempotency_claim_duration_seconds",
        &[("endpoint", ENDPOINT), ("outcome", "replayed")]
    )
    .is_empty());
    assert_eq!(counter("idempotency_expired_removed_total", &[]), 7);
    assert_eq!(
        metric(&values, "idempotency_cleanup_backlog", &[]),
        Some(&DebugValue::Gauge(7.0.into())),
        "the backlog gauge as refreshed before the cleanup"
    );
    assert_eq!(
        counter(
            "idempotency_outbox_delivered_total",
            &[("event_type", "MetricsTest")]
        ),
        1
    );
    assert!(
        values
            .keys()
            .all(|(_, labels)| labels.iter().all(|(k, _)| k != "tenant" && k != "key")),
        "no tenant or key label unless opted in"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_carry_no_body_and_no_raw_key() {
    let installed = installed();
    const KEY: &str = "raw-key-SECRET-9f8e";
    const BODY: &str = r#"{"card_number":"4242-SECRET-BODY","amount":1}"#;
    let store = MemoryStore::new();
    let layer = v1_layer(store, "POST /logs-test v1");
    let ok = layer.clone().layer(status_handler(StatusCode::CREATED));
    send(ok.clone(), post(Some("t"), Some(KEY), BODY)).await;
    send(ok.clone(), post(Some("t"), Some(KEY), BODY)).await;
    send(
        ok.clone(),
        post(
            Some("t"),
            Some(KEY),
            r#"{"card_number":"4242-SECRET-BODY","amount":2}"#,
        ),
    )
    .await;
    send(
        ok.clone(),
        post(
            Some("t"),
            Some("other-SECRET-key"),
            r#"{"card_number":"4242-SECRET-BODY""#,
        ),
    )
    .await;
    send(
        layer.layer(status_handler(StatusCode::INTERNAL_SERVER_ERROR)),
        post(Some("t"), Some("k2-SECRET"), BODY),
    )
    .await;
    let logs = String::from_utf8(installed.logs.0.lock().unwrap().clone()).unwrap();
    let hash = IdempotencyKey::parse(KEY.as_bytes()).unwrap().short_hash();
    assert!(
        logs.contains("POST /logs-test v1"),
        "the flow was logged:\n{logs}"
    );
    assert!(logs.contains(&hash), "keys appear hashed");
    for decision in [
        "committed",
        "replaying",
        "reused",
        "refused before claiming",
        "rolled back",
    ] {
        assert!(logs.contains(decision), "no '{decision}' event in:\n{logs}");
    }
    assert!(
        !logs.contains("SECRET"),
        "a raw key or a body leaked into the logs:\n{logs}"
    );
}

/// A server error marks the request's span as OpenTelemetry reads one:
/// `otel.status_code = "ERROR"` and `error.type` (the answer's status for
/// a handler's 5xx, the layer's stable code for its own failures); a
/// success and a refusal of the request (a 4xx) carry neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_error_marks_the_span_as_opentelemetry_reads_it() {
    let installed = installed();
    const ENDPOINT: &str = "POST /otel-test v1";
    let layer = v1_layer(MemoryStore::new(), ENDPOINT);
    let ok = layer.clone().layer(status_handler(StatusCode::CREATED));
    assert_eq!(
        send(ok.clone(), post(Some("t"), Some("otel-ok"), BODY))
            .await
            .status,
        StatusCode::CREATED
    );
    let reused = send(ok, post(Some("t"), Some("otel-ok"), r#"{"other":1}"#)).await;
    assert_eq!(reused.status, StatusCode::CONFLICT);
    let failed = send(
        layer.clone().layer(status_handler(StatusCode::BAD_GATEWAY)),
        post(Some("t"), Some("otel-502"), BODY),
    )
    .await;
    assert_eq!(failed.status, StatusCode::BAD_GATEWAY);
    let timed_out = send(
        layer
            .handler_timeout(Duration::from_millis(50))
            .layer(held(Arc::new(Notify::new()), Arc::new(Notify::new()))),
        post(Some("t"), Some("otel-slow"), BODY),
    )
    .await;
    assert_eq!(timed_out.status, StatusCode::SERVICE_UNAVAILABLE);
    let logs = String::from_utf8(installed.logs.0.lock().unwrap().clone()).unwrap();
    let ours: Vec<&str> = logs.lines().filter(|l| l.contains(ENDPOINT)).collect();
    let line = |event: &str, outcome: &str| {
        ours.iter()
            .find(|l| l.contains(event) && l.contains(&format!("outcome=\"{outcome}\"")))
            .copied()
            .unwrap_or_else(|| {
                panic!(
                    "no '{event}' line with outcome {outcome}:\n{}",
                    ours.join("\n")
                )
            })
    };
    let committed = line("committed the response", "new");
    let refused = line("key reused", "key_reused");
    for quiet in [committed, refused] {
        assert!(
            !quiet.contains("otel.status_code") && !quiet.contains("error.type"),
            "{quiet}"
        );
    }
    let hash_502 = IdempotencyKey::parse(b"otel-502").unwrap().short_hash();
    let rolled_back = ours
        .iter()
        .find(|l| l.contains("rolled back") && l.contains(&hash_502))
        .unwrap_or_else(|| panic!("no rolled back line for the 502:\n{}", ours.join("\n")));
    assert!(
        rolled_back.contains(r#"otel.status_code="ERROR""#)
            && rolled_back.contains(r#"error.type="502""#),
        "{rolled_back}"
    );
    let timeout = ours
        .iter()
        .find(|l| l.contains("did not finish within its deadline"))
        .unwrap_or_else(|| panic!("no handler timeout line:\n{}", ours.join("\n")));
    assert!(
        timeout.contains(r#"otel.status_code="ERROR""#)
            && timeout.contains(r#"error.type="handler_timeout""#),
        "{timeout}"
    );
}

/// A request that waits behind a duplicate in this process, and then again
/// in the store, records one wait and one outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_waits_twice_is_counted_once() {
    let installed = installed();
    const ENDPOINT: &str = "POST /wait-twice v1";
    let store = MemoryStore::new();
    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    // Process A holds the key.
    let process_a = v1_layer(store.clone(), ENDPOINT).layer(held(started.clone(), release.clone()));
    let holder = spawn_send(process_a, post(Some("t"), Some("k"), "{}"));
    started.notified().await;
    // Process B: its first request leads and gives up after 100 ms; the
    // second follows it in memory, then leads and waits in the store.
    let process_b = v1_layer(store.clone(), ENDPOINT);
    let short = process_b
        .clone()
        .wait(Duration::from_millis(100))
        .layer(status_handler(StatusCode::CREATED));
    let long = process_b
        .wait(Duration::from_millis(400))
        .layer(status_handler(StatusCode::CREATED));
    let first = spawn_send(short, post(Some("t"), Some("k"), "{}"));
    tokio::task::yield_now().await;
    let second = send(long, post(Some("t"), Some("k"), "{}")).await;
    let first = first.await.unwrap();
    assert_eq!(first.json()["code"], "idempotency_in_progress");
    assert_eq!(second.json()["code"], "idempotency_in_progress");
    release.notify_one();
    holder.await.unwrap();

    let values = snapshot(&installed.snapshotter);
    let waits = match metric(
        &values,
        "idempotency_duplicate_wait_seconds",
        &[("endpoint", ENDPOINT)],
    ) {
        Some(DebugValue::Histogram(samples)) => samples.len(),
        other => panic!("{other:?}"),
    };
    assert_eq!(waits, 2, "one wait per waiting request");
    assert_eq!(
        outcome(&values, ENDPOINT, "in_progress"),
        Some(&DebugValue::Counter(2))
    );
}

/// The runtime that runs a request's owned work shuts down under it: the
/// request is answered 503 and counted like every other.
#[test]
fn a_request_cut_by_a_runtime_shutdown_is_counted() {
    let installed = installed();
    const ENDPOINT: &str = "POST /shutdown v1";
    let owner = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let driver = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let started = Arc::new(Notify::new());
    let service = v1_layer(MemoryStore::new(), ENDPOINT).layer(tower::service_fn({
        let started = started.clone();
        move |_: Request<RequestBody>| {
            let started = started.clone();
            async move {
                started.notify_one();
                std::future::pending::<()>().await;
                Ok::<_, BoxError>(Response::new(Full::new(Bytes::new())))
            }
        }
    }));
    let owner_handle = owner.handle().clone();
    let answer = driver.block_on(async move {
        let mut request = Box::pin(send(service, post(Some("t"), Some("k"), "{}")));
        // Polled here, but the work it spawns once it owns the key lands on `owner`.
        let request = std::future::poll_fn(move |cx| {
            let _entered = owner_handle.enter();
            std::future::Future::poll(request.as_mut(), cx)
        });
        let shutdown = async move {
            started.notified().await;
            owner.shutdown_background();
        };
        tokio::join!(request, shutdown).0
    });
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    let values = snapshot(&installed.snapshotter);
    assert_eq!(
        outcome(&values, ENDPOINT, "store_unavailable"),
        Some(&DebugValue::Counter(1))
    );
}

/// The long-running mode's metrics: operations running, takeovers by a
/// request and by the recovery worker, fenced writes, recoveries, and the
/// lease gauges' readings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_running_operations_are_observable() {
    use std::sync::atomic::{AtomicU64, Ordering};
    use tower_idempotency::{
        fingerprint::Fingerprint,
        lease::{LeaseConfig, OperationId},
        postgres::{PgLease, TxErrorKind},
        scope::{Scope, TenantId},
        store::{Acquired, ClaimRequest, LeaseRequest, LeaseStore, StoredRequest},
    };
    let installed = installed();
    const ENDPOINT: &str = "POST /lease-metrics v1";
    const LEASE: Duration = Duration::from_millis(300);
    let pg = Postgres::new().await;
    // Panics on its first call (the owner dies: no heartbeat, no answer),
    // holds on the second until released, answers at once after that.
    let calls = Arc::new(AtomicU64::new(0));
    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let handler = {
        let (calls, started, release) = (calls.clone(), started.clone(), release.clone());
        tower::util::BoxCloneService::new(tower::service_fn(
            move |request: Request<RequestBody>| {
                let (calls, started, release) = (calls.clone(), started.clone(), release.clone());
                async move {
                    let call = calls.fetch_add(1, Ordering::SeqCst);
                    assert!(request.extensions().get::<PgLease>().is_some());
                    match call {
                        0 => panic!("the owner dies"),
                        1 => {
                            started.notify_one();
                            release.notified().await;
                        }
                        _ => {}
                    }
                    Ok::<_, BoxError>(response(StatusCode::OK, "{}"))
                }
            },
        ))
    };
    let layer = v1_layer(pg.store.clone(), ENDPOINT).long_running(
        LeaseConfig::new(LEASE)
            .heartbeat(Duration::from_millis(50))
            .respond_within(Duration::from_millis(50))
            // Recovered as soon as the lease expired.
            .recovery_backoff(Duration::ZERO, Duration::ZERO),
    );
    let until_expired = |key: &'static str| {
        let client = &pg.client;
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            loop {
                let row = client
                    .query_one(
                        "SELECT COALESCE(bool_and(lease_expires_at <= now()), false) FROM idempotency_requests WHERE idempotency_key = $1",
                        &[&key],
                    )
                    .await
                    .unwrap();
                if row.get::<_, bool>(0) {
                    return;
                }
                assert!(tokio::time::Instant::now() < deadline);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };

    // A dead owner taken over by its client's retry, which then runs on.
    let died = send(
        layer.clone().layer(handler.clone()),
        post(Some("t"), Some("k1"), "{}"),
    )
    .await;
    assert_eq!(died.status, StatusCode::ACCEPTED);
    // The dead owner's handler has run (and died) before its lease is left
    // to expire: on a loaded machine its task may first run late, and would
    // then still count as running when the retry's work is counted below.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while calls.load(Ordering::SeqCst) == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the first owner never ran"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // ...and its attempt has ended (the panic caught, the lease given up):
    // it no longer counts as running.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let values = snapshot(&installed.snapshotter);
        let running = metric(
            &values,
            "idempotency_operations_running",
            &[("endpoint", ENDPOINT)],
        );
        if !matches!(running, Some(DebugValue::Gauge(g)) if g.into_inner() > 0.0) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the dead owner's attempt never ended"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    until_expired("k1").await;
    let retry = spawn_send(
        layer.clone().layer(handler.clone()),
        post(Some("t"), Some("k1"), "{}"),
    );
    started.notified().await;
    let running = snapshot(&installed.snapshotter);
    assert_eq!(
        metric(
            &running,
            "idempotency_operations_running",
            &[("endpoint", ENDPOINT)]
        ),
        Some(&DebugValue::Gauge(1.0.into()))
    );
    let gauges = refresh_gauges(&pg.store).await;
    // The operation is as old as its first attempt (whose panic gave the
    // lease up at once, so the retry resumed it without waiting a lease).
    assert!(
        gauges.oldest_lease > Duration::ZERO,
        "{:?}",
        gauges.oldest_lease
    );
    assert!(
        gauges.oldest_in_progress > Duration::ZERO,
        "committed in-progress rows count: {:?}",
        gauges.oldest_in_progress
    );
    assert_eq!(gauges.expired_leases, 0);
    release.notify_one();
    // 202 or, had the work ended within respond_within, its 200.
    assert!(retry.await.unwrap().status.is_success());
    layer.drained().await;

    // A dead owner nobody retries: seen as an expired lease, then recovered.
    let claim = ClaimRequest::new(
        Scope::new(TenantId::new("t"), ENDPOINT),
        IdempotencyKey::parse(b"k2").unwrap(),
        Fingerprint::from_bytes([2; 32]),
    );
    let stored = StoredRequest::new(http::Method::POST, "/x", vec![], Bytes::from_static(b"{}"));
    let acquired = pg
        .store
        .acquire(
            &claim,
            &LeaseRequest::new(LEASE, OperationId::random(), stored),
        )
        .await
        .unwrap();
    let Acquired::Owned(dead) = acquired else {
        panic!("owned: {acquired:?}")
    };
    until_expired("k2").await;
    let gauges = refresh_gauges(&pg.store).await;
    assert_eq!(gauges.expired_leases, 1);
    assert_eq!(layer.recovery(handler).run_once().await.unwrap(), 1);
    // The dead owner wakes up: its write is refused.
    let refused = dead.lease.transaction().await.expect_err("fenced");
    assert_eq!(refused.kind(), TxErrorKind::Fenced);

    let values = snapshot(&installed.snapshotter);
    let counter = |name: &str, pairs: &[(&str, &str)]| match metric(&values, name, pairs) {
        Some(DebugValue::Counter(n)) => *n,
        other => panic!("{name} {pairs:?}: {other:?}"),
    };
    let endpoint = ("endpoint", ENDPOINT);
    assert_eq!(
        counter(
            "idempotency_lease_takeovers_total",
            &[endpoint, ("by", "request")]
        ),
        1
    );
    assert_eq!(
        counter(
            "idempotency_lease_takeovers_total",
            &[endpoint, ("by", "recovery")]
        ),
        1
    );
    assert_eq!(counter("idempotency_recoveries_total", &[endpoint]), 1);
    assert_eq!(
        counter("idempotency_fenced_total", &[endpoint, ("at", "write")]),
        1
    );
    assert_eq!(
        counter("idempotency_fenced_total", &[endpoint, ("at", "heartbeat")]),
        0
    );
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_eq!(
        pg.count("SELECT count(*) FROM idempotency_requests WHERE state = 'completed'")
            .await,
        2
    );
}

#[tokio::test]
async fn a_long_running_handler_timeout_is_counted_once_and_attempts_and_failures_are_counted() {
    let installed = installed();
    let endpoint = "POST /observability/long-timeout v1";
    let layer = IdempotencyLayer::new(MemoryStore::new(), endpoint, JsonFingerprinter::new("v1"))
        .handler_timeout(Duration::from_millis(50))
        .long_running(
            tower_idempotency::lease::LeaseConfig::new(Duration::from_secs(5))
                // The request waits longer than the handler may run.
                .respond_within(Duration::from_secs(5))
                .max_attempts(2),
        );
    let slow = tower::util::BoxCloneService::new(tower::service_fn(
        |_: Request<RequestBody>| async move {
            tokio::time::sleep(Duration::from_secs(30)).await;
            Ok::<_, BoxError>(created("never"))
        },
    ));
    let first = send(layer.layer(slow.clone()), tenant_a_post("k1")).await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(first.json()["code"], "handler_timeout");
    let values = snapshot(&installed.snapshotter);
    let timeouts = metric(
        &values,
        "idempotency_handler_timeouts_total",
        &[("endpoint", endpoint)],
    );
    assert!(
        matches!(timeouts, Some(DebugValue::Counter(1))),
        "one timeout, counted once: {timeouts:?}"
    );
    // The second and last attempt times out too: the operation fails.
    let second = send(layer.layer(slow), tenant_a_post("k1")).await;
    assert_eq!(second.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(second.json()["code"], "operation_failed");
    let values = snapshot(&installed.snapshotter);
    let count = |name: &str, pairs: &[(&str, &str)]| match metric(&values, name, pairs) {
        Some(DebugValue::Counter(n)) => *n,
        other => panic!("{name}: {other:?}"),
    };
    assert_eq!(
        count(
            "idempotency_handler_timeouts_total",
            &[("endpoint", endpoint)]
        ),
        2
    );
    assert_eq!(
        count(
            "idempotency_operation_attempts_total",
            &[("endpoint", endpoint), ("by", "request")]
        ),
        2
    );
    assert_eq!(
        count(
            "idempotency_operations_failed_total",
            &[("endpoint", endpoint)]
        ),
        1
    );
}

#[tokio::test]
async fn a_lost_commit_is_counted_and_answered_as_a_replay() {
    let installed = installed();
    let endpoint = "POST /observability/at-commit v1";
    let store = MemoryStore::new();
    // Two instances on one store: the second one's retry runs the handler
    // and loses at commit.
    let first = v1_layer(store.clone(), endpoint).claim_at_commit();
    let second = v1_layer(store.clone(), endpoint).claim_at_commit();
    let values = snapshot(&installed.snapshotter);
    assert!(
        matches!(
            commits_lost(&values, endpoint),
            Some(DebugValue::Counter(0))
        ),
        "registered at zero"
    );
    let created = send(
        first.layer(status_handler(StatusCode::CREATED)),
        tenant_a_post("k1"),
    )
    .await;
    assert_eq!(created.status, StatusCode::CREATED);
    let retried = send(
        second.layer(status_handler(StatusCode::CREATED)),
        tenant_a_post("k1"),
    )
    .await;
    assert!(retried.replayed());
    let values = snapshot(&installed.snapshotter);
    assert!(
        matches!(
            commits_lost(&values, endpoint),
            Some(DebugValue::Counter(1))
        ),
        "{:?}",
        commits_lost(&values, endpoint)
    );
    assert!(
        matches!(
            outcome(&values, endpoint, "replayed"),
            Some(DebugValue::Counter(1))
        ),
        "the loser is answered as a replay"
    );
    assert_eq!(store.completed_records(), 1);
}

/// An operation that ends `failed` is counted as failed, never as
/// recovered; an acquisition past the last attempt (the last one took its
/// process down) runs nothing and counts no attempt, only the takeover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_operation_is_not_a_recovery_and_an_attempt_that_never_ran_is_not_counted() {
    use std::sync::atomic::{AtomicU64, Ordering};
    use tower_idempotency::{
        fingerprint::Fingerprint,
        lease::{LeaseConfig, OperationId},
        scope::{Scope, TenantId},
        store::{Acquired, ClaimRequest, LeaseRequest, LeaseStore, StoredRequest},
    };
    let installed = installed();
    let pg = Postgres::new().await;
    let calls = Arc::new(AtomicU64::new(0));
    let failing = {
        let calls = calls.clone();
        tower::util::BoxCloneService::new(tower::service_fn(move |_: Request<RequestBody>| {
            calls.fetch_add(1, Ordering::SeqCst);
            async move { Ok::<_, BoxError>(response(StatusCode::BAD_GATEWAY, "down")) }
        }))
    };
    let long = |endpoint: &str, max_attempts: u32| {
        IdempotencyLayer::new(pg.store.clone(), endpoint, JsonFingerprinter::new("v1"))
            .long_running(
                LeaseConfig::new(Duration::from_secs(5))
                    .respond_within(Duration::from_secs(5))
                    .max_attempts(max_attempts)
                    .recovery_backoff(Duration::from_millis(1), Duration::from_millis(1)),
            )
    };
    // Recovery until it re-drove one operation (the backoff, 1 ms, counts
    // from the end of the lease).
    let recover_one = |layer: &IdempotencyLayer<_, _, _, _>| {
        let recovery = layer.recovery(failing.clone());
        async move {
            for _ in 0..500 {
                if recovery.run_once().await.unwrap() == 1 {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            panic!("nothing was recovered");
        }
    };
    let state = |key: &'static str| {
        let client = &pg.client;
        async move {
            let row = client
                .query_one(
                    "SELECT state, attempts FROM idempotency_requests WHERE idempotency_key = $1",
                    &[&key],
                )
                .await
                .unwrap();
            (row.get::<_, String>(0), row.get::<_, i32>(1))
        }
    };

    // Attempt 1 by the request, attempt 2 (the last) by recovery: failed.
    const FAILING: &str = "POST /observability/failing v1";
    let layer = long(FAILING, 2);
    let first = send(layer.layer(failing.clone()), tenant_a_post("k1")).await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY);
    recover_one(&layer).await;
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(state("k1").await, ("failed".to_owned(), 2));

    // The last attempt crashed (acquired, never ended): recovery takes the
    // operation over and fails it without running it.
    const CRASHED: &str = "POST /observability/crashed v1";
    let claim = ClaimRequest::new(
        Scope::new(TenantId::new("t"), CRASHED),
        IdempotencyKey::parse(b"k2").unwrap(),
        Fingerprint::from_bytes([2; 32]),
    );
    let stored = StoredRequest::new(http::Method::POST, "/x", vec![], Bytes::from_static(b"{}"));
    let lease = LeaseRequest::new(Duration::from_secs(5), OperationId::random(), stored);
    let Ok(Acquired::Owned(_dead)) = pg.store.acquire(&claim, &lease).await else {
        panic!("the first owner owns the key")
    };
    pg.exec("UPDATE idempotency_requests SET lease_expires_at = now() - interval '1 second' WHERE idempotency_key = 'k2'")
        .await;
    let layer = long(CRASHED, 1);
    recover_one(&layer).await;
    assert_eq!(calls.load(Ordering::SeqCst), 2, "no attempt past the last");
    assert_eq!(state("k2").await, ("failed".to_owned(), 1));

    let values = snapshot(&installed.snapshotter);
    let counter = |name: &str, endpoint: &str, by: Option<&str>| {
        let mut pairs = vec![("endpoint", endpoint)];
        pairs.extend(by.map(|by| ("by", by)));
        match metric(&values, name, &pairs) {
            Some(DebugValue::Counter(n)) => *n,
            None => 0,
            other => panic!("{name} {pairs:?}: {other:?}"),
        }
    };
    let attempts = "idempotency_operation_attempts_total";
    let (failed, recovered) = (
        "idempotency_operations_failed_total",
        "idempotency_recoveries_total",
    );
    assert_eq!(counter(attempts, FAILING, Some("request")), 1);
    assert_eq!(counter(attempts, FAILING, Some("recovery")), 1);
    assert_eq!(counter(failed, FAILING, None), 1);
    assert_eq!(
        counter(recovered, FAILING, None),
        0,
        "a failure is no recovery"
    );
    assert_eq!(
        counter(attempts, CRASHED, Some("recovery")),
        0,
        "the takeover ran no attempt"
    );
    assert_eq!(
        counter(
            "idempotency_lease_takeovers_total",
            CRASHED,
            Some("recovery")
        ),
        1
    );
    assert_eq!(counter(failed, CRASHED, None), 1);
    assert_eq!(counter(recovered, CRASHED, None), 0);
}

/// A client that goes away while its handler runs: the work runs on and
/// commits, and the request is counted as every other (`new`), once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_client_went_away_is_counted() {
    let installed = installed();
    const ENDPOINT: &str = "POST /client-gone v1";
    let store = MemoryStore::new();
    let (started, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let layer = v1_layer(store.clone(), ENDPOINT);
    let service = layer.clone().layer(held(started.clone(), release.clone()));
    let client = spawn_send(service, post(Some("t"), Some("k"), "{}"));
    started.notified().await;
    client.abort();
    assert!(client.await.unwrap_err().is_cancelled());
    release.notify_one();
    layer.drained().await;
    let replay = send(
        layer.layer(status_handler(StatusCode::CREATED)),
        post(Some("t"), Some("k"), "{}"),
    )
    .await;
    assert!(replay.replayed(), "the work committed");
    let values = snapshot(&installed.snapshotter);
    assert_eq!(
        outcome(&values, ENDPOINT, "new"),
        Some(&DebugValue::Counter(1))
    );
    assert_eq!(
        outcome(&values, ENDPOINT, "replayed"),
        Some(&DebugValue::Counter(1))
    );
}

/// What a request's spans say, as a real subscriber records them: the
/// request's `idempotency` span with its namespaced fields, a span for
/// each store step on its path with OpenTelemetry's database attributes,
/// and on a replay the trace of the run that produced the answer, kept in
/// the key's record (from the cache and from the database alike), in both
/// modes of a short transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_name_the_request_its_store_steps_and_the_trace_a_replay_answers_from() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let installed = installed();
    let pg = Postgres::new().await;
    let database: String = pg
        .client
        .query_one("SELECT current_database()", &[])
        .await
        .unwrap()
        .get(0);
    const ENDPOINT: &str = "POST /trace-test v1";
    const FIRST: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    const RETRY: &str = "0af7651916cd43dd8448eb211c80319c";
    let traced = |key: &str, trace: Option<&str>| {
        let mut request = post(Some("t"), Some(key), BODY);
        if let Some(trace) = trace {
            request.headers_mut().insert(
                "traceparent",
                format!("00-{trace}-00f067aa0ba902b7-01").parse().unwrap(),
            );
        }
        request
    };
    let calls = Arc::new(AtomicU64::new(0));
    let claim_first = v1_layer(pg.store.clone(), ENDPOINT);
    let one_commit = v1_layer(pg.store.clone(), ENDPOINT).claim_at_commit();
    // Another process: no replay cache, the record read from the database.
    let other = v1_layer(pg.store.clone(), ENDPOINT)
        .without_replay_cache()
        .layer(order_handler::<Postgres>(calls.clone()));
    let services = [
        (
            "trace-claim-first",
            tower::util::BoxCloneService::new(
                claim_first.layer(order_handler::<Postgres>(calls.clone())),
            ),
        ),
        (
            "trace-one-commit",
            tower::util::BoxCloneService::new(
                one_commit.layer(order_handler::<Postgres>(calls.clone())),
            ),
        ),
    ];
    for (key, service) in services {
        let first = send(service.clone(), traced(key, Some(FIRST))).await;
        assert_eq!(first.status, StatusCode::CREATED, "{key}");
        let kept: Option<String> = pg
            .client
            .query_one(
                "SELECT trace_id FROM idempotency_requests WHERE idempotency_key = $1",
                &[&key],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(
            kept,
            Some(format!("{FIRST}-00f067aa0ba902b7")),
            "{key}: the record keeps the trace and the caller's span"
        );
        let cached = send(service.clone(), traced(key, Some(RETRY))).await;
        let stored = send(other.clone(), traced(key, Some(RETRY))).await;
        for replay in [&cached, &stored] {
            assert_eq!(replay.headers["idempotent-replayed"], "true", "{key}");
            assert_eq!(replay.body, first.body, "{key}");
        }

        let hash = IdempotencyKey::parse(key.as_bytes()).unwrap().short_hash();
        let requests = installed
            .spans
            .named("idempotency", "idempotency.key_hash", &hash);
        assert_eq!(requests.len(), 3, "{key}: {requests:#?}");
        let new: Vec<_> = requests
            .iter()
            .filter(|s| s.fields["idempotency.outcome"] == "new")
            .collect();
        assert_eq!(new.len(), 1, "{key}: {requests:#?}");
        assert_eq!(new[0].fields["idempotency.endpoint"], ENDPOINT);
        assert!(!new[0].fields.contains_key("idempotency.original_trace_id"));
        let replays: Vec<_> = requests
            .iter()
            .filter(|s| s.fields["idempotency.outcome"] == "replayed")
            .collect();
        assert_eq!(replays.len(), 2, "{key}: {requests:#?}");
        for replay in replays {
            assert_eq!(
                replay
                    .fields
                    .get("idempotency.original_trace_id")
                    .map(String::as_str),
                Some(FIRST),
                "{key}: {replay:#?}"
            );
        }

        // The store's steps, children of the request's span.
        let steps: Vec<SpanSeen> = installed
            .spans
            .named("idempotency_store", "db.system.name", "postgresql")
            .into_iter()
            .filter(|s| {
                s.parent
                    .as_ref()
                    .and_then(|p| p.get("idempotency.key_hash"))
                    .is_some_and(|h| *h == hash)
            })
            .collect();
        let summaries: Vec<&str> = steps
            .iter()
            .map(|s| s.fields["db.query.summary"].as_str())
            .collect();
        let expected: &[&str] = if key == "trace-claim-first" {
            // The first request's claim and completion, the other
            // process's claim that finds the record.
            &[
                "INSERT idempotency_requests",
                "UPDATE idempotency_requests",
                "INSERT idempotency_requests",
            ]
        } else {
            // The first request's commit, the other process's claim.
            &["INSERT idempotency_requests", "INSERT idempotency_requests"]
        };
        assert_eq!(summaries, expected, "{key}: {steps:#?}");
        for step in &steps {
            for (field, value) in [
                ("db.collection.name", "idempotency_requests"),
                ("db.namespace", database.as_str()),
                ("otel.kind", "client"),
            ] {
                assert_eq!(
                    step.fields.get(field).map(String::as_str),
                    Some(value),
                    "{step:#?}"
                );
            }
            assert_eq!(step.fields["otel.name"], step.fields["db.query.summary"]);
            assert!(!step.fields.contains_key("error.type"), "{step:#?}");
        }
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2, "one run a key");

    // A request that carries no trace: none kept, none named on its replay.
    let untraced =
        v1_layer(pg.store.clone(), ENDPOINT).layer(order_handler::<Postgres>(calls.clone()));
    send(untraced.clone(), traced("trace-none", None)).await;
    send(untraced, traced("trace-none", Some(RETRY))).await;
    let kept: Option<String> = pg
        .client
        .query_one(
            "SELECT trace_id FROM idempotency_requests WHERE idempotency_key = 'trace-none'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(kept, None);
    let hash = IdempotencyKey::parse(b"trace-none").unwrap().short_hash();
    let replays = installed
        .spans
        .named("idempotency", "idempotency.key_hash", &hash);
    assert_eq!(replays.len(), 2);
    assert!(replays
        .iter()
        .all(|s| !s.fields.contains_key("idempotency.original_trace_id")));
}

/// The same through `SqlxStore`: the record keeps the trace, a replay read
/// from the database names it, and the store's steps carry the database
/// attributes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_store_keeps_the_trace_and_spans_its_steps() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let installed = installed();
    let backend = Sqlx::new().await;
    const ENDPOINT: &str = "POST /trace-test-sqlx v1";
    const FIRST: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
    let calls = Arc::new(AtomicU64::new(0));
    let mut first = post(Some("t"), Some("trace-sqlx"), BODY);
    first.headers_mut().insert(
        "traceparent",
        format!("00-{FIRST}-00f067aa0ba902b7-01").parse().unwrap(),
    );
    let answer = send(
        v1_layer(backend.store.clone(), ENDPOINT).layer(order_handler::<Sqlx>(calls.clone())),
        first,
    )
    .await;
    assert_eq!(answer.status, StatusCode::CREATED);
    let kept: Option<String> = backend
        .client
        .query_one(
            "SELECT trace_id FROM idempotency_requests WHERE idempotency_key = 'trace-sqlx'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(kept, Some(format!("{FIRST}-00f067aa0ba902b7")));
    let replay = send(
        v1_layer(backend.store.clone(), ENDPOINT)
            .without_replay_cache()
            .layer(order_handler::<Sqlx>(calls.clone())),
        post(Some("t"), Some("trace-sqlx"), BODY),
    )
    .await;
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    let hash = IdempotencyKey::parse(b"trace-sqlx").unwrap().short_hash();
    let requests = installed
        .spans
        .named("idempotency", "idempotency.key_hash", &hash);
    let replayed: Vec<_> = requests
        .iter()
        .filter(|s| s.fields["idempotency.outcome"] == "replayed")
        .collect();
    assert_eq!(replayed.len(), 1, "{requests:#?}");
    assert_eq!(
        replayed[0]
            .fields
            .get("idempotency.original_trace_id")
            .map(String::as_str),
        Some(FIRST)
    );
    let steps: Vec<String> = installed
        .spans
        .named("idempotency_store", "db.namespace", backend.db.name())
        .into_iter()
        .filter(|s| {
            s.parent
                .as_ref()
                .and_then(|p| p.get("idempotency.key_hash"))
                .is_some_and(|h| *h == hash)
        })
        .map(|s| s.fields["db.query.summary"].clone())
        .collect();
    assert_eq!(
        steps,
        [
            "INSERT idempotency_requests",
            "UPDATE idempotency_requests",
            "INSERT idempotency_requests"
        ]
    );
}
