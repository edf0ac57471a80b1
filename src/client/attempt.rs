//! One attempt: the wrapped service's call under the attempt's time bound,
//! its failure boxed, the problem fields of a `409` read, and the
//! in-progress predicate asked.

use std::{
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::Body;
use tower_service::Service;

use super::{
    body::ResponseBody,
    call::Shared,
    error::{AttemptError, BoxError},
    in_progress::ConflictProblem,
    layer::Config,
};
use crate::record::IDEMPOTENCY_ATTEMPT;

/// The largest `409` body read for its problem fields; the contract's problems are
/// far smaller. A larger one is passed on as it is.
const PROBLEM_LIMIT: u64 = 64 * 1024;

/// An answer to one attempt, and whether it says the first attempt with
/// this key still runs (the layer's in-progress predicate).
pub(crate) struct Answer<RB> {
    pub(crate) response: Response<ResponseBody<RB>>,
    pub(crate) in_progress: bool,
}

impl<RB> Answer<RB> {
    /// The answer, judged by the predicate on its head (with a `409`'s
    /// problem fields in its extensions).
    fn judged(response: Response<ResponseBody<RB>>, config: &Config) -> Self {
        let (parts, body) = response.into_parts();
        let in_progress = config.in_progress.matches(&parts);
        Answer {
            response: Response::from_parts(parts, body),
            in_progress,
        }
    }
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

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        let attempt = self.shared.attempt_started();
        // A retry says so: the server may answer it from one read of the
        // key's record.
        if attempt > 1 {
            request
                .headers_mut()
                .insert(IDEMPOTENCY_ATTEMPT, HeaderValue::from(attempt));
        }
        crate::metrics::client_attempt(&self.config.name);
        tracing::debug!(attempt, method = %request.method(), "sending attempt");
        let future = self.inner.call(request);
        let deadline = tokio::time::Instant::now() + self.config.attempt_timeout;
        let config = self.config.clone();
        Box::pin(async move {
            let response = match tokio::time::timeout_at(deadline, future).await {
                Err(_) => return Err(AttemptError::Timeout),
                Ok(Err(e)) => return Err(AttemptError::Inner(e.into())),
                Ok(Ok(response)) => response,
            };
            let response = if response.status() == StatusCode::CONFLICT {
                read_problem(response, deadline).await?
            } else {
                response.map(ResponseBody::inner)
            };
            Ok(Answer::judged(response, &config))
        })
    }
}

/// Reads a `409` of at most [`PROBLEM_LIMIT`] bytes, whether its length is
/// announced or not (a chunked answer), and puts its [`ConflictProblem`] in
/// its extensions, so that the in-progress predicate can tell
/// `idempotency_in_progress` (retried) from every other conflict (not). One
/// announced larger is passed on unread; one that turns out larger while
/// being read is passed on whole, the bytes read first and then the rest.
async fn read_problem<RB>(
    response: Response<RB>,
    deadline: tokio::time::Instant,
) -> Result<Response<ResponseBody<RB>>, AttemptError>
where
    RB: Body<Data = Bytes>,
    RB::Error: Into<BoxError>,
{
    if response.body().size_hint().lower() > PROBLEM_LIMIT {
        return Ok(response.map(ResponseBody::inner));
    }
    let (parts, body) = response.into_parts();
    // Boxed: should the body be too large, what is left of it is passed on,
    // and the caller's body type need not be `Unpin`.
    let mut body = Box::pin(body);
    let mut read = BytesMut::new();
    let mut trailers: Option<HeaderMap> = None;
    loop {
        // The body of an answer is part of the attempt: it may break off
        // or stall too.
        let frame = tokio::time::timeout_at(
            deadline,
            std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)),
        )
        .await
        .map_err(|_| AttemptError::Timeout)?;
        let Some(frame) = frame else { break };
        let frame = frame.map_err(|e| AttemptError::Inner(e.into()))?;
        match frame.into_data() {
            Ok(data) => {
                read.extend_from_slice(&data);
                if read.len() as u64 > PROBLEM_LIMIT {
                    let body = ResponseBody::prefixed(read.freeze(), body);
                    return Ok(Response::from_parts(parts, body));
                }
            }
            Err(frame) => {
                if let Ok(more) = frame.into_trailers() {
                    trailers.get_or_insert_with(HeaderMap::new).extend(more);
                }
            }
        }
    }
    let bytes = read.freeze();
    let mut parts = parts;
    if let Some(problem) = ConflictProblem::read(&bytes) {
        parts.extensions.insert(problem);
    }
    Ok(Response::from_parts(
        parts,
        ResponseBody::buffered(bytes, trailers),
    ))
}
