//! SPEC step 2: a reserved purchase becomes an `order.requested` event on
//! the broker, with a delivery outcome of three values.
//!
//! - Delivered within the request's budget: 202. The acknowledgement is
//!   recorded on the reservation (queued, [`crate::admission::acks`]), and
//!   from then on the reservation is never voided.
//! - Definitely not delivered (never handed over, never transmitted, or
//!   refused): the reservation is released and its request_id forgotten,
//!   and the buyer hears 503; nothing was kept.
//! - Unknown (no report within the budget, or a timeout after the message
//!   was sent): the broker may have it. Nothing is released or forgotten:
//!   the buyer hears 503 RETRY_LATER with the order_no, and this task keeps
//!   sending the same event (same event_id, which the consumer
//!   deduplicates) until the broker has it or the reservation was settled
//!   otherwise (the consumer committed it, or the reconciler voided it). A
//!   retry with the same request_id gets the same order_no; see
//!   [`Publisher::confirm`].

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, oneshot};

use crate::admission::acks::Acks;
use crate::admission::gate::{Status, Unsent};
use crate::admission::{Layout, RedisGate};
use crate::bus::events::OrderRequested;
use crate::bus::{Producer, PublishError, runner};
use crate::clock::SharedClock;
use crate::domain::ActivityId;
use crate::metrics::Metrics;

/// How the publish of one purchase ended, as far as its buyer is told.
#[derive(Debug)]
pub enum Published {
    /// The broker acknowledged the event: 202.
    Delivered,
    /// The broker definitely does not have it; the reservation was released
    /// and the request_id forgotten.
    NotDelivered(PublishError),
    /// No answer within the budget, or one that leaves the outcome open:
    /// the reservation stays, the delivery goes on in the background.
    Pending,
}

/// What a retry of an accepted-or-pending purchase found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Confirmation {
    /// This retry's send was acknowledged and recorded: the purchase is
    /// accepted now (202).
    ConfirmedNow,
    /// Acknowledged before, or already past the broker (committed,
    /// released, being voided, or its record gone): answer with the
    /// order's current status (200).
    Settled,
    /// Still unknown: 503 RETRY_LATER with the order_no again.
    Pending,
}

/// Publishes purchases. One per process, shared by every HTTP worker.
pub struct Publisher {
    /// The idempotent producer.
    pub producer: Producer,
    /// `order.requested` under this instance's prefix.
    pub topic: String,
    /// Reservations (release, acknowledgement, re-send bookkeeping).
    pub gate: Arc<RedisGate>,
    /// The queued writer of acknowledgements.
    pub acks: Acks,
    /// Produce latency and errors.
    pub metrics: Metrics,
    /// How long a request waits for its delivery report.
    pub budget: Duration,
    /// Whether the broker acknowledges at all (503 BUSY before Redis when not).
    pub breaker: Breaker,
    /// The sale clock (reservation stamps, the breaker's windows).
    pub clock: SharedClock,
    /// Whether the cluster takes writes, as a fresh client sees it.
    pub probe: Arc<crate::bus::probe::BrokerProbe>,
}

impl Publisher {
    /// Publishes the event of a reservation just made, waiting at most the
    /// budget. The delivery runs in a task of its own: if the request is
    /// dropped, or the budget passes, it goes on until its outcome is known
    /// and acted on. `permit` (the in-flight semaphore) is held until then.
    pub async fn publish(
        self: &Arc<Self>,
        event: OrderRequested,
        layout: Layout,
        permit: OwnedSemaphorePermit,
    ) -> Published {
        let (answer, told) = oneshot::channel();
        tokio::spawn(self.clone().deliver(event, layout, answer, permit));
        // The task always answers before it ends, unless it panicked.
        told.await.unwrap_or(Published::Pending)
    }

