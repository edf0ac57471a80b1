//! [`Idempotency`]: the request flow.

use std::{
    fmt,
    future::poll_fn,
    sync::Arc,
    task::{Context, Poll},
    time::Instant,
};

use bytes::Bytes;
use http::{header, request::Parts, Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tower_service::Service;
use tracing::{field, Instrument};

use crate::{
    body::{BoxError, RequestBody, ResponseBody},
    coalesce::{Turn, Woken},
    fingerprint::Fingerprinter,
    future::ResponseFuture,
    key::{IdempotencyKey, KeyError},
    layer::{Config, IdempotencyLayer},
    metrics::{self, Outcome},
    problem::{codes, Problem},
    record::{FinalResponse, StoredResponse},
    scope::{ResolveTenant, Scope, TenantFromExtension},
    store::{Claim, ClaimRequest, Store, StoreError, StoreErrorKind},
};

/// The middleware [`IdempotencyLayer`] produces.
///
/// The inner service receives `Request<`[`RequestBody`]`>` and must run on a
/// tokio runtime: once a request owns its key, its work is spawned so that it
/// finishes even if the client goes away.
pub struct Idempotency<S, St, F, R = TenantFromExtension> {
    inner: S,
    layer: IdempotencyLayer<St, F, R>,
}

impl<S, St, F> Idempotency<S, St, F, TenantFromExtension>
where
    St: Store,
    F: Fingerprinter,
{
    /// An [`IdempotencyLayer`] (same arguments as [`IdempotencyLayer::new`]).
    pub fn layer(
        store: St,
        endpoint: impl Into<Arc<str>>,
        fingerprinter: F,
    ) -> IdempotencyLayer<St, F, TenantFromExtension> {
        IdempotencyLayer::new(store, endpoint, fingerprinter)
    }
}

impl<S, St, F, R> Idempotency<S, St, F, R> {
    pub(crate) fn from_layer(inner: S, layer: IdempotencyLayer<St, F, R>) -> Self {
        Idempotency { inner, layer }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes the middleware, returning the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, St: Clone, F, R> Clone for Idempotency<S, St, F, R> {
    fn clone(&self) -> Self {
        Idempotency {
            inner: self.inner.clone(),
            layer: self.layer.clone(),
        }
    }
}

impl<S: fmt::Debug, St: fmt::Debug, F: fmt::Debug, R: fmt::Debug> fmt::Debug
    for Idempotency<S, St, F, R>
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("layer", &self.layer)
            .finish()
    }
}

impl<S, St, F, R, ReqB, ResB> Service<Request<ReqB>> for Idempotency<S, St, F, R>
where
    S: Service<Request<RequestBody>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Store,
    F: Fingerprinter,
    R: ResolveTenant,
    ReqB: Body<Data = Bytes> + Send + 'static,
    ReqB::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = S::Error;
    type Future = ResponseFuture<ResB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqB>) -> Self::Future {
        // Keep the service that was driven to readiness; leave a fresh clone behind.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let layer = self.layer.clone();
        ResponseFuture::new(Box::pin(handle(layer, inner, request)))
    }
}

type Answer<B, E> = Result<Response<ResponseBody<B>>, E>;

fn problem_response<B>(problem: &Problem) -> Response<ResponseBody<B>> {
    problem.to_response().map(ResponseBody::buffered)
}

async fn call_inner<S, ResB>(
    mut inner: S,
    request: Request<RequestBody>,
) -> Result<Response<ResB>, S::Error>
where
    S: Service<Request<RequestBody>, Response = Response<ResB>>,
{
    poll_fn(|cx| inner.poll_ready(cx)).await?;
    inner.call(request).await
}

