//! The consumer watchdog. librdkafka consumers can sit for good in a broken
//! group-coordinator state after a broker stall, logging timeouts while
//! nothing is consumed; the client must be torn down and built again. Each
//! consumer (order creator, stock releaser, coupon claimer) is supervised:
//! it reports its progress here, and it is rebuilt — a new rdkafka client in
//! the same group — when, for `kafka.consumer_stall_secs`, either
//!
//! - its group has messages waiting and commits nothing (seen from outside,
//!   through [`GroupProgress`]: the broker's committed offsets against the
//!   topic's end), while the consumer is not busy in a batch of its own
//!   (a batch retrying a failed database is not the client's fault, and a
//!   new client would not help), or
//! - its group coordinator is unreachable (the client's own statistics).
//!
//! Each rebuild logs a WARN and counts `seckill_consumer_restarts_total`.
//! While a consumer is stalled, `/health/ready` answers 503 and says why.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::client::ClientContext;
use rdkafka::consumer::ConsumerContext;

use super::progress::Sample;

/// Tracks how long a group has had messages waiting without committing any.
#[derive(Debug, Default)]
pub struct StallTracker {
    last_done: Option<i64>,
    waiting_since: Option<Instant>,
}

impl StallTracker {
    /// Feeds one sample (`None`: the broker could not be asked) taken at
    /// `now`; returns how long the group has been stalled (zero when it is
    /// caught up or moving).
    pub fn observe(&mut self, sample: Option<Sample>, now: Instant) -> Duration {
        let Some(sample) = sample else {
            // Unknown: neither proof of progress nor of a stall.
            return self.stalled_for(now);
        };
        if sample.lag <= 0 {
            self.waiting_since = None;
        } else if self.last_done != Some(sample.done) || self.waiting_since.is_none() {
            // Progress (or the first sight of waiting messages): the clock
            // starts again from here.
            self.waiting_since = Some(now);
        }
        self.last_done = Some(sample.done);
        self.stalled_for(now)
    }

    /// Starts the clock again (a new client gets a whole window).
    pub fn restart(&mut self, now: Instant) {
        if self.waiting_since.is_some() {
            self.waiting_since = Some(now);
        }
    }

    fn stalled_for(&self, now: Instant) -> Duration {
        self.waiting_since
            .map_or(Duration::ZERO, |since| now.duration_since(since))
    }
}

/// Follows the consumer group's coordinator state through librdkafka's
/// statistics (`cgrp.state` is "up" while the coordinator is known and
/// connected).
pub struct WatchedContext {
    /// Unix ms since which the coordinator has not been "up"; 0 while it is.
    coordinator_down_since: AtomicI64,
}

impl WatchedContext {
    /// A context for a client created now (its coordinator is not up yet).
    pub fn new() -> Self {
        Self {
            coordinator_down_since: AtomicI64::new(now_ms()),
        }
    }

    /// How long the coordinator has been unreachable.
    pub fn coordinator_down_for(&self) -> Duration {
        match self.coordinator_down_since.load(Ordering::Relaxed) {
            0 => Duration::ZERO,
            since => Duration::from_millis(u64::try_from(now_ms() - since).unwrap_or(0)),
        }
    }
}

impl Default for WatchedContext {
    fn default() -> Self {
        Self::new()
    }
}

impl ClientContext for WatchedContext {
    fn stats_raw(&self, statistics: &[u8]) {
        // Only the group's state, not librdkafka's whole statistics tree.
        #[derive(serde::Deserialize)]
        struct Stats {
            cgrp: Option<Cgrp>,
        }
        #[derive(serde::Deserialize)]
        struct Cgrp {
            state: String,
        }
        let Ok(Stats { cgrp: Some(cgrp) }) = serde_json::from_slice::<Stats>(statistics) else {
            return;
        };
        if cgrp.state == "up" {
            self.coordinator_down_since.store(0, Ordering::Relaxed);
        } else {
            let _ = self.coordinator_down_since.compare_exchange(
                0,
                now_ms(),
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }

    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        // Transport errors repeat every few seconds while a broker is away;
        // the watchdog acts on their effect, this only keeps them visible.
        tracing::debug!(error = %error, reason, "kafka consumer");
    }
}

impl ConsumerContext for WatchedContext {}

/// What the watchdog knows of one consumer; readiness reads it.
#[derive(Debug)]
pub struct Health {
    /// The consumer group.
    pub group: String,
    stalled: Mutex<Option<String>>,
}

impl Health {
    /// Why the consumer is stalled, if it is.
    pub fn stalled(&self) -> Option<String> {
        self.stalled
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Records the verdict of one check.
    pub fn set(&self, stalled: Option<String>) {
        *self.stalled.lock().unwrap_or_else(|e| e.into_inner()) = stalled;
    }
}

/// Every supervised consumer of this process.
#[derive(Debug, Default)]
pub struct Registry {
    consumers: Mutex<Vec<Arc<Health>>>,
}

impl Registry {
    /// Adds a consumer of `group`.
    pub fn register(&self, group: &str) -> Arc<Health> {
        let health = Arc::new(Health {
            group: group.to_owned(),
            stalled: Mutex::new(None),
        });
        self.consumers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(health.clone());
        health
    }

