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

/// An id the database makes (`BIGSERIAL`): typed so that an activity's id
/// is never passed where a coupon batch's goes. Stored, sent and shown as
/// the plain integer.
macro_rules! database_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(
            Debug,
            Clone,
            Copy,
            PartialEq,
            Eq,
            Hash,
            PartialOrd,
            Ord,
            Serialize,
            Deserialize,
            diesel::AsExpression,
            diesel::FromSqlRow,
        )]
        #[serde(transparent)]
        #[diesel(sql_type = diesel::sql_types::BigInt)]
        pub struct $name(i64);

        impl $name {
            /// The id the database gave.
            pub const fn new(id: i64) -> Self {
                Self(id)
            }

            /// The raw id, for storage and keys.
            pub const fn get(self) -> i64 {
                self.0
            }

            /// Parses a path segment: a decimal integer ≥ 1.
            pub fn parse(raw: &str) -> Option<Self> {
                match raw.parse::<i64>() {
                    Ok(id) if id >= 1 && raw.bytes().all(|b| b.is_ascii_digit()) => {
                        Some(Self(id))
                    }
                    _ => None,
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        impl diesel::serialize::ToSql<diesel::sql_types::BigInt, diesel::pg::Pg> for $name {
            fn to_sql<'b>(
                &'b self,
                out: &mut diesel::serialize::Output<'b, '_, diesel::pg::Pg>,
            ) -> diesel::serialize::Result {
                <i64 as diesel::serialize::ToSql<diesel::sql_types::BigInt, diesel::pg::Pg>>::to_sql(
                    &self.0, out,
                )
            }
        }

        impl diesel::deserialize::FromSql<diesel::sql_types::BigInt, diesel::pg::Pg> for $name {
            fn from_sql(bytes: diesel::pg::PgValue<'_>) -> diesel::deserialize::Result<Self> {
                <i64 as diesel::deserialize::FromSql<diesel::sql_types::BigInt, diesel::pg::Pg>>::from_sql(
                    bytes,
                )
                .map(Self)
            }
        }

        impl std::str::FromStr for $name {
            type Err = std::num::ParseIntError;

            fn from_str(raw: &str) -> Result<Self, Self::Err> {
                raw.parse().map(Self)
            }
        }

        impl redis::ToRedisArgs for $name {
            fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
                self.0.write_redis_args(out)
            }
        }

        impl redis::ToSingleRedisArg for $name {}
    };
}

database_id! {
    /// A flash-sale activity's id.
    ActivityId
}

database_id! {
    /// A coupon batch's id.
    CouponId
}

/// Whether `raw` is a key a client may choose (a request id, a purchase
/// token): 1..=[`RequestId::MAX_LEN`] printable ASCII characters, nothing
/// that could smuggle a header or a log line.
pub fn is_client_key(raw: &str) -> bool {
    !raw.is_empty() && raw.len() <= RequestId::MAX_LEN && raw.bytes().all(|b| b.is_ascii_graphic())
}

/// A client's idempotency key (a purchase's or a coupon claim's
/// `request_id`): 1..=64 printable ASCII characters.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RequestId(String);

impl RequestId {
    /// Longest accepted.
    pub const MAX_LEN: usize = 64;

    /// The key, if `raw` is one.
    pub fn parse(raw: &str) -> Option<Self> {
        is_client_key(raw).then(|| Self(raw.to_owned()))
    }

    /// [`RequestId::parse`] of a string the caller owns, without a copy.
    pub fn parse_owned(raw: String) -> Option<Self> {
        is_client_key(&raw).then_some(Self(raw))
    }

    /// The key.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key, owned.
    pub fn into_string(self) -> String {
        self.0
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_one_to_sixty_four_printable_ascii_characters() {
        assert_eq!(
            RequestId::parse("r-1").map(|r| r.to_string()),
            Some("r-1".into())
        );
        assert!(RequestId::parse(&"x".repeat(64)).is_some());
        assert_eq!(
            RequestId::parse_owned("r-1".to_owned()),
            RequestId::parse("r-1")
        );
        assert!(RequestId::parse_owned(" ".to_owned()).is_none());
        for bad in ["", "has space", "tab\t", "é", &"x".repeat(65)] {
            assert!(RequestId::parse(bad).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn database_ids_parse_like_user_ids_and_show_as_the_integer() {
        assert_eq!(ActivityId::parse("7"), Some(ActivityId::new(7)));
        assert_eq!(CouponId::new(9).to_string(), "9");
        assert_eq!(serde_json::to_string(&ActivityId::new(3)).unwrap(), "3");
        for bad in ["", "0", "-2", "x", "1.5"] {
            assert!(ActivityId::parse(bad).is_none(), "{bad:?}");
        }
    }

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
