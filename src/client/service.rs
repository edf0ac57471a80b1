//! `IdempotentClient<S>`: one key per call, retries by the contract.

use std::{
    fmt,
    sync::Arc,
    task::{Context, Poll},
};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response};
use http_body::Body;
use tokio::time::Instant;
use tower::retry::Retry;
use tower_service::Service;
use tracing::Instrument;

use super::{
    attempt::{Attempt, Outcome},
    body::{ReplayBody, ResponseBody},
    budget::SharedBudget,
    call::Shared,
    error::{BoxError, ClientError, ClientErrorKind},
    future::ResponseFuture,
    layer::Config,
    policy::{give_up, verdict, ClientPolicy},
    report::{CallReport, GiveUp},
    IdempotentClientLayer,
};
use crate::{
    key::{IdempotencyKey, KeyError},
    record::IDEMPOTENT_REPLAYED,
};

/// The client service [`IdempotentClientLayer`] makes: wraps any
/// `Service<http::Request<B>>` (a hyper client, an in-process router).
///
/// For an unsafe method it keeps the request's `Idempotency-Key` or sets a
/// new random one (UUIDv4), then sends the request until the answer is final
/// under the contract, every attempt with that key. Safe methods (`GET`,
/// `HEAD`, `OPTIONS`, `TRACE`) pass through once, untouched.
///
/// Its [retry budget](super::RetryBudget) is made with it and shared by its
/// clones.
#[derive(Clone)]
pub struct IdempotentClient<S> {
    inner: S,
    config: Arc<Config>,
    budget: Option<SharedBudget>,
}

impl<S> IdempotentClient<S> {
    pub(crate) fn new(inner: S, config: Arc<Config>) -> Self {
        let budget = config.budget.build();
        IdempotentClient {
            inner,
            config,
            budget,
        }
    }

    /// A layer with the defaults, to configure: [`IdempotentClientLayer::new`].
    pub fn layer() -> IdempotentClientLayer {
        IdempotentClientLayer::new()
    }

    crate::macros::define_inner_service_accessors!();
}

impl<S: fmt::Debug> fmt::Debug for IdempotentClient<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotentClient")
            .field("inner", &self.inner)
            .field("config", &self.config)
            .field("budget", &self.budget)
            .finish()
    }
}

fn is_safe(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    )
}

/// The key the request already carries, if any.
fn own_key<B>(request: &Request<B>, config: &Config) -> Result<Option<IdempotencyKey>, KeyError> {
    let mut values = request.headers().get_all(&config.header).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    IdempotencyKey::parse(value.as_bytes()).map(Some)
}

impl<S, B, RB> Service<Request<B>> for IdempotentClient<S>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    B: ReplayBody + Send + 'static,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<RB>>;
    type Error = ClientError;
    type Future = ResponseFuture<RB>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ClientError>> {
        self.inner
            .poll_ready(cx)
            .map_err(|e| ClientError::new(ClientErrorKind::ServiceFailed, 0, None, Some(e.into())))
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        // The service that was made ready is the one to call; the clone
        // stays behind for the next call.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        if is_safe(request.method()) {
            let future = inner.call(request);
            return ResponseFuture::new(async move {
                match future.await {
                    Ok(response) => Ok(response.map(ResponseBody::inner)),
                    Err(e) => Err(ClientError::new(
                        ClientErrorKind::ServiceFailed,
                        1,
                        None,
                        Some(e.into()),
                    )),
                }
            });
        }
        let config = self.config.clone();
        let key = match own_key(&request, &config) {
            Ok(Some(key)) if !config.quote_keys => key,
            Ok(Some(key)) => match set_key(&mut request, &key, &config) {
                Ok(()) => key,
                Err(e) => return refused(Box::new(e)),
            },
            Ok(None) => {
                let key = IdempotencyKey::new_v4();
                match set_key(&mut request, &key, &config) {
                    Ok(()) => key,
                    Err(e) => return refused(Box::new(e)),
                }
            }
            Err(e) => return refused(Box::new(e)),
        };
        if let Some(budget) = &self.budget {
            budget.deposit();
        }
        let span = tracing::info_span!(
            "idempotent_client",
            idempotency.client = %config.name,
            http.request.method = %request.method(),
            idempotency.key_hash = %key.short_hash(),
        );
        let shared = Shared::default();
        let deadline = Instant::now() + config.total_timeout;
        let policy = ClientPolicy {
            config: config.clone(),
            shared: shared.clone(),
            deadline,
            budget: self.budget.clone(),
        };
        let attempt = Attempt {
            inner,
            config: config.clone(),
            shared: shared.clone(),
        };
        ResponseFuture::new(
            async move {
                let mut retry = Retry::new(policy, attempt);
                let outcome = tokio::time::timeout_at(deadline, retry.call(request)).await;
                finish(outcome.ok(), &shared, key, &config)
            }
            .instrument(span),
        )
    }
}

