//! The idempotent producer, with a delivery outcome of three values.
//!
//! A publish that did not end in an acknowledgement is not a "no": a
//! message that timed out after it was sent may be on the broker all the
//! same. librdkafka knows which of its failures were never transmitted
//! (`rd_kafka_message_status`), so every publish here ends in one of:
//!
//! - delivered (`Ok`);
//! - [`PublishError::QueueFull`] or [`PublishError::NotDelivered`]: the
//!   broker definitely does not have it (never handed over, never sent, or
//!   refused by the broker), so whatever it stood for may be undone;
//! - [`PublishError::Unknown`]: sent, but no answer came back (a timeout, a
//!   connection lost mid-request). The broker may have it: nothing may be
//!   undone; send the same event again or let reconciliation decide.
//!   [`PublishError::Unconfirmed`] (a success librdkafka inferred, with no
//!   offset from the broker) is handled the same way.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Context;
use rdkafka::Message as _;
use rdkafka::bindings::{rd_kafka_message_status, rd_kafka_msg_status_t};
use rdkafka::client::ClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{DeliveryResult, OwnedHeaders};
use rdkafka::producer::{BaseRecord, ProducerContext, ThreadedProducer};
use tokio::sync::oneshot;

use super::closing::OffThread;
use super::partitioner::Partitions;
use super::watchdog::{Act, Escalation, Verdict};
use crate::config::KafkaSettings;

/// Why a publish did not end in an acknowledgement.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PublishError {
    /// The local producer queue is full: never handed over (backpressure).
    #[error("the producer queue is full")]
    QueueFull,
    /// Definitely not on the broker: refused before it was sent, never
    /// transmitted before its timeout, or refused by the broker.
    #[error("not delivered: {0}")]
    NotDelivered(KafkaError),
    /// Sent, but its fate is unknown (timed out or lost in transport after
    /// transmission): the broker may have it.
    #[error("delivery unknown: {0}")]
    Unknown(KafkaError),
    /// Reported delivered without an offset: librdkafka inferred it, the
    /// broker never confirmed it. It may be missing; see [`outcome`].
    #[error("delivery reported without an offset; unconfirmed")]
    Unconfirmed,
}

impl PublishError {
    /// Whether this says nothing about the message itself, only that the
    /// broker was unreachable, slow or busy. The outbox does not count
    /// these as attempts: a broker outage never makes an event DEAD.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::QueueFull | Self::Unknown(_) | Self::Unconfirmed => true,
            Self::NotDelivered(e) => e.rdkafka_error_code().is_none_or(is_transport),
        }
    }

    /// The metric label: `queue_full`, `not_delivered`, `unknown` or
    /// `unconfirmed`.
    pub fn label(&self) -> &'static str {
        match self {
            Self::QueueFull => "queue_full",
            Self::NotDelivered(_) => "not_delivered",
            Self::Unknown(_) => "unknown",
            Self::Unconfirmed => "unconfirmed",
        }
    }
}

/// Error codes that describe the path to the broker, not the message.
fn is_transport(code: RDKafkaErrorCode) -> bool {
    use RDKafkaErrorCode::*;
    matches!(
        code,
        MessageTimedOut
            | QueueFull
            | BrokerTransportFailure
            | AllBrokersDown
            | Resolve
            | OperationTimedOut
            | RequestTimedOut
            | NetworkException
            | LeaderNotAvailable
            | NotLeaderForPartition
            | UnknownTopicOrPartition
            | UnknownTopic
            | UnknownPartition
            | NotEnoughReplicas
            | NotEnoughReplicasAfterAppend
            | NotCoordinator
            | CoordinatorNotAvailable
            | BrokerNotAvailable
            | ReplicaNotAvailable
            | BrokerDestroy
            | DestroyBroker
            | PurgeQueue
            | PurgeInflight
            | Fatal
            | WaitingForCoordinator
            | TimedOutQueue
            | KafkaStorageError
    )
}

/// What a delivery callback hands back.
type Outcome = Result<(), PublishError>;

/// Turns librdkafka's delivery reports into [`Outcome`]s, keeps the
/// producer's [`Progress`], and chooses each message's partition.
struct DeliveryContext(Arc<Progress>, Partitions);

impl ClientContext for DeliveryContext {
    fn error(&self, error: KafkaError, reason: &str) {
        // Transport errors repeat every few seconds while a broker is away;
        // the delivery outcomes carry what matters.
        tracing::debug!(error = %error, reason, "kafka producer");
    }
}

