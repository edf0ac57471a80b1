//! The flow of the two modes whose owner writes in one transaction
//! (phases 2 to 5): coalesce, open the owner's transaction, run the owner
//! inside it, remember (commit the response with the handler's writes) or
//! roll back. [`ClaimFirst`] claims the key first and the owner
//! completes it; [`ClaimAtCommit`] claims it with the commit itself.

use std::{future::Future, sync::Arc, time::Instant};

use bytes::Bytes;
use http::Request;

use super::{
    admit::Admitted,
    body::RequestBody,
    cache::Repeat,
    coalesce::{coalesce, Coalesced, Proceed},
    deadline::{self, Deadlines},
    endpoint::Setup,
    inner::{Inner, InnerBody},
    mode::{ClaimAtCommit, ClaimFirst},
    owner::run_owner,
    settled::{Rollback, Settled, Timings},
};
use crate::{
    record::{says_retry, Record, StoredResponse, Trace},
    store::{
        limits::HOLD_MARGIN, Claim, ClaimRequest, CommitStore, Committed, Store, StoreError,
        StoreErrorKind,
    },
};

/// How a one-transaction mode opens the owner's transaction and ends it.
pub(crate) trait OneTransaction<St: Store>: Send + Sync + 'static {
    /// Whether [`commit`](Self::commit) may answer [`Committed::Freed`],
    /// after which the owner runs again (so its request is kept for that).
    const MAY_FREE: bool;

    /// Phase 3: the handle the owner writes through, or the answer the
    /// key already has.
    fn open(
        store: &St,
        claim: &ClaimRequest,
    ) -> impl Future<Output = Result<Claim<St::Tx>, StoreError>> + Send;

    /// Phase 5: commits `response` with the owner's writes.
    fn commit(
        store: &St,
        tx: St::Tx,
        claim: &ClaimRequest,
        response: &StoredResponse,
    ) -> impl Future<Output = Result<Committed, StoreError>> + Send;

    /// Phase 5, when the owner's work ended without a commit of its own:
    /// the record the key has by now, which a mode that did not read the
    /// key before running the owner must answer instead.
    fn decided_elsewhere(
        store: &St,
        claim: &ClaimRequest,
        deadlines: Deadlines,
    ) -> impl Future<Output = Option<Record>> + Send;
}

impl<St: Store> OneTransaction<St> for ClaimFirst {
    const MAY_FREE: bool = false;

    fn open(
        store: &St,
        claim: &ClaimRequest,
    ) -> impl Future<Output = Result<Claim<St::Tx>, StoreError>> + Send {
        store.claim(claim)
    }

    async fn commit(
        store: &St,
        tx: St::Tx,
        _: &ClaimRequest,
        response: &StoredResponse,
    ) -> Result<Committed, StoreError> {
        store.complete(tx, response).await.map(|()| Committed::Won)
    }

    /// The claim read the key: this request held it, so no other record.
    async fn decided_elsewhere(_: &St, _: &ClaimRequest, _: Deadlines) -> Option<Record> {
        None
    }
}

impl<St: CommitStore> OneTransaction<St> for ClaimAtCommit {
    const MAY_FREE: bool = true;

    async fn open(store: &St, claim: &ClaimRequest) -> Result<Claim<St::Tx>, StoreError> {
        store.begin(claim).await.map(Claim::Owned)
    }

    fn commit(
        store: &St,
        tx: St::Tx,
        claim: &ClaimRequest,
        response: &StoredResponse,
    ) -> impl Future<Output = Result<Committed, StoreError>> + Send {
        store.commit(tx, claim, response)
    }

    /// A retry that reached an instance without the key in its replay cache
    /// ran the owner before anything was read; its work failed, often on
    /// what the first commit wrote (a unique key of the domain). The key
    /// is read now, by a claim that is let go at once if the key is free:
    /// two round trips more, on failures only.
    async fn decided_elsewhere(
        store: &St,
        claim: &ClaimRequest,
        deadlines: Deadlines,
    ) -> Option<Record> {
        let claimed = deadline::within(
            deadlines.end(),
            store.claim(claim),
            deadline::claim_unanswered,
        );
        match claimed.await {
            Ok(Claim::Completed(record)) => Some(record),
            Ok(Claim::Owned(tx)) => {
                let _ = abort(store, tx, deadlines).await;
                None
            }
            Ok(Claim::InProgress) => None,
            Err(e) => {
                tracing::warn!(error = %e, "the key could not be read after the rollback");
                None
            }
        }
    }
}

