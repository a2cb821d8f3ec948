//! What a JSON reader did to a payload's numbers, read from its text.
//!
//! outboxd reads payloads with `serde_json` as it comes (no arbitrary
//! precision): an integer that fits neither `i64` nor `u64` is read as the
//! nearest `f64`, and a fraction of more than 15 significant digits is
//! rounded. Once read, `1.2345678901234568e29` cannot tell whether the
//! writer wrote it so or wrote `123456789012345678901234567890`; the text
//! can. The schema formats ask here before they write a number whose type
//! would keep the rounded value:
//! * [`huge_integers`]: integers no 64-bit type holds. Written to a
//!   `double` or `float` they would arrive as another number.
//! * [`long_numbers`]: every number that was rounded when read (for
//!   `decimal`s, which must be exact).
//! * [`exact_in_f64`] / [`exact_in_f32`]: whether an integer that was read
//!   exactly stays exact in a floating-point type.
//!
//! A fraction written to `double` stays "the nearest double", as in every
//! JSON reader: only integers, which a writer means exactly, are refused.

use serde_json::Number;

/// The number tokens of JSON `text` outside strings, in order.
fn tokens(text: &str) -> impl Iterator<Item = &str> {
    let b = text.as_bytes();
    let (mut i, mut in_string) = (0, false);
    std::iter::from_fn(move || {
        while i < b.len() {
            let c = b[i];
            if in_string {
                match c {
                    b'\\' => i += 1,
                    b'"' => in_string = false,
                    _ => {}
                }
                i += 1;
                continue;
            }
            if c == b'"' {
                in_string = true;
                i += 1;
                continue;
            }
            if c.is_ascii_digit() || c == b'-' {
                let start = i;
                i += 1;
                while i < b.len()
                    && (b[i].is_ascii_digit() || matches!(b[i], b'.' | b'e' | b'E' | b'+' | b'-'))
                {
                    i += 1;
                }
                return Some(&text[start..i]);
            }
            i += 1;
        }
        None
    })
}

/// The values (as read: the nearest `f64`) of the integer literals of
/// `text` that fit neither `i64` nor `u64`.
pub fn huge_integers(text: &str) -> Vec<f64> {
    tokens(text)
        .filter(|t| !t.contains(['.', 'e', 'E']))
        .filter(|t| t.parse::<i64>().is_err() && t.parse::<u64>().is_err())
        .filter_map(|t| t.parse::<f64>().ok())
        .collect()
}

/// Whether a number read as `x` may be one of `text`'s huge integers: a
/// whole number beyond `i64`'s range. Cheap, so that the text is scanned
/// only then.
pub fn may_be_huge(x: f64) -> bool {
    x.fract() == 0.0 && x.abs() >= 9.2e18
}

/// A payload's [`huge_integers`], read from its text the first time a
/// number may be one (most payloads never pay for the scan).
#[derive(Debug)]
pub struct Huge<'a> {
    text: &'a str,
    found: Option<Vec<f64>>,
}

impl<'a> Huge<'a> {
    pub fn new(text: &'a str) -> Self {
        Huge { text, found: None }
    }

    /// Whether `x` (a number read as a float) was an integer beyond 64
    /// bits in the text.
    pub fn holds(&mut self, x: f64) -> bool {
        if !may_be_huge(x) {
            return false;
        }
        let text = self.text;
        self.found.get_or_insert_with(|| huge_integers(text)).contains(&x)
    }

    /// [`Huge::holds`] for a JSON number (only one read as a float can be).
    pub fn holds_number(&mut self, n: &Number) -> bool {
        n.is_f64() && n.as_f64().is_some_and(|x| self.holds(x))
    }
}

/// The numbers of `text` that were rounded when read, as the values they
/// were read as: a fraction or exponent of more than 15 significant digits
/// (trailing zeros of a fraction do not count), or an integer of more than
/// 19.
pub fn long_numbers(text: &str) -> Vec<f64> {
    tokens(text)
        .filter(|token| {
            let mantissa = token.split(['e', 'E']).next().unwrap_or("");
            let fraction = mantissa.contains('.');
            let exponent = mantissa.len() < token.len();
            let mut digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
            if fraction {
                digits = digits.trim_end_matches('0').to_owned();
            }
            let significant = digits.trim_start_matches('0').len();
            ((fraction || exponent) && significant > 15) || significant > 19
        })
        .filter_map(|t| t.parse::<f64>().ok())
        .collect()
}

