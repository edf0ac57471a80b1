//! Retention's statements: expired records removed in batches, and the
//! gauges of the backlog, the oldest operation that holds a key and the
//! long-running operations.

use super::sql::Sql;

// The tenants of the oldest expired rows (among the `$1` oldest), oldest
// first: a read without locks, across tenants (on Citus, across shards).
// DELETE_BATCH then removes each tenant's.
pub(crate) const EXPIRED_TENANTS: Sql<'static> = Sql::new(
    "SELECT tenant_id FROM (SELECT tenant_id, expires_at FROM idempotency_requests \
         WHERE expires_at <= now() ORDER BY expires_at LIMIT $1::int8) AS expired \
     GROUP BY tenant_id ORDER BY min(expires_at)",
);

// Up to `$2` expired rows of tenant `$1`; rows locked by a claim (an expired
// key being taken over, a live owner) or by another cleaner are skipped,
// not waited for. An expired `in_progress` row that nobody holds is an
// orphan (its transaction ended without completing it) and goes too. Per
// tenant, so that on Citus the lock is taken on one shard (Citus refuses
// FOR UPDATE across shards).
pub(crate) const DELETE_BATCH: Sql<'static> = Sql::new(
    "DELETE FROM idempotency_requests \
     WHERE tenant_id = $1::text AND (endpoint, idempotency_key) IN ( \
         SELECT endpoint, idempotency_key FROM idempotency_requests \
         WHERE tenant_id = $1::text AND expires_at <= now() \
         ORDER BY expires_at LIMIT $2::int8 FOR UPDATE SKIP LOCKED)",
);

// Expired rows not yet removed (the cleanup backlog gauge).
pub(crate) const CLEANUP_BACKLOG: Sql<'static> =
    Sql::new("SELECT count(*) FROM idempotency_requests WHERE expires_at <= now()");

// The oldest operation that holds a key: open transactions that wrote to the
// key table (every claim inserts its row there; what else writes to it, a
// cleanup batch or a lease's short statement, ends in milliseconds), and
// committed in-progress rows not yet expired (an expired one holds nothing:
// the next claim takes it over). Found through the table's lock, so claims
// need no tag of their own.
//
// The committed rows that hold a key are long-running operations (a lease
// set), found through the lease index. A short-mode row is committed only
// `completed`: its owner is an open transaction, counted by the first term.
// One committed `in_progress` without a lease is an orphan nobody creates
// (the completion checks the claim's transaction id, the handle refuses
// transaction control); it holds nothing either (the next claim takes it
// over), and finding it would need an index on `state`, which would cost
// every completion its HOT update.
pub(crate) const OLDEST_IN_PROGRESS: Sql<'static> = Sql::new(
    "SELECT GREATEST( \
     (SELECT COALESCE(max(EXTRACT(EPOCH FROM now() - a.xact_start)), 0)::float8 \
      FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
      WHERE l.locktype = 'relation' AND l.relation = 'idempotency_requests'::regclass \
        AND l.mode = 'RowExclusiveLock' AND l.granted \
        AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
        AND a.xact_start IS NOT NULL AND a.pid <> pg_backend_pid()), \
     (SELECT COALESCE(EXTRACT(EPOCH FROM now() - min(created_at)), 0)::float8 FROM idempotency_requests \
      WHERE state = 'in_progress' AND lease_expires_at IS NOT NULL AND expires_at > now()))",
);

// Long-running operations: the oldest one still in progress, and how many
// wait for a takeover (lease expired, record not).
pub(crate) const LEASES: Sql<'static> = Sql::new(
    "SELECT \
     COALESCE(EXTRACT(EPOCH FROM now() - min(created_at)), 0)::float8, \
     count(*) FILTER (WHERE lease_expires_at <= now()) \
     FROM idempotency_requests \
     WHERE state = 'in_progress' AND lease_expires_at IS NOT NULL AND expires_at > now()",
);
