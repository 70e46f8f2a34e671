//! The stock ledger (SPEC "Stock", I1 and I7): an activity's opening
//! balance ([`open`]), then every move of its units between `available`,
//! `locked` and `sold`, which writes the `stock` row and, in the same
//! transaction (the caller's), one `stock_flow` row per
//! order: LOCK when an order is created, CONFIRM when it is paid, RELEASE
//! when it is cancelled or closed. `stock_flow` is unique on
//! `(biz_type, biz_no)` with no ON CONFLICT, so a second LOCK, CONFIRM or
//! RELEASE of one order aborts its transaction; the `stock` CHECKs
//! (`available >= 0`, `total = available + locked + sold`) refuse any move
//! that would break I1 or I7.
//!
//! Stock rows are locked in activity-id order, so two transactions that
//! touch several activities never wait on each other in opposite orders.

use std::collections::BTreeMap;

use diesel::prelude::*;
use diesel::sql_types::{Array, BigInt, Integer};

use crate::domain::ActivityId;
use crate::store::PgConn;

/// One order's units, as the ledger books them (readable from any query
/// that selects these three columns).
#[derive(Debug, Clone, Copy, PartialEq, Eq, QueryableByName)]
pub struct Units {
    /// The activity whose stock they are.
    #[diesel(sql_type = BigInt)]
    pub activity_id: ActivityId,
    /// The order they back (the flow row's `biz_no`).
    #[diesel(sql_type = BigInt)]
    pub order_no: i64,
    /// How many.
    #[diesel(sql_type = Integer)]
    pub quantity: i32,
}

/// A flow row's kind (`stock_flow.biz_type`).
#[derive(Debug, Clone, Copy)]
enum Flow {
    Lock,
    Confirm,
    Release,
}

impl Flow {
    fn sql(self) -> &'static str {
        match self {
            Self::Lock => "'LOCK'",
            Self::Confirm => "'CONFIRM'",
            Self::Release => "'RELEASE'",
        }
    }
}

/// The opening balance of a new activity: `total` units, all available.
pub fn open(conn: &mut PgConn, activity_id: ActivityId, total: i32) -> QueryResult<()> {
    use crate::store::schema::stock;
    diesel::insert_into(stock::table)
        .values((
            stock::activity_id.eq(activity_id),
            stock::total.eq(total),
            stock::available.eq(total),
        ))
        .execute(conn)?;
    Ok(())
}

/// LOCK: `available → locked` for new orders. Their flow rows go in first,
/// before any stock row is locked, so a concurrent transaction of the same
/// activity waits on that row only for the update (and what the caller does
/// after it). Per activity, one conditional update for all its orders;
/// when that does not fit, one per order. Returns the orders the stock
/// could not back: nothing of theirs stays booked.
pub fn lock(conn: &mut PgConn, orders: &[Units]) -> QueryResult<Vec<i64>> {
    if orders.is_empty() {
        return Ok(Vec::new());
    }
    insert_flows(conn, Flow::Lock, orders)?;
    let mut unbacked = Vec::new();
    for (activity_id, orders) in by_activity(orders) {
        let units: i32 = orders.iter().map(|o| o.quantity).sum();
        if take_available(conn, activity_id, units)? {
            continue;
        }
        for o in orders {
            if !take_available(conn, activity_id, o.quantity)? {
                unbacked.push(o.order_no);
            }
        }
    }
    delete_locks(conn, &unbacked)?;
    Ok(unbacked)
}

/// Undoes [`lock`] for `orders` inside the transaction that locked them
/// (an order found over its buyer's limit after the lock): `locked →
/// available` and their LOCK rows removed, so no one ever sees them.
pub fn unlock(conn: &mut PgConn, orders: &[Units]) -> QueryResult<()> {
    if orders.is_empty() {
        return Ok(());
    }
    for (activity_id, orders) in by_activity(orders) {
        give_back(conn, activity_id, orders.iter().map(|o| o.quantity).sum())?;
    }
    let nos: Vec<i64> = orders.iter().map(|o| o.order_no).collect();
    delete_locks(conn, &nos)
}

