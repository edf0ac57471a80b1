//! The replay cache: completed records this process committed, kept in
//! memory for a bounded time so that a retry that comes back to the same
//! process is answered without the database.
//!
//! Never the source of truth: an entry is only ever a copy of a committed
//! record, it never outlives the record's retention (nor the configured
//! TTL), and a miss costs only the normal claim. The one thing a cache
//! cannot see is a record removed by an operator (`remove_key`) or by
//! another process: an entry already cached answers until its TTL ends.
//!
//! Bounded by the bytes it holds, not by a count of entries: one remembered
//! response may be up to 256 MiB, so a count bounds nothing a tenant cannot
//! fill.

use std::{
    collections::hash_map::RandomState,
    hash::{Hash, Hasher},
    mem::size_of,
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use quick_cache::{
    sync::{Cache, DefaultLifecycle},
    Equivalent, OptionsBuilder, Weighter,
};

use crate::{key::IdempotencyKey, record::Record, scope::Scope};

type Key = (Scope, IdempotencyKey);

/// The replay cache's settings, for
/// [`IdempotencyLayer::replay_cache`](crate::IdempotencyLayer::replay_cache):
/// how many bytes it may hold, and how long an entry answers.
///
/// The budget counts what an entry keeps alive: the response body, its
/// remembered headers and trailers, the resource id, the tenant and the
/// key, plus a fixed allowance for the entry's own structures. One entry
/// may take at most a 64th of the budget
/// ([`max_entry_bytes`](Self::max_entry_bytes): 1 MiB of the default
/// 64 MiB); a heavier answer is not cached, and its retries replay from
/// the store. As the key, headers and allowance count too, an answer of
/// exactly the default
/// [`response_body_limit`](crate::IdempotencyLayer::response_body_limit)
/// (1 MiB) is just over it with the default budget.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::ReplayCache;
///
/// let cache = ReplayCache::new(16 * 1024 * 1024).ttl(Duration::from_secs(30));
/// assert_eq!(cache.max_entry_bytes(), 256 * 1024);
/// assert_eq!(ReplayCache::default().max_bytes(), 64 * 1024 * 1024);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayCache {
    max_bytes: u64,
    ttl: Duration,
}

impl ReplayCache {
    /// The default budget: 64 MiB per layer.
    pub const DEFAULT_MAX_BYTES: u64 = 64 * 1024 * 1024;
    /// The default time an entry answers: 60 s.
    pub const DEFAULT_TTL: Duration = Duration::from_secs(60);
    /// The share of the budget one entry may take. Small enough that a few
    /// large answers cannot push out everything else (a shard holds four
    /// of the largest), large enough that the default budget keeps answers
    /// up to about the default response limit.
    const ENTRY_SHARE: u64 = 64;

    /// A cache of at most `max_bytes` (0 turns it off), whose entries answer
    /// for 60 s.
    pub fn new(max_bytes: u64) -> Self {
        ReplayCache {
            max_bytes,
            ttl: Self::DEFAULT_TTL,
        }
    }

    /// How long an entry answers at most (default 60 s; zero turns the
    /// cache off). An entry never outlives its record's retention either,
    /// so a `ttl` above 100 years (the longest retention) is clamped to it.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl.min(crate::store::MAX_RETENTION);
        self
    }

    /// The budget, in bytes.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// The largest entry kept, in bytes: a 64th of the budget.
    pub fn max_entry_bytes(&self) -> u64 {
        self.max_bytes / Self::ENTRY_SHARE
    }
}

impl Default for ReplayCache {
    /// 64 MiB for at most 60 s.
    fn default() -> Self {
        ReplayCache::new(Self::DEFAULT_MAX_BYTES)
    }
}

/// The shards the cache is split into, whatever the machine. quick_cache
/// refuses an item heavier than about its shard's capacity and defaults to
/// four shards per core: on 64 cores a 64 MiB cache would refuse every
/// answer above 256 KiB. With 16, a shard holds four of the largest
/// entries.
const SHARDS: u64 = 16;

/// What an entry costs beyond the bytes it counts one by one: the entry,
/// its key and record, the `Arc`'s counts, and the cache's slot and index
/// for it.
const ENTRY_OVERHEAD: u64 =
    (size_of::<Key>() + size_of::<Entry>() + size_of::<Record>() + 64) as u64;

