//! Leases (one holder at a time, with a lifetime) and notes (a value with a
//! lifetime) under the instance's key prefix, in Redis: the reconcile lease
//! and the last run's report. Reached without going through admission.

use redis::{RedisResult, Script};

use crate::config::RedisSettings;
use crate::store::redis_conn::{RedisClient, RedisConn};

/// Leases and notes, on a lazily connected connection of their own.
#[derive(Clone)]
pub struct Notes {
    conn: RedisConn,
    prefix: String,
}

impl Notes {
    /// Leases and notes under `redis.key_prefix`. Must be called inside a
    /// Tokio runtime (nothing connects yet).
    pub fn new(redis: &RedisSettings) -> RedisResult<Self> {
        Ok(Self {
            conn: RedisClient::new(redis)?.connect_lazy()?,
            prefix: redis.key_prefix.clone(),
        })
    }

    /// Takes the lease `name` for `owner` for `ttl_ms` unless another owner
    /// holds it; true when `owner` holds it now. See [`Notes::take_lease`].
    pub async fn try_lease(&self, name: &str, owner: &str, ttl_ms: u64) -> RedisResult<bool> {
        Ok(self.take_lease(name, owner, ttl_ms).await?.is_some())
    }

    /// Takes the lease `name` for `owner` for `ttl_ms` unless another owner
    /// holds it. Returns its fencing token: a number larger than any taken
    /// before, which every write made under the lease carries, so that a
    /// holder that lost the lease without knowing (a process paused past
    /// the lifetime) has its late writes refused where a newer holder
    /// wrote (see `reconcile/lua/fence.lua`).
    ///
    /// An owner that holds it already takes it again, with a new token: a
    /// run cut short by Redis failing (its `SET` applied, the answer or the
    /// give-back lost, as a paused Redis does on resuming) must not keep
    /// the owner's own next runs out for the lease's whole lifetime, and
    /// that earlier run, if it still goes on somewhere, is fenced off.
    pub async fn take_lease(
        &self,
        name: &str,
        owner: &str,
        ttl_ms: u64,
    ) -> RedisResult<Option<i64>> {
        let script = Script::new(
            "local cur = redis.call('GET', KEYS[1]) \
             if cur and string.match(cur, '^(.*)|%d+$') ~= ARGV[1] then return 0 end \
             local t = redis.call('TIME') \
             local token = math.max(tonumber(redis.call('GET', KEYS[2]) or '0') + 1, \
               tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)) \
             redis.call('SET', KEYS[2], token) \
             redis.call('SET', KEYS[1], ARGV[1] .. '|' .. token, 'PX', ARGV[2]) \
             return token",
        );
        let (lease, counter) = self.lease_keys(name);
        let token: i64 = script
            .key(lease)
            .key(counter)
            .arg(owner)
            .arg(ttl_ms)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok((token > 0).then_some(token))
    }

    /// Extends the lease `name` by `ttl_ms` if `owner` still holds it
    /// under `token`; false when it does not (taken by another, or again).
    pub async fn renew_lease(
        &self,
        name: &str,
        owner: &str,
        token: i64,
        ttl_ms: u64,
    ) -> RedisResult<bool> {
        let script = Script::new(
            "if redis.call('GET', KEYS[1]) == ARGV[1] then \
               return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0",
        );
        let renewed: i64 = script
            .key(self.lease_keys(name).0)
            .arg(format!("{owner}|{token}"))
            .arg(ttl_ms)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(renewed == 1)
    }

    /// Gives the lease `name` back, if `owner` still holds it.
    pub async fn end_lease(&self, name: &str, owner: &str) -> RedisResult<()> {
        let script = Script::new(
            "local cur = redis.call('GET', KEYS[1]) \
             if cur and string.match(cur, '^(.*)|%d+$') == ARGV[1] then redis.call('DEL', KEYS[1]) end \
             return 0",
        );
        let _: i64 = script
            .key(self.lease_keys(name).0)
            .arg(owner)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    /// The lease's key and its token counter, in one slot of a cluster.
    fn lease_keys(&self, name: &str) -> (String, String) {
        (
            format!("{}{{lease:{name}}}", self.prefix),
            format!("{}{{lease:{name}}}:tokens", self.prefix),
        )
    }

    /// Keeps `note` under `name` for `ttl_secs` (the last reconciliation's
    /// report, for whichever instance an operator asks).
    pub async fn put_note(&self, name: &str, note: &str, ttl_secs: u64) -> RedisResult<()> {
        redis::cmd("SET")
            .arg(format!("{}note:{name}", self.prefix))
            .arg(note)
            .arg("EX")
            .arg(ttl_secs.max(1))
            .query_async(&mut self.conn.clone())
            .await
    }

    /// The note kept under `name`, if it has not expired.
    pub async fn note(&self, name: &str) -> RedisResult<Option<String>> {
        redis::cmd("GET")
            .arg(format!("{}note:{name}", self.prefix))
            .query_async(&mut self.conn.clone())
            .await
    }
}
