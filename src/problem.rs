//! RFC 9457 problem details: every answer the layer produces itself.
//!
//! Each problem carries a stable machine-readable `code` that clients can
//! branch on; titles and details are for humans and may change.

use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use serde_json::{Map, Value};

/// The `Content-Type` of every problem answer.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// The `type` of a problem without a [type base](Problem::with_type_base):
/// this prefix and the code.
pub const DEFAULT_TYPE_BASE: &str = "urn:tower-idempotency:problem:";

/// A problem-details answer (`application/problem+json`) with a stable `code`.
///
/// Fingerprinters return a `Problem` to reject a request before it owns its
/// key; such answers are never remembered.
///
/// ```
/// use http::StatusCode;
/// use tower_idempotency::problem::Problem;
///
/// let problem = Problem::new(StatusCode::UNPROCESSABLE_ENTITY, "coupon_invalid", "The coupon is not valid")
///     .with_detail("coupon codes are upper-case")
///     .with_member("field", "coupon");
/// assert_eq!(problem.code(), "coupon_invalid");
/// let response = problem.to_response();
/// assert_eq!(response.status(), 422);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    status: StatusCode,
    code: &'static str,
    title: String,
    detail: Option<String>,
    members: Map<String, Value>,
    retry_after: Option<u64>,
    /// Set: `type` is this and the code, and answers link it as their
    /// documentation. An `Arc<String>` (one pointer, where `Arc<str>` is
    /// two) keeps `Problem` small enough to return by value in `Result`s.
    type_base: Option<Arc<String>>,
}

impl Problem {
    /// A problem with an HTTP status, a stable machine `code` and a short title.
    pub fn new(status: StatusCode, code: &'static str, title: impl Into<String>) -> Self {
        Problem {
            status,
            code,
            title: title.into(),
            detail: None,
            members: Map::new(),
            retry_after: None,
            type_base: None,
        }
    }

    /// Adds a human-readable explanation specific to this occurrence.
    pub fn with_detail(self, detail: impl Into<String>) -> Self {
        crate::setter::with(self, |s| s.detail = Some(detail.into()))
    }

    /// Adds an extension member to the JSON body (e.g. `errors`, `order_id`).
    ///
    /// The members `type`, `title`, `status`, `code` and `detail` are reserved
    /// and cannot be overwritten this way.
    pub fn with_member(mut self, name: impl Into<String>, value: impl Into<Value>) -> Self {
        let name = name.into();
        if !matches!(
            name.as_str(),
            "type" | "title" | "status" | "code" | "detail"
        ) {
            self.members.insert(name, value.into());
        }
        self
    }

    /// Adds a `Retry-After` header (seconds).
    pub fn with_retry_after(self, seconds: u64) -> Self {
        crate::setter::with(self, |s| s.retry_after = Some(seconds))
    }

    /// Where the problem is documented: its `type` becomes `base` followed
    /// by the code (`https://docs.example.com/errors/` gives
    /// `https://docs.example.com/errors/idempotency_key_missing`) instead
    /// of `urn:tower-idempotency:problem:<code>`, and
    /// [`to_response`](Self::to_response) adds
    /// `Link: <that URL>; rel="describedby"`, as the IETF Idempotency-Key
    /// draft asks of error answers. The server layer sets it on its own
    /// answers with `IdempotencyLayer::problem_type_base`.
    ///
    /// `base` should be an absolute URL in ASCII (percent-encoded): one
    /// that cannot go in a header still names the `type`, without the
    /// `Link`.
    ///
    /// ```
    /// use http::StatusCode;
    /// use tower_idempotency::problem::Problem;
    ///
    /// let problem = Problem::new(StatusCode::BAD_REQUEST, "idempotency_key_missing", "No key")
    ///     .with_type_base("https://docs.example.com/errors/");
    /// assert_eq!(problem.type_uri(), "https://docs.example.com/errors/idempotency_key_missing");
    /// let response = problem.to_response();
    /// assert_eq!(
    ///     response.headers()["link"],
    ///     r#"<https://docs.example.com/errors/idempotency_key_missing>; rel="describedby""#
    /// );
    /// ```
    pub fn with_type_base(self, base: impl Into<String>) -> Self {
        crate::setter::with(self, |s| s.type_base = Some(Arc::new(base.into())))
    }

