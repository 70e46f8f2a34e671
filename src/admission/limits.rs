//! In-process token buckets in front of Redis (SPEC step 1): one per
//! activity and one per client IP. They shed load cheaply before any network
//! call; they are per instance, so N instances admit N × the rate.

use std::collections::HashMap;
use std::hash::Hash;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A bucket's wait, in the whole seconds of a `Retry-After` (at least 1).
pub fn retry_secs(wait: Duration) -> u32 {
    (wait.as_secs_f64().ceil() as u32).max(1)
}

/// One token bucket.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    last: Instant,
}

/// Token buckets keyed by `K`, all with the same rate and burst.
pub struct KeyedLimiter<K> {
    rate_per_sec: f64,
    burst: f64,
    buckets: Mutex<HashMap<K, Bucket>>,
}

/// Above this many keys, idle (full) buckets are dropped so that a flood of
/// distinct IPs cannot grow the map without bound.
const MAX_KEYS: usize = 100_000;

impl<K: Eq + Hash + Copy> KeyedLimiter<K> {
    /// `rate_per_sec = 0` turns the limiter off.
    pub fn new(rate_per_sec: u32, burst: u32) -> Self {
        Self {
            rate_per_sec: f64::from(rate_per_sec),
            burst: f64::from(burst.max(1)),
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one token for `key` at `now`; when the bucket is empty, how
    /// long until it holds one again.
    pub fn try_acquire_at(&self, key: K, now: Instant) -> Result<(), Duration> {
        if self.rate_per_sec <= 0.0 {
            return Ok(());
        }
        let mut buckets = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if buckets.len() >= MAX_KEYS && !buckets.contains_key(&key) {
            let (rate, burst) = (self.rate_per_sec, self.burst);
            buckets
                .retain(|_, b| b.tokens + now.duration_since(b.last).as_secs_f64() * rate < burst);
        }
        let bucket = buckets.entry(key).or_insert(Bucket {
            tokens: self.burst,
            last: now,
        });
        let refill = now.saturating_duration_since(bucket.last).as_secs_f64() * self.rate_per_sec;
        bucket.tokens = (bucket.tokens + refill).min(self.burst);
        bucket.last = now;
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64(
                (1.0 - bucket.tokens) / self.rate_per_sec,
            ))
        }
    }

    /// Takes one token for `key` now.
    pub fn try_acquire(&self, key: K) -> Result<(), Duration> {
        self.try_acquire_at(key, Instant::now())
    }
}

/// The two limiters of the purchase path.
pub struct Limits {
    /// Per activity.
    pub activity: KeyedLimiter<crate::domain::ActivityId>,
    /// Per client IP.
    pub ip: KeyedLimiter<IpAddr>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_allows_its_burst_then_refills_at_its_rate() {
        let limiter = KeyedLimiter::new(10, 5);
        let t0 = Instant::now();
        assert!((0..5).all(|_| limiter.try_acquire_at(1, t0).is_ok()));
        assert_eq!(
            limiter.try_acquire_at(1, t0),
            Err(Duration::from_millis(100)),
            "burst spent: the next token in 1/10 s"
        );
        assert!(
            limiter.try_acquire_at(2, t0).is_ok(),
            "keys are independent"
        );
        let later = t0 + Duration::from_millis(100);
        assert!(
            limiter.try_acquire_at(1, later).is_ok(),
            "one token refilled after 100 ms at 10/s"
        );
        let wait = limiter
            .try_acquire_at(1, later + Duration::from_millis(40))
            .unwrap_err();
        assert!(
            (wait.as_secs_f64() - 0.06).abs() < 1e-9,
            "0.4 of a token there: 60 ms to the next ({wait:?})"
        );
    }

    #[test]
    fn a_slow_bucket_says_when_it_refills() {
        let limiter = KeyedLimiter::new(1, 1);
        let t0 = Instant::now();
        assert!(limiter.try_acquire_at(1, t0).is_ok());
        assert_eq!(limiter.try_acquire_at(1, t0), Err(Duration::from_secs(1)));
    }

    #[test]
    fn rate_zero_means_off() {
        let limiter = KeyedLimiter::new(0, 0);
        assert!((0..10_000).all(|_| limiter.try_acquire(7).is_ok()));
    }
}
