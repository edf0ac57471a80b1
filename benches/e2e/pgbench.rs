//! `pgbench` with the same SQL as the servers: what the database itself
//! reaches on this machine, bare and for each protocol variant of a create.
//! The scripts are made from the statements the crate sends
//! (`tower_idempotency::testing::statements`), their parameters bound to
//! literals and pgbench variables, so they cannot go stale.

use tower_idempotency::testing::{statements, TempPostgres};

use crate::{load::median, servers::POOL};

/// `$n` of `sql` (highest first, so that `$1` does not match `$10`)
/// replaced by `args[n - 1]`: a statement the crate sends, as a pgbench
/// script line with literals and `:variables`.
fn bind(sql: &str, args: &[&str]) -> String {
    let mut bound = sql.to_owned();
    for (i, arg) in args.iter().enumerate().rev() {
        bound = bound.replace(&format!("${}", i + 1), arg);
    }
    format!("{bound};\n")
}

/// The key of a create's transaction (`k`, new each time).
const KEY: &str = "('k' || (:k)::text)";
/// The retention, in seconds (the layer's default).
const RETENTION: &str = "86400";
/// The session's hold limit, as the store's sessions keep it.
const HOLD_LIMIT: &str = "'35000ms'";

/// The answer's header block and body, as bytea literals.
fn answer_literals() -> (String, String) {
    let mut headers = http::HeaderMap::new();
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    let block = tower_idempotency::record::StoredResponse::new(
        http::StatusCode::CREATED,
        &headers,
        &[http::header::CONTENT_TYPE],
        bytes::Bytes::new(),
    )
    .encode_headers();
    let hex = |bytes: &[u8]| {
        let digits: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        format!("'\\x{digits}'")
    };
    let body =
        br#"{"id":"6f1c0f5e-5b7e-4c41-9d0a-2f4f7f0e9a11","checkout_id":"chk-0","total":2400}"#;
    (hex(&block), hex(body))
}

/// The order and its event, as the handlers write them (the event with
/// `outbox::enqueue`'s own statement).
fn writes(tag: &str) -> String {
    format!(
        "INSERT INTO orders (tenant_id, checkout_id, total) VALUES ('pgb', '{tag}-' || (:k)::text, 2400) RETURNING id;\n{}",
        bind(statements::ENQUEUE, &["'pgb'", "'x'", "'OrderCreated'", "'{}'"])
    )
}

/// Bare: the order and its event in a transaction.
fn bare_script() -> String {
    format!(
        "\\set k random(1, 9000000000000000)\nBEGIN;\n{}COMMIT;\n",
        writes("b")
    )
}

/// The default create with the store's statements and its pipelining:
/// `BEGIN`, its lock wait and the claim, the writes, then the completion
/// with the session reset in it (or without, `reset = false`) and
/// `COMMIT`. The completion's guard compares the row's token and this
/// transaction's id with themselves (the store binds what its claim
/// returned; pgbench cannot keep a pipelined statement's row).
fn default_create_script(reset: bool) -> String {
    let (headers, body) = answer_literals();
    let claim = bind(
        statements::CLAIM,
        &["'pgb'", "'e'", KEY, "'\\x00'", RETENTION],
    );
    let hold_limit = if reset { HOLD_LIMIT } else { "NULL" };
    let complete = bind(
        statements::COMPLETE_AND_RESET,
        &[
            "'pgb'",
            "'e'",
            KEY,
            // The guard's token and transaction id: the row's own and this
            // transaction's (the store binds what its claim returned).
            "attempt_token",
            "201",
            &headers,
            &body,
            RETENTION,
            "pg_current_xact_id()::text",
            // No resource id, no trace.
            "NULL",
            "NULL",
            hold_limit,
            "NULL",
        ],
    );
    // Without the reset: the same statement with the reset's call cut.
    let complete = if reset {
        complete
    } else {
        let at = complete
            .find("SELECT tower_idempotency_session_reset(")
            .expect("the completion calls the reset");
        format!(
            "{}SELECT 1 / (SELECT count(*)::int FROM done);\n",
            &complete[..at]
        )
    };
    format!(
        "\\set k random(1, 9000000000000000)\n\\startpipeline\nBEGIN ISOLATION LEVEL READ COMMITTED;\nSET LOCAL lock_timeout = '5000ms';\n{claim}\\endpipeline\n{}\\startpipeline\n{complete}COMMIT;\n\\endpipeline\n",
        writes("d")
    )
}

