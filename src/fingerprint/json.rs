//! [`JsonFingerprinter`] and the canonical JSON encoding it hashes.

use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;
use serde_json::Value;

use super::{
    number::{canonical_number, integer_digits, refuse_inexact_numbers},
    strict::parse_value,
    validation_problem, Fingerprint, Fingerprinter,
};
use crate::problem::Problem;

/// Fingerprints any JSON body by its canonical form.
///
/// Object key order, white space and number spelling (`1`, `1.0`, `1e0`) make
/// no difference; array order does. Top-level fields named with
/// [`ignore_field`](Self::ignore_field) (tracing ids, client timestamps),
/// and nested ones named by a dotted path with
/// [`ignore_path`](Self::ignore_path) (`meta.trace_id`), are dropped before
/// hashing.
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
    /// Each a path of member names from the top-level object.
    ignored: Arc<[Vec<String>]>,
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
    /// The name is taken whole: `"a.b"` is the member named `a.b`.
    pub fn ignore_field(self, name: impl Into<String>) -> Self {
        self.ignore(vec![name.into()])
    }

    /// Drops a nested field that is not part of the business request,
    /// named by the member names that lead to it from the top-level
    /// object, joined with `.`: `"meta.trace_id"` drops `trace_id` inside
    /// the object `meta`, and nothing else changes.
    ///
    /// Only objects are walked. A path that meets anything else before its
    /// last name (an array, a string, a missing member) drops nothing: no
    /// member inside an array can be ignored, and `*` or a number is a
    /// member name like any other (`"items.0"` is the member `0` of the
    /// object `items`). A path cannot name a member whose name holds a
    /// `.`; [`ignore_field`](Self::ignore_field) names a top-level one.
    ///
    /// ```
    /// use tower_idempotency::fingerprint::{Fingerprinter, JsonFingerprinter};
    ///
    /// let fp = JsonFingerprinter::new("orders.v1").ignore_path("meta.trace.id");
    /// let (mut parts, _) = http::Request::new(()).into_parts();
    /// let mut fingerprint = |body: &'static str| fp.fingerprint(&mut parts, &body.into()).unwrap();
    /// let a = fingerprint(r#"{"sku": "A", "meta": {"trace": {"id": "t1", "span": 1}}}"#);
    /// let b = fingerprint(r#"{"sku": "A", "meta": {"trace": {"id": "t2", "span": 1}}}"#);
    /// assert_eq!(a, b);
    /// let other_span = fingerprint(r#"{"sku": "A", "meta": {"trace": {"id": "t1", "span": 2}}}"#);
    /// assert_ne!(a, other_span);
    /// ```
    pub fn ignore_path(self, path: &str) -> Self {
        self.ignore(path.split('.').map(str::to_owned).collect())
    }

    fn ignore(mut self, path: Vec<String>) -> Self {
        let mut ignored = self.ignored.to_vec();
        ignored.push(path);
        self.ignored = ignored.into();
        self
    }
}

/// Removes the member at `path` (member names from `value`), if every
/// name before the last leads into an object.
fn remove_path(value: &mut Value, path: &[String]) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let mut current = value;
    for name in parents {
        match current {
            Value::Object(map) => match map.get_mut(name) {
                Some(inner) => current = inner,
                None => return,
            },
            _ => return,
        }
    }
    if let Value::Object(map) = current {
        map.remove(last);
    }
}

impl Fingerprinter for JsonFingerprinter {
    fn fingerprint(&self, _parts: &mut Parts, body: &Bytes) -> Result<Fingerprint, Problem> {
        let mut value = parse_value(body).map_err(|e| validation_problem(&[e]))?;
        refuse_inexact_numbers(body).map_err(|e| validation_problem(&[e]))?;
        for path in self.ignored.iter() {
            remove_path(&mut value, path);
        }
        Ok(canonical_digest(&self.version, &value))
    }

    /// The canonical form of the body, and nothing else.
    fn depends_on_body_only(&self) -> bool {
        true
    }
}

/// A deterministic, unambiguous byte encoding of a JSON value: objects by
/// sorted key, numbers by value, strings length-prefixed.
pub(crate) fn canonical_json(value: &Value) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    encode(value, &mut out);
    out
}

