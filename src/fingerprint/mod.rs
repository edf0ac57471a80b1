//! Request fingerprints: what makes two requests "the same request".
//!
//! - [`Fingerprint`] and the [`Fingerprinter`] trait live here.
//! - [`JsonFingerprinter`]: any JSON body by its canonical form.
//! - [`TypedFingerprinter`]: a DTO with validation, leaving
//!   [`Validated`] for the handler.
//!
//! What the fingerprint covers, and which bodies are refused because two
//! readers could read them differently:
//! [the fingerprints guide](crate::guide::fingerprints).
//!
//! A closure is a fingerprinter. This one lets a header take part and refuses
//! an empty body before the request claims its key:
//!
//! ```
//! use http::{request::Parts, StatusCode};
//! use tower_idempotency::{fingerprint::{Fingerprint, Fingerprinter}, problem::{codes, Problem}};
//!
//! let by_currency = |parts: &mut Parts, body: &bytes::Bytes| {
//!     if body.is_empty() {
//!         return Err(Problem::new(
//!             StatusCode::UNPROCESSABLE_ENTITY,
//!             codes::VALIDATION_FAILED,
//!             "The request body is empty",
//!         ));
//!     }
//!     let currency = parts.headers.get("currency").map_or(&b""[..], |v| v.as_bytes());
//!     let mut canonical = currency.to_vec();
//!     canonical.push(0);
//!     canonical.extend_from_slice(body);
//!     Ok(Fingerprint::digest("payments.v1", &canonical))
//! };
//!
//! let (mut eur, _) = http::Request::builder().header("currency", "EUR").body(()).unwrap().into_parts();
//! let (mut usd, _) = http::Request::builder().header("currency", "USD").body(()).unwrap().into_parts();
//! let body = bytes::Bytes::from_static(b"100");
//! assert_ne!(
//!     by_currency.fingerprint(&mut eur, &body).unwrap(),
//!     by_currency.fingerprint(&mut usd, &body).unwrap(),
//! );
//! let empty = by_currency.fingerprint(&mut eur, &bytes::Bytes::new()).unwrap_err();
//! assert_eq!(empty.status(), StatusCode::UNPROCESSABLE_ENTITY);
//! ```
//!
//! [`JsonFingerprinter`] needs no DTO:
//!
//! ```
//! use tower_idempotency::{fingerprint::{Fingerprinter, JsonFingerprinter}};
//!
//! let fp = JsonFingerprinter::new("orders.v1").ignore_field("request_id");
//! let (mut parts, _) = http::Request::new(()).into_parts();
//! let mut fingerprint = |body: &'static str| fp.fingerprint(&mut parts, &body.into());
//!
//! let first = fingerprint(r#"{"sku": "a", "qty": 2, "request_id": "r1"}"#).unwrap();
//! assert_eq!(first, fingerprint(r#"{"qty":2.0,"sku":"a","request_id":"r2"}"#).unwrap());
//! assert_ne!(first, fingerprint(r#"{"sku": "a", "qty": 3}"#).unwrap());
//! assert_eq!(fingerprint("not json").unwrap_err().code(), "validation_failed");
//! ```

use std::fmt;

use bytes::Bytes;
use http::request::Parts;
use sha2::{Digest, Sha256};

use crate::problem::Problem;

mod json;
mod number;
mod strict;
mod typed;

#[cfg(test)]
mod hostile_tests;

pub use json::JsonFingerprinter;
pub(crate) use json::{canonical_digest, canonical_json};
pub(crate) use typed::validation_problem;
pub use typed::{FieldError, TypedFingerprinter, Validated};

/// A SHA-256 over the canonical business fields of a request.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Wraps 32 digest bytes (e.g. read back from a store).
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Fingerprint(bytes)
    }

    /// Builds a fingerprint from a slice; `None` unless it is exactly 32 bytes.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Fingerprint)
    }

    /// Hashes `canonical` bytes under an endpoint `version`, so that changing
    /// what a version means never makes old and new requests collide.
    pub fn digest(version: &str, canonical: &[u8]) -> Self {
        let mut hasher = Self::hasher(version);
        hasher.update(canonical);
        Self::finish(hasher)
    }

    /// The hash [`digest`](Self::digest) feeds `canonical` to, fed what
    /// comes before it.
    pub(crate) fn hasher(version: &str) -> Sha256 {
        let mut hasher = Sha256::new();
        hasher.update(b"tower-idempotency/fingerprint/1\0");
        hasher.update((version.len() as u64).to_be_bytes());
        hasher.update(version.as_bytes());
        hasher
    }

    /// The fingerprint `hasher` has been fed.
    pub(crate) fn finish(hasher: Sha256) -> Self {
        Fingerprint(hasher.finalize().into())
    }

    /// Binds a body fingerprint to the request target: the same body sent to
    /// `POST /orders/1/cancel` and to `POST /orders/2/cancel` under one key
    /// is a reused key, not a retry.
    pub(crate) fn for_target(self, method: &http::Method, path_and_query: &str) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(b"tower-idempotency/target/1\0");
        hasher.update(self.0);
        hasher.update(method.as_str().as_bytes());
        hasher.update(b" ");
        hasher.update(path_and_query.as_bytes());
        Fingerprint(hasher.finalize().into())
    }

    /// The 32 digest bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({self})")
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

/// Validates a request's business fields and fingerprints them.
///
/// Supplied per endpoint. It runs before the request owns its key: a
/// rejection (`Err`) is answered at once and never remembered, so a corrected
/// body may reuse the key. It may leave what it parsed in `parts.extensions`
/// for the handler (the [`TypedFingerprinter`] does).
///
/// Closures `Fn(&mut Parts, &Bytes) -> Result<Fingerprint, Problem>` implement
/// this trait:
///
/// ```
/// use tower_idempotency::{fingerprint::{Fingerprint, Fingerprinter}};
///
/// // Every byte counts: the raw body is the fingerprint.
/// let raw = |_: &mut http::request::Parts, body: &bytes::Bytes| Ok(Fingerprint::digest("v1", body));
/// # fn check(_: impl Fingerprinter) {}
/// check(raw);
/// ```
pub trait Fingerprinter: Send + Sync + 'static {
    /// Validates the request and returns its fingerprint, or the problem to
    /// answer with.
    fn fingerprint(&self, parts: &mut Parts, body: &Bytes) -> Result<Fingerprint, Problem>;

    /// Whether [`fingerprint`](Self::fingerprint) answers the same for the
    /// same body bytes, whatever else: it reads neither the request's parts
    /// nor anything that changes (a clock, a setting, a database). Default
    /// `false`.
    ///
    /// When `true`, a retry that repeats a request the replay cache holds,
    /// byte for byte (the same method, target and body), is answered
    /// without being fingerprinted again: the same bytes would give the
    /// same fingerprint. A retry whose bytes differ (its members in another
    /// order) is fingerprinted and compared as usual.
    /// [`JsonFingerprinter`] says `true`, and so does a
    /// [`TypedFingerprinter`] without a validator.
    fn depends_on_body_only(&self) -> bool {
        false
    }
}

impl<F> Fingerprinter for F
where
    F: Fn(&mut Parts, &Bytes) -> Result<Fingerprint, Problem> + Send + Sync + 'static,
{
    fn fingerprint(&self, parts: &mut Parts, body: &Bytes) -> Result<Fingerprint, Problem> {
        self(parts, body)
    }
}
