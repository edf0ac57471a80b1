//! `pgbench` with the same SQL as the servers: what the database itself
//! reaches on this machine, bare and for each protocol variant of a create.

use tower_idempotency::testing::TempPostgres;

use crate::{load::median, servers::POOL};

const PGBENCH_BARE: &str = r#"\set c random(1, 9000000000000000)
BEGIN;
INSERT INTO orders (tenant_id, checkout_id, total) VALUES ('pgb', 'pgb-' || (:c)::text, 2400) RETURNING id;
INSERT INTO outbox_events (tenant_id, aggregate_id, event_type, payload) VALUES ('pgb', 'x', 'OrderCreated', '{}');
COMMIT;
"#;

const PGBENCH_LAYERED: &str = r#"\set k random(1, 9000000000000000)
SELECT state FROM idempotency_requests WHERE tenant_id = 'pgb' AND endpoint = 'e' AND idempotency_key = 'k' || (:k)::text AND expires_at > now();
BEGIN;
INSERT INTO idempotency_requests AS r (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at) VALUES ('pgb', 'e', 'k' || (:k)::text, '\x00', 'in_progress', now() + interval '1 day') ON CONFLICT ON CONSTRAINT idempotency_requests_pkey DO UPDATE SET state = 'in_progress' WHERE r.expires_at <= now() RETURNING attempt_token;
INSERT INTO orders (tenant_id, checkout_id, total) VALUES ('pgb', 'pgbl-' || (:k)::text, 2400) RETURNING id;
INSERT INTO outbox_events (tenant_id, aggregate_id, event_type, payload) VALUES ('pgb', 'x', 'OrderCreated', '{}');
UPDATE idempotency_requests SET state = 'completed', response_status = 201, response_body = '\x00', completed_at = now(), expires_at = now() + interval '1 day' WHERE tenant_id = 'pgb' AND endpoint = 'e' AND idempotency_key = 'k' || (:k)::text;
COMMIT;
"#;

/// The layered SQL plus the session reset that follows every owner's
/// `COMMIT` (`SESSION_RESET` in the store), as one message (`\;` joins the
/// statements; both scripts then run with the simple protocol). An upper
/// bound of its cost: pgbench waits for each command, so the reset costs it
/// a round trip that the store, which pipelines the reset behind the
/// `COMMIT`, does not pay.
const PGBENCH_LAYERED_RESET: &str = r#"\set k random(1, 9000000000000000)
SELECT state FROM idempotency_requests WHERE tenant_id = 'pgb' AND endpoint = 'e' AND idempotency_key = 'r' || (:k)::text AND expires_at > now();
BEGIN;
INSERT INTO idempotency_requests AS r (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at) VALUES ('pgb', 'e', 'r' || (:k)::text, '\x00', 'in_progress', now() + interval '1 day') ON CONFLICT ON CONSTRAINT idempotency_requests_pkey DO UPDATE SET state = 'in_progress' WHERE r.expires_at <= now() RETURNING attempt_token;
INSERT INTO orders (tenant_id, checkout_id, total) VALUES ('pgb', 'pgbr-' || (:k)::text, 2400) RETURNING id;
INSERT INTO outbox_events (tenant_id, aggregate_id, event_type, payload) VALUES ('pgb', 'x', 'OrderCreated', '{}');
UPDATE idempotency_requests SET state = 'completed', response_status = 201, response_body = '\x00', completed_at = now(), expires_at = now() + interval '1 day' WHERE tenant_id = 'pgb' AND endpoint = 'e' AND idempotency_key = 'r' || (:k)::text;
COMMIT;
SET SESSION AUTHORIZATION DEFAULT\; RESET ALL\; CLOSE ALL\; UNLISTEN *\; SELECT pg_advisory_unlock_all()\; DISCARD TEMP;
"#;

