//! Metric names, in one place. Emitted through the `metrics` facade; install
//! any recorder (e.g. a Prometheus exporter) to collect them.
//!
//! Labels carry the endpoint and the outcome, never the key or the tenant.

use std::sync::{Arc, OnceLock};

/// Counter: idempotent requests by `endpoint` and `outcome` (see [`Outcome`]),
/// and by `tenant` only if the layer opted in
/// ([`IdempotencyLayer::metrics_tenant_label`](crate::IdempotencyLayer::metrics_tenant_label)).
pub const REQUESTS_TOTAL: &str = "idempotency_requests_total";
/// Histogram (seconds): time from the arrival of a request to the store's
/// answer to its claim, by `endpoint` and `outcome`. A concurrent duplicate's
/// wait for the first request shows here.
pub const CLAIM_DURATION_SECONDS: &str = "idempotency_claim_duration_seconds";
/// Histogram (seconds): how long an owner held its key (claim to commit or
/// rollback), by `endpoint`.
pub const KEY_HELD_SECONDS: &str = "idempotency_key_held_seconds";

/// Counter: expired idempotency records removed by cleanup.
pub const EXPIRED_REMOVED_TOTAL: &str = "idempotency_expired_removed_total";
/// Gauge: expired idempotency records not yet removed (cleanup backlog).
pub const CLEANUP_BACKLOG: &str = "idempotency_cleanup_backlog";
/// Gauge (seconds): age of the oldest operation still holding its key,
/// across every process sharing the database; 0 when none.
pub const OLDEST_IN_PROGRESS_SECONDS: &str = "idempotency_oldest_in_progress_seconds";
/// Histogram (seconds): how long a concurrent duplicate waited for the
/// request that held its key, by `endpoint`.
pub const DUPLICATE_WAIT_SECONDS: &str = "idempotency_duplicate_wait_seconds";

/// Counter: owners stopped and rolled back at the layer's handler timeout, by `endpoint`.
pub const HANDLER_TIMEOUTS_TOTAL: &str = "idempotency_handler_timeouts_total";

/// Counter: one-commit mode requests whose handler ran and whose commit
/// lost to another commit of the key (rolled back, answered with the
/// winner's record), or met the key's expired record (rolled back, the
/// record removed and the handler run again), by `endpoint`: handler work
/// done and discarded.
pub const COMMITS_LOST_TOTAL: &str = "idempotency_commits_lost_total";

/// Gauge: long-running operations whose work runs in this process right
/// now, by `endpoint`.
pub const OPERATIONS_RUNNING: &str = "idempotency_operations_running";
/// Counter: long-running operations taken over after their lease expired,
/// by `endpoint` and `by` (`request`: a duplicate; `recovery`: the
/// recovery worker).
pub const LEASE_TAKEOVERS_TOTAL: &str = "idempotency_lease_takeovers_total";
/// Counter: writes, completions and heartbeats of a stale owner refused
/// because another owner holds a larger token, by `endpoint` and `at`
/// (`write`, `completion`, `heartbeat`).
pub const FENCED_TOTAL: &str = "idempotency_fenced_total";
/// Counter: operations the recovery worker re-drove with nobody retrying,
/// by `endpoint`.
pub const RECOVERIES_TOTAL: &str = "idempotency_recoveries_total";
/// Counter: attempts of long-running operations (the first run, takeovers
/// by a duplicate, recoveries), by `endpoint` and `by` (`request`,
/// `recovery`).
pub const OPERATION_ATTEMPTS_TOTAL: &str = "idempotency_operation_attempts_total";
/// Counter: long-running operations that ended `failed` for good after
/// their last allowed attempt, by `endpoint`.
pub const OPERATIONS_FAILED_TOTAL: &str = "idempotency_operations_failed_total";
/// Gauge (seconds): age of the oldest long-running operation still in
/// progress, across every process sharing the database; 0 when none.
pub const OLDEST_LEASE_SECONDS: &str = "idempotency_oldest_lease_seconds";
/// Gauge: long-running operations whose lease expired and that nobody has
/// taken over yet (a recovery worker keeps it near 0).
pub const EXPIRED_LEASES: &str = "idempotency_expired_leases";

