//! SQL-level trials (`E2E_ONLY=trials`): changes to the statements or the
//! schema tried with pgbench before any is built into the store, each
//! against the form the store has now, in alternating rounds, median tx/s.
//! One is adopted only if it wins by 5 % or more. `E2E_ROUNDS` rounds (at
//! least 2) of `E2E_SECONDS` (at least 5) each.
//!
//! 1. The settings a transaction needs as startup options of the
//!    connection (`PGOPTIONS=-c …`, possible on a direct connection, not
//!    behind a transaction pooler) instead of `SET LOCAL` statements sent
//!    with `BEGIN`: in the one-commit mode (one setting) and the claim-first
//!    mode (two).
//! 2. A narrower primary key: `(tenant_id, key_digest)` with a 16-byte
//!    digest of endpoint and key, against `(tenant_id, endpoint,
//!    idempotency_key)`.
//! 3. A BRIN index on `expires_at` instead of a B-tree.
//! 4. Compression of large stored bodies (8 KB of JSON): pglz (the
//!    default), lz4, none; with the bytes each row takes.
//! 5. The session reset behind every owner's `COMMIT`: six statements (as
//!    the stores sent it before migration 3), one call of the function
//!    migration 3 creates (as they send it now), none.
//! 6. The one-commit claim's form: one plain `INSERT` (as the store sends
//!    it now: a key with a row fails it, and a row that may be taken over
//!    is removed afterwards and the work runs again), against one `INSERT
//!    … ON CONFLICT … DO UPDATE` whose update of a record it may not take
//!    over divides by zero as it sets a column (as it sent it before), and
//!    that `INSERT` with the takeover rule as its `WHERE` inside a `WITH`,
//!    then a division by the rows it wrote (earlier still).
//! 7. The idempotency key's collation in a database whose locale is not C
//!    (as managed services create them: `en_US.UTF-8`): the key table's
//!    text columns in that locale (before migrations 6 to 9), against the
//!    idempotency key in `"C"` (after). Needs the locale on the machine
//!    before the cluster starts (`localedef -i en_US -f UTF-8
//!    en_US.UTF-8`); without it the trial is left out, saying so. The
//!    columns name the collation, which costs a little more per comparison
//!    than a database's default (callgrind: 660,600 instructions a create
//!    against 635,200), so it is an upper bound.
//!
//! `E2E_TRIALS` (comma-separated numbers) runs only those trials.
//!
//! Trials 2 to 4 and 7 insert the key row as the one-commit mode does (order,
//! outbox event, key row with its response, `COMMIT`) into a copy of
//! `idempotency_requests` that differs only in what is tried.

use tower_idempotency::testing::TempPostgres;

use crate::{
    load::median,
    pgbench::{pgbench_with, psql},
};

const TABLES: &str = "
DROP TABLE IF EXISTS trial_wide, trial_narrow, trial_brin, trial_pglz, trial_lz4, trial_plain;
CREATE TABLE trial_wide (LIKE idempotency_requests INCLUDING DEFAULTS) WITH (fillfactor = 80);
ALTER TABLE trial_wide ADD PRIMARY KEY (tenant_id, endpoint, idempotency_key);
CREATE INDEX ON trial_wide (expires_at);
CREATE TABLE trial_narrow (LIKE idempotency_requests INCLUDING DEFAULTS) WITH (fillfactor = 80);
ALTER TABLE trial_narrow ADD COLUMN key_digest bytea NOT NULL;
ALTER TABLE trial_narrow ADD PRIMARY KEY (tenant_id, key_digest);
CREATE INDEX ON trial_narrow (expires_at);
CREATE TABLE trial_brin (LIKE idempotency_requests INCLUDING DEFAULTS) WITH (fillfactor = 80);
ALTER TABLE trial_brin ADD PRIMARY KEY (tenant_id, endpoint, idempotency_key);
CREATE INDEX ON trial_brin USING brin (expires_at);
CREATE TABLE trial_pglz (LIKE trial_wide INCLUDING ALL);
CREATE TABLE trial_lz4 (LIKE trial_wide INCLUDING ALL);
ALTER TABLE trial_lz4 ALTER COLUMN response_body SET COMPRESSION lz4;
CREATE TABLE trial_plain (LIKE trial_wide INCLUDING ALL);
ALTER TABLE trial_plain ALTER COLUMN response_body SET STORAGE EXTERNAL;
";

