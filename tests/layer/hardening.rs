//! Nothing the handler or the application does leaves a pooled connection, a
//! key or a transaction in a wrong state, and every wait is bounded. Each test
//! names the hole it closes.

use crate::common;

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use common::{proxy::SlowProxy, *};
use http::StatusCode;
use tokio::sync::oneshot;
use tower::Layer;
use tower_idempotency::{
    postgres::{PgStore, PgTx, SessionReset, TxErrorKind},
    record::StoredResponse,
    sqlx::SqlxTx,
    store::{Claim, Store, StoreErrorKind},
};

/// Writes one order for tenant-a through the handle.
async fn insert_order(tx: &PgTx) -> Result<(), BoxError> {
    tx.execute(
        "INSERT INTO orders (id, tenant_id) VALUES ($1, 'tenant-a')",
        &[&new_order_id()],
    )
    .await?;
    Ok(())
}

/// A handler that writes one order, runs `sql` through the handle (ignoring
/// its result, as a careless handler would), and answers 201.
fn writes_then_runs(sql: &'static str) -> Handler {
    handler(move |tx: PgTx| async move {
        insert_order(&tx).await?;
        let _ = tx.batch_execute(sql).await;
        Ok(created("{}"))
    })
}

/// Reports what `sql` run through the handle answered, then answers 201.
fn reports(sql: &'static str) -> (Handler, oneshot::Receiver<Result<(), TxErrorKind>>) {
    let (report, seen) = Report::channel();
    let service = handler(move |tx: PgTx| {
        let report = report.clone();
        async move {
            insert_order(&tx).await?;
            report.send(tx.batch_execute(sql).await.map_err(|e| e.kind()));
            Ok(created("{}"))
        }
    });
    (service, seen)
}

fn orders_service(store: PgStore) -> TestService<PgStore> {
    layer(store).layer(order_handler::<Postgres>(Default::default()))
}

// 1. Connections the application borrows go back clean.

/// The application's own transaction fails and is never ended: with a pool
/// of one, every later claim would run into `25P02` on that connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn application_connection_left_in_a_failed_transaction_is_cleaned() {
    let pg = Postgres::with_pool(1).await;
    {
        let client = pg.store.client().await.unwrap();
        let failed = client.batch_execute("BEGIN; SELECT 1/0; COMMIT").await;
        assert!(failed.is_err(), "the batch stops at the division by zero");
    }
    let answer = send(orders_service(pg.store.clone()), tenant_a_post("k1")).await;
    assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
    assert_eq!(pg.orders().await.len(), 1);
    assert_eq!(pg.records().await[0].2, "completed");
}

/// The application's future is dropped between its `BEGIN` and `COMMIT`
/// (axum drops it when the client disconnects): its writes must not ride
/// along with the next request's commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn application_transaction_abandoned_mid_way_is_rolled_back() {
    let pg = Postgres::with_pool(1).await;
    let (began, began_rx) = oneshot::channel();
    let store = pg.store.clone();
    let abandoned = tokio::spawn(async move {
        let client = store.client().await.unwrap();
        client
            .batch_execute("BEGIN; INSERT INTO orders (id, tenant_id) VALUES ('stray', 'tenant-a')")
            .await
            .unwrap();
        let _ = began.send(());
        std::future::pending::<()>().await;
        drop(client);
    });
    began_rx.await.unwrap();
    abandoned.abort();
    let _ = abandoned.await;
    let answer = send(orders_service(pg.store.clone()), tenant_a_post("k1")).await;
    assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
    let orders = pg.orders().await;
    assert_eq!(orders.len(), 1, "{orders:?}");
    assert_ne!(orders[0].0, "stray", "the abandoned write was rolled back");
}

// 2. Transaction control cannot slip past the guard; orphans never block a key.

/// PostgreSQL ends a `--` comment at `\r` too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_behind_a_carriage_return_comment_is_refused() {
    let pg = Postgres::new().await;
    let (service, seen) = reports("--\rCOMMIT");
    let answer = send(layer(pg.store.clone()).layer(service), tenant_a_post("k1")).await;
    assert_eq!(seen.await.unwrap(), Err(TxErrorKind::TransactionControl));
    assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
    let records = pg.records().await;
    assert_eq!(records.len(), 1);
    assert_eq!(
        records[0].2, "completed",
        "the claim was never committed early"
    );
    assert_eq!(pg.orders().await.len(), 1);
}

/// A committed `in_progress` row (a crash of an older version, a manual
/// edit, a bypass) has no transaction behind it: the next request with its
/// key takes it over instead of being told "in progress" for the retention.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_in_progress_row_is_taken_over_not_waited_for() {
    let pg = Postgres::new().await;
    pg.exec(
        "INSERT INTO idempotency_requests (tenant_id, endpoint, idempotency_key, request_fingerprint, state, expires_at) \
         VALUES ('tenant-a', 'POST /orders v1', 'k1', '\\x00', 'in_progress', now() + interval '1 day')",
    )
    .await;
    let answer = send(
        layer(pg.store.clone())
            .wait(WAIT_SHORT)
            .layer(order_handler::<Postgres>(Default::default())),
        tenant_a_post("k1"),
    )
    .await;
    assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
    let row = pg
        .row("SELECT state, attempt_token FROM idempotency_requests")
        .await;
    assert_eq!(row.get::<_, &str>(0), "completed");
    // Tokens come from one sequence that every claim draws from (a
    // conflicting insert too): larger, not necessarily next.
    assert!(row.get::<_, i64>(1) > 1, "taken over as a new attempt");
    assert_eq!(pg.orders().await.len(), 1);
}

// 3. The completion's COMMIT never goes out when its UPDATE could not.

