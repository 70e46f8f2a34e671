//! The consumer loop every subscriber of this service shares: receive a
//! batch (≤ N messages / T ms), hand it to a [`Handler`], and only when the
//! handler says the batch's effects are durable, store its offsets. Offsets
//! are stored locally (`enable.auto.offset.store=false`) and committed by
//! librdkafka's own thread (`enable.auto.commit`), so no blocking commit
//! runs on the async runtime; a client is closed on a thread of its own
//! ([`super::closing`]).
//!
//! Each consumer runs under a supervisor ([`super::watchdog`]) that checks
//! its progress every second and rebuilds the client when it is stalled.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use rdkafka::Message;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, OwnedHeaders, OwnedMessage};
use tokio_util::sync::CancellationToken;

use super::Producer;
use super::closing::OffThread;
use super::progress::GroupProgress;
pub use super::supervision::Supervision;
use super::watchdog::{Act, Escalation, Health, StallTracker, WatchedContext, verdict};
use crate::config::KafkaSettings;
use crate::worker::WorkerHandle;

/// What to consume.
#[derive(Debug, Clone)]
pub struct Subscription {
    /// Consumer group suffix (the topic prefix goes in front).
    pub group: &'static str,
    /// Full topic name.
    pub topic: String,
    /// Largest batch.
    pub batch_size: usize,
    /// Longest wait to fill a batch.
    pub batch_wait: Duration,
    /// Batches applied at once (at least 1). Their offsets are stored in the
    /// order they were received, each only when it and every batch before
    /// it are done, so a crash replays at most the batches in flight.
    pub in_flight: usize,
    /// While purchases rush through this instance, a batch waits longer to
    /// fill ([`super::batch`]); None: never.
    pub rush: Option<super::batch::Rush>,
}

/// Applies batches of messages.
pub trait Handler: Send + Sync + 'static {
    /// Applies `batch`; returns false when `shutdown` interrupted it, in
    /// which case its offsets are not stored and it will be redelivered.
    fn handle<'a>(
        &'a self,
        batch: &'a [OwnedMessage],
        shutdown: &'a CancellationToken,
    ) -> impl Future<Output = bool> + Send + 'a;
}

/// A running consumer.
pub type ConsumerHandle = WorkerHandle;

type Client = StreamConsumer<WatchedContext>;

/// A client shared by its supervisor and the task running it; destroyed
/// (closed) on a thread of its own whoever lets go of it last.
type Shared = Arc<OffThread<Client>>;

/// The group's session timeout: a member silent for this long is out of
/// the group anyway, so a stop waits no longer for a close to leave it.
const SESSION_TIMEOUT: Duration = Duration::from_secs(10);

/// Starts the consumer of `sub` under its supervisor, on the current runtime.
pub fn spawn<H: Handler>(
    kafka: &KafkaSettings,
    sub: Subscription,
    handler: H,
    supervision: Supervision,
) -> anyhow::Result<ConsumerHandle> {
    let group = super::group_id(kafka, sub.group);
    let progress = Arc::new(GroupProgress::new(kafka, &group, &sub.topic)?);
    // The first client is built here, so a configuration error fails the
    // caller instead of a background task.
    let first = build(kafka, &group, &sub.topic)?;
    let kafka = kafka.clone();
    Ok(WorkerHandle::spawn(move |shutdown| {
        supervise(
            kafka,
            sub,
            group,
            Arc::new(handler),
            supervision,
            progress,
            first,
            shutdown,
        )
    }))
}

