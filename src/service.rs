//! [`Idempotency`]: the request flow, in the order of the README's diagram.
//!
//! 1. **Admit** ([`admit`](crate::admit)): key, tenant, body, fingerprint.
//! 2. **Coalesce**: wait behind a duplicate of this process, holding nothing.
//! 3. **Claim**: the store owns the key for us, or answers for it.
//! 4. **Run the owner**: the inner service, under the handler timeout.
//! 5. **Remember**: commit the response with the handler's writes, or roll back.
//!
//! Every path ends in one [`Settled`], which is observed once and answered
//! once ([`settled`](crate::settled)).

use std::{
    fmt,
    future::{poll_fn, Future},
    marker::PhantomData,
    ops::ControlFlow,
    sync::Arc,
    task::{Context, Poll},
    time::Instant,
};

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tower_service::Service;
use tracing::{field, Instrument};

use crate::{
    admit::{admit, Admission, Admitted},
    body::{BoxError, RequestBody, ResponseBody},
    coalesce::{LeadGuard, Turn, Woken},
    endpoint::Endpoint,
    fingerprint::Fingerprinter,
    future::ResponseFuture,
    lease::{settle_long, LongRunning, ShortTransaction},
    record::{FinalResponse, Record, ResourceId, StoredResponse, IDEMPOTENT_REPLAYED},
    replay::{RebuildRequest, Rebuilder, Rebuilt},
    scope::{ResolveTenant, TenantFromExtension, TenantId},
    settled::{MiddlewareResult, Rollback, Settled, Timings},
    store::{Claim, LeaseStore, Store},
};

/// A named fault point of the request flow (feature `failpoints`, for
/// tests): fires if the request carries an `InjectFault` for it, and
/// compiles to nothing without the feature.
macro_rules! fault_point {
    ($faults:expr, $point:ident) => {
        #[cfg(feature = "failpoints")]
        crate::failpoints::InjectFault::hit($faults, crate::failpoints::FaultPoint::$point);
    };
}

/// The middleware [`IdempotencyLayer`](crate::IdempotencyLayer) produces.
///
/// The inner service receives `Request<`[`RequestBody`]`>` and must run on a
/// tokio runtime: once a request owns its key, its work is spawned so that it
/// finishes even if the client goes away.
///
/// `M` is the mode: [`ShortTransaction`] (the default) or
/// [`LongRunning`](crate::lease::LongRunning).
pub struct Idempotency<S, St, F, R = TenantFromExtension, M = ShortTransaction> {
    inner: S,
    endpoint: Endpoint<St, F, R>,
    mode: PhantomData<fn() -> M>,
}

impl<S, St, F, R, M> Idempotency<S, St, F, R, M> {
    pub(crate) fn new(inner: S, endpoint: Endpoint<St, F, R>) -> Self {
        Idempotency {
            inner,
            endpoint,
            mode: PhantomData,
        }
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

impl<S: Clone, St: Clone, F, R, M> Clone for Idempotency<S, St, F, R, M> {
    fn clone(&self) -> Self {
        Idempotency::new(self.inner.clone(), self.endpoint.clone())
    }
}

impl<S: fmt::Debug, St: fmt::Debug, F: fmt::Debug, R: fmt::Debug, M> fmt::Debug
    for Idempotency<S, St, F, R, M>
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

impl<S, St, F, R, ReqB, ResB> Service<Request<ReqB>> for Idempotency<S, St, F, R, ShortTransaction>
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
        let (endpoint, inner) = self.take_ready();
        ResponseFuture::new(Box::pin(handle(endpoint, inner, request, settle)))
    }
}

impl<S, St, F, R, ReqB, ResB> Service<Request<ReqB>> for Idempotency<S, St, F, R, LongRunning>
where
    S: Service<Request<RequestBody>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: LeaseStore,
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
        let (endpoint, inner) = self.take_ready();
        ResponseFuture::new(Box::pin(handle(endpoint, inner, request, settle_long)))
    }
}

impl<S: Clone, St: Clone, F, R, M> Idempotency<S, St, F, R, M> {
    /// The service that was driven to readiness, with a fresh clone left
    /// behind, and the endpoint.
    fn take_ready(&mut self) -> (Endpoint<St, F, R>, S) {
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        (self.endpoint.clone(), inner)
    }
}

/// The inner services the middleware wraps (an alias for their bounds).
pub(crate) trait Inner<ResB>:
    Service<
        Request<RequestBody>,
        Response = Response<ResB>,
        Future: Send + 'static,
        Error: Send + 'static,
    > + Send
    + 'static
{
}

