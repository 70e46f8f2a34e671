//! An activity Redis lost (restarted empty, flushed) is restored from the
//! database by reconciliation, without overselling.
//!
//! The database's available count is exact only once every order event
//! sent before the loss has either become a row or provably never will: a
//! purchase admitted just before the loss may still be on its way to the
//! broker (for up to `Settings::restore_wait_ms`) or waiting in Kafka.
//! Restoring earlier would hand its unit out a second time. So the restore
//! waits until that long has passed since the loss was first seen AND the
//! order consumers have committed every partition to its end (read after
//! that moment); meanwhile purchases hear 503 RETRY_LATER. Senders check
//! their reservation record before every send and stop once it is gone,
//! but a send can still reach the broker after the restore: one whose
//! check came just before the loss and whose task ran late, or one
//! librdkafka delivers long after its message timeout. So the restore
//! first moves the activity's fence to the loss (`begin_restore`): an
//! event whose reservation was made before it and that Redis no longer
//! knows makes no order. Its purchase was never answered 202 (a 202 comes
//! within the budget, and the wait above covers it), and the restored
//! Redis holds neither its unit nor its request id, so a retry of the
//! purchase is admitted anew.
//!
//! Then, from one database snapshot, in one MULTI/EXEC: the stock (the
//! database's available), every order's request id (a replay gets its
//! order), the holdings of live orders (the per-user limit), committed
//! records for WAITING_PAY orders and released ones for cancelled or closed
//! orders (a later release applies exactly once), and the meta last.
//!
//! The same restore brings an activity back from the database fallback
//! (`admission/fallback.rs`): its orders are rows like any other. Before
//! the snapshot the activity's admission moves to RESTORING under its
//! stock row's lock, so no fallback purchase is written after it; once
//! Redis holds the activity, admission moves back to REDIS.

use chrono::Utc;
use diesel::prelude::*;
use diesel::sql_types::{BigInt, Integer, Text, Timestamptz};

use super::cutoff::Cutoff;
use super::repairs::{Restore, RestoredOrder, RestoredState};
use super::{Reconciler, Report};
use crate::admission::mode::Mode;
use crate::domain::ActivityId;
use crate::orders::OrderStatus;
use crate::store::{self, PgConn};

#[derive(QueryableByName)]
struct Row {
    #[diesel(sql_type = BigInt)]
    order_no: i64,
    #[diesel(sql_type = BigInt)]
    user_id: i64,
    #[diesel(sql_type = Text)]
    request_id: String,
    #[diesel(sql_type = Integer)]
    quantity: i32,
    #[diesel(sql_type = Text)]
    status: OrderStatus,
    #[diesel(sql_type = Timestamptz)]
    created_at: chrono::DateTime<Utc>,
    /// Cancelled or closed recently enough that a release of it may still
    /// come (within the reservation records' lifetime).
    #[diesel(sql_type = diesel::sql_types::Bool)]
    recently_closed: bool,
}

impl Reconciler {
    /// Restores `activity_id` once it is provably safe; reports the loss
    /// and what it waits for until then.
    pub(super) async fn restore(
        &self,
        activity_id: ActivityId,
        cutoff: &Cutoff,
        fence: i64,
    ) -> anyhow::Result<Report> {
        let mut report = Report::new(activity_id);
        let since = self
            .repairs(fence)
            .restoring_since(activity_id, self.clock.now_ms())
            .await?;
        report.consistent = false;
        report.differences.push(format!(
            "Redis has no stock for this warmed activity (seen lost at {since} ms)"
        ));
        let bound = crate::clock::millis(self.settings.restore_wait());
        let safe_from = since.saturating_add(bound);
        if cutoff.at_ms < safe_from || !cutoff.proven {
            report.restoring = true;
            report.differences.push(if cutoff.at_ms < safe_from {
                format!(
                    "restore waits {} ms more for events sent before the loss",
                    safe_from - cutoff.at_ms
                )
            } else {
                "restore waits for the order consumers to catch up".to_owned()
            });
            return Ok(report);
        }
        let ttl_secs = self.settings.admission.reservation_ttl_secs.as_secs_f64();
        // From here on a late event of a reservation Redis lost makes no
        // order (the fence): the snapshot below does not count it.
        store::run(&self.db, move |conn| {
            Ok(crate::activities::repo::begin_restore(
                conn,
                activity_id,
                &[Mode::Database, Mode::Redis],
                since,
            )?)
        })
        .await?;
        let restore =
            store::snapshot(&self.db, move |conn| snapshot(conn, activity_id, ttl_secs)).await?;
        let Some(restore) = restore else {
            return Ok(report);
        };
        self.repairs(fence).restore(&restore).await?;
        self.switch_admission(activity_id, &[Mode::Restoring], Mode::Redis)
            .await?;
        self.metrics
            .reconcile
            .with_label_values(&["repair", "restored"])
            .inc();
        let live = restore
            .orders
            .iter()
            .filter(|o| o.state == RestoredState::Live)
            .count();
        report.repaired.push(format!(
            "restored from the database: {} units available, {} orders' request ids, {live} waiting for payment",
            restore.spec.units,
            restore.orders.len()
        ));
        tracing::warn!(
            activity_id = %activity_id,
            units = restore.spec.units,
            orders = restore.orders.len(),
            "activity restored into Redis from the database"
        );
        Ok(report)
    }
}

/// The activity as the database knows it, in one snapshot.
fn snapshot(
    conn: &mut PgConn,
    activity_id: ActivityId,
    ttl_secs: f64,
) -> QueryResult<Option<Restore>> {
    let Some((activity, stock)) = crate::activities::repo::find_with_stock(conn, activity_id)?
    else {
        return Ok(None);
    };
    let rows: Vec<Row> = diesel::sql_query(
        "SELECT order_no, user_id, request_id, quantity, status, created_at, \
           COALESCE(closed_at > now() - make_interval(secs => $2), false) AS recently_closed \
         FROM orders WHERE activity_id = $1",
    )
    .bind::<BigInt, _>(activity_id)
    .bind::<diesel::sql_types::Double, _>(ttl_secs)
    .load(conn)?;
    let orders = rows
        .into_iter()
        .map(|r| RestoredOrder {
            order_no: r.order_no,
            user_id: r.user_id,
            quantity: r.quantity,
            reserved_at_ms: r.created_at.timestamp_millis(),
            holds: r.status.holds_units(),
            state: match r.status {
                OrderStatus::WaitingPay => RestoredState::Live,
                OrderStatus::Cancelled | OrderStatus::Closed if r.recently_closed => {
                    RestoredState::Released
                }
                _ => RestoredState::Settled,
            },
            request_id: r.request_id,
        })
        .collect();
    Ok(Some(Restore {
        spec: activity.warm_spec(stock.available),
        orders,
    }))
}