/// Gauge: undelivered, unparked outbox events (refreshed by the relay).
pub const OUTBOX_BACKLOG: &str = "idempotency_outbox_backlog_events";
/// Gauge (seconds): age of the oldest undelivered outbox event; 0 when none.
pub const OUTBOX_LAG_SECONDS: &str = "idempotency_outbox_lag_seconds";
/// Counter: outbox deliveries that succeeded, by `event_type`.
pub const OUTBOX_DELIVERED_TOTAL: &str = "idempotency_outbox_delivered_total";
/// Counter: outbox deliveries that failed (retried or parked), by `event_type`.
pub const OUTBOX_FAILED_TOTAL: &str = "idempotency_outbox_failed_total";
/// Counter: outbox events parked after their last allowed attempt, by `event_type`.
pub const OUTBOX_PARKED_TOTAL: &str = "idempotency_outbox_parked_total";
/// Counter: restarts of a relay task that ended before shutdown (an error or
/// a panic). The crate never restarts a relay itself: the application's
/// supervisor increments it, as the example order server does.
pub const OUTBOX_RELAY_RESTARTS_TOTAL: &str = "idempotency_outbox_relay_restarts_total";

/// Counter: attempts sent by the client layer (feature `client`), by
/// `client` (the layer's name).
pub const CLIENT_ATTEMPTS_TOTAL: &str = "idempotency_client_attempts_total";
/// Counter: retries made by the client layer, by `client` and `reason`
/// (`transport`, `timeout`, `unavailable`, `gateway`, `in_progress`).
pub const CLIENT_RETRIES_TOTAL: &str = "idempotency_client_retries_total";
/// Counter: calls whose last outcome was worth a retry but the client layer
/// stopped, by `client` and `reason` (`attempts_exhausted`, `deadline`,
/// `body_not_replayable`, `retry_budget`).
pub const CLIENT_GIVE_UPS_TOTAL: &str = "idempotency_client_give_ups_total";
/// Counter: answers marked `Idempotent-Replayed: true` that the client layer
/// received, by `client`.
pub const CLIENT_REPLAYED_TOTAL: &str = "idempotency_client_replayed_total";