/// A response bigger than PostgreSQL's protocol can carry fails to encode on
/// the client: the pipelined COMMIT must not be sent without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_that_cannot_be_encoded_commits_nothing() {
    let pg = Postgres::new().await;
    let tx = pg
        .own(&claim_request("huge", Duration::from_secs(5)), "owner")
        .await;
    tx.execute("INSERT INTO orders (id, tenant_id) VALUES ('o1', 't')", &[])
        .await
        .unwrap();
    let huge = StoredResponse {
        status: StatusCode::OK,
        headers: vec![],
        body: Bytes::from(vec![0u8; i32::MAX as usize + 1]),
        resource_id: None,
        trailers: Vec::new(),
        trace_id: None,
        span_id: None,
    };
    let error = pg.store.complete(tx, &huge).await.unwrap_err();
    assert_ne!(error.kind(), StoreErrorKind::Unavailable, "{error}");
    assert!(pg.orders().await.is_empty(), "the order was not committed");
    assert!(pg.records().await.is_empty(), "no claim row was committed");
}

// 4. Session state does not outlive the request on a pooled connection.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_level_statements_are_refused() {
    for sql in [
        "DEALLOCATE ALL",
        "PREPARE q AS SELECT 1",
        "LISTEN channel",
        "DISCARD ALL",
        "SELECT set_config('search_path', 'nowhere', false)",
        "SELECT pg_advisory_lock(42)",
        "CREATE TEMP TABLE scratch (x int)",
        "DECLARE c CURSOR WITH HOLD FOR SELECT 1",
    ] {
        let pg = Postgres::with_pool(1).await;
        let (service, seen) = reports(sql);
        let first = send(layer(pg.store.clone()).layer(service), tenant_a_post("k1")).await;
        assert_eq!(seen.await.unwrap(), Err(TxErrorKind::SessionState), "{sql}");
        assert_eq!(first.status, StatusCode::CREATED, "{sql}");
        let second = send(orders_service(pg.store.clone()), tenant_a_post("k2")).await;
        assert_eq!(
            second.status,
            StatusCode::CREATED,
            "{sql}: {:?}",
            second.body
        );
    }
}

/// What no lexer can see (a function that changes the session) is reset
/// before the connection serves anyone else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_changes_hidden_in_functions_do_not_outlive_the_request() {
    let pg = Postgres::with_pool(1).await;
    pg.exec(
        "CREATE FUNCTION wander() RETURNS text LANGUAGE sql AS \
             $$ SELECT set_config('search_path', 'nowhere', false) $$; \
         CREATE FUNCTION hold_lock() RETURNS void LANGUAGE sql AS \
             $$ SELECT pg_advisory_lock(42) $$; \
         CREATE FUNCTION scratch() RETURNS void LANGUAGE plpgsql AS \
             $$ BEGIN EXECUTE 'CREATE TEMP TABLE scratch (x int)'; END $$;",
    )
    .await;
    // A temporary table made where the guard cannot see it is gone before
    // the connection serves anyone else (the reset discards the session's
    // temporary objects when it has a temporary schema).
    let scratching = layer(pg.store.clone()).layer(writes_then_runs("SELECT scratch()"));
    let made = send(scratching, tenant_a_post("k0")).await;
    assert_eq!(made.status, StatusCode::CREATED, "{:?}", made.body);
    let client = pg.store.client().await.unwrap();
    let row = client
        .query_one(
            "SELECT pg_my_temp_schema() <> 0, \
                 (SELECT count(*) FROM pg_class WHERE relnamespace = pg_my_temp_schema())",
            &[],
        )
        .await
        .unwrap();
    assert!(
        row.get::<_, bool>(0),
        "the session has its temporary schema"
    );
    assert_eq!(row.get::<_, i64>(1), 0, "and nothing left in it");
    drop(client);
    let locking = layer(pg.store.clone()).layer(writes_then_runs("SELECT hold_lock()"));
    let first = send(locking, tenant_a_post("k1")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let free: bool = pg.value("SELECT pg_try_advisory_lock(42)").await;
    assert!(free, "the session advisory lock was released");
    // A search_path changed inside the transaction hides the key table from
    // the completion itself: the request fails whole, nothing is committed.
    let wandering = layer(pg.store.clone()).layer(writes_then_runs("SELECT wander()"));
    let second = send(wandering, tenant_a_post("k2")).await;
    assert_eq!(second.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(second.json()["code"], "commit_rejected");
    assert_eq!(pg.orders().await.len(), 2);
    // The next request on the same (only) connection sees the default again.
    let third = send(orders_service(pg.store.clone()), tenant_a_post("k2")).await;
    assert_eq!(third.status, StatusCode::CREATED, "{:?}", third.body);
    assert_eq!(pg.orders().await.len(), 3);
}

/// A handler that writes one order, leaves `x.mark = mark` on its session
/// through a function (where the guard cannot see it), and answers
/// `status`: a 201 commits, a 500 rolls back.
fn marks_then_answers(mark: &'static str, status: StatusCode) -> Handler {
    handler(move |tx: PgTx| async move {
        insert_order(&tx).await?;
        tx.query_one("SELECT mark($1)", &[&mark]).await?;
        Ok(response(status, "{}"))
    })
}

/// `SessionReset::TrustedHandlers` skips the reset after an owner's
/// transaction that committed, and only then: what a function left on the
/// session stays for the next request on the connection (the documented
/// cost of a false assertion), while after a rollback the reset still
/// runs. The default resets after both. In both modes, on a pool of one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trusted_handlers_skip_the_reset_after_a_commit_and_only_then() {
    const MARK: &str = "SELECT pg_backend_pid(), coalesce(current_setting('x.mark', true), '')";
    for (reset, kept) in [
        (SessionReset::Always, false),
        (SessionReset::TrustedHandlers, true),
    ] {
        let pg = Postgres::with_store(|b| b.max_connections(1).session_reset(reset)).await;
        pg.exec(
            "CREATE FUNCTION mark(v text) RETURNS text LANGUAGE sql AS \
                 $$ SELECT set_config('x.mark', v, false) $$",
        )
        .await;
        let (pid, _) = on_a_borrowed_connection(&pg.store, MARK).await;
        for one_commit in [false, true] {
            let send_with = |handler: Handler, key: &str| {
                let layer = layer(pg.store.clone());
                let request = tenant_a_post(key);
                async move {
                    if one_commit {
                        send(layer.claim_at_commit().layer(handler), request).await
                    } else {
                        send(layer.layer(handler), request).await
                    }
                }
            };
            let committed_key = format!("committed-{one_commit}");
            let answer = send_with(
                marks_then_answers("committed", StatusCode::CREATED),
                &committed_key,
            )
            .await;
            assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
            let (seen_pid, mark) = on_a_borrowed_connection(&pg.store, MARK).await;
            assert_eq!(seen_pid, pid, "the pool's one connection");
            assert_eq!(
                mark == "committed",
                kept,
                "{reset:?}, one-commit {one_commit}: after a commit the mark is {mark:?}"
            );
            // The borrowed connection went back reset: the mark is gone
            // before the rollback's request runs.
            let rolled_back_key = format!("rolled-back-{one_commit}");
            let answer = send_with(
                marks_then_answers("rolled back", StatusCode::INTERNAL_SERVER_ERROR),
                &rolled_back_key,
            )
            .await;
            assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
            assert_eq!(
                on_a_borrowed_connection(&pg.store, MARK).await,
                (pid, String::new()),
                "{reset:?}, one-commit {one_commit}: a rollback is always followed by the reset"
            );
        }
        // What committed is all there is: two completed keys, two orders.
        assert_eq!(pg.orders().await.len(), 2, "{reset:?}");
        let records = pg.records().await;
        assert_eq!(
            records
                .iter()
                .map(|(_, key, state, status)| (key.as_str(), state.as_str(), *status))
                .collect::<Vec<_>>(),
            [
                ("committed-false", "completed", Some(201)),
                ("committed-true", "completed", Some(201)),
            ],
            "{reset:?}"
        );
    }
}

