//! The response future of [`Idempotency`](crate::Idempotency).

use std::{
    fmt,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use http::Response;

use crate::server::body::ResponseBody;

type BoxFuture<B, E> = Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send>>;

/// The future [`Idempotency`](crate::Idempotency) returns.
///
/// Dropping it (the client went away) does not cancel an operation that
/// already owns its key: that work runs on to commit or roll back, so a retry
/// finds a finished result.
pub struct ResponseFuture<B, E> {
    inner: BoxFuture<B, E>,
}

impl<B, E> ResponseFuture<B, E> {
    pub(crate) fn new(inner: BoxFuture<B, E>) -> Self {
        ResponseFuture { inner }
    }
}

impl<B, E> Future for ResponseFuture<B, E> {
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<B, E> fmt::Debug for ResponseFuture<B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
