//! Where the relay delivers ([`Sink`]), how a delivery fails
//! ([`DeliveryError`]), and what a batch or the outbox looks like
//! ([`BatchReport`], [`OutboxStatus`]).

use std::{fmt, future::Future, time::Duration};

use super::event::OutboxEvent;

/// Where the relay delivers events (a payment API, a message broker, …).
///
/// Delivery is at least once: the same event may arrive again after a crash,
/// a timeout or a re-drive, so the sink must make repeats harmless, typically
/// by sending [`OutboxEvent::derived_key`] as the downstream idempotency key.
///
/// A delivery that panics counts as a failed, retryable attempt with
/// `last_error` "the sink panicked" (the relay neither stores nor logs the
/// panic's message: it may quote the payload); the rest of the batch goes
/// on, and the same sink keeps delivering. This needs unwinding panics (not
/// `panic = "abort"`).
pub trait Sink: Send + Sync + 'static {
    /// Delivers one event. `Err` schedules a retry (or parks the event).
    fn deliver(
        &self,
        event: &OutboxEvent,
    ) -> impl Future<Output = Result<(), DeliveryError>> + Send;
}

/// Why a delivery failed. Only the message is stored (`last_error`): keep
/// payloads and secrets out of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryError {
    pub(super) message: String,
    pub(super) permanent: bool,
}

impl DeliveryError {
    /// A failure worth retrying (timeouts, 5xx, `idempotency_in_progress`).
    pub fn retryable(message: impl Into<String>) -> Self {
        DeliveryError {
            message: storable(message.into()),
            permanent: false,
        }
    }

    /// A failure no retry will fix: the event is parked at once.
    pub fn permanent(message: impl Into<String>) -> Self {
        DeliveryError {
            message: storable(message.into()),
            permanent: true,
        }
    }

    /// The message stored as `last_error`.
    pub fn message(&self) -> &str {
        &self.message
    }
}

/// `last_error` must always be writable: a text column refuses NUL, and a
/// downstream may put anything in its error. Long messages are cut.
fn storable(message: String) -> String {
    const MAX_CHARS: usize = 1000;
    let clean = message.replace('\0', "\u{fffd}");
    match clean.char_indices().nth(MAX_CHARS) {
        Some((cut, _)) => format!("{}…", &clean[..cut]),
        None => clean,
    }
}

impl fmt::Display for DeliveryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for DeliveryError {}

/// What the outbox gauges say, as [`Relay::refresh_backlog`](super::Relay::refresh_backlog) read them.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct OutboxStatus {
    /// Undelivered, unparked events.
    pub backlog: u64,
    /// Age of the oldest of them (zero when none).
    pub lag: Duration,
}

/// What one batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchReport {
    /// Events claimed in this batch.
    pub claimed: usize,
    /// Delivered and marked published.
    pub delivered: usize,
    /// Failed and scheduled for a retry.
    pub retried: usize,
    /// Failed for the last time (or permanently) and parked.
    pub parked: usize,
    /// Claimed but not attempted: the batch ran out of time. They stay due,
    /// untouched, for the next batch.
    pub deferred: usize,
}
