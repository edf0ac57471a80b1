//! Replays rebuilt from the remembered resource, for responses that must not
//! be served stale.
//!
//! By default a retry gets the first response back byte for byte. Some
//! responses carry what goes stale: a signed download URL valid for five
//! minutes, a payment link with a short-lived token, a price quote with an
//! expiry. Replaying those bytes an hour later hands the client a dead link.
//! For such an endpoint, [`IdempotencyLayer::rebuild_replays`] makes the
//! layer answer a replay by asking the application for the current
//! representation of the resource the first request created, named by the
//! [`ResourceId`] its handler put in the response extensions.
//!
//! # The contract
//!
//! A rebuilt replay:
//!
//! - has the **first response's status**, whatever status the rebuild
//!   function's response carries (the first answer decided the outcome; a
//!   replay only refreshes its representation);
//! - carries `Idempotent-Replayed: true`;
//! - is about the **same resource**: the rebuild function gets the tenant,
//!   the endpoint, the stored [`ResourceId`] and the stored status, never the
//!   request;
//! - never runs the original handler again, is still refused with `409
//!   idempotency_key_reused` (or 422, see `key_reuse_status`) when the
//!   request differs from the first, and stays within the tenant;
//! - when the resource no longer exists ([`Rebuilt::Gone`]), is `410 Gone`
//!   with the stable code `resource_gone`: the operation happened, its result
//!   is gone, and retrying cannot change that;
//! - when the rebuild function fails, is `503 replay_unavailable` with
//!   `Retry-After`: nothing changed, and the retry may succeed.
//!
//! Records without a resource id (a handler that named none, a record
//! written before the column existed) replay their stored bytes. The
//! long-running mode's status resource shows the stored answer, not a
//! rebuilt one.
//!
//! [`IdempotencyLayer::rebuild_replays`]: crate::IdempotencyLayer::rebuild_replays

use std::{fmt, future::Future, pin::Pin, sync::Arc};

use bytes::Bytes;
use http::{Response, StatusCode};
use tower_service::Service;

use crate::{error::BoxError, record::ResourceId, scope::TenantId};

/// What the rebuild function is given: which resource to represent, for whom.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RebuildRequest {
    /// The tenant the record belongs to (the replaying request's tenant).
    pub tenant: TenantId,
    /// The endpoint name the layer was built with.
    pub endpoint: Arc<str>,
    /// The resource the first request's handler named.
    pub resource_id: ResourceId,
    /// The first response's status, which the replay keeps.
    pub status: StatusCode,
}

/// What the rebuild function answers.
#[derive(Debug)]
#[non_exhaustive]
pub enum Rebuilt {
    /// The resource's current representation: its headers and body are the
    /// replay's (its status is replaced by the first response's).
    Current(Response<Bytes>),
    /// The resource no longer exists: the replay is `410 resource_gone`.
    Gone,
}

type RebuildFuture = Pin<Box<dyn Future<Output = Result<Rebuilt, BoxError>> + Send>>;

/// The layer's handle on the application's rebuild service.
#[derive(Clone)]
pub(crate) struct Rebuilder(Arc<dyn Fn(RebuildRequest) -> RebuildFuture + Send + Sync>);

impl Rebuilder {
    pub(crate) fn new<Rb>(rebuild: Rb) -> Self
    where
        Rb: Service<RebuildRequest, Response = Rebuilt> + Clone + Send + Sync + 'static,
        Rb::Error: Into<BoxError>,
        Rb::Future: Send + 'static,
    {
        Rebuilder(Arc::new(move |request| {
            let mut service = rebuild.clone();
            Box::pin(async move {
                std::future::poll_fn(|cx| service.poll_ready(cx))
                    .await
                    .map_err(Into::into)?;
                service.call(request).await.map_err(Into::into)
            })
        }))
    }

    pub(crate) fn rebuild(&self, request: RebuildRequest) -> RebuildFuture {
        (self.0)(request)
    }
}

impl fmt::Debug for Rebuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Rebuilder(..)")
    }
}