/// Trial 7's tables, in the collation a database created in `en_US.UTF-8`
/// gives its text columns, and with the idempotency key in `"C"`.
const LOCALE_TABLES: &str = r#"
DROP TABLE IF EXISTS trial_locale, trial_locale_c;
CREATE TABLE trial_locale (LIKE idempotency_requests INCLUDING DEFAULTS) WITH (fillfactor = 80);
ALTER TABLE trial_locale ALTER COLUMN tenant_id TYPE text COLLATE "en_US.utf8",
    ALTER COLUMN endpoint TYPE text COLLATE "en_US.utf8",
    ALTER COLUMN idempotency_key TYPE text COLLATE "en_US.utf8";
ALTER TABLE trial_locale ADD PRIMARY KEY (tenant_id, endpoint, idempotency_key);
CREATE INDEX ON trial_locale (expires_at);
CREATE TABLE trial_locale_c (LIKE trial_locale INCLUDING ALL) WITH (fillfactor = 80);
ALTER TABLE trial_locale_c ALTER COLUMN idempotency_key TYPE text COLLATE "C";
"#;

/// The session reset the store sends behind every owner's `COMMIT`: six
/// statements, each its own message, pipelined.
const RESET_STATEMENTS: &str = "SET SESSION AUTHORIZATION DEFAULT;
RESET ALL;
CLOSE ALL;
UNLISTEN *;
SELECT pg_advisory_unlock_all();
DISCARD TEMP;
";

/// A key as clients send them (a UUID), a response as the layer stores it.
const KEY: &str = "'5f0c3a2e-9d41-4c7b-' || lpad((:k % 1000000000000)::text, 12, '0')";
const SMALL_BODY: &str = "'{\"id\":\"9f1c2d0e-8b7a-4c3d-9e2f-1a0b9c8d7e6f\",\"checkout_id\":\"chk-123456\",\"total\":2400,\"currency\":\"JPY\"}'::bytea";
/// 8 KB of JSON (an order with 160 lines), built by the server alike for
/// every variant.
const LARGE_BODY: &str = "convert_to('[' || repeat('{\"sku\":\"SKU-1001\",\"quantity\":2,\"unit_price\":800},', 160) || '{}]', 'UTF8')";

fn order(tag: &str) -> String {
    format!(
        "INSERT INTO orders (tenant_id, checkout_id, total) VALUES ('pgb', '{tag}-' || (:k)::text, 2400) RETURNING id;\n"
    )
}

const OUTBOX: &str = "INSERT INTO outbox_events (tenant_id, aggregate_id, event_type, payload) VALUES ('pgb', 'x', 'OrderCreated', '{}');\n";

/// The one-commit mode's key row into `table` (`digest`: with the narrow
/// key's column), pipelined with `COMMIT`.
fn key_row(table: &str, body: &str, digest: bool) -> String {
    let (column, value, conflict) = if digest {
        (
            ", key_digest",
            ", int8send((:k)::int8) || int8send((:k)::int8 + 7)",
            "(tenant_id, key_digest)",
        )
    } else {
        ("", "", "(tenant_id, endpoint, idempotency_key)")
    };
    format!(
        "\\startpipeline
WITH won AS (INSERT INTO {table} AS r (tenant_id, endpoint, idempotency_key, request_fingerprint, state, response_status, response_headers, response_body, created_at, completed_at, expires_at{column}) VALUES ('pgb', 'POST /orders v1', {KEY}, '\\x00', 'completed', 201, '\\x00', {body}, statement_timestamp(), statement_timestamp(), statement_timestamp() + interval '1 day'{value}) ON CONFLICT {conflict} DO UPDATE SET state = 'completed' WHERE r.expires_at <= EXCLUDED.created_at RETURNING 1) SELECT 1 / (SELECT count(*)::int FROM won);
COMMIT;
\\endpipeline
"
    )
}

