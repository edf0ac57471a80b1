//! What an [`IdempotencyLayer`](crate::IdempotencyLayer) sets up for its
//! endpoint, shared by every service the layer makes: the configuration, the
//! strategies, and the state that concurrent requests share at run time.

use std::{sync::Arc, time::Duration};

use http::{header, HeaderName, StatusCode};

use super::{
    cache::{RecordCache, ReplayCache},
    drain::Drain,
    in_flight::InFlight,
    mode::{ClaimFirst, Covers},
};

/// The status answered when a key is reused with a different request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum KeyReuseStatus {
    /// `409 Conflict` (the default, and what the example server's contract says).
    #[default]
    Conflict,
    /// `422 Unprocessable Content`, as the IETF `Idempotency-Key` draft suggests.
    UnprocessableContent,
}

impl KeyReuseStatus {
    pub(crate) fn status(self) -> StatusCode {
        match self {
            KeyReuseStatus::Conflict => StatusCode::CONFLICT,
            KeyReuseStatus::UnprocessableContent => StatusCode::UNPROCESSABLE_ENTITY,
        }
    }
}

/// The layer's settings: plain data.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) endpoint: Arc<str>,
    /// The endpoint's per-request series, registered with the layer.
    pub(crate) metrics: Arc<crate::metrics::EndpointMetrics>,
    pub(crate) header: HeaderName,
    pub(crate) key_required: bool,
    pub(crate) max_key_len: usize,
    pub(crate) request_body_limit: usize,
    pub(crate) response_body_limit: usize,
    pub(crate) wait: Duration,
    pub(crate) handler_timeout: Duration,
    pub(crate) retention: Duration,
    pub(crate) replay_headers: Vec<HeaderName>,
    pub(crate) key_reuse: KeyReuseStatus,
    pub(crate) tenant_label: bool,
    /// Set when replays are rebuilt from the remembered resource.
    pub(crate) rebuild: Option<crate::server::replay::Rebuilder>,
    /// What counts as success (`classify`).
    pub(crate) classifier: Arc<dyn crate::classify::Classifier>,
    /// Where the key is read when the header has none (`key_from_body`).
    pub(crate) key_from_body: Option<KeyFromBodyFn>,
    /// The documentation URL prefix of the layer's own problems
    /// (`problem_type_base`).
    pub(crate) problem_type_base: Option<Arc<String>>,
}

/// A [`KeyFromBody`](crate::key::KeyFromBody), shared by the layer's clones.
#[derive(Clone)]
pub(crate) struct KeyFromBodyFn(pub(crate) Arc<dyn crate::key::KeyFromBody>);

impl std::fmt::Debug for KeyFromBodyFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyFromBody")
    }
}

impl Config {
    pub(crate) fn new(endpoint: Arc<str>) -> Self {
        Config {
            metrics: Arc::new(crate::metrics::EndpointMetrics::new(endpoint.clone())),
            endpoint,
            header: HeaderName::from_static("idempotency-key"),
            key_required: true,
            max_key_len: crate::key::MAX_KEY_LEN,
            request_body_limit: 1024 * 1024,
            response_body_limit: 1024 * 1024,
            wait: Duration::from_secs(5),
            handler_timeout: crate::store::limits::DEFAULT_HANDLER_TIMEOUT,
            retention: Duration::from_secs(24 * 3600),
            replay_headers: vec![
                header::CONTENT_TYPE,
                // The stored bytes are the inner service's: when a layer
                // inside this one compressed them, these say so.
                header::CONTENT_ENCODING,
                header::VARY,
                header::CONTENT_LANGUAGE,
                header::LOCATION,
                header::ETAG,
                header::LAST_MODIFIED,
                header::LINK,
                // A gRPC answer with no message (trailers-only, as tonic
                // sends an error) carries its status in the headers.
                HeaderName::from_static("grpc-status"),
                HeaderName::from_static("grpc-message"),
                HeaderName::from_static("grpc-status-details-bin"),
                // A gRPC message the service compressed (tonic's
                // `send_compressed`) is stored compressed; a replay without
                // its encoding could not be read.
                HeaderName::from_static("grpc-encoding"),
            ],
            key_reuse: KeyReuseStatus::Conflict,
            tenant_label: false,
            rebuild: None,
            classifier: Arc::new(crate::classify::ServerOrGrpcErrorsAsFailures),
            key_from_body: None,
            problem_type_base: None,
        }
    }
}

impl Config {
    /// The same settings for another endpoint, with that endpoint's own
    /// series.
    pub(crate) fn for_endpoint(&self, endpoint: Arc<str>) -> Self {
        Config {
            metrics: Arc::new(crate::metrics::EndpointMetrics::new(endpoint.clone())),
            endpoint,
            ..self.clone()
        }
    }
}

