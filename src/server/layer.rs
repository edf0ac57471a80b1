//! [`IdempotencyLayer`]: configuration and builder methods, and the
//! switches from the claim-first mode to another.

use std::{sync::Arc, time::Duration};

use http::HeaderName;
use tower_layer::Layer;

use super::{
    cache::{RecordCache, ReplayCache},
    endpoint::{Config, KeyReuseStatus, Setup, Shared},
    lease_config::LeaseConfig,
    mode::{ClaimAtCommit, ClaimFirst, Covers, LongRunning},
    on_paths::OnPaths,
    recovery::Recovery,
    service::Idempotency,
    status::StatusService,
};
use crate::{
    fingerprint::Fingerprinter,
    scope::{ResolveTenant, TenantFromExtension},
    store::{CommitStore, LeaseStore, Store, MAX_WAIT},
};

/// The largest body limit: a quarter of PostgreSQL's 1 GiB field and message limits.
const MAX_BODY: usize = 256 * 1024 * 1024;
const MAX_RETENTION: Duration = crate::store::MAX_RETENTION;

/// Gives the wrapped service Idempotency-Key semantics.
///
/// One layer serves one endpoint: keys are scoped by the authenticated tenant
/// and the endpoint name it is built with. The request flow, the guarantees
/// and a complete example are in the [crate docs](crate).
///
/// Each setting's default is stated on its setter, and only there.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{IdempotencyLayer, fingerprint::JsonFingerprinter, memory::MemoryStore};
///
/// let layer = IdempotencyLayer::new(MemoryStore::new(), "POST /orders v1", JsonFingerprinter::new("orders.v1"))
///     .wait(Duration::from_secs(2))
///     .retention(Duration::from_secs(7 * 24 * 3600))
///     .replay_header(http::header::CACHE_CONTROL);
/// ```
///
/// `M` is the mode: [`ClaimFirst`] (the default: the handler writes
/// through the claim's transaction) or [`LongRunning`](super::mode::LongRunning) (set by
/// [`long_running`](Self::long_running): a committed record with a lease and a
/// fencing token).
#[derive(Debug)]
pub struct IdempotencyLayer<St, F, R = TenantFromExtension, M = ClaimFirst> {
    setup: Setup<St, F, R, M>,
}

impl<St: Clone, F, R, M: Clone> Clone for IdempotencyLayer<St, F, R, M> {
    fn clone(&self) -> Self {
        IdempotencyLayer {
            setup: self.setup.clone(),
        }
    }
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

impl<St, F> IdempotencyLayer<St, F, TenantFromExtension>
where
    St: Store,
    F: Fingerprinter,
{
    /// A layer for one endpoint (e.g. `"POST /orders v1"`), with its store and
    /// fingerprinter. The tenant comes from a [`TenantId`](crate::scope::TenantId) in
    /// the request extensions until [`tenant_resolver`](Self::tenant_resolver)
    /// says otherwise.
    ///
    /// Creates the endpoint's `idempotency_requests_total` series at zero in
    /// the installed metrics recorder, and describes every metric of
    /// [`metrics`](crate::metrics) to it ([`describe`](crate::metrics::describe)),
    /// so install the recorder first. (Each per-request series is
    /// registered once, at the first request that records it, and then
    /// recorded through its handle.)
    pub fn new(store: St, endpoint: impl Into<Arc<str>>, fingerprinter: F) -> Self {
        let endpoint = endpoint.into();
        crate::metrics::describe();
        IdempotencyLayer {
            setup: Setup {
                store,
                fingerprinter: Arc::new(fingerprinter),
                resolver: Arc::new(TenantFromExtension),
                config: Arc::new(Config::new(endpoint)),
                mode: ClaimFirst,
                shared: Shared::default(),
            },
        }
    }
}

impl<St, F, R, M> IdempotencyLayer<St, F, R, M> {
    /// The layer with `set` applied to its (copied-on-write) settings.
    fn configure(mut self, set: impl FnOnce(&mut Config)) -> Self {
        set(Arc::make_mut(&mut self.setup.config));
        self
    }

