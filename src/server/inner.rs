//! What the layer asks of the service it wraps: [`Inner`] and the bodies it
//! answers with, [`InnerBody`].

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use super::body::RequestBody;
use crate::error::BoxError;

/// The inner services the middleware wraps (an alias for their bounds;
/// public only to the sealed [`Mode`](super::Mode)).
pub trait Inner<ResB>:
    Service<
        Request<RequestBody>,
        Response = Response<ResB>,
        Future: Send + 'static,
        Error: Send + 'static,
    > + Clone
    + Send
    + 'static
{
}

impl<T, ResB> Inner<ResB> for T where
    T: Service<
            Request<RequestBody>,
            Response = Response<ResB>,
            Future: Send + 'static,
            Error: Send + 'static,
        > + Clone
        + Send
        + 'static
{
}

/// Response bodies of the inner service (an alias for their bounds;
/// public only to the sealed [`Mode`](super::Mode)).
pub trait InnerBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static {}

impl<T> InnerBody for T where T: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static {}
