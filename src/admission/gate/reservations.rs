//! A reservation's life after admission: release (`lua/release.lua`),
//! acknowledgement (`lua/ack.lua`), sending (`lua/sending.lua`), void
//! (`lua/void.lua`), commit (`lua/commit.lua`), and its record.

use redis::RedisResult;

use super::{RedisGate, by_shard};
use crate::admission::keys::Layout;
use crate::bus::events::OrderRequested;
use crate::domain::{ActivityId, CouponId};
use crate::ids::OrderNo;

/// Why a reservation is released; recorded on the reservation.
#[derive(Debug, Clone, Copy)]
pub enum ReleaseReason {
    /// The order event could not be published; nothing was kept.
    PublishFailed,
    /// The database could not back the order (it is FAILED).
    OrderFailed,
    /// The order was cancelled or closed after it was created; the units
    /// come back even if Redis lost the reservation record.
    OrderReleased { user_id: i64, quantity: i32 },
}

impl ReleaseReason {
    fn as_str(self) -> &'static str {
        match self {
            Self::PublishFailed => "PUBLISH_FAILED",
            Self::OrderFailed => "ORDER_FAILED",
            Self::OrderReleased { .. } => "ORDER_RELEASED",
        }
    }
}

/// What a release for an undelivered publish did ([`RedisGate::release_unsent`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unsent {
    /// Released now, its request_id forgotten: nothing was kept.
    Released,
    /// Released before, or its record is gone.
    Gone,
    /// Kept: a retry's send of the same event was acknowledged, or its
    /// order was written already. The order exists.
    Kept,
}

impl RedisGate {
    /// Gives a reservation's stock back; idempotent per order. Returns
    /// whether this call released it.
    pub async fn release(
        &self,
        activity_id: ActivityId,
        order_no: i64,
        layout: Layout,
        reason: ReleaseReason,
    ) -> RedisResult<bool> {
        Ok(self
            .release_code(activity_id, order_no, layout, reason)
            .await?
            == 1)
    }

    /// The release of a purchase whose publish definitely did not deliver
    /// its event: the reservation goes, and its request_id with it, unless
    /// the order exists after all (a retry of the purchase sent the same
    /// event and got it acknowledged, or a consumer already wrote it): an
    /// acknowledged purchase is never undone.
    pub async fn release_unsent(
        &self,
        activity_id: ActivityId,
        order_no: i64,
        layout: Layout,
    ) -> RedisResult<Unsent> {
        match self
            .release_code(activity_id, order_no, layout, ReleaseReason::PublishFailed)
            .await?
        {
            1 => Ok(Unsent::Released),
            0 => Ok(Unsent::Gone),
            2 => Ok(Unsent::Kept),
            other => Err(redis::RedisError::from((
                redis::ErrorKind::UnexpectedReturnType,
                "unknown reply of release.lua",
                other.to_string(),
            ))),
        }
    }

    /// The cap of the purchase token a reservation was made with (`None`:
    /// the per-user limit), to give the same token back when it is
    /// released unsent.
    pub async fn reservation_most(
        &self,
        activity_id: ActivityId,
        order_no: i64,
        layout: Layout,
    ) -> RedisResult<Option<u32>> {
        let k = self.order_keys(activity_id, layout, order_no);
        redis::cmd("HGET")
            .arg(k.reservation(order_no))
            .arg("most")
            .query_async(&mut self.conn())
            .await
    }

    /// The order number `request_id` of `user_id` is bound to, if a
    /// purchase under it was admitted (the same record `reserve.lua`
    /// answers a replay from).
    pub async fn requested_order(
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
            .query_async(&mut self.conn())
            .await
    }

    async fn release_code(
        &self,
        activity_id: ActivityId,
        order_no: i64,
        layout: Layout,
        reason: ReleaseReason,
    ) -> RedisResult<i64> {
        let k = self.order_keys(activity_id, layout, order_no);
        let mut call = self.release.prepare_invoke();
        call.key(k.reservation(order_no))
            .key(k.open())
            .key(k.holdings())
            .key(k.requests());
        for b in 0..layout.buckets {
            call.key(k.bucket(b));
        }
        let forget = matches!(reason, ReleaseReason::PublishFailed);
        // Units to restore when Redis lost the record: only for an order the
        // database had backed (cancelled / closed); nothing otherwise.
        let (user, fallback) = match reason {
            ReleaseReason::OrderReleased { user_id, quantity } => (user_id, quantity),
            _ => (0, 0),
        };
        call.arg(order_no)
            .arg(reason.as_str())
            .arg(if forget { "1" } else { "0" })
            .arg(fallback)
            .arg(user)
            .arg(&self.returned)
            .arg(activity_id);
        call.invoke_async(&mut self.conn.clone()).await
    }

