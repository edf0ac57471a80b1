//! The span around each of the store's steps on a request's path (claim,
//! lookup, completion, commit; a long-running operation's acquisition and
//! finish), with the attributes OpenTelemetry's
//! database conventions name, so that a trace shows where a request's time
//! in PostgreSQL went and which step failed.

use std::future::Future;

use tracing::{field, Instrument, Span};

use super::driver::Driver;
use crate::store::StoreError;

/// The table every step reads or writes.
const TABLE: &str = "idempotency_requests";

/// Where a driver's connections go, as the spans name it: the database
/// (`db.namespace`) and, with one host configured, the server
/// (`server.address`, `server.port`). Several hosts (a failover list)
/// name none: which one answers is known only once connected.
#[derive(Debug, Default)]
pub(crate) struct Target {
    pub(crate) database: Option<String>,
    pub(crate) host: Option<String>,
    pub(crate) port: Option<u16>,
}

/// One step of the store: its operation (`db.operation.name`: the
/// statement that decides it) and its summary (`db.query.summary`, also
/// the span's OpenTelemetry name).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Step {
    pub(crate) operation: &'static str,
    pub(crate) summary: &'static str,
}

/// The claim: `INSERT … ON CONFLICT` (or the record that holds the key);
/// also a long-running operation's acquisition.
pub(crate) const CLAIM: Step = Step {
    operation: "INSERT",
    summary: "INSERT idempotency_requests",
};
/// The read of a key's record a retry that says so is answered from.
pub(crate) const LOOKUP: Step = Step {
    operation: "SELECT",
    summary: "SELECT idempotency_requests",
};
/// The claim-first completion: the response, then `COMMIT`; also a
/// long-running operation's finish.
pub(crate) const COMPLETE: Step = Step {
    operation: "UPDATE",
    summary: "UPDATE idempotency_requests",
};
/// The one-commit mode's record with the response, pipelined with `COMMIT`.
pub(crate) const COMMIT: Step = Step {
    operation: "INSERT",
    summary: "INSERT idempotency_requests",
};

/// `work`, in the span of `step` against `driver`'s database: a child of
/// the request's span. A failure records `error.type` (the store error's
/// stable code), the SQLSTATE when the server sent one
/// (`db.response.status_code`) and `otel.status_code = "ERROR"`.
pub(crate) async fn step<D, T>(
    driver: &D,
    step: Step,
    work: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError>
where
    D: Driver,
{
    let span = tracing::info_span!(
        "idempotency_store",
        otel.name = step.summary,
        otel.kind = "client",
        otel.status_code = field::Empty,
        db.system.name = "postgresql",
        db.operation.name = step.operation,
        db.collection.name = TABLE,
        db.query.summary = step.summary,
        db.namespace = field::Empty,
        db.response.status_code = field::Empty,
        server.address = field::Empty,
        server.port = field::Empty,
        error.type = field::Empty,
    );
    if span.is_disabled() {
        return work.await;
    }
    let target = driver.target();
    record(&span, "db.namespace", target.database.as_deref());
    record(&span, "server.address", target.host.as_deref());
    if let Some(port) = target.port {
        span.record("server.port", port);
    }
    let done = work.instrument(span.clone()).await;
    if let Err(e) = &done {
        span.record("otel.status_code", "ERROR");
        span.record("error.type", e.kind().code());
        record(&span, "db.response.status_code", e.sql_state());
    }
    done
}

fn record(span: &Span, field: &'static str, value: Option<&str>) {
    if let Some(value) = value {
        span.record(field, value);
    }
}
