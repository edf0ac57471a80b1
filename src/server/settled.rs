//! How a request ended, and the two things made of it: the answer the client
//! gets ([`Settled::answer`]) and what operators see ([`Settled::observe`]:
//! the span's outcome, one log event, the metrics). Both match every
//! variant, so a new way to end does not compile until both handle it, and
//! each runs exactly once per request.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, response, HeaderValue, Response, StatusCode};
use tracing::Span;

use std::sync::Arc;

use super::{
    body::{BoxError, ResponseBody},
    endpoint::Config,
    lease_config::LeaseConfig,
};
use crate::{
    metrics::{self, Outcome},
    problem::{codes, Problem},
    record::{ResourceId, StoredResponse, IDEMPOTENT_REPLAYED},
    store::{OperationId, StoreError, StoreErrorKind},
};

/// What the middleware returns: the inner service's error type is kept.
pub(crate) type MiddlewareResult<B, E> = Result<Response<ResponseBody<B>>, E>;

/// Where a running operation's status is, and when asking again is useful:
/// what a `202` says (from the long-running mode's settings).
#[derive(Debug, Clone)]
pub struct StatusHint {
    path: Arc<str>,
    retry_after: u64,
}

impl StatusHint {
    pub(crate) fn of(config: &LeaseConfig) -> Self {
        StatusHint {
            path: config.status_path.clone(),
            retry_after: config.retry_after(),
        }
    }

    /// The `Location` of operation `id`'s status resource.
    fn location(&self, id: OperationId) -> Option<HeaderValue> {
        HeaderValue::try_from(format!("{}/{id}", self.path)).ok()
    }
}

