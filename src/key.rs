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
pub struct IdempotencyKey(Box<str>);

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
            Some(contents) => Self::from_bytes(contents),
            None => Self::from_bytes(raw.to_vec()),
        }
    }

    /// The key from its own text, as [`as_str`](Self::as_str) gave it (what
    /// a store keeps): nothing is unquoted.
    #[cfg(any(feature = "postgres", feature = "sqlx", test))]
    pub(crate) fn from_text(text: &str) -> Result<Self, KeyError> {
        Self::from_bytes(text.as_bytes().to_vec())
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

    fn from_bytes(key: Vec<u8>) -> Result<Self, KeyError> {
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
        String::from_utf8(key)
            .map(|s| IdempotencyKey(s.into_boxed_str()))
            .map_err(|_| KeyError::InvalidCharacter)
    }

    /// A new random key (a UUIDv4: 122 random bits), for a client starting
    /// an operation.
    #[cfg(feature = "client")]
    pub(crate) fn new_v4() -> Self {
        // Hex digits and dashes: visible ASCII, 36 characters.
        IdempotencyKey(uuid::Uuid::new_v4().to_string().into_boxed_str())
    }

    /// The key as the client sent it (unquoted).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The first 12 hex digits of the key's SHA-256: safe to log, enough to
    /// correlate log lines of one operation.
    pub fn short_hash(&self) -> String {
        use sha2::{Digest, Sha256};
        use std::fmt::Write as _;
        let digest = Sha256::digest(self.0.as_bytes());
        let mut hex = String::with_capacity(12);
        for b in &digest[..6] {
            let _ = write!(hex, "{b:02x}");
        }
        hex
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
/// message: [`grpc_message`] takes the frame off). `Ok(None)`: no key in
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
/// uncompressed frame (a compressed message is for the extractor to
/// decompress: the flag byte is 1 and this gives `None`).
pub fn grpc_message(body: &[u8]) -> Option<&[u8]> {
    let (&flag, rest) = body.split_first()?;
    if flag != 0 || rest.len() < 4 {
        return None;
    }
    let (len, message) = rest.split_at(4);
    let len = u32::from_be_bytes(len.try_into().ok()?) as usize;
    (message.len() == len).then_some(message)
}

#[cfg(test)]
mod grpc_tests {
    use super::grpc_message;

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
