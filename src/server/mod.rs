//! The server middleware: [`IdempotencyLayer`] and the [`Idempotency`]
//! service it makes, in tower-http's shape (a folder, a file per role).
//!
//! - `layer`: the builder; `endpoint`: what one layer sets up and shares.
//! - `mode`: the mode as a value (short transaction, claim at commit, or
//!   long-running with its `lease_config`).
//! - `service`: the one `Service` impl: admission, then the mode's flow on a
//!   task of its own, then the answer.
//! - `admit`, `coalesce`, `cache`, `owner`: the phases both modes share.
//! - `short`, `long`: the one-transaction flow (the short-transaction and
//!   the one-commit modes) and the long-running flow;
//!   `recovery`, `status`: the long-running mode's two services.
//! - `settled`: how a request ended, and **all** answer building.
//! - `future`, `body`: the response future and bodies; `operations`: the
//!   drain counter; `replay`: rebuilt replays; `extract`: axum extractors.

mod admit;
mod body;
mod cache;
mod coalesce;
mod endpoint;
#[cfg(feature = "axum")]
mod extract;
#[cfg(feature = "failpoints")]
pub mod failpoints;
mod future;
mod layer;
mod lease_config;
mod long;
mod mode;
mod operations;
mod owner;
mod recovery;
pub mod replay;
mod service;
mod settled;
mod short;
mod status;

pub use body::{RequestBody, ResponseBody};
pub use endpoint::KeyReuseStatus;
#[cfg(feature = "axum")]
pub use extract::MissingFromLayer;
pub use future::ResponseFuture;
pub use layer::IdempotencyLayer;
pub use lease_config::LeaseConfig;
pub use mode::{ClaimAtCommit, LongRunning, Mode, ShortTransaction};
pub use recovery::Recovery;
pub use service::Idempotency;
pub use status::{StatusFuture, StatusService};
