//! The lexer's unit tests and proptests.

use super::*;
use proptest::prelude::*;

const ENDS_TRANSACTION: &[&str] = &[
    "COMMIT",
    "  commit;",
    "COMMIT;",
    "end;",
    "/* x */ COMMIT",
    "/* a /* nested */ b */ commit",
    "-- c\nROLLBACK",
    "BEGIN",
    "start transaction",
    "rollback",
    "abort",
    "PREPARE TRANSACTION 'x'",
    "INSERT INTO t VALUES (1); COMMIT",
    "SELECT 'a;b'; END",
    "COMMIT PREPARED 'x'",
    "ROLLBACK PREPARED 'x'",
    "ROLLBACK AND CHAIN",
    "COMMIT AND NO CHAIN",
    "END TRANSACTION",
    "BEGIN ISOLATION LEVEL SERIALIZABLE",
    "((COMMIT))",
    "SELECT 1;COMMIT",
    // `$` continues an identifier, so neither `$$` opens a dollar quote.
    "SELECT 1 AS x$$; COMMIT; SELECT 1 AS y$$",
    "SELECT B'0'\n'1'; COMMIT",
    "SELECT 1\n-- a comment; COMMIT\n;COMMIT",
];

const WHITESPACE_AND_COMMENT_ENDINGS: &[&str] = &[
    "--\rCOMMIT",
    "-- x\rROLLBACK",
    "SELECT 1 --\r; COMMIT",
    "SELECT 1 -- x\r\n; END",
    "\x0bCOMMIT",
    "\x0cCOMMIT",
    "SELECT 1;\x0bBEGIN",
    "SELECT 1;\x0c\x0b\t\r\n ABORT",
    "/* c */\x0b-- d\rCOMMIT",
];

const UNFOLLOWED: &[&str] = &[
    "SELECT 'abc",
    "SELECT 'abc''",
    "SELECT \"abc",
    "SELECT \"\"",
    "SELECT $$abc",
    "SELECT $a$ abc $b$",
    "SELECT $a$ abc $A$",
    "/* abc",
    "/* /* */ COMMIT",
    "SELECT E'abc\\'",
    "SELECT E'abc\\",
    "SELECT U&'abc",
    "SELECT U&\"abc",
    "SELECT B'01",
    "SELECT X'ab",
    "SELECT N'ab",
    "SELECT 'a\0b'",
    "SELECT 1\0; COMMIT",
    "SELECT 1\x01",
    "\x7fCOMMIT",
    "SELECT 1\x1b",
    "SELECT U&\"\\00zz\"",
    "SELECT U&\"\\+00\"",
    "SELECT U&\"x!0041\" UESCAPE '!'",
    "SELECT U&\"x\"/* c */uescape '!'",
];

/// Refused under either setting of standard_conforming_strings.
const EITHER_STRING_READING: &[&str] = &[
    // Off: '\'; SELECT ' is one string, then COMMIT runs.
    "SELECT '\\'; SELECT ';COMMIT;--'",
    // On: '\' is one string, then COMMIT runs.
    "SELECT '\\'; COMMIT; --'",
    "SELECT N'\\'; SELECT ';COMMIT;--'",
    // An E'…' continued on the next line still takes backslash escapes:
    // E'x' '\'; SELECT ' is one string.
    "SELECT E'x'\n'\\'; SELECT ';COMMIT;--'",
    "SELECT E'x' -- c\n\r -- d\n'\\'; SELECT ';COMMIT;--'",
];

const SESSION_SETTINGS: &[&str] = &[
    "SET default_transaction_read_only = on",
    "set search_path to x",
    "RESET ALL",
    "SET SESSION x = 1",
    "SET SESSION AUTHORIZATION DEFAULT",
    "SET ROLE r",
    "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY",
    // Another client encoding would change how the server reads the text.
    "SET LOCAL client_encoding = 'SJIS'",
    "SET LOCAL \"client_encoding\" TO 'SJIS'",
    "set local names 'SJIS'",
];

