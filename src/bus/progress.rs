//! How far a consumer group has provably got: the reconciler's evidence
//! (SPEC step 4) that no order event published before a moment is still
//! waiting to be processed.
//!
//! The order consumer stores a message's offset only after its database
//! transaction and its Redis marks are done, so a committed offset at a
//! partition's end means every message in that partition is applied. When
//! every partition is there, any reservation whose event was acknowledged
//! before the watermarks were read has its order row, and one still open is
//! an orphan (a crash between the script and the publish).

use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset, TopicPartitionList};

use super::closing::OffThread;
pub use super::watchdog::Sample;
use super::watchdog::StallTracker;
use crate::config::KafkaSettings;
use crate::worker::WorkerHandle;

/// Reads one group's committed offsets against its topic's end offsets.
pub struct GroupProgress {
    /// Never subscribes: only asks the group coordinator and the leaders.
    /// Replaced by [`GroupProgress::heal`] when it wedges.
    client: Mutex<Arc<OffThread<BaseConsumer>>>,
    kafka: KafkaSettings,
    group: String,
    topic: String,
    timeout: Duration,
    /// Unix ms since which every sample has failed; 0 while they succeed.
    failing_since: AtomicI64,
    /// Unix ms of the last client made anew for a partition without a
    /// leader (see [`GroupProgress::sample`]).
    renewed_at: AtomicI64,
    /// Clients made anew with no sample answered since.
    renewals_in_a_row: AtomicU32,
    /// Rebuilds by [`GroupProgress::heal`] with no sample answered since.
    heals_in_a_row: AtomicU32,
    /// The topic's end offsets as read at moments of the caller's clock
    /// ([`GroupProgress::applied_before`]), oldest first.
    marks: Mutex<std::collections::VecDeque<Mark>>,
    /// The last sample [`spawn_sampler`] got an answer to: when it
    /// started, and the lag it read; `None` until one answered.
    last_sample: Mutex<Option<(std::time::Instant, i64)>>,
}

/// The topic's end offset of each partition, read at `at_ms`.
#[derive(Debug, Clone)]
struct Mark {
    at_ms: i64,
    ends: Vec<(i32, i64)>,
}

/// `(partition, offset)` of each partition of a topic, in partition order.
type Offsets = Vec<(i32, i64)>;

/// How many marks are kept: the proof looks back this many calls.
const MARKS_KEPT: usize = 32;

impl GroupProgress {
    /// For consumer group `group` on `topic`. Connects on first use.
    pub fn new(kafka: &KafkaSettings, group: &str, topic: &str) -> anyhow::Result<Self> {
        Ok(Self {
            client: Mutex::new(Arc::new(OffThread::new(Self::client(kafka, group)?))),
            kafka: kafka.clone(),
            group: group.to_owned(),
            topic: topic.to_owned(),
            timeout: kafka.timeout_ms.max(Duration::from_millis(100)),
            failing_since: AtomicI64::new(0),
            renewed_at: AtomicI64::new(0),
            renewals_in_a_row: AtomicU32::new(0),
            heals_in_a_row: AtomicU32::new(0),
            marks: Mutex::new(std::collections::VecDeque::new()),
            last_sample: Mutex::new(None),
        })
    }

    fn client(kafka: &KafkaSettings, group: &str) -> anyhow::Result<BaseConsumer> {
        super::client_config(kafka)
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .create()
            .context("creating the Kafka progress client")
    }

