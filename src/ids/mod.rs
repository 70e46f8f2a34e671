//! Order and payment numbers: Twitter-style snowflakes (41 bits of
//! milliseconds since 2024-01-01, 10 bits of instance id, 12 bits of
//! sequence), made before anything is written so the number can key the
//! Redis reservation, the Kafka message and the order row alike.
//!
//! Two things make them unique across a fleet and across time:
//! - the instance id is leased in Redis ([`lease`]), so two running
//!   instances never share one, whatever their configuration says;
//! - the generator's clock never goes back: when the wall clock steps back
//!   (an NTP correction), it goes on from the last millisecond it used,
//!   taking the next millisecond once that one's 4096 numbers are spent.
//!   It never panics and never repeats a number.
//!
//! Every order number carries its buyer's gene ([`user_gene`]) in its low
//! [`GENE_BITS`] bits (see [`IdGenerator::next_id_with_gene`]), so the
//! number alone says which partition of the order table holds the order
//! (the gene's low 4 bits, [`user_slot`]) and, in a sharded activity,
//! which shard holds its reservation (the gene modulo the shards). The generator skips ahead to the next sequence value
//! with that gene: at most 64 values per number, 64 numbers per
//! millisecond per instance.

pub mod lease;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

pub use lease::{InstanceLease, LeaseError, LeasedIds};

/// Snowflake epoch: 2024-01-01T00:00:00Z in unix ms. 41 bits of
/// milliseconds last until 2093.
pub const EPOCH_UNIX_MS: u64 = 1_704_067_200_000;

/// The largest instance id (10 bits).
pub const MAX_INSTANCE: u16 = 1023;

/// The instance id of the numbers the database makes for orders it admits
/// while Redis is down (`admission/fallback.rs`); no lease grants it.
pub const DATABASE_INSTANCE: u16 = MAX_INSTANCE;

/// The largest instance id a lease (or `app.instance_id`) may take.
pub const MAX_LEASED_INSTANCE: u16 = MAX_INSTANCE - 1;

// The settings check `app.instance_id` against their own copy of the bound:
// they depend on nothing of the crate's.
const _: () = assert!(MAX_LEASED_INSTANCE == crate::config::MAX_CONFIGURED_INSTANCE);

const SEQUENCE_BITS: u32 = 12;
const INSTANCE_BITS: u32 = 10;
const SEQUENCE_MASK: u64 = (1 << SEQUENCE_BITS) - 1;

/// Makes unique ids; a trait so tests can make deterministic ones.
pub trait IdGenerator: Send + Sync {
    /// A new id, unique across instances with distinct instance ids; `None`
    /// while this process holds no instance id (its lease is not taken yet,
    /// or was lost), when it must not make any.
    fn next_id(&self) -> Option<i64>;

    /// A new id whose low [`GENE_BITS`] bits are `gene`'s (an order's
    /// shard), unique as [`IdGenerator::next_id`]'s are.
    fn next_id_with_gene(&self, gene: u8) -> Option<i64>;
}

/// Bits at the bottom of an order number that name its buyer's gene: 6,
/// so that 16 partitions (the gene's low 4 bits) and any shard count up
/// to 16 (the gene modulo it) each get an even share of buyers (64 values
/// over 3 shards: 22, 21, 21; over 16 values it would be 6, 5, 5).
pub const GENE_BITS: u32 = 6;

/// Bits of the gene that name the order table's partition.
pub const SLOT_BITS: u32 = 4;

/// The order table's partitions (`orders::partition`), one per slot.
pub const PARTITIONS: u8 = 1 << SLOT_BITS;

/// A buyer's gene, `splitmix64(user_id) mod 64`: in every order number
/// minted for them, and (modulo the shards) their shard in a sharded
/// activity. The same in every process.
pub fn user_gene(user_id: i64) -> u8 {
    (splitmix64(user_id as u64) % (1 << GENE_BITS)) as u8
}

/// A buyer's slot, `splitmix64(user_id) mod 16` (their gene's low 4
/// bits): the partition of their orders. The same in every process and in
/// the database (`seckill_user_slot`).
pub fn user_slot(user_id: i64) -> u8 {
    user_gene(user_id) % PARTITIONS
}

