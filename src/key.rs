//! Idempotency keys: parsing and validation.

use std::fmt;

/// The longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key: 1–255 visible ASCII characters (0x21–0x7E).
///
/// The header may carry the key bare (`Idempotency-Key: abc`) or as an
/// RFC 8941 string (`Idempotency-Key: "abc"`, the form the IETF draft uses);
/// both mean the key `abc`. A key whose own text is a quoted string (`"abc"`,
/// quotes included) is sent quoted: `"\"abc\""`;
/// [`header_value`](Self::header_value) writes each key in a form that
/// reads back as it.
///
/// `Debug` and `Display` never print the raw key: keys are client secrets in
/// the same sense as request bodies, so logs only see [`IdempotencyKey::short_hash`].
/// Cloning one shares the text (single-flight, the transaction handle and the
/// replay cache each hold a clone).
///
/// ```
/// use tower_idempotency::key::IdempotencyKey;
///
/// let key = IdempotencyKey::parse(b"\"order-42\"").unwrap();
/// assert_eq!(key.as_str(), "order-42");
/// assert!(IdempotencyKey::parse(b"has space").is_err());
/// assert!(IdempotencyKey::parse(b"").is_err());
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(std::sync::Arc<str>);

/// Why a key was refused; answered as `400 idempotency_key_invalid`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyError {
    /// The key is empty.
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`] bytes (or the layer's
    /// `max_key_length`).
    TooLong,
    /// The key contains a byte outside visible ASCII (0x21–0x7E).
    InvalidCharacter,
    /// The header appeared more than once.
    Repeated,
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KeyError::Empty => "the key is empty",
            KeyError::TooLong => {
                "the key is longer than allowed (255 characters, or the endpoint's own limit)"
            }
            KeyError::InvalidCharacter => {
                "the key may only contain visible ASCII characters (0x21-0x7E)"
            }
            KeyError::Repeated => "the key header appears more than once",
        })
    }
}

impl std::error::Error for KeyError {}

impl IdempotencyKey {
    /// Parses a header value: a bare key or an RFC 8941 quoted string.
    ///
    /// A value that is a well-formed quoted string is unquoted (`"abc"` and
    /// `abc` name the same key; `"\"abc\""` is the key `"abc"`); anything
    /// else is taken as it is, so a bare key may itself contain `"`.
    pub fn parse(raw: &[u8]) -> Result<Self, KeyError> {
        match quoted(raw) {
            Some(contents) => Self::from_bytes(&contents),
            None => Self::from_bytes(raw),
        }
    }

    /// The key from its own text, as [`as_str`](Self::as_str) gave it (what
    /// a store keeps): nothing is unquoted.
    #[cfg(any(feature = "postgres", feature = "sqlx", test))]
    pub(crate) fn from_text(text: &str) -> Result<Self, KeyError> {
        Self::from_bytes(text.as_bytes())
    }

    /// The header value that [`parse`](Self::parse) reads as this key: the
    /// key itself, or its RFC 8941 quoted form when the key's own text is a
    /// quoted string (the key `"abc"` is sent as `"\"abc\""`). Send this,
    /// not [`as_str`](Self::as_str), to name the key again.
    ///
    /// ```
    /// use tower_idempotency::key::IdempotencyKey;
    ///
    /// let key = IdempotencyKey::parse(br#""\"abc\"""#).unwrap();
    /// assert_eq!(key.as_str(), r#""abc""#);
    /// assert_eq!(key.header_value(), r#""\"abc\"""#);
    /// assert_eq!(IdempotencyKey::parse(key.header_value().as_bytes()), Ok(key));
    /// assert_eq!(IdempotencyKey::parse(b"abc").unwrap().header_value(), "abc");
    /// ```
    pub fn header_value(&self) -> std::borrow::Cow<'_, str> {
        if quoted(self.0.as_bytes()).is_some() {
            let escaped = self.0.replace('\\', "\\\\").replace('"', "\\\"");
            std::borrow::Cow::Owned(format!("\"{escaped}\""))
        } else {
            std::borrow::Cow::Borrowed(&self.0)
        }
    }

    fn from_bytes(key: &[u8]) -> Result<Self, KeyError> {
        if key.is_empty() {
            return Err(KeyError::Empty);
        }
        if key.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong);
        }
        if !key.iter().all(|b| (0x21..=0x7e).contains(b)) {
            return Err(KeyError::InvalidCharacter);
        }
        // Visible ASCII is valid UTF-8.
        std::str::from_utf8(key)
            .map(|s| IdempotencyKey(s.into()))
            .map_err(|_| KeyError::InvalidCharacter)
    }

    /// A new random key (a UUIDv4: 122 random bits), for a client starting
    /// an operation.
    #[cfg(feature = "client")]
    pub(crate) fn new_v4() -> Self {
        // Hex digits and dashes: visible ASCII, 36 characters.
        IdempotencyKey(uuid::Uuid::new_v4().to_string().into())
    }

    /// The key as the client sent it (unquoted).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The first 12 hex digits of the key's SHA-256: safe to log, enough to
    /// correlate log lines of one operation.
    pub fn short_hash(&self) -> String {
        self.short_hash_digits().as_str().to_owned()
    }

    /// [`short_hash`](Self::short_hash) on the stack: what a span records
    /// on every request, with no allocation and no formatting machinery.
    pub(crate) fn short_hash_digits(&self) -> ShortHash {
        use sha2::{Digest, Sha256};
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let digest = Sha256::digest(self.0.as_bytes());
        let mut digits = [0; 12];
        for (pair, b) in digits.chunks_exact_mut(2).zip(&digest[..6]) {
            pair[0] = HEX[usize::from(b >> 4)];
            pair[1] = HEX[usize::from(b & 0xf)];
        }
        ShortHash(digits)
    }
}