/// A handler that writes one order and reports its backend's process id
/// and its transaction's isolation level.
fn reports_isolation() -> Handler {
    handler(|tx: PgTx| async move {
        let row = tx
            .query_one(
                "SELECT pg_backend_pid(), current_setting('transaction_isolation')",
                &[],
            )
            .await?;
        let (pid, level): (i32, String) = (row.get(0), row.get(1));
        insert_order(&tx).await?;
        Ok(created(
            serde_json::json!({ "pid": pid, "level": level }).to_string(),
        ))
    })
}

/// Owners' transactions begin with a plain `BEGIN` only while every
/// connection the store opened starts at READ COMMITTED: once the database
/// default changes, the next connection the store opens sees it, and every
/// transaction names its level again. Each owner runs at READ COMMITTED
/// throughout, on the old connection and the new one, in both modes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owners_run_at_read_committed_when_the_database_default_changes() {
    let pg = Postgres::with_pool(2).await;
    let mut keys = 0;
    let mut pids = std::collections::BTreeSet::new();
    let mut run = |one_commit: bool| {
        keys += 1;
        let key = format!("k{keys}");
        let layer = layer(pg.store.clone());
        async move {
            let answer = if one_commit {
                send(
                    layer.claim_at_commit().layer(reports_isolation()),
                    tenant_a_post(&key),
                )
                .await
            } else {
                send(layer.layer(reports_isolation()), tenant_a_post(&key)).await
            };
            assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
            let seen = answer.json();
            assert_eq!(seen["level"], "read committed", "one-commit {one_commit}");
            seen["pid"].as_i64().unwrap()
        }
    };
    pids.insert(run(false).await);
    pids.insert(run(true).await);
    set_database_default(
        &pg.client,
        &pg.db,
        "default_transaction_isolation",
        "serializable",
    )
    .await;
    {
        // The connection the store has is busy: the next owner gets a new
        // one, which starts at the new default.
        let held = pg.store.client().await.unwrap();
        let held_pid: i32 = held
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        let new_pid = run(false).await;
        assert_ne!(i64::from(held_pid), new_pid, "a second connection");
        let new_default: String = held
            .query_one(
                "SELECT current_setting('default_transaction_isolation')",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(
            new_default, "read committed",
            "the old session keeps its default"
        );
        pids.insert(new_pid);
    }
    for one_commit in [false, true, false, true] {
        pids.insert(run(one_commit).await);
    }
    assert_eq!(pids.len(), 2, "both connections served owners");
    assert_eq!(pg.orders().await.len(), keys);
    assert_eq!(
        pg.count("SELECT count(*) FROM idempotency_requests WHERE state = 'completed'")
            .await,
        keys as i64
    );
}

/// What `sql` (one row of the backend's process id and one text) reads on
/// a connection the application borrows from `store`.
async fn on_a_borrowed_connection(store: &PgStore, sql: &str) -> (i32, String) {
    let client = store.client().await.unwrap();
    let row = client.query_one(sql, &[]).await.unwrap();
    (row.get(0), row.get(1))
}

/// The session's idle limit, with its process id.
const IDLE_LIMIT: &str =
    "SELECT pg_backend_pid(), current_setting('idle_in_transaction_session_timeout')";

/// A handler that reports its session (backend process id) and the idle
/// limit its transaction runs under, writes one order, then calls
/// `unlimit()`, a function that takes the session's idle limit away where
/// the guard cannot see it.
fn reports_hold_limit_then_unlimits() -> Handler {
    handler(|tx: PgTx| async move {
        let row = tx.query_one(IDLE_LIMIT, &[]).await?;
        let (pid, limit): (i32, String) = (row.get(0), row.get(1));
        insert_order(&tx).await?;
        tx.query_one("SELECT unlimit()", &[]).await?;
        Ok(created(
            serde_json::json!({ "pid": pid, "limit": limit }).to_string(),
        ))
    })
}

