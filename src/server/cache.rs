//! The replay cache: completed records this process committed, kept in
//! memory for a bounded time so that a retry that comes back to the same
//! process is answered without the database.
//!
//! Never the source of truth: an entry is only ever a copy of a committed
//! record, it never outlives the record's retention (nor the configured
//! TTL), and a miss costs only the normal claim. The one thing a cache
//! cannot see is a record removed by an operator (`remove_key`) or by
//! another process: an entry already cached answers until its TTL ends.

use std::{
    hash::{Hash, Hasher},
    sync::Arc,
    time::{Duration, Instant},
};

use quick_cache::{sync::Cache, Equivalent};

use crate::{key::IdempotencyKey, record::Record, scope::Scope};

type Key = (Scope, IdempotencyKey);

/// The cache of one layer (shared by every service it makes).
#[derive(Clone)]
pub(crate) struct RecordCache {
    entries: Arc<Cache<Key, Entry>>,
    ttl: Duration,
}

#[derive(Clone)]
struct Entry {
    record: Arc<Record>,
    /// When the entry stops answering: its record's retention end (by this
    /// process's clock: the instant taken before its commit, so never later
    /// than the database's), or the TTL after it was cached, the sooner.
    until: Instant,
}

/// A key looked up by reference: hashes as the owned `(Scope, IdempotencyKey)`
/// does (each part in turn), so that a lookup copies nothing.
struct Lookup<'a>(&'a Scope, &'a IdempotencyKey);

impl Hash for Lookup<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.hash(state);
        self.1.hash(state);
    }
}

impl Equivalent<Key> for Lookup<'_> {
    fn equivalent(&self, key: &Key) -> bool {
        *self.0 == key.0 && *self.1 == key.1
    }
}

impl RecordCache {
    /// A cache of at most about `capacity` records, each kept at most `ttl`.
    pub(crate) fn new(capacity: u64, ttl: Duration) -> Self {
        let capacity = usize::try_from(capacity).unwrap_or(usize::MAX);
        RecordCache {
            entries: Arc::new(Cache::new(capacity)),
            ttl,
        }
    }

    /// The cached record of `key`, if any and still answering.
    pub(crate) fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Option<Arc<Record>> {
        let lookup = Lookup(scope, key);
        let entry = self.entries.get(&lookup)?;
        if entry.until > Instant::now() {
            return Some(entry.record);
        }
        self.entries.remove(&lookup);
        None
    }

    /// Keeps `record` until `expires` (or the TTL, or until evicted).
    pub(crate) fn insert(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        record: Arc<Record>,
        expires: Instant,
    ) {
        let until = Instant::now()
            .checked_add(self.ttl)
            .map_or(expires, |ttl_end| ttl_end.min(expires));
        self.entries
            .insert((scope.clone(), key.clone()), Entry { record, until });
    }
}

impl std::fmt::Debug for RecordCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordCache")
            .field("entries", &self.entries.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::{sync::Arc, time::Duration};

    use bytes::Bytes;
    use http::{HeaderMap, StatusCode};

    use super::*;
    use crate::{fingerprint::Fingerprint, record::StoredResponse, scope::TenantId};

    fn record(body: &'static str) -> Arc<Record> {
        Arc::new(Record {
            fingerprint: Fingerprint::from_bytes([7; 32]),
            response: StoredResponse::new(
                StatusCode::CREATED,
                &HeaderMap::new(),
                &[],
                Bytes::from_static(body.as_bytes()),
            ),
        })
    }

    fn scope(tenant: &str) -> Scope {
        Scope::new(TenantId::new(tenant), "POST /orders v1")
    }

    fn key(k: &str) -> IdempotencyKey {
        IdempotencyKey::parse(k.as_bytes()).unwrap()
    }

    fn later(d: Duration) -> Instant {
        Instant::now() + d
    }

    /// A lookup by reference finds what was inserted under the owned key,
    /// and only under the same tenant, endpoint and key.
    #[test]
    fn a_borrowed_lookup_finds_the_owned_key() {
        let cache = RecordCache::new(100, Duration::from_secs(60));
        let hour = later(Duration::from_secs(3600));
        cache.insert(&scope("a"), &key("k1"), record("first"), hour);
        cache.insert(&scope("b"), &key("k1"), record("other tenant"), hour);
        let found = cache.get(&scope("a"), &key("k1")).expect("cached");
        assert_eq!(found.response.body, Bytes::from_static(b"first"));
        let found = cache.get(&scope("b"), &key("k1")).expect("cached");
        assert_eq!(found.response.body, Bytes::from_static(b"other tenant"));
        assert!(cache.get(&scope("a"), &key("k2")).is_none());
        let other_endpoint = Scope::new(TenantId::new("a"), "POST /orders v2");
        assert!(cache.get(&other_endpoint, &key("k1")).is_none());
    }

    /// An entry answers until its record's retention ends or its TTL does,
    /// the sooner, and is dropped when found past it.
    #[test]
    fn an_entry_stops_answering_at_its_retention_or_its_ttl() {
        let cache = RecordCache::new(100, Duration::from_secs(60));
        let s = scope("a");
        cache.insert(&s, &key("past"), record("x"), Instant::now());
        assert!(cache.get(&s, &key("past")).is_none(), "retention over");
        assert_eq!(cache.entries.len(), 0, "dropped when found expired");

        let short = RecordCache::new(100, Duration::ZERO);
        short.insert(
            &s,
            &key("ttl"),
            record("x"),
            later(Duration::from_secs(3600)),
        );
        assert!(short.get(&s, &key("ttl")).is_none(), "ttl over");

        cache.insert(
            &s,
            &key("live"),
            record("x"),
            later(Duration::from_secs(3600)),
        );
        assert!(cache.get(&s, &key("live")).is_some());
    }

    /// The longest TTL does not overflow the clock: the retention bounds it.
    #[test]
    fn the_longest_ttl_is_bounded_by_the_retention() {
        let cache = RecordCache::new(10, Duration::MAX);
        let s = scope("a");
        cache.insert(&s, &key("k"), record("x"), later(Duration::from_secs(60)));
        assert!(cache.get(&s, &key("k")).is_some());
        cache.insert(&s, &key("gone"), record("x"), Instant::now());
        assert!(cache.get(&s, &key("gone")).is_none());
    }

    /// The cache holds about its capacity, whatever is inserted.
    #[test]
    fn the_cache_holds_about_its_capacity() {
        let cache = RecordCache::new(50, Duration::from_secs(60));
        let s = scope("a");
        let hour = later(Duration::from_secs(3600));
        for i in 0..1000 {
            cache.insert(&s, &key(&format!("k{i}")), record("x"), hour);
        }
        let held = cache.entries.len();
        assert!((1..=60).contains(&held), "held {held} of capacity 50");
    }

    /// The largest capacity a caller can give allocates nothing up front.
    #[test]
    fn the_largest_capacity_allocates_lazily() {
        let cache = RecordCache::new(u64::MAX, Duration::from_secs(60));
        let s = scope("a");
        cache.insert(&s, &key("k"), record("x"), later(Duration::from_secs(60)));
        assert!(cache.get(&s, &key("k")).is_some());
    }
}
