//! The transactional outbox: side effects after commit, at least once, never
//! twice in effect.
//!
//! The handler writes an event next to its rows ([`enqueue`]), in the same
//! transaction as the remembered response; after the commit a [`Relay`]
//! delivers it to a [`Sink`], every delivery with the same [`derive_key`].
//! Consumers that read events themselves deduplicate with the [`inbox`].
//! How delivery, retries, parking and re-drives work:
//! [the outbox guide](crate::guide::outbox).

pub(crate) mod event;
pub mod inbox;
mod key;
pub(crate) mod relay;

pub use event::{enqueue, OutboxEvent};
pub use key::derive_key;
pub use relay::{BatchReport, DeliveryError, OutboxStatus, Relay, Sink};
