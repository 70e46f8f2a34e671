//! Order and payment numbers: Twitter-style snowflakes (41 bits of
//! milliseconds since 2024-01-01, 10 bits of instance id from
//! `app.instance_id`, 12 bits of sequence), made before anything is written
//! so the number can key the Redis reservation, the Kafka message and the
//! order row alike.

use std::fmt;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

/// Snowflake epoch: 2024-01-01T00:00:00Z. 41 bits of milliseconds last until 2093.
const EPOCH_UNIX_SECS: u64 = 1_704_067_200;

/// Makes unique ids; a trait so tests can make deterministic ones.
pub trait IdGenerator: Send + Sync {
    /// A new id, unique across instances with distinct instance ids.
    fn next_id(&self) -> i64;
}

/// The real generator.
pub struct Snowflake(snowflaked::sync::Generator);

impl Snowflake {
    /// A generator for `instance` (0..=1023, validated by `Settings`).
    pub fn new(instance: u16) -> Self {
        let epoch = SystemTime::UNIX_EPOCH + Duration::from_secs(EPOCH_UNIX_SECS);
        Self(
            snowflaked::Builder::new()
                .instance(instance)
                .epoch(epoch)
                .build(),
        )
    }
}

impl IdGenerator for Snowflake {
    fn next_id(&self) -> i64 {
        self.0.generate()
    }
}

/// An order number. A string in JSON (API.md), an i64 in storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OrderNo(i64);

impl OrderNo {
    /// Wraps a stored or generated number.
    pub fn new(raw: i64) -> Self {
        Self(raw)
    }

    /// Parses the decimal string a client sends; `None` for anything else.
    pub fn parse(raw: &str) -> Option<Self> {
        if raw.is_empty() || raw.len() > 19 || !raw.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        raw.parse::<i64>().ok().filter(|n| *n > 0).map(Self)
    }

    /// The raw number, for storage.
    pub fn get(self) -> i64 {
        self.0
    }
}

impl fmt::Display for OrderNo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl Serialize for OrderNo {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for OrderNo {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(d)?;
        Self::parse(&raw).ok_or_else(|| serde::de::Error::custom("order_no must be a decimal id"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn snowflakes_are_unique_increasing_and_carry_the_instance() {
        let generator = Snowflake::new(7);
        let ids: Vec<i64> = (0..10_000).map(|_| generator.next_id()).collect();
        assert!(ids.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(ids.iter().collect::<HashSet<_>>().len(), ids.len());
        assert!(
            ids.iter().all(|id| (id >> 12) & 0x3ff == 7),
            "instance bits"
        );
        assert!(ids[0] > 0);
    }

    #[test]
    fn two_instances_never_collide() {
        let a = Snowflake::new(1);
        let b = Snowflake::new(2);
        let mut seen = HashSet::new();
        for _ in 0..5_000 {
            assert!(seen.insert(a.next_id()));
            assert!(seen.insert(b.next_id()));
        }
    }

    #[test]
    fn order_numbers_parse_only_from_positive_decimal_strings() {
        assert_eq!(OrderNo::parse("123").map(OrderNo::get), Some(123));
        for bad in ["", "0", "-5", "12a", " 1", "99999999999999999999"] {
            assert!(OrderNo::parse(bad).is_none(), "{bad:?}");
        }
        let json = serde_json::to_string(&OrderNo::new(42)).unwrap();
        assert_eq!(json, "\"42\"");
    }
}