fn build(kafka: &KafkaSettings, group: &str, topic: &str) -> anyhow::Result<Shared> {
    let consumer: Client = super::client_config(kafka)
        .set("group.id", group)
        .set("enable.auto.commit", "true")
        .set("auto.commit.interval.ms", "500")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set(
            "session.timeout.ms",
            SESSION_TIMEOUT.as_millis().to_string(),
        )
        .set("fetch.min.bytes", kafka.fetch_min_bytes.max(1).to_string())
        .set(
            "fetch.wait.max.ms",
            kafka.fetch_wait_max_ms.as_millis().to_string(),
        )
        // The watchdog reads the group coordinator's state from these.
        .set("statistics.interval.ms", "1000")
        .create_with_context(WatchedContext::new())
        .with_context(|| format!("creating the {group} consumer"))?;
    consumer
        .subscribe(&[topic])
        .with_context(|| format!("subscribing to {topic}"))?;
    Ok(Arc::new(OffThread::new(consumer)))
}

/// Runs a client, checks it every second, rebuilds it when it is stalled.
#[allow(clippy::too_many_arguments)]
async fn supervise<H: Handler>(
    kafka: KafkaSettings,
    sub: Subscription,
    group: String,
    handler: Arc<H>,
    supervision: Supervision,
    progress: Arc<GroupProgress>,
    first: Shared,
    shutdown: CancellationToken,
) {
    let health = supervision.register(&group, sub.group);
    let stall = kafka.consumer_stall_secs;
    // How long the group has had messages waiting with nothing committed,
    // sampled from outside the client by a task of its own (a sample can
    // take seconds while the broker is away).
    let waiting = Arc::new(AtomicI64::new(0));
    let restarted = Arc::new(tokio::sync::Notify::new());
    // Which client is running (one more at each rebuild), and the latest
    // one a sample begun in its time saw the group move forward under.
    let marks = Arc::new(Marks::new());
    let sampler = tokio::spawn(sample(
        progress.clone(),
        waiting.clone(),
        restarted.clone(),
        marks.clone(),
        supervision.clone(),
        stall,
        shutdown.clone(),
    ));
    let mut escalation = Escalation::new(stall, Instant::now());
    let mut client = Some(first);
    while !shutdown.is_cancelled() {
        let consumer = match client.take() {
            Some(c) => c,
            None => match build(&kafka, &group, &sub.topic) {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(
                        error = format!("{e:#}"),
                        group,
                        "rebuilding the consumer failed; retrying"
                    );
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            },
        };
        let busy_since = Arc::new(AtomicI64::new(0));
        let stop = shutdown.child_token();
        let mut running = tokio::spawn(run(
            consumer.clone(),
            sub.clone(),
            handler.clone(),
            busy_since.clone(),
            stop.clone(),
        ));
        let watch = Watch {
            stall,
            waiting: &waiting,
            busy_since: &busy_since,
            supervision: &supervision,
            health: &health,
            marks: &marks,
        };
        let act = watch
            .until_rebuild(&mut running, &consumer, &mut escalation)
            .await;
        match act {
            Some(Act::GiveUp(why)) => {
                supervision
                    .liveness
                    .give_up(format!("the {group} consumer: {why}"));
                // Stop consuming; the process is about to exit.
                running.abort();
                let _ = running.await;
                std::mem::forget(consumer);
                break;
            }
            Some(Act::Rebuild(why)) => {
                supervision.count_rebuild(&group, sub.group, &why);
                running.abort();
                let _ = running.await;
                // The new client is judged on samples of its own time: a
                // sample still running began under the old one.
                marks.client.fetch_add(1, Ordering::AcqRel);
                waiting.store(0, Ordering::Relaxed);
                restarted.notify_one();
                // Closing may hang on an unreachable coordinator: let it,
                // on a thread of its own, while the new client starts.
                drop(consumer);
            }
            Some(Act::Wait(_)) | None => {
                // Stopped: close it, committing the stored offsets and
                // leaving the group, for as long as the group would wait.
                stop.cancel();
                if let Ok(consumer) = Arc::try_unwrap(consumer)
                    && !consumer.destroy_within(SESSION_TIMEOUT).await
                {
                    tracing::warn!(group, "the consumer did not close in time; leaving it");
                }
                health.set(None);
            }
        }
    }
    sampler.abort();
    let _ = sampler.await;
    // Its client is destroyed on a thread of its own.
    drop(progress);
}

