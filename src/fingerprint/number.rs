//! Numbers in fingerprints: the value each one stands for, written the same
//! way whatever its spelling, and the refusal of a number whose written value
//! is not the one encoded.

use serde_json::Number;

use super::FieldError;

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

/// The digits of an integer that fits 64 bits, written into `buffer`:
/// what [`canonical_number`] prints for it, without allocating. `None` for
/// every other number.
pub(super) fn integer_digits<'b>(
    n: &serde_json::Number,
    buffer: &'b mut itoa::Buffer,
) -> Option<&'b str> {
    if let Some(i) = n.as_i64() {
        return Some(buffer.format(i));
    }
    n.as_u64().map(|u| buffer.format(u))
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
    // serde_json prints a double it holds as its shortest decimal, ties to
    // even; std's `{:e}` would round a tie up, and refuse what clients send.
    // The number is made again from the double, because a `Number` that
    // keeps its written text (serde_json's `arbitrary_precision`) prints that.
    match Number::from_f64(f).and_then(|double| Decimal::parse(&double.to_string())) {
        Some(shortest) => Encoded::Shortest(shortest),
        None => Encoded::Printed(format!("{f:e}")),
    }
}

#[cfg(test)]
mod tests;
