//! Why a purchase was not accepted: each refusal answers differently, and
//! says whether and when a retry may get past it.

use crate::ids::OrderNo;

/// Why a purchase was not accepted (each one answers differently).
#[derive(Debug)]
pub enum Refusal {
    /// The body is wrong (400).
    Invalid(&'static str),
    /// A token bucket is empty (429); says whose, and in how many seconds
    /// it holds a token again.
    RateLimited(&'static str, u32),
    /// The database fallback's rate for the activity is used up (429), in
    /// how many seconds it has room again. Redis is down, so no lookup of
    /// a replay in it is tried: each would be one more failed connection
    /// per refusal, while the fallback refuses most purchases. A replay of
    /// an order the fallback wrote is answered once within the rate.
    FallbackRateLimited(u32),
    /// The sale is not open (409).
    NotActive,
    /// Redis lost the activity and reconciliation is restoring it (503).
    Restoring,
    /// Sold out (409); `from_memory` when the sold-out flag answered.
    SoldOut {
        /// Answered from the in-process flag, Redis not asked.
        from_memory: bool,
    },
    /// The coupon cannot back this order (400): why.
    CouponInvalid(&'static str),
    /// Back-pressure (503 BUSY); says which, and in how many seconds a
    /// retry may find room.
    Busy(&'static str, u32),
    /// No instance id is leased, so no number can be made (503).
    NoOrderNumber,
    /// Redis is down and the database fallback does not take this
    /// purchase yet (503 RETRY_LATER): why, and when to retry.
    Degraded(&'static str, u32),
    /// The buyer already holds the per-user limit (409).
    LimitExceeded,
    /// The purchase token is missing, used, expired or not the buyer's.
    InvalidToken,
    /// The number made was already reserved: two instances share an id.
    NumberTaken,
    /// The broker definitely does not have it; nothing was kept (503).
    NotQueued,
    /// The cluster answers but refuses writes (too few in-sync replicas):
    /// nothing was reserved (503 RETRY_LATER), in how many seconds to retry.
    WritesRefused(u32),
    /// The delivery is not confirmed yet: retry with the same request id
    /// (503, with the order_no).
    Pending(OrderNo),
    /// Redis failed during the reservation (503); counted.
    ReserveFailed(anyhow::Error),
    /// A dependency failed before anything was reserved (503).
    Unavailable(anyhow::Error),
}

impl Refusal {
    /// For a refusal a retry may get past: in how many seconds (the
    /// `Retry-After` of its 429 or 503).
    pub fn retry_after(&self) -> Option<u32> {
        match self {
            Self::RateLimited(_, secs)
            | Self::FallbackRateLimited(secs)
            | Self::Busy(_, secs)
            | Self::Degraded(_, secs)
            | Self::WritesRefused(secs) => Some(*secs),
            Self::Restoring
            | Self::NoOrderNumber
            | Self::NotQueued
            | Self::NumberTaken
            | Self::Pending(_)
            | Self::ReserveFailed(_)
            | Self::Unavailable(_) => Some(1),
            Self::Invalid(_)
            | Self::NotActive
            | Self::SoldOut { .. }
            | Self::CouponInvalid(_)
            | Self::LimitExceeded
            | Self::InvalidToken => None,
        }
    }

    /// Whether this refusal comes from a check made before the admission
    /// script (which answers a replay first), so that a retry bound to an
    /// order must be looked up before hearing it. Not the sold-out flag's:
    /// those stand only once no buyer was accepted since the flag's
    /// buyers were read (`SoldOut::confirm`), one read for many refusals.
    pub(super) fn spares_a_replay(&self) -> bool {
        matches!(
            self,
            Self::RateLimited(..)
                | Self::Busy(..)
                | Self::WritesRefused(_)
                | Self::CouponInvalid(_)
        )
    }

    /// The `seckill_admission_total` outcome label, for those counted.
    pub fn outcome(&self) -> Option<&'static str> {
        Some(match self {
            Self::RateLimited(..) | Self::FallbackRateLimited(_) => "rate_limited",
            Self::NotActive => "not_active",
            Self::Restoring
            | Self::NoOrderNumber
            | Self::NotQueued
            | Self::ReserveFailed(_)
            | Self::WritesRefused(_)
            | Self::Degraded(..) => "retry_later",
            Self::SoldOut { from_memory: true } => "sold_out_memory",
            Self::SoldOut { from_memory: false } => "sold_out",
            Self::Busy(..) => "busy",
            Self::LimitExceeded => "limit_exceeded",
            Self::InvalidToken => "invalid_token",
            Self::NumberTaken => "number_taken",
            Self::Pending(_) => "pending",
            Self::Invalid(_) | Self::CouponInvalid(_) | Self::Unavailable(_) => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_a_retry_can_get_past_say_when() {
        assert_eq!(Refusal::RateLimited("x", 3).retry_after(), Some(3));
        assert_eq!(Refusal::FallbackRateLimited(2).retry_after(), Some(2));
        assert!(Refusal::RateLimited("x", 3).spares_a_replay());
        assert!(
            !Refusal::FallbackRateLimited(2).spares_a_replay(),
            "Redis is down: a replay is not looked up in it"
        );
        assert_eq!(Refusal::Busy("x", 7).retry_after(), Some(7));
        assert_eq!(Refusal::Restoring.retry_after(), Some(1));
        assert_eq!(Refusal::SoldOut { from_memory: false }.retry_after(), None);
        assert_eq!(Refusal::LimitExceeded.retry_after(), None);
    }
}
