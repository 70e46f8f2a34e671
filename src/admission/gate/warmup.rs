//! Loading an activity into Redis (`lua/warmup.lua`), ending its sale, and
//! its stock figure across buckets and shards.

use redis::{RedisResult, Script};

use super::RedisGate;
use crate::admission::keys::Layout;
use crate::domain::ActivityId;

/// An activity's sale window and limits, as warmed into Redis.
#[derive(Debug, Clone, Copy)]
pub struct WarmSpec {
    /// The activity.
    pub activity_id: ActivityId,
    /// Sale start, unix ms.
    pub start_ms: i64,
    /// Sale end, unix ms.
    pub end_ms: i64,
    /// Per-user limit.
    pub per_user_limit: i32,
    /// Units to load (the database's available count).
    pub units: i32,
    /// Unit price, cents.
    pub price_cents: i64,
    /// Buckets and shards to split the units over.
    pub layout: Layout,
}

impl RedisGate {
    /// Loads stock and the sale window, unless already warm: each shard
    /// its share of the units and a copy of the window, then the base meta.
    /// Returns `(warmed_now, units_in_redis)`.
    pub async fn warmup(&self, spec: &WarmSpec) -> RedisResult<(bool, i64)> {
        let layout = spec.layout;
        let (mut warmed_now, mut units) = (false, 0);
        for (shard, share) in layout.split(i64::from(spec.units)).into_iter().enumerate() {
            let k = self.shard_keys(spec.activity_id, layout, shard);
            let mut call = self.warmup.prepare_invoke();
            call.key(k.meta());
            for b in 0..layout.buckets {
                call.key(k.bucket(b));
            }
            call.arg(spec.start_ms)
                .arg(spec.end_ms)
                .arg(spec.per_user_limit)
                .arg(share)
                .arg(spec.price_cents);
            let (code, found): (i64, i64) = call.invoke_async(&mut self.conn.clone()).await?;
            warmed_now |= code == 0;
            units += found;
        }
        if layout.is_sharded() {
            self.write_base_meta(spec).await?;
        }
        Ok((warmed_now, units))
    }

    /// The base meta of a sharded activity (what [`RedisGate::meta`]
    /// reads): the window, limit, price and layout.
    pub(crate) async fn write_base_meta(&self, spec: &WarmSpec) -> RedisResult<()> {
        redis::cmd("HSET")
            .arg(self.keys(spec.activity_id).meta())
            .arg("start_ms")
            .arg(spec.start_ms)
            .arg("end_ms")
            .arg(spec.end_ms)
            .arg("limit")
            .arg(spec.per_user_limit)
            .arg("price")
            .arg(spec.price_cents)
            .arg("buckets")
            .arg(spec.layout.buckets)
            .arg("shards")
            .arg(spec.layout.shards)
            .query_async(&mut self.conn.clone())
            .await
    }

    /// Closes a warm activity's sale window at `now_ms` on every meta hash
    /// (the admission script reads the window there): `end_ms` moves to
    /// `now_ms` if it was later, and `start_ms` to just before it if it was
    /// later still. Idempotent; an activity never warmed is left alone.
    pub async fn end_sale(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        now_ms: i64,
    ) -> RedisResult<()> {
        let script = Script::new(
            "if redis.call('HEXISTS', KEYS[1], 'start_ms') == 0 then return 0 end \
             local now = tonumber(ARGV[1]) \
             if tonumber(redis.call('HGET', KEYS[1], 'end_ms')) > now then \
               redis.call('HSET', KEYS[1], 'end_ms', now) end \
             if tonumber(redis.call('HGET', KEYS[1], 'start_ms')) >= now then \
               redis.call('HSET', KEYS[1], 'start_ms', now - 1) end \
             return 1",
        );
        let mut metas = vec![self.keys(activity_id).meta()];
        if layout.is_sharded() {
            metas
                .extend((0..layout.shards).map(|s| self.shard_keys(activity_id, layout, s).meta()));
        }
        for meta in metas {
            let _: i64 = script
                .key(meta)
                .arg(now_ms)
                .invoke_async(&mut self.conn.clone())
                .await?;
        }
        Ok(())
    }

    /// [`RedisGate::available`] when every shard is warm, each shard's
    /// meta and buckets read in one step; `None` when one is not (never
    /// loaded, or dropped for a restore). A decision that cannot be taken
    /// back (a waiting room sold out for good) is taken on this figure:
    /// a shard being restored has no buckets for a moment, and its 0 is
    /// not "no units".
    pub async fn available_if_warm(
        &self,
        activity_id: ActivityId,
        layout: Layout,
    ) -> RedisResult<Option<i64>> {
        let mut sum = 0;
        for shard in 0..layout.shards {
            let k = self.shard_keys(activity_id, layout, shard);
            let mut call = self.shard_stock.prepare_invoke();
            call.key(k.meta());
            for b in 0..layout.buckets {
                call.key(k.bucket(b));
            }
            let units: i64 = call.invoke_async(&mut self.conn.clone()).await?;
            if units < 0 {
                return Ok(None);
            }
            sum += units;
        }
        Ok(Some(sum + self.in_transfer(activity_id, layout).await?))
    }

    /// Units available in Redis: the sum of every shard's buckets, plus
    /// units lent by one shard and not yet credited to another.
    pub async fn available(&self, activity_id: ActivityId, layout: Layout) -> RedisResult<i64> {
        let mut sum = 0;
        for shard in 0..layout.shards {
            sum += self.shard_sum(activity_id, layout, shard).await?;
        }
        Ok(sum + self.in_transfer(activity_id, layout).await?)
    }

    /// Units lent by one shard and not yet credited to another.
    pub(crate) async fn in_transfer(
        &self,
        activity_id: ActivityId,
        layout: Layout,
    ) -> RedisResult<i64> {
        let mut sum = 0;
        for t in self.transfers(activity_id, layout).await? {
            let credited: bool = redis::cmd("EXISTS")
                .arg(self.shard_keys(activity_id, layout, t.home).credited(&t.id))
                .query_async(&mut self.conn.clone())
                .await?;
            if !credited {
                sum += t.units;
            }
        }
        Ok(sum)
    }

    pub(crate) async fn shard_sum(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        shard: usize,
    ) -> RedisResult<i64> {
        let k = self.shard_keys(activity_id, layout, shard);
        let values: Vec<Option<i64>> = redis::cmd("MGET")
            .arg(k.buckets(layout.buckets))
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(values.into_iter().flatten().sum())
    }
}
