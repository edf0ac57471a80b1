//! Request fingerprints: what makes two requests "the same request".
//!
//! A key names one operation; the fingerprint says what that operation was.
//! A retry with the same key and the same fingerprint replays the first
//! answer; the same key with another fingerprint is refused.

use std::{fmt, marker::PhantomData, sync::Arc};

use bytes::Bytes;
use http::{request::Parts, StatusCode};
use serde::{de::DeserializeOwned, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::problem::{codes, Problem};

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
        let mut hasher = Sha256::new();
        hasher.update(b"tower-idempotency/fingerprint/1\0");
        hasher.update((version.len() as u64).to_be_bytes());
        hasher.update(version.as_bytes());
        hasher.update(canonical);
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
/// use tower_idempotency::{Fingerprint, Fingerprinter};
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
}

impl<F> Fingerprinter for F
where
    F: Fn(&mut Parts, &Bytes) -> Result<Fingerprint, Problem> + Send + Sync + 'static,
{
    fn fingerprint(&self, parts: &mut Parts, body: &Bytes) -> Result<Fingerprint, Problem> {
        self(parts, body)
    }
}

/// One failing field of a rejected body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FieldError {
    /// Where the field is, e.g. `items[0].quantity` (empty for the whole body).
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

impl FieldError {
    /// A failing field.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        FieldError {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// The `422 validation_failed` problem listing the failing fields.
pub fn validation_problem(errors: &[FieldError]) -> Problem {
    Problem::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        codes::VALIDATION_FAILED,
        "The request body is not valid",
    )
    .with_member(
        "errors",
        serde_json::to_value(errors).unwrap_or(Value::Null),
    )
}

/// Fingerprints any JSON body by its canonical form.
///
/// Object key order, white space and number spelling (`1`, `1.0`, `1e0`) make
/// no difference; array order does. Top-level fields named with
/// [`ignore_field`](Self::ignore_field) (tracing ids, client timestamps) are
/// dropped before hashing. A body that is not JSON is answered with
/// `422 validation_failed`.
///
/// ```
/// use tower_idempotency::{Fingerprinter, JsonFingerprinter};
///
/// let fp = JsonFingerprinter::new("orders.v1").ignore_field("trace_id");
/// let (mut parts, _) = http::Request::new(()).into_parts();
/// let a = fp.fingerprint(&mut parts, &r#"{"a": 1, "b": [1, 2], "trace_id": "x"}"#.into()).unwrap();
/// let b = fp.fingerprint(&mut parts, &r#"{"b":[1,2.0],"a":1}"#.into()).unwrap();
/// assert_eq!(a, b);
/// ```
#[derive(Debug, Clone)]
pub struct JsonFingerprinter {
    version: Arc<str>,
    ignored: Arc<[String]>,
}

impl JsonFingerprinter {
    /// A fingerprinter for an endpoint version (e.g. `"orders.v1"`).
    pub fn new(version: impl Into<Arc<str>>) -> Self {
        JsonFingerprinter {
            version: version.into(),
            ignored: Arc::from(Vec::new()),
        }
    }

    /// Drops a top-level field that is not part of the business request.
    pub fn ignore_field(mut self, name: impl Into<String>) -> Self {
        let mut ignored = self.ignored.to_vec();
        ignored.push(name.into());
        self.ignored = ignored.into();
        self
    }
}

impl Fingerprinter for JsonFingerprinter {
    fn fingerprint(&self, _parts: &mut Parts, body: &Bytes) -> Result<Fingerprint, Problem> {
        let mut value: Value = serde_json::from_slice(body)
            .map_err(|e| validation_problem(&[FieldError::new("", e.to_string())]))?;
        if let Value::Object(map) = &mut value {
            for name in self.ignored.iter() {
                map.remove(name);
            }
        }
        Ok(Fingerprint::digest(&self.version, &canonical_json(&value)))
    }
}

/// The validated DTO a [`TypedFingerprinter`] parsed, left in the request
/// extensions so the handler does not parse the body again.
///
/// With the `axum` feature it is an extractor.
#[derive(Debug)]
pub struct Validated<T>(Arc<T>);

impl<T> Validated<T> {
    /// Wraps an already validated value.
    pub fn new(value: T) -> Self {
        Validated(Arc::new(value))
    }

    /// The shared value.
    pub fn into_inner(self) -> Arc<T> {
        self.0
    }
}

impl<T> Clone for Validated<T> {
    fn clone(&self) -> Self {
        Validated(self.0.clone())
    }
}

impl<T> std::ops::Deref for Validated<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

type Validator<T> = Arc<dyn Fn(&T) -> Result<(), Vec<FieldError>> + Send + Sync>;

