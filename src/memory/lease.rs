//! [`LeaseStore`] for [`MemoryStore`], and its lease handle [`MemoryLease`].

use super::*;

impl LeaseStore for MemoryStore {
    type Lease = MemoryLease;

    async fn acquire(
        &self,
        claim: &ClaimRequest,
        request: &LeaseRequest,
    ) -> Result<Acquired<MemoryLease>, StoreError> {
        let entry_key = (claim.scope.clone(), claim.key.clone());
        let deadline = Instant::now() + claim.wait;
        loop {
            let mut changed = {
                let mut state = lock(&self.state);
                let now = Instant::now();
                let State {
                    entries,
                    next_token,
                    lease_changes,
                    ..
                } = &mut *state;
                match entries.get_mut(&entry_key) {
                    Some(Entry::Completed {
                        record, expires_at, ..
                    }) if *expires_at > now => {
                        return Ok(Acquired::Completed(record.clone()));
                    }
                    Some(Entry::InProgress { done_rx, .. }) => done_rx.clone(),
                    Some(Entry::Leased(leased)) if leased.expires_at > now => {
                        // A live lease is never taken over; an expired one only
                        // by the same request (another one is a reused key).
                        if leased.lease_expires_at > now || leased.fingerprint != claim.fingerprint
                        {
                            return Ok(Acquired::Running {
                                operation_id: leased.operation_id,
                                fingerprint: leased.fingerprint,
                            });
                        }
                        if leased.holds == 0 {
                            let token = issue_token(next_token);
                            leased.take_over(token, request.lease, claim.retention, now);
                            // The same request (its fingerprint), perhaps
                            // encoded differently: re-drive the latest.
                            leased.request = request.request.clone();
                            return Ok(Acquired::Owned(self.owned(entry_key, leased)));
                        }
                        // Its owner, lease run out, is still writing through a
                        // fenced transaction: wait for that to end, then look
                        // again (the lease may be renewed by then).
                        lease_changes.subscribe()
                    }
                    Some(Entry::Leased(leased)) if leased.holds > 0 => lease_changes.subscribe(),
                    // Absent, or its retention passed: a new operation.
                    _ => {
                        let leased = Leased {
                            token: issue_token(next_token),
                            operation_id: request.operation_id,
                            fingerprint: claim.fingerprint,
                            request: request.request.clone(),
                            lease_expires_at: now + request.lease,
                            expires_at: now + request.lease + claim.retention,
                            retention: claim.retention,
                            holds: 0,
                            attempts: 1,
                        };
                        let owned = self.owned(entry_key.clone(), &leased);
                        entries.insert(entry_key, Entry::Leased(leased));
                        return Ok(Acquired::Owned(owned));
                    }
                }
            };
            if tokio::time::timeout_at(deadline, changed.changed())
                .await
                .is_err()
            {
                return Ok(Acquired::InProgress);
            }
        }
    }

    async fn heartbeat(&self, lease: &MemoryLease, extend: Duration) -> Result<(), StoreError> {
        let extend = extend.min(crate::store::MAX_WAIT);
        self.check_same(&lease.inner.state)?;
        let mut state = lock(&self.state);
        let leased = leased_mut(
            &mut state.entries,
            &lease.inner.entry_key,
            lease.inner.token,
        )?;
        // An expired lease not yet taken over is still this owner's.
        leased.lease_expires_at = Instant::now() + extend;
        // The retention counts from the operation's end: while it runs,
        // a retention past its lease.
        leased.expires_at = leased
            .expires_at
            .max(leased.lease_expires_at + leased.retention);
        Ok(())
    }

    async fn fenced(&self, lease: &MemoryLease) -> Result<MemoryTx, StoreError> {
        self.check_same(&lease.inner.state)?;
        lease.transaction()
    }

    async fn commit_fenced(&self, tx: MemoryTx) -> Result<(), StoreError> {
        if !matches!(tx.inner.kind, TxKind::Fenced) {
            return Err(StoreError::new(
                StoreErrorKind::TransactionAborted,
                "a claim's transaction commits with Store::complete",
            ));
        }
        self.check_same(&tx.inner.state)?;
        let staged = tx.take_staged()?;
        if tx.inner.failed.load(std::sync::atomic::Ordering::Acquire) {
            tx.inner.roll_back();
            return Err(super::failed());
        }
        // The owner finished or released the operation while this
        // transaction was open (a takeover waits for it): nothing is applied.
        self.change_leased(&tx.inner.entry_key, tx.inner.token, |leased, tables, _| {
            leased.holds = leased.holds.saturating_sub(1);
            for (table, row) in staged {
                tables.entry(table).or_default().push(row);
            }
        })
    }

