//! What is remembered about a completed request, and how it replays.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};

use crate::fingerprint::Fingerprint;

/// The header added to every replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The request header that says which attempt of a call this is: `1` for
/// the first, `2` for the first retry, and so on.
///
/// [`IdempotentClient`](crate::client::IdempotentClient) sends it on every
/// retry. In the claim-first and one-commit modes, a request whose value is
/// above 1 and that the replay cache does not answer is answered from one read of the key's record
/// ([`Store::lookup`](crate::store::Store::lookup)) when the key has one:
/// one round trip and nothing written, where a claim that finds the row
/// taken costs a transaction. Without a record, the claim arbitrates as
/// for any request. The header is a hint and changes no answer: a first
/// attempt that claims to be a retry costs one extra read; a retry that
/// does not say so is claimed and replayed as before. A value that is not
/// a decimal number is ignored.
pub const IDEMPOTENCY_ATTEMPT: HeaderName = HeaderName::from_static("idempotency-attempt");

/// Whether a request's [`IDEMPOTENCY_ATTEMPT`] says it is a retry.
pub(crate) fn says_retry(headers: &HeaderMap) -> bool {
    headers
        .get(IDEMPOTENCY_ATTEMPT)
        .and_then(|v| std::str::from_utf8(v.as_bytes()).ok())
        .and_then(|v| v.trim().parse::<u32>().ok())
        .is_some_and(|n| n > 1)
}

/// Marks a non-2xx response as a final answer to remember and replay.
///
/// Put it in the response extensions for deterministic business rejections
/// (an expired coupon, a checkout that already has an order): the handler's
/// writes commit with it and every retry gets the same answer. Without it,
/// only 2xx responses are remembered; everything else rolls back and frees the
/// key. A 5xx is never remembered.
///
/// ```
/// use tower_idempotency::record::FinalResponse;
///
/// let mut response = http::Response::new("coupon expired");
/// *response.status_mut() = http::StatusCode::UNPROCESSABLE_ENTITY;
/// response.extensions_mut().insert(FinalResponse);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FinalResponse;

/// Names the resource an operation created or changed; remembered with its
/// response, in the same transaction.
///
/// The handler puts it in the response extensions. Operators then see which
/// resource a key made ([`PgStore::inspect_key`](crate::postgres::PgStore::inspect_key)
/// and the `resource_id` column), and an endpoint that replays by rebuilding
/// ([`IdempotencyLayer::rebuild_replays`](crate::IdempotencyLayer::rebuild_replays))
/// gets it back on every retry to produce the resource's current
/// representation.
///
/// At most [`MAX_RESOURCE_ID_LEN`] bytes, not empty, no control characters:
/// a response naming another id is not remembered (`500
/// response_not_storable`, its writes rolled back).
///
/// ```
/// use tower_idempotency::record::ResourceId;
///
/// let mut response = http::Response::new(r#"{"id":"ord_1"}"#);
/// *response.status_mut() = http::StatusCode::CREATED;
/// response.extensions_mut().insert(ResourceId::new("ord_1"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ResourceId(String);

/// The longest [`ResourceId`] remembered, in bytes.
pub const MAX_RESOURCE_ID_LEN: usize = 255;

impl ResourceId {
    /// The id of the resource the operation created or changed.
    pub fn new(id: impl Into<String>) -> Self {
        ResourceId(id.into())
    }

    /// The id as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether a store can remember it: not empty, at most
    /// [`MAX_RESOURCE_ID_LEN`] bytes, no control characters.
    pub fn is_storable(&self) -> bool {
        !self.0.is_empty()
            && self.0.len() <= MAX_RESOURCE_ID_LEN
            && !self.0.chars().any(char::is_control)
    }
}

impl std::fmt::Display for ResourceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// A remembered response: status, allow-listed headers and the body bytes,
/// and the resource the operation named.
///
/// Replay gives back exactly these bytes; multi-valued headers keep every
/// value in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResponse {
    /// The first response's status.
    pub status: StatusCode,
    /// The allow-listed headers of the first response, in order.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The first response's body, byte for byte.
    pub body: Bytes,
    /// The resource the operation created or changed, if its handler named
    /// one ([`ResourceId`] in the response extensions).
    pub resource_id: Option<ResourceId>,
    /// The first response's trailers (HTTP/2 and gRPC: `grpc-status`,
    /// `grpc-message`), in order; empty for a response without any.
    pub trailers: Vec<(HeaderName, HeaderValue)>,
    /// The trace of the request that did the work (from its W3C
    /// `traceparent` header; with the `opentelemetry` feature, from its
    /// span's OpenTelemetry context): a replay's span names it
    /// (`idempotency.original_trace_id`), so that an operator following a
    /// retry finds the run that produced its answer. `None` when that
    /// request carried no trace, or for a store that does not keep it.
    pub trace_id: Option<TraceId>,
    /// The span of that run in [`trace_id`](Self::trace_id)'s trace: the
    /// caller's span its `traceparent` names, or with the `opentelemetry`
    /// feature the request's own span, which a replay's span links to.
    pub span_id: Option<SpanId>,
}

