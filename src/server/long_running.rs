//! The long-running mode's flow (phases 2 to 5): coalesce, acquire the
//! operation, run its attempt on a task of its own, answer with its result
//! or `202`; and [`drive`]: one attempt of the owner's work under its lease,
//! shared by requests and the recovery worker.

use std::{panic::AssertUnwindSafe, sync::Arc, time::Instant};

use bytes::Bytes;
use futures_util::FutureExt;
use http::{header, request::Parts, Request, StatusCode};
use tokio::sync::oneshot;
use tracing::Instrument;

use super::{
    admit::Admitted,
    body::RequestBody,
    coalesce::{coalesce, Proceed},
    drain::Counted,
    endpoint::{Config, Setup},
    inner::{Inner, InnerBody},
    lease_config::LeaseConfig,
    mode::LongRunning,
    owner::run_owner,
    settled::{Rollback, Settled, StatusHint, Timings},
};
use crate::{
    metrics::{self, TakeoverBy},
    problem::{codes, Problem},
    record::StoredResponse,
    store::{Acquired, LeaseRequest, LeaseStore, OperationId, StoreErrorKind, StoredRequest},
};

/// How one attempt of the owner's work under a lease ended.
pub(crate) enum Driven<B, E> {
    /// The handler's answer is stored (the compare-and-swap on the token
    /// held).
    Completed(http::response::Parts, Bytes),
    /// No allowed attempt gave an answer: the operation ended `failed`, and
    /// this is its remembered `500 operation_failed`.
    Failed(http::response::Parts, Bytes),
    /// It ended without an answer to remember; the operation stays, its
    /// lease given up, for the next attempt.
    AttemptFailed(Rollback<B, E>),
    /// Another owner took the operation over; this one stopped.
    Fenced,
    /// It panicked, or its end could not be stored (logged): the operation
    /// stays, and its next attempt resumes it.
    Unfinished,
}

/// One attempt of an operation, for [`drive`]: the lease it runs under,
/// its number (1 for the first) and who acquired it.
pub(crate) struct Attempt<L> {
    pub(crate) lease: L,
    pub(crate) number: u32,
    pub(crate) by: TakeoverBy,
}

