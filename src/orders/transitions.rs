//! The order state machine's releasing transitions (SPEC step 6):
//! WAITING_PAY → CANCELLED (owner) and WAITING_PAY → CLOSED (payment
//! timeout). Both are the same conditional update; only the transaction that
//! wins it writes the RELEASE flow row, moves stock `locked → available`,
//! returns the coupon and enqueues `stock.released`.

use std::collections::HashMap;

use diesel::prelude::*;
use diesel::sql_types::{Array, BigInt, SmallInt, Text};

use super::OrderStatus;
use super::partition::user_slot_column;
use crate::bus::events::StockReleased;
use crate::coupons::repo as coupons;
use crate::domain::{ActivityId, CouponId, UserId};
use crate::ids::OrderNo;
use crate::outbox;
use crate::stock::{self, Units};
use crate::store::PgConn;
use crate::store::schema::activities;

/// What a release needs of an order.
#[derive(Debug, Clone, Copy, QueryableByName)]
pub struct Releasable {
    /// Its units (activity, order_no, quantity).
    #[diesel(embed)]
    pub units: Units,
    /// Its buyer.
    #[diesel(sql_type = BigInt)]
    pub user_id: i64,
    /// The coupon it holds, if any.
    #[diesel(sql_type = diesel::sql_types::Nullable<BigInt>)]
    pub coupon_id: Option<CouponId>,
}

#[derive(QueryableByName)]
struct Moved {
    #[diesel(sql_type = BigInt)]
    order_no: i64,
}

/// Target of a release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseTo {
    /// The owner cancelled.
    Cancelled,
    /// The payment deadline passed.
    Closed,
}

impl ReleaseTo {
    fn status(self) -> OrderStatus {
        match self {
            Self::Cancelled => OrderStatus::Cancelled,
            Self::Closed => OrderStatus::Closed,
        }
    }
}

/// Moves those of `orders` still WAITING_PAY to `to` and releases their
/// stock, in the caller's transaction. Returns the order_nos this call moved
/// (the winners); the others had already left WAITING_PAY.
pub fn release(conn: &mut PgConn, orders: &[Releasable], to: ReleaseTo) -> QueryResult<Vec<i64>> {
    if orders.is_empty() {
        return Ok(Vec::new());
    }
    let nos: Vec<i64> = orders.iter().map(|o| o.units.order_no).collect();
    // The buyers' partitions only (one, for a cancel).
    let mut slots: Vec<i16> = orders.iter().map(|o| user_slot_column(o.user_id)).collect();
    slots.sort_unstable();
    slots.dedup();
    let moved: Vec<i64> = diesel::sql_query(format!(
        "UPDATE orders SET status = $2, closed_at = now(), updated_at = now() \
         WHERE user_slot = ANY($3) AND order_no = ANY($1) AND status = {} RETURNING order_no",
        OrderStatus::WaitingPay.sql()
    ))
    .bind::<Array<BigInt>, _>(&nos)
    .bind::<Text, _>(to.status())
    .bind::<Array<SmallInt>, _>(&slots)
    .load::<Moved>(conn)?
    .into_iter()
    .map(|m| m.order_no)
    .collect();
    if moved.is_empty() {
        return Ok(moved);
    }
    let winners: Vec<&Releasable> = orders
        .iter()
        .filter(|o| moved.contains(&o.units.order_no))
        .collect();
    let units: Vec<Units> = winners.iter().map(|w| w.units).collect();
    stock::release(conn, &units)?;
    coupons::unlock_for_orders(conn, &moved)?;

    let ids: Vec<ActivityId> = units.iter().map(|u| u.activity_id).collect();
    let layouts: HashMap<ActivityId, (i32, i32)> = activities::table
        .filter(activities::id.eq_any(&ids))
        .select((activities::id, (activities::buckets, activities::shards)))
        .load::<(ActivityId, (i32, i32))>(conn)?
        .into_iter()
        .collect();
    for w in winners {
        let u = w.units;
        let event = StockReleased {
            event_id: format!("release-{}", u.order_no),
            order_no: OrderNo::new(u.order_no),
            activity_id: u.activity_id,
            user_id: w.user_id,
            quantity: u.quantity,
            buckets: layouts.get(&u.activity_id).map_or(1, |l| l.0),
            shards: layouts.get(&u.activity_id).map_or(1, |l| l.1),
            reason: to.status().as_str().to_owned(),
            coupon_id: w.coupon_id,
        };
        let key = u.order_no.to_string();
        outbox::enqueue(conn, outbox::STOCK_RELEASED, &key, &event)?;
    }
    Ok(moved)
}

/// Locks up to `limit` overdue WAITING_PAY orders (skipping rows another
/// closer or a payment holds) and closes them. Returns the orders closed.
pub fn close_overdue(conn: &mut PgConn, limit: i64) -> QueryResult<Vec<i64>> {
    conn.transaction(|conn| {
        // The literal state (not a parameter) lets the planner use the
        // partial index `orders_waiting_deadline`.
        let overdue: Vec<Releasable> = diesel::sql_query(format!(
            "SELECT order_no, activity_id, user_id, quantity, coupon_id FROM orders \
             WHERE status = {} AND pay_deadline < now() \
             ORDER BY pay_deadline LIMIT $1 FOR UPDATE SKIP LOCKED",
            OrderStatus::WaitingPay.sql()
        ))
        .bind::<BigInt, _>(limit)
        .load(conn)?;
        release(conn, &overdue, ReleaseTo::Closed)
    })
}

/// Cancels the caller's order if it is WAITING_PAY, releasing its units,
/// in one transaction; returns the order as it then stands (`None`: not
/// theirs, or no such order).
pub fn cancel_for_user(
    conn: &mut PgConn,
    order_no: OrderNo,
    user_id: UserId,
) -> QueryResult<Option<super::repo::Order>> {
    conn.transaction(|conn| {
        let Some((order, status)) = lock_for_user(conn, order_no, user_id)? else {
            return Ok(None);
        };
        if status == OrderStatus::WaitingPay {
            release(conn, &[order], ReleaseTo::Cancelled)?;
        }
        super::repo::find_for_user(conn, order_no, user_id)
    })
}

/// The caller's order, locked for a transition.
pub fn lock_for_user(
    conn: &mut PgConn,
    order_no: OrderNo,
    user_id: UserId,
) -> QueryResult<Option<(Releasable, OrderStatus)>> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(embed)]
        r: Releasable,
        #[diesel(sql_type = Text)]
        status: OrderStatus,
    }
    let row: Option<Row> = diesel::sql_query(
        "SELECT order_no, activity_id, user_id, quantity, coupon_id, status FROM orders \
         WHERE user_slot = $3 AND order_no = $1 AND user_id = $2 FOR UPDATE",
    )
    .bind::<BigInt, _>(order_no.get())
    .bind::<BigInt, _>(user_id.get())
    .bind::<SmallInt, _>(user_slot_column(user_id.get()))
    .get_result(conn)
    .optional()?;
    Ok(row.map(|r| (r.r, r.status)))
}
