//! What reconciliation changes in Redis: a repair by compare-and-set
//! (`lua/repair.lua`), the restore of a lost activity, the removal of an
//! ended one, and what it reads to decide. Nothing else changes these: the
//! purchase path only reads what they write.

use std::sync::LazyLock;

use redis::{RedisResult, Script};

use crate::admission::RedisGate;
use crate::admission::gate::WarmSpec;
use crate::admission::keys::{Layout, split_evenly};
use crate::domain::ActivityId;

/// What a sharded repair compares before and after.
#[derive(Debug, PartialEq, Eq)]
struct ShardState {
    sum: i64,
    open: i64,
    lent: i64,
}

/// Reconciliation's view of the gate: what it changes in Redis.
pub struct Repairs<'a> {
    gate: &'a RedisGate,
}

/// `lua/repair.lua`: a compare-and-set of one shard's buckets.
static REPAIR: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/repair.lua")));

impl<'a> Repairs<'a> {
    /// The repairs made through `gate`'s connection.
    pub fn new(gate: &'a RedisGate) -> Self {
        Self { gate }
    }

    /// Sets the activity's Redis stock to `target` units, but only while
    /// no reservation is open and the buckets still sum to `expected`
    /// (`repair.lua`). Returns the delta applied, or `None` when something
    /// moved in between and nothing was done. Reconciliation only.
    ///
    /// A sharded activity is repaired in its shard 0, by the same
    /// compare-and-set; the other shards are read before (nothing open,
    /// nothing lent) and after, and if any moved meanwhile the repair is
    /// undone and `None` returned.
    pub async fn repair(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        expected: i64,
        target: i64,
    ) -> RedisResult<Option<i64>> {
        if !layout.is_sharded() {
            return self
                .repair_shard(activity_id, layout, 0, expected, target)
                .await;
        }
        let before = self.shard_states(activity_id, layout).await?;
        if before.iter().any(|s| s.open > 0 || s.lent > 0)
            || before.iter().map(|s| s.sum).sum::<i64>() != expected
        {
            return Ok(None);
        }
        let sum0 = before[0].sum;
        let Some(applied) = self
            .repair_shard(activity_id, layout, 0, sum0, sum0 + target - expected)
            .await?
        else {
            return Ok(None);
        };
        let after = self.shard_states(activity_id, layout).await?;
        if after[1..] == before[1..] {
            return Ok(Some(applied));
        }
        // Another shard moved while shard 0 was repaired: the figures
        // described different moments. Undo (a compare-and-set again).
        if self
            .repair_shard(activity_id, layout, 0, sum0 + applied, sum0)
            .await?
            .is_none()
        {
            tracing::warn!(
                activity_id = %activity_id,
                applied,
                "a sharded repair could not be undone; the next run compares again"
            );
        }
        Ok(None)
    }

    async fn repair_shard(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        shard: usize,
        expected: i64,
        target: i64,
    ) -> RedisResult<Option<i64>> {
        let k = self.gate.shard_keys(activity_id, layout, shard);
        let mut call = REPAIR.prepare_invoke();
        call.key(k.open());
        for b in 0..layout.buckets {
            call.key(k.bucket(b));
        }
        let (done, value): (i64, i64) = call
            .arg(expected)
            .arg(target)
            .arg(self.gate.returned())
            .arg(activity_id)
            .invoke_async(&mut self.gate.conn())
            .await?;
        Ok((done == 1).then_some(value))
    }

    async fn shard_states(
        &self,
        activity_id: ActivityId,
        layout: Layout,
    ) -> RedisResult<Vec<ShardState>> {
        let mut states = Vec::with_capacity(layout.shards);
        for shard in 0..layout.shards {
            let k = self.gate.shard_keys(activity_id, layout, shard);
            let (open, lent): (i64, i64) = redis::pipe()
                .cmd("ZCARD")
                .arg(k.open())
                .cmd("HLEN")
                .arg(k.lent())
                .query_async(&mut self.gate.conn())
                .await?;
            states.push(ShardState {
                sum: self.gate.shard_sum(activity_id, layout, shard).await?,
                open,
                lent,
            });
        }
        Ok(states)
    }

    /// Open reservations made before `cutoff_ms` (up to 1,000 per shard).
    pub async fn open_before(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        cutoff_ms: i64,
    ) -> RedisResult<Vec<i64>> {
        let mut found = Vec::new();
        for shard in 0..layout.shards {
            let some: Vec<i64> = redis::cmd("ZRANGEBYSCORE")
                .arg(self.gate.shard_keys(activity_id, layout, shard).open())
                .arg("-inf")
                .arg(format!("({cutoff_ms}"))
                .arg("LIMIT")
                .arg(0)
                .arg(1000)
                .query_async(&mut self.gate.conn())
                .await?;
            found.extend(some);
        }
        Ok(found)
    }

