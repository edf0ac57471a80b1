-- Events to deliver downstream, written in the same transaction as the
-- business rows (see tower_idempotency::outbox).
CREATE TABLE outbox_events (
    id               uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
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
    parked_at        timestamptz
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

-- Consumer-side deduplication: one row per (consumer, event) processed.
CREATE TABLE inbox_events (
    consumer      text        NOT NULL,
    event_id      text        NOT NULL,
    processed_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);
