//! A queue consumer that pays each order once, however often the queue
//! delivers its message: `function::Idempotent` keyed by the message id.
//!
//!     cargo run --example queue_consumer
//!
//! It starts a private, temporary PostgreSQL (or uses `DATABASE_URL`),
//! makes a hand-made queue table that delivers at least once, and puts 5
//! `OrderPaid` messages on it, 3 of them twice (a broker's redelivery after
//! a lost acknowledgement), one of them with a payment service that fails
//! on its first attempt. Two consumers take messages concurrently
//! (`FOR UPDATE SKIP LOCKED`); each message's work marks its order paid and
//! records a payment row through the transaction `Idempotent::run` hands
//! it, and the message is acknowledged after the run returns. It prints
//! what was delivered, what ran, and the rows: one payment per order.

use std::{
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use serde::{Deserialize, Serialize};
use tower_idempotency::{
    function::{Idempotent, RunError},
    postgres::{PgStore, PgTx},
    scope::TenantId,
    testing::TempPostgres,
};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS queue_messages (
    seq         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id  text   NOT NULL,
    tenant_id   text   NOT NULL,
    payload     jsonb  NOT NULL,
    acked       bool   NOT NULL DEFAULT false
);
CREATE TABLE IF NOT EXISTS payments (
    tenant_id  text   NOT NULL,
    order_id   text   NOT NULL,
    amount     bigint NOT NULL,
    PRIMARY KEY (tenant_id, order_id, amount)
);
CREATE TABLE IF NOT EXISTS paid_orders (
    tenant_id  text NOT NULL,
    order_id   text NOT NULL,
    payments   int  NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, order_id)
);";

#[derive(Debug, Clone, Serialize, Deserialize)]
struct OrderPaid {
    order_id: String,
    amount: i64,
}

/// What a run returns, and a repeat gets back.
#[derive(Debug, Serialize, Deserialize)]
struct Receipt {
    payments_for_order: i32,
}

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Error> {
    let cluster;
    let store = match std::env::var("DATABASE_URL") {
        Ok(url) if !url.trim().is_empty() => PgStore::connect(&url)?,
        _ => {
            cluster = tokio::task::spawn_blocking(TempPostgres::start).await??;
            PgStore::builder(cluster.config()).build()?
        }
    };
    store.migrate().await?;
    let client = store.client().await?;
    client.batch_execute(SCHEMA).await?;
    for (id, order, amount, copies) in [
        ("m-1", "o-1", 1200, 2),
        ("m-2", "o-2", 800, 1),
        ("m-3", "o-3", 500, 2),
        ("m-4", "o-4", 300, 1),
        ("m-5", "o-5", 950, 2),
    ] {
        let payload = serde_json::json!({ "order_id": order, "amount": amount });
        for _ in 0..copies {
            client
                .execute(
                    "INSERT INTO queue_messages (message_id, tenant_id, payload) VALUES ($1, 'tenant-a', $2)",
                    &[&id, &payload],
                )
                .await?;
        }
    }
    drop(client);

    let consume = Arc::new(Idempotent::new(store.clone(), "consume OrderPaid v1"));
    let runs = Arc::new(AtomicU64::new(0));
    let consumers: Vec<_> = (0..2)
        .map(|_| {
            let (store, consume, runs) = (store.clone(), consume.clone(), runs.clone());
            tokio::spawn(async move { consumer(store, consume, runs).await })
        })
        .collect();
    let mut delivered = 0;
    for consumer in consumers {
        delivered += consumer.await??;
    }

    let client = store.client().await?;
    let rows = client
        .query(
            "SELECT o.order_id, o.payments, count(p.*) FROM paid_orders o \
             LEFT JOIN payments p USING (tenant_id, order_id) GROUP BY 1, 2 ORDER BY 1",
            &[],
        )
        .await?;
    println!(
        "{delivered} deliveries of 5 messages; the work ran {} times (one failed and was retried)",
        runs.load(Ordering::SeqCst)
    );
    for row in &rows {
        let (order, marked, payments): (String, i32, i64) = (row.get(0), row.get(1), row.get(2));
        println!("{order}: paid {marked} time(s), {payments} payment row(s)");
    }
    let doubled = rows.iter().filter(|r| r.get::<_, i64>(2) != 1).count();
    if rows.len() != 5 || doubled > 0 {
        return Err(format!("expected one payment for each of 5 orders; {doubled} differ").into());
    }
    Ok(())
}

/// Takes messages until the queue is empty; returns how many it took.
async fn consumer(
    store: PgStore,
    consume: Arc<Idempotent<PgStore>>,
    runs: Arc<AtomicU64>,
) -> Result<u64, Error> {
    let mut taken = 0;
    loop {
        let client = store.client().await?;
        let next = client
            .query_opt(
                "UPDATE queue_messages SET acked = true WHERE seq = ( \
                     SELECT seq FROM queue_messages WHERE NOT acked ORDER BY seq \
                     LIMIT 1 FOR UPDATE SKIP LOCKED) \
                 RETURNING message_id, tenant_id, payload",
                &[],
            )
            .await?;
        drop(client);
        let Some(message) = next else {
            return Ok(taken);
        };
        taken += 1;
        let (message_id, tenant): (String, String) = (message.get(0), message.get(1));
        let event: OrderPaid = serde_json::from_value(message.get(2))?;
        // A delivery is retried here until its work commits (a broker would
        // redeliver it instead; the key makes both the same).
        loop {
            match pay(
                &consume,
                &TenantId::new(tenant.as_str()),
                &message_id,
                &event,
                &runs,
            )
            .await
            {
                Ok(receipt) => {
                    println!(
                        "{message_id}: order {} has {} payment(s)",
                        event.order_id, receipt.payments_for_order
                    );
                    break;
                }
                Err(RunError::Work(e)) => {
                    println!("{message_id}: {e}; rolled back, retrying");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(RunError::InProgress) => tokio::time::sleep(Duration::from_millis(50)).await,
                Err(e) => return Err(e.to_string().into()),
            }
        }
    }
}

/// The work: a payment row and the order marked paid, in the run's
/// transaction. The payment service fails `o-3`'s first attempt.
async fn pay(
    consume: &Idempotent<PgStore>,
    tenant: &TenantId,
    message_id: &str,
    event: &OrderPaid,
    runs: &AtomicU64,
) -> Result<Receipt, RunError<Error>> {
    consume
        .run(tenant, message_id, event, |tx: PgTx| async move {
            let run = runs.fetch_add(1, Ordering::SeqCst);
            tx.execute(
                "INSERT INTO payments (tenant_id, order_id, amount) VALUES ($1, $2, $3)",
                &[&tx.tenant(), &event.order_id, &event.amount],
            )
            .await?;
            let row = tx
                .query_one(
                    "INSERT INTO paid_orders (tenant_id, order_id, payments) VALUES ($1, $2, 1) \
                     ON CONFLICT (tenant_id, order_id) DO UPDATE SET payments = paid_orders.payments + 1 \
                     RETURNING payments",
                    &[&tx.tenant(), &event.order_id],
                )
                .await?;
            if event.order_id == "o-3" && !FAILED_ONCE.swap(true, Ordering::SeqCst) {
                return Err(format!("payment service unavailable (run {run})").into());
            }
            Ok(Receipt {
                payments_for_order: row.get(0),
            })
        })
        .await
}

static FAILED_ONCE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