/// Deserialises the body into the endpoint's DTO, validates it and hashes its
/// canonical encoding.
///
/// Serde decides what is a business field: unknown fields are ignored (unless
/// the type denies them), `#[serde(default)]` fills defaults, so `quantity`
/// absent and `quantity: 1` are the same request. The DTO is left in the
/// request extensions as [`Validated<T>`].
///
/// ```
/// use serde::{Deserialize, Serialize};
/// use tower_idempotency::{FieldError, Fingerprinter, TypedFingerprinter, Validated};
///
/// #[derive(Serialize, Deserialize)]
/// struct Transfer { to: String, #[serde(default)] memo: Option<String>, amount: u64 }
///
/// let fp = TypedFingerprinter::<Transfer>::new("transfers.v1").with_validator(|t| {
///     if t.amount == 0 { Err(vec![FieldError::new("amount", "must be positive")]) } else { Ok(()) }
/// });
/// let (mut parts, _) = http::Request::new(()).into_parts();
/// let a = fp.fingerprint(&mut parts, &r#"{"to":"bob","amount":5}"#.into()).unwrap();
/// let b = fp.fingerprint(&mut parts, &r#"{"amount":5,"memo":null,"to":"bob","note":"x"}"#.into()).unwrap();
/// assert_eq!(a, b);
/// assert_eq!(parts.extensions.get::<Validated<Transfer>>().unwrap().to, "bob");
/// let rejected = fp.fingerprint(&mut parts, &r#"{"to":"bob","amount":0}"#.into()).unwrap_err();
/// assert_eq!(rejected.code(), "validation_failed");
/// ```
pub struct TypedFingerprinter<T> {
    version: Arc<str>,
    validator: Option<Validator<T>>,
    _dto: PhantomData<fn() -> T>,
}

impl<T> TypedFingerprinter<T> {
    /// A fingerprinter for the DTO `T` under an endpoint version.
    pub fn new(version: impl Into<Arc<str>>) -> Self {
        TypedFingerprinter {
            version: version.into(),
            validator: None,
            _dto: PhantomData,
        }
    }

    /// Adds business validation run after deserialisation; failures are
    /// answered with `422 validation_failed` listing the fields.
    pub fn with_validator<F>(mut self, validator: F) -> Self
    where
        F: Fn(&T) -> Result<(), Vec<FieldError>> + Send + Sync + 'static,
    {
        self.validator = Some(Arc::new(validator));
        self
    }
}

impl<T> Clone for TypedFingerprinter<T> {
    fn clone(&self) -> Self {
        TypedFingerprinter {
            version: self.version.clone(),
            validator: self.validator.clone(),
            _dto: PhantomData,
        }
    }
}

impl<T> fmt::Debug for TypedFingerprinter<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TypedFingerprinter")
            .field("dto", &std::any::type_name::<T>())
            .field("version", &self.version)
            .field("validator", &self.validator.is_some())
            .finish()
    }
}

impl<T> Fingerprinter for TypedFingerprinter<T>
where
    T: DeserializeOwned + Serialize + Send + Sync + 'static,
{
    fn fingerprint(&self, parts: &mut Parts, body: &Bytes) -> Result<Fingerprint, Problem> {
        let mut de = serde_json::Deserializer::from_slice(body);
        let dto: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let field = e.path().to_string();
            let field = if field == "." { String::new() } else { field };
            validation_problem(&[FieldError::new(field, e.inner().to_string())])
        })?;
        de.end()
            .map_err(|e| validation_problem(&[FieldError::new("", e.to_string())]))?;
        if let Some(validator) = &self.validator {
            validator(&dto).map_err(|errors| validation_problem(&errors))?;
        }
        let canonical = serde_json::to_value(&dto).map_err(|e| {
            validation_problem(&[FieldError::new("", format!("cannot encode: {e}"))])
        })?;
        let fingerprint = Fingerprint::digest(&self.version, &canonical_json(&canonical));
        parts.extensions.insert(Validated::new(dto));
        Ok(fingerprint)
    }
}

/// A deterministic, unambiguous byte encoding of a JSON value: objects by
/// sorted key, numbers by value, strings length-prefixed.
pub fn canonical_json(value: &Value) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    encode(value, &mut out);
    out
}

fn encode(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Null => out.push(b'n'),
        Value::Bool(true) => out.push(b't'),
        Value::Bool(false) => out.push(b'f'),
        Value::Number(n) => {
            out.push(b'#');
            out.extend_from_slice(canonical_number(n).as_bytes());
            out.push(b';');
        }
        Value::String(s) => encode_str(s, out),
        Value::Array(items) => {
            out.push(b'[');
            items.iter().for_each(|item| encode(item, out));
            out.push(b']');
        }
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (key, item) in entries {
                encode_str(key, out);
                encode(item, out);
            }
            out.push(b'}');
        }
    }
}