/// The entry sizes the cache's bookkeeping is planned for (it only sizes
/// the record of recently evicted keys, which lives outside the budget:
/// half this many hashes).
const TYPICAL_ENTRY: u64 = 4096;

/// The cache of one layer (shared by every service it makes).
#[derive(Clone)]
pub(crate) struct RecordCache {
    // std's keyed SipHash, random per cache (tenants choose the keys), named
    // rather than quick_cache's default hasher, which turns into ahash when
    // any crate in the build turns on quick_cache's `ahash` feature.
    entries: Arc<Cache<Key, Entry, ByWeight, RandomState>>,
    ttl: Duration,
    max_entry: u64,
}

#[derive(Clone)]
struct Entry {
    record: Arc<Record>,
    /// The first request as [`Repeat`] keeps it, when its fingerprint
    /// depends on nothing else.
    first: Option<Bytes>,
    /// When the entry stops answering: its record's retention end (by this
    /// process's clock: the instant taken before its commit, so never later
    /// than the database's), or the TTL after it was cached, the sooner.
    until: Instant,
    /// Weighed once, as it goes in: the cache asks again while it evicts.
    weight: u64,
}

/// Weighs an entry by the bytes it keeps alive.
#[derive(Clone, Copy)]
struct ByWeight;

impl Weighter<Key, Entry> for ByWeight {
    fn weight(&self, _key: &Key, entry: &Entry) -> u64 {
        entry.weight
    }
}

/// The bytes an entry for `record` under `key` keeps alive.
fn weigh(scope: &Scope, key: &IdempotencyKey, record: &Record) -> u64 {
    let pairs = |pairs: &[(HeaderName, HeaderValue)]| -> u64 {
        pairs
            .iter()
            .map(|(name, value)| {
                (size_of::<(HeaderName, HeaderValue)>() + name.as_str().len() + value.len()) as u64
            })
            .sum()
    };
    let response = &record.response;
    let resource = response
        .resource_id
        .as_ref()
        .map_or(0, |id| id.as_str().len());
    ENTRY_OVERHEAD
        + (scope.tenant().as_str().len() + key.as_str().len() + resource) as u64
        + response.body.len() as u64
        + pairs(&response.headers)
        + pairs(&response.trailers)
}

/// A request as it must be repeated, byte for byte, to be answered from
/// the cache without being fingerprinted again: its method, its target
/// (path and query) and its message, in one buffer. Made only for a
/// fingerprinter whose fingerprint depends on nothing else
/// ([`Fingerprinter::depends_on_body_only`](crate::fingerprint::Fingerprinter::depends_on_body_only)):
/// the same bytes then have the same fingerprint, so they are the same
/// request. Bytes that differ (a retry with its members in another order)
/// are fingerprinted and compared as usual.
pub(crate) struct Repeat(Bytes);

impl Repeat {
    /// `method`, `target` and `message` in a buffer of their own.
    pub(crate) fn new(method: &http::Method, target: &str, message: &[u8]) -> Self {
        let method = method.as_str().as_bytes();
        let mut buffer = Vec::with_capacity(method.len() + target.len() + message.len() + 2);
        for part in [method, b" ", target.as_bytes(), b"\n", message] {
            buffer.extend_from_slice(part);
        }
        Repeat(buffer.into())
    }

    /// Whether `method`, `target` and `message` are these, byte for byte.
    /// (A target holds no line break, so the split is unambiguous.)
    fn is(first: &[u8], method: &http::Method, target: &str, message: &[u8]) -> bool {
        let method = method.as_str().as_bytes();
        let len = method.len() + target.len() + message.len() + 2;
        first.len() == len
            && first[..method.len()] == *method
            && first[method.len()] == b' '
            && first[method.len() + 1..][..target.len()] == *target.as_bytes()
            && first[method.len() + 1 + target.len()] == b'\n'
            && first[len - message.len()..] == *message
    }
}

/// A record the cache answers with, and the first request's bytes when
/// they were kept ([`Repeat`]).
pub(crate) struct Hit {
    pub(crate) record: Arc<Record>,
    first: Option<Bytes>,
}

impl Hit {
    /// Whether the request is the first one again, byte for byte (and so
    /// has its fingerprint).
    pub(crate) fn repeats(&self, method: &http::Method, target: &str, message: &[u8]) -> bool {
        self.first
            .as_deref()
            .is_some_and(|first| Repeat::is(first, method, target, message))
    }
}