/// A named fault point of the request flow (feature `failpoints`, for
/// tests): fires if the request carries an `InjectFault` for it, and
/// compiles to nothing without the feature.
macro_rules! fault_point {
    ($faults:expr, $point:ident) => {
        #[cfg(feature = "failpoints")]
        super::failpoints::InjectFault::hit($faults, super::failpoints::FaultPoint::$point);
    };
}

/// Phases 2 to 5 for a request that may own its key: coalesce, claim (or
/// open), run the owner, remember. Says how the request settled.
pub(crate) async fn run<S: Inner<B>, St: Store, F, R, B: InnerBody, M: OneTransaction<St>>(
    setup: Setup<St, F, R, M>,
    inner: S,
    admitted: Admitted,
) -> (Settled<B, S::Error>, Timings) {
    let Admitted {
        parts,
        body,
        mut claim,
        repeatable,
    } = admitted;
    let config = &setup.config;
    let mut timings = Timings::start();
    // Remembered with the response: a replay's span names this trace.
    let trace = crate::record::request_trace(&parts.headers);
    let deadline = tokio::time::Instant::now() + config.wait;
    let deadlines = Deadlines::new(deadline, config.handler_timeout);
    #[cfg(feature = "failpoints")]
    let faults: Faults = parts
        .extensions
        .get::<super::failpoints::InjectFault>()
        .copied();
    #[cfg(not(feature = "failpoints"))]
    let faults: Faults = ();
    fault_point!(faults, BeforeClaim);

    // A retry of a record this process committed was answered from memory
    // before this flow was spawned (in admission). The record this request
    // commits goes in, with the request's method, target and body when a
    // retry that repeats them byte for byte may be answered without a
    // fingerprint (copied now, in one buffer: the owner consumes the
    // request's parts).
    let cache = setup.shared.cache.as_ref();
    let mut first = cache.filter(|_| repeatable).map(|_| {
        let target = parts.uri.path_and_query().map_or("/", |t| t.as_str());
        Repeat::new(&parts.method, target, &body)
    });

    // 2. Coalesce.
    let in_process = coalesce(&setup.shared.in_flight, &claim, deadline).await;
    let Proceed { lead, followed } = match in_process.go_on(&claim.fingerprint, &mut timings, 1) {
        std::ops::ControlFlow::Continue(proceed) => proceed,
        std::ops::ControlFlow::Break(settled) => return (settled, timings),
    };
    // Followers of this process answer from the record this request
    // commits or finds.
    let answered = |record: Arc<Record>| {
        if let Some(lead) = &lead {
            lead.answered(record);
        }
    };

    // A retry that says so, which the replay cache did not answer: the
    // key's record read first (one round trip, nothing written), instead of
    // a claim that would find the row taken. What the read finds is what
    // the claim would answer; when it finds nothing, the claim arbitrates.
    if says_retry(&parts.headers) {
        let looked = deadline::within(
            deadlines.claim(),
            setup.store.lookup(&claim),
            deadline::claim_unanswered,
        );
        match looked.await {
            Ok(Some(record)) => {
                timings.claimed = Some(timings.since_arrival());
                let record = Arc::new(record);
                answered(record.clone());
                return (Coalesced::answer(&record, &claim.fingerprint), timings);
            }
            Ok(None) => {}
            Err(e) => return (Settled::ClaimFailed(e), timings),
        }
    }

    // A second run's request, in a mode whose commit may free the key
    // first (`Committed::Freed`: the key's record had expired): the parts
    // as they came, before the owner's transaction joins them, and the
    // service. Copied before the first run, which consumes them.
    let mut again = M::MAY_FREE.then(|| (copy_parts(&parts), inner.clone()));
    let (mut parts, mut inner) = (parts, inner);
    let expires = std::time::Instant::now() + claim.retention;
    // The key is held from the first run's claim to the end of the last.
    let mut held_since = None;
    // A second run gets what is left of the request's budget, if less.
    let mut handler_timeout = config.handler_timeout;
    loop {
        // 3. Claim (or only open the transaction), with what is left of
        // the wait. Should this process freeze past the handler's deadline,
        // the database ends the claim by itself. The record's retention
        // counts from the claim (or the commit), so it ends no sooner than
        // `expires`.
        claim.wait = deadline.saturating_duration_since(tokio::time::Instant::now());
        claim.hold_limit = Some(config.handler_timeout.saturating_add(HOLD_MARGIN));
        let claimed = deadline::within(
            deadlines.claim(),
            M::open(&setup.store, &claim),
            deadline::claim_unanswered,
        )
        .await;
        let claimed_at = *timings.claimed.get_or_insert(timings.since_arrival());
        if followed || matches!(claimed, Ok(Claim::InProgress)) {
            timings.waited = Some(claimed_at);
        }
        let tx = match claimed {
            Ok(Claim::Owned(tx)) => tx,
            Ok(Claim::Completed(record)) => {
                let record = Arc::new(record);
                answered(record.clone());
                return (Coalesced::answer(&record, &claim.fingerprint), timings);
            }
            Ok(Claim::InProgress) => return (Settled::InProgress { retry_after: 1 }, timings),
            Err(e) => return (Settled::ClaimFailed(e), timings),
        };
        let held_since = *held_since.get_or_insert_with(Instant::now);
        fault_point!(faults, AfterClaim);

        // 4. Run the owner, under its deadline.
        parts.extensions.insert(tx.clone());
        let request = Request::from_parts(parts, RequestBody::buffered(body.clone()));
        let owner = run_owner(
            inner,
            request,
            config.response_body_limit,
            &*config.classifier,
        );
        let ran = tokio::time::timeout(handler_timeout, owner)
            .await
            .unwrap_or(Err(Rollback::TimedOut));
        if ran.is_ok() {
            fault_point!(faults, AfterHandler);
        }

        // 5. Remember, or roll back.
        let ran = ran.map(|(parts, body)| (parts, body, trace));
        let remembered = remember::<M, _, _, _, _, _>(&setup, tx, &claim, ran, deadlines, faults);
        let ended = match remembered.await {
            Remembered::Committed(parts, stored) => {
                fault_point!(faults, AfterCommit);
                // The response as committed is the record this process now
                // answers retries with.
                let body = stored.body.clone();
                let record = Arc::new(Record {
                    fingerprint: claim.fingerprint,
                    response: stored,
                });
                if let Some(cache) = cache {
                    cache.insert_with(&claim.scope, &claim.key, &record, first.take(), expires);
                }
                answered(record);
                Settled::Committed(parts, body)
            }
            Remembered::Settled(ended) => ended,
            // One-commit mode: another commit had the key; answer its record.
            Remembered::Lost(record) => {
                crate::metrics::commit_lost(&config.endpoint);
                let record = Arc::new(record);
                answered(record.clone());
                timings.held = Some(held_since.elapsed());
                return (Coalesced::answer(&record, &claim.fingerprint), timings);
            }
            // One-commit mode: the key was freed of an expired record, and
            // the work was rolled back: run it again, once, on the free key
            // (under a handler timeout of its own). The discarded run is
            // counted as a lost commit's is.
            Remembered::Freed => match again.take() {
                Some((copied, service)) if !deadlines.rerun(config.handler_timeout).is_zero() => {
                    handler_timeout = deadlines.rerun(config.handler_timeout);
                    crate::metrics::commit_lost(&config.endpoint);
                    tracing::debug!("the key's expired record was removed; running the work again");
                    (parts, inner) = (copied, service);
                    continue;
                }
                // Nothing left to run it again in: the key is free, and the
                // retry runs it.
                _ => Settled::InProgress { retry_after: 1 },
            },
        };
        timings.held = Some(held_since.elapsed());
        return (ended, timings);
    }
}