/// Phases 3 to 5 in the long-running mode: acquire the operation (or say
/// where it stands), start its work on a task of its own, and wait for it
/// up to `respond_within` before answering `202 Accepted`.
pub(crate) async fn run<S: Inner<B>, St: LeaseStore, F, R, B: InnerBody>(
    setup: Setup<St, F, R, LongRunning>,
    inner: S,
    mut admitted: Admitted,
) -> (Settled<B, S::Error>, Timings) {
    let claim = &mut admitted.claim;
    let config = setup.config.clone();
    let lease_config = setup.mode.config.clone();
    let status = StatusHint::of(&lease_config);
    let mut timings = Timings::start();
    let deadline = tokio::time::Instant::now() + config.wait;

    // 2. Coalesce, as in the claim-first mode.
    let in_process = coalesce(&setup.shared.in_flight, claim, deadline).await;
    let retry_after = lease_config.retry_after();
    let Proceed { lead, followed } =
        match in_process.go_on(&claim.fingerprint, &mut timings, retry_after) {
            std::ops::ControlFlow::Continue(proceed) => proceed,
            std::ops::ControlFlow::Break(settled) => return (settled, timings),
        };

    // 3. Acquire: a committed record, whoever owns it.
    claim.wait = deadline.saturating_duration_since(tokio::time::Instant::now());
    let request = LeaseRequest::new(
        lease_config.lease,
        OperationId::random(),
        stored_request(&admitted.parts, &admitted.body),
    );
    let acquired = setup.store.acquire(claim, &request).await;
    timings.claimed = Some(timings.since_arrival());
    if followed || matches!(acquired, Ok(Acquired::InProgress)) {
        timings.waited = timings.claimed;
    }
    // The key has a committed record: duplicates here may read it, or take
    // the completed one from here.
    if let Some(lead) = &lead {
        match &acquired {
            Ok(Acquired::Completed(record)) => lead.answered(std::sync::Arc::new(record.clone())),
            Ok(Acquired::Owned(_) | Acquired::Running { .. }) => lead.settled(),
            _ => {}
        }
    }
    let owned = match acquired {
        Ok(Acquired::Owned(owned)) => owned,
        Ok(Acquired::Running {
            operation_id,
            fingerprint,
        }) if fingerprint == claim.fingerprint => {
            return (Settled::StillRunning(operation_id, status), timings)
        }
        Ok(Acquired::Completed(record)) if record.fingerprint == claim.fingerprint => {
            return (Settled::Replayed(record.response), timings)
        }
        Ok(Acquired::Running { .. } | Acquired::Completed(_)) => {
            return (Settled::KeyReused, timings)
        }
        Ok(Acquired::InProgress) => return (Settled::InProgress { retry_after }, timings),
        Err(e) => return (Settled::ClaimFailed(e), timings),
    };
    let operation_id = owned.operation_id;
    if owned.taken_over {
        tracing::info!(%operation_id, token = owned.token, attempt = owned.attempt, "resumed an operation whose lease had ended");
        metrics::lease_takeover(&config.endpoint, TakeoverBy::Request);
    }

    // 4. Start the work; it outlives this request if it must.
    let (mut parts, body) = (admitted.parts, admitted.body);
    parts.extensions.insert(owned.lease.clone());
    let request = Request::from_parts(parts, RequestBody::buffered(body));
    let running = setup.shared.drain.start();
    let work = drive(
        setup.store.clone(),
        config.clone(),
        lease_config.clone(),
        inner,
        request,
        Attempt {
            lease: owned.lease,
            number: owned.attempt,
            by: TakeoverBy::Request,
        },
    );
    let done = spawn_work(work, running);

    // 5. Answer with its result if it comes in time, else 202.
    match tokio::time::timeout(lease_config.respond_within, done).await {
        Ok(Ok(Driven::Completed(parts, body) | Driven::Failed(parts, body))) => {
            (Settled::Committed(parts, body), timings)
        }
        Ok(Ok(Driven::AttemptFailed(rollback))) => {
            (Settled::AttemptFailed(operation_id, rollback), timings)
        }
        // Fenced, unfinished (resumed later), or still running: the
        // operation exists; its status resource tells how it ends.
        _ => (Settled::Accepted(operation_id, status), timings),
    }
}

/// Runs `work` on a task of its own, counted as running until it ends.
/// A panic is logged (never its message, which may quote request data): the
/// lease then lapses, and the operation is taken over.
pub(crate) fn spawn_work<B, E>(
    work: impl std::future::Future<Output = Driven<B, E>> + Send + 'static,
    running: Counted,
) -> oneshot::Receiver<Driven<B, E>>
where
    B: Send + 'static,
    E: Send + 'static,
{
    let (ended, done) = oneshot::channel();
    let task = tokio::spawn(work.in_current_span());
    tokio::spawn(
        async move {
            let _running = running;
            match task.await {
                Ok(driven) => {
                    let _ = ended.send(driven);
                }
                Err(e) if e.is_panic() => tracing::error!(
                    "the operation's work panicked; its lease will lapse and it will be taken over"
                ),
                Err(_) => {
                    tracing::warn!("the operation's work was cancelled by a runtime shutdown")
                }
            }
        }
        .in_current_span(),
    );
    done
}

