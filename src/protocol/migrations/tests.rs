//! The runner against a real PostgreSQL, with lists of the tests' own: a
//! migration applied while claims keep the table busy, an interrupted
//! index build, migrators racing over an index build.
// Against PostgreSQL through `PgStore` and the throwaway cluster: with
// `postgres` only (`test-util` alone builds the conformance suite).
#![cfg(feature = "postgres")]

use std::{
    sync::{
        atomic::{AtomicBool, Ordering::Relaxed},
        Arc,
    },
    time::{Duration, Instant},
};

use super::{run_on, Migration, Settings, Step, Summary, MIGRATIONS};
use crate::{
    fingerprint::Fingerprint,
    key::IdempotencyKey,
    postgres::PgStore,
    scope::{Scope, TenantId},
    store::{Claim, ClaimRequest, Store, StoreError, StoreErrorKind},
    testing::TestDatabase,
};

/// Short waits, so that a test sees several attempts time out in a second.
const SETTINGS: Settings = Settings {
    lock_timeout: Duration::from_millis(300),
    attempts: 100,
    first_backoff: Duration::from_millis(10),
    max_backoff: Duration::from_millis(50),
    index_builds: 3,
    build_wait: Duration::from_secs(60),
};

// The crate's migrations, which the tests' own are appended to.
const BASELINE: Migration = MIGRATIONS[0];
const LZ4: Migration = MIGRATIONS[1];
const RESET: Migration = MIGRATIONS[2];
const KEEP: Migration = MIGRATIONS[3];
const STATIC: Migration = MIGRATIONS[4];
const BYTEWISE_INDEXES: Migration = MIGRATIONS[5];
const BYTEWISE_REQUESTS: Migration = MIGRATIONS[6];
const BYTEWISE_OUTBOX: Migration = MIGRATIONS[7];
const BYTEWISE_INBOX: Migration = MIGRATIONS[8];
const TRACE_IDS: Migration = MIGRATIONS[9];

/// What the crate's migrations record.
fn released() -> Vec<(i32, String)> {
    MIGRATIONS
        .iter()
        .map(|m| (m.version, m.name.to_owned()))
        .collect()
}

const NOTE_INDEX: &str = "idempotency_requests_load_note_idx";

/// Migrations of the kinds the guide allows: a nullable column, then an
/// index on it built concurrently.
const UNDER_LOAD: &[Migration] = &[
    BASELINE,
    LZ4,
    RESET,
    KEEP,
    STATIC,
    BYTEWISE_INDEXES,
    BYTEWISE_REQUESTS,
    BYTEWISE_OUTBOX,
    BYTEWISE_INBOX,
    TRACE_IDS,
    Migration {
        version: 11,
        name: "load_note",
        steps: &[Step::Transactional(
            "ALTER TABLE idempotency_requests ADD COLUMN load_note text",
        )],
    },
    Migration {
        version: 12,
        name: "load_note_index",
        steps: &[Step::ConcurrentIndex {
            name: NOTE_INDEX,
            table: "idempotency_requests",
            sql: "CREATE INDEX CONCURRENTLY IF NOT EXISTS idempotency_requests_load_note_idx \
                  ON idempotency_requests (load_note)",
            taken_by: None,
        }],
    },
];

/// The recorded rows `UNDER_LOAD` leaves.
fn under_load_recorded() -> Vec<(i32, String)> {
    UNDER_LOAD
        .iter()
        .map(|m| (m.version, m.name.to_owned()))
        .collect()
}

const TARGET_INDEX: &str = "idempotency_requests_target_idx";

/// A unique index, which a build fails on duplicate rows.
const UNIQUE_TARGET: &[Migration] = &[
    BASELINE,
    LZ4,
    RESET,
    KEEP,
    STATIC,
    BYTEWISE_INDEXES,
    BYTEWISE_REQUESTS,
    BYTEWISE_OUTBOX,
    BYTEWISE_INBOX,
    TRACE_IDS,
    Migration {
        version: 11,
        name: "unique_target",
        steps: &[Step::ConcurrentIndex {
            name: TARGET_INDEX,
            table: "idempotency_requests",
            sql: "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS idempotency_requests_target_idx \
                  ON idempotency_requests (tenant_id, request_target)",
            taken_by: None,
        }],
    },
];

async fn value<T>(client: &tokio_postgres::Client, sql: &str) -> T
where
    T: for<'a> tokio_postgres::types::FromSql<'a>,
{
    client.query_one(sql, &[]).await.unwrap().get(0)
}

/// Whether index `name` exists and is valid.
async fn index_valid(client: &tokio_postgres::Client, name: &str) -> Option<bool> {
    client
        .query_opt(
            "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)",
            &[&name],
        )
        .await
        .unwrap()
        .map(|row| row.get(0))
}

