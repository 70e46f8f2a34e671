//! Activity and stock rows.

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Text};

use super::Activity;
use crate::admission::Layout;
use crate::admission::mode::Mode;
use crate::domain::ActivityId;
use crate::orders::OrderStatus;
use crate::room::repo::RoomRow;
use crate::store::PgConn;
use crate::store::schema::{activities, stock};

/// A new activity, validated by the route.
#[derive(Debug, Insertable)]
#[diesel(table_name = activities)]
pub struct NewActivity {
    pub sku_id: i64,
    pub name: String,
    pub price_cents: i64,
    pub start_at: DateTime<Utc>,
    pub end_at: DateTime<Utc>,
    pub per_user_limit: i32,
    pub pay_timeout_secs: i32,
    pub buckets: i32,
    pub shards: i32,
}

/// The stock row of an activity, in units.
#[derive(Debug, Clone, Copy, Queryable, Selectable)]
#[diesel(table_name = stock)]
pub struct StockRow {
    pub total: i32,
    pub available: i32,
    pub locked: i32,
    pub sold: i32,
}

/// Inserts the activity, its stock row and its waiting room (`room`, its
/// activity id set here) in one transaction.
pub fn create(
    conn: &mut PgConn,
    new: &NewActivity,
    units: i32,
    room: Option<RoomRow>,
) -> QueryResult<Activity> {
    conn.transaction(|conn| {
        let activity: Activity = diesel::insert_into(activities::table)
            .values(new)
            .returning(Activity::as_returning())
            .get_result(conn)?;
        crate::stock::open(conn, activity.id, units)?;
        if let Some(mut room) = room {
            room.activity_id = activity.id;
            crate::room::repo::insert(conn, &room)?;
        }
        Ok(activity)
    })
}

/// The activities not ended at `now` (their status, or their window).
pub fn live_ids(conn: &mut PgConn, now: DateTime<Utc>) -> QueryResult<Vec<ActivityId>> {
    activities::table
        .filter(activities::status.ne("ENDED"))
        .filter(activities::end_at.gt(now))
        .select(activities::id)
        .load(conn)
}

/// The activity, if it exists.
pub fn find(conn: &mut PgConn, id: ActivityId) -> QueryResult<Option<Activity>> {
    activities::table
        .find(id)
        .select(Activity::as_select())
        .first(conn)
        .optional()
}

/// The activity with its stock row.
pub fn find_with_stock(
    conn: &mut PgConn,
    id: ActivityId,
) -> QueryResult<Option<(Activity, StockRow)>> {
    activities::table
        .inner_join(stock::table)
        .filter(activities::id.eq(id))
        .select((Activity::as_select(), StockRow::as_select()))
        .first(conn)
        .optional()
}

/// Records that the activity's stock is in Redis (PENDING → READY, once).
pub fn mark_warmed(conn: &mut PgConn, id: ActivityId) -> QueryResult<()> {
    diesel::update(
        activities::table
            .find(id)
            .filter(activities::warmed_at.is_null()),
    )
    .set((
        activities::status.eq("READY"),
        activities::warmed_at.eq(diesel::dsl::now),
        activities::updated_at.eq(diesel::dsl::now),
    ))
    .execute(conn)?;
    Ok(())
}

