-- The schema of the first release, in one migration. Every later change is
-- a migration of its own, appended to `MIGRATIONS` (src/pg/migrations.rs)
-- and written by the rules of the migration guide (docs/migrations.md).
--
-- Column order is part of the schema (it is what `SELECT *` and a dump
-- show): columns are listed in the order the development schema added them.

-- One row per (tenant, endpoint, key): the claim, then the remembered
-- response. Concurrent duplicates are arbitrated by the primary key
-- (`INSERT … ON CONFLICT`), never by a read first.
CREATE TABLE idempotency_requests (
    tenant_id            text        NOT NULL,
    endpoint             text        NOT NULL,
    idempotency_key      text        NOT NULL,
    request_fingerprint  bytea       NOT NULL,
    -- 'failed': a long-running operation that failed after its last allowed
    -- attempt, its failure remembered like a completion.
    state                text        NOT NULL DEFAULT 'in_progress',
    -- The default is set below, from idempotency_attempt_token_seq.
    attempt_token        bigint      NOT NULL DEFAULT 1,
    response_status      smallint,
    response_headers     bytea,
    response_body        bytea,
    created_at           timestamptz NOT NULL DEFAULT now(),
    completed_at         timestamptz,
    expires_at           timestamptz NOT NULL,
    -- Long-running operations (tower_idempotency::lease): a committed
    -- in_progress row with a lease, a public operation id, and the request
    -- stored so that a recovery worker can re-drive it. All NULL for
    -- short-transaction records.
    operation_id         uuid,
    lease_expires_at     timestamptz,
    request_method       text,
    request_target       text,
    request_headers      bytea,
    request_body         bytea,
    -- The resource an operation created or changed (record::ResourceId),
    -- stored with its response in the same transaction; NULL for handlers
    -- that name none. Not indexed: the completion UPDATE that sets it stays a
    -- heap-only-tuple update, and "which resource did key X make" is a
    -- primary-key lookup.
    resource_id          text,
    -- Long-running operations count their attempts (the first run,
    -- takeovers, recoveries).
    attempts             integer     NOT NULL DEFAULT 0,
    CONSTRAINT idempotency_requests_pkey
        PRIMARY KEY (tenant_id, endpoint, idempotency_key),
    CONSTRAINT idempotency_requests_state_check
        CHECK (state IN ('in_progress', 'completed', 'failed'))
) WITH (fillfactor = 80);
-- fillfactor leaves room on each page for the completion UPDATE's new row
-- version: with it, and no index on a column the completion changes, the
-- update is a heap-only-tuple (HOT) update. PostgreSQL 15 makes an UPDATE
-- HOT only if it changes no indexed column and no column named in any
-- index's predicate. The completion changes `state` (and not `expires_at`:
-- retention counts from the claim), so no index may name `state`;
-- tests/hot_completion.rs checks the catalog against the completion's SET
-- list.
CREATE INDEX idempotency_requests_expires_at_idx ON idempotency_requests (expires_at);

-- Attempt tokens come from one sequence, so a key's token only ever grows:
-- also after its row was removed (by cleanup or an operator), when a
-- per-row counter would start again at 1. A worker still holding an old
-- token can then never pass for the newest attempt.
CREATE SEQUENCE idempotency_attempt_token_seq AS bigint;
ALTER TABLE idempotency_requests
    ALTER COLUMN attempt_token SET DEFAULT nextval('idempotency_attempt_token_seq');
ALTER SEQUENCE idempotency_attempt_token_seq OWNED BY idempotency_requests.attempt_token;

-- The status resource finds an operation by its id (scoped to the tenant
-- in the query); ids are random, unique across every tenant. Every primary
-- key and unique index includes tenant_id, so the tables can be
-- distributed by tenant (Citus's rule: a unique index must contain the
-- distribution column).
CREATE UNIQUE INDEX idempotency_requests_operation_id_idx
    ON idempotency_requests (tenant_id, operation_id) WHERE operation_id IS NOT NULL;
-- Recovery workers look for expired leases of one endpoint; the retention
-- gauge finds the committed in-progress rows that hold a key (long-running
-- operations) through it too. `state` is not in its predicate (see the HOT
-- update above) and need not be: an operation sets lease_expires_at to NULL
-- when it completes or fails, and so does a short-mode or one-commit
-- takeover of an abandoned operation. Every query through this index also
-- asks for state = 'in_progress'.
CREATE INDEX idempotency_requests_lease_idx
    ON idempotency_requests (endpoint, lease_expires_at)
    WHERE lease_expires_at IS NOT NULL;

-- Events to deliver downstream, written in the same transaction as the
-- business rows (see tower_idempotency::outbox). The primary key includes
-- tenant_id (see above); ids stay random UUIDs: unique in practice, and
-- every statement of a request names its tenant anyway.
CREATE TABLE outbox_events (
    id               uuid        NOT NULL DEFAULT gen_random_uuid(),
    tenant_id        text        NOT NULL,
    aggregate_id     text        NOT NULL,
    event_type       text        NOT NULL,
    payload          jsonb       NOT NULL DEFAULT '{}',
    created_at       timestamptz NOT NULL DEFAULT now(),
    -- NULL until delivered; set it back to NULL to deliver again.
    published_at     timestamptz,
    attempts         integer     NOT NULL DEFAULT 0,
    last_error       text,
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    -- Set after the last allowed attempt failed; set it back to NULL to re-drive.
    parked_at        timestamptz,
    CONSTRAINT outbox_events_pkey PRIMARY KEY (tenant_id, id)
);
CREATE INDEX outbox_events_due_idx ON outbox_events (next_attempt_at)
    WHERE published_at IS NULL AND parked_at IS NULL;
CREATE INDEX outbox_events_aggregate_idx ON outbox_events (tenant_id, aggregate_id);

-- Wake relays at commit (NOTIFY is transactional and collapses duplicates
-- within one transaction); statement-level, so a batch notifies once.
CREATE FUNCTION tower_idempotency_outbox_notify() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('tower_idempotency_outbox', '');
    RETURN NULL;
END
$$;
CREATE TRIGGER outbox_events_notify_insert AFTER INSERT ON outbox_events
    FOR EACH STATEMENT EXECUTE FUNCTION tower_idempotency_outbox_notify();
-- Re-drives only: an event made deliverable again.
CREATE TRIGGER outbox_events_notify_redrive AFTER UPDATE OF published_at, parked_at ON outbox_events
    FOR EACH ROW
    WHEN ((OLD.published_at IS NOT NULL OR OLD.parked_at IS NOT NULL)
          AND NEW.published_at IS NULL AND NEW.parked_at IS NULL)
    EXECUTE FUNCTION tower_idempotency_outbox_notify();

-- Consumer-side deduplication: one row per (tenant, consumer, event)
-- processed. tenant_id comes last and defaults to '' as in the development
-- schema, which added it to a table that had rows.
CREATE TABLE inbox_events (
    consumer      text        NOT NULL,
    event_id      text        NOT NULL,
    processed_at  timestamptz NOT NULL DEFAULT now(),
    tenant_id     text        NOT NULL DEFAULT '',
    CONSTRAINT inbox_events_pkey PRIMARY KEY (tenant_id, consumer, event_id)
);