    /// The problem with `base` as its type base unless it has its own (a
    /// fingerprinter's problem may name its own documentation).
    pub(crate) fn or_type_base(mut self, base: Option<&Arc<String>>) -> Self {
        if self.type_base.is_none() {
            self.type_base = base.cloned();
        }
        self
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The stable machine-readable code, e.g. `idempotency_key_reused`.
    pub fn code(&self) -> &'static str {
        self.code
    }

    /// The problem's `type` URI: `urn:tower-idempotency:problem:<code>`,
    /// or the [type base](Self::with_type_base) followed by the code.
    pub fn type_uri(&self) -> String {
        let base = self
            .type_base
            .as_deref()
            .map_or(DEFAULT_TYPE_BASE, String::as_str);
        format!("{base}{}", self.code)
    }

    /// The JSON body.
    pub fn to_json(&self) -> Value {
        let mut body = Map::new();
        body.insert("type".into(), Value::String(self.type_uri()));
        body.insert("title".into(), Value::String(self.title.clone()));
        body.insert("status".into(), Value::from(self.status.as_u16()));
        body.insert("code".into(), Value::String(self.code.into()));
        if let Some(detail) = &self.detail {
            body.insert("detail".into(), Value::String(detail.clone()));
        }
        for (name, value) in &self.members {
            body.insert(name.clone(), value.clone());
        }
        Value::Object(body)
    }

    /// Renders the problem as an HTTP response with a `Bytes` body (and a
    /// `Link` to its documentation when it has a
    /// [type base](Self::with_type_base)).
    pub fn to_response(&self) -> Response<Bytes> {
        let body = Bytes::from(self.to_json().to_string());
        let mut response = Response::new(body);
        *response.status_mut() = self.status;
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if self.type_base.is_some() {
            // A base that is no header value (not visible ASCII) still
            // names the `type`; the link is what is left out.
            let link = format!("<{}>; rel=\"describedby\"", self.type_uri());
            if let Ok(link) = HeaderValue::try_from(link) {
                response.headers_mut().insert(header::LINK, link);
            }
        }
        response
    }
}

/// gRPC's status codes the layer answers with.
mod grpc_code {
    pub(super) const INVALID_ARGUMENT: u32 = 3;
    pub(super) const NOT_FOUND: u32 = 5;
    pub(super) const PERMISSION_DENIED: u32 = 7;
    pub(super) const RESOURCE_EXHAUSTED: u32 = 8;
    pub(super) const FAILED_PRECONDITION: u32 = 9;
    pub(super) const ABORTED: u32 = 10;
    pub(super) const UNIMPLEMENTED: u32 = 12;
    pub(super) const INTERNAL: u32 = 13;
    pub(super) const UNAVAILABLE: u32 = 14;
    pub(super) const UNAUTHENTICATED: u32 = 16;
    pub(super) const UNKNOWN: u32 = 2;
}