    fn current(&self) -> Arc<OffThread<BaseConsumer>> {
        self.client
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Rebuilds this client when its samples have failed for `stall` while
    /// the broker answered a fresh client as long: it wedged like any
    /// other long-lived client can. The old one is destroyed on a thread
    /// of its own. After [`super::watchdog::MAX_REBUILDS_IN_A_ROW`] such
    /// rebuilds with no sample answered in between, the process gives up,
    /// to be restarted, as for any other client.
    pub fn heal(&self, supervision: &super::supervision::Supervision, stall: Duration) {
        let failing_for = super::watchdog::elapsed(&self.failing_since);
        // Judged like the consumers: only over a window in which the
        // cluster answered and took writes (two brokers of three down, it
        // answers, and its group coordinators may not).
        let probe = &supervision.probe;
        let working_for = probe.answering_for().min(probe.writable_for());
        if stall.is_zero() || failing_for < stall || working_for < stall {
            return;
        }
        let in_a_row = self.heals_in_a_row.load(Ordering::Relaxed);
        let stuck = super::closing::stuck();
        if in_a_row >= super::watchdog::MAX_REBUILDS_IN_A_ROW || stuck >= super::closing::MAX_STUCK
        {
            supervision.liveness.give_up(format!(
                "the Kafka progress client of {}: its samples failed for {}s while the broker \
                 answers a fresh client, after {in_a_row} rebuilds ({stuck} Kafka clients stuck closing)",
                self.group,
                failing_for.as_secs()
            ));
            return;
        }
        let new = match Self::client(&self.kafka, &self.group) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(
                    error = format!("{e:#}"),
                    "rebuilding the progress client failed"
                );
                return;
            }
        };
        tracing::warn!(
            client = "progress",
            group = self.group,
            failing_secs = failing_for.as_secs(),
            "Kafka progress client wedged (its queries fail while a fresh client gets answers); rebuilding it"
        );
        supervision.rebuilds.with_label_values(&["progress"]).inc();
        self.heals_in_a_row.fetch_add(1, Ordering::Relaxed);
        self.replace_client(new);
        // A new client gets a whole window of its own.
        self.failing_since.store(now_ms(), Ordering::Relaxed);
    }

    /// True when the group has committed every partition up to its end:
    /// each message appended before this call started is applied. Runs on
    /// the blocking pool (metadata and offset requests block).
    pub async fn caught_up(self: &Arc<Self>) -> anyhow::Result<bool> {
        Ok(self.lag().await? == 0)
    }

    /// The latest moment `t` (of the caller's clock, as passed to earlier
    /// calls and this one as `now_ms`) such that the group has committed
    /// every message appended to the topic before `t`: each message
    /// published before it is applied. `None` while no moment is proven.
    ///
    /// Unlike [`GroupProgress::caught_up`], this needs no instant with
    /// nothing waiting: under a steady sale the group is never at the end,
    /// but it passes the ends read one call ago. Each call reads the ends
    /// and the commits once, keeps the ends as a mark of `now_ms`, and
    /// finds the latest mark the commits have passed. Runs on the blocking
    /// pool.
    pub async fn applied_before(self: &Arc<Self>, now_ms: i64) -> anyhow::Result<Option<i64>> {
        let this = self.clone();
        let (ends, committed) = tokio::task::spawn_blocking(move || this.offsets_blocking())
            .await
            .context("Kafka progress task failed")??;
        let mut marks = self.marks.lock().unwrap_or_else(|e| e.into_inner());
        marks.push_back(Mark {
            at_ms: now_ms,
            ends,
        });
        while marks.len() > MARKS_KEPT {
            marks.pop_front();
        }
        let passed = |m: &Mark| {
            m.ends
                .iter()
                .all(|&(p, end)| committed.iter().any(|&(q, done)| q == p && done >= end))
        };
        let Some(i) = marks.iter().rposition(passed) else {
            return Ok(None);
        };
        let at = marks[i].at_ms;
        // Older marks are proven by this one; keep it and what follows.
        marks.drain(..i);
        Ok(Some(at))
    }

    /// The end offset and the committed offset of each partition, ends
    /// first (commits only move forward, so the pair errs towards "behind").
    fn offsets_blocking(&self) -> anyhow::Result<(Offsets, Offsets)> {
        let client = self.current();
        for _ in 0..1000 {
            if client.poll(Duration::ZERO).is_none() {
                break;
            }
        }
        let metadata = client
            .fetch_metadata(Some(&self.topic), self.timeout)
            .context("fetching topic metadata")?;
        let partitions: Vec<i32> = metadata
            .topics()
            .iter()
            .flat_map(|t| t.partitions())
            .map(|p| p.id())
            .collect();
        anyhow::ensure!(
            !partitions.is_empty(),
            "topic {} has no partitions",
            self.topic
        );
        let mut ends = Vec::with_capacity(partitions.len());
        let mut lows = Vec::with_capacity(partitions.len());
        let mut tpl = TopicPartitionList::new();
        for &p in &partitions {
            let (low, high) = client
                .fetch_watermarks(&self.topic, p, self.timeout)
                .with_context(|| format!("watermarks of {}[{p}]", self.topic))?;
            ends.push((p, high));
            lows.push((p, low));
            tpl.add_partition(&self.topic, p);
        }
        let committed = client
            .committed_offsets(tpl, self.timeout)
            .context("fetching the group's committed offsets")?;
        let done = lows
            .into_iter()
            .map(|(p, low)| {
                let done = match committed.find_partition(&self.topic, p).map(|e| e.offset()) {
                    Some(Offset::Offset(o)) => o.max(low),
                    // Nothing committed: the group starts at the log's start.
                    _ => low,
                };
                (p, done)
            })
            .collect();
        Ok((ends, done))
    }

    /// The last sample [`spawn_sampler`] got an answer to: when it
    /// started (an order published after that is not in its lag) and the
    /// lag. It stands while later samples fail.
    pub fn last_sample(&self) -> Option<(std::time::Instant, i64)> {
        *self.last_sample.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Messages on the topic the group has not committed yet (Σ over
    /// partitions of end offset − committed offset). Runs on the blocking pool.
    pub async fn lag(self: &Arc<Self>) -> anyhow::Result<i64> {
        Ok(self.sample().await?.lag)
    }

    /// The lag and how far the group has committed. Runs on the blocking pool.
    pub async fn sample(self: &Arc<Self>) -> anyhow::Result<Sample> {
        let this = self.clone();
        let result = tokio::task::spawn_blocking(move || this.sample_blocking())
            .await
            .context("Kafka progress task failed")?;
        super::watchdog::holds_since(&self.failing_since, result.is_err(), now_ms());
        if result.is_ok() {
            self.heals_in_a_row.store(0, Ordering::Relaxed);
            self.renewals_in_a_row.store(0, Ordering::Relaxed);
        }
        if let Err(e) = &result {
            self.renew_after_failure(e);
        }
        result
    }

    /// A sample that failed makes the next one use a new client, when
    /// [`renewal_due`] says so. A topic just made (every test, a new deployment)
    /// has partitions without a leader for a moment, longer on a loaded
    /// host, and a client that asked then can keep that answer (librdkafka
    /// #5430); a client that asked a broker still loading its group
    /// coordinators can sit in a broken coordinator state and time out
    /// every offset query after. Either fails every sample, and with
    /// `kafka.consumer_stall_secs` at 0 nothing else rebuilds it. The
    /// client never joins the group: a new one costs a connection, nothing
    /// else, and one that also fails is a broker that does not answer.
    fn renew_after_failure(&self, error: &anyhow::Error) {
        let now = now_ms();
        if !renewal_due(
            now,
            self.renewed_at.load(Ordering::Relaxed),
            self.renewals_in_a_row.load(Ordering::Relaxed),
            super::closing::stuck(),
        ) {
            return;
        }
        let Ok(new) = Self::client(&self.kafka, &self.group) else {
            return;
        };
        self.renewed_at.store(now, Ordering::Relaxed);
        self.renewals_in_a_row.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            group = self.group,
            error = format!("{error:#}"),
            "a progress sample failed; the client is made anew"
        );
        self.replace_client(new);
    }

    /// Puts `new` in the old client's place; the old one is destroyed on
    /// a thread of its own once nobody samples through it.
    fn replace_client(&self, new: BaseConsumer) {
        let old = std::mem::replace(
            &mut *self.client.lock().unwrap_or_else(|e| e.into_inner()),
            Arc::new(OffThread::new(new)),
        );
        drop(old);
    }

    fn sample_blocking(&self) -> anyhow::Result<Sample> {
        let (ends, committed) = self.offsets_blocking()?;
        let mut sample = Sample { lag: 0, done: 0 };
        for ((p, high), (q, done)) in ends.into_iter().zip(committed) {
            debug_assert_eq!(p, q, "both in partition order");
            sample.lag += (high - done).max(0);
            sample.done += done;
        }
        Ok(sample)
    }
}

