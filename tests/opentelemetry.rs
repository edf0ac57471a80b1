//! The `opentelemetry` feature through a real OpenTelemetry SDK: requests
//! traced by `tracing-opentelemetry` into an in-memory exporter. The key's
//! record keeps the span context of the request span that did the work, and
//! a replay's exported span links to that span, from the replay cache and
//! from the database.

mod common;

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc, OnceLock,
};

use common::*;
use http::StatusCode;
use opentelemetry::{trace::TracerProvider as _, KeyValue, Value};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tower::Layer;
use tower_idempotency::{fingerprint::JsonFingerprinter, key::IdempotencyKey, IdempotencyLayer};
use tracing_subscriber::{layer::SubscriberExt, util::SubscriberInitExt};

/// The exporter every span of this test binary ends in.
fn exporter() -> &'static InMemorySpanExporter {
    static EXPORTER: OnceLock<InMemorySpanExporter> = OnceLock::new();
    EXPORTER.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("tests")))
            .init();
        exporter
    })
}

fn attribute<'a>(span: &'a SpanData, key: &str) -> Option<&'a Value> {
    span.attributes
        .iter()
        .find(|KeyValue { key: k, .. }| k.as_str() == key)
        .map(|kv| &kv.value)
}

/// The exported `idempotency` spans of the key `key`, by outcome.
fn request_spans(key: &str, outcome: &str) -> Vec<SpanData> {
    let hash = IdempotencyKey::parse(key.as_bytes()).unwrap().short_hash();
    exporter()
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|span| {
            span.name == "idempotency"
                && attribute(span, "idempotency.key_hash")
                    .is_some_and(|v| v.as_str() == hash.as_str())
                && attribute(span, "idempotency.outcome").is_some_and(|v| v.as_str() == outcome)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_links_to_the_span_of_the_run_that_produced_its_answer() {
    exporter();
    let pg = Postgres::new().await;
    const ENDPOINT: &str = "POST /otel-link v1";
    let calls = Arc::new(AtomicU64::new(0));
    let layer = || IdempotencyLayer::new(pg.store.clone(), ENDPOINT, JsonFingerprinter::new("v1"));
    let first_process = layer().layer(order_handler::<Postgres>(calls.clone()));
    let other_process = layer()
        .without_replay_cache()
        .layer(order_handler::<Postgres>(calls.clone()));

    let first = send(first_process.clone(), post(Some("t"), Some("otel-1"), BODY)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    for replay in [
        send(first_process, post(Some("t"), Some("otel-1"), BODY)).await,
        send(other_process, post(Some("t"), Some("otel-1"), BODY)).await,
    ] {
        assert_eq!(replay.headers["idempotent-replayed"], "true");
        assert_eq!(replay.body, first.body);
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    // The run's own span context, in its record.
    let runs = request_spans("otel-1", "new");
    assert_eq!(runs.len(), 1, "{runs:#?}");
    let run = runs[0].span_context.clone();
    let kept: String = pg
        .client
        .query_one(
            "SELECT trace_id FROM idempotency_requests WHERE idempotency_key = 'otel-1'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(kept, format!("{}-{}", run.trace_id(), run.span_id()));

    // Each replay (cache, database) links to it and names it.
    let replays = request_spans("otel-1", "replayed");
    assert_eq!(replays.len(), 2, "{replays:#?}");
    for replay in &replays {
        let linked: Vec<_> = replay
            .links
            .iter()
            .map(|link| (link.span_context.trace_id(), link.span_context.span_id()))
            .collect();
        assert_eq!(linked, [(run.trace_id(), run.span_id())], "{replay:#?}");
        assert_ne!(
            replay.span_context.trace_id(),
            run.trace_id(),
            "a trace of its own"
        );
        assert_eq!(
            attribute(replay, "idempotency.original_trace_id").map(|v| v.as_str().into_owned()),
            Some(run.trace_id().to_string())
        );
        assert_eq!(
            attribute(replay, "idempotency.original_span_id").map(|v| v.as_str().into_owned()),
            Some(run.span_id().to_string())
        );
    }
    // The run's span has no link, and its store steps are its children.
    assert!(runs[0].links.is_empty());
    let steps: Vec<_> = exporter()
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|span| span.parent_span_id == run.span_id())
        .map(|span| span.name.into_owned())
        .collect();
    assert_eq!(
        steps,
        ["INSERT idempotency_requests", "UPDATE idempotency_requests"],
        "the claim and the completion, named by otel.name"
    );
}
