//! The conformance suite fails stores that are wrong: a small store written
//! from the `Store` docs alone passes every check, and each of its broken
//! variants (one flaw each) fails exactly the checks of the guarantee it
//! breaks, with a message that says so.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex, MutexGuard,
    },
    time::Duration,
};

use tokio::{sync::watch, time::Instant};
use tower_idempotency::{
    fingerprint::Fingerprint,
    memory::MemoryStore,
    record::{Record, StoredResponse},
    store::{Claim, ClaimRequest, Store, StoreError, StoreErrorKind},
    testing::conformance::{self, BoxError, Guarantee, Outcome, Report, Writes},
};

/// The one thing a variant of [`Toy`] gets wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flaw {
    /// Nothing: a correct store.
    None,
    /// `claim` looks for the key, then inserts it in a second step (a
    /// SELECT, then an INSERT without a unique constraint).
    CheckThenInsert,
    /// `complete` stores the response without checking that the handle
    /// still owns the key (no token compare, no open transaction).
    CompleteWithoutOwnerCheck,
    /// `complete` stores the response by itself, then commits the
    /// handler's writes (which can still fail).
    ResponseApartFromWrites,
    /// `abort` discards the writes but leaves the key taken.
    AbortKeepsTheKey,
    /// `claim` waits for the owner however long it takes.
    WaitsForever,
    /// Records are keyed by endpoint and key only: tenants share keys.
    KeyIgnoresTenant,
    /// A completed record is replayed forever, its retention ignored.
    ExpiredNeverTakenOver,
    /// `lookup` finds a completed record whose retention ended (its claim
    /// is right).
    LookupIgnoresRetention,
    /// `abort` panics.
    PanicsOnAbort,
}

type Key = (String, String, String);

/// A store written from the `Store` docs: a map of keys behind a mutex,
/// handles that stage the handler's rows, and one flaw (or none).
#[derive(Clone)]
struct Toy {
    flaw: Flaw,
    state: Arc<Mutex<State>>,
}

struct State {
    entries: HashMap<Key, Entry>,
    // The markers of committed handler writes.
    committed: Vec<String>,
    next_token: u64,
    // Sent whenever an owner finishes: what waiting claims wait for.
    changes: watch::Sender<()>,
}

enum Entry {
    Owned(u64),
    Completed { record: Record, expires_at: Instant },
}

#[derive(Clone)]
struct ToyTx(Arc<TxInner>);

struct TxInner {
    store: Toy,
    key: Key,
    token: u64,
    fingerprint: Fingerprint,
    retention: Duration,
    // The handler's rows; `None` once the transaction finished.
    staged: Mutex<Option<Vec<String>>>,
    failed: AtomicBool,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

fn aborted(message: &str) -> StoreError {
    StoreError::new(StoreErrorKind::TransactionAborted, message)
}

impl Toy {
    fn new(flaw: Flaw) -> Self {
        Toy {
            flaw,
            state: Arc::new(Mutex::new(State {
                entries: HashMap::new(),
                committed: Vec::new(),
                next_token: 0,
                changes: watch::Sender::new(()),
            })),
        }
    }

    fn key(&self, request: &ClaimRequest) -> Key {
        let tenant = if self.flaw == Flaw::KeyIgnoresTenant {
            ""
        } else {
            request.scope.tenant().as_str()
        };
        (
            tenant.to_owned(),
            request.scope.endpoint().to_owned(),
            request.key.as_str().to_owned(),
        )
    }

    fn own(&self, state: &mut State, key: Key, request: &ClaimRequest) -> ToyTx {
        state.next_token += 1;
        let token = state.next_token;
        state.entries.insert(key.clone(), Entry::Owned(token));
        ToyTx(Arc::new(TxInner {
            store: self.clone(),
            key,
            token,
            fingerprint: request.fingerprint,
            retention: request.retention,
            staged: Mutex::new(Some(Vec::new())),
            failed: AtomicBool::new(false),
        }))
    }

    /// Frees `key` if `token` still owns it.
    fn release(&self, key: &Key, token: u64) {
        let mut state = lock(&self.state);
        if matches!(state.entries.get(key), Some(Entry::Owned(t)) if *t == token) {
            state.entries.remove(key);
            state.changes.send_replace(());
        }
    }

