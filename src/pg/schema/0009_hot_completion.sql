-- The short mode's completion UPDATE becomes a heap-only-tuple (HOT) update:
-- PostgreSQL 15 makes an UPDATE HOT only if it changes no indexed column and
-- no column named in any index's predicate. The completion changes `state`
-- (and no longer `expires_at`: retention counts from the claim), so no index
-- may name `state`.
--
-- Committed in-progress rows of the short mode are orphans nobody creates
-- (the completion checks the claim's transaction id and the handle refuses
-- transaction control); the retention gauge now finds the committed
-- in-progress rows that hold a key, long-running operations, through the
-- lease index below.
DROP INDEX IF EXISTS idempotency_requests_in_progress_idx;
-- Without `state` in its predicate it keeps the same rows: a long-running
-- operation sets lease_expires_at to NULL when it completes or fails, and
-- so does a short-mode or one-commit takeover of an abandoned operation.
-- Every query through this index also asks for state = 'in_progress'.
DROP INDEX IF EXISTS idempotency_requests_lease_idx;
CREATE INDEX idempotency_requests_lease_idx
    ON idempotency_requests (endpoint, lease_expires_at)
    WHERE lease_expires_at IS NOT NULL;
