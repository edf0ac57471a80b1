//! [`Recovery`]: re-drives long-running operations that nobody retries.

use std::{fmt, future::Future, pin::Pin};

use http::{Request, Response};
use tower_service::Service;
use tracing::Instrument;

use super::{
    body::{BoxError, RequestBody},
    endpoint::Setup,
    long_running::{drive, fail_for_good, spawn_work, Attempt, Driven},
    mode::LongRunning,
};
use crate::{
    fingerprint::Fingerprinter,
    metrics,
    store::{LeaseStore, Recovered, StoreError},
};

/// Re-drives a long-running endpoint's operations whose lease expired with
/// nobody retrying: their owner crashed or stalled, and their client gave up.
///
/// Built by [`IdempotencyLayer::recovery`](crate::IdempotencyLayer::recovery)
/// from the layer and the service it wraps (without the layer). Run one in
/// every instance, like the outbox relay: each operation is taken over by
/// one worker only ([`LeaseStore::recover`] skips those another worker is
/// taking over), under a new, larger token, and its work runs as on a
/// takeover by a request: heartbeats, fenced writes, the answer stored by a
/// compare-and-swap, for the client's next retry or the status resource.
///
/// The re-driven request is rebuilt from what the record stores: method,
/// path and query, `Content-Type` and body, with the tenant as a
/// [`TenantId`](crate::scope::TenantId) extension and the lease handle, and
/// the endpoint's fingerprinter runs again so that its validated value is in
/// the extensions too. What the handler must do to be re-drivable is in the
/// [long-running guide](crate::guide::long_running).
///
/// ```no_run
/// # async fn run(layer: tower_idempotency::IdempotencyLayer<tower_idempotency::postgres::PgStore, tower_idempotency::fingerprint::JsonFingerprinter, tower_idempotency::scope::TenantFromExtension, tower_idempotency::lease::LongRunning>, handler: axum::Router) {
/// let recovery = layer.recovery(handler);
/// tokio::spawn(recovery.run(async { /* shutdown signal */ }));
/// # }
/// ```
pub struct Recovery<S, St, F, R> {
    inner: S,
    setup: Setup<St, F, R, LongRunning>,
}

impl<S: fmt::Debug, St: fmt::Debug, F: fmt::Debug, R: fmt::Debug> fmt::Debug
    for Recovery<S, St, F, R>
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Recovery")
            .field("inner", &self.inner)
            .field("setup", &self.setup)
            .finish()
    }
}

impl<S, St, F, R> Recovery<S, St, F, R> {
    pub(crate) fn new(inner: S, setup: Setup<St, F, R, LongRunning>) -> Self {
        Recovery { inner, setup }
    }
}