/// What requests of one layer share while they run: who leads each key in
/// this process, which operations still own a key, and the replay cache.
#[derive(Debug, Clone)]
pub(crate) struct Shared {
    pub(crate) in_flight: Arc<InFlight>,
    pub(crate) drain: Arc<Drain>,
    pub(crate) cache: Option<RecordCache>,
    /// The raised retention last said, configured and effective
    /// (`Setup::say_raised_retention`): a clone reconfigured to another
    /// pair says its own once.
    pub(crate) retention_said: Arc<std::sync::Mutex<Option<(Duration, Duration)>>>,
}

impl Default for Shared {
    fn default() -> Self {
        Shared {
            in_flight: Arc::default(),
            drain: Arc::default(),
            cache: RecordCache::new(ReplayCache::default()),
            retention_said: Arc::default(),
        }
    }
}

/// What a layer sets up for its endpoint: the store, the strategies, the
/// settings, the mode and the state its requests share. Cheap to clone
/// (handles and `Arc`s).
#[derive(Debug)]
pub struct Setup<St, F, R, M = ClaimFirst> {
    pub(crate) store: St,
    pub(crate) fingerprinter: Arc<F>,
    pub(crate) resolver: Arc<R>,
    pub(crate) config: Arc<Config>,
    pub(crate) mode: M,
    pub(crate) shared: Shared,
}

impl<St, F, R, M> Setup<St, F, R, M> {
    /// The same setup with the resolver and the mode that `swap` makes of
    /// the current ones (the builders that change a type parameter).
    pub(crate) fn swap<R2, M2>(
        self,
        swap: impl FnOnce(Arc<R>, M) -> (Arc<R2>, M2),
    ) -> Setup<St, F, R2, M2> {
        let (resolver, mode) = swap(self.resolver, self.mode);
        Setup {
            store: self.store,
            fingerprinter: self.fingerprinter,
            resolver,
            config: self.config,
            mode,
            shared: self.shared,
        }
    }
}

impl<St: Clone, F, R, M: Clone> Clone for Setup<St, F, R, M> {
    fn clone(&self) -> Self {
        Setup {
            store: self.store.clone(),
            fingerprinter: self.fingerprinter.clone(),
            resolver: self.resolver.clone(),
            config: self.config.clone(),
            mode: self.mode.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<St, F, R, M: Covers> Setup<St, F, R, M> {
    /// The retention records are kept for: the configured one, raised to
    /// what the mode's work needs (see [`IdempotencyLayer::retention`](crate::IdempotencyLayer::retention)).
    pub(crate) fn retention(&self) -> Duration {
        self.config
            .retention
            .max(self.mode.covers(self.config.handler_timeout))
    }

    /// Says once, when the layer makes its first service, that the
    /// retention in force is longer than the one configured: an operator
    /// who set a retention must be able to see that keys live longer.
    pub(crate) fn say_raised_retention(&self) {
        let (configured, effective) = (self.config.retention, self.retention());
        if effective <= configured {
            return;
        }
        let mut said = self
            .shared
            .retention_said
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if said.replace((configured, effective)) != Some((configured, effective)) {
            tracing::warn!(
                endpoint = %self.config.endpoint,
                configured_retention = ?configured,
                effective_retention = ?effective,
                handler_timeout = ?self.config.handler_timeout,
                "the configured retention is shorter than this mode's work may take; \
                 keys are remembered for the effective retention instead"
            );
        }
    }
}

/// The setups of an [`OnPaths`](crate::OnPaths) layer, one a guarded path,
/// each under the endpoint named by its path without the leading `/`.
pub(crate) struct Paths<St, F, R, M>(Arc<[Setup<St, F, R, M>]>);

impl<St, F, R, M> Paths<St, F, R, M> {
    pub(crate) fn new(setups: Vec<Setup<St, F, R, M>>) -> Self {
        Paths(setups.into())
    }

    /// The setup of the endpoint `path` names, if it is guarded.
    pub(crate) fn find(&self, path: &str) -> Option<&Setup<St, F, R, M>> {
        let endpoint = path.strip_prefix('/')?;
        self.0
            .iter()
            .find(|setup| &*setup.config.endpoint == endpoint)
    }

    pub(crate) fn endpoints(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|setup| &*setup.config.endpoint)
    }
}

impl<St, F, R, M> Clone for Paths<St, F, R, M> {
    fn clone(&self) -> Self {
        Paths(self.0.clone())
    }
}

impl<St, F, R, M> std::fmt::Debug for Paths<St, F, R, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.endpoints()).finish()
    }
}
