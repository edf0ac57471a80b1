//! Scopes: every key lives inside (tenant, endpoint).

use std::{fmt, sync::Arc};

use http::request::Parts;

/// The authenticated tenant a request acts for.
///
/// Whatever authenticates the request (an auth layer, a gateway) decides the
/// tenant; a header the client can set must never choose it. The default
/// resolver, [`TenantFromExtension`], reads a `TenantId` that the auth layer
/// put into the request extensions.
///
/// ```
/// use tower_idempotency::scope::TenantId;
///
/// let mut request = http::Request::new(());
/// request.extensions_mut().insert(TenantId::new("tenant-a"));
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(Arc<str>);

impl TenantId {
    /// A tenant id (any non-empty string your auth layer uses).
    pub fn new(id: impl Into<Arc<str>>) -> Self {
        TenantId(id.into())
    }

    /// The id as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("TenantId").field(&&*self.0).finish()
    }
}

impl fmt::Display for TenantId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for TenantId {
    fn from(id: &str) -> Self {
        TenantId::new(id)
    }
}

impl From<String> for TenantId {
    fn from(id: String) -> Self {
        TenantId::new(id)
    }
}

/// Where a key lives: the tenant and the endpoint (e.g. `POST /orders v1`).
///
/// The same raw key under two scopes names two unrelated operations.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Scope {
    tenant: TenantId,
    endpoint: Arc<str>,
}

impl Scope {
    /// A scope for one tenant on one endpoint.
    pub fn new(tenant: TenantId, endpoint: impl Into<Arc<str>>) -> Self {
        Scope {
            tenant,
            endpoint: endpoint.into(),
        }
    }

    /// The tenant.
    pub fn tenant(&self) -> &TenantId {
        &self.tenant
    }

    /// The endpoint name the layer was built with.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }
}

/// Finds the authenticated tenant of a request.
///
/// Returning `None` fails closed: the layer answers `401 unauthorized` and
/// never falls back to a shared scope. Closures `Fn(&Parts) -> Option<TenantId>`
/// implement this trait.
///
/// ```
/// use tower_idempotency::{scope::{ResolveTenant, TenantId}};
///
/// // Tenant from a header set by a trusted gateway (never from the client).
/// let resolver = |parts: &http::request::Parts| {
///     parts.headers.get("x-gateway-tenant")?.to_str().ok().map(TenantId::from)
/// };
/// let request = http::Request::builder()
///     .header("x-gateway-tenant", "acme")
///     .body(())
///     .unwrap();
/// let (parts, ()) = request.into_parts();
/// assert_eq!(resolver.resolve(&parts), Some(TenantId::new("acme")));
/// ```
pub trait ResolveTenant: Send + Sync + 'static {
    /// The tenant of this request, or `None` when it has none.
    fn resolve(&self, parts: &Parts) -> Option<TenantId>;
}

impl<F> ResolveTenant for F
where
    F: Fn(&Parts) -> Option<TenantId> + Send + Sync + 'static,
{
    fn resolve(&self, parts: &Parts) -> Option<TenantId> {
        self(parts)
    }
}

/// The default resolver: the [`TenantId`] an auth layer inserted into the
/// request extensions.
#[derive(Clone, Copy, Debug, Default)]
pub struct TenantFromExtension;

impl ResolveTenant for TenantFromExtension {
    fn resolve(&self, parts: &Parts) -> Option<TenantId> {
        parts.extensions.get::<TenantId>().cloned()
    }
}

/// A fixed tenant, for services that really have exactly one.
///
/// This is an explicit choice made when the layer is built; it is never a
/// fallback for requests whose tenant is unknown.
#[derive(Clone, Debug)]
pub struct SingleTenant(TenantId);

impl SingleTenant {
    /// Every request belongs to `tenant`.
    pub fn new(tenant: impl Into<TenantId>) -> Self {
        SingleTenant(tenant.into())
    }
}

impl ResolveTenant for SingleTenant {
    fn resolve(&self, _parts: &Parts) -> Option<TenantId> {
        Some(self.0.clone())
    }
}
