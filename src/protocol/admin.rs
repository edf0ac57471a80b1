//! The operator's statements: look at one key, or forget it deliberately,
//! and the reading of what the look returns.

use super::{
    record::{fingerprint, status},
    sql::{Columns, Param, Sql},
};
use crate::{
    key::IdempotencyKey,
    record::ResourceId,
    scope::Scope,
    store::{KeyRecord, KeyState, StoreError},
};

/// One key's record without its body or headers, as [`key_record`] reads
/// it; the timestamps as whole microseconds since the Unix epoch.
pub(crate) const INSPECT_KEY: Sql<'static> = Sql::new(
    "SELECT tenant_id, endpoint, state, request_fingerprint, response_status, attempt_token, \
         (EXTRACT(EPOCH FROM created_at) * 1000000)::int8, \
         (EXTRACT(EPOCH FROM completed_at) * 1000000)::int8, \
         (EXTRACT(EPOCH FROM expires_at) * 1000000)::int8, resource_id, trace_id \
     FROM idempotency_requests \
     WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text",
);

/// Removes one key's record.
pub(crate) const REMOVE_KEY: Sql<'static> = Sql::new(
    "DELETE FROM idempotency_requests \
     WHERE tenant_id = $1::text AND endpoint = $2::text AND idempotency_key = $3::text",
);

/// The parameters of both: tenant, endpoint, key.
pub(crate) fn params<'a>(scope: &'a Scope, key: &'a IdempotencyKey) -> [Param<'a>; 3] {
    [
        Param::Text(scope.tenant().as_str()),
        Param::Text(scope.endpoint()),
        Param::Text(key.as_str()),
    ]
}

/// A row of [`INSPECT_KEY`].
pub(crate) fn key_record<R: Columns>(row: &R) -> Result<KeyRecord, StoreError> {
    Ok(KeyRecord {
        tenant_id: row.text(0)?.to_owned(),
        endpoint: row.text(1)?.to_owned(),
        state: match row.text(2)? {
            "completed" => KeyState::Completed,
            "failed" => KeyState::Failed,
            _ => KeyState::InProgress,
        },
        fingerprint: fingerprint(row.bytea(3)?)?,
        response_status: row.opt_int2(4)?.map(status).transpose()?,
        attempt_token: row.int8(5)?,
        created_at: row.micros(6)?,
        completed_at: row.opt_micros(7)?,
        expires_at: row.micros(8)?,
        resource_id: row.opt_text(9)?.map(|id| ResourceId::new(id.to_owned())),
        trace_id: row
            .opt_text(10)?
            .and_then(|text| crate::record::TraceText::parse(text).0),
    })
}