    fn remember(state: &mut State, tx: &TxInner, response: &StoredResponse) {
        let record = Record {
            fingerprint: tx.fingerprint,
            response: response.clone(),
        };
        let expires_at = Instant::now() + tx.retention;
        state
            .entries
            .insert(tx.key.clone(), Entry::Completed { record, expires_at });
        state.changes.send_replace(());
    }
}

impl TxInner {
    fn take(&self) -> Option<Vec<String>> {
        lock(&self.staged).take()
    }
}

impl Drop for TxInner {
    fn drop(&mut self) {
        // Every clone dropped unfinished: roll back.
        if lock(&self.staged).is_some() {
            self.store.release(&self.key, self.token);
        }
    }
}

impl Store for Toy {
    type Tx = ToyTx;

    async fn claim(&self, request: &ClaimRequest) -> Result<Claim<ToyTx>, StoreError> {
        let key = self.key(request);
        let deadline = Instant::now() + request.wait;
        loop {
            let mut changed = {
                let mut state = lock(&self.state);
                match state.entries.get(&key) {
                    Some(Entry::Completed { record, expires_at })
                        if *expires_at > Instant::now()
                            || self.flaw == Flaw::ExpiredNeverTakenOver =>
                    {
                        return Ok(Claim::Completed(record.clone()));
                    }
                    Some(Entry::Owned(_)) => Some(state.changes.subscribe()),
                    _ if self.flaw == Flaw::CheckThenInsert => None,
                    _ => return Ok(Claim::Owned(self.own(&mut state, key, request))),
                }
            };
            let Some(changed) = changed.as_mut() else {
                // Free when we looked: insert in a second step, after the
                // round trip of the look.
                tokio::task::yield_now().await;
                let mut state = lock(&self.state);
                return Ok(Claim::Owned(self.own(&mut state, key, request)));
            };
            if self.flaw == Flaw::WaitsForever {
                let _ = changed.changed().await;
            } else if tokio::time::timeout_at(deadline, changed.changed())
                .await
                .is_err()
            {
                return Ok(Claim::InProgress);
            }
        }
    }

    async fn complete(&self, tx: ToyTx, response: &StoredResponse) -> Result<(), StoreError> {
        let inner = &tx.0;
        let failed = inner.failed.load(Ordering::Acquire);
        match self.flaw {
            Flaw::CompleteWithoutOwnerCheck => {
                // Whether this handle's transaction still runs, and whether
                // its token still owns the key: neither is looked at.
                let rows = inner.take().unwrap_or_default();
                if failed {
                    self.release(&inner.key, inner.token);
                    return Err(aborted("a statement failed"));
                }
                let mut state = lock(&self.state);
                state.committed.extend(rows);
                Toy::remember(&mut state, inner, response);
                Ok(())
            }
            Flaw::ResponseApartFromWrites => {
                let rows = inner.take().ok_or_else(|| aborted("finished"))?;
                {
                    let mut state = lock(&self.state);
                    if !matches!(state.entries.get(&inner.key), Some(Entry::Owned(t)) if *t == inner.token)
                    {
                        return Err(aborted("no longer the owner"));
                    }
                    Toy::remember(&mut state, inner, response);
                }
                // The writes' own commit, which fails after a failed statement.
                if failed {
                    return Err(aborted("a statement failed"));
                }
                lock(&self.state).committed.extend(rows);
                Ok(())
            }
            _ => {
                let rows = inner.take().ok_or_else(|| aborted("finished"))?;
                if failed {
                    self.release(&inner.key, inner.token);
                    return Err(aborted("a statement failed"));
                }
                let mut state = lock(&self.state);
                if !matches!(state.entries.get(&inner.key), Some(Entry::Owned(t)) if *t == inner.token)
                {
                    return Err(aborted("no longer the owner"));
                }
                state.committed.extend(rows);
                Toy::remember(&mut state, inner, response);
                Ok(())
            }
        }
    }

    async fn abort(&self, tx: ToyTx) -> Result<(), StoreError> {
        if self.flaw == Flaw::PanicsOnAbort {
            panic!("the toy store's abort panics");
        }
        if tx.0.take().is_some() && self.flaw != Flaw::AbortKeepsTheKey {
            self.release(&tx.0.key, tx.0.token);
        }
        Ok(())
    }

