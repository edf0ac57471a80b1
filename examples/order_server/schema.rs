//! The example's own tables, applied at start-up under an advisory lock so
//! several processes may start at once.

use tower_idempotency::{PgStore, StoreError};

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
CREATE TABLE IF NOT EXISTS outbox_events (
    id            uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    tenant_id     text        NOT NULL,
    aggregate_id  uuid        NOT NULL,
    event_type    text        NOT NULL,
    payload       jsonb       NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    published_at  timestamptz,
    attempts      integer     NOT NULL DEFAULT 0,
    last_error    text
);
CREATE INDEX IF NOT EXISTS outbox_events_unpublished_idx
    ON outbox_events (created_at) WHERE published_at IS NULL;
"#;

pub async fn migrate(store: &PgStore) -> Result<(), String> {
    store
        .migrate()
        .await
        .map_err(|e: StoreError| format!("idempotency migrations failed: {e}"))?;
    let client = store
        .client()
        .await
        .map_err(|e| format!("cannot reach the database: {e}"))?;
    client
        .batch_execute(&format!("BEGIN; {SCHEMA} COMMIT;"))
        .await
        .map_err(|e| format!("schema migration failed: {e}"))
}