/// Everything before ownership: cheap checks, buffering, fingerprinting.
async fn handle<S, St, F, R, ReqB, ResB>(
    layer: IdempotencyLayer<St, F, R>,
    inner: S,
    request: Request<ReqB>,
) -> Answer<ResB, S::Error>
where
    S: Service<Request<RequestBody>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Store,
    F: Fingerprinter,
    R: ResolveTenant,
    ReqB: Body<Data = Bytes> + Send + 'static,
    ReqB::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let config = &layer.config;
    let passthrough = |request: Request<ReqB>, inner: S| async move {
        let response = call_inner(inner, request.map(RequestBody::streaming)).await?;
        Ok(response.map(ResponseBody::inner))
    };
    if is_safe(request.method()) {
        return passthrough(request, inner).await;
    }
    let span = tracing::info_span!(
        "idempotency",
        endpoint = &*config.endpoint,
        key_hash = field::Empty,
        outcome = field::Empty,
    );
    let reject = |problem: Problem| {
        tracing::debug!(parent: &span, code = problem.code(), "request refused before claiming a key");
        span.record("outcome", Outcome::Rejected.as_str());
        metrics::request(&config.endpoint, Outcome::Rejected, None);
        Ok(problem_response(&problem))
    };

    let key = match parse_key(config, &request) {
        Ok(Some(key)) => key,
        Ok(None) => return passthrough(request, inner).await,
        Err(problem) => return reject(problem),
    };
    span.record("key_hash", key.short_hash());
    let (mut parts, body) = request.into_parts();
    let Some(tenant) = layer.resolver.resolve(&parts) else {
        tracing::warn!(parent: &span, "no authenticated tenant for an idempotent request; refusing (fail closed)");
        return reject(Problem::new(
            StatusCode::UNAUTHORIZED,
            codes::UNAUTHORIZED,
            "No authenticated tenant",
        ));
    };
    let bytes = match read_body(config, &parts, body).await {
        Ok(bytes) => bytes,
        Err(problem) => return reject(problem),
    };
    let fingerprint = match layer.fingerprinter.fingerprint(&mut parts, &bytes) {
        Ok(fingerprint) => {
            let target = parts.uri.path_and_query().map_or("/", |t| t.as_str());
            fingerprint.for_target(&parts.method, target)
        }
        Err(problem) => return reject(problem),
    };
    let claim = ClaimRequest::new(
        Scope::new(tenant, config.endpoint.clone()),
        key,
        fingerprint,
        config.retention,
        config.wait,
    );

    // From the claim on, a connection may be inside a transaction: run to the
    // end on our own task, whether or not the client is still waiting.
    let running = layer.operations.start();
    let tenant_label = config
        .tenant_label
        .then(|| claim.scope.tenant().as_str().to_owned());
    let work = own(layer.clone(), inner, parts, bytes, claim).instrument(span.clone());
    let owned = tokio::spawn(async move {
        let _running = running;
        work.await
    });
    let (outcome, answer) = match owned.await {
        Ok(settled) => settled,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => {
            let problem = store_unavailable("the request was cancelled by a runtime shutdown");
            (Outcome::StoreUnavailable, Ok(problem_response(&problem)))
        }
    };
    // The one place an owned request is counted.
    span.record("outcome", outcome.as_str());
    metrics::request(&config.endpoint, outcome, tenant_label.as_deref());
    answer
}

