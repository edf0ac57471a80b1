//! [`TypedFingerprinter`]: a DTO-shaped fingerprint, with validation and the
//! [`Validated`] value it leaves for the handler.

use std::{fmt, marker::PhantomData, sync::Arc};

use bytes::Bytes;
use http::{request::Parts, StatusCode};
use serde::{de::DeserializeOwned, Serialize};
use serde_json::Value;

use super::{
    canonical_digest,
    strict::{arbitrary_precision, refuse_duplicate_members},
    Fingerprint, Fingerprinter,
};
use crate::problem::{codes, Problem};

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
pub(crate) fn validation_problem(errors: &[FieldError]) -> Problem {
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
/// request extensions as [`Validated<T>`]. The fingerprint hashes the values
/// the DTO holds, so numbers compare as the DTO's types read them.
///
/// A body with a duplicate member name anywhere (`{"to": "bob", "to":
/// "eve"}`, also in fields the DTO ignores) is refused with
/// `422 validation_failed`: parsers disagree on which one counts, so a
/// handler reading the body itself could see another request than the one
/// fingerprinted. Nesting deeper than 128 arrays or objects is refused the
/// same way, and so is a `u128` or `i128` value beyond the 64-bit range (the
/// fingerprint compares numbers as 64-bit integers or doubles, as
/// [`JsonFingerprinter`](super::JsonFingerprinter) does): the error names the
/// field; send such values as strings.
///
/// ```
/// use serde::{Deserialize, Serialize};
/// use tower_idempotency::{
///     fingerprint::{FieldError, Fingerprinter, TypedFingerprinter, Validated},
/// };
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
    /// The body decoded as `T` and encoded again: nothing else, unless a
    /// validator (which may read anything) is set.
    fn depends_on_body_only(&self) -> bool {
        self.validator.is_none()
    }

    fn fingerprint(&self, parts: &mut Parts, body: &Bytes) -> Result<Fingerprint, Problem> {
        let mut de = serde_json::Deserializer::from_slice(body);
        let dto: T = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let field = e.path().to_string();
            let field = if field == "." { String::new() } else { field };
            validation_problem(&[FieldError::new(field, e.inner().to_string())])
        })?;
        de.end()
            .map_err(|e| validation_problem(&[FieldError::new("", e.to_string())]))?;
        // Serde's derive refuses a repeated field of `T`, but not one it
        // ignores or one inside a map or `Value`: refuse them all, so a
        // handler reading the body itself cannot see another request.
        refuse_duplicate_members(body).map_err(|e| validation_problem(&[e]))?;
        if let Some(validator) = &self.validator {
            validator(&dto).map_err(|errors| validation_problem(&errors))?;
        }
        let wide = |field: String, why: &dyn fmt::Display| {
            validation_problem(&[FieldError::new(
                field,
                format!(
                    "the value cannot be fingerprinted ({why}): numbers are compared as \
                     64-bit integers or IEEE-754 doubles; send larger integers as strings"
                ),
            )])
        };
        // Paths cost a little per field, so the failing one is looked for
        // only once the value is known not to encode.
        let canonical =
            serde_json::to_value(&dto).map_err(|_| {
                match serde_path_to_error::serialize(&dto, serde_json::value::Serializer) {
                    Err(e) => {
                        let field = e.path().to_string();
                        let field = if field == "." { String::new() } else { field };
                        wide(field, e.inner())
                    }
                    Ok(_) => wide(String::new(), &"it does not encode as JSON"),
                }
            })?;
        // With serde_json's `arbitrary_precision` (turned on by any crate in
        // the build) a 128-bit integer serializes; refuse it all the same.
        if let Some(field) = arbitrary_precision()
            .then(|| wide_integer(&canonical))
            .flatten()
        {
            return Err(wide(field, &"number out of range"));
        }
        let fingerprint = canonical_digest(&self.version, &canonical);
        parts.extensions.insert(Validated::new(dto));
        Ok(fingerprint)
    }
}

/// Where `value` holds an integer beyond the 64-bit range (only serde_json
/// built with `arbitrary_precision` makes one), as `items[0].amount`.
fn wide_integer(value: &Value) -> Option<String> {
    match value {
        Value::Number(n) if !(n.is_i64() || n.is_u64() || n.is_f64()) => Some(String::new()),
        Value::Array(items) => items.iter().enumerate().find_map(|(i, item)| {
            wide_integer(item).map(|inner| format!("[{i}]{}", dotted(&inner)))
        }),
        Value::Object(members) => members.iter().find_map(|(name, member)| {
            wide_integer(member).map(|inner| format!("{name}{}", dotted(&inner)))
        }),
        _ => None,
    }
}

/// `inner` as the rest of a path: `.b`, `[0]`, or nothing.
fn dotted(inner: &str) -> String {
    if inner.is_empty() || inner.starts_with('[') {
        inner.to_owned()
    } else {
        format!(".{inner}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
