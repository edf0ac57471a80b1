//! What is remembered about a completed request, and how it replays.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};

use crate::fingerprint::Fingerprint;

/// The header added to every replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

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

/// A remembered response: status, allow-listed headers and the body bytes.
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
}

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
        }
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
        response
    }

    /// Encodes the headers as an HTTP/1-style block (`name: value\r\n`).
    ///
    /// Header values cannot contain CR or LF, so the encoding is unambiguous
    /// and keeps non-UTF-8 values byte for byte.
    pub fn encode_headers(&self) -> Vec<u8> {
        encode_headers(&self.headers)
    }

    /// Decodes a block written by [`encode_headers`](Self::encode_headers).
    pub fn decode_headers(block: &[u8]) -> Option<Vec<(HeaderName, HeaderValue)>> {
        decode_headers(block)
    }
}

/// Headers as an HTTP/1-style block (`name: value\r\n`).
pub(crate) fn encode_headers(headers: &[(HeaderName, HeaderValue)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in headers {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out
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
        };
        let decoded = StoredResponse::decode_headers(&stored.encode_headers()).unwrap();
        assert_eq!(decoded, stored.headers);
        assert_eq!(StoredResponse::decode_headers(b"").unwrap(), vec![]);
        assert!(StoredResponse::decode_headers(b"no colon\r\n").is_none());
    }
}