/// The hold limit is the session's: every connection the store opens
/// carries it (35 s, the default handler timeout's), an owner with the
/// default handler timeout runs under it, one with another timeout under
/// its own, and a function that took it away is undone before the
/// connection serves anyone else. In both modes, on a pool of one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hold_limit_is_the_sessions_whatever_a_function_did_to_it() {
    let pg = Postgres::with_pool(1).await;
    pg.exec(
        "CREATE FUNCTION unlimit() RETURNS text LANGUAGE sql AS \
             $$ SELECT set_config('idle_in_transaction_session_timeout', '0', false) $$",
    )
    .await;
    let (pid, limit) = on_a_borrowed_connection(&pg.store, IDLE_LIMIT).await;
    assert_eq!(limit, "35s", "a new connection carries the hold limit");

    let mut keys = 0;
    for one_commit in [false, true] {
        for (timeout, expected) in [(None, "35s"), (Some(10), "15s"), (None, "35s")] {
            let mut layer = layer(pg.store.clone());
            if let Some(secs) = timeout {
                layer = layer.handler_timeout(Duration::from_secs(secs));
            }
            keys += 1;
            let key = format!("k{keys}");
            let answer = if one_commit {
                let service = layer
                    .claim_at_commit()
                    .layer(reports_hold_limit_then_unlimits());
                send(service, tenant_a_post(&key)).await
            } else {
                send(
                    layer.layer(reports_hold_limit_then_unlimits()),
                    tenant_a_post(&key),
                )
                .await
            };
            assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
            let seen = answer.json();
            assert_eq!(seen["pid"], pid, "the pool's one connection");
            assert_eq!(
                seen["limit"], expected,
                "one-commit {one_commit}, handler timeout {timeout:?}"
            );
            // unlimit() set the session's limit to 0 in the handler's
            // transaction, which committed: the reset behind it set it back.
            assert_eq!(
                on_a_borrowed_connection(&pg.store, IDLE_LIMIT).await,
                (pid, "35s".to_owned())
            );
        }
    }
    assert_eq!(pg.orders().await.len(), keys);
    assert_eq!(
        pg.count("SELECT count(*) FROM idempotency_requests WHERE state = 'completed'")
            .await,
        keys as i64
    );
}

/// The session's idle limit and where it came from (`client`: asked for
/// in the startup packet; `session`: a `SET`), with its process id.
const IDLE_LIMIT_SOURCE: &str = "SELECT pg_backend_pid(), setting || ' ' || source \
     FROM pg_settings WHERE name = 'idle_in_transaction_session_timeout'";

/// A connection the store opens asks for the hold limit as it starts, so
/// the limit is the session's own default: what a function did to it is
/// undone by the reset's `RESET ALL`, with no setting sent again, and the
/// session still has it from its start afterwards. In both modes, on a
/// pool of one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hold_limit_comes_with_the_connection() {
    let pg = Postgres::with_pool(1).await;
    pg.exec(
        "CREATE FUNCTION unlimit() RETURNS text LANGUAGE sql AS \
             $$ SELECT set_config('idle_in_transaction_session_timeout', '0', false) $$",
    )
    .await;
    let (pid, seen) = on_a_borrowed_connection(&pg.store, IDLE_LIMIT_SOURCE).await;
    assert_eq!(seen, "35000 client", "asked for as the connection started");
    for (i, one_commit) in [false, true].into_iter().enumerate() {
        let layer = layer(pg.store.clone());
        let key = format!("k{i}");
        let answer = if one_commit {
            let service = layer
                .claim_at_commit()
                .layer(reports_hold_limit_then_unlimits());
            send(service, tenant_a_post(&key)).await
        } else {
            send(
                layer.layer(reports_hold_limit_then_unlimits()),
                tenant_a_post(&key),
            )
            .await
        };
        assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
        assert_eq!(answer.json()["limit"], "35s", "one-commit {one_commit}");
        assert_eq!(
            on_a_borrowed_connection(&pg.store, IDLE_LIMIT_SOURCE).await,
            (pid, "35000 client".to_owned()),
            "one-commit {one_commit}: back to the session's start"
        );
    }
    assert_eq!(pg.orders().await.len(), 2);
}

/// A store on a pool of its own leaves the sessions as they are: every
/// owner sets its hold limit for its own transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_pool_of_your_own_each_owner_sets_its_hold_limit() {
    let db = tower_idempotency::testing::TestDatabase::create().await;
    let manager = deadpool_postgres::Manager::new(db.config(), tokio_postgres::NoTls);
    let pool = deadpool_postgres::Pool::builder(manager)
        .max_size(1)
        .build()
        .unwrap();
    let store = PgStore::builder(db.config()).pool(pool).build().unwrap();
    store.migrate().await.unwrap();
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE orders (id text PRIMARY KEY, tenant_id text NOT NULL); \
             CREATE FUNCTION unlimit() RETURNS text LANGUAGE sql AS \
             $$ SELECT set_config('idle_in_transaction_session_timeout', '0', false) $$",
        )
        .await
        .unwrap();
    assert_eq!(
        on_a_borrowed_connection(&store, IDLE_LIMIT).await.1,
        "0",
        "the server's default"
    );
    let answer = send(
        layer(store.clone()).layer(reports_hold_limit_then_unlimits()),
        tenant_a_post("k1"),
    )
    .await;
    assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
    assert_eq!(answer.json()["limit"], "35s", "set for the transaction");
    assert_eq!(on_a_borrowed_connection(&store, IDLE_LIMIT).await.1, "0");
}

