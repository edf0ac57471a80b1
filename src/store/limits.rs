//! How long an owner may hold a key: the defaults the middleware's
//! endpoints and the stores' sessions share, so that neither has to ask the
//! other.

use std::time::Duration;

/// How long past the handler's deadline the database itself ends an owner's
/// transaction that went silent (its process frozen, its network gone).
pub(crate) const HOLD_MARGIN: Duration = Duration::from_secs(5);

/// An endpoint's handler timeout unless it sets one.
pub(crate) const DEFAULT_HANDLER_TIMEOUT: Duration = Duration::from_secs(30);

/// The hold limit of an endpoint with the default handler timeout: what a
/// store's sessions carry by default, so that such an owner sends no
/// `SET LOCAL` of its own (`PgStoreBuilder::hold_limit`).
#[allow(
    dead_code,
    reason = "PgStore's builder is its one user; a build without that store leaves it unused"
)]
pub(crate) const DEFAULT_HOLD_LIMIT: Duration = DEFAULT_HANDLER_TIMEOUT.saturating_add(HOLD_MARGIN);