/// The 12 hex digits of [`IdempotencyKey::short_hash`], held inline.
#[derive(Clone, Copy)]
pub(crate) struct ShortHash([u8; 12]);

impl ShortHash {
    pub(crate) fn as_str(&self) -> &str {
        // Hex digits only: ASCII.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

/// RFC 8941 sf-string body: printable ASCII with `\"` and `\\` as the only
/// escapes; `None` if it is not one.
/// The contents of `raw` if it is a well-formed RFC 8941 quoted string.
fn quoted(raw: &[u8]) -> Option<Vec<u8>> {
    match raw {
        [b'"', inner @ .., b'"'] => unquote(inner),
        _ => None,
    }
}

fn unquote(inner: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&escaped @ (b'"' | b'\\')) => out.push(escaped),
                _ => return None,
            },
            b'"' => return None,
            0x20..=0x7e => out.push(b),
            _ => return None,
        }
    }
    Some(out)
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey(#{})", self.short_hash())
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.short_hash())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn accepts_bare_and_quoted_forms() {
        assert_eq!(IdempotencyKey::parse(b"abc").unwrap().as_str(), "abc");
        assert_eq!(IdempotencyKey::parse(b"\"abc\"").unwrap().as_str(), "abc");
        assert_eq!(
            IdempotencyKey::parse(br#""a\"b\\c""#).unwrap().as_str(),
            r#"a"b\c"#
        );
    }

    #[test]
    fn refuses_bad_keys_with_a_reason() {
        assert_eq!(IdempotencyKey::parse(b""), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::parse(b"\"\""), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::parse(&[b'a'; 256]), Err(KeyError::TooLong));
        assert!(IdempotencyKey::parse(&[b'a'; 255]).is_ok());
        assert_eq!(
            IdempotencyKey::parse(b"a b"),
            Err(KeyError::InvalidCharacter)
        );
        assert_eq!(
            IdempotencyKey::parse(b"\"a b\""),
            Err(KeyError::InvalidCharacter)
        );
        // Not a well-formed quoted string: a bare key that happens to hold quotes.
        assert_eq!(IdempotencyKey::parse(b"\"abc").unwrap().as_str(), "\"abc");
        assert_eq!(IdempotencyKey::parse(b"\"").unwrap().as_str(), "\"");
        assert_eq!(
            IdempotencyKey::parse(b"\"a\\x\"").unwrap().as_str(),
            "\"a\\x\""
        );
        assert_eq!(
            IdempotencyKey::parse("ключ".as_bytes()),
            Err(KeyError::InvalidCharacter)
        );
    }

    #[test]
    fn a_key_that_is_a_quoted_string_is_sent_quoted() {
        // The keys `"rk1"` and `""`, quotes included.
        for (raw, text) in [(&br#""\"rk1\"""#[..], r#""rk1""#), (br#""\"\"""#, r#""""#)] {
            let key = IdempotencyKey::parse(raw).unwrap();
            assert_eq!(key.as_str(), text);
            assert_eq!(key.header_value().as_bytes(), raw);
            assert_eq!(IdempotencyKey::from_text(key.as_str()), Ok(key));
        }
        // Quotes that do not make a quoted string are the key's own.
        let key = IdempotencyKey::parse(br#""\"a\"b\"""#).unwrap();
        assert_eq!(key.as_str(), r#""a"b""#);
        assert_eq!(key.header_value(), key.as_str());
        assert_eq!(IdempotencyKey::parse(key.as_str().as_bytes()), Ok(key));
    }

    #[test]
    fn debug_and_display_hide_the_raw_key() {
        let key = IdempotencyKey::parse(b"secret-key-123").unwrap();
        assert!(!format!("{key:?}").contains("secret"));
        assert!(!key.to_string().contains("secret"));
        assert_eq!(key.short_hash().len(), 12);
        // The digits are the digest's first six bytes, in lower-case hex.
        use sha2::{Digest, Sha256};
        let digest = Sha256::digest(key.as_str().as_bytes());
        let expected: String = digest[..6].iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(key.short_hash(), expected);
    }

    /// `key` in the RFC 8941 quoted form.
    fn quote(key: &str) -> String {
        format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""))
    }

    proptest! {
        #[test]
        fn parse_never_panics(raw in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = IdempotencyKey::parse(&raw);
        }

        /// A key that is not in the quoted form (`"…"`, which means its
        /// contents: `quoted_keys_round_trip`) is itself.
        #[test]
        fn visible_ascii_keys_round_trip(key in "[!-~]{1,255}") {
            prop_assume!(!(key.len() >= 2 && key.starts_with('"') && key.ends_with('"')));
            let parsed = IdempotencyKey::parse(key.as_bytes()).unwrap();
            prop_assert_eq!(parsed.as_str(), key.as_str());
        }

        #[test]
        fn quoted_keys_round_trip(key in "[!-~]{1,253}") {
            let parsed = IdempotencyKey::parse(quote(&key).as_bytes()).unwrap();
            prop_assert_eq!(parsed.as_str(), key.as_str());
        }

        /// An accepted key read again is the same key: from the text a store
        /// keeps (`as_str`, for the recovery worker), and from its
        /// `header_value` (for a client that sends it again).
        #[test]
        fn an_accepted_key_reads_back_as_itself(
            raw in prop_oneof![
                proptest::collection::vec(prop_oneof![Just(b'"'), Just(b'\\'), 0x21..0x7f_u8], 0..40),
                "[a-c\"\\\\]{0,8}".prop_map(|k| quote(&k).into_bytes()),
                "[a-c\"\\\\]{0,8}".prop_map(|k| quote(&quote(&k)).into_bytes()),
            ],
        ) {
            if let Ok(key) = IdempotencyKey::parse(&raw) {
                prop_assert_eq!(IdempotencyKey::from_text(key.as_str()), Ok(key.clone()));
                prop_assert_eq!(IdempotencyKey::parse(key.header_value().as_bytes()), Ok(key));
            }
        }

        /// Whatever the bytes, an accepted key is 1-255 visible ASCII
        /// characters, and a refused one says why.
        #[test]
        fn any_header_bytes_give_a_valid_key_or_a_reason(
            raw in prop_oneof![
                proptest::collection::vec(any::<u8>(), 0..300),
                proptest::collection::vec(prop_oneof![Just(b'"'), Just(b'\\'), Just(b' '), 0x21..0x7f_u8], 0..300),
            ],
        ) {
            match IdempotencyKey::parse(&raw) {
                Ok(key) => {
                    prop_assert!((1..=MAX_KEY_LEN).contains(&key.as_str().len()));
                    prop_assert!(key.as_str().bytes().all(|b| (0x21..=0x7e).contains(&b)));
                }
                Err(KeyError::Empty) => prop_assert!(raw.is_empty() || raw == b"\"\""),
                Err(KeyError::TooLong) => prop_assert!(raw.len() > MAX_KEY_LEN),
                Err(KeyError::InvalidCharacter) => {
                    prop_assert!(raw.iter().any(|b| !(0x21..=0x7e).contains(b)));
                }
                Err(e) => prop_assert!(false, "parse never says {:?}", e),
            }
            // A byte no form allows is always refused.
            if raw.iter().any(|b| !(0x20..=0x7e).contains(b)) {
                prop_assert!(IdempotencyKey::parse(&raw).is_err());
            }
        }
    }
}

/// Reads an operation's key from the request itself when it is not in the
/// key header: from a field of the message, as Google's AIP-155 puts a
/// `request_id` in every mutating gRPC request. Given to
/// [`IdempotencyLayer::key_from_body`](crate::IdempotencyLayer::key_from_body);
/// any `Fn(&Parts, &Bytes) -> Result<Option<String>, String>` is one.
///
/// It sees the request's head and its buffered body (for gRPC, the framed
/// message: [`grpc_message`] takes the frame off; a compressed message is
/// handed over decompressed, in an uncompressed frame, as the fingerprinter
/// sees it: [`decode_grpc_message`]). `Ok(None)`: no key in
/// this request; `Err`: the message cannot be read, answered as
/// `400 idempotency_key_invalid` with the reason.
pub trait KeyFromBody: Send + Sync + 'static {
    /// The key this request carries, if any.
    fn key(
        &self,
        head: &http::request::Parts,
        body: &bytes::Bytes,
    ) -> Result<Option<String>, String>;
}