impl<T, ResB> Inner<ResB> for T where
    T: Service<
            Request<RequestBody>,
            Response = Response<ResB>,
            Future: Send + 'static,
            Error: Send + 'static,
        > + Send
        + 'static
{
}

/// Response bodies of the inner service (an alias for their bounds).
pub(crate) trait ReplyBody:
    Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static
{
}

impl<T> ReplyBody for T where T: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static {}

/// Phase 1 (admission), then the mode's `settle` (phases 2 to 5) on a task
/// of its own, then the answer.
async fn handle<S, St, F, R, ReqB, ResB, G, Fut>(
    endpoint: Endpoint<St, F, R>,
    inner: S,
    request: Request<ReqB>,
    settle: G,
) -> MiddlewareResult<ResB, S::Error>
where
    S: Inner<ResB>,
    St: Store,
    F: Fingerprinter,
    R: ResolveTenant,
    ReqB: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
    ResB: ReplyBody,
    G: FnOnce(Endpoint<St, F, R>, S, Admitted) -> Fut,
    Fut: Future<Output = (Settled<ResB, S::Error>, Timings)> + Send + 'static,
{
    if is_safe(request.method()) {
        return pass_through(inner, request).await;
    }
    let config = endpoint.config.clone();
    let span = tracing::info_span!(
        "idempotency",
        endpoint = &*config.endpoint,
        key_hash = field::Empty,
        outcome = field::Empty,
    );
    let admitted = match admit(&endpoint, request).instrument(span.clone()).await {
        Admission::PassThrough(request) => return pass_through(inner, request).await,
        Admission::Refused(problem) => {
            let refused = Settled::Rejected(problem);
            refused.observe(&config, &span, &Timings::start(), None);
            return refused.answer(&config);
        }
        Admission::Admitted(admitted) => admitted,
    };
    let tenant = (config.tenant_label).then(|| admitted.claim.scope.tenant().as_str().to_owned());
    let rebuild_for = config
        .rebuild
        .is_some()
        .then(|| admitted.claim.scope.tenant().clone());
    // From the claim on, a connection may be inside a transaction: run to the
    // end on a task of our own, whether or not the client is still waiting.
    let running = endpoint.runtime.operations.start();
    let work = settle(endpoint, inner, admitted).instrument(span.clone());
    let (settled, timings) = match tokio::spawn(async move {
        let _running = running;
        work.await
    })
    .await
    {
        Ok(ended) => ended,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => (Settled::Cancelled, Timings::start()),
    };
    let settled = match (settled, &config.rebuild, rebuild_for) {
        (Settled::Replayed(stored), Some(rebuilder), Some(tenant)) => {
            rebuild(rebuilder, &config, tenant, stored)
                .instrument(span.clone())
                .await
        }
        (settled, ..) => settled,
    };
    settled.observe(&config, &span, &timings, tenant.as_deref());
    settled.answer(&config)
}

/// A replay of a record that names its resource, rebuilt by the
/// application's function under the first response's status; any other
/// replay as stored. Bounded by the handler timeout.
async fn rebuild<B, E>(
    rebuilder: &Rebuilder,
    config: &crate::endpoint::Config,
    tenant: TenantId,
    stored: StoredResponse,
) -> Settled<B, E> {
    let Some(resource_id) = stored.resource_id.clone() else {
        return Settled::Replayed(stored);
    };
    let request = RebuildRequest {
        tenant,
        endpoint: config.endpoint.clone(),
        resource_id: resource_id.clone(),
        status: stored.status,
    };
    match tokio::time::timeout(config.handler_timeout, rebuilder.rebuild(request)).await {
        Ok(Ok(Rebuilt::Current(mut response))) => {
            *response.status_mut() = stored.status;
            response
                .headers_mut()
                .insert(IDEMPOTENT_REPLAYED, http::HeaderValue::from_static("true"));
            Settled::Rebuilt(response)
        }
        Ok(Ok(Rebuilt::Gone)) => Settled::ResourceGone(resource_id),
        Ok(Err(e)) => Settled::RebuildFailed(e),
        Err(_) => {
            Settled::RebuildFailed("the rebuild did not finish within the handler timeout".into())
        }
    }
}

