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
//!   only): see [`refuse_inexact_numbers`](super::number::refuse_inexact_numbers).
//!
//! Nesting deeper than serde_json's limit (128 arrays or objects) is refused
//! by the parser itself, before anything recursive here runs.
//!
//! [`JsonFingerprinter`]: super::JsonFingerprinter

use std::{borrow::Cow, collections::HashSet, fmt, sync::OnceLock};

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

/// The member name under which serde_json, built with its
/// `arbitrary_precision` feature, hands a number to a visitor: a map of one
/// member whose value is the number's text. serde_json's own `Value` reads
/// such a map as that number; so does [`StrictVisitor`].
const NUMBER_TOKEN: &str = "$serde_json::private::Number";

/// Whether serde_json is built with `arbitrary_precision`: any crate in the
/// build can turn it on, and it changes how numbers reach a visitor (see
/// [`NUMBER_TOKEN`]) and how a `Number` prints, not which bodies are valid.
/// Without it a number keeps no spelling: `1e0` prints as `1.0` (and as
/// `1e+0` with it).
pub(crate) fn arbitrary_precision() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| serde_json::from_str::<Number>("1e0").is_ok_and(|n| n.to_string() != "1.0"))
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
            if members.is_empty() && name == NUMBER_TOKEN && arbitrary_precision() {
                // A number, as serde_json hands it over in that build.
                let text: String = map.next_value()?;
                return text
                    .parse::<Number>()
                    .map(Value::Number)
                    .map_err(serde::de::Error::custom);
            }
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