/// What kind of metric a name is, for [`describe`].
#[derive(Clone, Copy)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// Every metric name with its kind, unit and one-line description.
const DESCRIPTIONS: &[(&str, Kind, metrics::Unit, &str)] = {
    use metrics::Unit::{Count, Seconds};
    use Kind::{Counter, Gauge, Histogram};
    &[
        (
            REQUESTS_TOTAL,
            Counter,
            Count,
            "Idempotent requests by endpoint and outcome.",
        ),
        (
            CLAIM_DURATION_SECONDS,
            Histogram,
            Seconds,
            "Time from a request's arrival to the store's answer to its claim.",
        ),
        (
            KEY_HELD_SECONDS,
            Histogram,
            Seconds,
            "How long an owner held its key, claim to commit or rollback.",
        ),
        (
            EXPIRED_REMOVED_TOTAL,
            Counter,
            Count,
            "Expired idempotency records removed by cleanup.",
        ),
        (
            CLEANUP_BACKLOG,
            Gauge,
            Count,
            "Expired idempotency records not yet removed (cleanup backlog).",
        ),
        (
            OLDEST_IN_PROGRESS_SECONDS,
            Gauge,
            Seconds,
            "Age of the oldest operation still holding its key; 0 when none.",
        ),
        (
            DUPLICATE_WAIT_SECONDS,
            Histogram,
            Seconds,
            "How long a concurrent duplicate waited for the request holding its key.",
        ),
        (
            HANDLER_TIMEOUTS_TOTAL,
            Counter,
            Count,
            "Owners stopped and rolled back at the layer's handler timeout.",
        ),
        (
            COMMITS_LOST_TOTAL,
            Counter,
            Count,
            "One-commit mode handler runs whose work was discarded at commit.",
        ),
        (
            OPERATIONS_RUNNING,
            Gauge,
            Count,
            "Long-running operations whose work runs in this process now.",
        ),
        (
            LEASE_TAKEOVERS_TOTAL,
            Counter,
            Count,
            "Long-running operations taken over after their lease expired.",
        ),
        (
            FENCED_TOTAL,
            Counter,
            Count,
            "Writes, completions and heartbeats of a stale owner refused.",
        ),
        (
            RECOVERIES_TOTAL,
            Counter,
            Count,
            "Operations the recovery worker re-drove with nobody retrying.",
        ),
        (
            OPERATION_ATTEMPTS_TOTAL,
            Counter,
            Count,
            "Attempts of long-running operations (first runs, takeovers, recoveries).",
        ),
        (
            OPERATIONS_FAILED_TOTAL,
            Counter,
            Count,
            "Long-running operations that ended failed after their last attempt.",
        ),
        (
            OLDEST_LEASE_SECONDS,
            Gauge,
            Seconds,
            "Age of the oldest long-running operation in progress; 0 when none.",
        ),
        (
            EXPIRED_LEASES,
            Gauge,
            Count,
            "Long-running operations whose lease expired, not yet taken over.",
        ),
        (
            OUTBOX_BACKLOG,
            Gauge,
            Count,
            "Undelivered, unparked outbox events.",
        ),
        (
            OUTBOX_LAG_SECONDS,
            Gauge,
            Seconds,
            "Age of the oldest undelivered outbox event; 0 when none.",
        ),
        (
            OUTBOX_DELIVERED_TOTAL,
            Counter,
            Count,
            "Outbox deliveries that succeeded, by event type.",
        ),
        (
            OUTBOX_FAILED_TOTAL,
            Counter,
            Count,
            "Outbox deliveries that failed (retried or parked), by event type.",
        ),
        (
            OUTBOX_PARKED_TOTAL,
            Counter,
            Count,
            "Outbox events parked after their last allowed attempt, by event type.",
        ),
        (
            OUTBOX_RELAY_RESTARTS_TOTAL,
            Counter,
            Count,
            "Restarts of an outbox relay task that ended before shutdown.",
        ),
        (
            CLIENT_ATTEMPTS_TOTAL,
            Counter,
            Count,
            "Attempts sent by the client layer.",
        ),
        (
            CLIENT_RETRIES_TOTAL,
            Counter,
            Count,
            "Retries made by the client layer, by reason.",
        ),
        (
            CLIENT_GIVE_UPS_TOTAL,
            Counter,
            Count,
            "Calls the client layer stopped retrying although worth a retry, by reason.",
        ),
        (
            CLIENT_REPLAYED_TOTAL,
            Counter,
            Count,
            "Answers marked Idempotent-Replayed: true that the client layer received.",
        ),
    ]
};

/// Describes every metric of this module (its kind, unit and a one-line
/// description) to the installed recorder, so that a Prometheus exporter
/// renders `# HELP` lines.
///
/// [`IdempotencyLayer::new`](crate::IdempotencyLayer::new) calls it, so an
/// application that installs its recorder before building its layers needs
/// nothing more. Call it yourself right after installing the recorder if
/// the process builds no layer (a relay or cleanup worker, a client only)
/// or builds its layers first. Describing again is harmless: a recorder
/// keeps the last description of a name. Units are
/// [`Seconds`](metrics::Unit::Seconds) for the `_seconds` metrics and
/// [`Count`](metrics::Unit::Count) for the rest; every name already ends
/// in its unit, so an exporter that appends units to names renames none.
pub fn describe() {
    for &(name, kind, unit, description) in DESCRIPTIONS {
        match kind {
            Kind::Counter => metrics::describe_counter!(name, unit, description),
            Kind::Gauge => metrics::describe_gauge!(name, unit, description),
            Kind::Histogram => metrics::describe_histogram!(name, unit, description),
        }
    }
}