    /// Records that the broker acknowledged the events of `order_nos` (one
    /// activity): an open reservation is never voided from then on. Returns
    /// the status each reservation had (`None` when its record is gone);
    /// [`Status::Occupied`] means it is acknowledged now.
    pub async fn ack(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        order_nos: &[i64],
        now_ms: i64,
    ) -> RedisResult<Vec<Option<Status>>> {
        let mut found = vec![None; order_nos.len()];
        for (shard, group) in by_shard(layout, order_nos) {
            let k = self.shard_keys(activity_id, layout, shard);
            let mut call = self.ack.prepare_invoke();
            for &(_, o) in &group {
                call.key(k.reservation(o));
            }
            let statuses: Vec<String> = call
                .arg(now_ms)
                .invoke_async(&mut self.conn.clone())
                .await?;
            for ((i, _), s) in group.iter().zip(statuses) {
                found[*i] = Status::parse(&s);
            }
        }
        Ok(found)
    }

    /// Reads a reservation before its event is sent again; an open,
    /// unacknowledged one has its `sent` time moved to `now_ms` in the same
    /// call (see `sending.lua`). `None` when the record is gone.
    pub async fn sending(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        order_no: i64,
        now_ms: i64,
    ) -> RedisResult<Option<Reservation>> {
        let fields: Vec<String> = self
            .sending
            .key(
                self.order_keys(activity_id, layout, order_no)
                    .reservation(order_no),
            )
            .arg(now_ms)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(Reservation::from_fields(&fields))
    }

    /// Claims an open, unacknowledged reservation not made or sent since
    /// `cutoff_ms` for voiding (`void.lua`).
    pub async fn claim_void(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        order_no: i64,
        cutoff_ms: i64,
    ) -> RedisResult<VoidClaim> {
        let code: i64 = self
            .void
            .key(
                self.order_keys(activity_id, layout, order_no)
                    .reservation(order_no),
            )
            .arg(cutoff_ms)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(match code {
            1 => VoidClaim::Claimed,
            0 => VoidClaim::Refused,
            _ => VoidClaim::Gone,
        })
    }

    /// The status of each of `order_nos`' reservations (one activity), in
    /// one round trip per shard; `None` where the record is gone.
    pub async fn statuses(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        order_nos: &[i64],
    ) -> RedisResult<Vec<Option<Status>>> {
        let mut found = vec![None; order_nos.len()];
        for (shard, group) in by_shard(layout, order_nos) {
            let k = self.shard_keys(activity_id, layout, shard);
            let mut pipe = redis::pipe();
            for &(_, o) in &group {
                pipe.hget(k.reservation(o), "status");
            }
            let statuses: Vec<Option<String>> = pipe.query_async(&mut self.conn.clone()).await?;
            for ((i, _), s) in group.iter().zip(statuses) {
                found[*i] = s.as_deref().and_then(Status::parse);
            }
        }
        Ok(found)
    }

    /// Marks reservations of orders now in the database as committed;
    /// idempotent. Returns the order_nos that had been released meanwhile.
    pub async fn commit(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        order_nos: &[i64],
    ) -> RedisResult<Vec<i64>> {
        let mut conflicts = Vec::new();
        for (shard, group) in by_shard(layout, order_nos) {
            let k = self.shard_keys(activity_id, layout, shard);
            let mut call = self.commit.prepare_invoke();
            call.key(k.open());
            for &(_, o) in &group {
                call.key(k.reservation(o)).arg(o);
            }
            let found: Vec<i64> = call.invoke_async(&mut self.conn.clone()).await?;
            conflicts.extend(found);
        }
        Ok(conflicts)
    }

    /// The reservation record of an order, if Redis has it.
    pub async fn reservation(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        order_no: i64,
    ) -> RedisResult<Option<Reservation>> {
        let fields: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(
                self.order_keys(activity_id, layout, order_no)
                    .reservation(order_no),
            )
            .arg(&Reservation::FIELDS)
            .query_async(&mut self.conn.clone())
            .await?;
        let fields: Vec<String> = fields.into_iter().map(Option::unwrap_or_default).collect();
        Ok(Reservation::from_fields(&fields))
    }
}

