//! [`MemoryStore`]: the store contract in memory.
//!
//! For unit tests of services behind the layer, demos, and as the reference a
//! custom store can be read against. Nothing survives the process. Time is
//! `tokio::time`, so tests can pause and advance it to exercise expiry.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard},
};

use serde_json::Value;
use tokio::{sync::watch, time::Instant};

use crate::store::{Claim, ClaimRequest, Store, StoreError, StoreErrorKind};
use crate::{
    key::IdempotencyKey,
    record::{Record, StoredResponse},
    scope::Scope,
};

type EntryKey = (Scope, IdempotencyKey);

/// An in-memory [`Store`] whose transaction handle, [`MemoryTx`], stages
/// JSON rows that become visible only when the operation completes.
///
/// ```
/// use tower_idempotency::memory::MemoryStore;
///
/// let store = MemoryStore::new();
/// assert!(store.rows("orders").is_empty());
/// ```
#[derive(Clone, Debug, Default)]
pub struct MemoryStore {
    state: Arc<Mutex<State>>,
}

#[derive(Debug, Default)]
struct State {
    entries: HashMap<EntryKey, Entry>,
    tables: HashMap<String, Vec<Value>>,
    next_token: u64,
}

#[derive(Debug)]
enum Entry {
    InProgress {
        token: u64,
        // Dropped when the owner finishes, which wakes every waiter.
        _done: watch::Sender<()>,
        done_rx: watch::Receiver<()>,
    },
    Completed {
        record: Record,
        expires_at: Instant,
    },
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// The committed rows of `table`, in commit order.
    pub fn rows(&self, table: &str) -> Vec<Value> {
        lock(&self.state)
            .tables
            .get(table)
            .cloned()
            .unwrap_or_default()
    }

    /// How many completed records the store remembers (expired ones included
    /// until they are taken over).
    pub fn completed_records(&self) -> usize {
        lock(&self.state)
            .entries
            .values()
            .filter(|e| matches!(e, Entry::Completed { .. }))
            .count()
    }
}

// A poisoned lock only means another test thread panicked; the map itself is
// always left consistent, so keep going.
fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Store for MemoryStore {
    type Tx = MemoryTx;

    async fn claim(&self, request: &ClaimRequest) -> Result<Claim<MemoryTx>, StoreError> {
        let entry_key = (request.scope.clone(), request.key.clone());
        let deadline = Instant::now() + request.wait;
        loop {
            let mut done_rx = {
                let mut state = lock(&self.state);
                match state.entries.get(&entry_key) {
                    Some(Entry::Completed { record, expires_at })
                        if *expires_at > Instant::now() =>
                    {
                        return Ok(Claim::Completed(record.clone()));
                    }
                    Some(Entry::InProgress { done_rx, .. }) => done_rx.clone(),
                    // Absent or expired: a new operation.
                    _ => {
                        state.next_token += 1;
                        let token = state.next_token;
                        let (done, done_rx) = watch::channel(());
                        state.entries.insert(
                            entry_key.clone(),
                            Entry::InProgress {
                                token,
                                _done: done,
                                done_rx,
                            },
                        );
                        return Ok(Claim::Owned(MemoryTx {
                            inner: Arc::new(TxInner {
                                state: self.state.clone(),
                                entry_key,
                                token,
                                fingerprint: request.fingerprint,
                                retention: request.retention,
                                staged: Mutex::new(Some(Vec::new())),
                            }),
                        }));
                    }
                }
            };
            // `changed` fails once the owner's sender is dropped: it finished.
            if tokio::time::timeout_at(deadline, done_rx.changed())
                .await
                .is_err()
            {
                return Ok(Claim::InProgress);
            }
        }
    }

    async fn complete(&self, tx: MemoryTx, response: &StoredResponse) -> Result<(), StoreError> {
        let staged = tx.take_staged()?;
        let mut state = lock(&self.state);
        let inner = &tx.inner;
        match state.entries.get(&inner.entry_key) {
            Some(Entry::InProgress { token, .. }) if *token == inner.token => {}
            _ => {
                return Err(StoreError::new(
                    StoreErrorKind::TransactionAborted,
                    "the key is no longer owned by this transaction",
                ))
            }
        }
        for (table, row) in staged {
            state.tables.entry(table).or_default().push(row);
        }
        let expires_at = Instant::now() + inner.retention;
        let record = Record {
            fingerprint: inner.fingerprint,
            response: response.clone(),
        };
        state.entries.insert(
            inner.entry_key.clone(),
            Entry::Completed { record, expires_at },
        );
        Ok(())
    }

    async fn abort(&self, tx: MemoryTx) -> Result<(), StoreError> {
        // Aborting a finished transaction is a no-op, as with PostgreSQL.
        if tx.take_staged().is_ok() {
            tx.inner.release();
        }
        Ok(())
    }
}

/// The transaction handle of a [`MemoryStore`] owner.
///
/// Rows staged with [`insert`](Self::insert) become visible in
/// [`MemoryStore::rows`] only when the operation completes; an abort, or
/// dropping every clone of the handle unfinished, discards them and frees the key.
#[derive(Clone, Debug)]
pub struct MemoryTx {
    inner: Arc<TxInner>,
}

#[derive(Debug)]
struct TxInner {
    state: Arc<Mutex<State>>,
    entry_key: EntryKey,
    token: u64,
    fingerprint: crate::fingerprint::Fingerprint,
    retention: std::time::Duration,
    staged: Mutex<Option<Vec<(String, Value)>>>,
}

impl MemoryTx {
    /// Stages a row for `table`, committed with the remembered response.
    pub fn insert(&self, table: &str, row: Value) -> Result<(), StoreError> {
        let mut staged = self.inner.staged.lock().unwrap_or_else(|p| p.into_inner());
        match staged.as_mut() {
            Some(rows) => {
                rows.push((table.to_owned(), row));
                Ok(())
            }
            None => Err(finished()),
        }
    }

    /// The rows staged for `table` so far, as this transaction sees them.
    pub fn staged_rows(&self, table: &str) -> Vec<Value> {
        let staged = self.inner.staged.lock().unwrap_or_else(|p| p.into_inner());
        staged
            .iter()
            .flatten()
            .filter(|(t, _)| t == table)
            .map(|(_, row)| row.clone())
            .collect()
    }

    fn take_staged(&self) -> Result<Vec<(String, Value)>, StoreError> {
        let mut staged = self.inner.staged.lock().unwrap_or_else(|p| p.into_inner());
        staged.take().ok_or_else(finished)
    }
}

fn finished() -> StoreError {
    StoreError::new(
        StoreErrorKind::TransactionAborted,
        "the transaction has already finished",
    )
}

impl TxInner {
    /// Frees the key if this transaction still owns it.
    fn release(&self) {
        let mut state = lock(&self.state);
        if matches!(state.entries.get(&self.entry_key), Some(Entry::InProgress { token, .. }) if *token == self.token)
        {
            state.entries.remove(&self.entry_key);
        }
    }
}

impl Drop for TxInner {
    fn drop(&mut self) {
        // Every handle is gone without complete/abort (a panicking handler, a
        // leaked clone): roll back, like PostgreSQL does for a closed connection.
        let unfinished = self.staged.get_mut().map(|s| s.is_some()).unwrap_or(true);
        if unfinished {
            self.release();
        }
    }
}