#[cfg(feature = "client")]
pub(crate) fn client_attempt(client: &str) {
    metrics::counter!(CLIENT_ATTEMPTS_TOTAL, "client" => client.to_owned()).increment(1);
}

#[cfg(feature = "client")]
pub(crate) fn client_retry(client: &str, reason: &'static str) {
    metrics::counter!(CLIENT_RETRIES_TOTAL, "client" => client.to_owned(), "reason" => reason)
        .increment(1);
}

#[cfg(feature = "client")]
pub(crate) fn client_give_up(client: &str, reason: &'static str) {
    metrics::counter!(CLIENT_GIVE_UPS_TOTAL, "client" => client.to_owned(), "reason" => reason)
        .increment(1);
}

#[cfg(feature = "client")]
pub(crate) fn client_replayed(client: &str) {
    metrics::counter!(CLIENT_REPLAYED_TOTAL, "client" => client.to_owned()).increment(1);
}

/// Defines [`Outcome`] with its label values and the list of all of them,
/// so that a new outcome cannot be left out of [`EndpointMetrics`].
macro_rules! outcomes {
    ($($(#[$doc:meta])* $variant:ident => $label:literal,)*) => {
        /// How an idempotent request ended, as the `outcome` label says it.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum Outcome {
            $($(#[$doc])* $variant,)*
        }

        impl Outcome {
            /// Every outcome, in declaration order.
            pub const ALL: &'static [Outcome] = &[$(Outcome::$variant),*];

            /// The label value.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Outcome::$variant => $label,)*
                }
            }
        }
    };
}

outcomes! {
    /// The request owned its key, ran, and its response was committed.
    New => "new",
    /// A completed record was replayed.
    Replayed => "replayed",
    /// The key was reused with a different request and refused.
    KeyReused => "key_reused",
    /// Another request still held the key after the wait.
    InProgress => "in_progress",
    /// Refused before owning a key (missing/invalid key, no tenant, too
    /// large, validation failure).
    Rejected => "rejected",
    /// The owner's work was rolled back (5xx, service error, panic,
    /// unstorable response, handler timeout, a commit the database refused).
    RolledBack => "rolled_back",
    /// The store failed, or the commit's outcome is unknown.
    StoreUnavailable => "store_unavailable",
    /// A completed record was replayed by rebuilding its resource's current
    /// representation ([`IdempotencyLayer::rebuild_replays`](crate::IdempotencyLayer::rebuild_replays)).
    Rebuilt => "rebuilt",
    /// A replay to rebuild found its resource gone (`410 resource_gone`).
    ResourceGone => "resource_gone",
    /// A replay could not be rebuilt (`503 replay_unavailable`).
    RebuildFailed => "rebuild_failed",
}

/// `tenant` is only passed when the user opted in to the tenant label.
pub(crate) fn request(endpoint: &str, outcome: Outcome, tenant: Option<&str>) {
    match tenant {
        None => metrics::counter!(REQUESTS_TOTAL, "endpoint" => endpoint.to_owned(), "outcome" => outcome.as_str())
            .increment(1),
        Some(tenant) => metrics::counter!(
            REQUESTS_TOTAL,
            "endpoint" => endpoint.to_owned(),
            "outcome" => outcome.as_str(),
            "tenant" => tenant.to_owned()
        )
        .increment(1),
    }
}

pub(crate) fn key_held(endpoint: &str, seconds: f64) {
    metrics::histogram!(KEY_HELD_SECONDS, "endpoint" => endpoint.to_owned()).record(seconds);
}

/// Creates the one-commit mode's series at zero.
pub(crate) fn register_at_commit(endpoint: &str) {
    metrics::counter!(COMMITS_LOST_TOTAL, "endpoint" => endpoint.to_owned()).increment(0);
}

pub(crate) fn commit_lost(endpoint: &str) {
    metrics::counter!(COMMITS_LOST_TOTAL, "endpoint" => endpoint.to_owned()).increment(1);
}

pub(crate) fn handler_timeout(endpoint: &str) {
    metrics::counter!(HANDLER_TIMEOUTS_TOTAL, "endpoint" => endpoint.to_owned()).increment(1);
}

/// How one outbox delivery ended, each counted in its own counter.
#[cfg(feature = "postgres")]
#[derive(Debug, Clone, Copy)]
pub(crate) enum Delivery {
    /// [`OUTBOX_DELIVERED_TOTAL`].
    Delivered,
    /// [`OUTBOX_FAILED_TOTAL`].
    Failed,
    /// [`OUTBOX_PARKED_TOTAL`].
    Parked,
}

#[cfg(feature = "postgres")]
pub(crate) fn outbox_delivery(delivery: Delivery, event_type: &str) {
    let counter = match delivery {
        Delivery::Delivered => OUTBOX_DELIVERED_TOTAL,
        Delivery::Failed => OUTBOX_FAILED_TOTAL,
        Delivery::Parked => OUTBOX_PARKED_TOTAL,
    };
    metrics::counter!(counter, "event_type" => event_type.to_owned()).increment(1);
}

#[cfg(feature = "postgres")]
pub(crate) fn outbox_backlog(events: f64, lag_seconds: f64) {
    metrics::gauge!(OUTBOX_BACKLOG).set(events);
    metrics::gauge!(OUTBOX_LAG_SECONDS).set(lag_seconds);
}

#[cfg(feature = "postgres")]
pub(crate) fn expired_removed(rows: u64) {
    metrics::counter!(EXPIRED_REMOVED_TOTAL).increment(rows);
}

#[cfg(feature = "postgres")]
pub(crate) fn retention_gauges(backlog: f64, oldest_in_progress_seconds: f64) {
    metrics::gauge!(CLEANUP_BACKLOG).set(backlog);
    metrics::gauge!(OLDEST_IN_PROGRESS_SECONDS).set(oldest_in_progress_seconds);
}

/// Who took a long-running operation over.
#[derive(Debug, Clone, Copy)]
pub(crate) enum TakeoverBy {
    Request,
    Recovery,
}

impl TakeoverBy {
    const ALL: [TakeoverBy; 2] = [TakeoverBy::Request, TakeoverBy::Recovery];

    fn as_str(self) -> &'static str {
        match self {
            TakeoverBy::Request => "request",
            TakeoverBy::Recovery => "recovery",
        }
    }
}

