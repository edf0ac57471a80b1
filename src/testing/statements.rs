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
/// retention in seconds (`float8`). A key that has a row fails it with a
/// unique violation (`23505`). The layer sends it without the session
/// reset when its store's reset is not folded in.
pub const CLAIM_AT_COMMIT: &str = crate::protocol::at_commit::CLAIM_AT_COMMIT.text();