// The protocol variants, statement for statement as the store sends them,
// pipelined where it pipelines. `:k` makes each transaction's key and
// checkout new; replays read keys `rp1` … `rp20000`, completed at setup.
const V_BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED;
SET LOCAL lock_timeout = '5000ms';
SET LOCAL idle_in_transaction_session_timeout = '35000ms';
";
/// The begin batch before the statement diet: claims also tagged themselves
/// with `application_name` for the oldest-in-progress gauge.
const V_BEGIN_BEFORE: &str = "BEGIN ISOLATION LEVEL READ COMMITTED;
SET LOCAL lock_timeout = '5000ms';
SET LOCAL application_name = 'tower-idempotency';
SET LOCAL idle_in_transaction_session_timeout = '35000ms';
";
const V_LOOKUP: &str = "SELECT request_fingerprint, state, response_status, response_headers, response_body FROM idempotency_requests WHERE tenant_id = 'pgb' AND endpoint = 'e' AND idempotency_key = :key AND expires_at > now();
";
const V_CLAIM_OLD: &str = "INSERT INTO idempotency_requests AS r (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at) VALUES ('pgb', 'e', :key, '\\x00', 'in_progress', now() + interval '1 day') ON CONFLICT ON CONSTRAINT idempotency_requests_pkey DO UPDATE SET state = 'in_progress' WHERE r.expires_at <= now() RETURNING attempt_token, pg_current_xact_id()::text, set_config('lock_timeout', NULL, true);
";
const V_CLAIM_FIRST: &str = "WITH claimed AS (INSERT INTO idempotency_requests AS r (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at) VALUES ('pgb', 'e', :key, '\\x00', 'in_progress', now() + interval '1 day') ON CONFLICT ON CONSTRAINT idempotency_requests_pkey DO NOTHING RETURNING attempt_token, pg_current_xact_id()::text AS xid, set_config('lock_timeout', NULL, true)) SELECT true, attempt_token, xid, NULL::bytea, NULL::text, NULL::int2, NULL::bytea, NULL::bytea, false FROM claimed UNION ALL SELECT false, NULL::int8, NULL::text, request_fingerprint, state, response_status, response_headers, response_body, expires_at <= now() FROM idempotency_requests WHERE tenant_id = 'pgb' AND endpoint = 'e' AND idempotency_key = :key AND NOT EXISTS (SELECT FROM claimed);
";
const V_WRITES: &str = "INSERT INTO orders (tenant_id, checkout_id, total) VALUES ('pgb', 'v-' || (:k)::text, 2400) RETURNING id;
INSERT INTO outbox_events (tenant_id, aggregate_id, event_type, payload) VALUES ('pgb', 'x', 'OrderCreated', '{}');
";
const V_COMPLETE_GUARDED: &str = "WITH done AS (UPDATE idempotency_requests SET state = 'completed', response_status = 201, response_headers = '\\x00', response_body = '\\x00', completed_at = statement_timestamp(), expires_at = statement_timestamp() + interval '1 day' WHERE tenant_id = 'pgb' AND endpoint = 'e' AND idempotency_key = :key AND state = 'in_progress' AND pg_current_xact_id() = pg_current_xact_id() RETURNING 1) SELECT 1 / (SELECT count(*)::int FROM done);
";
const V_COMPLETE_PLAIN: &str = "UPDATE idempotency_requests SET state = 'completed', response_status = 201, response_headers = '\\x00', response_body = '\\x00', completed_at = statement_timestamp(), expires_at = statement_timestamp() + interval '1 day' WHERE tenant_id = 'pgb' AND endpoint = 'e' AND idempotency_key = :key AND state = 'in_progress';
";

/// Item 5's experiment, "claim at commit": the handler's writes first, then
/// the key row inserted with its response, and `COMMIT`; the unique index
/// arbitrates at the end (a loser would roll back and replay).
const PGBENCH_CLAIM_AT_COMMIT: &str = "\\set k random(1, 9000000000000000)
BEGIN;
INSERT INTO orders (tenant_id, checkout_id, total) VALUES ('pgb', 'c-' || (:k)::text, 2400) RETURNING id;
INSERT INTO outbox_events (tenant_id, aggregate_id, event_type, payload) VALUES ('pgb', 'x', 'OrderCreated', '{}');
\\startpipeline
INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, request_fingerprint, state, response_status, response_headers, response_body, completed_at, expires_at) VALUES ('pgb', 'e', 'c' || (:k)::text, '\\x00', 'completed', 201, '\\x00', '\\x00', now(), now() + interval '1 day');
COMMIT;
\\endpipeline
";

/// A create of one protocol variant: its claim (after an optional lookup),
/// the handler's writes, its completion and `COMMIT`.
fn create_script(lookup_first: bool, begin: &str, claim: &str, complete: &str) -> String {
    let mut script = String::from("\\set k random(1, 9000000000000000)\n");
    let key = |sql: &str| sql.replace(":key", "'k' || (:k)::text");
    if lookup_first {
        script.push_str(&key(V_LOOKUP));
    }
    script.push_str("\\startpipeline\n");
    script.push_str(begin);
    script.push_str(&key(claim));
    script.push_str("\\endpipeline\n");
    script.push_str(V_WRITES);
    script.push_str("\\startpipeline\n");
    script.push_str(&key(complete));
    script.push_str("COMMIT;\n\\endpipeline\n");
    script
}

