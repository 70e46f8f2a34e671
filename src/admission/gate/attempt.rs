//! One purchase attempt as the admission script sees it, and what the
//! script decided.

use crate::admission::keys::Layout;
use crate::domain::{ActivityId, CouponId};

/// What the admission script decided. Ordinary outcomes, not errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Stock reserved for this new order.
    Accepted(i64),
    /// This user's `request_id` was accepted before, as this order.
    Duplicate(i64),
    /// No bucket (nor all of them together) holds the quantity.
    SoldOut,
    /// The user's live quantity would pass the per-user limit.
    LimitExceeded,
    /// Purchase token missing, used, expired or another user's.
    InvalidToken,
    /// Outside the sale window.
    NotActive,
    /// Redis holds no stock for the activity: never warmed, or Redis lost
    /// it (restarted empty) and reconciliation has not restored it yet.
    NotWarm,
    /// The order_no already keys another reservation (two instances made
    /// the same number): nothing was reserved, the other is untouched.
    NumberTaken,
    /// Units were on their way between shards through every round of
    /// borrowing: nothing was reserved, retry shortly.
    InTransit,
}

/// One purchase attempt, as the admission script sees it.
#[derive(Debug, Clone, Copy)]
pub struct ReserveRequest<'a> {
    /// The activity.
    pub activity_id: ActivityId,
    /// The buyer.
    pub user_id: i64,
    /// The client's idempotency key.
    pub request_id: &'a str,
    /// The one-time purchase token.
    pub token: &'a str,
    /// Units wanted.
    pub quantity: i32,
    /// The snowflake made for this attempt.
    pub order_no: i64,
    /// The activity's buckets and shards.
    pub layout: Layout,
    /// Now, in unix milliseconds.
    pub now_ms: i64,
    /// The coupon the buyer wants to use, kept on the reservation so the
    /// order event can be rebuilt from it.
    pub coupon_id: Option<CouponId>,
}
