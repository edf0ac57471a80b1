//! [`MemoryStore`]: the store contract in memory.
//!
//! For unit tests of services behind the layer, demos, and as the reference a
//! custom store can be read against. Nothing survives the process. Time is
//! `tokio::time`, so tests can pause and advance it to exercise expiry.
//!
//! Every mode is implemented: [`Store`] for the short transaction, with
//! [`MemoryTx`] as the handle the handler writes through, [`CommitStore`]
//! for the one-commit mode with the same handle, and [`LeaseStore`] for
//! long-running operations, with [`MemoryLease`] as the lease handle and
//! fenced [`MemoryTx`]s for the owner's writes.

use std::{
    collections::HashMap,
    fmt,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, MutexGuard,
    },
    time::Duration,
};

use serde_json::Value;
use tokio::{sync::watch, time::Instant};

use crate::store::{
    Acquired, Backoff, Claim, ClaimRequest, CommitStore, Committed, LeaseRequest, LeaseStore,
    Operation, OperationState, Owned, Recovered, Store, StoreError, StoreErrorKind, StoredRequest,
};
use crate::{
    fingerprint::Fingerprint,
    key::IdempotencyKey,
    record::{Record, StoredResponse},
    scope::{Scope, TenantId},
    store::OperationId,
};

mod commit;
mod lease;
#[cfg(test)]
mod tests;
mod tx;

pub use lease::MemoryLease;
pub use tx::MemoryTx;
use tx::{failed, TxKind};

type EntryKey = (Scope, IdempotencyKey);

/// An in-memory [`Store`], [`CommitStore`] and [`LeaseStore`].
///
/// In the claim-first mode its transaction handle, [`MemoryTx`], stages JSON rows
/// that become visible only when the operation completes. In the
/// long-running mode the owner's handler finds a [`MemoryLease`] in its
/// request extensions; rows it stages in a fenced transaction
/// ([`MemoryLease::transaction`]) become visible at
/// [`commit_fenced`](LeaseStore::commit_fenced), and only while the lease's
/// attempt token is still the record's.
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

#[derive(Debug)]
struct State {
    entries: HashMap<EntryKey, Entry>,
    tables: HashMap<String, Vec<Value>>,
    // One counter for every key and both modes, never reset: a token handed
    // out is larger than every earlier one, also after its record was removed.
    next_token: i64,
    // Sent whenever a leased record is finished or released or stops being
    // held by a fenced transaction: what a claim or acquire that waits on a
    // leased record waits for. Receivers subscribe under the state lock, so
    // none misses a change made after it looked.
    lease_changes: watch::Sender<()>,
}

impl Default for State {
    fn default() -> Self {
        State {
            entries: HashMap::new(),
            tables: HashMap::new(),
            next_token: 0,
            lease_changes: watch::Sender::new(()),
        }
    }
}

#[derive(Debug)]
enum Entry {
    /// A short-mode owner's open transaction.
    InProgress {
        token: i64,
        // Dropped when the owner finishes, which wakes every waiter.
        _done: watch::Sender<()>,
        done_rx: watch::Receiver<()>,
    },
    /// A long-running operation, committed with a lease.
    Leased(Leased),
    Completed {
        record: Record,
        expires_at: Instant,
        // Set when a long-running operation ended, so that its status
        // resource can still find it.
        operation: Option<Ended>,
    },
}

/// How a long-running operation ended, for its status resource.
#[derive(Debug, Clone, Copy)]
struct Ended {
    id: OperationId,
    attempts: u32,
    // After its last allowed attempt, without an answer.
    failed: bool,
}

#[derive(Debug)]
struct Leased {
    token: i64,
    operation_id: OperationId,
    fingerprint: Fingerprint,
    // What a recovery worker re-drives.
    request: StoredRequest,
    lease_expires_at: Instant,
    // The record itself is forgotten after this (never before the lease
    // runs out).
    expires_at: Instant,
    // How long the answer is remembered once finished.
    retention: Duration,
    // Fenced transactions open at `token`. While any is open, no takeover:
    // a fenced transaction's check and its commit must see the same owner.
    holds: usize,
    // Attempts so far: the first run, takeovers, recoveries.
    attempts: u32,
}

impl Leased {
    /// Moves the record to a new owner under `token`, leased for `lease`.
    fn take_over(&mut self, token: i64, lease: Duration, retention: Duration, now: Instant) {
        debug_assert_eq!(self.holds, 0, "a held record is never taken over");
        self.token = token;
        self.lease_expires_at = now + lease;
        self.expires_at = self.expires_at.max(self.lease_expires_at + retention);
        self.retention = retention;
        self.attempts = self.attempts.saturating_add(1);
    }
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

    /// Refuses a lease or fenced transaction of another `MemoryStore`: its
    /// token could equal one of ours by chance, as every store counts from 1.
    fn check_same(&self, state: &Arc<Mutex<State>>) -> Result<(), StoreError> {
        if Arc::ptr_eq(&self.state, state) {
            Ok(())
        } else {
            Err(StoreError::new(
                StoreErrorKind::Backend,
                "the lease belongs to another MemoryStore",
            ))
        }
    }