/// The rows of `sql`, two columns each.
async fn pairs<A, B>(client: &tokio_postgres::Client, sql: &str) -> Vec<(A, B)>
where
    A: for<'a> tokio_postgres::types::FromSql<'a>,
    B: for<'a> tokio_postgres::types::FromSql<'a>,
{
    client
        .query(sql, &[])
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

async fn recorded(client: &tokio_postgres::Client) -> Vec<(i32, String)> {
    pairs(
        client,
        "SELECT version, name FROM tower_idempotency_migrations ORDER BY version",
    )
    .await
}

fn claim_request(key: &str) -> ClaimRequest {
    ClaimRequest::new(
        Scope::new(TenantId::new("t"), "POST /x"),
        IdempotencyKey::parse(key.as_bytes()).unwrap(),
        Fingerprint::from_bytes([1; 32]),
    )
    .with_retention(Duration::from_secs(60))
    .with_wait(Duration::from_secs(5))
}

/// One claim and its completion; how long both took. Sent as the stores
/// of a release before version 10 send them (that release's instances
/// serve while a new one migrates; this build's statements need version
/// 10's column): the key's row inserted `ON CONFLICT DO NOTHING` and
/// completed in one transaction, whose locks on the table are the claim's.
async fn claim_and_complete(store: &PgStore, key: &str) -> Result<Duration, StoreError> {
    let started = Instant::now();
    let client = store.client().await?;
    let failed =
        |e: tokio_postgres::Error| StoreError::new(StoreErrorKind::Unavailable, e.to_string());
    client.batch_execute("BEGIN").await.map_err(failed)?;
    let claimed = client
        .query_opt(
            "INSERT INTO idempotency_requests \
                 (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at) \
             VALUES ('t', 'POST /x', $1::text, decode(repeat('01', 32), 'hex'), \
                 'in_progress', now() + interval '60 seconds') \
             ON CONFLICT ON CONSTRAINT idempotency_requests_pkey DO NOTHING \
             RETURNING attempt_token",
            &[&key],
        )
        .await
        .map_err(failed)?;
    assert!(claimed.is_some(), "a new key {key} is owned");
    client
        .execute(
            "UPDATE idempotency_requests SET state = 'completed', response_status = 200, \
                 response_headers = ''::bytea, response_body = 'done'::bytea, \
                 completed_at = statement_timestamp() \
             WHERE tenant_id = 't' AND endpoint = 'POST /x' AND idempotency_key = $1::text",
            &[&key],
        )
        .await
        .map_err(failed)?;
    client.batch_execute("COMMIT").await.map_err(failed)?;
    Ok(started.elapsed())
}

/// What a claim worker saw: every claim's end (since the test began) and
/// how long it took.
type Claims = Vec<(Duration, Duration)>;

/// Claims new keys until `stop`, as an application's requests would.
async fn claim_until(
    store: PgStore,
    worker: usize,
    epoch: Instant,
    stop: Arc<AtomicBool>,
) -> Claims {
    let mut claims = Vec::new();
    for i in 0.. {
        if stop.load(Relaxed) {
            break;
        }
        let latency = claim_and_complete(&store, &format!("w{worker}-{i}"))
            .await
            .unwrap_or_else(|e| panic!("a claim failed during the migration: {e}"));
        claims.push((epoch.elapsed(), latency));
    }
    claims
}

/// A migration applied while claims keep the table busy and a long
/// transaction holds a lock on it (a report, an idle-in-transaction
/// session): the `ALTER TABLE` queues for its lock at most the lock timeout
/// at a time, the claims queued behind it go through in between, and the
/// migration gets through once the long transaction ends. The index is
/// built concurrently, under the claims.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_under_load_holds_claims_up_at_most_its_lock_timeout() {
    let (db, store) = claims_store().await;
    store.migrate().await.unwrap();
    let summary = under_load(&db, &store, UNDER_LOAD, "ADD COLUMN").await;
    let client = db.client().await;
    assert_eq!(summary.applied, [11, 12]);
    assert_eq!(summary.rebuilds, 0);
    let column: i64 = value(
        &client,
        "SELECT count(*) FROM pg_attribute \
         WHERE attrelid = 'idempotency_requests'::regclass AND attname = 'load_note'",
    )
    .await;
    assert_eq!(column, 1);
    assert_eq!(index_valid(&client, NOTE_INDEX).await, Some(true));
    assert_eq!(recorded(&client).await, under_load_recorded());
}

/// Versions 7 to 9 (the key columns made bytewise, the indexes version 6
/// built swapped in) as the test above runs a migration: version 7's first
/// `ALTER TABLE` queues behind a long transaction at most the lock timeout at
/// a time while claims go on, and the three get through once it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_7_to_9_under_load_hold_claims_up_at_most_their_lock_timeout() {
    let (db, store) = claims_store().await;
    run_on(&store, &MIGRATIONS[..6], &SETTINGS).await.unwrap();
    let summary = under_load(&db, &store, MIGRATIONS, "DROP CONSTRAINT").await;
    let client = db.client().await;
    assert_eq!(summary.applied, [7, 8, 9, 10]);
    assert_eq!(key_collations(&client).await, bytewise_collations());
    assert_eq!(recorded(&client).await, released());
}

/// How many claims [`under_load`] keeps running.
const WORKERS: usize = 4;

/// A database of the test's own and a store with a connection for each of
/// [`under_load`]'s workers.
async fn claims_store() -> (TestDatabase, PgStore) {
    let db = TestDatabase::create().await;
    let store = PgStore::builder(db.config())
        .max_connections(WORKERS)
        .build()
        .unwrap();
    (db, store)
}

