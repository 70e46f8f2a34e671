//! What reconciliation changes in Redis: a repair by compare-and-set
//! (`lua/repair.lua`), the restore of a lost activity, the removal of an
//! ended one, and what it reads to decide. Nothing else changes these: the
//! purchase path only reads what they write.
//!
//! Every write is fenced with the lease token of the run that makes it
//! (`lua/fenced.lua`): each slot keeps the highest token that wrote there,
//! a run claims each activity's slots before it reads them, and a write
//! carrying a lower token is refused. A run that lost its lease without
//! knowing (a pause longer than the lease, a failover of the lease key's
//! master) can so never restore over a newer holder's restore, which could
//! oversell and forget request ids.

use std::sync::LazyLock;

use redis::{RedisResult, Script};

use crate::admission::RedisGate;
use crate::admission::gate::WarmSpec;
use crate::admission::keys::{Layout, split_evenly};
use crate::domain::ActivityId;
use crate::store::fenced::{Writes, command, fenced_off};

/// What a sharded repair compares before and after.
#[derive(Debug, PartialEq, Eq)]
struct ShardState {
    sum: i64,
    open: i64,
    lent: i64,
    accepted: i64,
}

/// Redis's stock of an activity as reconciliation read it before its
/// database snapshot ([`Repairs::mark`]): what a repair is decided on, and
/// what must not have moved when it is applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StockMark {
    /// Units available: every shard's buckets, plus units lent by one shard
    /// and not yet credited to another.
    pub available: i64,
    /// Reservations open (between Redis and the database).
    pub open: i64,
    /// Each shard's acceptance count (`accepted` in its meta).
    accepted: Vec<i64>,
}

/// Reconciliation's view of the gate: what it changes in Redis.
pub struct Repairs<'a> {
    gate: &'a RedisGate,
    /// The lease token every write carries.
    fence: i64,
}

/// `lua/repair.lua`: a compare-and-set of one shard's buckets.
static REPAIR: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/repair.lua")));

/// `lua/stock_mark.lua`: one shard's buckets, open reservations and
/// acceptance count, read in one step.
static STOCK_MARK: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/stock_mark.lua")));

impl<'a> Repairs<'a> {
    /// The repairs made through `gate`'s connection, each write carrying
    /// the lease token `fence`.
    pub fn new(gate: &'a RedisGate, fence: i64) -> Self {
        Self { gate, fence }
    }

    /// Only reads: any write it were asked to make is refused.
    pub fn reading(gate: &'a RedisGate) -> Self {
        Self::new(gate, i64::MIN)
    }

    /// Claims every slot of the activity for this run's token before
    /// anything is read: from then on a run with an older token writes
    /// nothing there. An error when a newer holder claimed it already.
    pub async fn claim(&self, activity_id: ActivityId, layout: Layout) -> RedisResult<()> {
        for shard in 0..layout.shards {
            let k = self.gate.shard_keys(activity_id, layout, shard);
            self.fenced(&k.fence(), Writes::default()).await?;
        }
        if layout.is_sharded() {
            let base = self.gate.keys(activity_id);
            self.fenced(&base.fence(), Writes::default()).await?;
        }
        Ok(())
    }

    /// Runs `writes` in the slot of `fence_key` under this run's token.
    async fn fenced(&self, fence_key: &str, writes: Writes) -> RedisResult<()> {
        writes.run(&self.gate.conn(), fence_key, self.fence).await
    }

    /// Redis's stock of the activity, each shard read in one step
    /// (`stock_mark.lua`): what a repair decides on. Read before the
    /// database snapshot it is compared with.
    pub async fn mark(&self, activity_id: ActivityId, layout: Layout) -> RedisResult<StockMark> {
        let mut mark = StockMark {
            available: 0,
            open: 0,
            accepted: Vec::with_capacity(layout.shards),
        };
        for shard in 0..layout.shards {
            let k = self.gate.shard_keys(activity_id, layout, shard);
            let mut call = STOCK_MARK.prepare_invoke();
            call.key(k.meta()).key(k.open());
            for b in 0..layout.buckets {
                call.key(k.bucket(b));
            }
            let (sum, open, accepted): (i64, i64, i64) =
                call.invoke_async(&mut self.gate.conn()).await?;
            mark.available += sum;
            mark.open += open;
            mark.accepted.push(accepted);
        }
        if layout.is_sharded() {
            mark.available += self.gate.in_transfer(activity_id, layout).await?;
        }
        Ok(mark)
    }

