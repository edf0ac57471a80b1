//! A key's record as every statement sees it: the key's parameters, the
//! rule that says whether the record may be taken over, and how its columns
//! are read back (the fingerprint, whether it holds an answer, the stored
//! response). The claim, the completion and the long-running mode build on
//! this; it builds on nothing of theirs.

use bytes::Bytes;

use super::sql::{corrupt, Columns, Param};
use crate::{
    fingerprint::Fingerprint,
    record::{Record, ResourceId, StoredResponse, TraceText},
    store::{ClaimRequest, StoreError},
};

/// The rule "may this record be taken over", in SQL, for the record's
/// columns prefixed by `$row` and the instant `$now`: its retention ended,
/// or it is an `in_progress` row no transaction holds (an owner in the
/// claim-first mode only ever commits `completed`, so such a row is an orphan:
/// a crash of an older version, a manual edit) whose lease, if it has one
/// (a long-running operation's), expired. Every statement that takes a key
/// over says it through this one text.
macro_rules! may_take_over {
    ($row:literal, $now:literal) => {
        concat!(
            $row,
            "expires_at <= ",
            $now,
            " OR (",
            $row,
            "state = 'in_progress' AND (",
            $row,
            "lease_expires_at IS NULL OR ",
            $row,
            "lease_expires_at <= ",
            $now,
            "))"
        )
    };
}
pub(crate) use may_take_over;

/// The key's columns: tenant, endpoint, key.
pub(crate) fn key_params(request: &ClaimRequest) -> [Param<'_>; 3] {
    [
        Param::Text(request.scope.tenant().as_str()),
        Param::Text(request.scope.endpoint()),
        Param::Text(request.key.as_str()),
    ]
}

/// The record in the seven columns from `at` (see [`LOOKUP`]); `None` for a
/// row without an answer to replay (in progress). A long-running
/// operation's remembered failure replays as a completion does.
pub(crate) fn record_at<R: Columns + ?Sized>(
    row: &R,
    at: usize,
) -> Result<Option<Record>, StoreError> {
    if !answered(row.text(at + 1)?) {
        return Ok(None);
    }
    // The trace is for operators: one that does not read is left out.
    let (trace_id, span_id) = row.opt_text(at + 6)?.map_or((None, None), TraceText::parse);
    Ok(Some(Record {
        fingerprint: fingerprint(row.bytea(at)?)?,
        response: response_at(row, at + 2)?.with_trace(trace_id, span_id),
    }))
}

/// The response stored in the columns from `at`: status, headers (and
/// trailers), body, resource id.
pub(crate) fn response_at<R: Columns + ?Sized>(
    row: &R,
    at: usize,
) -> Result<StoredResponse, StoreError> {
    let block = row.bytea(at + 1)?;
    Ok(StoredResponse {
        status: status(row.int2(at)?)?,
        headers: StoredResponse::decode_headers(block).ok_or_else(|| corrupt("header block"))?,
        body: Bytes::copy_from_slice(row.bytea(at + 2)?),
        resource_id: row
            .opt_text(at + 3)?
            .map(|id| ResourceId::new(id.to_owned())),
        trailers: StoredResponse::decode_trailers(block).ok_or_else(|| corrupt("trailer block"))?,
        trace_id: None,
        span_id: None,
    })
}

/// A stored fingerprint.
pub(crate) fn fingerprint(bytes: &[u8]) -> Result<Fingerprint, StoreError> {
    Fingerprint::from_slice(bytes).ok_or_else(|| corrupt("fingerprint"))
}

/// A stored status code.
pub(crate) fn status(status: i16) -> Result<http::StatusCode, StoreError> {
    u16::try_from(status)
        .ok()
        .and_then(|s| http::StatusCode::from_u16(s).ok())
        .ok_or_else(|| corrupt("status"))
}

/// Whether a record in `state` holds an answer to replay: a completion, or
/// a long-running operation's remembered failure. Both drivers' claims and
/// lookups read the `state` column through this one rule.
pub(crate) fn answered(state: &str) -> bool {
    matches!(state, "completed" | "failed")
}
