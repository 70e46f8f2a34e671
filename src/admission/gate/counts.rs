//! What admission and the stats read of an activity's shards: purchases
//! accepted, the users who bought, reservations still open.

use redis::RedisResult;

use super::RedisGate;
use crate::admission::keys::Layout;
use crate::domain::ActivityId;

impl RedisGate {
    /// Purchases the activity has accepted since it was warmed (or
    /// restored), over its shards.
    pub async fn acceptances(&self, activity_id: ActivityId, layout: Layout) -> RedisResult<i64> {
        let mut sum = 0;
        for shard in 0..layout.shards {
            let n: Option<i64> = redis::cmd("HGET")
                .arg(self.shard_keys(activity_id, layout, shard).meta())
                .arg("accepted")
                .query_async(&mut self.conn.clone())
                .await?;
            sum += n.unwrap_or(0);
        }
        Ok(sum)
    }

    /// The users with a request accepted in the activity (its request-id
    /// hashes), over its shards.
    pub async fn buyers(
        &self,
        activity_id: ActivityId,
        layout: Layout,
    ) -> RedisResult<std::collections::HashSet<i64>> {
        let mut buyers = std::collections::HashSet::new();
        for shard in 0..layout.shards {
            let fields: Vec<String> = redis::cmd("HKEYS")
                .arg(self.shard_keys(activity_id, layout, shard).requests())
                .query_async(&mut self.conn.clone())
                .await?;
            buyers.extend(
                fields
                    .iter()
                    .filter_map(|f| f.split_once(':')?.0.parse::<i64>().ok()),
            );
        }
        Ok(buyers)
    }

    /// Number of open (not yet committed) reservations, over all shards.
    pub async fn open_reservations(
        &self,
        activity_id: ActivityId,
        layout: Layout,
    ) -> RedisResult<i64> {
        let mut open = 0;
        for shard in 0..layout.shards {
            let n: i64 = redis::cmd("ZCARD")
                .arg(self.shard_keys(activity_id, layout, shard).open())
                .query_async(&mut self.conn.clone())
                .await?;
            open += n;
        }
        Ok(open)
    }
}