/// Runs `list` on a migrator of its own while [`WORKERS`] claim and
/// complete keys on `store` and a long transaction holds ACCESS SHARE on the
/// key table until a statement of `list` holding `statement` has queued for
/// its lock in four transactions of the migrator (three timed out). Asserts
/// that the claims kept answering, none slower than the lock timeout over
/// what a claim takes unloaded, and that the migrator counted its timed-out
/// attempts; gives what it applied.
async fn under_load(
    db: &TestDatabase,
    store: &PgStore,
    list: &'static [Migration],
    statement: &str,
) -> Summary {
    let mut config = db.config();
    config.application_name("migration-under-load");
    let migrator = PgStore::builder(config).max_connections(1).build().unwrap();
    let client = db.client().await;

    // The claims' own latency, as many at once, with no migration.
    let warm_up: Vec<_> = (0..WORKERS)
        .map(|worker| {
            let store = store.clone();
            tokio::spawn(async move {
                let mut slowest = Duration::ZERO;
                for i in 0..25 {
                    let key = format!("warm-{worker}-{i}");
                    slowest = slowest.max(claim_and_complete(&store, &key).await.unwrap());
                }
                slowest
            })
        })
        .collect();
    let mut unloaded = Duration::ZERO;
    for worker in warm_up {
        unloaded = unloaded.max(worker.await.unwrap());
    }

    let epoch = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..WORKERS)
        .map(|worker| tokio::spawn(claim_until(store.clone(), worker, epoch, stop.clone())))
        .collect();

    // A long transaction holding ACCESS SHARE: the ALTER must wait for it.
    let blocker = db.client().await;
    blocker
        .batch_execute("BEGIN; SELECT count(*) FROM idempotency_requests")
        .await
        .unwrap();
    let blocked_at = epoch.elapsed();
    let migration = tokio::spawn(async move { run_on(&migrator, list, &SETTINGS).await });

    // Hold it until the ALTER has queued for its lock in four
    // transactions: three of them timed out. Each wait lasts the lock
    // timeout; a look every 20 ms sees each.
    let mut waits: Vec<String> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while waits.len() < 4 {
        assert!(
            Instant::now() < deadline,
            "the ALTER never waited: {waits:?}"
        );
        let rows = client
            .query(
                "SELECT xact_start::text FROM pg_stat_activity \
                 WHERE application_name = 'migration-under-load' AND wait_event_type = 'Lock' \
                   AND strpos(query, $1) > 0",
                &[&statement],
            )
            .await
            .unwrap();
        for row in rows {
            let started: String = row.get(0);
            if !waits.contains(&started) {
                waits.push(started);
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    blocker.batch_execute("COMMIT").await.unwrap();
    let released_at = epoch.elapsed();
    let summary: Summary = migration
        .await
        .unwrap()
        .expect("the migration gets through");
    let migrated_at = epoch.elapsed();
    stop.store(true, Relaxed);
    let mut claims = Claims::new();
    for worker in workers {
        claims.extend(worker.await.unwrap());
    }

    // A claim queues behind the waiting ALTER at most its lock timeout,
    // on top of what a claim takes anyway.
    let bound = SETTINGS.lock_timeout + unloaded * 2 + Duration::from_millis(200);
    let held = released_at - blocked_at;
    assert!(
        held > bound,
        "the long transaction held its lock {held:?}, past the bound {bound:?}"
    );
    let during: Vec<_> = claims
        .iter()
        .filter(|(end, _)| *end > blocked_at && *end <= released_at)
        .collect();
    let slowest = claims.iter().map(|(_, latency)| *latency).max().unwrap();
    eprintln!(
        "claims: {} in all, {} while the lock was held ({held:?}); slowest {slowest:?}, bound \
         {bound:?} (lock timeout {:?}, unloaded slowest {unloaded:?}); migration done after \
         {:?}: {summary:?}",
        claims.len(),
        during.len(),
        SETTINGS.lock_timeout,
        migrated_at - blocked_at,
    );
    assert!(
        during.len() >= WORKERS,
        "the claims kept answering: {}",
        during.len()
    );
    assert!(slowest <= bound, "a claim took {slowest:?}, past {bound:?}");

    assert!(
        summary.lock_timeouts as usize >= waits.len() - 1,
        "{} waits seen, {summary:?}",
        waits.len()
    );
    summary
}

/// A migration whose lock never comes gives up after its attempts with
/// `Unavailable`, naming itself, and leaves nothing applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_that_never_gets_its_lock_gives_up_unavailable() {
    let db = TestDatabase::create().await;
    let store = PgStore::builder(db.config()).build().unwrap();
    store.migrate().await.unwrap();
    let blocker = db.client().await;
    blocker
        .batch_execute("BEGIN; SELECT count(*) FROM idempotency_requests")
        .await
        .unwrap();
    let settings = Settings {
        lock_timeout: Duration::from_millis(50),
        attempts: 3,
        ..SETTINGS
    };
    let e = run_on(&store, UNDER_LOAD, &settings).await.unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Unavailable, "{e}");
    assert_eq!(e.sql_state(), Some("55P03"));
    let message = e.to_string();
    assert!(
        message.contains("migration 11 (load_note)") && message.contains("3 attempts"),
        "{message}"
    );
    blocker.batch_execute("COMMIT").await.unwrap();
    let client = db.client().await;
    assert_eq!(recorded(&client).await, released());
    assert_eq!(index_valid(&client, NOTE_INDEX).await, None);
}

/// Rows on which a unique index build fails: two keys with one target.
async fn duplicate_targets(client: &tokio_postgres::Client) {
    client
        .batch_execute(
            "INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, \
                 request_fingerprint, expires_at, request_target)
             VALUES ('t', 'e', 'a', '\\x00', now() + interval '1 day', '/dup'),
                    ('t', 'e', 'b', '\\x00', now() + interval '1 day', '/dup')",
        )
        .await
        .unwrap();
}

