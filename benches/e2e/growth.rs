//! Cost as the key table grows: the table filled with remembered keys of
//! other requests (in SQL, not through HTTP), then bare, create and replay
//! at each size; and cleanup deleting expired keys while creates run.
//!
//! The filled keys look like the keys real clients send (UUIDs spread over
//! the whole key index), are completed and unexpired, of the same tenant and
//! endpoint as the load, with a ~150-byte response body. They are inserted
//! in key order (one `INSERT … SELECT generate_series`), so each fill is one
//! sweep over the index. The sizes are nested: size `s` holds the keys whose
//! index `n` (out of the largest size `M`) has `n · a mod M < s`, `a` prime
//! to `M`, so each fill adds only the keys the previous one lacked, spread
//! evenly between them.

use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use tower_idempotency::{postgres::PgStore, retention::Cleanup};

use crate::load::{print_round, Keys, Kind, Load, Run, Scenario, Stats, GROWTH_KEYS};

/// Key space the keys' first 12 hex digits spread over.
const SPACE: u64 = 1 << 48;
/// A ~150-byte body, as the load's answers are.
const BODY: &str = r#"convert_to('{"id":"' || k || '","checkout_id":"chk-fill-' || n || '","customer_id":' || (n % 10000) || ',"total":2400,"currency":"EUR","status":"created"}', 'UTF8')"#;
/// The headers a real completion of the endpoint stored.
const HEADERS: &str = "COALESCE((SELECT response_headers FROM idempotency_requests \
     WHERE endpoint = 'POST /orders v1' AND state = 'completed' LIMIT 1), ''::bytea)";
/// Each fill runs as this many `INSERT`s at once, on disjoint ranges of keys.
pub(crate) const FILL_SESSIONS: u64 = 2;

