//! Request bodies the layer can send again, and the body it answers with.

use std::{
    fmt,
    pin::Pin,
    task::{Context, Poll},
};

use bytes::{Buf, Bytes};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{combinators, Empty, Full};
use pin_project_lite::pin_project;

use super::error::BoxError;

/// A request body that can be sent again for a retry.
///
/// Buffered bodies ([`Full`], [`Empty`], [`String`]) answer with a copy
/// (cheap for `Full<Bytes>`: a reference count). A streaming body answers
/// `None`: the layer sends it once, and a failure that would otherwise be
/// retried is returned as it is (a response, with
/// [`GiveUp::BodyNotReplayable`](super::GiveUp::BodyNotReplayable) in its
/// [`CallReport`](super::CallReport); no answer at all, as
/// [`ClientErrorKind::BodyNotReplayable`](super::ClientErrorKind::BodyNotReplayable)).
///
/// Implement it for your own body type:
///
/// ```
/// use tower_idempotency::client::ReplayBody;
///
/// struct Upload(http_body_util::Full<bytes::Bytes>);
/// # impl http_body::Body for Upload {
/// #     type Data = bytes::Bytes;
/// #     type Error = std::convert::Infallible;
/// #     fn poll_frame(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>)
/// #         -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, Self::Error>>> {
/// #         std::pin::Pin::new(&mut self.get_mut().0).poll_frame(cx)
/// #     }
/// # }
///
/// impl ReplayBody for Upload {
///     fn try_clone(&self) -> Option<Self> {
///         Some(Upload(self.0.clone()))
///     }
/// }
/// ```
pub trait ReplayBody: Body + Sized {
    /// A body with the same content, or `None` if this one cannot be sent again.
    fn try_clone(&self) -> Option<Self>;
}

impl<D: Buf + Clone> ReplayBody for Full<D> {
    fn try_clone(&self) -> Option<Self> {
        Some(self.clone())
    }
}

impl<D: Buf> ReplayBody for Empty<D> {
    fn try_clone(&self) -> Option<Self> {
        Some(Empty::new())
    }
}

impl ReplayBody for String {
    fn try_clone(&self) -> Option<Self> {
        Some(self.clone())
    }
}

/// A boxed body is a stream the layer cannot rewind: sent once, never retried.
impl<D: Buf, E> ReplayBody for combinators::BoxBody<D, E> {
    fn try_clone(&self) -> Option<Self> {
        None
    }
}

/// A boxed body is a stream the layer cannot rewind: sent once, never retried.
impl<D: Buf, E> ReplayBody for combinators::UnsyncBoxBody<D, E> {
    fn try_clone(&self) -> Option<Self> {
        None
    }
}

pin_project! {
    /// The body of an answer through [`IdempotentClient`](super::IdempotentClient):
    /// the wrapped service's body as it came, or, for a `409` the layer read
    /// to learn its problem `code`, the same bytes, from memory as far as
    /// the layer read them.
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner { #[pin] inner: B },
        Buffered { data: Option<Bytes>, trailers: Option<HeaderMap> },
        // A body read in part: the bytes read, then the rest.
        Prefixed { data: Option<Bytes>, rest: Pin<Box<B>> },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(inner: B) -> Self {
        ResponseBody {
            kind: Kind::Inner { inner },
        }
    }

    pub(crate) fn buffered(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        ResponseBody {
            kind: Kind::Buffered {
                data: Some(data).filter(|d| !d.is_empty()),
                trailers,
            },
        }
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn prefixed(data: Bytes, rest: Pin<Box<B>>) -> Self {
        ResponseBody {
            kind: Kind::Prefixed {
                data: Some(data).filter(|d| !d.is_empty()),
                rest,
            },
        }
    }
}

impl<B> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            Kind::Inner { .. } => "Inner",
            Kind::Buffered { .. } => "Buffered",
            Kind::Prefixed { .. } => "Prefixed",
        };
        f.debug_struct("ResponseBody").field("kind", &kind).finish()
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
            KindProj::Inner { inner } => inner.poll_frame(cx).map_err(Into::into),
            KindProj::Buffered { data, trailers } => {
                if let Some(data) = data.take() {
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Poll::Ready(trailers.take().map(|t| Ok(Frame::trailers(t))))
            }
            KindProj::Prefixed { data, rest } => {
                if let Some(data) = data.take() {
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                rest.as_mut().poll_frame(cx).map_err(Into::into)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { inner } => inner.is_end_stream(),
            Kind::Buffered { data, trailers } => data.is_none() && trailers.is_none(),
            Kind::Prefixed { data, rest } => data.is_none() && rest.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { inner } => inner.size_hint(),
            Kind::Buffered { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Kind::Prefixed { data, rest } => {
                let read = data.as_ref().map_or(0, |d| d.len() as u64);
                let rest = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(rest.lower().saturating_add(read));
                if let Some(upper) = rest.upper() {
                    hint.set_upper(upper.saturating_add(read));
                }
                hint
            }
        }
    }
}
