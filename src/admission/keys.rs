//! Redis key layout. Every key of an activity carries the hash tag
//! `{a:<activity_id>}`, so all keys one script touches live in one Redis
//! Cluster slot and the scripts run unchanged on a cluster.
//!
//! A sharded activity (`shards` > 1, docs/HOT_ACTIVITY.md) has, besides
//! that base tag (its meta and `restoring` marker only), one tag per shard,
//! `{a:<id>:<shard>.<k>}`: each shard's keys are one slot, and `k` is the
//! first that puts shard `s` in the `s`-th of `shards` equal ranges of the
//! 16,384 slots. A cluster made by `redis-cli --cluster create` gives each
//! master one contiguous equal range, so with as many shards as masters
//! every master holds one shard.

use crate::domain::ActivityId;

/// Hash slots of a Redis Cluster.
const SLOTS: u32 = 16_384;

/// How an activity's keys are laid out: stock buckets per shard, and
/// shards. Fixed at creation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Layout {
    /// Stock buckets in each shard (≥ 1).
    pub buckets: usize,
    /// Shards (1 ..= [`Layout::MAX_SHARDS`]); 1 is the unsharded layout.
    pub shards: usize,
}

impl Layout {
    /// The most shards an activity can have (an order's shard is the gene
    /// in its number, [`crate::ids::GENE_BITS`] bits, modulo the shards).
    pub const MAX_SHARDS: usize = 16;

    /// A layout, with both counts clamped into range.
    pub fn new(buckets: usize, shards: usize) -> Self {
        Self {
            buckets: buckets.max(1),
            shards: shards.clamp(1, Self::MAX_SHARDS),
        }
    }

    /// The unsharded layout with `buckets` buckets.
    pub fn single(buckets: usize) -> Self {
        Self::new(buckets, 1)
    }

    /// Whether the activity is spread over several shards.
    pub fn is_sharded(self) -> bool {
        self.shards > 1
    }

    /// The shard of a buyer: their gene ([`crate::ids::user_gene`], a
    /// fixed hash, the same in every process) modulo the shards.
    pub fn shard_of_user(self, user_id: i64) -> usize {
        if !self.is_sharded() {
            return 0;
        }
        usize::from(crate::ids::user_gene(user_id)) % self.shards
    }

    /// The shard of an order: the gene in its number (its buyer's)
    /// modulo the shards, as [`Layout::shard_of_user`].
    pub fn shard_of_order(self, order_no: i64) -> usize {
        if !self.is_sharded() {
            return 0;
        }
        usize::from(crate::ids::gene_of(order_no)) % self.shards
    }

    /// How `units` are split over the shards at warm-up (and restore):
    /// evenly, the first shards taking one more.
    pub fn split(self, units: i64) -> Vec<i64> {
        split_evenly(units, self.shards)
    }
}

/// `units` over `parts` parts (at least one), as evenly as can be: the
/// first parts take one more. The buckets of a shard are split the same
/// way (`warmup.lua`).
pub fn split_evenly(units: i64, parts: usize) -> Vec<i64> {
    let n = parts.max(1) as i64;
    let units = units.max(0);
    (0..n)
        .map(|i| units / n + i64::from(i < units % n))
        .collect()
}

