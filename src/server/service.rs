//! [`Idempotency`]: the middleware, with one `Service` impl for every mode.
//!
//! 1. **Admit** (`admit`): key, tenant, body, fingerprint.
//! 2. to 5. **The mode's flow** ([`Mode`]): coalesce, claim, run the owner,
//!    remember (`one_transaction`), or acquire, run under a lease, finish
//!    (`long_running`), on a task of its own.
//! 6. Every path ends in one [`Settled`], which is observed once and
//!    answered once (`settled`).

use std::{
    fmt,
    sync::Arc,
    task::{Context, Poll},
};

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body::Body;
use tower_service::Service;
use tracing::{field, Instrument};

use super::{
    admit::{admit, Admission, Admitted},
    body::{BoxError, RequestBody, ResponseBody},
    coalesce::Coalesced,
    endpoint::{Config, Paths, Setup},
    flow::Mode,
    future::ResponseFuture,
    inner::{Inner, InnerBody},
    mode::ClaimFirst,
    owner::call_inner,
    replay::{RebuildRequest, Rebuilder, Rebuilt},
    settled::{MiddlewareResult, Settled, Timings},
};
use crate::{
    fingerprint::{Fingerprint, Fingerprinter},
    record::{Record, StoredResponse, IDEMPOTENT_REPLAYED},
    scope::{ResolveTenant, TenantFromExtension, TenantId},
    store::Store,
};

/// The middleware [`IdempotencyLayer`](crate::IdempotencyLayer) produces.
///
/// The inner service receives `Request<`[`RequestBody`]`>` and must run on a
/// tokio runtime: once a request owns its key, its work is spawned so that it
/// finishes even if the client goes away.
///
/// `M` is the mode: [`ClaimFirst`] (the default) or
/// [`LongRunning`](crate::lease::LongRunning).
pub struct Idempotency<S, St, F, R = TenantFromExtension, M = ClaimFirst> {
    inner: S,
    setup: Setup<St, F, R, M>,
    /// Made by [`OnPaths`](crate::OnPaths): the setup of each guarded path,
    /// whose endpoint is the path without its `/`; any other path passes
    /// through. `None`: every request is `setup`'s endpoint.
    paths: Option<Paths<St, F, R, M>>,
}

impl<S, St, F, R, M> Idempotency<S, St, F, R, M> {
    pub(crate) fn new(inner: S, setup: Setup<St, F, R, M>) -> Self {
        Idempotency {
            inner,
            setup,
            paths: None,
        }
    }

    pub(crate) fn on_paths(inner: S, setup: Setup<St, F, R, M>, paths: Paths<St, F, R, M>) -> Self {
        Idempotency {
            inner,
            setup,
            paths: Some(paths),
        }
    }

    crate::macros::define_inner_service_accessors!();
}

impl<S: Clone, St: Clone, F, R, M: Clone> Clone for Idempotency<S, St, F, R, M> {
    fn clone(&self) -> Self {
        Idempotency {
            inner: self.inner.clone(),
            setup: self.setup.clone(),
            paths: self.paths.clone(),
        }
    }
}

impl<S: fmt::Debug, St: fmt::Debug, F: fmt::Debug, R: fmt::Debug, M: fmt::Debug> fmt::Debug
    for Idempotency<S, St, F, R, M>
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .field("setup", &self.setup)
            .field("paths", &self.paths)
            .finish()
    }
}

impl<S, St, F, R, M, ReqB, ResB> Service<Request<ReqB>> for Idempotency<S, St, F, R, M>
where
    S: Service<Request<RequestBody>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: Store,
    F: Fingerprinter,
    R: ResolveTenant,
    M: Mode<St>,
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
        // The service that was driven to readiness, with a fresh clone left
        // behind.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let setup = match &self.paths {
            None => self.setup.clone(),
            Some(paths) => match paths.find(request.uri().path()) {
                Some(setup) => setup.clone(),
                None => return ResponseFuture::new(Box::pin(pass_through(inner, request))),
            },
        };
        ResponseFuture::new(Box::pin(handle(setup, inner, request)))
    }
}

