//! What the operator API shows of one key: [`KeyRecord`] and its
//! [`KeyState`] (no body, no headers), as `PgStore::inspect_key` reads it.

use std::time::SystemTime;

use http::StatusCode;

use crate::{fingerprint::Fingerprint, record::ResourceId};

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
    /// The trace of the request that did the work, if it carried one
    /// (see [`StoredResponse::trace_id`](crate::record::StoredResponse::trace_id)).
    pub trace_id: Option<crate::record::TraceId>,
}