    /// Resolves once no request that claimed a key through this layer (its
    /// clones and the services it made included) is still running.
    ///
    /// Once a request owns its key its work runs on a task of its own, so
    /// that it finishes even if the client goes away; a server's graceful
    /// shutdown does not wait for such tasks. Await this after the server
    /// has stopped accepting requests and before the runtime ends, and every
    /// owned operation commits or rolls back first.
    ///
    /// ```no_run
    /// # async fn run(listener: tokio::net::TcpListener, app: axum::Router, layer: tower_idempotency::IdempotencyLayer<tower_idempotency::memory::MemoryStore, tower_idempotency::fingerprint::JsonFingerprinter>) {
    /// axum::serve(listener, app).with_graceful_shutdown(async { /* signal */ }).await.ok();
    /// layer.drained().await;
    /// # }
    /// ```
    pub fn drained(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let drain = self.setup.shared.drain.clone();
        async move { drain.idle().await }
    }

    /// Resolves tenants with `resolver` (a [`ResolveTenant`] or a closure
    /// over the request parts) instead of the default,
    /// [`TenantFromExtension`]: the tenant an authentication layer put in the
    /// request's extensions.
    pub fn tenant_resolver<R2: ResolveTenant>(
        self,
        resolver: R2,
    ) -> IdempotencyLayer<St, F, R2, M> {
        IdempotencyLayer {
            setup: self.setup.swap(|_, mode| (Arc::new(resolver), mode)),
        }
    }

    /// The header carrying the key (default `Idempotency-Key`).
    pub fn header_name(self, name: HeaderName) -> Self {
        self.configure(|c| c.header = name)
    }

    /// Reads the key from the request's message when the key header has
    /// none: a field of the body, as AIP-155's `request_id` (see
    /// [`KeyFromBody`](crate::key::KeyFromBody); for gRPC,
    /// [`grpc_message`](crate::key::grpc_message) takes the frame off, and
    /// a compressed message is handed over decompressed: see
    /// [`decode_grpc_message`](crate::key::decode_grpc_message)).
    /// The header wins when both are there. The body is read (under the
    /// request limit) before the key is known, and a request that has no
    /// key in either place is refused with `400 idempotency_key_missing`
    /// whatever [`require_key`](Self::require_key) says: its body is
    /// consumed, so it cannot pass through.
    pub fn key_from_body(self, extractor: impl crate::key::KeyFromBody) -> Self {
        let extractor = crate::server::endpoint::KeyFromBodyFn(Arc::new(extractor));
        self.configure(|c| c.key_from_body = Some(extractor))
    }

    /// Whether a request without a key is refused with `400
    /// idempotency_key_missing` (default `true`). When `false`, such requests
    /// pass through without any idempotency.
    pub fn require_key(self, required: bool) -> Self {
        self.configure(|c| c.key_required = required)
    }

    /// The longest key accepted, in characters (default and maximum 255);
    /// longer keys are answered `400 idempotency_key_invalid`. Endpoints
    /// whose clients send UUIDs may say 36.
    pub fn max_key_length(self, chars: usize) -> Self {
        self.configure(|c| c.max_key_len = chars.clamp(1, crate::key::MAX_KEY_LEN))
    }

    /// The largest request body buffered (default 1 MiB); larger ones are
    /// answered `413 payload_too_large`. At most 256 MiB. A compressed gRPC
    /// message is held to it decompressed too (`RESOURCE_EXHAUSTED`),
    /// and never inflated past it.
    pub fn request_body_limit(self, bytes: usize) -> Self {
        self.configure(|c| c.request_body_limit = bytes.min(MAX_BODY))
    }