/// Phase 1 (admission), then the mode's flow (phases 2 to 5) on a task of
/// its own, then the answer.
async fn handle<S, St, F, R, M, ReqB, ResB>(
    setup: Setup<St, F, R, M>,
    inner: S,
    request: Request<ReqB>,
) -> MiddlewareResult<ResB, S::Error>
where
    S: Inner<ResB>,
    St: Store,
    F: Fingerprinter,
    R: ResolveTenant,
    M: Mode<St>,
    ReqB: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
    ResB: InnerBody,
{
    if is_safe(request.method()) {
        return pass_through(inner, request).await;
    }
    let config = setup.config.clone();
    let grpc = is_grpc(request.headers());
    let span = tracing::info_span!(
        "idempotency",
        idempotency.endpoint = &*config.endpoint,
        idempotency.key_hash = field::Empty,
        idempotency.outcome = field::Empty,
        idempotency.original_trace_id = field::Empty,
        idempotency.original_span_id = field::Empty,
        otel.status_code = field::Empty,
        error.type = field::Empty,
    );
    let admitted = match admit(&setup, request).instrument(span.clone()).await {
        Admission::PassThrough(request) => return pass_through(inner, request).await,
        Admission::Refused(problem) => {
            let refused = Settled::Rejected(problem);
            refused.observe(&config, &span, &Timings::start(), None);
            return refused.answer(&config, grpc);
        }
        // A retry of a record this process committed, answered from memory
        // on the caller's task: a hit owns nothing (no key, no connection),
        // so nothing has to outlive the client, and nothing is spawned.
        Admission::Cached(record, fingerprint, tenant) => {
            Route::FromCache(record, fingerprint, tenant)
        }
        Admission::Admitted(admitted) => Route::Flow(admitted),
    };
    let tenant_id = match &admitted {
        Route::Flow(admitted) => admitted.claim.scope.tenant(),
        Route::FromCache(_, _, tenant) => tenant,
    };
    let tenant = (config.tenant_label).then(|| tenant_id.as_str().to_owned());
    let rebuild_for = config.rebuild.is_some().then(|| tenant_id.clone());
    let (settled, timings, observed) = match admitted {
        Route::FromCache(record, fingerprint, _) => {
            let mut timings = Timings::start();
            timings.claimed = Some(timings.since_arrival());
            let settled = Coalesced::answer(&record, &fingerprint);
            (settled, timings, false)
        }
        Route::Flow(admitted) => {
            // From the claim on, a connection may be inside a transaction:
            // run to the end on a task of our own, whether or not the client
            // is still waiting. The task also counts how the request settled,
            // so that a request whose client went away is counted too; a
            // replay to rebuild is counted once rebuilt, for the client that
            // waits for it.
            let running = setup.shared.drain.start();
            // Boxed where it is made: the work is a large future, and moved
            // by value into the task it would be copied whole at every step
            // on the way (the span's wrapper, the task's closure, the spawn,
            // the task's cell).
            let work = Box::pin(M::run(setup, inner, admitted)).instrument(span.clone());
            let counted = (config.clone(), span.clone(), tenant.clone());
            let rebuilds = rebuild_for.is_some();
            match tokio::spawn(async move {
                let _running = running;
                let (settled, timings) = work.await;
                let observed = !(rebuilds && matches!(settled, Settled::Replayed(_)));
                if observed {
                    let (config, span, tenant) = counted;
                    settled.observe(&config, &span, &timings, tenant.as_deref());
                }
                (settled, timings, observed)
            })
            .await
            {
                Ok(ended) => ended,
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Err(_) => (Settled::Cancelled, Timings::start(), false),
            }
        }
    };
    let settled = match (settled, &config.rebuild, rebuild_for) {
        (Settled::Replayed(stored), Some(rebuilder), Some(tenant)) => {
            rebuild(rebuilder, &config, tenant, stored)
                .instrument(span.clone())
                .await
        }
        (settled, ..) => settled,
    };
    if !observed {
        settled.observe(&config, &span, &timings, tenant.as_deref());
    }
    settled.answer(&config, grpc)
}

/// Where an admitted request goes: answered from the replay cache, or
/// through the mode's flow. Held for one `match` on the way: boxing the
/// larger variant would cost an allocation a request.
#[allow(clippy::large_enum_variant)]
enum Route {
    FromCache(Arc<Record>, Fingerprint, TenantId),
    Flow(Admitted),
}

/// A gRPC request (`application/grpc`, `application/grpc+proto`, …): the
/// layer's own answers go back as gRPC statuses.
fn is_grpc(headers: &http::HeaderMap) -> bool {
    crate::classify::grpc_content(headers) == Some(crate::classify::GrpcContent::Grpc)
}

/// A replay of a record that names its resource, rebuilt by the
/// application's function under the first response's status; any other
/// replay as stored. Bounded by the handler timeout.
async fn rebuild<B, E>(
    rebuilder: &Rebuilder,
    config: &Config,
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

fn is_safe(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    )
}
