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
    /// holds it; true when `owner` holds it now.
    ///
    /// An owner that holds it already takes it again: a run cut short by
    /// Redis failing (its `SET` applied, the answer or the give-back lost,
    /// as a paused Redis does on resuming) must not keep the owner's own
    /// next runs out for the lease's whole lifetime.
    pub async fn try_lease(&self, name: &str, owner: &str, ttl_ms: u64) -> RedisResult<bool> {
        let script = Script::new(
            "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end \
             if redis.call('GET', KEYS[1]) == ARGV[1] then \
               redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end \
             return 0",
        );
        let taken: i64 = script
            .key(format!("{}lease:{name}", self.prefix))
            .arg(owner)
            .arg(ttl_ms)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(taken == 1)
    }

    /// Gives the lease `name` back, if `owner` still holds it.
    pub async fn end_lease(&self, name: &str, owner: &str) -> RedisResult<()> {
        let script = Script::new(
            "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end return 0",
        );
        let _: i64 = script
            .key(format!("{}lease:{name}", self.prefix))
            .arg(owner)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(())
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
