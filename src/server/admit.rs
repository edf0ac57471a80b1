//! Admission: everything decided before a key is claimed. Cheap checks
//! first (key, tenant), then the body is buffered under its limit and
//! fingerprinted. Nothing here is remembered.

use std::sync::Arc;

use bytes::Bytes;
use http::{header, request::Parts, Request, StatusCode};
use http_body::Body;
use http_body_util::BodyExt;

use crate::{
    fingerprint::{Fingerprint, Fingerprinter},
    key::{decode_grpc_message, GrpcMessageError, IdempotencyKey, KeyError},
    problem::{codes, Problem},
    record::Record,
    scope::{ResolveTenant, Scope, TenantId},
    server::body::BoxError,
    server::endpoint::{Config, Setup},
    store::ClaimRequest,
};

/// What admission decided.
pub(crate) enum Admission<B> {
    /// No key, and keys are optional: the request goes through untouched.
    PassThrough(Request<B>),
    /// Refused before claiming; never remembered.
    Refused(Problem),
    /// Ready to claim its key.
    Admitted(Admitted),
    /// Answered by the replay cache: the record this process committed
    /// for the key, the request's fingerprint to compare with it, and the
    /// request's tenant.
    Cached(Arc<Record>, Fingerprint, TenantId),
}

/// A request ready to claim its key: its parts, its buffered body and what
/// it asks the store for.
#[allow(missing_debug_implementations)]
pub struct Admitted {
    pub(crate) parts: Parts,
    pub(crate) body: Bytes,
    pub(crate) claim: ClaimRequest,
    /// Whether a retry repeating this request byte for byte has its
    /// fingerprint (the fingerprinter reads the body alone, and the body is
    /// the message it read): the replay cache may then keep the request
    /// ([`Repeat`](super::cache::Repeat)).
    pub(crate) repeatable: bool,
}

pub(crate) async fn admit<St, F, R, M, B>(
    setup: &Setup<St, F, R, M>,
    request: Request<B>,
) -> Admission<B>
where
    F: Fingerprinter,
    R: ResolveTenant,
    M: super::mode::Covers,
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let config = &setup.config;
    let key = match parse_key(config, &request) {
        Ok(Some(key)) => Some(key),
        // Read from the message once the body is in (`key_from_body`).
        Ok(None) if config.key_from_body.is_some() => None,
        Ok(None) => return Admission::PassThrough(request),
        Err(problem) => return Admission::Refused(problem),
    };
    if let Some(key) = &key {
        record_key_hash(key);
    }
    let (mut parts, body) = request.into_parts();
    let Some(tenant) = setup.resolver.resolve(&parts) else {
        tracing::warn!("no authenticated tenant for an idempotent request; refusing (fail closed)");
        let problem = Problem::new(
            StatusCode::UNAUTHORIZED,
            codes::UNAUTHORIZED,
            "No authenticated tenant",
        );
        return Admission::Refused(problem);
    };
    let body = match read_body(config, &parts, body).await {
        Ok(body) => body,
        Err(problem) => return Admission::Refused(problem),
    };
    // The key and the fingerprint are read from the message whatever its
    // compression; the handler is handed the body as it came.
    let message = match message_view(config.request_body_limit, &parts.headers, &body) {
        Ok(message) => message,
        Err(problem) => return Admission::Refused(problem),
    };
    let key = match key {
        Some(key) => key,
        None => match key_in_body(config, &parts, &message) {
            Ok(key) => {
                record_key_hash(&key);
                key
            }
            Err(problem) => return Admission::Refused(problem),
        },
    };
    let scope = Scope::new(tenant, config.endpoint.clone());
    // A retry of a record this process committed is answered from memory;
    // one that repeats the first request byte for byte, without being
    // fingerprinted again.
    let repeatable = setup.fingerprinter.depends_on_body_only()
        && message.as_ptr() == body.as_ptr()
        && message.len() == body.len();
    let hit = setup
        .shared
        .cache
        .as_ref()
        .and_then(|c| c.hit(&scope, &key));
    let target = parts.uri.path_and_query().map_or("/", |t| t.as_str());
    if let Some(hit) = &hit {
        if repeatable && hit.repeats(&parts.method, target, &message) {
            let fingerprint = hit.record.fingerprint;
            return Admission::Cached(hit.record.clone(), fingerprint, scope.tenant().clone());
        }
    }
    let fingerprint = match setup.fingerprinter.fingerprint(&mut parts, &message) {
        // The same body sent to another path or query is another request.
        Ok(fingerprint) => {
            let target = parts.uri.path_and_query().map_or("/", |t| t.as_str());
            fingerprint.for_target(&parts.method, target)
        }
        Err(problem) => return Admission::Refused(problem),
    };
    if let Some(hit) = hit {
        return Admission::Cached(hit.record, fingerprint, scope.tenant().clone());
    }
    let claim = ClaimRequest::new(scope, key, fingerprint)
        .with_retention(setup.retention())
        .with_wait(config.wait);
    Admission::Admitted(Admitted {
        parts,
        body,
        claim,
        repeatable,
    })
}

