//! An activity's figures from both sides (`GET /admin/activities/{id}/stats`):
//! the database's stock row and order counts from ONE snapshot, and Redis's
//! open reservations and available units, read in that order.

use std::collections::BTreeMap;

use serde::Serialize;

use super::{Lifecycle, repo};
use crate::admission::RedisGate;
use crate::admission::gate::room::RoomFigures;
use crate::clock::Clock;
use crate::domain::ActivityId;
use crate::orders::OrderStatus;
use crate::store::{self, PgPool};

/// The figures of one activity.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ActivityStats {
    /// The activity.
    #[schema(value_type = i64)]
    pub activity_id: ActivityId,
    /// Its lifecycle state on the sale clock.
    pub status: Lifecycle,
    /// Units the activity was created with.
    pub stock_total: i32,
    /// Units Redis holds for sale (every bucket and shard, units moving
    /// between shards included).
    pub redis_available: i64,
    /// The database's available units.
    pub db_available: i32,
    /// The database's units held by WAITING_PAY orders.
    pub db_locked: i32,
    /// The database's units sold (PAID).
    pub db_sold: i32,
    /// Reservations Redis holds open (accepted, not yet written).
    pub reservations_open: i64,
    /// Orders by status, every status present (PROCESSING: the open
    /// reservations).
    pub orders: BTreeMap<String, i64>,
    /// Its waiting room's queue in Redis, when it has one there.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub waiting_room: Option<RoomFigures>,
}

/// The activity's figures; `None` when there is no such activity.
pub async fn read(
    db: &PgPool,
    gate: &RedisGate,
    clock: &dyn Clock,
    id: ActivityId,
) -> anyhow::Result<Option<ActivityStats>> {
    // The stock row and the order counts from ONE snapshot, so a transition
    // committing in between can never show, say, CLOSED with its units still
    // locked.
    let (found, counts) = store::snapshot(db, move |conn| {
        Ok((
            repo::find_with_stock(conn, id)?,
            repo::order_counts(conn, id)?,
        ))
    })
    .await?;
    let Some((activity, stock)) = found else {
        return Ok(None);
    };
    // The open reservations before the stock: a release (which closes a
    // reservation and gives its units back in one script) that the open
    // count already shows is in the stock read after it. The other way
    // round, a release landing between the two reads showed nothing open
    // and its units still taken, and a caller waiting for "nothing open"
    // read a stock it then never saw again.
    let open = gate.open_reservations(id, activity.layout()).await?;
    let redis_available = gate.available(id, activity.layout()).await?;
    let waiting_room = gate.room_figures(id).await?;
    // Every state, the ones with no order too.
    let mut orders = BTreeMap::new();
    orders.insert(OrderStatus::Processing.to_string(), open);
    for status in OrderStatus::STORED {
        orders.insert(status.to_string(), 0);
    }
    for (status, n) in counts {
        orders.insert(status.to_string(), n);
    }
    Ok(Some(ActivityStats {
        activity_id: id,
        status: activity.lifecycle(clock.now()),
        stock_total: stock.total,
        redis_available,
        db_available: stock.available,
        db_locked: stock.locked,
        db_sold: stock.sold,
        reservations_open: open,
        orders,
        waiting_room,
    }))
}