/// Redis Cluster's key hash (CRC16-XMODEM) of a hash tag, as a slot.
pub fn slot_of_tag(tag: &str) -> u32 {
    let mut crc: u16 = 0;
    for &byte in tag.as_bytes() {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    u32::from(crc) % SLOTS
}

/// The hash tag of shard `shard` of `shards` of an activity (without the
/// braces): the first `a:<id>:<shard>.<k>` whose slot is in the shard's
/// range.
fn shard_tag(activity_id: ActivityId, shard: usize, shards: usize) -> String {
    let (lo, hi) = (
        SLOTS * shard as u32 / shards as u32,
        SLOTS * (shard as u32 + 1) / shards as u32,
    );
    // A range holds at least 1,024 of 16,384 slots: a few dozen tries.
    (0u32..)
        .map(|k| format!("a:{activity_id}:{shard}.{k}"))
        .find(|tag| (lo..hi).contains(&slot_of_tag(tag)))
        .expect("some suffix lands in every range")
}

/// The keys of one activity under this instance's prefix.
#[derive(Debug, Clone)]
pub struct ActivityKeys {
    base: String,
}

impl ActivityKeys {
    /// Keys for `activity_id` under `prefix` (`redis.key_prefix`).
    pub fn new(prefix: &str, activity_id: ActivityId) -> Self {
        Self {
            base: format!("{prefix}{{a:{activity_id}}}:"),
        }
    }

    /// Keys of shard `shard` of an activity laid out as `layout`: the base
    /// keys when it is not sharded.
    pub fn shard(prefix: &str, activity_id: ActivityId, layout: Layout, shard: usize) -> Self {
        if !layout.is_sharded() {
            return Self::new(prefix, activity_id);
        }
        let tag = shard_tag(activity_id, shard % layout.shards, layout.shards);
        Self {
            base: format!("{prefix}{{{tag}}}:"),
        }
    }

    /// The highest reconcile lease token that wrote in this slot
    /// (`reconcile/lua/fenced.lua`).
    pub fn fence(&self) -> String {
        format!("{}fence", self.base)
    }

    /// Hash of the activity's sale window and limits; present once warmed.
    pub fn meta(&self) -> String {
        format!("{}meta", self.base)
    }

    /// Stock bucket `b` (units available to reserve).
    pub fn bucket(&self, b: usize) -> String {
        format!("{}stock:{b}", self.base)
    }

    /// All `n` stock buckets.
    pub fn buckets(&self, n: usize) -> Vec<String> {
        (0..n).map(|b| self.bucket(b)).collect()
    }

    /// Hash `"<user>:<request_id>"` → order_no (I3).
    pub fn requests(&self) -> String {
        format!("{}reqs", self.base)
    }

    /// Hash user → live reserved quantity (I2).
    pub fn holdings(&self) -> String {
        format!("{}users", self.base)
    }

    /// One purchase token.
    pub fn token(&self, token: &str) -> String {
        format!("{}token:{token}", self.base)
    }

    /// The reservation record of one order.
    pub fn reservation(&self, order_no: i64) -> String {
        format!("{}res:{order_no}", self.base)
    }

    /// Zset of open (not yet committed) reservations by time.
    pub fn open(&self) -> String {
        format!("{}open", self.base)
    }

    /// Marker that every other shard was found empty (sharded activities;
    /// expires within a fraction of a second): SOLD_OUT without asking
    /// them again.
    pub fn dry(&self) -> String {
        format!("{}dry", self.base)
    }

    /// Hash of the units this shard lent out: transfer id → `home:units:ms`.
    pub fn lent(&self) -> String {
        format!("{}lent", self.base)
    }

    /// Marker that this shard was credited with transfer `id`.
    pub fn credited(&self, id: &str) -> String {
        format!("{}credited:{id}", self.base)
    }

    /// When reconciliation first saw that Redis lost this activity (unix
    /// ms); present only until it is restored.
    pub fn restoring(&self) -> String {
        format!("{}restoring", self.base)
    }

    /// Hash of the activity's waiting room: its settings, counters
    /// (tickets taken, place being served), the draw's seed and
    /// commitment, the admission bucket (docs/WAITING_ROOM.md).
    pub fn room(&self) -> String {
        format!("{}room", self.base)
    }

    /// Hash user → ticket of the room.
    pub fn room_users(&self) -> String {
        format!("{}room:users", self.base)
    }

    /// List of the users who took the pre-queue tickets, in ticket order:
    /// what the commitment to the draw is built from.
    pub fn room_entrants(&self) -> String {
        format!("{}room:entrants", self.base)
    }

    /// Hash ticket → state, for tickets past their turn or gone:
    /// `A:<ms>`/`O:<ms>` a pass or offer until then, `U:`/`V:` the same
    /// used, `E` expired, `L` left.
    pub fn room_states(&self) -> String {
        format!("{}room:st", self.base)
    }

    /// Zset of unused passes and offers by expiry.
    pub fn room_active(&self) -> String {
        format!("{}room:active", self.base)
    }

    /// Zset of the offers of released units by expiry (used or not).
    pub fn room_offers(&self) -> String {
        format!("{}room:offers", self.base)
    }

    /// Marker that a proof-of-work answer was accepted (until its
    /// challenge expires).
    pub fn room_pow(&self, challenge: &str) -> String {
        format!("{}room:pow:{challenge}", self.base)
    }

    /// Joins in one second (unix seconds), for the difficulty.
    pub fn room_joins(&self, second: i64) -> String {
        format!("{}room:joins:{second}", self.base)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_of_an_activity_shares_one_hash_tag() {
        let k = ActivityKeys::new("sk:", ActivityId::new(42));
        for key in [
            k.meta(),
            k.bucket(3),
            k.requests(),
            k.holdings(),
            k.token("t"),
            k.reservation(9),
            k.open(),
            k.restoring(),
            k.room(),
            k.room_users(),
            k.room_entrants(),
            k.room_states(),
            k.room_active(),
            k.room_offers(),
            k.room_pow("c"),
            k.room_joins(1),
        ] {
            assert!(key.starts_with("sk:{a:42}:"), "{key}");
        }
        assert_ne!(
            ActivityKeys::new("sk:", ActivityId::new(4)).meta(),
            ActivityKeys::new("sk:", ActivityId::new(42)).meta()
        );
    }

    #[test]
    fn an_unsharded_activity_keeps_the_base_tag_in_every_shard_call() {
        let k = ActivityKeys::shard("sk:", ActivityId::new(42), Layout::single(4), 3);
        assert_eq!(
            k.meta(),
            ActivityKeys::new("sk:", ActivityId::new(42)).meta()
        );
    }

    #[test]
    fn each_shard_has_its_own_tag_in_its_own_slot_range() {
        // The slot function agrees with Redis (CLUSTER KEYSLOT values).
        assert_eq!(slot_of_tag("foo"), 12_182);
        assert_eq!(slot_of_tag("a:1"), 8_311);
        for shards in [2, 3, 5, 16] {
            let layout = Layout::new(4, shards);
            for s in 0..shards {
                let k = ActivityKeys::shard("sk:", ActivityId::new(7), layout, s);
                let key = k.bucket(0);
                let tag = &key[key.find('{').unwrap() + 1..key.find('}').unwrap()];
                let slot = slot_of_tag(tag);
                assert!(slot >= 16_384 * s as u32 / shards as u32, "{key}");
                assert!(slot < 16_384 * (s as u32 + 1) / shards as u32, "{key}");
                for other in [
                    k.requests(),
                    k.holdings(),
                    k.token("t"),
                    k.reservation(1),
                    k.open(),
                    k.dry(),
                    k.lent(),
                    k.credited("x"),
                ] {
                    assert!(
                        other.starts_with(&key[..key.find('}').unwrap() + 1]),
                        "{other}"
                    );
                }
            }
        }
    }

    #[test]
    fn buyers_and_their_orders_route_to_one_shard_and_spread_over_all() {
        let layout = Layout::new(1, 3);
        let mut per_shard = [0; 3];
        for user in 1..=3_000 {
            let s = layout.shard_of_user(user);
            per_shard[s] += 1;
            let order_no = crate::ids::Snowflake::new(1).next_with_gene_at(1, s as u8);
            assert_eq!(layout.shard_of_order(order_no), s);
        }
        assert!(
            per_shard.iter().all(|&n| (900..1_100).contains(&n)),
            "{per_shard:?}"
        );
        assert_eq!(Layout::single(2).shard_of_user(99), 0);
        assert_eq!(Layout::new(1, 3).split(10), vec![4, 3, 3]);
    }
}