/// Runs attempt number `attempt` of the owner's work under `lease`: the
/// handler (bounded by the handler timeout, a panic caught), with
/// heartbeats renewing the lease until it returns, then its answer stored
/// by a compare-and-swap on the token. An attempt that ends without an
/// answer gives the lease up and leaves the operation to the next attempt;
/// the last allowed one ends it `failed`. A heartbeat that finds the token
/// changed stops the work: it was fenced.
pub(crate) async fn drive<S, St, ResB>(
    store: St,
    config: Arc<Config>,
    lease_config: LeaseConfig,
    inner: S,
    request: Request<RequestBody>,
    attempt: Attempt<St::Lease>,
) -> Driven<ResB, S::Error>
where
    S: Inner<ResB>,
    St: LeaseStore,
    ResB: InnerBody,
{
    let endpoint = &*config.endpoint;
    let Attempt {
        lease,
        number: attempt,
        by,
    } = attempt;
    if attempt > lease_config.max_attempts {
        // Every allowed attempt ended without an answer; the last may have
        // taken its process down, so nobody recorded the failure then.
        return fail_for_good(&store, &lease, &config, attempt - 1).await;
    }
    // Counted once it is sure to run, whoever acquired it.
    metrics::operation_attempt(endpoint, by);
    let _running = metrics::OperationRunning::start(endpoint);
    let started = Instant::now();
    let (trace_id, span_id) = crate::record::request_trace(request.headers());
    let work = AssertUnwindSafe(tokio::time::timeout(
        config.handler_timeout,
        run_owner(
            inner,
            request,
            config.response_body_limit,
            &*config.classifier,
        ),
    ))
    .catch_unwind();
    let ran = tokio::select! {
        biased;
        ran = work => ran,
        () = keep_alive(&store, &lease, &lease_config) => {
            metrics::fenced(endpoint, metrics::FencedAt::Heartbeat);
            tracing::warn!("the operation was taken over by another owner; stopped its work");
            return Driven::Fenced;
        }
    };
    let failed =
        |rollback| attempt_failed(&store, &lease, &config, &lease_config, attempt, rollback);
    let driven = match ran {
        Ok(Ok(Ok((parts, body)))) => {
            let stored = StoredResponse::remember(&parts, &config.replay_headers, body)
                .with_trace(trace_id, span_id);
            match store.finish(&lease, &stored).await {
                Ok(()) => {
                    tracing::info!(
                        status = parts.status.as_u16(),
                        "operation completed; its answer is stored"
                    );
                    Driven::Completed(parts, stored.body)
                }
                Err(e) if e.kind() == StoreErrorKind::Fenced => {
                    metrics::fenced(endpoint, metrics::FencedAt::Completion);
                    tracing::warn!(
                        "the operation was taken over before it completed; its answer was refused"
                    );
                    Driven::Fenced
                }
                Err(e) => {
                    tracing::error!(error = %e, "could not store the operation's answer; it will be taken over once its lease expires");
                    Driven::Unfinished
                }
            }
        }
        Ok(Ok(Err(rollback))) => failed(Some(rollback)).await,
        Ok(Err(_elapsed)) => {
            // Counted here, for requests and recoveries alike; the
            // request's answer does not count it again.
            metrics::handler_timeout(endpoint);
            failed(Some(Rollback::TimedOut)).await
        }
        Err(_panic) => {
            // Never the panic's message: it may quote request data.
            tracing::error!(attempt, "the operation's attempt panicked");
            failed(None).await
        }
    };
    metrics::key_held(endpoint, started.elapsed().as_secs_f64());
    driven
}

/// An attempt ended without an answer to remember (`None`: it panicked).
/// Before the last allowed attempt, the lease is given up and the
/// operation waits for its next attempt; after it, the operation fails.
async fn attempt_failed<St: LeaseStore, B, E>(
    store: &St,
    lease: &St::Lease,
    config: &Config,
    lease_config: &LeaseConfig,
    attempt: u32,
    rollback: Option<Rollback<B, E>>,
) -> Driven<B, E> {
    let max_attempts = lease_config.max_attempts;
    if attempt >= max_attempts {
        return fail_for_good(store, lease, config, attempt).await;
    }
    match store.release(lease).await {
        Err(e) if e.kind() == StoreErrorKind::Fenced => {
            metrics::fenced(&config.endpoint, metrics::FencedAt::Completion);
            return Driven::Fenced;
        }
        Err(e) => tracing::warn!(error = %e, "could not give the lease up; the next attempt comes once it expires"),
        Ok(()) => tracing::info!(
            attempt,
            max_attempts,
            "the attempt ended without an answer to remember; the operation resumes on a retry with the same key or by recovery"
        ),
    }
    rollback.map_or(Driven::Unfinished, Driven::AttemptFailed)
}