/// Coalesces, claims, runs the owner and remembers its answer; says how the
/// request ended along with the answer, for the caller to count once.
async fn own<S, St, F, R, ResB>(
    layer: IdempotencyLayer<St, F, R>,
    inner: S,
    mut parts: Parts,
    bytes: Bytes,
    claim: ClaimRequest,
) -> (Outcome, Answer<ResB, S::Error>)
where
    S: Service<Request<RequestBody>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    St: Store,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let config = &layer.config;
    let endpoint = &*config.endpoint;
    let arrived = Instant::now();
    // Counted once, however many times the request waited.
    let waited = |why: &'static str| {
        let waited = arrived.elapsed();
        metrics::duplicate_wait(endpoint, waited.as_secs_f64());
        tracing::info!(waited_ms = waited.as_millis() as u64, "{why}");
    };
    // Duplicates of a key this process is already working on wait here,
    // holding no connection, then ask the store with what is left of the wait.
    let deadline = tokio::time::Instant::now() + config.wait;
    let mut followed = false;
    let lead = loop {
        match layer.in_flight.enter(&claim.scope, &claim.key) {
            Turn::Lead(guard) => break Some(guard),
            Turn::Follow(follower) => {
                followed = true;
                match follower.wait(deadline).await {
                    // The key has a record: read it without leading.
                    Woken::Settled => break None,
                    // The leader rolled back: one of us leads next.
                    Woken::Unsettled => continue,
                    Woken::TimedOut => {
                        waited("key still in progress after the wait");
                        metrics::claim_duration(
                            endpoint,
                            Outcome::InProgress,
                            arrived.elapsed().as_secs_f64(),
                        );
                        return (Outcome::InProgress, Ok(problem_response(&in_progress())));
                    }
                }
            }
        }
    };
    let settled = || {
        if let Some(lead) = &lead {
            lead.settled();
        }
    };
    let mut claim = claim;
    claim.wait = deadline.saturating_duration_since(tokio::time::Instant::now());
    // The server ends the claim's transaction by itself should this process
    // freeze past the handler's deadline.
    claim.hold_limit = Some(config.handler_timeout.saturating_add(HOLD_MARGIN));
    let claimed = layer.store.claim(&claim).await;
    let claim_outcome = match &claimed {
        Ok(Claim::Owned(_)) => Outcome::New,
        Ok(Claim::Completed(record)) if record.fingerprint == claim.fingerprint => {
            Outcome::Replayed
        }
        Ok(Claim::Completed(_)) => Outcome::KeyReused,
        Ok(Claim::InProgress) => Outcome::InProgress,
        Err(_) => Outcome::StoreUnavailable,
    };
    metrics::claim_duration(endpoint, claim_outcome, arrived.elapsed().as_secs_f64());
    if followed && claim_outcome != Outcome::InProgress {
        waited("waited for a concurrent duplicate in this process");
    }
    let tx = match claimed {
        Ok(Claim::Owned(tx)) => tx,
        Ok(Claim::Completed(record)) if record.fingerprint == claim.fingerprint => {
            settled();
            tracing::info!("replaying the completed response");
            let replay = record.response.to_replay().map(ResponseBody::buffered);
            return (Outcome::Replayed, Ok(replay));
        }
        Ok(Claim::Completed(_)) => {
            settled();
            tracing::info!("key reused with a different request; refused");
            return (
                Outcome::KeyReused,
                Ok(problem_response(&key_reused(config))),
            );
        }
        Ok(Claim::InProgress) => {
            waited("key still in progress after the wait");
            return (Outcome::InProgress, Ok(problem_response(&in_progress())));
        }
        Err(e) => {
            tracing::error!(error = %e, "claim failed");
            let problem = store_unavailable("the idempotency store is unavailable");
            return (Outcome::StoreUnavailable, Ok(problem_response(&problem)));
        }
    };
    tracing::debug!("claimed the key");
    let held_since = Instant::now();
    parts.extensions.insert(tx.clone());
    let request = Request::from_parts(parts, RequestBody::buffered(bytes));
    let ran = tokio::time::timeout(
        config.handler_timeout,
        run_owner(inner, request, config.response_body_limit),
    )
    .await;
    let held = || metrics::key_held(endpoint, held_since.elapsed().as_secs_f64());
    let rollback = |reason: &'static str| {
        let (store, tx) = (layer.store.clone(), tx.clone());
        async move {
            if let Err(e) = store.abort(tx).await {
                tracing::warn!(error = %e, "rollback failed; the connection was discarded");
            }
            tracing::info!(reason, "rolled back; the key is free again");
            held();
        }
    };
    let (response_parts, stored_body) = match ran {
        Err(_elapsed) => {
            rollback("the handler did not finish within its deadline").await;
            metrics::handler_timeout(endpoint);
            return (
                Outcome::RolledBack,
                Ok(problem_response(&handler_timeout(config))),
            );
        }
        Ok(Ran::Failed(e)) => {
            rollback("the service failed").await;
            return (Outcome::RolledBack, Err(e));
        }
        Ok(Ran::NotRemembered(response)) => {
            rollback("the response is not remembered").await;
            return (Outcome::RolledBack, Ok(response.map(ResponseBody::inner)));
        }
        Ok(Ran::Unstorable(reason)) => {
            rollback(reason).await;
            let problem = Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                codes::RESPONSE_NOT_STORABLE,
                "The response could not be remembered; nothing was changed",
            );
            return (Outcome::RolledBack, Ok(problem_response(&problem)));
        }
        Ok(Ran::Remember(parts, body)) => (parts, body),
    };
    let stored = StoredResponse::new(
        response_parts.status,
        &response_parts.headers,
        &config.replay_headers,
        stored_body,
    );
    let completed = layer.store.complete(tx, &stored).await;
    held();
    match completed {
        Ok(()) => {
            settled();
            tracing::info!(
                status = stored.status.as_u16(),
                "committed the response with the handler's writes"
            );
            let body = ResponseBody::buffered(stored.body);
            (Outcome::New, Ok(Response::from_parts(response_parts, body)))
        }
        Err(e) => {
            let (outcome, problem) = completion_failed(&e);
            (outcome, Ok(problem_response(&problem)))
        }
    }
}