/// A W3C Trace Context trace id: the 16 bytes that name one distributed
/// trace, written as 32 lowercase hex digits.
///
/// ```
/// use tower_idempotency::record::{SpanId, TraceId};
///
/// let header = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
/// let (trace, span) = TraceId::from_traceparent(header).unwrap();
/// assert_eq!(trace.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
/// assert_eq!(span, SpanId::parse("00f067aa0ba902b7").unwrap());
/// assert_eq!(TraceId::parse(&trace.to_string()), Some(trace));
/// // All zeros is not a trace, nor is anything but 32 hex digits.
/// assert_eq!(TraceId::parse("00000000000000000000000000000000"), None);
/// assert_eq!(TraceId::from_traceparent(b"00-4bf92f35-00f067aa0ba902b7-01"), None);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TraceId([u8; 16]);

/// A W3C Trace Context span id: the 8 bytes that name one span of a
/// trace, written as 16 lowercase hex digits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SpanId([u8; 8]);

/// The request header of W3C Trace Context that carries the trace id.
pub(crate) const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// `N` bytes from their `2 N` hex digits (either case); `None` for anything
/// else, or all zeros (W3C Trace Context's "no id").
fn from_hex<const N: usize>(hex: &str) -> Option<[u8; N]> {
    let hex = hex.as_bytes();
    if hex.len() != 2 * N {
        return None;
    }
    let mut bytes = [0; N];
    for (byte, pair) in bytes.iter_mut().zip(hex.chunks_exact(2)) {
        let digit = |d: u8| (d as char).to_digit(16);
        *byte = (digit(pair[0])? * 16 + digit(pair[1])?) as u8;
    }
    (bytes != [0; N]).then_some(bytes)
}

/// `bytes` as lowercase hex digits into `out`, which is twice as long.
fn to_hex(bytes: &[u8], out: &mut [u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (pair, byte) in out.chunks_exact_mut(2).zip(bytes) {
        pair[0] = DIGITS[usize::from(byte >> 4)];
        pair[1] = DIGITS[usize::from(byte & 0xf)];
    }
}

impl TraceId {
    /// The trace id of 16 bytes; `None` for all zeros (no trace).
    pub fn from_bytes(bytes: [u8; 16]) -> Option<Self> {
        (bytes != [0; 16]).then_some(TraceId(bytes))
    }

    /// Its 16 bytes.
    pub fn to_bytes(self) -> [u8; 16] {
        self.0
    }

    /// 32 hex digits (lowercase, as W3C Trace Context writes them; upper
    /// case is read too); `None` for anything else, or all zeros.
    pub fn parse(hex: &str) -> Option<Self> {
        from_hex(hex).map(TraceId)
    }

    /// The trace id and the parent's span id of a `traceparent` header's
    /// value (`version-traceid-parentid-flags`); `None` when it is not one.
    pub fn from_traceparent(value: &[u8]) -> Option<(Self, SpanId)> {
        let value = std::str::from_utf8(value).ok()?.trim();
        let mut fields = value.split('-');
        let version = fields.next()?;
        let trace = fields.next()?;
        let parent = fields.next()?;
        let flags = fields.next()?;
        let hex = |f: &str, len| f.len() == len && f.bytes().all(|b| b.is_ascii_hexdigit());
        // Version ff is invalid; a later version may add fields after these.
        if !hex(version, 2) || version == "ff" || !hex(flags, 2) {
            return None;
        }
        if version == "00" && fields.next().is_some() {
            return None;
        }
        Some((Self::parse(trace)?, SpanId::parse(parent)?))
    }
}

impl SpanId {
    /// The span id of 8 bytes; `None` for all zeros (no span).
    pub fn from_bytes(bytes: [u8; 8]) -> Option<Self> {
        (bytes != [0; 8]).then_some(SpanId(bytes))
    }

    /// Its 8 bytes.
    pub fn to_bytes(self) -> [u8; 8] {
        self.0
    }

    /// 16 hex digits; `None` for anything else, or all zeros.
    pub fn parse(hex: &str) -> Option<Self> {
        from_hex(hex).map(SpanId)
    }
}

impl std::fmt::Display for TraceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut hex = [0; 32];
        to_hex(&self.0, &mut hex);
        f.write_str(std::str::from_utf8(&hex).unwrap_or_default())
    }
}