/// Statements that change the session in ways the guard used to miss, each
/// with what the handler runs after it (its result ignored): an UPDATE of
/// the pg_settings view (its rule calls `set_config(…, false)`), the same
/// call in a `DO` block, in a function created and called in one text, in
/// SQL text that `query_to_xml` runs; and a search_path naming pg_temp, which
/// makes the next unqualified CREATE TABLE a temporary table that lives as
/// long as the session (and hides a permanent table of the same name).
const SESSION_CHANGES: [(&str, Option<&str>); 5] = [
    (
        "UPDATE pg_settings SET setting = '1234kB' WHERE name = 'work_mem'",
        None,
    ),
    (
        "DO $$ BEGIN PERFORM set_config('work_mem', '2345kB', false); END $$",
        None,
    ),
    (
        "CREATE FUNCTION wander() RETURNS text LANGUAGE sql AS \
             $$ SELECT set_config('work_mem', '3456kB', false) $$; \
         SELECT wander()",
        None,
    ),
    (
        "SELECT query_to_xml('SELECT set_config(''work_mem'', ''4567kB'', false)', true, false, '')",
        None,
    ),
    (
        // pg_temp alone would hide the key table from the completion, which
        // then fails and rolls the table back; with public after it, the
        // request commits and the table stays.
        "SET LOCAL search_path = pg_temp, public",
        Some("CREATE TABLE scratch (x int)"),
    ),
];

/// What a transaction sees of its session: the backend's process id,
/// work_mem, search_path, and how many temporary relations it has.
type Session = (i32, String, String, i64);

const SESSION: &str = "SELECT pg_backend_pid(), current_setting('work_mem'), \
     current_setting('search_path'), \
     (SELECT count(*) FROM pg_class WHERE relnamespace = pg_my_temp_schema())";

/// What a leaking handler reports: whether the guard refused the statement,
/// and the session before it and at the end of the handler.
type Leaked = (bool, Session, Session);

/// Checks one case: refused, nothing changed in the request's transaction,
/// and the next transaction on the same connection finds the session as the
/// first one did. The problems found, for one report over all cases.
fn check_session_case(sql: &str, leaked: Leaked, next: Session, problems: &mut Vec<String>) {
    let (refused, before, after) = leaked;
    if !refused {
        problems.push(format!("not refused: {sql}"));
    }
    if after != before {
        problems.push(format!(
            "{sql}: in its transaction {before:?} became {after:?}"
        ));
    }
    if next.0 != before.0 {
        problems.push(format!("{sql}: the next request got another connection"));
    } else if next != before {
        problems.push(format!(
            "{sql}: the next request on the connection found {next:?}, not {before:?}"
        ));
    }
}

/// With `transaction_pooling(true)` the store sends no session reset (it
/// would reach another server connection behind a pooler), so the guard is
/// all that stands between a handler's session change and the next request
/// on the connection. A pool of one, reached directly: the next request
/// surely gets the same server session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_changes_through_pg_settings_bodies_and_pg_temp_are_refused_in_pooling_mode() {
    let pg =
        Postgres::with_store(|builder| builder.max_connections(1).transaction_pooling(true)).await;
    let mut problems = Vec::new();
    for (i, (sql, then)) in SESSION_CHANGES.into_iter().enumerate() {
        let (report, seen) = Report::channel();
        let leaking = handler(move |tx: PgTx| {
            let report = report.clone();
            async move {
                insert_order(&tx).await?;
                let session = |row: tokio_postgres::Row| -> Session {
                    (row.get(0), row.get(1), row.get(2), row.get(3))
                };
                let before = session(tx.query_one(SESSION, &[]).await?);
                let refused = tx.batch_execute(sql).await.map_err(|e| e.kind())
                    == Err(TxErrorKind::SessionState);
                if let Some(then) = then {
                    let _ = tx.batch_execute(then).await;
                }
                let after = session(tx.query_one(SESSION, &[]).await?);
                report.send((refused, before, after));
                Ok(created("{}"))
            }
        });
        let first = send(
            layer(pg.store.clone()).layer(leaking),
            tenant_a_post(&format!("a{i}")),
        )
        .await;
        if first.status != StatusCode::CREATED {
            problems.push(format!("{sql}: answered {:?}", first.body));
            continue;
        }
        let leaked = seen.await.unwrap();

        let (report, seen) = Report::channel();
        let looking = handler(move |tx: PgTx| {
            let report = report.clone();
            async move {
                let row = tx.query_one(SESSION, &[]).await?;
                report.send((row.get(0), row.get(1), row.get(2), row.get(3)));
                Ok(created("{}"))
            }
        });
        let second = send(
            layer(pg.store.clone()).layer(looking),
            tenant_a_post(&format!("b{i}")),
        )
        .await;
        assert_eq!(
            second.status,
            StatusCode::CREATED,
            "{sql}: {:?}",
            second.body
        );
        check_session_case(sql, leaked, seen.await.unwrap(), &mut problems);
    }
    assert!(problems.is_empty(), "{problems:#?}");
    assert_eq!(pg.orders().await.len(), SESSION_CHANGES.len());
}

