//! Order rows: the batch that creates them (SPEC step 3) and the reads
//! behind the status routes.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Duration, Utc};
use diesel::dsl::{AsSelect, SqlTypeOf};
use diesel::pg::Pg;
use diesel::prelude::*;
use diesel::sql_types::{Array, BigInt, Integer, Nullable, SmallInt, Text, Timestamptz};
use serde::Serialize;

use super::OrderStatus;
use super::partition::{seckill_order_slot, user_slot_column};
use crate::admission::Layout;
use crate::bus::events::OrderRequested;
use crate::coupons::repo as coupons;
use crate::domain::{ActivityId, CouponId, UserId};
use crate::ids::OrderNo;
use crate::stock::{self, Units};
use crate::store::PgConn;
use crate::store::schema::{activities, orders};

/// An order row.
#[derive(Debug, Clone, Queryable, Selectable, Serialize)]
#[diesel(table_name = orders)]
pub struct Order {
    #[serde(serialize_with = "as_string")]
    pub order_no: i64,
    pub request_id: String,
    pub activity_id: ActivityId,
    pub user_id: i64,
    pub quantity: i32,
    pub amount_cents: i64,
    pub coupon_id: Option<CouponId>,
    pub status: OrderStatus,
    pub failure_reason: Option<String>,
    pub pay_deadline: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    pub paid_at: Option<DateTime<Utc>>,
}