/// The fingerprint of `value` under `version`: [`Fingerprint::digest`] of
/// its [`canonical_json`], with the encoding fed to the hash as it is made
/// instead of gathered in a buffer first (the same bytes, so the same
/// digest).
pub(crate) fn canonical_digest(version: &str, value: &Value) -> Fingerprint {
    let mut hasher = Fingerprint::hasher(version);
    encode(value, &mut hasher);
    Fingerprint::finish(hasher)
}

/// Where the canonical encoding goes: a buffer, or a hash.
pub(crate) trait Out {
    fn put(&mut self, bytes: &[u8]);
}

impl Out for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

impl Out for sha2::Sha256 {
    fn put(&mut self, bytes: &[u8]) {
        sha2::Digest::update(self, bytes);
    }
}

fn encode(value: &Value, out: &mut impl Out) {
    match value {
        Value::Null => out.put(b"n"),
        Value::Bool(true) => out.put(b"t"),
        Value::Bool(false) => out.put(b"f"),
        Value::Number(n) => {
            out.put(b"#");
            match integer_digits(n, &mut itoa::Buffer::new()) {
                Some(digits) => out.put(digits.as_bytes()),
                None => out.put(canonical_number(n).as_bytes()),
            }
            out.put(b";");
        }
        Value::String(s) => encode_str(s, out),
        Value::Array(items) => {
            out.put(b"[");
            items.iter().for_each(|item| encode(item, out));
            out.put(b"]");
        }
        Value::Object(map) => {
            out.put(b"{");
            // serde_json keeps members sorted by name, unless a crate in the
            // build turned on its `preserve_order` (then in the body's order):
            // sorted already, encoded as they are; else sorted here.
            if map.keys().is_sorted() {
                for (key, item) in map {
                    encode_str(key, out);
                    encode(item, out);
                }
            } else {
                let mut entries: Vec<_> = map.iter().collect();
                entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
                for (key, item) in entries {
                    encode_str(key, out);
                    encode(item, out);
                }
            }
            out.put(b"}");
        }
    }
}