/// A copy of a request's parts, for a second run of its owner.
fn copy_parts(parts: &http::request::Parts) -> http::request::Parts {
    let (mut copy, ()) = Request::new(()).into_parts();
    copy.method = parts.method.clone();
    copy.uri = parts.uri.clone();
    copy.version = parts.version;
    copy.headers = parts.headers.clone();
    copy.extensions = parts.extensions.clone();
    copy
}

/// How phase 5 ended.
enum Remembered<B, E> {
    /// Committed with the handler's writes: the response's parts, and the
    /// response as stored.
    Committed(http::response::Parts, StoredResponse),
    Settled(Settled<B, E>),
    /// The one-commit mode's work lost to this record: its commit found
    /// the key taken, or its work failed and the key was found taken.
    Lost(Record),
    /// The one-commit mode's commit found the key's record expired and
    /// removed it: the work was rolled back, and may run again.
    Freed,
}

/// Commits the owner's response with its writes, or rolls its work back.
async fn remember<M: OneTransaction<St>, St: Store, F, R, ResB, E>(
    setup: &Setup<St, F, R, M>,
    tx: St::Tx,
    claim: &ClaimRequest,
    ran: Result<(http::response::Parts, Bytes, Trace), Rollback<ResB, E>>,
    deadlines: Deadlines,
    #[cfg_attr(not(feature = "failpoints"), allow(unused_variables))] faults: Faults,
) -> Remembered<ResB, E> {
    let failed = match ran {
        Ok((parts, body, (trace_id, span_id))) => {
            let replayed = &setup.config.replay_headers;
            let stored =
                StoredResponse::remember(&parts, replayed, body).with_trace(trace_id, span_id);
            fault_point!(faults, BeforeCommit);
            let committed = deadline::within(
                deadlines.end(),
                M::commit(&setup.store, tx, claim, &stored),
                deadline::commit_unanswered,
            );
            match committed.await {
                Ok(Committed::Won) => return Remembered::Committed(parts, stored),
                Ok(Committed::Lost(record)) => return Remembered::Lost(record),
                Ok(Committed::Held) => {
                    return Remembered::Settled(Settled::InProgress { retry_after: 1 })
                }
                Ok(Committed::Freed) => return Remembered::Freed,
                // The database did not answer the commit: reading the key
                // now would go unanswered too, and the retry learns the
                // outcome.
                Err(e)
                    if matches!(
                        e.kind(),
                        StoreErrorKind::OutcomeUnknown | StoreErrorKind::Unavailable
                    ) =>
                {
                    return Remembered::Settled(Settled::CompletionFailed(e))
                }
                Err(e) => Settled::CompletionFailed(e),
            }
        }
        Err(rollback) => {
            let aborted = abort(&setup.store, tx, deadlines).await;
            match (rollback, aborted) {
                // The handler's statements went unanswered, and so did the
                // rollback: the database, not the handler, stopped. Reading
                // the key now would go unanswered too.
                (Rollback::TimedOut, Err(e)) if e.kind() == StoreErrorKind::Unavailable => {
                    return Remembered::Settled(Settled::StoreLost(e))
                }
                (rollback, _) => Settled::RolledBack(rollback),
            }
        }
    };
    match M::decided_elsewhere(&setup.store, claim, deadlines).await {
        Some(record) => Remembered::Lost(record),
        None => Remembered::Settled(failed),
    }
}

/// Rolls the owner's work back, by the end's deadline; a rollback that
/// fails or is not answered in time leaves the connection closed, and the
/// server rolls back when it learns so.
async fn abort<St: Store>(store: &St, tx: St::Tx, deadlines: Deadlines) -> Result<(), StoreError> {
    let aborted = deadline::within(
        deadlines.end(),
        store.abort(tx),
        deadline::rollback_unanswered,
    )
    .await;
    if let Err(e) = &aborted {
        tracing::warn!(error = %e, "rollback failed; the connection was discarded");
    }
    aborted
}

/// The fault injected into this request, if any (feature `failpoints`).
#[cfg(feature = "failpoints")]
type Faults = Option<super::failpoints::InjectFault>;
#[cfg(not(feature = "failpoints"))]
type Faults = ();