const OUTLIVES_TRANSACTION: &[&str] = &[
    "PREPARE q AS SELECT 1",
    "prepare q (int) AS SELECT $1",
    "EXECUTE q",
    "EXECUTE q(1)",
    "DEALLOCATE q",
    "DEALLOCATE ALL",
    "LISTEN c",
    "UNLISTEN *",
    "DISCARD ALL",
    "DISCARD TEMP",
    "LOAD 'auto_explain'",
    "DECLARE c CURSOR WITH HOLD FOR SELECT 1",
    "declare c no scroll cursor with hold for select 1",
    "CREATE TEMP TABLE t (id int)",
    "CREATE TEMPORARY TABLE t (id int)",
    "CREATE LOCAL TEMP TABLE t (id int)",
    "CREATE LOCAL TEMPORARY TABLE t (id int)",
    "CREATE GLOBAL TEMP TABLE t (id int)",
    "create temp table t on commit drop as select 1",
    "CREATE TEMP SEQUENCE s",
    "CREATE TEMP VIEW v AS SELECT 1",
    "CREATE OR REPLACE TEMP VIEW v AS SELECT 1",
    "CREATE TEMP RECURSIVE VIEW v (n) AS SELECT 1",
    "EXPLAIN ANALYZE CREATE TEMP TABLE t AS SELECT 1",
    "SELECT 1 INTO TEMP t",
    "SELECT * INTO TEMPORARY TABLE t FROM x",
    "SELECT * INTO LOCAL TEMP t FROM x",
    "WITH x AS (SELECT 1) SELECT * INTO TEMP t FROM x",
    "CREATE TABLE pg_temp.t (id int)",
    "CREATE FUNCTION pg_temp.f() RETURNS int LANGUAGE sql AS 'SELECT 1'",
    "SELECT * INTO pg_temp_3.t FROM x",
    "SELECT 1; LISTEN c",
];

const SESSION_FUNCTIONS_ANYWHERE: &[&str] = &[
    "SELECT set_config('search_path', 'x', false)",
    "SELECT SET_CONFIG('a.b', 'x', false)",
    "SELECT pg_catalog.set_config('a.b', 'x', false)",
    "SELECT pg_catalog . set_config ('a.b', 'x', false)",
    "SELECT \"set_config\"('a.b', 'x', false)",
    "SELECT U&\"\\0073et_config\"('a.b', 'x', false)",
    "SELECT * FROM set_config('a.b', 'x', false)",
    "INSERT INTO t SELECT set_config('a.b', 'x', false)",
    "SELECT 1 FROM t WHERE pg_advisory_lock(1) IS NOT NULL",
    "SELECT pg_advisory_lock(1, 2)",
    "SELECT pg_advisory_lock_shared(1)",
    "SELECT pg_try_advisory_lock(1)",
    "SELECT pg_try_advisory_lock_shared(1)",
    "WITH l AS (SELECT pg_advisory_lock(1)) SELECT 1",
    "SELECT 1 /* pg_advisory_lock */; SELECT pg_advisory_lock(1)",
    // A single-byte server encoding with a Turkish locale folds İ into i.
    "SELECT set_conf\u{130}g('a.b', 'x', false)",
];

/// An UPDATE of the pg_settings view calls `set_config(name, setting,
/// false)` through its rule: a session setting. So does an UPDATE of a view
/// over it, which a CREATE naming pg_settings could make.
const PG_SETTINGS_WRITES: &[&str] = &[
    "UPDATE pg_settings SET setting = 'x' WHERE name = 'search_path'",
    "update PG_SETTINGS set setting = 'x' where name = 'work_mem'",
    "UPDATE pg_catalog.pg_settings SET setting = 'x' WHERE name = 'work_mem'",
    "UPDATE /* c */ pg_catalog . \"pg_settings\" SET setting = 'x'",
    "UPDATE ONLY pg_settings SET setting = 'x' WHERE name = 'work_mem'",
    "UPDATE \"pg_settings\" AS s SET setting = 'x' WHERE s.name = 'work_mem'",
    "UPDATE U&\"pg\\005fsettings\" SET setting = 'x'",
    // A single-byte server encoding with a Turkish locale folds İ into i.
    "UPDATE pg_sett\u{130}ngs SET setting = 'x'",
    "EXPLAIN ANALYZE UPDATE pg_settings SET setting = 'x' WHERE name = 'work_mem'",
    "WITH u AS (UPDATE pg_settings SET setting = 'x' WHERE name = 'work_mem') SELECT 1",
    "SELECT 1; UPDATE pg_settings SET setting = 'x' WHERE name = 'work_mem'",
    "CREATE VIEW s AS SELECT * FROM pg_settings",
    "CREATE OR REPLACE VIEW s AS SELECT name, setting FROM pg_catalog.pg_settings",
    "CREATE RULE r AS ON INSERT TO t DO ALSO UPDATE pg_settings SET setting = 'x'",
];