fn encode_str(s: &str, out: &mut Vec<u8>) {
    out.push(b's');
    out.extend_from_slice(&(s.len() as u64).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Numbers compare by value: integers print as integers, and a float with
/// no fractional part prints as the integer it exactly is, so `2`, `2.0` and
/// `2e0` (or `100000000000000000` and `1e17`) agree. Other floats compare as
/// IEEE-754 doubles: values that differ only beyond double precision collide,
/// so send amounts in integer minor units or as strings.
fn canonical_number(n: &serde_json::Number) -> String {
    if let Some(i) = n.as_i64() {
        return i.to_string();
    }
    if let Some(u) = n.as_u64() {
        return u.to_string();
    }
    let f = n.as_f64().unwrap_or(f64::NAN);
    // Every integral double below 2^127 converts to i128 exactly.
    const I128_SAFE: f64 = 1.7014118346046923e38;
    if f.fract() == 0.0 && f.abs() < I128_SAFE {
        return (f as i128).to_string();
    }
    format!("{f:e}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn fp(json: &JsonFingerprinter, body: &str) -> Result<Fingerprint, Problem> {
        let (mut parts, _) = http::Request::new(()).into_parts();
        json.fingerprint(&mut parts, &Bytes::copy_from_slice(body.as_bytes()))
    }

    #[test]
    fn number_spelling_does_not_matter() {
        let json = JsonFingerprinter::new("v1");
        let a = fp(&json, r#"{"n": 2, "x": 0.5}"#).unwrap();
        assert_eq!(a, fp(&json, r#"{"n": 2.0, "x": 5e-1}"#).unwrap());
        assert_eq!(a, fp(&json, r#"{"x":0.50,"n":2E0}"#).unwrap());
        assert_eq!(
            fp(&json, "100000000000000000").unwrap(),
            fp(&json, "1e17").unwrap()
        );
        assert_eq!(fp(&json, "-0.0").unwrap(), fp(&json, "0").unwrap());
        assert_ne!(a, fp(&json, r#"{"n": 3, "x": 0.5}"#).unwrap());
    }

    #[test]
    fn array_order_and_types_matter() {
        let json = JsonFingerprinter::new("v1");
        assert_ne!(fp(&json, "[1,2]").unwrap(), fp(&json, "[2,1]").unwrap());
        assert_ne!(
            fp(&json, r#"{"a":"1"}"#).unwrap(),
            fp(&json, r#"{"a":1}"#).unwrap()
        );
        assert_ne!(
            fp(&json, r#"{"a":null}"#).unwrap(),
            fp(&json, "{}").unwrap()
        );
        // Length prefixes keep concatenations apart.
        assert_ne!(
            fp(&json, r#"{"ab":"c"}"#).unwrap(),
            fp(&json, r#"{"a":"bc"}"#).unwrap()
        );
    }

    #[test]
    fn version_is_mixed_in() {
        let body = r#"{"a":1}"#;
        assert_ne!(
            fp(&JsonFingerprinter::new("v1"), body).unwrap(),
            fp(&JsonFingerprinter::new("v2"), body).unwrap()
        );
    }

    #[test]
    fn invalid_json_is_a_validation_problem() {
        let problem = fp(&JsonFingerprinter::new("v1"), "{nope").unwrap_err();
        assert_eq!(problem.status(), StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(problem.code(), codes::VALIDATION_FAILED);
    }

    #[derive(serde::Deserialize, Serialize)]
    struct Item {
        sku: String,
        #[serde(default = "one")]
        quantity: u32,
    }
    fn one() -> u32 {
        1
    }

    #[test]
    fn typed_reports_the_failing_field_path() {
        let typed = TypedFingerprinter::<Vec<Item>>::new("v1");
        let (mut parts, _) = http::Request::new(()).into_parts();
        let problem = typed
            .fingerprint(
                &mut parts,
                &Bytes::from_static(br#"[{"sku":"a"},{"sku":"b","quantity":-1}]"#),
            )
            .unwrap_err();
        let json = problem.to_json();
        assert_eq!(json["errors"][0]["field"], "[1].quantity");
        assert!(parts.extensions.get::<Validated<Vec<Item>>>().is_none());
    }

    #[test]
    fn typed_applies_defaults_before_hashing() {
        let typed = TypedFingerprinter::<Item>::new("v1");
        let (mut parts, _) = http::Request::new(()).into_parts();
        let a = typed
            .fingerprint(&mut parts, &Bytes::from_static(br#"{"sku":"a"}"#))
            .unwrap();
        let b = typed
            .fingerprint(
                &mut parts,
                &Bytes::from_static(br#"{"quantity":1,"sku":"a","extra":[1]}"#),
            )
            .unwrap();
        assert_eq!(a, b);
        assert!(typed
            .fingerprint(&mut parts, &Bytes::from_static(br#"{"sku":"a"} trailing"#))
            .is_err());
    }

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            "[a-z]{0,6}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::btree_map("[a-z]{1,3}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn pretty_and_compact_spellings_agree(value in arb_json()) {
            let json = JsonFingerprinter::new("v1");
            let compact = serde_json::to_string(&value).unwrap();
            let pretty = serde_json::to_string_pretty(&value).unwrap();
            prop_assert_eq!(fp(&json, &compact).unwrap(), fp(&json, &pretty).unwrap());
        }

        #[test]
        fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..256)) {
            let (mut parts, _) = http::Request::new(()).into_parts();
            let _ = JsonFingerprinter::new("v1").fingerprint(&mut parts, &Bytes::from(body));
        }
    }
}
