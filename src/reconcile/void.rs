//! Voiding (SPEC step 4): the reservations no order event will back.
//!
//! A reservation is first claimed in Redis (`void.lua`), so no purchase
//! retry can confirm it from then on; then its order row decides. Without
//! a row it is inserted FAILED and the units go back; with one, the
//! reservation is settled as the row says. An acknowledged reservation is
//! never voided: its event is published again instead.

use anyhow::Context;

use super::cutoff::Cutoff;
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
    /// before a moment by which the order consumers have provably applied
    /// every published event; none without that proof. An acknowledged reservation
    /// is never voided: if the consumers have provably applied everything
    /// and it is still open, its row decides, and without a row the broker
    /// lost its event, which is published again.
    pub(super) async fn void_stale(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        cutoff: &Cutoff,
        fence: i64,
        report: &mut Report,
    ) -> anyhow::Result<()> {
        if !cutoff.proven {
            return Ok(());
        }
        for order_no in self
            .repairs(fence)
            .open_before(activity_id, layout, cutoff.before_ms)
            .await?
        {
            let Some(r) = self.gate.reservation(activity_id, layout, order_no).await? else {
                self.repairs(fence)
                    .forget_open(activity_id, layout, order_no)
                    .await?;
                report.repaired.push(format!(
                    "dropped index entry {order_no} without a reservation"
                ));
                continue;
            };
            if r.acked && r.is_open() {
                self.settle_acknowledged(activity_id, order_no, layout, &r, report)
                    .await?;
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
                    self.repairs(fence)
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

    /// What may be voided: reservations neither made nor sent within the
    /// publish window (and the grace) before the latest moment by which
    /// the order consumers have provably applied every published event
    /// ([`crate::bus::progress::GroupProgress::applied_before`]: under a
    /// steady sale, the moment of an earlier run whose end offsets the
    /// group has committed past since). Nothing is voided without that
    /// proof: an accepted purchase whose acknowledgement was never
    /// recorded looks like an orphan, and only the consumers having gone
    /// past its event tells the two apart.
    pub(super) async fn void_cutoff(&self) -> Cutoff {
        let r = &self.settings.reconcile;
        let now = self.clock.now_ms();
        let secs = crate::clock::millis;
        match self.progress.applied_before(now).await {
            Ok(Some(at)) => Cutoff {
                at_ms: at,
                before_ms: at - secs(r.publish_window_secs.min(r.reservation_grace_secs)),
                because: "the order consumers have applied every published event up to then",
                proven: true,
            },
            Ok(None) => Cutoff::unproven(now),
            Err(e) => {
                tracing::debug!(
                    error = format!("{e:#}"),
                    "consumer progress unknown; nothing is voided"
                );
                Cutoff::unproven(now)
            }
        }
    }
}