impl<F> KeyFromBody for F
where
    F: Fn(&http::request::Parts, &bytes::Bytes) -> Result<Option<String>, String>
        + Send
        + Sync
        + 'static,
{
    fn key(
        &self,
        head: &http::request::Parts,
        body: &bytes::Bytes,
    ) -> Result<Option<String>, String> {
        self(head, body)
    }
}

/// The message of a unary gRPC request body: its one length-prefixed frame
/// without the 5-byte prefix; `None` if the body is not exactly one
/// uncompressed frame (the flag byte is 1 for a compressed message, and
/// this gives `None`: [`decode_grpc_message`] decompresses it).
///
/// Behind the layer a fingerprinter or a [`KeyFromBody`] may use this on
/// a compressed call too: for a gRPC request the layer hands them the
/// message decompressed, in an uncompressed frame (see
/// [`decode_grpc_message`]).
pub fn grpc_message(body: &[u8]) -> Option<&[u8]> {
    match grpc_frame(body)? {
        (0, message) => Some(message),
        _ => None,
    }
}

/// The flag byte and the message of a body that is exactly one
/// length-prefixed gRPC frame.
fn grpc_frame(body: &[u8]) -> Option<(u8, &[u8])> {
    let (&flag, rest) = body.split_first()?;
    if rest.len() < 4 {
        return None;
    }
    let (len, message) = rest.split_at(4);
    let len = u32::from_be_bytes(len.try_into().ok()?) as usize;
    (message.len() == len).then_some((flag, message))
}

