-- Committed in-progress rows are rare (a handler that ended the claim's
-- transaction itself); this keeps finding the oldest one cheap.
CREATE INDEX idempotency_requests_in_progress_idx ON idempotency_requests (created_at)
    WHERE state = 'in_progress';
