//! [`MemoryTx`]: the transaction handle of a [`MemoryStore`] owner.

use super::*;

/// The transaction handle of a [`MemoryStore`] owner.
///
/// Rows staged with [`insert`](Self::insert) become visible in
/// [`MemoryStore::rows`] only when the transaction commits, all together.
///
/// - A claim's transaction (the claim-first mode) commits with
///   [`Store::complete`]; an abort, or dropping every clone of the handle
///   unfinished, discards its rows and frees the key.
/// - A one-commit transaction ([`CommitStore::begin`]) holds nothing until
///   [`CommitStore::commit`] claims the key and commits its rows, or finds
///   the key taken and discards them.
/// - A fenced transaction ([`MemoryLease::transaction`],
///   [`LeaseStore::fenced`]) commits with
///   [`LeaseStore::commit_fenced`], only if its lease's token is still the
///   record's. While it is open, the record is held: no takeover happens. An
///   abort, or dropping it unfinished, discards its rows and ends the hold;
///   the lease stays its owner's.
#[derive(Clone, Debug)]
pub struct MemoryTx {
    pub(super) inner: Arc<TxInner>,
}

#[derive(Debug)]
pub(super) struct TxInner {
    pub(super) state: Arc<Mutex<State>>,
    pub(super) entry_key: EntryKey,
    // The request's: with the key, what the operation is (`derived_id`).
    pub(super) fingerprint: Fingerprint,
    pub(super) token: i64,
    pub(super) kind: TxKind,
    pub(super) staged: Mutex<Option<Vec<(String, Value)>>>,
    // Set by `fail`: the transaction can only roll back.
    pub(super) failed: AtomicBool,
}

#[derive(Debug)]
pub(super) enum TxKind {
    /// A short-mode owner: the key is held by this transaction itself.
    Claim {
        fingerprint: Fingerprint,
        // When the record ends: the claim's time plus the retention.
        expires_at: Instant,
    },
    /// A long-running owner's write: the key is held by its lease.
    Fenced,
    /// A one-commit owner: nothing is held until its commit.
    AtCommit,
}

impl MemoryTx {
    pub(super) fn new(
        state: Arc<Mutex<State>>,
        entry_key: EntryKey,
        fingerprint: Fingerprint,
        token: i64,
        kind: TxKind,
    ) -> Self {
        MemoryTx {
            inner: Arc::new(TxInner {
                state,
                entry_key,
                fingerprint,
                token,
                kind,
                staged: Mutex::new(Some(Vec::new())),
                failed: AtomicBool::new(false),
            }),
        }
    }

    /// The id of what this operation creates, `name` saying which: the
    /// same whenever the operation is redone
    /// ([`Scope::derived_id`](crate::scope::Scope::derived_id)).
    pub fn derived_id(&self, name: &str) -> String {
        let (scope, key) = &self.inner.entry_key;
        scope.derived_id(key.as_str(), &self.inner.fingerprint, name)
    }

    /// Stages a row for `table`, committed with the remembered response.
    ///
    /// [`TransactionAborted`](StoreErrorKind::TransactionAborted) once the
    /// transaction finished or [failed](Self::fail).
    pub fn insert(&self, table: &str, row: Value) -> Result<(), StoreError> {
        let mut staged = self.inner.staged.lock().unwrap_or_else(|p| p.into_inner());
        if self.inner.failed.load(Ordering::Acquire) {
            return Err(failed());
        }
        match staged.as_mut() {
            Some(rows) => {
                rows.push((table.to_owned(), row));
                Ok(())
            }
            None => Err(finished()),
        }
    }

    /// Fails the transaction, as a failed statement fails a PostgreSQL
    /// transaction: it takes no more rows, and completing it (or committing
    /// a fenced one) rolls it back and answers
    /// [`TransactionAborted`](StoreErrorKind::TransactionAborted). For tests
    /// of a handler whose write failed.
    pub fn fail(&self) {
        self.inner.failed.store(true, Ordering::Release);
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

    pub(super) fn take_staged(&self) -> Result<Vec<(String, Value)>, StoreError> {
        let mut staged = self.inner.staged.lock().unwrap_or_else(|p| p.into_inner());
        staged.take().ok_or_else(finished)
    }
}

pub(super) fn failed() -> StoreError {
    StoreError::new(
        StoreErrorKind::TransactionAborted,
        "a statement of the transaction failed; it can only roll back",
    )
}

pub(super) fn finished() -> StoreError {
    StoreError::new(
        StoreErrorKind::TransactionAborted,
        "the transaction has already finished",
    )
}

impl TxInner {
    /// Ends this unfinished transaction without committing: a claim frees
    /// its key; a fenced transaction only ends its hold.
    pub(super) fn roll_back(&self) {
        let mut state = lock(&self.state);
        match self.kind {
            TxKind::Claim { .. } => {
                if matches!(state.entries.get(&self.entry_key), Some(Entry::InProgress { token, .. }) if *token == self.token)
                {
                    state.entries.remove(&self.entry_key);
                }
            }
            TxKind::AtCommit => {}
            TxKind::Fenced => {
                let State {
                    entries,
                    lease_changes,
                    ..
                } = &mut *state;
                // Gone or another token: the owner finished or released the
                // operation meanwhile, and the hold went with the record.
                if let Ok(leased) = leased_mut(entries, &self.entry_key, self.token) {
                    leased.holds = leased.holds.saturating_sub(1);
                    lease_changes.send_replace(());
                }
            }
        }
    }
}

impl Drop for TxInner {
    fn drop(&mut self) {
        // Every handle is gone without being finished (a panicking handler,
        // a leaked clone): roll back, like PostgreSQL does for a closed
        // connection.
        let unfinished = self.staged.get_mut().map(|s| s.is_some()).unwrap_or(true);
        if unfinished {
            self.roll_back();
        }
    }
}
