//! Guides: how the pieces work together, one topic each.
//!
//! The crate's front page says what the crate guarantees and lists these
//! guides; each module's own docs hold its API reference.

pub mod deploying {
    #![doc = include_str!("../docs/deploying.md")]
}

pub mod request_flow {
    #![doc = include_str!("../docs/request_flow.md")]
}

pub mod modes {
    #![doc = include_str!("../docs/modes.md")]
}

pub mod fingerprints {
    #![doc = include_str!("../docs/fingerprints.md")]
}

pub mod transaction {
    #![doc = include_str!("../docs/transaction.md")]
}

pub mod replays {
    #![doc = include_str!("../docs/replays.md")]
}

pub mod long_running {
    #![doc = include_str!("../docs/long_running.md")]
}

pub mod custom_stores {
    #![doc = include_str!("../docs/custom_stores.md")]
}

pub mod outbox {
    #![doc = include_str!("../docs/outbox.md")]
}

#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub mod client {
    #![doc = include_str!("../docs/client.md")]
}

pub mod retention {
    #![doc = include_str!("../docs/retention.md")]
}

pub mod observability {
    #![doc = include_str!("../docs/observability.md")]
}

pub mod performance {
    #![doc = include_str!("../docs/performance.md")]
}
