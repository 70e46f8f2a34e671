//! What the hot path needs to know about an activity (window, limit, bucket
//! count), read from the Redis meta hash and kept in process for a few
//! seconds, so admission touches neither the database nor Redis twice.
//!
//! When Redis has no meta for an activity, the database says whether that
//! is because it was never warmed (NOT_ACTIVE) or because Redis lost it
//! (restarted empty): then purchases hear 503 RETRY_LATER while the
//! reconciler restores it, instead of a NOT_ACTIVE that would send buyers
//! away. That answer is cached for a second, so a lost Redis costs the
//! database one query per activity per second, not one per request.
//!
//! An id Redis has no meta for, and that is not among the live activities
//! (read as a whole, at most once a second), is answered NOT_ACTIVE with
//! no query of its own and nothing kept: made-up ids cost the database
//! nothing per id, and the cache holds live activities only.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use super::Lifecycle;
use crate::admission::RedisGate;
use crate::clock::Clock;
use crate::domain::ActivityId;
use crate::metrics::Metrics;
use crate::store::{self, PgPool};

/// How long a warm activity's meta is trusted. Windows and limits never
/// change after creation; this only bounds memory for ended activities.
const WARM_TTL: Duration = Duration::from_secs(5);

/// How long "not in Redis" answers are trusted: short, so a warm-up or a
/// restore is seen within a second.
const ABSENT_TTL: Duration = Duration::from_secs(1);

/// The admission view of a warmed activity.
pub use crate::admission::gate::Meta as ActivityMeta;

/// Where an activity stands for admission.
#[derive(Debug, Clone, Copy)]
pub enum Lookup {
    /// Warm in Redis.
    Warm(ActivityMeta),
    /// Warmed and live according to the database, but Redis lost it: being
    /// restored by reconciliation.
    Restoring,
    /// Unknown, never warmed, or over.
    NotActive,
}

/// Process-local cache of [`Lookup`]s.
pub struct ActivityCache {
    entries: RwLock<HashMap<ActivityId, (Instant, Lookup)>>,
    /// The live activities (not ended), read again after [`ABSENT_TTL`];
    /// one caller reads while the others wait for that read.
    live: tokio::sync::Mutex<Option<(Instant, Arc<HashSet<ActivityId>>)>>,
    metrics: Metrics,
}

impl ActivityCache {
    /// An empty cache counting its database reads in `metrics`.
    pub fn new(metrics: Metrics) -> Self {
        Self {
            entries: RwLock::default(),
            live: tokio::sync::Mutex::default(),
            metrics,
        }
    }

    /// The ids of the activities not ended at `now`, read again when older
    /// than [`ABSENT_TTL`].
    async fn live_ids(
        &self,
        db: &PgPool,
        now: chrono::DateTime<chrono::Utc>,
    ) -> anyhow::Result<Arc<HashSet<ActivityId>>> {
        let mut live = self.live.lock().await;
        if let Some((_, ids)) = live.as_ref().filter(|(at, _)| at.elapsed() < ABSENT_TTL) {
            return Ok(ids.clone());
        }
        self.metrics
            .activity_lookups
            .with_label_values(&["index"])
            .inc();
        let ids = store::run(db, move |conn| Ok(super::repo::live_ids(conn, now)?)).await?;
        let ids = Arc::new(ids.into_iter().collect::<HashSet<_>>());
        *live = Some((Instant::now(), ids.clone()));
        Ok(ids)
    }

    /// Where the activity stands: Redis first, the database only when
    /// Redis has no meta for it (and only then is `clock` read, to tell a
    /// live activity Redis lost from one that is over).
    pub async fn lookup(
        &self,
        gate: &RedisGate,
        db: &PgPool,
        activity_id: ActivityId,
        clock: &dyn Clock,
    ) -> anyhow::Result<Lookup> {
        if let Some(hit) = self.read(activity_id) {
            return Ok(hit);
        }
        let found = match gate.meta(activity_id).await? {
            Some(meta) => Lookup::Warm(meta),
            None if !self.live_ids(db, clock.now()).await?.contains(&activity_id) => {
                return Ok(Lookup::NotActive);
            }
            None => {
                self.metrics
                    .activity_lookups
                    .with_label_values(&["row"])
                    .inc();
                let activity =
                    store::run(db, move |conn| Ok(super::repo::find(conn, activity_id)?)).await?;
                match activity {
                    Some(a)
                        if a.status != "ENDED"
                            && matches!(
                                a.lifecycle(clock.now()),
                                Lifecycle::Ready | Lifecycle::Active
                            ) =>
                    {
                        Lookup::Restoring
                    }
                    _ => Lookup::NotActive,
                }
            }
        };
        let mut entries = self.entries.write().unwrap_or_else(|e| e.into_inner());
        entries.retain(|_, (at, l)| at.elapsed() < ttl(l));
        entries.insert(activity_id, (Instant::now(), found));
        Ok(found)
    }

    /// Drops what is known about an activity (Redis just said it is not
    /// warm after all).
    pub fn forget(&self, activity_id: ActivityId) {
        self.entries
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&activity_id);
    }

    fn read(&self, activity_id: ActivityId) -> Option<Lookup> {
        let entries = self.entries.read().unwrap_or_else(|e| e.into_inner());
        let (at, found) = entries.get(&activity_id)?;
        (at.elapsed() < ttl(found)).then_some(*found)
    }
}

fn ttl(found: &Lookup) -> Duration {
    match found {
        Lookup::Warm(_) => WARM_TTL,
        Lookup::Restoring | Lookup::NotActive => ABSENT_TTL,
    }
}