impl std::fmt::Display for SpanId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut hex = [0; 16];
        to_hex(&self.0, &mut hex);
        f.write_str(std::str::from_utf8(&hex).unwrap_or_default())
    }
}

/// A trace and a span in it, either or both unknown.
pub(crate) type Trace = (Option<TraceId>, Option<SpanId>);

/// The trace and the span of the request that does the work, remembered
/// with its response. With the `opentelemetry` feature, the request span's
/// own OpenTelemetry context when it has a valid one; otherwise the
/// request's `traceparent` header (its trace, and the caller's span).
pub(crate) fn request_trace(headers: &HeaderMap) -> Trace {
    #[cfg(feature = "opentelemetry")]
    {
        use opentelemetry::trace::TraceContextExt;
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let span = tracing::Span::current();
        if !span.is_disabled() {
            let context = span.context();
            let own = context.span().span_context().clone();
            if own.is_valid() {
                return (
                    TraceId::from_bytes(own.trace_id().to_bytes()),
                    SpanId::from_bytes(own.span_id().to_bytes()),
                );
            }
        }
    }
    match headers
        .get(TRACEPARENT)
        .and_then(|value| TraceId::from_traceparent(value.as_bytes()))
    {
        Some((trace, span)) => (Some(trace), Some(span)),
        None => (None, None),
    }
}

/// How a record keeps its trace: the trace id's 32 hex digits, then `-`
/// and the span id's 16 when it has one. On the stack.
#[cfg(any(feature = "postgres", feature = "sqlx"))]
pub(crate) struct TraceText {
    text: [u8; 49],
    len: usize,
}

#[cfg(any(feature = "postgres", feature = "sqlx"))]
impl TraceText {
    /// The text of `response`'s trace, if it has one.
    pub(crate) fn of(response: &StoredResponse) -> Option<Self> {
        let trace = response.trace_id?;
        let mut text = [0; 49];
        to_hex(&trace.0, &mut text[..32]);
        let len = match response.span_id {
            Some(span) => {
                text[32] = b'-';
                to_hex(&span.0, &mut text[33..]);
                49
            }
            None => 32,
        };
        Some(TraceText { text, len })
    }

    pub(crate) fn as_str(&self) -> &str {
        // Hex digits and a hyphen: always ASCII.
        std::str::from_utf8(&self.text[..self.len]).unwrap_or_default()
    }

    /// A kept text as its trace and span; what does not read is left out.
    pub(crate) fn parse(text: &str) -> Trace {
        let (trace, span) = text.split_once('-').unwrap_or((text, ""));
        match TraceId::parse(trace) {
            Some(trace) => (Some(trace), SpanId::parse(span)),
            None => (None, None),
        }
    }
}

/// A response's trailers, carried in its extensions between the layer's
/// steps (the body is buffered, so they are taken off it).
#[derive(Clone, Debug)]
pub(crate) struct ResponseTrailers(pub(crate) HeaderMap);

/// A remembered operation as a store returns it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// The fingerprint of the request that created it.
    pub fingerprint: Fingerprint,
    /// Its response.
    pub response: StoredResponse,
}

impl StoredResponse {
    /// Keeps the headers of `headers` whose names are in `allow` (never `Set-Cookie`).
    pub fn new(status: StatusCode, headers: &HeaderMap, allow: &[HeaderName], body: Bytes) -> Self {
        let headers = allow
            .iter()
            .filter(|name| **name != http::header::SET_COOKIE)
            .flat_map(|name| {
                headers
                    .get_all(name)
                    .iter()
                    .map(move |value| (name.clone(), value.clone()))
            })
            .collect();
        StoredResponse {
            status,
            headers,
            body,
            resource_id: None,
            trailers: Vec::new(),
            trace_id: None,
            span_id: None,
        }
    }

    /// What the layer remembers of a response to store: its allow-listed
    /// headers, its body, and the [`ResourceId`] its handler named.
    pub(crate) fn remember(
        parts: &http::response::Parts,
        allow: &[HeaderName],
        body: Bytes,
    ) -> Self {
        let stored = StoredResponse::new(parts.status, &parts.headers, allow, body)
            .with_resource_id(parts.extensions.get::<ResourceId>().cloned());
        match parts.extensions.get::<ResponseTrailers>() {
            Some(ResponseTrailers(trailers)) => stored.with_trailers(trailers),
            None => stored,
        }
    }