impl Problem {
    /// The gRPC status code of this problem: by its code where the layer
    /// knows it (a missing or malformed key `INVALID_ARGUMENT`, a reused
    /// key `FAILED_PRECONDITION`, a key still in progress `ABORTED`, an
    /// unavailable store or a handler timeout `UNAVAILABLE`, an answer that
    /// could not be stored `INTERNAL`, a message compressed in an encoding
    /// the layer does not read `UNIMPLEMENTED`), otherwise by its HTTP
    /// status as gRPC maps HTTP.
    pub fn grpc_status(&self) -> u32 {
        use grpc_code::*;
        match self.code {
            codes::KEY_MISSING | codes::KEY_INVALID | codes::VALIDATION_FAILED => INVALID_ARGUMENT,
            codes::BODY_UNREADABLE => INVALID_ARGUMENT,
            codes::KEY_REUSED => FAILED_PRECONDITION,
            codes::IN_PROGRESS => ABORTED,
            codes::PAYLOAD_TOO_LARGE => RESOURCE_EXHAUSTED,
            codes::UNAUTHORIZED => UNAUTHENTICATED,
            codes::STORE_UNAVAILABLE
            | codes::HANDLER_TIMEOUT
            | codes::REPLAY_UNAVAILABLE
            | codes::OPERATION_TAKEN_OVER => UNAVAILABLE,
            codes::RESPONSE_NOT_STORABLE | codes::OPERATION_FAILED | codes::STATEMENT_FAILED => {
                INTERNAL
            }
            codes::NOT_FOUND | codes::RESOURCE_GONE => NOT_FOUND,
            codes::METHOD_NOT_ALLOWED | codes::ENCODING_UNSUPPORTED => UNIMPLEMENTED,
            _ => match self.status.as_u16() {
                400 => INVALID_ARGUMENT,
                401 => UNAUTHENTICATED,
                403 => PERMISSION_DENIED,
                404 => NOT_FOUND,
                409 => ABORTED,
                429 => RESOURCE_EXHAUSTED,
                502..=504 => UNAVAILABLE,
                _ => UNKNOWN,
            },
        }
    }

    /// The problem as a gRPC service answers an error, for a caller that
    /// speaks gRPC: HTTP 200, `content-type: application/grpc`, no message,
    /// and the status in the headers (a trailers-only answer):
    /// `grpc-status` ([`grpc_status`](Self::grpc_status)), `grpc-message`
    /// (the title, then the detail, percent-encoded as gRPC requires), and
    /// where HTTP says `Retry-After`, `grpc-retry-pushback-ms` (the delay
    /// gRPC's retry policy honours) and `retry-after` too; for a refused
    /// message encoding, `grpc-accept-encoding` with those that are read;
    /// and `grpc-status-details-bin`, the same status as a
    /// `google.rpc.Status` with an `ErrorInfo` (AIP-193: `reason` the
    /// stable code in capitals, `domain` [`GRPC_ERROR_DOMAIN`], the code as
    /// it is in `metadata["code"]`) and, with `Retry-After`, a `RetryInfo`.
    pub fn to_grpc_response(&self) -> Response<Bytes> {
        let mut response = Response::new(Bytes::new());
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc"),
        );
        headers.insert("grpc-status", HeaderValue::from(self.grpc_status()));
        let message = match &self.detail {
            Some(detail) => format!("{}: {detail}", self.title),
            None => self.title.clone(),
        };
        if let Ok(message) = HeaderValue::from_str(&grpc_percent_encode(&message)) {
            headers.insert("grpc-message", message);
        }
        if let Some(seconds) = self.retry_after {
            headers.insert(
                "grpc-retry-pushback-ms",
                HeaderValue::from(seconds.saturating_mul(1000)),
            );
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if self.code == codes::ENCODING_UNSUPPORTED {
            // gRPC's compression spec: a refused encoding is answered with
            // the encodings that are read.
            headers.insert(
                "grpc-accept-encoding",
                HeaderValue::from_static(crate::key::GRPC_ACCEPT_ENCODING),
            );
        }
        use base64::Engine as _;
        let details = base64::engine::general_purpose::STANDARD_NO_PAD
            .encode(self.grpc_status_details(&message));
        if let Ok(details) = HeaderValue::from_str(&details) {
            headers.insert("grpc-status-details-bin", details);
        }
        response
    }