/// What tells one client's time from the next, and whether the group
/// moved forward in it.
#[derive(Debug)]
struct Marks {
    /// The running client's number: one more at each rebuild.
    client: AtomicU64,
    /// The number of the latest client under which a sample, begun in its
    /// time, found the group committing or caught up; `u64::MAX` before any.
    progressed: AtomicU64,
}

impl Marks {
    fn new() -> Self {
        Self {
            client: AtomicU64::new(0),
            progressed: AtomicU64::new(u64::MAX),
        }
    }

    /// Whether the running client has been seen making progress.
    fn current_progressed(&self) -> bool {
        self.progressed.load(Ordering::Acquire) == self.client.load(Ordering::Acquire)
    }
}

/// What a running client is judged on, every second.
struct Watch<'a> {
    stall: Duration,
    /// How long the group has had messages waiting with nothing committed (s).
    waiting: &'a AtomicI64,
    /// Since when the handler has been in one batch (unix ms; 0 between).
    busy_since: &'a AtomicI64,
    supervision: &'a Supervision,
    health: &'a Health,
    marks: &'a Marks,
}

impl Watch<'_> {
    /// Checks the client every second until it ends (`None`: shutdown, or a
    /// panic) or must be rebuilt or given up on ([`Escalation`]). The
    /// client proves it works with its coordinator up and a sample of its
    /// own time that found the group committing or caught up.
    async fn until_rebuild(
        &self,
        running: &mut tokio::task::JoinHandle<()>,
        consumer: &Client,
        escalation: &mut Escalation,
    ) -> Option<Act> {
        loop {
            tokio::select! {
                _ = &mut *running => return None,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            let waiting_for =
                Duration::from_secs(self.waiting.load(Ordering::Relaxed).max(0) as u64);
            let busy = match self.busy_since.load(Ordering::Relaxed) {
                0 => None,
                since => Some(Duration::from_millis((now_ms() - since).max(0) as u64)),
            };
            // A consumer commits its offsets (writes to the group's offsets
            // topic): while the cluster refuses writes (too few in-sync
            // replicas) nothing can be committed, and a new client would
            // fare no better. It is blamed only for a window in which the
            // cluster answered and took writes.
            let probe = &self.supervision.probe;
            let answering_for = probe.answering_for().min(probe.writable_for());
            let client = consumer.context().observed(answering_for);
            let works = client.coordinator_down_for.is_zero() && self.marks.current_progressed();
            let verdict = verdict(self.stall, client, waiting_for, busy);
            match escalation.check(Instant::now(), verdict, works, super::closing::stuck()) {
                Act::Wait(why) => self.health.set(why),
                act @ (Act::Rebuild(_) | Act::GiveUp(_)) => {
                    if let Act::Rebuild(why) | Act::GiveUp(why) = &act {
                        self.health.set(Some(why.clone()));
                    }
                    return Some(act);
                }
            }
        }
    }
}