impl<S, St, F, R, ResB> Recovery<S, St, F, R>
where
    S: Service<Request<RequestBody>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: LeaseStore,
    F: Fingerprinter,
    ResB: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    /// Takes over every operation whose lease has expired and re-drives
    /// each on a task of its own; resolves once they have all ended, with
    /// how many there were.
    pub async fn run_once(&self) -> Result<usize, StoreError> {
        let mut driven = tokio::task::JoinSet::new();
        loop {
            let Some(recovered) = self.take_over().await? else {
                break;
            };
            driven.spawn(self.redrive(recovered));
        }
        let count = driven.len();
        while driven.join_next().await.is_some() {}
        Ok(count)
    }

    /// Runs until `shutdown` resolves: takes over due operations as they
    /// come, and looks again every
    /// [`recovery_interval`](super::LeaseConfig::recovery_interval) when
    /// there are none. A takeover under way when `shutdown` resolves is
    /// finished and handed to its work first. Re-driven work that is still
    /// running at shutdown runs on (also an operation ended failed because
    /// its request no longer validates);
    /// [`IdempotencyLayer::drained`](crate::IdempotencyLayer::drained)
    /// waits for it.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) {
        let interval = self.setup.mode.config.recovery_interval;
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            // Shutdown is looked at between takeovers, never raced against
            // one: a takeover dropped after it committed would leave its
            // operation under a lease nobody runs, an attempt used up.
            tokio::select! {
                biased;
                () = &mut shutdown => return,
                () = std::future::ready(()) => {}
            }
            match self.take_over().await {
                Ok(Some(recovered)) => {
                    tokio::spawn(self.redrive(recovered));
                    continue;
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(error = %e, "recovery could not look for expired leases"),
            }
            tokio::select! {
                () = &mut shutdown => return,
                () = tokio::time::sleep(interval) => {}
            }
        }
    }

    async fn take_over(&self) -> Result<Option<Recovered<St::Lease>>, StoreError> {
        let lease = self.setup.mode.config.lease;
        let backoff = self.setup.mode.config.backoff;
        self.setup
            .store
            .recover(
                &self.setup.config.endpoint,
                lease,
                self.setup.retention(),
                backoff,
            )
            .await
    }

    /// The re-driven work of one recovered operation, counted as running
    /// for [`drained`](crate::IdempotencyLayer::drained). A stored request
    /// that can no longer be rebuilt (it no longer validates) can never
    /// run: the operation ends failed.
    fn redrive(&self, recovered: Recovered<St::Lease>) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        let Recovered {
            owned,
            scope,
            request,
        } = recovered;
        let config = self.setup.config.clone();
        let store = self.setup.store.clone();
        let span = tracing::info_span!(
            "idempotency_recovery",
            idempotency.endpoint = &*config.endpoint,
            idempotency.operation_id = %owned.operation_id,
            idempotency.fencing_token = owned.token,
            idempotency.attempt = owned.attempt,
        );
        let _entered = span.enter();
        metrics::lease_takeover(&config.endpoint, metrics::TakeoverBy::Recovery);
        let mut builder = Request::builder()
            .method(request.method)
            .uri(request.target.as_str());
        for (name, value) in request.headers {
            builder = builder.header(name, value);
        }
        let rebuilt = builder
            .body(RequestBody::buffered(request.body.clone()))
            .map_err(|e| e.to_string())
            .and_then(|rebuilt| {
                let (mut parts, body) = rebuilt.into_parts();
                parts.extensions.insert(scope.tenant().clone());
                // Validated as at admission: from the message, decompressed.
                let message = super::admit::message_view(
                    config.request_body_limit,
                    &parts.headers,
                    &request.body,
                );
                match message
                    .and_then(|message| self.setup.fingerprinter.fingerprint(&mut parts, &message))
                {
                    Ok(_) => Ok(Request::from_parts(parts, body)),
                    Err(problem) => Err(format!(
                        "the stored request no longer validates ({})",
                        problem.code()
                    )),
                }
            });
        let mut rebuilt = match rebuilt {
            Ok(rebuilt) => rebuilt,
            Err(reason) => {
                tracing::error!(reason, "cannot re-drive an operation; it ends failed");
                let lease = owned.lease;
                let attempts = owned.attempt.saturating_sub(1);
                // Running until it has failed the operation, for `drained`.
                let running = self.setup.shared.drain.start();
                return Box::pin(
                    async move {
                        let _: Driven<ResB, S::Error> =
                            fail_for_good(&store, &lease, &config, attempts).await;
                        drop(running);
                    }
                    .instrument(span.clone()),
                );
            }
        };
        rebuilt.extensions_mut().insert(owned.lease.clone());
        tracing::info!("re-driving an operation whose lease expired");
        let running = self.setup.shared.drain.start();
        let endpoint = config.endpoint.clone();
        let work = drive(
            store,
            config,
            self.setup.mode.config.clone(),
            self.inner.clone(),
            rebuilt,
            Attempt {
                lease: owned.lease,
                number: owned.attempt,
                by: metrics::TakeoverBy::Recovery,
            },
        );
        let done = spawn_work(work.instrument(span.clone()), running);
        Box::pin(
            async move {
                if let Ok(Driven::Completed(..)) = done.await {
                    metrics::recovered(&endpoint);
                }
            }
            .instrument(span.clone()),
        )
    }
}
