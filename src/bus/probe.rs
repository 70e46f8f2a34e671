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
//! a leader: a fenced broker leads nothing. Every supervisor reads
//! [`BrokerProbe::answering_for`] and blames a client of its own only once
//! the probe has answered for a whole stall window.

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

    /// Records one look's result.
    fn record(&self, answered: bool) {
        let now = now_ms();
        holds_since(&self.answering_since, answered, now);
        if answered {
            self.last_answer.store(now, Ordering::Relaxed);
        }
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
    let mut hanging: Option<tokio::task::JoinHandle<anyhow::Result<()>>> = None;
    let mut was = None;
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
            Ok(Ok(Ok(()))) => Ok(()),
            Ok(Ok(Err(e))) => Err(format!("{e:#}")),
            Ok(Err(e)) => Err(format!("the probe task failed: {e}")),
            Err(_) => {
                hanging = Some(look);
                Err("the look is still hanging".to_owned())
            }
        };
        if was != Some(answered.is_ok()) {
            match &answered {
                Ok(()) => tracing::info!("Kafka probe: the broker answers a fresh client"),
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
        p.record(answered.is_ok());
        drop(p);
        tokio::time::sleep(EVERY).await;
    }
}

/// One look: a new client, one metadata request, the client dropped.
fn look(settings: &KafkaSettings, topic: &str) -> anyhow::Result<()> {
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
    for t in metadata.topics() {
        // A topic not created yet says nothing about the broker.
        if t.error().is_some() {
            continue;
        }
        if let Some(p) = t.partitions().iter().find(|p| p.leader() < 0) {
            anyhow::bail!("{}[{}] has no leader", t.name(), p.id());
        }
    }
    Ok(())
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
        probe.record(true);
        assert!(probe.answers());
        probe.record(false);
        assert!(!probe.answers(), "a failed look breaks the run");
        assert_eq!(probe.answering_for(), Duration::ZERO);
    }
}