/// The first wait between two clients made anew, in ms.
const RENEW_FIRST_MS: i64 = 5_000;
/// The longest wait between two clients made anew, in ms.
const RENEW_MAX_MS: i64 = 60_000;

/// Whether a failed sample may make the progress client anew at `now`
/// (Unix ms), `last` being the last time it did. The wait starts at 5 s and
/// doubles with each client made anew without a sample answered since, up
/// to a minute: through a broker outage every new client fails as the old
/// one did, and each old one's close can hold a thread for good. While a
/// close is stuck the wait is a minute; at [`super::closing::MAX_STUCK`]
/// none is made, and [`GroupProgress::heal`] gives up instead.
fn renewal_due(now: i64, last: i64, in_a_row: u32, stuck: usize) -> bool {
    let wait = if stuck >= super::closing::MAX_STUCK {
        return false;
    } else if stuck > 0 {
        RENEW_MAX_MS
    } else {
        (RENEW_FIRST_MS << in_a_row.min(4)).min(RENEW_MAX_MS)
    };
    now - last >= wait
}

/// A lag that could not be sampled (the broker could not be asked).
pub const UNKNOWN_LAG: i64 = -1;

/// Whether purchases should wait (SPEC step 2): a known `lag` above `max`
/// (0 = off). An unknown lag never refuses: a broker that cannot be asked
/// fails the publish instead, with its own answer.
pub fn lag_over(lag: i64, max: i64) -> bool {
    max > 0 && lag > max
}

