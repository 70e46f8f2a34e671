//! Coupon rows: batches, the claims consumer's transaction, the owner's list.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{Array, BigInt, Text, Timestamptz};
use serde::Serialize;

use crate::bus::events::CouponClaimed;
use crate::domain::CouponId;
use crate::store::PgConn;
use crate::store::schema::{coupons, user_coupons};

/// A coupon batch.
#[derive(Debug, Clone, Queryable, Selectable, Serialize)]
#[diesel(table_name = coupons)]
pub struct Coupon {
    #[serde(rename = "coupon_id")]
    pub id: CouponId,
    pub name: String,
    pub total: i32,
    pub discount_cents: i64,
    pub min_amount_cents: i64,
    pub per_user_limit: i32,
    pub valid_until: DateTime<Utc>,
}

/// A new batch, validated by the route.
#[derive(Debug, Insertable)]
#[diesel(table_name = coupons)]
pub struct NewCoupon {
    pub name: String,
    pub total: i32,
    pub discount_cents: i64,
    pub min_amount_cents: i64,
    pub per_user_limit: i32,
    pub valid_until: DateTime<Utc>,
}

/// Inserts a batch; `warm` loads it into Redis before the transaction
/// commits, so a failed warm-up leaves no row behind.
pub fn create(
    conn: &mut PgConn,
    new: &NewCoupon,
    warm: impl FnOnce(&Coupon) -> anyhow::Result<()>,
) -> anyhow::Result<Coupon> {
    conn.transaction(|conn| {
        let coupon: Coupon = diesel::insert_into(coupons::table)
            .values(new)
            .returning(Coupon::as_returning())
            .get_result(conn)?;
        warm(&coupon)?;
        Ok(coupon)
    })
}

/// The batch, if it exists.
pub fn find(conn: &mut PgConn, id: CouponId) -> QueryResult<Option<(Coupon, i32)>> {
    coupons::table
        .find(id)
        .select((Coupon::as_select(), coupons::claimed))
        .first(conn)
        .optional()
}

/// One of the caller's coupons.
#[derive(Debug, Clone, Queryable, Serialize, utoipa::ToSchema)]
pub struct Mine {
    #[schema(value_type = i64)]
    pub coupon_id: CouponId,
    /// UNUSED, LOCKED (by an order waiting for payment) or USED.
    pub status: String,
    /// The order it is locked by or was used for, as a decimal string.
    #[serde(serialize_with = "opt_string")]
    #[schema(value_type = Option<String>)]
    pub order_no: Option<i64>,
}

fn opt_string<S: serde::Serializer>(v: &Option<i64>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(n) => s.collect_str(n),
        None => s.serialize_none(),
    }
}

/// The caller's coupons, newest claim first.
pub fn mine(conn: &mut PgConn, user_id: i64) -> QueryResult<Vec<Mine>> {
    user_coupons::table
        .filter(user_coupons::user_id.eq(user_id))
        .order(user_coupons::id.desc())
        .select((
            user_coupons::coupon_id,
            user_coupons::status,
            user_coupons::order_no,
        ))
        .load(conn)
}

/// User coupons of a batch per status.
pub fn status_counts(conn: &mut PgConn, coupon_id: CouponId) -> QueryResult<Vec<(String, i64)>> {
    user_coupons::table
        .filter(user_coupons::coupon_id.eq(coupon_id))
        .group_by(user_coupons::status)
        .select((user_coupons::status, diesel::dsl::count_star()))
        .load(conn)
}

#[derive(QueryableByName)]
struct Id {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

/// What a claims batch did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ClaimsOutcome {
    /// Rows written.
    pub written: usize,
    /// Events applied before.
    pub duplicates: usize,
    /// The user already had one (the unique key refused it).
    pub refused_duplicate_user: usize,
    /// The batch was full in the database (Redis issued too many): refused.
    pub refused_over_issue: usize,
}