/// The one-commit create: `BEGIN` pipelined with the first write, then the
/// record inserted completed with the response, pipelined with `COMMIT`:
/// the layer's statement with the session reset in it, or the full-record
/// experiment's (the same insert, no reset: what trusted handlers send).
fn one_commit_script(reset: bool) -> String {
    let (headers, body) = answer_literals();
    let mut args = vec![
        "'pgb'", "'e'", KEY, "'\\x00'", "201", &headers, &body, "NULL", RETENTION, "NULL",
    ];
    let sql = if reset {
        args.extend([HOLD_LIMIT, "NULL"]);
        statements::CLAIM_AT_COMMIT_AND_RESET
    } else {
        statements::CLAIM_AT_COMMIT
    };
    let record = bind(sql, &args);
    let tag = if reset { "o" } else { "t" };
    let writes = writes(tag);
    let (first, second) = writes.split_once('\n').expect("two writes");
    format!(
        "\\set k random(1, 9000000000000000)\n\\startpipeline\nBEGIN;\n{first}\n\\endpipeline\n{second}\\startpipeline\n{record}COMMIT;\n\\endpipeline\n"
    )
}

/// A replay of a completed key: the claim-first mode's claim, which finds
/// the record (its empty transaction rolled back, off the request's path in
/// the store), or a lookup alone (no transaction, no WAL).
fn replay_script(lookup: bool) -> String {
    let key = "('rp' || (:r)::text)";
    let mut script = String::from("\\set r random(1, 20000)\n");
    if lookup {
        script.push_str(&bind(statements::LOOKUP, &["'pgb'", "'e'", key]));
    } else {
        script.push_str("\\startpipeline\nBEGIN ISOLATION LEVEL READ COMMITTED;\nSET LOCAL lock_timeout = '5000ms';\n");
        script.push_str(&bind(
            statements::CLAIM,
            &["'pgb'", "'e'", key, "'\\x00'", RETENTION],
        ));
        script.push_str("\\endpipeline\nROLLBACK;\n");
    }
    script
}

/// Every variant in alternating rounds (so that drift is shared), median tx/s each.
fn pgbench_variants(pg: &TempPostgres, seconds: u64) -> Vec<(&'static str, Option<f64>)> {
    let scripts: Vec<(&'static str, String)> = vec![
        ("bare: BEGIN, order, outbox, COMMIT", bare_script()),
        (
            "default create (claim, writes, completion with the reset)",
            default_create_script(true),
        ),
        (
            "one-commit create (writes, record with the reset)",
            one_commit_script(true),
        ),
        (
            "one-commit create, trusted handlers = the full-record experiment",
            one_commit_script(false),
        ),
        ("replay, claim first (no cache)", replay_script(false)),
        ("replay, lookup only", replay_script(true)),
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
    let Some(tps) = text.lines().find(|l| l.starts_with("tps = ")) else {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let first: Vec<&str> = stderr.lines().take(4).collect();
        eprintln!("pgbench ({name}) gave no rate: {first:?}");
        return None;
    };
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
    let bare = pgbench(pg, "bare", &bare_script(), seconds);
    let layered = pgbench(pg, "layered", &default_create_script(true), seconds);
    // The session reset's cost is a few percent at most: alternate two
    // rounds of each so that drift does not pass for it.
    let mut reset_rounds = Vec::new();
    for _ in 0..2 {
        let without = pgbench(pg, "layered", &default_create_script(false), seconds);
        let with = pgbench(pg, "reset", &default_create_script(true), seconds);
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
            "pgbench, the session reset inside the completion: without {without:.0} tx/s, with {with:.0} tx/s (ratio {:.3}, mean of {} alternating rounds)",
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