/// `pairs` in buffers of their own. A header value may be a view into a
/// larger buffer (a client's read buffer, when the handler proxies), which
/// the entry would keep alive without counting it.
fn own_pairs(pairs: &[(HeaderName, HeaderValue)]) -> Vec<(HeaderName, HeaderValue)> {
    pairs
        .iter()
        .map(|(name, value)| {
            let owned = HeaderValue::from_maybe_shared(Bytes::copy_from_slice(value.as_bytes()))
                .map(|mut owned| {
                    owned.set_sensitive(value.is_sensitive());
                    owned
                })
                // Cannot fail (the bytes are a valid value's); the original
                // is as good, only not weighed exactly.
                .unwrap_or_else(|_| value.clone());
            (name.clone(), owned)
        })
        .collect()
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
    /// A cache as `settings` say, or none when they turn it off.
    pub(crate) fn new(settings: ReplayCache) -> Option<Self> {
        if settings.max_bytes == 0 || settings.ttl.is_zero() {
            return None;
        }
        // Each shard gets an equal part: rounded down so that the parts add
        // up to no more than the budget.
        let max_bytes = settings.max_bytes - settings.max_bytes % SHARDS;
        let typical = usize::try_from(max_bytes / TYPICAL_ENTRY).unwrap_or(usize::MAX);
        let options = OptionsBuilder::new()
            .shards(SHARDS as usize)
            .weight_capacity(max_bytes)
            .estimated_items_capacity(typical.clamp(1, 1 << 18))
            .build()
            // Fails only on a setting left out, and all are set above.
            .ok()?;
        let entries = Cache::with_options(
            options,
            ByWeight,
            RandomState::new(),
            DefaultLifecycle::default(),
        );
        Some(RecordCache {
            entries: Arc::new(entries),
            ttl: settings.ttl,
            max_entry: settings.max_entry_bytes(),
        })
    }

    /// The cached record of `key`, if any and still answering.
    #[cfg(test)]
    pub(crate) fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Option<Arc<Record>> {
        self.hit(scope, key).map(|hit| hit.record)
    }

    /// The cached record of `key` and the request that made it, if any and
    /// still answering.
    pub(crate) fn hit(&self, scope: &Scope, key: &IdempotencyKey) -> Option<Hit> {
        let lookup = Lookup(scope, key);
        let entry = self.entries.get(&lookup)?;
        if entry.until > Instant::now() {
            return Some(Hit {
                record: entry.record,
                first: entry.first,
            });
        }
        self.entries.remove(&lookup);
        None
    }

    /// Keeps a copy of `record` until `expires` (or the TTL, or until
    /// evicted), unless it weighs more than an entry may.
    #[cfg(test)]
    pub(crate) fn insert(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        record: &Record,
        expires: Instant,
    ) {
        self.insert_with(scope, key, record, None, expires);
    }

    /// [`insert`](Self::insert), with the request that made the record if
    /// kept ([`Repeat`]).
    pub(crate) fn insert_with(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        record: &Record,
        first: Option<Repeat>,
        expires: Instant,
    ) {
        let first = first.map(|Repeat(bytes)| bytes);
        let weight = weigh(scope, key, record) + first.as_ref().map_or(0, |b| b.len() as u64);
        if weight > self.max_entry {
            // Its retries read the store. An entry left under the key is
            // an expired record's (or it would have answered): gone too.
            self.entries.remove(&Lookup(scope, key));
            return;
        }
        let until = Instant::now()
            .checked_add(self.ttl)
            .map_or(expires, |ttl_end| ttl_end.min(expires));
        let response = &record.response;
        // The body in a buffer of its own, so that the entry keeps alive
        // what it is weighed by: the handler's `Bytes` may be a view into a
        // larger allocation (a `Vec` grown past its length, a read buffer).
        let copy = Record {
            fingerprint: record.fingerprint,
            response: crate::record::StoredResponse {
                status: response.status,
                headers: own_pairs(&response.headers),
                body: Bytes::copy_from_slice(&response.body),
                resource_id: response.resource_id.clone(),
                trailers: own_pairs(&response.trailers),
                trace_id: response.trace_id,
                span_id: response.span_id,
            },
        };
        let entry = Entry {
            record: Arc::new(copy),
            first,
            until,
            weight,
        };
        self.entries.insert((scope.clone(), key.clone()), entry);
    }
}

