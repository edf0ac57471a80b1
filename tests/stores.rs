//! The scenarios every store must pass, run against `MemoryStore`, `PgStore`
//! and `SqlxStore` (`behaviour`: the layer's flow; `scenarios`: the store's
//! side), each store's own guarantees (`postgres`, `sqlx_store`,
//! `memory_leases`), and the conformance suites shown to fail broken stores.

#[path = "stores/behaviour.rs"]
mod behaviour;
#[path = "stores/citus.rs"]
mod citus;
mod common;
#[path = "stores/conformance_catches_broken_commit_stores.rs"]
mod conformance_catches_broken_commit_stores;
#[path = "stores/conformance_catches_broken_stores.rs"]
mod conformance_catches_broken_stores;
#[path = "stores/memory_leases.rs"]
mod memory_leases;
#[path = "stores/postgres.rs"]
mod postgres;
#[path = "stores/scenarios.rs"]
mod scenarios;
#[path = "stores/sqlx_store.rs"]
mod sqlx_store;