/// Sets the key header: the key as it is, or as an RFC 8941 string when
/// the layer quotes keys.
fn set_key<B>(
    request: &mut Request<B>,
    key: &IdempotencyKey,
    config: &Config,
) -> Result<(), http::header::InvalidHeaderValue> {
    let value = if config.quote_keys {
        // RFC 8941 §3.3.3: `\` and `"` are the only escapes; the rest of a
        // key (visible ASCII) stands for itself.
        let escaped = key.as_str().replace('\\', "\\\\").replace('"', "\\\"");
        HeaderValue::try_from(format!("\"{escaped}\""))?
    } else {
        HeaderValue::from_str(&key.header_value())?
    };
    request.headers_mut().insert(config.header.clone(), value);
    Ok(())
}

/// A call refused before anything was sent.
fn refused<RB: Send + 'static>(source: BoxError) -> ResponseFuture<RB> {
    let error = ClientError::new(ClientErrorKind::KeyInvalid, 0, None, Some(source));
    ResponseFuture::new(std::future::ready(Err(error)))
}

/// The caller's answer from the last outcome (`None`: the deadline passed
/// during an attempt).
fn finish<RB>(
    outcome: Option<Outcome<RB>>,
    shared: &Shared,
    key: IdempotencyKey,
    config: &Config,
) -> Result<Response<ResponseBody<RB>>, ClientError> {
    let mut state = shared.lock();
    let Some(outcome) = outcome else {
        if state.gave_up.is_none() {
            give_up(config, &mut state, GiveUp::Deadline);
        }
        return Err(ClientError::new(
            ClientErrorKind::DeadlineExceeded,
            state.attempts,
            Some(key),
            None,
        ));
    };
    if state.gave_up.is_none() && state.not_replayable && verdict(&outcome).is_some() {
        give_up(config, &mut state, GiveUp::BodyNotReplayable);
    }
    match outcome {
        Ok(answer) => {
            let mut response = answer.response;
            let replayed = response
                .headers()
                .get(IDEMPOTENT_REPLAYED)
                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
            if replayed {
                crate::metrics::client_replayed(&config.name);
            }
            tracing::debug!(
                attempts = state.attempts,
                status = response.status().as_u16(),
                replayed,
                "answered"
            );
            response.extensions_mut().insert(CallReport {
                key,
                attempts: state.attempts,
                retries: std::mem::take(&mut state.retries),
                replayed,
                gave_up: state.gave_up,
            });
            Ok(response)
        }
        Err(e) => {
            let kind = match state.gave_up {
                Some(GiveUp::AttemptsExhausted) => ClientErrorKind::AttemptsExhausted,
                Some(GiveUp::Deadline) => ClientErrorKind::DeadlineExceeded,
                Some(GiveUp::BodyNotReplayable) => ClientErrorKind::BodyNotReplayable,
                Some(GiveUp::RetryBudget) => ClientErrorKind::RetryBudgetExhausted,
                // Only a failed `poll_ready` before a retry ends a call
                // without the policy's say.
                None => ClientErrorKind::ServiceFailed,
            };
            Err(ClientError::new(
                kind,
                state.attempts,
                Some(key),
                Some(e.into_source()),
            ))
        }
    }
}
