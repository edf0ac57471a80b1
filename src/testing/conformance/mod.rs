//! The behaviour every [`Store`] owes the layer, as runnable checks.
//!
//! One line in a test of your store runs them all and fails with a report
//! of every check (passed, failed with the broken guarantee and why,
//! skipped with why):
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! # let store = tower_idempotency::memory::MemoryStore::new();
//! tower_idempotency::testing::conformance::run_all(store).await.assert_passed();
//! # }
//! ```
//!
//! [`run_all`] returns a [`Report`]; [`Report::assert_passed`] panics with
//! it if a check failed. Checks use fresh keys, so one store instance can run
//! them all, also a store other tests use. Each check runs in a task of its
//! own under a time limit: a store that panics or never answers fails that
//! check and the run goes on. A claim that must answer within its wait is
//! given that wait and two seconds more.
//!
//! # The checks of the claim-first mode
//!
//! Each check is named by its function here and checks one guarantee of the
//! [`Store`] docs (a [`Guarantee`]):
//!
//! | check | guarantee | the store must |
//! | --- | --- | --- |
//! | [`completed_record_replays_byte_for_byte`] | replay | answer a completed key with its status, headers (repeated ones in order) and body bytes; `lookup` nothing before and during the claim, then that record or nothing |
//! | [`fingerprint_is_returned_for_comparison`] | replay | return the first request's fingerprint with the record |
//! | [`concurrent_claims_have_one_owner`] | one owner | let exactly one of 8 concurrent claims own a new key; the others get its record |
//! | [`stale_handle_cannot_complete`] | one owner | refuse `complete` through a handle whose transaction ended, after another claim owns the key |
//! | [`abort_frees_the_key`] | abort frees the key | let the next claim own a key whose owner aborted |
//! | [`dropped_handle_frees_the_key`] | drop frees the key | let the next claim own a key whose owner dropped every clone of its handle |
//! | [`wait_is_bounded`] | bounded wait | answer `InProgress` after the claim's wait while another request owns the key |
//! | [`scopes_are_isolated`] | tenant isolation | keep the same raw key of two tenants apart: neither replays the other's record |
//! | [`expired_record_is_a_new_operation`] | expiry takeover | let a claim own a completed key whose retention ended; `lookup` not find it |
//!
//! What the handler writes through the transaction handle is
//! store-specific. Give the suite a way to write and to look ([`Writes`])
//! with [`run_all_with`], and four more checks run (skipped without it):
//!
//! | check | guarantee | the store must |
//! | --- | --- | --- |
//! | [`handler_writes_commit_with_the_response`] | atomic completion | show the handler's write only once `complete` returned, then together with the record |
//! | [`failed_write_fails_the_completion`] | atomic completion | refuse `complete` after a failed write (`TransactionAborted`), remember nothing, commit nothing, free the key |
//! | [`abort_discards_the_handler_writes`] | abort frees the key | discard the handler's write on abort |
//! | [`dropped_handle_discards_the_handler_writes`] | drop frees the key | discard the handler's write when the handle is dropped |
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use tower_idempotency::{memory::MemoryStore, testing::conformance};
//!
//! let store = MemoryStore::new();
//! // MemoryStore is its own `Writes`: rows staged through `MemoryTx`.
//! let report = conformance::run_all_with(store.clone(), store).await;
//! println!("{report}");
//! report.assert_passed();
//! # }
//! ```
//!
//! The individual checks are public too: each returns `Ok(())` or the
//! [`CheckFailure`] naming the guarantee it found broken.
//!
//! # The one-commit mode
//!
//! A store that also implements [`CommitStore`](crate::store::CommitStore)
//! runs [`run_at_commit`] (or [`run_at_commit_with`], with [`Writes`]): one
//! commit wins, the loser gets the winner's record and rolls back, another
//! request is told the first fingerprint, an abort leaves the key free,
//! tenants are isolated, an expired record is won again. Its docs list each
//! check.
//!
//! # Long-running operations
//!
//! A store that also implements [`LeaseStore`](crate::store::LeaseStore)
//! runs [`run_leases`] too. Its checks, each named by the guarantee a
//! failure names:
//!
//! - **one owner** ([`concurrent_acquires_have_one_owner`],
//!   [`duplicate_during_a_lease_is_running`]): of 20 concurrent acquires of a
//!   new key exactly one owns the operation, and every other one, like any
//!   duplicate while the lease is valid, gets `Running` with its id;
//! - **takeover** ([`expired_lease_is_taken_over_once`]): once the lease
//!   expired, of 20 concurrent acquires by the same request exactly one
//!   takes the operation over, keeping its id, under a larger token; another
//!   request gets `Running`;
//! - **fencing** ([`stale_owner_is_fenced`]): after a takeover, the old
//!   lease's fenced transaction, heartbeat, finish and release are `Fenced`
//!   and change nothing (the operation still runs under its new owner);
//!   the new owner's succeed;
//! - **monotonic token** ([`tokens_only_grow`]): after a release, and after
//!   the record's retention ended, the next owner's token is larger than
//!   every earlier one;
//! - **identity** ([`a_released_operation_keeps_its_identity`]): a release
//!   keeps the operation (its status `Running`, attempts counted, the old
//!   lease fenced); another request still finds it running; the same
//!   request resumes it at once as attempt 2 with its id; a recovery worker
//!   only after its backoff, as attempt 3; and an operation that outlives
//!   its retention keeps it while it runs
//!   ([`an_operation_outlives_its_retention_while_it_runs`]): abandoned, it
//!   is still `Running` and recovered under its id;
//! - **failure** ([`a_failed_operation_replays_its_failure`]): a failed
//!   operation replays its failure as a completed record, shows `Failed`
//!   with its attempts, and fences the lease that failed it;
//! - **heartbeat** ([`heartbeats_keep_the_lease`]): a lease renewed past its
//!   first end is not taken over;
//! - **finish** and **status**
//!   ([`finished_operation_replays_and_has_a_status`]): a finished operation
//!   replays its answer byte for byte with the first request's fingerprint,
//!   and [`operation`](crate::store::LeaseStore::operation) shows it
//!   `Completed` to its tenant and to no other, and nothing for an unknown id;
//! - **recovery** ([`expired_lease_is_recovered_once`]): an expired
//!   operation is recovered by one of two concurrent workers, under a larger
//!   token, with its stored request intact; a live or just recovered one is not.
//!
//! The checks sleep past leases of a few hundred milliseconds (the
//! behaviour under test), about two seconds in all. What a fenced
//! transaction writes is store-specific: the suite only checks that the
//! current owner's commits and a stale owner's cannot be opened; test that
//! your `commit_fenced` commits the writes at the current token only.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! # let store = tower_idempotency::memory::MemoryStore::new();
//! tower_idempotency::testing::conformance::run_leases(store).await.assert_passed();
//! # }
//! ```

