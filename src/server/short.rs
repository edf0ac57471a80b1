//! The short-transaction mode's flow (phases 2 to 5): coalesce, claim,
//! run the owner inside the claim's transaction, remember (commit the
//! response with the handler's writes) or roll back.

use std::{sync::Arc, time::Instant};

use bytes::Bytes;
use http::Request;

use super::{
    admit::Admitted,
    body::RequestBody,
    coalesce::{coalesce, Coalesced, Proceed},
    endpoint::Setup,
    owner::run_owner,
    service::{Inner, InnerBody},
    settled::{Rollback, Settled, Timings},
};
use crate::{
    record::{Record, StoredResponse},
    store::{Claim, Store},
};

/// A named fault point of the request flow (feature `failpoints`, for
/// tests): fires if the request carries an `InjectFault` for it, and
/// compiles to nothing without the feature.
macro_rules! fault_point {
    ($faults:expr, $point:ident) => {
        #[cfg(feature = "failpoints")]
        super::failpoints::InjectFault::hit($faults, super::failpoints::FaultPoint::$point);
    };
}

/// Phases 2 to 5 for a request that may own its key: coalesce, claim, run
/// the owner, remember. Says how the request settled.
pub(crate) async fn run<S, St, F, R, ResB>(
    setup: Setup<St, F, R>,
    inner: S,
    admitted: Admitted,
) -> (Settled<ResB, S::Error>, Timings)
where
    S: Inner<ResB>,
    St: Store,
    ResB: InnerBody,
{
    let Admitted {
        mut parts,
        body,
        mut claim,
    } = admitted;
    let config = &setup.config;
    let mut timings = Timings::start();
    let deadline = tokio::time::Instant::now() + config.wait;
    #[cfg(feature = "failpoints")]
    let faults: Faults = parts
        .extensions
        .get::<super::failpoints::InjectFault>()
        .copied();
    #[cfg(not(feature = "failpoints"))]
    let faults: Faults = ();
    fault_point!(faults, BeforeClaim);

    // A retry of a record this process committed: answered from memory.
    let cache = setup.shared.cache.as_ref();
    if let Some(record) = cache.and_then(|c| c.get(&claim.scope, &claim.key)) {
        timings.claimed = Some(timings.since_arrival());
        return (Coalesced::answer(&record, &claim.fingerprint), timings);
    }

    // 2. Coalesce.
    let in_process = coalesce(&setup, &claim, deadline).await;
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

    // 3. Claim, with what is left of the wait. Should this process freeze
    // past the handler's deadline, the database ends the claim by itself.
    claim.wait = deadline.saturating_duration_since(tokio::time::Instant::now());
    claim.hold_limit = Some(config.handler_timeout.saturating_add(HOLD_MARGIN));
    // The record's retention counts from its claim, which comes after this
    // instant: a record this request commits lives at least until `expires`.
    let expires = std::time::Instant::now() + config.retention;
    let claimed = setup.store.claim(&claim).await;
    timings.claimed = Some(timings.since_arrival());
    if followed || matches!(claimed, Ok(Claim::InProgress)) {
        timings.waited = timings.claimed;
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
    let held_since = Instant::now();
    fault_point!(faults, AfterClaim);

    // 4. Run the owner, under its deadline.
    parts.extensions.insert(tx.clone());
    let request = Request::from_parts(parts, RequestBody::buffered(body));
    let owner = run_owner(inner, request, config.response_body_limit);
    let ran = tokio::time::timeout(config.handler_timeout, owner)
        .await
        .unwrap_or(Err(Rollback::TimedOut));
    if ran.is_ok() {
        fault_point!(faults, AfterHandler);
    }

    // 5. Remember, or roll back.
    let ended = remember(&setup, tx, ran, faults).await;
    if let Settled::Committed(parts, body) = &ended {
        fault_point!(faults, AfterCommit);
        let replayed = &config.replay_headers;
        let record = Arc::new(Record {
            fingerprint: claim.fingerprint,
            response: StoredResponse::remember(parts, replayed, body.clone()),
        });
        if let Some(cache) = cache {
            cache.insert(&claim.scope, &claim.key, record.clone(), expires);
        }
        answered(record);
    }
    timings.held = Some(held_since.elapsed());
    (ended, timings)
}

/// Commits the owner's response with its writes, or rolls its work back.
async fn remember<St: Store, F, R, ResB, E>(
    setup: &Setup<St, F, R>,
    tx: St::Tx,
    ran: Result<(http::response::Parts, Bytes), Rollback<ResB, E>>,
    #[cfg_attr(not(feature = "failpoints"), allow(unused_variables))] faults: Faults,
) -> Settled<ResB, E> {
    match ran {
        Ok((parts, body)) => {
            let replayed = &setup.config.replay_headers;
            let stored = StoredResponse::remember(&parts, replayed, body);
            fault_point!(faults, BeforeCommit);
            match setup.store.complete(tx, &stored).await {
                Ok(()) => Settled::Committed(parts, stored.body),
                Err(e) => Settled::CompletionFailed(e),
            }
        }
        Err(rollback) => {
            if let Err(e) = setup.store.abort(tx).await {
                tracing::warn!(error = %e, "rollback failed; the connection was discarded");
            }
            Settled::RolledBack(rollback)
        }
    }
}

/// The fault injected into this request, if any (feature `failpoints`).
#[cfg(feature = "failpoints")]
type Faults = Option<super::failpoints::InjectFault>;
#[cfg(not(feature = "failpoints"))]
type Faults = ();

/// How long past the handler's deadline the database itself ends an owner's
/// transaction that went silent (its process frozen, its network gone).
const HOLD_MARGIN: std::time::Duration = std::time::Duration::from_secs(5);
