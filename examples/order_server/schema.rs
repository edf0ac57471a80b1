//! The example's own tables, applied at start-up under an advisory lock so
//! several processes may start at once. `outbox_events` comes with the
//! library's migrations (`PgStore::migrate`). On a Citus coordinator they
//! are distributed by tenant beside the library's (which `migrate`
//! distributes), unless an operator distributed them already.

use tower_idempotency::{postgres::PgStore, store::StoreError};

const SCHEMA: &str = r#"
SELECT pg_advisory_xact_lock(7243410001);
-- Every primary key and unique constraint includes tenant_id, so the
-- tables can be distributed by tenant (see the deploying guide).
CREATE TABLE IF NOT EXISTS orders (
    id                  uuid        NOT NULL DEFAULT gen_random_uuid(),
    tenant_id           text        NOT NULL,
    checkout_id         text        NOT NULL,
    status              text        NOT NULL DEFAULT 'created',
    currency            text        NOT NULL,
    items               jsonb       NOT NULL,
    total               bigint      NOT NULL,
    coupon              text,
    shipping_address_id text        NOT NULL,
    created_at          timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT orders_pkey PRIMARY KEY (tenant_id, id),
    -- The permanent duplicate rule: it outlives the idempotency retention.
    CONSTRAINT orders_tenant_checkout_key UNIQUE (tenant_id, checkout_id)
);
-- What the fake payment provider charged: one row per idempotency key.
CREATE TABLE IF NOT EXISTS payment_charges (
    id               uuid        NOT NULL DEFAULT gen_random_uuid(),
    tenant_id        text        NOT NULL,
    idempotency_key  text        NOT NULL,
    order_id         text        NOT NULL,
    amount           bigint      NOT NULL,
    currency         text        NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, id),
    UNIQUE (tenant_id, idempotency_key)
);
-- What the fake inventory service reserved: one row per idempotency key.
CREATE TABLE IF NOT EXISTS inventory_reservations (
    id               uuid        NOT NULL DEFAULT gen_random_uuid(),
    tenant_id        text        NOT NULL,
    idempotency_key  text        NOT NULL,
    order_id         text        NOT NULL,
    items            jsonb       NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, id),
    UNIQUE (tenant_id, idempotency_key)
);
-- The order side of a fulfilment, written by the operation that shipped it
-- (its derived warehouse key), so that a re-driven attempt recognises its
-- own earlier work and answers another operation with already_fulfilled.
ALTER TABLE orders
    ADD COLUMN IF NOT EXISTS fulfilment     text,
    ADD COLUMN IF NOT EXISTS shipment_id    text,
    ADD COLUMN IF NOT EXISTS fulfilment_key text;
-- What the fake warehouse shipped: at most one shipment per order, whatever
-- the attempts, takeovers and stale workers. The warehouse is another
-- system: it knows the order id as the text it was sent, not as our uuid.
CREATE TABLE IF NOT EXISTS warehouse_shipments (
    shipment_id      text        NOT NULL
                                 DEFAULT 'shp_' || replace(gen_random_uuid()::text, '-', ''),
    order_id         text        NOT NULL,
    idempotency_key  text        NOT NULL,
    fencing_token    bigint      NOT NULL,
    warehouse        text        NOT NULL,
    tenant_id        text        NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, shipment_id),
    UNIQUE (tenant_id, order_id)
);
-- The highest fencing token the warehouse has seen per order: a call that
-- carries a lower one comes from an attempt that was taken over.
CREATE TABLE IF NOT EXISTS warehouse_tokens (
    tenant_id        text        NOT NULL,
    order_id         text        NOT NULL,
    highest_token    bigint      NOT NULL,
    updated_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, order_id)
);
"#;

pub(crate) async fn migrate(store: &PgStore) -> Result<(), String> {
    store
        .migrate()
        .await
        .map_err(|e: StoreError| format!("idempotency migrations failed: {e}"))?;
    let client = store
        .client()
        .await
        .map_err(|e| format!("cannot reach the database: {e}"))?;
    // One statement at a time: Citus forwards a DDL statement's text to its
    // workers and refuses text that holds several.
    let applied = async {
        client.batch_execute("BEGIN").await?;
        for statement in SCHEMA.split(";\n").filter(|s| !s.trim().is_empty()) {
            client.batch_execute(statement).await?;
        }
        client.batch_execute("COMMIT").await
    };
    if let Err(e) = applied.await {
        let _ = client.batch_execute("ROLLBACK").await;
        return Err(format!("schema migration failed: {}", database_error(&e)));
    }
    store
        .distribute_by_tenant(&TABLES)
        .await
        .map_err(|e| format!("distributing the tables failed: {e}"))?;
    Ok(())
}

/// The example's tables, each distributed by `tenant_id` on Citus.
const TABLES: [&str; 5] = [
    "orders",
    "payment_charges",
    "inventory_reservations",
    "warehouse_shipments",
    "warehouse_tokens",
];

/// A database error as the database said it, with its SQLSTATE (the
/// driver's own text for it is only "db error").
fn database_error(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} (SQLSTATE {})", db.message(), db.code().code()),
        None => e.to_string(),
    }
}