fn as_string<S: serde::Serializer>(v: &i64, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

/// A query for order rows.
pub type OrderQuery = orders::BoxedQuery<'static, Pg, SqlTypeOf<AsSelect<Order, Pg>>>;

/// The caller's order, if it is theirs.
pub fn find_for_user(
    conn: &mut PgConn,
    order_no: OrderNo,
    user_id: UserId,
) -> QueryResult<Option<Order>> {
    find_for_user_query(order_no, user_id)
        .first(conn)
        .optional()
}

/// [`find_for_user`]'s query: in the buyer's partition, where all of one
/// user's orders are.
pub fn find_for_user_query(order_no: OrderNo, user_id: UserId) -> OrderQuery {
    orders::table
        .filter(orders::order_no.eq(order_no.get()))
        .filter(orders::user_slot.eq(user_slot_column(user_id.get())))
        .filter(orders::user_id.eq(user_id.get()))
        .select(Order::as_select())
        .into_boxed()
}

/// The order numbered `order_no`, whoever's it is: its number names its
/// partition (`seckill_order_slot`), which the executor reads alone.
pub fn by_number_query(order_no: OrderNo) -> OrderQuery {
    orders::table
        .filter(orders::order_no.eq(order_no.get()))
        .filter(orders::user_slot.eq(seckill_order_slot(order_no.get())))
        .select(Order::as_select())
        .into_boxed()
}

/// The order's payment deadline (the provider stops taking money then).
pub fn pay_deadline(conn: &mut PgConn, order_no: OrderNo) -> QueryResult<Option<DateTime<Utc>>> {
    Ok(by_number_query(order_no)
        .first::<Order>(conn)
        .optional()?
        .and_then(|o| o.pay_deadline))
}

/// The caller's orders, newest first, after `cursor` (an order_no).
pub fn list_for_user(
    conn: &mut PgConn,
    user_id: UserId,
    status: Option<OrderStatus>,
    cursor: Option<OrderNo>,
    limit: i64,
) -> QueryResult<Vec<Order>> {
    list_for_user_query(user_id, status, cursor, limit).load(conn)
}

/// [`list_for_user`]'s query: one partition, the buyer's.
pub fn list_for_user_query(
    user_id: UserId,
    status: Option<OrderStatus>,
    cursor: Option<OrderNo>,
    limit: i64,
) -> OrderQuery {
    let mut query = orders::table
        .filter(orders::user_slot.eq(user_slot_column(user_id.get())))
        .filter(orders::user_id.eq(user_id.get()))
        .select(Order::as_select())
        .order(orders::order_no.desc())
        .limit(limit)
        .into_boxed();
    if let Some(status) = status {
        query = query.filter(orders::status.eq(status));
    }
    if let Some(cursor) = cursor {
        query = query.filter(orders::order_no.lt(cursor.get()));
    }
    query
}

/// What the consumer needs of an activity.
#[derive(Debug, Clone, Copy)]
pub struct ActivityTerms {
    pub price_cents: i64,
    pub pay_timeout_secs: i32,
    /// Its Redis layout.
    pub layout: Layout,
}

/// Terms of the given activities.
pub fn activity_terms(
    conn: &mut PgConn,
    ids: &[ActivityId],
) -> QueryResult<HashMap<ActivityId, ActivityTerms>> {
    let rows: Vec<(ActivityId, i64, i32, i32, i32)> = activities::table
        .filter(activities::id.eq_any(ids))
        .select((
            activities::id,
            activities::price_cents,
            activities::pay_timeout_secs,
            activities::buckets,
            activities::shards,
        ))
        .load(conn)?;
    Ok(rows
        .into_iter()
        .map(|(id, price_cents, pay_timeout_secs, buckets, shards)| {
            (
                id,
                ActivityTerms {
                    price_cents,
                    pay_timeout_secs,
                    layout: crate::activities::layout(buckets, shards),
                },
            )
        })
        .collect())
}

#[derive(QueryableByName)]
struct EventId {
    #[diesel(sql_type = Text)]
    event_id: String,
}

#[derive(QueryableByName)]
struct OrderNoRow {
    #[diesel(sql_type = BigInt)]
    order_no: i64,
}

/// Why an order could not be backed by the database.
pub const STOCK_UNAVAILABLE: &str = "STOCK_UNAVAILABLE";
/// The buyer's live orders would pass the per-user limit (I2's database
/// guard; Redis refuses these first unless it lost its holdings).
pub const LIMIT_EXCEEDED: &str = "LIMIT_EXCEEDED";
/// The coupon it named could not be locked (used by another order, expired,
/// or the order is below the coupon's minimum).
pub const COUPON_UNAVAILABLE: &str = "COUPON_UNAVAILABLE";
/// Its reservation was released before the event was processed (the publish
/// was reported failed, or the reconciler voided it).
pub const RESERVATION_RELEASED: &str = "RESERVATION_RELEASED";

/// What one batch did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct BatchOutcome {
    /// Events already applied before (found in `consume_log`).
    pub duplicates: usize,
    /// Orders inserted as WAITING_PAY.
    pub created: usize,
    /// Orders inserted as FAILED.
    pub failed: usize,
    /// Events naming an activity that does not exist (nothing written).
    pub unknown_activity: usize,
    /// Indexes (into the batch) of events whose event_id was applied
    /// before, or earlier in the batch, with a different payload: two
    /// instances minted one number. Nothing of theirs was written.
    pub conflicts: Vec<usize>,
    /// The status each event's order has as the batch's transaction
    /// leaves it (no entry: no row). Known from what the batch wrote; only
    /// the orders it did not insert (redeliveries) are read back.
    pub statuses: HashMap<i64, OrderStatus>,
    /// Order_nos of events whose reservation Redis lost before the
    /// activity's latest restore, and which the restore did not count:
    /// nothing of theirs was written.
    pub lost: HashSet<i64>,
}

/// What Redis said of a batch's reservations before the batch.
#[derive(Debug, Default, Clone)]
pub struct Marks {
    /// Already released: recorded FAILED, moving no stock.
    pub released: HashSet<i64>,
    /// No record: lost with Redis if made before the activity's restore
    /// fence, and then no order is made.
    pub unknown: HashSet<i64>,
}

