//! The client side (feature `client`): a tower layer that makes outgoing
//! `POST`s retry-safe under the contract the server layer answers.
//!
//! [`IdempotentClientLayer`] wraps any `tower::Service<http::Request<B>>`
//! (hyper's client, an in-process router): one key per logical operation, the
//! same key on every attempt, waits where the server says the first attempt
//! still runs, and no retry of a refused key. Every answer carries a
//! [`CallReport`]; a call without any answer ends in a [`ClientError`]. Which
//! outcomes are retried, the bounds and defaults, and calling the example
//! order server with hyper: [the client layer guide](crate::guide::client).
//!
//! A scripted service shows the retry: the first attempt is told the
//! operation is still running, the second gets the answer, with the same key.
//!
//! ```
//! use std::sync::{Arc, Mutex};
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use tower::{service_fn, Layer, ServiceExt};
//! use tower_idempotency::client::{CallReport, IdempotentClientLayer, RetryReason};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let keys = Arc::new(Mutex::new(Vec::new()));
//! let server = service_fn({
//!     let keys = keys.clone();
//!     move |request: Request<Full<Bytes>>| {
//!         let mut keys = keys.lock().unwrap();
//!         keys.push(request.headers()["idempotency-key"].clone());
//!         let response = if keys.len() == 1 {
//!             Response::builder().status(StatusCode::CONFLICT).header("retry-after", "0")
//!                 .body(Full::new(Bytes::from_static(br#"{"code":"idempotency_in_progress"}"#)))
//!         } else {
//!             Response::builder().status(StatusCode::CREATED).body(Full::new(Bytes::new()))
//!         };
//!         std::future::ready(response)
//!     }
//! });
//! let client = IdempotentClientLayer::new().layer(server);
//! let response = client.oneshot(Request::post("/orders").body(Full::new(Bytes::new())).unwrap()).await.unwrap();
//! assert_eq!(response.status(), StatusCode::CREATED);
//! let report = response.extensions().get::<CallReport>().unwrap();
//! assert_eq!(report.retries(), [RetryReason::InProgress]);
//! let keys = keys.lock().unwrap();
//! assert_eq!(keys[0], keys[1]);
//! assert_eq!(keys[0], report.key().as_str());
//! # }
//! ```

mod attempt;
mod body;
mod budget;
mod call;
mod error;
mod future;
mod in_progress;
mod layer;
mod policy;
mod report;
mod service;

pub use body::{ReplayBody, ResponseBody};
pub use budget::RetryBudget;
pub use error::{ClientError, ClientErrorKind};
pub use future::ResponseFuture;
pub use in_progress::ConflictProblem;
pub use layer::IdempotentClientLayer;
pub use report::{CallReport, GiveUp, RetryReason};
pub use service::IdempotentClient;