/// Only `set_config(<name>, <value>, true)` with a name written out (not
/// client_encoding) ends with the transaction; anything else might not.
const SET_CONFIG_NOT_SURELY_LOCAL: &[&str] = &[
    "SELECT set_config('a.b', 'x', 't')",
    "SELECT set_config('a.b', 'x', 'true')",
    "SELECT set_config('a.b', 'x', $1)",
    "SELECT set_config('a.b', 'x', true OR false)",
    "SELECT set_config('a.b', 'x', true::bool)",
    "SELECT set_config('a.b', 'x', (true))",
    "SELECT set_config('a.b', 'x', \"true\")",
    "SELECT set_config('a.b', 'x')",
    "SELECT set_config('a.b', 'x', true, true)",
    "SELECT set_config",
    "SELECT set_config('a.b', 'x', true), set_config('c.d', 'y', false)",
    "SELECT set_config($1, 'x', true)",
    "SELECT set_config(name, 'x', true) FROM t",
    "SELECT set_config('client_encoding', 'SJIS', true)",
    "SELECT set_config('CLIENT_ENCODING', 'SJIS', true)",
    "SELECT set_config('client_' || 'encoding', 'SJIS', true)",
    "SELECT set_config(E'client\\_encoding', 'SJIS', true)",
    "SELECT set_config(U&'client\\005fencoding', 'SJIS', true)",
    "SELECT set_config('client'\n'_encoding', 'SJIS', true)",
    "SELECT set_config('search_path', 'pg_temp', true)",
    "SELECT set_config('search_path', 'app, PG_TEMP', true)",
    "SELECT set_config('search_path', $1, true)",
    "SELECT set_config('Search_Path', 'nowhere,pg_temp_3', true)",
    "SELECT set_config('search_path', $$\"pg_temp\"$$, true)",
    "SELECT set_config('search_path', 'caf\u{e9}, public', true)",
];

