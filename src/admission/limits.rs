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
    /// The most keys one generation holds.
    max_keys: usize,
    buckets: Mutex<Generations<K>>,
}

/// The buckets in two generations: a key is looked up in the current one,
/// then moved up from the previous one. When the current one is full the
/// previous one, every key not used since it was the current one, is
/// dropped whole. So a flood of distinct keys (IPv6 addresses) costs O(1)
/// per request and holds at most twice `max_keys`, and a key in use keeps
/// its bucket; a forgotten key starts again with a full burst, which a key
/// idle that long would mostly have refilled to anyway.
struct Generations<K> {
    current: HashMap<K, Bucket>,
    previous: HashMap<K, Bucket>,
}

/// The most keys of a generation, by default: a flood of distinct IPs
/// cannot grow the map without bound.
const MAX_KEYS: usize = 100_000;

impl<K: Eq + Hash + Copy> KeyedLimiter<K> {
    /// `rate_per_sec = 0` turns the limiter off.
    pub fn new(rate_per_sec: u32, burst: u32) -> Self {
        Self::holding(rate_per_sec, burst, MAX_KEYS)
    }

    /// A limiter whose generations hold at most `max_keys` keys each.
    fn holding(rate_per_sec: u32, burst: u32, max_keys: usize) -> Self {
        Self {
            rate_per_sec: f64::from(rate_per_sec),
            burst: f64::from(burst.max(1)),
            max_keys: max_keys.max(1),
            buckets: Mutex::new(Generations {
                current: HashMap::new(),
                previous: HashMap::new(),
            }),
        }
    }

    /// Takes one token for `key` at `now`; when the bucket is empty, how
    /// long until it holds one again.
    pub fn try_acquire_at(&self, key: K, now: Instant) -> Result<(), Duration> {
        if self.rate_per_sec <= 0.0 {
            return Ok(());
        }
        let mut g = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        if !g.current.contains_key(&key) {
            let kept = g.previous.remove(&key);
            if g.current.len() >= self.max_keys {
                g.previous = std::mem::take(&mut g.current);
            }
            g.current.insert(
                key,
                kept.unwrap_or(Bucket {
                    tokens: self.burst,
                    last: now,
                }),
            );
        }
        let bucket = g.current.get_mut(&key).expect("inserted above");
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

    /// Keys held, in both generations.
    #[cfg(test)]
    fn keys(&self) -> usize {
        let g = self.buckets.lock().unwrap();
        g.current.len() + g.previous.len()
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
    fn a_flood_of_distinct_keys_stays_bounded_and_a_busy_key_stays_limited() {
        let limiter = KeyedLimiter::holding(1, 2, 1_000);
        let t0 = Instant::now();
        // A busy key: its burst spent.
        assert!(limiter.try_acquire_at(u32::MAX, t0).is_ok());
        assert!(limiter.try_acquire_at(u32::MAX, t0).is_ok());
        // Ten times as many distinct keys as a generation holds, each
        // with a bucket in use (not full), while the busy key goes on.
        for k in 0..10_000u32 {
            assert!(limiter.try_acquire_at(k, t0).is_ok(), "key {k}'s first");
            assert!(limiter.keys() <= 2_000, "{} keys", limiter.keys());
            if k % 500 == 0 {
                assert!(
                    limiter.try_acquire_at(u32::MAX, t0).is_err(),
                    "the busy key is still limited after {k} others"
                );
            }
        }
        // A key of the flood, used once and not since: forgotten.
        assert!(limiter.try_acquire_at(0, t0).is_ok());
        assert!(limiter.try_acquire_at(0, t0).is_ok());
        assert!(limiter.try_acquire_at(0, t0).is_err());
    }

    #[test]
    fn rate_zero_means_off() {
        let limiter = KeyedLimiter::new(0, 0);
        assert!((0..10_000).all(|_| limiter.try_acquire(7).is_ok()));
    }
}