    /// Removes an ended activity's keys (meta, buckets, request and holding
    /// hashes, open index, transfer records, its waiting room's queue).
    /// Reservation records expire on their own.
    pub async fn remove_activity(
        &self,
        activity_id: ActivityId,
        layout: Layout,
    ) -> RedisResult<()> {
        for shard in 0..layout.shards {
            let k = self.gate.shard_keys(activity_id, layout, shard);
            // The records of open reservations first: one left behind
            // would be sent again by its publisher after the restore's
            // snapshot, and its units counted twice. The open set names
            // them; a record in it outlives the set only by a moment (the
            // admission script writes both at once, and the meta, dropped
            // below, is gone for it afterwards).
            let open: Vec<i64> = redis::cmd("ZRANGE")
                .arg(k.open())
                .arg(0)
                .arg(-1)
                .query_async(&mut self.gate.conn())
                .await?;
            for chunk in open.chunks(500) {
                let records: Vec<String> = chunk.iter().map(|&no| k.reservation(no)).collect();
                let _: () = redis::cmd("DEL")
                    .arg(records)
                    .query_async(&mut self.gate.conn())
                    .await?;
            }
            let mut keys = k.buckets(layout.buckets);
            keys.extend([
                k.meta(),
                k.requests(),
                k.holdings(),
                k.open(),
                k.lent(),
                k.dry(),
            ]);
            let _: () = redis::cmd("DEL")
                .arg(keys)
                .query_async(&mut self.gate.conn())
                .await?;
        }
        let base = self.gate.keys(activity_id);
        // A waiting room's queue, unlinked: its hashes can hold a million
        // tickets, freed off Redis's main thread. (Answers and join counts
        // expire on their own.)
        let _: () = redis::cmd("UNLINK")
            .arg(&[
                base.room(),
                base.room_users(),
                base.room_tickets(),
                base.room_states(),
                base.room_active(),
                base.room_offers(),
            ])
            .query_async(&mut self.gate.conn())
            .await?;
        redis::cmd("DEL")
            .arg(&[base.meta(), base.restoring()])
            .query_async(&mut self.gate.conn())
            .await
    }

    /// Drops an order from the open index (its record is gone).
    pub async fn forget_open(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        order_no: i64,
    ) -> RedisResult<()> {
        redis::cmd("ZREM")
            .arg(self.gate.order_keys(activity_id, layout, order_no).open())
            .arg(order_no)
            .query_async(&mut self.gate.conn())
            .await
    }

    /// When Redis was first seen without this (warmed) activity: sets the
    /// marker to `now_ms` unless it is there, and returns its value.
    pub async fn restoring_since(&self, activity_id: ActivityId, now_ms: i64) -> RedisResult<i64> {
        crate::store::redis_conn::first_seen(
            &self.gate.conn(),
            &self.gate.keys(activity_id).restoring(),
            now_ms,
        )
        .await
    }

    /// Rebuilds a lost activity from a database snapshot, in one
    /// MULTI/EXEC per shard: the stock, the request ids and holdings of its
    /// orders, the records of its live and released orders (so a later
    /// cancel or release applies exactly once), and the meta last, which
    /// opens it (a sharded activity's base meta after every shard's).
    pub async fn restore(&self, r: &Restore) -> RedisResult<()> {
        let layout = r.spec.layout;
        let shares = layout.split(i64::from(r.spec.units));
        for (shard, share) in shares.into_iter().enumerate() {
            self.restore_shard(r, shard, share).await?;
        }
        if layout.is_sharded() {
            self.gate.write_base_meta(&r.spec).await?;
        }
        let _: () = redis::cmd("DEL")
            .arg(self.gate.keys(r.spec.activity_id).restoring())
            .query_async(&mut self.gate.conn())
            .await?;
        // Sold-out flags of the activity's past go.
        redis::cmd("PUBLISH")
            .arg(self.gate.returned())
            .arg(r.spec.activity_id)
            .query_async(&mut self.gate.conn())
            .await
    }

