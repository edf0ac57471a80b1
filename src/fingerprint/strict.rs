//! Strict JSON reading for the fingerprinters: one meaning per body.
//!
//! A body the fingerprint and a handler could read differently is refused
//! before it claims its key, with `422 validation_failed`:
//!
//! - **Duplicate member names** (`{"amount": 1, "amount": 1000}`, at any
//!   depth, also when spelled with escapes such as `"\u0061mount"`):
//!   `serde_json::Value` keeps the last, serde's derive refuses the field,
//!   other parsers keep the first. No reading is right, so none is chosen.
//! - **Numbers the fingerprint cannot hold exactly** ([`JsonFingerprinter`]
//!   only): see [`refuse_inexact_numbers`].
//!
//! Nesting deeper than serde_json's limit (128 arrays or objects) is refused
//! by the parser itself, before anything recursive here runs.
//!
//! [`JsonFingerprinter`]: super::JsonFingerprinter

use std::{borrow::Cow, collections::HashSet, fmt};

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{map::Entry, Map, Number, Value};

use super::FieldError;

/// Parses `body` as one JSON value, refusing duplicate member names anywhere.
pub(crate) fn parse_value(body: &[u8]) -> Result<Value, FieldError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    match serde::Deserialize::deserialize(&mut de)
        .and_then(|Strict(value)| de.end().map(|()| value))
    {
        Ok(value) => Ok(value),
        Err(e) => Err(locate::<Strict>(body, e)),
    }
}

/// Refuses a body with a duplicate member name anywhere, building nothing.
/// `body` is already known to be one valid JSON value.
pub(crate) fn refuse_duplicate_members(body: &[u8]) -> Result<(), FieldError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    <Scan as serde::Deserialize>::deserialize(&mut de)
        .map(drop)
        .map_err(|e| locate::<Scan>(body, e))
}

/// Where reading `body` as `T` failed with `error`. Paths cost an
/// allocation per member, so they are tracked only on this second reading,
/// for a body already refused.
fn locate<T: serde::de::DeserializeOwned>(body: &[u8], error: serde_json::Error) -> FieldError {
    let mut de = serde_json::Deserializer::from_slice(body);
    match serde_path_to_error::deserialize::<_, T>(&mut de) {
        Err(e) => path_error(e),
        // Trailing characters: the value itself was read.
        Ok(_) => FieldError::new("", error.to_string()),
    }
}

/// The failing field as `items[0].sku`: empty for the whole body, and where
/// serde_path_to_error lost track (`?`).
fn path_error(e: serde_path_to_error::Error<serde_json::Error>) -> FieldError {
    let field = e.path().to_string();
    let field = if field == "." || field == "?" {
        String::new()
    } else {
        field
    };
    FieldError::new(field, e.inner().to_string())
}

fn duplicate<E: serde::de::Error>(name: &str) -> E {
    // The name is the client's own text: bounded, so an error stays small.
    let shown: String = name.chars().take(64).collect();
    let more = if shown.len() < name.len() { "…" } else { "" };
    E::custom(format!(
        "duplicate member name `{shown}{more}`: a member may appear once per object"
    ))
}

/// A JSON value read with [`StrictVisitor`].
struct Strict(Value);

impl<'de> serde::Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(StrictVisitor).map(Strict)
    }
}

/// Builds a `serde_json::Value` as its own visitor does, but refuses a
/// member name seen before in the same object.
struct StrictVisitor;

impl<'de> Visitor<'de> for StrictVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Value, E> {
        // serde_json never reads a non-finite number; refuse rather than
        // turn one into null.
        Number::from_f64(v)
            .map(Value::Number)
            .ok_or_else(|| E::custom("number out of range"))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(Strict(item)) = seq.next_element()? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut members = Map::new();
        while let Some(name) = map.next_key::<String>()? {
            let Strict(value) = map.next_value()?;
            match members.entry(name) {
                Entry::Vacant(vacant) => {
                    vacant.insert(value);
                }
                Entry::Occupied(occupied) => return Err(duplicate(occupied.key())),
            }
        }
        Ok(Value::Object(members))
    }
}

/// Walks a JSON value without keeping it, refusing duplicate member names.
struct Scan;

impl<'de> serde::Deserialize<'de> for Scan {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ScanVisitor).map(|()| Scan)
    }
}

struct ScanVisitor;

