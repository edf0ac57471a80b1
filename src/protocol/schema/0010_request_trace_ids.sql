-- The trace id (W3C Trace Context, 32 hex digits) of the request whose work
-- a record remembers, written with the response: a replay's span names it,
-- so that an operator following a retry finds the run that produced its
-- answer. Nullable, no default: the catalog changes, no row is rewritten.
ALTER TABLE idempotency_requests ADD COLUMN IF NOT EXISTS trace_id text;