    /// The largest response body remembered (default 1 MiB). A larger one is
    /// rolled back and answered `500 response_not_storable`.
    ///
    /// At most 256 MiB, well inside what PostgreSQL takes in one `bytea`
    /// value and one protocol message (1 GiB), so a remembered response can
    /// always be sent to the database.
    pub fn response_body_limit(self, bytes: usize) -> Self {
        self.configure(|c| c.response_body_limit = bytes.min(MAX_BODY))
    }

    /// How long a concurrent duplicate waits for the first request to finish
    /// before it is answered `409 idempotency_in_progress` (default 5 s).
    ///
    /// The claim, taking a pooled connection included, is answered within
    /// this wait plus 5 s whatever the database or the network does: past it
    /// the claim's connection is closed and the request answered `503
    /// store_unavailable` (see the [deploying guide](crate::guide::deploying)
    /// on network partitions).
    ///
    /// Values above `i32::MAX` milliseconds (about 24.8 days), PostgreSQL's
    /// limit, are clamped to it.
    pub fn wait(self, wait: Duration) -> Self {
        self.configure(|c| c.wait = wait.min(MAX_WAIT))
    }

    /// How long a completed key is remembered (default 24 h). After that the
    /// same key is a new operation.
    ///
    /// In the claim-first mode retention counts from the claim, so it must
    /// cover the work: at least [`handler_timeout`](Self::handler_timeout)
    /// plus 5 s (the margin within which the database ends a silent owner),
    /// or a record could expire before its work commits, and a retry right
    /// after that commit would run the work again. In the long-running mode
    /// it must cover the lease plus the longest recovery backoff plus 5 s, so
    /// that a released operation is still there when recovery may take it.
    /// The one-commit mode counts it from the commit: no floor. A shorter
    /// value is raised to the floor, never silently: the layer warns once,
    /// naming both values, and
    /// [`effective_retention`](Self::effective_retention) tells the value in
    /// force. A service that must remember keys for exactly what its
    /// operator configured refuses a shorter value at start, as the example
    /// order server does.
    ///
    /// Values above 100 years are clamped to it.
    pub fn retention(self, retention: Duration) -> Self {
        self.configure(|c| c.retention = retention.min(MAX_RETENTION))
    }

    /// Also remember and replay this response header. By default the
    /// replayed headers are `Content-Type`, `Content-Encoding`, `Vary`,
    /// `Content-Language`, `Location`, `ETag`, `Last-Modified`, `Link`, and
    /// gRPC's `grpc-status`, `grpc-message` and `grpc-status-details-bin`
    /// (in the headers of a trailers-only answer) and `grpc-encoding` (the
    /// message's compression). `Set-Cookie` is never replayed, whatever the
    /// list says. Trailers are always replayed.
    pub fn replay_header(self, name: HeaderName) -> Self {
        self.configure(|c| {
            if !c.replay_headers.contains(&name) {
                c.replay_headers.push(name);
            }
        })
    }

    /// Replaces the list of replayed response headers (the default list is
    /// on [`replay_header`](Self::replay_header)).
    pub fn replay_headers(self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.configure(|c| c.replay_headers = names.into_iter().collect())
    }

    /// What counts as success: which responses are remembered with the
    /// handler's writes and which roll back and free the key. See
    /// [`classify`](crate::classify).
    ///
    /// The default,
    /// [`ServerOrGrpcErrorsAsFailures`](crate::classify::ServerOrGrpcErrorsAsFailures),
    /// judges each answer by its protocol, told by its `content-type`: an
    /// `application/grpc` or `application/grpc+<codec>` answer by its
    /// `grpc-status`, in the trailers or in a trailers-only head
    /// ([`GrpcErrorsAsFailures`](crate::classify::GrpcErrorsAsFailures)),
    /// so that a gRPC `UNAVAILABLE`, HTTP 200 like every gRPC answer, rolls
    /// back; any other answer by its HTTP status
    /// ([`ServerErrorsAsFailures`](crate::classify::ServerErrorsAsFailures)).
    ///
    /// A classifier set here judges every answer, whatever its content
    /// type: `classify(ServerErrorsAsFailures)` remembers a gRPC error as
    /// the HTTP 200 it is, and `classify(GrpcErrorsAsFailures)` rolls back
    /// any HTTP 200 without a `grpc-status`.
    pub fn classify(self, classifier: impl crate::classify::Classifier) -> Self {
        let classifier: Arc<dyn crate::classify::Classifier> = Arc::new(classifier);
        self.configure(|c| c.classifier = classifier)
    }