/// The message encodings [`decode_grpc_message`] reads, as a server
/// announces them in `grpc-accept-encoding`. `zstd` is not among them: the
/// only implementation tonic offers is the C library.
pub const GRPC_ACCEPT_ENCODING: &str = "identity,gzip,deflate";

/// Why [`decode_grpc_message`] could not give the message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum GrpcMessageError {
    /// The body is not exactly one length-prefixed frame (with the flag
    /// byte 0 or 1).
    NotOneFrame,
    /// The frame is compressed with an encoding not in
    /// [`GRPC_ACCEPT_ENCODING`] (its name as the request gave it); gRPC
    /// answers this `UNIMPLEMENTED`.
    UnsupportedEncoding(String),
    /// The frame's flag says compressed, but the request names no
    /// `grpc-encoding` (or `identity`).
    NoEncoding,
    /// Decompressed, the message is longer than the limit given.
    TooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The bytes do not decompress in the encoding the request names.
    Corrupt(String),
}

impl fmt::Display for GrpcMessageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GrpcMessageError::NotOneFrame => f.write_str("the body is not one gRPC frame"),
            GrpcMessageError::UnsupportedEncoding(name) => write!(
                f,
                "the message is compressed with {name:?}, which is not read here (read: {GRPC_ACCEPT_ENCODING})"
            ),
            GrpcMessageError::NoEncoding => {
                f.write_str("the message is flagged compressed but the request names no grpc-encoding")
            }
            GrpcMessageError::TooLarge { limit } => {
                write!(f, "the message decompressed is over the limit of {limit} bytes")
            }
            GrpcMessageError::Corrupt(reason) => {
                write!(f, "the message does not decompress: {reason}")
            }
        }
    }
}

