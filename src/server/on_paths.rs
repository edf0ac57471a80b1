//! [`OnPaths`]: one layer for a set of methods of a server that routes by
//! path (a tonic server, generated or not), every other path passed
//! through.

use std::{fmt, sync::Arc, time::Duration};

use tower_layer::Layer;

use crate::scope::TenantFromExtension;

use super::{
    endpoint::{Paths, Setup},
    flow::Mode,
    mode::{ClaimFirst, Covers},
    service::Idempotency,
};

/// An [`IdempotencyLayer`](crate::IdempotencyLayer) that guards a set of
/// paths, each as an endpoint of its own, and passes every other request
/// through untouched. Made by
/// [`IdempotencyLayer::on_paths`](crate::IdempotencyLayer::on_paths), after
/// every other setting.
///
/// A request whose path is not in the set reaches the wrapped service as it
/// came: its body is not read, nothing is claimed, and no span or metric
/// is recorded for it.
pub struct OnPaths<St, F, R = TenantFromExtension, M = ClaimFirst> {
    /// The layer's settings under the endpoint it was built with: what
    /// [`effective_retention`](Self::effective_retention) and the drain
    /// read. No request is served under its endpoint.
    template: Setup<St, F, R, M>,
    paths: Paths<St, F, R, M>,
}

impl<St: Clone, F, R, M: Covers + Clone> OnPaths<St, F, R, M> {
    pub(crate) fn new<P: AsRef<str>>(
        template: Setup<St, F, R, M>,
        paths: impl IntoIterator<Item = P>,
    ) -> Self {
        let mut endpoints: Vec<Arc<str>> = Vec::new();
        for path in paths {
            let endpoint = path.as_ref().trim_start_matches('/');
            if !endpoint.is_empty() && !endpoints.iter().any(|e| &**e == endpoint) {
                endpoints.push(endpoint.into());
            }
        }
        let setups = endpoints
            .into_iter()
            .map(|endpoint| {
                template.mode.register(&endpoint);
                Setup {
                    config: Arc::new(template.config.for_endpoint(endpoint)),
                    ..template.clone()
                }
            })
            .collect();
        OnPaths {
            template,
            paths: Paths::new(setups),
        }
    }
}

impl<St, F, R, M> OnPaths<St, F, R, M> {
    /// The endpoints this layer guards, in the order given: each path
    /// without its leading `/`.
    pub fn endpoints(&self) -> impl Iterator<Item = &str> {
        self.paths.endpoints()
    }

    /// Resolves once no request that claimed a key through this layer is
    /// still running: see
    /// [`IdempotencyLayer::drained`](crate::IdempotencyLayer::drained).
    pub fn drained(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let drain = self.template.shared.drain.clone();
        async move { drain.idle().await }
    }
}

impl<St, F, R, M: Covers> OnPaths<St, F, R, M> {
    /// How long the keys of every guarded path are remembered: see
    /// [`IdempotencyLayer::effective_retention`](crate::IdempotencyLayer::effective_retention).
    pub fn effective_retention(&self) -> Duration {
        self.template.retention()
    }
}

impl<St: Clone, F, R, M: Clone> Clone for OnPaths<St, F, R, M> {
    fn clone(&self) -> Self {
        OnPaths {
            template: self.template.clone(),
            paths: self.paths.clone(),
        }
    }
}

impl<St: fmt::Debug, F: fmt::Debug, R: fmt::Debug, M: fmt::Debug> fmt::Debug
    for OnPaths<St, F, R, M>
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OnPaths")
            .field("template", &self.template)
            .field("paths", &self.paths)
            .finish()
    }
}

impl<S, St: Clone, F, R, M: Mode<St>> Layer<S> for OnPaths<St, F, R, M> {
    type Service = Idempotency<S, St, F, R, M>;

    fn layer(&self, inner: S) -> Self::Service {
        self.template.say_raised_retention();
        Idempotency::on_paths(inner, self.template.clone(), self.paths.clone())
    }
}
