//! The operator API: look at one key, or forget it deliberately.

use tokio_postgres::types::Type;

use super::{decode, key_record::KeyRecord, statements::Sql, PgStore};
use crate::{key::IdempotencyKey, scope::Scope, store::StoreError};

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
