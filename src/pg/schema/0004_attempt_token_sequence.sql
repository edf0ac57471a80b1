-- Attempt tokens come from one sequence, so a key's token only ever grows:
-- also after its row was removed (by cleanup or an operator), when a
-- per-row counter would start again at 1. A worker still holding an old
-- token can then never pass for the newest attempt. The sequence starts
-- above every token already handed out.
CREATE SEQUENCE idempotency_attempt_token_seq AS bigint;
SELECT setval('idempotency_attempt_token_seq',
              COALESCE((SELECT max(attempt_token) FROM idempotency_requests), 0) + 1,
              false);
ALTER TABLE idempotency_requests
    ALTER COLUMN attempt_token SET DEFAULT nextval('idempotency_attempt_token_seq');
ALTER SEQUENCE idempotency_attempt_token_seq OWNED BY idempotency_requests.attempt_token;
