//! Back-pressure before Redis is touched: purchases wait while the order
//! consumers are behind or stalled, the broker acknowledges nothing or
//! refuses writes, or acknowledgements queue up, and each refusal says for
//! about how long.

use super::admit::Admitter;
use super::refusal::Refusal;
use crate::bus::progress;

/// The `Retry-After` of a purchase refused while the cluster refuses
/// writes: a broker's return takes seconds, and the probe looks every one.
const WRITES_REFUSED_RETRY_SECS: u32 = 5;

/// `admission.max_consumer_lag` is sized as this many seconds of draining
/// (config/default.toml): the drain rate a `Retry-After` estimates with.
const LAG_BOUND_SECS: i64 = 5;

/// The lag purchases are held past, and the drain rate (orders a second)
/// a `Retry-After` estimates with: `admission.max_consumer_lag`, sized as
/// `LAG_BOUND_SECS` of draining; but when `orders.max_write_rate` paces
/// the consumers slower than that, its rate, and at most `LAG_BOUND_SECS`
/// of it behind (a lag the bound allows would otherwise take minutes to
/// write).
fn lag_bound(max_consumer_lag: i64, max_write_rate: u32) -> (i64, i64) {
    let sized = (max_consumer_lag / LAG_BOUND_SECS).max(1);
    match i64::from(max_write_rate) {
        0 => (max_consumer_lag, sized),
        paced => {
            let per_sec = paced.min(sized);
            (max_consumer_lag.min(per_sec * LAG_BOUND_SECS), per_sec)
        }
    }
}

/// Seconds until a lag of `lag` is back under `bound`, draining `per_sec`
/// orders a second; 1 to 30.
fn drain_secs(lag: i64, bound: i64, per_sec: i64) -> u32 {
    let per_sec = per_sec.max(1);
    let excess = (lag - bound).max(0);
    u32::try_from((excess + per_sec - 1) / per_sec)
        .unwrap_or(u32::MAX)
        .clamp(1, 30)
}

impl Admitter {
    /// Back-pressure before Redis is touched: a 202 now would stay
    /// PROCESSING for long, or would not be acknowledged.
    pub(super) fn not_overloaded(&self, now_ms: i64) -> Result<(), Refusal> {
        if self.publisher.probe.refuses_writes().is_some() {
            // Two of three brokers down: every acks=all write is refused
            // until they are back. Reserving now would only hold units
            // for purchases no broker can take.
            return Err(Refusal::WritesRefused(WRITES_REFUSED_RETRY_SECS));
        }
        if let Some((why, secs)) = self.consumer_backpressure() {
            return Err(Refusal::Busy(why, secs));
        }
        if !self.publisher.breaker.admits(now_ms) {
            // The breaker lets one probe through a second.
            return Err(Refusal::Busy(
                "the broker is not acknowledging orders; retry shortly",
                1,
            ));
        }
        if !self.publisher.acks.has_room() {
            return Err(Refusal::Busy(
                "acknowledgements are waiting on Redis; retry shortly",
                1,
            ));
        }
        Ok(())
    }

    /// Why purchases should get 503 BUSY because of the order consumers,
    /// if they should: too many messages behind, or stalled (messages
    /// waiting, nothing committed) for `kafka.consumer_stall_secs`. Both
    /// are sampled every second by the lag sampler.
    /// Why purchases must wait for the order consumers, and for about how
    /// many seconds: over the lag bound, the time to drain the excess (the
    /// bound is sized as `LAG_BOUND_SECS` of draining); stalled, the
    /// watchdog's window, after which it rebuilds the consumer.
    pub fn consumer_backpressure(&self) -> Option<(&'static str, u32)> {
        let lag = self.metrics.order_consumer_lag.get();
        let (bound, per_sec) = lag_bound(
            self.settings.admission.max_consumer_lag,
            self.settings.orders.max_write_rate,
        );
        if progress::lag_over(lag, bound) {
            return Some((
                "orders are being written; retry shortly",
                drain_secs(lag, bound, per_sec),
            ));
        }
        // A stall that began while PostgreSQL did not answer (a failover)
        // is the outage's, not a wedged consumer's: the events wait on the
        // broker, and the lag bound above still holds the purchases'
        // number. A stall holds purchases once the database has answered
        // for the whole stall window.
        let window_ms = crate::clock::millis(self.settings.kafka.consumer_stall_secs);
        if self.order_consumers_stalled().is_some() && self.fallback.database_answers_for(window_ms)
        {
            let window =
                u32::try_from(self.settings.kafka.consumer_stall_secs.as_secs()).unwrap_or(30);
            return Some((
                "the order consumers are stalled; retry shortly",
                window.clamp(1, 30),
            ));
        }
        None
    }

    /// How long the order consumers (wherever they run) have had messages
    /// waiting and committed nothing, once that reaches
    /// `kafka.consumer_stall_secs`.
    pub fn order_consumers_stalled(&self) -> Option<i64> {
        let stall =
            i64::try_from(self.settings.kafka.consumer_stall_secs.as_secs()).unwrap_or(i64::MAX);
        let stalled = self.metrics.order_consumer_stalled_seconds.get();
        (stall > 0 && stalled >= stall).then_some(stalled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_retry_after_of_a_lag_is_the_time_to_drain_its_excess() {
        // A bound of 100 000 is 5 s of draining: 20 000 a second.
        let (bound, rate) = lag_bound(100_000, 0);
        assert_eq!((bound, rate), (100_000, 20_000));
        assert_eq!(drain_secs(100_001, bound, rate), 1);
        assert_eq!(drain_secs(160_000, bound, rate), 3);
        assert_eq!(drain_secs(10_000_000, bound, rate), 30, "at most 30 s");
        let (bound, rate) = lag_bound(3, 0);
        assert_eq!(
            drain_secs(4, bound, rate),
            1,
            "a tiny bound still says a second"
        );
    }

    #[test]
    fn consumers_paced_slower_hold_purchases_sooner_and_say_so() {
        // Paced at 2 000 orders a second: 5 s of it is 10 000 behind, and
        // 30 000 behind is 10 s more to write.
        let (bound, rate) = lag_bound(100_000, 2_000);
        assert_eq!((bound, rate), (10_000, 2_000));
        assert!(progress::lag_over(30_000, bound));
        assert_eq!(drain_secs(30_000, bound, rate), 10);
        // A pace faster than the bound is sized for changes nothing.
        assert_eq!(lag_bound(100_000, 50_000), (100_000, 20_000));
    }
}
