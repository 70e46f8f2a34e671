//! Consumer of `stock.released` (from the outbox): gives a cancelled or
//! closed order's units back to Redis so they can be bought again. The
//! release script is idempotent per order_no, so redeliveries — and two
//! relays publishing the same row — apply once.

use std::time::Duration;

use rdkafka::Message;
use rdkafka::message::OwnedMessage;
use tokio_util::sync::CancellationToken;

use super::consumer::{ConsumerDeps, ConsumerHandle};
use crate::admission::ReleaseReason;
use crate::bus::events::StockReleased;
use crate::bus::runner::{self, Handler};

/// Name of this consumer (its group id suffix).
pub const CONSUMER: &str = "stock-releaser";

/// Subscribes and starts the consumer on the current runtime.
pub fn spawn(deps: ConsumerDeps) -> anyhow::Result<ConsumerHandle> {
    let wait = Duration::from_millis(5);
    deps.subscribe(
        CONSUMER,
        &deps.topics.stock_released,
        100,
        wait,
        Releaser(deps.clone()),
    )
}

struct Releaser(ConsumerDeps);

impl Handler for Releaser {
    async fn handle(&self, batch: &[OwnedMessage], shutdown: &CancellationToken) -> bool {
        for m in batch {
            if !release(&self.0, m, shutdown).await {
                return false;
            }
        }
        true
    }
}

async fn release(deps: &ConsumerDeps, m: &OwnedMessage, shutdown: &CancellationToken) -> bool {
    let e = match StockReleased::decode(m.payload().unwrap_or_default()) {
        Ok(e) => e,
        Err(reason) => {
            // Written by our own outbox: unreadable means a bug, not data.
            tracing::error!(
                reason,
                offset = m.offset(),
                "unreadable stock.released skipped"
            );
            deps.metrics
                .stock_released
                .with_label_values(&["unreadable"])
                .inc();
            return true;
        }
    };
    let reason = ReleaseReason::OrderReleased {
        user_id: e.user_id,
        quantity: e.quantity,
    };
    let layout = e.layout();
    if let Some(coupon_id) = e.coupon_id {
        // The coupon the order held is free for the buyer's next order
        // (the database returned it to UNUSED in the same transaction);
        // freed before the units, so a buyer who sees them back finds it
        // free too.
        let freed = runner::retry("Redis coupon release", shutdown, || async {
            Ok(deps
                .coupons
                .unhold(coupon_id, e.user_id, e.order_no.get())
                .await?)
        })
        .await;
        if freed.is_none() {
            return false;
        }
    }
    let released = runner::retry("Redis release", shutdown, || async {
        Ok(deps
            .gate
            .release(e.activity_id, e.order_no.get(), layout, reason)
            .await?)
    })
    .await;
    let Some(released) = released else {
        return false;
    };
    let result = if released { "released" } else { "already" };
    deps.metrics
        .stock_released
        .with_label_values(&[result])
        .inc();
    true
}