/// Phases 2 to 5 for a request that may own its key: coalesce, claim, run
/// the owner, remember. Says how the request settled.
async fn settle<S, St, F, R, ResB>(
    endpoint: Endpoint<St, F, R>,
    inner: S,
    admitted: Admitted,
) -> (Settled<ResB, S::Error>, Timings)
where
    S: Inner<ResB>,
    St: Store,
    ResB: ReplyBody,
{
    let Admitted {
        mut parts,
        body,
        mut claim,
    } = admitted;
    let config = &endpoint.config;
    let mut timings = Timings::start();
    let deadline = tokio::time::Instant::now() + config.wait;
    #[cfg(feature = "failpoints")]
    let faults: Faults = parts
        .extensions
        .get::<crate::failpoints::InjectFault>()
        .copied();
    #[cfg(not(feature = "failpoints"))]
    let faults: Faults = ();
    fault_point!(faults, BeforeClaim);

    // A retry of a record this process committed: answered from memory.
    let cache = endpoint.runtime.cache.as_ref();
    if let Some(record) = cache.and_then(|c| c.get(&claim.scope, &claim.key)) {
        timings.claimed = Some(timings.since_arrival());
        return (Coalesced::answer(&record, &claim.fingerprint), timings);
    }

    // 2. Coalesce.
    let in_process = coalesce(&endpoint, &claim, deadline).await;
    let (lead, followed) = match in_process.go_on(&claim.fingerprint, &mut timings) {
        std::ops::ControlFlow::Continue(go_on) => go_on,
        std::ops::ControlFlow::Break(settled) => return (settled, timings),
    };
    // Followers of this process answer from the record this request
    // commits or finds.
    let answered = |record: Arc<Record>| {
        if let Some(lead) = &lead {
            lead.answered(record);
        }
    };

    // 3. Claim, with what is left of the wait. Should this process freeze
    // past the handler's deadline, the database ends the claim by itself.
    claim.wait = deadline.saturating_duration_since(tokio::time::Instant::now());
    claim.hold_limit = Some(config.handler_timeout.saturating_add(HOLD_MARGIN));
    let claimed = endpoint.store.claim(&claim).await;
    timings.claimed = Some(timings.since_arrival());
    if followed || matches!(claimed, Ok(Claim::InProgress)) {
        timings.waited = timings.claimed;
    }
    let tx = match claimed {
        Ok(Claim::Owned(tx)) => tx,
        Ok(Claim::Completed(record)) => {
            let record = Arc::new(record);
            answered(record.clone());
            return (Coalesced::answer(&record, &claim.fingerprint), timings);
        }
        Ok(Claim::InProgress) => return (Settled::InProgress, timings),
        Err(e) => return (Settled::ClaimFailed(e), timings),
    };
    let held_since = Instant::now();
    fault_point!(faults, AfterClaim);

    // 4. Run the owner, under its deadline.
    parts.extensions.insert(tx.clone());
    let request = Request::from_parts(parts, RequestBody::buffered(body));
    let owner = run_owner(inner, request, config.response_body_limit);
    let ran = tokio::time::timeout(config.handler_timeout, owner)
        .await
        .unwrap_or(Err(Rollback::TimedOut));
    if ran.is_ok() {
        fault_point!(faults, AfterHandler);
    }

    // 5. Remember, or roll back. The record's retention counts from its
    // commit, so it ends no sooner than `expires`.
    let expires = std::time::Instant::now() + config.retention;
    let ended = remember(&endpoint, tx, ran, faults).await;
    if let Settled::Committed(parts, body) = &ended {
        fault_point!(faults, AfterCommit);
        let replayed = &config.replay_headers;
        let record = Arc::new(Record {
            fingerprint: claim.fingerprint,
            response: StoredResponse::remember(parts, replayed, body.clone()),
        });
        if let Some(cache) = cache {
            cache.insert(&claim.scope, &claim.key, record.clone(), expires);
        }
        answered(record);
    }
    timings.held = Some(held_since.elapsed());
    (ended, timings)
}

/// Commits the owner's response with its writes, or rolls its work back.
async fn remember<St: Store, F, R, ResB, E>(
    endpoint: &Endpoint<St, F, R>,
    tx: St::Tx,
    ran: Result<(http::response::Parts, Bytes), Rollback<ResB, E>>,
    #[cfg_attr(not(feature = "failpoints"), allow(unused_variables))] faults: Faults,
) -> Settled<ResB, E> {
    match ran {
        Ok((parts, body)) => {
            let replayed = &endpoint.config.replay_headers;
            let stored = StoredResponse::remember(&parts, replayed, body);
            fault_point!(faults, BeforeCommit);
            match endpoint.store.complete(tx, &stored).await {
                Ok(()) => Settled::Committed(parts, stored.body),
                Err(e) => Settled::CompletionFailed(e),
            }
        }
        Err(rollback) => {
            if let Err(e) = endpoint.store.abort(tx).await {
                tracing::warn!(error = %e, "rollback failed; the connection was discarded");
            }
            Settled::RolledBack(rollback)
        }
    }
}

/// The fault injected into this request, if any (feature `failpoints`).
#[cfg(feature = "failpoints")]
type Faults = Option<crate::failpoints::InjectFault>;
#[cfg(not(feature = "failpoints"))]
type Faults = ();

