//! Long-running operations: a committed `in_progress` record, a lease kept
//! alive by heartbeats, and a fencing token that stale workers cannot get past.
//!
//! For work too slow for one transaction (a slow warehouse, a payment
//! provider that answers late),
//! [`IdempotencyLayer::long_running`](crate::IdempotencyLayer::long_running)
//! switches an endpoint to this mode with a [`LeaseConfig`];
//! [`IdempotencyLayer::status_service`](crate::IdempotencyLayer::status_service)
//! answers the status resource and
//! [`IdempotencyLayer::recovery`](crate::IdempotencyLayer::recovery) re-drives
//! abandoned operations. How the mode works, what it answers, how to write a
//! handler a takeover can run again, and when to choose it:
//! [long-running operations](crate::guide::long_running).

mod config;
mod flow;
mod id;
mod recovery;
mod status;

pub use config::LeaseConfig;
pub use id::{OperationId, OperationIdError};
pub use recovery::Recovery;
pub use status::{OperationStatus, OperationStatusFuture};

pub(crate) use flow::{accepted_body, drive, settle_long, spawn_work, status_location, Driven};

/// The layer's mode: one short transaction per request (the default).
///
/// A type parameter of [`IdempotencyLayer`](crate::IdempotencyLayer) and
/// [`Idempotency`](crate::Idempotency); see [`LongRunning`].
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct ShortTransaction;

/// The layer's mode for long-running operations, set by
/// [`IdempotencyLayer::long_running`](crate::IdempotencyLayer::long_running).
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct LongRunning;
