//! Voiding (SPEC step 4): the reservations no order event will back.
//!
//! A reservation is first claimed in Redis (`void.lua`), so no purchase
//! retry can confirm it from then on; then its order row decides. Without
//! a row it is inserted FAILED and the units go back; with one, the
//! reservation is settled as the row says. An acknowledged reservation is
//! never voided: its event is published again instead.

use anyhow::Context;

use super::{RESERVATION_EXPIRED, Reconciler, Report};
use crate::admission::gate::{Reservation, VoidClaim};
use crate::admission::{Layout, ReleaseReason};
use crate::domain::ActivityId;
use crate::orders::OrderStatus;
use crate::orders::events::StatusChange;
use crate::orders::repo as orders;
use crate::store;

impl Reconciler {
    /// Voids open reservations no order event will back (SPEC step 4):
    /// unacknowledged ones neither made nor sent within the publish window
    /// once the order consumers have provably applied every published
    /// event, else those older than the grace. An acknowledged reservation
    /// is never voided: if the consumers have provably applied everything
    /// and it is still open, its row decides, and without a row the broker
    /// lost its event, which is published again.
    pub(super) async fn void_stale(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        cutoff: &Cutoff,
        report: &mut Report,
    ) -> anyhow::Result<()> {
        for order_no in self
            .repairs()
            .open_before(activity_id, layout, cutoff.before_ms)
            .await?
        {
            let Some(r) = self.gate.reservation(activity_id, layout, order_no).await? else {
                self.repairs()
                    .forget_open(activity_id, layout, order_no)
                    .await?;
                report.repaired.push(format!(
                    "dropped index entry {order_no} without a reservation"
                ));
                continue;
            };
            if r.acked && r.is_open() {
                if cutoff.proven {
                    self.settle_acknowledged(activity_id, order_no, layout, &r, report)
                        .await?;
                }
                continue;
            }
            match self
                .gate
                .claim_void(activity_id, layout, order_no, cutoff.before_ms)
                .await?
            {
                VoidClaim::Claimed => {}
                VoidClaim::Refused => continue,
                VoidClaim::Gone => {
                    self.repairs()
                        .forget_open(activity_id, layout, order_no)
                        .await?;
                    continue;
                }
            }
            let event = r.event(activity_id, order_no);
            let status = store::run(&self.db, move |conn| {
                Ok(orders::insert_failed(conn, &event, RESERVATION_EXPIRED)?)
            })
            .await?;
            match status {
                // No row: the same (user, request_id) already has another
                // order; this reservation backs nothing.
                Some(OrderStatus::Failed) | None => {
                    self.gate
                        .release(activity_id, order_no, layout, ReleaseReason::OrderFailed)
                        .await?;
                    let status = OrderStatus::Failed;
                    self.order_events
                        .publish(&[StatusChange { order_no, status }])
                        .await;
                    self.count("repair", "voided");
                    report.repaired.push(format!(
                        "voided reservation {order_no} (no order event arrived; {})",
                        cutoff.because
                    ));
                }
                Some(status) => {
                    self.gate.commit(activity_id, layout, &[order_no]).await?;
                    report.repaired.push(format!(
                        "committed reservation {order_no} (its order is {status})"
                    ));
                }
            }
        }
        Ok(())
    }

    /// An acknowledged reservation still open although the consumers have
    /// applied every published event: its order row says what happened
    /// (the Redis step after the row was lost); without a row, the broker
    /// lost the event, which is published again.
    async fn settle_acknowledged(
        &self,
        activity_id: ActivityId,
        order_no: i64,
        layout: Layout,
        r: &Reservation,
        report: &mut Report,
    ) -> anyhow::Result<()> {
        let status = store::run(&self.db, move |conn| {
            Ok(orders::statuses(conn, &[order_no])?.remove(&order_no))
        })
        .await?;
        match status {
            None => {
                let event = r.event(activity_id, order_no).encode();
                self.producer
                    .publish(
                        &self.topics.order_requested,
                        &order_no.to_string(),
                        &event,
                        None,
                    )
                    .await
                    .with_context(|| format!("publishing the event of {order_no} again"))?;
                self.count("repair", "republished");
                report.repaired.push(format!(
                    "published again the event of reservation {order_no} \
                     (acknowledged, but the consumers never got it)"
                ));
            }
            Some(OrderStatus::Failed) => {
                self.gate
                    .release(activity_id, order_no, layout, ReleaseReason::OrderFailed)
                    .await?;
                report.repaired.push(format!(
                    "released reservation {order_no} (its order FAILED)"
                ));
            }
            Some(status) => {
                self.gate.commit(activity_id, layout, &[order_no]).await?;
                report.repaired.push(format!(
                    "committed reservation {order_no} (its order is {status})"
                ));
            }
        }
        Ok(())
    }

    /// The grace, or the much shorter publish window when the order
    /// consumers have committed every partition to its end. `now` is read
    /// before the offsets, so every event that reached the broker before it
    /// is among those proven applied.
    pub(super) async fn void_cutoff(&self) -> Cutoff {
        let r = &self.settings.reconcile;
        let now = self.clock.now_ms();
        let secs = crate::clock::millis;
        let grace = Cutoff {
            at_ms: now,
            before_ms: now - secs(r.reservation_grace_secs),
            because: "older than the grace",
            proven: false,
        };
        match self.progress.caught_up().await {
            Ok(true) => Cutoff {
                at_ms: now,
                before_ms: now - secs(r.publish_window_secs.min(r.reservation_grace_secs)),
                because: "the order consumers have applied every published event",
                proven: true,
            },
            Ok(_) => grace,
            Err(e) => {
                tracing::debug!(
                    error = format!("{e:#}"),
                    "consumer progress unknown; using the grace"
                );
                grace
            }
        }
    }
}

/// Reservations neither made nor sent since `before_ms` are voided,
/// `because` of what.
pub(super) struct Cutoff {
    /// When it was read (before the consumers' offsets).
    pub(super) at_ms: i64,
    pub(super) before_ms: i64,
    pub(super) because: &'static str,
    /// The order consumers have applied every event published before
    /// `at_ms`.
    pub(super) proven: bool,
}