/// Samples the lag every `every` into `lag` and how long the group has had
/// messages waiting without committing any into `stalled_secs` (the
/// exported metrics, which admission and readiness read).
pub fn spawn_sampler(
    progress: Arc<GroupProgress>,
    every: Duration,
    lag: prometheus::IntGauge,
    stalled_secs: prometheus::IntGauge,
    supervision: super::supervision::Supervision,
    stall: Duration,
) -> WorkerHandle {
    WorkerHandle::spawn(move |stop| async move {
        let mut tracker = StallTracker::default();
        loop {
            let started = std::time::Instant::now();
            let sample = match progress.sample().await {
                Ok(sample) => Some(sample),
                Err(e) => {
                    tracing::debug!(error = format!("{e:#}"), "consumer lag unknown");
                    None
                }
            };
            progress.heal(&supervision, stall);
            lag.set(sample.map_or(UNKNOWN_LAG, |s| s.lag));
            if let Some(s) = sample {
                *progress
                    .last_sample
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = Some((started, s.lag));
            }
            let stalled = tracker.observe(sample, std::time::Instant::now());
            stalled_secs.set(i64::try_from(stalled.as_secs()).unwrap_or(i64::MAX));
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(every) => {}
            }
        }
    })
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_known_lag_above_the_limit_refuses() {
        assert!(!lag_over(UNKNOWN_LAG, 10), "unknown never refuses");
        assert!(!lag_over(10, 10));
        assert!(lag_over(11, 10));
        assert!(!lag_over(11, 0), "0 turns it off");
    }

    /// #59 (6e): a minute of failed samples (a broker outage) makes three
    /// clients anew, not one every 5 s; a stuck close slows it to one a
    /// minute, and enough of them stop it.
    #[test]
    fn a_broker_outage_makes_few_clients_anew_and_weighs_stuck_closes() {
        let renewals_over_a_minute = |stuck: usize| {
            let (mut last, mut in_a_row, mut made) = (0, 0, 0);
            for now in (1_000..=60_000).step_by(1_000) {
                if renewal_due(now, last, in_a_row, stuck) {
                    last = now;
                    in_a_row += 1;
                    made += 1;
                }
            }
            made
        };
        assert_eq!(renewals_over_a_minute(0), 3, "at 5, 15 and 35 s");
        assert_eq!(renewals_over_a_minute(1), 1, "one a minute");
        assert_eq!(renewals_over_a_minute(crate::bus::closing::MAX_STUCK), 0);
        // A sample answered starts the waits over: 5 s again.
        assert!(renewal_due(5_000, 0, 0, 0));
        assert!(!renewal_due(4_999, 0, 0, 0));
        assert!(!renewal_due(100_000, 50_000, 9, 0), "a minute at most");
        assert!(renewal_due(110_000, 50_000, 9, 0));
    }
}