/// The body of a `202 Accepted`: the same bytes for the first answer and
/// every duplicate while the operation runs.
fn accepted_body(id: OperationId) -> Bytes {
    Bytes::from(format!(r#"{{"operation_id":"{id}","state":"running"}}"#))
}

/// How an idempotent request ended (public only to the sealed
/// [`Mode`](super::mode::Mode); nothing outside the crate can name it).
#[allow(missing_debug_implementations)]
pub enum Settled<B, E> {
    /// Refused before claiming its key (key, tenant, body, fingerprint).
    Rejected(Problem),
    /// The key has a completed record for the same request: its replay.
    Replayed(StoredResponse),
    /// The key has a completed record for another request.
    KeyReused,
    /// Another request still held the key when the wait ran out; asking
    /// again is useful after `retry_after` seconds.
    InProgress { retry_after: u64 },
    /// The store could not arbitrate the key.
    ClaimFailed(StoreError),
    /// The owner's response committed with its writes.
    Committed(response::Parts, Bytes),
    /// The owner's work was rolled back; the key is free again.
    RolledBack(Rollback<B, E>),
    /// The owner's response was ready, but the commit failed (see the kind).
    CompletionFailed(StoreError),
    /// The database stopped answering while the owner held its key: its
    /// statements and then its rollback went unanswered (a network
    /// partition). The connection was closed; nothing was committed, and
    /// the server rolls the work back once it learns so.
    StoreLost(StoreError),
    /// The runtime shut down under the owned work.
    Cancelled,
    /// A long-running operation was started (or taken over) and did not
    /// finish within `respond_within`: `202 Accepted`.
    Accepted(OperationId, StatusHint),
    /// A duplicate of a long-running operation that still runs: the same
    /// `202`, marked replayed.
    StillRunning(OperationId, StatusHint),
    /// An attempt of a long-running operation ended without an answer to
    /// remember; the operation stays for its next attempt.
    AttemptFailed(OperationId, Rollback<B, E>),
    /// A replay rebuilt from its resource: the current representation under
    /// the first status, marked replayed.
    Rebuilt(Response<Bytes>),
    /// A replay to rebuild whose resource is gone.
    ResourceGone(ResourceId),
    /// A replay that could not be rebuilt.
    RebuildFailed(BoxError),
}

/// Why an owner's work was rolled back, with what the client gets.
#[allow(missing_debug_implementations)]
pub enum Rollback<B, E> {
    /// A response that is not remembered (5xx, unmarked 4xx): passed on.
    NotRemembered(Response<B>),
    /// A response found not to be remembered once its body was buffered
    /// (its trailers decided: a gRPC error): passed on, trailers included.
    NotRememberedBuffered(response::Parts, Bytes),
    /// The inner service failed: its error is passed on.
    ServiceFailed(E),
    /// A response to remember whose body could not be buffered.
    Unstorable(&'static str),
    /// The handler did not finish within the handler timeout.
    TimedOut,
}

/// When the phases of a request ended, for the metrics.
#[derive(Debug, Clone, Copy)]
pub struct Timings {
    arrived: Instant,
    /// Arrival to the store's answer to the claim.
    pub(crate) claimed: Option<Duration>,
    /// Arrival to the end of waiting for a concurrent duplicate, if it waited.
    pub(crate) waited: Option<Duration>,
    /// How long the owner held its key, claim to commit or rollback.
    pub(crate) held: Option<Duration>,
}

impl Timings {
    pub(crate) fn start() -> Self {
        Timings {
            arrived: Instant::now(),
            claimed: None,
            waited: None,
            held: None,
        }
    }

    pub(crate) fn since_arrival(&self) -> Duration {
        self.arrived.elapsed()
    }
}

impl<B, E> Settled<B, E> {
    /// The `outcome` label.
    pub(crate) fn outcome(&self) -> Outcome {
        match self {
            Settled::Rejected(_) => Outcome::Rejected,
            Settled::Replayed(_) => Outcome::Replayed,
            Settled::KeyReused => Outcome::KeyReused,
            Settled::InProgress { .. } => Outcome::InProgress,
            Settled::ClaimFailed(_) | Settled::StoreLost(_) | Settled::Cancelled => {
                Outcome::StoreUnavailable
            }
            Settled::Committed(..) | Settled::Accepted(..) => Outcome::New,
            Settled::StillRunning(..) => Outcome::Replayed,
            Settled::Rebuilt(_) => Outcome::Rebuilt,
            Settled::ResourceGone(_) => Outcome::ResourceGone,
            Settled::RebuildFailed(_) => Outcome::RebuildFailed,
            Settled::RolledBack(_) | Settled::AttemptFailed(..) => Outcome::RolledBack,
            Settled::CompletionFailed(e) => match e.kind() {
                StoreErrorKind::TransactionAborted | StoreErrorKind::Conflict => {
                    Outcome::RolledBack
                }
                _ => Outcome::StoreUnavailable,
            },
        }
    }

    /// The request's error, as OpenTelemetry's `error.type` names it, for
    /// an answer that is the server's failure (a 5xx, the store's or the
    /// handler's failure); `None` for a success and for a refusal of the
    /// request (a 4xx: the client's to fix). A stable code of the layer's
    /// where it has one, else the answer's HTTP status, as the convention
    /// names an HTTP server's errors.
    fn error_type(&self) -> Option<std::borrow::Cow<'static, str>> {
        let status = |status: StatusCode| {
            status
                .is_server_error()
                .then(|| std::borrow::Cow::Owned(status.as_str().to_owned()))
        };
        let code = |code: &'static str| Some(std::borrow::Cow::Borrowed(code));
        let rollback = |rollback: &Rollback<B, E>| match rollback {
            Rollback::NotRemembered(response) => status(response.status()),
            Rollback::NotRememberedBuffered(parts, _) => status(parts.status),
            Rollback::ServiceFailed(_) => code("service_failed"),
            Rollback::Unstorable(_) => code(codes::RESPONSE_NOT_STORABLE),
            Rollback::TimedOut => code(codes::HANDLER_TIMEOUT),
        };
        match self {
            Settled::ClaimFailed(e) | Settled::StoreLost(e) | Settled::CompletionFailed(e) => {
                code(e.kind().code())
            }
            Settled::Cancelled => code("cancelled"),
            Settled::RebuildFailed(_) => code(codes::REPLAY_UNAVAILABLE),
            Settled::RolledBack(r) | Settled::AttemptFailed(_, r) => rollback(r),
            Settled::Rejected(problem) if problem.status().is_server_error() => {
                code(problem.code())
            }
            _ => None,
        }
    }

    /// What the claim itself answered, for the claim-duration histogram.
    fn claim_outcome(&self) -> Outcome {
        match self {
            Settled::Committed(..)
            | Settled::RolledBack(_)
            | Settled::AttemptFailed(..)
            | Settled::CompletionFailed(_)
            | Settled::StoreLost(_)
            | Settled::Accepted(..) => Outcome::New,
            // The claim found a completed record; only the answer was rebuilt.
            Settled::Rebuilt(_) | Settled::ResourceGone(_) | Settled::RebuildFailed(_) => {
                Outcome::Replayed
            }
            other => other.outcome(),
        }
    }

    /// Records the outcome on the span, logs the decision once, and counts
    /// the request once.
    pub(crate) fn observe(
        &self,
        config: &Config,
        span: &Span,
        timings: &Timings,
        tenant: Option<&str>,
    ) {
        let _entered = span.enter();
        let endpoint = &*config.endpoint;
        let outcome = self.outcome();
        span.record("idempotency.outcome", outcome.as_str());
        // OpenTelemetry's span status and error class, for a server error.
        if let Some(error) = self.error_type() {
            span.record("otel.status_code", "ERROR");
            span.record("error.type", &*error);
        }
        // A replay names the trace of the run that produced its answer.
        if let Settled::Replayed(stored) = self {
            link_to_original(span, stored);
        }
        match self {
            Settled::Rejected(problem) => {
                tracing::debug!(
                    code = problem.code(),
                    "request refused before claiming a key"
                );
            }
            // A request that went as it should is counted by the metrics;
            // its event is for debugging (a subscriber at `INFO` formats
            // nothing per successful request).
            Settled::Replayed(_) => tracing::debug!("replaying the completed response"),
            Settled::KeyReused => tracing::info!("key reused with a different request; refused"),
            Settled::InProgress { .. } => tracing::info!("key still in progress after the wait"),
            Settled::ClaimFailed(e) => tracing::error!(error = %e, "claim failed"),
            Settled::StoreLost(e) => {
                metrics::handler_timeout(endpoint);
                tracing::error!(
                    error = %e,
                    "the database stopped answering the owner's transaction; its connection was closed, nothing was committed"
                )
            }
            Settled::Committed(parts, _) => tracing::debug!(
                status = parts.status.as_u16(),
                "committed the response to remember with the handler's writes"
            ),
            Settled::RolledBack(rollback) => {
                let reason = match rollback {
                    Rollback::NotRemembered(_) | Rollback::NotRememberedBuffered(..) => {
                        "the response is not remembered"
                    }
                    Rollback::ServiceFailed(_) => "the service failed",
                    Rollback::Unstorable(reason) => reason,
                    Rollback::TimedOut => {
                        metrics::handler_timeout(endpoint);
                        "the handler did not finish within its deadline"
                    }
                };
                tracing::info!(reason, "rolled back; the key is free again");
            }
            // The handler timeout is counted where the attempt ran (it runs
            // for recoveries too), not here.
            Settled::AttemptFailed(id, rollback) => {
                let reason = match rollback {
                    Rollback::NotRemembered(_) | Rollback::NotRememberedBuffered(..) => {
                        "the response is not remembered"
                    }
                    Rollback::ServiceFailed(_) => "the service failed",
                    Rollback::Unstorable(reason) => reason,
                    Rollback::TimedOut => "the handler did not finish within its deadline",
                };
                tracing::info!(operation_id = %id, reason, "the attempt ended without an answer; the operation waits for its next attempt");
            }
            Settled::CompletionFailed(e) => match e.kind() {
                StoreErrorKind::OutcomeUnknown => tracing::error!(
                    error = %e,
                    "the connection was lost while committing: the outcome is unknown; a retry with the same key finds out"
                ),
                StoreErrorKind::TransactionAborted => tracing::error!(
                    error = %e,
                    "the database refused to commit the handler's writes; rolled back"
                ),
                StoreErrorKind::Conflict => tracing::warn!(
                    error = %e,
                    "the commit conflicted with a concurrent transaction; rolled back"
                ),
                _ => {
                    tracing::error!(error = %e, "commit failed; the handler's writes were rolled back")
                }
            },
            Settled::Cancelled => tracing::warn!("the runtime shut down under an owned request"),
            Settled::Accepted(id, _) => {
                tracing::info!(operation_id = %id, "accepted; the operation runs on")
            }
            Settled::StillRunning(id, _) => {
                tracing::info!(operation_id = %id, "the operation still runs; answered 202 again")
            }
            Settled::Rebuilt(_) => {
                tracing::info!("replaying the resource's current representation")
            }
            Settled::ResourceGone(id) => {
                tracing::info!(resource_id = %id, "the replayed operation's resource is gone")
            }
            Settled::RebuildFailed(e) => {
                tracing::warn!(error = %e, "the replay could not be rebuilt")
            }
        }
        let series = &config.metrics;
        series.request(outcome, tenant);
        if let Some(claimed) = timings.claimed {
            series.claim_duration(self.claim_outcome(), claimed.as_secs_f64());
        }
        if let Some(waited) = timings.waited {
            tracing::debug!(
                waited_ms = waited.as_millis() as u64,
                "waited for a concurrent duplicate"
            );
            series.duplicate_wait(waited.as_secs_f64());
        }
        if let Some(held) = timings.held {
            series.key_held(held.as_secs_f64());
        }
    }

    /// The response the client gets; the layer's own answers as gRPC
    /// statuses when the request was gRPC's.
    pub(crate) fn answer(self, config: &Config, grpc: bool) -> MiddlewareResult<B, E> {
        let problem = match self {
            Settled::Replayed(stored) => return Ok(ResponseBody::remembered(stored.to_replay())),
            Settled::Committed(parts, body) => {
                return Ok(ResponseBody::remembered(Response::from_parts(parts, body)))
            }
            Settled::RolledBack(Rollback::NotRemembered(response)) => {
                return Ok(response.map(ResponseBody::inner))
            }
            Settled::RolledBack(Rollback::ServiceFailed(e)) => return Err(e),
            Settled::AttemptFailed(_, Rollback::NotRemembered(response)) => {
                return Ok(response.map(ResponseBody::inner))
            }
            Settled::RolledBack(Rollback::NotRememberedBuffered(parts, body))
            | Settled::AttemptFailed(_, Rollback::NotRememberedBuffered(parts, body)) => {
                return Ok(ResponseBody::remembered(Response::from_parts(parts, body)))
            }
            Settled::AttemptFailed(_, Rollback::ServiceFailed(e)) => return Err(e),
            Settled::AttemptFailed(id, Rollback::TimedOut) => attempt_timed_out(config, id),
            Settled::AttemptFailed(id, Rollback::Unstorable(_)) => Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                codes::RESPONSE_NOT_STORABLE,
                "The response could not be remembered",
            )
            .with_detail("this attempt's answer was not stored; retry with the same key to resume the same operation")
            .with_member("operation_id", id.to_string()),
            Settled::Rejected(problem) => problem,
            Settled::KeyReused => key_reused(config),
            Settled::InProgress { retry_after } => in_progress(retry_after),
            Settled::ClaimFailed(_) => store_unavailable("the idempotency store is unavailable"),
            Settled::StoreLost(_) => store_unavailable(
                "the database stopped answering; nothing was committed, retry with the same key",
            ),
            Settled::RolledBack(Rollback::Unstorable(_)) => Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                codes::RESPONSE_NOT_STORABLE,
                "The response could not be remembered; nothing was changed",
            ),
            Settled::RolledBack(Rollback::TimedOut) => handler_timeout(config),
            Settled::CompletionFailed(e) => completion_failed(&e),
            Settled::Cancelled => {
                store_unavailable("the request was cancelled by a runtime shutdown")
            }
            Settled::Accepted(id, status) => return Ok(accepted(&status, id, false)),
            Settled::StillRunning(id, status) => return Ok(accepted(&status, id, true)),
            Settled::Rebuilt(response) => return Ok(response.map(ResponseBody::buffered)),
            Settled::ResourceGone(_) => Problem::new(
                StatusCode::GONE,
                codes::RESOURCE_GONE,
                "The resource this request created no longer exists",
            )
            .with_detail("the operation ran once; its result was removed since, and retrying cannot bring it back"),
            Settled::RebuildFailed(_) => Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                codes::REPLAY_UNAVAILABLE,
                "The first answer could not be rebuilt; retry with the same key",
            )
            .with_detail("the operation ran once; nothing was changed now")
            .with_retry_after(1),
        };
        let problem = problem.or_type_base(config.problem_type_base.as_ref());
        let response = if grpc {
            problem.to_grpc_response()
        } else {
            problem.to_response()
        };
        Ok(response.map(ResponseBody::buffered))
    }
}

