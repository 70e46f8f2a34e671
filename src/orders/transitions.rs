//! The order state machine's releasing transitions (SPEC step 6):
//! WAITING_PAY → CANCELLED (owner) and WAITING_PAY → CLOSED (payment
//! timeout). Both are the same conditional update; only the transaction that
//! wins it writes the RELEASE flow row, moves stock `locked → available`,
//! returns the coupon and enqueues `stock.released`.

use std::collections::{BTreeMap, HashMap};

use diesel::prelude::*;
use diesel::sql_types::{Array, BigInt, Integer, Text};

use super::OrderStatus;
use crate::bus::events::StockReleased;
use crate::ids::OrderNo;
use crate::outbox;
use crate::store::PgConn;
use crate::store::schema::activities;

/// What a release needs of an order.
#[derive(Debug, Clone, Copy, QueryableByName)]
pub struct Releasable {
    #[diesel(sql_type = BigInt)]
    pub order_no: i64,
    #[diesel(sql_type = BigInt)]
    pub activity_id: i64,
    #[diesel(sql_type = BigInt)]
    pub user_id: i64,
    #[diesel(sql_type = Integer)]
    pub quantity: i32,
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
    let nos: Vec<i64> = orders.iter().map(|o| o.order_no).collect();
    let moved: Vec<i64> = diesel::sql_query(format!(
        "UPDATE orders SET status = $2, closed_at = now(), updated_at = now() \
         WHERE order_no = ANY($1) AND status = {} RETURNING order_no",
        OrderStatus::WaitingPay.sql()
    ))
    .bind::<Array<BigInt>, _>(&nos)
    .bind::<Text, _>(to.status())
    .load::<Moved>(conn)?
    .into_iter()
    .map(|m| m.order_no)
    .collect();
    if moved.is_empty() {
        return Ok(moved);
    }
    let winners: Vec<&Releasable> = orders
        .iter()
        .filter(|o| moved.contains(&o.order_no))
        .collect();

    // One RELEASE per order, ever: a second one aborts this transaction.
    let (a, o, q): (Vec<i64>, Vec<i64>, Vec<i32>) = (
        winners.iter().map(|w| w.activity_id).collect(),
        winners.iter().map(|w| w.order_no).collect(),
        winners.iter().map(|w| w.quantity).collect(),
    );
    diesel::sql_query(
        "INSERT INTO stock_flow (activity_id, biz_type, biz_no, quantity) \
         SELECT a, 'RELEASE', o, q FROM unnest($1::bigint[], $2::bigint[], $3::int[]) AS t(a, o, q)",
    )
    .bind::<Array<BigInt>, _>(&a)
    .bind::<Array<BigInt>, _>(&o)
    .bind::<Array<Integer>, _>(&q)
    .execute(conn)?;

    // Stock rows locked in id order, so two transactions never wait on each
    // other's rows in opposite orders (no deadlock).
    let mut units: BTreeMap<i64, i32> = BTreeMap::new();
    for w in &winners {
        *units.entry(w.activity_id).or_default() += w.quantity;
    }
    for (&activity_id, &n) in &units {
        // The CHECKs refuse a negative `locked`: a release never double-counts.
        diesel::sql_query(
            "UPDATE stock SET locked = locked - $2, available = available + $2, updated_at = now() \
             WHERE activity_id = $1",
        )
        .bind::<BigInt, _>(activity_id)
        .bind::<Integer, _>(n)
        .execute(conn)?;
    }
    diesel::sql_query(
        "UPDATE user_coupons SET status = 'UNUSED', order_no = NULL, updated_at = now() \
         WHERE order_no = ANY($1) AND status = 'LOCKED'",
    )
    .bind::<Array<BigInt>, _>(&moved)
    .execute(conn)?;

    let ids: Vec<i64> = units.keys().copied().collect();
    let layouts: HashMap<i64, (i32, i32)> = activities::table
        .filter(activities::id.eq_any(&ids))
        .select((activities::id, (activities::buckets, activities::shards)))
        .load::<(i64, (i32, i32))>(conn)?
        .into_iter()
        .collect();
    for w in winners {
        let event = StockReleased {
            event_id: format!("release-{}", w.order_no),
            order_no: OrderNo::new(w.order_no),
            activity_id: w.activity_id,
            user_id: w.user_id,
            quantity: w.quantity,
            buckets: layouts.get(&w.activity_id).map_or(1, |l| l.0),
            shards: layouts.get(&w.activity_id).map_or(1, |l| l.1),
            reason: to.status().as_str().to_owned(),
        };
        outbox::enqueue(
            conn,
            outbox::STOCK_RELEASED,
            &w.order_no.to_string(),
            &event,
        )?;
    }
    Ok(moved)
}

/// Locks up to `limit` overdue WAITING_PAY orders (skipping rows another
/// closer or a payment holds) and closes them. Returns how many it closed.
pub fn close_overdue(conn: &mut PgConn, limit: i64) -> QueryResult<usize> {
    conn.transaction(|conn| {
        // The literal state (not a parameter) lets the planner use the
        // partial index `orders_waiting_deadline`.
        let overdue: Vec<Releasable> = diesel::sql_query(format!(
            "SELECT order_no, activity_id, user_id, quantity FROM orders \
             WHERE status = {} AND pay_deadline < now() \
             ORDER BY pay_deadline LIMIT $1 FOR UPDATE SKIP LOCKED",
            OrderStatus::WaitingPay.sql()
        ))
        .bind::<BigInt, _>(limit)
        .load(conn)?;
        Ok(release(conn, &overdue, ReleaseTo::Closed)?.len())
    })
}

/// The caller's order, locked for a transition.
pub fn lock_for_user(
    conn: &mut PgConn,
    order_no: i64,
    user_id: i64,
) -> QueryResult<Option<(Releasable, OrderStatus)>> {
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(embed)]
        r: Releasable,
        #[diesel(sql_type = Text)]
        status: OrderStatus,
    }
    let row: Option<Row> = diesel::sql_query(
        "SELECT order_no, activity_id, user_id, quantity, status FROM orders \
         WHERE order_no = $1 AND user_id = $2 FOR UPDATE",
    )
    .bind::<BigInt, _>(order_no)
    .bind::<BigInt, _>(user_id)
    .get_result(conn)
    .optional()?;
    Ok(row.map(|r| (r.r, r.status)))
}