/// The same with `SqlxStore`, whose guarded connection uses the same guard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_changes_through_pg_settings_bodies_and_pg_temp_are_refused_in_pooling_mode_sqlx() {
    use sqlx::Executor as _;
    let backend = Sqlx::with_pool(1).await;
    let store = backend.store.clone().transaction_pooling(true);
    let mut problems = Vec::new();
    for (i, (sql, then)) in SESSION_CHANGES.into_iter().enumerate() {
        let (report, seen) = Report::channel();
        let leaking = sqlx_service(move |tx: SqlxTx| {
            let report = report.clone();
            async move {
                let mut conn = tx.conn().await?;
                sqlx::query("INSERT INTO orders (id, tenant_id) VALUES ($1, 'tenant-a')")
                    .bind(new_order_id())
                    .persistent(false)
                    .execute(&mut *conn)
                    .await?;
                let before: Session = sqlx::query_as(SESSION)
                    .persistent(false)
                    .fetch_one(&mut *conn)
                    .await?;
                let refused = matches!(
                    (&mut *conn).execute(sql).await,
                    Err(sqlx::Error::InvalidArgument(ref m)) if m.contains("idempotency")
                );
                if let Some(then) = then {
                    let _ = (&mut *conn).execute(then).await;
                }
                let after: Session = sqlx::query_as(SESSION)
                    .persistent(false)
                    .fetch_one(&mut *conn)
                    .await?;
                report.send((refused, before, after));
                Ok(created("{}"))
            }
        });
        let first = send(
            layer(store.clone()).layer(leaking),
            tenant_a_post(&format!("a{i}")),
        )
        .await;
        if first.status != StatusCode::CREATED {
            problems.push(format!("{sql}: answered {:?}", first.body));
            continue;
        }
        let leaked = seen.await.unwrap();

        let (report, seen) = Report::channel();
        let looking = sqlx_service(move |tx: SqlxTx| {
            let report = report.clone();
            async move {
                let mut conn = tx.conn().await?;
                let session: Session = sqlx::query_as(SESSION)
                    .persistent(false)
                    .fetch_one(&mut *conn)
                    .await?;
                report.send(session);
                Ok(created("{}"))
            }
        });
        let second = send(
            layer(store.clone()).layer(looking),
            tenant_a_post(&format!("b{i}")),
        )
        .await;
        assert_eq!(
            second.status,
            StatusCode::CREATED,
            "{sql}: {:?}",
            second.body
        );
        check_session_case(sql, leaked, seen.await.unwrap(), &mut problems);
    }
    assert!(problems.is_empty(), "{problems:#?}");
    assert_eq!(backend.orders().await.len(), SESSION_CHANGES.len());
}

/// The layer's service around a handler that runs `f` on the `SqlxTx` the
/// layer passes.
fn sqlx_service<F, Fut>(f: F) -> Handler
where
    F: Fn(SqlxTx) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<http::Response<http_body_util::Full<Bytes>>, BoxError>>
        + Send
        + 'static,
{
    tower::util::BoxCloneService::new(tower::service_fn(
        move |request: http::Request<tower_idempotency::RequestBody>| {
            let tx = request.extensions().get::<SqlxTx>().cloned();
            let f = f.clone();
            async move { f(tx.ok_or("the layer passes a SqlxTx")?).await }
        },
    ))
}

/// A connection whose cached statements were destroyed behind the layer's
/// back (here by the application's own connection) is replaced, not reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_that_lost_its_prepared_statements_is_replaced() {
    let pg = Postgres::with_pool(1).await;
    let service = orders_service(pg.store.clone());
    assert_eq!(
        send(service.clone(), tenant_a_post("k1")).await.status,
        StatusCode::CREATED
    );
    {
        let client = pg.store.client().await.unwrap();
        client.batch_execute("DEALLOCATE ALL").await.unwrap();
    }
    let answer = send(service, tenant_a_post("k2")).await;
    assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
    assert_eq!(pg.orders().await.len(), 2);
}

/// The session reset is sent where code other than the store's reached the
/// session, and only there: an owner's transaction and a borrowed
/// connection are reset; a replay read from the table (a claim that found
/// the record, rolled back) ran nothing but the store's own statements, and
/// its connection goes back without one. The calls are counted by a
/// wrapper around the reset function, on a pool of one, in both modes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_sessions_that_ran_other_code_are_reset() {
    let pg = Postgres::with_pool(1).await;
    pg.exec(
        "CREATE TABLE reset_calls (at timestamptz NOT NULL DEFAULT clock_timestamp()); \
         ALTER FUNCTION tower_idempotency_session_reset(text, text) RENAME TO counted_reset; \
         CREATE FUNCTION tower_idempotency_session_reset(hold_limit text, login text) \
             RETURNS void LANGUAGE plpgsql AS $$ BEGIN \
                 INSERT INTO reset_calls DEFAULT VALUES; \
                 PERFORM counted_reset(hold_limit, login); \
             END $$;",
    )
    .await;
    let resets = || pg.count("SELECT count(*) FROM reset_calls");
    let service = layer(pg.store.clone())
        .without_replay_cache()
        .layer(order_handler::<Postgres>(Default::default()));
    let first = send(service.clone(), tenant_a_post("k1")).await;
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
    assert_eq!(resets().await, 1, "the owner's transaction");

    for _ in 0..3 {
        let replay = send(service.clone(), tenant_a_post("k1")).await;
        assert!(replay.replayed(), "{:?}", replay.headers);
        assert_eq!(replay.body, first.body);
    }
    // The pool's one connection: this owner's claim waits for the last
    // replay's rollback to give it back.
    let second = send(service.clone(), tenant_a_post("k2")).await;
    assert_eq!(second.status, StatusCode::CREATED, "{:?}", second.body);
    assert_eq!(resets().await, 2, "no reset behind the replays' rollbacks");

    let one_commit = layer(pg.store.clone())
        .without_replay_cache()
        .claim_at_commit()
        .layer(order_handler::<Postgres>(Default::default()));
    let third = send(one_commit.clone(), tenant_a_post("k3")).await;
    assert_eq!(third.status, StatusCode::CREATED, "{:?}", third.body);
    assert_eq!(resets().await, 3, "the one-commit owner's transaction");
    // A retry the one-commit mode cannot answer before running the owner:
    // the owner ran (its order rolled back), so its session is reset.
    let retry = send(one_commit, tenant_a_post("k3")).await;
    assert!(retry.replayed(), "{:?}", retry.headers);
    assert_eq!(retry.body, third.body);
    assert_eq!(resets().await, 4, "the owner that lost at commit");

    {
        let client = pg.store.client().await.unwrap();
        client.batch_execute("SELECT 1").await.unwrap();
    }
    let fourth = send(service, tenant_a_post("k4")).await;
    assert_eq!(fourth.status, StatusCode::CREATED, "{:?}", fourth.body);
    assert_eq!(resets().await, 6, "a borrowed connection, then the owner");

    assert_eq!(pg.orders().await.len(), 4);
    assert_eq!(
        pg.count("SELECT count(*) FROM idempotency_requests WHERE state = 'completed'")
            .await,
        4
    );
}
// 5. A commit that fails for good is not "the database is down".

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deferred_constraint_failing_at_commit_is_a_final_error_not_unavailable() {
    let pg = Postgres::new().await;
    pg.exec(
        "CREATE TABLE shipments (order_id text, UNIQUE (order_id) DEFERRABLE INITIALLY DEFERRED)",
    )
    .await;
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let service = layer(pg.store.clone()).layer(handler({
        let calls = calls.clone();
        move |tx: PgTx| {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async move {
                insert_order(&tx).await?;
                tx.execute("INSERT INTO shipments VALUES ('o1'), ('o1')", &[])
                    .await?;
                Ok(created("{}"))
            }
        }
    }));
    let answer = send(service, tenant_a_post("k1")).await;
    assert_eq!(answer.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(answer.json()["code"], "commit_rejected");
    assert!(
        answer.headers.get("retry-after").is_none(),
        "a retry would fail the same way"
    );
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert!(pg.orders().await.is_empty());
    assert!(pg.records().await.is_empty(), "the key is free");
}

/// The connection dies while `COMMIT` runs: nobody knows whether it
/// committed, and the answer says so (503: the retry finds out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_lost_during_commit_is_reported_as_unknown() {
    let pg = Postgres::with_pool(1).await;
    // A deferred constraint trigger runs inside COMMIT; this one ends its
    // own session there.
    pg.exec(
        "CREATE TABLE doomed (x int); \
         CREATE FUNCTION die() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN PERFORM pg_terminate_backend(pg_backend_pid()); PERFORM pg_sleep(5); RETURN NULL; END $$; \
         CREATE CONSTRAINT TRIGGER die_at_commit AFTER INSERT ON doomed \
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION die();",
    )
    .await;
    let service = layer(pg.store.clone()).layer(writes_then_runs("INSERT INTO doomed VALUES (1)"));
    let answer = send(service, tenant_a_post("k1")).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.json()["code"], "store_unavailable");
    assert_eq!(answer.headers["retry-after"], "1");
    let detail = answer.json()["detail"].as_str().unwrap().to_owned();
    assert!(detail.contains("unknown"), "{detail}");
    assert!(
        pg.orders().await.is_empty(),
        "the server died before committing"
    );
    let retry = send(orders_service(pg.store.clone()), tenant_a_post("k1")).await;
    assert_eq!(
        retry.status,
        StatusCode::CREATED,
        "the retry finds the key free"
    );
}

