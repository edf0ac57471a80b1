//! The example's own tables, applied at start-up under an advisory lock so
//! several processes may start at once. `outbox_events` comes with the
//! library's migrations (`PgStore::migrate`).

use tower_idempotency::{postgres::PgStore, store::StoreError};

const SCHEMA: &str = r#"
SELECT pg_advisory_xact_lock(7243410001);
CREATE TABLE IF NOT EXISTS orders (
    id                  uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant_id           text        NOT NULL,
    checkout_id         text        NOT NULL,
    status              text        NOT NULL DEFAULT 'created',
    currency            text        NOT NULL,
    items               jsonb       NOT NULL,
    total               bigint      NOT NULL,
    coupon              text,
    shipping_address_id text        NOT NULL,
    created_at          timestamptz NOT NULL DEFAULT now(),
    -- The permanent duplicate rule: it outlives the idempotency retention.
    CONSTRAINT orders_tenant_checkout_key UNIQUE (tenant_id, checkout_id)
);
-- What the fake payment provider charged: one row per idempotency key.
CREATE TABLE IF NOT EXISTS payment_charges (
    id               uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant_id        text        NOT NULL,
    idempotency_key  text        NOT NULL UNIQUE,
    order_id         text        NOT NULL,
    amount           bigint      NOT NULL,
    currency         text        NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now()
);
-- What the fake inventory service reserved: one row per idempotency key.
CREATE TABLE IF NOT EXISTS inventory_reservations (
    id               uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant_id        text        NOT NULL,
    idempotency_key  text        NOT NULL UNIQUE,
    order_id         text        NOT NULL,
    items            jsonb       NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now()
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
    if let Err(e) = client
        .batch_execute(&format!("BEGIN; {SCHEMA} COMMIT;"))
        .await
    {
        let _ = client.batch_execute("ROLLBACK").await;
        return Err(format!("schema migration failed: {e}"));
    }
    Ok(())
}
