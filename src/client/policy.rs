//! The retry policy: which outcomes are retried, after how long, and when
//! the layer stops.

use std::{sync::Arc, time::Duration};

use http::{header, Request, StatusCode};
use tokio::time::{Instant, Sleep};
use tower::retry::Policy;

use super::{
    attempt::{Answer, Outcome},
    body::ReplayBody,
    budget::SharedBudget,
    call::{CallState, Shared},
    error::AttemptError,
    layer::Config,
    report::{GiveUp, RetryReason},
};
/// Would the contract have this outcome retried, and why?
pub(crate) fn verdict<RB>(outcome: &Outcome<RB>) -> Option<RetryReason> {
    match outcome {
        Err(AttemptError::Timeout) => Some(RetryReason::Timeout),
        Err(AttemptError::Inner(_) | AttemptError::NotReady(_)) => Some(RetryReason::Transport),
        Ok(Answer {
            response,
            in_progress,
        }) => match response.status() {
            StatusCode::SERVICE_UNAVAILABLE => Some(RetryReason::Unavailable),
            StatusCode::BAD_GATEWAY | StatusCode::GATEWAY_TIMEOUT => Some(RetryReason::Gateway),
            _ if *in_progress => Some(RetryReason::InProgress),
            _ => None,
        },
    }
}

/// `Retry-After` as the wait it asks for (RFC 9110 §10.2.3): delay-seconds,
/// or an HTTP date (the time until it by this machine's clock; none if it
/// has passed). Unreadable is absent: the backoff applies. Either form is
/// bounded by the call's deadline, where the policy gives up instead.
fn retry_after<RB>(outcome: &Outcome<RB>) -> Option<Duration> {
    let Ok(answer) = outcome else { return None };
    let value = answer.response.headers().get(header::RETRY_AFTER)?;
    let value = value.to_str().ok()?.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    // IMF-fixdate, and the obsolete RFC 850 and asctime forms a recipient
    // must accept too.
    let date = httpdate::parse_http_date(value).ok()?;
    Some(
        date.duration_since(std::time::SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

/// The call's retry policy (`tower::retry::Policy`); one per call.
#[derive(Clone)]
pub(crate) struct ClientPolicy {
    pub(crate) config: Arc<Config>,
    pub(crate) shared: Shared,
    pub(crate) deadline: Instant,
    /// The service's budget, shared with its other calls (`None`: unlimited).
    pub(crate) budget: Option<SharedBudget>,
}

impl ClientPolicy {
    /// The jittered exponential wait before retry number `retry` (1-based).
    fn backoff(&self, retry: u32) -> Duration {
        let doubling = 2_f64.powi(retry.saturating_sub(1).min(30) as i32);
        let full = (self.config.backoff_base.as_secs_f64() * doubling)
            .min(self.config.backoff_max.as_secs_f64());
        crate::jitter::equal(full)
    }
}

/// Records that the call stops although its last outcome was worth a retry.
pub(crate) fn give_up(config: &Config, state: &mut CallState, why: GiveUp) {
    state.gave_up = Some(why);
    crate::metrics::client_give_up(&config.name, why.as_str());
    tracing::warn!(
        attempts = state.attempts,
        reason = why.as_str(),
        "giving up; the last outcome is returned"
    );
}

impl<B, RB> Policy<Request<B>, Answer<RB>, AttemptError> for ClientPolicy
where
    B: ReplayBody,
{
    type Future = Sleep;

    fn retry(
        &mut self,
        _request: &mut Request<B>,
        result: &mut Result<Answer<RB>, AttemptError>,
    ) -> Option<Sleep> {
        let reason = verdict(result)?;
        let shared = self.shared.clone();
        let mut state = shared.lock();
        if state.attempts >= self.config.max_attempts {
            give_up(&self.config, &mut state, GiveUp::AttemptsExhausted);
            return None;
        }
        let retry = state.attempts;
        let wait = retry_after(result).unwrap_or_else(|| self.backoff(retry));
        let resume = Instant::now()
            .checked_add(wait)
            .filter(|resume| *resume < self.deadline);
        let Some(resume) = resume else {
            give_up(&self.config, &mut state, GiveUp::Deadline);
            return None;
        };
        // Asked last: a retry that another bound stops must not spend the
        // budget other calls could use.
        if self.budget.as_ref().is_some_and(|b| !b.withdraw()) {
            give_up(&self.config, &mut state, GiveUp::RetryBudget);
            return None;
        }
        state.retries.push(reason);
        crate::metrics::client_retry(&self.config.name, reason.as_str());
        tracing::info!(
            attempt = state.attempts,
            reason = reason.as_str(),
            wait_ms = wait.as_millis() as u64,
            "retrying with the same key"
        );
        Some(tokio::time::sleep_until(resume))
    }

    fn clone_request(&mut self, request: &Request<B>) -> Option<Request<B>> {
        let Some(body) = request.body().try_clone() else {
            self.shared.lock().not_replayable = true;
            return None;
        };
        let mut copy = Request::new(body);
        *copy.method_mut() = request.method().clone();
        *copy.uri_mut() = request.uri().clone();
        *copy.version_mut() = request.version();
        *copy.headers_mut() = request.headers().clone();
        *copy.extensions_mut() = request.extensions().clone();
        Some(copy)
    }
}