/// A one-commit create into `table`: `BEGIN` with `settings` pipelined
/// with the order, the outbox event, the key row pipelined with `COMMIT`.
fn one_commit(table: &str, settings: &str, body: &str, digest: bool) -> String {
    format!(
        "\\set k random(1, 9000000000000000)
\\startpipeline
BEGIN ISOLATION LEVEL READ COMMITTED;
{settings}{order}\\endpipeline
{OUTBOX}{key_row}",
        order = order(table),
        key_row = key_row(table, body, digest),
    )
}

/// [`one_commit`] into `trial_wide` with `reset` pipelined behind its
/// `COMMIT`.
fn one_commit_then(reset: &str) -> String {
    one_commit("trial_wide", IDLE, SMALL_BODY, false).replace(
        "COMMIT;\n\\endpipeline\n",
        &format!("COMMIT;\n{reset}\\endpipeline\n"),
    )
}

const IDLE: &str = "SET LOCAL idle_in_transaction_session_timeout = '35000ms';\n";
const WAITS: &str =
    "SET LOCAL lock_timeout = '5000ms';\nSET LOCAL idle_in_transaction_session_timeout = '35000ms';\n";
const IDLE_OPTION: &str = "-c idle_in_transaction_session_timeout=35000";
const WAITS_OPTION: &str = "-c lock_timeout=5000 -c idle_in_transaction_session_timeout=35000";

/// A claim-first create (the claim as the store sends it, into the real
/// table), its `BEGIN` with `settings`.
fn claim_first(settings: &str) -> String {
    format!(
        "\\set k random(1, 9000000000000000)
\\startpipeline
BEGIN ISOLATION LEVEL READ COMMITTED;
{settings}WITH claimed AS (INSERT INTO idempotency_requests AS r (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at) VALUES ('pgb', 'POST /orders v1', {KEY}, '\\x00', 'in_progress', now() + interval '1 day') ON CONFLICT ON CONSTRAINT idempotency_requests_pkey DO NOTHING RETURNING attempt_token, pg_current_xact_id()::text AS xid) SELECT true, attempt_token, xid FROM claimed;
\\endpipeline
{order}{OUTBOX}\\startpipeline
UPDATE idempotency_requests SET state = 'completed', response_status = 201, response_headers = '\\x00', response_body = {SMALL_BODY}, completed_at = statement_timestamp() WHERE tenant_id = 'pgb' AND endpoint = 'POST /orders v1' AND idempotency_key = {KEY} AND state = 'in_progress';
COMMIT;
\\endpipeline
",
        order = order("cf"),
    )
}

/// The takeover rule, as the store's one-commit claim reads it.
const TAKEOVER: &str = "r.expires_at <= EXCLUDED.created_at OR (r.state = 'in_progress' \
     AND (r.lease_expires_at IS NULL OR r.lease_expires_at <= EXCLUDED.created_at))";

/// The one-commit claim's forms trial 6 compares.
#[derive(Clone, Copy)]
enum ClaimForm {
    /// One plain `INSERT`: a key with a row fails it (a unique violation);
    /// a row that may be taken over is removed after and the work runs again.
    Plain,
    /// One `INSERT … ON CONFLICT … DO UPDATE` that divides by zero as it
    /// updates a record it may not take over.
    Dividing,
    /// The `INSERT … ON CONFLICT … DO UPDATE … WHERE <takeover>` in a
    /// `WITH`, then a division by the rows it wrote.
    InWith,
}