/// Ends the operation `failed` after `attempts` attempts: its
/// `500 operation_failed` is remembered, answered and replayed.
pub(crate) async fn fail_for_good<St: LeaseStore, B, E>(
    store: &St,
    lease: &St::Lease,
    config: &Config,
    attempts: u32,
) -> Driven<B, E> {
    let problem = operation_failed(attempts)
        .or_type_base(config.problem_type_base.as_ref())
        .to_response();
    let (parts, body) = problem.into_parts();
    let stored = StoredResponse::new(parts.status, &parts.headers, &[header::CONTENT_TYPE], body);
    match store.fail(lease, &stored, attempts).await {
        Ok(()) => {
            metrics::operation_failed(&config.endpoint);
            tracing::warn!(
                attempts,
                "the operation ended failed: no attempt gave an answer; retries replay operation_failed"
            );
            Driven::Failed(parts, stored.body)
        }
        Err(e) if e.kind() == StoreErrorKind::Fenced => {
            metrics::fenced(&config.endpoint, metrics::FencedAt::Completion);
            Driven::Fenced
        }
        Err(e) => {
            tracing::error!(error = %e, "could not store the operation's failure; the next attempt will");
            Driven::Unfinished
        }
    }
}

/// The remembered answer of an operation that ran out of attempts.
fn operation_failed(attempts: u32) -> Problem {
    Problem::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        codes::OPERATION_FAILED,
        "The operation failed",
    )
    .with_detail(format!(
        "it ended without an answer in each of its {attempts} attempts; retrying with the same key gets this answer again"
    ))
    .with_member("attempts", attempts)
}

/// Renews the lease every heartbeat; returns only once a heartbeat finds
/// the lease fenced. A heartbeat that fails otherwise (the database
/// unreachable) is tried again at the next beat: the lease only lapses if
/// none gets through for the whole lease.
async fn keep_alive<St: LeaseStore>(store: &St, lease: &St::Lease, config: &LeaseConfig) {
    let mut beats = tokio::time::interval_at(
        tokio::time::Instant::now() + config.heartbeat,
        config.heartbeat,
    );
    beats.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        beats.tick().await;
        match tokio::time::timeout(config.heartbeat, store.heartbeat(lease, config.lease)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) if e.kind() == StoreErrorKind::Fenced => return,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "heartbeat failed; trying again at the next one")
            }
            Err(_) => tracing::warn!("heartbeat timed out; trying again at the next one"),
        }
    }
}

/// What is stored to re-drive the request: method, target, `Content-Type`
/// and body (never credentials).
fn stored_request(parts: &Parts, body: &Bytes) -> StoredRequest {
    let target = parts.uri.path_and_query().map_or("/", |t| t.as_str());
    // The content type, and a gRPC message's encoding: without it neither
    // the re-driven handler nor the fingerprint could read a compressed
    // message again.
    let grpc_encoding = header::HeaderName::from_static("grpc-encoding");
    let headers = [header::CONTENT_TYPE, grpc_encoding]
        .into_iter()
        .flat_map(|name| {
            parts
                .headers
                .get_all(&name)
                .iter()
                .map(move |value| (name.clone(), value.clone()))
                .collect::<Vec<_>>()
        })
        .collect();
    StoredRequest::new(parts.method.clone(), target, headers, body.clone())
}
