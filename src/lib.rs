//! Idempotency-Key middleware for [`tower`](https://docs.rs/tower): a retried
//! `POST` creates one resource and every retry gets the first answer back.
//!
//! Correctness rests on PostgreSQL, not on timing: a primary key on
//! `(tenant, endpoint, key)` arbitrates concurrent duplicates
//! (`INSERT … ON CONFLICT`), and the handler's own rows commit in the same
//! transaction as the remembered response, before the response is sent.
//!
//! # The guarantees
//!
//! 1. One `(tenant, endpoint, key)` = one operation: however often and however
//!    concurrently it arrives, at most one execution commits.
//! 2. The handler's writes (through [`PgTx`](postgres::PgTx)) and the remembered response commit
//!    together, before the response leaves; on rollback none exist and the key
//!    is free for a retry.
//! 3. A retry with the same request gets the first status, allow-listed headers
//!    and body byte for byte, marked `Idempotent-Replayed: true`. The same key
//!    with a different request is refused (`409 idempotency_key_reused`) and
//!    changes nothing.
//! 4. Keys are scoped by the authenticated tenant and the endpoint.
//! 5. A concurrent duplicate waits a bounded time for the first request, then
//!    replays it or is answered `409 idempotency_in_progress` with `Retry-After`.
//!
//! # The request flow
//!
//! 1. Safe methods (`GET`, `HEAD`, `OPTIONS`, `TRACE`) pass through untouched.
//! 2. The key is parsed ([`IdempotencyKey`](key::IdempotencyKey)), the tenant resolved
//!    ([`ResolveTenant`](scope::ResolveTenant); none fails closed), the body buffered under a limit
//!    and fingerprinted ([`Fingerprinter`](fingerprint::Fingerprinter)). A failure here answers at once
//!    and is never remembered.
//! 3. The [`Store`](store::Store) claims the key: owned, completed (replay or refuse), or in
//!    progress.
//! 4. The owner's handler runs with the transaction handle in its request
//!    extensions. 2xx responses and responses marked [`FinalResponse`](record::FinalResponse) are
//!    remembered and committed; 5xx and errors roll back.
//! 5. From the claim on, the work runs on its own task: a client that goes
//!    away does not cancel it, so its retry finds the finished result.
//!
//! # Example
//!
//! ```no_run
//! use axum::{routing::post, Router, http::StatusCode};
//! use serde::{Deserialize, Serialize};
//! use tower_idempotency::{
//!     IdempotencyLayer,
//!     postgres::{PgStore, PgTx},
//!     fingerprint::{TypedFingerprinter, Validated},
//! };
//!
//! #[derive(Serialize, Deserialize)]
//! struct NewOrder { checkout_id: String, total: i64 }
//!
//! async fn create(tx: PgTx, order: Validated<NewOrder>) -> Result<StatusCode, StatusCode> {
//!     tx.execute(
//!         "INSERT INTO orders (tenant_id, checkout_id, total) VALUES ($1, $2, $3)",
//!         &[&tx.tenant(), &order.checkout_id, &order.total],
//!     )
//!     .await
//!     .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
//!     Ok(StatusCode::CREATED)
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let store = PgStore::connect("postgres://app@localhost/app")?;
//! store.migrate().await?;
//! let app: Router = Router::new().route(
//!     "/orders",
//!     post(create).layer(IdempotencyLayer::new(
//!         store,
//!         "POST /orders v1",
//!         TypedFingerprinter::<NewOrder>::new("orders.v1"),
//!     )),
//! );
//! // An auth layer outside this one must insert a `TenantId` into the request
//! // extensions (or configure `tenant_resolver`).
//! # Ok(()) }
//! ```
//!
//! # Beyond the request
//!
//! - [`lease`]: long-running operations, for work too slow for one
//!   transaction: a committed in-progress record with a lease, heartbeats,
//!   takeover by compare-and-swap, fencing tokens, `202 Accepted` with a
//!   status resource, and a recovery worker.
//! - [`outbox`]: side effects after commit, at least once, never twice in
//!   effect (`enqueue` in the handler's transaction, a [`outbox::Relay`],
//!   derived downstream keys, a consumer inbox).
//! - [`retention`]: batched removal of expired keys and the operator gauges.
//! - [`metrics`]: every metric name the crate emits.
//! - [`PgStore::inspect_key`](postgres::PgStore::inspect_key) and [`PgStore::remove_key`](postgres::PgStore::remove_key): the operator API.
//! - [`IdempotencyLayer::drained`]: wait for owned work at shutdown.
//! - `client` (feature `client`): calling an idempotent API, one key per
//!   operation, retried by the contract.
//!
//! # Feature flags
//!
//! - `axum`: [`PgTx`](postgres::PgTx), [`PgLease`](postgres::PgLease) and [`Validated`](fingerprint::Validated) (and `SqlxTx`, `SqlxLease` with `sqlx`) are axum extractors.
//! - `client`: [`client`]: the other half of the contract, a tower layer
//!   for outgoing requests (one key per operation, retries by the contract).
//! - `test-util`: [`testing`]: a throwaway PostgreSQL cluster and the store
//!   conformance suite.
//! - `sqlx`: [`sqlx::SqlxStore`], the store on a `sqlx::PgPool`, whose
//!   handlers write through the claim's `sqlx` transaction.

// The other lints are configured in Cargo.toml (`[lints]`).
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod admit;
mod body;
mod cache;
#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub mod client;
mod coalesce;
mod endpoint;
#[cfg(feature = "failpoints")]
#[cfg_attr(docsrs, doc(cfg(feature = "failpoints")))]
pub mod failpoints;
pub mod fingerprint;
mod future;
pub mod key;
mod layer;
pub mod lease;
pub mod memory;
pub mod metrics;
mod operations;
pub mod outbox;
pub mod postgres;
pub mod problem;
pub mod record;
pub mod replay;
pub mod retention;
pub mod scope;
mod service;
mod settled;
#[cfg(feature = "sqlx")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlx")))]
pub mod sqlx;
pub mod store;

#[doc = include_str!("../docs/deploying.md")]
pub mod deploying {}

#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
mod extract;
#[cfg(feature = "test-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub mod testing;

// The middleware's own types live at the root; everything else under the
// module named for its concern, each type at one path.
pub use body::{RequestBody, ResponseBody};
pub use endpoint::KeyReuseStatus;
#[cfg(feature = "axum")]
pub use extract::MissingFromLayer;
pub use future::ResponseFuture;
pub use layer::IdempotencyLayer;
pub use service::Idempotency;

// The README's examples compile as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
