//! The `waiting_rooms` row of an activity: its settings, seed and epoch.

use chrono::{DateTime, Utc};
use diesel::prelude::*;

use crate::domain::ActivityId;
use crate::store::PgConn;
use crate::store::schema::{activities, waiting_rooms};

/// A room's row.
#[derive(Debug, Clone, Queryable, Selectable, Insertable)]
#[diesel(table_name = waiting_rooms)]
pub struct RoomRow {
    pub activity_id: ActivityId,
    pub prequeue_secs: i32,
    pub admit_per_sec: i32,
    pub max_active: Option<i32>,
    pub pass_ttl_secs: i32,
    pub offer_secs: i32,
    pub pow_difficulty: i64,
    /// Hex, 32 bytes; secret until the sale starts.
    pub seed: String,
    pub epoch: i32,
    /// [`super::Method`]'s name.
    pub method: String,
}

impl RoomRow {
    /// How the room lets buyers through now (as read).
    pub fn method(&self) -> super::Method {
        super::Method::parse(&self.method).unwrap_or_default()
    }
}

/// A room with its activity's window and layout: what the admitter and
/// the routes need.
#[derive(Debug, Clone)]
pub struct LiveRoom {
    pub room: RoomRow,
    pub start_at: DateTime<Utc>,
    pub end_at: DateTime<Utc>,
    pub buckets: i32,
    pub shards: i32,
    pub warmed: bool,
    /// Its first queue was opened in Redis: a queue missing since was lost.
    pub opened: bool,
}

/// Inserts the room (inside the activity's creation transaction).
pub fn insert(conn: &mut PgConn, row: &RoomRow) -> QueryResult<()> {
    diesel::insert_into(waiting_rooms::table)
        .values(row)
        .execute(conn)?;
    Ok(())
}

/// The room of an activity, if it has one.
pub fn find(conn: &mut PgConn, id: ActivityId) -> QueryResult<Option<RoomRow>> {
    waiting_rooms::table
        .find(id)
        .select(RoomRow::as_select())
        .first(conn)
        .optional()
}

/// Every activity that has a room.
pub fn ids(conn: &mut PgConn) -> QueryResult<Vec<ActivityId>> {
    waiting_rooms::table
        .select(waiting_rooms::activity_id)
        .load(conn)
}

/// The rooms of these activities.
pub fn find_many(conn: &mut PgConn, ids: &[ActivityId]) -> QueryResult<Vec<RoomRow>> {
    waiting_rooms::table
        .filter(waiting_rooms::activity_id.eq_any(ids))
        .select(RoomRow::as_select())
        .load(conn)
}

type LiveColumns = (
    RoomRow,
    DateTime<Utc>,
    DateTime<Utc>,
    i32,
    i32,
    Option<DateTime<Utc>>,
    Option<DateTime<Utc>>,
);

fn live_room(
    (room, start_at, end_at, buckets, shards, warmed_at, opened_at): LiveColumns,
) -> LiveRoom {
    LiveRoom {
        room,
        start_at,
        end_at,
        buckets,
        shards,
        warmed: warmed_at.is_some(),
        opened: opened_at.is_some(),
    }
}

macro_rules! live_columns {
    () => {
        (
            RoomRow::as_select(),
            activities::start_at,
            activities::end_at,
            activities::buckets,
            activities::shards,
            activities::warmed_at,
            waiting_rooms::opened_at,
        )
    };
}

/// Rooms of activities not ended at `now` (warmed or not), the admitter's
/// round.
pub fn live(conn: &mut PgConn, now: DateTime<Utc>) -> QueryResult<Vec<LiveRoom>> {
    let rows: Vec<LiveColumns> = waiting_rooms::table
        .inner_join(activities::table)
        .filter(activities::end_at.gt(now))
        .filter(activities::status.ne("ENDED"))
        .select(live_columns!())
        .load(conn)?;
    Ok(rows.into_iter().map(live_room).collect())
}

/// The room of one activity with its window.
pub fn find_live(conn: &mut PgConn, id: ActivityId) -> QueryResult<Option<LiveRoom>> {
    let row: Option<LiveColumns> = waiting_rooms::table
        .inner_join(activities::table)
        .filter(waiting_rooms::activity_id.eq(id))
        .select(live_columns!())
        .first(conn)
        .optional()?;
    Ok(row.map(live_room))
}

/// Records that the room's first queue is open; false if it was already.
pub fn mark_opened(conn: &mut PgConn, id: ActivityId) -> QueryResult<bool> {
    let n = diesel::update(
        waiting_rooms::table
            .find(id)
            .filter(waiting_rooms::opened_at.is_null()),
    )
    .set(waiting_rooms::opened_at.eq(diesel::dsl::now))
    .execute(conn)?;
    Ok(n == 1)
}

/// Sets the admission rate and cap; the row after, `None` without a room.
pub fn set_rate(
    conn: &mut PgConn,
    id: ActivityId,
    rate: Option<(i32, Option<i32>)>,
    method: Option<super::Method>,
) -> QueryResult<Option<RoomRow>> {
    conn.transaction(|conn| {
        if let Some((admit_per_sec, max_active)) = rate {
            diesel::update(waiting_rooms::table.find(id))
                .set((
                    waiting_rooms::admit_per_sec.eq(admit_per_sec),
                    waiting_rooms::max_active.eq(max_active),
                ))
                .execute(conn)?;
        }
        if let Some(method) = method {
            diesel::update(waiting_rooms::table.find(id))
                .set(waiting_rooms::method.eq(method.as_str()))
                .execute(conn)?;
        }
        diesel::update(waiting_rooms::table.find(id))
            .set(waiting_rooms::updated_at.eq(diesel::dsl::now))
            .returning(RoomRow::as_returning())
            .get_result(conn)
            .optional()
    })
}

/// Starts the room's next epoch after `seen` (Redis lost the queue), once
/// however many instances see the loss: the epoch after, or `None` when
/// another instance started it first.
pub fn next_epoch(conn: &mut PgConn, id: ActivityId, seen: i32) -> QueryResult<Option<i32>> {
    diesel::update(
        waiting_rooms::table
            .find(id)
            .filter(waiting_rooms::epoch.eq(seen)),
    )
    .set((
        waiting_rooms::epoch.eq(seen + 1),
        waiting_rooms::updated_at.eq(diesel::dsl::now),
    ))
    .returning(waiting_rooms::epoch)
    .get_result(conn)
    .optional()
}