/// How long past the handler's deadline the database itself ends an owner's
/// transaction that went silent (its process frozen, its network gone).
const HOLD_MARGIN: std::time::Duration = std::time::Duration::from_secs(5);

/// What the owner's handler produced.
enum Ran<ResB, E> {
    /// A response to remember: its parts and its buffered body.
    Remember(http::response::Parts, Bytes),
    /// A response that is passed on and rolled back (5xx, unmarked 4xx).
    NotRemembered(Response<ResB>),
    /// A response to remember whose body could not be buffered.
    Unstorable(&'static str),
    /// The service failed.
    Failed(E),
}

/// Calls the handler and buffers what is to be remembered: the part of the
/// owner's work the handler's deadline bounds.
async fn run_owner<S, ResB>(
    inner: S,
    request: Request<RequestBody>,
    body_limit: usize,
) -> Ran<ResB, S::Error>
where
    S: Service<Request<RequestBody>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes>,
    ResB::Error: Into<BoxError>,
{
    let response = match call_inner(inner, request).await {
        Ok(response) => response,
        Err(e) => return Ran::Failed(e),
    };
    if !is_remembered(&response) {
        return Ran::NotRemembered(response);
    }
    let (parts, body) = response.into_parts();
    match Limited::new(body, body_limit).collect().await {
        Ok(collected) => Ran::Remember(parts, collected.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => {
            Ran::Unstorable("the response body is over the stored-response limit")
        }
        Err(_) => Ran::Unstorable("the response body failed"),
    }
}

/// The answer and the outcome for a completion that failed; see
/// [`StoreErrorKind`] for what each kind means.
fn completion_failed(error: &StoreError) -> (Outcome, Problem) {
    match error.kind() {
        StoreErrorKind::OutcomeUnknown => {
            tracing::error!(error = %error, "the connection was lost while committing: the outcome is unknown; a retry with the same key finds out");
            (
                Outcome::StoreUnavailable,
                store_unavailable(
                    "the commit's outcome is unknown; retry with the same key to learn it",
                ),
            )
        }
        StoreErrorKind::TransactionAborted => {
            tracing::error!(error = %error, "the database refused to commit the handler's writes; rolled back");
            let problem = Problem::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                codes::COMMIT_REJECTED,
                "The database refused to commit this request's changes; nothing was changed",
            )
            .with_detail("retrying the same request fails the same way");
            (Outcome::RolledBack, problem)
        }
        StoreErrorKind::Conflict => {
            tracing::warn!(error = %error, "the commit conflicted with a concurrent transaction; rolled back");
            (
                Outcome::RolledBack,
                store_unavailable(
                    "the transaction conflicted with a concurrent one and was rolled back",
                ),
            )
        }
        _ => {
            tracing::error!(error = %error, "commit failed; the handler's writes were rolled back");
            (
                Outcome::StoreUnavailable,
                store_unavailable("the transaction could not be committed"),
            )
        }
    }
}

fn is_safe(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    )
}

