//! Admission: everything decided before a key is claimed. Cheap checks
//! first (key, tenant), then the body is buffered under its limit and
//! fingerprinted. Nothing here is remembered.

use bytes::Bytes;
use http::{header, request::Parts, Request, StatusCode};
use http_body::Body;
use http_body_util::BodyExt;

use crate::{
    fingerprint::Fingerprinter,
    key::{IdempotencyKey, KeyError},
    problem::{codes, Problem},
    scope::{ResolveTenant, Scope},
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
}

/// A request ready to claim its key: its parts, its buffered body and what
/// it asks the store for.
#[allow(missing_debug_implementations)]
pub struct Admitted {
    pub(crate) parts: Parts,
    pub(crate) body: Bytes,
    pub(crate) claim: ClaimRequest,
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
    let key = match key {
        Some(key) => key,
        None => match key_in_body(config, &parts, &body) {
            Ok(key) => {
                record_key_hash(&key);
                key
            }
            Err(problem) => return Admission::Refused(problem),
        },
    };
    let fingerprint = match setup.fingerprinter.fingerprint(&mut parts, &body) {
        // The same body sent to another path or query is another request.
        Ok(fingerprint) => {
            let target = parts.uri.path_and_query().map_or("/", |t| t.as_str());
            fingerprint.for_target(&parts.method, target)
        }
        Err(problem) => return Admission::Refused(problem),
    };
    let claim = ClaimRequest::new(
        Scope::new(tenant, config.endpoint.clone()),
        key,
        fingerprint,
    )
    .with_retention(setup.retention())
    .with_wait(config.wait);
    Admission::Admitted(Admitted { parts, body, claim })
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
    let too_large = || {
        Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            codes::PAYLOAD_TOO_LARGE,
            "The request body is too large",
        )
        .with_detail(format!("the limit is {limit} bytes"))
    };
    let unreadable = || {
        Problem::new(
            StatusCode::BAD_REQUEST,
            codes::BODY_UNREADABLE,
            "The request body could not be read",
        )
    };
    let drain_limit = limit.saturating_add(DRAIN_LIMIT) as u64;
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > drain_limit) {
        return Err(too_large());
    }
    let mut body = std::pin::pin!(body);
    let mut buffered = bytes::BytesMut::new();
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
            buffered.extend_from_slice(&data);
        }
    }
    if seen > limit as u64 {
        return Err(too_large());
    }
    Ok(buffered.freeze())
}

/// How far past the request body limit an over-long body is read and discarded.
const DRAIN_LIMIT: usize = 1024 * 1024;

/// The key's hash on the request's span, computed only when the span is
/// recorded at all (no subscriber, or one that leaves the span out: no
/// digest per request).
fn record_key_hash(key: &IdempotencyKey) {
    let span = tracing::Span::current();
    if !span.is_disabled() {
        span.record("key_hash", key.short_hash());
    }
}
