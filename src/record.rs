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
    /// The trace of the request that did the work, from its W3C
    /// `traceparent` header: a replay's span names it
    /// (`idempotency.original_trace_id`), so that an operator following a
    /// retry finds the run that produced its answer. `None` when that
    /// request carried no trace, or for a store that does not keep it.
    pub trace_id: Option<TraceId>,
}

/// A W3C Trace Context trace id: the 16 bytes that name one distributed
/// trace, written as 32 lowercase hex digits.
///
/// ```
/// use tower_idempotency::record::TraceId;
///
/// let header = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
/// let id = TraceId::from_traceparent(header.as_bytes()).unwrap();
/// assert_eq!(id.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
/// assert_eq!(TraceId::parse(&id.to_string()), Some(id));
/// // All zeros is not a trace, nor is anything but 32 hex digits.
/// assert_eq!(TraceId::parse("00000000000000000000000000000000"), None);
/// assert_eq!(TraceId::from_traceparent(b"00-4bf92f35-00f067aa0ba902b7-01"), None);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TraceId([u8; 16]);

/// The request header of W3C Trace Context that carries the trace id.
pub(crate) const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

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
        let hex = hex.as_bytes();
        if hex.len() != 32 {
            return None;
        }
        let mut bytes = [0; 16];
        for (byte, pair) in bytes.iter_mut().zip(hex.chunks_exact(2)) {
            let digit = |d: u8| (d as char).to_digit(16);
            *byte = (digit(pair[0])? * 16 + digit(pair[1])?) as u8;
        }
        Self::from_bytes(bytes)
    }

    /// The trace id of a `traceparent` header's value
    /// (`version-traceid-parentid-flags`); `None` when it is not one.
    pub fn from_traceparent(value: &[u8]) -> Option<Self> {
        let value = std::str::from_utf8(value).ok()?.trim();
        let mut fields = value.split('-');
        let version = fields.next()?;
        let trace = fields.next()?;
        let parent = fields.next()?;
        let flags = fields.next()?;
        let hex = |f: &str, len| f.len() == len && f.bytes().all(|b| b.is_ascii_hexdigit());
        // Version ff is invalid; a later version may add fields after these.
        if !hex(version, 2) || version == "ff" || !hex(parent, 16) || !hex(flags, 2) {
            return None;
        }
        if version == "00" && fields.next().is_some() {
            return None;
        }
        Self::parse(trace)
    }

    /// The trace id of a request's `traceparent` header, if it has one.
    pub(crate) fn of_request(headers: &HeaderMap) -> Option<Self> {
        Self::from_traceparent(headers.get(TRACEPARENT)?.as_bytes())
    }
}

impl TraceId {
    /// Its 32 lowercase hex digits, on the stack.
    pub(crate) fn hex(self) -> TraceHex {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut hex = [0; 32];
        for (pair, byte) in hex.chunks_exact_mut(2).zip(self.0) {
            pair[0] = DIGITS[usize::from(byte >> 4)];
            pair[1] = DIGITS[usize::from(byte & 0xf)];
        }
        TraceHex(hex)
    }
}

/// A [`TraceId`] written out (see [`TraceId::hex`]).
pub(crate) struct TraceHex([u8; 32]);

impl TraceHex {
    pub(crate) fn as_str(&self) -> &str {
        // Hex digits only: always ASCII.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

impl std::fmt::Display for TraceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.hex().as_str())
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

    /// The same response, naming the trace of the request that did the work.
    pub fn with_trace_id(self, trace_id: Option<TraceId>) -> Self {
        crate::setter::with(self, |s| s.trace_id = trace_id)
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