/// Where a reservation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Stock held; the order is not in the database yet.
    Occupied,
    /// Its order is in the database (WAITING_PAY or later).
    Committed,
    /// Its stock went back (publish failed, order failed, voided,
    /// cancelled or closed).
    Released,
    /// The reconciler is voiding it (arbitration by the order row).
    Voiding,
}

impl Status {
    fn parse(raw: &str) -> Option<Self> {
        Some(match raw {
            "occupied" => Self::Occupied,
            "committed" => Self::Committed,
            "released" => Self::Released,
            "voiding" => Self::Voiding,
            _ => return None,
        })
    }
}

/// What [`RedisGate::claim_void`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VoidClaim {
    /// The reservation is the caller's to void.
    Claimed,
    /// Acknowledged, recently made or sent, or no longer open: left alone.
    Refused,
    /// The record is gone.
    Gone,
}

/// A reservation as stored in Redis.
#[derive(Debug, Clone)]
pub struct Reservation {
    /// Where it stands.
    pub status: Status,
    /// Whether the broker acknowledged its event (never voided then).
    pub acked: bool,
    /// The buyer.
    pub user_id: i64,
    /// Units reserved.
    pub quantity: i32,
    /// The client's idempotency key.
    pub request_id: String,
    /// When it was made (unix ms): the event's `reserved_at_ms`.
    pub reserved_at_ms: i64,
    /// The coupon the purchase named.
    pub coupon_id: Option<CouponId>,
}

impl Reservation {
    /// The hash fields read, in [`Reservation::from_fields`]' order (the
    /// order `sending.lua` returns them in).
    const FIELDS: [&'static str; 7] = ["status", "acked", "user", "qty", "req", "ts", "coupon"];

    /// From the values of [`Reservation::FIELDS`] (`""` for a missing one);
    /// `None` unless the record is whole.
    fn from_fields(f: &[String]) -> Option<Self> {
        let [status, acked, user, qty, req, ts, coupon] = f else {
            return None;
        };
        Some(Self {
            status: Status::parse(status)?,
            acked: !acked.is_empty(),
            user_id: user.parse().ok()?,
            quantity: qty.parse().ok()?,
            request_id: req.clone(),
            reserved_at_ms: ts.parse().unwrap_or(0),
            coupon_id: coupon.parse().ok(),
        })
    }

    /// Whether its stock went back.
    pub fn released(&self) -> bool {
        self.status == Status::Released
    }

    /// Open: between admission and the order row, and not being voided.
    pub fn is_open(&self) -> bool {
        self.status == Status::Occupied
    }

    /// The `order.requested` event admission published for it, rebuilt
    /// byte for byte (the consumers deduplicate by its event_id).
    pub fn event(&self, activity_id: ActivityId, order_no: i64) -> OrderRequested {
        OrderRequested {
            event_id: order_no.to_string(),
            order_no: OrderNo::new(order_no),
            activity_id,
            user_id: self.user_id,
            request_id: self.request_id.clone(),
            quantity: self.quantity,
            coupon_id: self.coupon_id,
            reserved_at_ms: self.reserved_at_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(v: [&str; 7]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn a_reservation_rebuilds_the_event_admission_published() {
        let r = Reservation::from_fields(&fields([
            "occupied",
            "",
            "7",
            "2",
            "req-1",
            "1700000000000",
            "3",
        ]))
        .expect("whole record");
        assert!(r.is_open() && !r.acked);
        let published = OrderRequested {
            event_id: "42".into(),
            order_no: OrderNo::new(42),
            activity_id: ActivityId::new(9),
            user_id: 7,
            request_id: "req-1".into(),
            quantity: 2,
            coupon_id: Some(CouponId::new(3)),
            reserved_at_ms: 1_700_000_000_000,
        };
        assert_eq!(r.event(ActivityId::new(9), 42).encode(), published.encode());
    }

    #[test]
    fn a_partial_or_unknown_record_is_no_reservation() {
        assert!(Reservation::from_fields(&fields(["", "", "", "", "", "", ""])).is_none());
        assert!(Reservation::from_fields(&fields(["odd", "", "7", "1", "r", "1", ""])).is_none());
        let acked = Reservation::from_fields(&fields(["occupied", "5", "7", "1", "r", "1", ""]))
            .expect("whole");
        assert!(acked.acked && acked.coupon_id.is_none());
    }
}
