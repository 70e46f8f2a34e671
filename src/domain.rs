//! Domain newtypes that validate when parsed, so handlers and repositories
//! never pass raw integers and strings around.

use std::fmt;

use serde::{Deserialize, Serialize};

/// A user id: the JWT `sub`, a positive decimal integer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct UserId(i64);

impl UserId {
    /// Parses a JWT `sub`: a decimal integer ≥ 1.
    pub fn parse(raw: &str) -> Option<Self> {
        match raw.parse::<i64>() {
            Ok(id) if id >= 1 && raw.bytes().all(|b| b.is_ascii_digit()) => Some(Self(id)),
            _ => None,
        }
    }

    /// The raw id, for storage.
    pub fn get(self) -> i64 {
        self.0
    }
}

impl fmt::Display for UserId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_id_accepts_only_positive_decimal_integers() {
        assert_eq!(UserId::parse("42").map(UserId::get), Some(42));
        for bad in [
            "",
            "0",
            "-1",
            "+3",
            " 4",
            "4.0",
            "1e3",
            "abc",
            "99999999999999999999",
        ] {
            assert!(UserId::parse(bad).is_none(), "{bad:?} should be refused");
        }
    }
}