    /// Adds a `tenant` label to `idempotency_requests_total` (default off:
    /// tenant ids can be personal data and make label sets unbounded).
    pub fn metrics_tenant_label(self, enabled: bool) -> Self {
        self.configure(|c| c.tenant_label = enabled)
    }

    /// How long the owner's work may take (default 30 s): from the moment
    /// the request owns its key until the response is ready to remember
    /// (the handler, and buffering its body).
    ///
    /// Past it the handler is dropped, a statement it left running in the
    /// database is cancelled, its writes are rolled back, and the client gets
    /// `503 handler_timeout` with `Retry-After`; the key is free again. Without
    /// it a handler that never returns would hold its key, its row lock and a
    /// pooled connection for good. The database also ends the owner's
    /// transaction by itself when it sits idle 5 s past this limit
    /// (`idle_in_transaction_session_timeout`), should the process freeze.
    ///
    /// In the claim-first mode the [`retention`](Self::retention) must be
    /// at least this plus 5 s; see there.
    ///
    /// Clamped to `i32::MAX` milliseconds (about 24.8 days), like the wait.
    pub fn handler_timeout(self, timeout: Duration) -> Self {
        self.configure(|c| c.handler_timeout = timeout.min(MAX_WAIT))
    }

    /// The replay cache, on by default with a budget of 64 MiB per layer and
    /// a TTL of 60 s ([`ReplayCache::default`]): the completed records this
    /// layer committed, kept in memory so that a retry coming back to this
    /// process is answered without the database. It is never the source of
    /// truth: an entry is a copy of a committed record, never outlives the
    /// record's retention nor the TTL, a different request under the key is
    /// still refused, and a miss costs only the normal claim.
    ///
    /// **Memory.** The cache is bounded by the bytes it holds, not by a
    /// count: each entry is weighed by its body, remembered headers and
    /// trailers, resource id, tenant and key, plus a fixed allowance for its
    /// own structures, and the least useful entries are evicted to keep the
    /// total within [`ReplayCache::max_bytes`]. An answer weighing more than
    /// [`ReplayCache::max_entry_bytes`] (a 64th of the budget: 1 MiB of the
    /// default 64 MiB) is not cached; its retries replay from the store. An
    /// entry keeps its bytes in buffers of its own, so what it weighs is
    /// what it keeps alive. Budget the sum over the process's layers: each
    /// layer has its own cache.
    ///
    /// What it cannot see: a record removed by
    /// [`PgStore::remove_key`](crate::postgres::PgStore::remove_key) (or by
    /// another process) is still replayed by a process that cached it, for
    /// at most the TTL. An operator who removes a key so that its client may
    /// run the operation again should wait the TTL first, or run with the
    /// cache off ([`without_replay_cache`](Self::without_replay_cache)). A
    /// budget or a TTL of 0 turns it off too.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{IdempotencyLayer, ReplayCache, fingerprint::JsonFingerprinter, memory::MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new(), "POST /orders v1", JsonFingerprinter::new("orders.v1"))
    ///     .replay_cache(ReplayCache::new(16 * 1024 * 1024).ttl(Duration::from_secs(30)));
    /// # let _ = layer;
    /// ```
    pub fn replay_cache(mut self, cache: ReplayCache) -> Self {
        self.setup.shared.cache = RecordCache::new(cache);
        self
    }

