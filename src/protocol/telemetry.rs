//! The span around each of the store's steps on a request's path (claim,
//! lookup, completion, commit; a long-running operation's acquisition and
//! finish), with the attributes OpenTelemetry's
//! database conventions name, so that a trace shows where a request's time
//! in PostgreSQL went and which step failed.

use tracing::{field, Span};

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

/// A store step under way: its span, open from [`start`] to [`Started::end`].
///
/// The work is not run inside the span (not `Instrument`ed): a wrapper
/// around the owner's futures, which are large, would copy them whole at
/// every step of the way, measured at about 37,000 instructions a one-commit
/// create (callgrind, `benches/pg_instructions.rs`). Opened before the work
/// and closed after it, the span still starts and ends with it, and its
/// parent is the request's span, which the work runs in.
pub(crate) struct Started(Span);

/// Opens the span of `step` against `driver`'s database, a child of the
/// current (the request's) span. Only a level check when no subscriber
/// records it.
pub(crate) fn start<D: Driver>(driver: &D, step: Step) -> Started {
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
    if !span.is_disabled() {
        let target = driver.target();
        record(&span, "db.namespace", target.database.as_deref());
        record(&span, "server.address", target.host.as_deref());
        if let Some(port) = target.port {
            span.record("server.port", port);
        }
    }
    Started(span)
}

impl Started {
    /// Closes the span with what the work ended with: a failure records
    /// `error.type` (the store error's stable code), the SQLSTATE when the
    /// server sent one (`db.response.status_code`) and
    /// `otel.status_code = "ERROR"`.
    pub(crate) fn end<T>(self, done: Result<T, StoreError>) -> Result<T, StoreError> {
        if let (Err(e), false) = (&done, self.0.is_disabled()) {
            self.0.record("otel.status_code", "ERROR");
            self.0.record("error.type", e.kind().code());
            record(&self.0, "db.response.status_code", e.sql_state());
        }
        done
    }
}

fn record(span: &Span, field: &'static str, value: Option<&str>) {
    if let Some(value) = value {
        span.record(field, value);
    }
}
