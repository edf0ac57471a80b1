-- Long-running operations (tower_idempotency::lease): a committed
-- in_progress row with a lease, a public operation id, and the request
-- stored so that a recovery worker can re-drive it. All NULL for
-- short-transaction records; adding nullable columns rewrites nothing.
ALTER TABLE idempotency_requests
    ADD COLUMN operation_id     uuid,
    ADD COLUMN lease_expires_at timestamptz,
    ADD COLUMN request_method   text,
    ADD COLUMN request_target   text,
    ADD COLUMN request_headers  bytea,
    ADD COLUMN request_body     bytea;
-- The status resource finds an operation by its id (scoped to the tenant
-- in the query); ids are random, unique across every tenant.
CREATE UNIQUE INDEX idempotency_requests_operation_id_idx
    ON idempotency_requests (operation_id) WHERE operation_id IS NOT NULL;
-- Recovery workers look for expired leases of one endpoint.
CREATE INDEX idempotency_requests_lease_idx
    ON idempotency_requests (endpoint, lease_expires_at)
    WHERE state = 'in_progress' AND lease_expires_at IS NOT NULL;
