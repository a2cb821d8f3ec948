//! PostgreSQL log sequence numbers.
//!
//! An LSN is a 64-bit byte position in the write-ahead log. PostgreSQL prints
//! it as two hexadecimal halves, `16/B374D848`; the ordering is the ordering
//! of the 64-bit integer, and the difference between two LSNs is a number of
//! WAL bytes (which is what "lag in bytes" means everywhere in outboxd).

use std::fmt;
use std::str::FromStr;

/// A position in the write-ahead log.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lsn(pub u64);

/// A row's place in the stream that a replay finds again: the commit LSN
/// of its transaction (the Begin's final LSN) and its index among that
/// transaction's outbox rows and messages. An insert's own LSN would not
/// do: COPY writes many rows in one WAL record, which all share it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RowPos {
    pub commit_lsn: Lsn,
    pub index: u32,
}

/// The text was not an LSN in `X/Y` notation.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid LSN {input:?}: expected two hexadecimal halves such as \"16/B374D848\"")]
pub struct ParseLsnError {
    input: String,
}

impl Lsn {
    /// `0/0`, which PostgreSQL uses for "no position" (`InvalidXLogRecPtr`).
    pub const ZERO: Lsn = Lsn(0);

    /// The number of WAL bytes from `earlier` to `self`; zero when `earlier` is ahead.
    pub fn bytes_since(self, earlier: Lsn) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

impl FromStr for Lsn {
    type Err = ParseLsnError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseLsnError { input: s.to_owned() };
        let (hi, lo) = s.split_once('/').ok_or_else(err)?;
        let valid = |half: &str| !half.is_empty() && half.len() <= 8;
        if !valid(hi) || !valid(lo) {
            return Err(err());
        }
        let hi = u32::from_str_radix(hi, 16).map_err(|_| err())?;
        let lo = u32::from_str_radix(lo, 16).map_err(|_| err())?;
        Ok(Lsn((u64::from(hi) << 32) | u64::from(lo)))
    }
}

impl From<u64> for Lsn {
    fn from(v: u64) -> Self {
        Lsn(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_and_prints_postgres_notation() {
        let lsn: Lsn = "16/B374D848".parse().unwrap();
        assert_eq!(lsn.0, 0x16_B374_D848);
        assert_eq!(lsn.to_string(), "16/B374D848");
        assert_eq!("0/0".parse::<Lsn>().unwrap(), Lsn::ZERO);
        assert_eq!(Lsn(0x1_0000_0000).to_string(), "1/0");
    }

    #[test]
    fn rejects_garbage() {
        for bad in [
            "",
            "16",
            "/1",
            "1/",
            "G/1",
            "1/2/3",
            "123456789/0",
            " 1/2",
            "-1/2",
        ] {
            assert!(bad.parse::<Lsn>().is_err(), "{bad:?} should not parse");
        }
    }

    #[test]
    fn orders_by_position_not_text() {
        let a: Lsn = "0/FFFFFFFF".parse().unwrap();
        let b: Lsn = "1/0".parse().unwrap();
        assert!(a < b);
        assert_eq!(b.bytes_since(a), 1);
        assert_eq!(a.bytes_since(b), 0);
    }

    proptest! {
        #[test]
        fn display_then_parse_round_trips(v in any::<u64>()) {
            let lsn = Lsn(v);
            prop_assert_eq!(lsn.to_string().parse::<Lsn>().unwrap(), lsn);
        }

        #[test]
        fn ordering_matches_integers(a in any::<u64>(), b in any::<u64>()) {
            prop_assert_eq!(Lsn(a).cmp(&Lsn(b)), a.cmp(&b));
            prop_assert_eq!(Lsn(a).bytes_since(Lsn(b)), a.saturating_sub(b));
        }
    }
}