/// A replay of a completed key by one protocol variant.
fn replay_script(lookup_first: bool) -> String {
    let key = |sql: &str| sql.replace(":key", "'rp' || (:r)::text");
    let mut script = String::from("\\set r random(1, 20000)\n");
    if lookup_first {
        script.push_str(&key(V_LOOKUP));
    } else {
        script.push_str("\\startpipeline\n");
        script.push_str(V_BEGIN);
        script.push_str(&key(V_CLAIM_FIRST));
        script.push_str("\\endpipeline\n");
        // Off the request's path in the store, but still work for the server.
        script.push_str("ROLLBACK;\n");
    }
    script
}

/// Every variant in alternating rounds (so that drift is shared), median tx/s each.
fn pgbench_variants(pg: &TempPostgres, seconds: u64) -> Vec<(&'static str, Option<f64>)> {
    let one_set = "BEGIN ISOLATION LEVEL READ COMMITTED;\nSET LOCAL lock_timeout = '5000ms';\n";
    let scripts: Vec<(&'static str, String)> = vec![
        (
            "bare: BEGIN, order, outbox, COMMIT",
            PGBENCH_BARE.to_owned(),
        ),
        (
            "create, lookup first, three settings (before)",
            create_script(true, V_BEGIN_BEFORE, V_CLAIM_OLD, V_COMPLETE_GUARDED),
        ),
        (
            "create, claim first, three settings",
            create_script(false, V_BEGIN_BEFORE, V_CLAIM_FIRST, V_COMPLETE_GUARDED),
        ),
        (
            "create, claim first, two settings (the default now)",
            create_script(false, V_BEGIN, V_CLAIM_FIRST, V_COMPLETE_GUARDED),
        ),
        (
            "create, claim first, lock_timeout only",
            create_script(false, one_set, V_CLAIM_FIRST, V_COMPLETE_GUARDED),
        ),
        (
            "create, claim first, completion UPDATE without its guard",
            create_script(false, V_BEGIN, V_CLAIM_FIRST, V_COMPLETE_PLAIN),
        ),
        (
            "create, claim at commit (one INSERT of key and response, no claim)",
            PGBENCH_CLAIM_AT_COMMIT.to_owned(),
        ),
        ("replay, lookup first (before)", replay_script(true)),
        (
            "replay, claim first (the default now, no cache)",
            replay_script(false),
        ),
    ];
    let rounds = 2;
    let mut seen: Vec<Vec<f64>> = vec![Vec::new(); scripts.len()];
    for _ in 0..rounds {
        for (i, (_, script)) in scripts.iter().enumerate() {
            if let Some(tps) = pgbench(pg, "variant", script, seconds) {
                seen[i].push(tps);
            }
        }
    }
    scripts
        .iter()
        .zip(seen)
        .map(|((name, _), mut tps)| (*name, (!tps.is_empty()).then(|| median(&mut tps))))
        .collect()
}

/// `pgbench` with the same SQL, same connection count: what the database
/// itself reaches on this machine.
fn pgbench(pg: &TempPostgres, name: &str, script: &str, seconds: u64) -> Option<f64> {
    pgbench_with(pg, name, script, seconds, "prepared", None)
}