    /// `(group, why)` of every stalled consumer.
    pub fn stalled(&self) -> Vec<(String, String)> {
        self.consumers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter_map(|h| h.stalled().map(|why| (h.group.clone(), why)))
            .collect()
    }
}

/// One check of a consumer: why it should be rebuilt now, if it should.
/// `busy_for` is how long it has been inside one batch of its own.
pub fn verdict(
    stall: Duration,
    coordinator_down_for: Duration,
    waiting_for: Duration,
    busy_for: Option<Duration>,
) -> Verdict {
    if stall.is_zero() {
        return Verdict::Healthy;
    }
    if coordinator_down_for >= stall {
        return Verdict::Rebuild(format!(
            "group coordinator unreachable for {}s",
            coordinator_down_for.as_secs()
        ));
    }
    if waiting_for >= stall {
        let why = format!(
            "messages waiting, nothing committed for {}s",
            waiting_for.as_secs()
        );
        return match busy_for {
            // Its own batch keeps failing (database, Redis): report, but a
            // new Kafka client would change nothing.
            Some(busy) if busy >= Duration::from_secs(1) => Verdict::Stalled(format!(
                "{why}; a batch has been retrying for {}s",
                busy.as_secs()
            )),
            _ => Verdict::Rebuild(why),
        };
    }
    Verdict::Healthy
}

/// What [`verdict`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Making progress, or nothing to do.
    Healthy,
    /// Stalled, but not the client's fault: report only.
    Stalled(String),
    /// Stalled: rebuild the client.
    Rebuild(String),
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(lag: i64, done: i64) -> Option<Sample> {
        Some(Sample { lag, done })
    }

    #[test]
    fn a_group_is_stalled_only_while_messages_wait_and_nothing_is_committed() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut t = StallTracker::default();
        assert_eq!(t.observe(sample(0, 10), at(0)), Duration::ZERO);
        assert_eq!(
            t.observe(sample(5, 10), at(1)),
            Duration::ZERO,
            "clock starts"
        );
        assert_eq!(t.observe(sample(5, 10), at(4)), Duration::from_secs(3));
        assert_eq!(
            t.observe(None, at(6)),
            Duration::from_secs(5),
            "unknown keeps it"
        );
        assert_eq!(t.observe(sample(3, 12), at(7)), Duration::ZERO, "progress");
        assert_eq!(t.observe(sample(3, 12), at(9)), Duration::from_secs(2));
        t.restart(at(9));
        assert_eq!(t.observe(sample(3, 12), at(10)), Duration::from_secs(1));
        assert_eq!(
            t.observe(sample(0, 15), at(11)),
            Duration::ZERO,
            "caught up"
        );
    }

    #[test]
    fn the_verdict_rebuilds_for_the_client_only() {
        let s = Duration::from_secs;
        assert_eq!(verdict(s(0), s(99), s(99), None), Verdict::Healthy, "off");
        assert_eq!(verdict(s(10), s(3), s(9), None), Verdict::Healthy);
        assert!(
            matches!(verdict(s(10), s(10), s(0), None), Verdict::Rebuild(w) if w.contains("coordinator"))
        );
        assert!(
            matches!(verdict(s(10), s(0), s(12), None), Verdict::Rebuild(w) if w.contains("waiting"))
        );
        assert!(
            matches!(verdict(s(10), s(0), s(12), Some(s(12))), Verdict::Stalled(w) if w.contains("retrying"))
        );
        assert!(
            matches!(
                verdict(s(10), s(11), s(12), Some(s(12))),
                Verdict::Rebuild(_)
            ),
            "a lost coordinator is the client's"
        );
    }
}
