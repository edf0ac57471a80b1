//! The client side (feature `client`): a tower layer that makes outgoing
//! `POST`s retry-safe under the contract the server layer answers.
//!
//! A client of an idempotent API has one loop to get right: one
//! high-entropy key per logical operation, the same key on every retry,
//! waiting when told the first attempt still runs, and never retrying a
//! refused key. [`IdempotentClientLayer`] is that loop, for any
//! `tower::Service<http::Request<B>>` (hyper's client, an in-process router),
//! built on `tower::retry`.
//!
//! - **The key.** An unsafe request without an `Idempotency-Key` gets a random
//!   UUIDv4; one that has a key (yours, or one derived with
//!   [`outbox::derive_key`](crate::outbox::derive_key)) keeps it. Every
//!   attempt of the call carries that key. An invalid key of yours is refused
//!   before anything is sent ([`ClientErrorKind::KeyInvalid`]). Logs and
//!   `Debug` output show the key only as a short hash (`key_hash`).
//! - **The answer.** Whatever its status, an answer is returned as a
//!   response, with a [`CallReport`] in its extensions: the key, the attempts,
//!   why each retry was made, whether `Idempotent-Replayed: true` was seen
//!   ([`CallReport::replayed`]), and why the layer gave up, if it did. A call
//!   that got no answer at all ends in a [`ClientError`] with a stable code.
//! - **Bounds.** At most [`max_attempts`](IdempotentClientLayer::max_attempts)
//!   attempts, each bounded by
//!   [`attempt_timeout`](IdempotentClientLayer::attempt_timeout), all of it
//!   by [`total_timeout`](IdempotentClientLayer::total_timeout): a wait that
//!   would end past it is not started.
//! - **Bodies.** Only a body that can be sent again is retried
//!   ([`ReplayBody`]: `Full`, `Empty`, `String`; streams are sent once).
//!
//! # Which outcomes are retried
//!
//! | outcome of an attempt | retried? | why |
//! | --- | --- | --- |
//! | connection error, or the body of a `409` breaks off | yes | the request may or may not have arrived; the same key makes a second arrival a replay |
//! | no answer within `attempt_timeout` | yes | the same: the server may have committed, and then replays |
//! | `503` (e.g. `store_unavailable`) | yes, after `Retry-After` | nothing was remembered; the retry starts afresh |
//! | `502`, `504` | yes | a proxy failed on the way; the same key keeps it safe |
//! | `409` `idempotency_in_progress` | yes, after `Retry-After` | the first attempt still runs; the retry gets its answer |
//! | `409` `idempotency_key_reused` | no | a different request under the same key: a bug a retry cannot fix |
//! | any other `409` (`checkout_already_ordered`, …) | no | a remembered, final answer |
//! | `422`, other `4xx` | no | the request is wrong as it is |
//! | `2xx` (new or `Idempotent-Replayed: true`) | no | done |
//! | `500`, other `5xx` | no | the server's contract: the same request fails the same way (`commit_rejected`) |
//!
//! `Retry-After` counts in either form, delay-seconds or an HTTP date (the
//! wait until it by the local clock, none if it has passed). Without it,
//! the wait is a jittered exponential backoff
//! ([`backoff`](IdempotentClientLayer::backoff)). A retryable outcome whose
//! body cannot be replayed, or that comes after the last attempt, or whose
//! wait would pass the deadline, is returned as it is.
//!
//! A `409`'s body is read for its `code`, up to 64 KiB, whether its length
//! is announced or not (chunked); one announced larger is passed on unread,
//! one that turns out larger is passed on whole, neither retried.
//!
//! # Example
//!
//! Calling the example order server with hyper's client (see the README):
//!
//! ```no_run
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use hyper_util::{client::legacy::Client, rt::TokioExecutor};
//! use tower::{ServiceBuilder, ServiceExt};
//! use tower_idempotency::client::{CallReport, IdempotentClientLayer};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
//! let client = ServiceBuilder::new()
//!     .layer(IdempotentClientLayer::new())
//!     .service(http);
//! let request = http::Request::post("http://127.0.0.1:3000/orders")
//!     .header("authorization", "Bearer demo-token-a")
//!     .header("content-type", "application/json")
//!     .body(Full::new(Bytes::from_static(br#"{"checkout_id":"chk_1","currency":"JPY","items":[{"sku":"SKU-1","unit_price":1200}],"shipping_address_id":"addr_1"}"#)))?;
//! let response = client.oneshot(request).await?;
//! let report = response.extensions().get::<CallReport>().expect("an unsafe method");
//! println!("{} after {} attempt(s), replayed: {}", response.status(), report.attempts(), report.replayed());
//! # Ok(()) }
//! ```
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
mod error;
mod future;
mod layer;
mod policy;
mod report;
mod service;

pub use body::{ReplayBody, ResponseBody};
pub use error::{ClientError, ClientErrorKind};
pub use future::ResponseFuture;
pub use layer::IdempotentClientLayer;
pub use report::{CallReport, GiveUp, RetryReason};
pub use service::IdempotentClient;
