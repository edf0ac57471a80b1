//! The texts of statements the layer sends, for benchmarks and experiments
//! whose hand-written anchors must send the very same ones: a comparison
//! then measures the layer, not another statement.
//!
//! Each parameter is cast in the text (`$1::text`), so a client may prepare
//! the statement without giving types.

/// The event [`outbox::enqueue`](crate::outbox::enqueue) writes:
/// `$1` the tenant, `$2` the aggregate id, `$3` the event type, `$4` the
/// payload (`jsonb`); returns the event's id as text.
pub const ENQUEUE: &str = crate::protocol::outbox::ENQUEUE.text();

/// The one-commit mode's record, inserted completed with the response as
/// the last statement of the handler's transaction (pipelined with its
/// `COMMIT`): `$1` tenant, `$2` endpoint, `$3` key, `$4` fingerprint
/// (`bytea`), `$5` status (`int2`), `$6` the header block
/// ([`StoredResponse::encode_headers`](crate::record::StoredResponse::encode_headers)),
/// `$7` body (`bytea`), `$8` resource id (`text`, may be null), `$9`
/// retention in seconds (`float8`), `$10` the request's trace id (`text`,
/// 32 hex digits, may be null). A key that has a row fails it with a
/// unique violation (`23505`). The layer sends it without the session
/// reset when its store's reset is not folded in.
pub const CLAIM_AT_COMMIT: &str = crate::protocol::at_commit::CLAIM_AT_COMMIT.text();

/// [`CLAIM_AT_COMMIT`] with the session reset in the same statement, as
/// the layer sends it on a connection reached directly: `$11` the hold
/// limit the session keeps, `$12` the role the store logs in as (each may
/// be null).
pub const CLAIM_AT_COMMIT_AND_RESET: &str =
    crate::protocol::at_commit::CLAIM_AT_COMMIT_AND_RESET.text();

/// The claim-first mode's claim: `$1` tenant, `$2` endpoint, `$3` key, `$4`
/// fingerprint, `$5` retention in seconds. One row: whether the key was
/// claimed, the attempt token and the transaction id (as text) when it
/// was, else the key's record.
pub const CLAIM: &str = crate::protocol::claim::CLAIM.text();

/// The claim-first mode's completion with the session reset in the same
/// statement: `$1`–`$3` the key, `$4` the attempt token, `$5` status, `$6`
/// header block, `$7` body, `$8` retention, `$9` the claim's transaction
/// id (text), `$10` resource id, `$11` the trace id (may be null), `$12`
/// the hold limit, `$13` the login. It
/// fails (division by zero) unless it completes the claim's row, so that
/// the `COMMIT` behind it rolls back.
pub const COMPLETE_AND_RESET: &str = crate::protocol::complete::COMPLETE_AND_RESET.text();

/// A key's record, read with a fresh snapshot: `$1` tenant, `$2` endpoint,
/// `$3` key.
pub const LOOKUP: &str = crate::protocol::claim::LOOKUP.text();