/// CONFIRM: `locked → sold` for a paid order.
pub fn confirm(conn: &mut PgConn, order: Units) -> QueryResult<()> {
    diesel::sql_query(
        "UPDATE stock SET locked = locked - $2, sold = sold + $2, updated_at = now() \
         WHERE activity_id = $1",
    )
    .bind::<BigInt, _>(order.activity_id)
    .bind::<Integer, _>(order.quantity)
    .execute(conn)?;
    insert_flows(conn, Flow::Confirm, &[order])
}

/// RELEASE: `locked → available` for cancelled or closed orders. The
/// CHECKs refuse a negative `locked`: a release never double-counts.
pub fn release(conn: &mut PgConn, orders: &[Units]) -> QueryResult<()> {
    if orders.is_empty() {
        return Ok(());
    }
    insert_flows(conn, Flow::Release, orders)?;
    for (activity_id, orders) in by_activity(orders) {
        give_back(conn, activity_id, orders.iter().map(|o| o.quantity).sum())?;
    }
    Ok(())
}

/// `orders` grouped by activity, in activity-id order.
fn by_activity(orders: &[Units]) -> BTreeMap<ActivityId, Vec<Units>> {
    let mut grouped: BTreeMap<ActivityId, Vec<Units>> = BTreeMap::new();
    for o in orders {
        grouped.entry(o.activity_id).or_default().push(*o);
    }
    grouped
}

/// `available → locked` for `units`, only if that many are available.
fn take_available(conn: &mut PgConn, activity_id: ActivityId, units: i32) -> QueryResult<bool> {
    let n = diesel::sql_query(
        "UPDATE stock SET available = available - $2, locked = locked + $2, updated_at = now() \
         WHERE activity_id = $1 AND available >= $2",
    )
    .bind::<BigInt, _>(activity_id)
    .bind::<Integer, _>(units)
    .execute(conn)?;
    Ok(n == 1)
}

/// `locked → available` for `units`.
fn give_back(conn: &mut PgConn, activity_id: ActivityId, units: i32) -> QueryResult<()> {
    diesel::sql_query(
        "UPDATE stock SET locked = locked - $2, available = available + $2, updated_at = now() \
         WHERE activity_id = $1",
    )
    .bind::<BigInt, _>(activity_id)
    .bind::<Integer, _>(units)
    .execute(conn)?;
    Ok(())
}

/// One flow row per order, in one statement. No ON CONFLICT (see the
/// module's doc).
fn insert_flows(conn: &mut PgConn, flow: Flow, orders: &[Units]) -> QueryResult<()> {
    let mut columns = (
        Vec::with_capacity(orders.len()),
        Vec::with_capacity(orders.len()),
        Vec::with_capacity(orders.len()),
    );
    for o in orders {
        columns.0.push(o.activity_id);
        columns.1.push(o.order_no);
        columns.2.push(o.quantity);
    }
    diesel::sql_query(format!(
        "INSERT INTO stock_flow (activity_id, biz_type, biz_no, quantity) \
         SELECT a, {}, o, q FROM unnest($1::bigint[], $2::bigint[], $3::int[]) AS t(a, o, q)",
        flow.sql()
    ))
    .bind::<Array<BigInt>, _>(&columns.0)
    .bind::<Array<BigInt>, _>(&columns.1)
    .bind::<Array<Integer>, _>(&columns.2)
    .execute(conn)?;
    Ok(())
}

/// Removes the LOCK rows of orders whose lock did not hold.
fn delete_locks(conn: &mut PgConn, order_nos: &[i64]) -> QueryResult<()> {
    if order_nos.is_empty() {
        return Ok(());
    }
    diesel::sql_query(format!(
        "DELETE FROM stock_flow WHERE biz_type = {} AND biz_no = ANY($1)",
        Flow::Lock.sql()
    ))
    .bind::<Array<BigInt>, _>(order_nos)
    .execute(conn)?;
    Ok(())
}
