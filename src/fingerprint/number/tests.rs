use super::*;

#[test]
fn decimals_compare_by_value() {
    let d = |s| Decimal::parse(s).unwrap();
    assert_eq!(d("2"), d("2.0"));
    assert_eq!(d("2"), d("20e-1"));
    assert_eq!(d("2"), d("0.2E+1"));
    assert_eq!(d("-0"), d("0.000e5"));
    assert_ne!(d("2"), d("-2"));
    assert_ne!(d("1e-400"), d("0"));
    assert_eq!(Decimal::parse("1e"), None);
    assert_eq!(Decimal::parse(".5"), None);
}

#[test]
fn number_tokens_skip_strings() {
    let body = br#"{"a\"1": [1, -2.5e3], "b": "3", "c": 0}"#;
    let tokens: Vec<_> = number_tokens(body).collect();
    assert_eq!(tokens, [&b"1"[..], b"-2.5e3", b"0"]);
}

proptest::proptest! {
    /// The digits written on the stack are what the canonical encoding
    /// printed for every integer of 64 bits.
    #[test]
    fn integer_digits_are_the_printed_integer(i: i64, u: u64) {
        for n in [serde_json::Number::from(i), serde_json::Number::from(u)] {
            let mut buffer = itoa::Buffer::new();
            let digits = integer_digits(&n, &mut buffer).expect("an integer of 64 bits");
            proptest::prop_assert_eq!(digits, canonical_number(&n));
        }
    }
}

#[test]
fn integer_digits_at_the_limits() {
    for (n, text) in [
        (serde_json::Number::from(0), "0"),
        (serde_json::Number::from(-1), "-1"),
        (serde_json::Number::from(i64::MIN), "-9223372036854775808"),
        (serde_json::Number::from(i64::MAX), "9223372036854775807"),
        (serde_json::Number::from(u64::MAX), "18446744073709551615"),
    ] {
        assert_eq!(integer_digits(&n, &mut itoa::Buffer::new()), Some(text));
    }
    // A double is not an integer here, even an integral one: it keeps its
    // own printing.
    let two = serde_json::Number::from_f64(2.0).unwrap();
    assert_eq!(integer_digits(&two, &mut itoa::Buffer::new()), None);
}
