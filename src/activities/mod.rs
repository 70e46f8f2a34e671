//! Activities: a flash sale of one SKU, its stock row and its lifecycle
//! PENDING → READY (warmed into Redis) → ACTIVE (inside the sale window) →
//! ENDED. The stored status says whether it was warmed; the clock says the rest.

pub mod cache;
pub mod repo;
pub mod stats;

use chrono::{DateTime, Utc};
use diesel::prelude::*;
use serde::Serialize;

use crate::admission::{Layout, WarmSpec};
use crate::domain::ActivityId;
use crate::store::schema::activities;

/// An activity row.
#[derive(Debug, Clone, Queryable, Selectable)]
#[diesel(table_name = activities)]
pub struct Activity {
    pub id: ActivityId,
    pub sku_id: i64,
    pub name: String,
    pub price_cents: i64,
    pub start_at: DateTime<Utc>,
    pub end_at: DateTime<Utc>,
    pub per_user_limit: i32,
    pub pay_timeout_secs: i32,
    pub buckets: i32,
    pub status: String,
    pub warmed_at: Option<DateTime<Utc>>,
    pub shards: i32,
}

/// The lifecycle state shown to clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Lifecycle {
    /// Created, stock not in Redis yet.
    Pending,
    /// Warmed, sale not started.
    Ready,
    /// Warmed and inside the sale window.
    Active,
    /// The sale window is over.
    Ended,
}

impl Activity {
    /// The lifecycle state at `now`.
    pub fn lifecycle(&self, now: DateTime<Utc>) -> Lifecycle {
        lifecycle(self.warmed_at.is_some(), self.start_at, self.end_at, now)
    }

    /// Its Redis layout: buckets per shard and shards (validated on
    /// creation).
    pub fn layout(&self) -> Layout {
        layout(self.buckets, self.shards)
    }

    /// What Redis is loaded with: its window, limit, price and buckets, and
    /// `units` of stock (the database's available count).
    pub fn warm_spec(&self, units: i32) -> WarmSpec {
        WarmSpec {
            activity_id: self.id,
            start_ms: self.start_at.timestamp_millis(),
            end_ms: self.end_at.timestamp_millis(),
            per_user_limit: self.per_user_limit,
            units,
            price_cents: self.price_cents,
            layout: self.layout(),
        }
    }
}

/// A stored `(buckets, shards)` pair as a [`Layout`].
pub fn layout(buckets: i32, shards: i32) -> Layout {
    Layout::new(
        usize::try_from(buckets).unwrap_or(1),
        usize::try_from(shards).unwrap_or(1),
    )
}

/// Lifecycle rule, kept apart from the row so it is testable on its own.
pub fn lifecycle(
    warmed: bool,
    start_at: DateTime<Utc>,
    end_at: DateTime<Utc>,
    now: DateTime<Utc>,
) -> Lifecycle {
    if now >= end_at {
        Lifecycle::Ended
    } else if !warmed {
        Lifecycle::Pending
    } else if now < start_at {
        Lifecycle::Ready
    } else {
        Lifecycle::Active
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Duration;

    #[test]
    fn lifecycle_follows_warm_up_and_the_clock() {
        let now = Utc::now();
        let (start, end) = (now + Duration::minutes(1), now + Duration::minutes(2));
        assert_eq!(lifecycle(false, start, end, now), Lifecycle::Pending);
        assert_eq!(lifecycle(true, start, end, now), Lifecycle::Ready);
        assert_eq!(lifecycle(true, start, end, start), Lifecycle::Active);
        assert_eq!(lifecycle(false, start, end, start), Lifecycle::Pending);
        assert_eq!(lifecycle(true, start, end, end), Lifecycle::Ended);
        assert_eq!(lifecycle(false, start, end, end), Lifecycle::Ended);
    }
}