// 6. A slow store is bounded by the wait and reported as unavailable.

/// No lock anywhere, just a slow database: the request is answered within
/// about its wait, as `store_unavailable`, not `idempotency_in_progress`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_database_is_unavailable_within_the_wait() {
    let pg = Postgres::new().await;
    let proxy = SlowProxy::start(pg.db.config()).await;
    let store = PgStore::builder(proxy.config()).build().unwrap();
    let service = layer(store)
        .wait(Duration::from_secs(1))
        .layer(order_handler::<Postgres>(Default::default()));
    assert_eq!(
        send(service.clone(), tenant_a_post("warm")).await.status,
        StatusCode::CREATED
    );
    proxy.set_delay(Duration::from_secs(6));
    let started = std::time::Instant::now();
    let answer = send(service.clone(), tenant_a_post("never-seen")).await;
    let took = started.elapsed();
    assert_eq!(
        answer.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{:?}",
        answer.body
    );
    assert_eq!(answer.json()["code"], "store_unavailable");
    assert!(took < Duration::from_secs(4), "answered after {took:?}");
    proxy.set_delay(Duration::ZERO);
    let retry = send(service, tenant_a_post("never-seen")).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert_eq!(pg.orders().await.len(), 2);
}

/// A claim statement that is slow for no lock (a trigger sleeping) is not
/// bounded by `lock_timeout`: the wait still bounds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_claim_statement_is_bounded_by_the_wait() {
    let pg = Postgres::new().await;
    pg.exec(
        "CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN PERFORM pg_sleep(3); RETURN NEW; END $$; \
         CREATE TRIGGER slow BEFORE INSERT ON idempotency_requests FOR EACH ROW EXECUTE FUNCTION slow();",
    )
    .await;
    let service = layer(pg.store.clone())
        .wait(Duration::from_millis(300))
        .layer(order_handler::<Postgres>(Default::default()));
    let started = std::time::Instant::now();
    let answer = send(service.clone(), tenant_a_post("k1")).await;
    let took = started.elapsed();
    assert_eq!(
        answer.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{:?}",
        answer.body
    );
    assert_eq!(answer.json()["code"], "store_unavailable");
    assert!(took < Duration::from_secs(2), "answered after {took:?}");
    // DROP TRIGGER waits for the slow statement's transaction to end.
    pg.exec("DROP TRIGGER slow ON idempotency_requests").await;
    let retry = send(service, tenant_a_post("k1")).await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert_eq!(pg.orders().await.len(), 1);
}

// 7. Nothing after the claim runs unbounded.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_that_never_returns_is_rolled_back_at_its_deadline() {
    let pg = Postgres::with_pool(1).await;
    let hanging = layer(pg.store.clone())
        .handler_timeout(Duration::from_millis(300))
        .layer(handler(|tx: PgTx| async move {
            tx.execute(
                "INSERT INTO orders (id, tenant_id) VALUES ('hung', 'tenant-a')",
                &[],
            )
            .await?;
            std::future::pending::<()>().await;
            Ok(created("{}"))
        }));
    let drained = layer(pg.store.clone());
    let answer = send(hanging.clone(), tenant_a_post("k1")).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.json()["code"], "handler_timeout");
    assert_eq!(answer.headers["retry-after"], "1");
    assert!(pg.orders().await.is_empty());
    assert!(pg.records().await.is_empty(), "the key is free");
    assert_eq!(pg.idle_in_transaction().await, 0);
    tokio::time::timeout(Duration::from_secs(10), drained.drained())
        .await
        .expect("no owned work is left running");
    let retry = send(orders_service(pg.store.clone()), tenant_a_post("k1")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
}