#[cfg(test)]
impl RecordCache {
    /// How many entries the cache holds now.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// What the cache holds now, by its weigher, in bytes.
    pub(crate) fn weight(&self) -> u64 {
        self.entries.weight()
    }

    /// The bytes the cached records' bodies hold now.
    pub(crate) fn held_bytes(&self) -> u64 {
        self.entries
            .iter()
            .map(|(_, entry)| entry.record.response.body.len() as u64)
            .sum()
    }
}

impl std::fmt::Debug for RecordCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordCache")
            .field("entries", &self.entries.len())
            .field("bytes", &self.entries.weight())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use http::{HeaderMap, StatusCode};

    use super::*;
    use crate::{fingerprint::Fingerprint, record::StoredResponse, scope::TenantId};

    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * KIB;

    fn record_of(body: Bytes) -> Record {
        Record {
            fingerprint: Fingerprint::from_bytes([7; 32]),
            response: StoredResponse::new(StatusCode::CREATED, &HeaderMap::new(), &[], body),
        }
    }

    fn record(body: &'static str) -> Record {
        record_of(Bytes::from_static(body.as_bytes()))
    }

    fn cache(max_bytes: u64, ttl: Duration) -> RecordCache {
        RecordCache::new(ReplayCache::new(max_bytes).ttl(ttl)).expect("on")
    }

    /// A request kept to be repeated matches only itself: every part
    /// counts, and moving bytes between the target and the message does
    /// not make another request look the same.
    #[test]
    fn a_repeat_matches_only_the_same_request() {
        use http::Method;
        let first = Repeat::new(&Method::POST, "/orders?a=1", b"{\"a\":1}");
        let is = |method: &Method, target: &str, message: &[u8]| {
            Repeat::is(&first.0, method, target, message)
        };
        assert!(is(&Method::POST, "/orders?a=1", b"{\"a\":1}"));
        assert!(!is(&Method::PUT, "/orders?a=1", b"{\"a\":1}"));
        assert!(!is(&Method::POST, "/orders?a=2", b"{\"a\":1}"));
        assert!(!is(&Method::POST, "/orders?a=1", b"{\"a\":2}"));
        assert!(!is(&Method::POST, "/orders?a=1{", b"\"a\":1}"));
        assert!(!is(&Method::POST, "/orders?a=1", b"{\"a\":1} "));
        assert!(!is(&Method::POST, "/orders?a=1", b""));
        let weighed = cache(MIB, Duration::from_secs(60));
        let s = scope("a");
        let hour = Instant::now() + Duration::from_secs(3600);
        weighed.insert_with(&s, &key("kept"), &record("x"), Some(first), hour);
        weighed.insert(&s, &key("plain"), &record("x"), hour);
        let kept = weighed.hit(&s, &key("kept")).expect("cached");
        assert!(kept.repeats(&Method::POST, "/orders?a=1", b"{\"a\":1}"));
        let plain = weighed.hit(&s, &key("plain")).expect("cached");
        assert!(!plain.repeats(&Method::POST, "/orders?a=1", b"{\"a\":1}"));
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
        let cache = cache(MIB, Duration::from_secs(60));
        let hour = later(Duration::from_secs(3600));
        cache.insert(&scope("a"), &key("k1"), &record("first"), hour);
        cache.insert(&scope("b"), &key("k1"), &record("other tenant"), hour);
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
        let cache = cache(MIB, Duration::from_secs(60));
        let s = scope("a");
        cache.insert(&s, &key("past"), &record("x"), Instant::now());
        assert!(cache.get(&s, &key("past")).is_none(), "retention over");
        assert_eq!(cache.len(), 0, "dropped when found expired");

        let short = self::cache(MIB, Duration::from_nanos(1));
        short.insert(
            &s,
            &key("ttl"),
            &record("x"),
            later(Duration::from_secs(3600)),
        );
        assert!(short.get(&s, &key("ttl")).is_none(), "ttl over");

        cache.insert(
            &s,
            &key("live"),
            &record("x"),
            later(Duration::from_secs(3600)),
        );
        assert!(cache.get(&s, &key("live")).is_some());
    }

    /// The longest TTL does not overflow the clock: the retention bounds it.
    #[test]
    fn the_longest_ttl_is_bounded_by_the_retention() {
        let cache = cache(MIB, Duration::MAX);
        let s = scope("a");
        cache.insert(&s, &key("k"), &record("x"), later(Duration::from_secs(60)));
        assert!(cache.get(&s, &key("k")).is_some());
        cache.insert(&s, &key("gone"), &record("x"), Instant::now());
        assert!(cache.get(&s, &key("gone")).is_none());
    }

    /// A zero budget or TTL turns the cache off.
    #[test]
    fn a_zero_budget_or_ttl_is_no_cache() {
        assert!(RecordCache::new(ReplayCache::new(0)).is_none());
        assert!(RecordCache::new(ReplayCache::default().ttl(Duration::ZERO)).is_none());
    }

    /// The cache holds at most its budget in bytes, whatever is inserted,
    /// and uses it: it is not bounded by a count.
    #[test]
    fn the_cache_holds_at_most_its_budget() {
        let budget = MIB;
        let cache = cache(budget, Duration::from_secs(60));
        let s = scope("a");
        let hour = later(Duration::from_secs(3600));
        for i in 0..1000 {
            let body = Bytes::from(vec![b'x'; 10 * KIB as usize]);
            cache.insert(&s, &key(&format!("k{i}")), &record_of(body), hour);
            assert!(cache.weight() <= budget, "{} over {budget}", cache.weight());
        }
        let (held, weight) = (cache.held_bytes(), cache.weight());
        assert!(held <= weight, "the weight counts every body byte");
        assert!(
            weight >= budget / 2,
            "it keeps what fits: {weight} of {budget}"
        );
        let small = self::cache(budget, Duration::from_secs(60));
        for i in 0..1000 {
            small.insert(&s, &key(&format!("k{i}")), &record("x"), hour);
        }
        assert!(small.len() > 1000 / 2, "small entries: {}", small.len());
    }

    /// An answer that weighs more than a 64th of the budget is not cached,
    /// and one at the limit is, in every shard: the cache crate's own limit
    /// (about a shard's capacity) is never the one that decides.
    #[test]
    fn an_answer_above_the_entry_limit_is_not_cached() {
        let settings = ReplayCache::new(4 * MIB);
        assert_eq!(settings.max_entry_bytes(), 64 * KIB);
        let cache = RecordCache::new(settings).expect("on");
        let s = scope("a");
        let hour = later(Duration::from_secs(3600));
        let large = record_of(Bytes::from(vec![b'x'; 64 * KIB as usize]));
        cache.insert(&s, &key("large"), &large, hour);
        assert!(cache.get(&s, &key("large")).is_none(), "not cached");
        assert_eq!(cache.weight(), 0);

        for i in 0..64 {
            let k = key(&format!("at-the-limit-{i}"));
            let fixed = weigh(&s, &k, &record(""));
            let body = vec![b'x'; (settings.max_entry_bytes() - fixed) as usize];
            let at_limit = record_of(Bytes::from(body));
            assert_eq!(weigh(&s, &k, &at_limit), settings.max_entry_bytes());
            cache.insert(&s, &k, &at_limit, hour);
            assert!(cache.get(&s, &k).is_some(), "cached at the limit");
        }

        // A larger answer under a key whose entry is still there (an
        // expired record's) takes that entry away too.
        let k = key("replaced");
        cache.insert(&s, &k, &record("old"), hour);
        cache.insert(&s, &k, &large, hour);
        assert!(cache.get(&s, &k).is_none());
    }

    /// A body that is a view into a larger buffer is kept as a copy of its
    /// own bytes: the entry does not keep the larger buffer alive.
    #[test]
    fn an_entry_keeps_only_its_own_bytes() {
        let cache = cache(MIB, Duration::from_secs(60));
        let s = scope("a");
        let large = Bytes::from(vec![b'x'; 512 * KIB as usize]);
        let view = large.slice(..10);
        cache.insert(
            &s,
            &key("k"),
            &record_of(view.clone()),
            later(Duration::from_secs(60)),
        );
        let found = cache.get(&s, &key("k")).expect("cached");
        assert_eq!(found.response.body, view);
        assert_ne!(found.response.body.as_ptr(), view.as_ptr(), "a copy");
        assert!(cache.weight() < 1024, "weighed by its own bytes");
    }

    /// The largest budget a caller can give allocates nothing up front.
    #[test]
    fn the_largest_budget_allocates_lazily() {
        let cache = cache(u64::MAX, Duration::from_secs(60));
        let s = scope("a");
        cache.insert(&s, &key("k"), &record("x"), later(Duration::from_secs(60)));
        assert!(cache.get(&s, &key("k")).is_some());
    }
}