    /// Sets the activity's Redis stock to `target` units (the database's
    /// figure), but only while no reservation is open, the buckets still
    /// sum to what `mark` read plus the `added` units this run gave back
    /// since, and no purchase was accepted since `mark` (`repair.lua`).
    /// Returns the delta applied, or `None` when something moved in
    /// between and nothing was done. Reconciliation only.
    ///
    /// A sharded activity is repaired in its shard 0, by the same
    /// compare-and-set; the other shards are read before (nothing open,
    /// nothing lent, no purchase since `mark`) and after, and if any moved
    /// meanwhile the repair is undone and `None` returned.
    pub async fn repair(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        mark: &StockMark,
        added: i64,
        target: i64,
    ) -> RedisResult<Option<i64>> {
        let expected = mark.available + added;
        if !layout.is_sharded() {
            return self
                .repair_shard(activity_id, layout, 0, expected, mark.accepted[0], target)
                .await;
        }
        let before = self.shard_states(activity_id, layout).await?;
        if before.iter().any(|s| s.open > 0 || s.lent > 0)
            || before.iter().map(|s| s.sum).sum::<i64>() != expected
            || before
                .iter()
                .map(|s| s.accepted)
                .ne(mark.accepted.iter().copied())
        {
            return Ok(None);
        }
        let (sum0, accepted0) = (before[0].sum, before[0].accepted);
        let Some(applied) = self
            .repair_shard(
                activity_id,
                layout,
                0,
                sum0,
                accepted0,
                sum0 + target - expected,
            )
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
            .repair_shard(activity_id, layout, 0, sum0 + applied, accepted0, sum0)
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
        accepted: i64,
        target: i64,
    ) -> RedisResult<Option<i64>> {
        let k = self.gate.shard_keys(activity_id, layout, shard);
        let mut call = REPAIR.prepare_invoke();
        call.key(k.fence()).key(k.open()).key(k.meta());
        for b in 0..layout.buckets {
            call.key(k.bucket(b));
        }
        let (done, value): (i64, i64) = call
            .arg(expected)
            .arg(target)
            .arg(self.gate.returned())
            .arg(activity_id)
            .arg(self.fence)
            .arg(accepted)
            .invoke_async(&mut self.gate.conn())
            .await?;
        match done {
            1 => Ok(Some(value)),
            0 => Ok(None),
            _ => Err(fenced_off()),
        }
    }

