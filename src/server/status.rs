//! [`StatusService`]: the status resource of long-running operations.

use std::{
    convert::Infallible,
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use serde_json::Value;
use tower_service::Service;

use super::body::ResponseBody;
use crate::{
    problem::{codes, Problem},
    scope::ResolveTenant,
    store::{LeaseStore, Operation, OperationId, OperationState},
};

/// The status resource of long-running operations, from
/// [`IdempotencyLayer::status_service`](crate::IdempotencyLayer::status_service):
/// mount it at `GET /operations/{id}` (the last path segment is the id).
///
/// For the tenant that started the operation it answers `200` with
/// `{"operation_id": "…", "state": "running", "attempts": 1}`, once
/// completed `{"operation_id": "…", "state": "completed", "attempts": 1,
/// "result": {"status": 200, "body": …}}` (the body as JSON when it is
/// JSON, else as a string), and once it ran out of attempts
/// `{"operation_id": "…", "state": "failed", "attempts": 5, "error":
/// {…problem…}}`. Every
/// other tenant, an unknown id and a malformed one get the same `404
/// not_found`, so ids cannot be probed across tenants. No tenant: `401`.
/// The store unreachable: `503 store_unavailable` with `Retry-After`.
pub struct StatusService<St, R> {
    store: St,
    resolver: Arc<R>,
}

impl<St: Clone, R> Clone for StatusService<St, R> {
    fn clone(&self) -> Self {
        StatusService {
            store: self.store.clone(),
            resolver: self.resolver.clone(),
        }
    }
}

impl<St: fmt::Debug, R> fmt::Debug for StatusService<St, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StatusService")
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}

impl<St, R> StatusService<St, R> {
    pub(crate) fn new(store: St, resolver: Arc<R>) -> Self {
        StatusService { store, resolver }
    }
}

impl<St, R, B> Service<Request<B>> for StatusService<St, R>
where
    St: LeaseStore,
    R: ResolveTenant,
{
    type Response = Response<ResponseBody<String>>;
    type Error = Infallible;
    type Future = StatusFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let (parts, _body) = request.into_parts();
        let tenant = self.resolver.resolve(&parts);
        let store = self.store.clone();
        StatusFuture(Box::pin(async move {
            if parts.method != Method::GET && parts.method != Method::HEAD {
                let problem = Problem::new(
                    StatusCode::METHOD_NOT_ALLOWED,
                    codes::METHOD_NOT_ALLOWED,
                    "The operation status answers GET only",
                );
                return Ok(respond(&problem));
            }
            let Some(tenant) = tenant else {
                let problem = Problem::new(
                    StatusCode::UNAUTHORIZED,
                    codes::UNAUTHORIZED,
                    "No authenticated tenant",
                );
                return Ok(respond(&problem));
            };
            let id = parts.uri.path().rsplit('/').next().unwrap_or_default();
            let Ok(id) = id.parse::<OperationId>() else {
                return Ok(respond(&not_found()));
            };
            let operation = match store.operation(&tenant, id).await {
                Ok(Some(operation)) => operation,
                Ok(None) => return Ok(respond(&not_found())),
                Err(e) => {
                    tracing::error!(error = %e, "cannot read an operation's status");
                    let problem = Problem::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        codes::STORE_UNAVAILABLE,
                        "The idempotency store is unavailable; retry",
                    )
                    .with_retry_after(1);
                    return Ok(respond(&problem));
                }
            };
            let body = status_body(&operation);
            let mut response = Response::new(ResponseBody::buffered(body));
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            Ok(response)
        }))
    }
}

/// The status document, members in the documented order: `operation_id`,
/// `state`, `attempts`, then `result` once completed or `error` once
/// failed. A remembered JSON body is embedded byte for byte; any other body
/// as a JSON string.
fn status_body(operation: &Operation) -> Bytes {
    let id = operation.id;
    let mut out = format!(r#"{{"operation_id":"{id}","state":"#).into_bytes();
    let attempts = format!(r#","attempts":{}"#, operation.attempts);
    match &operation.state {
        OperationState::Running => {
            out.extend_from_slice(br#""running""#);
            out.extend_from_slice(attempts.as_bytes());
            out.push(b'}');
        }
        OperationState::Completed(response) => {
            out.extend_from_slice(br#""completed""#);
            out.extend_from_slice(attempts.as_bytes());
            out.extend_from_slice(br#","result":{"status":"#);
            out.extend_from_slice(response.status.as_u16().to_string().as_bytes());
            out.extend_from_slice(br#","body":"#);
            embed(&mut out, &response.body);
            out.extend_from_slice(b"}}");
        }
        OperationState::Failed(response) => {
            out.extend_from_slice(br#""failed""#);
            out.extend_from_slice(attempts.as_bytes());
            out.extend_from_slice(br#","error":"#);
            embed(&mut out, &response.body);
            out.push(b'}');
        }
    }
    Bytes::from(out)
}

/// Appends a stored body: as it is when it is JSON, else as a JSON string.
/// JSON is UTF-8: the reader skips string contents without checking them,
/// so a body with invalid UTF-8 inside a string is checked apart and
/// embedded as a (lossy) string.
fn embed(out: &mut Vec<u8>, body: &[u8]) {
    if body.is_empty() {
        out.extend_from_slice(b"null");
    } else if std::str::from_utf8(body).is_ok()
        && serde_json::from_slice::<serde::de::IgnoredAny>(body).is_ok()
    {
        out.extend_from_slice(body);
    } else {
        let text = Value::String(String::from_utf8_lossy(body).into_owned());
        out.extend_from_slice(text.to_string().as_bytes());
    }
}

fn not_found() -> Problem {
    Problem::new(StatusCode::NOT_FOUND, codes::NOT_FOUND, "No such operation")
}

fn respond(problem: &Problem) -> Response<ResponseBody<String>> {
    problem.to_response().map(ResponseBody::buffered)
}

type StatusResult = Result<Response<ResponseBody<String>>, Infallible>;

/// The future [`StatusService`] returns.
pub struct StatusFuture(Pin<Box<dyn Future<Output = StatusResult> + Send>>);

impl Future for StatusFuture {
    type Output = StatusResult;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.0.as_mut().poll(cx)
    }
}

impl fmt::Debug for StatusFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StatusFuture").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::StoredResponse;

    fn completed(body: &'static [u8]) -> Operation {
        let response = StoredResponse::new(
            StatusCode::OK,
            &http::HeaderMap::new(),
            &[],
            Bytes::from_static(body),
        );
        Operation::new(
            OperationId::random(),
            OperationState::Completed(response),
            2,
        )
    }

    #[test]
    fn invalid_utf8_inside_a_stored_json_string_still_gives_valid_json() {
        let body = status_body(&completed(b"{\"name\":\"a\xff\xfeb\"}"));
        let parsed: Value = serde_json::from_slice(&body).unwrap_or_else(|e| {
            panic!(
                "the status document is not valid JSON ({e}): {}",
                String::from_utf8_lossy(&body)
            )
        });
        assert_eq!(parsed["state"], "completed");
        assert!(parsed["result"]["body"].is_string(), "{parsed}");
    }

    #[test]
    fn a_stored_json_body_is_embedded_as_json() {
        let body = status_body(&completed(br#"{"shipment_id":"s-1"}"#));
        let parsed: Value = serde_json::from_slice(&body).expect("valid JSON");
        assert_eq!(parsed["attempts"], 2);
        assert_eq!(parsed["result"]["body"]["shipment_id"], "s-1");
    }
}
