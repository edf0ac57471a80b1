//! Idempotent functions (`function::Idempotent`): a consumer's work runs
//! once per key, its writes committed with its result, on every store: a
//! repeat returns the remembered result without running; another input
//! under the key is refused; failed work rolls back and frees the key;
//! concurrent calls run the work once and the others get its result.
//! On PostgreSQL (both stores), the bounds: a work that outlives a short
//! retention still runs once (the retention is raised to cover the work),
//! and a hung work is cut off at its timeout, its statement cancelled, its
//! writes rolled back and its key freed.

use std::{
    future::Future,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};
use tokio::sync::{oneshot, Notify};
use tower_idempotency::{
    function::{Idempotent, RunError},
    postgres::PgTx,
    scope::TenantId,
    sqlx::SqlxTx,
    store::Store,
};

use crate::common::{Backend, Memory, Postgres, Sqlx};

#[derive(Serialize)]
struct OrderPaid {
    order_id: String,
    amount: i64,
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Receipt {
    order_id: String,
    run: u64,
}

/// One consumption of `event` under `key`: writes an order row named after
/// the event through the store's handle; fails when `fail` says so.
async fn consume<B: Backend>(
    consumer: &Idempotent<B::Store>,
    key: &str,
    event: &OrderPaid,
    runs: &AtomicU64,
    fail: bool,
) -> Result<Receipt, RunError<String>> {
    let tenant = TenantId::new("tenant-a");
    consumer
        .run(
            &tenant,
            key,
            event,
            |tx: <B::Store as Store>::Tx| async move {
                let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                B::insert_order(&tx, &format!("{}-{run}", event.order_id), "tenant-a").await?;
                if fail {
                    return Err("the payment service said no".to_owned());
                }
                Ok(Receipt {
                    order_id: event.order_id.clone(),
                    run,
                })
            },
        )
        .await
}

async fn runs_once_per_key<B: Backend>(backend: &B) {
    let consumer = Idempotent::new(backend.store(), "consume OrderPaid v1");
    let runs = AtomicU64::new(0);
    let event = OrderPaid {
        order_id: "o-1".into(),
        amount: 1200,
    };

    let first = consume::<B>(&consumer, "msg-1", &event, &runs, false).await;
    let again = consume::<B>(&consumer, "msg-1", &event, &runs, false).await;
    let expected = Receipt {
        order_id: "o-1".into(),
        run: 1,
    };
    assert_eq!(first.unwrap(), expected);
    assert_eq!(again.unwrap(), expected, "the remembered result");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the work ran once");

    let other = OrderPaid {
        order_id: "o-1".into(),
        amount: 1,
    };
    let reused = consume::<B>(&consumer, "msg-1", &other, &runs, false).await;
    assert!(matches!(reused, Err(RunError::KeyReused)), "{reused:?}");

    // Failed work rolls its row back and frees the key: the next call runs.
    let failed = consume::<B>(&consumer, "msg-2", &event, &runs, true).await;
    assert!(matches!(failed, Err(RunError::Work(_))), "{failed:?}");
    let retried = consume::<B>(&consumer, "msg-2", &event, &runs, false).await;
    assert_eq!(retried.unwrap().run, 3);

    let invalid = consume::<B>(&consumer, "", &event, &runs, false).await;
    assert!(
        matches!(invalid, Err(RunError::InvalidKey(_))),
        "{invalid:?}"
    );

    assert_eq!(
        backend.orders().await,
        [
            ("o-1-1".to_owned(), "tenant-a".to_owned()),
            ("o-1-3".to_owned(), "tenant-a".to_owned()),
        ],
        "the first run's row and the retry's; the failed run's rolled back"
    );
    assert_eq!(backend.remembered().await, 2, "two results remembered");
}

/// Concurrent calls with one key: the work runs once, the others wait for
/// it and get its result.
async fn concurrent_calls_run_once<B: Backend>(backend: &B) {
    let consumer = Arc::new(Idempotent::new(backend.store(), "consume OrderPaid v1"));
    let runs = Arc::new(AtomicU64::new(0));
    let calls: Vec<_> = (0..8)
        .map(|_| {
            let (consumer, runs) = (consumer.clone(), runs.clone());
            tokio::spawn(async move {
                let event = OrderPaid {
                    order_id: "o-9".into(),
                    amount: 5,
                };
                consume::<B>(&consumer, "msg-9", &event, &runs, false).await
            })
        })
        .collect();
    for call in calls {
        let receipt = call.await.unwrap().expect("every call gets the result");
        assert_eq!(receipt.run, 1);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(backend.orders().await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_runs_once_per_key_on_pg_store() {
    let pg = Postgres::new().await;
    runs_once_per_key(&pg).await;
    concurrent_calls_run_once(&Postgres::new().await).await;
    assert_eq!(pg.idle_in_transaction().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_runs_once_per_key_on_sqlx_store() {
    runs_once_per_key(&Sqlx::new().await).await;
    concurrent_calls_run_once(&Sqlx::new().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_runs_once_per_key_on_memory_store() {
    runs_once_per_key(&Memory::new().await).await;
    concurrent_calls_run_once(&Memory::new().await).await;
}

/// The queue-consumer example: 8 deliveries of 5 messages (3 redelivered),
/// one failing its first attempt, two consumers at once; the work commits
/// once per message, one payment per order (it exits non-zero otherwise),
/// on its own temporary PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_consumer_example_pays_each_order_once() {
    let binary = crate::common::example_binary::example(
        "queue_consumer",
        &["examples/queue_consumer.rs", "Cargo.toml"],
    );
    let out = tokio::process::Command::new(binary)
        .env_remove("DATABASE_URL")
        .output()
        .await
        .expect("the example runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("8 deliveries of 5 messages; the work ran 6 times"),
        "{stdout}"
    );
    for order in ["o-1", "o-2", "o-3", "o-4", "o-5"] {
        assert!(
            stdout.contains(&format!("{order}: paid 1 time(s), 1 payment row(s)")),
            "{stdout}"
        );
    }
}

/// A store on a real PostgreSQL: the test's own connection to read the
/// rows, and statements run through the owner's transaction.
trait OnPostgres: Backend {
    fn client(&self) -> &tokio_postgres::Client;
    /// Runs `sql` (a statement returning no rows of interest) through `tx`.
    fn run_sql(
        tx: &<Self::Store as Store>::Tx,
        sql: &'static str,
    ) -> impl Future<Output = Result<(), String>> + Send;
    /// A setting as the owner's transaction sees it.
    fn setting(
        tx: &<Self::Store as Store>::Tx,
        name: &'static str,
    ) -> impl Future<Output = Result<String, String>> + Send;
}

impl OnPostgres for Postgres {
    fn client(&self) -> &tokio_postgres::Client {
        &self.client
    }
    async fn run_sql(tx: &PgTx, sql: &'static str) -> Result<(), String> {
        tx.batch_execute(sql).await.map_err(|e| e.to_string())
    }
    async fn setting(tx: &PgTx, name: &'static str) -> Result<String, String> {
        let row = tx
            .query_one("SELECT current_setting($1)", &[&name])
            .await
            .map_err(|e| e.to_string())?;
        Ok(row.get(0))
    }
}

impl OnPostgres for Sqlx {
    fn client(&self) -> &tokio_postgres::Client {
        &self.client
    }
    async fn run_sql(tx: &SqlxTx, sql: &'static str) -> Result<(), String> {
        let mut conn = tx.conn().await.map_err(|e| e.to_string())?;
        sqlx::query(sql)
            .execute(&mut *conn)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
    async fn setting(tx: &SqlxTx, name: &'static str) -> Result<String, String> {
        let mut conn = tx.conn().await.map_err(|e| e.to_string())?;
        sqlx::query_scalar("SELECT current_setting($1)")
            .bind(name)
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| e.to_string())
    }
}

async fn count(client: &tokio_postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

/// Polls `sql` (a count) until it is `expected`, for at most 20 s.
async fn until_count(client: &tokio_postgres::Client, sql: &str, expected: i64, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let n = count(client, sql).await;
        if n == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: still {n}, not {expected}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A work that is still running when a 2 s retention has passed since its
/// claim commits afterwards; a call with the same key made while it runs
/// (and one after) gets its result, not a second run: the retention was
/// raised to cover the work (the default work timeout, 30 s, plus 5 s).
async fn a_work_outliving_its_retention_runs_once<B: OnPostgres>(backend: &B) {
    let consumer = Arc::new(
        Idempotent::new(backend.store(), "consume OrderPaid v1").retention(Duration::from_secs(2)),
    );
    let runs = Arc::new(AtomicU64::new(0));
    let release = Arc::new(Notify::new());
    let (started_tx, started) = oneshot::channel::<()>();
    let started_tx = Arc::new(Mutex::new(Some(started_tx)));
    let call = |consumer: Arc<Idempotent<B::Store>>| {
        let (runs, release, started_tx) = (runs.clone(), release.clone(), started_tx.clone());
        tokio::spawn(async move {
            let event = OrderPaid {
                order_id: "o-1".into(),
                amount: 1200,
            };
            let event = &event;
            consumer
                .run(
                    &TenantId::new("tenant-a"),
                    "msg-slow",
                    event,
                    |tx: <B::Store as Store>::Tx| async move {
                        let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                        B::insert_order(&tx, &format!("{}-{run}", event.order_id), "tenant-a")
                            .await?;
                        // The first run holds on until the test lets it go.
                        let first = started_tx.lock().unwrap().take();
                        if let Some(started) = first {
                            let _ = started.send(());
                            release.notified().await;
                        }
                        Ok::<_, String>(Receipt {
                            order_id: event.order_id.clone(),
                            run,
                        })
                    },
                )
                .await
        })
    };

    let first = call(consumer.clone());
    started.await.expect("the first work started");
    // The key's holder has been in its transaction longer than the
    // configured retention (its claim is as old as its transaction).
    until_count(
        backend.client(),
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND state LIKE 'idle in transaction%' AND xact_start < now() - interval '2.5 s'",
        1,
        "the first work's transaction older than the retention",
    )
    .await;
    // A duplicate arrives while the work still runs, and waits for the key.
    let during = call(consumer.clone());
    until_count(
        backend.client(),
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND wait_event_type = 'Lock'",
        1,
        "the duplicate waiting for the key",
    )
    .await;
    release.notify_one();

    let expected = Receipt {
        order_id: "o-1".into(),
        run: 1,
    };
    assert_eq!(first.await.unwrap().unwrap(), expected);
    let during = during.await.unwrap();
    let after = call(consumer.clone()).await.unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the work ran once");
    assert_eq!(during.unwrap(), expected, "the duplicate got the result");
    assert_eq!(after.unwrap(), expected, "a later call got the result");

    assert_eq!(
        backend.orders().await,
        [("o-1-1".to_owned(), "tenant-a".to_owned())],
        "one run's row"
    );
    let client = backend.client();
    let row = client
        .query_one(
            "SELECT state, EXTRACT(EPOCH FROM expires_at - created_at)::float8, expires_at > now() \
                 FROM idempotency_requests WHERE idempotency_key = 'msg-slow'",
            &[],
        )
        .await
        .unwrap();
    let (state, kept, unexpired): (String, f64, bool) = (row.get(0), row.get(1), row.get(2));
    assert_eq!(state, "completed");
    assert_eq!(
        kept, 35.0,
        "kept for the work timeout plus 5 s from the claim"
    );
    assert!(unexpired);
    assert_eq!(consumer.effective_retention(), Duration::from_secs(35));
}

/// A work that never returns (a statement sleeping 60 s in the database)
/// is cut off at its 1 s timeout: `run` says so, the statement is
/// cancelled, the work's row rolled back, the key freed, and the next
/// call with the key runs the work and commits. The owner's transaction
/// carries the hold limit, the timeout plus 5 s.
async fn a_hung_work_times_out_and_frees_its_key<B: OnPostgres>(backend: &B) {
    let consumer = Idempotent::new(backend.store(), "consume OrderPaid v1")
        .work_timeout(Duration::from_secs(1));
    let runs = AtomicU64::new(0);
    let hold_limit = Mutex::new(String::new());
    let event = OrderPaid {
        order_id: "o-2".into(),
        amount: 5,
    };
    let tenant = TenantId::new("tenant-a");
    let (event, runs, hold_limit) = (&event, &runs, &hold_limit);
    let call = |hang: bool| {
        consumer.run(
            &tenant,
            "msg-hang",
            event,
            move |tx: <B::Store as Store>::Tx| async move {
                let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                B::insert_order(&tx, &format!("{}-{run}", event.order_id), "tenant-a").await?;
                let limit = B::setting(&tx, "idle_in_transaction_session_timeout").await?;
                *hold_limit.lock().unwrap() = limit;
                if hang {
                    B::run_sql(&tx, "SELECT pg_sleep(60)").await?;
                }
                Ok::<_, String>(Receipt {
                    order_id: event.order_id.clone(),
                    run,
                })
            },
        )
    };

    let began = Instant::now();
    let hung = tokio::time::timeout(Duration::from_secs(20), call(true))
        .await
        .expect("run returns within 20 s");
    let took = began.elapsed();
    let Err(timed_out @ RunError::TimedOut(_)) = hung else {
        panic!("the hung work timed out: {hung:?}")
    };
    assert!(
        timed_out.to_string().contains("1s"),
        "the error names the timeout: {timed_out}"
    );
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(5),
        "run returned {took:?} after the call"
    );
    assert_eq!(hold_limit.lock().unwrap().as_str(), "6s", "the hold limit");

    let client = backend.client();
    assert_eq!(
        count(
            client,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                 AND pid <> pg_backend_pid() AND query LIKE '%pg_sleep%' AND state = 'active'"
        )
        .await,
        0,
        "the sleeping statement was cancelled"
    );
    assert_eq!(
        count(
            client,
            "SELECT count(*) FROM idempotency_requests WHERE idempotency_key = 'msg-hang'"
        )
        .await,
        0,
        "the key is free"
    );
    assert_eq!(backend.orders().await, [], "the work's row rolled back");

    let retried = call(false).await.expect("the next call runs the work");
    assert_eq!(retried.run, 2);
    assert_eq!(
        backend.orders().await,
        [("o-2-2".to_owned(), "tenant-a".to_owned())]
    );
    assert_eq!(
        count(
            client,
            "SELECT count(*) FROM idempotency_requests \
                 WHERE idempotency_key = 'msg-hang' AND state = 'completed'"
        )
        .await,
        1
    );
    assert_eq!(
        consumer.effective_retention(),
        Duration::from_secs(24 * 3600)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_work_outliving_its_retention_runs_once_on_pg_store() {
    let pg = Postgres::new().await;
    a_work_outliving_its_retention_runs_once(&pg).await;
    assert_eq!(pg.idle_in_transaction().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_work_outliving_its_retention_runs_once_on_sqlx_store() {
    a_work_outliving_its_retention_runs_once(&Sqlx::new().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_work_times_out_and_frees_its_key_on_pg_store() {
    let pg = Postgres::new().await;
    a_hung_work_times_out_and_frees_its_key(&pg).await;
    assert_eq!(pg.idle_in_transaction().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_work_times_out_and_frees_its_key_on_sqlx_store() {
    a_hung_work_times_out_and_frees_its_key(&Sqlx::new().await).await;
}
