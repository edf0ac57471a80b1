-- The session reset with the store's hold limit: what migration 3's
-- tower_idempotency_session_reset() runs, then the session's
-- idle_in_transaction_session_timeout set to `hold_limit` (unless NULL).
-- A PgStore that opens its own connections gives each of them that limit
-- when it opens and sends this call behind every owner's COMMIT or
-- ROLLBACK, so the limit is the session's, whatever a handler's function
-- did to it; an owner whose hold limit is the store's then sends no
-- `SET LOCAL` of its own (one statement fewer a create). The one without
-- an argument stays for builds that call it.
CREATE OR REPLACE FUNCTION tower_idempotency_session_reset(hold_limit text) RETURNS void
LANGUAGE plpgsql AS $reset$
BEGIN
    EXECUTE 'SET SESSION AUTHORIZATION DEFAULT';
    EXECUTE 'RESET ALL';
    EXECUTE 'CLOSE ALL';
    EXECUTE 'UNLISTEN *';
    PERFORM pg_advisory_unlock_all();
    EXECUTE 'DISCARD TEMP';
    IF hold_limit IS NOT NULL THEN
        PERFORM set_config('idle_in_transaction_session_timeout', hold_limit, false);
    END IF;
END
$reset$;