pub(crate) fn lease_takeover(endpoint: &str, by: TakeoverBy) {
    labelled(LEASE_TAKEOVERS_TOTAL, endpoint, "by", by.as_str()).increment(1);
}

/// What a stale owner tried when it was fenced.
#[derive(Debug, Clone, Copy)]
pub(crate) enum FencedAt {
    Write,
    Completion,
    Heartbeat,
}

impl FencedAt {
    const ALL: [FencedAt; 3] = [FencedAt::Write, FencedAt::Completion, FencedAt::Heartbeat];

    fn as_str(self) -> &'static str {
        match self {
            FencedAt::Write => "write",
            FencedAt::Completion => "completion",
            FencedAt::Heartbeat => "heartbeat",
        }
    }
}

pub(crate) fn fenced(endpoint: &str, at: FencedAt) {
    labelled(FENCED_TOTAL, endpoint, "at", at.as_str()).increment(1);
}

pub(crate) fn operation_attempt(endpoint: &str, by: TakeoverBy) {
    labelled(OPERATION_ATTEMPTS_TOTAL, endpoint, "by", by.as_str()).increment(1);
}

/// A counter by `endpoint` and one more label.
fn labelled(
    name: &'static str,
    endpoint: &str,
    label: &'static str,
    value: &'static str,
) -> metrics::Counter {
    metrics::counter!(name, "endpoint" => endpoint.to_owned(), label => value)
}

