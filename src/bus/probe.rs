//! Whether the broker works, judged from outside every long-lived client.
//!
//! A librdkafka client can wedge after a broker stall (the broker fenced
//! and unfenced by its controller, say): it keeps logging timeouts against
//! a broker that a new client reaches at once. Such a client also fails
//! anything asked through it, so it cannot judge itself, nor can another
//! long-lived client that wedged with it (seen in the incident of
//! 2026-12-01: the watchdog's own offset client was stuck like the
//! consumers it judged, so nothing was ever rebuilt). The probe builds a
//! new client for every look, asks the cluster for the order topic's
//! metadata on a new connection, and throws the client away.
//!
//! The broker "answers" when a fresh client gets metadata naming at least
//! one broker, and every partition of the order topic (once it exists) has
//! a leader: a fenced broker leads nothing. Every consumer's supervisor
//! reads [`BrokerProbe::answering_for`] and blames a client of its own only
//! once the probe has answered for a whole stall window.
//!
//! A cluster can answer and still refuse writes: a partition whose in-sync
//! replicas are fewer than `kafka.min_insync_replicas` refuses every
//! `acks=all` write with NOT_ENOUGH_REPLICAS (two of three brokers down),
//! while its metadata, its leader and its reads are fine. The same look
//! reads each partition's in-sync replicas, and the producer is blamed
//! only once the cluster has taken writes ([`BrokerProbe::writable_for`])
//! for a whole window: a new producer would be refused just the same.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use anyhow::Context;
use rdkafka::producer::{BaseProducer, Producer as _};

use super::watchdog::{elapsed, holds_since};
use crate::config::KafkaSettings;

/// How often the probe looks.
const EVERY: Duration = Duration::from_secs(1);
/// The longest one look may take: a stopped broker accepts the connection
/// and never answers.
const LOOK_TIMEOUT: Duration = Duration::from_secs(5);

/// The probe's verdict, shared by every supervisor and readiness.
pub struct BrokerProbe {
    settings: KafkaSettings,
    topic: String,
    /// Unix ms since which every look has been answered; 0 while not.
    answering_since: AtomicI64,
    /// Unix ms of the last look that was answered; 0: never.
    last_answer: AtomicI64,
    /// Unix ms since which every look found the order topic writable; 0
    /// while not.
    writable_since: AtomicI64,
    /// Why the last look found writes refused, if it did.
    refusal: std::sync::Mutex<Option<String>>,
    started: AtomicBool,
}

impl BrokerProbe {
    /// A probe of the cluster in `settings`, judged on `topic`'s leaders.
    /// It looks once [`BrokerProbe::start`] has started it.
    pub fn new(settings: &KafkaSettings, topic: &str) -> Arc<Self> {
        Arc::new(Self {
            settings: settings.clone(),
            topic: topic.to_owned(),
            answering_since: AtomicI64::new(0),
            last_answer: AtomicI64::new(0),
            writable_since: AtomicI64::new(0),
            refusal: std::sync::Mutex::new(None),
            started: AtomicBool::new(false),
        })
    }

    /// How long the broker has answered every look without a break; zero
    /// while it does not.
    pub fn answering_for(&self) -> Duration {
        elapsed(&self.answering_since)
    }

    /// Whether the last look, no older than a few looks, was answered.
    pub fn answers(&self) -> bool {
        let last = self.last_answer.load(Ordering::Relaxed);
        self.answering_since.load(Ordering::Relaxed) != 0
            && last != 0
            && now_ms() - last <= (LOOK_TIMEOUT + 2 * EVERY).as_millis() as i64
    }

    /// How long every look has found the order topic taking writes (each
    /// partition led, with enough in-sync replicas); zero while not.
    pub fn writable_for(&self) -> Duration {
        elapsed(&self.writable_since)
    }

