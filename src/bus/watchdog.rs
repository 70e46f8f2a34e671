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
//! - its group coordinator is unreachable (the client's own statistics),
//!
//! - none of its broker connections is up (the client's own statistics),
//!
//! and the broker has been answering, and taking writes (a commit is one),
//! for that whole window. That is judged
//! from outside every long-lived client, by [`super::probe::BrokerProbe`]:
//! a fresh client on a fresh connection each second. A client is blamed
//! only for what it fails to do with a broker that works; the judge is
//! never a client that could be wedged with the accused (the incident of
//! 2026-12-01, where the watchdog's own offset client was).
//! Through an outage (a broker killed or stopped) the consumer is reported
//! stalled, not rebuilt: a new client would meet the same outage, and
//! tearing a consumer down in the middle of one is what crashes librdkafka
//! 2.12.1 — its group termination, completing once the broker is back, can
//! abort the process on `assert: !rd_kafka_assignment_in_progress` (seen in
//! the broker-kill fault test; librdkafka issue #4027). After the outage the
//! client gets a whole window to recover by itself.
//!
//! Each rebuild logs a WARN and counts `seckill_consumer_restarts_total` and
//! `seckill_kafka_client_rebuilds_total`. While a consumer is stalled,
//! `/health/ready` answers 503 and says why. A client rebuilt
//! [`MAX_REBUILDS_IN_A_ROW`] times with no progress in between is beyond
//! what a rebuild mends: the process gives up ([`crate::liveness`]) and
//! exits, to be restarted by its supervisor.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::client::ClientContext;
use rdkafka::consumer::ConsumerContext;

/// Rebuilds of one client with no progress in between, after which the
/// process gives up and exits to be restarted.
pub const MAX_REBUILDS_IN_A_ROW: u32 = 3;

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

/// Follows the consumer group's coordinator state and the client's broker
/// connections through librdkafka's statistics (`cgrp.state` is "up" while
/// the coordinator is known and connected; a broker's `state` is "UP" while
/// its connection is).
pub struct WatchedContext {
    /// Unix ms since which the coordinator has not been "up"; 0 while it is.
    coordinator_down_since: AtomicI64,
    /// Unix ms since which no broker connection has been up; 0 while one is.
    brokers_down_since: AtomicI64,
}

impl WatchedContext {
    /// A context for a client created now (its coordinator is not up yet,
    /// nor any broker connection).
    pub fn new() -> Self {
        Self {
            coordinator_down_since: AtomicI64::new(now_ms()),
            brokers_down_since: AtomicI64::new(now_ms()),
        }
    }

    /// What the client's statistics say now; `answering_for` is how long
    /// the broker has answered a fresh client ([`super::probe`]).
    pub fn observed(&self, answering_for: Duration) -> ClientState {
        ClientState {
            coordinator_down_for: elapsed(&self.coordinator_down_since),
            brokers_down_for: elapsed(&self.brokers_down_since),
            answering_for,
        }
    }

    /// Records one statistics report.
    fn observe(&self, coordinator_up: bool, broker_up: bool, now: i64) {
        holds_since(&self.coordinator_down_since, !coordinator_up, now);
        holds_since(&self.brokers_down_since, !broker_up, now);
    }
}

/// Keeps `at` (unix ms) at the first moment a condition held without a
/// break: set to `now` when it starts holding, kept while it holds, 0 when
/// it does not.
pub fn holds_since(at: &AtomicI64, holds: bool, now: i64) {
    if holds {
        let _ = at.compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed);
    } else {
        at.store(0, Ordering::Relaxed);
    }
}

/// How long since `at` (unix ms; 0: not at all).
pub fn elapsed(at: &AtomicI64) -> Duration {
    match at.load(Ordering::Relaxed) {
        0 => Duration::ZERO,
        since => Duration::from_millis(u64::try_from(now_ms() - since).unwrap_or(0)),
    }
}

