//! The transactional outbox: side effects after commit, at least once, never
//! twice in effect.
//!
//! Payment and inventory systems cannot join the order's transaction. So the
//! handler only writes an event row next to the order ([`enqueue`]), in the
//! same transaction as the order and the remembered response; after the
//! commit a [`Relay`] delivers it to a [`Sink`], at least once. Every delivery
//! of one event carries the same derived key ([`derive_key`]) to the
//! downstream API, which is itself idempotent, so redeliveries never double
//! an effect.
//!
//! ```text
//!  POST /orders ──▶ IdempotencyLayer ──▶ handler
//!                        │                 │ INSERT orders
//!                        │                 │ outbox::enqueue(OrderCreated)
//!                        └── one COMMIT ───┘ + remembered response
//!
//!  Relay (any number, any process)
//!    BEGIN; SELECT … FOR UPDATE SKIP LOCKED      ◀── NOTIFY at commit (or poll)
//!    Sink::deliver(event) ──▶ POST /charges
//!                              Idempotency-Key: derive_key(order_id, "payment.charge")
//!                              (the provider's own IdempotencyLayer: one charge per key)
//!    UPDATE published_at / attempts / next_attempt_at / parked_at; COMMIT
//! ```
//!
//! Consumers that read events themselves deduplicate with the [`inbox`].
//!
//! The tables (`outbox_events`, `inbox_events`) come with
//! [`PgStore::migrate`](crate::postgres::PgStore::migrate). Operators re-drive an event
//! by setting `published_at` (delivered) or `parked_at` (given up) back to NULL.

pub(crate) mod event;
pub mod inbox;
mod key;
pub(crate) mod relay;

pub use event::{enqueue, OutboxEvent};
pub use key::derive_key;
pub use relay::{BatchReport, DeliveryError, OutboxStatus, Relay, Sink};