/// The body the fingerprinter and the key extractor read. For a gRPC
/// request whose body is one compressed frame: its message decompressed
/// (never past `limit` bytes) in an uncompressed frame, exactly the body
/// the same call sends uncompressed, so that compressing a retry or not
/// changes neither its key nor its fingerprint. Any other body as it is:
/// an uncompressed frame, several frames, or not gRPC.
///
/// Refused: an encoding not read here (`UNIMPLEMENTED` for gRPC, with the
/// encodings that are read in `grpc-accept-encoding`), a message over the
/// limit once decompressed (as a body over the limit), bytes that do not
/// decompress (as an unreadable body).
pub(crate) fn message_view(
    limit: usize,
    headers: &http::HeaderMap,
    body: &Bytes,
) -> Result<Bytes, Problem> {
    if body.first() != Some(&1)
        || crate::classify::grpc_content(headers) != Some(crate::classify::GrpcContent::Grpc)
    {
        return Ok(body.clone());
    }
    match decode_grpc_message(headers, body, limit) {
        Ok(std::borrow::Cow::Borrowed(_)) | Err(GrpcMessageError::NotOneFrame) => Ok(body.clone()),
        Ok(std::borrow::Cow::Owned(message)) => {
            // At most `limit` bytes, and the limit is at most 256 MiB; a
            // larger one is refused rather than framed wrong.
            let len = u32::try_from(message.len()).map_err(|_| too_large(limit))?;
            let mut framed = bytes::BytesMut::with_capacity(5 + message.len());
            framed.extend_from_slice(&[0]);
            framed.extend_from_slice(&len.to_be_bytes());
            framed.extend_from_slice(&message);
            Ok(framed.freeze())
        }
        Err(GrpcMessageError::TooLarge { limit }) => Err(too_large(limit).with_detail(format!(
            "the limit is {limit} bytes, and the message is over it decompressed"
        ))),
        Err(e @ GrpcMessageError::UnsupportedEncoding(_)) => Err(Problem::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            codes::ENCODING_UNSUPPORTED,
            "The message's encoding is not supported",
        )
        .with_detail(e.to_string())),
        Err(e) => Err(unreadable().with_detail(e.to_string())),
    }
}

fn too_large(limit: usize) -> Problem {
    Problem::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        codes::PAYLOAD_TOO_LARGE,
        "The request body is too large",
    )
    .with_detail(format!("the limit is {limit} bytes"))
}

fn unreadable() -> Problem {
    Problem::new(
        StatusCode::BAD_REQUEST,
        codes::BODY_UNREADABLE,
        "The request body could not be read",
    )
}

fn invalid_key(detail: String) -> Problem {
    Problem::new(
        StatusCode::BAD_REQUEST,
        codes::KEY_INVALID,
        "The idempotency key is not valid",
    )
    .with_detail(detail)
}

