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
    "SELECT set_config('search_path', 'x', true)",
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
        sql in prop::sample::select([ALLOWED, ORDINARY_DML].concat()),
    ) {
        let sql = format!("{}{sql}", prefix.concat());
        prop_assert_eq!(refusal(&sql), None, "{:?}", sql);
    }
}