/// A `DO` block's body runs now, and a function's whenever it is called:
/// what would be refused as a statement is refused in them, and so is
/// what the guard cannot read there (dynamic SQL, other languages).
const BODIES: &[&str] = &[
    "DO $$ BEGIN PERFORM set_config('search_path', 'x', false); END $$",
    "do $$begin perform pg_catalog.set_config('a.b', 'x', false); end$$",
    "DO $body$ BEGIN SET search_path = x; END $body$",
    "DO LANGUAGE plpgsql $$ BEGIN IF true THEN RESET ALL; END IF; END $$",
    "DO $$ BEGIN PERFORM 1; END $$ LANGUAGE plpgsql; DO $$ BEGIN LISTEN c; END $$",
    "DO 'BEGIN PERFORM set_config(''a.b'', ''x'', false); END'",
    "DO $$ BEGIN EXECUTE 'SET search_path = x'; END $$",
    "DO $$ BEGIN EXECUTE format('SELECT %s(%L, %L, false)', 'set_config', 'a.b', 'x'); END $$",
    "DO $$ DECLARE r record; BEGIN FOR r IN EXECUTE 'SELECT 1' LOOP END LOOP; END $$",
    "DO $$ BEGIN CREATE TEMP TABLE t (x int); END $$",
    "DO $$ BEGIN PERFORM pg_advisory_lock(1); END $$",
    "DO $$ BEGIN UPDATE pg_settings SET setting = 'x' WHERE name = 'work_mem'; END $$",
    "DO $$ BEGIN SET LOCAL search_path = pg_temp; CREATE TABLE t (x int); END $$",
    "DO $$ <<outer>> BEGIN LISTEN c; END $$",
    "DO $$ DECLARE n int; BEGIN LOOP DISCARD TEMP; EXIT; END LOOP; END $$",
    "DO $$ BEGIN PERFORM 1; EXCEPTION WHEN others THEN SET work_mem = '1MB'; END $$",
    "DO $$ BEGIN IF false THEN NULL; ELSE SET SESSION work_mem = '1MB'; END IF; END $$",
    "DO $a$ BEGIN DO $b$ BEGIN PERFORM set_config('a.b', 'x', false); END $b$; END $a$",
    "DO $$ BEGIN PERFORM query_to_xml('SELECT 1', true, false, ''); END $$",
    "DO LANGUAGE plperl $$ spi_exec_query('SET search_path = x') $$",
    "DO $$ spi_exec_query('SET search_path = x') $$ LANGUAGE \"plperl\"",
    // An escape string with a backslash: its value is not read.
    "DO E'BEGIN PERFORM set_config(\\'a.b\\', \\'x\\', false); END'",
    "DO $$ BEGIN PERFORM 'unterminated; END $$",
    "DO $$ /* unterminated BEGIN NULL; END $$",
    "CREATE FUNCTION f() RETURNS void LANGUAGE sql AS $$ SELECT set_config('search_path', 'x', false) $$",
    "CREATE OR REPLACE FUNCTION f() RETURNS void AS $$ BEGIN SET search_path = x; END $$ LANGUAGE plpgsql",
    "CREATE PROCEDURE p() LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_advisory_lock(1); END $$",
    "CREATE FUNCTION f() RETURNS void LANGUAGE sql AS 'SELECT set_config(''a.b'', ''x'', false)'",
    "CREATE FUNCTION f() RETURNS void LANGUAGE plpgsql SET search_path = pg_temp AS $$ BEGIN CREATE TABLE t (x int); END $$",
    "CREATE FUNCTION f(text, text, boolean) RETURNS text LANGUAGE internal AS 'set_config_by_name'",
    "CREATE FUNCTION f() RETURNS void LANGUAGE plpython3u AS $$ plpy.execute('SET search_path = x') $$",
    "CREATE FUNCTION f() RETURNS void AS 'f.so', 'f' LANGUAGE C",
    // Quoting inside a body is read as at the top.
    "DO $do$ BEGIN PERFORM /* $$ */ set_config('a.b', 'x', false); END $do$",
    "DO $$ BEGIN PERFORM \"set_config\"('a.b', 'x', false); END $$",
    "DO $$BEGIN PERFORM U&\"set\\005fconfig\"('a.b', 'x', false); END$$",
    "DO $$ BEGIN PERFORM 1; -- '\rRESET ALL; END $$",
    "/* DO $$ */ DO $$ BEGIN RESET ALL; END $$",
    "DO $$ BEGIN UPDATE \"pg_catalog\".\"pg_settings\" SET setting = 'x'; END $$",
];

/// A search_path naming the temporary schema makes an unqualified CREATE
/// create a temporary object (when it comes first, or when the schemas
/// before it do not exist), which lives as long as the session and is
/// found before the permanent one of the same name.
const SEARCH_PATH_WITH_PG_TEMP: &[&str] = &[
    "SET LOCAL search_path = pg_temp",
    "SET LOCAL search_path TO app, pg_temp",
    "SET LOCAL search_path = nowhere, pg_temp",
    "SET LOCAL search_path = 'pg_temp'",
    "SET LOCAL \"search_path\" = \"pg_temp\"",
    "set local SEARCH_PATH = PG_TEMP",
    "SET LOCAL search_path = pg_temp_3",
    "SET LOCAL search_path = E'pg_temp'",
    "SET LOCAL search_path = U&'pg\\005ftemp'",
    "SET LOCAL search_path = 'app'\n', pg_temp'",
    "SET LOCAL search_path = /* c */ pg_temp",
    "SET LOCAL search_path = pg_temp; CREATE TABLE t (id int)",
    "ALTER FUNCTION f() SET search_path = app, pg_temp",
];

/// Functions that run SQL text, where the guard cannot read it.
const SQL_TEXT_FUNCTIONS: &[&str] = &[
    "SELECT query_to_xml('SELECT set_config(''a.b'', ''x'', false)', true, false, '')",
    "SELECT query_to_xml($1, true, false, '')",
    "SELECT pg_catalog.query_to_xml_and_xmlschema($1, true, false, '')",
    "SELECT * FROM ts_stat('SELECT v FROM docs')",
    "SELECT ts_rewrite('a'::tsquery, 'SELECT t, s FROM aliases')",
    "SELECT ts_rewrite('a'::tsquery, $1)",
];

