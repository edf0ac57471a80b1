//! One attempt: the wrapped service's call under the attempt's time bound,
//! its failure boxed, and the problem `code` of a `409` read.

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Limited};
use tower_service::Service;

use super::{
    body::ResponseBody,
    error::{AttemptError, BoxError},
    layer::Config,
    policy::Shared,
};

/// The largest `409` body read for its `code`; the contract's problems are
/// far smaller. A larger (or unannounced) one is passed on unread.
const PROBLEM_LIMIT: u64 = 64 * 1024;

/// An answer to one attempt, with the problem `code` of a `409`.
pub(crate) struct Answer<RB> {
    pub(crate) response: Response<ResponseBody<RB>>,
    pub(crate) code: Option<String>,
}

pub(crate) type Outcome<RB> = Result<Answer<RB>, AttemptError>;

/// The service `tower::retry::Retry` calls once per attempt.
#[derive(Clone)]
pub(crate) struct Attempt<S> {
    pub(crate) inner: S,
    pub(crate) config: Arc<Config>,
    pub(crate) shared: Shared,
}

impl<S, B, RB> Service<Request<B>> for Attempt<S>
where
    S: Service<Request<B>, Response = Response<RB>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    RB: Body<Data = Bytes> + Send + 'static,
    RB::Error: Into<BoxError>,
{
    type Response = Answer<RB>;
    type Error = AttemptError;
    type Future = Pin<Box<dyn Future<Output = Outcome<RB>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), AttemptError>> {
        self.inner
            .poll_ready(cx)
            .map_err(|e| AttemptError::NotReady(e.into()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let attempt = self.shared.attempt_started();
        crate::metrics::client_attempt(&self.config.name);
        tracing::debug!(attempt, method = %request.method(), "sending attempt");
        let future = self.inner.call(request);
        let deadline = tokio::time::Instant::now() + self.config.attempt_timeout;
        Box::pin(async move {
            let response = match tokio::time::timeout_at(deadline, future).await {
                Err(_) => return Err(AttemptError::Timeout),
                Ok(Err(e)) => return Err(AttemptError::Inner(e.into())),
                Ok(Ok(response)) => response,
            };
            if response.status() != StatusCode::CONFLICT {
                return Ok(Answer {
                    response: response.map(ResponseBody::inner),
                    code: None,
                });
            }
            read_problem_code(response, deadline).await
        })
    }
}

/// Reads a `409` whose size is announced and small, to tell
/// `idempotency_in_progress` (retried) from every other conflict (not).
async fn read_problem_code<RB>(
    response: Response<RB>,
    deadline: tokio::time::Instant,
) -> Outcome<RB>
where
    RB: Body<Data = Bytes>,
    RB::Error: Into<BoxError>,
{
    let small = response
        .body()
        .size_hint()
        .upper()
        .is_some_and(|n| n <= PROBLEM_LIMIT);
    if !small {
        return Ok(Answer {
            response: response.map(ResponseBody::inner),
            code: None,
        });
    }
    let (parts, body) = response.into_parts();
    // The body of an answer is part of the attempt: it may break off too.
    let read = Limited::new(body, PROBLEM_LIMIT as usize).collect();
    let collected = tokio::time::timeout_at(deadline, read)
        .await
        .map_err(|_| AttemptError::Timeout)?
        .map_err(AttemptError::Inner)?;
    let trailers = collected.trailers().cloned();
    let bytes = collected.to_bytes();
    let code = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v.get("code")?.as_str().map(str::to_owned));
    Ok(Answer {
        response: Response::from_parts(parts, ResponseBody::buffered(bytes, trailers)),
        code,
    })
}