pub(crate) fn operation_failed(endpoint: &str) {
    metrics::counter!(OPERATIONS_FAILED_TOTAL, "endpoint" => endpoint.to_owned()).increment(1);
}

pub(crate) fn recovered(endpoint: &str) {
    metrics::counter!(RECOVERIES_TOTAL, "endpoint" => endpoint.to_owned()).increment(1);
}

#[cfg(feature = "postgres")]
pub(crate) fn lease_gauges(oldest_seconds: f64, expired: f64) {
    metrics::gauge!(OLDEST_LEASE_SECONDS).set(oldest_seconds);
    metrics::gauge!(EXPIRED_LEASES).set(expired);
}

/// One long-running operation's work in this process, counted in
/// [`OPERATIONS_RUNNING`] until dropped.
pub(crate) struct OperationRunning(String);

impl OperationRunning {
    pub(crate) fn start(endpoint: &str) -> Self {
        metrics::gauge!(OPERATIONS_RUNNING, "endpoint" => endpoint.to_owned()).increment(1.0);
        OperationRunning(endpoint.to_owned())
    }
}

impl Drop for OperationRunning {
    fn drop(&mut self) {
        metrics::gauge!(OPERATIONS_RUNNING, "endpoint" => self.0.clone()).decrement(1.0);
    }
}

/// Creates a long-running endpoint's series at zero.
pub(crate) fn register_long_running(endpoint: &str) {
    metrics::gauge!(OPERATIONS_RUNNING, "endpoint" => endpoint.to_owned()).increment(0.0);
    for by in TakeoverBy::ALL {
        labelled(LEASE_TAKEOVERS_TOTAL, endpoint, "by", by.as_str()).increment(0);
        labelled(OPERATION_ATTEMPTS_TOTAL, endpoint, "by", by.as_str()).increment(0);
    }
    for at in FencedAt::ALL {
        labelled(FENCED_TOTAL, endpoint, "at", at.as_str()).increment(0);
    }
    metrics::counter!(RECOVERIES_TOTAL, "endpoint" => endpoint.to_owned()).increment(0);
    metrics::counter!(OPERATIONS_FAILED_TOTAL, "endpoint" => endpoint.to_owned()).increment(0);
}

/// One endpoint's per-request series, each registered once, at the first
/// request that records it: a request then records through a handle,
/// without building a key with owned labels and looking it up in the
/// recorder. The recorder is the one installed by then (install it before
/// serving). The opt-in `tenant` label is the exception: its series are
/// looked up per request, since tenants are not known in advance.
pub(crate) struct EndpointMetrics {
    endpoint: Arc<str>,
    /// `idempotency_requests_total` by outcome, in [`Outcome::ALL`]'s order.
    requests: [OnceLock<metrics::Counter>; OUTCOMES],
    /// `idempotency_claim_duration_seconds` by outcome.
    claim: [OnceLock<metrics::Histogram>; OUTCOMES],
    key_held: OnceLock<metrics::Histogram>,
    duplicate_wait: OnceLock<metrics::Histogram>,
}

/// How many outcomes there are.
const OUTCOMES: usize = Outcome::ALL.len();

impl EndpointMetrics {
    /// `endpoint`'s series, none registered yet; every outcome's request
    /// series is created at zero now, so that dashboards and alerts see the
    /// metric before the first request of each kind.
    pub(crate) fn new(endpoint: Arc<str>) -> Self {
        for outcome in Outcome::ALL {
            metrics::counter!(REQUESTS_TOTAL, "endpoint" => endpoint.to_string(), "outcome" => outcome.as_str())
                .increment(0);
        }
        EndpointMetrics {
            endpoint,
            requests: [const { OnceLock::new() }; OUTCOMES],
            claim: [const { OnceLock::new() }; OUTCOMES],
            key_held: OnceLock::new(),
            duplicate_wait: OnceLock::new(),
        }
    }