/// What the rules above must leave alone.
const ALLOWED_NEAR_THE_RULES: &[&str] = &[
    "SELECT setting FROM pg_settings WHERE name = 'search_path'",
    "SELECT name, setting FROM pg_catalog.pg_settings WHERE source <> 'default'",
    "INSERT INTO audit (name, setting) SELECT name, setting FROM pg_settings",
    "UPDATE settings SET setting = 'x' WHERE name = 'theme'",
    "UPDATE app.settings SET setting = $1 WHERE name = $2",
    "UPDATE t SET setting = (SELECT setting FROM pg_settings WHERE name = 'work_mem')",
    "UPDATE t SET pg_settings = 1",
    "UPDATE pg_settings_archive SET setting = 'x'",
    "UPDATE t SET note = 'UPDATE pg_settings SET setting = 1'",
    "SELECT id FROM t FOR UPDATE",
    "INSERT INTO settings VALUES ($1, $2) ON CONFLICT (name) DO UPDATE SET setting = excluded.setting",
    "INSERT INTO t VALUES (1) ON CONFLICT DO NOTHING",
    "SELECT set_config('app.tenant_id', $1, true)",
    "SELECT set_config('search_path', 'app, public', true)",
    "SELECT pg_catalog.set_config('app.user', $1::text, TRUE)",
    "SELECT set_config('a.b', f(x, ARRAY[1, 2]), true)",
    "SELECT set_config('statement_timeout', '5s', true), set_config('app.x', $1, true)",
    "SELECT set_config(E'app.x', $1, true)",
    "SELECT set_config('app.x', 'it''s', /* local */ true)",
    "SELECT 'set_config(''a'', ''b'', false)' FROM t -- set_config(",
    "SET LOCAL search_path = 'app'",
    "SET LOCAL search_path TO \"$user\", public",
    "SET LOCAL search_path = app_pg_temp, pg_temporary",
    "SET LOCAL work_mem = '64MB'",
    "CREATE TABLE t (id int)",
    "CREATE TABLE app.t (id int)",
    "CREATE TABLE pg_temp_notes (id int)",
    "SELECT * FROM t WHERE note = 'pg_temp.x'",
    "DO $$ BEGIN INSERT INTO t VALUES (1); END $$",
    "DO $$ DECLARE n int; BEGIN SELECT count(*) INTO n FROM t; IF n = 0 THEN UPDATE t SET x = 1; END IF; END $$",
    "DO $$ BEGIN PERFORM set_config('app.x', 'v', true); SET LOCAL work_mem = '8MB'; END $$",
    "DO $$ BEGIN RAISE NOTICE 'SET search_path = x; %', 'set_config(a, b, false)'; END $$",
    "DO $$ BEGIN -- RESET ALL\n PERFORM 1; END $$",
    "DO 'BEGIN PERFORM 1; END'",
    "DO E'BEGIN PERFORM 1; END'",
    "DO LANGUAGE plpgsql $$ BEGIN NULL; END $$",
    "DO $outer$ BEGIN PERFORM $x$ SET search_path = x $x$; END $outer$",
    "DO $$ BEGIN INSERT INTO t VALUES ('set_config(''a'', ''b'', false)'); END $$",
    "DO $$ BEGIN PERFORM 1; /* RESET ALL; */ END $$",
    "DO $$ BEGIN INSERT INTO \"SET\" VALUES (1); END $$",
    "SELECT $$DO $x$ BEGIN RESET ALL; END $x$$$",
    "CREATE FUNCTION add(a int, b int) RETURNS int LANGUAGE sql IMMUTABLE AS $$ SELECT a + b $$",
    "CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql AS 'BEGIN RETURN 1; END'",
    "CREATE OR REPLACE FUNCTION f() RETURNS void AS $$ BEGIN UPDATE t SET x = 1; END $$ LANGUAGE plpgsql",
    "CREATE FUNCTION f() RETURNS int LANGUAGE sql RETURN 1",
    "CREATE FUNCTION f(a text DEFAULT 'it''s') RETURNS text LANGUAGE sql AS $$ SELECT a $$",
    "CREATE FUNCTION f() RETURNS void LANGUAGE plpgsql SET search_path = app, public AS $$ BEGIN NULL; END $$",
    "CREATE FUNCTION f(language text) RETURNS text LANGUAGE sql AS $$ SELECT language $$",
    "SELECT ts_rewrite(q, 'a'::tsquery, 'b'::tsquery) FROM t",
    "SELECT to_tsvector('english', body) @@ plainto_tsquery($1) FROM docs",
    "SELECT 'query_to_xml(''SET x = 1'')', 'ts_stat' FROM t",
];

