//! The operator API: look at one key, or forget it deliberately.

use super::{prepared::dyn_params, PgStore};
use crate::{
    key::IdempotencyKey,
    protocol::admin::{key_record, params, INSPECT_KEY, REMOVE_KEY},
    scope::Scope,
    store::{KeyRecord, StoreError},
};

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
        let mut session = self.session().await?;
        let params = params(scope, key);
        let row = session.query_opt(INSPECT_KEY, &dyn_params(&params)).await?;
        session.answered();
        row.as_ref().map(key_record).transpose()
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
        let mut session = self.session().await?;
        let (tenant, endpoint) = (scope.tenant().as_str(), scope.endpoint());
        let params = params(scope, key);
        let removed = session.execute(REMOVE_KEY, &dyn_params(&params)).await?;
        session.answered();
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
