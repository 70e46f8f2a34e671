//! Coupons (SPEC "Coupons", I8): a batch is warmed into Redis when created;
//! a claim is ONE Lua call (replay, expiry, one per user, remaining count),
//! then a `coupon.claimed` event that a consumer writes to `user_coupons`
//! with the database as the last guard (unique `(coupon_id, user_id)`,
//! `claimed <= total`). Orders lock a coupon in their creating transaction;
//! pay marks it USED; cancel / close return it.
//!
//! Per-user membership is a Redis **set** of user ids, not a bitmap: user ids
//! are arbitrary 63-bit integers, so a bitmap indexed by id could need up to
//! 2^63 bits, while a set holds at most `total` members — memory follows the
//! batch size, never the id space.

pub mod claim;
pub mod consumer;
pub mod gate;
pub mod repo;
