//! The Redis side of coupons. Keys carry the hash tag `{c:<coupon_id>}`.

use redis::{RedisResult, Script};

use crate::domain::CouponId;
use crate::store::fenced::{Writes, command};
use crate::store::redis_conn::RedisConn;

/// What the claim script decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// Claimed now.
    Claimed,
    /// This request_id claimed it before.
    Replay,
    /// None left.
    Exhausted,
    /// The user holds one already.
    AlreadyClaimed,
    /// Past `valid_until`.
    Expired,
    /// No such batch in Redis.
    Unknown,
}

/// Keys of one coupon batch.
pub struct CouponKeys {
    base: String,
}

impl CouponKeys {
    /// Keys for `coupon_id` under `prefix`.
    pub fn new(prefix: &str, coupon_id: CouponId) -> Self {
        Self {
            base: format!("{prefix}{{c:{coupon_id}}}:"),
        }
    }

    /// Hash: remaining, valid_until_ms.
    pub fn meta(&self) -> String {
        format!("{}meta", self.base)
    }

    /// Set of user ids holding one.
    pub fn claimants(&self) -> String {
        format!("{}claimed", self.base)
    }

    /// Hash `"<user>:<request_id>"` → 1.
    pub fn requests(&self) -> String {
        format!("{}reqs", self.base)
    }

    /// Sorted set `"<user>:<request_id>"` → claimed at (unix ms): claims
    /// whose event's delivery is not confirmed yet.
    pub fn unconfirmed(&self) -> String {
        format!("{}unconfirmed", self.base)
    }

    /// When the batch was first seen lost (unix ms), until it is restored.
    pub fn lost(&self) -> String {
        format!("{}lost", self.base)
    }

    /// The highest reconcile lease token that wrote in this slot
    /// (`store::fenced`).
    pub fn fence(&self) -> String {
        format!("{}fence", self.base)
    }
}

/// Coupon scripts over the shared multiplexed connection.
pub struct CouponGate {
    conn: RedisConn,
    prefix: String,
    claim: Script,
    unclaim: Script,
}

impl CouponGate {
    /// A gate on `conn` (the admission gate's connection).
    pub fn new(conn: RedisConn, prefix: &str) -> Self {
        Self {
            conn,
            prefix: prefix.to_owned(),
            claim: Script::new(include_str!("lua/claim.lua")),
            unclaim: Script::new(include_str!("lua/unclaim.lua")),
        }
    }

    /// Keys of a batch.
    pub fn keys(&self, coupon_id: CouponId) -> CouponKeys {
        CouponKeys::new(&self.prefix, coupon_id)
    }

    /// Loads a new batch (`remaining = total`).
    pub async fn warm(
        &self,
        coupon_id: CouponId,
        total: i32,
        valid_until_ms: i64,
    ) -> RedisResult<()> {
        redis::cmd("HSET")
            .arg(self.keys(coupon_id).meta())
            .arg("remaining")
            .arg(total)
            .arg("valid_until_ms")
            .arg(valid_until_ms)
            .query_async(&mut self.conn.clone())
            .await
    }

    /// Whether Redis holds the batch.
    pub async fn is_warm(&self, coupon_id: CouponId) -> RedisResult<bool> {
        redis::cmd("EXISTS")
            .arg(self.keys(coupon_id).meta())
            .query_async(&mut self.conn.clone())
            .await
    }

    /// When the batch was first seen lost (unix ms): `now_ms` if this is
    /// the first time.
    pub async fn lost_since(&self, coupon_id: CouponId, now_ms: i64) -> RedisResult<i64> {
        crate::store::redis_conn::first_seen(&self.conn, &self.keys(coupon_id).lost(), now_ms).await
    }

