//! The replay cache: completed records this process committed, kept in
//! memory for a bounded time so that a retry that comes back to the same
//! process is answered without the database.
//!
//! Never the source of truth: an entry is only ever a copy of a committed
//! record, it never outlives the record's retention (nor the configured
//! TTL), and a miss costs only the normal claim. The one thing a cache
//! cannot see is a record removed by an operator (`remove_key`) or by
//! another process: an entry already cached answers until its TTL ends.

use std::{sync::Arc, time::Duration};

use moka::sync::Cache;

use crate::{key::IdempotencyKey, record::Record, scope::Scope};

type Key = (Scope, IdempotencyKey);

/// The cache of one layer (shared by every service it makes).
#[derive(Clone)]
pub(crate) struct RecordCache {
    entries: Cache<Key, Entry>,
}

#[derive(Clone)]
struct Entry {
    record: Arc<Record>,
    /// When the record's retention ends, by this process's clock: the
    /// instant taken before its commit, so never later than the database's.
    expires: std::time::Instant,
}

/// Each entry lives until its record's retention ends, at most the TTL.
struct UntilExpired;

impl moka::Expiry<Key, Entry> for UntilExpired {
    fn expire_after_create(
        &self,
        _key: &Key,
        entry: &Entry,
        now: std::time::Instant,
    ) -> Option<Duration> {
        Some(entry.expires.saturating_duration_since(now))
    }
}

impl RecordCache {
    /// A cache of at most `capacity` records, each kept at most `ttl`.
    pub(crate) fn new(capacity: u64, ttl: Duration) -> Self {
        RecordCache {
            entries: Cache::builder()
                .max_capacity(capacity)
                .time_to_live(ttl)
                .expire_after(UntilExpired)
                .build(),
        }
    }

    /// The cached record of `key`, if any.
    pub(crate) fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Option<Arc<Record>> {
        self.entries
            .get(&(scope.clone(), key.clone()))
            .map(|entry| entry.record)
    }

    /// Keeps `record` until `expires` (or the TTL, or until evicted).
    pub(crate) fn insert(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        record: Arc<Record>,
        expires: std::time::Instant,
    ) {
        self.entries
            .insert((scope.clone(), key.clone()), Entry { record, expires });
    }
}

impl std::fmt::Debug for RecordCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordCache")
            .field("entries", &self.entries.entry_count())
            .finish()
    }
}