const ALLOWED: &[&str] = &[
    "SAVEPOINT a",
    "ROLLBACK TO SAVEPOINT a",
    "rollback to a",
    "ROLLBACK WORK TO a",
    "ROLLBACK TRANSACTION TO SAVEPOINT a",
    "RELEASE a",
    "RELEASE SAVEPOINT a",
    "SET LOCAL lock_timeout = '1s'",
    "SET LOCAL search_path = app, public",
    "SET LOCAL standard_conforming_strings = off",
    "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE",
    "SET CONSTRAINTS ALL DEFERRED",
    "INSERT INTO t VALUES (1)",
    "INSERT INTO t VALUES ('done; end of story')",
    "INSERT INTO t VALUES (E'it\\'s; commit')",
    "INSERT INTO t VALUES ($$; COMMIT $$)",
    "INSERT INTO t VALUES ($body$; ROLLBACK $body$)",
    "SELECT $1::text",
    "UPDATE \"commit\" SET x = 1",
    "(SELECT 1)",
    "",
    ";;",
    "-- only a comment",
    "CALL p()",
    "DECLARE c CURSOR FOR SELECT 1",
    "DECLARE c NO SCROLL CURSOR WITHOUT HOLD FOR SELECT 1",
    "WITH hold AS (SELECT 1) SELECT * FROM hold",
    "CREATE UNLOGGED TABLE t (id int)",
    "CREATE TABLE temp (id int)",
    "INSERT INTO temp VALUES (1)",
    "MERGE INTO temp USING s ON temp.id = s.id WHEN MATCHED THEN DELETE",
    "SELECT temp FROM readings",
    "SELECT pg_advisory_xact_lock(1)",
    "SELECT pg_try_advisory_xact_lock_shared(1)",
    "SELECT current_setting('search_path')",
    "SELECT 'set_config', \"pg_advisory_lock(1)\" FROM t",
    "SELECT 1 -- set_config(\n",
    "NOTIFY c, 'payload'",
    "SELECT pg_notify('c', 'payload')",
    "LOCK TABLE t IN SHARE MODE",
];

const ORDINARY_DML: &[&str] = &[
    "INSERT INTO orders (tenant_id, total) VALUES ($1, $2) RETURNING id",
    "INSERT INTO notes (body) VALUES ('COMMIT; ROLLBACK; SET x = 1; BEGIN')",
    "UPDATE accounts SET balance = balance - $1 WHERE id = $2",
    "DELETE FROM t WHERE id = ANY($1::bigint[])",
    "SELECT (ARRAY[1, 2, 3])[1], '{1,2}'::int[], $1::text[]",
    "SELECT doc->>'k', doc->'a'->>0, doc #>> '{a,b}' FROM t",
    "SELECT doc ? 'k', doc ?| array['a'], doc @> '{\"a\": 1}'::jsonb FROM t",
    "SELECT * FROM t WHERE tags && $1 AND x <> 1 AND y != 2",
    "WITH x AS (INSERT INTO t (a) VALUES ($1) RETURNING id) SELECT id FROM x",
    "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT * FROM n",
    "SELECT 1e5, 1.5, .5, 1E-3, 2::numeric(10, 2)",
    "SELECT E'\\n\\t\\'', B'0101', X'FF', N'caf\u{e9}', U&'\\0041'",
    "SELECT 'a'\n'b', 'c'\r\n  'd'",
    "SELECT 'it''s'",
    "SELECT x ~ '^\\d+$' FROM t",
    "SELECT 'C:\\' AS path",
    "SELECT '\\' || 'x'",
    "SELECT $a$ $b$ COMMIT $a$",
    "SELECT $a$ x $$ y $a$, $$ z $$",
    "SELECT \"caf\u{e9}\", 'na\u{ef}ve' FROM t -- h\u{e9}",
    "SELECT * FROM caf\u{e9} WHERE prix > 0",
    "SELECT 1 /* */ + /* a /* b */ c */ 2",
    "SELECT 1 -/* c */ 2",
    "INSERT INTO t VALUES ($1) ON CONFLICT (id) DO UPDATE SET x = excluded.x",
    "SELECT a.*, b.c FROM a JOIN b USING (id) ORDER BY 1 LIMIT $1 OFFSET $2",
    "SELECT U&\"\\0041\", U&\"a\\\\b\"",
    "SELECT 'x' AS \"a\"\"b\"",
];

