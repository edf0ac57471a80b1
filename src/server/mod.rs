//! The server middleware: [`IdempotencyLayer`] and the [`Idempotency`]
//! service it makes, in tower-http's shape (a folder, a file per role). The
//! files import one way, each only from the groups listed before its own:
//!
//! 1. **Settings and shared types.** `body` (the bodies), `inner` (what the
//!    wrapped service must be), `lease_config` and `mode` (the modes as
//!    values and the retention each needs), `cache` (the replay cache),
//!    `in_flight` (the keys this process works on), `drain` (the shutdown
//!    drain counter), `replay` (rebuilt replays), `failpoints`; then
//!    `endpoint`, what one layer sets up and shares.
//! 2. **Answers.** `settled`: how a request ended, and **all** answer
//!    building.
//! 3. **Phases both flows share.** `admit` (key, tenant, body, fingerprint),
//!    `coalesce` (waiting behind a duplicate of this process), `owner`
//!    (running the handler).
//! 4. **Flows.** `one_transaction` (the claim-first and the one-commit
//!    modes), `long_running` (the long-running mode); `flow`: which mode
//!    runs which ([`Mode`]).
//! 5. **Services.** `service`, the one `Service` impl (admission, then the
//!    mode's flow on a task of its own, then the answer) with its `future`;
//!    `recovery` and `status`, the long-running mode's two services;
//!    `extract`, the axum extractors, and `respond`, the axum answers
//!    (problems and a handler's statement errors as `IntoResponse`).
//! 6. **The builders.** `layer`, and `on_paths` (a layer for a set of
//!    paths, each its own endpoint).

mod admit;
mod body;
mod cache;
mod coalesce;
pub(crate) mod deadline;
mod drain;
mod endpoint;
#[cfg(feature = "axum")]
mod extract;
#[cfg(feature = "failpoints")]
pub mod failpoints;
mod flow;
mod future;
mod in_flight;
mod inner;
mod layer;
mod lease_config;
mod long_running;
mod mode;
mod on_paths;
mod one_transaction;
mod owner;
mod recovery;
pub mod replay;
#[cfg(feature = "axum")]
mod respond;
mod service;
mod settled;
mod status;

pub use body::{RequestBody, ResponseBody};
pub use cache::ReplayCache;
pub use endpoint::KeyReuseStatus;
#[cfg(feature = "axum")]
pub use extract::MissingFromLayer;
pub use flow::Mode;
pub use future::ResponseFuture;
pub use layer::IdempotencyLayer;
pub use lease_config::LeaseConfig;
pub use mode::{ClaimAtCommit, ClaimFirst, LongRunning};
pub use on_paths::OnPaths;
pub use recovery::Recovery;
pub use service::Idempotency;
pub use status::{StatusFuture, StatusService};