    /// The `google.rpc.Status` of this problem, encoded as protobuf, as
    /// `grpc-status-details-bin` carries it (AIP-193): the status code, the
    /// message, a `google.rpc.ErrorInfo` whose `reason` is the stable code
    /// in capitals (`IDEMPOTENCY_KEY_REUSED`), whose `domain` is
    /// `tower-idempotency` and whose `metadata` holds the code as it is
    /// (`code`), and where the problem says when to retry, a
    /// `google.rpc.RetryInfo` with that delay. A client branches on the
    /// reason (tonic: `tonic_types::StatusExt::get_details_error_info`)
    /// without parsing `grpc-message`.
    fn grpc_status_details(&self, message: &str) -> Vec<u8> {
        let mut error_info = Vec::new();
        proto::bytes_field(
            &mut error_info,
            1,
            self.code.to_ascii_uppercase().as_bytes(),
        );
        proto::bytes_field(&mut error_info, 2, GRPC_ERROR_DOMAIN.as_bytes());
        let mut entry = Vec::new();
        proto::bytes_field(&mut entry, 1, b"code");
        proto::bytes_field(&mut entry, 2, self.code.as_bytes());
        proto::bytes_field(&mut error_info, 3, &entry);
        let mut status = Vec::new();
        proto::varint_field(&mut status, 1, u64::from(self.grpc_status()));
        proto::bytes_field(&mut status, 2, message.as_bytes());
        proto::bytes_field(
            &mut status,
            3,
            &proto::any("type.googleapis.com/google.rpc.ErrorInfo", &error_info),
        );
        if let Some(seconds) = self.retry_after {
            // RetryInfo { retry_delay: Duration { seconds } }
            let mut delay = Vec::new();
            proto::varint_field(&mut delay, 1, seconds);
            let mut retry_info = Vec::new();
            proto::bytes_field(&mut retry_info, 1, &delay);
            proto::bytes_field(
                &mut status,
                3,
                &proto::any("type.googleapis.com/google.rpc.RetryInfo", &retry_info),
            );
        }
        status
    }
}

/// The `domain` of the `google.rpc.ErrorInfo` the layer's own gRPC answers
/// carry.
pub const GRPC_ERROR_DOMAIN: &str = "tower-idempotency";

/// The few protobuf encodings `google.rpc.Status` needs: varints and
/// length-delimited fields (strings, bytes, messages).
mod proto {
    fn varint(out: &mut Vec<u8>, mut value: u64) {
        while value >= 0x80 {
            out.push((value as u8 & 0x7f) | 0x80);
            value >>= 7;
        }
        out.push(value as u8);
    }

    /// Field `field` as a varint (wire type 0).
    pub(super) fn varint_field(out: &mut Vec<u8>, field: u64, value: u64) {
        varint(out, field << 3);
        varint(out, value);
    }

    /// Field `field` as length-delimited bytes (wire type 2).
    pub(super) fn bytes_field(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
        varint(out, (field << 3) | 2);
        varint(out, bytes.len() as u64);
        out.extend_from_slice(bytes);
    }

    /// A `google.protobuf.Any` of the message `value` of type `type_url`.
    pub(super) fn any(type_url: &str, value: &[u8]) -> Vec<u8> {
        let mut any = Vec::new();
        bytes_field(&mut any, 1, type_url.as_bytes());
        bytes_field(&mut any, 2, value);
        any
    }
}

/// gRPC's `grpc-message` encoding: bytes outside printable ASCII, and `%`,
/// as `%XX`.
fn grpc_percent_encode(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    for byte in message.bytes() {
        if (0x20..=0x7e).contains(&byte) && byte != b'%' {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}): {}",
            self.status.as_u16(),
            self.code,
            self.title
        )
    }
}

