//! The store side of the one-commit mode
//! ([`IdempotencyLayer::claim_at_commit`](crate::IdempotencyLayer::claim_at_commit)):
//! the key is claimed by the commit itself.

use std::future::Future;

use super::{ClaimRequest, Store, StoreError};
use crate::record::{Record, StoredResponse};

/// A [`Store`] that can also decide a key at commit time: the one-commit
/// mode's two steps.
///
/// In the claim-first mode the claim decides the owner before the handler
/// runs. Here nothing is claimed first: [`begin`](Self::begin) opens the
/// transaction the handler writes through, and [`commit`](Self::commit)
/// inserts the key's completed record with the response and commits it
/// with the handler's writes, unless the key is already remembered, in
/// which case everything the handler wrote is rolled back. Duplicates that
/// reach the store at the same time may each run the handler; exactly one
/// commit wins. That is sound only when every effect of the handler is in
/// the transaction (see [the guide](crate::guide::modes)).
///
/// A transaction that ends another way (an error, a `5xx`, a timeout) ends
/// with [`Store::abort`], as in the claim-first mode, and dropping every clone
/// of its handle unfinished must act as that abort.
///
/// The conformance suite's [`run_at_commit`](crate::testing::conformance::run_at_commit)
/// checks an implementation (feature `test-util`).
pub trait CommitStore: Store {
    /// Opens the transaction an owner's handler writes through, for
    /// `request`'s key, without claiming the key: nothing is held, nothing
    /// is read. A SQL store may defer the `BEGIN` until the handler's first
    /// statement, so that it costs no round trip of its own.
    ///
    /// **Errors.** [`StoreErrorKind::Unavailable`](super::StoreErrorKind::Unavailable)
    /// when no connection could be had in time.
    fn begin(
        &self,
        request: &ClaimRequest,
    ) -> impl Future<Output = Result<Self::Tx, StoreError>> + Send;

    /// Remembers `response` under `request`'s key and commits it with every
    /// write made through `tx`, if the key is free.
    ///
    /// **Atomic with what.** The insert of the key's record and the commit
    /// are one step that the backend's uniqueness of the key arbitrates (a
    /// unique index, a compare-and-set): of any number of concurrent
    /// commits of one key, exactly one returns [`Committed::Won`], and
    /// never one while the key has an unexpired record. A free key is one
    /// with no record, one whose retention ended, or one left in progress by
    /// no live owner, as for [`Store::claim`]. The record is remembered for
    /// [`ClaimRequest::retention`] from this commit.
    ///
    /// **Answers.**
    /// - [`Committed::Won`]: the record and the handler's writes are durable.
    /// - [`Committed::Lost`]: the key already had a record (or another
    ///   commit won meanwhile, which the store waits for): nothing of `tx`
    ///   was committed, and this is the winner's record, with the
    ///   fingerprint of the request that made it. The layer compares it.
    /// - [`Committed::Held`]: the key is held by an unfinished owner of the
    ///   other modes (an endpoint switched modes while requests ran):
    ///   nothing of `tx` was committed.
    /// - [`Committed::Freed`]: the key was free only by a record it had to
    ///   remove first (expired, or an orphan): nothing of `tx` was
    ///   committed; run the work again. `PgStore` and `SqlxStore` answer
    ///   so, which spares every create the cost of a takeover rule in its
    ///   insert.
    ///
    /// **Errors.** As [`Store::complete`]: nothing was committed and the
    /// key is as it was, except for
    /// [`StoreErrorKind::OutcomeUnknown`](super::StoreErrorKind::OutcomeUnknown).
    fn commit(
        &self,
        tx: Self::Tx,
        request: &ClaimRequest,
        response: &StoredResponse,
    ) -> impl Future<Output = Result<Committed, StoreError>> + Send;
}

/// How a [`CommitStore::commit`] ended.
#[derive(Debug)]
#[non_exhaustive]
pub enum Committed {
    /// This commit claimed the key: its record and writes are durable.
    Won,
    /// The key was already remembered: everything written through the
    /// transaction was rolled back. The remembered record.
    Lost(Record),
    /// The key is held by an unfinished owner of another mode: everything
    /// written through the transaction was rolled back.
    Held,
    /// The key's record had expired (or was left in progress by no live
    /// owner), and is now removed: everything written through the
    /// transaction was rolled back, and the key is free. The caller runs
    /// the work again, in a new transaction, whose commit decides as any
    /// other. The layer does so once per request; a store may instead take
    /// the key over inside [`commit`](CommitStore::commit) and answer
    /// [`Committed::Won`], as [`MemoryStore`](crate::memory::MemoryStore)
    /// does.
    Freed,
}
