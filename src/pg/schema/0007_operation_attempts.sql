-- Long-running operations count their attempts (the first run, takeovers,
-- recoveries) and may end 'failed' after their last allowed attempt, with
-- the failure remembered like a completion. Adding a column with a constant
-- default rewrites nothing. Every existing row satisfies the wider check, so
-- it is added NOT VALID: no scan under the table's lock.
ALTER TABLE idempotency_requests
    ADD COLUMN attempts integer NOT NULL DEFAULT 0;
ALTER TABLE idempotency_requests
    DROP CONSTRAINT idempotency_requests_state_check;
ALTER TABLE idempotency_requests
    ADD CONSTRAINT idempotency_requests_state_check
    CHECK (state IN ('in_progress', 'completed', 'failed')) NOT VALID;