    /// The same response, with `trailers` (all of them, in order).
    pub fn with_trailers(self, trailers: &HeaderMap) -> Self {
        let trailers = trailers
            .iter()
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect();
        crate::setter::with(self, |s| s.trailers = trailers)
    }

    /// The same response, naming the trace and the span of the request
    /// that did the work.
    pub fn with_trace(self, trace_id: Option<TraceId>, span_id: Option<SpanId>) -> Self {
        crate::setter::with(self, |s| {
            s.trace_id = trace_id;
            s.span_id = trace_id.and(span_id);
        })
    }

    /// The same response, naming the resource its operation created or changed.
    pub fn with_resource_id(self, resource_id: Option<ResourceId>) -> Self {
        crate::setter::with(self, |s| s.resource_id = resource_id)
    }

    /// The replay: the stored status, headers and body, plus `Idempotent-Replayed: true`.
    pub fn to_replay(&self) -> Response<Bytes> {
        let mut response = Response::new(self.body.clone());
        *response.status_mut() = self.status;
        let map = response.headers_mut();
        for (name, value) in &self.headers {
            map.append(name.clone(), value.clone());
        }
        map.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        if !self.trailers.is_empty() {
            let mut trailers = HeaderMap::new();
            for (name, value) in &self.trailers {
                trailers.append(name.clone(), value.clone());
            }
            response.extensions_mut().insert(ResponseTrailers(trailers));
        }
        response
    }

    /// Encodes the headers as an HTTP/1-style block (`name: value\r\n`),
    /// then, if there are trailers, an empty line (`\r\n`) and the
    /// trailers the same way, as HTTP/1.1 ends a chunked body.
    ///
    /// Header values cannot contain CR or LF, so the encoding is unambiguous
    /// and keeps non-UTF-8 values byte for byte.
    pub fn encode_headers(&self) -> Vec<u8> {
        let mut block = encode_headers(&self.headers);
        if !self.trailers.is_empty() {
            block.extend_from_slice(b"\r\n");
            block.extend_from_slice(&encode_headers(&self.trailers));
        }
        block
    }

    /// The headers of a block written by
    /// [`encode_headers`](Self::encode_headers) (what comes before the
    /// trailers); `None` if it is not such a block.
    pub fn decode_headers(block: &[u8]) -> Option<Vec<(HeaderName, HeaderValue)>> {
        decode_headers(split_trailers(block).0)
    }

    /// The trailers of a block written by
    /// [`encode_headers`](Self::encode_headers) (empty when it has none);
    /// `None` if it is not such a block.
    pub fn decode_trailers(block: &[u8]) -> Option<Vec<(HeaderName, HeaderValue)>> {
        decode_headers(split_trailers(block).1)
    }
}