/// A one-commit create into `trial_wide` whose key row goes in as `form`,
/// pipelined with `COMMIT`.
fn one_commit_claiming(form: ClaimForm) -> String {
    let insert = "INSERT INTO trial_wide AS r (tenant_id, endpoint, idempotency_key, request_fingerprint, state, response_status, response_headers, response_body, created_at, completed_at, expires_at) VALUES ('pgb', 'POST /orders v1', {KEY}, '\\x00', 'completed', 201, '\\x00', {SMALL_BODY}, statement_timestamp(), statement_timestamp(), statement_timestamp() + interval '1 day')";
    let insert = insert
        .replace("{KEY}", KEY)
        .replace("{SMALL_BODY}", SMALL_BODY);
    let update = "ON CONFLICT (tenant_id, endpoint, idempotency_key) DO UPDATE SET state = 'completed', response_body = EXCLUDED.response_body, expires_at = EXCLUDED.expires_at";
    let claim = match form {
        ClaimForm::Plain => format!("{insert} RETURNING 1"),
        ClaimForm::Dividing => format!(
            "{insert} {update}, attempts = 1 / (CASE WHEN {TAKEOVER} THEN 1 ELSE 0 END) - 1 RETURNING 1"
        ),
        ClaimForm::InWith => format!(
            "WITH won AS ({insert} {update} WHERE {TAKEOVER} RETURNING 1) SELECT 1 / (SELECT count(*)::int FROM won)"
        ),
    };
    format!(
        "\\set k random(1, 9000000000000000)
\\startpipeline
BEGIN ISOLATION LEVEL READ COMMITTED;
{order}\\endpipeline
{OUTBOX}\\startpipeline
{claim};
COMMIT;
\\endpipeline
",
        order = order("trial_wide"),
    )
}

/// One trial's result: its name, median tx/s, and bytes per row where sized.
pub(crate) type Trial = (String, Option<f64>, Option<f64>);