/// The integer `n` holds, if it was read as one.
fn integer(n: &Number) -> Option<i128> {
    n.as_i64().map(i128::from).or_else(|| n.as_u64().map(i128::from))
}

/// Whether `n`, when read as an integer, is exactly a `double` (a
/// fraction counts as exact: it is already the nearest double).
pub fn exact_in_f64(n: &Number) -> bool {
    integer(n).is_none_or(|i| i as f64 as i128 == i)
}

/// Whether `n`, when read as an integer, is exactly a `float`.
pub fn exact_in_f32(n: &Number) -> bool {
    integer(n).is_none_or(|i| i as f32 as i128 == i)
}

/// Why an integer cannot be written to a floating-point type of `bits`.
pub fn inexact_reason(n: &Number, bits: u8) -> String {
    format!(
        "{n} is an integer a {bits}-bit floating-point number cannot hold exactly (it would arrive as {}): use a long, or write it as a string",
        if bits == 32 {
            n.as_f64().map(|x| (x as f32).to_string()).unwrap_or_default()
        } else {
            n.as_f64().map(|x| x.to_string()).unwrap_or_default()
        }
    )
}

/// Why a huge integer cannot be written to any number type.
pub const HUGE_REASON: &str =
    "an integer beyond 64 bits, which a JSON reader rounds: no Avro or Protobuf number type holds it exactly; write it as a string (or a decimal as a string)";

#[cfg(test)]
mod tests {
    use super::*;

    fn number(text: &str) -> Number {
        serde_json::from_str(text).unwrap()
    }

    #[test]
    fn finds_integers_beyond_64_bits_only() {
        let text = r#"{"a": 123456789012345678901234567890, "b": -99999999999999999999, "c": 18446744073709551615,
                      "d": -9223372036854775808, "e": 1e30, "f": 1.5, "s": "123456789012345678901234567890"}"#;
        let huge = huge_integers(text);
        assert_eq!(huge, vec![1.2345678901234568e29, -1e20]);
        assert!(huge.iter().all(|x| may_be_huge(*x)));
        assert!(!may_be_huge(1.5) && !may_be_huge(4096.0));
        let mut lazy = Huge::new(text);
        assert!(lazy.holds(-1e20) && !lazy.holds(1e30) && !lazy.holds(2.0));
        assert!(lazy.holds_number(&number("123456789012345678901234567890")));
        assert!(!lazy.holds_number(&number("18446744073709551615")));
    }

    #[test]
    fn long_numbers_are_the_rounded_ones() {
        assert_eq!(long_numbers(r#"{"a": 0.10000000000000000555}"#), vec![0.1]);
        assert!(long_numbers(
            r#"{"a": "1234567890123456789", "b": 0.000001, "c": 9223372036854775807, "d": 1.0000000000000000}"#
        )
        .is_empty());
        assert_eq!(long_numbers(r#"{"c": -123456789012345678901}"#).len(), 1);
        assert_eq!(
            long_numbers(r#"{"s": "x\"1.23456789012345678", "e": 1.2345678901234567e3}"#).len(),
            1
        );
    }

    #[test]
    fn integers_exact_in_floating_point() {
        assert!(exact_in_f64(&number("9007199254740992")));
        assert!(!exact_in_f64(&number("9007199254740993")));
        assert!(!exact_in_f64(&number("18446744073709551615")));
        assert!(!exact_in_f64(&number("-9223372036854775807")));
        assert!(exact_in_f64(&number("-9223372036854775808")));
        assert!(exact_in_f64(&number("0.1")));
        assert!(exact_in_f32(&number("16777216")));
        assert!(!exact_in_f32(&number("16777217")));
        assert!(inexact_reason(&number("16777217"), 32).contains("16777216"));
    }
}
