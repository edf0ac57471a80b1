//! Rows of `idempotency_requests` decoded into records: the replayable
//! [`Record`] the claim reads, and the operator's [`KeyRecord`]. Both share
//! one reading of the stored state, fingerprint and status, and one error
//! for a value that does not decode ([`StoreErrorKind::Corrupt`]).

use bytes::Bytes;
use http::StatusCode;
use tokio_postgres::Row;

use super::key_record::{KeyRecord, KeyState};
use crate::{
    fingerprint::Fingerprint,
    record::{Record, ResourceId, StoredResponse},
    store::{StoreError, StoreErrorKind},
};

/// A row of the claim's lookup (`request_fingerprint, state,
/// response_status, response_headers, response_body, resource_id`); `None`
/// for a row that is not completed (a committed in-progress row).
pub(super) fn record(row: &Row) -> Result<Option<Record>, StoreError> {
    record_at(row, 0)
}

/// [`record`], for the same six columns starting at column `at`.
pub(super) fn record_at(row: &Row, at: usize) -> Result<Option<Record>, StoreError> {
    let state: &str = row.try_get(at + 1).map_err(|_| corrupt("state"))?;
    if !crate::protocol::lease::answered(state) {
        return Ok(None);
    }
    let fingerprint: &[u8] = row.try_get(at).map_err(|_| corrupt("fingerprint"))?;
    let status: i16 = row.try_get(at + 2).map_err(|_| corrupt("status"))?;
    let headers: &[u8] = row.try_get(at + 3).map_err(|_| corrupt("header block"))?;
    let body: &[u8] = row.try_get(at + 4).map_err(|_| corrupt("body"))?;
    let resource_id: Option<String> = row.try_get(at + 5).map_err(|_| corrupt("resource id"))?;
    Ok(Some(Record {
        fingerprint: fingerprint_of(fingerprint)?,
        response: StoredResponse {
            status: status_of(status)?,
            headers: StoredResponse::decode_headers(headers)
                .ok_or_else(|| corrupt("header block"))?,
            body: Bytes::copy_from_slice(body),
            resource_id: resource_id.map(ResourceId::new),
        },
    }))
}

/// A row of the operator's lookup (`tenant_id, endpoint, state,
/// request_fingerprint, response_status, attempt_token, created_at,
/// completed_at, expires_at, resource_id`).
pub(super) fn key_record(row: &Row) -> Result<KeyRecord, StoreError> {
    let state = state_of(row.get(2));
    let status: Option<i16> = row.get(4);
    Ok(KeyRecord {
        tenant_id: row.get(0),
        endpoint: row.get(1),
        state,
        fingerprint: fingerprint_of(row.get(3))?,
        response_status: status.map(status_of).transpose()?,
        attempt_token: row.get(5),
        created_at: row.get(6),
        completed_at: row.get(7),
        expires_at: row.get(8),
        resource_id: row.get::<_, Option<String>>(9).map(ResourceId::new),
    })
}

/// The `state` column: `completed`, `failed` (a long-running operation's
/// remembered failure, replayed as a completion is), or else in progress.
fn state_of(state: &str) -> KeyState {
    match state {
        "completed" => KeyState::Completed,
        "failed" => KeyState::Failed,
        _ => KeyState::InProgress,
    }
}

fn fingerprint_of(bytes: &[u8]) -> Result<Fingerprint, StoreError> {
    Fingerprint::from_slice(bytes).ok_or_else(|| corrupt("fingerprint"))
}

fn status_of(status: i16) -> Result<StatusCode, StoreError> {
    u16::try_from(status)
        .ok()
        .and_then(|s| StatusCode::from_u16(s).ok())
        .ok_or_else(|| corrupt("status"))
}

fn corrupt(what: &str) -> StoreError {
    StoreError::new(
        StoreErrorKind::Corrupt,
        format!("stored record has an invalid {what}"),
    )
}