use std::sync::Arc;

use crate::store::Store;

/// Runs the check function `$check` on the runner `$run`, under
/// `Guarantee::$guarantee` and its own name. With `$writes` (an
/// `Option<Arc<_>>` of [`Writes`]), a check that writes through the handle:
/// without them it is reported skipped, saying `$skipped`.
macro_rules! check {
    ($run:ident, $check:ident, $guarantee:ident) => {
        $run.check(
            stringify!($check),
            Guarantee::$guarantee,
            |store| async move { $check(&store).await },
        )
        .await
    };
    ($run:ident, $check:ident, $guarantee:ident, $writes:ident, $skipped:expr) => {
        $run.with_writes(
            stringify!($check),
            Guarantee::$guarantee,
            $writes.clone(),
            $skipped,
            |store, writes| async move { $check(&store, &*writes).await },
        )
        .await
    };
}

mod at_commit;
mod checks;
mod fixtures;
mod leases;
mod report;
mod runner;
mod writes;

pub use at_commit::{
    a_losers_writes_are_rolled_back, a_record_that_expires_during_the_work_is_won_at_commit,
    a_remembered_key_is_never_won_again, an_aborted_transaction_leaves_the_key_free,
    an_expired_record_is_won_again, another_request_gets_the_first_fingerprint,
    concurrent_commits_have_one_winner, run_at_commit, run_at_commit_with,
    scopes_are_isolated_at_commit, the_loser_gets_the_winners_record,
    the_winners_writes_commit_with_its_record,
};
pub use checks::{
    abort_frees_the_key, completed_record_replays_byte_for_byte, concurrent_claims_have_one_owner,
    dropped_handle_frees_the_key, expired_record_is_a_new_operation,
    fingerprint_is_returned_for_comparison, scopes_are_isolated, stale_handle_cannot_complete,
    wait_is_bounded,
};
pub use leases::{
    a_failed_operation_replays_its_failure, a_released_operation_keeps_its_identity,
    an_operation_outlives_its_retention_while_it_runs, concurrent_acquires_have_one_owner,
    duplicate_during_a_lease_is_running, expired_lease_is_recovered_once,
    expired_lease_is_taken_over_once, finished_operation_replays_and_has_a_status,
    heartbeats_keep_the_lease, run_leases, stale_owner_is_fenced, tokens_only_grow,
};
pub use report::{CheckFailure, CheckResult, Guarantee, Outcome, Report};
pub use writes::{
    abort_discards_the_handler_writes, dropped_handle_discards_the_handler_writes,
    failed_write_fails_the_completion, handler_writes_commit_with_the_response, BoxError, Writes,
};

use fixtures::*;
use runner::Runner;

/// Runs every check of the [`Store`] guarantees (the short-transaction
/// mode) that needs nothing but the store; those that look at the handler's
/// writes are reported skipped (see [`run_all_with`]). [`run_leases`] runs
/// those of the long-running mode.
pub async fn run_all<St: Store>(store: St) -> Report {
    run_short(store, None::<writes::NoWrites>).await
}

/// [`run_all`], plus the checks that write through the transaction handle
/// with `writes` and look at what was committed.
pub async fn run_all_with<St: Store, W: Writes<St::Tx>>(store: St, writes: W) -> Report {
    run_short(store, Some(writes)).await
}

async fn run_short<St: Store, W: Writes<St::Tx>>(store: St, writes: Option<W>) -> Report {
    let mut run = Runner::new("Store", store);
    check!(run, completed_record_replays_byte_for_byte, Replay);
    check!(run, fingerprint_is_returned_for_comparison, Replay);
    check!(run, concurrent_claims_have_one_owner, OneOwner);
    check!(run, stale_handle_cannot_complete, OneOwner);
    check!(run, abort_frees_the_key, AbortFreesTheKey);
    check!(run, dropped_handle_frees_the_key, DropFreesTheKey);
    check!(run, wait_is_bounded, BoundedWait);
    check!(run, scopes_are_isolated, TenantIsolation);
    check!(run, expired_record_is_a_new_operation, ExpiryTakeover);

    let writes = writes.map(Arc::new);
    let skipped = "needs a way to write through the handle: run_all_with(store, writes)";
    check! { run, handler_writes_commit_with_the_response, AtomicCompletion, writes, skipped }
    check! { run, failed_write_fails_the_completion, AtomicCompletion, writes, skipped }
    check! { run, abort_discards_the_handler_writes, AbortFreesTheKey, writes, skipped }
    check! { run, dropped_handle_discards_the_handler_writes, DropFreesTheKey, writes, skipped }
    run.finish()
}
