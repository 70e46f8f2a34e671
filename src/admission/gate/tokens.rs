//! One-time purchase tokens, bound to a user and an activity.

use redis::RedisResult;

use super::RedisGate;
use crate::admission::keys::Layout;
use crate::domain::ActivityId;

impl RedisGate {
    /// Stores a one-time purchase token bound to `user_id`, in the buyer's
    /// shard; with `most`, it buys at most that many units (a waiting
    /// room's offer holds one), else up to the per-user limit.
    pub async fn issue_token(
        &self,
        activity_id: ActivityId,
        layout: Layout,
        user_id: i64,
        token: &str,
        ttl_secs: u64,
        most: Option<u32>,
    ) -> RedisResult<()> {
        let k = self.shard_keys(activity_id, layout, layout.shard_of_user(user_id));
        let value = match most {
            Some(n) => format!("{user_id}:{n}"),
            None => user_id.to_string(),
        };
        redis::cmd("SET")
            .arg(k.token(token))
            .arg(value)
            .arg("EX")
            .arg(ttl_secs)
            .query_async(&mut self.conn.clone())
            .await
    }
}
