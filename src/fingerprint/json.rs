//! [`JsonFingerprinter`] and the canonical JSON encoding it hashes.

use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;
use serde_json::Value;

use super::{
    number::{canonical_number, refuse_inexact_numbers},
    strict::parse_value,
    validation_problem, Fingerprint, Fingerprinter,
};
use crate::problem::Problem;

/// Fingerprints any JSON body by its canonical form.
///
/// Object key order, white space and number spelling (`1`, `1.0`, `1e0`) make
/// no difference; array order does. Top-level fields named with
/// [`ignore_field`](Self::ignore_field) (tracing ids, client timestamps) are
/// dropped before hashing.
///
/// Answered with `422 validation_failed`, never claiming the key:
///
/// - a body that is not one JSON value (including bytes that are not UTF-8,
///   and nesting deeper than 128 arrays or objects);
/// - a **duplicate member name** in any object (`{"a": 1, "a": 2}`): parsers
///   disagree on which one counts, so the fingerprint and a handler could
///   read two requests into one;
/// - a **number the fingerprint cannot compare exactly**. Numbers are
///   compared by value: integers of the 64-bit range exactly; any other
///   number as an IEEE-754 double, which is compared as the exact integer
///   when it is integral and as its shortest decimal otherwise (of two
///   equally near, the even one, as serde_json and JavaScript write it). A number
///   written with another value than the one so compared
///   (`18446744073709551617`, `1e23`, `0.10000000000000001`, `1e-400`) would
///   share a fingerprint with a different number, so it is refused; send
///   such values as strings.
///
/// So two accepted bodies share a fingerprint exactly when they hold the same
/// members with the same values (`-0` and `0` being the same value).
///
/// ```
/// use tower_idempotency::{fingerprint::{Fingerprinter, JsonFingerprinter}};
///
/// let fp = JsonFingerprinter::new("orders.v1").ignore_field("trace_id");
/// let (mut parts, _) = http::Request::new(()).into_parts();
/// let a = fp.fingerprint(&mut parts, &r#"{"a": 1, "b": [1, 2], "trace_id": "x"}"#.into()).unwrap();
/// let b = fp.fingerprint(&mut parts, &r#"{"b":[1,2.0],"a":1}"#.into()).unwrap();
/// assert_eq!(a, b);
/// let twice = fp.fingerprint(&mut parts, &r#"{"a": 1, "a": 2}"#.into()).unwrap_err();
/// assert_eq!(twice.code(), "validation_failed");
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
        let mut value = parse_value(body).map_err(|e| validation_problem(&[e]))?;
        refuse_inexact_numbers(body).map_err(|e| validation_problem(&[e]))?;
        if let Value::Object(map) = &mut value {
            for name in self.ignored.iter() {
                map.remove(name);
            }
        }
        Ok(Fingerprint::digest(&self.version, &canonical_json(&value)))
    }
}

/// A deterministic, unambiguous byte encoding of a JSON value: objects by
/// sorted key, numbers by value, strings length-prefixed.
pub(crate) fn canonical_json(value: &Value) -> Vec<u8> {
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

#[cfg(test)]
mod tests {
    use super::super::hostile_tests::arb_json;
    use super::*;
    use crate::problem::codes;
    use http::StatusCode;
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