/// Runs `sql` with `psql` on the cluster; its output, unaligned, tuples only.
pub(crate) fn psql(pg: &TempPostgres, sql: &str) -> String {
    let config = pg.config();
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Unix(path)) => path.display().to_string(),
        Some(tokio_postgres::config::Host::Tcp(host)) => host.clone(),
        None => panic!("the cluster has a host"),
    };
    let port = config.get_ports().first().expect("a port").to_string();
    let output = std::process::Command::new(pg.bin_dir().join("psql"))
        .args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1"])
        .args([
            "-h", &host, "-p", &port, "-U", "postgres", "-d", "postgres", "-c", sql,
        ])
        .output()
        .expect("psql runs");
    assert!(
        output.status.success(),
        "psql: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// [`pgbench`] with a query protocol of choice (`simple` runs compound
/// `\;` commands, which `prepared` cannot) and startup `options` for its
/// connections (`PGOPTIONS`).
pub(crate) fn pgbench_with(
    pg: &TempPostgres,
    name: &str,
    script: &str,
    seconds: u64,
    protocol: &str,
    options: Option<&str>,
) -> Option<f64> {
    let file = std::env::temp_dir().join(format!(
        "tower-idempotency-{name}-{}.sql",
        std::process::id()
    ));
    std::fs::write(&file, script).ok()?;
    let config = pg.config();
    let host = match config.get_hosts().first()? {
        tokio_postgres::config::Host::Unix(path) => path.display().to_string(),
        tokio_postgres::config::Host::Tcp(host) => host.clone(),
    };
    let output = std::process::Command::new(pg.bin_dir().join("pgbench"))
        .env("PGOPTIONS", options.unwrap_or(""))
        .args([
            "-n",
            "-M",
            protocol,
            "-c",
            &POOL.to_string(),
            "-j",
            "2",
            "-T",
            &seconds.to_string(),
        ])
        .args([
            "-h",
            &host,
            "-p",
            &config.get_ports().first()?.to_string(),
            "-U",
            "postgres",
            "-f",
        ])
        .arg(&file)
        .arg("postgres")
        .output()
        .ok()?;
    let _ = std::fs::remove_file(&file);
    let text = String::from_utf8_lossy(&output.stdout);
    let tps = text.lines().find(|l| l.starts_with("tps = "))?;
    tps.trim_start_matches("tps = ")
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// What the pgbench section measured.
pub(crate) struct Results {
    bare: Option<f64>,
    layered: Option<f64>,
    /// (without, with) the session reset, per alternating round.
    reset_rounds: Vec<(f64, f64)>,
    variants: Vec<(&'static str, Option<f64>)>,
}

/// Runs the section: bare and layered, the session reset, the variants.
pub(crate) fn run(pg: &TempPostgres, seconds: u64) -> Results {
    let bare = pgbench(pg, "bare", PGBENCH_BARE, seconds);
    let layered = pgbench(pg, "layered", PGBENCH_LAYERED, seconds);
    // The session reset's cost is a few percent at most: alternate two
    // rounds of each so that drift does not pass for it.
    let mut reset_rounds = Vec::new();
    for _ in 0..2 {
        let without = pgbench_with(pg, "layered", PGBENCH_LAYERED, seconds, "simple", None);
        let with = pgbench_with(pg, "reset", PGBENCH_LAYERED_RESET, seconds, "simple", None);
        if let (Some(without), Some(with)) = (without, with) {
            reset_rounds.push((without, with));
        }
    }
    let variants = pgbench_variants(pg, seconds);
    Results {
        bare,
        layered,
        reset_rounds,
        variants,
    }
}

/// The lines about bare and layered pgbench and the session reset.
pub(crate) fn print_summary(r: &Results) {
    match (r.bare, r.layered) {
        (Some(bare), Some(layered)) => println!(
            "pgbench, same SQL, {POOL} connections: bare {bare:.0} tx/s, with claim + completion {layered:.0} tx/s (ratio {:.2})",
            layered / bare
        ),
        _ => println!("pgbench: not available"),
    }
    if !r.reset_rounds.is_empty() {
        let n = r.reset_rounds.len() as f64;
        let without = r.reset_rounds.iter().map(|r| r.0).sum::<f64>() / n;
        let with = r.reset_rounds.iter().map(|r| r.1).sum::<f64>() / n;
        println!(
            "pgbench, session reset after COMMIT (upper bound: one more round trip here, none in the store): without {without:.0} tx/s, with {with:.0} tx/s (ratio {:.3}, mean of {} alternating rounds)",
            with / without,
            r.reset_rounds.len()
        );
    }
}

/// The protocol variants' table.
pub(crate) fn print_variants(r: &Results) {
    let variants = &r.variants;
    println!();
    println!("pgbench, {POOL} connections, the statements of each protocol variant with the store's pipelining (\\startpipeline), alternating rounds, median tx/s:");
    println!();
    println!("| variant | tx/s | vs bare |");
    println!("| --- | ---: | ---: |");
    for (name, tps) in variants {
        let ratio = variants[0]
            .1
            .map_or(f64::NAN, |bare| tps.unwrap_or(f64::NAN) / bare);
        match tps {
            Some(tps) => println!("| {name} | {tps:.0} | {ratio:.2} |"),
            None => println!("| {name} | – | – |"),
        }
    }
}
