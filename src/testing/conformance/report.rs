//! What a run of the suite found: one line per check, readable in a CI log.

use std::{fmt, time::Duration};

use crate::store::StoreError;

/// A guarantee of the [`Store`](crate::store::Store) or
/// [`LeaseStore`](crate::store::LeaseStore) contract, as the checks name
/// them. Every failure names the guarantee it found broken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Guarantee {
    /// A completed record replays its status, headers and body byte for
    /// byte, with the first request's fingerprint.
    Replay,
    /// At most one owner per key at a time; a handle that lost the key
    /// cannot complete it.
    OneOwner,
    /// The handler's writes and the remembered response commit together, or
    /// neither does.
    AtomicCompletion,
    /// An abort (or a failed completion) discards the owner's writes and
    /// frees the key.
    AbortFreesTheKey,
    /// Dropping every clone of an unfinished handle, or cancelling a claim,
    /// holds nothing: the key is free again.
    DropFreesTheKey,
    /// A claim that meets an unfinished owner answers `InProgress` after its
    /// wait, not later.
    BoundedWait,
    /// Two tenants with the same raw key never see each other's records.
    TenantIsolation,
    /// A record past its retention is taken over as a new operation.
    ExpiryTakeover,
    /// Long-running mode: once a lease expired, exactly one request takes
    /// the operation over.
    LeaseTakeover,
    /// Long-running mode: a stale owner's writes, heartbeats, finish and
    /// release are refused and change nothing.
    Fencing,
    /// Long-running mode: a key's attempt tokens only grow.
    MonotonicToken,
    /// Long-running mode: heartbeats keep a lease alive.
    Heartbeat,
    /// Long-running mode: a finished operation replays its answer.
    Finish,
    /// Long-running mode: the status of an operation, to its tenant only.
    Status,
    /// Long-running mode: an abandoned operation is recovered by one worker.
    Recovery,
    /// Long-running mode: an operation keeps its id, record and status
    /// through an attempt that ended without an answer; the next attempt
    /// resumes it, counted.
    Identity,
    /// Long-running mode: an operation that ran out of attempts ends
    /// failed, and its failure replays like an answer.
    Failure,
    /// One-commit mode: of concurrent commits of one key exactly one wins,
    /// and none while the key's record lives.
    OneCommit,
    /// One-commit mode: nothing a losing commit's transaction wrote is
    /// committed.
    LoserRollsBack,
}

impl Guarantee {
    /// The guarantee's name, as failure messages start with it.
    pub fn name(self) -> &'static str {
        match self {
            Guarantee::Replay => "replay",
            Guarantee::OneOwner => "one owner",
            Guarantee::AtomicCompletion => "atomic completion",
            Guarantee::AbortFreesTheKey => "abort frees the key",
            Guarantee::DropFreesTheKey => "drop frees the key",
            Guarantee::BoundedWait => "bounded wait",
            Guarantee::TenantIsolation => "tenant isolation",
            Guarantee::ExpiryTakeover => "expiry takeover",
            Guarantee::LeaseTakeover => "takeover",
            Guarantee::Fencing => "fencing",
            Guarantee::MonotonicToken => "monotonic token",
            Guarantee::Heartbeat => "heartbeat",
            Guarantee::Finish => "finish",
            Guarantee::Status => "status",
            Guarantee::Recovery => "recovery",
            Guarantee::Identity => "identity",
            Guarantee::Failure => "failure",
            Guarantee::OneCommit => "one commit wins",
            Guarantee::LoserRollsBack => "a loser rolls back",
        }
    }
}

impl fmt::Display for Guarantee {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a check failed: the guarantee it found broken and what it saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckFailure {
    guarantee: Guarantee,
    message: String,
}

impl CheckFailure {
    /// A failure of `guarantee`; `message` says what the check saw.
    pub fn new(guarantee: Guarantee, message: impl Into<String>) -> Self {
        CheckFailure {
            guarantee,
            message: message.into(),
        }
    }

    /// The broken guarantee.
    pub fn guarantee(&self) -> Guarantee {
        self.guarantee
    }

    /// What the check saw.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for CheckFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.guarantee, self.message)
    }
}

impl std::error::Error for CheckFailure {}

/// What became of one check.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The store kept the guarantee.
    Passed,
    /// The store broke a guarantee (or the check did not finish in time, or
    /// the store panicked).
    Failed(CheckFailure),
    /// The check needs something the run was not given (e.g.
    /// [`Writes`](super::Writes)); the reason says what.
    Skipped(&'static str),
}

/// One check of a run: its name, the guarantee it checks, what became of it
/// and how long it took.
#[derive(Debug, Clone)]
pub struct CheckResult {
    name: &'static str,
    guarantee: Guarantee,
    outcome: Outcome,
    elapsed: Duration,
}

impl CheckResult {
    /// The check's name: the name of its function in this module.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The guarantee the check is about; a failure may name another one it
    /// found broken on the way ([`CheckFailure::guarantee`]).
    pub fn guarantee(&self) -> Guarantee {
        self.guarantee
    }

    /// What became of it.
    pub fn outcome(&self) -> &Outcome {
        &self.outcome
    }