impl<'de> Visitor<'de> for ScanVisitor {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }

    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }

    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element::<Scan>()?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        // Names borrowed from the body where they have no escapes; a short
        // list for small objects, a hash set past it, so an object with many
        // members costs linear time, not quadratic.
        let mut few: Vec<Cow<'de, str>> = Vec::new();
        let mut many: Option<HashSet<Cow<'de, str>>> = None;
        while let Some(Name(name)) = map.next_key()? {
            let repeated = match &many {
                Some(set) => set.contains(&name),
                None => few.contains(&name),
            };
            if repeated {
                return Err(duplicate(&name));
            }
            match &mut many {
                Some(set) => {
                    set.insert(name);
                }
                None if few.len() < 16 => few.push(name),
                None => {
                    let mut set: HashSet<_> = few.drain(..).collect();
                    set.insert(name);
                    many = Some(set);
                }
            }
            map.next_value_seed(IgnoreScan)?;
        }
        Ok(())
    }
}

/// A member name, borrowed from the body unless it has escapes.
struct Name<'de>(Cow<'de, str>);

impl<'de> serde::Deserialize<'de> for Name<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_str(NameVisitor)
    }
}

struct NameVisitor;

impl<'de> Visitor<'de> for NameVisitor {
    type Value = Name<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a member name")
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Name<'de>, E> {
        Ok(Name(Cow::Borrowed(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<Name<'de>, E> {
        Ok(Name(Cow::Owned(v.to_owned())))
    }
}

/// Scans a member's value (a seed, so the map's value stays unread by type).
struct IgnoreScan;

impl<'de> DeserializeSeed<'de> for IgnoreScan {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(ScanVisitor)
    }
}

/// Refuses a number whose value the fingerprint does not encode exactly.
///
/// Fingerprints compare numbers as `serde_json` reads them: integers of the
/// 64-bit range exactly, every other number as an IEEE-754 double, encoded
/// as the exact integer when it is integral (below 2^127) and as the shortest
/// decimal that identifies the double otherwise. A number written with any
/// other value (`18446744073709551617`, `1e23`, `0.10000000000000001`,
/// `1e-400`) would share its fingerprint with a different number that a
/// precise reader (`u128`, a decimal type) tells apart, so it is refused:
/// send such values as strings. Equal values in any spelling (`2`, `2.0`,
/// `20e-1`) are accepted and agree.
///
/// `body` is already known to be one valid JSON value.
pub(crate) fn refuse_inexact_numbers(body: &[u8]) -> Result<(), FieldError> {
    for token in number_tokens(body) {
        let token = std::str::from_utf8(token).unwrap_or_default();
        if !is_exact(token) {
            let shown: String = token.chars().take(64).collect();
            return Err(FieldError::new(
                "",
                format!(
                    "the number {shown} cannot be compared exactly \
                     (it is not the value a 64-bit integer or an IEEE-754 double holds); \
                     send it as a string"
                ),
            ));
        }
    }
    Ok(())
}

/// The number tokens of a valid JSON text, in order.
fn number_tokens(body: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut at = 0;
    std::iter::from_fn(move || {
        while at < body.len() {
            match body[at] {
                b'"' => {
                    at += 1;
                    while at < body.len() {
                        match body[at] {
                            b'\\' => at += 2,
                            b'"' => {
                                at += 1;
                                break;
                            }
                            _ => at += 1,
                        }
                    }
                }
                b'-' | b'0'..=b'9' => {
                    let start = at;
                    while at < body.len()
                        && matches!(body[at], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')
                    {
                        at += 1;
                    }
                    return Some(&body[start..at]);
                }
                _ => at += 1,
            }
        }
        None
    })
}

/// Whether the value `token` spells is the value its fingerprint encodes.
fn is_exact(token: &str) -> bool {
    // Most numbers are short integers: exact without another reading.
    let digits = token.strip_prefix('-').unwrap_or(token);
    if digits.len() <= 18 && digits.bytes().all(|b| b.is_ascii_digit()) {
        return true;
    }
    let Ok(number) = serde_json::from_str::<Number>(token) else {
        return false;
    };
    if number.is_i64() || number.is_u64() {
        return true;
    }
    let encoded = match encode(&number) {
        Encoded::Printed(text) => Decimal::parse(&text),
        Encoded::Shortest(decimal) => Some(decimal),
    };
    matches!((Decimal::parse(token), encoded), (Some(written), Some(encoded)) if written == encoded)
}

/// A decimal number's exact value: sign, significant digits (no leading or
/// trailing zeros) and the power of ten of the last digit. Zero has no sign.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Decimal {
    negative: bool,
    digits: String,
    exponent: i64,
}

impl Decimal {
    /// Reads a JSON number (or a Rust `{:e}` float) exactly; `None` if it is
    /// neither.
    pub(crate) fn parse(text: &str) -> Option<Decimal> {
        let (negative, rest) = match text.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        let (mantissa, exponent) = match rest.find(['e', 'E']) {
            Some(at) => (&rest[..at], Some(&rest[at + 1..])),
            None => (rest, None),
        };
        let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
        if int.is_empty() || !int.bytes().chain(frac.bytes()).all(|b| b.is_ascii_digit()) {
            return None;
        }
        // Exponents beyond ±10^15 saturate: no double is near them, and a
        // non-zero digit string still compares unequal.
        let mut exponent: i64 = match exponent {
            None => 0,
            Some(e) => {
                let (sign, digits) = match e.as_bytes().first() {
                    Some(b'-') => (-1, &e[1..]),
                    Some(b'+') => (1, &e[1..]),
                    _ => (1, e),
                };
                if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                let magnitude = digits.bytes().fold(0_i64, |acc, b| {
                    acc.saturating_mul(10)
                        .saturating_add(i64::from(b - b'0'))
                        .min(1_000_000_000_000_000)
                });
                sign * magnitude
            }
        };
        exponent -= i64::try_from(frac.len()).ok()?;
        let all: String = int.chars().chain(frac.chars()).collect();
        let significant = all.trim_start_matches('0');
        let trimmed = significant.trim_end_matches('0');
        if trimmed.is_empty() {
            return Some(Decimal {
                negative: false,
                digits: String::new(),
                exponent: 0,
            });
        }
        exponent += i64::try_from(significant.len() - trimmed.len()).ok()?;
        Some(Decimal {
            negative,
            digits: trimmed.to_owned(),
            exponent,
        })
    }