    async fn restore_shard(&self, r: &Restore, shard: usize, units: i64) -> RedisResult<()> {
        let layout = r.spec.layout;
        let k = self.gate.shard_keys(r.spec.activity_id, layout, shard);
        let ttl = self.gate.reservation_ttl_secs();
        let mut pipe = redis::pipe();
        pipe.atomic();
        let mut stale = k.buckets(layout.buckets);
        stale.extend([
            k.requests(),
            k.holdings(),
            k.open(),
            k.meta(),
            k.lent(),
            k.dry(),
        ]);
        pipe.cmd("DEL").arg(stale).ignore();
        for (b, share) in split_evenly(units, layout.buckets).into_iter().enumerate() {
            pipe.cmd("SET").arg(k.bucket(b)).arg(share).ignore();
        }
        let buyers: Vec<&RestoredOrder> = r
            .orders
            .iter()
            .filter(|o| layout.shard_of_user(o.user_id) == shard)
            .collect();
        for chunk in buyers.chunks(500) {
            let mut requests = redis::cmd("HSET");
            requests.arg(k.requests());
            for o in chunk {
                requests
                    .arg(format!("{}:{}", o.user_id, o.request_id))
                    .arg(o.order_no);
            }
            pipe.add_command(requests).ignore();
        }
        for o in r
            .orders
            .iter()
            .filter(|o| layout.shard_of_order(o.order_no) == shard)
        {
            let status = match o.state {
                RestoredState::Live => "committed",
                RestoredState::Released => "released",
                RestoredState::Settled => continue,
            };
            let key = k.reservation(o.order_no);
            pipe.cmd("HSET")
                .arg(&key)
                .arg(&[
                    ("user", o.user_id.to_string()),
                    ("qty", o.quantity.to_string()),
                    ("alloc", format!("0:{}", o.quantity)),
                    ("req", o.request_id.clone()),
                    ("status", status.to_owned()),
                    ("ts", o.reserved_at_ms.to_string()),
                ])
                .ignore();
            pipe.cmd("EXPIRE").arg(&key).arg(ttl).ignore();
        }
        let mut held: std::collections::BTreeMap<i64, i64> = std::collections::BTreeMap::new();
        for o in buyers.iter().filter(|o| o.holds) {
            *held.entry(o.user_id).or_default() += i64::from(o.quantity);
        }
        for chunk in held.into_iter().collect::<Vec<_>>().chunks(500) {
            pipe.cmd("HSET").arg(k.holdings()).arg(chunk).ignore();
        }
        pipe.cmd("HSET")
            .arg(k.meta())
            .arg("start_ms")
            .arg(r.spec.start_ms)
            .arg("end_ms")
            .arg(r.spec.end_ms)
            .arg("limit")
            .arg(r.spec.per_user_limit)
            .arg("price")
            .arg(r.spec.price_cents)
            .arg("buckets")
            .arg(layout.buckets)
            // The acceptance count restarts below zero (minus now): no
            // count an instance read before the loss matches one after, so
            // its sold-out fast path reads the restored buyers again.
            .arg("accepted")
            .arg(-chrono::Utc::now().timestamp_millis())
            .ignore();
        pipe.query_async(&mut self.gate.conn()).await
    }

    /// Whether every shard of a sharded activity still has its meta (a
    /// shard's master can restart empty while the base keys, elsewhere,
    /// stay). One EXISTS per shard: their keys sit in different slots.
    pub async fn shards_warm(&self, activity_id: ActivityId, layout: Layout) -> RedisResult<bool> {
        if !layout.is_sharded() {
            return Ok(true);
        }
        for shard in 0..layout.shards {
            let exists: bool = redis::cmd("EXISTS")
                .arg(self.gate.shard_keys(activity_id, layout, shard).meta())
                .query_async(&mut self.gate.conn())
                .await?;
            if !exists {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

/// A lost activity, as the database knows it (see [`Repairs::restore`]).
#[derive(Debug, Clone)]
pub struct Restore {
    /// Window, limit, price, buckets, and the database's available units.
    pub spec: WarmSpec,
    /// Every order of the activity.
    pub orders: Vec<RestoredOrder>,
}

/// One order of a lost activity.
#[derive(Debug, Clone)]
pub struct RestoredOrder {
    /// Its number.
    pub order_no: i64,
    /// The buyer.
    pub user_id: i64,
    /// The buyer's idempotency key: a replay gets this order again.
    pub request_id: String,
    /// Units.
    pub quantity: i32,
    /// When it was made (unix ms).
    pub reserved_at_ms: i64,
    /// Whether it counts against the buyer's limit (WAITING_PAY, PAID).
    pub holds: bool,
    /// What its reservation record becomes.
    pub state: RestoredState,
}

/// The reservation record a restored order gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestoredState {
    /// WAITING_PAY: committed, so a later cancel or close releases it.
    Live,
    /// CANCELLED / CLOSED: released, so a late release is a no-op (the
    /// database's available count already has its units).
    Released,
    /// PAID or FAILED: no record needed.
    Settled,
}