/// 2xx, and any non-5xx the handler marked as a final answer.
fn is_remembered<B>(response: &Response<B>) -> bool {
    let status = response.status();
    status.is_success()
        || (!status.is_server_error() && response.extensions().get::<FinalResponse>().is_some())
}

fn parse_key<B>(config: &Config, request: &Request<B>) -> Result<Option<IdempotencyKey>, Problem> {
    let mut values = request.headers().get_all(&config.header).iter();
    let invalid = |e: KeyError| {
        Problem::new(
            StatusCode::BAD_REQUEST,
            codes::KEY_INVALID,
            "The idempotency key is not valid",
        )
        .with_detail(e.to_string())
    };
    match (values.next(), values.next()) {
        (None, _) if config.key_required => Err(Problem::new(
            StatusCode::BAD_REQUEST,
            codes::KEY_MISSING,
            "An idempotency key is required",
        )
        .with_detail(format!(
            "send a unique `{}` header with this request",
            config.header
        ))),
        (None, _) => Ok(None),
        (Some(_), Some(_)) => Err(invalid(KeyError::Repeated)),
        (Some(value), None) => match IdempotencyKey::parse(value.as_bytes()) {
            Ok(key) if key.as_str().len() > config.max_key_len => Err(invalid(KeyError::TooLong)),
            Ok(key) => Ok(Some(key)),
            Err(e) => Err(invalid(e)),
        },
    }
}

/// Buffers the body under the limit. An over-long body is still read (and
/// discarded) up to [`DRAIN_LIMIT`] so that an HTTP/1 client, which sends its
/// whole body before it reads, sees the 413 instead of a broken pipe.
async fn read_body<B>(config: &Config, parts: &Parts, body: B) -> Result<Bytes, Problem>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let limit = config.request_body_limit;
    let too_large = || {
        Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            codes::PAYLOAD_TOO_LARGE,
            "The request body is too large",
        )
        .with_detail(format!("the limit is {limit} bytes"))
    };
    let unreadable = || {
        Problem::new(
            StatusCode::BAD_REQUEST,
            codes::BODY_UNREADABLE,
            "The request body could not be read",
        )
    };
    let drain_limit = limit.saturating_add(DRAIN_LIMIT) as u64;
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > drain_limit) {
        return Err(too_large());
    }
    let mut body = std::pin::pin!(body);
    let mut buffered = bytes::BytesMut::new();
    let mut seen: u64 = 0;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|_| unreadable())?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        seen += data.len() as u64;
        if seen > drain_limit {
            break;
        }
        if seen <= limit as u64 {
            buffered.extend_from_slice(&data);
        }
    }
    if seen > limit as u64 {
        return Err(too_large());
    }
    Ok(buffered.freeze())
}

/// How far past the request body limit an over-long body is read and discarded.
const DRAIN_LIMIT: usize = 1024 * 1024;

fn key_reused(config: &Config) -> Problem {
    Problem::new(
        config.key_reuse.status(),
        codes::KEY_REUSED,
        "This idempotency key was already used for a different request",
    )
    .with_detail("use a new key for a new request; the first request's result is unchanged")
}

fn in_progress() -> Problem {
    Problem::new(
        StatusCode::CONFLICT,
        codes::IN_PROGRESS,
        "A request with this idempotency key is still in progress",
    )
    .with_detail("retry after a moment to get its result")
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

fn store_unavailable(detail: &str) -> Problem {
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        codes::STORE_UNAVAILABLE,
        "The idempotency store is unavailable; retry with the same key",
    )
    .with_detail(detail)
    .with_retry_after(1)
}
