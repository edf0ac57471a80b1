//! Scopes: every key lives inside (tenant, endpoint).

use std::{fmt, sync::Arc};

use http::request::Parts;

use crate::fingerprint::Fingerprint;

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

    /// The id of what the operation under `key` in this scope, with the
    /// request whose fingerprint is `fingerprint`, creates, `name` saying
    /// which ("order", "shipment"): a UUID that follows from the operation
    /// alone, the same whenever the operation runs again.
    ///
    /// An operation runs again after its transaction rolled back, and after
    /// an asynchronous failover lost its commit: the client's retry with the
    /// same key then creates its rows anew. With a generated id (a sequence,
    /// `gen_random_uuid()`) the new rows get a new id, and everything keyed
    /// by that id outside the database (a payment provider's idempotency
    /// key from [`derive_tenant_key`](crate::outbox::derive_tenant_key), a
    /// link the client already holds) no longer matches: the provider
    /// charges again. With this id the recreated row is the same row, its
    /// outbox event carries the same entity id, and every derived key is
    /// the same (see the [outbox guide](crate::guide::outbox)).
    ///
    /// The operation is the key *and* its request: once a key's retention
    /// has ended, the same key with another request is a new operation and
    /// gets a new id, while the same request again gets the same id (and
    /// meets whatever domain rule its first run's rows set, such as one
    /// order per checkout).
    ///
    /// It is 16 bytes of `SHA-256("tower-idempotency/derived-id/2" ‖ tenant
    /// ‖ endpoint ‖ key ‖ fingerprint ‖ name)` (each part length-prefixed)
    /// as an RFC 9562 version-8 UUID, hyphenated. Handlers get it from their
    /// transaction (`PgTx::derived_id`, `SqlxTx::derived_id`, the lease
    /// handles).
    ///
    /// ```
    /// use tower_idempotency::{fingerprint::Fingerprint, scope::{Scope, TenantId}};
    ///
    /// let scope = Scope::new(TenantId::new("tenant-a"), "POST /orders v1");
    /// let request = Fingerprint::digest("orders.v1", br#"{"checkout_id":"chk_1"}"#);
    /// let id = scope.derived_id("9f1c2d0e-order-1", &request, "order");
    /// assert_eq!(id, scope.derived_id("9f1c2d0e-order-1", &request, "order"));
    /// assert_ne!(id, scope.derived_id("9f1c2d0e-order-1", &request, "shipment"));
    /// let another = Fingerprint::digest("orders.v1", br#"{"checkout_id":"chk_2"}"#);
    /// assert_ne!(id, scope.derived_id("9f1c2d0e-order-1", &another, "order"));
    /// let other = Scope::new(TenantId::new("tenant-b"), "POST /orders v1");
    /// assert_ne!(id, other.derived_id("9f1c2d0e-order-1", &request, "order"));
    /// assert_eq!((id.len(), &id[14..15]), (36, "8"));
    /// ```
    pub fn derived_id(&self, key: &str, fingerprint: &Fingerprint, name: &str) -> String {
        use sha2::{Digest, Sha256};
        let mut hasher = Sha256::new();
        hasher.update(b"tower-idempotency/derived-id/2");
        let parts: [&[u8]; 5] = [
            self.tenant.as_str().as_bytes(),
            self.endpoint().as_bytes(),
            key.as_bytes(),
            fingerprint.as_bytes().as_slice(),
            name.as_bytes(),
        ];
        for part in parts {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part);
        }
        let digest = hasher.finalize();
        let mut bytes = [0u8; 16];
        bytes.copy_from_slice(&digest[..16]);
        // Version 8 (custom), variant RFC 9562.
        bytes[6] = (bytes[6] & 0x0f) | 0x80;
        bytes[8] = (bytes[8] & 0x3f) | 0x80;
        uuid::Uuid::from_bytes(bytes).hyphenated().to_string()
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