impl ProducerContext<Partitions> for DeliveryContext {
    type DeliveryOpaque = Box<oneshot::Sender<Outcome>>;

    fn get_custom_partitioner(&self) -> Option<&Partitions> {
        Some(&self.1)
    }

    fn delivery(&self, result: &DeliveryResult<'_>, tx: Self::DeliveryOpaque) {
        let outcome = outcome(result);
        self.0.reported(
            outcome
                .as_ref()
                .map_or_else(|e| !e.is_transient(), |()| true),
            now_ms(),
        );
        // The publisher may have stopped waiting (its request ended): fine.
        let _ = tx.send(outcome);
    }
}

/// What one delivery report says, in three values.
///
/// A positive report counts only if the broker gave the message an offset.
/// librdkafka also reports success, with no offset, for messages it never
/// saw acknowledged: when a later batch to the same partition succeeds
/// while an earlier one waits to be retried, it assumes the earlier one
/// was written ("implicitly acked by subsequent batch success"), since a
/// broker refuses sequence gaps. A broker that has no state yet for this
/// producer on the partition (a new producer, a new topic) accepts any
/// first sequence, though: the earlier batch, refused or never written, is
/// then lost while its report says delivered. Seen here on a topic made
/// seconds before the sale: sequence 0 of a partition absent from the log,
/// the partition starting at sequence 1, and its purchase acknowledged.
/// Such a report is [`PublishError::Unconfirmed`], handled as unknown: the
/// same event is sent again (the consumer deduplicates it) until the broker
/// names an offset.
fn outcome(result: &DeliveryResult<'_>) -> Outcome {
    match result {
        Ok(message) if message.offset() >= 0 => {
            // Where the broker says it put the message: what a missing
            // event is checked against (`seckill::bus::delivery=debug`).
            tracing::debug!(
                target: "seckill::bus::delivery",
                topic = message.topic(),
                key = %String::from_utf8_lossy(message.key().unwrap_or_default()),
                partition = message.partition(),
                offset = message.offset(),
                "delivered"
            );
            Ok(())
        }
        Ok(message) => {
            tracing::warn!(
                topic = message.topic(),
                key = %String::from_utf8_lossy(message.key().unwrap_or_default()),
                partition = message.partition(),
                "delivery reported without an offset (inferred by librdkafka, never acknowledged by the broker); sending it again"
            );
            Err(PublishError::Unconfirmed)
        }
        Err((error, message)) => {
            // SAFETY: the message is alive for the duration of this
            // callback, and the status call only reads it.
            let status = unsafe { rd_kafka_message_status(message.ptr()) };
            Err(match status {
                rd_kafka_msg_status_t::RD_KAFKA_MSG_STATUS_NOT_PERSISTED => {
                    PublishError::NotDelivered(error.clone())
                }
                _ => PublishError::Unknown(error.clone()),
            })
        }
    }
}

/// Whether the producer gets its messages delivered: how long it has had
/// work without one answer from the broker. Only time with messages
/// pending counts: the stretch opens at a send, pauses while nothing
/// waits (an idle producer after a last failed publish is not stalled),
/// resumes at the next send, and closes at an answer. Messages timing out
/// and sent again so add up to one long stall, and an idle gap between
/// them adds nothing.
#[derive(Debug, Default)]
struct Progress(std::sync::Mutex<Stretch>);

#[derive(Debug, Default, Clone, Copy)]
struct Stretch {
    /// Answers from the broker so far: the supervisor's proof of progress
    /// between two rebuilds.
    answers: u64,
    pending: i64,
    /// Unanswered time with messages pending, in ms, up to `since`.
    unanswered_ms: i64,
    /// Unix ms since which messages have waited with no answer; `None`
    /// while nothing waits.
    since: Option<i64>,
}

