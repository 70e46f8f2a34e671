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

/// Whether a buyer's coupon can back an order (`lua/use.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Use {
    /// Held for the order now.
    Held,
    /// Redis does not hold the batch (lost, or never warmed).
    Unknown,
    /// The buyer never claimed one.
    NotHeld,
    /// Past `valid_until`.
    Expired,
    /// The order's amount is below the coupon's minimum.
    BelowMinimum,
    /// It backs another order, live or paid.
    InUse,
}

impl Use {
    /// Why the coupon cannot back the order, in words; `None` when held.
    pub fn refusal(self) -> Option<&'static str> {
        Some(match self {
            Self::Held => return None,
            Self::Unknown => "the coupon batch is unknown",
            Self::NotHeld => "you hold no coupon of this batch",
            Self::Expired => "the coupon has expired",
            Self::BelowMinimum => "the order is below the coupon's minimum amount",
            Self::InUse => "the coupon already backs another order",
        })
    }
}

impl TryFrom<i64> for Use {
    type Error = redis::RedisError;

    /// An unknown code is an error, never a default.
    fn try_from(code: i64) -> Result<Self, Self::Error> {
        Ok(match code {
            0 => Self::Held,
            1 => Self::Unknown,
            2 => Self::NotHeld,
            3 => Self::Expired,
            4 => Self::BelowMinimum,
            5 => Self::InUse,
            other => {
                return Err(redis::RedisError::from((
                    redis::ErrorKind::UnexpectedReturnType,
                    "unknown reply of use.lua",
                    other.to_string(),
                )));
            }
        })
    }
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

    /// Hash: remaining, valid_until_ms, min_amount.
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

    /// Hash user → the order_no the user's coupon backs (locked by a live
    /// order, or used by a paid one): admission holds it here before a
    /// 202 (`lua/use.lua`), so an order that could not use it is refused
    /// then, never FAILED after its 202.
    pub fn uses(&self) -> String {
        format!("{}uses", self.base)
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

/// A lost batch as the database knows it ([`CouponGate::restore`]).
pub struct Restored<'a> {
    /// The batch.
    pub coupon_id: CouponId,
    /// Coupons left to claim.
    pub remaining: i64,
    /// Its end, unix ms.
    pub valid_until_ms: i64,
    /// The least order amount it applies to (cents).
    pub min_amount_cents: i64,
    /// Every claim: (user, request id).
    pub claims: &'a [(i64, String)],
    /// Every coupon backing an order, LOCKED or USED: (user, order_no).
    pub holds: &'a [(i64, i64)],
}

/// Coupon scripts over the shared multiplexed connection.
pub struct CouponGate {
    conn: RedisConn,
    prefix: String,
    claim: Script,
    unclaim: Script,
    hold: Script,
    unhold: Script,
}

impl CouponGate {
    /// A gate on `conn` (the admission gate's connection).
    pub fn new(conn: RedisConn, prefix: &str) -> Self {
        Self {
            conn,
            prefix: prefix.to_owned(),
            claim: Script::new(include_str!("lua/claim.lua")),
            unclaim: Script::new(include_str!("lua/unclaim.lua")),
            hold: Script::new(include_str!("lua/use.lua")),
            unhold: Script::new(include_str!("lua/unuse.lua")),
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
        min_amount_cents: i64,
    ) -> RedisResult<()> {
        redis::cmd("HSET")
            .arg(self.keys(coupon_id).meta())
            .arg("remaining")
            .arg(total)
            .arg("valid_until_ms")
            .arg(valid_until_ms)
            .arg("min_amount")
            .arg(min_amount_cents)
            .query_async(&mut self.conn.clone())
            .await
    }

    /// Holds the buyer's coupon for `order_no` if it can back it
    /// (`lua/use.lua`): claimed, valid at `now_ms`, `amount_cents` at
    /// least its minimum, and backing no other order.
    pub async fn hold(
        &self,
        coupon_id: CouponId,
        user_id: i64,
        order_no: i64,
        amount_cents: i64,
        now_ms: i64,
    ) -> RedisResult<Use> {
        let k = self.keys(coupon_id);
        let code: i64 = self
            .hold
            .key(k.meta())
            .key(k.claimants())
            .key(k.uses())
            .arg(user_id)
            .arg(order_no)
            .arg(amount_cents)
            .arg(now_ms)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Use::try_from(code)
    }

    /// Frees the coupon held for `order_no` (nothing kept, or the order
    /// FAILED, was cancelled or closed); a later order's hold stays.
    pub async fn unhold(
        &self,
        coupon_id: CouponId,
        user_id: i64,
        order_no: i64,
    ) -> RedisResult<bool> {
        let freed: i64 = self
            .unhold
            .key(self.keys(coupon_id).uses())
            .arg(user_id)
            .arg(order_no)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(freed == 1)
    }

    /// Every hold of the batch: (user, order_no).
    pub async fn holds_of(&self, coupon_id: CouponId) -> RedisResult<Vec<(i64, i64)>> {
        redis::cmd("HGETALL")
            .arg(self.keys(coupon_id).uses())
            .query_async(&mut self.conn.clone())
            .await
    }

    /// Holds `user_id`'s coupon for `order_no` unless it holds one already
    /// (the database's LOCKED or USED coupons, which Redis missed).
    pub async fn hold_if_free(
        &self,
        coupon_id: CouponId,
        user_id: i64,
        order_no: i64,
    ) -> RedisResult<bool> {
        redis::cmd("HSETNX")
            .arg(self.keys(coupon_id).uses())
            .arg(user_id)
            .arg(order_no)
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
    /// twice), every coupon backing an order, then the meta with what is
    /// left.
    pub async fn restore(&self, b: &Restored<'_>, fence: i64) -> RedisResult<()> {
        let k = self.keys(b.coupon_id);
        let claims = b.claims;
        let mut w = Writes::default();
        let stale = [k.claimants(), k.requests(), k.unconfirmed(), k.uses()];
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
        for chunk in b.holds.chunks(500) {
            w.on(
                &k.uses(),
                command(
                    "HSET",
                    std::iter::once(k.uses()).chain(
                        chunk
                            .iter()
                            .flat_map(|(u, o)| [u.to_string(), o.to_string()]),
                    ),
                ),
            );
        }
        w.on(
            &k.meta(),
            command(
                "HSET",
                [
                    k.meta(),
                    "remaining".into(),
                    b.remaining.max(0).to_string(),
                    "valid_until_ms".into(),
                    b.valid_until_ms.to_string(),
                    "min_amount".into(),
                    b.min_amount_cents.to_string(),
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