    async fn finish(
        &self,
        lease: &MemoryLease,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        self.end(lease, response, None)
    }

    async fn release(&self, lease: &MemoryLease) -> Result<(), StoreError> {
        self.check_same(&lease.inner.state)?;
        let inner = &lease.inner;
        self.change_leased(&inner.entry_key, inner.token, |leased, _, next_token| {
            // The operation stays; its lease ends now and its token moves on.
            // Fenced transactions still open at the old token can never commit
            // (their token is no longer the record's), so they hold nothing.
            leased.token = issue_token(next_token);
            leased.lease_expires_at = Instant::now();
            leased.holds = 0;
        })
    }

    async fn fail(
        &self,
        lease: &MemoryLease,
        response: &StoredResponse,
        attempts: u32,
    ) -> Result<(), StoreError> {
        self.end(lease, response, Some(attempts))
    }

    async fn operation(
        &self,
        tenant: &TenantId,
        id: OperationId,
    ) -> Result<Option<Operation>, StoreError> {
        let state = lock(&self.state);
        let now = Instant::now();
        let found = state
            .entries
            .iter()
            .filter(|((scope, _), _)| scope.tenant() == tenant)
            .find_map(|(_, entry)| match entry {
                Entry::Leased(leased) if leased.operation_id == id && leased.expires_at > now => {
                    Some(Operation::new(id, OperationState::Running, leased.attempts))
                }
                Entry::Completed {
                    record,
                    expires_at,
                    operation: Some(ended),
                } if ended.id == id && *expires_at > now => {
                    let response = record.response.clone();
                    let state = if ended.failed {
                        OperationState::Failed(response)
                    } else {
                        OperationState::Completed(response)
                    };
                    Some(Operation::new(id, state, ended.attempts))
                }
                _ => None,
            });
        Ok(found)
    }

    async fn recover(
        &self,
        endpoint: &str,
        lease: Duration,
        retention: Duration,
        backoff: Backoff,
    ) -> Result<Option<Recovered<MemoryLease>>, StoreError> {
        let (lease, retention) = crate::store::bounded(lease, retention);
        let mut state = lock(&self.state);
        let now = Instant::now();
        let State {
            entries,
            next_token,
            ..
        } = &mut *state;
        // The longest abandoned first. A held record is skipped: its owner
        // is committing a fenced write, so it is not abandoned.
        let abandoned = entries
            .iter_mut()
            .filter_map(|(entry_key, entry)| match entry {
                Entry::Leased(leased)
                    if entry_key.0.endpoint() == endpoint
                        && leased.lease_expires_at + backoff.after(leased.attempts) <= now
                        && leased.expires_at > now
                        && leased.holds == 0 =>
                {
                    Some((entry_key, leased))
                }
                _ => None,
            })
            .min_by_key(|(_, leased)| leased.lease_expires_at);
        let Some((entry_key, leased)) = abandoned else {
            return Ok(None);
        };
        leased.take_over(issue_token(next_token), lease, retention, now);
        let owned = self.owned(entry_key.clone(), leased);
        Ok(Some(Recovered::new(
            owned,
            entry_key.0.clone(),
            leased.request.clone(),
        )))
    }
}

impl MemoryStore {
    /// Under the state lock, `change`s the leased record of `entry_key`
    /// that `token` still owns (given the tables and the token counter as
    /// well), then wakes whoever waits on a leased record; [`fenced`] if
    /// the token is no longer the record's ([`leased_mut`]).
    fn change_leased(
        &self,
        entry_key: &EntryKey,
        token: i64,
        change: impl FnOnce(&mut Leased, &mut HashMap<String, Vec<Value>>, &mut i64),
    ) -> Result<(), StoreError> {
        let mut state = lock(&self.state);
        let State {
            entries,
            tables,
            next_token,
            lease_changes,
        } = &mut *state;
        change(leased_mut(entries, entry_key, token)?, tables, next_token);
        lease_changes.send_replace(());
        Ok(())
    }

    /// Finish (`failed_after: None`) or fail an operation with `response`,
    /// if the lease's token is still the record's.
    fn end(
        &self,
        lease: &MemoryLease,
        response: &StoredResponse,
        failed_after: Option<u32>,
    ) -> Result<(), StoreError> {
        self.check_same(&lease.inner.state)?;
        let mut state = lock(&self.state);
        let State {
            entries,
            lease_changes,
            ..
        } = &mut *state;
        let leased = leased_mut(entries, &lease.inner.entry_key, lease.inner.token)?;
        let ended = Entry::Completed {
            record: Record {
                fingerprint: leased.fingerprint,
                response: response.clone(),
            },
            expires_at: Instant::now() + leased.retention,
            operation: Some(Ended {
                id: leased.operation_id,
                attempts: failed_after.unwrap_or(leased.attempts),
                failed: failed_after.is_some(),
            }),
        };
        entries.insert(lease.inner.entry_key.clone(), ended);
        lease_changes.send_replace(());
        Ok(())
    }
}