    /// Counts a request that ended with `outcome` (`tenant` only when the
    /// tenant label was opted in to).
    pub(crate) fn request(&self, outcome: Outcome, tenant: Option<&str>) {
        match tenant {
            None => self.requests[outcome as usize]
                .get_or_init(|| {
                    metrics::counter!(REQUESTS_TOTAL, "endpoint" => self.endpoint.to_string(), "outcome" => outcome.as_str())
                })
                .increment(1),
            Some(_) => request(&self.endpoint, outcome, tenant),
        }
    }

    pub(crate) fn claim_duration(&self, outcome: Outcome, seconds: f64) {
        self.claim[outcome as usize]
            .get_or_init(|| {
                metrics::histogram!(CLAIM_DURATION_SECONDS, "endpoint" => self.endpoint.to_string(), "outcome" => outcome.as_str())
            })
            .record(seconds);
    }

    pub(crate) fn key_held(&self, seconds: f64) {
        self.key_held
            .get_or_init(
                || metrics::histogram!(KEY_HELD_SECONDS, "endpoint" => self.endpoint.to_string()),
            )
            .record(seconds);
    }

    pub(crate) fn duplicate_wait(&self, seconds: f64) {
        self.duplicate_wait
            .get_or_init(|| {
                metrics::histogram!(DUPLICATE_WAIT_SECONDS, "endpoint" => self.endpoint.to_string())
            })
            .record(seconds);
    }
}

impl std::fmt::Debug for EndpointMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EndpointMetrics").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use metrics_util::debugging::DebuggingRecorder;
    use metrics_util::MetricKind;

    /// Every `pub const NAME: &str = "…";` of this file, with the kind its
    /// doc comment starts with (`Counter:`, `Gauge`, `Histogram`).
    fn constants() -> Vec<(String, MetricKind)> {
        let mut found = Vec::new();
        let mut doc = String::new();
        for line in include_str!("metrics.rs").lines().map(str::trim) {
            if let Some(text) = line.strip_prefix("///") {
                doc.push_str(text.trim());
                doc.push(' ');
                continue;
            }
            if let Some(rest) = line.strip_prefix("pub const ") {
                if rest.contains(": &str = ") {
                    let name = rest.split('"').nth(1).expect("a quoted name").to_owned();
                    let kind = if doc.starts_with("Counter") {
                        MetricKind::Counter
                    } else if doc.starts_with("Gauge") {
                        MetricKind::Gauge
                    } else if doc.starts_with("Histogram") {
                        MetricKind::Histogram
                    } else {
                        panic!("{name}: its doc comment names no kind: {doc}");
                    };
                    found.push((name, kind));
                }
            }
            doc.clear();
        }
        found
    }

    #[test]
    fn describe_covers_every_metric_name() {
        let constants = constants();
        assert_eq!(constants.len(), super::DESCRIPTIONS.len(), "{constants:?}");
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, || {
            super::describe();
            // The recorder shows only registered metrics.
            for (name, kind) in &constants {
                let name = name.clone();
                match kind {
                    MetricKind::Counter => metrics::counter!(name).increment(0),
                    MetricKind::Gauge => metrics::gauge!(name).set(0.0),
                    MetricKind::Histogram => metrics::histogram!(name).record(0.0),
                }
            }
        });
        let snapshot = snapshotter.snapshot().into_vec();
        for (name, kind) in &constants {
            let (_, unit, description, _) = snapshot
                .iter()
                .find(|(key, ..)| key.kind() == *kind && key.key().name() == name)
                .unwrap_or_else(|| panic!("{name} ({kind:?}) not recorded"));
            let description = description
                .as_ref()
                .unwrap_or_else(|| panic!("{name} ({kind:?}) has no description"));
            assert!(!description.is_empty(), "{name}");
            assert!(!description.contains('\n'), "{name}: one line");
            let expected = if name.ends_with("_seconds") {
                metrics::Unit::Seconds
            } else {
                metrics::Unit::Count
            };
            assert_eq!(*unit, Some(expected), "{name}");
        }
    }
}
