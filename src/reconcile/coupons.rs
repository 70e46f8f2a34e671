//! A coupon batch Redis lost (restarted empty, flushed) is restored from
//! the database, as an activity is (`restore.rs`) and with the same wait:
//! a claim Redis acknowledged just before the loss may still be on its way
//! to the broker, or waiting in Kafka, and restoring before it is written
//! would hand its coupon out a second time (the database's `claimed <
//! total` would then refuse the acknowledged one). An order admitted with
//! a coupon may likewise still be on its way: its hold was lost with the
//! batch, and a second order holding the coupon would be FAILED after its
//! 202. So a batch is restored only once `Settings::restore_wait_ms` has
//! passed since it was first seen lost AND the coupon claimer and the
//! order consumers have committed every partition to its end, read after
//! that. Then, from one snapshot: every claim's user and
//! request id, and what is left.
//!
//! A claim whose event's delivery was never confirmed (the process that
//! sent it died, or its answer was unknown and the client never retried)
//! holds its coupon in Redis with nothing on its way to the database: once
//! the publish window has passed, the claim is sent again. The consumer
//! writes one row per (batch, user) whatever the copies; the claim is never
//! undone on an unknown outcome.

use crate::bus::events::CouponClaimed;
use crate::coupons::repo;
use crate::domain::CouponId;
use crate::orders::OrderStatus;
use crate::store;

use super::Reconciler;

/// Claims sent again per batch and run, at most.
const RESEND_PER_RUN: usize = 500;

impl Reconciler {
    /// Restores every valid batch Redis lost once that is safe; the ids
    /// of those still waiting.
    pub(super) async fn restore_coupons(
        &self,
        fence: i64,
        cutoff: &super::cutoff::Cutoff,
    ) -> anyhow::Result<Vec<CouponId>> {
        let now = self.clock.now();
        let ids = store::run(&self.db, move |conn| Ok(repo::valid_ids(conn, now)?)).await?;
        let mut lost = Vec::new();
        for id in ids {
            if self.coupons.is_warm(id).await? {
                self.resend_unconfirmed_claims(id).await?;
                self.sync_holds(id, cutoff).await?;
            } else {
                lost.push(id);
            }
        }
        if lost.is_empty() {
            return Ok(lost);
        }
        // The moment first, the consumers' progress after it: the claims
        // written, and the orders too, whose coupon holds Redis lost with
        // the batch (the database's LOCKED rows bring them back).
        let at_ms = self.clock.now_ms();
        let proven = self.coupon_progress.caught_up().await.unwrap_or(false)
            && self.progress.caught_up().await.unwrap_or(false);
        let bound = crate::clock::millis(self.settings.restore_wait());
        let mut waiting = Vec::new();
        for id in lost {
            let since = self.coupons.lost_since(id, at_ms).await?;
            if at_ms < since.saturating_add(bound) || !proven {
                waiting.push(id);
                continue;
            }
            let snapshot = store::snapshot(&self.db, move |conn| repo::snapshot(conn, id)).await?;
            let Some(b) = snapshot else { continue };
            self.coupons
                .restore(
                    &crate::coupons::gate::Restored {
                        coupon_id: b.coupon_id,
                        remaining: b.remaining,
                        valid_until_ms: b.valid_until_ms,
                        min_amount_cents: b.min_amount_cents,
                        claims: &b.claims,
                        holds: &b.holds,
                    },
                    fence,
                )
                .await?;
            self.count("repair", "coupon_batch_restored");
            tracing::warn!(
                coupon_id = %id,
                remaining = b.remaining,
                claims = b.claims.len(),
                "coupon batch restored into Redis from the database"
            );
        }
        Ok(waiting)
    }
}

impl Reconciler {
    /// Brings the batch's holds in Redis (which coupon backs which order,
    /// decided at admission) in line with the database: a coupon the
    /// database has LOCKED or USED (an order of the database fallback, a
    /// hold lost with a Redis call) is held for its order; a hold whose
    /// order is FAILED, CANCELLED or CLOSED (its release lost, a crash
    /// between the hold and the publish) is freed. A hold whose order the
    /// database does not know is left while its event may still come, and
    /// freed once the order consumers have provably applied every event
    /// published after its number was minted (the void's proof): a hold
    /// whose reply was lost, for a purchase refused and never published.
    async fn sync_holds(
        &self,
        coupon_id: CouponId,
        cutoff: &super::cutoff::Cutoff,
    ) -> anyhow::Result<()> {
        let in_redis = self.coupons.holds_of(coupon_id).await?;
        let order_nos: Vec<i64> = in_redis.iter().map(|&(_, o)| o).collect();
        let (in_db, statuses) = store::snapshot(&self.db, move |conn| {
            Ok((
                repo::holds(conn, coupon_id)?,
                crate::orders::repo::statuses(conn, &order_nos)?,
            ))
        })
        .await?;
        let held: std::collections::HashMap<i64, i64> = in_redis.iter().copied().collect();
        for &(user, order_no) in &in_db {
            if !held.contains_key(&user)
                && self.coupons.hold_if_free(coupon_id, user, order_no).await?
            {
                self.count("repair", "coupon_hold_added");
            }
        }
        for (user, order_no) in in_redis {
            let never_written = cutoff.proven
                && !statuses.contains_key(&order_no)
                && crate::ids::minted_at_unix_ms(order_no) < cutoff.before_ms;
            let settled = never_written
                || matches!(
                    statuses.get(&order_no),
                    Some(OrderStatus::Failed | OrderStatus::Cancelled | OrderStatus::Closed)
                );
            if settled
                && !in_db.contains(&(user, order_no))
                && self.coupons.unhold(coupon_id, user, order_no).await?
            {
                self.count("repair", "coupon_hold_freed");
            }
        }
        Ok(())
    }

    /// Sends again each claim of batch `coupon_id` made more than the
    /// publish window ago and still unconfirmed; a delivered one is
    /// confirmed. A send that fails stays for the next run.
    async fn resend_unconfirmed_claims(&self, coupon_id: CouponId) -> anyhow::Result<()> {
        let window_ms = crate::clock::millis(self.settings.reconcile.publish_window_secs);
        let before_ms = self.clock.now_ms().saturating_sub(window_ms);
        let due = self
            .coupons
            .unconfirmed(coupon_id, before_ms, RESEND_PER_RUN)
            .await?;
        for (user_id, request_id, claimed_at_ms) in due {
            let event = CouponClaimed {
                event_id: format!("claim-{coupon_id}-{user_id}"),
                coupon_id,
                user_id,
                request_id,
                claimed_at_ms,
            };
            let sent = self
                .producer
                .publish(
                    &self.topics.coupon_claimed,
                    &user_id.to_string(),
                    &event.encode(),
                    None,
                )
                .await;
            if let Err(e) = sent {
                tracing::warn!(error = %e, coupon_id = %coupon_id, user_id, "sending an unconfirmed coupon claim again failed; next run");
                continue;
            }
            self.coupons
                .confirm(coupon_id, user_id, &event.request_id)
                .await?;
            self.count("repair", "coupon_claim_resent");
            tracing::warn!(
                coupon_id = %coupon_id,
                user_id,
                "a coupon claim whose delivery was never confirmed was sent again"
            );
        }
        Ok(())
    }
}