/// A fixed 64-bit mix (the splitmix64 finaliser).
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The gene of an id: its low [`GENE_BITS`] bits.
pub fn gene_of(id: i64) -> u8 {
    (id as u64 & ((1 << GENE_BITS) - 1)) as u8
}

/// Milliseconds since the snowflake epoch by the wall clock (0 before it).
pub fn epoch_ms_now() -> u64 {
    let unix_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    unix_ms.saturating_sub(EPOCH_UNIX_MS)
}

/// A snowflake generator. Lock-free: the last id it made (millisecond,
/// instance and sequence) is one atomic word.
pub struct Snowflake {
    last: AtomicU64,
}

const MS_SHIFT: u32 = INSTANCE_BITS + SEQUENCE_BITS;

impl Snowflake {
    /// A generator for `instance` (0..=1023; higher bits are dropped).
    pub fn new(instance: u16) -> Self {
        Self::starting_at(instance, 0)
    }

    /// A generator for `instance` whose first id is in a millisecond (since
    /// the epoch) no earlier than `floor_ms`: where an earlier holder of the
    /// same instance id may have got to.
    pub fn starting_at(instance: u16, floor_ms: u64) -> Self {
        Self {
            last: AtomicU64::new(Self::before(instance, floor_ms)),
        }
    }

    /// Makes ids for `instance` from now on, starting no earlier than
    /// `floor_ms` (a new lease). An id this generator held before is never
    /// taken back below where it got to: the floor a lease finds records
    /// only where its holder had got to at its last renewal, and the
    /// numbers made since are this generator's own.
    pub fn reset(&self, instance: u16, floor_ms: u64) {
        let start = Self::before(instance, floor_ms);
        let _ = self
            .last
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |last| {
                // One instance's ids order as (millisecond, sequence), and
                // so do their words.
                let same = instance_of(last as i64) == instance & MAX_INSTANCE;
                Some(if same { last.max(start) } else { start })
            });
    }

    /// The last id of the millisecond before `floor_ms`.
    fn before(instance: u16, floor_ms: u64) -> u64 {
        floor_ms.saturating_sub(1) << MS_SHIFT
            | u64::from(instance & MAX_INSTANCE) << SEQUENCE_BITS
            | SEQUENCE_MASK
    }

    /// The instance id in every number this makes.
    pub fn instance(&self) -> u16 {
        instance_of(self.last.load(Ordering::Acquire) as i64)
    }

    /// The millisecond (since the epoch) of the last id made: where this
    /// generator got to, which may be ahead of the wall clock.
    pub fn last_ms(&self) -> u64 {
        self.last.load(Ordering::Acquire) >> MS_SHIFT
    }

    /// The next id, given the wall clock reads `now_ms` since the epoch.
    pub fn next_at(&self, now_ms: u64) -> i64 {
        self.advance(now_ms, None)
    }

    /// The next id whose gene is `gene`, given the wall clock reads
    /// `now_ms` since the epoch.
    pub fn next_with_gene_at(&self, now_ms: u64, gene: u8) -> i64 {
        self.advance(now_ms, Some(u64::from(gene) & GENE_MASK))
    }

    fn advance(&self, now_ms: u64, gene: Option<u64>) -> i64 {
        let mut last = self.last.load(Ordering::Relaxed);
        loop {
            let last_ms = last >> MS_SHIFT;
            let instance = last & (u64::from(MAX_INSTANCE) << SEQUENCE_BITS);
            let (ms, mut seq) = if now_ms > last_ms {
                (now_ms, 0)
            } else {
                (last_ms, (last & SEQUENCE_MASK) + 1)
            };
            if let Some(g) = gene {
                seq += (g + GENE_MASK + 1 - (seq & GENE_MASK)) & GENE_MASK;
            }
            let next = if seq <= SEQUENCE_MASK {
                ms << MS_SHIFT | instance | seq
            } else {
                // This millisecond is spent (or the clock stepped back):
                // borrow the next one.
                (ms + 1) << MS_SHIFT | instance | gene.unwrap_or(0)
            };
            match self
                .last
                .compare_exchange_weak(last, next, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return (next & (i64::MAX as u64)) as i64,
                Err(actual) => last = actual,
            }
        }
    }
}