/// `202 Accepted` for a long-running operation: the same status, `Location`
/// and body for the first answer and every duplicate while it runs.
fn accepted<B>(status: &StatusHint, id: OperationId, replayed: bool) -> Response<ResponseBody<B>> {
    let mut response = Response::new(ResponseBody::buffered(accepted_body(id)));
    *response.status_mut() = StatusCode::ACCEPTED;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(location) = status.location(id) {
        headers.insert(header::LOCATION, location);
    }
    headers.insert(header::RETRY_AFTER, HeaderValue::from(status.retry_after));
    if replayed {
        headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    response
}

fn key_reused(config: &Config) -> Problem {
    Problem::new(
        config.key_reuse.status(),
        codes::KEY_REUSED,
        "This idempotency key was already used for a different request",
    )
    .with_detail("use a new key for a new request; the first request's result is unchanged")
}

/// `Retry-After`: in the long-running mode, when the operation's status can
/// next change (a heartbeat); otherwise a second.
fn in_progress(retry_after: u64) -> Problem {
    Problem::new(
        StatusCode::CONFLICT,
        codes::IN_PROGRESS,
        "A request with this idempotency key is still in progress",
    )
    .with_detail("retry after a moment to get its result")
    .with_retry_after(retry_after)
}

/// A long-running attempt stopped at the handler timeout. What it committed
/// stays (never "nothing was changed"): the next attempt resumes it.
fn attempt_timed_out(config: &Config, id: OperationId) -> Problem {
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        codes::HANDLER_TIMEOUT,
        "The attempt did not finish in time; the operation resumes on a retry",
    )
    .with_detail(format!(
        "the attempt was stopped after {} ms; retry with the same key to resume the same operation",
        config.handler_timeout.as_millis()
    ))
    .with_member("operation_id", id.to_string())
    .with_retry_after(1)
}

