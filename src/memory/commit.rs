//! [`CommitStore`] for [`MemoryStore`]: the one-commit mode in memory.

use super::*;

impl CommitStore for MemoryStore {
    async fn begin(&self, request: &ClaimRequest) -> Result<MemoryTx, StoreError> {
        let entry_key = (request.scope.clone(), request.key.clone());
        // No token: nothing is claimed before the commit.
        Ok(MemoryTx::new(
            self.state.clone(),
            entry_key,
            request.fingerprint,
            0,
            TxKind::AtCommit,
        ))
    }

    async fn commit(
        &self,
        tx: MemoryTx,
        request: &ClaimRequest,
        response: &StoredResponse,
    ) -> Result<Committed, StoreError> {
        let inner = &tx.inner;
        if !matches!(inner.kind, TxKind::AtCommit) {
            return Err(StoreError::new(
                StoreErrorKind::TransactionAborted,
                "only a transaction begun with CommitStore::begin commits with CommitStore::commit",
            ));
        }
        self.check_same(&inner.state)?;
        if inner.entry_key != (request.scope.clone(), request.key.clone()) {
            return Err(StoreError::new(
                StoreErrorKind::TransactionAborted,
                "the transaction was begun for another key",
            ));
        }
        let staged = tx.take_staged()?;
        if inner.failed.load(Ordering::Acquire) {
            return Err(failed());
        }
        // The lock is the commit: deciding the key and making the rows
        // visible are one step.
        let mut state = lock(&self.state);
        let now = Instant::now();
        match state.entries.get(&inner.entry_key) {
            Some(Entry::Completed {
                record, expires_at, ..
            }) if *expires_at > now => return Ok(Committed::Lost(record.clone())),
            // A default-mode owner's open transaction, a live lease, or a
            // fenced write under way: held by another mode.
            Some(Entry::InProgress { .. }) => return Ok(Committed::Held),
            Some(Entry::Leased(leased)) if leased.holds > 0 || leased.lease_expires_at > now => {
                return Ok(Committed::Held)
            }
            // Free: absent, expired, or an operation whose lease expired
            // (replaced: its stale owner is fenced, as by a takeover).
            _ => {}
        }
        for (table, row) in staged {
            state.tables.entry(table).or_default().push(row);
        }
        let replaced = state.entries.insert(
            inner.entry_key.clone(),
            Entry::Completed {
                record: Record {
                    fingerprint: request.fingerprint,
                    response: response.clone(),
                },
                expires_at: now + request.retention,
                operation: None,
            },
        );
        if matches!(replaced, Some(Entry::Leased(_))) {
            state.lease_changes.send_replace(());
        }
        Ok(Committed::Won)
    }
}