/// The stable codes of the problems the layer itself answers with.
pub mod codes {
    /// No idempotency key header on a request that requires one (400).
    pub const KEY_MISSING: &str = "idempotency_key_missing";
    /// The key is not 1–255 visible ASCII characters (400).
    pub const KEY_INVALID: &str = "idempotency_key_invalid";
    /// The same key arrived with a different request (409, or 422 in the IETF profile).
    pub const KEY_REUSED: &str = "idempotency_key_reused";
    /// The first request with this key is still running (409 with `Retry-After`).
    pub const IN_PROGRESS: &str = "idempotency_in_progress";
    /// The request body is over the configured limit (413).
    pub const PAYLOAD_TOO_LARGE: &str = "payload_too_large";
    /// The request body could not be read (400): for gRPC, also a
    /// compressed message that does not decompress.
    pub const BODY_UNREADABLE: &str = "request_body_unreadable";
    /// A gRPC message compressed in an encoding the layer does not read
    /// (415; gRPC `UNIMPLEMENTED`, with `grpc-accept-encoding`).
    pub const ENCODING_UNSUPPORTED: &str = "message_encoding_unsupported";
    /// No authenticated tenant could be resolved for the request (401).
    pub const UNAUTHORIZED: &str = "unauthorized";
    /// The store could not be reached or the transaction was rolled back (503 with `Retry-After`).
    pub const STORE_UNAVAILABLE: &str = "store_unavailable";
    /// The handler's response could not be remembered (e.g. over the stored-response limit); its work was rolled back (500).
    pub const RESPONSE_NOT_STORABLE: &str = "response_not_storable";
    /// The handler did not finish within the layer's handler timeout; its
    /// work was rolled back (503 with `Retry-After`).
    pub const HANDLER_TIMEOUT: &str = "handler_timeout";
    /// The database refused to commit the handler's writes (a deferred
    /// constraint, a statement that failed and was ignored); nothing was
    /// changed, and the same request fails the same way again (500).
    pub const COMMIT_REJECTED: &str = "commit_rejected";
    /// The request body failed the endpoint's validation (422).
    pub const VALIDATION_FAILED: &str = "validation_failed";
    /// No such operation for this tenant: an unknown or malformed id, or
    /// another tenant's operation (404).
    pub const NOT_FOUND: &str = "not_found";
    /// The status resource answers `GET` and `HEAD` only (405).
    pub const METHOD_NOT_ALLOWED: &str = "method_not_allowed";
    /// A replay rebuilt from its resource found the resource gone: the
    /// operation happened, its result no longer exists (410).
    pub const RESOURCE_GONE: &str = "resource_gone";
    /// A replay rebuilt from its resource could not be rebuilt (the rebuild
    /// function failed or timed out); nothing changed (503 with `Retry-After`).
    pub const REPLAY_UNAVAILABLE: &str = "replay_unavailable";
    /// A long-running operation ended without an answer after its last
    /// allowed attempt ([`LeaseConfig::max_attempts`](crate::lease::LeaseConfig::max_attempts));
    /// remembered and replayed to every retry under its key (500).
    pub const OPERATION_FAILED: &str = "operation_failed";
    /// A statement the handler sent through the layer's transaction failed
    /// in a way a retry repeats: the database refused it (a constraint, a
    /// missing table, a type mismatch), the handle refused it (transaction
    /// control, session state), or the transaction had already ended. Sent
    /// by a handler that returns a [`TxError`](crate::postgres::TxError) or a
    /// [`StoreError`](crate::store::StoreError) as its answer; the layer
    /// rolls its work back (500).
    pub const STATEMENT_FAILED: &str = "statement_failed";
    /// A long-running operation's attempt was taken over by a newer owner
    /// (its fenced transaction was refused); this attempt changed nothing
    /// and stopped, and a retry with the same key resumes the operation
    /// (503 with `Retry-After`).
    pub const OPERATION_TAKEN_OVER: &str = "operation_taken_over";
}