/// Every second: how long the group has been stalled, into `waiting` (s),
/// and in `marks` whether the running client's group moved forward.
/// The progress client is itself long-lived: when it fails while the
/// broker answers a fresh client, it is rebuilt too.
async fn sample(
    progress: Arc<GroupProgress>,
    waiting: Arc<AtomicI64>,
    restarted: Arc<tokio::sync::Notify>,
    marks: Arc<Marks>,
    supervision: Supervision,
    stall: Duration,
    shutdown: CancellationToken,
) {
    let mut tracker = StallTracker::default();
    let mut last_done = None;
    loop {
        let client = marks.client.load(Ordering::Acquire);
        let sample = progress.sample().await.ok();
        progress.heal(&supervision, stall);
        if let Some(s) = sample {
            if s.lag <= 0 || last_done.is_some_and(|d| s.done > d) {
                marks.progressed.store(client, Ordering::Release);
            }
            last_done = Some(s.done);
        }
        let stalled = tracker.observe(sample, Instant::now());
        waiting.store(stalled.as_secs() as i64, Ordering::Relaxed);
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = restarted.notified() => {
                // A new client gets a whole window of its own.
                tracker.restart(Instant::now());
                waiting.store(0, Ordering::Relaxed);
            }
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

async fn run<H: Handler>(
    consumer: Shared,
    sub: Subscription,
    handler: Arc<H>,
    busy_since: Arc<AtomicI64>,
    shutdown: CancellationToken,
) {
    let max = sub.batch_size.max(1);
    let depth = sub.in_flight.max(1);
    // Batches being applied, oldest first.
    let mut applying: VecDeque<Applying> = VecDeque::with_capacity(depth);
    // The last batch filled to `max`: the topic has a backlog.
    let mut backlog = false;
    loop {
        busy_since.store(
            applying.front().map_or(0, |a| a.started_ms),
            Ordering::Relaxed,
        );
        let next = tokio::select! {
            _ = shutdown.cancelled() => Next::Stop,
            r = oldest(&mut applying), if !applying.is_empty() => Next::Applied(r),
            m = consumer.recv(), if applying.len() < depth_now(depth, sub.rush.as_ref(), backlog) => Next::Received(m.map(|m| m.detach())),
        };
        match next {
            Next::Stop => break,
            Next::Applied(result) => {
                applying.pop_front();
                if !stored(&consumer, result) {
                    return; // shutting down mid-retry: these offsets stay uncommitted
                }
            }
            Next::Received(Err(e)) => {
                tracing::warn!(error = %e, group = sub.group, "receive failed");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Next::Received(Ok(first)) => {
                let batch =
                    super::batch::fill(first, max, sub.batch_wait, sub.rush.as_ref(), || async {
                        match consumer.recv().await {
                            Ok(m) => Some(m.detach()),
                            Err(e) => {
                                tracing::warn!(error = %e, group = sub.group, "receive failed");
                                None
                            }
                        }
                    })
                    .await;
                backlog = batch.len() >= max;
                let (handler, stop) = (handler.clone(), shutdown.clone());
                applying.push_back(Applying {
                    started_ms: now_ms(),
                    task: tokio::spawn(async move {
                        let done = handler.handle(&batch, &stop).await;
                        (batch, done)
                    }),
                });
            }
        }
    }
    // Stopping: the batches in flight finish (a handler in a retry gives up
    // at once) and the offsets of those done are stored.
    while !applying.is_empty() {
        let result = oldest(&mut applying).await;
        applying.pop_front();
        if !stored(&consumer, result) {
            break;
        }
    }
    busy_since.store(0, Ordering::Relaxed);
}

/// Batches applied at once: `depth`; or one while purchases rush through
/// this instance (the database's commits then wait their turn too), unless
/// the last batch filled up. A sale that keeps accepting thousands a
/// second is one long rush, and its orders must not fall behind: full
/// batches say they are, and get every batch in flight again.
fn depth_now(depth: usize, rush: Option<&super::batch::Rush>, backlog: bool) -> usize {
    if !backlog && rush.is_some_and(super::batch::Rush::on) {
        1
    } else {
        depth
    }
}

/// What the consumer loop does next.
enum Next {
    Stop,
    Applied(Result<(Vec<OwnedMessage>, bool), tokio::task::JoinError>),
    Received(rdkafka::error::KafkaResult<OwnedMessage>),
}

/// A batch being applied on a task of its own. Dropping it (the loop
/// aborted for a rebuild) aborts the task, as the loop's own future would
/// have been.
struct Applying {
    started_ms: i64,
    task: tokio::task::JoinHandle<(Vec<OwnedMessage>, bool)>,
}

impl Drop for Applying {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Waits for the oldest batch in flight; never resolves when there is none.
async fn oldest(
    applying: &mut VecDeque<Applying>,
) -> Result<(Vec<OwnedMessage>, bool), tokio::task::JoinError> {
    match applying.front_mut() {
        Some(a) => (&mut a.task).await,
        None => std::future::pending().await,
    }
}

/// Stores the offsets of an applied batch; false when its handler was
/// interrupted by shutdown. A handler's panic goes on up, as it would
/// have from the loop itself.
fn stored(
    consumer: &Client,
    result: Result<(Vec<OwnedMessage>, bool), tokio::task::JoinError>,
) -> bool {
    let (batch, done) = match result {
        Ok(r) => r,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => return false, // aborted: only while the loop itself is dropped
    };
    if !done {
        return false;
    }
    for m in &batch {
        if let Err(e) = consumer.store_offset(m.topic(), m.partition(), m.offset()) {
            // Partition revoked meanwhile: its new owner replays, harmlessly.
            tracing::debug!(error = %e, "offset not stored");
        }
    }
    true
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// Exponential backoff: 200 ms, 400 ms, … capped at 5 s.
pub fn backoff(attempt: u32) -> Duration {
    (Duration::from_millis(100) * 2u32.saturating_pow(attempt.min(10))).min(Duration::from_secs(5))
}

/// Runs `op` until it succeeds, logging each failure as `what` and backing
/// off between attempts. `None` if shutdown came first.
pub async fn retry<T, F, Fut>(what: &str, shutdown: &CancellationToken, mut op: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let mut attempt = 0;
    loop {
        match op().await {
            Ok(value) => return Some(value),
            Err(e) => {
                attempt += 1;
                tracing::warn!(error = format!("{e:#}"), attempt, "{what} failed; retrying");
                if !pause(attempt, shutdown).await {
                    return None;
                }
            }
        }
    }
}

/// Sleeps for `backoff(attempt)`; false if shutdown came first.
pub async fn pause(attempt: u32, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => false,
        _ = tokio::time::sleep(backoff(attempt)) => true,
    }
}

/// Publishes `m` to `dlq` with the reason and its origin in headers,
/// retrying until the broker takes it (a dead letter must not be lost).
/// False if shutdown came first.
pub async fn dead_letter(
    producer: &Producer,
    dlq: &str,
    m: &OwnedMessage,
    reason: &str,
    shutdown: &CancellationToken,
) -> bool {
    tracing::warn!(
        reason,
        topic = m.topic(),
        partition = m.partition(),
        offset = m.offset(),
        "dead-lettered"
    );
    let partition = m.partition().to_string();
    let offset = m.offset().to_string();
    let key = m.key().map(String::from_utf8_lossy).unwrap_or_default();
    let mut attempt = 0;
    loop {
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "error",
                value: Some(reason),
            })
            .insert(Header {
                key: "source.topic",
                value: Some(m.topic()),
            })
            .insert(Header {
                key: "source.partition",
                value: Some(partition.as_str()),
            })
            .insert(Header {
                key: "source.offset",
                value: Some(offset.as_str()),
            });
        match producer
            .publish(dlq, &key, m.payload().unwrap_or_default(), Some(headers))
            .await
        {
            Ok(()) => return true,
            Err(e) => {
                attempt += 1;
                tracing::warn!(error = %e, attempt, "dead-letter publish failed; retrying");
                if !pause(attempt, shutdown).await {
                    return false;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::depth_now;
    use crate::bus::batch::tests::rush;

    #[test]
    fn a_rush_applies_one_batch_at_a_time_unless_the_topic_has_a_backlog() {
        let (busy, _held) = rush(65);
        assert_eq!(depth_now(4, Some(&busy), false), 1);
        assert_eq!(
            depth_now(4, Some(&busy), true),
            4,
            "full batches: orders falling behind"
        );
        let (quiet, _held) = rush(64);
        assert_eq!(depth_now(4, Some(&quiet), false), 4);
        assert_eq!(depth_now(4, None, false), 4);
    }
}
