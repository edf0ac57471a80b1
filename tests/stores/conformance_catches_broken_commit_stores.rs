//! The one-commit mode's conformance checks fail stores that are wrong:
//! `MemoryStore` passes them all, and each broken wrapper around it (one
//! flaw each) fails the checks of the guarantee it breaks.

use tower_idempotency::{
    memory::{MemoryStore, MemoryTx},
    record::StoredResponse,
    store::{Claim, ClaimRequest, CommitStore, Committed, Store, StoreError},
    testing::conformance::{self, BoxError, Guarantee, Outcome, Report, Writes},
};

/// What a [`Broken`] store gets wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flaw {
    /// Nothing: `MemoryStore` as it is.
    None,
    /// A commit that finds the key taken answers `Won` anyway: two commits
    /// win.
    TwoWinners,
    /// A losing commit still commits the loser's writes (under a key of
    /// its own), as a store that inserts the key apart from the handler's
    /// transaction would.
    LoserKeepsItsWrites,
    /// A loser is told a record of its own making, not the winner's.
    LoserAnswersItself,
}

#[derive(Clone)]
struct Broken {
    flaw: Flaw,
    inner: MemoryStore,
}

impl Store for Broken {
    type Tx = MemoryTx;

    async fn claim(&self, request: &ClaimRequest) -> Result<Claim<MemoryTx>, StoreError> {
        self.inner.claim(request).await
    }

    async fn complete(&self, tx: MemoryTx, response: &StoredResponse) -> Result<(), StoreError> {
        self.inner.complete(tx, response).await
    }

    async fn abort(&self, tx: MemoryTx) -> Result<(), StoreError> {
        self.inner.abort(tx).await
    }
}

impl CommitStore for Broken {
    async fn begin(&self, request: &ClaimRequest) -> Result<MemoryTx, StoreError> {
        self.inner.begin(request).await
    }

    async fn commit(
        &self,
        tx: MemoryTx,
        request: &ClaimRequest,
        response: &StoredResponse,
    ) -> Result<Committed, StoreError> {
        let staged = tx.staged_rows(TABLE);
        let committed = self.inner.commit(tx, request, response).await?;
        let Committed::Lost(record) = committed else {
            return Ok(committed);
        };
        match self.flaw {
            Flaw::None => Ok(Committed::Lost(record)),
            Flaw::TwoWinners => Ok(Committed::Won),
            Flaw::LoserKeepsItsWrites => {
                let elsewhere = ClaimRequest::new(
                    request.scope.clone(),
                    tower_idempotency::key::IdempotencyKey::parse(
                        format!("elsewhere-{}", request.key.as_str()).as_bytes(),
                    )
                    .expect("a valid key"),
                    request.fingerprint,
                );
                let side = self.inner.begin(&elsewhere).await?;
                for row in staged {
                    side.insert(TABLE, row)?;
                }
                self.inner.commit(side, &elsewhere, response).await?;
                Ok(Committed::Lost(record))
            }
            Flaw::LoserAnswersItself => {
                let mut own = record;
                own.fingerprint = request.fingerprint;
                own.response = response.clone();
                Ok(Committed::Lost(own))
            }
        }
    }
}

/// The table `MemoryStore`'s own `Writes` stages its markers in.
const TABLE: &str = "conformance_writes";

impl Writes<MemoryTx> for Broken {
    async fn write(&self, tx: &MemoryTx, marker: &str) -> Result<(), BoxError> {
        self.inner.write(tx, marker).await
    }

    async fn fail(&self, tx: &MemoryTx) -> Result<(), BoxError> {
        self.inner.fail(tx).await
    }

    async fn is_committed(&self, marker: &str) -> Result<bool, BoxError> {
        self.inner.is_committed(marker).await
    }
}

async fn report(flaw: Flaw) -> Report {
    let store = Broken {
        flaw,
        inner: MemoryStore::new(),
    };
    conformance::run_at_commit_with(store.clone(), store).await
}

fn failed(report: &Report) -> Vec<(&'static str, Guarantee)> {
    report
        .failures()
        .map(|c| (c.name(), c.failure().expect("a failure").guarantee()))
        .collect()
}

#[tokio::test]
async fn memory_store_passes_every_one_commit_check() {
    let report = report(Flaw::None).await;
    assert_eq!(failed(&report), [], "{report}");
    assert_eq!(report.checks().len(), 10, "{report}");
    report.assert_all_passed();
}

#[tokio::test]
async fn a_store_that_lets_two_commits_win_is_caught() {
    let report = report(Flaw::TwoWinners).await;
    let failed = failed(&report);
    assert!(
        failed.contains(&("concurrent_commits_have_one_winner", Guarantee::OneCommit)),
        "{report}"
    );
    assert!(
        failed.contains(&("a_remembered_key_is_never_won_again", Guarantee::OneCommit)),
        "{report}"
    );
}

#[tokio::test]
async fn a_store_that_keeps_a_losers_writes_is_caught() {
    let report = report(Flaw::LoserKeepsItsWrites).await;
    assert_eq!(
        failed(&report),
        [("a_losers_writes_are_rolled_back", Guarantee::LoserRollsBack)],
        "{report}"
    );
    assert!(
        report.to_string().contains("a loser rolls back"),
        "{report}"
    );
}

#[tokio::test]
async fn a_store_that_answers_a_loser_with_its_own_response_is_caught() {
    let report = report(Flaw::LoserAnswersItself).await;
    let failed = failed(&report);
    assert!(
        failed.contains(&("the_loser_gets_the_winners_record", Guarantee::Replay)),
        "{report}"
    );
    assert!(
        failed.contains(&(
            "another_request_gets_the_first_fingerprint",
            Guarantee::Replay
        )),
        "{report}"
    );
}

#[tokio::test]
async fn without_writes_the_write_checks_are_skipped_and_say_why() {
    let report = conformance::run_at_commit(MemoryStore::new()).await;
    assert_eq!(failed(&report), [], "{report}");
    let skipped: Vec<_> = report
        .checks()
        .iter()
        .filter(|c| matches!(c.outcome(), Outcome::Skipped(_)))
        .map(|c| c.name())
        .collect();
    assert_eq!(
        skipped,
        [
            "the_winners_writes_commit_with_its_record",
            "a_losers_writes_are_rolled_back",
            "a_record_that_expires_during_the_work_is_won_at_commit"
        ]
    );
    assert!(report
        .to_string()
        .contains("run_at_commit_with(store, writes)"));
}
