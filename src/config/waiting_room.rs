//! `[waiting_room]`: the process-wide side of activities' waiting rooms
//! (each room's own rate, pass time and difficulty are set at creation).

use std::time::Duration;

use serde::Deserialize;

use super::duration;

/// The admitter and the proof-of-work challenges.
#[derive(Debug, Clone, Deserialize)]
pub struct WaitingRoomSettings {
    /// Pause between admission rounds of the admitter (every instance
    /// runs one), in milliseconds.
    #[serde(deserialize_with = "duration::millis")]
    pub admit_interval_ms: Duration,
    /// How long a proof-of-work challenge can be answered, in seconds.
    #[serde(deserialize_with = "duration::secs")]
    pub challenge_ttl_secs: Duration,
    /// Run the admitter inside `serve`.
    pub admitter_enabled: bool,
    /// Slow admission while the order pipeline is behind: the rate falls
    /// from the room's own as the order consumers' lag goes from half of
    /// `admission.max_consumer_lag` to all of it, and stops while the
    /// broker refuses deliveries; it comes back as they recover.
    #[serde(default = "adaptive_by_default")]
    pub adaptive: bool,
    /// How long after it is given out an unused pass counts as an order
    /// to come in adaptive admission's window: about the time a buyer
    /// takes to see their turn (the next refresh of the status page) and
    /// to click, in milliseconds.
    #[serde(
        default = "fresh_pass_by_default",
        deserialize_with = "duration::millis"
    )]
    pub fresh_pass_ms: Duration,
}

fn adaptive_by_default() -> bool {
    true
}

fn fresh_pass_by_default() -> Duration {
    Duration::from_secs(5)
}

impl WaitingRoomSettings {
    /// The bounds of its durations, naming the key that is out of them.
    pub(super) fn check(&self) -> anyhow::Result<()> {
        if self.admit_interval_ms < Duration::from_millis(10) {
            anyhow::bail!("waiting_room.admit_interval_ms must be at least 10 ms");
        }
        if self.fresh_pass_ms < Duration::from_millis(100)
            || self.fresh_pass_ms > Duration::from_secs(600)
        {
            anyhow::bail!("waiting_room.fresh_pass_ms must be from 100 ms to 600 s");
        }
        if self.challenge_ttl_secs < Duration::from_secs(5) {
            anyhow::bail!("waiting_room.challenge_ttl_secs must be at least 5 s");
        }
        Ok(())
    }
}
