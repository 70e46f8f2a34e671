//! A purchase as the buyer asked for it: what the admission path and its
//! database fallback are both handed.

use std::net::IpAddr;

use crate::domain::{ActivityId, CouponId, RequestId, UserId};

/// A purchase as the buyer asked for it, its request id already valid.
#[derive(Debug, Clone)]
pub struct Purchase {
    /// The activity.
    pub activity_id: ActivityId,
    /// The buyer.
    pub user_id: UserId,
    /// The client's address, when known (its own rate bucket).
    pub client_ip: Option<IpAddr>,
    /// The buyer's idempotency key.
    pub request_id: RequestId,
    /// Units wanted (default 1).
    pub quantity: i32,
    /// The one-time purchase token, if the activity asked for one.
    pub token: Option<String>,
    /// A coupon of the buyer's to use.
    pub coupon_id: Option<CouponId>,
}
