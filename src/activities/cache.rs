//! What the hot path needs to know about an activity (window, limit, bucket
//! count), read from the Redis meta hash and kept in process for a few
//! seconds, so admission touches neither the database nor Redis twice.
//! Only warmed activities are cached: a just-warmed activity is visible at once.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use redis::RedisResult;

use crate::admission::RedisGate;

/// How long a cached entry is trusted. Windows and limits never change after
/// creation; this only bounds memory for ended activities.
const TTL: Duration = Duration::from_secs(5);

/// The admission view of a warmed activity.
#[derive(Debug, Clone, Copy)]
pub struct ActivityMeta {
    /// Sale start, unix ms.
    pub start_ms: i64,
    /// Sale end, unix ms.
    pub end_ms: i64,
    /// Per-user limit.
    pub per_user_limit: i32,
    /// Stock buckets.
    pub buckets: usize,
}

impl ActivityMeta {
    /// Whether `now_ms` is inside the sale window.
    pub fn is_open(&self, now_ms: i64) -> bool {
        self.start_ms <= now_ms && now_ms < self.end_ms
    }
}

/// Process-local cache of [`ActivityMeta`].
#[derive(Default)]
pub struct ActivityCache {
    entries: RwLock<HashMap<i64, (Instant, ActivityMeta)>>,
}

impl ActivityCache {
    /// The activity's meta, or `None` when it is not warmed (or unknown).
    pub async fn get(
        &self,
        gate: &RedisGate,
        activity_id: i64,
    ) -> RedisResult<Option<ActivityMeta>> {
        if let Some((at, meta)) = self.read(activity_id)
            && at.elapsed() < TTL
        {
            return Ok(Some(meta));
        }
        let (start, end, limit, buckets): (Option<i64>, Option<i64>, Option<i32>, Option<usize>) =
            redis::cmd("HMGET")
                .arg(gate.keys(activity_id).meta())
                .arg(&["start_ms", "end_ms", "limit", "buckets"])
                .query_async(&mut gate.conn())
                .await?;
        let (Some(start_ms), Some(end_ms), Some(per_user_limit), Some(buckets)) =
            (start, end, limit, buckets)
        else {
            return Ok(None);
        };
        let meta = ActivityMeta {
            start_ms,
            end_ms,
            per_user_limit,
            buckets: buckets.max(1),
        };
        let mut entries = self.entries.write().unwrap_or_else(|e| e.into_inner());
        entries.retain(|_, (at, _)| at.elapsed() < TTL);
        entries.insert(activity_id, (Instant::now(), meta));
        Ok(Some(meta))
    }

    fn read(&self, activity_id: i64) -> Option<(Instant, ActivityMeta)> {
        self.entries
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&activity_id)
            .copied()
    }
}

/// Shared handle.
pub type SharedActivityCache = Arc<ActivityCache>;
