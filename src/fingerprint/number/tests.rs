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
