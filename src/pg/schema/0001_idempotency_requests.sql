CREATE TABLE idempotency_requests (
    tenant_id            text        NOT NULL,
    endpoint             text        NOT NULL,
    idempotency_key      text        NOT NULL,
    request_fingerprint  bytea       NOT NULL,
    state                text        NOT NULL DEFAULT 'in_progress'
                                     CHECK (state IN ('in_progress', 'completed')),
    attempt_token        bigint      NOT NULL DEFAULT 1,
    response_status      smallint,
    response_headers     bytea,
    response_body        bytea,
    created_at           timestamptz NOT NULL DEFAULT now(),
    completed_at         timestamptz,
    expires_at           timestamptz NOT NULL,
    CONSTRAINT idempotency_requests_pkey
        PRIMARY KEY (tenant_id, endpoint, idempotency_key)
) WITH (fillfactor = 80);
-- fillfactor leaves room on each page for the completion UPDATE's new row
-- version: with it, and no index on a column the completion changes, the
-- update is a HOT update (see 0009, which made that true).
CREATE INDEX idempotency_requests_expires_at_idx ON idempotency_requests (expires_at);
