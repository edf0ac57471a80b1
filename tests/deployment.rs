//! Where the crate is deployed: through a transaction pooler (PgBouncer),
//! across a network partition,
//! over TLS as managed PostgreSQL requires it, on Citus, on Patroni, the
//! operator's files under `ops/`, and what operators run themselves (the
//! schema applied by hand, the `keys` tool).

#[path = "deployment/citus.rs"]
mod citus;
mod common;
#[path = "deployment/operators.rs"]
mod operators;
#[path = "deployment/ops.rs"]
mod ops;
#[path = "deployment/partition.rs"]
mod partition;
#[path = "deployment/patroni.rs"]
mod patroni;
#[path = "deployment/pooler.rs"]
mod pooler;
#[path = "deployment/server_contract.rs"]
mod server_contract;
#[path = "deployment/tls.rs"]
mod tls;
