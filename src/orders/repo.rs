//! Order rows: the batch that creates them (SPEC step 3) and the reads
//! behind the status routes.

use std::collections::{BTreeMap, HashMap, HashSet};

use chrono::{DateTime, Duration, Utc};
use diesel::prelude::*;
use diesel::sql_types::{Array, BigInt, Integer, Nullable, Text, Timestamptz};
use serde::Serialize;

use super::OrderStatus;
use crate::admission::Layout;
use crate::bus::events::OrderRequested;
use crate::store::PgConn;
use crate::store::schema::{activities, orders};

/// An order row.
#[derive(Debug, Clone, Queryable, Selectable, Serialize)]
#[diesel(table_name = orders)]
pub struct Order {
    #[serde(serialize_with = "as_string")]
    pub order_no: i64,
    pub request_id: String,
    pub activity_id: i64,
    pub user_id: i64,
    pub quantity: i32,
    pub amount_cents: i64,
    pub coupon_id: Option<i64>,
    pub status: OrderStatus,
    pub failure_reason: Option<String>,
    pub pay_deadline: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
    pub paid_at: Option<DateTime<Utc>>,
}

fn as_string<S: serde::Serializer>(v: &i64, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

/// The caller's order, if it is theirs.
pub fn find_for_user(conn: &mut PgConn, order_no: i64, user_id: i64) -> QueryResult<Option<Order>> {
    orders::table
        .find(order_no)
        .filter(orders::user_id.eq(user_id))
        .select(Order::as_select())
        .first(conn)
        .optional()
}

/// The caller's orders, newest first, after `cursor` (an order_no).
pub fn list_for_user(
    conn: &mut PgConn,
    user_id: i64,
    status: Option<OrderStatus>,
    cursor: Option<i64>,
    limit: i64,
) -> QueryResult<Vec<Order>> {
    let mut query = orders::table
        .filter(orders::user_id.eq(user_id))
        .select(Order::as_select())
        .order(orders::order_no.desc())
        .limit(limit)
        .into_boxed();
    if let Some(status) = status {
        query = query.filter(orders::status.eq(status));
    }
    if let Some(cursor) = cursor {
        query = query.filter(orders::order_no.lt(cursor));
    }
    query.load(conn)
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
pub fn activity_terms(conn: &mut PgConn, ids: &[i64]) -> QueryResult<HashMap<i64, ActivityTerms>> {
    let rows: Vec<(i64, i64, i32, i32, i32)> = activities::table
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
}

/// SPEC step 3 in ONE transaction: skip events already in `consume_log`;
/// insert their orders (`ON CONFLICT DO NOTHING` on order_no and on
/// (activity, user, request_id)); move stock `available → locked` with one
/// conditional update per activity, falling back to per-order updates when
/// it does not fit; orders the stock cannot back become FAILED; `stock_flow`
/// LOCK rows for the rest. `released` are order_nos whose Redis reservation
/// is already released: they are recorded as FAILED and move no stock.
pub fn apply_batch(
    conn: &mut PgConn,
    consumer: &str,
    events: &[OrderRequested],
    terms: &HashMap<i64, ActivityTerms>,
    released: &HashSet<i64>,
    now: DateTime<Utc>,
) -> QueryResult<BatchOutcome> {
    use OrderStatus::{Failed, WaitingPay};
    conn.transaction(|conn| {
        let mut outcome = BatchOutcome::default();
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
            let gross = t.price_cents.saturating_mul(i64::from(e.quantity));
            let deadline = Some(now + Duration::seconds(i64::from(t.pay_timeout_secs)));
            let (status, reason, deadline, amount) = if released.contains(&order_no) {
                (Failed, Some(RESERVATION_RELEASED), None, gross)
            } else if let Some(coupon_id) = e.coupon_id {
                match lock_coupon(conn, coupon_id, e.user_id, order_no, gross)? {
                    Some(discount) => {
                        coupon_locked.push(order_no);
                        (WaitingPay, None, deadline, gross.saturating_sub(discount).max(0))
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
        let orphaned: Vec<i64> =
            coupon_locked.iter().filter(|o| !inserted.contains(o)).copied().collect();
        unlock_coupons(conn, &orphaned)?;

        // Stock for the inserted WAITING_PAY orders, per activity. Their
        // LOCK rows go in first, before any stock row is locked: a
        // concurrent batch of the same activity waits on that row only for
        // the update, the limit check and the commit. The rows of orders
        // that get no stock, or go over the limit, go again below (in this
        // transaction, so no one ever sees them).
        let mut by_activity: BTreeMap<i64, Vec<(i64, i32)>> = BTreeMap::new();
        for i in 0..rows.order_no.len() {
            if inserted.contains(&rows.order_no[i]) && rows.status[i] == WaitingPay {
                by_activity
                    .entry(rows.activity_id[i])
                    .or_default()
                    .push((rows.order_no[i], rows.quantity[i]));
            }
        }
        let mut locked: Vec<(i64, i64, i32)> = by_activity
            .iter()
            .flat_map(|(&a, orders)| orders.iter().map(move |&(o, q)| (a, o, q)))
            .collect();
        insert_lock_flows(conn, &locked)?;
        // Stock rows locked in id order: concurrent batches never deadlock.
        let mut unbacked: Vec<i64> = Vec::new();
        for (activity_id, orders) in by_activity {
            let units: i32 = orders.iter().map(|(_, q)| q).sum();
            if move_to_locked(conn, activity_id, units)? {
                continue;
            }
            for (order_no, quantity) in orders {
                if !move_to_locked(conn, activity_id, quantity)? {
                    unbacked.push(order_no);
                }
            }
        }
        fail_orders(conn, &unbacked, STOCK_UNAVAILABLE)?;

        // I2's last guard. Redis enforces the per-user limit atomically; this
        // holds it even if Redis lost its holdings. The stock rows are locked
        // by now, so a concurrent batch of the same activity waits here and
        // then sees this one's rows.
        locked.retain(|(_, o, _)| !unbacked.contains(o));
        let over = over_limit(conn, &locked)?;
        if !over.is_empty() {
            fail_orders(conn, &over.iter().map(|o| o.order_no).collect::<Vec<_>>(), LIMIT_EXCEEDED)?;
            let mut units: BTreeMap<i64, i32> = BTreeMap::new();
            for o in &over {
                *units.entry(o.activity_id).or_default() += o.quantity;
            }
            for (activity_id, n) in units {
                diesel::sql_query(
                    "UPDATE stock SET available = available + $2, locked = locked - $2, updated_at = now() \
                     WHERE activity_id = $1",
                )
                .bind::<BigInt, _>(activity_id)
                .bind::<Integer, _>(n)
                .execute(conn)?;
            }
            locked.retain(|(_, o, _)| !over.iter().any(|v| v.order_no == *o));
        }
        let unlocked: Vec<i64> = unbacked
            .iter()
            .copied()
            .chain(over.iter().map(|o| o.order_no))
            .collect();
        if !unlocked.is_empty() {
            diesel::sql_query("DELETE FROM stock_flow WHERE biz_type = 'LOCK' AND biz_no = ANY($1)")
                .bind::<Array<BigInt>, _>(&unlocked)
                .execute(conn)?;
        }
        outcome.created = locked.len();
        outcome.failed = inserted.len() - locked.len();
        Ok(outcome)
    })
}

/// What an event says of its order, to tell a redelivery from another
/// order under the same number.
fn payload(e: &OrderRequested) -> (i64, i64, &str, i32, Option<i64>) {
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
    unlock_coupons(conn, order_nos)
}

#[derive(QueryableByName)]
struct OverLimit {
    #[diesel(sql_type = BigInt)]
    order_no: i64,
    #[diesel(sql_type = BigInt)]
    activity_id: i64,
    #[diesel(sql_type = Integer)]
    quantity: i32,
}

/// The orders of `batch` (activity, order_no, quantity) that would put their
/// buyer over the activity's per-user limit, counting every other live order
/// of that buyer and this batch's earlier ones (by order_no).
fn over_limit(conn: &mut PgConn, batch: &[(i64, i64, i32)]) -> QueryResult<Vec<OverLimit>> {
    if batch.is_empty() {
        return Ok(Vec::new());
    }
    let nos: Vec<i64> = batch.iter().map(|(_, o, _)| *o).collect();
    diesel::sql_query(format!(
        "SELECT o.order_no, o.activity_id, o.quantity FROM orders o \
         JOIN activities a ON a.id = o.activity_id \
         WHERE o.order_no = ANY($1) AND a.per_user_limit < ( \
           SELECT COALESCE(sum(p.quantity), 0) FROM orders p \
           WHERE p.user_id = o.user_id AND p.activity_id = o.activity_id \
             AND p.status IN ({}) \
             AND (p.order_no <> ALL($1) OR p.order_no <= o.order_no))",
        OrderStatus::sql_list(&OrderStatus::HOLDING)
    ))
    .bind::<Array<BigInt>, _>(&nos)
    .load(conn)
}

/// Locks the user's UNUSED coupon of batch `coupon_id` for `order_no`, if
/// the batch is still valid and the order reaches its minimum; returns the
/// discount. The conditional update makes one coupon back one order (I8).
fn lock_coupon(
    conn: &mut PgConn,
    coupon_id: i64,
    user_id: i64,
    order_no: i64,
    gross_cents: i64,
) -> QueryResult<Option<i64>> {
    #[derive(QueryableByName)]
    struct Discount {
        #[diesel(sql_type = BigInt)]
        discount_cents: i64,
    }
    let locked: Option<Discount> = diesel::sql_query(
        "UPDATE user_coupons uc SET status = 'LOCKED', order_no = $3, updated_at = now()          FROM coupons c          WHERE uc.coupon_id = $1 AND uc.user_id = $2 AND uc.status = 'UNUSED'            AND c.id = uc.coupon_id AND c.valid_until > now() AND c.min_amount_cents <= $4          RETURNING c.discount_cents",
    )
    .bind::<BigInt, _>(coupon_id)
    .bind::<BigInt, _>(user_id)
    .bind::<BigInt, _>(order_no)
    .bind::<BigInt, _>(gross_cents)
    .get_result(conn)
    .optional()?;
    Ok(locked.map(|d| d.discount_cents))
}

/// Returns the coupons locked by `order_nos` to UNUSED.
fn unlock_coupons(conn: &mut PgConn, order_nos: &[i64]) -> QueryResult<()> {
    if order_nos.is_empty() {
        return Ok(());
    }
    diesel::sql_query(
        "UPDATE user_coupons SET status = 'UNUSED', order_no = NULL, updated_at = now()          WHERE order_no = ANY($1) AND status = 'LOCKED'",
    )
    .bind::<Array<BigInt>, _>(order_nos)
    .execute(conn)?;
    Ok(())
}

/// `available → locked` for `units`, only if that many are available.
fn move_to_locked(conn: &mut PgConn, activity_id: i64, units: i32) -> QueryResult<bool> {
    let n = diesel::sql_query(
        "UPDATE stock SET available = available - $2, locked = locked + $2, updated_at = now() \
         WHERE activity_id = $1 AND available >= $2",
    )
    .bind::<BigInt, _>(activity_id)
    .bind::<Integer, _>(units)
    .execute(conn)?;
    Ok(n == 1)
}

/// The LOCK rows of `orders` (activity, order_no, quantity). No ON
/// CONFLICT: a second LOCK for one order must abort the batch.
fn insert_lock_flows(conn: &mut PgConn, orders: &[(i64, i64, i32)]) -> QueryResult<()> {
    if orders.is_empty() {
        return Ok(());
    }
    let (a, o, q) = unzip3(orders);
    diesel::sql_query(
        "INSERT INTO stock_flow (activity_id, biz_type, biz_no, quantity) \
         SELECT a, 'LOCK', o, q FROM unnest($1::bigint[], $2::bigint[], $3::int[]) AS t(a, o, q)",
    )
    .bind::<Array<BigInt>, _>(&a)
    .bind::<Array<BigInt>, _>(&o)
    .bind::<Array<Integer>, _>(&q)
    .execute(conn)?;
    Ok(())
}

fn unzip3(v: &[(i64, i64, i32)]) -> (Vec<i64>, Vec<i64>, Vec<i32>) {
    let mut out = (
        Vec::with_capacity(v.len()),
        Vec::with_capacity(v.len()),
        Vec::with_capacity(v.len()),
    );
    for &(a, b, c) in v {
        out.0.push(a);
        out.1.push(b);
        out.2.push(c);
    }
    out
}

/// Column-wise order rows, inserted with one `unnest` statement.
#[derive(Default)]
struct OrderColumns {
    order_no: Vec<i64>,
    request_id: Vec<String>,
    activity_id: Vec<i64>,
    user_id: Vec<i64>,
    quantity: Vec<i32>,
    amount_cents: Vec<i64>,
    coupon_id: Vec<Option<i64>>,
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
        self.quantity.push(e.quantity);
        self.amount_cents.push(amount_cents);
        self.coupon_id.push(e.coupon_id);
        self.status.push(status);
        self.failure_reason.push(reason);
        self.pay_deadline.push(deadline);
    }

    /// Inserts every row not already there; returns the order_nos inserted.
    fn insert(&self, conn: &mut PgConn) -> QueryResult<HashSet<i64>> {
        if self.order_no.is_empty() {
            return Ok(HashSet::new());
        }
        let rows: Vec<OrderNoRow> = diesel::sql_query(
            "INSERT INTO orders (order_no, request_id, activity_id, user_id, quantity, amount_cents, \
             coupon_id, status, failure_reason, pay_deadline) \
             SELECT * FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::bigint[], $5::int[], \
             $6::bigint[], $7::bigint[], $8::text[], $9::text[], $10::timestamptz[]) \
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
        "INSERT INTO orders (order_no, request_id, activity_id, user_id, quantity, amount_cents, status, failure_reason) \
         SELECT $1, $2, $3, $4, $5, a.price_cents * $5, {}, $6 FROM activities a WHERE a.id = $3 \
         ON CONFLICT DO NOTHING",
        OrderStatus::Failed.sql()
    ))
    .bind::<BigInt, _>(order_no)
    .bind::<Text, _>(&e.request_id)
    .bind::<BigInt, _>(e.activity_id)
    .bind::<BigInt, _>(e.user_id)
    .bind::<Integer, _>(e.quantity)
    .bind::<Text, _>(reason)
    .execute(conn)?;
    Ok(statuses(conn, &[order_no])?.remove(&order_no))
}
