// The front page is the README, so that the two cannot drift. The README
// links the guides and files by their place in the repository; these link
// definitions come first, so rustdoc uses them instead (the first definition
// of a label wins): the guides as modules, the other files on GitHub.
//! [request-flow]: guide::request_flow
//! [modes]: guide::modes
//! [fingerprints]: guide::fingerprints
//! [transaction]: guide::transaction
//! [replays]: guide::replays
//! [grpc]: guide::grpc
//! [functions]: guide::functions
//! [long-running]: guide::long_running
//! [custom-stores]: guide::custom_stores
//! [outbox]: guide::outbox
//! [client]: guide::client
//! [retention]: guide::retention
//! [observability]: guide::observability
//! [performance]: guide::performance
//! [deploying]: guide::deploying
//! [migrations]: guide::migrations
//! [order-server]: https://github.com/tower-idempotency/tower-idempotency/blob/main/examples/order_server/README.md
//! [testing]: https://github.com/tower-idempotency/tower-idempotency/blob/main/TESTING.md
//! [benchmarks]: https://github.com/tower-idempotency/tower-idempotency/blob/main/BENCHMARKS.md
//! [runbook]: https://github.com/tower-idempotency/tower-idempotency/blob/main/ops/RUNBOOK.md
//! [changelog]: https://github.com/tower-idempotency/tower-idempotency/blob/main/CHANGELOG.md
//! [license-mit]: https://github.com/tower-idempotency/tower-idempotency/blob/main/LICENSE-MIT
//! [license-apache]: https://github.com/tower-idempotency/tower-idempotency/blob/main/LICENSE-APACHE
#![doc = include_str!("../README.md")]
// The other lints are configured in Cargo.toml (`[lints]`).
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]
// Guides: documentation only, included from `docs/`.
pub mod guide;

pub mod classify;
#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub mod client;
mod error;
pub mod fingerprint;
pub mod function;
#[cfg(any(feature = "client", feature = "postgres", feature = "sqlx"))]
mod jitter;
pub mod key;
pub mod lease;
mod macros;
pub mod memory;
pub mod metrics;
pub mod outbox;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
pub mod problem;
// What both drivers share; a build with one of them leaves the other's
// share unused (the full build, which CI lints, uses all of it).
#[cfg(any(feature = "postgres", feature = "sqlx"))]
#[cfg_attr(not(all(feature = "postgres", feature = "sqlx")), allow(dead_code))]
mod protocol;
pub mod record;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod retention;
#[cfg(any(feature = "postgres", feature = "sqlx"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "postgres", feature = "sqlx"))))]
pub mod schema;
pub mod scope;
mod server;
mod setter;
#[cfg(feature = "sqlx")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlx")))]
pub mod sqlx;
pub mod store;
#[cfg(test)]
mod test_log;

#[cfg(feature = "test-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub mod testing;

// The middleware's own types live at the root; everything else under the
// module named for its concern, each type at one path.
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub use server::MissingFromLayer;
pub use server::{
    replay, ClaimAtCommit, ClaimFirst, Idempotency, IdempotencyLayer, KeyReuseStatus, Mode,
    OnPaths, ReplayCache, RequestBody, ResponseBody, ResponseFuture,
};
// Test-only fault points: behind a feature, and out of the documented API.
#[cfg(feature = "failpoints")]
#[doc(hidden)]
pub use server::failpoints;