/// SPEC step 3 in ONE transaction: skip events already in `consume_log`;
/// insert their orders (`ON CONFLICT DO NOTHING` on order_no and on
/// (activity, user, request_id)); move stock `available → locked` with one
/// conditional update per activity, falling back to per-order updates when
/// it does not fit; orders the stock cannot back become FAILED; `stock_flow`
/// LOCK rows for the rest. `marks.released` are order_nos whose Redis
/// reservation is already released: they are recorded as FAILED and move
/// no stock. An event Redis has no record of, reserved before its
/// activity's restore fence, makes no order (`outcome.lost`; see
/// `reconcile/restore.rs`).
pub fn apply_batch(
    conn: &mut PgConn,
    consumer: &str,
    events: &[OrderRequested],
    terms: &HashMap<ActivityId, ActivityTerms>,
    marks: &Marks,
    now: DateTime<Utc>,
) -> QueryResult<BatchOutcome> {
    use OrderStatus::{Failed, WaitingPay};
    let released = &marks.released;
    conn.transaction(|conn| {
        let mut outcome = BatchOutcome::default();
        let activity_ids: Vec<ActivityId> = events.iter().map(|e| e.activity_id).collect();
        let fences = crate::activities::repo::restore_fences(conn, &activity_ids)?;
        let ids: Vec<&str> = events.iter().map(|e| e.event_id.as_str()).collect();
        let fresh: HashSet<String> = diesel::sql_query(
            "INSERT INTO consume_log (event_id, consumer) SELECT unnest($1::text[]), $2 \
             ON CONFLICT DO NOTHING RETURNING event_id",
        )
        .bind::<Array<Text>, _>(&ids)
        .bind::<Text, _>(consumer)
        .load::<EventId>(conn)?
        .into_iter()
        .map(|r| r.event_id)
        .collect();
        outcome.duplicates = events.len() - fresh.len();
        outcome.conflicts = conflicts(conn, events, &fresh)?;

        let mut rows = OrderColumns::default();
        let mut coupon_locked: Vec<i64> = Vec::new();
        let mut seen = HashSet::new();
        for (i, e) in events.iter().enumerate() {
            // The same event twice in one batch counts once.
            if !fresh.contains(&e.event_id)
                || outcome.conflicts.contains(&i)
                || !seen.insert(e.order_no.get())
            {
                continue;
            }
            let Some(t) = terms.get(&e.activity_id) else {
                outcome.unknown_activity += 1;
                continue;
            };
            let order_no = e.order_no.get();
            // A zero stamp is an event that carries none: never fenced.
            if marks.unknown.contains(&order_no)
                && e.reserved_at_ms > 0
                && e.reserved_at_ms < fences.get(&e.activity_id).copied().unwrap_or(0)
            {
                outcome.lost.insert(order_no);
                continue;
            }
            let gross = t.price_cents.saturating_mul(i64::from(e.quantity));
            let deadline = Some(now + Duration::seconds(i64::from(t.pay_timeout_secs)));
            let (status, reason, deadline, amount) = if released.contains(&order_no) {
                (Failed, Some(RESERVATION_RELEASED), None, gross)
            } else if let Some(coupon_id) = e.coupon_id {
                match coupons::lock_for_order(
                    conn,
                    coupon_id,
                    e.user_id,
                    order_no,
                    gross,
                    e.reserved_at_ms,
                )? {
                    Some(discount) => {
                        coupon_locked.push(order_no);
                        (
                            WaitingPay,
                            None,
                            deadline,
                            gross.saturating_sub(discount).max(0),
                        )
                    }
                    None => (Failed, Some(COUPON_UNAVAILABLE), None, gross),
                }
            } else {
                (WaitingPay, None, deadline, gross)
            };
            rows.push(e, amount, status, reason, deadline);
        }
        let inserted: HashSet<i64> = rows.insert(conn)?;
        // A coupon locked for an order whose row already existed goes back.
        let orphaned: Vec<i64> = coupon_locked
            .iter()
            .filter(|o| !inserted.contains(o))
            .copied()
            .collect();
        coupons::unlock_for_orders(conn, &orphaned)?;

        // Stock for the inserted WAITING_PAY orders (the ledger writes
        // their LOCK rows before it locks any stock row). Orders the stock
        // cannot back fail, and hold nothing.
        let mut locked = rows.created(&inserted);
        let unbacked = stock::lock(conn, &locked)?;
        fail_orders(conn, &unbacked, STOCK_UNAVAILABLE)?;
        locked.retain(|o| !unbacked.contains(&o.order_no));

        // I2's last guard. Redis enforces the per-user limit atomically; this
        // holds it even if Redis lost its holdings. The stock rows are locked
        // by now, so a concurrent batch of the same activity waits here and
        // then sees this one's rows. Their lock is undone in this
        // transaction, so no one ever sees it.
        let over = over_limit(conn, &locked, &rows)?;
        let over_nos: Vec<i64> = over.iter().map(|o| o.order_no).collect();
        fail_orders(conn, &over_nos, LIMIT_EXCEEDED)?;
        stock::unlock(conn, &over)?;
        locked.retain(|o| !over_nos.contains(&o.order_no));
        outcome.created = locked.len();
        outcome.failed = inserted.len() - locked.len();
        outcome.statuses = rows.statuses(&inserted, &unbacked, &over_nos);
        // Rows this batch did not insert (a redelivery, a number taken)
        // are read: a lookup by numbers alone asks every partition, so only
        // for these.
        let rest: Vec<i64> = events
            .iter()
            .map(|e| e.order_no.get())
            .filter(|n| !outcome.statuses.contains_key(n) && !outcome.lost.contains(n))
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        if !rest.is_empty() {
            outcome.statuses.extend(statuses(conn, &rest)?);
        }
        Ok(outcome)
    })
}