/// Runs every trial's variants in alternating rounds.
pub(crate) fn run(pg: &TempPostgres, seconds: u64, rounds: usize) -> Vec<Vec<Trial>> {
    psql(pg, TABLES);
    // (name, script, PGOPTIONS, table to size)
    type Variant = (
        &'static str,
        String,
        Option<&'static str>,
        Option<&'static str>,
    );
    let trials: Vec<Vec<Variant>> = vec![
        vec![
            (
                "one-commit, SET LOCAL idle limit (before migration 4)",
                one_commit("trial_wide", IDLE, SMALL_BODY, false),
                None,
                None,
            ),
            (
                "one-commit, idle limit as a startup option (no statement, as with migration 4)",
                one_commit("trial_wide", "", SMALL_BODY, false),
                Some(IDLE_OPTION),
                None,
            ),
            (
                "claim first, two SET LOCAL (before migration 4; one now)",
                claim_first(WAITS),
                None,
                None,
            ),
            (
                "claim first, both as startup options",
                claim_first(""),
                Some(WAITS_OPTION),
                None,
            ),
        ],
        vec![
            (
                "one-commit, the session reset as six statements (before migration 3)",
                one_commit_then(RESET_STATEMENTS),
                None,
                None,
            ),
            (
                "one-commit, the session reset as one function call (migration 3)",
                one_commit_then("SELECT tower_idempotency_session_reset();\n"),
                None,
                None,
            ),
            (
                "one-commit, no session reset",
                one_commit_then(""),
                None,
                None,
            ),
        ],
        vec![
            (
                "primary key (tenant, endpoint, key) (now)",
                one_commit("trial_wide", "", SMALL_BODY, false),
                None,
                Some("trial_wide"),
            ),
            (
                "primary key (tenant, 16-byte digest)",
                one_commit("trial_narrow", "", SMALL_BODY, true),
                None,
                Some("trial_narrow"),
            ),
        ],
        vec![
            (
                "B-tree on expires_at (now)",
                one_commit("trial_wide", "", SMALL_BODY, false),
                None,
                None,
            ),
            (
                "BRIN on expires_at",
                one_commit("trial_brin", "", SMALL_BODY, false),
                None,
                Some("trial_brin"),
            ),
        ],
        vec![
            (
                "8 KB body, pglz (PostgreSQL's default)",
                one_commit("trial_pglz", "", LARGE_BODY, false),
                None,
                Some("trial_pglz"),
            ),
            (
                "8 KB body, lz4 (migration 2)",
                one_commit("trial_lz4", "", LARGE_BODY, false),
                None,
                Some("trial_lz4"),
            ),
            (
                "8 KB body, not compressed",
                one_commit("trial_plain", "", LARGE_BODY, false),
                None,
                Some("trial_plain"),
            ),
        ],
        vec![
            (
                "one-commit claim as one plain INSERT, a takeover running the work again (now)",
                one_commit_claiming(ClaimForm::Plain),
                None,
                None,
            ),
            (
                "one-commit claim as one INSERT … ON CONFLICT … DO UPDATE, dividing by zero on a record it may not take over (before)",
                one_commit_claiming(ClaimForm::Dividing),
                None,
                None,
            ),
            (
                "one-commit claim in a WITH, then a division by its rows (earlier)",
                one_commit_claiming(ClaimForm::InWith),
                None,
                None,
            ),
        ],
    ];
    let mut trials: Vec<(usize, Vec<Variant>)> = (1..).zip(trials).collect();
    let locale = psql(
        pg,
        "SELECT count(*) FROM pg_collation WHERE collname = 'en_US.utf8'",
    );
    if locale.trim() == "1" {
        psql(pg, LOCALE_TABLES);
        trials.push((
            7,
            vec![
                (
                    "en_US.UTF-8 key columns (before migrations 6 to 9)",
                    one_commit("trial_locale", "", SMALL_BODY, false),
                    None,
                    None,
                ),
                (
                    "en_US.UTF-8, the idempotency key in \"C\" (after)",
                    one_commit("trial_locale_c", "", SMALL_BODY, false),
                    None,
                    None,
                ),
            ],
        ));
    } else {
        eprintln!(
            "trial 7 left out: no en_US.UTF-8 locale on this machine \
             (localedef -i en_US -f UTF-8 en_US.UTF-8, before the bench starts its cluster)"
        );
    }
    if let Ok(only) = std::env::var("E2E_TRIALS") {
        let only: Vec<usize> = only
            .split(',')
            .filter_map(|n| n.trim().parse().ok())
            .collect();
        trials.retain(|(n, _)| only.contains(n));
    }
    let mut results = Vec::new();
    for (_, trial) in trials {
        let mut seen: Vec<Vec<f64>> = vec![Vec::new(); trial.len()];
        for _ in 0..rounds.max(2) {
            for (i, (_, script, options, _)) in trial.iter().enumerate() {
                if let Some(tps) = pgbench_with(pg, "trial", script, seconds, "prepared", *options)
                {
                    seen[i].push(tps);
                }
            }
        }
        results.push(
            trial
                .iter()
                .zip(seen)
                .map(|((name, _, _, table), mut tps)| {
                    let size = table.and_then(|t| {
                        psql(pg, &format!(
                            "SELECT pg_total_relation_size('{t}')::float8 / greatest(count(*), 1) FROM {t}"
                        ))
                        .trim()
                        .parse()
                        .ok()
                    });
                    (name.to_string(), (!tps.is_empty()).then(|| median(&mut tps)), size)
                })
                .collect(),
        );
    }
    results
}

pub(crate) fn print(trials: &[Vec<Trial>]) {
    println!();
    println!("SQL-level trials (pgbench, alternating rounds, median tx/s; each against the first row of its group):");
    println!();
    println!("| variant | tx/s | vs now | bytes per row |");
    println!("| --- | ---: | ---: | ---: |");
    for trial in trials {
        let now = trial.first().and_then(|t| t.1);
        for (i, (name, tps, size)) in trial.iter().enumerate() {
            // The settings trial holds two pairs: each against its own "now".
            let base = if i >= 2 && name.starts_with("claim") {
                trial[2].1
            } else {
                now
            };
            let vs = match (tps, base) {
                (Some(t), Some(b)) => format!("{:.3}", t / b),
                _ => "–".into(),
            };
            println!(
                "| {name} | {} | {vs} | {} |",
                tps.map_or("–".into(), |t| format!("{t:.0}")),
                size.map_or(String::new(), |s| format!("{s:.0}"))
            );
        }
    }
}