    fn owned(&self, entry_key: EntryKey, leased: &Leased) -> Owned<MemoryLease> {
        let lease = MemoryLease::new(self.state.clone(), entry_key, leased);
        Owned::new(lease, leased.operation_id, leased.token, leased.attempts)
    }
}

// A poisoned lock only means another test thread panicked; the map itself is
// always left consistent, so keep going.
fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn issue_token(next_token: &mut i64) -> i64 {
    *next_token += 1;
    *next_token
}

/// The leased record `token` still owns.
fn leased_mut<'a>(
    entries: &'a mut HashMap<EntryKey, Entry>,
    entry_key: &EntryKey,
    token: i64,
) -> Result<&'a mut Leased, StoreError> {
    match entries.get_mut(entry_key) {
        Some(Entry::Leased(leased)) if leased.token == token => Ok(leased),
        _ => Err(fenced()),
    }
}

fn fenced() -> StoreError {
    StoreError::new(
        StoreErrorKind::Fenced,
        "the lease's token is no longer the record's (taken over, finished or released)",
    )
}

impl Store for MemoryStore {
    type Tx = MemoryTx;

    async fn claim(&self, request: &ClaimRequest) -> Result<Claim<MemoryTx>, StoreError> {
        let entry_key = (request.scope.clone(), request.key.clone());
        let deadline = Instant::now() + request.wait;
        loop {
            // When to look again without being told: a lease running out.
            let mut recheck = deadline;
            let mut changed = {
                let mut state = lock(&self.state);
                let now = Instant::now();
                match state.entries.get(&entry_key) {
                    Some(Entry::Completed {
                        record, expires_at, ..
                    }) if *expires_at > now => {
                        return Ok(Claim::Completed(record.clone()));
                    }
                    Some(Entry::InProgress { done_rx, .. }) => done_rx.clone(),
                    // A long-running operation under a live lease is never
                    // taken over here: wait for it to finish or be released,
                    // as for a short owner. One held by a fenced write waits
                    // for the write.
                    Some(Entry::Leased(leased))
                        if leased.holds > 0 || leased.lease_expires_at > now =>
                    {
                        recheck = recheck.min(leased.lease_expires_at);
                        state.lease_changes.subscribe()
                    }
                    // Absent or expired, or a long-running operation whose
                    // lease expired: a new operation. The abandoned one is
                    // taken over as PgStore does, so that an endpoint moved
                    // back to the claim-first mode finds its keys usable before
                    // their retention ends; its stale owner is fenced.
                    _ => {
                        let token = issue_token(&mut state.next_token);
                        let (done, done_rx) = watch::channel(());
                        state.entries.insert(
                            entry_key.clone(),
                            Entry::InProgress {
                                token,
                                _done: done,
                                done_rx,
                            },
                        );
                        return Ok(Claim::Owned(MemoryTx::new(
                            self.state.clone(),
                            entry_key,
                            request.fingerprint,
                            token,
                            TxKind::Claim {
                                fingerprint: request.fingerprint,
                                // Retention counts from the claim, as in
                                // PgStore (whose completion leaves the
                                // claim's expiry alone).
                                expires_at: now + request.retention,
                            },
                        )));
                    }
                }
            };
            // `changed` answers when a leased record changed, or fails once
            // a short owner's sender is dropped: either way, look again.
            let woken = tokio::time::timeout_at(recheck, changed.changed()).await;
            if woken.is_err() && Instant::now() >= deadline {
                return Ok(Claim::InProgress);
            }
        }
    }

    async fn complete(&self, tx: MemoryTx, response: &StoredResponse) -> Result<(), StoreError> {
        let TxKind::Claim {
            fingerprint,
            expires_at,
        } = tx.inner.kind
        else {
            // Left unfinished: dropping it releases its hold, as an abort would.
            return Err(StoreError::new(
                StoreErrorKind::TransactionAborted,
                "a fenced transaction commits with LeaseStore::commit_fenced",
            ));
        };
        let staged = tx.take_staged()?;
        if tx.inner.failed.load(Ordering::Acquire) {
            tx.inner.roll_back();
            return Err(failed());
        }
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
        let record = Record {
            fingerprint,
            response: response.clone(),
        };
        state.entries.insert(
            inner.entry_key.clone(),
            Entry::Completed {
                record,
                expires_at,
                operation: None,
            },
        );
        Ok(())
    }

    async fn abort(&self, tx: MemoryTx) -> Result<(), StoreError> {
        // Aborting a finished transaction is a no-op, as with PostgreSQL.
        if tx.take_staged().is_ok() {
            tx.inner.roll_back();
        }
        Ok(())
    }

    async fn lookup(&self, request: &ClaimRequest) -> Result<Option<Record>, StoreError> {
        let entry_key = (request.scope.clone(), request.key.clone());
        let state = lock(&self.state);
        Ok(match state.entries.get(&entry_key) {
            Some(Entry::Completed {
                record, expires_at, ..
            }) if *expires_at > Instant::now() => Some(record.clone()),
            _ => None,
        })
    }
}