    async fn deliver(
        self: Arc<Self>,
        event: OrderRequested,
        layout: Layout,
        answer: oneshot::Sender<Published>,
        _permit: OwnedSemaphorePermit,
    ) {
        let (activity_id, order_no) = (event.activity_id, event.order_no.get());
        let payload = event.encode();
        let started = Instant::now();
        let outcome = match self
            .producer
            .enqueue(&self.topic, &event.event_id, &payload, None)
        {
            Err(e) => Err(e),
            Ok(delivery) => {
                tokio::pin!(delivery);
                tokio::select! {
                    outcome = &mut delivery => outcome,
                    _ = tokio::time::sleep(self.budget) => {
                        // The buyer is told to retry; the delivery goes on.
                        self.breaker.expired(self.clock.now_ms());
                        let _ = answer.send(Published::Pending);
                        let outcome = delivery.await;
                        self.observe(started, &outcome);
                        self.keep_sending(event, layout, payload, outcome).await;
                        return;
                    }
                }
            }
        };
        self.observe(started, &outcome);
        match outcome {
            Ok(()) => {
                self.acks.ack(activity_id, layout, order_no).await;
                let _ = answer.send(Published::Delivered);
            }
            Err(e @ (PublishError::QueueFull | PublishError::NotDelivered(_))) => {
                // The broker does not have this send. A retry of the
                // purchase may have sent the same event since and got it
                // acknowledged (its wait for this attempt's report ran
                // out): the release then keeps the reservation, and the
                // purchase is accepted after all.
                tracing::warn!(error = %e, order_no, activity_id = %activity_id, "order event not delivered; releasing");
                let told = match self
                    .gate
                    .release_unsent(activity_id, order_no, layout)
                    .await
                {
                    Ok(Unsent::Kept) => {
                        tracing::info!(order_no, activity_id = %activity_id, "order event not delivered, but a retry's was: kept");
                        Published::Delivered
                    }
                    Ok(Unsent::Released | Unsent::Gone) => Published::NotDelivered(e),
                    Err(re) => {
                        // Left open: reconciliation voids it once provably
                        // unsent, or the next retry sends it again.
                        tracing::error!(error = %re, order_no, activity_id = %activity_id, "release after an undelivered publish failed");
                        Published::Pending
                    }
                };
                let _ = answer.send(told);
            }
            Err(e @ (PublishError::Unknown(_) | PublishError::Unconfirmed)) => {
                let _ = answer.send(Published::Pending);
                self.keep_sending(event, layout, payload, Err(e)).await;
            }
        }
    }

    fn observe(&self, started: Instant, outcome: &Result<(), PublishError>) {
        self.metrics
            .produce_duration
            .observe(started.elapsed().as_secs_f64());
        match outcome {
            Ok(()) => self.breaker.delivered(self.clock.now_ms()),
            Err(e) => self
                .metrics
                .produce_errors
                .with_label_values(&[e.label()])
                .inc(),
        }
    }

    /// After the buyer was told to retry: sends the same event again until
    /// the broker acknowledges it, as long as its reservation is open and
    /// unacknowledged. Each send first moves the reservation's `sent` time
    /// (`sending.lua`), so the reconciler never voids a reservation whose
    /// event may still be on its way; it decides what is left when this
    /// process is gone.
    async fn keep_sending(
        &self,
        event: OrderRequested,
        layout: Layout,
        payload: Vec<u8>,
        mut outcome: Result<(), PublishError>,
    ) {
        let (activity_id, order_no) = (event.activity_id, event.order_no.get());
        let pending = &self.metrics.deliveries_pending;
        pending.inc();
        let mut attempt = 0u32;
        loop {
            match &outcome {
                Ok(()) => {
                    self.acks.ack(activity_id, layout, order_no).await;
                    break;
                }
                Err(e) if attempt == 0 => {
                    tracing::warn!(error = %e, order_no, activity_id = %activity_id, "order event delivery unknown; sending it again until the broker has it");
                }
                Err(_) => {}
            }
            attempt += 1;
            tokio::time::sleep(runner::backoff(attempt)).await;
            match self
                .gate
                .sending(activity_id, layout, order_no, self.clock.now_ms())
                .await
            {
                Ok(Some(r)) if r.is_open() && !r.acked => {}
                // Acknowledged (another send got through), committed,
                // released, being voided, or gone: nothing left to do.
                Ok(_) => break,
                // Never send without moving `sent` first.
                Err(e) => {
                    tracing::debug!(error = %e, order_no, "Redis unavailable; re-send postponed");
                    continue;
                }
            }
            let started = Instant::now();
            outcome = self
                .producer
                .publish(&self.topic, &event.event_id, &payload, None)
                .await;
            self.observe(started, &outcome);
        }
        pending.dec();
    }