    async fn shard_states(
        &self,
        activity_id: ActivityId,
        layout: Layout,
    ) -> RedisResult<Vec<ShardState>> {
        let mut states = Vec::with_capacity(layout.shards);
        for shard in 0..layout.shards {
            let k = self.gate.shard_keys(activity_id, layout, shard);
            let (open, lent, accepted): (i64, i64, Option<i64>) = redis::pipe()
                .cmd("ZCARD")
                .arg(k.open())
                .cmd("HLEN")
                .arg(k.lent())
                .cmd("HGET")
                .arg(k.meta())
                .arg("accepted")
                .query_async(&mut self.gate.conn())
                .await?;
            states.push(ShardState {
                sum: self.gate.shard_sum(activity_id, layout, shard).await?,
                open,
                lent,
                accepted: accepted.unwrap_or(0),
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

    /// Removes an activity's sale keys (meta, buckets, request and holding
    /// hashes, open index, transfer records) and, with [`Room::Drop`], its
    /// waiting room's queue. Reservation records expire on their own.
    pub async fn remove_activity(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        room: Room,
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
            let mut keys: Vec<String> = open.iter().map(|&no| k.reservation(no)).collect();
            keys.extend(k.buckets(layout.buckets));
            keys.extend([
                k.meta(),
                k.requests(),
                k.holdings(),
                k.open(),
                k.lent(),
                k.dry(),
            ]);
            let mut writes = Writes::default();
            for chunk in keys.chunks(500) {
                writes.cmd(chunk, command("DEL", chunk));
            }
            self.fenced(&k.fence(), writes).await?;
        }
        let base = self.gate.keys(activity_id);
        let mut writes = Writes::default();
        if room == Room::Drop {
            // A waiting room's queue, unlinked: its hashes can hold a
            // million tickets, freed off Redis's main thread. (Answers and
            // join counts expire on their own.)
            let room = [
                base.room(),
                base.room_users(),
                base.room_entrants(),
                base.room_states(),
                base.room_active(),
                base.room_offers(),
            ];
            writes.cmd(
                &room,
                std::iter::once("UNLINK".to_owned())
                    .chain(room.iter().cloned())
                    .collect(),
            );
        }
        let gone = [base.meta(), base.restoring()];
        writes.cmd(
            &gone,
            std::iter::once("DEL".to_owned())
                .chain(gone.iter().cloned())
                .collect(),
        );
        self.fenced(&base.fence(), writes).await
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
        let base = self.gate.keys(r.spec.activity_id);
        let mut writes = Writes::default();
        if layout.is_sharded() {
            writes.on(&base.meta(), base_meta_command(&base.meta(), &r.spec));
        }
        let restoring = base.restoring();
        writes.on(&restoring, command("DEL", [&restoring]));
        self.fenced(&base.fence(), writes).await?;
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
        let ttl = self.gate.reservation_ttl_secs().to_string();
        let mut w = Writes::default();
        let mut stale = k.buckets(layout.buckets);
        stale.extend([
            k.requests(),
            k.holdings(),
            k.open(),
            k.meta(),
            k.lent(),
            k.dry(),
        ]);
        w.cmd(
            &stale,
            std::iter::once("DEL".to_owned())
                .chain(stale.iter().cloned())
                .collect(),
        );
        for (b, share) in split_evenly(units, layout.buckets).into_iter().enumerate() {
            let bucket = k.bucket(b);
            w.on(&bucket, command("SET", [bucket.clone(), share.to_string()]));
        }
        let buyers: Vec<&RestoredOrder> = r
            .orders
            .iter()
            .filter(|o| layout.shard_of_user(o.user_id) == shard)
            .collect();
        for chunk in buyers.chunks(500) {
            let mut hset = vec!["HSET".to_owned(), k.requests()];
            for o in chunk {
                hset.push(format!("{}:{}", o.user_id, o.request_id));
                hset.push(o.order_no.to_string());
            }
            w.on(&k.requests(), hset);
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
            let mut hset = vec!["HSET".to_owned(), key.clone()];
            for (field, value) in [
                ("user", o.user_id.to_string()),
                ("qty", o.quantity.to_string()),
                ("alloc", format!("0:{}", o.quantity)),
                ("req", o.request_id.clone()),
                ("status", status.to_owned()),
                ("ts", o.reserved_at_ms.to_string()),
            ] {
                hset.push(field.to_owned());
                hset.push(value);
            }
            w.on(&key, hset);
            w.on(&key, command("EXPIRE", [&key, &ttl]));
        }
        let mut held: std::collections::BTreeMap<i64, i64> = std::collections::BTreeMap::new();
        for o in buyers.iter().filter(|o| o.holds) {
            *held.entry(o.user_id).or_default() += i64::from(o.quantity);
        }
        for chunk in held.into_iter().collect::<Vec<_>>().chunks(500) {
            let mut hset = vec!["HSET".to_owned(), k.holdings()];
            for (user, units) in chunk {
                hset.push(user.to_string());
                hset.push(units.to_string());
            }
            w.on(&k.holdings(), hset);
        }
        let meta = k.meta();
        w.on(
            &meta,
            [
                "HSET",
                &meta,
                "start_ms",
                &r.spec.start_ms.to_string(),
                "end_ms",
                &r.spec.end_ms.to_string(),
                "limit",
                &r.spec.per_user_limit.to_string(),
                "price",
                &r.spec.price_cents.to_string(),
                "buckets",
                &layout.buckets.to_string(),
                // The acceptance count restarts below zero (minus now): no
                // count an instance read before the loss matches one after,
                // so its sold-out fast path reads the restored buyers again.
                "accepted",
                &(-chrono::Utc::now().timestamp_millis()).to_string(),
            ]
            .map(str::to_owned)
            .to_vec(),
        );
        self.fenced(&k.fence(), w).await
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

/// The HSET of a sharded activity's base meta (window, limit, price,
/// layout), as warm-up writes it.
fn base_meta_command(key: &str, spec: &WarmSpec) -> Vec<String> {
    [
        "HSET".to_owned(),
        key.to_owned(),
        "start_ms".into(),
        spec.start_ms.to_string(),
        "end_ms".into(),
        spec.end_ms.to_string(),
        "limit".into(),
        spec.per_user_limit.to_string(),
        "price".into(),
        spec.price_cents.to_string(),
        "buckets".into(),
        spec.layout.buckets.to_string(),
        "shards".into(),
        spec.layout.shards.to_string(),
    ]
    .to_vec()
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

/// Whether [`Repairs::remove_activity`] takes the waiting room's queue too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Room {
    /// The sale is over: the queue goes with the rest.
    Drop,
    /// The sale's keys are restored from the database, and the queue,
    /// which the database cannot restore (its tickets, passes and draw live
    /// in Redis only), stays as it is: a shard lost on another master, or
    /// keys written over by the database fallback, leave it intact. (A
    /// queue that was itself lost starts its next epoch, the admitter's.)
    Keep,
}
