//! Consumer of `coupon.claimed`: writes `user_coupons` in batches, one
//! transaction each, offsets stored only after the commit.

use std::time::Duration;

use rdkafka::Message;
use rdkafka::message::OwnedMessage;
use tokio_util::sync::CancellationToken;

use super::repo;
use crate::bus::events::CouponClaimed;
use crate::bus::runner::{self, ConsumerHandle, Handler};
use crate::orders::consumer::ConsumerDeps;
use crate::store;

/// Name of this consumer in `consume_log` and in its group id.
pub const CONSUMER: &str = "coupon-claimer";

/// Subscribes and starts the consumer on the current runtime.
pub fn spawn(deps: ConsumerDeps) -> anyhow::Result<ConsumerHandle> {
    let wait = Duration::from_millis(10);
    deps.subscribe(
        CONSUMER,
        &deps.topics.coupon_claimed,
        200,
        wait,
        Claimer(deps.clone()),
    )
}

struct Claimer(ConsumerDeps);

impl Handler for Claimer {
    async fn handle(&self, batch: &[OwnedMessage], shutdown: &CancellationToken) -> bool {
        let deps = &self.0;
        let mut events = Vec::with_capacity(batch.len());
        for m in batch {
            match CouponClaimed::decode(m.payload().unwrap_or_default()) {
                Ok(e) => events.push(e),
                Err(reason) => {
                    let dlq = &deps.topics.coupon_claimed_dlq;
                    if !runner::dead_letter(&deps.producer, dlq, m, &reason, shutdown).await {
                        return false;
                    }
                    deps.metrics.dead_letters.inc();
                }
            }
        }
        if events.is_empty() {
            return true;
        }
        let applied = runner::retry("coupon claims batch", shutdown, || {
            let owned = events.clone();
            store::run(&deps.db, move |conn| {
                Ok(repo::apply_claims(conn, CONSUMER, &owned)?)
            })
        })
        .await;
        let Some(outcome) = applied else { return false };
        if outcome.refused_over_issue > 0 {
            tracing::error!(
                count = outcome.refused_over_issue,
                "coupon claims beyond the batch total refused by the database"
            );
        }
        let m = &deps.metrics.consumer_events;
        m.with_label_values(&["coupon_written"])
            .inc_by(outcome.written as u64);
        m.with_label_values(&["coupon_refused"])
            .inc_by((outcome.refused_over_issue + outcome.refused_duplicate_user) as u64);
        true
    }
}