/// One client's view of its group, and whether the broker works.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClientState {
    /// How long the group coordinator has been unreachable.
    pub coordinator_down_for: Duration,
    /// How long none of the client's broker connections has been up.
    pub brokers_down_for: Duration,
    /// How long the broker has answered a fresh client without a break;
    /// zero during an outage.
    pub answering_for: Duration,
}

impl Default for WatchedContext {
    fn default() -> Self {
        Self::new()
    }
}

impl ClientContext for WatchedContext {
    fn stats_raw(&self, statistics: &[u8]) {
        // Only the group's state and the brokers' connection states, not
        // librdkafka's whole statistics tree.
        #[derive(serde::Deserialize)]
        struct Stats {
            cgrp: Option<Cgrp>,
            #[serde(default)]
            brokers: std::collections::HashMap<String, Broker>,
        }
        #[derive(serde::Deserialize)]
        struct Cgrp {
            state: String,
        }
        #[derive(serde::Deserialize)]
        struct Broker {
            state: String,
            nodeid: i32,
        }
        let Ok(Stats {
            cgrp: Some(cgrp),
            brokers,
        }) = serde_json::from_slice::<Stats>(statistics)
        else {
            return;
        };
        // Real brokers only (the bootstrap and coordinator entries are
        // logical, with no node id).
        let broker_up = brokers.values().any(|b| b.nodeid >= 0 && b.state == "UP");
        self.observe(cgrp.state == "up", broker_up, now_ms());
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
/// `waiting_for` is how long its group has had messages waiting with
/// nothing committed; `busy_for` how long it has been inside one batch of
/// its own.
pub fn verdict(
    stall: Duration,
    client: ClientState,
    waiting_for: Duration,
    busy_for: Option<Duration>,
) -> Verdict {
    if stall.is_zero() {
        return Verdict::Healthy;
    }
    // Only a client that had a whole window of a working broker is to blame.
    let blame = client.answering_for >= stall;
    let unless_blamed = |why: String| {
        if blame {
            Verdict::Rebuild(why)
        } else {
            Verdict::Stalled(format!(
                "{why}; the broker has not been answering (or taking writes)"
            ))
        }
    };
    if client.coordinator_down_for >= stall {
        return unless_blamed(format!(
            "group coordinator unreachable for {}s",
            client.coordinator_down_for.as_secs()
        ));
    }
    if client.brokers_down_for >= stall {
        return unless_blamed(format!(
            "no broker connection up for {}s",
            client.brokers_down_for.as_secs()
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
            _ => unless_blamed(why),
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

/// How one supervised client's rebuilds escalate. A new client gets a
/// whole window before it can be blamed (its first checks still read
/// figures of the client before it); only proof that it works resets the
/// count of rebuilds in a row (a client that merely has not been stalled
/// for a whole window yet proves nothing: every new one is like that);
/// and after [`MAX_REBUILDS_IN_A_ROW`] rebuilds with no such proof, or
/// with [`super::closing::MAX_STUCK`] old clients stuck closing, the
/// process gives up, to be restarted, instead of rebuilding for ever.
#[derive(Debug, Clone)]
pub struct Escalation {
    stall: Duration,
    in_a_row: u32,
    built: Instant,
}

/// What a supervisor does after one check ([`Escalation::check`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Act {
    /// Nothing now; why the client is stalled, if it is.
    Wait(Option<String>),
    /// Rebuild the client, for this reason.
    Rebuild(String),
    /// Give up: the process exits, for this reason.
    GiveUp(String),
}

impl Escalation {
    /// For a client built at `now`, judged over `stall` windows.
    pub fn new(stall: Duration, now: Instant) -> Self {
        Self {
            stall,
            in_a_row: 0,
            built: now,
        }
    }

    /// Rebuilds so far with no proof of work in between.
    pub fn in_a_row(&self) -> u32 {
        self.in_a_row
    }

    /// One check at `now`: the [`verdict`], whether the running client has
    /// proved it works, and how many old clients are stuck closing.
    pub fn check(&mut self, now: Instant, verdict: Verdict, works: bool, stuck: usize) -> Act {
        if works {
            self.in_a_row = 0;
        }
        match verdict {
            Verdict::Healthy => Act::Wait(None),
            Verdict::Stalled(why) => Act::Wait(Some(why)),
            Verdict::Rebuild(why) if now.duration_since(self.built) < self.stall => {
                Act::Wait(Some(format!(
                    "{why}; its client was built {}s ago and gets a whole window",
                    now.duration_since(self.built).as_secs()
                )))
            }
            Verdict::Rebuild(why)
                if self.in_a_row >= MAX_REBUILDS_IN_A_ROW || stuck >= super::closing::MAX_STUCK =>
            {
                Act::GiveUp(format!(
                    "{why}, after {} rebuilds with no progress ({stuck} Kafka clients stuck closing)",
                    self.in_a_row
                ))
            }
            Verdict::Rebuild(why) => {
                self.in_a_row += 1;
                self.built = now;
                Act::Rebuild(why)
            }
        }
    }
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// One look at a group's progress on its topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// Messages not committed yet (Σ end − committed).
    pub lag: i64,
    /// Σ over partitions of the committed offset: grows with every commit.
    pub done: i64,
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
        let answering = |down: u64| ClientState {
            coordinator_down_for: s(down),
            brokers_down_for: s(0),
            answering_for: s(60),
        };
        assert_eq!(
            verdict(s(0), answering(99), s(99), None),
            Verdict::Healthy,
            "off"
        );
        assert_eq!(verdict(s(10), answering(3), s(9), None), Verdict::Healthy);
        assert!(
            matches!(verdict(s(10), answering(10), s(0), None), Verdict::Rebuild(w) if w.contains("coordinator"))
        );
        assert!(
            matches!(verdict(s(10), answering(0), s(12), None), Verdict::Rebuild(w) if w.contains("waiting"))
        );
        assert!(
            matches!(verdict(s(10), answering(0), s(12), Some(s(12))), Verdict::Stalled(w) if w.contains("retrying"))
        );
        assert!(
            matches!(
                verdict(s(10), answering(11), s(12), Some(s(12))),
                Verdict::Rebuild(_)
            ),
            "a lost coordinator is the client's"
        );
    }

    #[test]
    fn nothing_is_rebuilt_before_the_broker_has_answered_a_whole_window() {
        let s = Duration::from_secs;
        // A broker killed or stopped: reported, not rebuilt, whatever waits.
        let outage = ClientState {
            coordinator_down_for: s(30),
            brokers_down_for: s(30),
            answering_for: s(0),
        };
        assert!(
            matches!(verdict(s(10), outage, s(0), None), Verdict::Stalled(w) if w.contains("not been answering"))
        );
        assert!(matches!(
            verdict(
                s(10),
                ClientState {
                    coordinator_down_for: s(0),
                    brokers_down_for: s(0),
                    ..outage
                },
                s(30),
                None
            ),
            Verdict::Stalled(_)
        ));
        // Back for 9 s: the client still has time to recover by itself.
        let back = ClientState {
            coordinator_down_for: s(39),
            brokers_down_for: s(0),
            answering_for: s(9),
        };
        assert!(matches!(
            verdict(s(10), back, s(39), None),
            Verdict::Stalled(_)
        ));
        let still = ClientState {
            answering_for: s(10),
            ..back
        };
        assert!(matches!(
            verdict(s(10), still, s(0), None),
            Verdict::Rebuild(_)
        ));
    }

    #[test]
    fn a_client_whose_connections_stay_down_while_a_fresh_client_gets_answers_is_rebuilt() {
        // The incident of 2026-12-01: the broker answered a new client, but
        // the long-lived one never reconnected. Its own statistics must not
        // excuse it.
        let c = WatchedContext {
            coordinator_down_since: AtomicI64::new(0),
            brokers_down_since: AtomicI64::new(0),
        };
        let t = now_ms();
        c.observe(true, false, t - 30_000);
        let o = c.observed(Duration::from_secs(60));
        assert_eq!(
            o.answering_for,
            Duration::from_secs(60),
            "the probe's, not the client's"
        );
        assert!(o.brokers_down_for >= Duration::from_secs(29));
        assert!(
            matches!(verdict(Duration::from_secs(10), o, Duration::ZERO, None), Verdict::Rebuild(w) if w.contains("no broker connection")),
        );
        // During an outage (the probe unanswered), the same client waits.
        let outage = c.observed(Duration::ZERO);
        assert!(matches!(
            verdict(Duration::from_secs(10), outage, Duration::ZERO, None),
            Verdict::Stalled(_)
        ));
        c.observe(true, true, t);
        assert_eq!(
            c.observed(Duration::ZERO),
            ClientState::default(),
            "all clear"
        );
    }

    #[test]
    fn a_client_that_keeps_wedging_is_given_up_on_though_each_new_one_looks_healthy_at_first() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let stall = Duration::from_secs(20);
        let mut e = Escalation::new(stall, t0);
        let wedged = || Verdict::Rebuild("messages waiting, nothing committed for 20s".into());
        let mut t = 0;
        let mut rebuilds = 0;
        let gave_up = loop {
            // A new client: healthy at its first checks, never working.
            assert_eq!(
                e.check(at(t + 1), Verdict::Healthy, false, 0),
                Act::Wait(None)
            );
            t += 21;
            match e.check(at(t), wedged(), false, 0) {
                Act::Rebuild(_) => rebuilds += 1,
                Act::GiveUp(why) => break why,
                Act::Wait(w) => panic!("a whole window passed: {w:?}"),
            }
            assert!(rebuilds <= MAX_REBUILDS_IN_A_ROW, "rebuilt for ever");
        };
        assert_eq!(rebuilds, MAX_REBUILDS_IN_A_ROW);
        assert!(gave_up.contains("3 rebuilds"), "{gave_up}");
    }

    #[test]
    fn a_new_client_is_not_blamed_for_figures_of_the_one_before_it() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut e = Escalation::new(Duration::from_secs(20), t0);
        let stale = || Verdict::Rebuild("messages waiting, nothing committed for 25s".into());
        assert!(matches!(
            e.check(at(25), stale(), false, 0),
            Act::Rebuild(_)
        ));
        // A sampler stuck in a slow query still says 25 s a second later.
        for s in 26..45 {
            assert!(
                matches!(e.check(at(s), stale(), false, 0), Act::Wait(Some(_))),
                "rebuilt again {}s after the last",
                s - 25
            );
        }
        assert!(matches!(
            e.check(at(45), stale(), false, 0),
            Act::Rebuild(_)
        ));
        assert_eq!(e.in_a_row(), 2);
    }

    #[test]
    fn proof_of_work_resets_the_count_and_stuck_closes_end_it() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut e = Escalation::new(Duration::from_secs(10), t0);
        let wedged = || Verdict::Rebuild("group coordinator unreachable for 10s".into());
        assert!(matches!(
            e.check(at(10), wedged(), false, 0),
            Act::Rebuild(_)
        ));
        assert!(matches!(
            e.check(at(20), wedged(), false, 0),
            Act::Rebuild(_)
        ));
        assert_eq!(e.check(at(25), Verdict::Healthy, true, 0), Act::Wait(None));
        assert_eq!(e.in_a_row(), 0, "it worked");
        assert!(matches!(
            e.check(at(40), wedged(), false, super::super::closing::MAX_STUCK),
            Act::GiveUp(_)
        ));
    }
}
