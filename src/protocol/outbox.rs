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

// The tenants with due events (among the `$1` due longest), those due
// longest first: a read without locks, across tenants (on Citus, across
// shards). CLAIM_EVENTS then locks each tenant's.
pub(crate) const DUE_TENANTS: Sql<'static> = Sql::new(
    "SELECT tenant_id FROM (SELECT tenant_id, next_attempt_at FROM outbox_events \
         WHERE published_at IS NULL AND parked_at IS NULL AND next_attempt_at <= now() \
         ORDER BY next_attempt_at LIMIT $1::int8) AS due \
     GROUP BY tenant_id ORDER BY min(next_attempt_at)",
);

// Up to `$2` due events of tenant `$1`, locked for this batch; rows another
// relay holds are skipped. Per tenant, so that on Citus the lock is taken
// on one shard (Citus refuses FOR UPDATE across shards).
pub(crate) const CLAIM_EVENTS: Sql<'static> = Sql::new(
    "SELECT id::text, tenant_id, aggregate_id, event_type, payload, attempts \
     FROM outbox_events \
     WHERE tenant_id = $1::text AND published_at IS NULL AND parked_at IS NULL \
         AND next_attempt_at <= now() \
     ORDER BY next_attempt_at \
     LIMIT $2::int8 \
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

// The retry's time is made of the statement's time, read once in a
// subquery, and immutable arithmetic: Citus refuses a stable function
// (timestamptz + interval is one) applied to a column in an UPDATE.
pub(crate) const MARK_FAILED: Sql<'static> = Sql::new(
    "UPDATE outbox_events AS o \
     SET attempts = o.attempts + 1, last_error = f.error, \
         next_attempt_at = to_timestamp( \
             (SELECT extract(epoch FROM statement_timestamp()))::float8 + f.delay_ms / 1000) \
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