/// The live fill of keys `range.0..range.1` out of at most `max` keys, or
/// the expired fill: one `INSERT … SELECT` per session, each over its part
/// of the key space. The random-looking digits come from PostgreSQL's
/// integer hashes (`md5` costs twice as much per row).
fn fill_sql(max: u64, range: (u64, u64), expired: bool) -> Vec<String> {
    let stride = SPACE / max.max(1);
    let multiplier = [7919u64, 7907, 7901]
        .into_iter()
        .find(|a| gcd(*a, max) == 1)
        .unwrap_or(1);
    let (prefix, filter, created, seed) = if expired {
        // Between the live keys, created 48 to 25 hours ago: all expired.
        (
            format!("n * {stride} + {}", stride / 2),
            "true".to_owned(),
            "now() - interval '48 hours' + interval '23 hours' * (n::float8 / MAX)",
            100,
        )
    } else {
        (
            format!("n * {stride}"),
            format!(
                "(n * {multiplier}) % MAX >= {} AND (n * {multiplier}) % MAX < {}",
                range.0, range.1
            ),
            "now() - interval '23 hours' + interval '23 hours' * (n::float8 / MAX)",
            0,
        )
    };
    let part = max.div_ceil(FILL_SESSIONS);
    (0..FILL_SESSIONS)
        .map(|i| {
            let (first, last) = (i * part, ((i + 1) * part).min(max));
            format!(
                "INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, request_fingerprint, state, \
                     attempt_token, response_status, response_headers, response_body, created_at, completed_at, expires_at) \
                 SELECT 'bench', 'POST /orders v1', k, \
                     int8send(hashint8extended(n, {s1})) || int8send(hashint8extended(n, {s2})) \
                     || int8send(hashint8extended(n, {s3})) || int8send(hashint8extended(n, {s4})), \
                     'completed', n, 201, {HEADERS}, {BODY}, c, c + interval '3 ms', c + interval '24 hours' \
                 FROM (SELECT n, substr(h, 1, 8) || '-' || substr(h, 9, 4) || '-4' || substr(h, 13, 3) || '-a' \
                              || substr(h, 16, 3) || '-' || substr(h, 19, 12) AS k, {created} AS c \
                       FROM (SELECT n, lpad(to_hex({prefix}), 12, '0') || lpad(to_hex(hashint8extended(n, {s5})), 16, '0') \
                                    || lpad(to_hex(hashint8(n + {seed})), 8, '0') AS h \
                             FROM generate_series({first}::bigint, {last} - 1) n WHERE {filter}) s) t",
                s1 = seed + 1,
                s2 = seed + 2,
                s3 = seed + 3,
                s4 = seed + 4,
                s5 = seed + 5,
            )
            .replace("MAX", &max.to_string())
        })
        .collect()
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The key table's size: (rows as ANALYZE counted them, heap MB, indexes MB).
async fn table_size(store: &PgStore) -> (f64, f64, f64) {
    let client = store.client().await.expect("client");
    let row = client
        .query_one(
            "SELECT reltuples::float8, pg_table_size(oid)::float8 / 1048576, pg_indexes_size(oid)::float8 / 1048576 \
             FROM pg_class WHERE oid = 'idempotency_requests'::regclass",
            &[],
        )
        .await
        .expect("size");
    (row.get(0), row.get(1), row.get(2))
}

/// Free space where the cluster lives, in GB (`df`), if known.
fn free_gb(dir: &std::path::Path) -> Option<f64> {
    let out = std::process::Command::new("df")
        .args(["-Pk"])
        .arg(dir)
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let kb: f64 = text
        .lines()
        .nth(1)?
        .split_whitespace()
        .nth(3)?
        .parse()
        .ok()?;
    Some(kb / 1048576.0)
}

/// Runs `sql`, then `VACUUM ANALYZE`, with `fsync` and `full_page_writes`
/// off and a larger `max_wal_size` (a bulk load's settings: with them on,
/// every dirty page the load evicts waits for a WAL flush), then puts them
/// back, and `CHECKPOINT` and `sync` write everything out, so that the runs
/// after it neither lack durability nor pay for the fill.
/// Returns (fill seconds, vacuum + checkpoint seconds).
async fn fill(store: &PgStore, sql: &[String]) -> (f64, f64) {
    let client = store.client().await.expect("client");
    let client = &*client;
    let run = |sql: &'static str| async move {
        client.batch_execute(sql).await.expect(sql);
        if sql.contains("reload") {
            // Every process rereads the settings at its next idle moment.
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    };
    run("ALTER SYSTEM SET fsync = off").await;
    run("ALTER SYSTEM SET full_page_writes = off").await;
    run("ALTER SYSTEM SET max_wal_size = '16GB'").await;
    run("SELECT pg_reload_conf()").await;
    let started = Instant::now();
    let sessions = sql.iter().map(|sql| async move {
        let client = store.client().await.expect("client");
        client.batch_execute(sql).await.expect("fill");
    });
    futures_util::future::join_all(sessions).await;
    let filled = started.elapsed().as_secs_f64();
    let started = Instant::now();
    run("VACUUM ANALYZE idempotency_requests").await;
    run("ALTER SYSTEM RESET fsync").await;
    run("ALTER SYSTEM RESET full_page_writes").await;
    run("ALTER SYSTEM RESET max_wal_size").await;
    run("SELECT pg_reload_conf()").await;
    run("CHECKPOINT").await;
    let _ = tokio::process::Command::new("sync").status().await;
    let on: String = client
        .query_one(
            "SELECT current_setting('fsync') || current_setting('full_page_writes')",
            &[],
        )
        .await
        .expect("settings")
        .get(0);
    assert_eq!(on, "onon", "fsync and full_page_writes are back on");
    (filled, started.elapsed().as_secs_f64())
}

/// One size of the table and what ran at it.
pub(crate) struct Step {
    pub(crate) keys: u64,
    rows: f64,
    heap_mb: f64,
    index_mb: f64,
    fill_s: f64,
    settle_s: f64,
    /// bare, create, replay (no cache)
    pub(crate) runs: [Vec<Run>; 3],
}

/// The servers the growth and cleanup scenarios use.
#[derive(Clone, Copy)]
pub(crate) struct Targets {
    pub(crate) bare: std::net::SocketAddr,
    pub(crate) layered: std::net::SocketAddr,
    pub(crate) uncached: std::net::SocketAddr,
}

fn scenarios(t: Targets) -> [Scenario; 3] {
    [
        Scenario::new("bare (no layer)", t.bare, Kind::Plain),
        Scenario::new("create", t.layered, Kind::Create)
            .keys(Keys::Uuid)
            .list(GROWTH_KEYS),
        Scenario::new("replay, no replay cache", t.uncached, Kind::Replay).list(GROWTH_KEYS),
    ]
}

/// Each size in turn (ascending): fill up to it, then the three scenarios
/// in alternating rounds.
pub(crate) async fn run(
    load: &Arc<Load>,
    store: &PgStore,
    data_dir: &std::path::Path,
    targets: Targets,
    sizes: &[u64],
    duration: Duration,
    rounds: usize,
) -> Vec<Step> {
    let max = sizes.iter().copied().max().unwrap_or(0);
    let mut filled = 0;
    let mut steps = Vec::new();
    for &keys in sizes {
        let (fill_s, settle_s);
        if keys > filled {
            // About 650 bytes a key in the heap and indexes, and the fill's WAL.
            let needed = ((keys - filled) as f64).mul_add(1.1e-6, 5.0);
            if let Some(free) = free_gb(data_dir).filter(|free| *free < needed) {
                println!("growth: skipping {keys} keys and more: {free:.1} GB free, about {needed:.0} GB needed");
                break;
            }
            println!("growth: filling the key table to {keys} remembered keys…");
            (fill_s, settle_s) = fill(store, &fill_sql(max, (filled, keys), false)).await;
            filled = keys;
        } else {
            (fill_s, settle_s) = (0.0, fill(store, &[]).await.1);
        }
        let (rows, heap_mb, index_mb) = table_size(store).await;
        println!(
            "growth: {keys} keys: {rows:.0} rows, table {heap_mb:.0} MB, indexes {index_mb:.0} MB; fill {fill_s:.1} s, VACUUM ANALYZE + CHECKPOINT {settle_s:.1} s"
        );
        let mut runs: [Vec<Run>; 3] = Default::default();
        for round in 1..=rounds {
            for (i, s) in scenarios(targets).into_iter().enumerate() {
                let run = load.run(s, duration).await;
                print_round(round, &format!("{keys} keys, {}", s.name), &run);
                runs[i].push(run);
            }
        }
        steps.push(Step {
            keys,
            rows,
            heap_mb,
            index_mb,
            fill_s,
            settle_s,
            runs,
        });
    }
    steps
}

pub(crate) fn print(steps: &[Step]) {
    println!();
    println!("Key-table growth (filled in SQL; create keys are random UUIDs; replays without the replay cache):");
    println!();
    println!("| remembered keys | rows | table MB | indexes MB | fill s | vacuum + checkpoint s | bare req/s | create req/s | create p99 ms | replay req/s | replay p99 ms | create / bare | unexpected |");
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for step in steps {
        let [bare, create, replay] = step.runs.each_ref().map(|r| Stats::of(r));
        println!(
            "| {} | {:.0} | {:.0} | {:.0} | {:.1} | {:.1} | {:.0} | {:.0} | {:.2} | {:.0} | {:.2} | {:.2} | {} |",
            step.keys, step.rows, step.heap_mb, step.index_mb, step.fill_s, step.settle_s, bare.tput,
            create.tput, create.p99, replay.tput, replay.p99, create.tput / bare.tput,
            bare.unexpected + create.unexpected + replay.unexpected
        );
    }
}

/// Create throughput at 10 M keys against at 0, each divided by bare's in
/// the same step (the machine's drift between steps cancels); and the raw
/// ratio. `None` unless both sizes ran.
pub(crate) fn create_10m_vs_0(steps: &[Step]) -> Option<(f64, f64)> {
    let at = |keys: u64| {
        let step = steps.iter().find(|s| s.keys == keys)?;
        Some((Stats::of(&step.runs[0]).tput, Stats::of(&step.runs[1]).tput))
    };
    let ((bare0, create0), (bare10, create10)) = (at(0)?, at(10_000_000)?);
    Some(((create10 / bare10) / (create0 / bare0), create10 / create0))
}

/// Cleanup deleting expired keys while creates run.
pub(crate) struct CleanupRun {
    expired: u64,
    fill_s: f64,
    rows: f64,
    /// (create without cleanup, create while cleanup runs, rows removed, seconds it ran)
    rounds: Vec<(Run, Run, u64, f64)>,
    exhausted: bool,
}

/// Fills `expired` expired keys (spread between the live ones), then, each
/// round, creates alone and creates while `Cleanup` deletes batches of 1,000.
pub(crate) async fn cleanup(
    load: &Arc<Load>,
    store: &PgStore,
    cleaner: PgStore,
    targets: Targets,
    expired: u64,
    duration: Duration,
    rounds: usize,
) -> CleanupRun {
    println!("cleanup: filling {expired} expired keys…");
    let (fill_s, _) = fill(store, &fill_sql(expired, (0, expired), true)).await;
    let (rows, _, _) = table_size(store).await;
    let create = scenarios(targets)[1];
    let cleanup = Cleanup::new(cleaner).batch_size(1000);
    let mut result = CleanupRun {
        expired,
        fill_s,
        rows,
        rounds: Vec::new(),
        exhausted: false,
    };
    for round in 1..=rounds {
        let alone = load.run(create, duration).await;
        print_round(round, "create, no cleanup", &alone);
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn({
            let (cleanup, stop) = (cleanup.clone(), stop.clone());
            async move {
                let (started, mut removed, mut exhausted) = (Instant::now(), 0, false);
                while !stop.load(Ordering::Relaxed) {
                    match cleanup.delete_batch().await {
                        Ok(n) => {
                            removed += n;
                            if n < 1000 {
                                exhausted = true;
                                break;
                            }
                        }
                        Err(e) => {
                            println!("cleanup failed: {e}");
                            break;
                        }
                    }
                }
                (removed, started.elapsed().as_secs_f64(), exhausted)
            }
        });
        let during = load.run(create, duration).await;
        stop.store(true, Ordering::Relaxed);
        let (removed, seconds, exhausted) = task.await.expect("cleanup task");
        print_round(round, "create while cleanup runs", &during);
        println!(
            "round {round} cleanup removed {removed} rows in {seconds:.1} s ({:.0} rows/s)",
            removed as f64 / seconds
        );
        result.exhausted |= exhausted;
        result.rounds.push((alone, during, removed, seconds));
    }
    result
}

pub(crate) fn print_cleanup(c: &CleanupRun) {
    let alone: Vec<Run> = c.rounds.iter().map(|r| r.0.clone()).collect();
    let during: Vec<Run> = c.rounds.iter().map(|r| r.1.clone()).collect();
    let (alone, during) = (Stats::of(&alone), Stats::of(&during));
    let removed: u64 = c.rounds.iter().map(|r| r.2).sum();
    let seconds: f64 = c.rounds.iter().map(|r| r.3).sum();
    println!();
    println!(
        "Cleanup ({} expired keys filled in {:.1} s, {:.0} rows in the table; retention::Cleanup, batches of 1,000, one connection):",
        c.expired, c.fill_s, c.rows
    );
    println!();
    println!("| scenario | req/s | p50 ms | p99 ms | unexpected answers |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    for (name, s) in [
        ("create, no cleanup", &alone),
        ("create while cleanup runs", &during),
    ] {
        println!(
            "| {name} | {:.0} | {:.2} | {:.2} | {} |",
            s.tput, s.p50, s.p99, s.unexpected
        );
    }
    println!();
    println!(
        "cleanup: {removed} expired rows removed in {seconds:.1} s while creates ran ({:.0} rows/s){}; create during cleanup {:.2} of create alone",
        removed as f64 / seconds,
        if c.exhausted { ", backlog exhausted" } else { "" },
        during.tput / alone.tput
    );
}