    /// Rebuilds a lost batch from a database snapshot, in one atomic call
    /// fenced with the reconcile lease token `fence` (a run that lost its
    /// lease restores nothing over a newer one's): every claim's user and
    /// request id (a replay answers as before, a holder cannot claim
    /// twice), then the meta with what is left.
    pub async fn restore(
        &self,
        coupon_id: CouponId,
        remaining: i64,
        valid_until_ms: i64,
        claims: &[(i64, String)],
        fence: i64,
    ) -> RedisResult<()> {
        let k = self.keys(coupon_id);
        let mut w = Writes::default();
        let stale = [k.claimants(), k.requests(), k.unconfirmed()];
        w.cmd(&stale, command("DEL", &stale));
        for chunk in claims.chunks(500) {
            w.on(
                &k.claimants(),
                command(
                    "SADD",
                    std::iter::once(k.claimants()).chain(chunk.iter().map(|(u, _)| u.to_string())),
                ),
            );
            let mut hset = vec!["HSET".to_owned(), k.requests()];
            for (user, request_id) in chunk {
                hset.push(format!("{user}:{request_id}"));
                hset.push("1".to_owned());
            }
            w.on(&k.requests(), hset);
        }
        w.on(
            &k.meta(),
            command(
                "HSET",
                [
                    k.meta(),
                    "remaining".into(),
                    remaining.max(0).to_string(),
                    "valid_until_ms".into(),
                    valid_until_ms.to_string(),
                ],
            ),
        );
        w.on(&k.lost(), command("DEL", [k.lost()]));
        w.run(&self.conn, &k.fence(), fence).await
    }

    /// Runs the claim script.
    pub async fn claim(
        &self,
        coupon_id: CouponId,
        user_id: i64,
        request_id: &str,
        now_ms: i64,
    ) -> RedisResult<Claim> {
        let k = self.keys(coupon_id);
        let code: i64 = self
            .claim
            .key(k.meta())
            .key(k.claimants())
            .key(k.requests())
            .key(k.unconfirmed())
            .arg(user_id)
            .arg(request_id)
            .arg(now_ms)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(match code {
            0 => Claim::Claimed,
            1 => Claim::Replay,
            2 => Claim::Exhausted,
            3 => Claim::AlreadyClaimed,
            4 => Claim::Expired,
            _ => Claim::Unknown,
        })
    }

    /// Undoes a claim (its event was not published); idempotent.
    pub async fn unclaim(
        &self,
        coupon_id: CouponId,
        user_id: i64,
        request_id: &str,
    ) -> RedisResult<bool> {
        let k = self.keys(coupon_id);
        let undone: i64 = self
            .unclaim
            .key(k.meta())
            .key(k.claimants())
            .key(k.requests())
            .key(k.unconfirmed())
            .arg(user_id)
            .arg(request_id)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(undone == 1)
    }

    /// The claim's event was delivered: it is no longer sent again.
    pub async fn confirm(
        &self,
        coupon_id: CouponId,
        user_id: i64,
        request_id: &str,
    ) -> RedisResult<()> {
        redis::cmd("ZREM")
            .arg(self.keys(coupon_id).unconfirmed())
            .arg(format!("{user_id}:{request_id}"))
            .query_async(&mut self.conn.clone())
            .await
    }

    /// Claims made before `before_ms` whose delivery was never confirmed
    /// (its answer lost with the process that sent it, or never heard):
    /// (user, request_id, claimed at), at most `limit`.
    pub async fn unconfirmed(
        &self,
        coupon_id: CouponId,
        before_ms: i64,
        limit: usize,
    ) -> RedisResult<Vec<(i64, String, i64)>> {
        let found: Vec<(String, i64)> = redis::cmd("ZRANGEBYSCORE")
            .arg(self.keys(coupon_id).unconfirmed())
            .arg("-inf")
            .arg(format!("({before_ms}"))
            .arg("WITHSCORES")
            .arg("LIMIT")
            .arg(0)
            .arg(limit)
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(found
            .into_iter()
            .filter_map(|(field, at)| {
                let (user, request_id) = field.split_once(':')?;
                Some((user.parse().ok()?, request_id.to_owned(), at))
            })
            .collect())
    }

    /// Whether `user_id` holds a coupon of the batch (the admission check).
    pub async fn holds(&self, coupon_id: CouponId, user_id: i64) -> RedisResult<bool> {
        redis::cmd("SISMEMBER")
            .arg(self.keys(coupon_id).claimants())
            .arg(user_id)
            .query_async(&mut self.conn.clone())
            .await
    }

    /// Coupons left in Redis (None if the batch is unknown there).
    pub async fn remaining(&self, coupon_id: CouponId) -> RedisResult<Option<i64>> {
        redis::cmd("HGET")
            .arg(self.keys(coupon_id).meta())
            .arg("remaining")
            .query_async(&mut self.conn.clone())
            .await
    }
}
