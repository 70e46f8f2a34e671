//! The admission script (`lua/reserve.lua`, SPEC step 1): replay, token,
//! per-user limit, stock and reservation in one call; in a sharded
//! activity, borrowing from the other shards when the buyer's is short.

use redis::RedisResult;

use super::RedisGate;
use super::attempt::{Admission, ReserveRequest};
use super::lending::{BORROW_ROUNDS, DRY_MS, IN_FLIGHT_PAUSE, Lend, STALE_TRANSFER_MS};
use crate::admission::keys::Layout;
use crate::domain::ActivityId;

impl RedisGate {
    /// Runs the admission script (one `EVALSHA`) in the buyer's shard. In
    /// a sharded activity whose buyer's shard lacks the units, borrows a
    /// batch from another shard and runs it again; SOLD_OUT only once
    /// every other shard had none to lend and none on its way, and the
    /// buyer's shard, looked at after them, had none either.
    pub async fn reserve(&self, r: &ReserveRequest<'_>) -> RedisResult<Admission> {
        let home = r.layout.shard_of_user(r.user_id);
        let mut rounds = 0;
        let mut settled = false;
        loop {
            if rounds == BORROW_ROUNDS {
                // Units kept moving between shards, or sat in a transfer
                // whose process died between lend and credit: the stale
                // ones are completed here, once, and the rounds run again.
                // Still nothing: retry shortly (units exist, so never
                // SOLD_OUT).
                if !settled {
                    let before_ms = r.now_ms.saturating_sub(STALE_TRANSFER_MS);
                    settled = true;
                    if self
                        .settle_transfers(r.activity_id, r.layout, before_ms)
                        .await?
                        > 0
                    {
                        rounds = 0;
                        continue;
                    }
                }
                return Ok(Admission::InTransit);
            }
            rounds += 1;
            if let Some(found) = self.reserve_in(r, home).await? {
                return Ok(found);
            }
            match self.borrow_round(r, home).await? {
                Lend::Lent => continue,
                Lend::InFlight => tokio::time::sleep(IN_FLIGHT_PAUSE).await,
                Lend::Nothing => {
                    // A transfer into this shard that finished before the
                    // donors were asked is in its buckets now.
                    if let Some(found) = self.reserve_in(r, home).await? {
                        return Ok(found);
                    }
                    // Sold out everywhere; said so from this shard for a
                    // moment without asking the others again.
                    let _: () = redis::cmd("SET")
                        .arg(self.shard_keys(r.activity_id, r.layout, home).dry())
                        .arg(1)
                        .arg("PX")
                        .arg(DRY_MS)
                        .query_async(&mut self.conn.clone())
                        .await?;
                    return Ok(Admission::SoldOut);
                }
            }
        }
    }

    /// The order a buyer's request id is already bound to, if any: one
    /// `HGET` of what the admission script records, in the buyer's shard.
    /// A retry is answered from it before any check could refuse it.
    pub async fn bound_order(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        user_id: i64,
        request_id: &str,
    ) -> RedisResult<Option<i64>> {
        let k = self.shard_keys(activity_id, layout, layout.shard_of_user(user_id));
        redis::cmd("HGET")
            .arg(k.requests())
            .arg(format!("{user_id}:{request_id}"))
            .query_async(&mut self.conn.clone())
            .await
    }

    /// The admission script in one shard; `None` when the shard lacks the
    /// units and others may not (sharded activities only).
    async fn reserve_in(
        &self,
        r: &ReserveRequest<'_>,
        shard: usize,
    ) -> RedisResult<Option<Admission>> {
        let buckets = r.layout.buckets;
        let k = self.shard_keys(r.activity_id, r.layout, shard);
        let mut call = self.reserve.prepare_invoke();
        call.key(k.meta())
            .key(k.requests())
            .key(k.holdings())
            .key(k.token(r.token))
            .key(k.reservation(r.order_no))
            .key(k.open())
            .key(k.dry());
        for b in 0..buckets {
            call.key(k.bucket(b));
        }
        let first_bucket = if buckets > 1 {
            fastrand::usize(..buckets)
        } else {
            0
        };
        call.arg(r.user_id)
            .arg(r.request_id)
            .arg(r.quantity)
            .arg(r.order_no)
            .arg(r.now_ms)
            .arg(first_bucket)
            .arg(self.reservation_ttl_secs)
            .arg(r.coupon_id.map(|c| c.to_string()).unwrap_or_default())
            .arg(if r.layout.is_sharded() { "1" } else { "0" });
        let (code, order_no): (i64, String) = match &self.pool {
            None => call.invoke_async(&mut self.conn.clone()).await?,
            Some(pool) => {
                let mut conn = pool.get().await.map_err(|e| {
                    redis::RedisError::from((
                        redis::ErrorKind::Io,
                        "no pooled connection",
                        e.to_string(),
                    ))
                })?;
                call.invoke_async(&mut conn).await?
            }
        };
        let order_no = || order_no.parse::<i64>().unwrap_or(0);
        Ok(Some(match Reply::try_from(code)? {
            Reply::Accepted => Admission::Accepted(order_no()),
            Reply::Duplicate => Admission::Duplicate(order_no()),
            Reply::SoldOut => Admission::SoldOut,
            Reply::LimitExceeded => Admission::LimitExceeded,
            Reply::InvalidToken => Admission::InvalidToken,
            Reply::NotActive => Admission::NotActive,
            Reply::NotWarm => Admission::NotWarm,
            Reply::NumberTaken => Admission::NumberTaken,
            Reply::ShardShort => return Ok(None),
        }))
    }
}

/// The reply code of `lua/reserve.lua` (its header lists them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reply {
    Accepted,
    Duplicate,
    SoldOut,
    LimitExceeded,
    InvalidToken,
    NotActive,
    NotWarm,
    NumberTaken,
    /// This shard lacks the quantity and others may not.
    ShardShort,
}

impl TryFrom<i64> for Reply {
    type Error = redis::RedisError;

    /// An unknown code is an error, never a default.
    fn try_from(code: i64) -> Result<Self, Self::Error> {
        Ok(match code {
            0 => Self::Accepted,
            1 => Self::Duplicate,
            2 => Self::SoldOut,
            3 => Self::LimitExceeded,
            4 => Self::InvalidToken,
            5 => Self::NotActive,
            6 => Self::NotWarm,
            7 => Self::NumberTaken,
            8 => Self::ShardShort,
            other => {
                return Err(redis::RedisError::from((
                    redis::ErrorKind::UnexpectedReturnType,
                    "unknown reply of reserve.lua",
                    other.to_string(),
                )));
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Reply;

    #[test]
    fn every_reply_of_the_script_is_known_and_an_unknown_one_is_an_error() {
        for code in 0..=8 {
            assert!(Reply::try_from(code).is_ok(), "{code}");
        }
        assert!(Reply::try_from(9).is_err());
        assert!(Reply::try_from(-1).is_err());
    }
}