    /// The `{:e}` layout of a non-zero value: `-1.25e-7`, `3e20`.
    fn scientific(&self) -> String {
        let (first, rest) = self.digits.split_at(self.digits.len().min(1));
        let sign = if self.negative { "-" } else { "" };
        let point = if rest.is_empty() { "" } else { "." };
        let exponent = self.exponent + self.digits.len() as i64 - 1;
        format!("{sign}{first}{point}{rest}e{exponent}")
    }
}

/// Numbers compare by value: integers print as integers, and a float with
/// no fractional part prints as the integer it exactly is, so `2`, `2.0` and
/// `2e0` (or `100000000000000000` and `1e17`) agree. Other floats print as
/// the shortest decimal of their double in `{:e}` layout. Where two shortest
/// decimals lie equally near the double (`581340081208420.25` between `…0.2`
/// and `…0.3`), it is the even one, which serde_json and JavaScript write.
/// A written number whose value is not the one printed here is refused
/// before hashing ([`refuse_inexact_numbers`]), so no two different values
/// collide.
pub(super) fn canonical_number(n: &serde_json::Number) -> String {
    match encode(n) {
        Encoded::Printed(text) => text,
        Encoded::Shortest(decimal) => decimal.scientific(),
    }
}

/// What a number's fingerprint encodes, before it is printed.
enum Encoded {
    /// An integer, printed.
    Printed(String),
    /// A double's shortest decimal, laid out as `{:e}` when printed.
    Shortest(Decimal),
}

fn encode(n: &serde_json::Number) -> Encoded {
    if let Some(i) = n.as_i64() {
        return Encoded::Printed(i.to_string());
    }
    if let Some(u) = n.as_u64() {
        return Encoded::Printed(u.to_string());
    }
    let f = n.as_f64().unwrap_or(f64::NAN);
    // Every integral double below 2^127 converts to i128 exactly.
    const I128_SAFE: f64 = 1.7014118346046923e38;
    if f.fract() == 0.0 && f.abs() < I128_SAFE {
        return Encoded::Printed((f as i128).to_string());
    }
    // serde_json prints a float's shortest decimal, ties to even; std's
    // `{:e}` would round a tie up, and refuse what clients send.
    match Decimal::parse(&n.to_string()) {
        Some(shortest) => Encoded::Shortest(shortest),
        None => Encoded::Printed(format!("{f:e}")),
    }
}

#[cfg(test)]
mod tests;