    async fn lookup(&self, request: &ClaimRequest) -> Result<Option<Record>, StoreError> {
        let state = lock(&self.state);
        Ok(match state.entries.get(&self.key(request)) {
            Some(Entry::Completed { record, expires_at })
                if *expires_at > Instant::now() || self.flaw == Flaw::LookupIgnoresRetention =>
            {
                Some(record.clone())
            }
            _ => None,
        })
    }
}

impl Writes<ToyTx> for Toy {
    async fn write(&self, tx: &ToyTx, marker: &str) -> Result<(), BoxError> {
        if tx.0.failed.load(Ordering::Acquire) {
            return Err("the transaction failed".into());
        }
        match lock(&tx.0.staged).as_mut() {
            Some(rows) => {
                rows.push(marker.to_owned());
                Ok(())
            }
            None => Err("the transaction finished".into()),
        }
    }

    async fn fail(&self, tx: &ToyTx) -> Result<(), BoxError> {
        tx.0.failed.store(true, Ordering::Release);
        Ok(())
    }

    async fn is_committed(&self, marker: &str) -> Result<bool, BoxError> {
        Ok(lock(&self.state).committed.iter().any(|m| m == marker))
    }
}

async fn report(flaw: Flaw) -> Report {
    let toy = Toy::new(flaw);
    conformance::run_all_with(toy.clone(), toy).await
}

/// The failed checks, with the guarantee each one names, in the order run.
fn failed(report: &Report) -> Vec<(&'static str, Guarantee)> {
    report
        .failures()
        .map(|c| (c.name(), c.failure().expect("a failure").guarantee()))
        .collect()
}

fn message<'r>(report: &'r Report, check: &str) -> &'r str {
    report
        .check(check)
        .and_then(|c| c.failure())
        .map(|f| f.message())
        .unwrap_or_else(|| panic!("{check} did not fail:\n{report}"))
}

#[tokio::test]
async fn a_correct_store_passes_every_check() {
    let report = report(Flaw::None).await;
    report.assert_passed();
    assert_eq!(report.checks().len(), 13, "{report}");
    report.assert_all_passed();
}

#[tokio::test]
async fn memory_store_passes_every_check() {
    let store = MemoryStore::new();
    let report = conformance::run_all_with(store.clone(), store).await;
    assert_eq!(failed(&report), [], "{report}");
    report.assert_all_passed();
}

#[tokio::test]
async fn check_then_insert_is_caught_as_two_owners() {
    let report = report(Flaw::CheckThenInsert).await;
    assert_eq!(
        failed(&report),
        [("concurrent_claims_have_one_owner", Guarantee::OneOwner)],
        "{report}"
    );
    let message = message(&report, "concurrent_claims_have_one_owner");
    assert!(
        message.ends_with("of 8 concurrent claims owned the same new key (exactly one may)")
            && !message.starts_with("1 of"),
        "{message}"
    );
}

#[tokio::test]
async fn complete_without_an_owner_check_is_caught() {
    let report = report(Flaw::CompleteWithoutOwnerCheck).await;
    assert_eq!(
        failed(&report),
        [("stale_handle_cannot_complete", Guarantee::OneOwner)],
        "{report}"
    );
    assert_eq!(
        message(&report, "stale_handle_cannot_complete"),
        "complete through an aborted handle succeeded while another claim owned the key"
    );
}

#[tokio::test]
async fn a_response_committed_apart_from_the_writes_is_caught() {
    let report = report(Flaw::ResponseApartFromWrites).await;
    assert_eq!(
        failed(&report),
        [(
            "failed_write_fails_the_completion",
            Guarantee::AtomicCompletion
        )],
        "{report}"
    );
    assert!(
        message(&report, "failed_write_fails_the_completion")
            .starts_with("complete failed, yet its response was remembered"),
        "{report}"
    );
}

#[tokio::test]
async fn an_abort_that_leaves_the_key_taken_is_caught() {
    let report = report(Flaw::AbortKeepsTheKey).await;
    assert_eq!(
        failed(&report),
        [
            ("stale_handle_cannot_complete", Guarantee::AbortFreesTheKey),
            ("abort_frees_the_key", Guarantee::AbortFreesTheKey),
            (
                "abort_discards_the_handler_writes",
                Guarantee::AbortFreesTheKey
            ),
        ],
        "{report}"
    );
    assert_eq!(
        message(&report, "abort_frees_the_key"),
        "the claim after the abort: expected to own the key, got InProgress"
    );
}