/// What an event says of its order, to tell a redelivery from another
/// order under the same number.
fn payload(e: &OrderRequested) -> (ActivityId, i64, &str, i32, Option<CouponId>) {
    (
        e.activity_id,
        e.user_id,
        &e.request_id,
        e.quantity,
        e.coupon_id,
    )
}

/// Indexes of `events` that reuse an event_id with another payload: against
/// the order row of an event applied before, or against the first event
/// of the batch with that id.
fn conflicts(
    conn: &mut PgConn,
    events: &[OrderRequested],
    fresh: &HashSet<String>,
) -> QueryResult<Vec<usize>> {
    let applied: Vec<i64> = events
        .iter()
        .filter(|e| !fresh.contains(&e.event_id))
        .map(|e| e.order_no.get())
        .collect();
    let stored: HashMap<i64, Order> = if applied.is_empty() {
        HashMap::new()
    } else {
        orders::table
            .filter(orders::order_no.eq_any(&applied))
            .select(Order::as_select())
            .load(conn)?
            .into_iter()
            .map(|o| (o.order_no, o))
            .collect()
    };
    let mut first: HashMap<&str, &OrderRequested> = HashMap::new();
    let mut conflicts = Vec::new();
    for (i, e) in events.iter().enumerate() {
        let differs = match stored.get(&e.order_no.get()) {
            Some(o) if !fresh.contains(&e.event_id) => {
                (
                    o.activity_id,
                    o.user_id,
                    o.request_id.as_str(),
                    o.quantity,
                    o.coupon_id,
                ) != payload(e)
            }
            _ => payload(first.entry(&e.event_id).or_insert(e)) != payload(e),
        };
        if differs {
            conflicts.push(i);
        }
    }
    Ok(conflicts)
}

/// Marks WAITING_PAY orders FAILED with `reason` and frees their coupons.
fn fail_orders(conn: &mut PgConn, order_nos: &[i64], reason: &str) -> QueryResult<()> {
    if order_nos.is_empty() {
        return Ok(());
    }
    diesel::sql_query(format!(
        "UPDATE orders SET status = {}, failure_reason = $2, updated_at = now() \
         WHERE order_no = ANY($1) AND status = {}",
        OrderStatus::Failed.sql(),
        OrderStatus::WaitingPay.sql()
    ))
    .bind::<Array<BigInt>, _>(order_nos)
    .bind::<Text, _>(reason)
    .execute(conn)?;
    coupons::unlock_for_orders(conn, order_nos)
}