/// A handler stuck inside a statement: the statement is cancelled, so the
/// row lock and the connection come back at the deadline, not when the
/// statement would have ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_stuck_in_a_statement_is_cancelled_at_its_deadline() {
    let pg = Postgres::with_pool(1).await;
    let started = std::time::Instant::now();
    let answer = send(
        layer(pg.store.clone())
            .handler_timeout(Duration::from_millis(300))
            .layer(writes_then_runs("SELECT pg_sleep(30)")),
        tenant_a_post("k1"),
    )
    .await;
    assert_eq!(answer.json()["code"], "handler_timeout");
    let retry = send(orders_service(pg.store.clone()), tenant_a_post("k1")).await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    let sleeping = pg
        .count("SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep(30)%'")
        .await;
    assert_eq!(sleeping, 0);
    assert_eq!(pg.orders().await.len(), 1);
}

/// A process that froze while owning a key (no deadline of its own can
/// fire) is ended by the server: the key is free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_owner_is_ended_by_the_server() {
    let pg = Postgres::new().await;
    let frozen =
        claim_request("k", Duration::from_secs(5)).with_hold_limit(Duration::from_millis(300));
    let owner = pg.own(&frozen, "owner").await;
    let setting: String = owner
        .query_one(
            "SELECT current_setting('idle_in_transaction_session_timeout')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(setting, "300ms");
    // The owner does nothing more. A second claim waits on the key's row
    // lock until the server ends the idle owner's session.
    let next = pg
        .store
        .claim(&claim_request("k", Duration::from_secs(20)))
        .await
        .unwrap();
    let Claim::Owned(next) = next else {
        panic!("the key was freed by the server: {next:?}")
    };
    pg.store.complete(next, &stored(b"second")).await.unwrap();
    assert!(pg.store.complete(owner, &stored(b"first")).await.is_err());
    assert_eq!(pg.records().await[0].2, "completed");
}

/// The session reset rides in the one-commit claim, and runs only once the
/// claim has won: an owner that loses at commit is rolled back before its
/// reset, and gets one behind the `ROLLBACK` instead. Either way the
/// session advisory lock its handler's function took is released before
/// the pool's one connection serves anyone else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_commit_owner_releases_its_session_locks_whether_it_wins_or_loses() {
    use tower_idempotency::store::{CommitStore, Committed};
    let pg = Postgres::with_pool(1).await;
    pg.exec(
        "CREATE FUNCTION hold_lock() RETURNS void LANGUAGE sql AS \
             $$ SELECT pg_advisory_lock(42) $$",
    )
    .await;
    let request = claim_request("k", Duration::from_secs(5));
    let mut pids = Vec::new();
    for (body, won) in [(&b"first"[..], true), (b"second", false)] {
        let tx = CommitStore::begin(&pg.store, &request).await.unwrap();
        let pid: i32 = tx
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        pids.push(pid);
        tx.query_one("SELECT hold_lock()", &[]).await.unwrap();
        let committed = pg.store.commit(tx, &request, &stored(body)).await.unwrap();
        assert_eq!(matches!(committed, Committed::Won), won, "{committed:?}");
        let free: bool = pg.value("SELECT pg_try_advisory_lock(42)").await;
        assert!(free, "won {won}: the session advisory lock was released");
        let _: bool = pg.value("SELECT pg_advisory_unlock(42)").await;
    }
    assert_eq!(pids[0], pids[1], "the connection went back to the pool");
    let records = pg.records().await;
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].2, "completed");
}

/// A handler's function that changes the session's authorization (a
/// superuser's `SET SESSION AUTHORIZATION`, which the reset undoes only
/// when the session is not the store's login any more): the request runs
/// as the other role to its end, and the next one on the connection is the
/// login again. Both modes, on a pool of one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_authorization_changed_in_a_function_does_not_outlive_the_request() {
    let pg = Postgres::with_pool(1).await;
    let login = pg.db.config().get_user().expect("a user").to_owned();
    pg.exec(
        "DO $$ BEGIN CREATE ROLE tia_hidden_role; \
             EXCEPTION WHEN duplicate_object THEN NULL; END $$; \
         GRANT ALL ON ALL TABLES IN SCHEMA public TO tia_hidden_role; \
         GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO tia_hidden_role; \
         CREATE FUNCTION become() RETURNS text LANGUAGE plpgsql AS \
             $$ BEGIN EXECUTE 'SET SESSION AUTHORIZATION tia_hidden_role'; \
                RETURN session_user::text; END $$",
    )
    .await;
    let becomes = handler(|tx: PgTx| async move {
        insert_order(&tx).await?;
        let user: String = tx.query_one("SELECT become()", &[]).await?.get(0);
        Ok(created(serde_json::json!({ "user": user }).to_string()))
    });
    for (key, one_commit) in [("k1", false), ("k2", true)] {
        let answer = if one_commit {
            send(
                layer(pg.store.clone())
                    .claim_at_commit()
                    .layer(becomes.clone()),
                tenant_a_post(key),
            )
            .await
        } else {
            send(
                layer(pg.store.clone()).layer(becomes.clone()),
                tenant_a_post(key),
            )
            .await
        };
        assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
        assert_eq!(answer.json()["user"], "tia_hidden_role");
        assert_eq!(
            on_a_borrowed_connection(&pg.store, "SELECT pg_backend_pid(), session_user::text")
                .await
                .1,
            login,
            "one-commit {one_commit}"
        );
    }
    assert_eq!(pg.orders().await.len(), 2);
}
