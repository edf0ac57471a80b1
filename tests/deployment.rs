//! Where the crate is deployed: through a transaction pooler (PgBouncer),
//! over TLS as managed PostgreSQL requires it, and the operator's files
//! under `ops/`.

mod common;
#[path = "deployment/ops.rs"]
mod ops;
#[path = "deployment/pooler.rs"]
mod pooler;
#[path = "deployment/tls.rs"]
mod tls;
