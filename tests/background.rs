//! What runs beside the requests, against a real PostgreSQL: the
//! long-running mode (leases, fencing, the status resource, recovery), the
//! outbox and its relays, retention and cleanup.

mod common;
#[path = "background/long_running.rs"]
mod long_running;
#[path = "background/outbox.rs"]
mod outbox;
#[path = "background/retention.rs"]
mod retention;