    /// The failure, if the check failed.
    pub fn failure(&self) -> Option<&CheckFailure> {
        match &self.outcome {
            Outcome::Failed(failure) => Some(failure),
            _ => None,
        }
    }

    /// How long the check ran.
    pub fn elapsed(&self) -> Duration {
        self.elapsed
    }
}

/// The result of [`run_all`](super::run_all) or
/// [`run_leases`](super::run_leases): every check, in the order run.
///
/// `Display` prints one line per check (passed, failed with the broken
/// guarantee and why, skipped with why) under a summary line;
/// [`assert_passed`](Self::assert_passed) panics with all of it, for a
/// one-line test:
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use tower_idempotency::{memory::MemoryStore, testing::conformance};
///
/// let report = conformance::run_all(MemoryStore::new()).await;
/// assert!(report.passed(), "{report}");
/// assert!(report.check("concurrent_claims_have_one_owner").is_some());
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Report {
    title: &'static str,
    checks: Vec<CheckResult>,
}

impl Report {
    pub(super) fn new(title: &'static str) -> Self {
        Report {
            title,
            checks: Vec::new(),
        }
    }

    pub(super) fn push(
        &mut self,
        name: &'static str,
        guarantee: Guarantee,
        outcome: Outcome,
        elapsed: Duration,
    ) {
        self.checks.push(CheckResult {
            name,
            guarantee,
            outcome,
            elapsed,
        });
    }

    /// Every check, in the order run.
    pub fn checks(&self) -> &[CheckResult] {
        &self.checks
    }

    /// The check named `name`, if the run had one.
    pub fn check(&self, name: &str) -> Option<&CheckResult> {
        self.checks.iter().find(|c| c.name == name)
    }

    /// The checks that failed.
    pub fn failures(&self) -> impl Iterator<Item = &CheckResult> {
        self.checks.iter().filter(|c| c.failure().is_some())
    }

    /// The names of the checks that failed, in the order run.
    pub fn failed_names(&self) -> Vec<&'static str> {
        self.failures().map(|c| c.name).collect()
    }

    /// Whether no check failed (skipped checks do not fail a run).
    pub fn passed(&self) -> bool {
        self.failures().next().is_none()
    }

    /// Panics with the whole report if a check failed.
    #[track_caller]
    pub fn assert_passed(&self) {
        if !self.passed() {
            panic!("{self}");
        }
    }

    /// Whether every check ran and passed: none failed, none skipped.
    pub fn all_passed(&self) -> bool {
        self.checks.iter().all(|c| c.outcome == Outcome::Passed)
    }

    /// Panics with the whole report unless every check ran and passed (a
    /// store that gives the suite its handler writes should see no check
    /// skipped).
    #[track_caller]
    pub fn assert_all_passed(&self) {
        if !self.all_passed() {
            panic!("every check must run and pass:\n{self}");
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let count = |p: fn(&Outcome) -> bool| self.checks.iter().filter(|c| p(&c.outcome)).count();
        let passed = count(|o| matches!(o, Outcome::Passed));
        let failed = count(|o| matches!(o, Outcome::Failed(_)));
        let skipped = count(|o| matches!(o, Outcome::Skipped(_)));
        writeln!(
            f,
            "{} conformance: {passed} passed, {failed} failed, {skipped} skipped",
            self.title
        )?;
        let width = self.checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
        for check in &self.checks {
            let ms = check.elapsed.as_millis();
            match &check.outcome {
                Outcome::Passed => writeln!(
                    f,
                    "  ok    {:width$}  {} ({ms} ms)",
                    check.name, check.guarantee
                )?,
                Outcome::Failed(failure) => {
                    writeln!(f, "  FAIL  {:width$}  {failure} ({ms} ms)", check.name)?
                }
                Outcome::Skipped(why) => writeln!(
                    f,
                    "  skip  {:width$}  {}: {why}",
                    check.name, check.guarantee
                )?,
            }
        }
        Ok(())
    }
}

/// Turns a store's error into the failure of a check.
pub(super) trait OrFail<T> {
    /// `Err(e)` becomes a failure of `guarantee`: "`what`: `e`".
    fn or_fail(self, guarantee: Guarantee, what: &str) -> Result<T, CheckFailure>;
}

impl<T> OrFail<T> for Result<T, StoreError> {
    fn or_fail(self, guarantee: Guarantee, what: &str) -> Result<T, CheckFailure> {
        self.map_err(|e| CheckFailure::new(guarantee, format!("{what}: {e}")))
    }
}

/// Fails the check with a failure of `$guarantee` unless `$cond` holds.
macro_rules! ensure {
    ($cond:expr, $guarantee:expr, $($message:tt)+) => {
        if !$cond {
            return Err($crate::testing::conformance::CheckFailure::new(
                $guarantee,
                format!($($message)+),
            ));
        }
    };
}

/// Fails the check with a failure of `$guarantee`.
macro_rules! fail {
    ($guarantee:expr, $($message:tt)+) => {
        return Err($crate::testing::conformance::CheckFailure::new(
            $guarantee,
            format!($($message)+),
        ))
    };
}

pub(super) use {ensure, fail};
