//! Event payloads on Kafka, JSON-encoded. Decoding validates, so a consumer
//! never writes a value the schema would refuse; what fails to decode goes
//! to the dead-letter topic.

use serde::{Deserialize, Serialize};

use crate::domain::{ActivityId, CouponId};
use crate::ids::OrderNo;

/// `order.requested`: a purchase admitted by Redis, to be written by the
/// order consumer (SPEC step 3).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderRequested {
    /// Idempotency key of the consumers (`consume_log`): the order_no.
    pub event_id: String,
    /// The order's number, made at admission.
    pub order_no: OrderNo,
    /// The activity.
    pub activity_id: ActivityId,
    /// The buyer.
    pub user_id: i64,
    /// The client's idempotency key.
    pub request_id: String,
    /// Units reserved.
    pub quantity: i32,
    /// Coupon the buyer asked to use, if any.
    pub coupon_id: Option<CouponId>,
    /// When Redis reserved the stock, unix ms.
    pub reserved_at_ms: i64,
}

impl OrderRequested {
    /// Encodes for the wire.
    pub fn encode(&self) -> Vec<u8> {
        // Serialising this struct cannot fail: no maps with non-string keys,
        // no floats.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Decodes and validates; the error names what is wrong.
    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        let event: Self =
            serde_json::from_slice(bytes).map_err(|e| format!("invalid JSON: {e}"))?;
        if event.event_id.is_empty() || event.event_id.len() > 64 {
            return Err("event_id must be 1..=64 characters".into());
        }
        if event.request_id.is_empty() || event.request_id.len() > 64 {
            return Err("request_id must be 1..=64 characters".into());
        }
        if event.quantity < 1 {
            return Err("quantity must be at least 1".into());
        }
        if event.activity_id.get() < 1 || event.user_id < 1 {
            return Err("activity_id and user_id must be positive".into());
        }
        Ok(event)
    }
}

/// `stock.released`: an order was cancelled or closed and its units went
/// back to `available` in the database; Redis must follow (once).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StockReleased {
    /// Idempotency key: `release-<order_no>`.
    pub event_id: String,
    /// The order whose reservation is released.
    pub order_no: OrderNo,
    /// The activity.
    pub activity_id: ActivityId,
    /// The buyer (their per-user holding goes down).
    pub user_id: i64,
    /// Units released.
    pub quantity: i32,
    /// The activity's Redis bucket count (per shard).
    pub buckets: i32,
    /// The activity's Redis shard count (1 when absent: events written
    /// before activities had shards).
    #[serde(default = "one_shard")]
    pub shards: i32,
    /// `CANCELLED` or `CLOSED`.
    pub reason: String,
    /// The coupon the order held, freed in Redis too (absent in events
    /// written before coupons were held at admission).
    #[serde(default)]
    pub coupon_id: Option<CouponId>,
}

/// `order.paid`: for downstream systems (fulfilment, notifications).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderPaid {
    /// Idempotency key: `paid-<order_no>`.
    pub event_id: String,
    /// The order.
    pub order_no: OrderNo,
    /// The activity.
    pub activity_id: ActivityId,
    /// The buyer.
    pub user_id: i64,
    /// Amount charged, cents.
    pub amount_cents: i64,
    /// The payment that paid it.
    pub payment_no: String,
}

/// `coupon.claimed`: a claim admitted by Redis, to be written to
/// `user_coupons` by the claims consumer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CouponClaimed {
    /// Idempotency key: `claim-<coupon_id>-<user_id>`.
    pub event_id: String,
    /// The batch.
    pub coupon_id: CouponId,
    /// The claimant.
    pub user_id: i64,
    /// The client's idempotency key.
    pub request_id: String,
    /// When Redis admitted the claim, unix ms.
    pub claimed_at_ms: i64,
}

impl CouponClaimed {
    /// Encodes for the wire.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Decodes and validates.
    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        let e: Self = serde_json::from_slice(bytes).map_err(|e| format!("invalid JSON: {e}"))?;
        if e.coupon_id.get() < 1 || e.user_id < 1 {
            return Err("coupon_id and user_id must be positive".into());
        }
        if e.request_id.is_empty() || e.request_id.len() > 64 || e.event_id.is_empty() {
            return Err("request_id must be 1..=64 characters".into());
        }
        Ok(e)
    }
}

fn one_shard() -> i32 {
    1
}

impl StockReleased {
    /// The activity's Redis layout.
    pub fn layout(&self) -> crate::admission::Layout {
        crate::activities::layout(self.buckets, self.shards)
    }

    /// Decodes and validates.
    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        let e: Self = serde_json::from_slice(bytes).map_err(|e| format!("invalid JSON: {e}"))?;
        if e.quantity < 1 || e.buckets < 1 || e.shards < 1 || e.activity_id.get() < 1 {
            return Err("quantity, buckets, shards and activity_id must be positive".into());
        }
        Ok(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event() -> OrderRequested {
        OrderRequested {
            event_id: "77".into(),
            order_no: OrderNo::new(77),
            activity_id: ActivityId::new(3),
            user_id: 9,
            request_id: "r-1".into(),
            quantity: 1,
            coupon_id: None,
            reserved_at_ms: 1_700_000_000_000,
        }
    }

    #[test]
    fn an_event_round_trips() {
        assert_eq!(OrderRequested::decode(&event().encode()), Ok(event()));
    }

    #[test]
    fn garbage_and_invalid_events_are_refused_with_a_reason() {
        assert!(
            OrderRequested::decode(b"not json")
                .unwrap_err()
                .contains("JSON")
        );
        let mut bad = event();
        bad.quantity = 0;
        assert!(
            OrderRequested::decode(&bad.encode())
                .unwrap_err()
                .contains("quantity")
        );
        let mut bad = event();
        bad.request_id = "x".repeat(65);
        assert!(OrderRequested::decode(&bad.encode()).is_err());
    }
}
