//! The outbox's statements: the event a handler enqueues, the relay's
//! batch (claim the due events, mark each delivered, failed with its retry
//! scheduled, or parked), the backlog, and the inbox's record of a
//! delivered event.

use super::sql::Sql;

// An event, written in the handler's transaction.
pub(crate) const ENQUEUE: Sql<'static> = Sql::new(
    "INSERT INTO outbox_events (tenant_id, aggregate_id, event_type, payload) \
     VALUES ($1::text, $2::text, $3::text, $4::jsonb) RETURNING id::text",
);

// Due events, locked for this batch; rows another relay holds are skipped.
pub(crate) const CLAIM_EVENTS: Sql<'static> = Sql::new(
    "SELECT id::text, tenant_id, aggregate_id, event_type, payload, attempts \
     FROM outbox_events \
     WHERE published_at IS NULL AND parked_at IS NULL AND next_attempt_at <= now() \
     ORDER BY next_attempt_at \
     LIMIT $1::int8 \
     FOR UPDATE SKIP LOCKED",
);

// Events are named by their key, (tenant, id): the first array holds the
// tenants, the second the ids, in the same order.
pub(crate) const MARK_DELIVERED: Sql<'static> = Sql::new(
    "UPDATE outbox_events AS o \
     SET published_at = statement_timestamp(), attempts = o.attempts + 1, last_error = NULL \
     FROM unnest($1::text[], $2::text[]) AS f(tenant_id, id) \
     WHERE o.tenant_id = f.tenant_id AND o.id = f.id::uuid",
);

pub(crate) const MARK_FAILED: Sql<'static> = Sql::new(
    "UPDATE outbox_events AS o \
     SET attempts = o.attempts + 1, last_error = f.error, \
         next_attempt_at = statement_timestamp() + f.delay_ms * interval '1 millisecond' \
     FROM unnest($1::text[], $2::text[], $3::text[], $4::float8[]) AS f(tenant_id, id, error, delay_ms) \
     WHERE o.tenant_id = f.tenant_id AND o.id = f.id::uuid",
);

pub(crate) const MARK_PARKED: Sql<'static> = Sql::new(
    "UPDATE outbox_events AS o \
     SET attempts = o.attempts + 1, last_error = f.error, parked_at = statement_timestamp() \
     FROM unnest($1::text[], $2::text[], $3::text[]) AS f(tenant_id, id, error) \
     WHERE o.tenant_id = f.tenant_id AND o.id = f.id::uuid",
);

// Undelivered events and the age of the oldest (the backlog and lag gauges).
pub(crate) const OUTBOX_BACKLOG: Sql<'static> = Sql::new(
    "SELECT count(*), COALESCE(EXTRACT(EPOCH FROM now() - min(created_at))::float8, 0) \
     FROM outbox_events WHERE published_at IS NULL AND parked_at IS NULL",
);

// A delivered event, recorded once per consumer.
pub(crate) const INBOX_INSERT: Sql<'static> = Sql::new(
    "INSERT INTO inbox_events (tenant_id, consumer, event_id) \
     VALUES ($1::text, $2::text, $3::text) \
     ON CONFLICT (tenant_id, consumer, event_id) DO NOTHING",
);