// Non-ASCII characters are identifier letters: these are identifiers, which
// PostgreSQL would reject as statements.
const KEYWORD_LOOKALIKES: &[&str] = &[
    "COMMIT\u{e9}",
    "\u{a0}COMMIT",
    "COMMIT\u{a0}",
    "COMMIT$",
    "\"COMMIT\"",
    "\"set\" x = 1",
];

/// One test a list: each statement of the list gets the same answer from
/// the guard (`None`: allowed).
macro_rules! refusal_tests {
    ($($test:ident: $statements:ident => $expected:expr;)*) => {
        $(
            #[test]
            fn $test() {
                for sql in $statements {
                    assert_eq!(refusal(sql), $expected, "{sql:?}");
                }
            }
        )*
    };
}

refusal_tests! {
    refuses_statements_that_end_the_transaction:
        ENDS_TRANSACTION => Some(Refusal::TransactionControl);
    comments_end_at_carriage_returns_and_vertical_tabs_are_whitespace:
        WHITESPACE_AND_COMMENT_ENDINGS => Some(Refusal::TransactionControl);
    refuses_text_the_lexer_cannot_follow:
        UNFOLLOWED => Some(Refusal::TransactionControl);
    reads_plain_strings_with_and_without_standard_conforming_strings:
        EITHER_STRING_READING => Some(Refusal::TransactionControl);
    refuses_session_level_settings:
        SESSION_SETTINGS => Some(Refusal::SessionState);
    refuses_statements_whose_effects_outlive_the_transaction:
        OUTLIVES_TRANSACTION => Some(Refusal::SessionState);
    refuses_session_functions_anywhere_outside_quotes:
        SESSION_FUNCTIONS_ANYWHERE => Some(Refusal::SessionState);
    allows_ordinary_statements_savepoints_and_local_settings:
        ALLOWED => None;
    allows_ordinary_dml:
        ORDINARY_DML => None;
    keywords_must_be_exact_and_unquoted:
        KEYWORD_LOOKALIKES => None;
    refuses_writes_to_pg_settings:
        PG_SETTINGS_WRITES => Some(Refusal::SessionState);
    refuses_set_config_unless_surely_transaction_local:
        SET_CONFIG_NOT_SURELY_LOCAL => Some(Refusal::SessionState);
    reads_do_blocks_and_function_bodies:
        BODIES => Some(Refusal::SessionState);
    refuses_a_search_path_naming_the_temporary_schema:
        SEARCH_PATH_WITH_PG_TEMP => Some(Refusal::SessionState);
    refuses_functions_that_run_sql_text:
        SQL_TEXT_FUNCTIONS => Some(Refusal::SessionState);
    allows_what_resembles_the_session_rules:
        ALLOWED_NEAR_THE_RULES => None;
}

#[test]
fn never_panics_on_truncated_input() {
    for sql in [
        "'",
        "\"",
        "$",
        "$a",
        "$a$",
        "/*",
        "E'",
        "E'\\",
        "--",
        "x$",
        "U&",
        "U&\"",
        "U&\"\\",
        "U&\"\\+\"",
        "U&'",
        "B'",
        "X'",
        "N'",
        "'a'\n",
        "'a'\n--",
        "'a' -",
        "*/",
        "/*/",
        "\u{e9}",
        "$\u{e9}$",
    ] {
        let _ = refusal(sql);
    }
}

/// PostgreSQL's whitespace, and comments ended by either newline.
fn separator() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![" ", "\t", "\n", "\r", "\x0b", "\x0c"]).prop_map(String::from),
        ("[^\r\n\0]*", prop::sample::select(vec!["\n", "\r"]))
            .prop_map(|(body, end)| format!("--{body}{end}")),
        "[^*/\0]*".prop_map(|body| format!("/*{body}*/")),
        ("[^*/\0]*", "[^*/\0]*").prop_map(|(a, b)| format!("/*{a}/*{b}*/*/")),
    ]
}