fn handler_timeout(config: &Config) -> Problem {
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        codes::HANDLER_TIMEOUT,
        "The request did not finish in time; nothing was changed",
    )
    .with_detail(format!(
        "the handler was stopped after {} ms and its work rolled back; retry with the same key",
        config.handler_timeout.as_millis()
    ))
    .with_retry_after(1)
}

/// See [`StoreErrorKind`] for what each kind means.
fn completion_failed(error: &StoreError) -> Problem {
    match error.kind() {
        StoreErrorKind::OutcomeUnknown => store_unavailable(
            "the commit's outcome is unknown; retry with the same key to learn it",
        ),
        StoreErrorKind::TransactionAborted => Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            codes::COMMIT_REJECTED,
            "The database refused to commit this request's changes; nothing was changed",
        )
        .with_detail("retrying the same request fails the same way"),
        StoreErrorKind::Conflict => store_unavailable(
            "the transaction conflicted with a concurrent one and was rolled back",
        ),
        _ => store_unavailable("the transaction could not be committed"),
    }
}

fn store_unavailable(detail: &str) -> Problem {
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        codes::STORE_UNAVAILABLE,
        "The idempotency store is unavailable; retry with the same key",
    )
    .with_detail(detail)
    .with_retry_after(1)
}

/// Records on a replay's `span` the trace of the run that produced its
/// answer (`idempotency.original_trace_id`, and `idempotency.original_span_id`
/// when the record has it); with the `opentelemetry` feature, a link from
/// the replay's span to that run's span, too.
fn link_to_original(span: &Span, stored: &StoredResponse) {
    let Some(trace_id) = stored.trace_id else {
        return;
    };
    span.record(
        "idempotency.original_trace_id",
        tracing::field::display(trace_id),
    );
    let Some(span_id) = stored.span_id else {
        return;
    };
    span.record(
        "idempotency.original_span_id",
        tracing::field::display(span_id),
    );
    #[cfg(feature = "opentelemetry")]
    {
        use opentelemetry::trace::{SpanContext, TraceFlags, TraceState};
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        span.add_link(SpanContext::new(
            opentelemetry::trace::TraceId::from_bytes(trace_id.to_bytes()),
            opentelemetry::trace::SpanId::from_bytes(span_id.to_bytes()),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        ));
    }
}
