//! The body types the layer hands to the inner service and returns.

use std::{
    fmt,
    pin::Pin,
    task::{Context, Poll},
};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use pin_project_lite::pin_project;

pub(crate) use crate::error::BoxError;

/// The request body the inner service receives.
///
/// For an idempotent request it is the buffered body the fingerprint was
/// computed from (the handler sees exactly those bytes); requests the layer
/// passes through (safe methods, or no key when keys are optional) stream.
pub struct RequestBody {
    kind: RequestKind,
}

enum RequestKind {
    Buffered(Buffered),
    Streaming(http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>),
}

impl RequestBody {
    pub(crate) fn buffered(bytes: Bytes) -> Self {
        RequestBody {
            kind: RequestKind::Buffered(Buffered::new(bytes)),
        }
    }

    pub(crate) fn streaming<B>(body: B) -> Self
    where
        B: Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        RequestBody {
            kind: RequestKind::Streaming(body.map_err(Into::into).boxed_unsync()),
        }
    }
}

/// A buffered body, e.g. to call a handler service directly in a test.
impl From<Bytes> for RequestBody {
    fn from(bytes: Bytes) -> Self {
        RequestBody::buffered(bytes)
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match &mut self.get_mut().kind {
            RequestKind::Buffered(buffered) => buffered.poll_frame(),
            RequestKind::Streaming(body) => Pin::new(body).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            RequestKind::Buffered(buffered) => buffered.is_end_stream(),
            RequestKind::Streaming(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            RequestKind::Buffered(buffered) => buffered.size_hint(),
            RequestKind::Streaming(body) => body.size_hint(),
        }
    }
}

impl fmt::Debug for RequestBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            RequestKind::Buffered(_) => "buffered",
            RequestKind::Streaming(_) => "streaming",
        };
        f.debug_struct("RequestBody").field("kind", &kind).finish()
    }
}

pin_project! {
    /// The response body the layer returns: the buffered bytes that were
    /// remembered (or replayed, or a problem), or the inner service's body for
    /// responses that were not remembered.
    pub struct ResponseBody<B> {
        #[pin]
        kind: ResponseKind<B>,
    }
}

pin_project! {
    #[project = ResponseKindProj]
    enum ResponseKind<B> {
        Buffered { buffered: Buffered },
        Inner { #[pin] body: B },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn buffered(bytes: Bytes) -> Self {
        ResponseBody {
            kind: ResponseKind::Buffered {
                buffered: Buffered::new(bytes),
            },
        }
    }

    /// A remembered (or replayed) response's body: `response`'s bytes, then
    /// the trailers its extensions carry, if any.
    pub(crate) fn remembered(response: http::Response<Bytes>) -> http::Response<Self> {
        let (mut parts, bytes) = response.into_parts();
        let trailers = parts
            .extensions
            .remove::<crate::record::ResponseTrailers>()
            .map(|t| t.0);
        let mut buffered = Buffered::new(bytes);
        buffered.trailers = trailers.filter(|t| !t.is_empty());
        http::Response::from_parts(
            parts,
            ResponseBody {
                kind: ResponseKind::Buffered { buffered },
            },
        )
    }

    pub(crate) fn inner(body: B) -> Self {
        ResponseBody {
            kind: ResponseKind::Inner { body },
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            ResponseKindProj::Buffered { buffered } => buffered.poll_frame(),
            ResponseKindProj::Inner { body } => body.poll_frame(cx).map_err(Into::into),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            ResponseKind::Buffered { buffered } => buffered.is_end_stream(),
            ResponseKind::Inner { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            ResponseKind::Buffered { buffered } => buffered.size_hint(),
            ResponseKind::Inner { body } => body.size_hint(),
        }
    }
}

impl<B> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            ResponseKind::Buffered { .. } => "buffered",
            ResponseKind::Inner { .. } => "inner",
        };
        f.debug_struct("ResponseBody").field("kind", &kind).finish()
    }
}

/// A body that is already in memory: one data frame, the trailers if any,
/// then the end.
struct Buffered {
    data: Option<Bytes>,
    trailers: Option<http::HeaderMap>,
}

impl Buffered {
    fn new(bytes: Bytes) -> Self {
        Buffered {
            data: (!bytes.is_empty()).then_some(bytes),
            trailers: None,
        }
    }

    fn poll_frame(&mut self) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let frame = match self.data.take() {
            Some(bytes) => Some(Frame::data(bytes)),
            None => self.trailers.take().map(Frame::trailers),
        };
        Poll::Ready(frame.map(Ok))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.data.as_ref().map_or(0, |bytes| bytes.len() as u64))
    }
}