/// Headers as an HTTP/1-style block (`name: value\r\n`).
pub(crate) fn encode_headers(headers: &[(HeaderName, HeaderValue)]) -> Vec<u8> {
    let size = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 4)
        .sum();
    let mut out = Vec::with_capacity(size);
    for (name, value) in headers {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// A stored block's headers and trailers: the trailers follow the first
/// empty line (`\r\n` at the start of a line).
fn split_trailers(block: &[u8]) -> (&[u8], &[u8]) {
    if let Some(rest) = block.strip_prefix(b"\r\n") {
        return (&[], rest);
    }
    match block.windows(4).position(|w| w == b"\r\n\r\n") {
        Some(at) => (&block[..at + 2], &block[at + 4..]),
        None => (block, &[]),
    }
}

/// Reads a block written by [`encode_headers`].
pub(crate) fn decode_headers(block: &[u8]) -> Option<Vec<(HeaderName, HeaderValue)>> {
    block
        .split(|b| *b == b'\n')
        .filter(|line| !line.is_empty())
        .map(|line| {
            let line = line.strip_suffix(b"\r")?;
            let colon = line.iter().position(|b| *b == b':')?;
            let name = HeaderName::from_bytes(&line[..colon]).ok()?;
            let value = line[colon + 1..].strip_prefix(b" ")?;
            Some((name, HeaderValue::from_bytes(value).ok()?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::header;

    #[test]
    fn keeps_allow_listed_multi_values_and_never_set_cookie() {
        let mut headers = HeaderMap::new();
        headers.append(header::LINK, HeaderValue::from_static("<a>; rel=x"));
        headers.append(header::LINK, HeaderValue::from_static("<b>; rel=y"));
        headers.append(header::SET_COOKIE, HeaderValue::from_static("s=1"));
        headers.append(header::SERVER, HeaderValue::from_static("x"));
        let stored = StoredResponse::new(
            StatusCode::CREATED,
            &headers,
            &[header::LINK, header::SET_COOKIE],
            Bytes::from_static(b"{}"),
        );
        assert_eq!(stored.headers.len(), 2);
        let replay = stored.to_replay();
        let links: Vec<_> = replay.headers().get_all(header::LINK).iter().collect();
        assert_eq!(links, ["<a>; rel=x", "<b>; rel=y"]);
        assert!(replay.headers().get(header::SET_COOKIE).is_none());
        assert_eq!(replay.headers()[IDEMPOTENT_REPLAYED], "true");
    }

    #[test]
    fn header_block_round_trips_opaque_bytes() {
        let stored = StoredResponse {
            status: StatusCode::OK,
            headers: vec![
                (header::LOCATION, HeaderValue::from_static("/orders/1")),
                (
                    header::ETAG,
                    HeaderValue::from_bytes(b"\"caf\xe9: x\"").unwrap(),
                ),
                (header::LOCATION, HeaderValue::from_static("")),
            ],
            body: Bytes::new(),
            resource_id: None,
            trailers: Vec::new(),
            trace_id: None,
            span_id: None,
        };
        let decoded = StoredResponse::decode_headers(&stored.encode_headers()).unwrap();
        assert_eq!(decoded, stored.headers);
        assert_eq!(StoredResponse::decode_headers(b"").unwrap(), vec![]);
        assert!(StoredResponse::decode_headers(b"no colon\r\n").is_none());
    }

    #[test]
    fn resource_ids_a_store_can_keep() {
        assert!(ResourceId::new("ord_1").is_storable());
        assert!(ResourceId::new("é".repeat(127)).is_storable());
        assert!(!ResourceId::new("").is_storable());
        assert!(!ResourceId::new("x".repeat(MAX_RESOURCE_ID_LEN + 1)).is_storable());
        assert!(!ResourceId::new("a\0b").is_storable());
        assert!(!ResourceId::new("a\nb").is_storable());
    }

    fn grpc_trailers() -> HeaderMap {
        let mut trailers = HeaderMap::new();
        trailers.append("grpc-status", HeaderValue::from_static("0"));
        trailers.append("grpc-message", HeaderValue::from_static("ok"));
        trailers.append("x-trace", HeaderValue::from_bytes(b"\xff1").unwrap());
        trailers
    }

    /// Trailers follow the headers after an empty line, in order and byte
    /// for byte, and come back apart from them; a block written before
    /// trailers were remembered reads as headers and no trailers.
    #[test]
    fn trailers_are_encoded_after_the_headers_and_read_back_apart() {
        let mut headers = HeaderMap::new();
        headers.append(header::LOCATION, HeaderValue::from_static("/orders/1"));
        let stored = StoredResponse::new(
            StatusCode::OK,
            &headers,
            &[header::LOCATION],
            Bytes::from_static(b"\0\0\0\0\x02{}"),
        )
        .with_trailers(&grpc_trailers());
        let block = stored.encode_headers();
        assert_eq!(
            block,
            b"location: /orders/1\r\n\r\ngrpc-status: 0\r\ngrpc-message: ok\r\nx-trace: \xff1\r\n"
        );
        assert_eq!(
            StoredResponse::decode_headers(&block).unwrap(),
            stored.headers
        );
        assert_eq!(
            StoredResponse::decode_trailers(&block).unwrap(),
            stored.trailers
        );

        let old = b"location: /orders/1\r\n";
        assert_eq!(StoredResponse::decode_headers(old).unwrap(), stored.headers);
        assert_eq!(StoredResponse::decode_trailers(old).unwrap(), vec![]);

        let trailers_only = StoredResponse::new(StatusCode::OK, &headers, &[], Bytes::new())
            .with_trailers(&grpc_trailers());
        let block = trailers_only.encode_headers();
        assert!(block.starts_with(b"\r\ngrpc-status: 0\r\n"));
        assert_eq!(StoredResponse::decode_headers(&block).unwrap(), vec![]);
        assert_eq!(
            StoredResponse::decode_trailers(&block).unwrap(),
            trailers_only.trailers
        );
        assert_eq!(StoredResponse::decode_trailers(b"a: b\r\n\r\nbroken"), None);
    }

    /// The replay carries the trailers to the body the layer sends.
    #[test]
    fn the_replay_carries_the_trailers() {
        let stored = StoredResponse::new(StatusCode::OK, &HeaderMap::new(), &[], Bytes::new())
            .with_trailers(&grpc_trailers());
        let replay = stored.to_replay();
        let carried = replay.extensions().get::<ResponseTrailers>().unwrap();
        assert_eq!(carried.0, grpc_trailers());
    }
}