/// The answer for a handler's statement that failed with an error of
/// `kind`, whichever driver met it: the database gone or a transaction
/// that lost to a concurrent one is worth a retry (503 with `Retry-After`),
/// anything else fails the same way again (500). The body says what a
/// client can act on and nothing of the statement or its values.
pub(crate) fn statement_failed(kind: crate::store::StoreErrorKind) -> Problem {
    use crate::store::StoreErrorKind as Kind;
    let unavailable = |detail: &str| {
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            codes::STORE_UNAVAILABLE,
            "The database is unavailable; retry with the same key",
        )
        .with_detail(detail)
        .with_retry_after(1)
    };
    match kind {
        Kind::Unavailable => unavailable("the database could not be reached or ended the session"),
        Kind::Conflict => {
            unavailable("the transaction conflicted with a concurrent one and was rolled back")
        }
        Kind::OutcomeUnknown => {
            unavailable("the commit's outcome is unknown; retry with the same key to learn it")
        }
        Kind::Fenced => Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            codes::OPERATION_TAKEN_OVER,
            "Another attempt took this operation over; this one stopped",
        )
        .with_detail("a retry with the same key resumes the operation")
        .with_retry_after(1),
        Kind::TransactionAborted | Kind::Corrupt | Kind::Schema | Kind::Backend => Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            codes::STATEMENT_FAILED,
            "A database statement of this request failed",
        )
        .with_detail("retrying the same request fails the same way"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_members_cannot_be_overwritten() {
        let problem = Problem::new(StatusCode::CONFLICT, "x", "t")
            .with_member("code", "y")
            .with_member("order_id", "o1");
        let json = problem.to_json();
        assert_eq!(json["code"], "x");
        assert_eq!(json["order_id"], "o1");
        assert_eq!(json["status"], 409);
        assert_eq!(json["type"], "urn:tower-idempotency:problem:x");
    }

    #[test]
    fn a_type_base_names_the_type_and_links_it() {
        let plain = Problem::new(StatusCode::CONFLICT, codes::KEY_REUSED, "t");
        assert!(!plain.to_response().headers().contains_key(header::LINK));
        let based = plain.with_type_base("https://docs.example.com/problems#");
        let json = based.to_json();
        assert_eq!(
            json["type"],
            "https://docs.example.com/problems#idempotency_key_reused"
        );
        let response = based.to_response();
        assert_eq!(
            response.headers()[header::LINK],
            "<https://docs.example.com/problems#idempotency_key_reused>; rel=\"describedby\""
        );
        // Not a header value: the type still, no link, no panic.
        let odd = Problem::new(StatusCode::CONFLICT, "x", "t").with_type_base("https://d\n/é/");
        assert_eq!(odd.type_uri(), "https://d\n/é/x");
        assert!(!odd.to_response().headers().contains_key(header::LINK));
    }

    #[test]
    fn response_has_problem_content_type_and_retry_after() {
        let response = Problem::new(StatusCode::SERVICE_UNAVAILABLE, "store_unavailable", "down")
            .with_retry_after(2)
            .to_response();
        assert_eq!(response.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
        assert_eq!(response.headers()[header::RETRY_AFTER], "2");
    }

    /// A gRPC answer: the status by the problem's code, the message
    /// percent-encoded as gRPC requires, the retry delay in both forms.
    #[test]
    fn a_grpc_answer_carries_the_status_message_and_pushback() {
        let response = Problem::new(StatusCode::CONFLICT, codes::IN_PROGRESS, "Busy 100% — wait")
            .with_retry_after(2)
            .to_grpc_response();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers()["grpc-status"], "10");
        assert_eq!(
            response.headers()["grpc-message"],
            "Busy 100%25 %E2%80%94 wait"
        );
        assert_eq!(response.headers()["grpc-retry-pushback-ms"], "2000");
        assert!(response.body().is_empty());
        let other = Problem::new(StatusCode::BAD_GATEWAY, "upstream_down", "x");
        assert_eq!(other.grpc_status(), 14, "UNAVAILABLE, by the HTTP status");
    }

    /// `google.rpc.Status` and the two details, as protobuf declares them.
    mod rpc {
        #[derive(Clone, PartialEq, prost::Message)]
        pub(super) struct Status {
            #[prost(int32, tag = "1")]
            pub(super) code: i32,
            #[prost(string, tag = "2")]
            pub(super) message: String,
            #[prost(message, repeated, tag = "3")]
            pub(super) details: Vec<Any>,
        }
        #[derive(Clone, PartialEq, prost::Message)]
        pub(super) struct Any {
            #[prost(string, tag = "1")]
            pub(super) type_url: String,
            #[prost(bytes = "vec", tag = "2")]
            pub(super) value: Vec<u8>,
        }
        #[derive(Clone, PartialEq, prost::Message)]
        pub(super) struct ErrorInfo {
            #[prost(string, tag = "1")]
            pub(super) reason: String,
            #[prost(string, tag = "2")]
            pub(super) domain: String,
            #[prost(map = "string, string", tag = "3")]
            pub(super) metadata: std::collections::HashMap<String, String>,
        }
        #[derive(Clone, PartialEq, prost::Message)]
        pub(super) struct RetryInfo {
            #[prost(message, optional, tag = "1")]
            pub(super) retry_delay: Option<Duration>,
        }
        #[derive(Clone, PartialEq, prost::Message)]
        pub(super) struct Duration {
            #[prost(int64, tag = "1")]
            pub(super) seconds: i64,
            #[prost(int32, tag = "2")]
            pub(super) nanos: i32,
        }
    }

    /// `grpc-status-details-bin` decodes, with prost, into the status the
    /// other headers say, an `ErrorInfo` naming the stable code and, with a
    /// retry delay, a `RetryInfo` holding it.
    #[test]
    fn a_grpc_answer_carries_its_status_as_aip_193_details() {
        use base64::Engine as _;
        use prost::Message as _;
        let decode = |response: &Response<Bytes>| {
            let header = response.headers()["grpc-status-details-bin"].as_bytes();
            let bytes = base64::engine::general_purpose::STANDARD_NO_PAD
                .decode(header)
                .expect("base64");
            rpc::Status::decode(bytes.as_slice()).expect("a google.rpc.Status")
        };
        let busy = Problem::new(StatusCode::CONFLICT, codes::IN_PROGRESS, "Busy")
            .with_detail("wait")
            .with_retry_after(3)
            .to_grpc_response();
        let status = decode(&busy);
        assert_eq!((status.code, status.message.as_str()), (10, "Busy: wait"));
        assert_eq!(status.details.len(), 2, "{status:?}");
        assert_eq!(
            status.details[0].type_url,
            "type.googleapis.com/google.rpc.ErrorInfo"
        );
        let info = rpc::ErrorInfo::decode(status.details[0].value.as_slice()).unwrap();
        assert_eq!(info.reason, "IDEMPOTENCY_IN_PROGRESS");
        assert_eq!(info.domain, "tower-idempotency");
        assert_eq!(info.metadata["code"], codes::IN_PROGRESS);
        assert_eq!(
            status.details[1].type_url,
            "type.googleapis.com/google.rpc.RetryInfo"
        );
        let retry = rpc::RetryInfo::decode(status.details[1].value.as_slice()).unwrap();
        assert_eq!(
            retry.retry_delay.map(|d| (d.seconds, d.nanos)),
            Some((3, 0))
        );

        let reused =
            Problem::new(StatusCode::CONFLICT, codes::KEY_REUSED, "Reused").to_grpc_response();
        let status = decode(&reused);
        assert_eq!(status.code, 9, "FAILED_PRECONDITION");
        assert_eq!(status.details.len(), 1, "no retry delay, no RetryInfo");
        let info = rpc::ErrorInfo::decode(status.details[0].value.as_slice()).unwrap();
        assert_eq!(info.reason, "IDEMPOTENCY_KEY_REUSED");
    }
}