const GENE_MASK: u64 = (1 << GENE_BITS) - 1;

impl IdGenerator for Snowflake {
    fn next_id(&self) -> Option<i64> {
        Some(self.next_at(epoch_ms_now()))
    }

    fn next_id_with_gene(&self, gene: u8) -> Option<i64> {
        Some(self.next_with_gene_at(epoch_ms_now(), gene))
    }
}

/// A number of [`DATABASE_INSTANCE`] for millisecond `ms` (since the
/// epoch) and `seq` (a database sequence's value, of which the low 12 bits
/// are kept), with `gene` in its low bits when it has one. Distinct as long
/// as fewer than 4,096 (64 with a gene) come from the sequence within one
/// millisecond; a clash is refused by the orders' primary key anyway.
pub fn database_id(ms: u64, seq: u64, gene: Option<u8>) -> i64 {
    let seq = match gene {
        Some(g) => (seq << GENE_BITS | u64::from(g) & GENE_MASK) & SEQUENCE_MASK,
        None => seq & SEQUENCE_MASK,
    };
    let id = ms << MS_SHIFT | u64::from(DATABASE_INSTANCE) << SEQUENCE_BITS | seq;
    (id & (i64::MAX as u64)) as i64
}

/// A number made by the database, for when no instance id is leased (the
/// Redis fallback's orders, and payments while Redis is down): a
/// snowflake of [`DATABASE_INSTANCE`] from the database's clock and the
/// `fallback_order_seq` sequence, which no leased instance ever makes.
pub fn database_number(
    conn: &mut crate::store::PgConn,
    gene: Option<u8>,
) -> diesel::QueryResult<i64> {
    use diesel::RunQueryDsl;
    use diesel::sql_types::BigInt;
    #[derive(diesel::QueryableByName)]
    struct Minted {
        #[diesel(sql_type = BigInt)]
        seq: i64,
        #[diesel(sql_type = BigInt)]
        unix_ms: i64,
    }
    let m = diesel::sql_query(
        "SELECT nextval('fallback_order_seq') AS seq, \
           (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS unix_ms",
    )
    .get_result::<Minted>(conn)?;
    let ms = u64::try_from(m.unix_ms)
        .unwrap_or(0)
        .saturating_sub(EPOCH_UNIX_MS);
    Ok(database_id(ms, u64::try_from(m.seq).unwrap_or(0), gene))
}

/// When a snowflake was minted, unix ms (by its minter's clock).
pub fn minted_at_unix_ms(id: i64) -> i64 {
    let ms = (id as u64) >> MS_SHIFT;
    i64::try_from(ms.saturating_add(EPOCH_UNIX_MS)).unwrap_or(i64::MAX)
}

/// The instance id inside a snowflake.
pub fn instance_of(id: i64) -> u16 {
    ((id as u64 >> SEQUENCE_BITS) & u64::from(MAX_INSTANCE)) as u16
}

/// A snowflake number newtype: a decimal string in JSON, an i64 in storage.
macro_rules! snowflake_number {
    ($(#[$doc:meta])* $name:ident, $what:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(i64);

        impl $name {
            /// Wraps a stored or generated number.
            pub fn new(raw: i64) -> Self {
                Self(raw)
            }

            /// Parses the decimal string a client sends; `None` for
            /// anything else.
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

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(&self.0)
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let raw = String::deserialize(d)?;
                Self::parse(&raw)
                    .ok_or_else(|| serde::de::Error::custom(concat!($what, " must be a decimal id")))
            }
        }
    };
}

snowflake_number!(
    /// An order number (a string in JSON, docs/HTTP.md).
    OrderNo,
    "order_no"
);

