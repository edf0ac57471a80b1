-- Every primary key and unique index includes tenant_id, so the tables can
-- be distributed by tenant (Citus's rule: a unique index must contain the
-- distribution column). Ids stay random UUIDs: unique in practice, and
-- every statement of a request names its tenant anyway.
ALTER TABLE outbox_events DROP CONSTRAINT outbox_events_pkey;
ALTER TABLE outbox_events ADD CONSTRAINT outbox_events_pkey PRIMARY KEY (tenant_id, id);
-- The consumer's deduplication is per tenant too; rows recorded before
-- this migration keep an empty tenant.
ALTER TABLE inbox_events ADD COLUMN tenant_id text NOT NULL DEFAULT '';
ALTER TABLE inbox_events DROP CONSTRAINT inbox_events_pkey;
ALTER TABLE inbox_events ADD CONSTRAINT inbox_events_pkey PRIMARY KEY (tenant_id, consumer, event_id);
DROP INDEX idempotency_requests_operation_id_idx;
CREATE UNIQUE INDEX idempotency_requests_operation_id_idx
    ON idempotency_requests (tenant_id, operation_id) WHERE operation_id IS NOT NULL;