    /// Why the cluster answers but refuses writes, as the last look found;
    /// `None` while it takes them, or while it does not answer at all.
    pub fn refuses_writes(&self) -> Option<String> {
        if !self.answers() {
            return None;
        }
        self.refusal
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Records one look's result.
    fn record(&self, look: &Result<Writes, String>) {
        let now = now_ms();
        let answered = look.is_ok();
        holds_since(&self.answering_since, answered, now);
        holds_since(&self.writable_since, matches!(look, Ok(Writes::Taken)), now);
        if answered {
            self.last_answer.store(now, Ordering::Relaxed);
        }
        *self.refusal.lock().unwrap_or_else(|e| e.into_inner()) = match look {
            Ok(Writes::Refused(why)) => Some(why.clone()),
            _ => None,
        };
    }

    /// Starts looking, every second, for as long as anyone holds the
    /// probe (once; later calls do nothing). Must be called inside a Tokio
    /// runtime.
    pub fn start(self: &Arc<Self>) {
        if !self.started.swap(true, Ordering::Relaxed) {
            tokio::spawn(run(Arc::downgrade(self)));
        }
    }
}

/// Each look runs on the blocking pool (metadata calls and a client's
/// destruction block); a look that hangs past its timeout counts as
/// unanswered, and no second look starts while it hangs.
async fn run(probe: Weak<BrokerProbe>) {
    let mut hanging: Option<tokio::task::JoinHandle<anyhow::Result<Writes>>> = None;
    let mut was = None;
    let mut refused_before = None;
    while let Some(p) = probe.upgrade() {
        let mut look = match hanging.take() {
            Some(h) => h,
            None => {
                let (settings, topic) = (p.settings.clone(), p.topic.clone());
                tokio::task::spawn_blocking(move || look(&settings, &topic))
            }
        };
        drop(p);
        let answered = match tokio::time::timeout(LOOK_TIMEOUT + EVERY, &mut look).await {
            Ok(Ok(Ok(writes))) => Ok(writes),
            Ok(Ok(Err(e))) => Err(format!("{e:#}")),
            Ok(Err(e)) => Err(format!("the probe task failed: {e}")),
            Err(_) => {
                hanging = Some(look);
                Err("the look is still hanging".to_owned())
            }
        };
        let refused = match &answered {
            Ok(Writes::Refused(why)) => Some(why.clone()),
            _ => None,
        };
        if Some(refused.is_some()) != refused_before {
            match &refused {
                Some(why) => tracing::warn!(
                    reason = why,
                    "Kafka probe: the cluster answers but refuses writes"
                ),
                None if refused_before == Some(true) => {
                    tracing::info!("Kafka probe: the cluster takes writes again")
                }
                None => {}
            }
            refused_before = Some(refused.is_some());
        }
        if was != Some(answered.is_ok()) {
            match &answered {
                Ok(_) => tracing::info!("Kafka probe: the broker answers a fresh client"),
                Err(e) => {
                    tracing::warn!(
                        error = e,
                        "Kafka probe: the broker does not answer a fresh client"
                    )
                }
            }
            was = Some(answered.is_ok());
        }
        let Some(p) = probe.upgrade() else { break };
        p.record(&answered);
        drop(p);
        tokio::time::sleep(EVERY).await;
    }
}

/// Whether the order topic takes `acks=all` writes, as its metadata shows.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Writes {
    Taken,
    /// Why not: a partition with fewer in-sync replicas than writes need.
    Refused(String),
}

/// One look: a new client, one metadata request, the client dropped.
fn look(settings: &KafkaSettings, topic: &str) -> anyhow::Result<Writes> {
    let client: BaseProducer = super::client_config(settings)
        // Its own failures are the probe's verdict, logged once per change.
        .set("log_level", "2")
        .create()
        .context("creating the probe's client")?;
    let metadata = client
        .client()
        .fetch_metadata(Some(topic), LOOK_TIMEOUT)
        .context("fetching metadata on a fresh connection")?;
    anyhow::ensure!(
        !metadata.brokers().is_empty(),
        "the cluster reports no broker"
    );
    let mut writes = Writes::Taken;
    for t in metadata.topics() {
        // A topic not created yet says nothing about the broker.
        if t.error().is_some() {
            continue;
        }
        if let Some(p) = t.partitions().iter().find(|p| p.leader() < 0) {
            anyhow::bail!("{}[{}] has no leader", t.name(), p.id());
        }
        let isr: Vec<(i32, usize)> = t
            .partitions()
            .iter()
            .map(|p| (p.id(), p.isr().len()))
            .collect();
        if let Some(why) = short_of_replicas(t.name(), &isr, settings.min_insync_replicas) {
            writes = Writes::Refused(why);
        }
    }
    Ok(writes)
}

/// Why writes to `topic` are refused, if a partition (id, in-sync
/// replicas) has fewer in-sync replicas than `needed`.
fn short_of_replicas(topic: &str, isr: &[(i32, usize)], needed: i32) -> Option<String> {
    let needed = usize::try_from(needed).unwrap_or(0);
    let (id, n) = isr.iter().copied().find(|&(_, n)| n < needed)?;
    Some(format!(
        "{topic}[{id}] has {n} in-sync replica{} and acks=all writes need {needed} \
         (kafka.min_insync_replicas): the broker refuses them with NOT_ENOUGH_REPLICAS",
        if n == 1 { "" } else { "s" }
    ))
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_answers_only_after_an_unbroken_run_of_answers() {
        let settings = crate::config::Settings::load_env("test").unwrap().kafka;
        let probe = BrokerProbe::new(&settings, "t");
        assert!(!probe.answers(), "nothing looked yet");
        assert_eq!(probe.answering_for(), Duration::ZERO);
        probe.record(&Ok(Writes::Taken));
        assert!(probe.answers());
        assert_eq!(probe.refuses_writes(), None);
        probe.record(&Err("down".into()));
        assert!(!probe.answers(), "a failed look breaks the run");
        assert_eq!(probe.answering_for(), Duration::ZERO);
    }

    #[test]
    fn a_cluster_short_of_in_sync_replicas_answers_but_refuses_writes() {
        let settings = crate::config::Settings::load_env("test").unwrap().kafka;
        let probe = BrokerProbe::new(&settings, "t");
        let why = short_of_replicas("t", &[(0, 3), (1, 1), (2, 2)], 2).expect("refused");
        assert!(why.contains("t[1] has 1 in-sync replica "), "{why}");
        assert_eq!(short_of_replicas("t", &[(0, 2), (1, 3)], 2), None);
        assert_eq!(short_of_replicas("t", &[(0, 1)], 1), None);
        probe.record(&Ok(Writes::Refused(why.clone())));
        assert!(probe.answers(), "metadata, leaders and reads are fine");
        assert_eq!(probe.refuses_writes(), Some(why));
        assert_eq!(probe.writable_for(), Duration::ZERO);
        probe.record(&Ok(Writes::Taken));
        assert_eq!(probe.refuses_writes(), None);
    }
}