/// Text built from the pieces the lexer treats specially.
fn sql_like() -> impl Strategy<Value = String> {
    let pieces = vec![
        "'",
        "''",
        "\"",
        "$",
        "$$",
        "$a$",
        "$1",
        "--",
        "/*",
        "*/",
        "\n",
        "\r",
        "\\",
        "E'",
        "e",
        "U&'",
        "U&\"",
        "B'",
        "X'",
        "N'",
        "U&",
        ";",
        "(",
        "COMMIT",
        "SET",
        "set_config",
        "pg_temp",
        ".",
        " ",
        "\x0b",
        "\x0c",
        "x",
        "\u{e9}",
        "\u{130}",
        "UESCAPE",
        "\0",
        "\x01",
        "+",
        "-",
        "*",
        "/",
        "0",
    ];
    prop::collection::vec(prop::sample::select(pieces), 0..40).prop_map(|pieces| pieces.concat())
}

fn refused() -> Vec<(&'static str, Refusal)> {
    let tc = [
        ENDS_TRANSACTION,
        WHITESPACE_AND_COMMENT_ENDINGS,
        UNFOLLOWED,
        EITHER_STRING_READING,
    ];
    let ss = [
        SESSION_SETTINGS,
        OUTLIVES_TRANSACTION,
        SESSION_FUNCTIONS_ANYWHERE,
        PG_SETTINGS_WRITES,
        SET_CONFIG_NOT_SURELY_LOCAL,
        BODIES,
        SEARCH_PATH_WITH_PG_TEMP,
        SQL_TEXT_FUNCTIONS,
    ];
    let tc = tc
        .into_iter()
        .flatten()
        .map(|&sql| (sql, Refusal::TransactionControl));
    let ss = ss
        .into_iter()
        .flatten()
        .map(|&sql| (sql, Refusal::SessionState));
    tc.chain(ss).collect()
}

proptest! {
    #[test]
    fn never_panics(sql in any::<String>()) {
        let _ = refusal(&sql);
    }

    #[test]
    fn never_panics_on_bytes(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        let _ = refusal(&String::from_utf8_lossy(&bytes));
    }

    #[test]
    fn never_panics_on_sql_like_text(sql in sql_like()) {
        let _ = refusal(&sql);
    }

    #[test]
    fn whitespace_and_comments_before_a_refused_statement_change_nothing(
        prefix in prop::collection::vec(separator(), 0..6),
        (sql, expected) in prop::sample::select(refused()),
    ) {
        let sql = format!("{}{sql}", prefix.concat());
        prop_assert_eq!(refusal(&sql), Some(expected), "{:?}", sql);
    }

    #[test]
    fn whitespace_and_comments_before_an_allowed_statement_change_nothing(
        prefix in prop::collection::vec(separator(), 0..6),
        sql in prop::sample::select([ALLOWED, ORDINARY_DML, ALLOWED_NEAR_THE_RULES].concat()),
    ) {
        let sql = format!("{}{sql}", prefix.concat());
        prop_assert_eq!(refusal(&sql), None, "{:?}", sql);
    }
}

/// A remembered verdict is the fresh one, also after the thread's memory
/// was cleared for being full, and a text too long to remember is judged.
#[test]
fn remembered_verdicts_are_the_fresh_ones() {
    let texts = [
        "INSERT INTO orders (tenant_id) VALUES ($1)",
        "COMMIT",
        "SET search_path = x",
        "SET LOCAL lock_timeout = '1s'",
        "SELECT set_config('a.b', 'c', false)",
    ];
    for round in 0..3 {
        for text in texts {
            assert_eq!(refusal(text), judge(text), "{text} (round {round})");
        }
        // Enough other texts to fill the memory and clear it.
        for n in 0..=REMEMBERED {
            let other = format!("SELECT {n}");
            assert_eq!(refusal(&other), None);
        }
    }
    let long = format!("SELECT '{}'; COMMIT", "x".repeat(REMEMBERED_LEN));
    assert_eq!(refusal(&long), Some(Refusal::TransactionControl));
    assert_eq!(refusal(&long), Some(Refusal::TransactionControl));
}
