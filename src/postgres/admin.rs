//! The operator API: look at one key, or forget it deliberately.

use std::time::SystemTime;

use http::StatusCode;
use tokio_postgres::types::Type;

use super::{decode, statements::Sql, PgStore};
use crate::{
    fingerprint::Fingerprint, key::IdempotencyKey, record::ResourceId, scope::Scope,
    store::StoreError,
};

// Column order as `decode::key_record` reads it.
const INSPECT_KEY: &str =
    "SELECT tenant_id, endpoint, state, request_fingerprint, response_status, attempt_token, \
         created_at, completed_at, expires_at, resource_id \
     FROM idempotency_requests \
     WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text";

const REMOVE_KEY: &str = "DELETE FROM idempotency_requests \
     WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text";

// tenant, endpoint, key.
const KEY_PARAMS: &[Type] = &[Type::TEXT, Type::TEXT, Type::TEXT];
pub(super) const INSPECT_KEY_SQL: Sql<'static> = Sql::new(INSPECT_KEY, KEY_PARAMS);
pub(super) const REMOVE_KEY_SQL: Sql<'static> = Sql::new(REMOVE_KEY, KEY_PARAMS);

/// The state of a remembered key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyState {
    /// An operation holds the key (committed in-progress rows only; a claim
    /// still inside its transaction is invisible until it commits).
    InProgress,
    /// The response is remembered and replays until `expires_at`.
    Completed,
    /// A long-running operation ended `failed` after its last allowed
    /// attempt; its `500 operation_failed` replays until `expires_at`.
    Failed,
}

/// What an operator sees of one key: no body, no headers.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyRecord {
    /// The tenant.
    pub tenant_id: String,
    /// The endpoint name.
    pub endpoint: String,
    /// In progress or completed.
    pub state: KeyState,
    /// The first request's fingerprint.
    pub fingerprint: Fingerprint,
    /// The remembered status, once completed.
    pub response_status: Option<StatusCode>,
    /// The resource the operation created or changed, if its handler named
    /// one ([`ResourceId`]).
    pub resource_id: Option<ResourceId>,
    /// 1 for the first operation under this key, higher after expiry takeovers.
    pub attempt_token: i64,
    /// When the current operation claimed the key.
    pub created_at: SystemTime,
    /// When it completed.
    pub completed_at: Option<SystemTime>,
    /// When the key stops replaying and becomes a new operation.
    pub expires_at: SystemTime,
}

impl PgStore {
    /// Looks up one key of one tenant on one endpoint.
    ///
    /// ```no_run
    /// # async fn admin(store: tower_idempotency::postgres::PgStore) -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_idempotency::{key::IdempotencyKey, scope::{Scope, TenantId}};
    ///
    /// let scope = Scope::new(TenantId::new("tenant-a"), "POST /orders v1");
    /// let key = IdempotencyKey::parse(b"order-attempt-1")?;
    /// if let Some(record) = store.inspect_key(&scope, &key).await? {
    ///     println!("{:?} {:?} expires {:?}", record.state, record.response_status, record.expires_at);
    ///     if let Some(order) = &record.resource_id {
    ///         println!("this key created {order}");
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn inspect_key(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
    ) -> Result<Option<KeyRecord>, StoreError> {
        let session = self.session().await?;
        let (tenant, endpoint, key) = (scope.tenant().as_str(), scope.endpoint(), key.as_str());
        let row = session
            .query_opt(INSPECT_KEY_SQL, &[&tenant, &endpoint, &key])
            .await?;
        row.as_ref().map(decode::key_record).transpose()
    }

    /// Forgets one key deliberately: the next request with it is a new
    /// operation. Returns whether a record was removed. Every call is
    /// audited through `tracing` (target `tower_idempotency::audit`, with the
    /// key hashed and the reason given).
    ///
    /// Removing a key does not undo its operation: the domain's own unique
    /// constraints (e.g. one order per checkout) still stand.
    pub async fn remove_key(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        reason: &str,
    ) -> Result<bool, StoreError> {
        let session = self.session().await?;
        let (tenant, endpoint) = (scope.tenant().as_str(), scope.endpoint());
        let removed = session
            .execute(REMOVE_KEY_SQL, &[&tenant, &endpoint, &key.as_str()])
            .await?;
        tracing::warn!(
            target: "tower_idempotency::audit",
            tenant,
            endpoint,
            key_hash = %key.short_hash(),
            reason,
            removed = removed > 0,
            "idempotency key removed by an operator"
        );
        Ok(removed > 0)
    }
}
