//! Idempotent functions (`function::Idempotent`): a consumer's work runs
//! once per key, its writes committed with its result, on every store: a
//! repeat returns the remembered result without running; another input
//! under the key is refused; failed work rolls back and frees the key;
//! concurrent calls run the work once and the others get its result.

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc,
};

use serde::{Deserialize, Serialize};
use tower_idempotency::{
    function::{Idempotent, RunError},
    scope::TenantId,
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