/// How long past the handler's deadline the database itself ends an owner's
/// transaction that went silent (its process frozen, its network gone).
const HOLD_MARGIN: std::time::Duration = std::time::Duration::from_secs(5);

/// Waits while another request of this process works on the same key, and
/// says how this request goes on.
pub(crate) async fn coalesce<St, F, R>(
    endpoint: &Endpoint<St, F, R>,
    claim: &crate::store::ClaimRequest,
    deadline: tokio::time::Instant,
) -> Coalesced {
    let mut followed = false;
    loop {
        match endpoint.runtime.in_flight.enter(&claim.scope, &claim.key) {
            Turn::Lead(guard) => return Coalesced::Lead(guard, followed),
            Turn::Follow(follower) => {
                followed = true;
                match follower.wait(deadline).await {
                    Woken::Answer(record) => return Coalesced::Answered(record),
                    // The key has a record: read it without leading.
                    Woken::Settled => return Coalesced::Read,
                    // The leader rolled back: one of us leads next.
                    Woken::Unsettled => {}
                    Woken::TimedOut => return Coalesced::TimedOut,
                }
            }
        }
    }
}

/// How a request goes on after [`coalesce`].
pub(crate) enum Coalesced {
    /// To the store, as the key's leader in this process (`true`: after
    /// waiting behind another request first).
    Lead(LeadGuard, bool),
    /// To the store, after a leader of this process settled the key.
    Read,
    /// Answered from the leader's record: no store needed.
    Answered(Arc<Record>),
    /// The wait ran out first.
    TimedOut,
}

impl Coalesced {
    /// `Continue((lead, followed))` if the request goes on to the store (as
    /// the key's leader here, or not), else `Break` with how it settled in
    /// memory, its wait recorded in `timings`.
    pub(crate) fn go_on<B, E>(
        self,
        fingerprint: &crate::fingerprint::Fingerprint,
        timings: &mut Timings,
    ) -> ControlFlow<Settled<B, E>, (Option<LeadGuard>, bool)> {
        let settled = match self {
            Coalesced::Lead(lead, followed) => {
                return ControlFlow::Continue((Some(lead), followed))
            }
            Coalesced::Read => return ControlFlow::Continue((None, true)),
            Coalesced::Answered(record) => Coalesced::answer(&record, fingerprint),
            Coalesced::TimedOut => Settled::InProgress,
        };
        timings.waited = Some(timings.since_arrival());
        timings.claimed = timings.waited;
        ControlFlow::Break(settled)
    }

    /// The record the leader handed over, compared with this request's own
    /// fingerprint: its replay, or a refusal.
    pub(crate) fn answer<B, E>(
        record: &Record,
        fingerprint: &crate::fingerprint::Fingerprint,
    ) -> Settled<B, E> {
        if record.fingerprint == *fingerprint {
            Settled::Replayed(record.response.clone())
        } else {
            Settled::KeyReused
        }
    }
}

/// Calls the inner service and buffers a response to remember: the part of
/// the owner's work the handler timeout bounds.
pub(crate) async fn run_owner<S, ResB>(
    inner: S,
    request: Request<RequestBody>,
    body_limit: usize,
) -> Result<(http::response::Parts, Bytes), Rollback<ResB, S::Error>>
where
    S: Service<Request<RequestBody>, Response = Response<ResB>>,
    ResB: ReplyBody,
{
    let response = call_inner(inner, request)
        .await
        .map_err(Rollback::ServiceFailed)?;
    if !is_remembered(&response) {
        return Err(Rollback::NotRemembered(response));
    }
    let (parts, body) = response.into_parts();
    if parts
        .extensions
        .get::<ResourceId>()
        .is_some_and(|id| !id.is_storable())
    {
        return Err(Rollback::Unstorable(
            "the resource id is empty, longer than 255 bytes or has control characters",
        ));
    }
    match Limited::new(body, body_limit).collect().await {
        Ok(collected) => Ok((parts, collected.to_bytes())),
        Err(e) if e.is::<LengthLimitError>() => Err(Rollback::Unstorable(
            "the response body is over the stored-response limit",
        )),
        Err(_) => Err(Rollback::Unstorable("the response body failed")),
    }
}

async fn pass_through<S, ReqB, ResB>(
    inner: S,
    request: Request<ReqB>,
) -> MiddlewareResult<ResB, S::Error>
where
    S: Service<Request<RequestBody>, Response = Response<ResB>>,
    ReqB: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
{
    let response = call_inner(inner, request.map(RequestBody::streaming)).await?;
    Ok(response.map(ResponseBody::inner))
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
