//! What runs beside the requests, against a real PostgreSQL: the
//! long-running mode (leases, fencing, the status resource, recovery), the
//! outbox and its relays, retention and cleanup, and idempotent functions
//! (work that is not a request).

mod common;
#[path = "background/functions.rs"]
mod functions;
#[path = "background/long_running.rs"]
mod long_running;
#[path = "background/outbox.rs"]
mod outbox;
#[path = "background/retention.rs"]
mod retention;