/// The orders of `batch` that would put their buyer over the activity's
/// per-user limit, counting every other live order of that buyer and this
/// batch's earlier ones (by order_no). The batch's orders come from
/// `rows` (their buyers and partitions), not from the table: a lookup of
/// the table by numbers alone asks each of its 16 partitions, and cost
/// the partitioned table's drain most of its time over the single table.
/// Each buyer's sum reads their partition only (pruned at run time).
fn over_limit(conn: &mut PgConn, batch: &[Units], rows: &OrderColumns) -> QueryResult<Vec<Units>> {
    if batch.is_empty() {
        return Ok(Vec::new());
    }
    let at: HashMap<i64, usize> = rows
        .order_no
        .iter()
        .enumerate()
        .map(|(i, &no)| (no, i))
        .collect();
    let mut b = OverLimitColumns::default();
    for u in batch {
        let i = at[&u.order_no];
        b.order_no.push(u.order_no);
        b.activity_id.push(u.activity_id);
        b.quantity.push(u.quantity);
        b.user_id.push(rows.user_id[i]);
        b.user_slot.push(rows.user_slot[i]);
    }
    diesel::sql_query(format!(
        "SELECT b.order_no, b.activity_id, b.quantity \
         FROM unnest($1::bigint[], $2::bigint[], $3::int[], $4::bigint[], $5::smallint[]) \
           AS b(order_no, activity_id, quantity, user_id, user_slot) \
         JOIN activities a ON a.id = b.activity_id \
         WHERE a.per_user_limit < ( \
           SELECT COALESCE(sum(p.quantity), 0) FROM orders p \
           WHERE p.user_slot = b.user_slot AND p.user_id = b.user_id \
             AND p.activity_id = b.activity_id \
             AND p.status IN ({}) \
             AND (p.order_no <> ALL($1) OR p.order_no <= b.order_no))",
        OrderStatus::sql_list(&OrderStatus::HOLDING)
    ))
    .bind::<Array<BigInt>, _>(&b.order_no)
    .bind::<Array<BigInt>, _>(&b.activity_id)
    .bind::<Array<Integer>, _>(&b.quantity)
    .bind::<Array<BigInt>, _>(&b.user_id)
    .bind::<Array<SmallInt>, _>(&b.user_slot)
    .load(conn)
}

/// The batch's locked orders, column-wise, for [`over_limit`].
#[derive(Default)]
struct OverLimitColumns {
    order_no: Vec<i64>,
    activity_id: Vec<ActivityId>,
    quantity: Vec<i32>,
    user_id: Vec<i64>,
    user_slot: Vec<i16>,
}

/// Column-wise order rows, inserted with one `unnest` statement.
#[derive(Default)]
struct OrderColumns {
    order_no: Vec<i64>,
    request_id: Vec<String>,
    activity_id: Vec<ActivityId>,
    user_id: Vec<i64>,
    user_slot: Vec<i16>,
    quantity: Vec<i32>,
    amount_cents: Vec<i64>,
    coupon_id: Vec<Option<CouponId>>,
    status: Vec<OrderStatus>,
    failure_reason: Vec<Option<&'static str>>,
    pay_deadline: Vec<Option<DateTime<Utc>>>,
}

impl OrderColumns {
    fn push(
        &mut self,
        e: &OrderRequested,
        amount_cents: i64,
        status: OrderStatus,
        reason: Option<&'static str>,
        deadline: Option<DateTime<Utc>>,
    ) {
        self.order_no.push(e.order_no.get());
        self.request_id.push(e.request_id.clone());
        self.activity_id.push(e.activity_id);
        self.user_id.push(e.user_id);
        self.user_slot.push(user_slot_column(e.user_id));
        self.quantity.push(e.quantity);
        self.amount_cents.push(amount_cents);
        self.coupon_id.push(e.coupon_id);
        self.status.push(status);
        self.failure_reason.push(reason);
        self.pay_deadline.push(deadline);
    }

    /// The units of the rows inserted as WAITING_PAY.
    fn created(&self, inserted: &HashSet<i64>) -> Vec<Units> {
        (0..self.order_no.len())
            .filter(|&i| {
                inserted.contains(&self.order_no[i]) && self.status[i] == OrderStatus::WaitingPay
            })
            .map(|i| Units {
                activity_id: self.activity_id[i],
                order_no: self.order_no[i],
                quantity: self.quantity[i],
            })
            .collect()
    }

    /// The status each inserted row is left in: as inserted, FAILED for
    /// those failed since (`unbacked`, `over`).
    fn statuses(
        &self,
        inserted: &HashSet<i64>,
        unbacked: &[i64],
        over: &[i64],
    ) -> HashMap<i64, OrderStatus> {
        let mut out: HashMap<i64, OrderStatus> = (0..self.order_no.len())
            .filter(|&i| inserted.contains(&self.order_no[i]))
            .map(|i| (self.order_no[i], self.status[i]))
            .collect();
        for no in unbacked.iter().chain(over) {
            out.insert(*no, OrderStatus::Failed);
        }
        out
    }

