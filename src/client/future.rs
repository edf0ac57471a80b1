//! The future of a call through `IdempotentClient`.

use std::{
    fmt,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use http::Response;

use super::{body::ResponseBody, error::ClientError};

type Boxed<RB> =
    Pin<Box<dyn Future<Output = Result<Response<ResponseBody<RB>>, ClientError>> + Send>>;

/// The future [`IdempotentClient`](super::IdempotentClient) returns: every
/// attempt and wait of one call.
pub struct ResponseFuture<RB> {
    inner: Boxed<RB>,
}

impl<RB> ResponseFuture<RB> {
    pub(crate) fn new(
        future: impl Future<Output = Result<Response<ResponseBody<RB>>, ClientError>> + Send + 'static,
    ) -> Self {
        ResponseFuture {
            inner: Box::pin(future),
        }
    }
}

impl<RB> Future for ResponseFuture<RB> {
    type Output = Result<Response<ResponseBody<RB>>, ClientError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<RB> fmt::Debug for ResponseFuture<RB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
