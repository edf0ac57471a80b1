//! The operator API: look at one key, or forget it deliberately.

use std::time::SystemTime;

use http::StatusCode;

use super::{map_error, PgStore};
use crate::{Fingerprint, IdempotencyKey, StoreError, StoreErrorKind, TenantId};

/// The state of a remembered key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyState {
    /// An operation holds the key (committed in-progress rows only; a claim
    /// still inside its transaction is invisible until it commits).
    InProgress,
    /// The response is remembered and replays until `expires_at`.
    Completed,
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
    /// # async fn admin(store: tower_idempotency::PgStore) -> Result<(), tower_idempotency::StoreError> {
    /// use tower_idempotency::TenantId;
    ///
    /// if let Some(record) = store.inspect_key(&TenantId::new("tenant-a"), "POST /orders v1", "order-attempt-1").await? {
    ///     println!("{:?} {:?} expires {:?}", record.state, record.response_status, record.expires_at);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn inspect_key(
        &self,
        tenant: &TenantId,
        endpoint: &str,
        key: &str,
    ) -> Result<Option<KeyRecord>, StoreError> {
        let conn = self.conn().await?;
        let row = conn
            .query_opt(
                "SELECT tenant_id, endpoint, state, request_fingerprint, response_status, attempt_token, \
                        created_at, completed_at, expires_at \
                 FROM idempotency_requests WHERE tenant_id = $1 AND endpoint = $2 AND idempotency_key = $3",
                &[&tenant.as_str(), &endpoint, &key],
            )
            .await
            .map_err(map_error)?;
        let Some(row) = row else { return Ok(None) };
        let corrupt = |what: &str| {
            StoreError::new(
                StoreErrorKind::Corrupt,
                format!("stored record has an invalid {what}"),
            )
        };
        let state = match row.get::<_, &str>(2) {
            "completed" => KeyState::Completed,
            _ => KeyState::InProgress,
        };
        let status: Option<i16> = row.get(4);
        Ok(Some(KeyRecord {
            tenant_id: row.get(0),
            endpoint: row.get(1),
            state,
            fingerprint: Fingerprint::from_slice(row.get(3))
                .ok_or_else(|| corrupt("fingerprint"))?,
            response_status: match status {
                Some(s) => Some(
                    u16::try_from(s)
                        .ok()
                        .and_then(|s| StatusCode::from_u16(s).ok())
                        .ok_or_else(|| corrupt("status"))?,
                ),
                None => None,
            },
            attempt_token: row.get(5),
            created_at: row.get(6),
            completed_at: row.get(7),
            expires_at: row.get(8),
        }))
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
        tenant: &TenantId,
        endpoint: &str,
        key: &str,
        reason: &str,
    ) -> Result<bool, StoreError> {
        let conn = self.conn().await?;
        let removed = conn
            .execute(
                "DELETE FROM idempotency_requests WHERE tenant_id = $1 AND endpoint = $2 AND idempotency_key = $3",
                &[&tenant.as_str(), &endpoint, &key],
            )
            .await
            .map_err(map_error)?;
        let key_hash = IdempotencyKey::parse(key.as_bytes())
            .map(|k| k.short_hash())
            .unwrap_or_default();
        tracing::warn!(
            target: "tower_idempotency::audit",
            tenant = tenant.as_str(),
            endpoint,
            key_hash,
            reason,
            removed = removed > 0,
            "idempotency key removed by an operator"
        );
        Ok(removed > 0)
    }
}