impl std::error::Error for GrpcMessageError {}

/// The message of a unary gRPC request body, decompressed: the frame taken
/// off as [`grpc_message`] does, and a compressed frame (flag byte 1)
/// decompressed in the encoding its request's `grpc-encoding` header names,
/// `gzip` or `deflate` (the zlib format, as gRPC means it), the name's case
/// aside. An uncompressed frame is its message whatever the header says
/// (gRPC lets a client send any message of a call uncompressed).
///
/// No more than `limit` bytes are ever decompressed: a message longer than
/// that is [`TooLarge`](GrpcMessageError::TooLarge), however small its
/// compressed form (a compression bomb stops at `limit + 1` bytes).
///
/// The layer does this itself for a gRPC request before the fingerprint and
/// the key are read, with the endpoint's
/// [`request_body_limit`](crate::IdempotencyLayer::request_body_limit):
/// they see the message in an uncompressed frame, so a call and its retry
/// are the same operation whether or not either was compressed.
///
/// ```
/// use std::io::Write;
/// use tower_idempotency::key::{decode_grpc_message, GrpcMessageError};
///
/// let mut gzip = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
/// gzip.write_all(b"hello").unwrap();
/// let compressed = gzip.finish().unwrap();
/// let mut body = vec![1];
/// body.extend_from_slice(&(compressed.len() as u32).to_be_bytes());
/// body.extend_from_slice(&compressed);
///
/// let mut headers = http::HeaderMap::new();
/// headers.insert("grpc-encoding", "gzip".parse().unwrap());
/// assert_eq!(&*decode_grpc_message(&headers, &body, 1024).unwrap(), b"hello");
/// assert_eq!(
///     decode_grpc_message(&headers, &body, 4),
///     Err(GrpcMessageError::TooLarge { limit: 4 }),
/// );
/// headers.insert("grpc-encoding", "snappy".parse().unwrap());
/// assert_eq!(
///     decode_grpc_message(&headers, &body, 1024),
///     Err(GrpcMessageError::UnsupportedEncoding("snappy".into())),
/// );
/// # assert_eq!(&*decode_grpc_message(&headers, b"\0\0\0\0\x02hi", 1024).unwrap(), b"hi");
/// ```
pub fn decode_grpc_message<'a>(
    headers: &http::HeaderMap,
    body: &'a [u8],
    limit: usize,
) -> Result<std::borrow::Cow<'a, [u8]>, GrpcMessageError> {
    use std::io::Read;

    let message = match grpc_frame(body) {
        Some((0, message)) if message.len() > limit => {
            return Err(GrpcMessageError::TooLarge { limit })
        }
        Some((0, message)) => return Ok(std::borrow::Cow::Borrowed(message)),
        Some((1, message)) => message,
        // gRPC defines the flags 0 and 1 only.
        _ => return Err(GrpcMessageError::NotOneFrame),
    };
    let name = match headers.get("grpc-encoding") {
        None => return Err(GrpcMessageError::NoEncoding),
        Some(value) => String::from_utf8_lossy(value.as_bytes()).trim().to_owned(),
    };
    let reader: Box<dyn Read + '_> = if name.eq_ignore_ascii_case("gzip") {
        Box::new(flate2::read::GzDecoder::new(message))
    } else if name.eq_ignore_ascii_case("deflate") {
        Box::new(flate2::read::ZlibDecoder::new(message))
    } else if name.eq_ignore_ascii_case("identity") {
        return Err(GrpcMessageError::NoEncoding);
    } else {
        return Err(GrpcMessageError::UnsupportedEncoding(name));
    };
    // One byte past the limit is enough to know the message is over it;
    // nothing past that is ever inflated.
    let cap = u64::try_from(limit).unwrap_or(u64::MAX).saturating_add(1);
    let mut decoded = Vec::with_capacity(message.len().saturating_mul(2).min(limit));
    reader
        .take(cap)
        .read_to_end(&mut decoded)
        .map_err(|e| GrpcMessageError::Corrupt(e.to_string()))?;
    if decoded.len() > limit {
        return Err(GrpcMessageError::TooLarge { limit });
    }
    Ok(std::borrow::Cow::Owned(decoded))
}

