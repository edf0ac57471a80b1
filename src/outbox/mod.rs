//! The transactional outbox: side effects after commit, at least once, never
//! twice in effect.
//!
//! The handler writes an event next to its rows ([`enqueue`]), in the same
//! transaction as the remembered response; after the commit a [`Relay`]
//! delivers it to a [`Sink`], every delivery with the same [`derive_key`].
//! Consumers that read events themselves deduplicate with the [`inbox`].
//! How delivery, retries, parking and re-drives work:
//! [the outbox guide](crate::guide::outbox).

#[cfg(feature = "postgres")]
pub(crate) mod event;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod inbox;
mod key;
#[cfg(feature = "postgres")]
pub(crate) mod relay;
#[cfg(feature = "postgres")]
mod sink;
#[cfg(feature = "postgres")]
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use event::{enqueue, OutboxEvent};
pub use key::{derive_key, derive_tenant_key};
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use relay::Relay;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use sink::{BatchReport, DeliveryError, OutboxStatus, Sink};