impl Progress {
    fn with<T>(&self, f: impl FnOnce(&mut Stretch) -> T) -> T {
        f(&mut self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn sent(&self, now: i64) {
        self.with(|s| {
            s.pending += 1;
            s.since.get_or_insert(now);
        });
    }

    /// Refused before it was handed over (a full queue waits on the
    /// messages before it, which keep the stretch open).
    fn not_sent(&self, now: i64) {
        self.with(|s| s.settle(false, now));
    }

    /// One delivery report. `answered`: delivered, or refused by the broker
    /// for the message's own sake (the broker answered); a timeout or a
    /// transport failure is no progress.
    fn reported(&self, answered: bool, now: i64) {
        self.with(|s| s.settle(answered, now));
    }

    /// A new client gets a whole window of its own; so does the client
    /// after a stretch in which the cluster refused writes (forgiven, not
    /// carried over).
    fn restart(&self, now: i64) {
        self.with(|s| {
            s.unanswered_ms = 0;
            if s.since.is_some() {
                s.since = Some(now);
            }
        });
    }

    /// How many answers the broker has given so far.
    fn answers(&self) -> u64 {
        self.with(|s| s.answers)
    }

    /// How long messages have waited with no answer, idle gaps left out.
    fn stalled_ms(&self, now: i64) -> i64 {
        self.with(|s| match s.since {
            Some(since) if s.pending > 0 => s.unanswered_ms + (now - since).max(0),
            _ => 0,
        })
    }
}

impl Stretch {
    /// One message left the producer: answered (the stretch closes, or
    /// starts again while others wait) or not (it goes on, and pauses if
    /// nothing waits any more).
    fn settle(&mut self, answered: bool, now: i64) {
        self.pending = (self.pending - 1).max(0);
        if answered {
            self.answers += 1;
            self.unanswered_ms = 0;
            self.since = (self.pending > 0).then_some(now);
        } else if self.pending == 0
            && let Some(since) = self.since.take()
        {
            self.unanswered_ms += (now - since).max(0);
        }
    }
}

/// The supervisor's look at the producer, once a second: a rebuild once
/// messages have waited `stall` with no answer while the cluster took
/// writes from a fresh client for as long (`writable_for`). While the
/// cluster refuses writes (or does not answer) the wait is forgiven, not
/// carried over: otherwise a stretch of a refused-writes period, resumed by
/// the first send after the brokers return, would condemn a producer that
/// had no chance yet to be answered.
fn judge(progress: &Progress, stall: Duration, writable_for: Duration, now: i64) -> Verdict {
    if writable_for.is_zero() {
        progress.restart(now);
        return Verdict::Healthy;
    }
    let stalled = Duration::from_millis(u64::try_from(progress.stalled_ms(now)).unwrap_or(0));
    if stall.is_zero() || stalled < stall || writable_for < stall {
        return Verdict::Healthy;
    }
    Verdict::Rebuild(format!(
        "nothing delivered for {}s while the cluster takes writes from a fresh client",
        stalled.as_secs()
    ))
}

type Client = ThreadedProducer<DeliveryContext, Partitions>;

/// The idempotent producer: `acks=all`, retried by librdkafka without
/// duplicates or reordering within a partition until
/// `kafka.message_timeout_ms`. Cheap to clone; every clone sends through
/// the same client, which [`Producer::rebuild`] replaces for all of them.
#[derive(Clone)]
pub struct Producer {
    inner: Arc<RwLock<Arc<OffThread<Client>>>>,
    progress: Arc<Progress>,
    settings: Arc<KafkaSettings>,
}

impl Producer {
    /// Creates the producer (it connects on first use).
    pub fn new(settings: &KafkaSettings) -> anyhow::Result<Self> {
        let progress = Arc::new(Progress::default());
        let inner = build(settings, &progress)?;
        Ok(Self {
            inner: Arc::new(RwLock::new(Arc::new(OffThread::new(inner)))),
            progress,
            settings: Arc::new(settings.clone()),
        })
    }

    fn current(&self) -> Arc<OffThread<Client>> {
        self.inner.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// How long messages have waited with not one delivered; zero while
    /// the producer is idle or delivering.
    pub fn stalled_for(&self) -> Duration {
        Duration::from_millis(u64::try_from(self.progress.stalled_ms(now_ms())).unwrap_or(0))
    }

    /// Replaces the client for every clone. The old one is destroyed on
    /// a thread of its own once nobody sends through it (a send in hand
    /// holds it for a moment): its queue is purged, each message reported
    /// as never sent or as unknown, as librdkafka knows it (the unknown
    /// ones are sent again from their reservations).
    pub fn rebuild(&self) -> anyhow::Result<()> {
        let new = Arc::new(OffThread::new(build(&self.settings, &self.progress)?));
        let old = std::mem::replace(
            &mut *self.inner.write().unwrap_or_else(|e| e.into_inner()),
            new,
        );
        self.progress.restart(now_ms());
        drop(old);
        Ok(())
    }

    /// Rebuilds the client whenever it has delivered nothing for
    /// `kafka.consumer_stall_secs` while the cluster took writes from a
    /// fresh client for as long ([`super::probe::BrokerProbe::writable_for`]:
    /// a cluster that refuses writes, two of three brokers down, refuses a
    /// new producer just the same). Gives up (the process exits, to be
    /// restarted) after [`super::watchdog::MAX_REBUILDS_IN_A_ROW`] rebuilds
    /// with no answer from the broker in between.
    pub fn supervise(&self, watch: super::supervision::Supervision) -> crate::worker::WorkerHandle {
        let producer = self.clone();
        let stall = self.settings.consumer_stall_secs;
        watch.rebuilds.with_label_values(&["producer"]);
        crate::worker::WorkerHandle::spawn(move |stop| async move {
            let mut escalation = Escalation::new(stall, std::time::Instant::now());
            let mut answers_at_rebuild = producer.progress.answers();
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
                // Only an answer proves a rebuild mended it: a stretch
                // with nothing pending says nothing either way.
                let works = producer.progress.answers() != answers_at_rebuild;
                let verdict = judge(
                    &producer.progress,
                    stall,
                    watch.probe.writable_for(),
                    now_ms(),
                );
                match escalation.check(
                    std::time::Instant::now(),
                    verdict,
                    works,
                    super::closing::stuck(),
                ) {
                    Act::Wait(_) => {}
                    Act::GiveUp(why) => {
                        watch.liveness.give_up(format!("the Kafka producer: {why}"));
                        break;
                    }
                    Act::Rebuild(why) => {
                        answers_at_rebuild = producer.progress.answers();
                        tracing::warn!(
                            client = "producer",
                            reason = why,
                            "Kafka client wedged; rebuilding it"
                        );
                        watch.rebuilds.with_label_values(&["producer"]).inc();
                        if let Err(e) = producer.rebuild() {
                            tracing::warn!(
                                error = format!("{e:#}"),
                                "rebuilding the producer failed"
                            );
                        }
                    }
                }
            }
        })
    }

    /// Messages librdkafka holds: queued, or sent and not reported yet.
    pub fn queued(&self) -> i32 {
        use rdkafka::producer::Producer as _;
        self.current().in_flight_count()
    }

    /// Hands one message to librdkafka now (so messages enqueued one after
    /// another keep their order within a partition) and returns the wait
    /// for its delivery report. A full queue is reported at once.
    pub fn enqueue(
        &self,
        topic: &str,
        key: &str,
        payload: &[u8],
        headers: Option<OwnedHeaders>,
    ) -> Result<Delivery, PublishError> {
        let (tx, rx) = oneshot::channel();
        let mut record = BaseRecord::with_opaque_to(topic, Box::new(tx))
            .key(key)
            .payload(payload);
        if let Some(h) = headers {
            record = record.headers(h);
        }
        self.progress.sent(now_ms());
        let result = self.current().send(record);
        if result.is_err() {
            self.progress.not_sent(now_ms());
        }
        match result {
            Ok(()) => Ok(Delivery(rx)),
            Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                Err(PublishError::QueueFull)
            }
            // Refused before it was handed over: never sent.
            Err((e, _)) => Err(PublishError::NotDelivered(e)),
        }
    }

    /// Enqueues one message and waits for its delivery report.
    pub async fn publish(
        &self,
        topic: &str,
        key: &str,
        payload: &[u8],
        headers: Option<OwnedHeaders>,
    ) -> Result<(), PublishError> {
        self.enqueue(topic, key, payload, headers)?.await
    }
}

fn build(settings: &KafkaSettings, progress: &Arc<Progress>) -> anyhow::Result<Client> {
    super::client_config(settings)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", settings.linger_ms.as_millis().to_string())
        .set("queue.buffering.max.messages", "200000")
        // A leader that stops answering without closing (paused) is given
        // up after this, past its fencing, not after the message timeout:
        // librdkafka's client-side wait for a produce answer is the lesser
        // of socket.timeout.ms and the message's remaining time
        // (request.timeout.ms is only the brokers' own ack wait).
        .set(
            "socket.timeout.ms",
            settings
                .request_timeout_ms
                .min(settings.message_timeout_ms)
                .max(Duration::from_secs(1))
                .as_millis()
                .to_string(),
        )
        // A connection to every broker, not only to the leaders in use: when
        // the one broker leading every partition goes down, librdkafka asks
        // another for the new leaders. With only the lost connection it
        // finds no broker to ask and waits until a message times out.
        .set("enable.sparse.connections", "false")
        .set(
            "message.timeout.ms",
            settings
                .message_timeout_ms
                .max(Duration::from_secs(1))
                .as_millis()
                .to_string(),
        )
        .create_with_context(DeliveryContext(
            progress.clone(),
            Partitions::new(super::Topics::new(&settings.topic_prefix).order_requested),
        ))
        .context("creating the Kafka producer")
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// The wait for one delivery report.
pub struct Delivery(oneshot::Receiver<Outcome>);

impl Future for Delivery {
    type Output = Outcome;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Outcome> {
        std::pin::Pin::new(&mut self.0).poll(cx).map(|r| {
            // The producer went away with the message in it (shutdown): it
            // may or may not have been sent.
            r.unwrap_or(Err(PublishError::Unknown(KafkaError::Canceled)))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_time_with_messages_pending_and_no_answer_counts_as_a_stall() {
        let p = Progress::default();
        // A last publish that timed out, and nothing sent after it.
        p.sent(1_000);
        p.reported(false, 6_000);
        assert_eq!(p.stalled_ms(60_000), 0, "idle, however long after");
        assert_eq!(p.stalled_ms(600_000), 0);
        // The next send resumes the stretch: 5 s before, 3 s now.
        p.sent(600_000);
        assert_eq!(p.stalled_ms(603_000), 8_000);
        // A delivery closes it.
        p.reported(true, 603_500);
        assert_eq!(p.stalled_ms(700_000), 0);
        // Two pending: one answered restarts the clock for the other.
        p.sent(700_000);
        p.sent(700_100);
        p.reported(true, 702_000);
        assert_eq!(p.stalled_ms(703_000), 1_000);
        p.reported(false, 704_000);
        assert_eq!(p.stalled_ms(900_000), 0, "nothing waits");
        // A refusal before the hand-over (queue full) with nothing else
        // pending leaves nothing waiting either.
        p.sent(1_000_000);
        p.not_sent(1_000_000);
        assert_eq!(p.stalled_ms(1_100_000), 0);
    }

    #[test]
    fn a_new_client_gets_a_whole_window() {
        let p = Progress::default();
        p.sent(0);
        assert_eq!(p.stalled_ms(30_000), 30_000);
        p.restart(30_000);
        assert_eq!(p.stalled_ms(31_000), 1_000);
    }

    /// #59 (6c): messages that timed out while two brokers of three were
    /// down, an idle minute once they were back, then one purchase: its
    /// send must not resume the outage's stretch and condemn the producer
    /// at once.
    #[test]
    fn a_refused_writes_period_is_not_carried_over_into_a_stall() {
        let stall = Duration::from_secs(20);
        let p = Progress::default();
        let mut now = 0;
        let writable_for = |now: i64| match now {
            ..10_000 => Duration::from_millis(u64::try_from(now + 60_000).unwrap()),
            10_000..70_000 => Duration::ZERO,
            _ => Duration::from_millis(u64::try_from(now - 70_000).unwrap()),
        };
        // Writes go on for 10 s with nothing answered (the fencing of the
        // lost brokers), then are refused for a minute: re-sent messages
        // time out one after another.
        while now < 70_000 {
            if now % 15_000 == 0 && now < 60_000 {
                p.sent(now);
            }
            if now % 15_000 == 14_000 {
                p.reported(false, now);
            }
            assert!(
                matches!(judge(&p, stall, writable_for(now), now), Verdict::Healthy),
                "at {now} ms: not the producer's fault"
            );
            now += 1_000;
        }
        // Back, and idle for a minute.
        while now < 130_000 {
            assert!(matches!(
                judge(&p, stall, writable_for(now), now),
                Verdict::Healthy
            ));
            now += 1_000;
        }
        // One purchase: its message has had no time to be answered yet.
        p.sent(now);
        now += 1_000;
        assert!(
            matches!(judge(&p, stall, writable_for(now), now), Verdict::Healthy),
            "stalled {} ms: carried over from the outage",
            p.stalled_ms(now)
        );
        // Unanswered for a whole window while the cluster takes writes: a
        // wedged producer is still rebuilt.
        now += 20_000;
        assert!(matches!(
            judge(&p, stall, writable_for(now), now),
            Verdict::Rebuild(_)
        ));
    }

    #[test]
    fn only_refusals_of_the_message_itself_count_as_attempts() {
        let timed_out = KafkaError::MessageProduction(RDKafkaErrorCode::MessageTimedOut);
        assert!(PublishError::Unknown(timed_out.clone()).is_transient());
        assert!(PublishError::NotDelivered(timed_out).is_transient());
        assert!(PublishError::QueueFull.is_transient());
        let too_large = KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge);
        assert!(!PublishError::NotDelivered(too_large).is_transient());
    }
}
