-- The session reset with the store's hold limit: what migration 3's
-- tower_idempotency_session_reset() runs, then the session's
-- idle_in_transaction_session_timeout set to `hold_limit` (unless NULL).
-- A PgStore that opens its own connections gives each of them that limit
-- when it opens and calls this behind (or inside) every transaction it
-- ends, so the limit is the session's whatever a handler's function did to
-- it; an owner whose hold limit is the store's then sends no `SET LOCAL` of
-- its own. `login` is the role the store logs in as: the session's
-- authorization is reset only when it is another (or `login` is NULL), as
-- resetting it costs the session its cached search path every time.
-- The function without arguments stays for builds that call it.
CREATE OR REPLACE FUNCTION tower_idempotency_session_reset(hold_limit text, login text)
RETURNS void LANGUAGE plpgsql AS $reset$
BEGIN
    IF login IS NULL OR session_user <> login THEN
        EXECUTE 'SET SESSION AUTHORIZATION DEFAULT';
    END IF;
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