    /// Turns the replay cache off: every replay reads the store.
    pub fn without_replay_cache(mut self) -> Self {
        self.setup.shared.cache = None;
        self
    }

    /// Replays by rebuilding instead of replaying the stored bytes (off by
    /// default: replays are the stored bytes): for an
    /// endpoint whose responses must not be served stale (a signed URL, a
    /// short-lived payment link).
    ///
    /// On every replay of a record whose handler named a
    /// [`ResourceId`](crate::record::ResourceId), the layer calls `rebuild`
    /// with the tenant, the endpoint, the resource id and the stored status,
    /// and answers its representation under the first response's status,
    /// marked `Idempotent-Replayed: true`. The handler never runs again; a
    /// different request under the key is still refused; [`Rebuilt::Gone`]
    /// answers `410 resource_gone`; a failed rebuild (or one that takes
    /// longer than the handler timeout) answers `503 replay_unavailable`.
    /// Records without a resource id replay their stored bytes. The
    /// contract in full is in [`replay`](crate::server::replay).
    ///
    /// ```
    /// use bytes::Bytes;
    /// use tower_idempotency::{
    ///     fingerprint::JsonFingerprinter, memory::MemoryStore,
    ///     replay::{RebuildRequest, Rebuilt}, IdempotencyLayer,
    /// };
    ///
    /// let rebuild = tower::service_fn(|request: RebuildRequest| async move {
    ///     // Look the resource up again and sign a fresh URL for it.
    ///     let url = format!("https://files.example/{}?sig=fresh", request.resource_id);
    ///     let body = Bytes::from(format!(r#"{{"download_url":"{url}"}}"#));
    ///     Ok::<_, std::convert::Infallible>(Rebuilt::Current(http::Response::new(body)))
    /// });
    /// let layer = IdempotencyLayer::new(MemoryStore::new(), "POST /exports v1", JsonFingerprinter::new("exports.v1"))
    ///     .rebuild_replays(rebuild);
    /// ```
    ///
    /// [`Rebuilt::Gone`]: crate::server::replay::Rebuilt::Gone
    pub fn rebuild_replays<Rb>(self, rebuild: Rb) -> Self
    where
        Rb: tower_service::Service<
                crate::server::replay::RebuildRequest,
                Response = crate::server::replay::Rebuilt,
            > + Clone
            + Send
            + Sync
            + 'static,
        Rb::Error: Into<crate::error::BoxError>,
        Rb::Future: Send + 'static,
    {
        self.configure(|c| c.rebuild = Some(crate::server::replay::Rebuilder::new(rebuild)))
    }

    /// The status for a key reused with a different request (default `409`).
    pub fn key_reuse_status(self, status: KeyReuseStatus) -> Self {
        self.configure(|c| c.key_reuse = status)
    }