/// An interrupted concurrent build leaves an invalid index, which `IF NOT
/// EXISTS` alone would take for done: the runner drops it and builds it
/// again. A build that fails leaves the migration unrecorded.
async fn an_interrupted_index_build_is_rebuilt<F, Fut>(db: &TestDatabase, run: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<Summary, StoreError>>,
{
    let client = db.client().await;
    duplicate_targets(&client).await;
    let interrupted = client
        .batch_execute(
            "CREATE UNIQUE INDEX CONCURRENTLY idempotency_requests_target_idx \
             ON idempotency_requests (tenant_id, request_target)",
        )
        .await
        .unwrap_err();
    assert_eq!(interrupted.code().map(|c| c.code()), Some("23505"));
    assert_eq!(index_valid(&client, TARGET_INDEX).await, Some(false));

    // The duplicates are still there: the build fails again, nothing is
    // recorded.
    let e = run().await.unwrap_err();
    assert_eq!(e.sql_state(), Some("23505"), "{e}");
    assert_eq!(recorded(&client).await, released());
    assert_eq!(index_valid(&client, TARGET_INDEX).await, Some(false));

    client
        .batch_execute("DELETE FROM idempotency_requests WHERE idempotency_key = 'b'")
        .await
        .unwrap();
    let summary = run().await.unwrap();
    assert_eq!(summary.applied, [11]);
    assert_eq!(summary.rebuilds, 1, "{summary:?}");
    assert_eq!(index_valid(&client, TARGET_INDEX).await, Some(true));
    assert_eq!(
        recorded(&client).await,
        [
            (1, "baseline".to_owned()),
            (2, "lz4_stored_bodies".to_owned()),
            (3, "session_reset_function".to_owned()),
            (4, "session_reset_keeps_hold_limit".to_owned()),
            (5, "session_reset_static".to_owned()),
            (6, "bytewise_key_indexes".to_owned()),
            (7, "bytewise_request_keys".to_owned()),
            (8, "bytewise_outbox_aggregate".to_owned()),
            (9, "bytewise_inbox_keys".to_owned()),
            (10, "request_trace_ids".to_owned()),
            (11, "unique_target".to_owned())
        ]
    );
    assert_eq!(
        run().await.unwrap(),
        Summary::default(),
        "nothing left to do"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_index_build_is_rebuilt_by_pg_store() {
    let db = TestDatabase::create().await;
    let store = PgStore::builder(db.config()).build().unwrap();
    store.migrate().await.unwrap();
    an_interrupted_index_build_is_rebuilt(&db, || run_on(&store, UNIQUE_TARGET, &SETTINGS)).await;
}

#[cfg(feature = "sqlx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_index_build_is_rebuilt_by_sqlx_store() {
    let db = TestDatabase::create().await;
    let store = crate::sqlx::SqlxStore::new(sqlx_pool(&db).await);
    store.migrate().await.unwrap();
    an_interrupted_index_build_is_rebuilt(&db, || run_on(&store, UNIQUE_TARGET, &SETTINGS)).await;
}

#[cfg(feature = "sqlx")]
async fn sqlx_pool(db: &TestDatabase) -> ::sqlx::PgPool {
    let config = db.config();
    let mut options = ::sqlx::postgres::PgConnectOptions::new().database(db.name());
    if let Some(tokio_postgres::config::Host::Unix(path)) = config.get_hosts().first() {
        options = options.socket(path);
    }
    if let Some(port) = config.get_ports().first() {
        options = options.port(*port);
    }
    if let Some(user) = config.get_user() {
        options = options.username(user);
    }
    ::sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .unwrap()
}

/// Migrators racing over the same index build: the later builds wait for
/// the first one's table lock and find the index there; one row per
/// version, a valid index, nothing rebuilt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrators_racing_over_an_index_build_record_each_version_once() {
    let db = TestDatabase::create().await;
    let store = PgStore::builder(db.config()).build().unwrap();
    let runs: Vec<_> = (0..4)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { run_on(&store, UNDER_LOAD, &SETTINGS).await })
        })
        .collect();
    let mut applied = Vec::new();
    for run in runs {
        let summary = run.await.unwrap().expect("every migrator succeeds");
        eprintln!("{summary:?}");
        applied.extend(summary.applied);
    }
    applied.sort_unstable();
    assert_eq!(
        applied,
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
        "each version applied by one migrator"
    );
    let client = db.client().await;
    assert_eq!(recorded(&client).await, under_load_recorded());
    assert_eq!(index_valid(&client, NOTE_INDEX).await, Some(true));
}

/// The key columns versions 6 to 9 make compare byte by byte, and the
/// index each ends up in (under its old name).
const BYTEWISE: [(&str, &str, &str); 4] = [
    (
        "idempotency_requests",
        "idempotency_key",
        "idempotency_requests_pkey",
    ),
    (
        "outbox_events",
        "aggregate_id",
        "outbox_events_aggregate_idx",
    ),
    ("inbox_events", "consumer", "inbox_events_pkey"),
    ("inbox_events", "event_id", "inbox_events_pkey"),
];

/// Each column of [`BYTEWISE`], and `tenant_id` and `endpoint`: the
/// column's collation, and the collation the index it is in uses for it
/// (`default` for the database's).
async fn key_collations(client: &tokio_postgres::Client) -> Vec<(String, String, String)> {
    let mut columns: Vec<_> = BYTEWISE.to_vec();
    columns.extend([
        (
            "idempotency_requests",
            "tenant_id",
            "idempotency_requests_pkey",
        ),
        (
            "idempotency_requests",
            "endpoint",
            "idempotency_requests_pkey",
        ),
        (
            "idempotency_requests",
            "endpoint",
            "idempotency_requests_lease_idx",
        ),
        ("inbox_events", "tenant_id", "inbox_events_pkey"),
    ]);
    let mut found = Vec::new();
    for (table, column, index) in columns {
        let row = client
            .query_one(
                "SELECT (SELECT collname::text FROM pg_collation WHERE oid = a.attcollation), \
                        (SELECT collname::text FROM pg_collation \
                          WHERE oid = i.indcollation[array_position(i.indkey::int2[], a.attnum)]) \
                 FROM pg_attribute a, pg_index i \
                 WHERE a.attrelid = $1::text::regclass AND a.attname = $2 \
                   AND i.indexrelid = $3::text::regclass AND i.indisvalid",
                &[&table, &column, &index],
            )
            .await
            .unwrap_or_else(|e| panic!("{table}.{column} in a valid {index}: {e}"));
        found.push((
            format!("{table}.{column} in {index}"),
            row.get(0),
            row.get(1),
        ));
    }
    found
}