#[tokio::test]
async fn a_claim_that_waits_forever_is_caught_by_its_time_limit() {
    let started = std::time::Instant::now();
    let report = report(Flaw::WaitsForever).await;
    assert_eq!(
        failed(&report),
        [
            ("stale_handle_cannot_complete", Guarantee::BoundedWait),
            ("wait_is_bounded", Guarantee::BoundedWait),
        ],
        "{report}"
    );
    assert_eq!(
        message(&report, "wait_is_bounded"),
        "a claim while the key is owned: a claim with a wait of 200 ms had not answered after \
         2200 ms"
    );
    // Each hanging claim was given its wait and two seconds, no more.
    assert!(started.elapsed() < Duration::from_secs(30), "{report}");
}

#[tokio::test]
async fn a_replay_across_tenants_is_caught() {
    let report = report(Flaw::KeyIgnoresTenant).await;
    assert_eq!(
        failed(&report),
        [("scopes_are_isolated", Guarantee::TenantIsolation)],
        "{report}"
    );
    assert!(
        message(&report, "scopes_are_isolated")
            .starts_with("tenant b got the record of the same raw key in tenant a"),
        "{report}"
    );
}

#[tokio::test]
async fn an_expired_record_never_taken_over_is_caught() {
    let report = report(Flaw::ExpiredNeverTakenOver).await;
    assert_eq!(
        failed(&report),
        [(
            "expired_record_is_a_new_operation",
            Guarantee::ExpiryTakeover
        )],
        "{report}"
    );
    assert!(
        message(&report, "expired_record_is_a_new_operation").starts_with(
            "a claim after the record's retention ended: expected to own the key, got Completed"
        ),
        "{report}"
    );
}

#[tokio::test]
async fn a_lookup_that_finds_an_expired_record_is_caught() {
    let report = report(Flaw::LookupIgnoresRetention).await;
    assert_eq!(
        failed(&report),
        [(
            "expired_record_is_a_new_operation",
            Guarantee::ExpiryTakeover
        )],
        "{report}"
    );
    assert!(
        message(&report, "expired_record_is_a_new_operation").ends_with(", whose retention ended"),
        "{report}"
    );
}

#[tokio::test]
async fn a_store_that_panics_fails_its_checks_and_the_run_goes_on() {
    let report = report(Flaw::PanicsOnAbort).await;
    assert_eq!(report.checks().len(), 13, "every check ran:\n{report}");
    let panicked: Vec<_> = report
        .failures()
        .filter(|c| {
            c.failure()
                .is_some_and(|f| f.message() == "the check panicked: the toy store's abort panics")
        })
        .map(|c| c.name())
        .collect();
    assert!(panicked.contains(&"abort_frees_the_key"), "{report}");
    assert!(
        report
            .check("concurrent_claims_have_one_owner")
            .unwrap()
            .outcome()
            == &Outcome::Passed,
        "checks that never abort pass:\n{report}"
    );
}

#[tokio::test]
async fn without_writes_the_atomicity_checks_are_skipped_and_say_why() {
    let report = conformance::run_all(Toy::new(Flaw::ResponseApartFromWrites)).await;
    assert!(report.passed(), "{report}");
    let skipped: Vec<_> = report
        .checks()
        .iter()
        .filter(|c| matches!(c.outcome(), Outcome::Skipped(_)))
        .map(|c| c.name())
        .collect();
    assert_eq!(
        skipped,
        [
            "handler_writes_commit_with_the_response",
            "failed_write_fails_the_completion",
            "abort_discards_the_handler_writes",
            "dropped_handle_discards_the_handler_writes",
        ]
    );
    assert!(
        report
            .to_string()
            .contains("needs a way to write through the handle: run_all_with(store, writes)"),
        "{report}"
    );
}

#[tokio::test]
async fn the_report_reads_as_a_table_of_every_check() {
    let report = report(Flaw::KeyIgnoresTenant).await;
    let text = report.to_string();
    let mut lines = text.lines();
    assert_eq!(
        lines.next(),
        Some("Store conformance: 12 passed, 1 failed, 0 skipped")
    );
    let rows: Vec<_> = lines.collect();
    assert_eq!(rows.len(), 13, "{text}");
    assert!(
        rows.iter()
            .any(|r| r.starts_with("  FAIL  scopes_are_isolated ")
                && r.contains("tenant isolation: tenant b got the record")),
        "{text}"
    );
    assert!(
        rows.iter().any(
            |r| r.starts_with("  ok    concurrent_claims_have_one_owner ")
                && r.contains("one owner")
        ),
        "{text}"
    );
}

#[tokio::test]
#[should_panic(expected = "FAIL  expired_record_is_a_new_operation")]
async fn assert_passed_panics_with_the_report() {
    report(Flaw::ExpiredNeverTakenOver).await.assert_passed();
}
