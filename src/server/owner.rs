//! Running the owner: the inner service called, and a response to remember
//! buffered under its limit. Shared by both modes.

use std::future::poll_fn;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tower_service::Service;

use super::{body::RequestBody, inner::InnerBody, settled::Rollback};
use crate::{
    classify::{Classifier, Verdict},
    record::{ResourceId, ResponseTrailers},
};

/// Calls the inner service and buffers a response to remember: the part of
/// the owner's work the handler timeout bounds.
pub(crate) async fn run_owner<S, ResB>(
    inner: S,
    request: Request<RequestBody>,
    body_limit: usize,
    classifier: &dyn Classifier,
) -> Result<(http::response::Parts, Bytes), Rollback<ResB, S::Error>>
where
    S: Service<Request<RequestBody>, Response = Response<ResB>>,
    ResB: InnerBody,
{
    let response = call_inner(inner, request)
        .await
        .map_err(Rollback::ServiceFailed)?;
    let (mut parts, body) = response.into_parts();
    let verdict = classifier.classify_head(&parts);
    if verdict == Verdict::RollBack {
        return Err(Rollback::NotRemembered(Response::from_parts(parts, body)));
    }
    if parts
        .extensions
        .get::<ResourceId>()
        .is_some_and(|id| !id.is_storable())
    {
        return Err(Rollback::Unstorable(
            "the resource id is empty, longer than 255 bytes or has control characters",
        ));
    }
    match Limited::new(body, body_limit).collect().await {
        Ok(collected) => {
            // Kept beside the bytes: remembered with them, and sent after
            // them in the first answer and every replay.
            let trailers = collected.trailers().filter(|t| !t.is_empty()).cloned();
            let remembered =
                verdict == Verdict::Remember || classifier.classify_end(&parts, trailers.as_ref());
            if let Some(trailers) = trailers {
                parts.extensions.insert(ResponseTrailers(trailers));
            }
            let bytes = collected.to_bytes();
            if remembered {
                Ok((parts, bytes))
            } else {
                Err(Rollback::NotRememberedBuffered(parts, bytes))
            }
        }
        Err(e) if e.is::<LengthLimitError>() => Err(Rollback::Unstorable(
            "the response body is over the stored-response limit",
        )),
        Err(_) => Err(Rollback::Unstorable("the response body failed")),
    }
}

pub(crate) async fn call_inner<S, ResB>(
    mut inner: S,
    request: Request<RequestBody>,
) -> Result<Response<ResB>, S::Error>
where
    S: Service<Request<RequestBody>, Response = Response<ResB>>,
{
    poll_fn(|cx| inner.poll_ready(cx)).await?;
    inner.call(request).await
}