    /// A retry (same request_id) of a purchase whose order is `order_no`.
    /// While the first attempt may still be waiting for its delivery report
    /// (within its budget), this waits for that report's acknowledgement
    /// instead of sending a second copy. After that, if the delivery is
    /// still unconfirmed, it sends the event again once (rebuilt from the
    /// reservation) and waits at most the budget. A confirmation counts only
    /// if the reservation is still open when the acknowledgement is
    /// recorded, so a reservation being voided never turns into a 202.
    pub async fn confirm(
        self: &Arc<Self>,
        activity_id: ActivityId,
        layout: Layout,
        order_no: i64,
    ) -> redis::RedisResult<Confirmation> {
        let budget_ms = i64::try_from(self.budget.as_millis()).unwrap_or(i64::MAX / 2);
        loop {
            let Some(r) = self.gate.reservation(activity_id, layout, order_no).await? else {
                return Ok(Confirmation::Settled);
            };
            match (r.status, r.acked) {
                (Status::Voiding, _) => return Ok(Confirmation::Pending),
                (Status::Occupied, false) => {}
                _ => return Ok(Confirmation::Settled),
            }
            // The first attempt's report, and the acknowledgement queued
            // right after it, are due by then.
            if self.clock.now_ms() >= r.reserved_at_ms.saturating_add(budget_ms + ACK_SLACK_MS) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let Some(r) = self
            .gate
            .sending(activity_id, layout, order_no, self.clock.now_ms())
            .await?
        else {
            return Ok(Confirmation::Settled);
        };
        match (r.status, r.acked) {
            (Status::Voiding, _) => return Ok(Confirmation::Pending),
            (Status::Occupied, false) => {}
            _ => return Ok(Confirmation::Settled),
        }
        let event = r.event(activity_id, order_no);
        let payload = event.encode();
        let this = self.clone();
        let (answer, told) = oneshot::channel();
        // One send per retry, in a task of its own: its acknowledgement is
        // recorded even if it arrives after this request has answered.
        tokio::spawn(async move {
            let started = Instant::now();
            let outcome = this
                .producer
                .publish(&this.topic, &event.event_id, &payload, None)
                .await;
            this.observe(started, &outcome);
            let confirmed = match outcome {
                Ok(()) => match this
                    .gate
                    .ack(activity_id, layout, &[order_no], this.clock.now_ms())
                    .await
                {
                    Ok(found) => Ok(match found.as_slice() {
                        [Some(Status::Occupied)] => Confirmation::ConfirmedNow,
                        [Some(Status::Voiding)] => Confirmation::Pending,
                        _ => Confirmation::Settled,
                    }),
                    Err(e) => Err(e),
                },
                Err(_) => Ok(Confirmation::Pending),
            };
            let _ = answer.send(confirmed);
        });
        match tokio::time::timeout(self.budget, told).await {
            Ok(Ok(confirmed)) => confirmed,
            _ => Ok(Confirmation::Pending),
        }
    }
}

/// How long after its budget a purchase's acknowledgement may take to be
/// recorded (it is queued and written in pipelines).
const ACK_SLACK_MS: i64 = 500;

/// Whether the broker acknowledges at all. Once a delivery ran out of its
/// budget and none has been acknowledged since, new purchases get 503 BUSY
/// before they reserve anything, except one probe a second that finds out
/// when the broker is back. Without it, a stalled broker would let the whole
/// stock be reserved by purchases whose outcome no one can tell yet.
#[derive(Debug, Default)]
pub struct Breaker {
    last_delivered_ms: AtomicI64,
    last_expired_ms: AtomicI64,
    last_probe_ms: AtomicI64,
}

impl Breaker {
    /// A delivery report came back positive at `now`.
    pub fn delivered(&self, now: i64) {
        self.last_delivered_ms.fetch_max(now, Ordering::Relaxed);
    }

    /// A delivery ran out of its budget at `now`.
    pub fn expired(&self, now: i64) {
        self.last_expired_ms.fetch_max(now, Ordering::Relaxed);
    }

    /// Whether the last delivery that ended ran out of its budget (no
    /// positive report since): the broker is not taking purchases.
    pub fn is_open(&self) -> bool {
        self.last_expired_ms.load(Ordering::Relaxed)
            > self.last_delivered_ms.load(Ordering::Relaxed)
    }

    /// Whether a purchase may go on to Redis at `now`.
    pub fn admits(&self, now: i64) -> bool {
        if self.last_expired_ms.load(Ordering::Relaxed)
            <= self.last_delivered_ms.load(Ordering::Relaxed)
        {
            return true;
        }
        let last = self.last_probe_ms.load(Ordering::Relaxed);
        now - last >= 1000
            && self
                .last_probe_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_breaker_opens_on_an_expired_delivery_and_closes_on_the_next_acknowledgement() {
        let b = Breaker::default();
        assert!(b.admits(1_000) && b.admits(1_001), "closed at first");
        b.delivered(1_000);
        b.expired(2_000);
        assert!(b.admits(3_100), "one probe");
        assert!(!b.admits(3_200), "no second probe within a second");
        assert!(b.admits(4_100), "the next second's probe");
        b.delivered(4_200);
        assert!(b.admits(4_201) && b.admits(4_202), "closed again");
    }
}
