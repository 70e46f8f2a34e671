//! The way back from the database fallback: an activity sold through the
//! database has its stale Redis copy dropped, is restored, and is switched
//! back to Redis under its stock row's lock.

use super::Reconciler;
use super::repairs::Room;
use crate::admission::Layout;
use crate::admission::mode::Mode;
use crate::domain::ActivityId;
use crate::store::{self};

impl Reconciler {
    /// Redis answers again for an activity admitted through the database
    /// (or being loaded back): true when it is warm in Redis and back on
    /// the Redis path. In DATABASE mode Redis holds the activity as it was
    /// before the fallback sold from the database, without those orders'
    /// units, request ids and holdings: its keys are dropped, and the
    /// restore loads it from the database once that is safe. In RESTORING
    /// mode the restore ran and only the switch back is left.
    pub(super) async fn back_from_fallback(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        mode: Mode,
        fence: i64,
    ) -> anyhow::Result<bool> {
        if mode == Mode::Restoring {
            self.switch_admission(activity_id, &[Mode::Restoring], Mode::Redis)
                .await?;
            return Ok(true);
        }
        self.repairs(fence)
            .remove_activity(activity_id, layout, Room::Keep)
            .await?;
        self.count("repair", "fallback_keys_dropped");
        tracing::warn!(
            activity_id = %activity_id,
            "Redis answers again: its keys of an activity sold through the database \
             are dropped, to be restored from the database"
        );
        Ok(false)
    }

    /// Moves the activity's admission from `from` to `to`.
    pub(super) async fn switch_admission(
        &self,
        activity_id: ActivityId,
        from: &'static [Mode],
        to: Mode,
    ) -> anyhow::Result<()> {
        let switched = store::run(&self.db, move |conn| {
            Ok(crate::activities::repo::switch_admission(
                conn,
                activity_id,
                from,
                to,
            )?)
        })
        .await?;
        if switched && to == Mode::Redis {
            tracing::warn!(activity_id = %activity_id, "activity admitted through Redis again");
        }
        Ok(())
    }
}