    /// Where the layer's problems are documented: each of its own error
    /// answers gets the `type` `base` followed by its code (e.g.
    /// `https://docs.example.com/errors/idempotency_key_missing`) instead
    /// of `urn:tower-idempotency:problem:<code>`, and a
    /// `Link: <that URL>; rel="describedby"` header, as the IETF
    /// Idempotency-Key draft asks of error answers
    /// ([`Problem::with_type_base`](crate::problem::Problem::with_type_base)).
    /// A fingerprinter's problem with a base of its own keeps it. gRPC
    /// answers carry neither. Default: none.
    pub fn problem_type_base(self, base: impl Into<String>) -> Self {
        let base = Arc::new(base.into());
        self.configure(|c| c.problem_type_base = Some(base))
    }
}

// The switches from the claim-first mode to another, and what only a
// long-running layer offers.

impl<St, F, R> IdempotencyLayer<St, F, R, ClaimFirst>
where
    St: LeaseStore,
{
    /// Switches the endpoint to the long-running mode (see [`lease`](crate::lease)):
    /// the first short transaction commits an `in_progress` record with a
    /// lease and an attempt token, the work runs outside any claim
    /// transaction with heartbeats renewing the lease, its writes go through
    /// fenced transactions, and a request whose work takes longer than
    /// [`LeaseConfig::respond_within`] is answered `202 Accepted` with the
    /// operation's status resource.
    ///
    /// The handler finds the store's lease handle (for [`PgStore`](crate::postgres::PgStore):
    /// [`PgLease`](crate::postgres::PgLease)) in its request extensions, instead of a
    /// transaction. [`handler_timeout`](Self::handler_timeout) bounds the
    /// whole work; raise it for work that takes longer than 30 s.
    pub fn long_running(self, config: LeaseConfig) -> IdempotencyLayer<St, F, R, LongRunning> {
        let mode = LongRunning::new(config);
        mode.register(&self.setup.config.endpoint);
        self.with_mode(mode)
    }
}

impl<St, F, R> IdempotencyLayer<St, F, R, ClaimFirst>
where
    St: CommitStore,
{
    /// Switches the endpoint to the one-commit mode ([`ClaimAtCommit`]):
    /// nothing is claimed before the handler runs; its writes come first,
    /// and the key's record goes in with the response in the same
    /// transaction, pipelined with the `COMMIT`, so that the key's
    /// uniqueness decides at commit. A request costs about what the bare
    /// handler costs (no claim round trip, no completion `UPDATE`).
    ///
    /// The guarantee changes from "one owner runs" to "one commit wins":
    /// duplicates in this process are still coalesced (one handler run),
    /// but duplicates that reach two processes at once may each run the
    /// handler, and every loser's transaction rolls back and answers the
    /// winner's response. Choose it only when **every effect of the
    /// handler is in its transaction** (rows, outbox events; calls to
    /// other systems go through the outbox): see
    /// [choosing a mode](crate::guide::modes). A long-running endpoint
    /// cannot use it: the two switches exist only on a default-mode layer.
    ///
    /// ```
    /// use tower_idempotency::{fingerprint::JsonFingerprinter, memory::MemoryStore, IdempotencyLayer};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new(), "POST /orders v1", JsonFingerprinter::new("orders.v1"))
    ///     .claim_at_commit();
    /// # let _ = layer;
    /// ```
    pub fn claim_at_commit(self) -> IdempotencyLayer<St, F, R, ClaimAtCommit> {
        ClaimAtCommit.register(&self.setup.config.endpoint);
        self.with_mode(ClaimAtCommit)
    }
}

impl<St, F, R> IdempotencyLayer<St, F, R, ClaimFirst> {
    /// The same layer in another mode.
    fn with_mode<M>(self, mode: M) -> IdempotencyLayer<St, F, R, M> {
        IdempotencyLayer {
            setup: self.setup.swap(|resolver, _| (resolver, mode)),
        }
    }
}

impl<St, F, R> IdempotencyLayer<St, F, R, LongRunning>
where
    St: LeaseStore,
    F: Fingerprinter,
    R: ResolveTenant,
{
    /// The status resource of this endpoint's operations, to mount at the
    /// configured [`status_path`](LeaseConfig::status_path) (e.g.
    /// `GET /operations/{id}`). It resolves tenants as this layer does, and
    /// answers `404 not_found` for other tenants' and unknown operations.
    pub fn status_service(&self) -> StatusService<St, R> {
        StatusService::new(self.setup.store.clone(), self.setup.resolver.clone())
    }

    /// A worker that re-drives this endpoint's operations whose lease
    /// expired with nobody retrying, through `inner`: the service this
    /// layer wraps, without the layer (see [`Recovery`]).
    pub fn recovery<S>(&self, inner: S) -> Recovery<S, St, F, R> {
        Recovery::new(inner, self.setup.clone())
    }
}

impl<St, F, R, M: super::flow::Mode<St>> IdempotencyLayer<St, F, R, M> {
    /// How long this layer's keys are remembered: the configured
    /// [`retention`](Self::retention), or the mode's floor when that is
    /// longer (the claim-first mode: [`handler_timeout`](Self::handler_timeout)
    /// plus 5 s; the long-running mode: the lease plus the longest recovery
    /// backoff plus 5 s; the one-commit mode has none). When the two
    /// differ, the layer says so once with a warning naming both, as it
    /// makes its first service.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{IdempotencyLayer, fingerprint::JsonFingerprinter, memory::MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new(), "POST /orders v1", JsonFingerprinter::new("orders.v1"))
    ///     .handler_timeout(Duration::from_secs(2))
    ///     .retention(Duration::from_secs(3));
    /// assert_eq!(layer.effective_retention(), Duration::from_secs(7));
    /// let layer = layer.claim_at_commit();
    /// assert_eq!(layer.effective_retention(), Duration::from_secs(3));
    /// ```
    pub fn effective_retention(&self) -> Duration {
        self.setup.retention()
    }
}

impl<St: Clone, F, R, M: Covers + Clone> IdempotencyLayer<St, F, R, M> {
    /// Guards only the requests whose path is one of `paths`, each as an
    /// endpoint of its own, and passes every other request through
    /// untouched (its body unread, nothing claimed, no span, no metric).
    /// Call it last: the [`OnPaths`] it returns takes no further setting.
    ///
    /// A path's endpoint is the path without its leading `/`, which the
    /// endpoint given to [`new`](IdempotencyLayer::new) gives way to. For a
    /// gRPC method that is its full name (`orders.v1.Orders/CreateOrder`),
    /// so the layer goes on a tonic server in front of the services tonic
    /// generated, with no router of one's own, and keys, metrics and spans
    /// are per method. Every guarded path shares the layer's settings, its
    /// fingerprinter and its key extractor; both are handed each request's
    /// parts, so one of them tells the methods apart by `parts.uri.path()`.
    /// A path is matched exactly; empty and repeated paths are dropped.
    ///
    /// ```
    /// use tower_idempotency::{fingerprint::JsonFingerprinter, memory::MemoryStore, IdempotencyLayer};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new(), "orders", JsonFingerprinter::new("orders.v1"))
    ///     .on_paths(["/orders.v1.Orders/CreateOrder", "/orders.v1.Orders/CancelOrder"]);
    /// assert_eq!(
    ///     layer.endpoints().collect::<Vec<_>>(),
    ///     ["orders.v1.Orders/CreateOrder", "orders.v1.Orders/CancelOrder"],
    /// );
    /// ```
    ///
    /// With tonic (the [gRPC guide](crate::guide::grpc) has it whole):
    ///
    /// ```ignore
    /// Server::builder()
    ///     .layer(authentication)  // puts the caller's TenantId in the extensions
    ///     .layer(idempotency.on_paths(["/orders.v1.Orders/CreateOrder"]))
    ///     .add_service(OrdersServer::new(orders))
    ///     .serve(addr)
    ///     .await?;
    /// ```
    ///
    /// The long-running mode's [`status_service`](IdempotencyLayer::status_service)
    /// and [`recovery`](IdempotencyLayer::recovery) serve one endpoint:
    /// where those are needed, build a layer for each path instead.
    pub fn on_paths<P: AsRef<str>>(
        self,
        paths: impl IntoIterator<Item = P>,
    ) -> OnPaths<St, F, R, M> {
        OnPaths::new(self.setup, paths)
    }
}

impl<S, St: Clone, F, R, M: super::flow::Mode<St>> Layer<S> for IdempotencyLayer<St, F, R, M> {
    type Service = Idempotency<S, St, F, R, M>;

    fn layer(&self, inner: S) -> Self::Service {
        self.setup.say_raised_retention();
        Idempotency::new(inner, self.setup.clone())
    }
}

#[cfg(test)]
mod tests;
