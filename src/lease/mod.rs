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

// The long-running mode's public face: everything is defined where it
// works (the mode and its services in the server, the id with the stores)
// and named here.
pub use crate::server::{LeaseConfig, LongRunning, Recovery, StatusFuture, StatusService};
pub use crate::store::id::{OperationId, OperationIdError};
