//! The schema, as versioned migrations both drivers apply: append only;
//! never edit an applied migration.

/// Serialises concurrent migrators (any constant unique to this crate).
pub(crate) const MIGRATION_LOCK: i64 = 0x7469_6465_6d70_0001;

/// `(version, name, sql)`: append only; never edit an applied migration.
pub(crate) const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "idempotency_requests",
        include_str!("schema/0001_idempotency_requests.sql"),
    ),
    (
        2,
        "outbox_and_inbox",
        include_str!("schema/0002_outbox_and_inbox.sql"),
    ),
    (3, "retention", include_str!("schema/0003_retention.sql")),
    (
        4,
        "attempt_token_sequence",
        include_str!("schema/0004_attempt_token_sequence.sql"),
    ),
    (
        5,
        "long_running_operations",
        include_str!("schema/0005_long_running_operations.sql"),
    ),
    (
        6,
        "resource_id",
        include_str!("schema/0006_resource_id.sql"),
    ),
    (
        7,
        "operation_attempts",
        include_str!("schema/0007_operation_attempts.sql"),
    ),
    (
        8,
        "tenant_in_every_key",
        include_str!("schema/0008_tenant_in_every_key.sql"),
    ),
    (
        9,
        "hot_completion",
        include_str!("schema/0009_hot_completion.sql"),
    ),
];

/// The newest schema version this build knows.
pub(crate) const LATEST: i32 = MIGRATIONS[MIGRATIONS.len() - 1].0;