/// What [`key_collations`] finds after version 9: the key columns "C"
/// in their indexes too, `tenant_id` and `endpoint` the database's.
fn bytewise_collations() -> Vec<(String, String, String)> {
    let mut expected: Vec<_> = BYTEWISE
        .iter()
        .map(|(table, column, index)| (format!("{table}.{column} in {index}"), "C", "C"))
        .collect();
    expected.extend([
        (
            "idempotency_requests.tenant_id in idempotency_requests_pkey".to_owned(),
            "default",
            "default",
        ),
        (
            "idempotency_requests.endpoint in idempotency_requests_pkey".to_owned(),
            "default",
            "default",
        ),
        (
            "idempotency_requests.endpoint in idempotency_requests_lease_idx".to_owned(),
            "default",
            "default",
        ),
        (
            "inbox_events.tenant_id in inbox_events_pkey".to_owned(),
            "default",
            "default",
        ),
    ]);
    expected
        .into_iter()
        .map(|(name, column, index)| (name, column.to_owned(), index.to_owned()))
        .collect()
}

/// The storage (`relfilenode`) of each of the three tables and of each of
/// their indexes, by name: a rebuilt index or a rewritten table has a new
/// one.
async fn files(client: &tokio_postgres::Client) -> Vec<(String, u32)> {
    pairs(
        client,
        "SELECT c.relname::text, c.relfilenode::oid FROM pg_class c \
         WHERE c.relkind IN ('r', 'i') AND c.relnamespace = current_schema()::regnamespace \
           AND c.relname ~ '^(idempotency_requests|outbox_events|inbox_events)' \
         ORDER BY 1",
    )
    .await
}

/// The indexes versions 7 to 9 put in the place of others: the name they
/// end with, the name version 6 built them under.
const SWAPS: [(&str, &str); 3] = [
    (
        "idempotency_requests_pkey",
        "idempotency_requests_key_bytewise",
    ),
    (
        "outbox_events_aggregate_idx",
        "outbox_events_aggregate_bytewise",
    ),
    ("inbox_events_pkey", "inbox_events_key_bytewise"),
];

/// Drops the database [`c_utf8_database`] made (what is left of a failed
/// test goes with `admin`'s cluster).
async fn drop_database(admin: &TestDatabase, name: &str) {
    let _ = admin
        .client()
        .await
        .batch_execute(&format!("DROP DATABASE {name} WITH (FORCE)"))
        .await;
}

/// A database of the test's own in the locale C.UTF-8 (the C library's,
/// which PostgreSQL compares through `strcoll` as it does en_US.UTF-8, and
/// which every glibc machine has), beside `admin`'s: its name and how to
/// reach it.
async fn c_utf8_database(admin: &TestDatabase) -> (String, tokio_postgres::Config) {
    let name = format!("{}_utf8", admin.name());
    admin
        .client()
        .await
        .batch_execute(&format!(
            "CREATE DATABASE {name} TEMPLATE template0 ENCODING 'UTF8' LOCALE 'C.UTF-8'"
        ))
        .await
        .expect("a database in C.UTF-8 (the C library's, not PostgreSQL's C)");
    let mut config = admin.config();
    config.dbname(&name);
    (name, config)
}