#[cfg(test)]
mod grpc_tests {
    use std::io::Write;

    use proptest::prelude::*;

    use super::{decode_grpc_message, grpc_message, GrpcMessageError};

    fn frame(flag: u8, message: &[u8]) -> Vec<u8> {
        let mut body = vec![flag];
        body.extend_from_slice(&(message.len() as u32).to_be_bytes());
        body.extend_from_slice(message);
        body
    }

    fn gzip(message: &[u8]) -> Vec<u8> {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        encoder.write_all(message).unwrap();
        encoder.finish().unwrap()
    }

    fn deflate(message: &[u8]) -> Vec<u8> {
        let mut encoder =
            flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        encoder.write_all(message).unwrap();
        encoder.finish().unwrap()
    }

    fn encoding(name: Option<&str>) -> http::HeaderMap {
        let mut headers = http::HeaderMap::new();
        if let Some(name) = name {
            headers.insert("grpc-encoding", name.parse().unwrap());
        }
        headers
    }

    #[test]
    fn the_same_message_decodes_the_same_in_every_encoding() {
        let message = b"\x0a\x05rid-1\x12\x03tea\x18\x02";
        for (case, body, name) in [
            ("identity", frame(0, message), None),
            ("identity, named", frame(0, message), Some("identity")),
            ("uncompressed under gzip", frame(0, message), Some("gzip")),
            ("gzip", frame(1, &gzip(message)), Some("gzip")),
            ("Gzip", frame(1, &gzip(message)), Some("Gzip")),
            ("deflate", frame(1, &deflate(message)), Some("deflate")),
        ] {
            let decoded = decode_grpc_message(&encoding(name), &body, 1024);
            assert_eq!(decoded.as_deref(), Ok(&message[..]), "{case}");
        }
    }