/// Writes claims in ONE transaction. The database stays the last guard:
/// `ON CONFLICT DO NOTHING` on `(coupon_id, user_id)`, and `claimed` only
/// grows while it is below `total`.
pub fn apply_claims(
    conn: &mut PgConn,
    consumer: &str,
    events: &[CouponClaimed],
) -> QueryResult<ClaimsOutcome> {
    conn.transaction(|conn| {
        let mut out = ClaimsOutcome::default();
        for e in events {
            let fresh = diesel::sql_query(
                "INSERT INTO consume_log (event_id, consumer) VALUES ($1, $2) ON CONFLICT DO NOTHING",
            )
            .bind::<Text, _>(&e.event_id)
            .bind::<Text, _>(consumer)
            .execute(conn)?;
            if fresh == 0 {
                out.duplicates += 1;
                continue;
            }
            let inserted: Option<Id> = diesel::sql_query(
                "INSERT INTO user_coupons (coupon_id, user_id, request_id) \
                 SELECT id, $2, $3 FROM coupons WHERE id = $1 \
                 ON CONFLICT DO NOTHING RETURNING id",
            )
            .bind::<BigInt, _>(e.coupon_id)
            .bind::<BigInt, _>(e.user_id)
            .bind::<Text, _>(&e.request_id)
            .get_result(conn)
            .optional()?;
            let Some(row) = inserted else {
                out.refused_duplicate_user += 1;
                continue;
            };
            let counted = diesel::sql_query(
                "UPDATE coupons SET claimed = claimed + 1 WHERE id = $1 AND claimed < total",
            )
            .bind::<BigInt, _>(e.coupon_id)
            .execute(conn)?;
            if counted == 0 {
                diesel::sql_query("DELETE FROM user_coupons WHERE id = $1").bind::<BigInt, _>(row.id).execute(conn)?;
                out.refused_over_issue += 1;
                continue;
            }
            out.written += 1;
        }
        Ok(out)
    })
}

/// Locks the buyer's coupon of batch `coupon_id` for `order_no`, as
/// admission decided at `purchased_at_ms` (unix ms): the batch valid then,
/// the order reaching its minimum. Returns the discount, or `None` when
/// the database holds the coupon for something else (drift: admission had
/// it free). The conditional update makes one coupon back one order (I8).
///
/// A claim answered before its consumer wrote its row leaves no row yet:
/// the row is written here, LOCKED, and counted against the batch's total
/// as the claim's own write would be; that write later finds it and adds
/// nothing. So a purchase admitted with a coupon is never FAILED for the
/// claim consumer's lag, nor for the batch expiring while the order waits
/// on the broker.
pub fn lock_for_order(
    conn: &mut PgConn,
    coupon_id: CouponId,
    user_id: i64,
    order_no: i64,
    gross_cents: i64,
    purchased_at_ms: i64,
) -> QueryResult<Option<i64>> {
    #[derive(QueryableByName)]
    struct Discount {
        #[diesel(sql_type = BigInt)]
        discount_cents: i64,
    }
    // An event with no time (a reservation read back without one) is
    // judged now, as before.
    let purchased_at = Some(purchased_at_ms)
        .filter(|ms| *ms > 0)
        .and_then(DateTime::<Utc>::from_timestamp_millis)
        .unwrap_or_else(Utc::now);
    let lock = |conn: &mut PgConn| -> QueryResult<Option<i64>> {
        let locked: Option<Discount> = diesel::sql_query(
            "UPDATE user_coupons uc SET status = 'LOCKED', order_no = $3, updated_at = now() \
             FROM coupons c \
             WHERE uc.coupon_id = $1 AND uc.user_id = $2 AND uc.status = 'UNUSED' \
               AND c.id = uc.coupon_id AND c.valid_until > $5 AND c.min_amount_cents <= $4 \
             RETURNING c.discount_cents",
        )
        .bind::<BigInt, _>(coupon_id)
        .bind::<BigInt, _>(user_id)
        .bind::<BigInt, _>(order_no)
        .bind::<BigInt, _>(gross_cents)
        .bind::<Timestamptz, _>(purchased_at)
        .get_result(conn)
        .optional()?;
        Ok(locked.map(|d| d.discount_cents))
    };
    if let Some(discount) = lock(conn)? {
        return Ok(Some(discount));
    }
    let written: i64 = user_coupons::table
        .filter(user_coupons::coupon_id.eq(coupon_id))
        .filter(user_coupons::user_id.eq(user_id))
        .count()
        .get_result(conn)?;
    if written > 0 {
        return Ok(None);
    }
    // The claim's row is not written yet: written here, for this order.
    let inserted: Option<Discount> = diesel::sql_query(
        "INSERT INTO user_coupons (coupon_id, user_id, request_id, status, order_no) \
         SELECT c.id, $2, 'order:' || $3::text, 'LOCKED', $3 FROM coupons c \
         WHERE c.id = $1 AND c.valid_until > $5 AND c.min_amount_cents <= $4 \
         ON CONFLICT DO NOTHING \
         RETURNING (SELECT discount_cents FROM coupons WHERE id = $1) AS discount_cents",
    )
    .bind::<BigInt, _>(coupon_id)
    .bind::<BigInt, _>(user_id)
    .bind::<BigInt, _>(order_no)
    .bind::<BigInt, _>(gross_cents)
    .bind::<Timestamptz, _>(purchased_at)
    .get_result(conn)
    .optional()?;
    let Some(inserted) = inserted else {
        // The claim consumer wrote it meanwhile: lock that one.
        return lock(conn);
    };
    let counted = diesel::sql_query(
        "UPDATE coupons SET claimed = claimed + 1 WHERE id = $1 AND claimed < total",
    )
    .bind::<BigInt, _>(coupon_id)
    .execute(conn)?;
    if counted == 0 {
        // The batch is full in the database: Redis issued one too many.
        diesel::delete(
            user_coupons::table
                .filter(user_coupons::coupon_id.eq(coupon_id))
                .filter(user_coupons::user_id.eq(user_id)),
        )
        .execute(conn)?;
        return Ok(None);
    }
    Ok(Some(inserted.discount_cents))
}