/// Versions 6 to 9 on a database whose locale is not PostgreSQL's C
/// (C.UTF-8, which PostgreSQL compares through the C library as it does
/// en_US.UTF-8, and which every glibc machine has), with rows in every
/// table and claims running before and after: the key columns end up "C"
/// in the catalog and in their indexes under the old names, the indexes
/// version 6 built are the ones in use (same storage: nothing was rebuilt
/// while a table was locked), the other indexes untouched, no row lost,
/// and the keys still arbitrate (a duplicate claim is not owned again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_columns_become_bytewise_under_claims_without_a_rebuild() {
    const WORKERS: usize = 3;
    let admin = TestDatabase::create().await;
    let (name, config) = c_utf8_database(&admin).await;
    let store = PgStore::builder(config.clone())
        .max_connections(WORKERS + 1)
        .build()
        .unwrap();
    let (client, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);

    run_on(&store, &MIGRATIONS[..5], &SETTINGS).await.unwrap();
    client
        .batch_execute(
            "INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, \
                 request_fingerprint, state, response_status, response_headers, response_body, \
                 completed_at, expires_at)
             SELECT 't', 'POST /x', 'old-' || i, decode(repeat('01', 32), 'hex'), 'completed',
                    200, '', 'done', now(), now() + interval '1 day'
             FROM generate_series(1, 2000) i;
             INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, \
                 request_fingerprint, expires_at, lease_expires_at)
             SELECT 't', 'POST /x', 'leased-' || i, '\\x00', now() + interval '1 day',
                    now() + interval '1 hour'
             FROM generate_series(1, 200) i;
             INSERT INTO outbox_events (tenant_id, aggregate_id, event_type, payload)
             SELECT 't', 'order-' || (i % 100), 'E', '{}' FROM generate_series(1, 2000) i;
             INSERT INTO inbox_events (tenant_id, consumer, event_id)
             SELECT 't', 'c' || (i % 3), 'e' || i FROM generate_series(1, 2000) i;",
        )
        .await
        .unwrap();
    let before = key_collations(&client).await;
    assert!(
        before
            .iter()
            .all(|(_, column, index)| column == "default" && index == "default"),
        "{before:?}"
    );

    let untouched = files(&client).await;
    let summary = run_on(&store, &MIGRATIONS[..6], &SETTINGS).await.unwrap();
    assert_eq!(summary.applied, [6]);
    let built = files(&client).await;
    let file = |files: &[(String, u32)], name: &str| {
        files
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, f)| *f)
            .unwrap_or_else(|| panic!("{name} in {files:?}"))
    };

    // Claims before, around and after versions 7 to 9: the migration
    // starts once the workers have committed claims, and the workers stop
    // once they have committed more after it.
    let epoch = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..WORKERS)
        .map(|worker| tokio::spawn(claim_until(store.clone(), worker, epoch, stop.clone())))
        .collect();
    let claimed_rows = "SELECT count(*) FROM idempotency_requests WHERE idempotency_key LIKE 'w%'";
    let mut seen: i64 = 0;
    while seen < 2 * WORKERS as i64 {
        seen = value(&client, claimed_rows).await;
        tokio::task::yield_now().await;
    }
    let started_at = epoch.elapsed();
    let summary = run_on(&store, MIGRATIONS, &SETTINGS).await.unwrap();
    let migrated_at = epoch.elapsed();
    let at_end: i64 = value(&client, claimed_rows).await;
    let mut now = at_end;
    while now < at_end + 2 * WORKERS as i64 {
        now = value(&client, claimed_rows).await;
        tokio::task::yield_now().await;
    }
    stop.store(true, Relaxed);
    let mut claims = Claims::new();
    for worker in workers {
        claims.extend(worker.await.unwrap());
    }
    assert_eq!(summary.applied, [7, 8, 9, 10]);
    assert!(
        claims.iter().any(|(end, _)| *end <= started_at)
            && claims.iter().any(|(end, _)| *end > migrated_at),
        "claims before and after it: {claims:?}"
    );

    assert_eq!(key_collations(&client).await, bytewise_collations());
    let after = files(&client).await;
    for (now, then) in SWAPS {
        assert_eq!(
            file(&after, now),
            file(&built, then),
            "{now} is {then}, not rebuilt"
        );
    }
    // Everything else (the tables, the other indexes) has the storage it
    // had before version 6.
    for (name, before) in untouched
        .iter()
        .filter(|(name, _)| SWAPS.iter().all(|(swapped, _)| name != swapped))
    {
        assert_eq!(file(&after, name), *before, "{name} untouched");
    }
    assert!(
        untouched.len() > SWAPS.len() + 3,
        "the tables and their other indexes: {untouched:?}"
    );
    assert!(
        after.iter().all(|(name, _)| !name.ends_with("_bytewise")),
        "{after:?}"
    );
    let primary: bool = value(
        &client,
        "SELECT indisprimary FROM pg_index WHERE indexrelid = 'idempotency_requests_pkey'::regclass",
    )
    .await;
    assert!(primary);
    let rows: i64 = value(
        &client,
        "SELECT count(*) FROM idempotency_requests WHERE idempotency_key LIKE 'old-%'",
    )
    .await;
    assert_eq!(rows, 2000);
    let claimed: i64 = value(
        &client,
        "SELECT count(*) FROM idempotency_requests WHERE idempotency_key LIKE 'w%'",
    )
    .await;
    assert_eq!(claimed as usize, claims.len(), "one row per claim");
    let counts: (i64, i64) = {
        let row = client
            .query_one(
                "SELECT (SELECT count(*) FROM outbox_events), (SELECT count(*) FROM inbox_events)",
                &[],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!(counts, (2000, 2000));

    // The keys still arbitrate: the first claim's key and an old one are
    // not owned again; the inbox still refuses an event twice.
    for key in ["w0-0", "old-7"] {
        let claim = store.claim(&claim_request(key)).await.unwrap();
        assert!(!matches!(claim, Claim::Owned(_)), "{key} owned twice");
    }
    let inserted = client
        .execute(
            "INSERT INTO inbox_events (tenant_id, consumer, event_id) VALUES ('t', 'c1', 'e1') \
             ON CONFLICT (tenant_id, consumer, event_id) DO NOTHING",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(inserted, 0);
    drop(client);
    drop(store);
    drop_database(&admin, &name).await;
}

/// Versions 7 to 9 step by step, each statement in a transaction of its
/// own that is checked before it commits: no statement gives a table or an
/// index new storage, so none rebuilt an index under its table's lock (an
/// index rebuilt by one statement and dropped by a later one would pass a
/// check made only at the end). A statement that does rebuild, changing
/// `endpoint`'s collation (in the primary key and the partial lease index),
/// is caught by the same check, so the check can fail. Then every index's
/// definition: its columns, their order and collations, as the statements
/// expect them.
#[tokio::test]
async fn no_step_of_versions_7_to_9_rebuilds_an_index() {
    let admin = TestDatabase::create().await;
    let (name, config) = c_utf8_database(&admin).await;
    let store = PgStore::builder(config.clone()).build().unwrap();
    let (client, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    run_on(&store, &MIGRATIONS[..6], &SETTINGS).await.unwrap();
    client
        .batch_execute(
            "INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, \
                 request_fingerprint, expires_at, lease_expires_at)
             SELECT 't', 'POST /x', 'k' || i, '\\x00', now() + interval '1 day',
                    now() + interval '1 hour'
             FROM generate_series(1, 100) i;
             INSERT INTO outbox_events (tenant_id, aggregate_id, event_type, payload)
             SELECT 't', 'order-' || i, 'E', '{}' FROM generate_series(1, 100) i;
             INSERT INTO inbox_events (tenant_id, consumer, event_id)
             SELECT 't', 'c', 'e' || i FROM generate_series(1, 100) i;",
        )
        .await
        .unwrap();

    // What a statement gave new storage to, checked inside its transaction.
    let new_files = |sql: &'static str, end: &'static str| {
        let client = &client;
        async move {
            client.batch_execute("BEGIN").await.unwrap();
            let before = files(client).await;
            client
                .batch_execute(sql)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
            let after = files(client).await;
            client.batch_execute(end).await.unwrap();
            let mut new: Vec<_> = after
                .into_iter()
                .filter(|(_, file)| before.iter().all(|(_, old)| old != file))
                .map(|(name, _)| name)
                .collect();
            new.sort();
            new
        }
    };
    let mut steps = 0;
    for migration in [BYTEWISE_REQUESTS, BYTEWISE_OUTBOX, BYTEWISE_INBOX] {
        for step in migration.steps {
            let Step::Transactional(sql) = *step else {
                panic!("{}: an index build among the swaps", migration.name);
            };
            assert_eq!(
                new_files(sql, "COMMIT").await,
                Vec::<String>::new(),
                "{}: {sql}",
                migration.name
            );
            steps += 1;
        }
    }
    assert_eq!(steps, 9);
    assert_eq!(key_collations(&client).await, bytewise_collations());
    assert_eq!(
        new_files(
            "ALTER TABLE idempotency_requests ALTER COLUMN endpoint TYPE text COLLATE \"C\"",
            "ROLLBACK",
        )
        .await,
        [
            "idempotency_requests_lease_idx",
            "idempotency_requests_pkey"
        ],
        "a statement that rebuilds is seen to"
    );

    let definitions: Vec<(String, String)> = pairs(
        &client,
        "SELECT c.relname::text, pg_get_indexdef(c.oid) FROM pg_class c \
         WHERE c.relkind = 'i' AND c.relnamespace = current_schema()::regnamespace \
           AND c.relname ~ '^(idempotency_requests|outbox_events|inbox_events)' \
         ORDER BY 1",
    )
    .await;
    let definitions: Vec<(&str, &str)> = definitions
        .iter()
        .map(|(name, definition)| (&**name, &**definition))
        .collect();
    assert_eq!(definitions, INDEX_DEFINITIONS);
    drop(client);
    drop(store);
    drop_database(&admin, &name).await;
}

/// Every index of the three tables after version 9, as `pg_get_indexdef`
/// gives it (a column's collation is named only where it is not the
/// column's own).
const INDEX_DEFINITIONS: [(&str, &str); 8] = [
    (
        "idempotency_requests_expires_at_idx",
        "CREATE INDEX idempotency_requests_expires_at_idx ON public.idempotency_requests USING btree \
         (expires_at)",
    ),
    (
        "idempotency_requests_lease_idx",
        "CREATE INDEX idempotency_requests_lease_idx ON public.idempotency_requests USING btree \
         (endpoint, lease_expires_at) WHERE (lease_expires_at IS NOT NULL)",
    ),
    (
        "idempotency_requests_operation_id_idx",
        "CREATE UNIQUE INDEX idempotency_requests_operation_id_idx ON public.idempotency_requests USING btree \
         (tenant_id, operation_id) WHERE (operation_id IS NOT NULL)",
    ),
    (
        "idempotency_requests_pkey",
        "CREATE UNIQUE INDEX idempotency_requests_pkey ON public.idempotency_requests USING btree \
         (tenant_id, endpoint, idempotency_key)",
    ),
    (
        "inbox_events_pkey",
        "CREATE UNIQUE INDEX inbox_events_pkey ON public.inbox_events USING btree \
         (tenant_id, consumer, event_id)",
    ),
    (
        "outbox_events_aggregate_idx",
        "CREATE INDEX outbox_events_aggregate_idx ON public.outbox_events USING btree \
         (tenant_id, aggregate_id)",
    ),
    (
        "outbox_events_due_idx",
        "CREATE INDEX outbox_events_due_idx ON public.outbox_events USING btree \
         (next_attempt_at) WHERE ((published_at IS NULL) AND (parked_at IS NULL))",
    ),
    (
        "outbox_events_pkey",
        "CREATE UNIQUE INDEX outbox_events_pkey ON public.outbox_events USING btree \
         (tenant_id, id)",
    ),
];

/// Versions 6 to 9 on a Citus cluster whose tables were distributed by an
/// earlier release: the coordinator forwards each statement to every
/// shard, and every shard ends with its key columns "C" in its primary
/// key; claims route and arbitrate as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_columns_become_bytewise_on_citus_distributed_tables() {
    use crate::protocol::citus::OWN_TABLES;
    let citus = tokio::task::spawn_blocking(|| crate::testing::TempCitus::start(2))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}"));
    let db = citus.database().await.unwrap_or_else(|e| panic!("{e}"));
    let store = PgStore::builder(db.config()).build().unwrap();
    run_on(&store, &MIGRATIONS[..5], &SETTINGS).await.unwrap();
    assert!(store.distribute_by_tenant(&OWN_TABLES).await.unwrap());
    let client = db.client().await;
    let distributed: i64 = value(&client, "SELECT count(*) FROM pg_dist_partition").await;
    assert_eq!(distributed, 3);
    claim_and_complete(&store, "before").await.unwrap();

    let summary = run_on(&store, MIGRATIONS, &SETTINGS).await.unwrap();
    assert_eq!(summary.applied, [6, 7, 8, 9, 10]);
    assert_eq!(key_collations(&client).await, bytewise_collations());
    // Every shard of each table: its key columns "C", in its primary key
    // (or the aggregate index) too.
    for (table, column, index) in BYTEWISE {
        let rows = client
            .query(
                "SELECT success, result FROM run_command_on_shards($1::text::regclass, $2::text)",
                &[
                    &table,
                    &format!(
                        "SELECT (SELECT collname FROM pg_collation WHERE oid = a.attcollation) \
                                || '/' || (SELECT collname FROM pg_collation \
                                  WHERE oid = i.indcollation[array_position(i.indkey::int2[], a.attnum)]) \
                         FROM pg_attribute a, pg_index i, pg_class c \
                         WHERE a.attrelid = '%s'::regclass AND a.attname = '{column}' \
                           AND i.indrelid = a.attrelid AND i.indexrelid = c.oid \
                           AND c.relname LIKE '{index}%%' AND i.indisvalid"
                    ),
                ],
            )
            .await
            .unwrap();
        assert!(!rows.is_empty(), "{table} has shards");
        for row in rows {
            let (ok, result): (bool, String) = (row.get(0), row.get(1));
            assert!(
                ok && result == "C/C",
                "{table}.{column} on a shard: {result}"
            );
        }
    }
    claim_and_complete(&store, "after").await.unwrap();
    for key in ["before", "after"] {
        let claim = store.claim(&claim_request(key)).await.unwrap();
        assert!(!matches!(claim, Claim::Owned(_)), "{key} owned twice");
    }
    let rows: i64 = value(&client, "SELECT count(*) FROM idempotency_requests").await;
    assert_eq!(rows, 2);
}

/// Every index of the crate's three tables: its name and its definition
/// (`pg_get_indexdef`, which names the columns, their collations and
/// whether it is unique), and whether it is valid, in name order.
async fn index_list(client: &tokio_postgres::Client) -> Vec<(String, String, bool)> {
    client
        .query(
            "SELECT c.relname::text, pg_get_indexdef(i.indexrelid), i.indisvalid \
             FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
             WHERE i.indrelid IN ('idempotency_requests'::regclass, \
                                  'outbox_events'::regclass, 'inbox_events'::regclass) \
             ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1), row.get(2)))
        .collect()
}