/// The key the request's message carries (`key_from_body`), held to the
/// header's rules.
fn key_in_body(config: &Config, parts: &Parts, body: &Bytes) -> Result<IdempotencyKey, Problem> {
    let Some(extractor) = &config.key_from_body else {
        return Err(invalid_key("no key".into()));
    };
    match extractor.0.key(parts, body) {
        Ok(Some(raw)) => match IdempotencyKey::parse(raw.as_bytes()) {
            Ok(key) if key.as_str().len() > config.max_key_len => {
                Err(invalid_key(KeyError::TooLong.to_string()))
            }
            Ok(key) => Ok(key),
            Err(e) => Err(invalid_key(e.to_string())),
        },
        Ok(None) => Err(Problem::new(
            StatusCode::BAD_REQUEST,
            codes::KEY_MISSING,
            "An idempotency key is required",
        )
        .with_detail(format!(
            "send a unique `{}` header, or the key in the request's message",
            config.header
        ))),
        Err(reason) => Err(invalid_key(format!(
            "the key could not be read from the message: {reason}"
        ))),
    }
}

fn parse_key<B>(config: &Config, request: &Request<B>) -> Result<Option<IdempotencyKey>, Problem> {
    let mut values = request.headers().get_all(&config.header).iter();
    let invalid = |e: KeyError| invalid_key(e.to_string());
    match (values.next(), values.next()) {
        (None, _) if config.key_required && config.key_from_body.is_none() => Err(Problem::new(
            StatusCode::BAD_REQUEST,
            codes::KEY_MISSING,
            "An idempotency key is required",
        )
        .with_detail(format!(
            "send a unique `{}` header with this request",
            config.header
        ))),
        (None, _) => Ok(None),
        (Some(_), Some(_)) => Err(invalid(KeyError::Repeated)),
        (Some(value), None) => match IdempotencyKey::parse(value.as_bytes()) {
            Ok(key) if key.as_str().len() > config.max_key_len => Err(invalid(KeyError::TooLong)),
            Ok(key) => Ok(Some(key)),
            Err(e) => Err(invalid(e)),
        },
    }
}

/// Buffers the body under the limit. An over-long body is still read (and
/// discarded) up to [`DRAIN_LIMIT`] so that an HTTP/1 client, which sends its
/// whole body before it reads, sees the 413 instead of a broken pipe.
async fn read_body<B>(config: &Config, parts: &Parts, body: B) -> Result<Bytes, Problem>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let limit = config.request_body_limit;
    let drain_limit = limit.saturating_add(DRAIN_LIMIT) as u64;
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > drain_limit) {
        return Err(too_large(limit));
    }
    let mut body = std::pin::pin!(body);
    let mut buffered = Buffered::Empty;
    let mut seen: u64 = 0;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|_| unreadable())?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        seen += data.len() as u64;
        if seen > drain_limit {
            break;
        }
        if seen <= limit as u64 {
            buffered.push(data);
        }
    }
    if seen > limit as u64 {
        return Err(too_large(limit));
    }
    Ok(buffered.into_bytes())
}

/// A body read so far: a body of one frame is kept as the frame's own
/// `Bytes` (no copy, no allocation), and only a second frame gathers them
/// in one buffer. Whatever keeps request bytes beyond the request (the
/// replay cache's byte-for-byte repeat) copies them into a buffer of its
/// own, so a frame that is a view into a larger read buffer is held only
/// while the request is.
enum Buffered {
    Empty,
    One(Bytes),
    Many(bytes::BytesMut),
}

impl Buffered {
    fn push(&mut self, data: Bytes) {
        if data.is_empty() {
            return;
        }
        *self = match std::mem::replace(self, Buffered::Empty) {
            Buffered::Empty => Buffered::One(data),
            Buffered::One(first) => {
                let mut many = bytes::BytesMut::with_capacity(first.len() + data.len());
                many.extend_from_slice(&first);
                many.extend_from_slice(&data);
                Buffered::Many(many)
            }
            Buffered::Many(mut many) => {
                many.extend_from_slice(&data);
                Buffered::Many(many)
            }
        };
    }

    fn into_bytes(self) -> Bytes {
        match self {
            Buffered::Empty => Bytes::new(),
            Buffered::One(data) => data,
            Buffered::Many(many) => many.freeze(),
        }
    }
}

#[cfg(test)]
mod buffered_tests {
    use super::*;