    #[test]
    fn what_cannot_be_decoded_says_why() {
        let message = b"hello";
        let refused = |body: &[u8], name| {
            decode_grpc_message(&encoding(name), body, 1024).map(|m| m.into_owned())
        };
        assert_eq!(
            refused(&frame(1, &gzip(message)), Some("snappy")),
            Err(GrpcMessageError::UnsupportedEncoding("snappy".into()))
        );
        assert_eq!(
            refused(&frame(1, &gzip(message)), Some("zstd")),
            Err(GrpcMessageError::UnsupportedEncoding("zstd".into()))
        );
        assert_eq!(
            refused(&frame(1, &gzip(message)), None),
            Err(GrpcMessageError::NoEncoding)
        );
        assert_eq!(
            refused(&frame(1, &gzip(message)), Some("identity")),
            Err(GrpcMessageError::NoEncoding)
        );
        assert!(matches!(
            refused(&frame(1, message), Some("gzip")),
            Err(GrpcMessageError::Corrupt(_))
        ));
        let mut truncated = gzip(message);
        truncated.truncate(truncated.len() - 4);
        assert!(matches!(
            refused(&frame(1, &truncated), Some("gzip")),
            Err(GrpcMessageError::Corrupt(_))
        ));
        assert_eq!(
            refused(&frame(2, message), Some("gzip")),
            Err(GrpcMessageError::NotOneFrame)
        );
        assert_eq!(
            refused(b"\x01\0\0", Some("gzip")),
            Err(GrpcMessageError::NotOneFrame)
        );
    }

    /// 10 MiB of zeros gzips to about 10 KiB: decoded under a 1 MiB limit,
    /// it is refused, and the limit itself is read.
    #[test]
    fn a_compression_bomb_stops_at_the_limit() {
        let limit = 1024 * 1024;
        let bomb = frame(1, &gzip(&vec![0; 10 * 1024 * 1024]));
        assert!(bomb.len() < 64 * 1024);
        assert_eq!(
            decode_grpc_message(&encoding(Some("gzip")), &bomb, limit),
            Err(GrpcMessageError::TooLarge { limit })
        );
        let at_limit = frame(1, &deflate(&vec![0; limit]));
        let decoded = decode_grpc_message(&encoding(Some("deflate")), &at_limit, limit).unwrap();
        assert_eq!(decoded.len(), limit);
        assert_eq!(
            decode_grpc_message(&encoding(None), &frame(0, b"12345"), 4),
            Err(GrpcMessageError::TooLarge { limit: 4 })
        );
    }

    proptest! {
        #[test]
        fn any_message_round_trips_through_gzip_and_deflate(
            message in proptest::collection::vec(any::<u8>(), 0..2048),
        ) {
            for (name, compressed) in [("gzip", gzip(&message)), ("deflate", deflate(&message))] {
                let body = frame(1, &compressed);
                let decoded = decode_grpc_message(&encoding(Some(name)), &body, 2048);
                prop_assert_eq!(decoded.as_deref(), Ok(&message[..]));
            }
        }

        #[test]
        fn any_body_decodes_or_says_why_never_past_the_limit(
            body in proptest::collection::vec(any::<u8>(), 0..256),
            name in prop_oneof![Just("gzip"), Just("deflate"), Just("x")],
        ) {
            if let Ok(message) = decode_grpc_message(&encoding(Some(name)), &body, 64) {
                prop_assert!(message.len() <= 64);
            }
        }
    }

    #[test]
    fn grpc_message_takes_one_uncompressed_frame_off() {
        assert_eq!(grpc_message(b"\0\0\0\0\x02hi"), Some(&b"hi"[..]));
        assert_eq!(grpc_message(b"\0\0\0\0\0"), Some(&b""[..]));
        assert_eq!(grpc_message(b"\x01\0\0\0\x02hi"), None, "compressed");
        assert_eq!(grpc_message(b"\0\0\0\0\x03hi"), None, "short");
        assert_eq!(grpc_message(b"\0\0\0\0\x01hi"), None, "two messages");
        assert_eq!(grpc_message(b"\0\0"), None);
        assert_eq!(grpc_message(b""), None);
    }
}
