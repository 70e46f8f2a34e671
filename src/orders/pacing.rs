//! Pacing of the order consumer to what the database can take
//! (`orders.max_write_rate`): a token bucket of orders per second on this
//! instance, shared by the batches in flight.
//!
//! A batch takes its tokens before its transaction. The bucket may go into
//! debt: a batch larger than what is left waits for the debt to be repaid
//! at the rate, outside the lock, so the batches behind it queue in order
//! and the long-run rate is exactly the setting. The bucket holds a tenth
//! of a second of tokens, so an idle consumer starts with a small burst,
//! not a second's worth at once. While the consumer waits, the topic's lag
//! grows, and admission's `max_consumer_lag` answers purchases 503 `BUSY`
//! with `Retry-After`: the backpressure of a paced consumer is the existing
//! one, not a new one.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use prometheus::Counter;
use tokio_util::sync::CancellationToken;

/// A token bucket of orders per second.
pub struct Pacer {
    rate: f64,
    burst: f64,
    state: Mutex<Bucket>,
    /// `seckill_order_consumer_paced_seconds_total`: time batches waited.
    waited: Counter,
}

struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Pacer {
    /// A bucket of `rate` orders per second, or none when `rate` is 0
    /// (unlimited).
    pub fn new(rate: u32, waited: Counter) -> Option<Self> {
        (rate > 0).then(|| {
            let rate = f64::from(rate);
            let burst = (rate / 10.0).max(1.0);
            Self {
                rate,
                burst,
                state: Mutex::new(Bucket {
                    tokens: burst,
                    at: Instant::now(),
                }),
                waited,
            }
        })
    }

    /// The largest batch worth reading at once: a tenth of a second of
    /// orders (at least one), so that no batch waits for long with its
    /// messages held, and the batches in flight stay well inside the
    /// consumer watchdog's stall limit.
    pub fn batch_size(&self, configured: usize) -> usize {
        configured.min(self.burst.ceil() as usize).max(1)
    }

    /// How long a batch of `n` must wait, its tokens taken now.
    fn take(&self, n: usize, now: Instant) -> Duration {
        let mut b = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let elapsed = now.saturating_duration_since(b.at).as_secs_f64();
        b.tokens = (b.tokens + elapsed * self.rate).min(self.burst);
        b.at = now;
        b.tokens -= n as f64;
        if b.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-b.tokens / self.rate)
        }
    }

    /// Waits until a batch of `n` orders may be written; false when
    /// `shutdown` came first (the batch is not applied, and its tokens are
    /// not given back: the next instance starts its own bucket anyway).
    pub async fn admit(&self, n: usize, shutdown: &CancellationToken) -> bool {
        let wait = self.take(n, Instant::now());
        if wait.is_zero() {
            return true;
        }
        self.waited.inc_by(wait.as_secs_f64());
        tokio::select! {
            () = tokio::time::sleep(wait) => true,
            () = shutdown.cancelled() => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pacer(rate: u32) -> Pacer {
        Pacer::new(rate, Counter::new("w", "w").expect("a counter")).expect("a rate")
    }

    #[test]
    fn zero_is_unlimited() {
        assert!(Pacer::new(0, Counter::new("w", "w").unwrap()).is_none());
    }

    #[test]
    fn a_backlog_is_let_through_at_the_rate() {
        let p = pacer(200);
        let t0 = Instant::now();
        // 20 tokens of burst; 1,000 orders in batches of 20, all taken at
        // once: the last batch may go when 980 more tokens have come in.
        let waits: Vec<Duration> = (0..50).map(|_| p.take(20, t0)).collect();
        assert_eq!(waits[0], Duration::ZERO);
        assert_eq!(waits[1], Duration::from_millis(100));
        let last = waits[49].as_secs_f64();
        assert!((last - 4.9).abs() < 1e-9, "{last}");
    }

    #[test]
    fn an_idle_bucket_refills_only_to_its_burst() {
        let p = pacer(1000);
        let t0 = Instant::now();
        assert_eq!(p.take(100, t0), Duration::ZERO);
        // An hour idle buys a tenth of a second of orders, not an hour's.
        let later = t0 + Duration::from_secs(3600);
        assert_eq!(p.take(100, later), Duration::ZERO);
        assert_eq!(p.take(100, later), Duration::from_millis(100));
    }

    #[test]
    fn batches_are_a_tenth_of_a_second_of_orders() {
        assert_eq!(pacer(200).batch_size(2000), 20);
        assert_eq!(pacer(5).batch_size(2000), 1);
        assert_eq!(pacer(1_000_000).batch_size(2000), 2000);
    }
}