fn encode_str(s: &str, out: &mut impl Out) {
    out.put(b"s");
    out.put(&(s.len() as u64).to_be_bytes());
    out.put(s.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::super::hostile_tests::arb_json;
    use super::*;
    use crate::problem::codes;
    use http::StatusCode;
    use proptest::prelude::*;

    proptest! {
        /// The digest fed as the encoding is made is the digest of the
        /// encoding gathered first: the same bytes, whatever the value.
        #[test]
        fn the_streamed_digest_is_the_digest_of_the_canonical_bytes(value in arb_json(), version in "[a-z0-9.]{0,12}") {
            prop_assert_eq!(
                canonical_digest(&version, &value),
                Fingerprint::digest(&version, &canonical_json(&value))
            );
        }
    }

    /// Today's bytes, pinned: a change of the encoding would change every
    /// stored fingerprint, and a retry across an upgrade would be refused.
    #[test]
    fn the_canonical_bytes_are_pinned() {
        let value: Value =
            serde_json::from_str(r#"{"b":[1,2.5,null,true],"a":{"z":"x","y":false}}"#).unwrap();
        let mut expected = Vec::new();
        expected.extend_from_slice(b"{");
        expected.extend_from_slice(b"s");
        expected.extend_from_slice(&1u64.to_be_bytes());
        expected.extend_from_slice(b"a{s");
        expected.extend_from_slice(&1u64.to_be_bytes());
        expected.extend_from_slice(b"yfs");
        expected.extend_from_slice(&1u64.to_be_bytes());
        expected.extend_from_slice(b"zs");
        expected.extend_from_slice(&1u64.to_be_bytes());
        expected.extend_from_slice(b"x}s");
        expected.extend_from_slice(&1u64.to_be_bytes());
        expected.extend_from_slice(b"b[#1;#2.5e0;nt]}");
        assert_eq!(canonical_json(&value), expected);
    }

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

    #[test]
    fn ignored_paths_walk_objects_only() {
        let json = JsonFingerprinter::new("v1").ignore_path("a.b");
        let plain = JsonFingerprinter::new("v1");
        // Dropped inside the object `a`, and only there.
        assert_eq!(
            fp(&json, r#"{"a":{"b":1,"c":2},"b":3}"#).unwrap(),
            fp(&plain, r#"{"a":{"c":2},"b":3}"#).unwrap()
        );
        // Through an array, a string or a missing member: nothing dropped.
        for body in [
            r#"{"a":[{"b":1}]}"#,
            r#"{"a":"b"}"#,
            r#"{"x":{"b":1}}"#,
            r#"[{"a":{"b":1}}]"#,
        ] {
            assert_eq!(
                fp(&json, body).unwrap(),
                fp(&plain, body).unwrap(),
                "{body}"
            );
        }
        // A path names members, never array positions.
        let numbered = JsonFingerprinter::new("v1").ignore_path("a.0");
        assert_eq!(
            fp(&numbered, r#"{"a":{"0":1}}"#).unwrap(),
            fp(&plain, r#"{"a":{}}"#).unwrap()
        );
        assert_eq!(
            fp(&numbered, r#"{"a":[1]}"#).unwrap(),
            fp(&plain, r#"{"a":[1]}"#).unwrap()
        );
        // `ignore_field` takes its name whole.
        let dotted = JsonFingerprinter::new("v1").ignore_field("a.b");
        assert_eq!(
            fp(&dotted, r#"{"a.b":1,"a":{"b":1}}"#).unwrap(),
            fp(&plain, r#"{"a":{"b":1}}"#).unwrap()
        );
    }

    /// A path of one to three names from `[a-d]{1,2}`, the names
    /// `arb_json` gives object members.
    fn arb_path() -> impl Strategy<Value = Vec<String>> {
        proptest::collection::vec("[a-d]{1,2}", 1..4)
    }

    /// `value` with `leaf` at `path`, objects made or replaced on the way.
    fn set_path(value: &mut Value, path: &[String], leaf: Value) {
        let mut current = value;
        for name in path {
            if !current.is_object() {
                *current = Value::Object(serde_json::Map::new());
            }
            let Value::Object(map) = current else {
                unreachable!("made an object above")
            };
            current = map.entry(name.clone()).or_insert(Value::Null);
        }
        *current = leaf;
    }

    proptest! {
        /// Ignoring a path is removing that member and nothing else.
        #[test]
        fn ignoring_a_path_is_removing_only_that_member(value in arb_json(), path in arb_path()) {
            let body = serde_json::to_string(&value).unwrap();
            let mut removed = value.clone();
            remove_path(&mut removed, &path);
            let ignoring = JsonFingerprinter::new("v1").ignore_path(&path.join("."));
            let plain = JsonFingerprinter::new("v1");
            prop_assert_eq!(
                fp(&ignoring, &body).unwrap(),
                fp(&plain, &serde_json::to_string(&removed).unwrap()).unwrap()
            );
            // Only the member at the path went: it is all that differs.
            let mut restored = removed.clone();
            if let Some(member) = path.iter().try_fold(&value, |v, name| v.get(name)) {
                set_path(&mut restored, &path, member.clone());
            }
            prop_assert_eq!(restored, value);
        }

        /// Two bodies that differ only at the ignored path share a
        /// fingerprint; a difference elsewhere still tells them apart.
        #[test]
        fn bodies_differing_only_at_the_path_agree(
            value in arb_json(),
            path in arb_path(),
            a in arb_json(),
            b in arb_json(),
        ) {
            let mut first = value.clone();
            set_path(&mut first, &path, a);
            let mut second = first.clone();
            set_path(&mut second, &path, b);
            let ignoring = JsonFingerprinter::new("v1").ignore_path(&path.join("."));
            let fingerprint = |v: &Value| fp(&ignoring, &serde_json::to_string(v).unwrap()).unwrap();
            prop_assert_eq!(fingerprint(&first), fingerprint(&second));
            let mut elsewhere = second.clone();
            set_path(&mut elsewhere, &[format!("{}x", path[0])], Value::Bool(true));
            prop_assert_ne!(fingerprint(&first), fingerprint(&elsewhere));
        }

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
