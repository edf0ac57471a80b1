//! Retry jitter from the standard library alone: the client's, the outbox
//! relay's and the migration runner's backoffs share it, and none needs a
//! randomness crate.

use std::{
    hash::{BuildHasher, Hasher, RandomState},
    sync::atomic::{AtomicU64, Ordering},
};

/// A number in [0, 1), a new one on every call. A `RandomState` has hash
/// keys that the standard library draws from the operating system (once
/// per thread, then advanced for every new one); hashing a process-wide
/// counter with them gives values that neither repeat in lockstep across
/// callers nor follow the clock. Not for anything secret: only to spread
/// retries.
pub(crate) fn unit() -> f64 {
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u64(CALLS.fetch_add(1, Ordering::Relaxed));
    // The top 53 bits: every value a double holds exactly in [0, 1).
    (hasher.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// "Equal jitter" on a wait of `full_secs` seconds: half of it fixed, the
/// other half random, so that many failed calls do not retry in lockstep.
#[cfg(any(feature = "client", feature = "postgres"))]
pub(crate) fn equal(full_secs: f64) -> std::time::Duration {
    std::time::Duration::from_secs_f64(full_secs * 0.5_f64.mul_add(unit(), 0.5))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    #[test]
    fn unit_is_in_range_and_varies() {
        let draws: Vec<f64> = (0..1000).map(|_| unit()).collect();
        assert!(draws.iter().all(|u| (0.0..1.0).contains(u)));
        let distinct: BTreeSet<u64> = draws.iter().map(|u| u.to_bits()).collect();
        assert_eq!(distinct.len(), draws.len(), "a draw repeated");
        // Both halves come up: a thousand fair draws all in one half has
        // probability 2^-999.
        assert!(draws.iter().any(|u| *u < 0.5) && draws.iter().any(|u| *u >= 0.5));
    }

    #[test]
    #[cfg(any(feature = "client", feature = "postgres"))]
    fn equal_jitter_waits_between_half_and_all() {
        for _ in 0..1000 {
            let wait = equal(2.0);
            let (half, all) = (
                std::time::Duration::from_secs(1),
                std::time::Duration::from_secs(2),
            );
            assert!(wait >= half && wait <= all);
        }
        assert_eq!(equal(0.0), std::time::Duration::ZERO);
    }
}