snowflake_number!(
    /// A payment number (a string in JSON, docs/HTTP.md).
    PaymentNo,
    "payment_no"
);

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn snowflakes_are_unique_increasing_and_carry_the_instance() {
        let generator = Snowflake::new(7);
        let ids: Vec<i64> = (0..10_000).map(|_| generator.next_id().unwrap()).collect();
        assert!(ids.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(ids.iter().collect::<HashSet<_>>().len(), ids.len());
        assert!(
            ids.iter().all(|id| (id >> 12) & 0x3ff == 7),
            "instance bits"
        );
        assert!(ids[0] > 0);
    }

    #[test]
    fn ids_with_a_gene_carry_it_and_stay_unique_and_increasing() {
        let generator = Snowflake::new(5);
        let now = epoch_ms_now();
        let mut ids = Vec::new();
        // Mixed with plain ids, across a spent millisecond (4096 / 16
        // numbers of one gene fit in one).
        for i in 0..2_000u32 {
            let gene = (i % 16) as u8;
            let id = generator.next_with_gene_at(now, gene);
            assert_eq!(gene_of(id), gene, "{id}");
            assert_eq!(instance_of(id), 5);
            ids.push(id);
            ids.push(generator.next_at(now));
        }
        assert!(ids.windows(2).all(|w| w[0] < w[1]));
        assert!(
            ids.last().unwrap() >> 22 > i64::try_from(now).unwrap(),
            "borrowed ms"
        );
    }

    /// The nemesis at 0111e91 (seed 801229897): Redis restarted empty,
    /// then was flushed six seconds later. The instance re-leased its id
    /// twice, each time at the floor PostgreSQL recorded before the first
    /// loss, which lies ahead of the clock. The second reset took the
    /// generator back to numbers it had made since the first, and a
    /// payment's insert met one: 500 for `payments_pkey`.
    #[test]
    fn a_lease_taken_again_at_the_same_floor_never_repeats_a_number() {
        let generator = Snowflake::new(0);
        let now = epoch_ms_now();
        let floor = now + 60_000;
        generator.reset(817, floor);
        let before: Vec<i64> = (0..100).map(|_| generator.next_at(now)).collect();
        generator.reset(817, floor);
        let after: Vec<i64> = (0..100).map(|_| generator.next_at(now + 3_000)).collect();
        assert!(
            after[0] > *before.last().unwrap(),
            "the second lease starts past the first's numbers"
        );
        // Another id starts at its own floor, whatever this one made.
        generator.reset(818, now);
        assert_eq!(instance_of(generator.next_at(now)), 818);
        assert!(generator.last_ms() < floor);
    }

    #[test]
    fn two_instances_never_collide() {
        let a = Snowflake::new(1);
        let b = Snowflake::new(2);
        let mut seen = HashSet::new();
        for _ in 0..5_000 {
            assert!(seen.insert(a.next_id().unwrap()));
            assert!(seen.insert(b.next_id().unwrap()));
        }
    }

    #[test]
    fn a_clock_stepping_back_neither_panics_nor_repeats_a_number() {
        let generator = Snowflake::new(3);
        let now = epoch_ms_now();
        let mut ids = Vec::new();
        // Forward, then the clock steps back by a minute and creeps on.
        for t in [now, now + 1, now + 2] {
            ids.extend((0..100).map(|_| generator.next_at(t)));
        }
        for t in (now - 60_000..now - 59_990).chain([now - 1, now, now + 2, now + 3]) {
            ids.extend((0..100).map(|_| generator.next_at(t)));
        }
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "strictly increasing");
        assert!(ids.iter().all(|id| instance_of(*id) == 3));
        assert!(generator.last_ms() >= now + 3);
    }

    #[test]
    fn a_spent_millisecond_borrows_the_next_one() {
        let generator = Snowflake::new(1);
        let t = epoch_ms_now();
        let ids: Vec<i64> = (0..10_000).map(|_| generator.next_at(t)).collect();
        assert!(ids.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(generator.last_ms(), t + 2, "10 000 numbers span three ms");
    }

    #[test]
    fn a_generator_starts_at_its_floor() {
        let now = epoch_ms_now();
        let generator = Snowflake::starting_at(5, now + 10_000);
        let id = generator.next_at(now);
        assert_eq!(id as u64 >> 22, now + 10_000);
        let fresh = Snowflake::new(5).next_at(now);
        assert!(fresh < id);
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
