//! A coupon claim, shaped like `admission::admit`: ONE Lua call in Redis,
//! then the `coupon.claimed` event. Delivered: the claim holds (new, or a
//! replay of its request id). Definitely not delivered: the claim is undone.
//! Unknown: the claim is kept, for a retry with the same request id to send
//! again, and for reconciliation to send it again if nobody does
//! (`reconcile/coupons.rs`); never undone on an unknown outcome.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use super::gate::{Claim, CouponGate};
use crate::bus::events::CouponClaimed;
use crate::bus::{Producer, PublishError};
use crate::clock::SharedClock;
use crate::domain::CouponId;
use crate::store::{self, PgPool};

/// A claim that holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claimed {
    /// Claimed now.
    New,
    /// This request id claimed it before.
    Replay,
}

/// Why a claim does not hold (or not yet).
#[derive(Debug)]
pub enum ClaimRefusal {
    /// None left.
    Exhausted,
    /// The user holds one of the batch under another request id.
    AlreadyClaimed,
    /// Past the batch's `valid_until`.
    Expired,
    /// No such batch.
    NotFound,
    /// Redis lost the batch; it is being restored (retry shortly).
    Restoring,
    /// The event was definitely not delivered; the claim was undone.
    NotKept,
    /// The delivery is not confirmed yet; the claim is kept (retry with
    /// the same request id).
    Unconfirmed,
    /// Redis or the database failed.
    Unavailable(anyhow::Error),
}

/// What a claim needs.
pub struct Claims {
    /// The batches in Redis.
    pub gate: Arc<CouponGate>,
    /// The batches' rows (is a batch Redis does not know real?).
    pub db: PgPool,
    /// Sends `coupon.claimed`.
    pub producer: Producer,
    /// `coupon.claimed` under this instance's prefix.
    pub topic: String,
    /// How long a claim waits for its delivery report.
    pub budget: Duration,
    /// The sale clock (expiry).
    pub clock: SharedClock,
    /// Wakes the local reconciler: Redis lost a batch.
    pub restore_wanted: Arc<Notify>,
}

impl Claims {
    /// Claims one coupon of `coupon_id` for `user_id` under `request_id`.
    pub async fn claim(
        &self,
        coupon_id: CouponId,
        user_id: i64,
        request_id: String,
    ) -> Result<Claimed, ClaimRefusal> {
        let now_ms = self.clock.now_ms();
        let unavailable = |e: redis::RedisError| ClaimRefusal::Unavailable(e.into());
        let claimed = match self
            .gate
            .claim(coupon_id, user_id, &request_id, now_ms)
            .await
            .map_err(unavailable)?
        {
            Claim::Claimed => Claimed::New,
            Claim::Replay => Claimed::Replay,
            Claim::Exhausted => return Err(ClaimRefusal::Exhausted),
            Claim::AlreadyClaimed => return Err(ClaimRefusal::AlreadyClaimed),
            Claim::Expired => return Err(ClaimRefusal::Expired),
            Claim::Unknown => return Err(self.unknown_batch(coupon_id).await),
        };
        // A replay sends the claim again too: its first delivery may have
        // been unknown. The consumer writes one row per (coupon, user)
        // whatever the number of copies.
        let event = CouponClaimed {
            event_id: format!("claim-{coupon_id}-{user_id}"),
            coupon_id,
            user_id,
            request_id,
            claimed_at_ms: now_ms,
        };
        match self.publish(&event).await {
            Ok(()) => {
                // Not confirmed here (a Redis error), reconciliation sends
                // the claim once more: a duplicate the consumer ignores.
                if let Err(e) = self
                    .gate
                    .confirm(coupon_id, user_id, &event.request_id)
                    .await
                {
                    tracing::warn!(error = %e, coupon_id = %coupon_id, user_id, "confirming a delivered coupon claim failed");
                }
                Ok(claimed)
            }
            Err(e @ (PublishError::QueueFull | PublishError::NotDelivered(_)))
                if claimed == Claimed::New =>
            {
                tracing::warn!(error = %e, coupon_id = %coupon_id, user_id, "coupon claim not delivered; undoing the claim");
                if let Err(e) = self
                    .gate
                    .unclaim(coupon_id, user_id, &event.request_id)
                    .await
                {
                    tracing::error!(error = %e, coupon_id = %coupon_id, user_id, "undoing a coupon claim failed");
                }
                Err(ClaimRefusal::NotKept)
            }
            // Unknown (or a replay's send failed): the claim stays, a retry
            // with the same request_id sends it again.
            Err(e) => {
                tracing::warn!(error = %e, coupon_id = %coupon_id, user_id, "coupon claim delivery unconfirmed; the claim is kept");
                Err(ClaimRefusal::Unconfirmed)
            }
        }
    }

    /// The event, waiting at most the budget: past it the outcome is
    /// unknown (the message may still be delivered).
    async fn publish(&self, event: &CouponClaimed) -> Result<(), PublishError> {
        let key = event.user_id.to_string();
        let payload = event.encode();
        tokio::time::timeout(
            self.budget,
            self.producer.publish(&self.topic, &key, &payload, None),
        )
        .await
        .unwrap_or(Err(PublishError::Unknown(
            rdkafka::error::KafkaError::MessageProduction(
                rdkafka::error::RDKafkaErrorCode::MessageTimedOut,
            ),
        )))
    }

    /// A batch Redis does not know: lost and being restored (the database
    /// has it), or no such batch.
    async fn unknown_batch(&self, coupon_id: CouponId) -> ClaimRefusal {
        let exists = store::run(&self.db, move |conn| {
            Ok(super::repo::find(conn, coupon_id)?.is_some())
        })
        .await;
        match exists {
            Ok(true) => {
                self.restore_wanted.notify_one();
                ClaimRefusal::Restoring
            }
            Ok(false) => ClaimRefusal::NotFound,
            Err(e) => ClaimRefusal::Unavailable(e),
        }
    }
}