/// Returns the coupons locked by `order_nos` to UNUSED (their orders
/// failed, or were cancelled or closed).
pub fn unlock_for_orders(conn: &mut PgConn, order_nos: &[i64]) -> QueryResult<()> {
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

/// Marks the coupon locked by a paid order USED.
pub fn use_for_order(conn: &mut PgConn, order_no: i64) -> QueryResult<()> {
    diesel::sql_query(
        "UPDATE user_coupons SET status = 'USED', updated_at = now() \
         WHERE order_no = $1 AND status = 'LOCKED'",
    )
    .bind::<BigInt, _>(order_no)
    .execute(conn)?;
    Ok(())
}

/// A batch still valid, as a restore needs it: what is left, and every
/// claim written so far (user, request id), read in one snapshot.
pub struct BatchSnapshot {
    pub coupon_id: CouponId,
    pub remaining: i64,
    pub valid_until_ms: i64,
    pub min_amount_cents: i64,
    pub claims: Vec<(i64, String)>,
    /// Every coupon backing an order (LOCKED or USED): (user, order_no).
    pub holds: Vec<(i64, i64)>,
}

/// The ids of the batches still valid at `now`.
pub fn valid_ids(conn: &mut PgConn, now: DateTime<Utc>) -> QueryResult<Vec<CouponId>> {
    coupons::table
        .filter(coupons::valid_until.gt(now))
        .select(coupons::id)
        .order(coupons::id)
        .load(conn)
}

/// One batch's snapshot (run it in a repeatable-read transaction).
pub fn snapshot(conn: &mut PgConn, coupon_id: CouponId) -> QueryResult<Option<BatchSnapshot>> {
    let Some((coupon, claimed)) = find(conn, coupon_id)? else {
        return Ok(None);
    };
    let claims: Vec<(i64, String)> = user_coupons::table
        .filter(user_coupons::coupon_id.eq(coupon_id))
        .select((user_coupons::user_id, user_coupons::request_id))
        .load(conn)?;
    Ok(Some(BatchSnapshot {
        coupon_id,
        remaining: i64::from(coupon.total) - i64::from(claimed),
        valid_until_ms: coupon.valid_until.timestamp_millis(),
        min_amount_cents: coupon.min_amount_cents,
        claims,
        holds: holds(conn, coupon_id)?,
    }))
}

/// The batch's coupons backing an order, LOCKED by a live one or USED by a
/// paid one: (user, order_no).
pub fn holds(conn: &mut PgConn, coupon_id: CouponId) -> QueryResult<Vec<(i64, i64)>> {
    let rows: Vec<(i64, Option<i64>)> = user_coupons::table
        .filter(user_coupons::coupon_id.eq(coupon_id))
        .filter(user_coupons::status.eq_any(["LOCKED", "USED"]))
        .select((user_coupons::user_id, user_coupons::order_no))
        .load(conn)?;
    Ok(rows
        .into_iter()
        .filter_map(|(user, order_no)| Some((user, order_no?)))
        .collect())
}