/// Number of orders per status for one activity.
pub fn order_counts(conn: &mut PgConn, id: ActivityId) -> QueryResult<Vec<(OrderStatus, i64)>> {
    #[derive(QueryableByName)]
    struct Count {
        #[diesel(sql_type = Text)]
        status: OrderStatus,
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let rows: Vec<Count> = diesel::sql_query(
        "SELECT status, count(*) AS n FROM orders WHERE activity_id = $1 GROUP BY status",
    )
    .bind::<BigInt, _>(id)
    .load(conn)?;
    Ok(rows.into_iter().map(|r| (r.status, r.n)).collect())
}

/// A warmed activity reconciliation looks at.
#[derive(Debug, Clone, Copy)]
pub struct ToReconcile {
    pub id: ActivityId,
    pub layout: Layout,
    pub end_at: DateTime<Utc>,
    /// Where its purchases are admitted.
    pub mode: Mode,
}

/// Warmed activities still to reconcile: not yet ENDED (their Redis keys
/// not yet removed).
pub fn to_reconcile(conn: &mut PgConn) -> QueryResult<Vec<ToReconcile>> {
    let rows: Vec<(ActivityId, i32, i32, DateTime<Utc>, String)> = activities::table
        .filter(activities::warmed_at.is_not_null())
        .filter(activities::status.ne("ENDED"))
        .order(activities::id)
        .select((
            activities::id,
            activities::buckets,
            activities::shards,
            activities::end_at,
            activities::admission,
        ))
        .load(conn)?;
    Ok(rows
        .into_iter()
        .map(|(id, buckets, shards, end_at, mode)| ToReconcile {
            id,
            layout: super::layout(buckets, shards),
            end_at,
            mode: Mode::parse(&mode),
        })
        .collect())
}

/// Moves the activity's admission from `from` to `to` under its stock
/// row's lock, the lock every fallback purchase takes before it reads the
/// mode; false if it was not in `from`.
pub fn switch_admission(
    conn: &mut PgConn,
    id: ActivityId,
    from: &[Mode],
    to: Mode,
) -> QueryResult<bool> {
    conn.transaction(|conn| {
        stock::table
            .find(id)
            .select(stock::activity_id)
            .for_update()
            .first::<i64>(conn)
            .optional()?;
        let from: Vec<&str> = from.iter().map(|m| m.as_str()).collect();
        let n = diesel::update(
            activities::table
                .find(id)
                .filter(activities::admission.eq_any(from)),
        )
        .set((
            activities::admission.eq(to.as_str()),
            activities::admission_since.eq(diesel::dsl::now),
            activities::updated_at.eq(diesel::dsl::now),
        ))
        .execute(conn)?;
        Ok(n == 1)
    })
}

/// The advisory lock class of restore fences: an order batch holds its
/// activities' fences shared until it commits, a restore takes one
/// exclusively to move it.
const RESTORE_FENCE_LOCK: i32 = 0x5EC1;

/// Starts a restore of the activity from the database: admission moves
/// from `from` to RESTORING (false if it was not in one of them), and the
/// restore fence to `lost_at_ms` when that is later. Every order batch
/// that could have read the old fence has committed by then (each holds
/// the fence shared until it commits), so the restore's snapshot, taken
/// after this, holds their orders; every later batch reads the new fence
/// ([`restore_fences`]).
pub fn begin_restore(
    conn: &mut PgConn,
    id: ActivityId,
    from: &[Mode],
    lost_at_ms: i64,
) -> QueryResult<bool> {
    conn.transaction(|conn| {
        diesel::sql_query("SELECT pg_advisory_xact_lock($1, ($2 % 2147483647)::int4)")
            .bind::<diesel::sql_types::Integer, _>(RESTORE_FENCE_LOCK)
            .bind::<BigInt, _>(id.get())
            .execute(conn)?;
        let switched = switch_admission(conn, id, from, Mode::Restoring)?;
        diesel::sql_query(
            "UPDATE activities SET restore_fence_ms = GREATEST(restore_fence_ms, $2) WHERE id = $1",
        )
        .bind::<BigInt, _>(id.get())
        .bind::<BigInt, _>(lost_at_ms)
        .execute(conn)?;
        Ok(switched)
    })
}

#[derive(QueryableByName)]
struct Fence {
    #[diesel(sql_type = BigInt)]
    id: i64,
    #[diesel(sql_type = BigInt)]
    restore_fence_ms: i64,
}

/// Each activity's restore fence (unix ms; 0 if never restored), held
/// shared until the caller's transaction ends, so no restore moves it
/// meanwhile. A reservation made before it, and unknown to Redis, was lost
/// with Redis and not counted by the restore ([`begin_restore`]).
pub fn restore_fences(
    conn: &mut PgConn,
    ids: &[ActivityId],
) -> QueryResult<std::collections::HashMap<ActivityId, i64>> {
    let mut ids: Vec<i64> = ids.iter().map(|a| a.get()).collect();
    ids.sort_unstable();
    ids.dedup();
    diesel::sql_query(
        "SELECT pg_advisory_xact_lock_shared($1, (a % 2147483647)::int4) \
         FROM unnest($2::bigint[]) AS t(a) ORDER BY a",
    )
    .bind::<diesel::sql_types::Integer, _>(RESTORE_FENCE_LOCK)
    .bind::<diesel::sql_types::Array<BigInt>, _>(&ids)
    .execute(conn)?;
    let rows: Vec<Fence> =
        diesel::sql_query("SELECT id, restore_fence_ms FROM activities WHERE id = ANY($1)")
            .bind::<diesel::sql_types::Array<BigInt>, _>(&ids)
            .load(conn)?;
    Ok(rows
        .into_iter()
        .map(|f| (ActivityId::new(f.id), f.restore_fence_ms))
        .collect())
}

/// Records that an ended activity's Redis keys are gone.
pub fn mark_ended(conn: &mut PgConn, id: ActivityId) -> QueryResult<()> {
    diesel::update(activities::table.find(id))
        .set((
            activities::status.eq("ENDED"),
            activities::updated_at.eq(diesel::dsl::now),
        ))
        .execute(conn)?;
    Ok(())
}

/// Activities whose sale window is not long past (status lookups search
/// their reservations).
pub fn recent_ids(
    conn: &mut PgConn,
    since: DateTime<Utc>,
) -> QueryResult<Vec<(ActivityId, Layout)>> {
    let rows: Vec<(ActivityId, i32, i32)> = activities::table
        .filter(activities::end_at.gt(since))
        .filter(activities::warmed_at.is_not_null())
        .select((activities::id, activities::buckets, activities::shards))
        .load(conn)?;
    Ok(rows
        .into_iter()
        .map(|(id, buckets, shards)| (id, super::layout(buckets, shards)))
        .collect())
}

/// Activities whose sale ends after `since`, with their stock rows, the
/// soonest to start first; at most `limit`.
pub fn list_recent(
    conn: &mut PgConn,
    since: DateTime<Utc>,
    limit: i64,
) -> QueryResult<Vec<(Activity, StockRow)>> {
    activities::table
        .inner_join(stock::table)
        .filter(activities::end_at.gt(since))
        .order((activities::start_at.asc(), activities::id.asc()))
        .limit(limit)
        .select((Activity::as_select(), StockRow::as_select()))
        .load(conn)
}

/// Ends the sale at `now`: its window closes there (and opens no later
/// than just before, so a sale that had not started never does). `None`
/// when there is no such activity; an ended one is returned unchanged.
pub fn end(conn: &mut PgConn, id: ActivityId, now: DateTime<Utc>) -> QueryResult<Option<Activity>> {
    conn.transaction(|conn| {
        let Some(activity) = activities::table
            .find(id)
            .select(Activity::as_select())
            .for_update()
            .first(conn)
            .optional()?
        else {
            return Ok(None);
        };
        if activity.end_at <= now {
            return Ok(Some(activity));
        }
        let start_at = activity
            .start_at
            .min(now - chrono::Duration::milliseconds(1));
        diesel::update(activities::table.find(id))
            .set((
                activities::start_at.eq(start_at),
                activities::end_at.eq(now),
                activities::updated_at.eq(diesel::dsl::now),
            ))
            .returning(Activity::as_returning())
            .get_result(conn)
            .map(Some)
    })
}