/// A database whose record lost version 6 while versions 7 to 9, which
/// took version 6's indexes under the old indexes' names, are recorded (a
/// hand-edited table, or a migrator that trailed the one that ran them):
/// migrating again builds none of version 6's indexes a second time.
async fn a_version_superseded_by_recorded_ones_is_not_built_again<F, Fut>(db: &TestDatabase, run: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<Summary, StoreError>>,
{
    let client = db.client().await;
    let migrated = index_list(&client).await;
    assert!(
        migrated
            .iter()
            .any(|(name, _, _)| name == "idempotency_requests_pkey"),
        "{migrated:?}"
    );
    client
        .batch_execute("DELETE FROM tower_idempotency_migrations WHERE version = 6")
        .await
        .unwrap();
    let summary = run().await.unwrap();
    assert_eq!(index_list(&client).await, migrated, "{summary:?}");
    assert!(summary.applied.is_empty(), "{summary:?}");
    assert_eq!(summary.superseded, [6], "{summary:?}");
    // The lost row is put back: the record says again what the schema is.
    assert_eq!(recorded(&client).await, released());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_superseded_by_recorded_ones_is_not_built_again_by_pg_store() {
    let db = TestDatabase::create().await;
    let store = PgStore::builder(db.config()).build().unwrap();
    store.migrate().await.unwrap();
    a_version_superseded_by_recorded_ones_is_not_built_again(&db, || {
        run_on(&store, MIGRATIONS, &SETTINGS)
    })
    .await;
}

#[cfg(feature = "sqlx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_superseded_by_recorded_ones_is_not_built_again_by_sqlx_store() {
    let db = TestDatabase::create().await;
    let store = crate::sqlx::SqlxStore::new(sqlx_pool(&db).await);
    store.migrate().await.unwrap();
    a_version_superseded_by_recorded_ones_is_not_built_again(&db, || {
        run_on(&store, MIGRATIONS, &SETTINGS)
    })
    .await;
}

/// How many migrators race, and how many fresh databases they race on.
const RACERS: usize = 4;
const RACES: usize = 10;

/// `RACERS` migrators at once on a fresh database, `RACES` times, with the
/// default settings (each `migrate()` of a store of its own, as instances
/// of a first deploy): every race leaves the indexes one migrator leaves. A
/// migrator that trails another through version 6's builds must not build
/// them again once versions 7 to 9 took them under the old names.
async fn racing_migrators_leave_one_migrators_indexes<F, Fut>(migrate: F)
where
    F: Fn(TestDatabase) -> Fut,
    Fut: std::future::Future<Output = TestDatabase>,
{
    let alone = migrate_alone().await;
    for race in 0..RACES {
        let db = migrate(TestDatabase::create().await).await;
        let client = db.client().await;
        assert_eq!(recorded(&client).await, released(), "race {race}");
        assert_eq!(index_list(&client).await, alone, "race {race}");
    }
}

/// The indexes one migrator leaves on a fresh database.
async fn migrate_alone() -> Vec<(String, String, bool)> {
    let db = TestDatabase::create().await;
    let store = PgStore::builder(db.config()).build().unwrap();
    store.migrate().await.unwrap();
    let list = index_list(&db.client().await).await;
    // Sanity: the pg_index rows the test compares are those the race
    // doubled (a second unique index beside each primary key).
    assert!(
        !list.iter().any(|(name, _, _)| name.ends_with("_bytewise")),
        "{list:?}"
    );
    list
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_migrators_leave_one_migrators_indexes_by_pg_store() {
    racing_migrators_leave_one_migrators_indexes(|db| async move {
        let runs: Vec<_> = (0..RACERS)
            .map(|_| {
                let store = PgStore::builder(db.config()).build().unwrap();
                tokio::spawn(async move { store.migrate().await })
            })
            .collect();
        for run in runs {
            run.await.unwrap().expect("every migrator succeeds");
        }
        db
    })
    .await;
}

#[cfg(feature = "sqlx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_migrators_leave_one_migrators_indexes_by_sqlx_store() {
    racing_migrators_leave_one_migrators_indexes(|db| async move {
        let mut stores = Vec::new();
        for _ in 0..RACERS {
            stores.push(crate::sqlx::SqlxStore::new(sqlx_pool(&db).await));
        }
        let runs: Vec<_> = stores
            .into_iter()
            .map(|store| tokio::spawn(async move { store.migrate().await }))
            .collect();
        for run in runs {
            run.await.unwrap().expect("every migrator succeeds");
        }
        db
    })
    .await;
}