/// The lease handle of a [`MemoryStore`]'s long-running operation: the
/// proof of ownership the layer puts into the owner's request extensions.
///
/// It names the operation's record and the attempt token it was acquired
/// under. Once another owner took the operation over (a larger token), every
/// [`LeaseStore`] call with this handle answers
/// [`Fenced`](StoreErrorKind::Fenced).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use std::time::Duration;
/// use bytes::Bytes;
/// use http::Method;
/// use tower_idempotency::{
///     fingerprint::Fingerprint,
///     key::IdempotencyKey,
///     lease::OperationId,
///     memory::MemoryStore,
///     scope::{Scope, TenantId},
///     store::{Acquired, ClaimRequest, LeaseRequest, LeaseStore, StoredRequest},
/// };
///
/// let store = MemoryStore::new();
/// let claim = ClaimRequest::new(
///     Scope::new(TenantId::new("tenant-a"), "POST /exports v1"),
///     IdempotencyKey::parse(b"k-1").unwrap(),
///     Fingerprint::from_bytes([0; 32]),
/// );
/// let request = StoredRequest::new(Method::POST, "/exports", vec![], Bytes::new());
/// let id = OperationId::random();
/// let Ok(Acquired::Owned(owned)) = store
///     .acquire(&claim, &LeaseRequest::new(Duration::from_secs(30), id, request))
///     .await
/// else {
///     panic!("a new key is owned");
/// };
/// let lease = owned.lease;
/// assert_eq!(lease.operation_id(), id);
///
/// // The handler's writes, fenced by the token.
/// let tx = lease.transaction().unwrap();
/// tx.insert("exports", serde_json::json!({"id": 1})).unwrap();
/// store.commit_fenced(tx).await.unwrap();
/// assert_eq!(store.rows("exports").len(), 1);
/// # }
/// ```
#[derive(Clone)]
pub struct MemoryLease {
    inner: Arc<LeaseInner>,
}

struct LeaseInner {
    state: Arc<Mutex<State>>,
    entry_key: EntryKey,
    operation_id: OperationId,
    fingerprint: crate::fingerprint::Fingerprint,
    token: i64,
}

impl MemoryLease {
    pub(super) fn new(state: Arc<Mutex<State>>, entry_key: EntryKey, leased: &Leased) -> Self {
        MemoryLease {
            inner: Arc::new(LeaseInner {
                state,
                entry_key,
                operation_id: leased.operation_id,
                fingerprint: leased.fingerprint,
                token: leased.token,
            }),
        }
    }

    /// The operation's id (the same across takeovers).
    pub fn operation_id(&self) -> OperationId {
        self.inner.operation_id
    }

    /// The attempt token this lease was acquired under: send it along with
    /// downstream calls so that they can refuse a stale attempt.
    pub fn attempt_token(&self) -> i64 {
        self.inner.token
    }

    /// The operation's tenant and endpoint.
    pub fn scope(&self) -> &Scope {
        &self.inner.entry_key.0
    }

    /// The operation's tenant.
    pub fn tenant(&self) -> &TenantId {
        self.inner.entry_key.0.tenant()
    }

    /// The id of what this operation creates, `name` saying which: the
    /// same for every attempt and when the operation is redone
    /// ([`Scope::derived_id`](crate::scope::Scope::derived_id)).
    pub fn derived_id(&self, name: &str) -> String {
        let (scope, key) = &self.inner.entry_key;
        scope.derived_id(key.as_str(), &self.inner.fingerprint, name)
    }

    /// Opens a fenced transaction, as [`LeaseStore::fenced`] does: its rows
    /// become visible at [`commit_fenced`](LeaseStore::commit_fenced), and
    /// until then no takeover can happen. `Fenced` if the token is no longer
    /// the record's.
    pub fn transaction(&self) -> Result<MemoryTx, StoreError> {
        let inner = &self.inner;
        let mut state = lock(&inner.state);
        leased_mut(&mut state.entries, &inner.entry_key, inner.token)?.holds += 1;
        Ok(MemoryTx::new(
            inner.state.clone(),
            inner.entry_key.clone(),
            inner.fingerprint,
            inner.token,
            TxKind::Fenced,
        ))
    }
}

impl fmt::Debug for MemoryLease {
    // Not the key: keys are client secrets, and the operation id names it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryLease")
            .field("operation_id", &self.inner.operation_id)
            .field("attempt_token", &self.inner.token)
            .field("scope", &self.inner.entry_key.0)
            .finish()
    }
}
