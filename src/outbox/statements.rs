//! The relay's statements: claiming a batch of due events, marking each
//! delivered, failed (its retry scheduled) or parked, and the backlog.

use crate::postgres::statements::Sql;

// Due events, locked for this batch; rows another relay holds are skipped.
const CLAIM_EVENTS: &str =
    "SELECT id::text, tenant_id, aggregate_id, event_type, payload, attempts \
     FROM outbox_events \
     WHERE published_at IS NULL AND parked_at IS NULL AND next_attempt_at <= now() \
     ORDER BY next_attempt_at \
     LIMIT $1::int8 \
     FOR UPDATE SKIP LOCKED";

// Events are named by their key, (tenant, id): the first array holds the
// tenants, the second the ids, in the same order.
const MARK_DELIVERED: &str = "UPDATE outbox_events AS o \
     SET published_at = clock_timestamp(), attempts = o.attempts + 1, last_error = NULL \
     FROM unnest($1::text[], $2::text[]) AS f(tenant_id, id) \
     WHERE o.tenant_id = f.tenant_id AND o.id = f.id::uuid";

const MARK_FAILED: &str = "UPDATE outbox_events AS o \
     SET attempts = o.attempts + 1, last_error = f.error, \
         next_attempt_at = clock_timestamp() + f.delay_ms * interval '1 millisecond' \
     FROM unnest($1::text[], $2::text[], $3::text[], $4::float8[]) AS f(tenant_id, id, error, delay_ms) \
     WHERE o.tenant_id = f.tenant_id AND o.id = f.id::uuid";

const MARK_PARKED: &str = "UPDATE outbox_events AS o \
     SET attempts = o.attempts + 1, last_error = f.error, parked_at = clock_timestamp() \
     FROM unnest($1::text[], $2::text[], $3::text[]) AS f(tenant_id, id, error) \
     WHERE o.tenant_id = f.tenant_id AND o.id = f.id::uuid";

// Undelivered events and the age of the oldest (the backlog and lag gauges).
pub(super) const OUTBOX_BACKLOG: &str =
    "SELECT count(*), COALESCE(EXTRACT(EPOCH FROM now() - min(created_at))::float8, 0) \
     FROM outbox_events WHERE published_at IS NULL AND parked_at IS NULL";

pub(crate) const CLAIM_EVENTS_SQL: Sql<'static> = Sql::new(CLAIM_EVENTS);
pub(crate) const MARK_DELIVERED_SQL: Sql<'static> = Sql::new(MARK_DELIVERED);
pub(crate) const MARK_FAILED_SQL: Sql<'static> = Sql::new(MARK_FAILED);
pub(crate) const MARK_PARKED_SQL: Sql<'static> = Sql::new(MARK_PARKED);
