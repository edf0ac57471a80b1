//! Writing your own `Store`: a decorator that counts what a store is asked
//! to do, wrapped around `MemoryStore`, checked with the conformance suite.
//!
//!     cargo run --example custom_store
//!
//! A store for another database follows the same shape: `claim` arbitrates
//! the key with that database's own unique constraint, `complete` commits
//! the handler's writes and the response together, `abort` rolls back.
//! `src/sqlx/` is one, written for the sqlx driver (feature `sqlx`). The
//! guarantees a store owes, method by method, are in the rustdoc of
//! `tower_idempotency::store::Store`.

use std::sync::{
    atomic::{AtomicU64, Ordering},
    Arc,
};

use tower_idempotency::{
    memory::MemoryStore,
    record::StoredResponse,
    store::{Claim, ClaimRequest, Store, StoreError},
    testing::conformance,
};

/// Counts claims by answer, completions and aborts of the store it wraps.
#[derive(Clone, Debug, Default)]
struct Counted<St> {
    inner: St,
    counts: Arc<Counts>,
}

#[derive(Debug, Default)]
struct Counts {
    owned: AtomicU64,
    completed: AtomicU64,
    in_progress: AtomicU64,
    commits: AtomicU64,
    aborts: AtomicU64,
}

impl<St: Store> Store for Counted<St> {
    // The handler sees the inner store's transaction handle unchanged.
    type Tx = St::Tx;

    async fn claim(&self, request: &ClaimRequest) -> Result<Claim<St::Tx>, StoreError> {
        let claim = self.inner.claim(request).await?;
        let counter = match &claim {
            Claim::Owned(_) => &self.counts.owned,
            Claim::Completed(_) => &self.counts.completed,
            _ => &self.counts.in_progress,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        Ok(claim)
    }

    async fn complete(&self, tx: St::Tx, response: &StoredResponse) -> Result<(), StoreError> {
        self.inner.complete(tx, response).await?;
        self.counts.commits.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    async fn abort(&self, tx: St::Tx) -> Result<(), StoreError> {
        self.counts.aborts.fetch_add(1, Ordering::Relaxed);
        self.inner.abort(tx).await
    }
}

#[tokio::main]
async fn main() {
    let store = Counted {
        inner: MemoryStore::new(),
        counts: Arc::default(),
    };
    // Every guarantee the layer relies on, checked against our store. The
    // handler's writes go through `MemoryTx`, so the inner store says how to
    // write and where to look.
    let report = conformance::run_all_with(store.clone(), store.inner.clone()).await;
    println!("{report}");
    report.assert_passed();
    let c = &store.counts;
    println!(
        "{} claims owned, {} found completed, {} in progress; {} commits, {} aborts",
        c.owned.load(Ordering::Relaxed),
        c.completed.load(Ordering::Relaxed),
        c.in_progress.load(Ordering::Relaxed),
        c.commits.load(Ordering::Relaxed),
        c.aborts.load(Ordering::Relaxed),
    );
}