    /// Inserts every row not already there; returns the order_nos inserted.
    /// The rows go in partition by partition (`ORDER BY` the buyer's
    /// slot): routed in runs, not switching partitions at every row, the
    /// statement took about 7 % less (docs/BENCHMARKS-HISTORY.md, "Orders at scale").
    fn insert(&self, conn: &mut PgConn) -> QueryResult<HashSet<i64>> {
        if self.order_no.is_empty() {
            return Ok(HashSet::new());
        }
        let rows: Vec<OrderNoRow> = diesel::sql_query(
            "INSERT INTO orders (order_no, request_id, activity_id, user_id, quantity, amount_cents, \
             coupon_id, status, failure_reason, pay_deadline, user_slot) \
             SELECT * FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::bigint[], $5::int[], \
             $6::bigint[], $7::bigint[], $8::text[], $9::text[], $10::timestamptz[], \
             $11::smallint[]) ORDER BY 11 \
             ON CONFLICT DO NOTHING RETURNING order_no",
        )
        .bind::<Array<BigInt>, _>(&self.order_no)
        .bind::<Array<Text>, _>(&self.request_id)
        .bind::<Array<BigInt>, _>(&self.activity_id)
        .bind::<Array<BigInt>, _>(&self.user_id)
        .bind::<Array<Integer>, _>(&self.quantity)
        .bind::<Array<BigInt>, _>(&self.amount_cents)
        .bind::<Array<Nullable<BigInt>>, _>(&self.coupon_id)
        .bind::<Array<Text>, _>(&self.status)
        .bind::<Array<Nullable<Text>>, _>(&self.failure_reason)
        .bind::<Array<Nullable<Timestamptz>>, _>(&self.pay_deadline)
        .bind::<Array<SmallInt>, _>(&self.user_slot)
        .load(conn)?;
        Ok(rows.into_iter().map(|r| r.order_no).collect())
    }
}

/// Current status of each of `order_nos` that has a row.
pub fn statuses(conn: &mut PgConn, order_nos: &[i64]) -> QueryResult<HashMap<i64, OrderStatus>> {
    let rows: Vec<(i64, OrderStatus)> = orders::table
        .filter(orders::order_no.eq_any(order_nos))
        .select((orders::order_no, orders::status))
        .load(conn)?;
    Ok(rows.into_iter().collect())
}

/// Why an order whose event was dead-lettered failed.
pub const DEAD_LETTERED: &str = "DEAD_LETTERED";

/// Records the order of `e` as FAILED with `reason`, unless a row with its
/// order_no (or its request_id) already stands; returns the status of the
/// row with its order_no, `None` when there is none (another order holds
/// the request_id). Whoever inserts first wins: this races safely with the
/// consumer (SPEC step 4's arbitration by the order row).
pub fn insert_failed(
    conn: &mut PgConn,
    e: &OrderRequested,
    reason: &str,
) -> QueryResult<Option<OrderStatus>> {
    let order_no = e.order_no.get();
    diesel::sql_query(format!(
        "INSERT INTO orders (order_no, request_id, activity_id, user_id, quantity, amount_cents, status, failure_reason, user_slot) \
         SELECT $1, $2, $3, $4, $5, a.price_cents * $5, {}, $6, $7 FROM activities a WHERE a.id = $3 \
         ON CONFLICT DO NOTHING",
        OrderStatus::Failed.sql()
    ))
    .bind::<BigInt, _>(order_no)
    .bind::<Text, _>(&e.request_id)
    .bind::<BigInt, _>(e.activity_id)
    .bind::<BigInt, _>(e.user_id)
    .bind::<Integer, _>(e.quantity)
    .bind::<Text, _>(reason)
    .bind::<SmallInt, _>(user_slot_column(e.user_id))
    .execute(conn)?;
    Ok(statuses(conn, &[order_no])?.remove(&order_no))
}
