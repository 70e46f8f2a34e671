//! A coupon batch Redis lost (restarted empty, flushed) is restored from
//! the database, as an activity is (`restore.rs`) and with the same wait:
//! a claim Redis acknowledged just before the loss may still be on its way
//! to the broker, or waiting in Kafka, and restoring before it is written
//! would hand its coupon out a second time (the database's `claimed <
//! total` would then refuse the acknowledged one). So a batch is restored
//! only once `Settings::restore_wait_ms` has passed since it was first
//! seen lost AND the coupon claimer has committed every partition to its
//! end, read after that. Then, from one snapshot: every claim's user and
//! request id, and what is left.

use crate::coupons::repo;
use crate::store;

use super::Reconciler;

impl Reconciler {
    /// Restores every valid batch Redis lost once that is safe; the ids
    /// of those still waiting.
    pub(super) async fn restore_coupons(&self) -> anyhow::Result<Vec<i64>> {
        let now = self.clock.now();
        let ids = store::run(&self.db, move |conn| Ok(repo::valid_ids(conn, now)?)).await?;
        let mut lost = Vec::new();
        for id in ids {
            if !self.coupons.is_warm(id).await? {
                lost.push(id);
            }
        }
        if lost.is_empty() {
            return Ok(lost);
        }
        // The moment first, the consumers' progress after it.
        let at_ms = self.clock.now_ms();
        let proven = self.coupon_progress.caught_up().await.unwrap_or(false);
        let bound = i64::try_from(self.settings.restore_wait_ms()).unwrap_or(i64::MAX / 2);
        let mut waiting = Vec::new();
        for id in lost {
            let since = self.coupons.lost_since(id, at_ms).await?;
            if at_ms < since.saturating_add(bound) || !proven {
                waiting.push(id);
                continue;
            }
            let snapshot = store::run(&self.db, move |conn| {
                Ok(conn
                    .build_transaction()
                    .read_only()
                    .repeatable_read()
                    .run(|conn| repo::snapshot(conn, id))?)
            })
            .await?;
            let Some(b) = snapshot else { continue };
            self.coupons
                .restore(b.coupon_id, b.remaining, b.valid_until_ms, &b.claims)
                .await?;
            self.count("repair", "coupon_batch_restored");
            tracing::warn!(
                coupon_id = id,
                remaining = b.remaining,
                claims = b.claims.len(),
                "coupon batch restored into Redis from the database"
            );
        }
        Ok(waiting)
    }
}