    #[test]
    fn one_frame_is_kept_and_more_are_gathered_in_order() {
        let frame = Bytes::from_static(b"{\"a\":1}");
        let mut one = Buffered::Empty;
        one.push(Bytes::new());
        one.push(frame.clone());
        one.push(Bytes::new());
        let kept = one.into_bytes();
        assert_eq!(kept, frame);
        // The same memory: nothing was copied.
        assert_eq!(kept.as_ptr(), frame.as_ptr());

        let mut many = Buffered::Empty;
        for part in [&b"ab"[..], b"", b"cd", b"e"] {
            many.push(Bytes::copy_from_slice(part));
        }
        assert_eq!(many.into_bytes(), Bytes::from_static(b"abcde"));
        assert!(Buffered::Empty.into_bytes().is_empty());
    }
}

/// How far past the request body limit an over-long body is read and discarded.
const DRAIN_LIMIT: usize = 1024 * 1024;

/// The key's hash on the request's span, computed only when the span is
/// recorded at all (no subscriber, or one that leaves the span out: no
/// digest per request).
fn record_key_hash(key: &IdempotencyKey) {
    let span = tracing::Span::current();
    if !span.is_disabled() {
        span.record("idempotency.key_hash", key.short_hash_digits().as_str());
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use bytes::Bytes;
    use http::HeaderMap;

    use super::message_view;
    use crate::{
        fingerprint::Fingerprint,
        key::{grpc_message, GRPC_ACCEPT_ENCODING},
        problem::codes,
    };

    fn frame(flag: u8, message: &[u8]) -> Bytes {
        let mut body = vec![flag];
        body.extend_from_slice(&(message.len() as u32).to_be_bytes());
        body.extend_from_slice(message);
        body.into()
    }

    fn headers(content_type: &str, encoding: Option<&str>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", content_type.parse().unwrap());
        if let Some(encoding) = encoding {
            headers.insert("grpc-encoding", encoding.parse().unwrap());
        }
        headers
    }

    /// What a fingerprinter that hashes the message computes.
    fn fingerprint(headers: &HeaderMap, body: &Bytes) -> Fingerprint {
        let message = message_view(1024, headers, body).unwrap();
        Fingerprint::digest("v1", grpc_message(&message).unwrap())
    }

    /// The same message, identity, gzip or deflate, has one fingerprint:
    /// the fingerprinter is handed the uncompressed frame each time.
    #[test]
    fn the_same_message_has_one_fingerprint_whatever_its_encoding() {
        let message = b"\x0a\x05rid-1\x12\x03tea";
        let mut gzip = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gzip.write_all(message).unwrap();
        let mut deflate = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::best());
        deflate.write_all(message).unwrap();
        let identity = frame(0, message);
        let plain = fingerprint(&headers("application/grpc", None), &identity);
        let gzipped = frame(1, &gzip.finish().unwrap());
        let deflated = frame(1, &deflate.finish().unwrap());
        for (body, encoding) in [(&gzipped, "gzip"), (&deflated, "deflate")] {
            let grpc = headers("application/grpc+proto", Some(encoding));
            assert_eq!(fingerprint(&grpc, body), plain, "{encoding}");
            assert_eq!(message_view(1024, &grpc, body).unwrap(), identity);
        }
        // Not gRPC: the body as it is, never decoded.
        let json = headers("application/json", Some("gzip"));
        assert_eq!(message_view(1024, &json, &gzipped).unwrap(), gzipped);
    }

    #[test]
    fn an_unknown_encoding_is_unimplemented_with_the_encodings_read() {
        let problem = message_view(
            1024,
            &headers("application/grpc", Some("br")),
            &frame(1, b"x"),
        )
        .unwrap_err();
        assert_eq!(problem.code(), codes::ENCODING_UNSUPPORTED);
        assert_eq!(problem.grpc_status(), 12);
        let answer = problem.to_grpc_response();
        assert_eq!(answer.headers()["grpc-status"], "12");
        assert_eq!(
            answer.headers()["grpc-accept-encoding"],
            GRPC_ACCEPT_ENCODING
        );
        assert_eq!(problem.to_response().status(), 415);
    }
}
